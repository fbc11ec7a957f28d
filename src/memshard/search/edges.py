"""The edge flow: how an activation gets from its producer's layout to its consumer's.

Alpa's edge linearisation, factored by mesh axis: resharding runs axis by axis (forward in
axis order, gradients in reverse), so the cost of step ``a`` depends only on its state
σ = (consumer placements on axes < a, producer placements on axes ≥ a, consumer placement on
axis a), and an edge needs Σ_a |σ_a| columns instead of |producer layouts| × |consumer
layouts|. With the choices integral the flow is integral (each state has one way in and
out), so its columns are continuous. Rows (family ``edge-flow``)::

  Σ_k Σ_{σ at a=0 with producer part L} z = Σ_{s: out(s)=L} x[p,s]
  Σ_k Σ_{σ at a=A−1 with consumer part K} z = Σ_{s: in(s)=K} x[c,s]
  flow into each state of step a+1 = flow out of step a
  Σ_σ z[e,1,0,σ] = κ[e]                      (κ: the edge keeps its copy, family ``keep``)

Recomputation (family ``replay``; r[g] = Σ_{c replayed} x[g,c]) adds flow copies k = 2, 3,
resharded twice like a kept copy (the replay runs the forward reshard again):

  Σ_σ z[e,2,0,σ] = r[producer]               a saved copy the producer's replay makes again
  Σ_σ z[e,2,0,σ] + Σ_σ z[e,3,0,σ] = r[consumer],  Σ z[e,2,0,σ] ≤ r[producer],
  Σ z[e,3,0,σ] ≤ 1 − r[producer]             an input a replaying consumer reads from the
                                             replayed producer (2) or its held tensor (3)
  κ[e] + r[consumer] ≤ 1                     a replayed op reads its saved input whole
"""

from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass

import highspy
import numpy as np

from memshard.core.mesh import Mesh
from memshard.core.placement import Layout, Partial
from memshard.problem import comm
from memshard.problem.records import READ_BY_REPLAY, REPLAYED_BY_PRODUCER, Problem, without_partial
from memshard.search.model import LinearModel, RowTag


@dataclass
class EdgeFlow:
    """One edge's flow columns and what reads them."""

    keeps: tuple[int, ...]  # its copies k (``flow_copies``): 0, 1 kept, 2 and 3 replayed
    steps: dict[tuple[int, int], tuple[list, np.ndarray]]  # (keep, axis) → (states, columns)
    consumer_layout_columns: dict[int, dict[Layout, list[int]]]  # keep → consumer layout → last step's
    producer_layout_columns: dict[int, dict[Layout, list[int]]]  # keep → producer layout → first step's
    time_columns: np.ndarray
    time_values: np.ndarray  # seconds (in the model's unit) per column
    keep_column: int | None = None


