"""Collectives: NCCL ring times and bytes on the wire, and resharding between layouts.

The expected figures are the ring algorithm's costs written out per case, on a 2x4 mesh of
A100s in nodes of 4: axis 0 (size 2) crosses nodes (ring steps of λ = 14 µs, β = 24 GB/s, one
NIC per device), axis 1 (size 4) stays inside a node (λ = 3.4 µs, β = 230 GB/s); every
collective starts up in α = 25 µs.
"""

from __future__ import annotations

import pytest

from memshard.core.hardware import hardware_from_dict
from memshard.core.mesh import parse_mesh
from memshard.core.placement import PARTIAL, REPLICATE, Shard
from memshard.problem import comm
from memshard.problem.comm import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    REDUCE_SCATTER,
    Collective,
    collective_time,
    gather_flat,
    reduce_scatter_flat,
    reshard,
    total_time,
    total_wire_bytes,
    wire_bytes,
)

R, P = REPLICATE, PARTIAL
NODES_OF_4 = hardware_from_dict({"base": "a100-80gb", "gpus_per_node": 4})
MESH = parse_mesh("2x4", hardware=NODES_OF_4)
ALPHA = 25e-6
A0 = (2, 14e-6, 24e9)  # size, λ, β of axis 0
A1 = (4, 3.4e-6, 230e9)  # of axis 1
MiB = 2**20


def rel(a: float, b: float) -> bool:
    return a == pytest.approx(b, rel=1e-12, abs=0.0)


# -- alpha-beta ---------------------------------------------------------------------------------
@pytest.mark.parametrize("axis, link", [(0, A0), (1, A1)])
@pytest.mark.parametrize("nbytes", [1.0, 3 * MiB, 1e9])
def test_all_gather_and_reduce_scatter(axis, link, nbytes):
    m, step, beta = link
    for kind in (ALL_GATHER, REDUCE_SCATTER):
        c = Collective(kind, axis, nbytes)
        assert rel(wire_bytes(c, MESH), (m - 1) / m * nbytes)
        assert rel(collective_time(c, MESH), ALPHA + (m - 1) * step + (m - 1) / m * nbytes / beta)


@pytest.mark.parametrize("axis, link", [(0, A0), (1, A1)])
@pytest.mark.parametrize("nbytes", [1.0, 3 * MiB, 1e9])
def test_all_reduce(axis, link, nbytes):
    m, step, beta = link
    c = Collective(ALL_REDUCE, axis, nbytes)
    assert rel(wire_bytes(c, MESH), 2 * (m - 1) / m * nbytes)
    assert rel(collective_time(c, MESH), ALPHA + 2 * (m - 1) * step + 2 * (m - 1) / m * nbytes / beta)


@pytest.mark.parametrize("axis, link", [(0, A0), (1, A1)])
def test_all_to_all(axis, link):
    m, step, beta = link
    local = 8 * MiB
    c = Collective(ALL_TO_ALL, axis, local)
    # each device keeps 1/m of its local buffer and sends the rest
    assert rel(wire_bytes(c, MESH), (m - 1) / m * local)
    # the other common form: (m−1)/m² · B with B summed over the m devices of the axis
    assert rel(collective_time(c, MESH), ALPHA + (m - 1) * step + (m - 1) / m**2 * (m * local) / beta)


def test_worked_numbers():
    # all-reduce of 1 GB over 4 GPUs in a node: 25 µs + 6·3.4 µs + 2·3/4·1e9/230e9 s = 6.567 ms
    c = Collective(ALL_REDUCE, 1, 1e9)
    assert collective_time(c, MESH) == pytest.approx(25e-6 + 20.4e-6 + 1.5e9 / 230e9, rel=1e-12)
    # all-gather of 100 MB over 2 nodes: 25 µs + 14 µs + 1/2·1e8/24e9 s = 2.122 ms
    c = Collective(ALL_GATHER, 0, 1e8)
    assert collective_time(c, MESH) == pytest.approx(39e-6 + 0.5e8 / 24e9, rel=1e-12)


