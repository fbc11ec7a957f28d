"""A pipelined plan, as data: the job's layers in contiguous stages over a pipeline axis, each
stage's own plan on its rank's share of the devices, and the step the schedule makes of them
(``plan.PIPELINE_SCHEMA`` JSON: sizes in bytes per device, times in seconds).

A stage's plan is an ordinary :class:`~memshard.plans.plan.Plan` of that stage's problem (its
layers, the micro-batches it holds at its peak); the pipelined plan adds what the stages do
together: the step's timeline (``problem.pipeline.simulate``), its bubble and transfers.

A rank may hold several stages (``stages_per_rank`` v > 1: the interleaved schedules, ZBV):
``stages`` then lists all p·v stages in model order, stage s on the rank the schedule places it
(``problem.pipeline.stage_ranks``). A rank's peak is counted from its action list
(``problem.pipeline.rank_peak_bytes``) with each of its stages' :class:`ChunkMemory`, read
from the stage's priced plan (:func:`chunk_memory`); a plan of one stage per rank keeps its
stage's own peak. Such a plan is written as ``PIPELINE_SCHEMA_V`` (``stages_per_rank``
added); one stage per rank is still written, and read, as ``PIPELINE_SCHEMA``.

``PipelinedPlan.from_dict`` reads the JSON back: each stage's plan rebuilt on its stage's
problem with its recorded choices; ``load_any_plan`` reads either kind of plan file (what
``memshard run`` and the torchrun worker accept).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, replace
from typing import Any

from memshard.core.errors import MemshardError
from memshard.core.files import read_json, write_text_atomically
from memshard.core.graph import TensorKind
from memshard.core.mesh import Mesh
from memshard.job import Job, mesh_from_dict, mesh_to_dict
from memshard.plans.plan import PIPELINE_SCHEMA, Plan, plan_from_dict
from memshard.problem.evaluate import Evaluation, evaluate
from memshard.problem.memory import CATEGORIES, tensor_bytes
from memshard.problem.pipeline import ChunkMemory, ChunkPhase, build_schedule, rank_peak_bytes
from memshard.problem.pricing import build_problem
from memshard.problem.records import MEGATRON_FRAMEWORKS, MEMSHARD, PipelineStage, without_partial

PIPELINE_SCHEMA_V = "memshard.pipeline/2"  # several stages per rank (``stages_per_rank``)
CATEGORY_ACTIVATIONS = CATEGORIES.index("activations")
SINGLE_STAGE_SCHEDULES = ("1f1b", "gpipe")  # one stage per rank, its peak its stage's own


@dataclass(frozen=True)
class StagePlan:
    """One stage: layers [first_layer, end_layer) of the model (the first stage also runs the
    embedding, the last the head and the loss), the micro-batches its ranks hold at their peak,
    its plan, and the times the schedule is priced with: one micro-batch's forward and backward
    on it, and sending that micro-batch's activations to the next stage (0 on the last)."""

    first_layer: int
    end_layer: int
    held_micro_batches: int
    plan: Plan
    forward_s: float
    backward_s: float
    transfer_s: float
    idle_s: float  # its ranks' time waiting in the step (the bubble, as they see it)

    @property
    def num_layers(self) -> int:
        return self.end_layer - self.first_layer


