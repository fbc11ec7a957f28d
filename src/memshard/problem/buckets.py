"""Data-parallel buckets: how PyTorch's DDP and Megatron-LM reduce gradients, and how
Megatron-LM's distributed optimizer gathers parameters, many weights to one collective.

Neither framework runs one collective per weight. Each packs the local gradients, in the order
the backward makes them, into buckets, and runs one collective per bucket:

- PyTorch's ``DistributedDataParallel`` (``torch/nn/parallel/distributed.py``:
  ``_DEFAULT_BUCKET_CAP_MB = 25``; ``dist._DEFAULT_FIRST_BUCKET_BYTES``, 1 MiB): the first
  bucket holds 1 MiB, every other 25 MiB, of gradient bytes. After the first iteration the
  reducer rebuilds its buckets in the order the gradients became ready. A bucket closes once
  its bytes reach the cap (``dist._compute_bucket_assignment_by_size``), so the weight that
  fills it is its last.
- Megatron-LM (``megatron/core/distributed/distributed_data_parallel.py``, core_v0.8.0
  lines 51–57, main lines 133–137): with ``--overlap-grad-reduce`` a bucket holds
  ``max(40,000,000, 1,000,000 × DP)`` parameters (``--ddp-bucket-size``); without it, one
  bucket holds the whole buffer; a pipeline stage after the first also takes one bucket.
  ``param_and_grad_buffer.py`` (core_v0.8.0 lines 296–341, main lines 980–990) lays the
  parameters out in reverse order and closes a bucket once it holds that many elements. The
  distributed optimizer all-gathers the updated parameters per bucket too
  (``distrib_optimizer.py``: one handle per bucket).

memshard prices a bucket's collective once: each weight's collective over the data-parallel
axes is a ``share`` of its bucket's call, its bytes over the bucket's. The shares of a bucket
sum to 1, so the bucket pays one start-up and one ring latency; the bytes are unchanged. The
backward makes gradients in reverse order of their first use; that order stands for both
frameworks'. A collective over other axes too (Megatron-LM's all-reduce of a sequence-parallel
norm's gradient over the TP and DP axes at once, without ``-distopt``) stays one call per weight.

The buckets depend on every weight's local size, so on the plan: :func:`bucketed` prices a
fixed plan's problem (the baselines'). memshard's own runtime buckets its ZeRO-0 all-reduces by
DDP's rule, written once in ``storage.py`` (``DDP_BUCKET_CAPS``, ``assign_buckets``,
``ready_order``), which prices them as the ILP can: before the plan is known (``zero0_shares``).
"""

from __future__ import annotations

import math
from dataclasses import replace

from memshard.core.placement import local_numel
from memshard.problem import comm
from memshard.problem.memory import param_layout
from memshard.problem.records import (
    DDP_FRAMEWORKS,
    MEGATRON,
    MEGATRON_OVERLAP,
    Choice,
    Problem,
    Selection,
    StorageGroup,
)
from memshard.problem.storage import (  # DDP's rule, which memshard's runtime shares (``storage.py``)
    DDP_BUCKET_CAPS,
    assign_buckets,
    ready_order,
    with_calls,
)

MEGATRON_BUCKET_PARAMETERS = 40_000_000  # max(40M, 1M × DP) parameters with --overlap-grad-reduce
MEGATRON_BUCKET_PER_DATA_RANK = 1_000_000
BUCKETED_KINDS = (comm.ALL_REDUCE, comm.REDUCE_SCATTER, comm.ALL_GATHER)


def bucket_caps(problem: Problem, data_parallel: int) -> tuple[str, tuple[float, ...]] | None:
    """How ``problem``'s framework fills its buckets: ("bytes" or "elements", the caps of the
    first buckets, the last repeated); None where it runs one collective per weight."""
    if problem.framework in DDP_FRAMEWORKS:
        return "bytes", DDP_BUCKET_CAPS
    if problem.framework == MEGATRON or (problem.framework == MEGATRON_OVERLAP and problem.stage is not None
                                         and problem.stage.first_layer > 0):
        return "elements", (math.inf,)
    if problem.framework == MEGATRON_OVERLAP:
        return "elements", (max(MEGATRON_BUCKET_PARAMETERS, MEGATRON_BUCKET_PER_DATA_RANK * data_parallel),)
    return None


