"""A pipelined plan, as data: the job's layers in contiguous stages over a pipeline axis, each
stage's own plan on its rank's share of the devices, and the step the schedule makes of them
(``plan.PIPELINE_SCHEMA`` JSON: sizes in bytes per device, times in seconds).

A stage's plan is an ordinary :class:`~memshard.plans.plan.Plan` of that stage's problem (its
layers, the micro-batches it holds at its peak); the pipelined plan adds what the stages do
together: the step's timeline (``problem.pipeline.simulate``), its bubble and transfers.

``PipelinedPlan.from_dict`` reads the JSON back: each stage's plan rebuilt on its stage's
problem with its recorded choices; ``load_any_plan`` reads either kind of plan file (what
``memshard run`` and the torchrun worker accept).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from memshard.core.errors import MemshardError
from memshard.core.files import read_json, write_text_atomically
from memshard.core.mesh import Mesh
from memshard.job import Job, mesh_from_dict, mesh_to_dict
from memshard.plans.plan import PIPELINE_SCHEMA, Plan, plan_from_dict
from memshard.problem.records import PipelineStage


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

    @property
    def step_time_s(self) -> float:
        return self.makespan_s + self.optimizer_s

    @property
    def peak_bytes(self) -> float:
        return max(stage.plan.peak_bytes for stage in self.stages)

    @property
    def peak_stage(self) -> StagePlan:
        """The stage whose ranks hold the most (the first of equals)."""
        return max(self.stages, key=lambda stage: stage.plan.peak_bytes)

    @property
    def bubble_s(self) -> float:
        """The least time a stage's ranks wait in the step: the fill and drain no rank avoids."""
        return min(stage.idle_s for stage in self.stages)

    @property
    def fits(self) -> bool:
        return all(stage.plan.memory.fits for stage in self.stages)

    def to_dict(self) -> dict[str, Any]:
        job = self.job.to_dict()
        return {
            "schema": PIPELINE_SCHEMA,
            "strategy": self.strategy,
            "objective": self.objective,
            "model": {"name": self.job.graph.name, **job["model"]}, "job_mesh": job["mesh"],
            "pipeline": {"stages": len(self.stages), "schedule": self.schedule,
                         "micro_batches": self.job.micro_batches, "mesh": mesh_to_dict(self.mesh),
                         "stage_mesh": mesh_to_dict(self.stage_mesh),
                         **({"typed_stage_mesh": mesh_to_dict(self.typed_stage_mesh)}
                            if self.typed_stage_mesh is not None else {})},
            "step_time_s": self.step_time_s, "makespan_s": self.makespan_s, "optimizer_s": self.optimizer_s,
            "bubble_s": self.bubble_s, "peak_bytes_per_device": self.peak_bytes, "fits": self.fits,
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
        if not isinstance(data, dict) or data.get("schema") != PIPELINE_SCHEMA:
            raise MemshardError(f"not a pipelined memshard plan (expected schema {PIPELINE_SCHEMA!r})")
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
                         mesh_from_dict(pipeline["typed_stage_mesh"]) if "typed_stage_mesh" in pipeline else None)


def load_any_plan(path: str) -> Plan | PipelinedPlan:
    """The plan saved at ``path``: a pipelined plan (``PIPELINE_SCHEMA``) or an ordinary one."""
    data = read_json(path, "plan")
    if isinstance(data, dict) and data.get("schema") == PIPELINE_SCHEMA:
        return PipelinedPlan.from_dict(data)
    return plan_from_dict(data)
