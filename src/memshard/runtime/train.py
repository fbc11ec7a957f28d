"""One rank of a training run under a plan, measured against the plan's predictions.

:func:`train` runs ``steps`` optimizer steps of a :class:`ShardedGraphModel` (Adam, each step
``micro_batches`` forward/backward passes) and measures the last step, when the optimizer
states exist as the memory model assumes: peak memory by category (``MemoryMeter``), bytes
sent per collective kind (``CommCounter``), and the step time. The same code runs under
``memshard run`` (which starts the ranks itself) and under an external ``torchrun``::

    torchrun --nproc-per-node 8 -m memshard.runtime.train --plan plan.json

Every rank writes its report to ``$MEMSHARD_OUT_DIR/rank<r>.json`` when that is set (the
launcher reads them), or prints rank 0's comparison table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from memshard.api import runtime_plan
from memshard.cost.comm import KINDS
from memshard.cost.memory import CATEGORIES
from memshard.errors import MemshardError
from memshard.files import write_text_atomically
from memshard.graph import Origin
from memshard.runtime.executor import GraphModel, make_batch, parallelize
from memshard.runtime.measure import CommCounter, MemoryMeter
from memshard.runtime.optim import LeanAdam

KILL_ENV = "MEMSHARD_TEST_KILL"  # "rank:step": that rank dies mid-step (the fault test)


def predicted(plan) -> dict:
    """The plan's figures for one device, in the shape of :func:`train`'s measurement."""
    mem, comm = plan.data["memory"], plan.data["communication"]
    return {
        "peak_bytes": mem["peak_bytes_per_device"],
        "breakdown": dict(mem["breakdown"]),
        "communication_bytes": comm["bytes_per_step_per_device"],
        "communication_by_kind": {k: comm["by_kind"].get(k, {}).get("wire_bytes", 0.0) for k in KINDS},
    }


def _maybe_die(step: int) -> None:
    spec = os.environ.get(KILL_ENV)
    if spec:
        rank, at = (int(x) for x in spec.split(":"))
        if dist.get_rank() == rank and step == at:
            os.kill(os.getpid(), 9)


def train(plan, device_mesh, steps: int = 2, seed: int = 0, lr: float = 1e-3, inspect=None, module=None) -> dict:
    """Run ``steps`` steps on this rank; measure the last one. Returns this rank's report.

    A plan of a traced module runs that ``module`` (default: the Hugging Face model the plan
    names, built with seed ``seed``) on random arguments of the traced shapes.

    ``inspect(model, step)``, if given, runs after each step's gradients are reduced and
    before the optimizer uses them, outside the measured region (tests read gradients)."""
    if steps < 2:
        raise MemshardError("run at least 2 steps: the last one is measured with optimizer states in place")
    graph = plan.problem.graph
    k = plan.problem.micro_batches
    if graph.origin is Origin.TRACED:
        from memshard.runtime import traced

        if module is None:
            from memshard.trace.hf import seeded_model

            job = plan.job
            module = seeded_model(job.model.source, job.precision or "mixed", job.model.attn_implementation,
                                  job.hf_overrides(), device_mesh.device_type, seed)
        model = parallelize(module, plan, device_mesh)
        del module  # the shards are the model now
        make_inputs = traced.make_batch
    else:
        model = parallelize(GraphModel(graph, seed), plan, device_mesh)
        make_inputs = make_batch
    optimizer = LeanAdam(model.optimizer_parameters(), lr=lr)
    losses, times = [], []
    measured = {}
    for step in range(steps):
        last = step == steps - 1
        meter = MemoryMeter(model, optimizer)
        counter = CommCounter()
        start = time.perf_counter()
        with meter if last else nullcontext(), counter if last else nullcontext():
            batches = make_inputs(graph, k, seed + step, model.device)  # inside: counts as activations
            model.step = step
            model.watch_gradients(meter.mark_gradient if last else None)
            total = 0.0
            for i, batch in enumerate(batches):
                loss = model(*batch[0], **batch[1]) if isinstance(batch, tuple) else model(batch)
                loss.backward()
                if i == k // 2:
                    _maybe_die(step)
                with counter.paused():
                    total += model.loss_value(loss)
                del loss
            model.finish_gradients()
            if inspect is not None and not last:
                with counter.paused():
                    inspect(model, step)
            optimizer.step()
            model.after_step()
            optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        losses.append(total / k)
        if last:
            measured = {
                "peak_bytes": meter.peak_bytes,
                "breakdown": {c: meter.breakdown.get(c, 0) for c in CATEGORIES},
                "communication_bytes": counter.total_wire_bytes,
                "communication_by_kind": {kind: counter.wire_bytes_by_kind.get(kind, 0.0) for kind in KINDS},
                "collective_calls": counter.calls_by_kind,
                "cuda_peak_bytes": meter.cuda_peak_bytes,
            }
    return {
        "rank": dist.get_rank(),
        "coordinate": list(device_mesh.get_coordinate() or []),
        "strategy": plan.data["strategy"],
        "losses": losses,
        "step_times_s": times,
        "predicted": predicted(plan),
        "measured": measured,
    }


# -- the worker command ---------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="memshard.runtime.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--plan", help="a plan written by `memshard plan --json` (or `memshard run`)")
    p.add_argument("--model", help="preset name, when no --plan is given")
    p.add_argument("--mesh", help="mesh shape, when no --plan is given")
    p.add_argument("--batch", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--micro-batches", type=int, default=1)
    p.add_argument("--strategy", default="memshard", help="memshard (default) or a baseline name")
    p.add_argument("--objective", choices=("memory", "time"), default="memory")
    p.add_argument("--zero3-unit", choices=("op", "layer"), default="op")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--backend", choices=("gloo", "nccl"), help="default: nccl with CUDA, else gloo")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        plan = runtime_plan(args.plan, args.model, args.mesh, strategy=args.strategy,
                            objective=args.objective, batch=args.batch, seq=args.seq,
                            micro_batches=args.micro_batches, zero3_unit=args.zero3_unit)
        backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
        timeout = float(os.environ.get("MEMSHARD_COLLECTIVE_TIMEOUT_S", "300"))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
        world = dist.get_world_size()
        shape = plan.problem.mesh.shape
        if world != plan.problem.mesh.num_devices:
            raise MemshardError(f"the plan is for {plan.problem.mesh.num_devices} devices, {world} ranks run")
        device = "cuda" if backend == "nccl" else "cpu"
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        mesh = init_device_mesh(device, shape, mesh_dim_names=plan.problem.mesh.axis_names)
        report = train(plan, mesh, steps=args.steps, seed=args.seed, lr=args.lr)
        out = os.environ.get("MEMSHARD_OUT_DIR")
        if out:
            write_text_atomically(os.path.join(out, f"rank{report['rank']}.json"), json.dumps(report))
        elif report["rank"] == 0:
            from rich.console import Console

            from memshard.runtime.report import render_run

            render_run([report], Console())
        dist.destroy_process_group()
        return 0
    except MemshardError as e:
        print(f"memshard: error: {e}", file=sys.stderr)
        return 2
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    sys.exit(main())
