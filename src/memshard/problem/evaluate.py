"""Price one complete plan: live bytes at every schedule point, the peak and its breakdown,
redundant bytes, the zero-redundancy bound, communication and step time.

The step time is the compute, plus every collective, less the collectives hidden under the
compute (:func:`hidden_communication`): the step is the longer of two streams, the compute and
the collectives its framework runs beside it, plus the collectives that run in line.

The evaluator reads the same :class:`~memshard.problem.records.Problem` the ILP is built from, but
sums it directly (no linearisation), so it is the reference the solver is tested against.

A pipeline stage's rank also holds k − 1 other micro-batches, each waiting for its backward
with what one micro-batch holds at the boundary (``Problem.waiting_micro_batches``)::

    live'(t) = live(t) + (k − 1)·S      S = the activations live at ``Schedule.boundary``

filed as activations at every point of the forward and the backward, their redundant part
alike; the optimizer step holds none (every micro-batch has run its backward by then).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from memshard.problem import comm
from memshard.problem.bounds import zero_redundancy_bound
from memshard.problem.kernels import GEMM_KINDS
from memshard.problem.memory import CATEGORIES
from memshard.problem.records import DURING_RESHARDS, OpGroup, Problem, Selection


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
    recompute_time_s: float = 0.0  # what replays add (in the step time already)
    compute_by_kind: dict[str, float] = field(default_factory=dict)  # COMPUTE_KINDS → seconds
    hidden_communication_s: float = 0.0  # of communication_time_s, under the compute
    # S: the activations one micro-batch holds between its forward and its backward (at
    # ``Schedule.boundary``), held k − 1 times more at every point by a pipeline stage's rank
    boundary_activation_bytes: float = 0.0

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


COMPUTE_KINDS = ("matmuls", "attention", "other ops", "optimizer step")


def compute_by_kind(problem: Problem, selection: Selection) -> dict[str, float]:
    """The step's compute per kind: GEMMs, fused attention, the ops priced by their bytes
    (norms, softmax, dropout, activations, adds, the embedding, the loss), Adam's step."""
    out = dict.fromkeys(COMPUTE_KINDS, 0.0)
    for group, k in zip(problem.groups, selection.choices):
        if isinstance(group, OpGroup):
            op_kind = problem.graph.ops[group.ops[0]].kind
            kind = "matmuls" if op_kind in GEMM_KINDS else "attention" if op_kind == "sdpa" else "other ops"
        else:
            kind = "optimizer step"
        out[kind] += group.instances * group.choices[k].compute_s
    return out


def recompute_time(problem: Problem, selection: Selection) -> float:
    """Seconds the replays add to a step: the replayed ops' forwards (with their statistics'
    all-reduces) and the forward reshards they run again."""
    ops = sum(g.instances * g.choices[k].replay_s for g, k in zip(problem.groups, selection.choices))
    edges = 0.0
    for e, edge in enumerate(problem.edges):
        layouts = problem.edge_layouts(selection, e)
        if layouts.replayed:
            spec = edge.tensor
            calls = comm.reshard(spec.shape, spec.dtype_bytes, layouts.producer, layouts.consumer, problem.mesh)
            edges += edge.executions * comm.total_time(calls, problem.mesh)
    return ops + edges


def hidden_communication(problem: Problem, selection: Selection) -> float:
    """Seconds of collectives the compute hides, where the framework runs some beside it
    (``Problem.overlaps``, ``Choice.overlapped_s``): up to the ops' compute C (the optimizer
    step waits for the reduced gradients), and those run once a step (``Choice.overlapped_once_s``:
    the reductions of the backward that syncs, the updated shards' gathers before the first
    forward) up to one micro-batch's compute, C/m. With O overlapped, O₁ of them once a step::

        exposed = max(0, O − C, O₁ − C/m)        hidden = O − exposed

    plus what the choices' own compute hides apart (``Choice.hidden_s``: ``tp_overlap.py``).
    """
    own = sum(group.instances * group.choices[k].hidden_s for group, k in zip(problem.groups, selection.choices))
    if not problem.overlaps:
        return own
    overlapped = once = compute = 0.0
    for group, k in zip(problem.groups, selection.choices):
        choice = group.choices[k]
        overlapped += group.instances * choice.overlapped_s
        once += group.instances * choice.overlapped_once_s
        if isinstance(group, OpGroup):
            compute += group.instances * choice.compute_s
    return own + overlapped - max(0.0, overlapped - compute, once - compute / problem.micro_batches)