class EdgeFlows:
    """Adds each edge's flow to ``model``; edges of one shape and layouts share their states."""

    def __init__(self, problem: Problem, model: LinearModel, choice_columns: list[np.ndarray], time_unit: float):
        self.problem = problem
        self.model = model
        self.choice_columns = choice_columns
        self.time_unit = time_unit
        self.by_side: dict[tuple, Sides] = {}  # see choices_by
        self.end_rows: dict[tuple, tuple] = {}  # (flows, sides) → where their rows' columns are (add_end_rows)

    def add(self, e: int) -> EdgeFlow:
        problem = self.problem
        edge = problem.edges[e]
        spec = edge.tensor
        # the producer's output layouts; the consumer's keys, per axis (input placement, gradient placement)
        producer_sides = self.choices_by(edge.producer, None)
        consumer_sides = self.choices_by(edge.consumer, edge.input_index)
        keeps = flow_copies(problem, e)
        shape = flow_shape(spec.shape, spec.dtype_bytes, producer_sides.sides, consumer_sides.sides, keeps,
                           edge.gradient_through, problem.mesh)
        block = self.model.columns(shape.size, integer=False)  # every step's states, one step after another
        steps, cost_cols, cost_vals = {}, [], []
        for step, (states, times) in shape.states.items():
            cols = block[shape.offsets[step]:shape.offsets[step] + len(states)]
            steps[step] = (states, cols)
            paid = times != 0
            cost_cols.append(cols[paid])
            cost_vals.append(times[paid] * (edge.executions / self.time_unit))
        flow = EdgeFlow(keeps, steps, {}, {}, np.concatenate(cost_cols), np.concatenate(cost_vals))
        self.add_end_rows(e, block, shape, producer_sides, consumer_sides)
        self.add_conservation_rows(e, block, shape)
        flow.consumer_layout_columns, flow.producer_layout_columns = self.layout_columns(block, shape)
        if 1 in keeps:
            flow.keep_column = int(self.model.columns(1, integer=True)[0])
            coefs = {int(c): 1.0 for c in steps[(1, 0)][1]}
            coefs[flow.keep_column] = -1.0
            self.model.row(coefs, 0.0, 0.0, RowTag("keep", item=edge.key))
        if edge.replay or (edge.saves and problem.groups[edge.consumer].may_replay):
            self.add_replay_rows(e, flow)
        return flow

    def replayed(self, group: int) -> dict[int, float]:
        """r[g]: the group's op is recomputed."""
        grp = self.problem.groups[group]
        return {int(self.choice_columns[group][c]): 1.0 for c in grp.replay_choices}

    def add_replay_rows(self, e: int, flow: EdgeFlow) -> None:
        edge = self.problem.edges[e]
        tag = RowTag("replay", item=edge.key)
        inf = highspy.kHighsInf

        def through(k: int, sign: float = 1.0) -> dict[int, float]:
            return {int(c): sign for c in flow.steps[(k, 0)][1]} if k in flow.keeps else {}

        producer, consumer = self.replayed(edge.producer), self.replayed(edge.consumer)
        if edge.replay == REPLAYED_BY_PRODUCER:
            self.model.row({**through(2), **{c: -v for c, v in producer.items()}}, 0.0, 0.0, tag)
        elif edge.replay == READ_BY_REPLAY:
            self.model.row({**through(2), **through(3), **{c: -v for c, v in consumer.items()}}, 0.0, 0.0, tag)
            if 2 in flow.keeps:
                self.model.row({**through(2), **{c: -v for c, v in producer.items()}}, -inf, 0.0, tag)
            self.model.row({**through(3), **producer}, -inf, 1.0, tag)
        if flow.keep_column is not None and consumer:
            self.model.row({flow.keep_column: 1.0, **consumer}, -inf, 1.0, tag)

    def add_end_rows(self, e: int, block: np.ndarray, shape: FlowShape, producer_sides: Sides,
                     consumer_sides: Sides) -> None:
        """The first step's producer side equals the producer's choice, the last step's
        consumer side the consumer's: per side, Σ its states' columns − Σ its choices' = 0
        (``block``: the edge's flow columns)."""
        tag = RowTag("edge-flow", item=self.problem.edges[e].key)
        for flows, sides in ((shape.producer_flows, producer_sides), (shape.consumer_flows, consumer_sides)):
            key = (id(flows), id(sides))
            if key not in self.end_rows:  # where each row's columns are, among the flows' then the choices'
                counts = np.array([len(f) for f in flows] + sides.counts, dtype=np.int64)
                rows = np.arange(len(counts)) % len(flows) * 2 + (np.arange(len(counts)) >= len(flows))
                order = np.argsort(np.repeat(rows, counts), kind="stable")
                signs = np.where(order < sum(counts[:len(flows)]), 1.0, -1.0)
                self.end_rows[key] = (flows, sides, order, _frozen(signs),
                                      np.cumsum([0, *(counts[:len(flows)] + counts[len(flows):])]).tolist())
            _, _, order, signs, bounds = self.end_rows[key]
            cols = np.concatenate([block[0] + np.concatenate([*flows, np.zeros(0, np.int64)]), sides.columns])[order]
            for r in range(len(bounds) - 1):
                self.model.append_row(cols[bounds[r]:bounds[r + 1]], signs[bounds[r]:bounds[r + 1]], 0.0, 0.0, tag)

    def choices_by(self, group: int, input_index: int | None) -> Sides:
        """The choices of op group ``group`` by their output layout (``input_index`` None), or by
        their input ``input_index``'s consumer key, sorted by repr (the order of the flow's end
        rows)."""
        key = (group, input_index)
        if key not in self.by_side:
            grp = self.problem.groups[group]
            if input_index is None:
                sides = [s.output_layout for s in grp.strategies]
            else:
                sides = [tuple(zip(s.input_layouts[input_index], g))
                         for s, g in zip(grp.strategies, grp.input_grads[input_index])]
            by_side: dict = defaultdict(list)
            for c, side in enumerate(sides):
                by_side[side].append(c)
            order = tuple(sorted(by_side, key=repr))
            chosen = np.array([c for side in order for c in by_side[side]], dtype=np.int64)
            self.by_side[key] = Sides(order, self.choice_columns[group][chosen].astype(np.int64),
                                      [len(by_side[side]) for side in order])
        return self.by_side[key]

    def add_conservation_rows(self, e: int, block: np.ndarray, shape: FlowShape) -> None:
        """What leaves step a enters step a+1, state by state."""
        tag = RowTag("edge-flow", item=self.problem.edges[e].key)
        positions, values, bounds = shape.conservation
        cols = block[0] + positions
        for r in range(len(bounds) - 1):
            self.model.append_row(cols[bounds[r]:bounds[r + 1]], values[bounds[r]:bounds[r + 1]], 0.0, 0.0, tag)

    def layout_columns(self, block: np.ndarray, shape: FlowShape) -> tuple[dict, dict]:
        """Per keep flag: which flow columns say "consumer layout L" (last step) and which
        "producer layout L" (first step)."""
        out = []
        for layouts in (shape.consumer_layouts, shape.producer_layouts):
            by_keep = {}
            for k, (order, positions, bounds) in layouts.items():
                cols = (block[0] + positions).tolist()
                by_keep[k] = {layout: cols[bounds[i]:bounds[i + 1]] for i, layout in enumerate(order)}
            out.append(by_keep)
        return out[0], out[1]


