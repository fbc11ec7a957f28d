"""Measuring one rank: collectives counted by CommCounter, memory by MemoryMeter.

Every expected figure is derived by hand in the test from the sizes involved and the
textbook definitions (memshard.problem.comm's docstring): for a group of m devices and a buffer
of B bytes one device sends (m−1)/m · B (all-gather B = the gathered output, reduce-scatter B
= the input, all-to-all and broadcast B = the local buffer), and 2(m−1)/m · B for an
all-reduce. Memory figures are element counts × 4 bytes (fp32, CPU: no allocator rounding).
"""

from __future__ import annotations

import contextlib
import datetime
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from memshard.runtime.measure import CATEGORIES, CommCounter, MemoryMeter, destroy, init_fake_world
from tests.runtime_harness import forked_world

AG, RS, AR, A2A, BC = "all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast"
F32 = 4


def _calls(counter: CommCounter) -> list[tuple[str, int, int, float]]:
    return [(c.kind, c.group_size, c.buffer_bytes, c.wire_bytes) for c in counter.calls]


# ------------------------------------------------------------------ real gloo, 4 processes


def _dtensor_linear_step(mesh: Any) -> tuple[MemoryMeter, CommCounter]:
    """Linear(512, 256) with its weight sharded Shard(0) over a 1-D mesh of 4, a replicated
    batch of 32, loss = sum of the all-gathered output, one Adam step (single-tensor)."""
    torch.manual_seed(0)
    model = nn.Linear(512, 256, bias=False)
    model.weight = nn.Parameter(distribute_tensor(model.weight.detach(), mesh, [Shard(0)]))
    opt = torch.optim.Adam(model.parameters(), foreach=False)
    meter = MemoryMeter(model, opt)
    with CommCounter() as comm, meter:
        x = DTensor.from_local(torch.randn(32, 512), mesh, [Replicate()])
        out = model(x)  # Shard(1): local 32 x 64
        loss = out.redistribute(mesh, [Replicate()]).sum()
        loss.backward()
        opt.step()
    return meter, comm


def _gloo_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),  # a stuck rank fails the test, not hangs it
    )
    res: dict[str, Any] = {}
    try:
        with CommCounter() as c:
            t = torch.ones(1000)
            dist.all_reduce(t)
            res["all_reduce_value"] = t[0].item()
        res["all_reduce"] = _calls(c)

        with CommCounter() as c:
            dist.all_gather_into_tensor(torch.empty(1000), torch.ones(250))
            dist.reduce_scatter_tensor(torch.empty(250), torch.ones(1000))
            dist.all_to_all_single(torch.empty(1000), torch.ones(1000))
            dist.broadcast(torch.ones(1000), src=0)
            with c.paused():
                dist.all_reduce(torch.ones(10))
        res["c10d"] = _calls(c)

        import torch.distributed._functional_collectives as funcol

        with CommCounter() as c:
            group = dist.group.WORLD
            funcol.all_gather_tensor(torch.ones(250), 0, group).wait()
            funcol.reduce_scatter_tensor(torch.ones(1000), "sum", 0, group).wait()
            funcol.all_reduce(torch.ones(1000), "sum", group).wait()
            funcol.all_to_all_single(torch.ones(1000), None, None, group).wait()
        res["functional"] = _calls(c)

        mesh = init_device_mesh("cpu", (world,))
        g = distribute_tensor(torch.randn(64, 32), mesh, [Shard(0)])
        p = DTensor.from_local(torch.ones(16, 16), mesh, [Partial()])
        with CommCounter() as c:
            r = g.redistribute(mesh, [Replicate()])
            q = p.redistribute(mesh, [Replicate()])
        res["dtensor_1d"] = _calls(c)
        res["dtensor_1d_shapes"] = [list(r.to_local().shape), q.to_local()[0, 0].item()]

        mesh2 = init_device_mesh("cpu", (2, 2))
        a = distribute_tensor(torch.randn(64, 32), mesh2, [Shard(0), Replicate()])
        b = DTensor.from_local(torch.ones(64, 32), mesh2, [Replicate(), Partial()])
        s = distribute_tensor(torch.randn(64, 32), mesh2, [Shard(0), Shard(1)])
        with CommCounter() as c:
            a.redistribute(mesh2, [Replicate(), Replicate()])
        res["dtensor_2d_gather"] = _calls(c)
        with CommCounter() as c:
            b.redistribute(mesh2, [Replicate(), Replicate()])
        res["dtensor_2d_reduce"] = _calls(c)
        with CommCounter() as c:
            s.redistribute(mesh2, [Replicate(), Replicate()])
        res["dtensor_2d_both"] = _calls(c)

        meter, comm = _dtensor_linear_step(mesh)
        res["meter"] = [meter.peak_bytes, meter.breakdown, _calls(comm)]
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(res))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return forked_world(_gloo_worker, 4, tmp_path_factory.mktemp("gloo"))


