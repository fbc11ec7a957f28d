"""Pipelined plans: the layers split into contiguous stages along a pipeline axis, each stage
planned by the search, the step priced by the schedule.

The pipeline axis is the outermost mesh axis, or a factor of it: ``8x8`` pipelined over 4
stages is a pipeline axis of 4 and a stage mesh of ``2x8`` (on one axis of 16 devices, 4
stages of 4). Nodes fill innermost axis first, so the pipeline runs across nodes and each
stage keeps its nodes' links.

Layers go to stages evenly; where they do not divide, the stages after the first take one
more (the first holds the most micro-batches, the last the head). The first stage also runs
the embedding, the last the final norm, the head and the loss (``Graph.pipeline_stage``).

Each stage is its own problem (``problem.records.PipelineStage``): its graph, and k, the
micro-batches its ranks hold at their peak, counted from the schedule's action list
(``problem.pipeline``: 1F1B's stage i of p holds min(p − i, m), GPipe's all m). The stages
are searched in order, each receiving its input in the layout the stage before sends it
(``build_problem``'s ``received_layouts``: its ``RECEIVE`` op's strategies of that layout
alone), so the runtime passes each rank's piece to one rank. Each stage's plan is optimal for
the objective given the layout it receives, not jointly: the first stage chooses its output
layout alone. The least memory is the largest of the stages' peaks, and the step time grows
with each stage's time.

The step: each stage's time for one micro-batch is its planned step (``micro_batches`` of
them, the search's own figure) less its optimizer step and its once-a-step collectives, over
the micro-batches; the forward takes its kernels' share of the stage's compute
(``forward_share``), the backward the rest, replays included. The schedule's timeline
(``problem.pipeline.simulate``) runs them, a micro-batch's activations crossing to the next
stage over the pipeline axis's link. The collectives a stage runs once a step go where torch's
schedule runs them (``OncePerStep``): its gradient reductions (ZeRO-0/1) after its last
backward, beside that backward at most (torch's stage syncs gradients there only), its updated
shards' all-gathers (ZeRO-1/2) before its first forward, beside it at most; a stage's fill and
drain hide them where they are long enough. The slowest stage's optimizer step follows.

Several stages per rank (``PipelineOptions.stages_per_rank`` v > 1: ``interleaved-1f1b``,
``interleaved-zb``, ``zbv``): the layers split into p·v stages, stage s on the rank the
schedule places it (s mod p; ZBV's V), each searched as above holding the most micro-batches
of it its rank holds at once. A rank's peak is then counted from its action list
(``PipelinedPlan.rank_peaks``: ``problem.pipeline.rank_peak_bytes``), not searched: each stage
is optimal for its own peak, not for its rank's. The zero-bubble schedules split each stage's
backward into I and W (``weight_share``: of each op that multiplies by a weight, half its
backward, the weight gradient's GEMM) for the timeline.

Views: where the options search views, every stage lies on one view of the stage mesh
(``best_view``, ``core.mesh.mesh_views``), so that a stage receives on the axes the stage
before sends on.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from memshard.baselines.names import Kind, parse_strategy
from memshard.baselines.recipes import baselines
from memshard.core.errors import MemshardError, NoBetterPlan
from memshard.core.graph import Graph, TensorKind
from memshard.core.mesh import Mesh, make_mesh, mesh_views
from memshard.core.placement import Layout
from memshard.job import Job, TracedModule
from memshard.planner import SearchOptions, plan_job
from memshard.plans.pipelined import PipelinedPlan, StagePlan
from memshard.plans.plan import Plan, build_plan
from memshard.problem import comm
from memshard.problem.kernels import GEMM_KINDS, op_time
from memshard.problem.memory import tensor_bytes
from memshard.problem.pipeline import (
    DEFAULT_STAGES_PER_RANK,
    StageTimes,
    build_schedule,
    check_schedule,
    held_stages,
    peak_held_counts,
    simulate,
)
from memshard.problem.pricing import build_problem, receive_time
from memshard.problem.records import OpGroup, PipelineStage, Problem, without_partial
from memshard.problem.storage import once_a_step

# one stage per rank (1f1b, gpipe); several (``PipelineOptions.stages_per_rank``) for the others
PIPELINE_SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b", "interleaved-zb", "zbv")
ZERO_BUBBLE_SCHEDULES = ("interleaved-zb", "zbv")  # their backward split into I and W
SPLITS = ("even", "balanced")  # the layers split evenly, or the split searched (``balanced_split``)
# The baselines listed with a pipeline: Megatron-LM's, and torchtitan's fully_shard alone or
# under parallelize_module
PIPELINED_KINDS = (Kind.MEGATRON, Kind.FSDP2, Kind.TORCH_TP)


@dataclass(frozen=True)
class PipelineOptions:
    """``stages`` pipeline ranks (at least 2) running ``schedule``, each rank holding
    ``stages_per_rank`` stages (v; None: the schedule's default, ``DEFAULT_STAGES_PER_RANK``:
    1 for 1f1b and gpipe, 2 for the others; zbv exactly 2), the layers split ``split``:
    ``even`` (``stage_layers``), ``balanced`` (searched: ``balanced_split``), or each stage's
    number of layers (p·v counts, in model order)."""

    stages: int
    schedule: str = "1f1b"
    split: str | tuple[int, ...] = "even"
    stages_per_rank: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stages, bool) or not isinstance(self.stages, int) or self.stages < 2:
            raise MemshardError(f"a pipeline has at least 2 stages, got {self.stages!r}")
        if self.schedule not in PIPELINE_SCHEDULES:
            raise MemshardError(f"the pipeline schedule must be one of {', '.join(PIPELINE_SCHEDULES)}, "
                                f"got {self.schedule!r}")
        v = self.stages_per_rank
        if v is None:
            object.__setattr__(self, "stages_per_rank", v := DEFAULT_STAGES_PER_RANK[self.schedule])
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise MemshardError(f"a pipeline rank holds at least 1 stage (--virtual-stages), got {v!r}")
        if self.schedule in ("1f1b", "gpipe") and v != 1:
            raise MemshardError(f"{self.schedule} runs one stage per rank, not {v} (--virtual-stages): choose "
                                "--schedule interleaved-1f1b, interleaved-zb or zbv")
        if self.schedule == "zbv" and v != 2:
            raise MemshardError(f"zbv runs exactly 2 stages per rank (its V), not {v} (--virtual-stages)")
        count = self.num_stages
        if isinstance(self.split, str):
            if self.split not in SPLITS:
                raise MemshardError(f"a pipeline's layers split {' or '.join(SPLITS)}, or as a count per stage, "
                                    f"got {self.split!r}")
        elif len(self.split) != count or not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in self.split):
            raise MemshardError(f"{count} pipeline stages take {count} layer counts of at least 1 each, "
                                f"got {', '.join(map(str, self.split))}")

    @property
    def num_stages(self) -> int:
        """p·v: the stages the layers are split into."""
        return self.stages * self.stages_per_rank


def pipeline_meshes(mesh: Mesh, stages: int) -> tuple[Mesh, Mesh]:
    """(the mesh with its outermost axis split into the pipeline axis and the rest, the mesh
    one stage runs on: that rest and the inner axes)."""
    outer = mesh.shape[0]
    if outer % stages:
        raise MemshardError(f"{stages} pipeline stages do not divide the outermost axis of mesh {mesh} ({outer} "
                            "devices): the pipeline runs along it")
    if mesh.real is not mesh:
        raise MemshardError("a pipeline splits the mesh as typed, not merged axes")
    rest = outer // stages
    shape = (stages, rest, *mesh.shape[1:]) if rest > 1 else (stages, *mesh.shape[1:])
    names = ("pipeline", *mesh.axis_names) if rest > 1 else ("pipeline", *mesh.axis_names[1:])
    if len(set(names)) < len(names):
        raise MemshardError(f"mesh {mesh} already has an axis named 'pipeline'")
    full = make_mesh(shape, names, device_memory_bytes=mesh.device_memory_bytes, hardware=mesh.hardware)
    if full.ndim == 1:
        raise MemshardError(f"{stages} pipeline stages of mesh {mesh} leave one device per stage: use fewer "
                            "stages or more devices")
    inner = full.axes[1:]
    if rest == 1:  # the inner axes as typed (their links, where set by hand)
        inner = mesh.axes[1:]
    return full, replace(full, axes=inner)


def stage_layers(num_layers: int, stages: int) -> tuple[tuple[int, int], ...]:
    """Each stage's layers [first, end): ⌊L/p⌋ each, one more for the stages after the first
    while L does not divide."""
    if num_layers < stages:
        raise MemshardError(f"{stages} pipeline stages need at least as many layers; the model has {num_layers}")
    base, extra = divmod(num_layers, stages)
    sizes = [base + (1 if 1 <= i <= extra else 0) for i in range(stages)]
    ends = [sum(sizes[:i + 1]) for i in range(stages)]
    return tuple(zip([0, *ends[:-1]], ends))


def held_micro_batches(schedule: str, stages: int, micro_batches: int, stages_per_rank: int = 1) -> tuple[int, ...]:
    """Per stage (p·v of them, in model order), the most micro-batches of it its rank holds at
    once, from the schedule's actions (``problem.pipeline.peak_held_counts``)."""
    plan = build_schedule(schedule, stages, micro_batches, stages_per_rank)
    held = {}
    for actions in plan.actions:
        held.update(zip(held_stages(actions), peak_held_counts(actions)))
    return tuple(held[s] for s in range(plan.num_stages))