@dataclass(frozen=True, eq=False)
class Sides:
    """An op group's choices by side (output layout, or consumer key), for an edge's end rows."""

    sides: tuple  # sorted by repr
    columns: np.ndarray  # the choices' columns, side by side
    counts: list[int]  # per side, its choices


def flow_copies(problem: Problem, e: int) -> tuple[int, ...]:
    """The copies k an edge's flow has: 0 (the forward's), 1 (kept), 2 and 3 (replayed)."""
    edge = problem.edges[e]
    producer, consumer = problem.groups[edge.producer], problem.groups[edge.consumer]
    keeps = (0, 1) if edge.saves and not consumer.always_replays else (0,)
    if edge.replay == REPLAYED_BY_PRODUCER:
        keeps = (*(keeps if not producer.always_replays else ()), 2)
    elif edge.replay == READ_BY_REPLAY:
        keeps = (*(keeps if not consumer.always_replays else ()),
                 *((2,) if producer.may_replay else ()), *((3,) if not producer.always_replays else ()))
    return keeps


@functools.lru_cache(maxsize=512)
def step_states(shape: tuple[int, ...], dtype_bytes: int, producer_layouts: tuple[Layout, ...],
                consumer_keys: tuple[tuple, ...], keeps: tuple[int, ...], gradient_through: bool, mesh: Mesh) -> dict:
    """Per (keep, step a): the flow states σ and each one's time (shared by every edge and
    every solve of one shape and layouts; read only); ``gradient_through``: no gradient
    step back (``Edge.gradient_through``). A state's time is its forward step (twice if the
    copy is kept and gathered again, or replayed) and its gradient's step back: each priced
    once per state, whichever copies have it."""
    axes = mesh.ndim
    suffixes = [{L[a:] for L in producer_layouts} for a in range(axes + 1)]
    prefixes = [{K[:a] for K in consumer_keys} for a in range(axes + 1)]
    placements = [sorted({K[a] for K in consumer_keys}, key=repr) for a in range(axes)]
    out = {}
    for a in range(axes):
        states = [(prefix, suffix, placement) for prefix in prefixes[a] for suffix in suffixes[a]
                  for placement in placements[a] if prefix + (placement,) in prefixes[a + 1]]
        forward = np.array([_forward_seconds(shape, dtype_bytes, a, *state, mesh) for state in states], dtype=float)
        backward = (np.zeros(len(states)) if gradient_through else
                    np.array([_backward_seconds(shape, dtype_bytes, a, *state, mesh) for state in states], dtype=float))
        # a kept copy is gathered from the producer's tensor, never from partial sums
        whole = np.array([not any(isinstance(x, Partial) for x in suffix) for _, suffix, _ in states], dtype=bool)
        for k in keeps:
            chosen = whole if k == 1 else np.ones(len(states), dtype=bool)
            times = (forward * (2 if k else 1) + backward)[chosen]
            times.setflags(write=False)
            out[(k, a)] = (tuple(s for s, c in zip(states, chosen) if c), times)
    return {(k, a): out[(k, a)] for k in keeps for a in range(axes)}


@dataclass(frozen=True, eq=False)
class FlowShape:
    """What every edge of one shape and layouts shares (``flow_shape``): its flow states and
    their times, and where its rows read them: positions in the edge's block of flow columns,
    the steps' states one step after another."""

    states: dict  # (keep, step a) → (states, times): ``step_states``
    offsets: dict  # (keep, step a) → the position of its first state
    size: int  # states in all
    producer_flows: tuple[np.ndarray, ...]  # per producer layout: its states at step 0, keep after keep
    consumer_flows: tuple[np.ndarray, ...]  # per consumer key: its states at the last step, keep after keep
    # keep → (layouts, their states at the first (producer) or last (consumer) step layout after
    # layout, each layout's bounds there)
    producer_layouts: dict[int, tuple[tuple, np.ndarray, list[int]]]
    consumer_layouts: dict[int, tuple[tuple, np.ndarray, list[int]]]
    conservation: tuple[np.ndarray, np.ndarray, list[int]]  # its rows: positions, coefficients, row bounds


