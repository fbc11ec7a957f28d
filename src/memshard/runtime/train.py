"""One rank of a training run under a plan, measured against the plan's predictions.

:func:`train` runs ``steps`` optimizer steps of a :class:`ShardedGraphModel` (``LeanAdam``, each
step ``micro_batches`` forward/backward passes, gradient sync on for the last one: the standard
loop of ``loop.py``) and measures the last step, when the optimizer
states exist as the memory model assumes: peak memory by category (``MemoryMeter``), bytes
sent per collective kind (``CommCounter``), and the step time. The same code runs under
``memshard run`` (which starts the ranks itself) and under an external ``torchrun``::

    torchrun --nproc-per-node 8 -m memshard.runtime.train --plan plan.json

Every rank writes its report to ``$MEMSHARD_OUT_DIR/rank<r>.json`` when that is set (the
launcher reads them), or prints rank 0's comparison table. A pipelined plan's ranks run
:func:`memshard.runtime.pipelined.train_pipelined` (same command, same report).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import time
import traceback
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from memshard.core.errors import MemshardError
from memshard.core.files import write_text_atomically
from memshard.plans.pipelined import PipelinedPlan, load_any_plan
from memshard.plans.plan import runnable
from memshard.runtime.launch import KILL_ENV, die_if_asked
from memshard.runtime.measure import CommCounter, MemoryMeter
from memshard.runtime.optim import LeanAdam
from memshard.runtime.parallel import sharded_model
from memshard.runtime.pipelined import train_pipelined
from memshard.runtime.report import measured_figures, predicted_figures

__all__ = ["KILL_ENV", "main", "train"]


def train(plan, device_mesh, steps: int = 2, seed: int = 0, lr: float = 1e-3, inspect=None, module=None) -> dict:
    """Run ``steps`` steps on this rank; measure the last one. Returns this rank's report.

    A plan of a traced module runs that ``module`` (default: the Hugging Face model the plan
    names, built with seed ``seed``) on random arguments of the traced shapes.

    ``inspect(model, step)``, if given, runs after each step's gradients are reduced and
    before the optimizer uses them, outside the measured region (tests read gradients)."""
    if steps < 2:
        raise MemshardError("run at least 2 steps: the last one is measured with optimizer states in place")
    plan = runnable(plan)  # (a Megatron-LM layout: re-priced for this runtime)
    model, make_inputs = sharded_model(plan, device_mesh, seed, module)
    del module  # the shards are the model now
    optimizer = LeanAdam(model.parameters(), lr=lr)
    model.replicate_loss = False  # the loss is summed outside the measured step (``loss_value``)
    losses, times = [], []
    for step in range(steps):
        last = step == steps - 1
        meter = MemoryMeter(model, optimizer)
        counter = CommCounter()
        # The global batch, drawn alike on every rank (the same numbers as a one-process run)
        # and cut to this rank's share, stands for the data loader's read: outside the
        # measured step, which counts the share the model keeps (``ShardedGraphModel.load``).
        batches = [((model.shares(*args, **kwargs),), {}) for args, kwargs in
                   make_inputs(plan.problem.graph, plan.problem.micro_batches, seed + step, model.device)]
        start = time.perf_counter()
        with meter if last else nullcontext(), counter if last else nullcontext():
            model.step = step
            model.watch_gradients(meter.mark_gradient if last else None)
            losses.append(_forward_backward(model, batches, counter, step) / len(batches))
            if inspect is not None and not last:
                with counter.paused():
                    inspect(model, step)
            optimizer.step()  # (its step hook gathers the updated ZeRO-1/2 shards)
            optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return {
        "rank": dist.get_rank(),
        "coordinate": list(device_mesh.get_coordinate() or []),
        "strategy": plan.strategy,
        "losses": losses,
        "step_times_s": times,
        "predicted": predicted_figures(plan),
        "measured": measured_figures(meter, counter),
    }


def _forward_backward(model, batches: list[tuple[tuple, dict]], counter: CommCounter, step: int) -> float:
    """Every micro-batch's forward and backward; the sum of their losses. Only the last
    backward reduces the gradients of ZeRO stages 0 and 1 (when it ends)."""
    total = 0.0
    for i, (args, kwargs) in enumerate(batches):
        model.set_requires_gradient_sync(i == len(batches) - 1)
        loss = model(*args, **kwargs)
        loss.backward()
        if i == len(batches) // 2:
            die_if_asked(dist.get_rank(), step)
        with counter.paused():
            total += model.loss_value(loss)
        del loss
    return total


# -- the worker command ---------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="memshard.runtime.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--plan", required=True,
                   help="a plan written by `memshard plan --json` (or `memshard run`)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--backend", choices=("gloo", "nccl"), help="default: nccl with CUDA, else gloo")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        plan = load_any_plan(args.plan)
        if not isinstance(plan, PipelinedPlan):
            plan = runnable(plan)
        mesh_spec = plan.mesh if isinstance(plan, PipelinedPlan) else plan.problem.mesh
        mesh = _world_mesh(mesh_spec, args.backend)
        run = train_pipelined if isinstance(plan, PipelinedPlan) else train
        report = run(plan, mesh, steps=args.steps, seed=args.seed, lr=args.lr)
        out = os.environ.get("MEMSHARD_OUT_DIR")
        if out:
            write_text_atomically(os.path.join(out, f"rank{report['rank']}.json"), json.dumps(report))
        elif report["rank"] == 0:
            from rich.console import Console

            from memshard.runtime.report import render_run

            render_run([report], Console())
        # nothing holds the process group now but the registry: it is destroyed here, its
        # gloo threads joined, not at interpreter exit (where they abort the process)
        del mesh
        gc.collect()
        dist.destroy_process_group()
        return 0
    except MemshardError as e:
        print(f"memshard: error: {e}", file=sys.stderr)
        return 2
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def _world_mesh(spec, backend: str | None):
    """The process group (``backend``; default nccl with CUDA, else gloo) and the DeviceMesh of
    mesh ``spec`` over it, checked against the ranks started."""
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    timeout = float(os.environ.get("MEMSHARD_COLLECTIVE_TIMEOUT_S", "300"))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    world = dist.get_world_size()
    if world != spec.num_devices:
        raise MemshardError(f"the plan is for {spec.num_devices} devices, {world} ranks run")
    device = "cuda" if backend == "nccl" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return init_device_mesh(device, spec.shape, mesh_dim_names=spec.axis_names)


if __name__ == "__main__":
    sys.exit(main())
