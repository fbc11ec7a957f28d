"""The result of planning: chosen strategies and storage, predicted figures, versioned JSON.

``build_plan`` reads the solver's selection and the evaluator's figures; ``Plan.to_dict``
writes the ``memshard.plan/1`` schema (all sizes in bytes per device, times in seconds).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from memshard.cost import comm
from memshard.cost.memory import CATEGORIES, StorageOption, param_layout
from memshard.errors import MemshardError
from memshard.evaluate import Evaluation, evaluate
from memshard.files import read_json, write_text_atomically
from memshard.graph import Graph, Origin
from memshard.ilp.solve import SolveResult
from memshard.job import Job, mesh_to_dict
from memshard.mesh import Mesh
from memshard.placement import format_layout
from memshard.problem import (
    DURING_RESHARDS,
    OpGroup,
    Problem,
    Selection,
    StorageGroup,
    build_problem,
    storage_links,
)

SCHEMA = "memshard.plan/1"


@dataclass(frozen=True)
class Plan:
    data: dict[str, Any]
    problem: Problem = field(repr=False, compare=False)
    selection: Selection = field(repr=False, compare=False)
    evaluation: Evaluation = field(repr=False, compare=False)
    job: Job | None = field(default=None, repr=False, compare=False)

    # Convenience accessors for the figures people ask for most.
    @property
    def peak_bytes(self) -> float:
        return self.data["memory"]["peak_bytes_per_device"]

    @property
    def lower_bound_bytes(self) -> float:
        return self.data["memory"]["lower_bound_bytes_per_device"]

    @property
    def redundant_bytes(self) -> float:
        return self.data["memory"]["redundant_bytes_per_device"]

    @property
    def step_time_s(self) -> float:
        return self.data["estimated_step_time_s"]

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(self.data))

    def to_json(self) -> str:
        return json.dumps(self.data, indent=2, sort_keys=False) + "\n"

    def save(self, path: str) -> None:
        write_text_atomically(path, self.to_json())

    def report(self, top: int = 10) -> str:
        from memshard.report import render_plan_text

        return render_plan_text(self, top=top)


def _assignment_dict(assignment, mesh: Mesh) -> dict:
    return {mesh.axis_names[a]: d for a, d in enumerate(assignment) if d is not None}


def redundancy_by_op(problem: Problem, selection: Selection, point: int) -> dict[str, float]:
    """Redundant bytes live at ``point`` per op role: an op owns its buffers and gradients,
    the weights it uses, and the activations it produces or keeps."""
    owner: dict[int, str] = {}
    for gid, grp in enumerate(problem.groups):
        if isinstance(grp, OpGroup):
            owner[gid] = grp.key
    for link in storage_links(problem):
        owner[link.a] = problem.groups[link.b].key
    out: dict[str, float] = {}
    for s in problem.slots:
        if s.start <= point <= s.end and s.phase != DURING_RESHARDS:  # (the moment before the reshards)
            key = owner[s.group]
            out[key] = out.get(key, 0.0) + float(s.redundant[selection.choices[s.group]])
    seen: dict[int, set] = {}
    for h in problem.holders:
        if not (h.start <= point <= h.end):
            continue
        layout = problem.holder_layout(selection, h)
        if layout is None:
            continue
        held = problem.held[h.tensor]
        lid = held.layout_id(layout)
        if lid in seen.setdefault(h.tensor, set()):
            continue
        seen[h.tensor].add(lid)
        gid = h.source if h.kind == "producer" else problem.edges[h.source].consumer
        key = problem.groups[gid].key
        out[key] = out.get(key, 0.0) + float(held.redundant[lid])
    return out


def build_plan(
    problem: Problem,
    result: SolveResult | None,
    selection: Selection | None = None,
    *,
    job: Job | None = None,
    constraints: dict | None = None,
    top: int = 10,
    strategy_name: str = "memshard",
) -> Plan:
    selection = selection or result.selection
    ev = evaluate(problem, selection)
    mesh = problem.mesh
    graph = problem.graph
    sched = problem.schedule

    ops = []
    for gid, grp in enumerate(problem.groups):
        if not isinstance(grp, OpGroup):
            continue
        s = grp.strategies[selection.choices[gid]]
        first = graph.ops[grp.ops[0]]
        choice = grp.choices[selection.choices[gid]]
        ops.append({
            "name": grp.key,
            "kind": first.kind,
            "instances": grp.instances,
            "einsum": ",".join("".join(x.dims) for x in first.inputs) + "->" + "".join(first.output.dims),
            "split": _assignment_dict(s.assignment, mesh),
            "input_layouts": {x.tensor.split(".", 2)[-1] if first.layer is not None else x.tensor: format_layout(L)
                              for x, L in zip(first.inputs, s.input_layouts)},
            "output_layout": format_layout(s.output_layout),
            "compute_time_s": choice.compute_s * grp.instances,
        })
    params = []
    for gid, grp in enumerate(problem.groups):
        if not isinstance(grp, StorageGroup):
            continue
        G, opt = grp.options[selection.choices[gid]]
        mem = grp.memory[selection.choices[gid]]
        params.append({
            "names": grp.params if len(grp.params) <= 4 else grp.params[:2] + ["…"] + grp.params[-1:],
            "instances": grp.instances,
            "shape": list(graph.tensors[grp.params[0]].shape),
            "layout": format_layout(param_layout(G)),
            "gradient_layout": _grad_text(G),
            "storage": StorageOption(opt.stage, opt.axes).name(mesh),
            "zero_stage": opt.stage,
            "storage_axes": [mesh.axis_names[a] for a in opt.axes],
            "bytes_per_device": {"parameters": mem.parameters, "gradients": mem.gradients,
                                 "optimizer_states": mem.optimizer_states},
        })
    edges = []
    for e, edge in enumerate(problem.edges):
        lp, lc, _, _, keep = problem.edge_layouts(selection, e)
        calls = problem.edge_calls(selection, e)
        if not calls and not keep:
            continue
        edges.append({
            "name": edge.key,
            "instances": edge.instances,
            "producer_layout": format_layout(lp),
            "consumer_layout": format_layout(lc),
            "saved_in_producer_layout": keep,
            "collectives": [c.kind for c in calls],
            "bytes_per_step": comm.total_wire_bytes(calls, mesh) * edge.executions,
        })

    red_by_op = redundancy_by_op(problem, selection, ev.peak_point)
    top_ops = sorted(red_by_op.items(), key=lambda kv: (-kv[1], kv[0]))[:top]
    data = {
        "schema": SCHEMA,
        "strategy": strategy_name,
        "model": {"name": graph.name, "num_parameters": graph.num_parameters, "num_layers": graph.num_layers,
                  "precision": graph.precision.name, **_traced_info(graph),
                  **(job.to_dict()["model"] if job is not None else {})},
        "mesh": mesh_to_dict(mesh),
        "objective": result.objective if result else None,
        "constraints": constraints or {},
        "memory": {
            "peak_bytes_per_device": ev.peak_bytes,
            "peak_at": sched.describe(ev.peak_point, graph),
            "breakdown": {c: ev.breakdown[c] for c in CATEGORIES},
            "redundant_bytes_per_device": ev.redundant_bytes,
            "lower_bound_bytes_per_device": ev.lower_bound_bytes,
            "lower_bound_at": sched.describe(ev.lower_bound_point, graph),
            "above_lower_bound": ev.peak_bytes / ev.lower_bound_bytes - 1 if ev.lower_bound_bytes else 0.0,
            "device_memory_bytes": mesh.device_memory_bytes,
            "fits": bool(ev.peak_bytes <= mesh.device_memory_bytes),
        },
        "communication": {
            "bytes_per_step_per_device": ev.communication_bytes,
            "by_kind": ev.communication_by_kind,
        },
        "estimated_step_time_s": ev.step_time_s,
        "compute_time_s": ev.compute_time_s,
        "communication_time_s": ev.communication_time_s,
        "solver": {
            "status": result.status if result else "fixed",
            "time_s": result.time_s if result else 0.0,
            "gap": result.gap if result else 0.0,
            "variables": result.variables if result else 0,
            "constraints": result.constraints if result else 0,
            "shared_layers": problem.shared_layers,
            "zero3_unit": problem.zero3_unit,
            "search_space": result.search_space if result else "fixed plan",
        },
        "most_redundant_ops": [{"op": k, "redundant_bytes_per_device": v} for k, v in top_ops],
        "ops": ops,
        "parameters": params,
        "reshards": edges,
    }
    return Plan(_plain(data), problem, selection, ev, job)


def _plain(obj):
    """numpy scalars → Python numbers, so the JSON is stable and byte-identical across runs."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def load_plan(source: str | dict) -> Plan:
    """A plan from its JSON (a path or the parsed dict): the job is rebuilt from the recorded
    model, mesh and batch, and every op, parameter and edge takes the recorded choice."""

    data = read_json(source, "plan") if isinstance(source, str) else source
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise MemshardError(f"not a memshard plan (expected schema {SCHEMA!r})")
    try:
        return _rebuild(data)
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise MemshardError(f"the plan does not match memshard's model of this job: {e!r}") from None