def bucket_shares(problem: Problem, selection: Selection, data_axes: tuple[int, ...]) -> dict[int, float]:
    """Storage group → the mean share of its bucket's call that each of its weights' bucketed
    collectives is (its local elements over the bucket's), under ``selection``; ``data_axes``:
    the data-parallel axes of ``problem.mesh``. Empty where the framework does not bucket."""
    data_parallel = math.prod(problem.mesh.shape[a] for a in data_axes)
    caps = bucket_caps(problem, data_parallel)
    if caps is None or data_parallel == 1:
        return {}
    unit, limits = caps
    names = [n for n in ready_order(problem.graph) if _bucketed(_choice(problem, selection, n).calls, problem, data_axes)]
    numel = [_local_numel(problem, selection, n) for n in names]
    per_element = [problem.graph.precision.reduce_bytes if unit == "bytes" else 1] * len(names)
    buckets = assign_buckets([n * b for n, b in zip(numel, per_element)], limits)
    totals: dict[int, float] = {}
    for b, n in zip(buckets, numel):
        totals[b] = totals.get(b, 0.0) + n
    sums: dict[int, float] = {}
    for name, b, n in zip(names, buckets, numel):
        gid = problem.storage_group[name]
        sums[gid] = sums.get(gid, 0.0) + n / totals[b]
    return {gid: total / problem.groups[gid].instances for gid, total in sums.items()}


def bucketed(problem: Problem, selection: Selection, data_axes: tuple[int, ...]) -> Problem:
    """``problem`` with the data-parallel collectives of ``selection``'s storage choices priced
    per bucket (:func:`bucket_shares`); ``problem`` itself where its framework runs one per
    weight. The other choices keep their prices."""
    shares = bucket_shares(problem, selection, data_axes)
    if not shares:
        return problem
    groups = list(problem.groups)
    for gid, share in shares.items():
        group = groups[gid]
        k = selection.choices[gid]
        choices = list(group.choices)
        choices[k] = shared_choice(problem, group, k, share, data_axes)
        groups[gid] = replace(group, choices=choices)
    return replace(problem, groups=groups)


def shared_choice(problem: Problem, group: StorageGroup, k: int, share: float, data_axes: tuple[int, ...]) -> Choice:
    """Storage choice ``k`` of ``group`` with its collectives over ``data_axes`` a ``share`` of
    one call each (whatever share they were: pricing a plan bucketed already again is the
    same); what runs beside the compute and what runs once a step as before."""
    choice, mesh = group.choices[k], problem.mesh
    real = set(mesh.to_real_axes(data_axes))
    calls = tuple(replace(c, share=share) if _in_bucket(c, real) else c for c in choice.calls)
    beside = calls if choice.overlapped_s > 0 else ()
    return with_calls(choice, calls, beside, group.options[k][1].stage, mesh)


def data_axes_of(mesh_shape: tuple[int, ...], tensor_parallel: int) -> tuple[int, ...]:
    """The data-parallel axes of a mesh whose innermost axes, ``tensor_parallel`` devices in
    all, are tensor-parallel (the baselines' layout): the axes before them."""
    k, devices = len(mesh_shape), 1
    while k > 0 and devices < tensor_parallel:
        k -= 1
        devices *= mesh_shape[k]
    return tuple(range(k))


def _choice(problem: Problem, selection: Selection, name: str) -> Choice:
    gid = problem.storage_group[name]
    return problem.groups[gid].choices[selection.choices[gid]]


def _local_numel(problem: Problem, selection: Selection, name: str) -> int:
    gid = problem.storage_group[name]
    G, _ = problem.groups[gid].options[selection.choices[gid]]
    return local_numel(problem.graph.tensors[name].shape, param_layout(G), problem.mesh.shape)


def _in_bucket(c: comm.Collective, real_data_axes: set[int]) -> bool:
    return c.kind in BUCKETED_KINDS and set(c.axes) <= real_data_axes


def _bucketed(calls: tuple[comm.Collective, ...], problem: Problem, data_axes: tuple[int, ...]) -> bool:
    real = set(problem.mesh.to_real_axes(data_axes))
    return any(_in_bucket(c, real) for c in calls)