@dataclass(frozen=True)
class PipelinedPlan:
    """``job`` on ``mesh`` (the job's mesh with its outermost axis split into the pipeline
    axis and the rest): ``stages`` ranks along the pipeline axis run ``schedule``, each on
    ``stage_mesh``. The step is the schedule's makespan plus the slowest optimizer step.
    ``strategy``: ``memshard`` (each stage searched for ``objective``) or a pipelined baseline's
    name (``megatron-tp2-pp2-dp2``…, objective None), each stage's plan that recipe's.
    ``typed_stage_mesh``: the stage mesh as typed, where the stages lie on another view of its
    devices (``core.mesh.mesh_views``): ``stage_mesh`` is then that view, every stage's, and
    ``mesh`` the pipeline axis and the view's axes; None where the stages lie on it as typed."""

    job: Job
    objective: str | None
    schedule: str
    mesh: Mesh
    stage_mesh: Mesh
    stages: tuple[StagePlan, ...]
    makespan_s: float  # the micro-batches' forwards, backwards and transfers, as scheduled
    optimizer_s: float  # the slowest stage's optimizer step, after the last backward
    strategy: str = "memshard"
    typed_stage_mesh: Mesh | None = None
    stages_per_rank: int = 1  # v: the pipeline has len(stages) / v ranks

    @property
    def step_time_s(self) -> float:
        return self.makespan_s + self.optimizer_s

    @property
    def ranks(self) -> int:
        """p: the ranks along the pipeline axis."""
        return len(self.stages) // self.stages_per_rank

    @property
    def stage_ranks(self) -> tuple[int, ...]:
        """The pipeline rank each stage runs on."""
        return build_schedule(self.schedule, self.ranks, self.job.micro_batches, self.stages_per_rank).stage_ranks

    @functools.cached_property
    def rank_peaks(self) -> tuple[float, ...]:
        """Each pipeline rank's peak: its stage's own, or with several stages per rank (or a
        zero-bubble schedule) counted from its action list (``problem.pipeline.rank_peak_bytes``)."""
        if self.schedule in SINGLE_STAGE_SCHEDULES:
            return tuple(stage.plan.peak_bytes for stage in self.stages)
        schedule = build_schedule(self.schedule, self.ranks, self.job.micro_batches, self.stages_per_rank)
        zero_bubble = any(a.kind == "W" for actions in schedule.actions for a in actions)
        chunks = {s: chunk_memory(stage.plan, zero_bubble) for s, stage in enumerate(self.stages)}
        return tuple(rank_peak_bytes(actions, chunks) for actions in schedule.actions)

    @property
    def peak_bytes(self) -> float:
        return max(self.rank_peaks)

    @property
    def peak_stage(self) -> StagePlan:
        """The stage whose plan's own peak is the largest (the first of equals); with one
        stage per rank, the stage whose ranks hold the most."""
        return max(self.stages, key=lambda stage: stage.plan.peak_bytes)

    @property
    def peak_rank(self) -> int:
        """The pipeline rank that holds the most (the first of equals)."""
        return max(range(self.ranks), key=lambda r: (self.rank_peaks[r], -r))

    @property
    def bubble_s(self) -> float:
        """The least time a stage's ranks wait in the step: the fill and drain no rank avoids."""
        return min(stage.idle_s for stage in self.stages)

    @property
    def fits(self) -> bool:
        if self.schedule in SINGLE_STAGE_SCHEDULES:
            return all(stage.plan.memory.fits for stage in self.stages)
        return self.peak_bytes <= self.stage_mesh.device_memory_bytes

    def to_dict(self) -> dict[str, Any]:
        job = self.job.to_dict()
        several = {"stages_per_rank": self.stages_per_rank} if self.schedule not in SINGLE_STAGE_SCHEDULES else {}
        return {
            "schema": PIPELINE_SCHEMA_V if several else PIPELINE_SCHEMA,
            "strategy": self.strategy,
            "objective": self.objective,
            "model": {"name": self.job.graph.name, **job["model"]}, "job_mesh": job["mesh"],
            "pipeline": {"stages": len(self.stages), "schedule": self.schedule,
                         "micro_batches": self.job.micro_batches, "mesh": mesh_to_dict(self.mesh),
                         "stage_mesh": mesh_to_dict(self.stage_mesh), **several,
                         **({"typed_stage_mesh": mesh_to_dict(self.typed_stage_mesh)}
                            if self.typed_stage_mesh is not None else {})},
            "step_time_s": self.step_time_s, "makespan_s": self.makespan_s, "optimizer_s": self.optimizer_s,
            "bubble_s": self.bubble_s, "peak_bytes_per_device": self.peak_bytes, "fits": self.fits,
            **({"rank_peak_bytes": list(self.rank_peaks)} if several else {}),
            "stages": [{"layers": [stage.first_layer, stage.end_layer],
                        "held_micro_batches": stage.held_micro_batches, "forward_s": stage.forward_s,
                        "backward_s": stage.backward_s, "transfer_s": stage.transfer_s, "idle_s": stage.idle_s,
                        "plan": stage.plan.to_dict()} for stage in self.stages],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def save(self, path: str) -> None:
        write_text_atomically(path, self.to_json())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PipelinedPlan:
        """The plan :meth:`to_dict` wrote: each stage's plan rebuilt with its recorded choices
        (``plan_from_dict``). A file without the job's model and mesh (written before they were
        recorded) takes them from its first stage's plan, on the pipelined mesh."""
        if not isinstance(data, dict) or data.get("schema") not in (PIPELINE_SCHEMA, PIPELINE_SCHEMA_V):
            raise MemshardError(f"not a pipelined memshard plan (expected schema {PIPELINE_SCHEMA!r} or "
                                f"{PIPELINE_SCHEMA_V!r})")
        try:
            return _read(data)
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise MemshardError(f"the pipelined plan does not match memshard's model of this job: {e!r}") from None


def _read(data: dict[str, Any]) -> PipelinedPlan:
    pipeline, entries = data["pipeline"], data["stages"]
    mesh = mesh_from_dict(pipeline["mesh"])
    whole = data.get("model") or {**entries[0]["plan"]["model"],
                                  "name": re.sub(r"\[\d+:\d+\]$", "", entries[0]["plan"]["model"]["name"])}
    job = Job.from_dict({"model": whole, "mesh": data.get("job_mesh") or pipeline["mesh"]})
    stages = []
    for entry in entries:
        first, end = entry["layers"]
        held = int(entry["held_micro_batches"])
        plan = plan_from_dict({**entry["plan"], "model": {**entry["plan"]["model"], "name": whole["name"]}},
                              stage=PipelineStage(first, end, held))
        stages.append(StagePlan(first, end, held, plan, float(entry["forward_s"]), float(entry["backward_s"]),
                                float(entry["transfer_s"]), float(entry["idle_s"])))
    return PipelinedPlan(job, data.get("objective"), pipeline["schedule"], mesh, mesh_from_dict(pipeline["stage_mesh"]),
                         tuple(stages), float(data["makespan_s"]), float(data["optimizer_s"]),
                         data.get("strategy", "memshard"),
                         mesh_from_dict(pipeline["typed_stage_mesh"]) if "typed_stage_mesh" in pipeline else None,
                         int(pipeline.get("stages_per_rank", 1)))


def load_any_plan(path: str) -> Plan | PipelinedPlan:
    """The plan saved at ``path``: a pipelined plan (``PIPELINE_SCHEMA``) or an ordinary one."""
    data = read_json(path, "plan")
    if isinstance(data, dict) and data.get("schema") in (PIPELINE_SCHEMA, PIPELINE_SCHEMA_V):
        return PipelinedPlan.from_dict(data)
    return plan_from_dict(data)


def chunk_memory(plan: Plan, zero_bubble: bool = False) -> ChunkMemory:
    """A stage's :class:`ChunkMemory` from its priced plan: its two phases from the plan on its
    stage's problem holding all m micro-batches (every forward first: no gradient accumulated
    in the first backward) and holding fewer (the gradients held from the start, a new one
    beside them in each backward), whichever of them the plan is of evaluated again on the
    other (``phase_evaluation``); S from the plan's own; ``zero_bubble``: G, the output gradient
    of every op that reads a weight, in its output layout (torch keeps them from I to W); R, the
    input gradient its backward sends back, which torch's multi-stage schedules keep to the
    step's end (none under Megatron-LM's schedule, which frees what it sent). A baseline's stage
    (Megatron-LM's, whose gradient buffer is held all step) has the one phase its problem
    prices."""
    problem = plan.problem
    m, k = problem.micro_batches, problem.stage.held_micro_batches
    alike = problem.framework != MEMSHARD  # (a baseline's stage: its framework's graph, one phase)
    first = plan.evaluation if k == m or alike else phase_evaluation(plan, m)
    later = plan.evaluation if k < m or m == 1 or alike else phase_evaluation(plan, m - 1)
    weight_inputs = 0.0
    if zero_bubble:
        graph = problem.graph
        for i, op in enumerate(graph.ops):
            if any(graph.tensors[x.tensor].kind is TensorKind.PARAMETER for x in op.inputs):
                layout = without_partial(problem.strategy(plan.selection, problem.op_group[i]).output_layout)
                weight_inputs += tensor_bytes(graph.tensors[op.output.tensor], layout, problem.mesh)
    ev = plan.evaluation
    return ChunkMemory(_phase(problem, first, m), _phase(problem, later, max(1, m - 1) if k == m else k),
                       float(ev.boundary_activation_bytes), weight_inputs,
                       float(later.live_bytes[problem.schedule.optimizer]),
                       0.0 if problem.framework in MEGATRON_FRAMEWORKS else received_bytes(plan))


def received_bytes(plan: Plan) -> float:
    """What one micro-batch of a stage receives (and sends back the gradient of): each received
    tensor in its ``RECEIVE`` op's layout, bytes per device (0 on the first stage)."""
    problem = plan.problem
    graph = problem.graph
    out = 0.0
    for name in graph.received:
        i, j = graph.consumers[name][0]
        layout = problem.strategy(plan.selection, problem.op_group[i]).input_layouts[j]
        out += tensor_bytes(graph.tensors[name], layout, problem.mesh)
    return out


def phase_evaluation(plan: Plan, held: int) -> Evaluation:
    """``plan``'s choices priced on its stage's problem holding ``held`` micro-batches (the
    same groups and choices: the phases differ in when gradients are held, not in what is
    chosen)."""
    problem = plan.problem
    other = build_problem(problem.graph, problem.mesh, shared_layers=problem.shared_layers,
                          micro_batches=problem.micro_batches, zero3_unit=problem.zero3_unit,
                          recompute=problem.recompute, framework=problem.framework,
                          stage=replace(problem.stage, held_micro_batches=held))
    if [len(g.choices) for g in other.groups] != [len(g.choices) for g in problem.groups] or len(
            other.edges) != len(problem.edges):
        raise MemshardError(f"stage {problem.graph.name}: its problem holding {held} micro-batches has other "
                            "choices; its phases cannot be priced alike")
    return evaluate(other, plan.selection)


def _phase(problem, evaluation: Evaluation, held: int) -> ChunkPhase:
    """One phase of a stage from an evaluation of its problem holding ``held`` micro-batches:
    one micro-batch's live bytes (the held − 1 others' S taken off), the least of them less
    its activations (its idle bytes), their worst over the forward's and the backward's points."""
    schedule = problem.schedule
    boundary, optimizer = schedule.boundary, schedule.optimizer
    waiting = (held - 1) * evaluation.boundary_activation_bytes
    live = evaluation.live_bytes[:optimizer] - waiting
    activations = evaluation.category_bytes[CATEGORY_ACTIVATIONS, :optimizer] - waiting
    return ChunkPhase(float((live - activations).min()), float(live[:boundary].max()), float(live[boundary:].max()))