def _rebuild(data: dict) -> Plan:
    job = Job.from_dict(data)
    mesh = job.mesh
    problem = build_problem(job.graph, mesh, shared_layers=data["solver"]["shared_layers"],
                            micro_batches=job.micro_batches, zero3_unit=data["solver"].get("zero3_unit", "op"))
    choices = [0] * len(problem.groups)
    by_key = {grp.key: gid for gid, grp in enumerate(problem.groups) if isinstance(grp, OpGroup)}
    for entry in data["ops"]:
        gid = by_key[entry["name"]]
        names = [s.assignment for s in problem.groups[gid].strategies]
        choices[gid] = [_assignment_dict(a, mesh) for a in names].index(entry["split"])
    for entry in data["parameters"]:
        gid = problem.storage_group[entry["names"][0]]
        axes = tuple(mesh.axis_names.index(a) for a in entry["storage_axes"])
        labels = [(format_layout(param_layout(G)), opt.stage, opt.axes) for G, opt in problem.groups[gid].options]
        grads = [_grad_text(G) for G, _ in problem.groups[gid].options]
        choices[gid] = next(i for i, (lab, g) in enumerate(zip(labels, grads))
                            if lab == (entry["layout"], entry["zero_stage"], axes) and g == entry["gradient_layout"])
    keeps = [0] * len(problem.edges)
    by_edge = {e.key: i for i, e in enumerate(problem.edges)}
    for entry in data["reshards"]:
        keeps[by_edge[entry["name"]]] = int(entry["saved_in_producer_layout"])
    selection = Selection(tuple(choices), tuple(keeps))
    rebuilt = build_plan(problem, None, selection, job=job, constraints=data.get("constraints"),
                         strategy_name=data.get("strategy", "memshard"))
    rebuilt.data["objective"] = data.get("objective")
    rebuilt.data["solver"] = data["solver"]
    return rebuilt


def _traced_info(graph: Graph) -> dict:
    """For a traced module: the ATen ops memshard has no description for (planned replicated)."""
    if graph.origin is not Origin.TRACED:
        return {}
    return {"unknown_ops": graph.unknown_ops}


def _grad_text(G: tuple[str, ...]) -> str:
    return "".join("P" if g == "P" else ("R" if g == "R" else f"S({g[1:]})") for g in G)
