"""The Python API: ``memshard.plan(model, mesh, ...) -> Plan``, ``compare``, ``strategy_plan``.

Each function turns its arguments into a :class:`~memshard.job.Job` and
:class:`~memshard.planner.SearchOptions` and hands them to the planner; the CLI calls the same
functions with the same names.
"""

from __future__ import annotations

from dataclasses import fields, replace

from memshard.baselines.names import Kind, StrategyName, parse_strategy
from memshard.baselines.recipes import baselines
from memshard.core.errors import MemshardError
from memshard.core.graph import Graph
from memshard.core.hardware import Hardware
from memshard.core.mesh import Mesh
from memshard.core.quantities import check_factor
from memshard.fitting import FitResult, fit_job
from memshard.job import HFModel, Job, TracedModule, as_mesh, is_module, mesh_to_dict
from memshard.models import ModelConfig
from memshard.pipelining import (
    PipelineOptions,
    pipelined_baseline,
    pipelined_baselines,
    plan_pipelined,
    plan_with_pipeline,
)
from memshard.planner import (
    SearchOptions,
    baseline_plans,
    baseline_problem,
    plan_job,
    searched_problem,
)
from memshard.plans.export import check_exportable, export_target, render
from memshard.plans.pipelined import PipelinedPlan
from memshard.plans.plan import Plan, build_plan, runnable
from memshard.problem.pricing import build_problem

Model = str | ModelConfig | Graph | HFModel
SEARCH_FIELDS = frozenset(f.name for f in fields(SearchOptions))


def make_job(model, mesh: str | Mesh, *, example_inputs=None, batch: int | None = None, seq: int | None = None,
             micro_batches: int = 1, gpu: str | Hardware | None = None, **overrides) -> Job:
    """The job the API's arguments describe (``overrides``: model knobs and ``precision``;
    ``gpu``: a preset's name, ``memshard.PRESETS``, or a ``Hardware`` record)."""
    precision = overrides.pop("precision", None)
    mesh = as_mesh(mesh, gpu)
    if is_module(model):
        model = TracedModule(model, example_inputs)
    elif example_inputs is not None:
        raise MemshardError("example inputs are for planning an nn.Module")
    return Job(model, mesh, batch=batch, seq=seq, micro_batches=micro_batches, overrides=overrides,
               precision=precision)


def plan(
    model: Model,
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
    mip_gap: float | None = None,
    start: Plan | None = None,
    zero3_unit: str | None = None,
    top: int = 10,
    recompute: str = "none",
    mesh_views: bool | None = None,
    pipeline: int | str | None = None,
    schedule: str | None = None,
    stage_layers: str | tuple[int, ...] | None = None,
    virtual_stages: int | None = None,
    **model_overrides,
) -> Plan | PipelinedPlan:
    """Find the plan with the least per-device peak memory (``objective="memory"``, optionally
    under ``max_step_time_s``) or the fastest plan under ``memory_budget`` (``"time"``).

    ``model`` is a preset name (see ``memshard models``), a :class:`ModelConfig`, a graph, an
    :class:`HFModel`, or an ``nn.Module`` with ``example_inputs`` (a tuple of positional
    arguments, a dict of keyword arguments, or one tensor: one micro-batch) that returns its
    loss; ``batch`` is the global batch in sequences (default: one per device), run as
    ``micro_batches`` accumulated micro-batches of ``batch / micro_batches``; model knobs
    (``num_layers``, ``hidden``, ``heads``, ``kv_heads``, ``ffn``, ``vocab``, ``dropout``) and
    ``precision`` (``mixed`` or ``fp32``) as keywords: ``hidden`` resizes the model as
    :func:`fit` grows it (the head size, the heads per key/value head and the MLP's ratio to
    the hidden size kept), ``heads``, ``kv_heads`` or ``ffn`` given too win. On meshes of three or more axes,
    adjacent axes with identical links are planned as one (see ``search/coarsen.py``) unless
    ``full_mesh``. ``start``: a plan of the same job the solver starts from (e.g. the
    memory-optimal plan when asking for the fastest one under a budget it meets; where axes
    are planned as one, used if it treats them alike). ``zero3_unit``: ZeRO-3 weights
    gathered per op (``"op"``, least memory) or per layer (``"layer"``, FSDP's unit: fewer,
    larger collectives); None: per op, and for the least memory with recomputation both,
    the leaner plan kept (``SearchOptions.zero3_units``). ``top``: how many of the most
    redundant ops the plan lists, each with what sharding it further would cost.
    ``recompute``: activation recomputation — ``"none"``, ``"selective"`` (Megatron-LM's core
    attention), ``"full"`` (each layer keeps its input only) or ``"auto"`` (the search decides
    per op role; see ``recompute.py``). ``mip_gap``: the relative optimality gap the search
    stops at (None: 0.2%, and 3% for the least memory with recomputation, whose bound is the
    peak's LP relaxation; ``SearchOptions.gap``); ``time_limit_s``: where it stops anyway.
    ``mesh_views``: whether the other ways the devices form mesh axes are searched too (a node
    of 8 as 2 × 4; ``core.mesh.mesh_views``); None: for the fastest plan (objective time)
    only. The plan lies on the best view (``Plan.job.mesh``). ``pipeline``: that many
    pipeline stages along the outermost mesh axis, run by ``schedule`` (``1f1b``, the default,
    ``gpipe``, or with ``virtual_stages`` stages per rank ``interleaved-1f1b``,
    ``interleaved-zb`` or ``zbv``; docs/pipelining.md): a :class:`PipelinedPlan`, each stage searched for the
    objective; ``"auto"``: the best of no pipeline and every number of stages. ``stage_layers``:
    how the layers split into stages, ``"even"`` (the default), ``"balanced"`` (a local search
    over splits for the objective) or a count per stage.
    """
    options = SearchOptions(objective, max_step_time_s, memory_budget, exact, full_mesh, zero3_unit, time_limit_s,
                            mip_gap, top, recompute, mesh_views=mesh_views)
    job = make_job(model, mesh, example_inputs=example_inputs, batch=batch, seq=seq, micro_batches=micro_batches,
                   **model_overrides)
    return plan_with_pipeline(job, options, pipeline, schedule, start, stage_layers, virtual_stages)