def step_time(problem: Problem, selection: Selection) -> float:
    """The plan's estimated step time (``evaluate(...).step_time_s`` without the memory)."""
    return sum(n * (compute_s + sum(comm.collective_time(c, problem.mesh) for c in calls))
               for n, compute_s, calls in _priced(problem, selection)) - hidden_communication(problem, selection)


class _Ledger:
    """Bytes per category and redundant bytes over schedule points, as differences: an item
    live on [start, end] adds at start and subtracts after end (summed up at the end)."""

    def __init__(self, num_points: int):
        self.num_points = num_points
        self.live = np.zeros((len(CATEGORIES), num_points + 1))
        self.redundant = np.zeros(num_points + 1)
        self.redundant_activations = np.zeros(num_points + 1)  # of ``redundant``

    def add(self, start: int, end: int, category: str, nbytes: float, redundant: float) -> None:
        k = CATEGORY_INDEX[category]
        self.live[k, start] += nbytes
        self.live[k, end + 1] -= nbytes
        self.redundant[start] += redundant
        self.redundant[end + 1] -= redundant
        if k == ACTIVATIONS:
            self.redundant_activations[start] += redundant
            self.redundant_activations[end + 1] -= redundant


CATEGORY_INDEX = {c: k for k, c in enumerate(CATEGORIES)}
ACTIVATIONS = CATEGORY_INDEX["activations"]


def check_plan(problem: Problem, selection: Selection) -> None:
    """Raise InconsistentPlan where ``selection`` is no plan of ``problem`` (links, kept
    copies, conflicts)."""
    check_links(problem, selection)
    for e, edge in enumerate(problem.edges):
        layouts = problem.edge_layouts(selection, e)
        if layouts.kept and not edge.can_keep(layouts.producer, layouts.consumer):
            raise InconsistentPlan(f"edge {edge.key} cannot keep its copy in layout {layouts.producer}")
        if layouts.kept and (layouts.replayed or problem.replayed(selection, edge.consumer)):
            raise InconsistentPlan(f"edge {edge.key} keeps its copy for a recomputed op")
    for c in problem.conflicts:
        if selection.choices[c.a] in c.a_choices and selection.choices[c.b] in c.b_choices:
            raise InconsistentPlan(c.why)


def _add_slots(problem: Problem, selection: Selection, ledger: _Ledger) -> dict[int, np.ndarray]:
    """The constants and the chosen slots (less the output-gradient slots that count one
    shared gradient twice: ``SharedGradient``); returns what changes at each point while its
    reshards run (``Slot.phase``): point → per category, then redundant."""
    for c in problem.constants:
        ledger.add(c.start, c.end, c.category, c.nbytes, c.redundant)
    for g in problem.shared_gradients:
        if g.shared(problem, selection):
            k = selection.choices[g.group]
            ledger.add(g.start, g.end, "transients", -g.nbytes[k], -g.redundant[k])
    swap = defaultdict(lambda: np.zeros(len(CATEGORIES) + 1))
    for s in problem.slots:
        k = selection.choices[s.group]
        if s.phase != DURING_RESHARDS:
            ledger.add(s.start, s.end, s.category, s.nbytes[k], s.redundant[k])
        if s.reshard_change:
            swap[s.end][CATEGORY_INDEX[s.category]] += s.reshard_change * s.nbytes[k]
            swap[s.end][-1] += s.reshard_change * s.redundant[k]
    return swap


def _add_held(problem: Problem, selection: Selection, ledger: _Ledger) -> None:
    """Each activation, once per distinct tensor held (``Problem.holder_identity``)."""
    by_tensor = defaultdict(list)
    for h in problem.holders:
        layout = problem.holder_layout(selection, h)
        if layout is not None:
            tensor = (problem.holder_identity(selection, h), problem.held[h.tensor].layout_id(layout))
            by_tensor[h.tensor].append((h.start, h.end, tensor, problem.made_in_backward(selection, h)))
    for t, entries in by_tensor.items():
        held = problem.held[t]
        cuts = sorted({s for s, _, _, _ in entries} | {e + 1 for _, e, _, _ in entries})
        for lo, hi in zip(cuts, cuts[1:]):
            # A copy made only for the backward (re-gathered, or made again by a replay) is
            # made there and dropped after: a transient.
            ids: dict[tuple, bool] = {}
            for s, e, tensor, regather in entries:
                if s <= lo and hi - 1 <= e:
                    ids[tensor] = ids.get(tensor, True) and regather
            for category, only_regathered in (("activations", False), ("transients", True)):
                mine = [i for (_, i), r in ids.items() if r == only_regathered]
                if mine:
                    ledger.add(lo, hi - 1, category, sum(held.nbytes[i] for i in mine),
                               sum(held.redundant[i] for i in mine))


