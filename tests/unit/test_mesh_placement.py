"""Meshes and layouts: parsing, default links, overrides, and DTensor local-shard arithmetic.

Every expected figure is written out by hand below (torch.chunk rule: a dim of n split m ways
gives pieces of ceil(n/m), the largest one sits on rank 0).
"""

from __future__ import annotations

import numpy as np
import pytest

from memshard.core.errors import MemshardError
from memshard.core.mesh import make_mesh, mesh_views, parse_mesh
from memshard.core.placement import (
    PARTIAL,
    REPLICATE,
    Partial,
    Replicate,
    Shard,
    format_layout,
    is_valid,
    local_numel,
    local_shape,
    parse_layout,
    replication,
)

R, P = REPLICATE, PARTIAL


# -- parse_mesh -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, shape, devices",
    [
        ("2x4", (2, 4), 8),
        ("8x8x16", (8, 8, 16), 1024),
        ("8", (8,), 8),
        ("1x4", (1, 4), 4),
        (" 2 x 4 ", (2, 4), 8),
        ("2X4", (2, 4), 8),
    ],
)
def test_parse_mesh_shapes(text, shape, devices):
    mesh = parse_mesh(text)
    assert mesh.shape == shape
    assert mesh.ndim == len(shape)
    assert mesh.num_devices == devices
    assert str(mesh) == "x".join(str(s) for s in shape)


@pytest.mark.parametrize("text", ["2x0", "0", "abc", "", "2x-1", "x4", "2x", "2xx4", "2.5x4", "-2"])
def test_parse_mesh_rejects(text):
    with pytest.raises(MemshardError):
        parse_mesh(text)


def test_parse_mesh_error_is_a_value_error_with_the_input_in_it():
    with pytest.raises(ValueError, match="2x0"):
        parse_mesh("2x0")


def test_default_axis_names():
    assert parse_mesh("8").axis_names == ("intra",)
    assert parse_mesh("2x4").axis_names == ("inter0", "intra")
    assert parse_mesh("8x8x16").axis_names == ("inter0", "inter1", "intra")


def test_make_mesh_rejects_duplicate_or_miscounted_names():
    with pytest.raises(MemshardError):
        make_mesh((2, 4), names=("a", "a"))
    with pytest.raises(MemshardError):
        make_mesh((2, 4), names=("a",))
    assert make_mesh((2, 4), names=("dp", "tp")).axis_names == ("dp", "tp")


# -- links ------------------------------------------------------------------------------------------
def test_default_links_innermost_axis_is_intra_node():
    mesh = parse_mesh("8x8x8")  # H100s, nodes of 8: the last axis is a node
    bandwidths = [a.bandwidth_bytes_per_s for a in mesh.axes]
    assert bandwidths == [48e9, 48e9, 370e9]
    assert [a.per_node for a in mesh.axes] == [1, 1, 8]
    lat = [a.latency_s for a in mesh.axes]
    # the intra-node link is faster in latency too
    assert lat[-1] < lat[0] and lat[0] == lat[1]
    # a single axis of 8 is the node itself
    assert parse_mesh("8").axes[0].bandwidth_bytes_per_s == 370e9


def test_devices_fill_nodes_innermost_first():
    """8x4x2 on nodes of 8: the two inner axes fill a node; 2x16: the 16 span two nodes, each
    node's 8 devices of it on its 8 NICs (as fast as NVLink allows)."""
    mesh = parse_mesh("8x4x2", hardware="a100-80gb")
    assert [(a.per_node, a.bandwidth_bytes_per_s) for a in mesh.axes] == [(1, 24e9), (4, 230e9), (2, 230e9)]
    mesh = parse_mesh("2x16", hardware="a100-80gb")
    assert [(a.per_node, a.bandwidth_bytes_per_s) for a in mesh.axes] == [(1, 24e9), (8, 8 * 24e9)]
    assert mesh.axes[1].latency_s == mesh.hardware.inter_node_step_latency_s


@pytest.mark.parametrize("text, views", [
    ("8", ["2x4"]),  # a node: as 2 × 4 (4 × 2 is the same grouping on alike links)
    ("2x4", ["8"]), ("4x2", ["8"]), ("4", ["2x2"]), ("6", ["2x3"]),
    ("16", ["2x8", "2x2x4"]),  # two nodes: nodes × a node, then the node as 2 × 4
    ("4x8", ["4x2x4"]),  # the axis across nodes kept
    ("2", []), ("1", []), ("7", []),  # no other factors
    ("8x8x16", []),  # a view would have 4 axes
])
def test_mesh_views_group_the_same_devices_otherwise(text, views):
    mesh = parse_mesh(text)
    found = mesh_views(mesh)
    assert [str(v) for v in found] == views
    assert all(v.num_devices == mesh.num_devices and v.hardware == mesh.hardware for v in found)