def plan_pipelined(job: Job, options: SearchOptions, pipeline: PipelineOptions) -> PipelinedPlan:
    """The plan ``options`` ask for with ``pipeline``'s stages: each stage searched on its own,
    in order, each receiving as the stage before sends; the split as ``pipeline.split`` says;
    every stage on one view of the stage mesh, the best (``stage_views``)."""
    if options.max_step_time_s is not None:
        raise MemshardError("a step-time budget (--max-step-time) does not yet bound a pipelined plan: its step "
                            "is the schedule's, not a stage's")
    stage_mesh = _pipeline_of(job, pipeline)[1]
    if options.mesh_views and not mesh_views(stage_mesh):
        raise MemshardError(f"mesh views (--mesh-views on) change nothing on the stage mesh {stage_mesh} of {job.mesh} "
                            f"in {pipeline.stages} stages: its devices form no other axes (docs/search.md, Mesh views)")
    return _plan_pipelined(job, options, pipeline)


def _plan_pipelined(job: Job, options: SearchOptions, pipeline: PipelineOptions) -> PipelinedPlan:
    """``plan_pipelined``, the views searched where ``options`` ask for them and the stage mesh
    has them."""
    num_layers = job.graph.num_layers
    if isinstance(pipeline.split, tuple) and sum(pipeline.split) != num_layers:
        raise MemshardError(f"the stages' layer counts ({', '.join(map(str, pipeline.split))}) add up to "
                            f"{sum(pipeline.split)}, not the model's {num_layers} layers")
    counts = pipeline.split if isinstance(pipeline.split, tuple) else tuple(
        end - first for first, end in stage_layers(num_layers, pipeline.num_stages))
    search, plan = best_view(job, options, pipeline, counts)
    if pipeline.split != "balanced":
        return plan
    search.cutoff = None  # (the split's search on the best view compares whole pipelined plans)
    return balanced_split(search, plan)