def job_and_options(model: Model | Job, mesh: str | Mesh, arguments: dict) -> tuple[Job, SearchOptions]:
    """Split keyword ``arguments`` into the job's (batch, seq, knobs, precision…) and the
    search's (``SearchOptions``' fields), for ``model`` on ``mesh`` or a :class:`Job`."""
    search = {k: arguments.pop(k) for k in list(arguments) if k in SEARCH_FIELDS}
    if isinstance(model, Job):
        if arguments:
            raise MemshardError(f"a Job fixes the job: give no {', '.join(arguments)}")
        return model, SearchOptions(**search)
    return make_job(model, mesh, **arguments), SearchOptions(**search)


def compare(model: Model | Job, mesh: str | Mesh = "2x4", *, time_slack: float | None = None,
            pipeline: int | None = None, **arguments) -> dict:
    """memshard's plans against the hand-made strategies (``baselines/recipes.py``), all priced by the
    same model: memshard's least-memory plan, memshard's least-memory plan within
    ``time_slack`` (None: 1.1) × the fastest baseline's step time, then every baseline by peak memory.
    ``model`` and the keyword ``arguments`` are what :func:`plan` takes (or a :class:`Job`);
    the objective is memory's, so no objective or budget may be given. With ``pipeline``
    stages (1F1B): memshard's pipelined plans of the least memory and the fastest within the
    device memory, then every pipelined Megatron-LM configuration of that degree the stage
    mesh lays out (``pipelining.pipelined_baselines``), by peak memory."""
    if pipeline is not None and time_slack is not None:
        raise MemshardError("compare with a pipeline lists memshard's least-memory and fastest pipelined plans: give "
                            "no time slack")
    time_slack = 1.1 if time_slack is None else time_slack
    check_factor(time_slack, "the time slack")
    given = sorted(set(arguments) & {"objective", "max_step_time_s", "memory_budget", "start"})
    if given:
        raise MemshardError(f"compare plans for the least memory and within the time slack: give no {', '.join(given)}")
    job, options = job_and_options(model, mesh, arguments)
    if pipeline is not None:
        return _compare_pipelined(job, options, PipelineOptions(pipeline))
    problem = searched_problem(job, options)
    best = plan_job(job, options, problem=problem)
    base_plans, skipped = baseline_plans(job, baseline_problem(job, options, best))
    rows, missing = [best], []
    if base_plans:
        budget = min(p.step_time_s for p in base_plans) * time_slack
        within = StrategyName(Kind.MEMSHARD, time_slack=time_slack)  # memshard ≤1.1× fastest
        try:
            timed = plan_job(job, replace(options, max_step_time_s=budget), problem=problem)
            rows.append(replace(timed, strategy=str(within)))
        except MemshardError as e:  # no memshard plan is that fast: say so, show the rest
            missing.append(f"{within}: none, {e}")
    rows += sorted(base_plans, key=lambda p: (p.peak_bytes, p.step_time_s))
    summary = best.to_dict()
    return {
        "schema": "memshard.compare/1",
        "model": summary["model"],
        "mesh": summary["mesh"],
        "rows": [_compare_row(p, best) for p in rows],
        "skipped": [{"strategy": n, "reason": r} for n, r in skipped],
        "notes": missing + _compare_notes(job, rows),
    }