# nccl-tests all-reduce on 2, 4 and 8 A100s in one node (vTrain's measured table, in
# ../docs/hardware.md): (GPUs, bytes, bus GB/s)
NCCL_TESTS_A100 = [(2, MiB, 23.7), (2, 16 * MiB, 127), (2, 2**30, 197), (4, MiB, 30.6), (4, 16 * MiB, 140),
                   (4, 2**30, 222), (8, MiB, 19.8), (8, 16 * MiB, 126), (8, 64 * MiB, 203), (8, 256 * MiB, 217),
                   (8, 2**30, 229)]


@pytest.mark.parametrize("gpus, nbytes, busbw", NCCL_TESTS_A100)
def test_all_reduce_times_follow_nccl_tests_on_a100(gpus, nbytes, busbw):
    """The ring model within 25% of the measured time from 1 MiB to 1 GiB, 2 to 8 GPUs: the
    start-up makes small messages latency-bound, the bus bandwidth large ones."""
    mesh = parse_mesh(str(gpus), hardware="a100-80gb")
    measured = nbytes * 2 * (gpus - 1) / gpus / (busbw * 1e9)
    assert collective_time(Collective(ALL_REDUCE, 0, nbytes), mesh) == pytest.approx(measured, rel=0.25)


def test_one_communicator_is_one_ring_over_the_nodes_nics():
    """A data-parallel group of 32 A100s, 4 per node over 8 nodes (TP 2 inside each node): one
    ring whose 4 NICs per node carry it, against the same all-reduce axis by axis."""
    mesh = parse_mesh("8x4x2", hardware="a100-80gb")
    per_axis = comm.all_reduce_over(1e9, (0, 1), mesh)
    (flat,) = comm.one_communicator(per_axis)
    assert flat.axes == (0, 1) and flat.buffer_bytes == 1e9
    assert rel(wire_bytes(flat, mesh), 2 * 31 / 32 * 1e9)
    steps = 7 * 14e-6 + (31 - 7) * 3.4e-6
    assert rel(collective_time(flat, mesh), 25e-6 + 2 * steps + 2 * 31 / 32 * 1e9 / (4 * 24e9))
    assert collective_time(flat, mesh) < total_time(per_axis, mesh) / 3
    # reduce-scatter then all-gather of a flat buffer: one call each, the whole buffer
    scatter = comm.one_communicator(reduce_scatter_flat(2**20, 4, (0, 1), mesh))
    gather = comm.one_communicator(gather_flat(2**20, 2, (0, 1), mesh))
    assert [(c.kind, c.buffer_bytes) for c in scatter + gather] == [(REDUCE_SCATTER, 4 * 2**20), (ALL_GATHER, 2 * 2**20)]
    assert rel(total_wire_bytes(scatter, mesh), total_wire_bytes(reduce_scatter_flat(2**20, 4, (0, 1), mesh), mesh))


def test_link_overrides_change_the_time():
    mesh = MESH.with_links(bandwidths=(10e9, 100e9), latencies=(1e-3, 1e-4))
    c = Collective(REDUCE_SCATTER, 1, 4e8)
    assert rel(collective_time(c, mesh), ALPHA + 3 * 1e-4 + 3 / 4 * 4e8 / 100e9)


def test_axis_of_size_one_costs_nothing():
    mesh = parse_mesh("1x4")
    c = Collective(ALL_REDUCE, 0, 1e9)
    assert collective_time(c, mesh) == 0.0
    assert wire_bytes(c, mesh) == 0.0