def stage_views(job: Job, options: SearchOptions, pipeline: PipelineOptions) -> tuple[Mesh | None, ...]:
    """The views each stage may lie on: None (the stage mesh as typed) and, where
    ``options.searches_views``, its other views (``core.mesh.mesh_views``), those of fewer axes
    first, the mesh as typed first among alike (as ``planner.candidates`` orders them)."""
    stage_mesh = _pipeline_of(job, pipeline)[1]
    views = mesh_views(stage_mesh) if options.searches_views else ()
    return tuple(sorted((None, *views), key=lambda view: (view or stage_mesh).ndim))


def best_view(job: Job, options: SearchOptions, pipeline: PipelineOptions,
              counts: tuple[int, ...]) -> tuple[StageSearch, PipelinedPlan]:
    """The best pipelined plan of the split ``counts`` over ``stage_views``, with its search:
    every stage on one view (a stage receives in the layout the one before sends, on the same
    axes). A pipelined plan's peak is no lower than any stage's, and its step no shorter than
    its first stage's planned step (stage 0 runs the step's first forward and its last backward,
    so no fill or drain hides its once-a-step collectives: ``OncePerStep``, whose plan counts
    them hidden under one micro-batch at most, as torch runs them). So a view's stages (for the
    time, its first stage) are searched under the best plan's figure so far
    (``StageSearch.cutoff``): one with no plan below it by the gap ends that view."""
    memory = options.objective == "memory"
    figure = (lambda p: p.peak_bytes) if memory else (lambda p: p.step_time_s)
    best: tuple[StageSearch, PipelinedPlan] | None = None
    failure: MemshardError | None = None
    for view in stage_views(job, options, pipeline):
        search = StageSearch(job, options, pipeline, view, cutoff=figure(best[1]) if best else None)
        try:
            plan = search.plan(counts)
        except NoBetterPlan:
            continue
        except MemshardError as e:  # (under a memory budget: a stage of this view has no plan within it)
            failure = failure or e
            continue
        if best is None or (figure(plan), plan.step_time_s, plan.peak_bytes) < (
                figure(best[1]), best[1].step_time_s, best[1].peak_bytes):
            best = search, plan
    if best is None:
        raise failure or MemshardError("no view of the stage mesh has a pipelined plan")
    return best