def _compare_notes(job: Job, rows: list[Plan]) -> list[str]:
    """What a row's name alone would not say."""
    ddp = any(parse_strategy(p.strategy).kind is Kind.DDP for p in rows)
    if job.graph.precision.name == "mixed" and ddp:
        return ["ddp rows: memshard's bf16 layout (bf16 weights and gradients, fp32 masters); DDP as its users "
                "train in bf16, under torch.autocast, is --precision autocast (traced models)"]
    return []


def _compare_row(p: Plan | PipelinedPlan, best: Plan | PipelinedPlan) -> dict:
    """A row of ``compare``; of a pipelined plan, its figures but the step those of the stage
    whose ranks hold the most."""
    figures = p.peak_stage.plan if isinstance(p, PipelinedPlan) else p
    return {
        "strategy": p.strategy,
        "peak_bytes_per_device": p.peak_bytes,
        "breakdown": dict(figures.memory.breakdown),
        "redundant_bytes_per_device": figures.redundant_bytes,
        "communication_bytes_per_step_per_device": figures.communication.bytes_per_step,
        "estimated_step_time_s": p.step_time_s,
        "memshard_saving": 1 - best.peak_bytes / p.peak_bytes if p.peak_bytes else 0.0,
        "fits": p.fits if isinstance(p, PipelinedPlan) else p.memory.fits,
    }


def _compare_pipelined(job: Job, options: SearchOptions, pipeline: PipelineOptions) -> dict:
    """``compare`` with ``pipeline``: memshard's pipelined plans (the least memory, the fastest
    within the device memory), then the pipelined Megatron-LM configurations of that degree."""
    best = plan_pipelined(job, options, pipeline)
    rows: list[PipelinedPlan] = [best]
    missing = []
    fastest_name = str(StrategyName(Kind.MEMSHARD, fastest=True))
    try:
        fastest = plan_pipelined(job, replace(options, objective="time"), pipeline)
        rows.append(replace(fastest, strategy=fastest_name))
    except MemshardError as e:  # some stage has no plan within the device memory
        missing.append(f"{fastest_name}: none, {e}")
    found, skipped = pipelined_baselines(job, pipeline.stages, zero3_unit=options.priced_unit,
                                         recompute=options.recompute, exact=options.exact)
    rows += sorted(found, key=lambda p: (p.peak_bytes, p.step_time_s))
    graph = job.graph
    return {
        "schema": "memshard.compare/1",
        "model": {"name": graph.name, "num_parameters": graph.num_parameters, "num_layers": graph.num_layers,
                  "precision": graph.precision.name, **job.to_dict()["model"]},
        "mesh": mesh_to_dict(job.mesh),
        "pipeline": {"stages": pipeline.stages, "schedule": pipeline.schedule, "micro_batches": job.micro_batches,
                     "stage_mesh": mesh_to_dict(best.stage_mesh)},
        "rows": [_compare_row(p, best) for p in rows],
        "skipped": [{"strategy": n, "reason": r} for n, r in skipped],
        "notes": missing,
    }


def strategy_plan(model: Model | Job, mesh: str | Mesh | None = None, strategy: str | None = None, *,
                  zero3_unit: str = "op", recompute: str = "none", **job_arguments) -> Plan | PipelinedPlan:
    """The fixed plan of a named baseline (``dp``, ``ddp``, ``zero3-fsdp``, ``fsdp2``, ``megatron-tp4-sp``…;
    ``memshard compare`` lists them) of ``model`` on ``mesh`` (keywords as :func:`plan`'s) or
    of a :class:`Job`, priced like memshard's own. With ``recompute`` other than ``none``
    the baselines recompute too: that policy, or (``auto``) each with no, selective and full
    recomputation (``megatron-tp4-sp+full``…; FSDP2 and DDP also with torchtitan's per-op
    policy, ``fsdp2+selective-op``), or with some of its layers recomputed as its recipe picks
    them (``megatron-tp4-sp+full-block12``: the first 12, Megatron-LM's block method;
    ``fsdp2+full-every2``: every second, torchtitan's). A pipelined Megatron-LM name
    (``megatron-tp2-pp2-dp2``: 2 stages along the outermost mesh axis, each running
    ``megatron-tp2-dp2``) gives a :class:`PipelinedPlan` priced stage by stage
    (``pipelining.pipelined_baseline``)."""
    job, _ = job_and_options(model, mesh, job_arguments)
    if _pipelined(strategy):
        return pipelined_baseline(job, strategy, zero3_unit, recompute)
    problem = build_problem(job.graph, job.mesh, micro_batches=job.micro_batches, zero3_unit=zero3_unit,
                            recompute=recompute)
    fixed, skipped = baselines(problem, lambda name: name == strategy)
    if fixed:
        return build_plan(fixed[0].problem, fixed[0].selection, job, strategy=strategy, advice=False)
    reason = dict(skipped).get(strategy)
    if reason:
        raise MemshardError(f"strategy {strategy} does not fit {job.graph.name} on {job.mesh}: {reason}")
    known = ", ".join(["memshard", *(b.name for b in baselines(problem)[0])])
    try:
        recomputes = parse_strategy(strategy).recompute != "none"
    except MemshardError:  # not a name memshard writes: unknown, as below
        recomputes = False
    hint = ""
    if recomputes and recompute != "auto":  # the recomputing names are built under auto
        hint = " (every recomputing baseline is named with recompute auto: --recompute auto)"
    raise MemshardError(f"unknown strategy {strategy!r} for this mesh{hint}; known: {known}")


