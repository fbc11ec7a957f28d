"""Price one complete plan: live bytes at every schedule point, the peak and its breakdown,
redundant bytes, the zero-redundancy bound, communication and step time.

The evaluator reads the same :class:`~memshard.problem.Problem` the ILP is built from, but
sums it directly (no linearisation), so it is the reference the solver is tested against.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from memshard.bounds import zero_redundancy_bound
from memshard.cost import comm
from memshard.cost.memory import CATEGORIES
from memshard.problem import DURING_RESHARDS, REGATHER, Problem, Selection


@dataclass(frozen=True)
class Evaluation:
    peak_bytes: float
    peak_point: int
    breakdown: dict[str, float]
    redundant_bytes: float
    lower_bound_bytes: float
    lower_bound_point: int
    step_time_s: float
    compute_time_s: float
    communication_time_s: float
    communication_bytes: float
    communication_by_kind: dict[str, dict[str, float]]
    live_bytes: np.ndarray  # per schedule point
    category_bytes: np.ndarray  # per category (CATEGORIES' order) × schedule point

    def breakdown_at(self, point: int) -> dict[str, float]:
        """Live bytes per category at schedule point ``point``."""
        return {c: float(self.category_bytes[k, point]) for k, c in enumerate(CATEGORIES)}


class InconsistentPlan(ValueError):
    pass


def check_links(problem: Problem, selection: Selection) -> None:
    for link in problem.links:
        a = link.a_labels[selection.choices[link.a]]
        b = link.b_labels[selection.choices[link.b]]
        if a != b:
            raise InconsistentPlan(
                f"{problem.groups[link.a].key} and {problem.groups[link.b].key} disagree: {a} vs {b}"
            )


def _priced(problem: Problem, selection: Selection) -> list[tuple[int, float, tuple[comm.Collective, ...]]]:
    """(times run per step, compute seconds, collectives) of every op, parameter and edge."""
    priced = [(g.instances, g.choices[k].compute_s, g.choices[k].calls)
              for g, k in zip(problem.groups, selection.choices)]
    return priced + [(edge.executions, 0.0, problem.edge_calls(selection, e)) for e, edge in enumerate(problem.edges)]


def step_time(problem: Problem, selection: Selection) -> float:
    """The plan's estimated step time (``evaluate(...).step_time_s`` without the memory)."""
    return sum(n * (compute_s + sum(comm.collective_time(c, problem.mesh) for c in calls))
               for n, compute_s, calls in _priced(problem, selection))


def evaluate(problem: Problem, selection: Selection) -> Evaluation:
    check_links(problem, selection)
    for e, edge in enumerate(problem.edges):
        layouts = problem.edge_layouts(selection, e)
        if layouts.kept and not edge.can_keep(layouts.producer, layouts.consumer):
            raise InconsistentPlan(f"edge {edge.key} cannot keep its copy in layout {layouts.producer}")
    n_points = problem.schedule.num_points
    cat_index = {c: k for k, c in enumerate(CATEGORIES)}
    live = np.zeros((len(CATEGORIES), n_points + 1))
    redundant = np.zeros(n_points + 1)

    def add(start, end, category, nbytes, red):
        live[cat_index[category], start] += nbytes
        live[cat_index[category], end + 1] -= nbytes
        redundant[start] += red
        redundant[end + 1] -= red

    for c in problem.constants:
        add(c.start, c.end, c.category, c.nbytes, c.redundant)
    # What changes at a slot's last point while the reshards there run (Slot.phase).
    swap = defaultdict(lambda: np.zeros(len(CATEGORIES) + 1))  # point → per category, redundant
    for s in problem.slots:
        k = selection.choices[s.group]
        if s.phase != DURING_RESHARDS:
            add(s.start, s.end, s.category, s.nbytes[k], s.redundant[k])
        if s.reshard_change:
            swap[s.end][cat_index[s.category]] += s.reshard_change * s.nbytes[k]
            swap[s.end][-1] += s.reshard_change * s.redundant[k]

    by_tensor = defaultdict(list)
    for h in problem.holders:
        layout = problem.holder_layout(selection, h)
        if layout is not None:
            tensor = (problem.holder_identity(selection, h), problem.held[h.tensor].layout_id(layout))
            by_tensor[h.tensor].append((h.start, h.end, tensor, h.kind == REGATHER))
    for t, entries in by_tensor.items():
        held = problem.held[t]
        cuts = sorted({s for s, _, _, _ in entries} | {e + 1 for _, e, _, _ in entries})
        for lo, hi in zip(cuts, cuts[1:]):
            # A copy only re-gathered for a backward is made there and dropped after: a transient.
            ids: dict[tuple, bool] = {}
            for s, e, tensor, regather in entries:
                if s <= lo and hi - 1 <= e:
                    ids[tensor] = ids.get(tensor, True) and regather
            for category, only_regathered in (("activations", False), ("transients", True)):
                mine = [i for (_, i), r in ids.items() if r == only_regathered]
                if mine:
                    add(lo, hi - 1, category, sum(held.nbytes[i] for i in mine),
                        sum(held.redundant[i] for i in mine))

    extra: dict[int, float] = defaultdict(float)  # one reshard at a time: the largest counts
    for rp in problem.reshard_points:
        extra[rp.point] = max(extra[rp.point], *problem.reshard_rows(selection, rp))
    # A point holds the larger of its two moments: before its reshards, and while the largest
    # runs (with what changed in between).
    for point, nbytes in extra.items():
        change = swap[point].copy()
        change[cat_index["transients"]] += nbytes
        if change[:-1].sum() > 0:
            for k, c in enumerate(CATEGORIES):
                add(point, point, c, change[k], 0.0)
            redundant[point] += change[-1]
            redundant[point + 1] -= change[-1]

    live = np.cumsum(live, axis=1)[:, :n_points]
    total = live.sum(axis=0)
    peak_point = int(np.argmax(total))
    bound = zero_redundancy_bound(problem)
    bound_point = int(np.argmax(bound))

    compute = communication = wire = 0.0
    by_kind: dict[str, dict[str, float]] = {k: {"calls": 0, "buffer_bytes": 0.0, "wire_bytes": 0.0} for k in comm.KINDS}
    for instances, compute_s, calls in _priced(problem, selection):
        compute += instances * compute_s
        for call in calls:
            w = comm.wire_bytes(call, problem.mesh)
            communication += instances * comm.collective_time(call, problem.mesh)
            wire += instances * w
            entry = by_kind[call.kind]
            entry["calls"] += instances * call.share
            entry["buffer_bytes"] += instances * call.buffer_bytes
            entry["wire_bytes"] += instances * w
    for entry in by_kind.values():  # unit members each count a share of their unit's calls
        entry["calls"] = round(entry["calls"])
    return Evaluation(
        peak_bytes=float(total[peak_point]),
        peak_point=peak_point,
        breakdown={c: float(live[k, peak_point]) for k, c in enumerate(CATEGORIES)},
        redundant_bytes=float(np.cumsum(redundant)[peak_point]),
        lower_bound_bytes=float(bound[bound_point]),
        lower_bound_point=bound_point,
        step_time_s=compute + communication,
        compute_time_s=compute,
        communication_time_s=communication,
        communication_bytes=wire,
        communication_by_kind=by_kind,
        live_bytes=total,
        category_bytes=live,
    )