def _as_tuples(calls: list[list[Any]]) -> list[tuple[str, int, int, float]]:
    return [(k, m, b, w) for k, m, b, w in calls]


def test_gloo_all_reduce(gloo_results: list[dict[str, Any]]) -> None:
    for res in gloo_results:
        assert res["all_reduce_value"] == 4.0  # the collective really ran
        # 1000 fp32 = 4000 B; all-reduce sends 2 · 3/4 · 4000
        assert _as_tuples(res["all_reduce"]) == [(AR, 4, 4000, 6000.0)]


def test_gloo_c10d_collectives(gloo_results: list[dict[str, Any]]) -> None:
    for res in gloo_results:
        assert _as_tuples(res["c10d"]) == [
            (AG, 4, 4000, 3000.0),  # B = gathered output, 4 x 250 fp32
            (RS, 4, 4000, 3000.0),  # B = input, 1000 fp32
            (A2A, 4, 4000, 3000.0),  # B = local buffer
            (BC, 4, 4000, 3000.0),
        ]  # the paused all-reduce is not there


def test_gloo_functional_collectives(gloo_results: list[dict[str, Any]]) -> None:
    for res in gloo_results:
        assert _as_tuples(res["functional"]) == [
            (AG, 4, 4000, 3000.0),
            (RS, 4, 4000, 3000.0),
            (AR, 4, 4000, 6000.0),
            (A2A, 4, 4000, 3000.0),
        ]


def test_gloo_dtensor_redistribute(gloo_results: list[dict[str, Any]]) -> None:
    for res in gloo_results:
        assert res["dtensor_1d_shapes"] == [[64, 32], 4.0]
        assert _as_tuples(res["dtensor_1d"]) == [
            (AG, 4, 64 * 32 * F32, 3 / 4 * 64 * 32 * F32),  # S(0)→R gathers the 64x32 tensor
            (AR, 4, 16 * 16 * F32, 2 * 3 / 4 * 16 * 16 * F32),  # P→R all-reduces 16x16
        ]
        # 2x2 mesh: each axis is a group of 2
        assert _as_tuples(res["dtensor_2d_gather"]) == [(AG, 2, 64 * 32 * F32, 64 * 32 * F32 / 2)]
        assert _as_tuples(res["dtensor_2d_reduce"]) == [(AR, 2, 64 * 32 * F32, 64 * 32 * F32)]
        # S(0)S(1)→RR: two all-gathers of 2, one to a half tensor (32x32 or 64x16) and one
        # to the whole 64x32, whichever axis goes first
        both = sorted(_as_tuples(res["dtensor_2d_both"]))
        assert both == [(AG, 2, 32 * 32 * F32, 32 * 32 * F32 / 2), (AG, 2, 8192, 4096.0)]