class StageSearch:
    """The stage plans of one job's pipeline, each searched once per layers, micro-batches held
    and received layouts: a split's plan reuses every stage another split already searched."""

    def __init__(self, job: Job, options: SearchOptions, pipeline: PipelineOptions, view: Mesh | None = None,
                 cutoff: float | None = None):
        self.job, self.options, self.pipeline, self.cutoff = job, options, pipeline, cutoff
        self.mesh, self.typed_stage_mesh = _pipeline_of(job, pipeline)
        # on a view, the pipeline axis then the view's axes: the same devices, stage by stage
        self.stage_mesh = view or self.typed_stage_mesh
        if view is not None:
            self.mesh = replace(self.mesh, axes=(self.mesh.axes[0], *view.axes))
        self.stage_job = _stage_job(job, self.typed_stage_mesh)  # (its plans record the mesh as typed)
        # one ZeRO-3 unit: a second would be searched on the whole model (``planner.candidates``)
        self.stage_options = replace(options, mesh_views=False, zero3_unit=options.zero3_units[0])
        self.held = held_micro_batches(pipeline.schedule, pipeline.stages, job.micro_batches,
                                       pipeline.stages_per_rank)
        self.plans: dict[tuple, Plan] = {}

    def problem(self, stage: PipelineStage, received: dict[str, Layout] | None) -> Problem:
        return build_problem(self.job.graph, self.stage_mesh, shared_layers=not self.options.exact,
                             micro_batches=self.job.micro_batches, zero3_unit=self.stage_options.zero3_unit,
                             recompute=self.options.recompute, stage=stage, received_layouts=received)

    def stage_plan(self, stage: PipelineStage, received: dict[str, Layout] | None) -> Plan:
        """The stage's plan, receiving each tensor in ``received`` (None: as it chooses)."""
        key = (stage, tuple(sorted(received.items())) if received else None)
        if key not in self.plans:  # (a plan found under the cutoff is the one found without it)
            bounds = received is None or self.options.objective == "memory"  # (``best_view``: stage 0's step)
            searched = plan_job(self.stage_job, self.stage_options, problem=self.problem(stage, received),
                                cutoff=self.cutoff if bounds else None)
            self.plans[key] = searched if received is None else on_problem(searched, self.problem(stage, None))
        return self.plans[key]

    def plan(self, counts: tuple[int, ...]) -> PipelinedPlan:
        """The pipelined plan of the split ``counts`` (layers per stage)."""
        plans: list[tuple[PipelineStage, Plan]] = []
        first = 0
        for index, count in enumerate(counts):
            stage = PipelineStage(first, first + count, self.held[index])
            first += count
            try:  # each tensor received as the stage before sends it
                plans.append((stage, self.stage_plan(stage, sent_layouts(plans[-1][1]) if plans else None)))
            except NoBetterPlan:
                raise
            except MemshardError as e:
                raise MemshardError(f"pipeline stage {index} (layers {stage.first_layer}–{stage.end_layer - 1}): "
                                    f"{e}") from None
        return _priced(self.job, self.options.objective, self.pipeline.schedule, self.mesh, self.stage_mesh, plans,
                       typed_stage_mesh=self.typed_stage_mesh if self.stage_mesh is not self.typed_stage_mesh else None,
                       stages_per_rank=self.pipeline.stages_per_rank)


def balanced_split(search: StageSearch, plan: PipelinedPlan) -> PipelinedPlan:
    """A local search over splits from ``plan``'s: one layer moved from the stage that binds
    the objective (the largest peak; for time, the slowest micro-batch) to another stage (the
    least loaded first; the stages between shift by one layer), kept as soon as the pipelined
    plan gets better (a lower peak, or a faster step within the memory budget). It ends where
    no such move helps: no optimality over every split is claimed."""
    memory = search.options.objective == "memory"
    score = (lambda p: (p.peak_bytes, p.step_time_s)) if memory else (lambda p: (p.step_time_s, p.peak_bytes))
    seen = {tuple(stage.num_layers for stage in plan.stages)}
    while True:
        counts = [stage.num_layers for stage in plan.stages]
        loads = [stage.plan.peak_bytes if memory else stage.forward_s + stage.backward_s for stage in plan.stages]
        binding = max(range(len(counts)), key=lambda i: (loads[i], -i))
        better = None
        for other in sorted((i for i in range(len(counts)) if i != binding), key=lambda i: (loads[i], i)):
            moved = list(counts)
            moved[binding] -= 1
            moved[other] += 1
            if moved[binding] < 1 or tuple(moved) in seen:
                continue
            seen.add(tuple(moved))
            try:
                candidate = search.plan(tuple(moved))
            except MemshardError:  # (a stage with no plan within the memory budget)
                continue
            if score(candidate) < score(plan):
                better = candidate
                break
        if better is None:
            return plan
        plan = better


def on_problem(plan: Plan, problem: Problem) -> Plan:
    """``plan`` (of a stage's problem whose received layouts were fixed) as a plan of
    ``problem``, the stage's problem with every strategy (as a saved plan is read back): the
    same strategies, priced alike."""
    choices = list(plan.searched_selection.choices)
    for gid, group in enumerate(plan.searched.groups):
        if isinstance(group, OpGroup) and len(group.strategies) != len(problem.groups[gid].strategies):
            strategy = group.strategies[choices[gid]]
            choices[gid] = problem.groups[gid].choice_of(strategy.assignment, group.replayed(choices[gid]))
    return replace(plan, searched=problem, searched_selection=replace(plan.searched_selection, choices=tuple(choices)))


def sent_layouts(plan: Plan) -> dict[str, Layout]:
    """Each tensor a stage's plan sends on → the layout it sends it in: its producer's output
    layout, partial sums summed (the runtime sums them before it sends)."""
    problem, graph = plan.problem, plan.problem.graph
    return {t: without_partial(problem.strategy(plan.selection, problem.op_group[graph.producer[t]]).output_layout)
            for t in sorted(graph.sent)}


def megatron_held_micro_batches(stages: int, micro_batches: int) -> tuple[int, ...]:
    """Per stage, the micro-batches Megatron-LM's non-interleaved 1F1B
    (``forward_backward_pipelining_without_interleaving``) has its ranks hold at their peak: the
    warm-up's forwards, min(p − i − 1, m), then one more forward before the first backward
    where micro-batches remain. (It is torch's ``Schedule1F1B``'s min(p − i, m).)"""
    held = []
    for i in range(stages):
        warm_up = min(stages - i - 1, micro_batches)
        held.append(warm_up + (1 if micro_batches > warm_up else 0))
    return tuple(held)


