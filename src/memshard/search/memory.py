"""The live bytes at each candidate schedule point, and the peak (row family ``memory``).

  L_t = L_prev + Δ_t          live bytes, chained so rows stay sparse   (family ``live-bytes``)
  L_t + const_t ≤ M           for every candidate point t               (family ``memory``)

Δ_t is what changed since the previous point: the slots (memory priced per choice of one
group) and the held activations. An activation may be held at once by its producer, by
consumers' input copies, saved copies and re-gathered copies; the producer's tensor counts
once however many hold it, a consumer reading another layout holds its own copy:

  c[e,L,R] ≥ [a holder of R holds L] − [producer's output is L]      (family ``copy``)
      edge e's consumer holds its own copy in layout L (R: which of its copy holders —
      input, saved, re-gathered — are live); for a saved or re-gathered copy the second
      term is the flow's "producer layout L" under the same keep flag, tighter in the LP
      relaxation
  y ≥ each kept copy's indicator,  y + c ≥ [e holds L]               (family ``held``)
      once the producer's own holder has ended, y counts the producer's tensor in L

Recomputation adds holders of the producer's own tensor (its saved output retained where the
op is not replayed, a replay's source) and a consumer's copy made again by the replay, each
read from the edge flow's copy it belongs to (``edges.flow_copies``). A holder that needs two
conditions at once (a copy made ahead by a replayed producer for a consumer not replayed, an
output PyTorch's selective checkpoint caches) is a column bounded by their product:

  w ≥ A + B − 1                                                      (family ``replay-holder``)
  u ≥ r[q]  for every group q of a layer that may be replayed        (family ``checkpointed``)
      u: the layer recomputes some op; B = u for an output cached where its op is not replayed

An add that hands its output's gradient to both its producers (``records.SharedGradient``)
takes one output-gradient slot back where both receive the tensor itself, per layout L:

  s_L ≤ [the add's gradient is in L],  s_L ≤ [each producer's is]
      (family ``shared-gradient``) memory pushes s_L up to their product; the live bytes
      count −bytes(L)·s_L

Tensors of shared layers have the same producer group and holders, so a (tensor kind, live
holders) signature is one expression, counted once per tensor that has it.

A pipeline stage's rank holds k − 1 other micro-batches (``Problem.waiting_micro_batches``),
each with what one holds at the boundary between its forward and its backward (t_b =
``Schedule.boundary``): the activations live there, as the evaluator files them (the slots and
constants of that category; the held tensors less the holders of what is made for the
backward, re-gathered copies, which are transients)::

  A = Σ_{activation slots at t_b} bytes·x + Σ_{held at t_b} (…) + const_b   (family ``in-flight``)
  L_0 = Δ_0 + (k − 1)·A

A ≥ 0 is one column and one row. It enters the chain's first point, so every L_t holds it, and
so every ``memory`` row (L_t + const_t ≤ M) and every reshard row, but the optimizer step's: the
chain takes it back there (every micro-batch has run its backward by then). With k = 1 there
is no A: the model is the one without pipelining.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import highspy
import numpy as np

from memshard.core.placement import Layout
from memshard.problem.records import (
    CACHED,
    DURING_RESHARDS,
    GROUP_KINDS,
    INPUT_COPY,
    MADE_FOR_BACKWARD,
    OWN_KINDS,
    PRODUCER,
    READ_BY_REPLAY,
    REGATHER,
    REPLAY_INPUT,
    REPLAY_OUT,
    REPLAY_READ,
    REPLAYED,
    REPLAYED_AHEAD,
    RETAINED,
    SAVED,
    SOURCE,
    Holder,
    Problem,
    SharedGradient,
    without_partial,
)
from memshard.search.edges import EdgeFlow
from memshard.search.model import LinearModel, RowTag, summed

# The flow copies k (``edges.flow_copies``) a consumer-side copy holder reads its layout from.
COPY_OF_FLOW = {REGATHER: (1,), REPLAYED: (2,), REPLAYED_AHEAD: (2,), REPLAY_INPUT: (2, 3)}
SAVED_KINDS = (SAVED, REPLAYED, REPLAYED_AHEAD)  # a consumer's saved tensor: kept, or made by a replay
Copies = dict[int, list[tuple[str, dict, dict]]]  # edge → (holder kind, own-copy indicator, any indicator)


class LiveBytes:
    """Builds the memory rows; keeps each point's live-bytes column and constant bytes."""

    def __init__(self, problem: Problem, model: LinearModel, choice_columns: list[np.ndarray],
                 flows: list[EdgeFlow], peak: int, bytes_unit: float):
        self.problem = problem
        self.model = model
        self.choice_columns = choice_columns
        self.choice_lists = [cols.tolist() for cols in choice_columns]  # (as ints, read one by one)
        self.flows = flows
        self.peak = peak
        self.bytes_unit = bytes_unit
        self.held_columns: dict[tuple, list[int]] = {}
        self.copy_columns: dict[tuple, int | None] = {}
        self.live_column: dict[int, int] = {}  # schedule point → its live-bytes column
        self.constants_at: dict[int, float] = {}  # schedule point → its constant bytes
        self.indicators: dict[Layout, dict[tuple, dict[int, float]]] = {}  # see indicators_at
        self.outputs: dict[int, dict[Layout, list[tuple[int, bool]]]] = {}  # see output_choices
        self.by_layout: dict[tuple[int, int | None], dict[Layout, list[int]]] = {}  # see columns_by_layout
        self.checkpointed: dict[tuple[int, ...], int] = {}  # a layer's replaying groups → u
        self.expressions: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        self.shared_expressions: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self.in_flight_column: int | None = None  # A, where the rank holds other micro-batches
        self.tags: dict[tuple[str, str], RowTag] = {}  # see tag

    # -- "holder h holds its tensor in layout L" ---------------------------------------------
    def indicator(self, h: Holder, layout: Layout, part: str = "all") -> dict[int, float]:
        """Linear expression of "holder h holds its tensor in ``layout``"; for a saved copy,
        ``part`` "copy" is the consumer's own copy (not kept), "kept" the producer's tensor."""
        return self.held_in(self.indicators_at(layout), h, layout, part)

    def indicators_at(self, layout: Layout) -> dict[tuple, dict[int, float]]:
        """The indicators made so far in ``layout``, by (holder kind, source, part)."""
        at = self.indicators.get(layout)
        if at is None:
            at = self.indicators[layout] = {}
        return at

    def held_in(self, at: dict, h: Holder, layout: Layout, part: str) -> dict[int, float]:
        """``indicator``, of ``at`` (``indicators_at(layout)``)."""
        key = (h.kind, h.source, part)
        found = at.get(key)
        if found is None:
            found = at[key] = self._indicator(h, layout, part)
        return found

    def _indicator(self, h: Holder, layout: Layout, part: str) -> dict[int, float]:
        problem, x = self.problem, self.choice_lists
        if h.kind in GROUP_KINDS:  # retained, cached: where the op is not replayed
            wanted = {PRODUCER: (False, True), RETAINED: (False,), CACHED: (False,), REPLAY_OUT: (True,)}[h.kind]
            held = {x[h.source][c]: 1.0 for c, replayed in self.output_choices(h.source).get(layout, ())
                    if replayed in wanted}
            if h.kind == CACHED:  # and its layer replays some op
                return self.conjunction(held, self.layer_replays(h.source), problem.groups[h.source].key)
            return held
        edge = problem.edges[h.source]
        if h.kind == INPUT_COPY:
            return dict.fromkeys(self.columns_by_layout(edge.consumer, edge.input_index).get(layout, ()), 1.0)
        flow = self.flows[h.source]
        out: dict[int, float] = {}
        if h.kind == SAVED:  # kept in the consumer's layout, or (kept) in the producer's
            if part != "kept":
                out.update(dict.fromkeys(flow.consumer_layout_columns.get(0, {}).get(layout, ()), 1.0))
            if part != "copy":
                out.update(dict.fromkeys(flow.producer_layout_columns.get(1, {}).get(layout, ()), 1.0))
        elif h.kind in COPY_OF_FLOW:
            for k in COPY_OF_FLOW[h.kind]:
                out.update(dict.fromkeys(flow.consumer_layout_columns.get(k, {}).get(layout, ()), 1.0))
            if h.kind == REPLAYED_AHEAD:
                out = self.both(out, edge.consumer, replayed=False)
        elif h.kind in (SOURCE, REPLAY_READ):  # the producer's tensor as it is, partial sums included
            for produced, cols in flow.producer_layout_columns.get(3 if h.kind == SOURCE else 2, {}).items():
                if without_partial(produced) == layout:
                    out.update(dict.fromkeys(cols, 1.0))
            if h.kind == REPLAY_READ and edge.replay != READ_BY_REPLAY:
                out = self.both(out, edge.consumer)
        return out

    def output_choices(self, group: int) -> dict[Layout, list[tuple[int, bool]]]:
        """Op group ``group``'s choices by the layout of their output, partial sums reduced:
        (choice, replayed) per layout."""
        if group not in self.outputs:
            grp = self.problem.groups[group]
            out = self.outputs[group] = defaultdict(list)
            for c, (s, replayed) in enumerate(zip(grp.strategies, grp.replays or [False] * len(grp.strategies))):
                out[without_partial(s.output_layout)].append((c, replayed))  # (``grp.replayed(c)``)
        return self.outputs[group]

    def tag(self, family: str, item: str) -> RowTag:
        """The row tag of ``family`` about ``item`` (one record for all its rows)."""
        key = (family, item)
        found = self.tags.get(key)
        if found is None:
            found = self.tags[key] = RowTag(family, item=item)
        return found

    def both(self, indicator: dict[int, float], group: int, replayed: bool = True) -> dict[int, float]:
        """w ≥ A + r[group] − 1 (or, ``replayed`` False, w ≥ A − r[group]): A and the group's op
        replayed (not replayed); memory pushes w down to the product. Flow copy 2 of an edge
        whose consumer saves says only that the producer is replayed: the replayed producer's
        output is kept for a replayed reader, its ticket made ahead for one not replayed."""
        grp = self.problem.groups[group]
        if not indicator or (grp.always_replays if replayed else not grp.may_replay):
            return indicator
        sign = 1.0 if replayed else -1.0
        r = {self.choice_lists[group][c]: sign for c in grp.replay_choices}
        return self.conjunction(indicator, r, grp.key, 1.0 if replayed else 0.0)

    def conjunction(self, indicator: dict[int, float], other: dict[int, float] | None, item: str,
                    upper: float = 1.0) -> dict[int, float]:
        """w ≥ A + B − ``upper`` (family ``replay-holder``): indicator A and B (B = 1 − r with
        ``other`` −r, ``upper`` 0; ``other`` None: B = 1); memory pushes w down to the product."""
        if not indicator or other is None:
            return indicator
        w = int(self.model.columns(1, integer=False)[0])
        row = dict(indicator)
        for col, v in other.items():
            row[col] = row.get(col, 0.0) + v
        row[w] = row.get(w, 0.0) - 1.0
        self.model.row(row, -highspy.kHighsInf, upper, self.tag("replay-holder", item))
        return {w: 1.0}

    def layer_replays(self, group: int) -> dict[int, float] | None:
        """u ≥ r[q] for every group q of ``group``'s layer that may be replayed (family
        ``checkpointed``): u is 1 where the layer recomputes some op (memory pushes it down to
        that); None where one of them always is."""
        peers = self.problem.checkpoint_peers[group]
        if any(self.problem.groups[q].always_replays for q in peers):
            return None
        if peers not in self.checkpointed:
            u = int(self.model.columns(1, integer=False)[0])
            for q in peers:
                row = {self.choice_lists[q][c]: 1.0 for c in self.problem.groups[q].replay_choices}
                row[u] = -1.0
                self.model.row(row, -highspy.kHighsInf, 0.0, RowTag("checkpointed", item=self.problem.groups[q].key))
            self.checkpointed[peers] = u
        return {self.checkpointed[peers]: 1.0}

    def producer_in(self, group: int, layout: Layout) -> dict[int, float]:
        """Π: the producer's output is exactly ``layout`` (a consumer reading it in that
        layout holds the producer's own tensor, no copy)."""
        return dict.fromkeys(self.columns_by_layout(group, None).get(layout, ()), 1.0)

    def columns_by_layout(self, group: int, input_index: int | None) -> dict[Layout, list[int]]:
        """Op group ``group``'s choice columns by their output layout (``input_index`` None) or
        their input ``input_index``'s layout, in choice order."""
        key = (group, input_index)
        if key not in self.by_layout:
            by_layout: dict[Layout, list[int]] = defaultdict(list)
            for col, s in zip(self.choice_lists[group], self.problem.groups[group].strategies):
                by_layout[s.output_layout if input_index is None else s.input_layouts[input_index]].append(col)
            self.by_layout[key] = dict(by_layout)
        return self.by_layout[key]

    def shared_gradient(self, g: SharedGradient) -> tuple[np.ndarray, np.ndarray]:
        """−bytes(L)·s_L over the layouts L of the add's output gradient (family
        ``shared-gradient``): the second count of a gradient both producers receive as it is.
        Adds of the same groups (identical layers) share their columns."""
        problem, x = self.problem, self.choice_lists
        producers = tuple(problem.edges[e].producer for e in g.edges)
        key = (g.group, producers)
        if key not in self.shared_expressions:
            by_layout: dict[Layout, list[int]] = defaultdict(list)  # the add's choices per layout
            for c, strategy in enumerate(problem.groups[g.group].strategies):
                if g.nbytes[c]:
                    by_layout[without_partial(strategy.output_layout)].append(c)
            cols, vals = [], []
            for layout, choices in by_layout.items():
                sides = [{x[g.group][c]: 1.0 for c in choices}]
                sides += [{x[p][c]: 1.0
                           for c, strategy in enumerate(problem.groups[p].strategies)
                           if without_partial(strategy.output_layout) == layout}
                          for p in producers]
                if not all(sides):
                    continue
                s = int(self.model.columns(1, integer=False)[0])
                for side in sides:
                    row = {col: -v for col, v in side.items()}
                    row[s] = 1.0
                    self.model.row(row, -highspy.kHighsInf, 0.0,
                                   RowTag("shared-gradient", item=problem.groups[g.group].key))
                cols.append(s)
                vals.append(-float(g.nbytes[choices[0]]) / self.bytes_unit)
            self.shared_expressions[key] = (np.array(cols, dtype=np.int64),
                                            np.array(vals, dtype=float))
        return self.shared_expressions[key]

    # -- the rows ------------------------------------------------------------------------------
    def add(self, points: list[int]) -> list[int]:
        """One ``memory`` row per candidate point (returned), over a chain of live-byte columns."""
        slot_keys, slot_vectors, slot_start, slot_end = self.merged_slots()
        holders = _HolderIndex(self.problem)
        shared_start = np.array([g.start for g in self.problem.shared_gradients], dtype=np.int64)
        shared_end = np.array([g.end for g in self.problem.shared_gradients], dtype=np.int64)
        terms = []
        for t in points:
            live_slots = np.nonzero((slot_start <= t) & (t <= slot_end))[0]
            shared = np.nonzero((shared_start <= t) & (t <= shared_end))[0]
            for g in shared:  # (its columns before the chain's)
                self.shared_gradient(self.problem.shared_gradients[g])
            signatures = []
            for signature, tensor, count in holders.live_at(t):
                if signature not in self.expressions:
                    self.expressions[signature] = self.expression(holders, *signature, tensor)
                signatures.append((signature, count))
            const = sum(c.nbytes for c in self.problem.constants if c.start <= t <= c.end) / self.bytes_unit
            terms.append((live_slots, signatures, const, shared))
        if self.problem.waiting_micro_batches:
            self.in_flight_column = self.in_flight(holders)
        rows = self.chain_rows(points, terms, slot_keys, slot_vectors)
        self.constants_at = {t: terms[k][2] for k, t in enumerate(points)}
        return rows

    def in_flight(self, holders: _HolderIndex) -> int:
        """A, the activations one micro-batch holds at the boundary (family ``in-flight``):
        A − Σ(its expression) = its constant bytes. Returns A's column."""
        problem, t = self.problem, self.problem.schedule.boundary
        cols: list[np.ndarray] = []
        vals: list[np.ndarray] = []
        for s in problem.slots:
            if s.category == "activations" and s.phase != DURING_RESHARDS and s.start <= t <= s.end:
                cols.append(self.choice_columns[s.group])
                vals.append(-s.nbytes / self.bytes_unit)
        for signature, tensor, count in holders.live_at(t, forward_only=True):
            if signature not in self.expressions:
                self.expressions[signature] = self.expression(holders, *signature, tensor)
            c, v = self.expressions[signature]
            cols.append(c)
            vals.append(-v * count)
        const = sum(c.nbytes for c in problem.constants
                    if c.category == "activations" and c.start <= t <= c.end) / self.bytes_unit
        column = int(self.model.columns(1, integer=False, hi=highspy.kHighsInf)[0])
        cols, vals = summed(np.concatenate([*cols, [column]]).astype(np.int64), np.concatenate([*vals, [1.0]]))
        self.model.row((cols, vals), const, const, RowTag("in-flight", t))
        return column

    def merged_slots(self):
        """Slots of one group and interval merged (e.g. the layers' weights): their keys, price
        vectors (model units) and intervals."""
        vectors: dict[tuple, np.ndarray] = {}
        for s in self.problem.slots:
            if s.phase == DURING_RESHARDS:  # in the reshard rows only
                continue
            key = (s.group, s.start, s.end)
            vectors[key] = vectors.get(key, 0) + s.nbytes / self.bytes_unit
        keys = list(vectors)
        return keys, vectors, np.array([k[1] for k in keys]), np.array([k[2] for k in keys])

    def chain_rows(self, points: list[int], terms: list, slot_keys: list, slot_vectors: dict) -> list[int]:
        """λ_k = λ_(k−1) + (what starts being held at point k − what stops) (family
        ``live-bytes``, λ_0 = the first point's terms) and λ_k ≤ M − constants(k) (``memory``):
        each row holds only the change since the point before, so the rows stay short."""
        model = self.model
        live = model.columns(len(points), integer=False, lo=-highspy.kHighsInf, hi=highspy.kHighsInf)
        dense = np.zeros(model.num_columns)  # λ_k's coefficients: the scale changes are measured against
        slots_before: set[int] = set()
        shared_before: set[int] = set()
        counts_before: dict[tuple, int] = {}
        rows = []
        optimizer = self.problem.schedule.optimizer
        for k, (live_slots, signatures, const, live_shared) in enumerate(terms):
            slots = set(live_slots.tolist())
            shared = set(live_shared.tolist())
            counts: dict[tuple, int] = defaultdict(int)
            for signature, count in signatures:
                counts[signature] += count
            parts = [(self.choice_columns[slot_keys[i][0]], slot_vectors[slot_keys[i]] * (1.0 if i in slots else -1.0))
                     for i in sorted(slots ^ slots_before)]
            for g in sorted(shared ^ shared_before):
                cols, vals = self.shared_gradient(self.problem.shared_gradients[g])
                parts.append((cols, vals * (1.0 if g in shared else -1.0)))
            for signature in sorted(counts.keys() | counts_before.keys()):
                change = counts.get(signature, 0) - counts_before.get(signature, 0)
                if change:
                    cols, vals = self.expressions[signature]
                    parts.append((cols, vals * change))
            if k and points[k] == optimizer and self.in_flight_column is not None:
                parts.append(self.first_point_extra(-1.0))  # the micro-batches in flight are done by the step
            cols, diff = summed(np.concatenate([c for c, _ in parts] or [np.zeros(0, np.int64)]),
                                np.concatenate([v for _, v in parts] or [np.zeros(0)]))
            dense[cols] += diff
            changed = np.abs(diff) > 1e-12 * max(1.0, float(np.abs(dense).max()))
            cols, diff = cols[changed], diff[changed]
            before, weight = ([live[k - 1]], [1.0]) if k else self.first_point_extra(float(points[k] < optimizer))
            model.row((np.concatenate([cols, [live[k]], before]).astype(np.int64),
                       np.concatenate([diff, [-1.0], weight])), 0.0, 0.0, RowTag("live-bytes", points[k]))
            rows.append(model.row({int(live[k]): 1.0, self.peak: -1.0}, -highspy.kHighsInf, -const,
                                  RowTag("memory", points[k])))
            self.live_column[points[k]] = int(live[k])
            slots_before, shared_before, counts_before = slots, shared, counts
        return rows

    def first_point_extra(self, sign: float = 1.0) -> tuple[list[int], list[float]]:
        """What the chain's first point holds besides its terms: (k − 1)·A, the other
        micro-batches in flight (none off a pipeline). Every L_t holds it through the chain
        but the optimizer step's, where ``sign`` −1 takes it back."""
        if self.in_flight_column is None:
            return [], []
        return [self.in_flight_column], [sign * self.problem.waiting_micro_batches]

    def expression(self, holders: _HolderIndex, key: int, mask: int, tensor: int) -> tuple[np.ndarray, np.ndarray]:
        """Bytes held of ``tensor`` (and every tensor of its kind) while the holders in ``mask`` live."""
        held = self.problem.held[tensor]
        active = _Active.of([h for k, h in enumerate(holders.by_tensor[tensor]) if mask >> k & 1])
        expr: dict[int, float] = defaultdict(float)
        for lid, layout in enumerate(held.layouts):
            nbytes = held.nbytes[lid] / self.bytes_unit
            if nbytes == 0:
                continue
            for col, value in self.layout_terms(active, layout, (key, mask, lid), held.key).items():
                expr[col] += value * nbytes
        return (np.fromiter(expr.keys(), dtype=np.int64, count=len(expr)),
                np.fromiter(expr.values(), dtype=float, count=len(expr)))

    def layout_terms(self, active: _Active, layout: Layout, key: tuple, producer: int) -> dict[int, float]:
        """Columns (with weights) counting the distinct tensors the ``active`` holders keep in
        ``layout``: the producer's tensor (its own holder, a copy kept in its layout) and, per
        edge, the consumer's copy (its input copy, its saved copy not kept, or the re-gathered
        one; the same copy written with different columns, each a row)."""
        at = self.indicators_at(layout)
        own = [ind for h in active.own if (ind := self.held_in(at, h, layout, "kept"))]
        copies = self.copies(active, layout, at)
        terms: dict[int, float] = defaultdict(float)
        base = None
        if active.producer is not None:
            # Every kept copy is in the producer's layout, so while the producer's holder is
            # live "its tensor is held in L" is the producer's indicator.
            base = self.held_in(at, active.producer, layout, "kept")
        elif not copies and len(own) == 1:
            base = own[0]
        elif len(copies) == 1 and _one_saved_tensor(next(iter(copies.values()))) and not active.owns:
            # One consumer's saved tensor (a copy, the producer's tensor kept, or the copy a
            # replay makes: disjoint flow copies, so their indicators add up): one tensor,
            # held in L iff "any" says so; a re-gathered copy beside it.
            (e, reps), = copies.items()
            base = defaultdict(float)
            for kind, _, anyone in reps:
                if kind in SAVED_KINDS:
                    for col, v in anyone.items():
                        base[col] += v
            rest = [r for r in reps if r[0] == REGATHER]
            copies = {e: rest} if rest else {}
        cols: list[int] = []
        if base is not None:
            for col, v in base.items():
                terms[col] += v
            cols = [c for e, reps in sorted(copies.items()) if (c := self.copy_column(e, layout, reps, producer)) is not None]
        elif own or copies:
            cols = self.held_columns_for(key, own, copies, producer, layout)
        for col in cols:
            terms[col] += 1.0
        return terms

    def copies(self, active: _Active, layout: Layout, at: dict) -> Copies:
        """Per edge, the live representations of its consumer's copy in ``layout`` (``at``: the
        indicators in it, ``indicators_at``)."""
        copies: Copies = {}
        for h in active.copies:
            if h.kind == INPUT_COPY:
                ind = self.held_in(at, h, layout, "all")
                rep = (h.kind, ind, ind)
            elif h.kind == SAVED:
                rep = (h.kind, self.held_in(at, h, layout, "copy"), self.held_in(at, h, layout, "all"))
            else:
                ind = self.held_in(at, h, layout, "copy")
                rep = (h.kind, ind, ind)
            reps = copies.setdefault(h.source, [])
            if rep[2]:
                reps.append(rep)
        return {e: reps for e, reps in copies.items() if reps}

    def copy_column(self, e: int, layout: Layout, reps: list[tuple[str, dict, dict]], producer: int) -> int | None:
        """c ≥ A − Π: edge ``e``'s consumer holds its own copy in ``layout`` (A: input copy,
        saved copy not kept or re-gathered copy, one row per representation ``reps`` of the
        copy; Π: the producer's output is exactly ``layout``, so the consumer holds the
        producer's tensor instead). Shared by every point where the same representations
        are live.

        For a saved or re-gathered copy Π is the edge flow's "producer layout L" under the
        same keep flag as A (not kept, kept): equal to the producer's indicator when the
        choices are integral, but in the LP relaxation a fractional plan can no longer
        cancel a kept edge's copy with the weight of another plan whose producer is in L
        and keeps nothing."""
        key = (e, layout, tuple([rep[0] for rep in reps]))
        if key not in self.copy_columns:
            if not any(copy for _, copy, _ in reps):
                self.copy_columns[key] = None
                return None
            col = int(self.model.columns(1, integer=False)[0])
            by_keep = self.flows[e].producer_layout_columns
            for kind, copy, _ in reps:
                if copy:
                    if kind == INPUT_COPY:
                        prod = self.producer_in(producer, layout)
                    else:
                        prod = {col: 1.0 for k in COPY_OF_FLOW.get(kind, (0,))
                                for col in by_keep.get(k, {}).get(layout, ())}
                    r = dict(copy)
                    for c, v in prod.items():
                        r[c] = r.get(c, 0.0) - v
                    r[col] = r.get(col, 0.0) - 1.0
                    self.model.row(r, -highspy.kHighsInf, 0.0, self.tag("copy", self.problem.edges[e].key))
            self.copy_columns[key] = col
        return self.copy_columns[key]

    def held_columns_for(self, key: tuple, own: list[dict], copies: Copies, producer: int, layout: Layout) -> list[int]:
        """Columns whose sum counts the distinct tensors held in ``layout`` once the producer's
        own holder has ended: y for the producer's tensor, c_e for edge e's consumer copy
        (``copy_column``). With K_e "edge e's consumer holds a copy in ``layout`` or keeps the
        producer's tensor in it":  y ≥ each indicator of the producer's tensor (kept copies),
        y + c_e ≥ K_e. With the choices integral the sum is exact (a consumer holding the
        producer's tensor may be counted in c_e instead of y, never twice)."""
        if key not in self.held_columns:
            inf = highspy.kHighsInf
            y = int(self.model.columns(1, integer=False)[0])
            cols = [y]
            tag = self.tag("held", self.problem.groups[producer].key)
            for ind in own:
                r = dict(ind)
                r[y] = r.get(y, 0.0) - 1.0
                self.model.row(r, -inf, 0.0, tag)
            for e in sorted(copies):
                c = self.copy_column(e, layout, copies[e], producer)
                if c is not None:
                    cols.append(c)
                for _, _, anyone in copies[e]:
                    r = dict(anyone)
                    r[y] = r.get(y, 0.0) - 1.0
                    if c is not None:
                        r[c] = r.get(c, 0.0) - 1.0
                    self.model.row(r, -inf, 0.0, tag)
            self.held_columns[key] = cols
        return self.held_columns[key]


