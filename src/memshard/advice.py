"""Where a plan's redundant bytes sit, and what sharding an op further would cost.

``redundancy_by_op``: the redundant bytes live at a schedule point, per op (an op owns its
buffers and gradients, the weights it uses, the activations it produces or keeps).
``advise``: the ops holding the most at the peak, each with the cheapest (in step time)
strategy that splits it over one more mesh axis, the plan re-priced with it, everything else
unchanged (``shard_alternative``). A plan computes its advice when it is built.
"""

from __future__ import annotations

from dataclasses import dataclass

from memshard.cost.memory import StorageOption
from memshard.evaluate import Evaluation, InconsistentPlan, evaluate
from memshard.problem import DURING_RESHARDS, OpGroup, Problem, Selection, storage_links


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


@dataclass(frozen=True)
class RedundantOp:
    op: str
    redundant_bytes: float  # per device, at the peak
    alternative: Alternative | None  # None: no strategy splits it over one more axis


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


def advise(problem: Problem, selection: Selection, evaluation: Evaluation, top: int,
           alternatives: bool = True) -> tuple[RedundantOp, ...]:
    """The ``top`` ops holding the most redundant bytes at the peak (ties by name), each with
    its alternative (``alternatives``; else none)."""
    by_op = redundancy_by_op(problem, selection, evaluation.peak_point)
    group_of = {g.key: i for i, g in enumerate(problem.groups) if isinstance(g, OpGroup)}
    out = []
    for op, nbytes in sorted(by_op.items(), key=lambda kv: (-kv[1], kv[0]))[:top]:
        alternative = (shard_alternative(problem, selection, group_of[op], evaluation)
                       if alternatives and nbytes > 0 else None)
        out.append(RedundantOp(op, nbytes, alternative))
    return tuple(out)

