"""The planning problem: decision groups, their choices, how they couple, what they cost.

``build_problem`` turns a graph and a mesh into the data both the ILP (``solver.py``) and the
plan evaluator (``evaluate.py``) read, so the two price every plan identically:

- **op groups** choose a strategy per op; **storage groups** choose a parameter's gradient
  layout and ZeRO storage sharding. Identical layers share one group per role;
  ``instances`` counts the copies.
- **links**: two groups' choices must agree on a label (a storage option's gradient layout
  equals the one its op's strategy implies; tied weights agree across their uses).
- **edges**: an activation flowing producer → consumer. The producer's output layout and the
  consumer's input layout follow from the two ops' strategies; the edge itself only adds one
  free choice, ``keep``: the consumer saves its copy in the producer's (smaller) layout and
  gathers it again in backward, as Megatron's sequence parallelism does. An edge costs the
  forward reshard, the backward reshard of the gradient, and the re-gather when kept.
- **slots**: memory priced per choice of one group, live on a closed interval of schedule points.
- **holders**: an activation can be held at once by its producer (until its last forward use),
  by a consumer's input copy, and by every op that saves it. The producer's tensor counts
  once however many hold it (consumers reading it in its own layout, copies kept in it); a
  consumer that reads another layout holds its own copy (``holder_identity``).
- **ZeRO-3 gather unit** (``zero3_unit``): ``"op"`` gathers a ZeRO-3 weight around each op
  that uses it (least memory); ``"layer"`` gathers all of a layer's ZeRO-3 weights at once
  for the layer's forward and again for its backward, and reduces their gradients together
  (FSDP's unit: far fewer collectives, the layer's weights held across it). See
  :func:`layer_units`.
- **constants**: memory no choice changes (the input batch).
- **reshard points**: before an op's forward its inputs are resharded one by one, after its
  backward their gradients. A reshard holds its source, its intermediate layouts and the
  buffers its collectives allocate (``cost.reshard_memory``), priced per edge from the pair
  (producer layout, consumer layout) by ``reshard_price``; ``reshard_terms`` says which prices
  are live while each reshard of a point runs, the point's transient is the largest sum.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np

from memshard.cost import comm
from memshard.cost.memory import (
    CROSS_ENTROPY_CHUNKS,
    STATS_BYTES,
    STATS_IN_BACKWARD,
    StorageMemory,
    StorageOption,
    buffer_bytes,
    buffer_global_bytes,
    buffer_redundant_bytes,
    param_layout,
    redundant_bytes,
    storage_memory,
    storage_options,
    tensor_bytes,
)
from memshard.cost.reshard_memory import reshard_peak_bytes
from memshard.errors import MemshardError
from memshard.graph import Graph, Op, TensorKind, TensorSpec
from memshard.mesh import Mesh
from memshard.placement import PARTIAL, REPLICATE, Layout, Partial, Shard, local_numel, local_shape
from memshard.schedule import Schedule, candidate_points
from memshard.strategies import (
    Strategy,
    activation_inputs,
    enumerate_strategies,
    grad_layout,
    input_grad_layout,
    parameter_inputs,
)

# Holder kinds
PRODUCER = "producer"  # the producer's output until its last forward use (or its backward if saved)
SAVED = "saved"  # a consumer's saved copy: consumer layout, or producer layout when kept
INPUT_COPY = "input_copy"  # the consumer's input during its forward
REGATHER = "regather"  # a kept copy gathered again during the consumer's backward


@dataclass(frozen=True)
class Choice:
    label: Hashable
    compute_s: float
    calls: tuple[comm.Collective, ...]  # per instance: forward + backward + optimizer
    time_s: float


@dataclass
class OpGroup:
    """The ops of one role (one per layer when layers share variables): choice k is the
    strategy ``strategies[k]``."""

    key: str
    choices: list[Choice]
    strategies: list[Strategy]
    input_grads: list[list[Layout]]  # per input, per strategy: the layout of the input's gradient
    ops: list[int] = field(default_factory=list)  # op indices, one per instance
    instances: int = 0


@dataclass
class StorageGroup:
    """A parameter (one per layer when layers share variables): choice k is ``options[k]``,
    its gradient layout and ZeRO storage, costing ``memory[k]``."""

    key: str
    choices: list[Choice]
    options: list[tuple[tuple[str, ...], StorageOption]]
    memory: list[StorageMemory]
    params: list[str] = field(default_factory=list)  # parameter names, one per instance
    instances: int = 0


Group = OpGroup | StorageGroup


@dataclass(frozen=True)
class Link:
    a: int
    a_labels: tuple[Hashable, ...]
    b: int
    b_labels: tuple[Hashable, ...]


@dataclass
class Edge:
    key: str
    tensor: TensorSpec  # the first instance's tensor (all instances have its shape)
    producer: int  # op group
    consumer: int  # op group
    input_index: int
    saves: bool
    instances: int = 0
    executions: int = 0  # per step: instances × micro-batches

    def can_keep(self, producer_layout: Layout, consumer_layout: Layout) -> bool:
        return self.saves and not any(isinstance(p, Partial) for p in producer_layout)


ALWAYS, BEFORE_RESHARDS, DURING_RESHARDS = "always", "before_reshards", "during_reshards"  # Slot.phase


@dataclass(frozen=True)
class Slot:
    group: int
    start: int
    end: int
    category: str
    nbytes: np.ndarray  # per choice
    redundant: np.ndarray  # per choice
    global_bytes: float  # plan-independent unique bytes (0 for plan-dependent copies)
    # At its last point: held throughout (ALWAYS), or only before (BEFORE_RESHARDS) or only
    # while (DURING_RESHARDS) the reshards there run. A weight's gradient is reduced after its
    # op's backward and before the reshards of the op's input gradients.
    phase: str = ALWAYS

    @property
    def reshard_change(self) -> float:
        """How its last point's moment with reshards differs from the one before: +1 if it
        is held only while they run, −1 if only before, 0 if throughout."""
        return {ALWAYS: 0.0, BEFORE_RESHARDS: -1.0, DURING_RESHARDS: 1.0}[self.phase]


@dataclass(frozen=True)
class HeldTensor:
    name: str
    key: int  # the producer's op group: equal for the same tensor in every shared layer
    layouts: tuple[Layout, ...]
    nbytes: np.ndarray  # per layout id
    redundant: np.ndarray
    global_bytes: float

    def layout_id(self, layout: Layout) -> int:
        return self.layouts.index(without_partial(layout))


@dataclass(frozen=True)
class Holder:
    tensor: int  # index into Problem.held
    kind: str  # PRODUCER, SAVED, INPUT_COPY or REGATHER
    source: int  # op group (PRODUCER) or edge index
    start: int
    end: int


@dataclass(frozen=True)
class Constant:
    start: int
    end: int
    category: str
    nbytes: float
    redundant: float
    global_bytes: float


@dataclass(frozen=True)
class ReshardPoint:
    """The reshards an op runs at schedule point ``point``: its activation inputs' edges in
    input order (forward), or their gradients (``backward``); ``last[k]``: the op is the last
    consumer of edge k's tensor (its gradient then becomes the producer's). ``regather``:
    the copies its saved inputs kept in the producer's layout, gathered again as its backward
    starts (priced at the point before its backward: nothing of that backward lives yet)."""

    point: int
    backward: bool
    edges: tuple[int, ...]
    last: tuple[bool, ...]
    regather: bool = False


class EdgeLayouts(NamedTuple):
    """An edge's layouts under a plan: the producer's output and the consumer's input, the
    consumer's input gradient and the producer's output gradient (its output without
    partial sums), and whether the consumer keeps its saved copy in the producer's layout."""

    producer: Layout
    consumer: Layout
    consumer_grad: Layout
    producer_grad: Layout
    kept: bool


