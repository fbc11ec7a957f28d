"""memshard's ZeRO-0 all-reduces are priced per bucket, as its runtime launches them.

The runtime packs the ZeRO-0 gradients, in the order the backward makes them final, into
buckets of PyTorch DDP's caps and all-reduces each bucket in one coalesced call. Each weight's
all-reduce is a share of its bucket's call: the shares of a bucket sum to 1, so the plan pays
the ring's latency once per bucket and the bytes as before. The bucket count here is what
PyTorch's own DDP rule (``dist._compute_bucket_assignment_by_size``) gives for the same local
gradients.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.distributed as dist

from memshard.api import make_job, strategy_plan
from memshard.core.placement import local_numel
from memshard.problem import comm
from memshard.problem.evaluate import evaluate
from memshard.problem.memory import param_layout
from memshard.problem.records import StorageGroup
from memshard.problem.storage import assign_buckets, zero0_shares


@functools.cache
def _dp_plan():
    """gpt3-1.3b cut to 4 layers, data parallel over mesh 2x4: every weight ZeRO-0, its
    gradient all-reduced over both axes (two calls a weight), several buckets."""
    job = make_job("gpt3-1.3b", "2x4", batch=8, precision="fp32", num_layers=4)
    return strategy_plan(job, strategy="dp")


def torch_buckets(problem, selection) -> list[list[str]]:
    """The buckets PyTorch's DDP packs the local gradients into (1 MiB first, then 25 MiB),
    the gradients in the order the backward makes them (by first use, last first; those of
    one op as DDP first orders them, the module's parameters reversed)."""
    first_use = {}
    for i, op in enumerate(problem.graph.ops):
        for t in op.inputs:
            if t.tensor in problem.graph.parameters:
                first_use.setdefault(t.tensor, i)
    order = sorted((n for n in reversed(problem.graph.parameters) if n in first_use), key=lambda n: -first_use[n])
    tensors = []
    for name in order:
        gid = problem.storage_group[name]
        G, _ = problem.groups[gid].options[selection.choices[gid]]
        numel = local_numel(problem.graph.tensors[name].shape, param_layout(G), problem.mesh.shape)
        tensors.append(torch.empty(numel, dtype=torch.float32, device="meta"))
    caps = [dist._DEFAULT_FIRST_BUCKET_BYTES, 25 * 1024 * 1024]  # torch's _DEFAULT_BUCKET_CAP_MB
    buckets, _ = dist._compute_bucket_assignment_by_size(tensors, caps)
    return [[order[k] for k in bucket] for bucket in buckets]


def _all_reduces(problem, selection) -> list[tuple[int, comm.Collective]]:
    """(instances, call) of every all-reduce the plan's storage choices run."""
    out = []
    for gid, group in enumerate(problem.groups):
        if isinstance(group, StorageGroup):
            choice = group.choices[selection.choices[gid]]
            out += [(group.instances, c) for c in choice.calls if c.kind == comm.ALL_REDUCE]
    return out


def test_a_plan_pays_one_all_reduce_latency_per_bucket_of_torchs_rule_and_the_same_bytes():
    plan = _dp_plan()
    problem, selection = plan.problem, plan.selection
    assert problem.graph.precision.reduce_bytes == 4  # (the meta tensors' fp32)
    buckets = torch_buckets(problem, selection)
    assert 1 < len(buckets) < len(problem.graph.parameters)
    calls = _all_reduces(problem, selection)
    mesh = problem.mesh
    for axis in range(mesh.real.ndim):
        on_axis = [(n, c) for n, c in calls if c.axes == (axis,)]
        assert sum(n * c.share for n, c in on_axis) == pytest.approx(len(buckets))
    # the evaluator counts the calls as they run, and prices each axis's latency once a bucket
    by_kind = evaluate(problem, selection).communication_by_kind[comm.ALL_REDUCE]
    assert by_kind["calls"] == pytest.approx(len(buckets) * mesh.real.ndim)
    hw = mesh.hardware
    latency = sum(hw.collective_latency_s + 2 * (a.size - 1) * a.latency_s for a in mesh.real.axes)
    bandwidth = sum(n * comm.wire_bytes(c, mesh) / mesh.real.axes[c.axis].bandwidth_bytes_per_s for n, c in calls)
    assert by_kind["time_s"] == pytest.approx(len(buckets) * latency + bandwidth)
    # the bytes of a weight's all-reduce: its whole local gradient, 2(m−1)/m of it on the wire
    numel = sum(problem.graph.tensors[name].numel for name in problem.graph.parameters)
    wire = sum(2 * (a.size - 1) / a.size for a in mesh.real.axes) * numel * 4
    assert by_kind["wire_bytes"] == pytest.approx(wire)


def test_the_shares_of_each_bucket_sum_to_one_and_split_it_by_elements():
    problem = _dp_plan().problem
    graph = problem.graph
    shares = zero0_shares(graph, 1.0, 4)
    assert set(shares) == set(graph.parameters)
    buckets = torch_buckets(problem, _dp_plan().selection)
    for bucket in buckets:
        assert sum(shares[name] for name in bucket) == pytest.approx(1.0)
        total = sum(graph.tensors[name].numel for name in bucket)
        for name in bucket:
            assert shares[name] == pytest.approx(graph.tensors[name].numel / total)
    # a quarter of every weight local: the buckets hold 4 times as many elements, and fewer
    fewer = zero0_shares(graph, 0.25, 4)
    assert math.fsum(fewer.values()) < math.fsum(shares.values())


@pytest.mark.parametrize("sizes, caps", [([1, 1, 1], (2,)), ([3, 1, 1, 1], (2, 3)), ([5], (1, 25)),
                                         ([1, 2, 1, 4, 1, 1], (2, 4))])
def test_a_bucket_closes_as_torchs_ddp_closes_it(sizes, caps):
    tensors = [torch.empty(s, dtype=torch.uint8, device="meta") for s in sizes]
    torch_buckets, _ = dist._compute_bucket_assignment_by_size(tensors, list(caps))
    assert assign_buckets(sizes, caps) == [next(b for b, bucket in enumerate(torch_buckets) if k in bucket)
                                          for k in range(len(sizes))]