def pipelined_baseline(job: Job, strategy: str, zero3_unit: str = "op", recompute: str = "none",
                       exact: bool = False) -> PipelinedPlan:
    """A pipelined Megatron-LM configuration (``megatron-tp2-pp2-dp2-sp``…) or torchtitan recipe
    (``fsdp2-pp2-noreshard``, ``torch-tp2-pp2-fsdp2``…) of ``job``, priced stage by stage
    (``pipelined_baselines``), or one MemshardError line saying why not."""
    name = parse_strategy(strategy)
    if name.kind not in PIPELINED_KINDS or name.pipeline_parallel == 1:
        raise MemshardError(f"{strategy} is not a pipelined baseline (megatron-tp<T>-pp<P>…, fsdp2-pp<P>…, "
                            "torch-tp<T>-pp<P>-fsdp…)")
    found, skipped = pipelined_baselines(job, name.pipeline_parallel, lambda text: text == strategy, zero3_unit,
                                         recompute, exact, name.virtual_pipeline)
    if found:
        return found[0]
    degree, recipe = name.pipeline_parallel, str(name.stage_recipe)
    why = dict(skipped).get(strategy) or (f"each stage runs {recipe}, which its mesh does not lay out (memshard "
                                          f"compare --pipeline {degree} lists those it does)")
    raise MemshardError(f"strategy {strategy} does not fit {job.graph.name} on {job.mesh}: {why}")


def pipelined_baselines(job: Job, degree: int, wanted: Callable[[str], bool] | None = None, zero3_unit: str = "op",
                        recompute: str = "none", exact: bool = False, virtual: int = 1
                        ) -> tuple[list[PipelinedPlan], list[tuple[str, str]]]:
    """Every Megatron-LM configuration and torchtitan recipe (PyTorch's ``fully_shard``, alone or
    under ``parallelize_module``, in stages of torch.distributed.pipelining) of pipeline degree
    ``degree`` (``-pp<degree>``) of ``job`` that the stage mesh lays out (``wanted``: those
    whose names it accepts; the layer splits, ``+full-block<N>`` and ``+full-every<N>``, only by
    name), and (name, reason) for those it refuses. ``degree`` stages along the outermost mesh
    axis (``pipeline_meshes``), the layers split as ``stage_layers`` splits them, each stage
    holding the micro-batches 1F1B makes it hold (Megatron-LM's and torch's ``Schedule1F1B``
    alike); on each stage's problem the rest of the name, laid out on the stage mesh as
    ``baselines`` lays it out on a flat mesh (a ``fully_shard`` as torch's ``PipelineStage``
    runs it: ``gathers.pipelined_units``); the step as memshard's own pipelined plans are
    priced (``_priced``). ``virtual``: Megatron-LM's interleaved pipeline of that many stages per
    rank (``-vpp<V>``, its ``--num-layers-per-virtual-pipeline-stage``): p·v stages, each holding
    what the interleaved 1F1B's action list makes it hold (Megatron-LM's warm-up,
    ``(p − r − 1)·2 + (v − 1)·g``, is torch's), Megatron-LM's recipes alone."""
    schedule = "interleaved-1f1b" if virtual > 1 else "1f1b"
    pipeline = PipelineOptions(degree, schedule, stages_per_rank=virtual)
    mesh, stage_mesh = _pipeline_of(job, pipeline)
    stage_job = _stage_job(job, stage_mesh)
    held = megatron_held_micro_batches(degree, job.micro_batches) if virtual == 1 else held_micro_batches(
        schedule, degree, job.micro_batches, virtual)

    def pipelined(recipe: str) -> str:
        return str(replace(parse_strategy(recipe), pipeline_parallel=degree, virtual_pipeline=virtual))

    def accepted(recipe: str) -> bool:
        name = parse_strategy(recipe)
        if name.kind not in PIPELINED_KINDS or name.prefetch or not isinstance(name.reshard_after_forward, bool):
            return False  # (a pipelined fully_shard's gathers are torch's PipelineStage's)
        if virtual > 1 and name.kind is not Kind.MEGATRON:
            return False
        return wanted(pipelined(recipe)) if wanted is not None else not (name.block or name.every or name.tp_overlap)

    stages: dict[str, list[tuple[PipelineStage, Plan]]] = {}
    skipped: dict[str, str] = {}
    for stage in _stages(job, pipeline, held):
        problem = build_problem(job.graph, stage_mesh, shared_layers=not exact, micro_batches=job.micro_batches,
                                zero3_unit=zero3_unit, recompute=recompute, stage=stage)
        fixed, refused = baselines(problem, accepted)
        skipped.update((pipelined(name), why) for name, why in refused)
        for b in fixed:
            stages.setdefault(pipelined(b.name), []).append(
                (stage, build_plan(b.problem, b.selection, stage_job, strategy=pipelined(b.name), advice=False)))
    plans = [_priced(job, None, pipeline.schedule, mesh, stage_mesh, plans, name, stages_per_rank=virtual)
             for name, plans in stages.items() if name not in skipped and len(plans) == pipeline.num_stages]
    return plans, list(skipped.items())