@dataclass(frozen=True)
class Selection:
    """A complete plan: one choice per group and the keep flag of every edge."""

    choices: tuple[int, ...]
    keeps: tuple[int, ...]


@dataclass
class Problem:
    graph: Graph
    mesh: Mesh
    schedule: Schedule
    shared_layers: bool
    groups: list[Group]
    links: list[Link]
    edges: list[Edge]
    slots: list[Slot]
    held: list[HeldTensor]
    holders: list[Holder]
    constants: list[Constant]
    candidate_points: list[int]
    op_group: list[int]  # op index → its group
    micro_batches: int
    edge_of_input: dict[tuple[int, int], int]  # (consumer op, input index) → edge
    storage_group: dict[str, int]  # parameter name → storage group
    reshard_points: list[ReshardPoint]
    zero3_unit: str = "op"  # one of ZERO3_UNITS

    def strategy(self, selection: Selection, group: int) -> Strategy:
        return self.groups[group].strategies[selection.choices[group]]

    def edge_layouts(self, selection: Selection, e: int) -> EdgeLayouts:
        """The layouts of edge ``e`` under ``selection``."""
        edge = self.edges[e]
        producer = self.strategy(selection, edge.producer).output_layout
        return EdgeLayouts(
            producer=producer,
            consumer=self.strategy(selection, edge.consumer).input_layouts[edge.input_index],
            consumer_grad=self.groups[edge.consumer].input_grads[edge.input_index][selection.choices[edge.consumer]],
            producer_grad=without_partial(producer),
            kept=bool(selection.keeps[e]),
        )

    def edge_calls(self, selection: Selection, e: int) -> tuple[comm.Collective, ...]:
        return edge_calls(self.edges[e].tensor, self.edge_layouts(selection, e), self.mesh)

    def holder_layout(self, selection: Selection, h: Holder) -> Layout | None:
        if h.kind == PRODUCER:
            return self.strategy(selection, h.source).output_layout
        edge = self.edge_layouts(selection, h.source)
        if h.kind == SAVED:
            return edge.producer if edge.kept else edge.consumer
        if h.kind == INPUT_COPY:
            return edge.consumer
        return edge.consumer if edge.kept else None

    def holder_identity(self, selection: Selection, h: Holder) -> int:
        """Which tensor a holder holds: −1 for the producer's own (its holder, a copy kept in
        its layout, a consumer reading exactly that layout), else the edge whose consumer made
        its own copy (consumers never share one: each reshards for itself)."""
        if h.kind == PRODUCER:
            return -1
        edge = self.edge_layouts(selection, h.source)
        if edge.producer == edge.consumer or (h.kind == SAVED and edge.kept):
            return -1
        return h.source

    def reshard_rows(self, selection: Selection, rp: ReshardPoint) -> list[float]:
        """Bytes live at ``rp`` beyond what spans it, while each of its reshards runs."""
        rows = []
        for terms in reshard_terms(rp):
            total = 0.0
            for e, kind, last in terms:
                layouts = self.edge_layouts(selection, e)
                if kind in KEPT_PRICES and not layouts.kept:
                    continue
                sides = ((layouts.producer_grad, layouts.consumer_grad) if kind in BACKWARD_PRICES
                         else (layouts.producer, layouts.consumer))
                total += reshard_price(self.edges[e].tensor, kind, *sides, self.mesh, last)
            rows.append(total)
        return rows