def test_a_views_axes_have_the_links_of_where_their_devices_sit():
    """16 devices on nodes of 8 viewed as 2 × 8: the 2 cross nodes (a NIC each), the 8 are a
    node's NVLink; the typed axis of 16 crossed nodes on 8 NICs per node."""
    (nodes, _) = mesh_views(parse_mesh("16", hardware="a100-80gb"))
    assert [(a.per_node, a.bandwidth_bytes_per_s) for a in nodes.axes] == [(1, 24e9), (8, 230e9)]


def test_no_view_of_a_mesh_whose_links_were_set_by_hand():
    assert mesh_views(parse_mesh("8").with_links(bandwidths=(100e9,))) == ()
    assert mesh_views(parse_mesh("8", device_memory_bytes=40 * 2**30))[0].device_memory_bytes == 40 * 2**30


def test_with_links_overrides_per_axis():
    mesh = parse_mesh("2x4")
    new = mesh.with_links(bandwidths=(50e9, 300e9), latencies=(1e-5, 2e-6))
    assert [a.bandwidth_bytes_per_s for a in new.axes] == [50e9, 300e9]
    assert [a.latency_s for a in new.axes] == [1e-5, 2e-6]
    assert new.shape == (2, 4)
    assert new.axis_names == mesh.axis_names
    # the original is unchanged (frozen dataclass)
    assert [a.bandwidth_bytes_per_s for a in mesh.axes] == [370e9, 370e9]


def test_with_links_only_one_field():
    mesh = parse_mesh("2x4")
    new = mesh.with_links(latencies=(3e-6, 4e-6))
    assert [a.bandwidth_bytes_per_s for a in new.axes] == [370e9, 370e9]
    assert [a.latency_s for a in new.axes] == [3e-6, 4e-6]
    assert mesh.with_links() == mesh


@pytest.mark.parametrize(
    "kwargs",
    [
        {"bandwidths": (1e9,)},  # one value for two axes
        {"bandwidths": (1e9, 1e9, 1e9)},
        {"latencies": (1e-6,)},
        {"bandwidths": (0.0, 1e9)},
        {"bandwidths": (1e9, -1e9)},
    ],
)
def test_with_links_errors(kwargs):
    with pytest.raises(MemshardError):
        parse_mesh("2x4").with_links(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"latencies": (-1e-6, 1e-6)},  # a negative latency makes collectives take negative time
        {"bandwidths": (float("nan"), 1e9)},
        {"latencies": (float("nan"), 1e-6)},
    ],
    ids=["negative-latency", "nan-bandwidth", "nan-latency"],
)
def test_with_links_rejects_meaningless_values(kwargs):
    with pytest.raises(MemshardError):
        parse_mesh("2x4").with_links(**kwargs)


# -- local shapes -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "shape, layout, mesh_shape, expected",
    [
        ((16, 32), (Shard(0), R), (2, 4), (8, 32)),
        ((16, 32), (R, Shard(1)), (2, 4), (16, 8)),
        ((16, 32), (Shard(1), Shard(0)), (2, 4), (4, 16)),
        ((16, 32), (P, Shard(1)), (2, 4), (16, 8)),  # a partial sum keeps the full shape
        ((16, 32), (R, R), (2, 4), (16, 32)),
        # one dim over two axes, split in axis order: 16 → 8 → 2
        ((16,), (Shard(0), Shard(0)), (2, 4), (2,)),
        # uneven: torch.chunk(50257, 8) → pieces of ceil(50257/8) = 6283 (rank 0)
        ((50257, 768), (Shard(0),), (8,), (6283, 768)),
        # 10 over 4: pieces 3, 3, 3, 1
        ((10, 6), (R, Shard(0)), (2, 4), (3, 6)),
        # nested uneven: 10 → 5 (over 2) → ceil(5/4) = 2
        ((10,), (Shard(0), Shard(0)), (2, 4), (2,)),
        # 7 over 2 → 4, then 4 over 4 → 1; the other dim 9 over nothing
        ((7, 9), (Shard(0), Shard(0)), (2, 4), (1, 9)),
        ((), (), (), ()),
    ],
)
def test_local_shape(shape, layout, mesh_shape, expected):
    assert local_shape(shape, layout, mesh_shape) == expected
    numel = 1
    for n in expected:
        numel *= n
    assert local_numel(shape, layout, mesh_shape) == numel


def test_local_numel_3d_on_2x4():
    # (6, 10, 16) as S(1)S(2) on 2x4: (6, 5, 4) = 120 elements
    assert local_numel((6, 10, 16), (Shard(1), Shard(2)), (2, 4)) == 120
    # S(2)S(2): 16 → 8 → 2: (6, 10, 2) = 120
    assert local_numel((6, 10, 16), (Shard(2), Shard(2)), (2, 4)) == 120
    # S(1)S(0): 10 → 5, 6 → ceil(6/4) = 2: (2, 5, 16) = 160
    assert local_numel((6, 10, 16), (Shard(1), Shard(0)), (2, 4)) == 160


