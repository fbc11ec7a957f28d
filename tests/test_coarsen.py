"""Merged-axis planning: the lifted plan is a valid plan of the real mesh, it splits dims as
the merged plan does, and the full search never does worse."""

from __future__ import annotations

import memshard
from memshard.coarsen import merge_groups, merged_mesh
from memshard.mesh import parse_mesh

TINY = dict(batch=8, seq=32, num_layers=2, hidden=64, heads=4, vocab=256, ffn=128, mip_gap=1e-2)


def test_merge_groups_joins_alike_adjacent_axes():
    mesh = parse_mesh("2x4x8")  # two inter-node axes (25 GB/s), one intra-node
    assert merge_groups(mesh) == [(0, 1), (2,)]
    coarse = merged_mesh(mesh, merge_groups(mesh))
    assert coarse.shape == (8, 8)
    assert coarse.axis_names == ("inter0*inter1", "intra")
    faster = mesh.with_links(bandwidths=(25e9, 50e9, 150e9))
    assert merge_groups(faster) == [(0,), (1,), (2,)]


def test_lifted_plan_is_priced_on_the_real_mesh_and_full_search_is_no_worse():
    # A third axis of size 1 keeps the full search as small as a two-axis one, so both run
    # quickly; axes 0 and 1 share their links and are merged.
    mesh = memshard.make_mesh((2, 2, 1)).with_links(bandwidths=(25e9, 25e9, 150e9), latencies=(2e-5, 2e-5, 5e-6))
    merged = memshard.plan("gpt2", mesh, **TINY)
    full = memshard.plan("gpt2", mesh, full_mesh=True, **TINY)
    assert merged.data["mesh"]["shape"] == [2, 2, 1]
    assert merged.data["solver"]["search_space"] == "axes inter0×inter1 planned as one"
    assert full.data["solver"]["search_space"] == "full"
    # Whatever the merged plan splits over the merged axis, it splits over both real axes.
    for op in merged.data["ops"]:
        split = op["split"]
        assert split.get("inter0") == split.get("inter1"), op
    # The full search contains every lifted plan.
    assert full.peak_bytes <= merged.peak_bytes * (1 + 1e-2)  # both solved to a 1% gap
    assert merged.peak_bytes >= merged.lower_bound_bytes