# What one edge adds at a reshard point, from (producer-side, consumer-side) layouts: forward
# (lp, lc), the reshard while it runs ("during", its result included) or the input copy it
# leaves ("after"); backward (gp, gc), the source gradient ("held") or the source and the
# reshard while it runs ("held+during"; the last consumer's result is the producer's output
# gradient, priced already); a kept copy's re-gather ("regathering", with the copies
# re-gathered before it, "regathered"), paid only if the edge keeps.
BACKWARD_PRICES = ("held", "held+during")
KEPT_PRICES = ("regathered", "regathering")
COPY_PRICES = ("after", "regathered", "held")  # a finished copy, not a reshard in flight


def reshard_terms(rp: ReshardPoint) -> list[list[tuple[int, str, bool]]]:
    """Each reshard of ``rp`` as the (edge, price, last consumer) terms live while it runs:
    forward, the input copies made before it and itself; backward, every source gradient (all
    exist when the first reshard starts) and itself."""
    if rp.backward:
        return [[(f, "held", lf) for f, lf in zip(rp.edges[:k] + rp.edges[k + 1:], rp.last[:k] + rp.last[k + 1:])]
                + [(e, "held+during", last)] for k, (e, last) in enumerate(zip(rp.edges, rp.last))]
    after, during = ("regathered", "regathering") if rp.regather else ("after", "during")
    return [[(f, after, False) for f in rp.edges[:k]] + [(e, during, False)] for k, e in enumerate(rp.edges)]


def reshard_price(spec: TensorSpec, kind: str, producer_side: Layout, consumer_side: Layout, mesh: Mesh,
                  last: bool) -> float:
    if producer_side == consumer_side:
        return 0.0
    if kind in COPY_PRICES:
        return _copy_bytes(spec, kind, consumer_side, mesh)
    if kind in BACKWARD_PRICES:  # "held+during"
        gp, gc = producer_side, consumer_side
        held = tensor_bytes(spec, without_partial(gc), mesh)
        during = reshard_peak_bytes(spec.shape, spec.dtype_bytes, gc, gp, mesh, reverse=True)
        return float(held + during - (tensor_bytes(spec, gp, mesh) if last else 0))
    return float(reshard_peak_bytes(spec.shape, spec.dtype_bytes, producer_side, consumer_side, mesh))


def reshard_price_table(spec: TensorSpec, kind: str, producer_sides: list[Layout], consumer_sides: list[Layout],
                        mesh: Mesh, last: bool) -> np.ndarray:
    """``reshard_price`` of every (producer side, consumer side) pair, as rows × columns."""
    if kind not in COPY_PRICES:
        return np.array([[reshard_price(spec, kind, a, c, mesh, last) for c in consumer_sides]
                         for a in producer_sides], dtype=float).reshape(len(producer_sides), len(consumer_sides))
    # a copy's bytes depend on the consumer side alone, and are 0 where the sides agree
    copy = np.array([_copy_bytes(spec, kind, c, mesh) for c in consumer_sides], dtype=float)
    same = np.array([[a == c for c in consumer_sides] for a in producer_sides], dtype=bool)
    return np.where(same.reshape(len(producer_sides), len(consumer_sides)), 0.0, copy)


def _copy_bytes(spec: TensorSpec, kind: str, consumer_side: Layout, mesh: Mesh) -> float:
    """The consumer's finished copy: its input (forward), or its input gradient (backward)."""
    return float(tensor_bytes(spec, without_partial(consumer_side) if kind == "held" else consumer_side, mesh))


def edge_calls(spec: TensorSpec, layouts: EdgeLayouts, mesh: Mesh) -> tuple[comm.Collective, ...]:
    """The forward reshard, the backward reshard of the gradient, and a kept copy's re-gather."""
    calls = comm.reshard(spec.shape, spec.dtype_bytes, layouts.producer, layouts.consumer, mesh)
    calls += comm.reshard(spec.shape, spec.dtype_bytes, layouts.consumer_grad, layouts.producer_grad, mesh,
                          reverse=True)
    if layouts.kept:
        calls += comm.reshard(spec.shape, spec.dtype_bytes, layouts.producer, layouts.consumer, mesh)
    return calls


# Ops whose backward does not read their weight (a lookup's gradient is a scatter of the
# output gradient): under ZeRO-3 their weight is gathered for forward only.
NO_WEIGHT_IN_BACKWARD = frozenset({"embedding", "embedding_add"})


def _gather_points(S: Schedule, graph: Graph, i: int) -> tuple[int, ...]:
    """The schedule points where ZeRO-3 holds op ``i``'s gathered weight: backward needs it
    only for the gradient of an activation input (a first layer on the raw input has none)."""
    op = graph.ops[i]
    if op.kind in NO_WEIGHT_IN_BACKWARD or not activation_inputs(graph, op):
        return (S.forward(i),)
    return (S.forward(i), S.backward(i))


ZERO3_UNITS = ("op", "layer")