def test_totals_add_up():
    calls = [Collective(ALL_REDUCE, 1, 1e6), Collective(ALL_GATHER, 0, 2e6)]
    assert rel(total_wire_bytes(calls, MESH), 2 * 3 / 4 * 1e6 + 1 / 2 * 2e6)
    assert rel(
        total_time(calls, MESH),
        (ALPHA + 6 * 3.4e-6 + 2 * 3 / 4 * 1e6 / 230e9) + (ALPHA + 14e-6 + 1 / 2 * 2e6 / 24e9),
    )
    assert total_time([], MESH) == 0.0


# -- resharding, one axis ---------------------------------------------------------------------------
SHAPE = (8, 128, 1024)  # b, s, h
DT = 2


def test_megatron_row_parallel_output_is_one_all_reduce():
    # mlp.proj `bsf,fh->bsh` split b over nodes, f inside the node: output S(0)P.
    # Making it replicated on the node axis is one all-reduce of the whole local output,
    # whose batch is halved by the node axis: 4·128·1024 elements of 2 bytes.
    calls = reshard(SHAPE, DT, (Shard(0), P), (Shard(0), R), MESH)
    assert calls == (Collective(ALL_REDUCE, 1, 4 * 128 * 1024 * 2),)
    assert rel(total_wire_bytes(calls, MESH), 2 * 3 / 4 * 4 * 128 * 1024 * 2)


def test_partial_to_shard_is_reduce_scatter_of_the_input_buffer():
    # 1-D mesh of 4: P → S(1) reduce-scatters the full 8·128·1024 tensor
    mesh = parse_mesh("4")
    calls = reshard(SHAPE, DT, (P,), (Shard(1),), mesh)
    assert calls == (Collective(REDUCE_SCATTER, 0, 8 * 128 * 1024 * 2),)
    # each device sends 3/4 of it
    assert rel(total_wire_bytes(calls, mesh), 3 / 4 * 8 * 128 * 1024 * 2)


def test_shard_to_replicate_gathers_to_the_full_size():
    mesh = parse_mesh("4")
    calls = reshard(SHAPE, DT, (Shard(1),), (R,), mesh)
    # the buffer is the gathered tensor, not the 32-row shard
    assert calls == (Collective(ALL_GATHER, 0, 8 * 128 * 1024 * 2),)


def test_shard_to_other_shard_is_all_to_all_of_the_local_shard():
    mesh = parse_mesh("4")
    calls = reshard(SHAPE, DT, (Shard(0),), (Shard(1),), mesh)
    assert calls == (Collective(ALL_TO_ALL, 0, 2 * 128 * 1024 * 2),)


def test_replicate_to_shard_and_no_change_are_free():
    assert reshard(SHAPE, DT, (R, R), (Shard(0), Shard(2)), MESH) == ()
    assert reshard(SHAPE, DT, (Shard(0), P), (Shard(0), P), MESH) == ()


def test_resharding_never_targets_partial():
    with pytest.raises(ValueError):
        reshard(SHAPE, DT, (R, R), (P, R), MESH)


# -- resharding, two axes ----------------------------------------------------------------------------
def test_two_axis_gather_in_axis_order_and_reversed():
    # (8, 16) fp16 as S(0)S(1) on 2x4 → RR.
    # axis order: axis 0 gathers (4, 4) → (8, 4) = 32 elements = 64 B; then axis 1 gathers
    # (8, 4) → (8, 16) = 256 B.
    fwd = reshard((8, 16), 2, (Shard(0), Shard(1)), (R, R), MESH)
    assert fwd == (Collective(ALL_GATHER, 0, 64), Collective(ALL_GATHER, 1, 256))
    # reversed: axis 1 first, (4, 4) → (4, 16) = 128 B; then axis 0 → 256 B.
    bwd = reshard((8, 16), 2, (Shard(0), Shard(1)), (R, R), MESH, reverse=True)
    assert bwd == (Collective(ALL_GATHER, 1, 128), Collective(ALL_GATHER, 0, 256))