def _pipeline_of(job: Job, pipeline: PipelineOptions) -> tuple[Mesh, Mesh]:
    """(the job's mesh with its pipeline axis, a stage's mesh), or why the job is not pipelined so."""
    if isinstance(job.model, TracedModule):
        raise MemshardError("a traced nn.Module is planned whole: pipeline stages split built-in and Hugging Face "
                            "models")
    meshes = pipeline_meshes(job.mesh, pipeline.stages)
    if pipeline.schedule == "1f1b" and job.micro_batches < pipeline.stages:
        raise MemshardError(f"1F1B over {pipeline.stages} stages needs at least {pipeline.stages} micro-batches "
                            f"(--micro-batches), got {job.micro_batches}")
    p, v = pipeline.stages, pipeline.stages_per_rank
    if v > 1 and job.graph.num_layers < p * v:
        raise MemshardError(f"{p} pipeline ranks of {v} stages each (--virtual-stages) need at least {p * v} layers; "
                            f"the model has {job.graph.num_layers}")
    check_schedule(pipeline.schedule, p, job.micro_batches, v)
    return meshes


def _stage_job(job: Job, stage_mesh: Mesh) -> Job:
    """The job one stage's plan is of: the job on the stage's mesh, the same global batch."""
    return replace(job, mesh=stage_mesh, batch=job.batch if job.batch is not None or isinstance(job.model, Graph)
                   else job.global_batch)


def _stages(job: Job, pipeline: PipelineOptions, held: tuple[int, ...]) -> list[PipelineStage]:
    """Each stage's layers and the micro-batches ``held`` says its ranks hold."""
    return [PipelineStage(first, end, k)
            for (first, end), k in zip(stage_layers(job.graph.num_layers, pipeline.num_stages), held)]


def pipeline_degrees(job: Job, schedule: str = "1f1b", stages_per_rank: int = 1) -> tuple[int, ...]:
    """The pipeline degrees ``plan_auto`` tries on ``job``: each divisor p ≥ 2 of the outermost
    mesh axis that leaves a stage more than one device, at most one layer per stage (p·v
    stages), and micro-batches the schedule takes (``problem.pipeline.check_schedule``: for
    1F1B no more stages than micro-batches)."""
    mesh, layers = job.mesh, job.graph.num_layers

    def takes(p: int) -> bool:
        try:
            check_schedule(schedule, p, job.micro_batches, stages_per_rank)
        except MemshardError:
            return False
        return True

    return tuple(p for p in range(2, mesh.shape[0] + 1)
                 if mesh.shape[0] % p == 0 and mesh.num_devices // p > 1 and p * stages_per_rank <= layers
                 and takes(p))


def plan_with_pipeline(job: Job, options: SearchOptions, pipeline: int | str | None, schedule: str | None,
                       start: Plan | None = None, split: str | tuple[int, ...] | None = None,
                       stages_per_rank: int | None = None) -> Plan | PipelinedPlan:
    """The plan ``memshard plan`` and ``memshard.plan`` make: without a pipeline (``pipeline``
    None or ``"none"``; ``start``: a plan the search starts from), with ``pipeline`` ranks run
    by ``schedule`` (None: 1F1B), each holding ``stages_per_rank`` stages (None: the schedule's
    default), their layers split ``split`` (None: evenly), or the best of both (``"auto"``)."""
    if pipeline in (None, "none"):
        if schedule is not None or split is not None or stages_per_rank is not None:
            what = ("a schedule (--schedule) orders" if schedule is not None else
                    "a split (--stage-layers) divides" if split is not None else
                    "stages per rank (--virtual-stages) divide")
            raise MemshardError(f"{what} a pipeline's stages: give --pipeline too")
        return plan_job(job, options, start)
    if start is not None:
        raise MemshardError("a pipelined plan is searched stage by stage: give no start plan")
    if pipeline == "auto":
        if isinstance(split, tuple):
            raise MemshardError("--pipeline auto tries every number of stages: split them even or balanced, "
                                "not by counts")
        return plan_auto(job, options, schedule, split or "even", stages_per_rank)
    return plan_pipelined(job, options, PipelineOptions(pipeline, schedule or "1f1b", split or "even",
                                                        stages_per_rank))


def auto_schedules(options: SearchOptions, schedule: str | None,
                   stages_per_rank: int | None) -> tuple[tuple[str, int], ...]:
    """The (schedule, stages per rank) ``plan_auto`` tries: the one given, or with none given
    1F1B and, for the fastest step, interleaved 1F1B of 2 stages per rank. (Not for the least
    memory: on equal layers interleaving's first rank holds (1 + (p − 1)/(p·v)) times 1F1B's
    first stage's activations, Megatron-LM's factor, so it never lowers the peak.)"""
    if schedule is not None:
        return ((schedule, PipelineOptions(2, schedule, stages_per_rank=stages_per_rank).stages_per_rank),)
    if stages_per_rank is not None:
        raise MemshardError("--virtual-stages divides an interleaved schedule's ranks: give --schedule too")
    if options.objective == "memory":
        return (("1f1b", 1),)
    return ("1f1b", 1), ("interleaved-1f1b", 2)


