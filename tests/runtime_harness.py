"""Run plans on real gloo ranks (forked on this machine) and on the single-process reference.

``run_plans(plans, steps)`` runs every plan of one mesh shape in one forked world, so the
ranks start once; each rank returns ``train``'s report plus the full gradients of every
parameter at the second step (rank 0 only). ``run_pipelined`` does the same for pipelined
plans (``train_pipelined``'s reports). ``reference(graph, steps)`` is the unsharded
model with ``torch.optim.Adam`` (on fp32 master weights under mixed precision): an independent
optimizer, so the check covers LeanAdam too. (The plans searched for these tests are saved:
``tests/runtime_plans.py``.)

A world in which a rank process dies of a signal (no Python error: glibc's heap check aborting
inside gloo's collectives, rare, seen in a few of the 2-core CI machine's runs)
runs once more, with a warning; a rank's Python error, a second crash or a hang fails at once.
What the tests compare comes only from a world in which every rank finished.
"""

from __future__ import annotations

import datetime
import json
import os
import queue as queue_module
import socket
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from memshard.runtime.executor import GraphModel, make_batch

INSPECT_STEP = 1  # gradients compared at the second step (after one optimizer update)
BATCH = 8
ROUNDING_FLOOR = 1e-3  # of a gradient's size: what fp32 rounding may reach in a sharded run


def assert_gradients_close(grads: dict, single: dict, exact: dict, label) -> None:
    """Each of a sharded run's gradients (``grads``) is as close to the exact (float64) one
    as the single process's (``single``) within a factor of 10, or within the rounding floor.

    The floor is rounding alone, at its worst over the model's parameters, relative to their
    size (those with a gradient at all: a key bias's is zero, up to rounding): a sharded run
    sums its rows in other orders (partials, all-reduced norm statistics), so a parameter the
    single process happened to sum accurately may land anywhere up to it. In fp32, up to
    ROUNDING_FLOOR of the parameter's size: a sum split over ranks and one Adam step after it
    land several times the single run's worst, still a thousandth of what a sharding mistake
    shows."""
    def error(g, name):
        return (g - exact[name]).abs().max().item()

    scales = {n: g.abs().max().item() for n, g in exact.items()}
    noise = max(error(g, n) / scales[n] for n, g in single.items() if scales[n] > 1e-6 * max(scales.values()))
    for name, g in grads.items():
        ours, own, scale = error(g, name), error(single[name], name), scales[name]
        assert ours <= max(10 * own, ROUNDING_FLOOR * scale, noise * scale), (label, name, ours, own, scale, noise)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clear_dtensor_caches() -> None:
    """Forget what DTensor cached in this process: a forked rank inherits its parent's caches,
    filled there by other tests' fake worlds (rank 0 of the same mesh shape), whose shards'
    offsets are not this rank's."""
    from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    clear_redistribute_planner_cache()


def _fresh_rank(rank: int, worker, *args) -> None:
    clear_dtensor_caches()
    worker(rank, *args)


def forked_world(worker, world: int, out_dir) -> list[dict]:
    """Run ``worker(rank, world, port, out_dir)`` on ``world`` forked ranks (one OpenMP thread
    each, DTensor's caches cleared) and return each rank's ``rank<r>.json`` from ``out_dir``.
    Forked ranks start in well under a second (spawned ones re-import torch: ~20 s on 2 cores);
    they inherit this process, which must hold no process group."""
    assert not dist.is_initialized()
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        for attempt in range(2):
            try:
                mp.start_processes(_fresh_rank, args=(worker, world, free_port(), str(out_dir)), nprocs=world, join=True,
                                   start_method="fork")
                break
            except mp.ProcessExitedException as crash:
                if crash.exit_code >= 0 or attempt:
                    raise
                warnings.warn(f"rank {crash.error_index} died of {crash.signal_name}; the world runs once more",
                              RuntimeWarning, stacklevel=2)
    finally:
        if old is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = old
    return [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(world)]


def reference(graph, steps: int, seed: int = 0, lr: float = 1e-3, dtype: torch.dtype | None = None):
    """The single-process run: the graph's model (its weights in ``dtype``, default the graph's
    compute dtype) and ``torch.optim.Adam``; below fp32 (mixed precision) Adam updates fp32
    master copies of the weights from their gradients and the weights are the masters
    rounded. Returns every step's loss and the gradients at ``INSPECT_STEP``."""
    model = GraphModel(graph, seed)
    if dtype is not None:
        model = model.to(dtype)
    weights = list(model.parameters())
    mixed = weights[0].dtype not in (torch.float32, torch.float64)
    masters = [w.detach().float() for w in weights] if mixed else weights
    opt = torch.optim.Adam(masters, lr=lr)
    losses, grads = [], {}
    for step in range(steps):
        model.step = step
        loss = model(make_batch(graph, 1, seed + step)[0])
        loss.backward()
        losses.append(loss.item())
        if step == INSPECT_STEP:
            grads = {n: model.parameter(n).grad.double() for n in graph.parameters}
        if mixed:
            for w, master in zip(weights, masters):
                master.grad, w.grad = w.grad.float(), None
        opt.step()
        opt.zero_grad()
        if mixed:
            with torch.no_grad():
                for w, master in zip(weights, masters):
                    w.copy_(master)
    return losses, grads