# Expected per-rank figures of _dtensor_linear_step on a mesh of 4, by hand:
LOCAL_W = 64 * 512  # 256 x 512 weight, Shard(0) over 4
DTENSOR_STEP = {
    "parameters": F32 * LOCAL_W,
    "gradients": F32 * LOCAL_W,  # the weight's gradient is Shard(0) too
    "optimizer_states": 2 * F32 * LOCAL_W + 4,  # exp_avg, exp_avg_sq, fp32 scalar step
    # at the peak (in Adam's update): x (32x512, replicated), out's shard (32x64), the loss
    "activations": F32 * (32 * 512 + 32 * 64) + 4,
    # Adam's denom = exp_avg_sq.sqrt() / bias_correction: two weight-sized temporaries
    "transients": 2 * F32 * LOCAL_W,
}
DTENSOR_STEP_COMM = [(AG, 4, 32 * 256 * F32, 3 / 4 * 32 * 256 * F32)]  # out S(1)→R


def test_gloo_memory_of_a_sharded_step(gloo_results: list[dict[str, Any]]) -> None:
    for res in gloo_results:
        peak, breakdown, calls = res["meter"]
        assert breakdown == DTENSOR_STEP
        assert peak == sum(DTENSOR_STEP.values())
        assert _as_tuples(calls) == DTENSOR_STEP_COMM


# ------------------------------------------------------------------- fake process group


@pytest.fixture
def fake_world() -> Any:
    assert not dist.is_initialized()
    init_fake_world(rank=5, world_size=64)
    try:
        assert (dist.get_rank(), dist.get_world_size()) == (5, 64)
        yield
    finally:
        destroy()
    assert not dist.is_initialized()


@pytest.mark.parametrize("fake_tensors", [False, True])
def test_fake_pg_dtensor_redistribute(fake_world: None, fake_tensors: bool) -> None:
    mesh = init_device_mesh("cpu", (64,))
    mesh2 = init_device_mesh("cpu", (8, 8))
    with FakeTensorMode() if fake_tensors else contextlib.nullcontext():
        g = distribute_tensor(torch.randn(128, 16), mesh, [Shard(0)])
        p = DTensor.from_local(torch.ones(4, 4), mesh, [Partial()])
        h = distribute_tensor(torch.randn(64, 16), mesh2, [Shard(0), Replicate()])
        with CommCounter() as c:
            g.redistribute(mesh, [Replicate()])
            p.redistribute(mesh, [Replicate()])
            h.redistribute(mesh2, [Replicate(), Replicate()])
            dist.all_reduce(torch.ones(100))
    assert _calls(c) == [
        (AG, 64, 128 * 16 * F32, 63 / 64 * 128 * 16 * F32),
        (AR, 64, 4 * 4 * F32, 2 * 63 / 64 * 4 * 4 * F32),
        (AG, 8, 64 * 16 * F32, 7 / 8 * 64 * 16 * F32),  # axis 0 of 8x8 is a group of 8
        (AR, 64, 400, 2 * 63 / 64 * 400),  # c10d op on the world group
    ]
    assert c.calls_by_kind == {AG: 2, AR: 2}
    assert c.wire_bytes_by_kind[AG] == pytest.approx(63 / 64 * 8192 + 7 / 8 * 4096)
    assert c.wire_bytes_by_kind_and_group_size[(AG, 8)] == pytest.approx(3584.0)
    assert c.total_wire_bytes == pytest.approx(sum(w for *_, w in _calls(c)))


def test_fake_pg_cpu_shard_to_shard_is_an_all_gather(fake_world: None) -> None:
    # DTensor on a CPU mesh does S(0)→S(1) as all-gather + local chunk, not all-to-all:
    # the 2x64 local shards of a 128x64 tensor are gathered whole (128x64 fp32 = 32 KiB).
    mesh = init_device_mesh("cpu", (64,))
    g = distribute_tensor(torch.randn(128, 64), mesh, [Shard(0)])
    with CommCounter() as c:
        s = g.redistribute(mesh, [Shard(1)])
    assert s.to_local().shape == (128, 1)
    assert _calls(c) == [(AG, 64, 128 * 64 * F32, 63 / 64 * 128 * 64 * F32)]