@functools.lru_cache(maxsize=512)
def flow_shape(shape: tuple[int, ...], dtype_bytes: int, producer_layouts: tuple[Layout, ...],
               consumer_keys: tuple[tuple, ...], keeps: tuple[int, ...], gradient_through: bool,
               mesh: Mesh) -> FlowShape:
    """The flow states of an edge of this shape and layouts (``step_states``) and where its
    rows read them (read only, shared as ``step_states`` is)."""
    states = step_states(shape, dtype_bytes, producer_layouts, consumer_keys, keeps, gradient_through, mesh)
    last = mesh.ndim - 1
    offsets = dict(zip(states, np.cumsum([0, *(len(s) for s, _ in states.values())]).tolist()))

    def positions(step: tuple[int, int], items) -> dict:
        out: dict = defaultdict(list)
        for i, key in enumerate(items, start=offsets[step]):
            out[key].append(i)
        return dict(out)

    producer_sides = {k: positions((k, 0), (suffix for _, suffix, _ in states[(k, 0)][0])) for k in keeps}
    consumer_sides = {k: positions((k, last), (prefix + (placement,) for prefix, _, placement in states[(k, last)][0]))
                      for k in keeps}
    consumer_layouts = {k: positions((k, last), (tuple(pl for pl, _ in prefix + (placement,))
                                                 for prefix, _, placement in states[(k, last)][0])) for k in keeps}

    def flat(by_layout: dict) -> tuple[tuple, np.ndarray, list[int]]:
        return (tuple(by_layout), _frozen(np.array([i for p in by_layout.values() for i in p], dtype=np.int64)),
                np.cumsum([0, *(len(p) for p in by_layout.values())]).tolist())

    def flows(sides: dict, order: tuple) -> tuple[np.ndarray, ...]:
        return tuple(_frozen(np.array([i for k in keeps for i in sides[k].get(side, ())], dtype=np.int64))
                     for side in order)

    rows = []
    for k in keeps:
        for a in range(last):
            through: dict[tuple, tuple[list, list]] = defaultdict(lambda: ([], []))
            for i, (prefix, suffix, placement) in enumerate(states[(k, a)][0], start=offsets[(k, a)]):
                through[(prefix + (placement,), suffix[1:])][0].append(i)
            for i, (prefix, suffix, _) in enumerate(states[(k, a + 1)][0], start=offsets[(k, a + 1)]):
                through[(prefix, suffix)][1].append(i)
            rows += [through[key] for key in sorted(through, key=repr)]
    conservation = (_frozen(np.array([i for out, into in rows for i in out + into], dtype=np.int64)),
                    _frozen(np.array([v for out, into in rows for v in [1.0] * len(out) + [-1.0] * len(into)])),
                    np.cumsum([0, *(len(out) + len(into) for out, into in rows)]).tolist())
    return FlowShape(states, offsets, sum(len(s) for s, _ in states.values()), flows(producer_sides, producer_layouts),
                     flows(consumer_sides, consumer_keys), {k: flat(v) for k, v in producer_sides.items()},
                     {k: flat(v) for k, v in consumer_layouts.items()}, conservation)


def _frozen(array: np.ndarray) -> np.ndarray:
    array.setflags(write=False)
    return array


def _forward_seconds(shape: tuple[int, ...], dtype_bytes: int, a: int, prefix, suffix, placement, mesh) -> float:
    """Seconds of the forward resharding step ``a`` in one state."""
    consumer_prefix = tuple(pl for pl, _ in prefix)
    return _step_seconds(shape, dtype_bytes, consumer_prefix + suffix, a, placement[0], mesh, False)


def _backward_seconds(shape: tuple[int, ...], dtype_bytes: int, a: int, prefix, suffix, placement, mesh) -> float:
    """Seconds of the gradient's step back through step ``a`` in one state."""
    grad_prefix = tuple(g for _, g in prefix)
    grad_suffix = tuple(without_partial(suffix))
    backward = grad_prefix + (placement[1],) + grad_suffix[1:]
    return _step_seconds(shape, dtype_bytes, backward, a, grad_suffix[0], mesh, True)


@functools.lru_cache(maxsize=8192)  # flow states of different prefixes share their steps
def _step_seconds(shape: tuple[int, ...], dtype_bytes: int, layout: Layout, a: int, target, mesh: Mesh,
                  reverse: bool) -> float:
    return comm.total_time(comm.reshard_step(shape, dtype_bytes, layout, a, target, mesh, reverse=reverse), mesh)