def plan_auto(job: Job, options: SearchOptions, schedule: str | None = None, split: str = "even",
              stages_per_rank: int | None = None) -> Plan | PipelinedPlan:
    """The best of the plan without a pipeline and the pipelined plans of every degree
    ``pipeline_degrees`` gives, under each of ``auto_schedules``: the least peak, or the fastest
    step (within the memory budget, where a degree has no stage plan within it, it is left out).
    Ties go to fewer stages, then to 1F1B. Each pipelined plan is the stage-by-stage search's,
    so the best is the best of those plans, not a joint optimum."""
    if isinstance(job.model, TracedModule) or options.max_step_time_s is not None:
        raise MemshardError("--pipeline auto searches built-in and Hugging Face models for the least memory or the "
                            "fastest step; give no step-time budget")
    tried = auto_schedules(options, schedule, stages_per_rank)
    best: Plan | PipelinedPlan = plan_job(job, options)
    objective = (lambda plan: plan.peak_bytes) if options.objective == "memory" else (lambda plan: plan.step_time_s)
    for name, v in tried:
        for degree in pipeline_degrees(job, name, v):
            try:
                pipelined = _plan_pipelined(job, options, PipelineOptions(degree, name, split, v))
            except MemshardError:  # under a memory budget: some stage has no plan within it
                continue
            if objective(pipelined) < objective(best):
                best = pipelined
    return best