@dataclass(frozen=True)
class LayerUnit:
    """The schedule of one layer's ZeRO-3 weights gathered as one unit (``zero3_unit="layer"``).

    Members are the parameters whose every use is an op of the layer. The gathered weights
    are held from the forward of the first op using a member to that of the last; again in
    backward from the backward of the last op that reads a member to that of the first; the
    members' gradients wait unsharded until the first op's backward, are copied into one flat
    buffer there and reduce-scattered together (at that op's gradient reshard point). The
    members are all ZeRO-3 alike or none is (``_Builder.link_layer_units``): the runtime
    gathers the members it holds from the first use of one to the last, so a unit of only
    some of them would span less than priced."""

    forward_span: tuple[int, int]
    backward_span: tuple[int, int] | None
    reduce_point: int
    members: int


def layer_units(graph: Graph, S: Schedule) -> dict[str, LayerUnit]:
    """Parameter name → its layer's unit, for the parameters all of whose uses are in one layer."""
    uses: dict[str, set[int]] = {}
    for i, op in enumerate(graph.ops):
        for j in parameter_inputs(graph, op):
            uses.setdefault(op.inputs[j].tensor, set()).add(i)
    members: dict[int, list[str]] = {}
    for name, ops_ in uses.items():
        layers = {graph.ops[i].layer for i in ops_}
        if len(layers) == 1 and None not in layers:
            members.setdefault(layers.pop(), []).append(name)
    units = {}
    for names in members.values():
        ops_ = sorted(set().union(*(uses[n] for n in names)))
        back = [i for i in ops_ if len(_gather_points(S, graph, i)) > 1]
        unit = LayerUnit(
            forward_span=(S.forward(ops_[0]), S.forward(ops_[-1])),
            backward_span=(S.backward(back[-1]), S.backward(back[0])) if back else None,
            reduce_point=S.reshard_out(ops_[0]),
            members=len(names),
        )
        units.update(dict.fromkeys(names, unit))
    return units


def without_partial(layout: Layout) -> Layout:
    return tuple(REPLICATE if isinstance(p, Partial) else p for p in layout)


def _role_key(op: Op, shared: bool) -> str:
    return op.role if shared and op.role is not None else op.name