def _one_saved_tensor(reps: list[tuple[str, dict, dict]]) -> bool:
    """The representations of one consumer's saved tensor (saved, made again by a replay),
    with at most its re-gathered copy beside them."""
    kinds = [kind for kind, _, _ in reps]
    return (bool(kinds) and set(kinds) <= {*SAVED_KINDS, REGATHER} and kinds.count(REGATHER) <= 1
            and len(kinds) > kinds.count(REGATHER))


@dataclass(frozen=True)
class _Active:
    """The live holders of a tensor, by what they hold (``LiveBytes.layout_terms``)."""

    producer: Holder | None  # the producer's own holder (the first), if live
    own: tuple[Holder, ...]  # the holders of the producer's tensor, and saved copies
    copies: tuple[Holder, ...]  # the holders of a consumer's copy (input, saved, re-gathered, replayed)
    owns: bool  # a holder of the producer's tensor

    @staticmethod
    def of(active: list[Holder]) -> _Active:
        return _Active(next((h for h in active if h.kind == PRODUCER), None),
                       tuple(h for h in active if h.kind in OWN_KINDS or h.kind == SAVED),
                       tuple(h for h in active if h.kind in (INPUT_COPY, SAVED) or h.kind in COPY_OF_FLOW),
                       any(h.kind in OWN_KINDS for h in active))