def _pipelined(strategy: str | None) -> bool:
    """Whether ``strategy`` names a pipelined baseline (a text that is no name is not)."""
    try:
        return parse_strategy(strategy).pipeline_parallel > 1
    except MemshardError:
        return False


def export(model: Model | Job, mesh: str | Mesh = "2x4", strategy: str = "memshard", **job_arguments) -> str:
    """A baseline written for the framework it is named after (``plans/export.py``): ``fsdp2``,
    ``ddp`` and ``torch-tp…`` as a Python function ``parallelize(model, mesh)`` that applies
    PyTorch's ``fully_shard``, ``DistributedDataParallel`` or ``parallelize_module`` ×
    ``fully_shard`` as the baseline is priced, ``megatron-…`` as
    Megatron-LM's arguments for a built-in preset; a header gives the job, the predicted peak
    per device and the command that writes it. ``model`` and the keywords are what
    :func:`strategy_plan` takes; the precision defaults to what the exported code runs (fp32,
    PyTorch's default, for PyTorch's; the model's own for Megatron-LM). memshard's
    own plans and the idealised baselines raise :class:`MemshardError`, pointing to
    ``memshard.parallelize``."""
    target = export_target(strategy)
    search = sorted(set(job_arguments) & SEARCH_FIELDS)
    if search:
        raise MemshardError(f"export writes a baseline as it is named, without a search: give no {', '.join(search)}")
    job, _ = job_and_options(model, mesh, job_arguments)
    if job.precision is None and target.precision and not isinstance(job.model, (Graph, TracedModule)):
        job = replace(job, precision=target.precision)
    check_exportable(target, job)
    return render(target, strategy_plan(job, strategy=strategy, recompute=target.policy))


def fit(model: Model | Job, mesh: str | Mesh = "2x4", *, knob: str = "batch", step: int | None = None,
        baselines: bool = True, max_slowdown: float | None = None, pipeline: int | None = None,
        **arguments) -> FitResult:
    """The largest value of ``knob`` (``"batch"``, ``"seq"``, ``"layers"``, ``"hidden"``) whose
    peak fits the mesh's device memory, for memshard and (``baselines``) every baseline, each
    with its plan and the proof about the next value (``fitting.py``). ``model`` and the keyword
    ``arguments`` are what :func:`plan` takes (the job at its own value is where the search
    starts); ``max_step_time_s`` bounds every strategy's step, or ``max_slowdown`` to that many
    times memshard's fastest plan that fits at each value; the objective is least memory.
    ``pipeline``: that many 1F1B stages, memshard's and pipelined Megatron-LM's."""
    job, options = job_and_options(model, mesh, arguments)
    return fit_job(job, knob, options, step=step, baselines=baselines, max_slowdown=max_slowdown, pipeline=pipeline)


def runtime_plan(job: Job, strategy: str = "memshard", options: SearchOptions | None = None) -> Plan:
    """The plan ``memshard run``, ``simulate`` and the torchrun worker execute: memshard's
    plan (searched to a 2% gap unless ``options`` say otherwise) or a named baseline."""
    if isinstance(job.model, (str, ModelConfig)) and job.config.family == "bert":
        raise MemshardError("the runtime does not execute BERT graphs (their token-type embeddings); "
                            "memshard plan and compare price them")
    options = options or SearchOptions(mip_gap=0.02)
    if strategy == "memshard":
        return plan_job(job, options)
    if _pipelined(strategy):
        raise MemshardError(f"{strategy} is a pipelined plan: memshard plans pipelines and prices them, its runtime "
                            "does not run them")
    plan = strategy_plan(job, strategy=strategy, zero3_unit=options.priced_unit, recompute=options.recompute)
    return runnable(plan)
