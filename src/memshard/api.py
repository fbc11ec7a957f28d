"""The Python API: ``memshard.plan(model, mesh, ...) -> Plan``."""

from __future__ import annotations

from memshard.coarsen import merge_groups, merged_mesh, solve_merged
from memshard.errors import MemshardError
from memshard.graph import Graph
from memshard.ilp.highs import Infeasible
from memshard.ilp.solve import solve
from memshard.job import HFModel, Job, TracedModule, is_module
from memshard.mesh import Mesh, parse_mesh
from memshard.models import ModelConfig
from memshard.plans import Plan, build_plan
from memshard.problem import build_problem
from memshard.units import format_bytes, format_seconds, parse_bytes


def plan(
    model: str | ModelConfig | Graph | HFModel,
    mesh: str | Mesh = "2x4",
    *,
    example_inputs=None,
    objective: str = "memory",
    batch: int | None = None,
    seq: int | None = None,
    micro_batches: int = 1,
    max_step_time_s: float | None = None,
    memory_budget: int | str | None = None,
    exact: bool = False,
    full_mesh: bool = False,
    time_limit_s: float = 60.0,
    mip_gap: float = 2e-3,
    start: Plan | None = None,
    zero3_unit: str = "op",
    **model_overrides,
) -> Plan:
    """Find the plan with the least per-device peak memory (``objective="memory"``, optionally
    under ``max_step_time_s``) or the fastest plan under ``memory_budget`` (``"time"``).

    ``model`` is a preset name (see ``memshard models``), a :class:`ModelConfig`, a graph, an
    :class:`HFModel`, or an ``nn.Module`` with ``example_inputs`` (a tuple of positional
    arguments, a dict of keyword arguments, or one tensor: one micro-batch) that returns its
    loss; ``batch`` is the global batch in sequences (default: one per device), run as
    ``micro_batches`` accumulated micro-batches of ``batch / micro_batches``. On meshes of three
    or more axes, adjacent axes with identical links are planned as one (see ``coarsen.py``)
    unless ``full_mesh``. ``start``: a plan of the same job the solver starts from (e.g. the
    memory-optimal plan when asking for the fastest one under a budget it meets; where axes
    are planned as one, used if it treats them alike). ``zero3_unit``: ZeRO-3 weights
    gathered per op (``"op"``, least memory) or per layer (``"layer"``, FSDP's unit: fewer,
    larger collectives).
    """
    mesh = parse_mesh(mesh) if isinstance(mesh, str) else mesh
    if isinstance(memory_budget, str):
        memory_budget = parse_bytes(memory_budget)
    if memory_budget is not None and memory_budget <= 0:
        raise MemshardError("the memory budget must be positive")
    if max_step_time_s is not None and max_step_time_s <= 0:
        raise MemshardError("the step-time budget must be positive")
    if time_limit_s <= 0:
        raise MemshardError("the solver time limit must be positive")
    if not 0 <= mip_gap < 1:
        raise MemshardError(f"the optimality gap must be in [0, 1), got {mip_gap}")
    if micro_batches < 1:
        raise MemshardError("the number of micro-batches must be positive")
    job = make_job(model, mesh, example_inputs, batch, seq, micro_batches, model_overrides)
    graph = job.graph
    problem = build_problem(graph, mesh, shared_layers=not exact, micro_batches=micro_batches,
                            zero3_unit=zero3_unit)
    constraints = {"max_step_time_s": max_step_time_s, "memory_budget_bytes": memory_budget}
    groups = merge_groups(mesh)
    searched = problem
    if mesh.ndim >= 3 and len(groups) < mesh.ndim and not full_mesh:
        searched = build_problem(graph, merged_mesh(mesh, groups), shared_layers=not exact,
                                 micro_batches=micro_batches, zero3_unit=zero3_unit)
    initial = None
    if start is not None:
        if len(start.selection.choices) != len(problem.groups):
            raise MemshardError("the start plan is of another job")
        initial = start.selection
    try:
        if searched is problem:
            result = solve(problem, objective, max_step_time_s=max_step_time_s, memory_budget_bytes=memory_budget,
                           time_limit_s=time_limit_s, mip_gap=mip_gap, start=initial)
        else:
            result = solve_merged(problem, searched, groups, objective, max_step_time_s=max_step_time_s,
                                  memory_budget_bytes=memory_budget, time_limit_s=time_limit_s, mip_gap=mip_gap,
                                  start=initial)
    except Infeasible:
        raise _explain_infeasible(searched, objective, max_step_time_s, memory_budget, time_limit_s) from None
    return build_plan(problem, result, job=job, constraints=constraints)


def make_job(model, mesh, example_inputs, batch, seq, micro_batches: int, overrides: dict) -> Job:
    """The job ``plan``'s arguments describe."""
    overrides = dict(overrides)
    precision = overrides.pop("precision", None)
    if is_module(model):
        model = TracedModule(model, example_inputs)
    elif example_inputs is not None:
        raise MemshardError("example inputs are for planning an nn.Module")
    return Job(model, mesh, batch=batch, seq=seq, micro_batches=micro_batches, overrides=overrides,
               precision=precision)