class _Builder:
    def __init__(self, graph: Graph, mesh: Mesh, shared: bool, micro_batches: int, zero3_unit: str = "op"):
        self.g = graph
        self.mesh = mesh
        self.shared = shared
        self.k = micro_batches
        self.sched = Schedule(len(graph.ops))
        self.units = layer_units(graph, self.sched) if zero3_unit == "layer" else {}
        self.groups: list[Group] = []
        self.index: dict[tuple, int] = {}
        self.links: list[Link] = []
        self.edges: list[Edge] = []
        self.edge_index: dict[tuple, int] = {}
        self.slots: list[Slot] = []
        self.held: list[HeldTensor] = []
        self.holders: list[Holder] = []
        self.constants: list[Constant] = []
        self.last_consumer = {t: c[-1][0] for t, c in graph.consumers.items()}
        self.cache: dict[tuple, object] = {}

    def time(self, calls) -> float:
        return comm.total_time(calls, self.mesh)

    def slot(self, group, start, end, category, nbytes, redundant=None, global_bytes=0.0, phase=ALWAYS) -> None:
        nbytes = np.asarray(nbytes, float)
        if (nbytes.any() or global_bytes) and start <= end:
            red = np.zeros_like(nbytes) if redundant is None else np.asarray(redundant, float)
            self.slots.append(Slot(group, start, end, category, nbytes, red, float(global_bytes), phase))

    def redundant(self, nbytes, layouts) -> list[float]:
        return [redundant_bytes(b, L, self.mesh) for b, L in zip(nbytes, layouts)]

    def cached(self, key: tuple, make):
        """Per-group price vectors: every instance of a shared group has the same shapes."""
        if key not in self.cache:
            self.cache[key] = make()
        return self.cache[key]

    def layout_prices(self, spec: TensorSpec, layouts: list[Layout]) -> tuple[np.ndarray, np.ndarray]:
        nbytes = np.array([tensor_bytes(spec, L, self.mesh) for L in layouts], float)
        return nbytes, np.array(self.redundant(nbytes, layouts))

    def chunk_prices(self, spec: TensorSpec, layouts: list[Layout]) -> tuple[np.ndarray, np.ndarray]:
        """One row chunk of the local logits (see CROSS_ENTROPY_CHUNKS) in each layout."""
        nbytes = []
        for L in layouts:
            shape = local_shape(spec.shape, L, self.mesh.shape)
            rows = math.prod(shape[:-1])
            nbytes.append(-(-rows // CROSS_ENTROPY_CHUNKS) * shape[-1] * spec.dtype_bytes)
        nbytes = np.array(nbytes, float)
        return nbytes, np.array(self.redundant(nbytes, layouts))

    # -- ops ---------------------------------------------------------------------------------
    def op_choices(self, op: Op, strategies: list[Strategy]) -> list[Choice]:
        rate = self.mesh.peak_flops * self.mesh.compute_efficiency
        out = []
        for s in strategies:
            local = s.local_sizes
            flops = op.flops_per_point * math.prod(local.values()) * (1 + op.backward_flops_ratio)
            calls: tuple[comm.Collective, ...] = ()
            if op.stats_per_row:
                rows = math.prod(n for d, n in local.items() if d not in op.reduced_dims)
                axes = tuple(a for a, d in enumerate(s.assignment) if d in op.reduced_dims)
                calls = comm.all_reduce_over(rows * op.stats_per_row * STATS_BYTES, axes, self.mesh)
                if op.kind in STATS_IN_BACKWARD:
                    calls += comm.all_reduce_over(rows * STATS_IN_BACKWARD[op.kind] * STATS_BYTES, axes, self.mesh)
            compute = flops / rate * self.k
            calls *= self.k
            out.append(Choice(s.name(), compute, calls, compute + self.time(calls)))
        return out

    def add_ops(self) -> list[int]:
        op_group = []
        for i, op in enumerate(self.g.ops):
            key = ("op", _role_key(op, self.shared))
            if key not in self.index:
                strategies = list(enumerate_strategies(self.g, op, self.mesh))
                self.index[key] = len(self.groups)
                self.groups.append(OpGroup(key[1], self.op_choices(op, strategies), strategies, [
                    [input_grad_layout(s, op, j) for s in strategies] for j in range(len(op.inputs))]))
            gid = self.index[key]
            self.groups[gid].instances += 1
            self.groups[gid].ops.append(i)
            op_group.append(gid)
        return op_group

    def op_slots(self, op_group: list[int]) -> None:
        S, mesh = self.sched, self.mesh
        for i, op in enumerate(self.g.ops):
            gid = op_group[i]
            strategies = self.groups[gid].strategies
            buffers = self.cached((gid, "buffers"), lambda op=op, strategies=strategies: (
                [buffer_bytes(op, s) for s in strategies],
                [buffer_redundant_bytes(op, s, mesh) for s in strategies]))
            self.slot(gid, S.forward(i), S.backward(i), "activations", *buffers, buffer_global_bytes(self.g, op))
            if op.kind == "cross_entropy":
                chunk = self.cached((gid, "workspace"), lambda op=op, strategies=strategies: self.chunk_prices(
                    self.g.tensors[op.inputs[0].tensor], [s.input_layouts[0] for s in strategies]))
                self.slot(gid, S.forward(i), S.forward(i), "transients", *chunk)
            out = self.g.tensors[op.output.tensor]
            if op.output.tensor in self.last_consumer:
                # The gradient of the output in our layout, from its last consumer's reshard of
                # it (the consumers' own layouts before: their input-gradient slots) to ours.
                prices = self.cached((gid, "output_grad"), lambda out=out, strategies=strategies: self.layout_prices(
                    out, [without_partial(s.output_layout) for s in strategies]))
                self.slot(gid, S.reshard_out(self.last_consumer[op.output.tensor]), S.backward(i),
                          "transients", *prices, out.nbytes)
            for j in activation_inputs(self.g, op):
                t = op.inputs[j].tensor
                prices = self.cached((gid, "input_grad", j), lambda t=t, gid=gid, j=j: self.layout_prices(
                    self.g.tensors[t], [without_partial(L) for L in self.groups[gid].input_grads[j]]))
                # The last consumer's is the tensor's whole gradient until it is resharded.
                unique = self.g.tensors[t].nbytes if self.last_consumer[t] == i else 0.0
                self.slot(gid, S.backward(i), S.backward(i), "transients", *prices, unique)

    # -- activations flowing between ops ----------------------------------------------------
    def add_edges(self, op_group: list[int]) -> dict[tuple[int, int], int]:
        S = self.sched
        edge_of_input = {}
        holders: dict[str, list[tuple[str, int, int, int]]] = {}
        for i, op in enumerate(self.g.ops):
            for j in activation_inputs(self.g, op):
                t = op.inputs[j].tensor
                pg, cg = op_group[self.g.producer[t]], op_group[i]
                key = (self.groups[pg].key, self.groups[cg].key, j)
                if key not in self.edge_index:
                    self.edge_index[key] = len(self.edges)
                    self.edges.append(Edge(f"{key[0]} -> {key[1]}[{j}]", self.g.tensors[t], pg, cg, j,
                                           j in op.saves_inputs))
                e = self.edge_index[key]
                self.edges[e].instances += 1
                edge_of_input[(i, j)] = e
                entry = holders.setdefault(t, [])
                entry.append((INPUT_COPY, e, S.forward(i), S.forward(i)))
                if j in op.saves_inputs:
                    entry.append((SAVED, e, S.forward(i), S.backward(i)))
                    entry.append((REGATHER, e, S.backward(i), S.backward(i)))
        self.add_holders(op_group, holders)
        return edge_of_input

    def add_reshard_points(self, edge_of_input: dict[tuple[int, int], int]) -> list[ReshardPoint]:
        S = self.sched
        points = []
        for i, op in enumerate(self.g.ops):
            inputs = activation_inputs(self.g, op)
            if not inputs:
                continue
            edges = tuple(edge_of_input[(i, j)] for j in inputs)
            last = tuple(self.last_consumer[op.inputs[j].tensor] == i for j in inputs)
            points.append(ReshardPoint(S.reshard_in(i), False, edges, last))
            points.append(ReshardPoint(S.reshard_out(i), True, edges, last))
            kept = tuple(e for e, j in zip(edges, inputs) if j in op.saves_inputs)
            if kept and i + 1 < len(self.g.ops):  # re-gathers don't use ``last``
                points.append(ReshardPoint(S.reshard_out(i + 1), False, kept, (False,) * len(kept), regather=True))
        return points

    def add_holders(self, op_group: list[int], edge_holders: dict[str, list[tuple]]) -> None:
        S = self.sched
        for p, op in enumerate(self.g.ops):
            t = op.output.tensor
            spec = self.g.tensors[t]
            pg = op_group[p]
            end = S.backward(p) if op.saves_output else S.forward(self.last_consumer.get(t, p))
            edges = tuple(sorted({e for _, e, _, _ in edge_holders.get(t, [])}))

            def prices(pg=pg, edges=edges, spec=spec):
                layouts = [s.output_layout for s in self.groups[pg].strategies]
                for e in edges:
                    edge = self.edges[e]
                    layouts += [s.input_layouts[edge.input_index] for s in self.groups[edge.consumer].strategies]
                layouts = list(dict.fromkeys(without_partial(L) for L in layouts))
                return (layouts, *self.layout_prices(spec, layouts))

            layouts, nbytes, red = self.cached(("held", pg, edges), prices)
            hid = len(self.held)
            self.held.append(HeldTensor(t, pg, tuple(layouts), nbytes, red, float(spec.nbytes)))
            self.holders.append(Holder(hid, PRODUCER, pg, S.forward(p), end))
            for kind, e, start, stop in edge_holders.get(t, []):
                self.holders.append(Holder(hid, kind, e, start, stop))

    # -- parameters ----------------------------------------------------------------------------
    def add_storage(self, op_group: list[int]) -> dict[str, int]:
        S, mesh, prec = self.sched, self.mesh, self.g.precision
        uses_of: dict[str, list[tuple[int, int]]] = {}
        for i, op in enumerate(self.g.ops):
            for j in parameter_inputs(self.g, op):
                uses_of.setdefault(op.inputs[j].tensor, []).append((i, j))
        storage_group = {}
        for name in self.g.parameters:
            uses = uses_of.get(name)
            if not uses:
                continue
            spec = self.g.tensors[name]
            i0, j0 = uses[0]
            og = op_group[i0]
            key = ("storage", self.groups[og].key, j0)
            if key not in self.index:
                g_labels = [grad_layout(self.g.ops[i0], j0, s) for s in self.groups[og].strategies]
                options = [(G, opt) for G in dict.fromkeys(g_labels) for opt in storage_options(G, mesh)]
                choices = []
                for G, opt in options:
                    calls = self.sync_calls(spec, G, opt, self.gathers_per_pass(name, uses))
                    if opt.stage == 3 and name in self.units:  # the unit's calls, shared
                        share = 1 / self.units[name].members
                        calls = tuple(replace(c, share=share) if c.kind != comm.ALL_REDUCE else c for c in calls)
                    choices.append(Choice((G, opt.stage, opt.axes), 0.0, calls, self.time(calls)))
                self.index[key] = len(self.groups)
                mems = [storage_memory(spec, G, opt, prec, mesh) for G, opt in options]
                self.groups.append(StorageGroup(name, choices, options, mems))
                gid = self.index[key]
                self.links.append(Link(gid, tuple(G for G, _ in options), og, tuple(g_labels)))
                for i, j in uses[1:]:  # tied weights: every use agrees on the layout
                    other = op_group[i]
                    self.links.append(Link(og, tuple(g_labels), other, tuple(
                        grad_layout(self.g.ops[i], j, s) for s in self.groups[other].strategies)))
            gid = self.index[key]
            grp = self.groups[gid]
            grp.instances += 1
            grp.params.append(name)
            storage_group[name] = gid
            v = self.cached((gid, "storage"), lambda grp=grp: self.storage_prices(grp))
            self.slot(gid, 0, S.optimizer, "parameters", *v["parameters"], spec.numel * prec.param_bytes)
            self.slot(gid, 0, S.optimizer, "optimizer_states", *v["optimizer_states"], spec.numel * prec.optimizer_bytes)
            # With several micro-batches the gradients accumulate across them: live all step.
            # Stored sharded (ZeRO-2/3), the gradient exists once every use's contribution is
            # reduce-scattered, after the first use's backward (the last one to run); until
            # then the whole local gradient waits, from the last use's backward on.
            first, last = uses[-1][0], uses[0][0]
            grads_from = S.backward(first) if self.k == 1 else 0
            reduced_at = S.reshard_out(last) if self.k == 1 else 0
            # A tied weight's gradient waits in autograd's input buffer, not yet the
            # parameter's .grad, until its last contribution (the first use's backward):
            # a transient until then (as MemTracker files it).
            summed_at = S.backward(last)
            grad_bytes = spec.numel * prec.grad_bytes
            if reduced_at > grads_from:
                whole = np.array([opt.stage < 2 for _, opt in grp.options], float)
                nbytes, red = v["gradients"]
                self.slot(gid, grads_from, summed_at - 1, "transients", nbytes * whole, red * whole, grad_bytes)
                self.slot(gid, summed_at, reduced_at - 1, "gradients", nbytes * whole, red * whole, grad_bytes)
            for i, _ in uses[:-1]:
                # A tied weight's earlier uses (later in backward): autograd sums their two
                # gradient contributions into a new buffer while both are still alive.
                self.slot(gid, S.backward(i), S.backward(i), "transients", *v["contributions"])
            unit = self.units.get(name)
            stages = np.array([opt.stage for _, opt in grp.options])
            # A layer unit's member under ZeRO-3: gathered for the unit's spans, its gradient
            # reduced with the unit's (after a copy into the unit's flat buffer); every other
            # option reduces its own gradient after the first use's backward.
            in_unit = (stages == 3) & (unit is not None)
            self.reduced_gradient(gid, v, stages, ~in_unit, reduced_at, grad_bytes, before_reshards=True)
            # ZeRO-2/3: the whole local gradient until its reduce-scatter; under ZeRO-2 the
            # parameter's .grad from its last contribution on (ZeRO-3 reduces its own).
            unsharded, red = v["unsharded"]
            zero2 = stages == 2
            zero3_per_op = ~in_unit & ~zero2  # (the unsharded bytes are 0 below ZeRO-2)
            self.slot(gid, S.backward(first), S.reshard_out(last), "transients", unsharded * zero3_per_op,
                      red * zero3_per_op, phase=BEFORE_RESHARDS)
            self.slot(gid, S.backward(first), summed_at - 1, "transients", unsharded * zero2, red * zero2)
            self.slot(gid, summed_at, S.reshard_out(last), "gradients", unsharded * zero2, red * zero2,
                      phase=BEFORE_RESHARDS)
            if unit is None:
                for i, _ in uses:
                    for point in _gather_points(S, self.g, i):
                        self.slot(gid, point, point, "transients", *v["gathered"])
                continue
            self.reduced_gradient(gid, v, stages, in_unit, unit.reduce_point if self.k == 1 else 0, 0.0,
                                  before_reshards=False)
            self.slot(gid, S.backward(first), unit.reduce_point, "transients", unsharded * in_unit, red * in_unit)
            self.slot(gid, unit.reduce_point, unit.reduce_point, "transients", unsharded * in_unit, red * in_unit)
            for span in (unit.forward_span, unit.backward_span):
                if span is not None:
                    self.slot(gid, *span, "transients", *v["gathered"])
                    # Gathered over several axes, one at a time: the partial results too.
                    self.slot(gid, span[0], span[0], "transients", *v["gathering"])
            self.slot(gid, unit.reduce_point, unit.reduce_point, "transients", *v["scattering"])
        self.link_layer_units(storage_group)
        return storage_group

    def link_layer_units(self, storage_group: dict[str, int]) -> None:
        """A layer unit is all or nothing, as FSDP's: every member ZeRO-3 over the same axes
        (and partial over them alike), gathered as one flat buffer; or none ZeRO-3. The
        runtime gathers the members it holds from the first use of one to the last; with a
        layer's parameters all in one unit that is the layer's span the unit is priced over."""
        def label(G, opt):
            return ("unit", opt.axes, tuple(G[a] == "P" for a in opt.axes)) if opt.stage == 3 else "apart"

        linked = set()
        by_unit: dict[int, list[int]] = {}
        for name, unit in self.units.items():
            if name in storage_group:
                by_unit.setdefault(id(unit), []).append(storage_group[name])
        for gids in by_unit.values():
            gids = sorted(set(gids))
            if len(gids) < 2 or tuple(gids) in linked:
                continue
            linked.add(tuple(gids))
            labels = {g: tuple(label(G, opt) for G, opt in self.groups[g].options) for g in gids}
            for g in gids[1:]:
                self.links.append(Link(gids[0], labels[gids[0]], g, labels[g]))

    def reduced_gradient(self, gid: int, v: dict, stages: np.ndarray, options: np.ndarray, at: int,
                         global_bytes: float, before_reshards: bool) -> None:
        """The stored gradient of ``options`` from its reduction at point ``at`` on. A ZeRO-2/3
        reduce-scatter's result is a transient there (the optimizer's .grad once it returns;
        ``before_reshards``: it returns before the reshards at ``at`` run); with micro-batches
        each one's is added to the gradient kept all step."""
        nbytes, red = v["gradients"]
        scattered = options & (stages >= 2) & (self.k == 1)
        kept = options & ~scattered
        self.slot(gid, at, self.sched.optimizer, "gradients", nbytes * kept, red * kept,
                  global_bytes)
        if before_reshards:  # reduced before the reshards at ``at``: .grad while they run
            self.slot(gid, at, at, "transients", nbytes * scattered, red * scattered, phase=BEFORE_RESHARDS)
            self.slot(gid, at, at, "gradients", nbytes * scattered, red * scattered, phase=DURING_RESHARDS)
        else:
            self.slot(gid, at, at, "transients", nbytes * scattered, red * scattered)
        self.slot(gid, at + 1, self.sched.optimizer, "gradients", nbytes * scattered, red * scattered)

    def gathers_per_pass(self, name: str, uses: list[tuple[int, int]]) -> int:
        """All-gathers of a ZeRO-3 weight per micro-batch: one per use and gather point, or
        its layer unit's (one for forward, one for backward if any op there reads it)."""
        unit = self.units.get(name)
        if unit is None:
            return sum(len(_gather_points(self.sched, self.g, i)) for i, _ in uses)
        return 1 + (unit.backward_span is not None)

    def storage_prices(self, grp: StorageGroup) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        mems = grp.memory
        layouts = [param_layout(G) for G, _ in grp.options]

        def vec(field: str, red_field: str | None = None):
            nbytes = np.array([getattr(m, field) for m in mems], float)
            red = (np.array([getattr(m, red_field) for m in mems]) if red_field
                   else np.array(self.redundant(nbytes, layouts)))
            return nbytes, red

        gathering, scattering = [], []
        for G, opt in grp.options:
            if opt.stage < 3 or not self.units:
                gathering.append(0.0)
                scattering.append(0.0)
                continue
            numel = local_numel(self.g.tensors[grp.params[0]].shape, param_layout(G), self.mesh.shape)
            flat = tuple(Shard(0) if a in opt.axes else REPLICATE for a in range(self.mesh.ndim))
            whole = tuple(REPLICATE for _ in flat)
            partial = tuple(PARTIAL if a in opt.axes and g == "P" else REPLICATE for a, g in enumerate(G))
            prec = self.g.precision
            gathering.append(reshard_peak_bytes((numel,), prec.param_bytes, flat, whole, self.mesh, reverse=True)
                             - numel * prec.param_bytes)
            scattering.append(reshard_peak_bytes((numel,), prec.grad_bytes, partial, flat, self.mesh)
                              - local_numel((numel,), flat, self.mesh.shape) * prec.grad_bytes)
        zeros = np.zeros(len(mems))
        return {
            "gathering": (np.array(gathering, float), zeros),
            "scattering": (np.array(scattering, float), zeros),
            "parameters": vec("parameters", "redundant_parameters"),
            "optimizer_states": vec("optimizer_states", "redundant_optimizer_states"),
            "gradients": vec("gradients", "redundant_gradients"),
            "gathered": vec("gathered_weight"),
            "unsharded": vec("unsharded_gradient"),
            "contributions": vec("gradient_contributions"),
        }

    def sync_calls(self, spec: TensorSpec, G: tuple[str, ...], opt: StorageOption, n_gathers: int):
        """Gradient reduction and weight gathers one step needs for this storage option.

        Gradients are reduced once per step (accumulated locally over micro-batches) unless
        they are stored sharded (ZeRO-2/3), which reduces them after every micro-batch;
        ZeRO-3 gathers the weight ``n_gathers`` times per micro-batch (``gathers_per_pass``)."""
        mesh, prec = self.mesh, self.g.precision
        numel = local_numel(spec.shape, param_layout(G), mesh.shape)
        partial_axes = tuple(a for a, g in enumerate(G) if g == "P")
        sharded = set(opt.axes) if opt.stage >= 1 else set()
        reduce = comm.all_reduce_over(numel * prec.grad_bytes, tuple(a for a in partial_axes if a not in sharded), mesh)
        if sharded:
            reduce += comm.reduce_scatter_flat(numel, prec.grad_bytes, tuple(a for a in opt.axes if a in partial_axes), mesh)
        calls = reduce * (self.k if opt.stage >= 2 else 1)
        if opt.stage in (1, 2):
            calls += comm.gather_flat(numel, prec.param_bytes, opt.axes, mesh)
        elif opt.stage == 3:
            calls += comm.gather_flat(numel, prec.param_bytes, opt.axes, mesh) * (n_gathers * self.k)
        return calls

    def add_inputs(self) -> None:
        n = self.mesh.num_devices
        for spec in self.g.tensors.values():
            if spec.kind is TensorKind.INPUT:
                self.constants.append(Constant(0, self.sched.optimizer, "activations", spec.nbytes,
                                               spec.nbytes * (1 - 1 / n), spec.nbytes))


def build_problem(graph: Graph, mesh: Mesh, shared_layers: bool = True, micro_batches: int = 1,
                  zero3_unit: str = "op") -> Problem:
    """``graph`` describes one micro-batch; a step runs ``micro_batches`` of them (gradient
    accumulation) and one optimizer update. ``zero3_unit``: see :class:`LayerUnit`."""
    if zero3_unit not in ZERO3_UNITS:
        raise MemshardError(f"the ZeRO-3 gather unit must be one of {', '.join(ZERO3_UNITS)}, got {zero3_unit!r}")
    b = _Builder(graph, mesh, shared_layers, micro_batches, zero3_unit)
    op_group = b.add_ops()
    b.op_slots(op_group)
    edge_of_input = b.add_edges(op_group)
    for edge in b.edges:
        edge.executions = edge.instances * micro_batches
    storage_group = b.add_storage(op_group)
    b.add_inputs()
    return Problem(
        graph=graph, mesh=mesh, schedule=b.sched, shared_layers=shared_layers, groups=b.groups,
        links=b.links, edges=b.edges, slots=b.slots, held=b.held, holders=b.holders,
        constants=b.constants, candidate_points=candidate_points(graph, b.sched, shared_layers),
        op_group=op_group, micro_batches=micro_batches, edge_of_input=edge_of_input,
        storage_group=storage_group, reshard_points=b.add_reshard_points(edge_of_input),
        zero3_unit=zero3_unit,
    )


def storage_links(problem: Problem) -> list[Link]:
    """The links from a parameter's storage group to its (first) op's group: the storage's
    gradient layout is the one the op's strategy gives. (The other links tie a tied weight's
    uses, or a layer unit's members.)"""
    return [link for link in problem.links
            if isinstance(problem.groups[link.a], StorageGroup) and isinstance(problem.groups[link.b], OpGroup)]


def complete_selection(
    problem: Problem,
    strategies: dict[int, int],
    storage: dict[int, StorageOption] | None = None,
    keeps: dict[int, int] | None = None,
) -> Selection:
    """A full selection from each op group's strategy index; storage groups take the option
    given (default: none) with the gradient layout the strategy implies; edges keep nothing
    unless told."""
    choices = [0] * len(problem.groups)
    for gid, k in strategies.items():
        choices[gid] = k
    for link in storage_links(problem):
        gid = link.a
        want_g = link.b_labels[choices[link.b]]
        opt = (storage or {}).get(gid, StorageOption(0))
        options = problem.groups[gid].options
        try:
            choices[gid] = options.index((want_g, opt))
        except ValueError:
            raise ValueError(f"storage {opt} is not available for {problem.groups[gid].key}") from None
    keep = [0] * len(problem.edges)
    for e, k in (keeps or {}).items():
        keep[e] = k
    return Selection(tuple(choices), tuple(keep))
