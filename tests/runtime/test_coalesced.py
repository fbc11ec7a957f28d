"""memshard's runtime all-reduces a bucket of ZeRO-0 gradients in one coalesced call, on 2 gloo ranks.

Under the data-parallel plan of tiny GPT on mesh 2 (every weight ZeRO-0), the backward that
syncs gradients issues one ``allreduce_coalesced`` per bucket and no all-reduce of a single
gradient: the buckets are those PyTorch's DDP packs the same local gradients into (1 MiB first,
then 25 MiB, in the order the backward makes them), each call's bytes its bucket's. The first
bucket starts before the first layer's gradients exist. ``CommCounter`` counts each call's bytes. Equality with one process is ``test_runtime_overlap.py``'s.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

import memshard
from memshard.api import strategy_plan
from memshard.core.placement import local_numel
from memshard.plans.plan import runnable
from memshard.problem.memory import param_layout
from memshard.runtime.executor import GraphModel, make_batch
from memshard.runtime.measure import CommCounter
from tests.runtime_harness import BATCH, forked_world

WORLD = 2


@functools.cache
def _plan():
    return runnable(strategy_plan("tiny-gpt", "2", strategy="dp", batch=BATCH, precision="fp32"))


def _torch_buckets(plan) -> list[list[str]]:
    """The buckets PyTorch's DDP packs the local gradients into (1 MiB first, then 25 MiB),
    the gradients in the order the backward makes them (by first use, last first; those of one
    op as DDP first orders them, the module's parameters reversed)."""
    problem, graph = plan.problem, plan.problem.graph
    first_use = {}
    for i, op in enumerate(graph.ops):
        for t in op.inputs:
            if t.tensor in graph.parameters:
                first_use.setdefault(t.tensor, i)
    order = sorted((n for n in reversed(graph.parameters) if n in first_use), key=lambda n: -first_use[n])
    tensors = []
    for name in order:
        gid = problem.storage_group[name]
        G, _ = problem.groups[gid].options[plan.selection.choices[gid]]
        tensors.append(torch.empty(local_numel(graph.tensors[name].shape, param_layout(G), problem.mesh.shape),
                                   dtype=torch.float32, device="meta"))
    buckets, _ = dist._compute_bucket_assignment_by_size(tensors, [dist._DEFAULT_FIRST_BUCKET_BYTES, 25 << 20])
    return [[order[k] for k in bucket] for bucket in buckets]


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from memshard.runtime import stores

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    plan = _plan()
    graph = plan.problem.graph
    model = memshard.parallelize(GraphModel(graph, seed=0), plan, init_device_mesh("cpu", plan.problem.mesh.shape))
    launches = []
    together = stores.all_reduce_together

    def logged(flats, group):
        # the members launched, and the weights with no gradient yet then
        ids = {id(f.untyped_storage()) for f in flats}
        launched = [n for n, s in model.stores.items() if s.param.grad is not None
                    and id(s.local_gradient().untyped_storage()) in ids]
        launches.append([launched, [n for n, s in model.stores.items() if s.param.grad is None]])
        return together(flats, group)

    stores.all_reduce_together = logged
    try:
        with CommCounter() as counter:
            model(make_batch(graph, 1, 0)[0]).backward()
    finally:
        stores.all_reduce_together = together
    calls = [[c.op, c.kind, c.buffer_bytes] for c in counter.calls]
    report = {"launches": launches, "calls": calls}
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def test_a_bucket_is_all_reduced_in_one_call_as_torchs_ddp_packs_it(tmp_path):
    plan = _plan()
    assert {plan.problem.groups[g].options[k][1].stage for g, k in
            ((plan.problem.storage_group[n], plan.selection.choices[plan.problem.storage_group[n]])
             for n in plan.problem.graph.parameters)} == {0}
    buckets = _torch_buckets(plan)
    assert len(buckets) > 1
    graph = plan.problem.graph
    reports = forked_world(_worker, WORLD, tmp_path)
    for report in reports:
        launched = [sorted(names) for names, _ in report["launches"]]
        assert launched == [sorted(bucket) for bucket in buckets]
        # the first bucket before the first layer's (and the embeddings') gradients exist
        _, missing = report["launches"][0]
        assert any(".0." in name for name in missing) and "wte.weight" in missing
        all_reduces = [c for c in report["calls"] if c[1] == "all_reduce"]
        coalesced = [c for c in all_reduces if "coalesced" in c[0]]
        assert [nbytes for _, _, nbytes in coalesced] == [
            4 * sum(graph.tensors[n].numel for n in bucket) for bucket in buckets]
        assert len(all_reduces) - len(coalesced) <= 1  # (the loss, replicated on every rank)