class _HolderIndex:
    """A tensor's live holders at a point as a bit mask over its holder list; (tensor kind,
    mask) — the kind being its producer group and holders (kinds, edges) — is a signature."""

    def __init__(self, problem: Problem):
        self.by_tensor: dict[int, list[Holder]] = defaultdict(list)
        position = []
        for h in problem.holders:
            position.append(len(self.by_tensor[h.tensor]))
            self.by_tensor[h.tensor].append(h)
        if position and max(position) >= 31:
            raise ValueError("a tensor with more than 31 holders")
        self.start = np.array([h.start for h in problem.holders])
        self.end = np.array([h.end for h in problem.holders])
        self.tensor = np.array([h.tensor for h in problem.holders])
        self.for_backward = np.array([h.kind in MADE_FOR_BACKWARD for h in problem.holders], dtype=bool)
        self.bit = np.left_shift(1, np.array(position, dtype=np.int64))
        kinds: dict[tuple, int] = {}
        self.kind = np.array([kinds.setdefault((held.key, tuple((h.kind, h.source) for h in self.by_tensor[t])),
                                               len(kinds)) for t, held in enumerate(problem.held)], dtype=np.int64)
        self.num_tensors = len(problem.held)

    def live_at(self, t: int, forward_only: bool = False) -> list[tuple[tuple[int, int], int, int]]:
        """(signature, a tensor that has it, how many have it) of the tensors held at ``t``;
        ``forward_only``: less the holders of what is made for the backward (transients)."""
        live = (self.start <= t) & (t <= self.end)
        act = np.nonzero(live & ~self.for_backward if forward_only else live)[0]
        masks = np.zeros(self.num_tensors, dtype=np.int64)
        np.bitwise_or.at(masks, self.tensor[act], self.bit[act])
        tensors = np.nonzero(masks)[0]
        combined = (self.kind[tensors] << 32) | masks[tensors]
        uniq, first, counts = np.unique(combined, return_index=True, return_counts=True)
        return [((u >> 32, u & 0xFFFFFFFF), int(tensors[f]), c)
                for u, f, c in zip(uniq.tolist(), first.tolist(), counts.tolist())]