# -- replication --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "layout, expected",
    [
        ((R, R), 8),
        ((Shard(0), R), 4),
        ((R, Shard(0)), 2),
        ((Shard(0), Shard(1)), 1),
        # docs/design.md: replication = product of the axes on which the tensor is not split; a
        # partial sum is not split (every device holds a full-size summand).
        ((P, R), 8),
        ((R, P), 8),
        ((P, P), 8),
        ((P, Shard(0)), 2),
    ],
)
def test_replication_on_2x4(layout, expected):
    assert replication(layout, (2, 4)) == expected


def test_replication_of_one_device_and_3d_mesh():
    assert replication((), ()) == 1
    assert replication((R, Shard(0), R), (8, 8, 16)) == 128
    assert replication((P, R, R), (8, 8, 16)) == 1024


# -- layout text -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "layout, text",
    [
        ((Shard(0), R), "S(0)R"),
        ((Shard(0), Shard(1)), "S(0)S(1)"),
        ((R, P), "RP"),
        ((Shard(12), P, R), "S(12)PR"),
        ((), "-"),
    ],
)
def test_format_parse_round_trip(layout, text):
    assert format_layout(layout) == text
    assert parse_layout(text) == layout
    assert parse_layout(format_layout(layout)) == layout


def test_parse_layout_types():
    layout = parse_layout("S(2)RP")
    assert isinstance(layout[0], Shard) and layout[0].dim == 2
    assert isinstance(layout[1], Replicate)
    assert isinstance(layout[2], Partial)


@pytest.mark.parametrize("text", ["X", "S0", "S(a)", "RQ", "S(1"])
def test_parse_layout_rejects(text):
    with pytest.raises(ValueError):
        parse_layout(text)


# -- validity ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "shape, layout, ok",
    [
        ((8, 8), (Shard(0), Shard(1)), True),
        ((8, 8), (R, R), True),
        ((8, 8), (P, R), True),
        ((8, 8), (Shard(2), R), False),  # no dim 2
        ((8, 3), (R, Shard(1)), False),  # 3 rows cannot go to 4 devices
        ((8, 3), (Shard(1), R), True),  # but to 2 they can
        ((8,), (Shard(0), Shard(0)), True),  # 8 → 4 → 1
        ((4,), (Shard(0), Shard(0)), False),  # 4 → 2, then 2 over 4
        ((6, 4), (Shard(0), Shard(0)), False),  # 6 → 3, then 3 over 4
    ],
)
def test_is_valid_on_2x4(shape, layout, ok):
    assert is_valid(layout, shape, parse_mesh("2x4")) is ok


def test_placements_are_one_object_each_and_behave_as_values():
    """Interned placements (a planner speed-up) keep value semantics: equality, order, the
    hash the generated one gives (sets of layouts iterate as before: the same plans), and
    pickling, copying and ``replace`` give the same objects back."""
    import copy
    import dataclasses
    import pickle

    assert Shard(1) is Shard(1) and Replicate() is REPLICATE and Partial() is PARTIAL
    assert Shard(0) != Shard(1) and Shard(0) < Shard(1) and REPLICATE != PARTIAL and Shard(0) != REPLICATE
    assert hash(Shard(2)) == hash((2,)) and hash(REPLICATE) == hash(PARTIAL) == hash(())
    layout = (Shard(0), REPLICATE, PARTIAL)
    assert pickle.loads(pickle.dumps(layout)) == layout and all(
        a is b for a, b in zip(pickle.loads(pickle.dumps(layout)), layout))
    assert all(a is b for a, b in zip(copy.deepcopy(layout), layout))
    assert dataclasses.replace(Shard(0), dim=3) is Shard(3) and Shard(0).dim == 0
    assert {(Shard(0), REPLICATE): 1}[(Shard(0), Replicate())] == 1
    assert Shard(np.int64(2)) is Shard(2) and type(Shard(np.int64(2)).dim) is int and repr(Shard(2)) == "Shard(dim=2)"


def test_a_resized_mesh_sits_on_nodes_anew_and_keeps_links_set_by_hand():
    from memshard.core.mesh import resized

    mesh = parse_mesh("1x4", hardware="a100-80gb")  # half a node: both axes on NVLink
    grown = resized(mesh, (4, 4))  # 16 devices: the outer axis now spans 2 nodes
    assert grown.shape == (4, 4) and grown.axis_names == mesh.axis_names
    assert [a.bandwidth_bytes_per_s for a in grown.axes] == [2 * 24e9, 230e9]
    by_hand = mesh.with_links(bandwidths=(10e9, 230e9))
    assert [a.bandwidth_bytes_per_s for a in resized(by_hand, (4, 4)).axes] == [10e9, 230e9]
