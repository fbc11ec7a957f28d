"""MemoryMeter on gloo frees a collective's buffers at its wait, in every run.

gloo's worker thread holds the collective's ``Work`` (and through it the collective's tensors)
for a moment after the collective completes; a buffer only the ``Work`` still held used to be
freed whenever that thread got the GIL, several allocations later in some runs and not in
others (``memshard run`` showed one rank's peak a few percent high). Here two forked gloo
ranks repeat a collective on a temporary buffer, drop it, wait, and allocate right after:
the buffer must be gone before that allocation every time.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from memshard.runtime.measure import MemoryMeter
from tests.runtime_harness import forked_world

REPEATS = 40
N = 1000  # fp32 elements of the temporary input
F32 = 4


def _functional(group: Any) -> MemoryMeter:
    """x (4 kB) all-gathered over 2 ranks into y (8 kB); x dropped before the wait; then z
    (16 kB). x is freed at the wait: the peak is y + z = 24 kB (28 kB if x outlived it)."""
    with MemoryMeter() as meter:
        x = torch.ones(N)
        y = funcol.all_gather_tensor(x, 0, group)
        del x
        y = y.wait() if hasattr(y, "wait") else y
        z = torch.ones(4 * N)
        del y, z
    return meter


def _c10d(group: Any) -> MemoryMeter:
    """A c10d all-reduce of a temporary (4 kB), then z (16 kB): the peak is z alone."""
    with MemoryMeter() as meter:
        dist.all_reduce(torch.ones(N), group=group)
        z = torch.ones(4 * N)
        del z
    return meter


def _c10d_beside(group: Any) -> MemoryMeter:
    """A c10d all-reduce of a temporary (4 kB) started beside y (4 kB), waited, its handle
    dropped; then z (16 kB): the peak is y + z (24 kB if the temporary outlived the handle)."""
    with MemoryMeter() as meter:
        work = dist.all_reduce(torch.ones(N), group=group, async_op=True)
        y = torch.ones(N)
        work.wait()
        del work
        z = torch.ones(4 * N)
        del y, z
    return meter


def _reduce_scatter(group: Any) -> MemoryMeter:
    """A c10d reduce-scatter of x (8 kB) into y (4 kB) over 2 ranks, started and waited: the
    peak is x + y. (gloo all-reduces a copy of x on its thread and copies this rank's chunk
    of it into y in the wait: its buffer, not counted, as under the fake process group.)"""
    with MemoryMeter() as meter:
        x = torch.ones(2 * N)
        y = torch.empty(N)
        work = dist.reduce_scatter_single(y, x, group=group, async_op=True)
        work.wait()
        del work, x
    assert torch.equal(y, torch.full((N,), 2.0))
    return meter


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        group = dist.group.WORLD
        steps = {"functional": _functional, "c10d": _c10d, "c10d_beside": _c10d_beside,
                 "reduce_scatter": _reduce_scatter}
        res: dict[str, list] = {**{kind: [] for kind in steps}, "unsettled": []}
        for _ in range(REPEATS):
            for kind, step in steps.items():
                meter = step(group)
                res[kind].append(meter.peak_bytes)
                res["unsettled"].append(meter.unsettled)
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(res))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def peaks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, list]]:
    return forked_world(_worker, 2, tmp_path_factory.mktemp("frees"))


def test_a_functional_collectives_input_is_freed_at_its_wait(peaks):
    for res in peaks:
        assert res["functional"] == [(2 * N + 4 * N) * F32] * REPEATS


def test_a_c10d_collectives_temporary_is_freed_before_the_next_op(peaks):
    for res in peaks:
        assert res["c10d"] == [4 * N * F32] * REPEATS


def test_a_c10d_collective_started_beside_frees_its_temporary_when_its_handle_is_dropped(peaks):
    for res in peaks:
        assert res["c10d_beside"] == [5 * N * F32] * REPEATS


def test_a_reduce_scatters_internal_copy_is_not_counted_at_its_wait(peaks):
    for res in peaks:
        assert res["reduce_scatter"] == [3 * N * F32] * REPEATS


def test_every_work_settled(peaks):
    for res in peaks:
        assert not any(res["unsettled"])
