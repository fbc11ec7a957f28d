"""What sharding an op further would cost: re-price the plan with one more mesh axis
splitting that op, everything else unchanged."""

from __future__ import annotations

from dataclasses import dataclass

from memshard.cost.memory import StorageOption
from memshard.evaluate import Evaluation, InconsistentPlan, evaluate
from memshard.problem import Problem, Selection, storage_links


@dataclass(frozen=True)
class Alternative:
    op: str
    split: dict[str, str]  # mesh axis → op dim, the new strategy
    peak_delta_bytes: float
    redundant_delta_bytes: float
    step_time_delta_s: float
    communication_delta_bytes: float


def reselect(problem: Problem, selection: Selection, gid: int, choice: int) -> Selection:
    """``selection`` with op group ``gid`` switched to strategy ``choice``; its parameters keep
    their ZeRO stage on the axes still free, and its edges stop keeping copies."""
    choices = list(selection.choices)
    choices[gid] = choice
    for link in storage_links(problem):
        if link.b != gid:
            continue
        options = problem.groups[link.a].options
        _, old = options[selection.choices[link.a]]
        new_g = link.b_labels[choice]
        free = {a for a, g in enumerate(new_g) if not g.startswith("S")}
        axes = tuple(a for a in old.axes if a in free)
        want = StorageOption(old.stage if axes else 0, axes)
        choices[link.a] = options.index((new_g, want))
    keeps = tuple(0 if gid in (e.producer, e.consumer) else k for e, k in zip(problem.edges, selection.keeps))
    return Selection(tuple(choices), keeps)


def shard_alternative(problem: Problem, selection: Selection, gid: int, base: Evaluation) -> Alternative | None:
    """The cheapest (in step time) strategy that splits the op over one more mesh axis."""
    grp = problem.groups[gid]
    strategies = grp.strategies
    current = strategies[selection.choices[gid]].assignment
    best = None
    for k, s in enumerate(strategies):
        changed = [(a, b) for a, b in zip(current, s.assignment) if a != b]
        if len(changed) != 1 or changed[0][0] is not None:
            continue
        try:
            ev = evaluate(problem, reselect(problem, selection, gid, k))
        except (InconsistentPlan, ValueError):
            continue  # a tied weight or another link forbids it
        alt = Alternative(
            op=grp.key,
            split={problem.mesh.axis_names[a]: d for a, d in enumerate(s.assignment) if d is not None},
            peak_delta_bytes=ev.peak_bytes - base.peak_bytes,
            redundant_delta_bytes=ev.redundant_bytes - base.redundant_bytes,
            step_time_delta_s=ev.step_time_s - base.step_time_s,
            communication_delta_bytes=ev.communication_bytes - base.communication_bytes,
        )
        if best is None or (alt.step_time_delta_s, alt.peak_delta_bytes) < (best.step_time_delta_s, best.peak_delta_bytes):
            best = alt
    return best