def _wait(t: Any) -> None:
    for x in t if isinstance(t, list) else [t]:
        if hasattr(x, "wait"):  # an AsyncCollectiveTensor
            x.wait()


def test_fake_pg_list_coalesced_and_subgroup_collectives(fake_world: None) -> None:
    import torch.distributed._functional_collectives as funcol

    world = dist.group.WORLD
    sub = dist.new_group(ranks=[0, 1, 2, 3, 4, 5])  # rank 5 is in it: a group of 6
    with CommCounter() as c:
        dist.all_gather([torch.empty(100) for _ in range(64)], torch.ones(100))
        dist.reduce_scatter(torch.empty(100), [torch.ones(100) for _ in range(64)])
        dist.all_to_all([torch.empty(10) for _ in range(64)], [torch.ones(10) for _ in range(64)])
        _wait(funcol.all_gather_single_coalesced([torch.ones(100), torch.ones(50)], world))
        _wait(funcol.all_reduce_coalesced([torch.ones(100), torch.ones(50)], "sum", world))
        _wait(funcol.reduce_scatter_single_coalesced([torch.ones(64)] * 2, "sum", [0, 0], world))
        _wait(funcol.broadcast(torch.ones(100), 0, world))
        dist.all_reduce(torch.ones(150), group=sub)
        dist.barrier()  # not a data collective
    assert _calls(c) == [
        (AG, 64, 64 * 400, 63 * 400),  # B = the 64 gathered 100-element tensors
        (RS, 64, 64 * 400, 63 * 400),  # B = the 64 input tensors
        (A2A, 64, 64 * 40, 63 * 40),  # B = the local send buffers
        (AG, 64, 64 * 600, 63 * 600),  # coalesced: one call, 150 elements gathered 64 times
        (AR, 64, 600, 2 * 63 / 64 * 600),
        (RS, 64, 2 * 256, 63 / 64 * 512),
        (BC, 64, 400, 63 / 64 * 400),
        (AR, 6, 600, 2 * 5 / 6 * 600),
    ]


def test_fake_pg_and_fake_tensors_memory_of_a_sharded_step() -> None:
    # DTensor derives output shapes by running each op on global-shape fake tensors, once per
    # op signature (then cached); under FakeTensorMode those must not count. Start uncached.
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator._propagate_tensor_meta_cached.cache_clear()
    original = type(propagator)._propagate_tensor_meta_non_cached
    init_fake_world(rank=1, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (4,))
        with FakeTensorMode():
            meter, comm = _dtensor_linear_step(mesh)
    finally:
        destroy()
    assert type(propagator)._propagate_tensor_meta_non_cached is original  # unpatched again
    assert meter.breakdown == DTENSOR_STEP
    assert meter.peak_bytes == sum(DTENSOR_STEP.values())
    assert _calls(comm) == DTENSOR_STEP_COMM


def test_init_fake_world_rejects_a_rank_outside_the_world() -> None:
    with pytest.raises(ValueError):
        init_fake_world(4, 4)
    assert not dist.is_initialized()


# ------------------------------------------------------------------------ memory, 1 process