def _priced(job: Job, objective: str | None, schedule_name: str, mesh: Mesh, stage_mesh: Mesh,
            plans: list[tuple[PipelineStage, Plan]], strategy: str = "memshard",
            typed_stage_mesh: Mesh | None = None, stages_per_rank: int = 1) -> PipelinedPlan:
    """The stages' plans (searched for ``objective``, or a baseline's: ``strategy``) run by the
    schedule: each stage's micro-batch times, the timeline, then each stage's once-a-step
    collectives where torch's schedule runs them (``OncePerStep``): its gathers before its first
    forward, its reductions after its last backward (``typed_stage_mesh``: the stage mesh as
    typed, where ``stage_mesh`` is another view of its devices). ``stages_per_rank``: v, the
    stages each rank runs (``plans`` lists p·v of them in model order)."""
    m = job.micro_batches
    times, optimizer, once = [], 0.0, []
    zero_bubble = schedule_name in ZERO_BUBBLE_SCHEDULES
    for _, plan in plans:
        optimizer_s = plan.compute_by_kind.get("optimizer step", 0.0)
        once.append(once_per_step(plan))
        per_micro_batch = (plan.step_time_s - optimizer_s - once[-1].in_step_s) / m
        forward = per_micro_batch * forward_share(plan)
        weight = min(per_micro_batch - forward, per_micro_batch * weight_share(plan)) if zero_bubble else 0.0
        times.append(StageTimes(forward, per_micro_batch - forward - weight, weight))
        optimizer = max(optimizer, optimizer_s)
    transfers = [_transfer_s(plan, mesh) for _, plan in plans[:-1]]
    schedule = build_schedule(schedule_name, len(plans) // stages_per_rank, m, stages_per_rank)
    timeline = simulate(schedule.actions, times, max(transfers))
    first, last = _first_and_last(schedule.actions, timeline)
    # a stage waits for its gathers only past its fill; its reductions end its part of the step
    late = max(0.0, *(o.before_first_forward_s(t.forward_s) - first[s]
                      for s, (o, t) in enumerate(zip(once, times))))
    makespan = late + max(last[s] + o.after_last_backward_s(t.backward_input_s + t.backward_weight_s)
                          for s, (o, t) in enumerate(zip(once, times)))
    idle = [timeline.idle_s[r] for r in schedule.stage_ranks]
    stages = tuple(StagePlan(stage.first_layer, stage.end_layer, stage.held_micro_batches, plan,
                             float(t.forward_s), float(t.backward_input_s + t.backward_weight_s), float(transfer),
                             float(waiting))
                   for (stage, plan), t, transfer, waiting in zip(plans, times, [*transfers, 0.0], idle))
    return PipelinedPlan(job, objective, schedule_name, mesh, stage_mesh, stages, float(makespan),
                         float(optimizer), strategy, typed_stage_mesh, stages_per_rank)


def _first_and_last(actions, timeline) -> tuple[dict[int, float], dict[int, float]]:
    """Per stage, when its first forward starts and when its last action ends."""
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    for rank_actions, starts, ends in zip(actions, timeline.starts_s, timeline.ends_s):
        for action, start, end in zip(rank_actions, starts, ends):
            first.setdefault(action.stage, start)
            last[action.stage] = max(last.get(action.stage, 0.0), end)
    return first, last


@dataclass(frozen=True)
class OncePerStep:
    """A stage's collectives that run once a step, not once a micro-batch: the gradient
    reductions of its ZeRO-0 and ZeRO-1 parameters, run in the step's last backward (torch's
    stage syncs gradients there only), and the updated-shard all-gathers of its ZeRO-1 and
    ZeRO-2 parameters, run at the step's start (``problem.storage.once_a_step``). ``*_beside_s``:
    of them, what the stage's framework runs beside the compute (``Choice.overlapped_once_s``);
    ``credited_s``: what the stage plan's step counts hidden of them (beside one micro-batch's
    forward and backward together; torch's schedule runs the gathers beside the first forward,
    the reductions beside the last backward)."""

    reductions_s: float
    reductions_beside_s: float
    gathers_s: float
    gathers_beside_s: float
    credited_s: float

    @property
    def in_step_s(self) -> float:
        """What they add to the stage plan's step (their time less the part counted hidden)."""
        return self.reductions_s + self.gathers_s - self.credited_s

    def after_last_backward_s(self, backward_s: float) -> float:
        """The reductions past the last backward, which hides those beside it up to its length."""
        return self.reductions_s - min(self.reductions_beside_s, backward_s)

    def before_first_forward_s(self, forward_s: float) -> float:
        """The gathers before the first forward can start (those beside it hidden up to its length)."""
        return self.gathers_s - min(self.gathers_beside_s, forward_s)


def once_per_step(plan: Plan) -> OncePerStep:
    """``plan``'s :class:`OncePerStep`, from its storage choices' collectives
    (``problem.storage.once_a_step``): a ZeRO-0/1 option reduces once a step, a ZeRO-2/3 one each
    micro-batch; a ZeRO-1/2 option gathers its updated shards once, a ZeRO-3 one each use. Of
    them, a choice's ``overlapped_once_s`` runs beside the compute (split between its
    reductions and gathers by their times); the plan counts hidden of them what its evaluation
    hides, up to one micro-batch's compute (``evaluate.hidden_communication``)."""
    problem, selection = plan.problem, plan.selection
    figures = [0.0, 0.0, 0.0, 0.0]  # reductions, beside; gathers, beside
    compute = 0.0
    for group, k in zip(problem.groups, selection.choices):
        choice = group.choices[k]
        if isinstance(group, OpGroup):
            compute += group.instances * choice.compute_s
            continue
        stage = group.options[k][1].stage
        once = [(call.kind, comm.collective_time(call, problem.mesh)) for call in choice.calls
                if once_a_step(call, stage)]
        total = sum(t for _, t in once)
        beside = choice.overlapped_once_s / total if total > 0 and problem.overlaps else 0.0
        reductions = sum(t for kind, t in once if kind != comm.ALL_GATHER)
        for i, seconds in ((0, reductions), (2, total - reductions)):
            figures[i] += group.instances * seconds
            figures[i + 1] += group.instances * seconds * beside
    credited = min(plan.evaluation.hidden_communication_s, figures[1] + figures[3], compute / problem.micro_batches)
    return OncePerStep(*figures, credited_s=credited)


def forward_share(plan: Plan) -> float:
    """The forward's share of a stage's compute: its ops' forward kernels (``kernels.op_time``)
    over all they compute, backwards and replays included (replays run in the backward)."""
    problem, selection = plan.problem, plan.selection
    forward = every = 0.0
    for group, k in zip(problem.groups, selection.choices):
        if isinstance(group, OpGroup):
            op = problem.graph.ops[group.ops[0]]
            kernels = receive_time(op) or op_time(op, problem.graph, group.strategies[k].local_sizes,
                                                  problem.mesh.hardware)
            forward += group.instances * kernels.forward_s
            every += group.instances * group.choices[k].compute_s / problem.micro_batches
    return forward / every if every > 0 else 0.0


def weight_share(plan: Plan) -> float:
    """The weight gradients' share (W of the zero-bubble schedules) of a stage's compute: of
    each op that multiplies by a weight (``kernels.GEMM_KINDS`` with a parameter input), half
    its backward, the GEMM of the weight's gradient, of the forward's FLOPs (the other half,
    the input's gradient, is I's with everything else, replays included)."""
    problem, selection = plan.problem, plan.selection
    graph = problem.graph
    weight = every = 0.0
    for group, k in zip(problem.groups, selection.choices):
        if isinstance(group, OpGroup):
            op = graph.ops[group.ops[0]]
            every += group.instances * group.choices[k].compute_s / problem.micro_batches
            if op.kind in GEMM_KINDS and any(graph.tensors[x.tensor].kind is TensorKind.PARAMETER for x in op.inputs):
                kernels = op_time(op, graph, group.strategies[k].local_sizes, problem.mesh.hardware)
                weight += group.instances * kernels.backward_s / 2
    return weight / every if every > 0 else 0.0


def _transfer_s(plan: Plan, mesh: Mesh) -> float:
    """One micro-batch's activations from a stage to the next: what each device holds of the
    tensors the stage sends, in the layouts its plan makes them, over one link of the pipeline
    axis (a device's own NIC where the axis crosses nodes)."""
    problem = plan.problem
    graph = problem.graph
    nbytes = sum(tensor_bytes(graph.tensors[t], layout, problem.mesh) for t, layout in sent_layouts(plan).items())
    axis, hardware = mesh.axes[0], mesh.hardware
    crosses_nodes = axis.per_node < axis.size
    bandwidth = hardware.inter_node_bandwidth if crosses_nodes else hardware.intra_node_bandwidth
    latency = hardware.inter_node_step_latency_s if crosses_nodes else hardware.intra_node_step_latency_s
    return hardware.collective_latency_s + latency + nbytes / bandwidth if math.isfinite(bandwidth) else 0.0