def _worker(rank: int, world: int, port: int, plans, steps: int, queue, module_factory=None) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from memshard.runtime.train import train

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
        out = []
        for plan in plans:
            mesh = init_device_mesh("cpu", plan.problem.mesh.shape)
            grads = {}

            def inspect(model, step, grads=grads):
                if step == INSPECT_STEP:
                    for name in model.graph.parameters:
                        grads[name] = model.full_gradient(name).double().numpy().copy()

            module = module_factory() if module_factory is not None else None
            report = train(plan, mesh, steps=steps, inspect=inspect, module=module)
            report["gradients"] = grads if rank == 0 else {}
            out.append(report)
        queue.put((rank, out, None))
        dist.destroy_process_group()
    except Exception:
        queue.put((rank, None, traceback.format_exc()))


class RankCrashed(RuntimeError):
    """A rank process died of a signal (a native crash), not of a Python error."""


def run_plans(plans, steps: int = 3, module_factory=None) -> list[list[dict]]:
    """Per plan, the reports of every rank (rank order). All plans share one mesh size.
    Plans of a traced module run ``module_factory()`` (default: the HF model they name).
    A world whose rank crashed runs once more (module docstring)."""
    try:
        return _world(plans, steps, module_factory)
    except RankCrashed as crash:
        warnings.warn(f"{crash}; the world runs once more", RuntimeWarning, stacklevel=2)
        return _world(plans, steps, module_factory)


def _world(plans, steps: int, module_factory) -> list[list[dict]]:
    world = plans[0].problem.mesh.num_devices
    assert all(p.problem.mesh.num_devices == world for p in plans)
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_fresh_rank, args=(r, _worker, world, port, plans, steps, queue, module_factory))
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, list] = {}
    deadline = time.monotonic() + 600
    try:
        while len(results) < world:
            try:
                rank, out, err = queue.get(timeout=1)
            except queue_module.Empty:
                if any(p.exitcode is not None and p.exitcode < 0 for p in procs):
                    raise _failure(procs, "") from None
                if time.monotonic() > deadline:
                    raise RuntimeError("the ranks did not report within 600 s") from None
                continue
            if err:
                raise _failure(procs, f"rank {rank} failed:\n{err}")
            results[rank] = out
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [[results[r][i] for r in range(world)] for i in range(len(plans))]


def _failure(procs, message: str) -> RuntimeError:
    """A rank's error: :class:`RankCrashed` if some rank process died of a signal (its peers
    then fail with a gloo connection error), else a plain error."""
    for p in procs:
        p.join(timeout=30)
    crashed = [r for r, p in enumerate(procs) if p.exitcode is not None and p.exitcode < 0]
    if crashed:
        return RankCrashed(f"rank {crashed[0]} died of signal {-procs[crashed[0]].exitcode}")
    return RuntimeError(message)


def _pipelined_rank(rank: int, world: int, port: int, out: str, plans: dict, steps: int) -> None:
    """One rank of every pipelined plan in ``plans`` (one world size), in turn: each report to
    ``out/rank<r>.json``, by case."""
    from torch.distributed.device_mesh import init_device_mesh

    from memshard.runtime.pipelined import train_pipelined

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    reports = {}
    for case, plan in plans.items():
        mesh = init_device_mesh("cpu", plan.mesh.shape, mesh_dim_names=plan.mesh.axis_names)
        reports[case] = train_pipelined(plan, mesh, steps=steps)
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(reports, f)
    dist.destroy_process_group()


def run_pipelined(plans: dict, steps: int, out_dir) -> dict[str, list[dict]]:
    """Every named pipelined plan's reports (rank order), ``steps`` steps each: one forked world
    per world size (the plans made before the fork: the ranks inherit them)."""
    by_world: dict[int, dict] = {}
    for case, plan in plans.items():
        by_world.setdefault(plan.mesh.num_devices, {})[case] = plan
    out: dict[str, list[dict]] = {}
    for world, cases in sorted(by_world.items()):
        folder = Path(out_dir) / f"world{world}"
        folder.mkdir(parents=True, exist_ok=True)
        ranks = forked_world(lambda r, w, p, o, cases=cases: _pipelined_rank(r, w, p, o, cases, steps), world, folder)
        out.update({c: [r[c] for r in ranks] for c in cases})
    return out


def run_cases(plans: dict, steps: int = 3) -> dict[str, list[dict]]:
    """``run_plans`` for named plans of any mesh sizes: one forked world per size."""
    by_world: dict[int, list[str]] = {}
    for case, plan in plans.items():
        by_world.setdefault(plan.problem.mesh.num_devices, []).append(case)
    out = {}
    for cases in by_world.values():
        out.update(zip(cases, run_plans([plans[c] for c in cases], steps)))
    return out