def _add_reshards(problem: Problem, selection: Selection, ledger: _Ledger, swap: dict[int, np.ndarray]) -> None:
    """A point holds the larger of its two moments: before its reshards, and while the
    largest runs (one reshard at a time), with what changed in between."""
    extra: dict[int, float] = defaultdict(float)
    for rp in problem.reshard_points:
        extra[rp.point] = max(extra[rp.point], *problem.reshard_rows(selection, rp))
    for point, nbytes in extra.items():
        change = swap[point].copy()
        change[CATEGORY_INDEX["transients"]] += nbytes
        if change[:-1].sum() > 0:
            for k, c in enumerate(CATEGORIES):
                ledger.add(point, point, c, change[k], 0.0)
            ledger.redundant[point] += change[-1]
            ledger.redundant[point + 1] -= change[-1]


def _communication(problem: Problem, selection: Selection) -> tuple[float, float, float, dict]:
    """(compute seconds, communication seconds, bytes sent, per collective kind)."""
    compute = communication = wire = 0.0
    by_kind: dict[str, dict[str, float]] = {k: {"calls": 0, "buffer_bytes": 0.0, "wire_bytes": 0.0, "time_s": 0.0}
                                            for k in comm.KINDS}
    for instances, compute_s, calls in _priced(problem, selection):
        compute += instances * compute_s
        for call in calls:
            w, t = comm.wire_bytes(call, problem.mesh), comm.collective_time(call, problem.mesh)
            communication += instances * t
            wire += instances * w
            entry = by_kind[call.kind]
            entry["time_s"] += instances * t
            entry["calls"] += instances * call.share
            entry["buffer_bytes"] += instances * call.buffer_bytes
            entry["wire_bytes"] += instances * w
    for entry in by_kind.values():  # unit members each count a share of their unit's calls
        entry["calls"] = round(entry["calls"])
    return compute, communication, wire, by_kind


def slot_peak(problem: Problem, selection: Selection) -> float:
    """The most bytes ``selection``'s constants and slots alone (weights, gradients, optimizer
    states, buffers) hold at one point: a lower bound on its peak, for a fraction of
    :func:`evaluate`'s cost (no activation, no reshard)."""
    ledger = _Ledger(problem.schedule.num_points)
    _add_slots(problem, selection, ledger)
    return float(np.cumsum(ledger.live.sum(axis=0))[:problem.schedule.num_points].max())


def evaluate(problem: Problem, selection: Selection) -> Evaluation:
    check_plan(problem, selection)
    n_points = problem.schedule.num_points
    ledger = _Ledger(n_points)
    swap = _add_slots(problem, selection, ledger)
    _add_held(problem, selection, ledger)
    _add_reshards(problem, selection, ledger, swap)
    live = np.cumsum(ledger.live, axis=1)[:, :n_points]
    redundant = np.cumsum(ledger.redundant)[:n_points]
    boundary = float(live[ACTIVATIONS, problem.schedule.boundary])
    if problem.waiting_micro_batches:  # (at the forward's and backward's points: none waits for the optimizer)
        step = problem.schedule.optimizer
        live[ACTIVATIONS, :step] += problem.waiting_micro_batches * boundary
        redundant[:step] += problem.waiting_micro_batches * float(
            np.cumsum(ledger.redundant_activations)[problem.schedule.boundary])
    total = live.sum(axis=0)
    peak_point = int(np.argmax(total))
    bound = zero_redundancy_bound(problem)
    bound_point = int(np.argmax(bound))
    compute, communication, wire, by_kind = _communication(problem, selection)
    hidden = hidden_communication(problem, selection)
    return Evaluation(
        peak_bytes=float(total[peak_point]),
        peak_point=peak_point,
        breakdown={c: float(live[k, peak_point]) for k, c in enumerate(CATEGORIES)},
        redundant_bytes=float(redundant[peak_point]),
        lower_bound_bytes=float(bound[bound_point]),
        lower_bound_point=bound_point,
        step_time_s=compute + communication - hidden,
        compute_time_s=compute,
        communication_time_s=communication,
        communication_bytes=wire,
        communication_by_kind=by_kind,
        live_bytes=total,
        category_bytes=live,
        recompute_time_s=recompute_time(problem, selection),
        compute_by_kind=compute_by_kind(problem, selection),
        hidden_communication_s=hidden,
        boundary_activation_bytes=boundary,
    )