def test_two_axis_mixed_collectives():
    # (8, 16) fp16, PS(0) → S(1)R on 2x4.
    # Axis order: axis 0 P→S(1) reduce-scatters the local (2, 16) = 64 B; the tensor is then
    # S(1)S(0), local (2, 8); axis 1 S(0)→R gathers to S(1)R, local (8, 8) = 128 B.
    src, dst = (P, Shard(0)), (Shard(1), R)
    fwd = reshard((8, 16), 2, src, dst, MESH)
    assert fwd == (Collective(REDUCE_SCATTER, 0, 64), Collective(ALL_GATHER, 1, 128))
    # Reversed: axis 1 S(0)→R first gathers to PR, local (8, 16) = 256 B; then axis 0
    # P→S(1) reduce-scatters that whole 256 B buffer.
    bwd = reshard((8, 16), 2, src, dst, MESH, reverse=True)
    assert bwd == (Collective(ALL_GATHER, 1, 256), Collective(REDUCE_SCATTER, 0, 256))
    # the order changes the bytes on the wire: 1/2·64 + 3/4·128 vs 3/4·256 + 1/2·256
    assert rel(total_wire_bytes(fwd, MESH), 32 + 96)
    assert rel(total_wire_bytes(bwd, MESH), 192 + 128)


def test_two_axis_all_reduce_then_all_to_all():
    # (8, 16) fp16, PS(0) → RS(1): axis 0 all-reduces the (2, 16) shard (64 B); axis 1 turns
    # S(0) into S(1) by an all-to-all of the same 64 B local shard.
    calls = reshard((8, 16), 2, (P, Shard(0)), (R, Shard(1)), MESH)
    assert calls == (Collective(ALL_REDUCE, 0, 64), Collective(ALL_TO_ALL, 1, 64))
    expected_time = (ALPHA + 2 * 14e-6 + 2 * 1 / 2 * 64 / 24e9) + (ALPHA + 3 * 3.4e-6 + 3 / 4 * 64 / 230e9)
    assert rel(total_time(calls, MESH), expected_time)


# -- flat buffers (ZeRO / FSDP storage) -------------------------------------------------------------
def test_gather_flat_even():
    # 1000 elements of 2 B sharded over both axes (125 per device): gather inside the node
    # first (125·4 = 500 elements = 1000 B), then across nodes (1000 elements = 2000 B).
    calls = gather_flat(1000, 2, (0, 1), MESH)
    assert calls == (Collective(ALL_GATHER, 1, 1000), Collective(ALL_GATHER, 0, 2000))
    assert rel(total_wire_bytes(calls, MESH), 3 / 4 * 1000 + 1 / 2 * 2000)


def test_gather_flat_one_axis():
    calls = gather_flat(1000, 2, (1,), MESH)
    assert calls == (Collective(ALL_GATHER, 1, 2000),)


def test_reduce_scatter_flat_even():
    # reduce-scatter 1000 fp16 elements across nodes (2000 B in), then the 500-element half
    # inside the node (1000 B in)
    calls = reduce_scatter_flat(1000, 2, (0, 1), MESH)
    assert calls == (Collective(REDUCE_SCATTER, 0, 2000), Collective(REDUCE_SCATTER, 1, 1000))
    assert rel(total_wire_bytes(calls, MESH), 1 / 2 * 2000 + 3 / 4 * 1000)


def test_reduce_scatter_plus_gather_costs_as_much_as_all_reduce_on_one_axis():
    # ring identity: all-reduce = reduce-scatter + all-gather, in bytes and in time but for
    # the second call's start-up
    rs = reduce_scatter_flat(4096, 2, (1,), MESH)
    ag = gather_flat(4096, 2, (1,), MESH)
    ar = comm.all_reduce_over(4096 * 2, (1,), MESH)
    assert rel(total_wire_bytes(rs + ag, MESH), 2 * 3 / 4 * 8192)
    assert rel(total_wire_bytes(rs + ag, MESH), total_wire_bytes(ar, MESH))
    assert rel(total_time(rs + ag, MESH), total_time(ar, MESH) + ALPHA)