def _explain_infeasible(problem, objective, max_step_time_s, memory_budget, time_limit_s) -> MemshardError:
    """Say what the least achievable figure is, so the user knows what to ask for."""
    if objective == "time":
        budget = memory_budget if memory_budget is not None else problem.mesh.device_memory_bytes
        best = build_plan(problem, solve(problem, "memory", time_limit_s=time_limit_s))
        return MemshardError(
            f"no plan fits in {format_bytes(budget)} per device: the least any plan needs is "
            f"{format_bytes(best.peak_bytes)} (zero-redundancy bound {format_bytes(best.lower_bound_bytes)})"
        )
    fastest = build_plan(problem, solve(problem, "time", memory_budget_bytes=float("inf"), time_limit_s=time_limit_s))
    return MemshardError(
        f"no plan runs a step within {format_seconds(max_step_time_s)}: the fastest plan takes "
        f"{format_seconds(fastest.step_time_s)}"
    )


def compare(
    model: str | ModelConfig | Graph,
    mesh: str | Mesh = "2x4",
    *,
    batch: int | None = None,
    seq: int | None = None,
    micro_batches: int = 1,
    time_slack: float = 1.1,
    time_limit_s: float = 60.0,
    mip_gap: float = 2e-3,
    **model_overrides,
) -> dict:
    """memshard's plans against the hand-made strategies (``baselines.py``), all priced by the
    same model: memshard's least-memory plan, memshard's least-memory plan within
    ``time_slack`` × the fastest baseline's step time, then every baseline by peak memory."""
    from memshard.baselines import baselines

    best = plan(model, mesh, batch=batch, seq=seq, micro_batches=micro_batches,
                time_limit_s=time_limit_s, mip_gap=mip_gap, **model_overrides)
    problem = best.problem
    fixed, skipped = baselines(problem)
    base_plans = [build_plan(b.problem, None, b.selection, job=best.job, strategy_name=b.name)
                  for b in fixed]
    rows = [best]
    if base_plans:
        budget = min(p.step_time_s for p in base_plans) * time_slack
        timed = plan(model, problem.mesh, batch=batch, seq=seq, micro_batches=micro_batches,
                     max_step_time_s=budget, time_limit_s=time_limit_s, mip_gap=mip_gap, **model_overrides)
        timed.data["strategy"] = f"memshard ≤{time_slack:g}× fastest"
        rows.append(timed)
    rows += sorted(base_plans, key=lambda p: (p.peak_bytes, p.step_time_s))
    return {
        "schema": "memshard.compare/1",
        "model": best.data["model"],
        "mesh": best.data["mesh"],
        "rows": [_compare_row(p, best) for p in rows],
        "skipped": [{"strategy": n, "reason": r} for n, r in skipped],
    }


def _compare_row(p: Plan, best: Plan) -> dict:
    return {
        "strategy": p.data["strategy"],
        "peak_bytes_per_device": p.peak_bytes,
        "breakdown": p.data["memory"]["breakdown"],
        "redundant_bytes_per_device": p.redundant_bytes,
        "communication_bytes_per_step_per_device": p.data["communication"]["bytes_per_step_per_device"],
        "estimated_step_time_s": p.step_time_s,
        "memshard_saving": 1 - best.peak_bytes / p.peak_bytes if p.peak_bytes else 0.0,
        "fits": p.data["memory"]["fits"],
    }


def strategy_plan(
    model: str | ModelConfig,
    mesh: str | Mesh,
    strategy: str,
    *,
    batch: int | None = None,
    seq: int | None = None,
    micro_batches: int = 1,
    zero3_unit: str = "op",
    **model_overrides,
) -> Plan:
    """The fixed plan of a named baseline (``ddp``, ``zero3-fsdp``, ``megatron-tp4-sp``…;
    ``memshard compare`` lists them), priced like memshard's own."""
    from memshard.baselines import baselines

    mesh = parse_mesh(mesh) if isinstance(mesh, str) else mesh
    job = make_job(model, mesh, None, batch, seq, micro_batches, model_overrides)
    graph = job.graph
    fixed, skipped = baselines(build_problem(graph, job.mesh, micro_batches=micro_batches, zero3_unit=zero3_unit))
    for b in fixed:
        if b.name == strategy:
            return build_plan(b.problem, None, b.selection, job=job, strategy_name=b.name)
    reason = dict(skipped).get(strategy)
    if reason:
        raise MemshardError(f"strategy {strategy} does not fit {graph.name} on {mesh}: {reason}")
    known = ", ".join(["memshard", *(b.name for b in fixed)])
    raise MemshardError(f"unknown strategy {strategy!r} for this mesh; known: {known}")


def runtime_plan(
    plan_path: str | None = None,
    model: str | None = None,
    mesh: str | None = None,
    *,
    strategy: str = "memshard",
    objective: str = "memory",
    batch: int | None = None,
    seq: int | None = None,
    micro_batches: int = 1,
    precision: str | None = None,
    zero3_unit: str = "op",
) -> Plan:
    """The plan ``memshard run``, ``simulate`` and the torchrun worker execute: a saved plan,
    memshard's plan or a named baseline; fp32, the precision the runtime computes in."""
    from memshard.plans import load_plan

    if plan_path:
        result = load_plan(plan_path)
    elif not (model and mesh):
        raise MemshardError("give --plan, or a model (--model, --hf-config or --hf-model) and --mesh")
    elif strategy == "memshard":
        result = plan(model, mesh, objective=objective, batch=batch, seq=seq, micro_batches=micro_batches,
                      mip_gap=0.02, precision=precision or "fp32", zero3_unit=zero3_unit)
    else:
        result = strategy_plan(model, mesh, strategy, batch=batch, seq=seq, micro_batches=micro_batches,
                               precision=precision or "fp32", zero3_unit=zero3_unit)
    if result.problem.graph.precision.name != "fp32":
        raise MemshardError("the runtime executes fp32 plans; plan with --precision fp32")
    return result
