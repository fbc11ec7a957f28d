"""The result of planning, as data: the job, the chosen strategies and storage, the predicted
figures, the advice, and the versioned JSON (``memshard.plan/3``: sizes in bytes per device,
times in seconds; version 2 records recomputation, version 3 the layer classes of a recipe
that recomputes some of its layers; plans of version 1 still load, as plans that recompute
nothing).

``build_plan`` reads a selection of the problem the search priced and its evaluation;
``Plan.to_dict`` / ``save`` write the JSON and ``plan_from_dict`` / ``load_plan`` read it
back. Where the search planned merged mesh axes (``search/coarsen.py``), the plan's records are
written on the real mesh, and its real-mesh problem (``Plan.problem``, what the runtime
executes) is built only when asked for.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

import numpy as np

from memshard.baselines.names import Kind, parse_strategy
from memshard.baselines.recipes import priced_as_run, run_by_memshard
from memshard.core.errors import MemshardError
from memshard.core.files import read_json, write_text_atomically
from memshard.core.graph import AUTOCAST, Origin
from memshard.core.mesh import Mesh
from memshard.core.placement import format_layout
from memshard.job import Job, mesh_to_dict
from memshard.plans.advice import RedundantOp, advise
from memshard.problem import comm
from memshard.problem.evaluate import Evaluation, evaluate
from memshard.problem.memory import CATEGORIES, StorageOption, param_layout
from memshard.problem.pricing import build_problem
from memshard.problem.records import (
    DDP_FRAMEWORKS,
    MEGATRON_FRAMEWORKS,
    MEMSHARD,
    TORCH_TP_FRAMEWORKS,
    OpGroup,
    PipelineStage,
    Problem,
    Selection,
    StorageGroup,
)
from memshard.search.coarsen import lift_selection
from memshard.search.solve import SolveResult
from memshard.search.stages import StageRecord

SCHEMA = "memshard.plan/3"
READABLE_SCHEMAS = ("memshard.plan/1", "memshard.plan/2", SCHEMA)
PIPELINE_SCHEMA = "memshard.pipeline/1"  # a pipelined plan's (``plans.pipelined``)


@dataclass(frozen=True)
class ModelSummary:
    name: str
    num_parameters: int
    num_layers: int
    precision: str
    unknown_ops: dict[str, int] | None  # a traced module: ATen ops planned replicated


@dataclass(frozen=True)
class Budgets:
    max_step_time_s: float | None = None
    memory_budget_bytes: float | None = None


@dataclass(frozen=True)
class MemoryFigures:
    peak_bytes: float
    peak_at: str
    breakdown: dict[str, float]  # per category (``CATEGORIES``) at the peak
    redundant_bytes: float
    lower_bound_bytes: float  # the zero-redundancy bound
    lower_bound_at: str
    above_lower_bound: float  # relative
    device_memory_bytes: int
    fits: bool


@dataclass(frozen=True)
class CommunicationFigures:
    bytes_per_step: float
    by_kind: dict[str, dict[str, float]]  # kind → calls, buffer_bytes, wire_bytes, time_s


@dataclass(frozen=True)
class SolverSummary:
    status: str  # "optimal", "time_limit", or "fixed" for a plan not searched
    time_s: float
    gap: float
    variables: int
    constraints: int
    shared_layers: bool
    zero3_unit: str
    search_space: str
    recompute: str = "none"  # the recomputation policy searched (``recompute.RECOMPUTE_POLICIES``)
    framework: str = MEMSHARD  # what runs the plan (``problem.FRAMEWORKS``)
    # each layer's class where layers share variables by class (``Graph.layer_classes``): a
    # recipe recomputing some of its layers; empty where all layers are one class
    layer_classes: tuple[int, ...] = ()
    # the mesh as typed, where the search laid the plan out on another view of its devices
    # (``core.mesh.mesh_views``; the job's mesh is that view); empty where it is the same
    typed_mesh: str = ""
    # the search's stages (``search/stages.py``): shown by ``memshard plan --verbose``, not
    # written to the plan's JSON (a plan read back has none)
    stages: tuple[StageRecord, ...] = field(default=(), compare=False)


@dataclass(frozen=True)
class OpChoice:
    name: str
    kind: str
    instances: int
    einsum: str
    split: dict[str, str]  # mesh axis → op dim
    input_layouts: dict[str, str]
    output_layout: str
    compute_time_s: float
    recomputed: bool = False  # replayed before its layer's backward


@dataclass(frozen=True)
class ParameterStorage:
    names: list[str]
    instances: int
    shape: list[int]
    layout: str
    gradient_layout: str
    storage: str
    zero_stage: int
    storage_axes: list[str]
    bytes_per_device: dict[str, float]


@dataclass(frozen=True)
class ReshardChoice:
    name: str
    instances: int
    producer_layout: str
    consumer_layout: str
    saved_in_producer_layout: bool
    collectives: list[str]
    bytes_per_step: float


@dataclass(frozen=True)
class Plan:
    strategy: str  # "memshard", or a baseline's name
    job: Job
    model: ModelSummary
    objective: str | None
    budgets: Budgets | None
    memory: MemoryFigures
    communication: CommunicationFigures
    step_time_s: float
    compute_time_s: float
    communication_time_s: float
    recompute_time_s: float  # what the replays add to the step: forward compute and reshards
    hidden_communication_s: float  # of communication_time_s, under the compute (not in the step)
    compute_by_kind: dict[str, float]  # matmuls, attention, other ops, optimizer step → seconds
    solver: SolverSummary
    most_redundant_ops: tuple[RedundantOp, ...]
    ops: tuple[OpChoice, ...]
    parameters: tuple[ParameterStorage, ...]
    reshards: tuple[ReshardChoice, ...]
    searched: Problem = field(repr=False, compare=False)  # the problem priced (axes merged, maybe)
    searched_selection: Selection = field(repr=False, compare=False)
    evaluation: Evaluation = field(repr=False, compare=False)

    @property
    def peak_bytes(self) -> float:
        return self.memory.peak_bytes

    @property
    def lower_bound_bytes(self) -> float:
        return self.memory.lower_bound_bytes

    @property
    def redundant_bytes(self) -> float:
        return self.memory.redundant_bytes

    @cached_property
    def problem(self) -> Problem:
        """The problem on the real mesh (the searched one, unless it merged axes)."""
        mesh = self.searched.mesh
        if mesh.real is mesh:
            return self.searched
        s = self.searched
        return build_problem(s.graph, mesh.real, s.shared_layers, s.micro_batches, s.zero3_unit, s.recompute,
                             s.framework, s.stage)

    @cached_property
    def selection(self) -> Selection:
        """The plan as a selection of :attr:`problem`."""
        if self.problem is self.searched:
            return self.searched_selection
        return lift_selection(self.searched, self.problem, self.searched_selection, list(self.searched.mesh.real_axes))

    def to_dict(self) -> dict[str, Any]:
        return _plain(_plan_dict(self))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n"

    def save(self, path: str) -> None:
        write_text_atomically(path, self.to_json())


def check_runnable_precision(precision: str | None) -> None:
    """Refuse a precision memshard's runtime does not execute: autocast is priced as PyTorch
    runs it, not run here."""
    if precision == AUTOCAST.name:
        raise MemshardError("memshard's runtime executes fp32 and mixed-precision plans; an autocast plan is priced "
                            "as PyTorch runs it (DDP, FSDP2), not run here")


def runnable(plan: Plan) -> Plan:
    """The plan memshard's runtime executes for ``plan``: ``plan`` itself, or a Megatron-LM
    baseline's layout priced as memshard's runtime runs it (no gradient buffer, its gradients
    in the job's precision, no fused GEMMs: ``recipes.run_by_memshard``). Refused: the baselines priced as PyTorch's implementations run
    them (``fsdp2``, ``ddp``, ``torch-tp*``)."""
    framework = plan.problem.framework
    check_runnable_precision(plan.model.precision)
    if framework in MEGATRON_FRAMEWORKS:  # (each projection on its own: the runtime fuses no GEMMs)
        problem, selection = run_by_memshard(plan.problem, plan.selection)
        return build_plan(problem, selection, plan.job, strategy=plan.strategy, advice=False)
    if framework != MEMSHARD:
        if framework in TORCH_TP_FRAMEWORKS:
            idealised = replace(parse_strategy(plan.strategy), kind=Kind.TP_FSDP,
                                reshard_after_forward=True, torchtitan_units=False)
            name, instead = "parallelize_module × fully_shard", str(idealised)
        elif framework in DDP_FRAMEWORKS:
            name, instead = "DistributedDataParallel", "dp"
        else:
            name, instead = "fully_shard (FSDP2)", "zero3-fsdp with --zero3-unit layer"
        raise MemshardError(f"the {plan.strategy} baseline prices PyTorch's {name}, which memshard's runtime does not "
                            f"run; run {instead} (memshard's runtime of the same layout)")
    return plan


def _plan_dict(plan: Plan) -> dict[str, Any]:
    m, s = plan.memory, plan.solver
    model = {"name": plan.model.name, "num_parameters": plan.model.num_parameters, "num_layers": plan.model.num_layers,
             "precision": plan.model.precision,
             **({"unknown_ops": plan.model.unknown_ops} if plan.model.unknown_ops is not None else {}),
             **plan.job.to_dict()["model"]}
    return {
        "schema": SCHEMA,
        "strategy": plan.strategy,
        "model": model,
        "mesh": mesh_to_dict(plan.job.mesh),
        "objective": plan.objective,
        "constraints": _constraints_dict(plan.budgets),
        "memory": {
            "peak_bytes_per_device": m.peak_bytes, "peak_at": m.peak_at, "breakdown": m.breakdown,
            "redundant_bytes_per_device": m.redundant_bytes, "lower_bound_bytes_per_device": m.lower_bound_bytes,
            "lower_bound_at": m.lower_bound_at, "above_lower_bound": m.above_lower_bound,
            "device_memory_bytes": m.device_memory_bytes, "fits": m.fits,
        },
        "communication": {"bytes_per_step_per_device": plan.communication.bytes_per_step,
                          "by_kind": plan.communication.by_kind},
        "estimated_step_time_s": plan.step_time_s,
        "compute_time_s": plan.compute_time_s,
        "communication_time_s": plan.communication_time_s,
        "recompute_time_s": plan.recompute_time_s,
        "hidden_communication_s": plan.hidden_communication_s,
        "compute_by_kind_s": plan.compute_by_kind,
        "solver": {"status": s.status, "time_s": s.time_s, "gap": s.gap, "variables": s.variables,
                   "constraints": s.constraints, "shared_layers": s.shared_layers, "zero3_unit": s.zero3_unit,
                   "search_space": s.search_space, "recompute": s.recompute, "framework": s.framework,
                   **({"layer_classes": list(s.layer_classes)} if s.layer_classes else {}),
                   **({"typed_mesh": s.typed_mesh} if s.typed_mesh else {})},
        "most_redundant_ops": [{"op": r.op, "redundant_bytes_per_device": r.redundant_bytes}
                               for r in plan.most_redundant_ops],
        "ops": [vars(o) for o in plan.ops],
        "parameters": [vars(p) for p in plan.parameters],
        "reshards": [vars(r) for r in plan.reshards],
    }


def _constraints_dict(budgets: Budgets | None) -> dict:
    if budgets is None:
        return {}
    return {"max_step_time_s": budgets.max_step_time_s, "memory_budget_bytes": budgets.memory_budget_bytes}


def _plain(obj):
    """numpy scalars → Python numbers, so the JSON is stable and byte-identical across runs."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


# -- building a plan -------------------------------------------------------------------------------
def build_plan(
    problem: Problem,
    selection: Selection,
    job: Job | None = None,
    *,
    result: SolveResult | None = None,
    evaluation: Evaluation | None = None,
    budgets: Budgets | None = None,
    strategy: str = "memshard",
    top: int = 10,
    advice: bool = True,
    typed_mesh: Mesh | None = None,
) -> Plan:
    """The plan ``selection`` of ``problem`` (the searched problem: its mesh may merge axes),
    priced by ``evaluation`` (evaluated here if not given), found by ``result`` (None: a fixed
    plan) for ``job`` (default: the problem's graph on its mesh); the ``top`` most redundant
    ops are listed, each with its ``advice``; ``typed_mesh``: the job's mesh as typed, where
    the plan lies on another view of its devices."""
    ev = evaluation or (result.evaluation if result is not None else None) or evaluate(problem, selection)
    graph, sched, mesh = problem.graph, problem.schedule, problem.mesh
    return Plan(
        strategy=strategy,
        job=job.on_mesh(mesh.real) if job is not None else Job(graph, mesh.real),
        model=ModelSummary(graph.name, graph.num_parameters, graph.num_layers, graph.precision.name,
                           dict(graph.unknown_ops) if graph.origin is Origin.TRACED else None),
        objective=result.objective if result else None,
        budgets=budgets,
        memory=MemoryFigures(
            peak_bytes=ev.peak_bytes, peak_at=sched.describe(ev.peak_point, graph),
            breakdown={c: ev.breakdown[c] for c in CATEGORIES}, redundant_bytes=ev.redundant_bytes,
            lower_bound_bytes=ev.lower_bound_bytes, lower_bound_at=sched.describe(ev.lower_bound_point, graph),
            above_lower_bound=ev.peak_bytes / ev.lower_bound_bytes - 1 if ev.lower_bound_bytes else 0.0,
            device_memory_bytes=mesh.device_memory_bytes, fits=bool(ev.peak_bytes <= mesh.device_memory_bytes)),
        communication=CommunicationFigures(ev.communication_bytes, ev.communication_by_kind),
        step_time_s=ev.step_time_s,
        compute_time_s=ev.compute_time_s,
        communication_time_s=ev.communication_time_s,
        recompute_time_s=ev.recompute_time_s,
        hidden_communication_s=ev.hidden_communication_s,
        compute_by_kind=ev.compute_by_kind,
        solver=_solver_summary(problem, result, typed_mesh),
        most_redundant_ops=advise(problem, selection, ev, top, alternatives=advice),
        ops=_op_choices(problem, selection),
        parameters=_parameter_storage(problem, selection),
        reshards=_reshard_choices(problem, selection),
        searched=problem,
        searched_selection=selection,
        evaluation=ev,
    )


def _solver_summary(problem: Problem, result: SolveResult | None, typed_mesh: Mesh | None) -> SolverSummary:
    classes = problem.graph.layer_classes
    classes = classes if len(set(classes)) > 1 else ()
    typed = str(typed_mesh) if typed_mesh is not None and typed_mesh != problem.mesh.real else ""
    if result is None:
        return SolverSummary("fixed", 0.0, 0.0, 0, 0, problem.shared_layers, problem.zero3_unit, "fixed plan",
                             problem.recompute, problem.framework, classes, typed)
    return SolverSummary(result.status, result.time_s, result.gap, result.variables, result.constraints,
                         problem.shared_layers, problem.zero3_unit, result.search_space, problem.recompute,
                         problem.framework, classes, typed, result.stages)


def _split(assignment: tuple, mesh: Mesh) -> dict[str, str]:
    """Mesh axis → the dim it splits, on the real mesh (a merged axis splits each of its parts)."""
    return {mesh.real.axis_names[r]: d for a, d in enumerate(assignment) if d is not None for r in mesh.real_axes[a]}


def _layout(layout: tuple, mesh: Mesh) -> str:
    return format_layout(mesh.on_real_axes(layout))


def _op_choices(problem: Problem, selection: Selection) -> tuple[OpChoice, ...]:
    mesh, graph = problem.mesh, problem.graph
    out = []
    for gid, grp in enumerate(problem.groups):
        if not isinstance(grp, OpGroup):
            continue
        s = grp.strategies[selection.choices[gid]]
        first = graph.ops[grp.ops[0]]
        out.append(OpChoice(
            name=grp.key,
            kind=first.kind,
            instances=grp.instances,
            einsum=",".join("".join(x.dims) for x in first.inputs) + "->" + "".join(first.output.dims),
            split=_split(s.assignment, mesh),
            input_layouts={x.tensor.split(".", 2)[-1] if first.layer is not None else x.tensor: _layout(L, mesh)
                           for x, L in zip(first.inputs, s.input_layouts)},
            output_layout=_layout(s.output_layout, mesh),
            compute_time_s=grp.choices[selection.choices[gid]].compute_s * grp.instances,
            recomputed=grp.replayed(selection.choices[gid]),
        ))
    return tuple(out)


def _parameter_storage(problem: Problem, selection: Selection) -> tuple[ParameterStorage, ...]:
    mesh, graph = problem.mesh, problem.graph
    out = []
    for gid, grp in enumerate(problem.groups):
        if not isinstance(grp, StorageGroup):
            continue
        grad, option = grp.options[selection.choices[gid]]
        mem = grp.memory[selection.choices[gid]]
        grad, option = mesh.on_real_axes(grad), _real_storage(option, mesh)
        out.append(ParameterStorage(
            names=grp.params if len(grp.params) <= 4 else grp.params[:2] + ["…"] + grp.params[-1:],
            instances=grp.instances,
            shape=list(graph.tensors[grp.params[0]].shape),
            layout=format_layout(param_layout(grad)),
            gradient_layout=_grad_text(grad),
            storage=option.name(mesh.real),
            zero_stage=option.stage,
            storage_axes=[mesh.real.axis_names[a] for a in option.axes],
            bytes_per_device={"parameters": mem.parameters, "gradients": mem.gradients,
                              "optimizer_states": mem.optimizer_states},
        ))
    return tuple(out)


def _real_storage(option: StorageOption, mesh: Mesh) -> StorageOption:
    """A storage option of ``mesh`` on ``mesh.real`` (a merged axis stores over each part)."""
    axes = tuple(r for r in mesh.to_real_axes(option.axes) if mesh.real.shape[r] > 1)
    return option.over(axes)


def _reshard_choices(problem: Problem, selection: Selection) -> tuple[ReshardChoice, ...]:
    mesh = problem.mesh
    out = []
    for e, edge in enumerate(problem.edges):
        layouts = problem.edge_layouts(selection, e)
        calls = problem.edge_calls(selection, e)
        if not calls and not layouts.kept:
            continue
        out.append(ReshardChoice(
            name=edge.key,
            instances=edge.instances,
            producer_layout=_layout(layouts.producer, mesh),
            consumer_layout=_layout(layouts.consumer, mesh),
            saved_in_producer_layout=layouts.kept,
            collectives=[c.kind for c in calls],
            bytes_per_step=comm.total_wire_bytes(calls, mesh) * edge.executions,
        ))
    return tuple(out)


def _grad_text(grad: tuple[str, ...]) -> str:
    return "".join("P" if g == "P" else ("R" if g == "R" else f"S({g[1:]})") for g in grad)


# -- reading a plan back ---------------------------------------------------------------------------
def load_plan(path: str) -> Plan:
    """The plan saved at ``path`` (:meth:`Plan.save`)."""
    return plan_from_dict(read_json(path, "plan"))


def plan_from_dict(data: dict, stage: PipelineStage | None = None) -> Plan:
    """A plan from its JSON: the job is rebuilt from the recorded model, mesh and batch, and
    every op, parameter and edge takes the recorded choice. ``stage``: the pipeline stage the
    plan is of (a stage's plan within a pipelined plan, which ``plans.pipelined`` reads)."""
    if isinstance(data, dict) and data.get("schema") == PIPELINE_SCHEMA:
        raise MemshardError("a pipelined plan: read it with memshard.plans.pipelined.load_any_plan "
                            "(docs/pipelining.md)")
    if not isinstance(data, dict) or data.get("schema") not in READABLE_SCHEMAS:
        raise MemshardError(f"not a memshard plan (expected schema {SCHEMA!r})")
    try:
        return _rebuild(data, stage)
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise MemshardError(f"the plan does not match memshard's model of this job: {e!r}") from None


def _rebuild(data: dict, stage: PipelineStage | None) -> Plan:
    job = Job.from_dict(data)
    solver = dict(data["solver"])
    solver["layer_classes"] = tuple(solver.get("layer_classes", ()))
    graph = job.graph if stage is None else job.graph.pipeline_stage(stage.first_layer, stage.end_layer)
    graph = graph.with_layer_classes(solver["layer_classes"]) if solver["layer_classes"] else graph
    problem = build_problem(graph, job.mesh, shared_layers=solver["shared_layers"],
                            micro_batches=job.micro_batches, zero3_unit=solver.get("zero3_unit", "op"),
                            recompute=solver.get("recompute", "none"), framework=solver.get("framework", MEMSHARD),
                            stage=stage)
    selection, strategy = _recorded_selection(problem, data), data.get("strategy", "memshard")
    if problem.framework != MEMSHARD:  # a baseline: its collectives priced as its framework runs them
        problem = priced_as_run(problem, selection, parse_strategy(strategy))
    rebuilt = build_plan(problem, selection, job,
                         budgets=Budgets(**data["constraints"]) if data.get("constraints") else None,
                         strategy=strategy, advice=False)
    # as the search reported it when the plan was made
    return replace(rebuilt, objective=data.get("objective"), solver=SolverSummary(**solver))


def _recorded_selection(problem: Problem, data: dict) -> Selection:
    mesh = problem.mesh
    choices = [0] * len(problem.groups)
    by_key = {grp.key: gid for gid, grp in enumerate(problem.groups) if isinstance(grp, OpGroup)}
    for entry in data["ops"]:
        gid = by_key[entry["name"]]
        grp = problem.groups[gid]
        splits = [(_split(s.assignment, mesh), grp.replayed(c)) for c, s in enumerate(grp.strategies)]
        choices[gid] = splits.index((entry["split"], entry.get("recomputed", False)))
    for entry in data["parameters"]:
        gid = problem.storage_group[entry["names"][0]]
        axes = tuple(mesh.axis_names.index(a) for a in entry["storage_axes"])
        options = problem.groups[gid].options
        choices[gid] = next(i for i, (grad, opt) in enumerate(options)
                            if (format_layout(param_layout(grad)), opt.stage, opt.axes, _grad_text(grad))
                            == (entry["layout"], entry["zero_stage"], axes, entry["gradient_layout"]))
    keeps = [0] * len(problem.edges)
    by_edge = {e.key: i for i, e in enumerate(problem.edges)}
    for entry in data["reshards"]:
        keeps[by_edge[entry["name"]]] = int(entry["saved_in_producer_layout"])
    return Selection(tuple(choices), tuple(keeps))