def test_linear_adam_step_breakdown_at_the_peak() -> None:
    n_w, n_b = 256 * 128, 128
    n = n_w + n_b
    model = nn.Linear(256, 128)
    opt = torch.optim.Adam(model.parameters(), foreach=False)
    meter = MemoryMeter(model, opt)
    with meter:
        x = torch.randn(4, 256)
        loss = model(x).sum()
        loss.backward()
        opt.step()
    # The peak is inside Adam's update of the weight: parameters, their gradients, the new
    # states (exp_avg + exp_avg_sq per element, a 4-byte fp32 step per parameter tensor),
    # and the two weight-sized temporaries of denom = exp_avg_sq.sqrt() / bias_correction.
    expected = {
        "parameters": F32 * n,
        "gradients": F32 * n,
        "optimizer_states": 2 * F32 * n + 2 * 4,
        "activations": F32 * 4 * 256 + 4,  # x and the loss, still held
        "transients": 2 * F32 * n_w,
    }
    assert meter.breakdown == expected
    assert meter.peak_bytes == sum(expected.values())
    assert set(meter.breakdown) == set(CATEGORIES)
    assert meter.peak_bytes_by_device == {"cpu": meter.peak_bytes}
    # each category's own peak: activations peaked in forward (x, the 4x128 output, loss)
    assert meter.category_peaks["activations"] == F32 * (4 * 256 + 4 * 128) + 4
    assert meter.cuda_peak_bytes is None

    # The next step, measured by a new meter: the states now exist before the region.
    opt.zero_grad(set_to_none=True)
    del x, loss
    meter2 = MemoryMeter(model, opt)
    with meter2:
        x = torch.randn(4, 256)
        loss = model(x).sum()
        loss.backward()
        opt.step()
    assert meter2.breakdown == expected


def test_forward_peak_counts_saved_and_transient_activations() -> None:
    # Linear(256→512) → ReLU → Linear(512→8), batch 64, forward only. Live activations:
    # x; x + h; x + h + relu(h) while ReLU runs (h is not saved: ReLU's backward uses its
    # output); then x + relu(h) + out. The peak is during ReLU.
    model = nn.Sequential(nn.Linear(256, 512, bias=False), nn.ReLU(), nn.Linear(512, 8, bias=False))
    meter = MemoryMeter(model)
    with meter:
        x = torch.randn(64, 256)
        out = model(x)
    assert out.shape == (64, 8)
    params = F32 * (256 * 512 + 512 * 8)
    acts = F32 * (64 * 256 + 64 * 512 + 64 * 512)
    assert meter.breakdown == dict.fromkeys(CATEGORIES, 0) | {
        "parameters": params,
        "activations": acts,
    }
    assert meter.peak_bytes == params + acts


def test_backward_peak_counts_the_fresh_gradient_as_a_gradient() -> None:
    # Linear(1024→1024) on an untracked batch of 2: the peak is when the weight's gradient
    # is allocated, beside the weight, the loss and its seed gradient (1.0). MemTracker
    # files that gradient under Temp until the gradient hook runs; the meter must not.
    model = nn.Linear(1024, 1024, bias=False)
    x = torch.randn(2, 1024)
    meter = MemoryMeter(model)
    with meter:
        model(x).sum().backward()
    w = F32 * 1024 * 1024
    assert meter.breakdown == {
        "parameters": w,
        "gradients": w,
        "optimizer_states": 0,
        "activations": 4 + 4,
        "transients": 0,
    }
    assert meter.peak_bytes == 2 * w + 8
    assert model.weight.grad is not None


def test_meter_counts_tensors_passed_in_as_transients() -> None:
    model = nn.Linear(64, 64, bias=False)
    extra = torch.zeros(1024)
    meter = MemoryMeter(model, None, extra)
    with meter:
        y = torch.zeros(256)
    del y
    assert meter.breakdown == dict.fromkeys(CATEGORIES, 0) | {
        "parameters": F32 * 64 * 64,
        "transients": F32 * 1024,
        "activations": F32 * 256,
    }


def test_storage_resize_counts_without_a_following_op() -> None:
    # FSDP2 grows and frees unsharded parameters with UntypedStorage.resize_; a grow and a
    # free with no op between them is still a 4096-byte peak.
    meter = MemoryMeter()
    with meter:
        t = torch.empty(0)
        t.untyped_storage().resize_(4096)
        t.untyped_storage().resize_(0)
    assert meter.peak_bytes == 4096
    assert meter.breakdown["activations"] == 4096
