"""The planning problem: decision groups, their choices, how they couple, what they cost.

These are the records both the ILP (``search/``) and the plan evaluator (``evaluate.py``) read,
so the two price every plan identically; ``pricing.build_problem`` makes them from a graph
and a mesh. A plan is a :class:`Selection`: one choice per group, a keep flag per edge.

- **op groups** choose a strategy per op, and, where recomputation is searched, whether the
  op is replayed before its layer's backward (``OpGroup.replays``, see ``recompute.py``);
  **storage groups** choose a parameter's gradient layout and ZeRO storage sharding.
  Identical layers share one group per role; ``instances`` counts the copies.
- **links**: two groups' choices must agree on a label (a storage option's gradient layout
  equals the one its op's strategy implies; tied weights agree across their uses).
- **edges**: an activation flowing producer → consumer. The producer's output layout and the
  consumer's input layout follow from the two ops' strategies; the edge itself only adds one
  free choice, ``keep``: the consumer saves its copy in the producer's (smaller) layout and
  gathers it again in backward, as Megatron's sequence parallelism does. An edge costs the
  forward reshard, the backward reshard of the gradient, and the re-gather when kept.
- **slots**: memory priced per choice of one group, live on a closed interval of schedule points.
- **shared gradients**: an add hands its output's gradient itself to both inputs; where both
  producers receive it in its own layout, their two output-gradient slots are one tensor
  (``SharedGradient`` takes one back).
- **holders**: an activation can be held at once by its producer (until its last forward use),
  by a consumer's input copy, and by every op that saves it; with recomputation also by a
  replay (what it makes again, what it reads). The producer's tensor counts
  once however many hold it (consumers reading it in its own layout, copies kept in it); a
  consumer that reads another layout holds its own copy (``holder_identity``).
- **ZeRO-3 gather unit** (``zero3_unit``): ``"op"`` gathers a ZeRO-3 weight around each op
  that uses it (least memory); ``"layer"`` gathers all of a layer's ZeRO-3 weights at once
  for the layer's forward and again for its backward, and reduces their gradients together
  (FSDP's unit: far fewer collectives, the layer's weights held across it). See
  ``gathers.layer_units``.
- **framework**: what runs the plan (``FRAMEWORKS``): memshard's runtime, or the PyTorch
  implementation a baseline is named after, priced as it allocates (``fsdp2``, ``ddp``).
- **constants**: memory no choice changes (a traced model's inputs besides the batch:
  its rotary tables; the batch is priced at each op choice's share, ``pricing.add_inputs``).
- **reshard points**: before an op's forward its inputs are resharded one by one, after its
  backward their gradients. A reshard holds its source, its intermediate layouts and the
  buffers its collectives allocate (``cost.reshard_memory``), priced per edge from the pair
  (producer layout, consumer layout) by ``reshard_price``; ``reshard_terms`` says which prices
  are live while each reshard of a point runs, the point's transient is the largest sum.
- **pipeline stage** (``PipelineStage``): the problem of one stage's rank, whose other
  micro-batches in flight each hold what one holds between its forward and its backward
  (``Problem.waiting_micro_batches``).
"""

from __future__ import annotations

import functools
from collections.abc import Hashable
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np

from memshard.core.graph import MIXED, Graph, TensorKind, TensorSpec
from memshard.core.mesh import Mesh
from memshard.core.placement import REPLICATE, Layout, Partial
from memshard.problem import comm
from memshard.problem.eager import as_eager
from memshard.problem.memory import (
    StorageMemory,
    StorageOption,
    tensor_bytes,
)
from memshard.problem.reshard_memory import reshard_peak_bytes
from memshard.problem.schedule import Schedule
from memshard.problem.strategies import Strategy
from memshard.problem.tensor_parallel import with_input_gathers, with_output_scatters

# Holder kinds
PRODUCER = "producer"  # the producer's output until its last forward use (or its backward if saved)
SAVED = "saved"  # a consumer's saved copy: consumer layout, or producer layout when kept
# What runs a plan, and so what it allocates besides the model's own tensors: memshard's
# runtime; or, for the baselines named after them, PyTorch's fully_shard on every layer and
# the root module (``gathers.fsdp2_units``: ZeRO-3 gathered by layer, the root all step,
# prefetch, flat buffers; FSDP2_NO_RESHARD: ``reshard_after_forward=False`` on every layer, its
# weights gathered once, from the layer's forward to its backward; FSDP2_PREFETCH: explicit
# prefetching of the next and the previous ``explicit_prefetch`` layers, as PyTorch's FSDP2
# example sets it; FSDP2_TORCHTITAN: torchtitan's wrapping, the token embedding and the
# output layers units of their own; FSDP2_RESHARD_NODE: ``reshard_after_forward`` = the
# innermost axis's size, each layer's weights resharded within a node after forward) and
# DistributedDataParallel
# (its gradient buckets, a second copy of the gradients; DDP_BUCKET_VIEW:
# ``gradient_as_bucket_view=True``, the buckets are the gradients); TORCH_TP: PyTorch's
# parallelize_module with torchtitan's plan (``tensor_parallel.with_input_gathers``: each
# block's attention and MLP input gathered once) × fully_shard as FSDP2 (TORCH_TP_NO_RESHARD: with
# ``reshard_after_forward=False``; TORCH_TP_TORCHTITAN: with torchtitan's units, as
# FSDP2_TORCHTITAN); MEGATRON: Megatron-LM's fused GEMMs (``tensor_parallel.with_input_gathers``
# with ``saved_split``: QKV's and fc1's input gathered once, saved split, gathered again in
# backward, its gradient reduced once) and its
# gradient buffer (``pricing.build_problem``: every local gradient in fp32, all step, reduced in
# fp32; MEGATRON_OVERLAP: the same with ``--overlap-grad-reduce --overlap-param-gather``). Not a
# search option: memshard's runtime executes "memshard" plans only.
MEMSHARD, FSDP2, DDP, TORCH_TP, MEGATRON = "memshard", "fsdp2", "ddp", "torch-tp", "megatron"
MEGATRON_OVERLAP = "megatron-overlap"
MEGATRON_FRAMEWORKS = (MEGATRON, MEGATRON_OVERLAP)
FSDP2_NO_RESHARD, DDP_BUCKET_VIEW, TORCH_TP_NO_RESHARD = "fsdp2-noreshard", "ddp-bucket-view", "torch-tp-noreshard"
FSDP2_PREFETCHED = 2  # the layers FSDP2_PREFETCH prefetches each way
FSDP2_PREFETCH = f"fsdp2-prefetch{FSDP2_PREFETCHED}"
FSDP2_TORCHTITAN, FSDP2_RESHARD_NODE = "fsdp2-torchtitan", "fsdp2-reshard-node"
TORCH_TP_TORCHTITAN = "torch-tp-torchtitan"
FRAMEWORKS = (MEMSHARD, FSDP2, FSDP2_NO_RESHARD, FSDP2_PREFETCH, FSDP2_TORCHTITAN, FSDP2_RESHARD_NODE, DDP, DDP_BUCKET_VIEW, TORCH_TP,
              TORCH_TP_NO_RESHARD, TORCH_TP_TORCHTITAN, MEGATRON, MEGATRON_OVERLAP)
TORCH_TP_FRAMEWORKS = (TORCH_TP, TORCH_TP_NO_RESHARD, TORCH_TP_TORCHTITAN)  # parallelize_module with torchtitan's plan
NO_RESHARD_FRAMEWORKS = (FSDP2_NO_RESHARD, TORCH_TP_NO_RESHARD)  # fully_shard(reshard_after_forward=False)
FSDP2_FRAMEWORKS = (FSDP2, FSDP2_NO_RESHARD, FSDP2_PREFETCH, FSDP2_TORCHTITAN, FSDP2_RESHARD_NODE, *TORCH_TP_FRAMEWORKS)  # fully_shard on every layer and the root
DDP_FRAMEWORKS = (DDP, DDP_BUCKET_VIEW)
TORCH_FRAMEWORKS = (*FSDP2_FRAMEWORKS, *DDP_FRAMEWORKS)  # run with torch.optim.Adam (foreach)
# The frameworks that run a layer's data-parallel collectives on a stream of their own, beside the
# compute: FSDP2 prefetches the next layer's all-gather and reduce-scatters a layer's gradients
# while the backward goes on; DDP all-reduces its buckets during the backward; Megatron-LM with
# ``--overlap-grad-reduce --overlap-param-gather`` reduce-scatters its gradient buckets during
# the backward and gathers the updated weights during the next forward; memshard's runtime
# reduces a ZeRO-0/1 weight's gradient during the backward, as soon as it is final, and gathers
# a ZeRO-1/2 weight during the next forward (``runtime/stores.py``, priced by
# ``storage.overlapped_calls``; its other collectives run in line). The root's (the embedding's, the head's)
# wait: the first all-gather starts the step, the last reduction ends it. Megatron-LM by
# default runs every collective in line. See ``Choice.overlapped_s`` and
# ``evaluate.hidden_communication``.
OVERLAPPING_FRAMEWORKS = (MEMSHARD, *TORCH_FRAMEWORKS, MEGATRON_OVERLAP)


def explicit_prefetch(framework: str) -> int:
    """How many layers each ``fully_shard`` of ``framework`` prefetches explicitly
    (``set_modules_to_forward_prefetch`` / ``…_backward_prefetch``); 0: FSDP2's default."""
    return FSDP2_PREFETCHED if framework == FSDP2_PREFETCH else 0


def framework_graph(graph: Graph, framework: str) -> Graph:
    """``graph`` as ``framework`` (``problem.FRAMEWORKS``) runs it."""
    if framework in TORCH_FRAMEWORKS:  # the eager module's views, not memshard's runtime's copies
        graph = as_eager(graph)
    if framework in TORCH_TP_FRAMEWORKS:
        graph = with_input_gathers(with_output_scatters(graph))
    if framework in MEGATRON_FRAMEWORKS:  # bf16 training accumulates and reduces gradients in fp32 (main_grad)
        # (the projections Megatron-LM fuses into one GEMM gather their input once, save it split)
        graph = with_input_gathers(graph, saved_split=True)
        graph = replace(graph, precision=replace(graph.precision, grad_bytes=4))
    if framework in FSDP2_FRAMEWORKS and graph.precision.name == MIXED.name:
        # FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): bf16 gathered
        # weights and computed gradients, the fp32 shard the master weight (as memshard's
        # ZeRO-3), gradients reduce-scattered in fp32
        graph = replace(graph, precision=replace(graph.precision, reduced_grad_bytes=4))
    return graph


def fsdp2_options(framework: str, node: int) -> dict:
    """The options of ``gathers.fsdp2_units`` that an FSDP2 framework sets (``node``: the
    devices of the mesh's innermost axis)."""
    return {"reshard_after_forward": framework not in NO_RESHARD_FRAMEWORKS,
            "post_forward_group": node if framework == FSDP2_RESHARD_NODE else 0,
            "prefetch": explicit_prefetch(framework), "wrap_ends": framework in (FSDP2_TORCHTITAN, TORCH_TP_TORCHTITAN)}


INPUT_COPY = "input_copy"  # the consumer's input during its forward
REGATHER = "regather"  # a kept copy gathered again during the consumer's backward
# Recomputation (``recompute.py``): the producer's saved output kept through the forward-to-
# backward gap unless it is replayed; a consumer's saved copy made again by the replay; the
# producer's tensor held for a replaying consumer until its layer's replay.
RETAINED = "retained"
REPLAYED = "replayed"
SOURCE = "source"
# PyTorch's selective checkpoint (``TORCH_FRAMEWORKS``) caches the output of an op its policy
# saves from the forward until the recompute reaches that op, needed or not, wherever the
# op's layer recomputes something.
CACHED = "cached"
# During the replay (``schedule.Schedule.replay``): a replayed op's output as it makes it; the
# replayed producer's output kept for a replayed reader until that reader's replay; a
# replayed reader's input copy (an input it does not save) while it runs.
REPLAYED_AHEAD = "replayed_ahead"  # a ticket the producer's replay makes for a consumer not replayed
REPLAY_OUT = "replay_out"
REPLAY_READ = "replay_read"
REPLAY_INPUT = "replay_input"
# Holders of a tensor made for the backward (transients; with a replayed producer's own holder
# from its replay on, which starts after ``Schedule.boundary``: ``Problem.made_in_backward``)
MADE_FOR_BACKWARD = (REGATHER, REPLAYED, REPLAYED_AHEAD, REPLAY_OUT, REPLAY_READ, REPLAY_INPUT)
OWN_KINDS = (PRODUCER, RETAINED, CACHED, SOURCE, REPLAY_OUT, REPLAY_READ)  # holders of the producer's own tensor
GROUP_KINDS = (PRODUCER, RETAINED, CACHED, REPLAY_OUT)  # holders whose source is the producer's op group


@dataclass(frozen=True)
class Choice:
    label: Hashable
    compute_s: float
    calls: tuple[comm.Collective, ...]  # per instance: forward + backward + optimizer
    time_s: float
    replay_s: float = 0.0  # per instance: what its replay adds (in compute_s and calls already)
    # per instance: of time_s, the collectives a framework that overlaps (``Problem.overlaps``)
    # runs beside the compute: a layer's gathers and gradient reductions (memshard's runtime:
    # a layer's ZeRO-0 gradient all-reduces only)
    overlapped_s: float = 0.0
    # of overlapped_s, the collectives run once a step, not once a micro-batch: the gradient
    # reductions of the backward that syncs (the last micro-batch's) and the updated shards'
    # gathers before the first forward; they hide under one micro-batch's compute at most
    overlapped_once_s: float = 0.0
    # per instance: of the collectives beside it, the seconds its own compute hides (a layer
    # linear's TP collectives under its GEMMs, ``tp_overlap.py``; a fixed plan's only)
    hidden_s: float = 0.0


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
    replays: list[bool] = field(default_factory=list)  # per choice: the op is recomputed (empty: never)

    def replayed(self, choice: int) -> bool:
        return bool(self.replays) and self.replays[choice]

    @property
    def replay_choices(self) -> tuple[int, ...]:
        return tuple(c for c, r in enumerate(self.replays) if r)

    @property
    def may_replay(self) -> bool:
        return any(self.replays)

    @property
    def always_replays(self) -> bool:
        return bool(self.replays) and all(self.replays)

    def choice_of(self, assignment: tuple, replayed: bool = False) -> int | None:
        """The choice with this assignment and recompute flag (the flag the group has, where
        its policy fixes it); None if the op has no such strategy."""
        flags = set(self.replays) or {False}
        if replayed not in flags:
            replayed = not replayed
        for c, s in enumerate(self.strategies):
            if s.assignment == assignment and self.replayed(c) == replayed:
                return c
        return None


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


@dataclass(frozen=True)
class Conflict:
    """Two choices no plan may take together: group ``a`` in ``a_choices`` and ``b`` in
    ``b_choices`` (a replayed op whose ZeRO-3 weight is gathered per op: the replay would
    gather it a third time)."""

    a: int
    a_choices: tuple[int, ...]
    b: int
    b_choices: tuple[int, ...]
    why: str


# Edge.replay: how recomputation can touch an edge. A saved copy ("producer") is made again by
# the producer's replay; an input the consumer's replay reads ("consumer") comes from the
# replayed producer or, when that one is not replayed, from its tensor held until the replay.
REPLAYED_BY_PRODUCER, READ_BY_REPLAY = "producer", "consumer"
# EdgeLayouts.replayed: not replayed; resharded again from the replayed producer; resharded
# again from the producer's tensor held since the forward.
NOT_REPLAYED, FROM_REPLAY, FROM_SOURCE = 0, 2, 3


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
    replay: str = ""  # REPLAYED_BY_PRODUCER, READ_BY_REPLAY or "" (recomputation never touches it)
    # The producer is a redistribution (``tensor_parallel.REDISTRIBUTE``): the consumer's input
    # gradient is added to the producer's output gradient as it is, partial sums and all.
    gradient_through: bool = False

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
class SharedGradient:
    """An op that hands its output's gradient itself to two inputs (an add:
    ``memory.passes_gradient``) of which it is the last consumer. A producer whose output
    gradient is in that gradient's layout (its edge reshards nothing) receives the tensor
    itself; when both do, their output-gradient slots count one tensor twice, from the op's
    input-gradient reshards (``start``) to the first of the two producers' backwards (``end``).
    The record takes the second count back (a negative transient)."""

    group: int  # the op's group
    edges: tuple[int, int]  # its two inputs' edges
    start: int
    end: int
    owner: int  # the op group of the producer whose backward is ``end`` (its count is taken back)
    nbytes: np.ndarray  # per choice of the op: its output gradient
    redundant: np.ndarray
    global_bytes: float

    def shared(self, problem: Problem, selection: Selection) -> bool:
        """Whether both producers receive the op's gradient tensor itself under ``selection``."""
        return all(layouts.producer_grad == layouts.consumer_grad
                   for layouts in (problem.edge_layouts(selection, e) for e in self.edges))


@dataclass(frozen=True)
class HeldTensor:
    name: str
    key: int  # the producer's op group: equal for the same tensor in every shared layer
    layouts: tuple[Layout, ...]
    nbytes: np.ndarray  # per layout id
    redundant: np.ndarray
    global_bytes: float

    def layout_id(self, layout: Layout) -> int:
        return self.layout_ids[without_partial(layout)]

    @functools.cached_property
    def layout_ids(self) -> dict[Layout, int]:
        """Each layout's id (the first, were one listed twice), found by hash, not by scan."""
        ids: dict[Layout, int] = {}
        for k, layout in enumerate(self.layouts):
            ids.setdefault(layout, k)
        return ids


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
    # A replay's reshards (``REPLAY_INPUTS``, ``REPLAY_TICKETS``): a replayed op's inputs again, or the tickets
    # a replayed op's output is resharded into for consumers that are not replayed.
    replay: str = ""


class EdgeLayouts(NamedTuple):
    """An edge's layouts under a plan: the producer's output and the consumer's input, the
    consumer's input gradient and the producer's output gradient (its output without
    partial sums), and whether the consumer keeps its saved copy in the producer's layout."""

    producer: Layout
    consumer: Layout
    consumer_grad: Layout
    producer_grad: Layout
    kept: bool
    replayed: int = NOT_REPLAYED  # NOT_REPLAYED, FROM_REPLAY or FROM_SOURCE


@dataclass(frozen=True)
class Selection:
    """A complete plan: one choice per group and the keep flag of every edge."""

    choices: tuple[int, ...]
    keeps: tuple[int, ...]


@dataclass(frozen=True)
class PipelineStage:
    """One pipeline stage as a rank runs it: the layers [first_layer, end_layer) of the graph
    (``Graph.pipeline_stage``: the first stage also runs the embedding, the last the head and
    the loss) and k, the micro-batches whose activations it holds at its peak: the one
    running and k − 1 that have run their forward and wait for their backward (1F1B's stage i
    of p: k = min(p − i, m)). Those k − 1 share the weights, gradients and optimizer states;
    each holds the activations one micro-batch holds at the boundary (``Schedule.boundary``)."""

    first_layer: int
    end_layer: int
    held_micro_batches: int = 1


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
    framework: str = MEMSHARD  # one of FRAMEWORKS
    recompute: str = "none"  # one of recompute.RECOMPUTE_POLICIES
    conflicts: list[Conflict] = field(default_factory=list)
    shared_gradients: list[SharedGradient] = field(default_factory=list)
    # The pipeline stage it is the problem of (None: the whole graph on every rank). Not
    # compared: a whole graph's problem is the record it was; a stage's graph and rows say it.
    stage: PipelineStage | None = field(default=None, compare=False)
    # ``edge_layouts`` of the selection last asked about (pricing a plan asks ~10 times per edge)
    _layouts_seen: tuple[Selection | None, dict[int, EdgeLayouts]] = field(
        default=(None, {}), init=False, repr=False, compare=False)

    def strategy(self, selection: Selection, group: int) -> Strategy:
        return self.groups[group].strategies[selection.choices[group]]

    @property
    def waiting_micro_batches(self) -> int:
        """k − 1: the other micro-batches the rank holds at the boundary (0 off a pipeline)."""
        return self.stage.held_micro_batches - 1 if self.stage is not None else 0

    @property
    def overlaps(self) -> bool:
        """Whether its framework runs the choices' ``overlapped_s`` beside the compute."""
        return self.framework in OVERLAPPING_FRAMEWORKS

    @functools.cached_property
    def checkpoint_peers(self) -> dict[int, tuple[int, ...]]:
        """Op group → the groups of its layer's ops that may be replayed (one layer stands for
        the layers of its class, which share groups): the layer recomputes something iff one
        of them is replayed."""
        by_layer: dict[int, set[int]] = {}
        for i, op in enumerate(self.graph.ops):
            group = self.groups[self.op_group[i]]
            if op.layer is not None and isinstance(group, OpGroup) and group.may_replay:
                by_layer.setdefault(op.layer, set()).add(self.op_group[i])
        return {g: tuple(sorted(by_layer.get(self.graph.ops[group.ops[0]].layer, ())))
                for g, group in enumerate(self.groups) if isinstance(group, OpGroup) and group.ops}

    def replayed(self, selection: Selection, group: int) -> bool:
        """Whether op group ``group`` is recomputed under ``selection``."""
        g = self.groups[group]
        return isinstance(g, OpGroup) and g.replayed(selection.choices[group])

    def edge_replay(self, selection: Selection, e: int) -> int:
        edge = self.edges[e]
        if edge.replay == REPLAYED_BY_PRODUCER and self.replayed(selection, edge.producer):
            return FROM_REPLAY
        if edge.replay == READ_BY_REPLAY and self.replayed(selection, edge.consumer):
            return FROM_REPLAY if self.replayed(selection, edge.producer) else FROM_SOURCE
        return NOT_REPLAYED

    def edge_layouts(self, selection: Selection, e: int) -> EdgeLayouts:
        """The layouts of edge ``e`` under ``selection``."""
        seen, known = self._layouts_seen
        if seen is not selection:
            known = {}
            self._layouts_seen = (selection, known)
        if e not in known:
            known[e] = self._computed_edge_layouts(selection, e)
        return known[e]

    def _computed_edge_layouts(self, selection: Selection, e: int) -> EdgeLayouts:
        edge = self.edges[e]
        producer = self.strategy(selection, edge.producer).output_layout
        consumer_grad = self.groups[edge.consumer].input_grads[edge.input_index][selection.choices[edge.consumer]]
        return EdgeLayouts(
            producer=producer,
            consumer=self.strategy(selection, edge.consumer).input_layouts[edge.input_index],
            consumer_grad=consumer_grad,
            producer_grad=consumer_grad if edge.gradient_through else without_partial(producer),
            kept=bool(selection.keeps[e]),
            replayed=self.edge_replay(selection, e),
        )

    def edge_calls(self, selection: Selection, e: int) -> tuple[comm.Collective, ...]:
        return edge_calls(self.edges[e].tensor, self.edge_layouts(selection, e), self.mesh)

    def holder_layout(self, selection: Selection, h: Holder) -> Layout | None:
        """The layout ``h`` holds its tensor in under ``selection``, None if it holds nothing."""
        if h.kind == PRODUCER:
            return self.strategy(selection, h.source).output_layout
        if h.kind == RETAINED:
            return None if self.replayed(selection, h.source) else self.strategy(selection, h.source).output_layout
        if h.kind == CACHED:
            cached = not self.replayed(selection, h.source) and any(
                self.replayed(selection, g) for g in self.checkpoint_peers[h.source])
            return self.strategy(selection, h.source).output_layout if cached else None
        if h.kind == REPLAY_OUT:
            return self.strategy(selection, h.source).output_layout if self.replayed(selection, h.source) else None
        edge = self.edge_layouts(selection, h.source)
        if h.kind == SAVED:
            if edge.replayed == FROM_REPLAY and self.edges[h.source].replay == REPLAYED_BY_PRODUCER:
                return None
            return edge.producer if edge.kept else edge.consumer
        if h.kind == INPUT_COPY:
            return edge.consumer
        if h.kind == REPLAYED:
            return edge.consumer if edge.replayed == FROM_REPLAY else None
        if h.kind == REPLAYED_AHEAD:
            ahead = edge.replayed == FROM_REPLAY and not self.replayed(selection, self.edges[h.source].consumer)
            return edge.consumer if ahead else None
        if h.kind == SOURCE:
            return edge.producer if edge.replayed == FROM_SOURCE else None
        if h.kind == REPLAY_READ:
            replayed = edge.replayed == FROM_REPLAY and self.replayed(selection, self.edges[h.source].consumer)
            return edge.producer if replayed else None
        if h.kind == REPLAY_INPUT:
            return edge.consumer if edge.replayed in (FROM_REPLAY, FROM_SOURCE) else None
        return edge.consumer if edge.kept else None

    def made_in_backward(self, selection: Selection, h: Holder) -> bool:
        """Whether ``h`` holds a tensor made for the backward (a re-gathered copy, what a replay
        makes): a transient, as PyTorch's memory tracker files it."""
        if h.kind in MADE_FOR_BACKWARD:
            return True
        return h.kind == PRODUCER and h.start >= 2 * self.schedule.num_ops and self.replayed(selection, h.source)

    def may_drop(self, h: Holder) -> bool:
        """Whether some plan holds nothing for ``h`` because of recomputation (a saved copy or
        saved output a replay makes again, a replay's source)."""
        if h.kind in (RETAINED, CACHED, SOURCE, REPLAYED_AHEAD, REPLAY_OUT, REPLAY_READ, REPLAY_INPUT):
            return True
        return h.kind == SAVED and self.edges[h.source].replay == REPLAYED_BY_PRODUCER

    def holder_identity(self, selection: Selection, h: Holder) -> int:
        """Which tensor a holder holds: −1 for the producer's own (its holder, a copy kept in
        its layout, a consumer reading exactly that layout), else the edge whose consumer made
        its own copy (consumers never share one: each reshards for itself)."""
        if h.kind in OWN_KINDS:
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
                edge = self.edges[e]
                if kind in REPLAY_PRICES and not replay_price_paid(
                        kind, edge, self.replayed(selection, edge.producer), self.replayed(selection, edge.consumer)):
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
COPY_PRICES = ("after", "regathered", "held", "replay-after")  # a finished copy, not a reshard in flight
# A replay runs the forward reshards of a replayed op's inputs again ("replay-after",
# "replay-during": paid where the op is replayed and reads the input from the replayed producer
# or the producer's held tensor), and reshards a replayed op's output into the saved copies of
# consumers that are not replayed ("ticket-during", the copy itself priced by its holder).
REPLAY_PRICES = ("replay-after", "replay-during", "ticket-during")
# Kinds whose price is the same function of the layouts as another's.
SAME_PRICE = {"replay-during": "during", "regathering": "during", "replay-after": "after", "regathered": "after"}
REPLAY_INPUTS, REPLAY_TICKETS = "inputs", "tickets"  # ReshardPoint.replay


def replay_price_paid(kind: str, edge: Edge, producer_replayed: bool, consumer_replayed: bool) -> bool:
    """Whether a replay price of ``edge`` is paid under these replay choices."""
    if kind == "ticket-during":
        return producer_replayed and not consumer_replayed
    return consumer_replayed and (edge.replay == READ_BY_REPLAY or producer_replayed)


def reshard_terms(rp: ReshardPoint) -> list[list[tuple[int, str, bool]]]:
    """Each reshard of ``rp`` as the (edge, price, last consumer) terms live while it runs:
    forward, the input copies made before it and itself; backward, every source gradient (all
    exist when the first reshard starts) and itself."""
    if rp.backward:
        return [[(f, "held", lf) for f, lf in zip(rp.edges[:k] + rp.edges[k + 1:], rp.last[:k] + rp.last[k + 1:])]
                + [(e, "held+during", last)] for k, (e, last) in enumerate(zip(rp.edges, rp.last))]
    if rp.replay == REPLAY_TICKETS:
        return [[(e, "ticket-during", False)] for e in rp.edges]
    after, during = (("regathered", "regathering") if rp.regather else
                     ("replay-after", "replay-during") if rp.replay else ("after", "during"))
    return [[(f, after, False) for f in rp.edges[:k]] + [(e, during, False)] for k, e in enumerate(rp.edges)]


def reshard_price(spec: TensorSpec, kind: str, producer_side: Layout, consumer_side: Layout, mesh: Mesh,
                  last: bool) -> float:
    if producer_side == consumer_side:
        return 0.0
    if kind in COPY_PRICES:
        return _copy_bytes(spec, kind, consumer_side, mesh)
    if kind == "ticket-during":  # beyond the finished copy
        during = reshard_peak_bytes(spec.shape, spec.dtype_bytes, producer_side, consumer_side, mesh)
        return float(max(0.0, during - tensor_bytes(spec, consumer_side, mesh)))
    if kind in BACKWARD_PRICES:  # "held+during"
        gp, gc = producer_side, consumer_side
        held = tensor_bytes(spec, without_partial(gc), mesh)
        during = reshard_peak_bytes(spec.shape, spec.dtype_bytes, gc, gp, mesh, reverse=True)
        return float(held + during - (tensor_bytes(spec, gp, mesh) if last else 0))
    return float(reshard_peak_bytes(spec.shape, spec.dtype_bytes, producer_side, consumer_side, mesh))


def reshard_price_table(spec: TensorSpec, kind: str, producer_sides: list[Layout], consumer_sides: list[Layout],
                        mesh: Mesh, last: bool) -> np.ndarray:
    """``reshard_price`` of every (producer side, consumer side) pair, as rows × columns (read
    only: tables are shared by every edge and every solve of the same shape and layouts, and by
    the kinds priced alike; each distinct pair is priced once)."""
    producers, consumers = list(dict.fromkeys(producer_sides)), list(dict.fromkeys(consumer_sides))
    table = _price_table(spec.shape, spec.dtype_bytes, SAME_PRICE.get(kind, kind), tuple(producers), tuple(consumers),
                         mesh, last and kind == "held+during")
    if len(producers) == len(producer_sides) and len(consumers) == len(consumer_sides):
        return table
    row_of = {a: i for i, a in enumerate(producers)}
    column_of = {c: j for j, c in enumerate(consumers)}
    return table[np.ix_([row_of[a] for a in producer_sides], [column_of[c] for c in consumer_sides])]


@functools.lru_cache(maxsize=512)
def _price_table(shape: tuple[int, ...], dtype_bytes: int, kind: str, producer_sides: tuple[Layout, ...],
                 consumer_sides: tuple[Layout, ...], mesh: Mesh, last: bool) -> np.ndarray:
    spec = TensorSpec("", shape, dtype_bytes, TensorKind.ACTIVATION)
    if kind not in COPY_PRICES:
        table = np.array([[reshard_price(spec, kind, a, c, mesh, last) for c in consumer_sides]
                          for a in producer_sides], dtype=float).reshape(len(producer_sides), len(consumer_sides))
    else:  # a copy's bytes depend on the consumer side alone, and are 0 where the sides agree
        copy = np.array([_copy_bytes(spec, kind, c, mesh) for c in consumer_sides], dtype=float)
        same = np.array([[a == c for c in consumer_sides] for a in producer_sides], dtype=bool)
        table = np.where(same.reshape(len(producer_sides), len(consumer_sides)), 0.0, copy)
    table.setflags(write=False)
    return table


def _copy_bytes(spec: TensorSpec, kind: str, consumer_side: Layout, mesh: Mesh) -> float:
    """The consumer's finished copy: its input (forward), or its input gradient (backward)."""
    return float(tensor_bytes(spec, without_partial(consumer_side) if kind == "held" else consumer_side, mesh))


def edge_calls(spec: TensorSpec, layouts: EdgeLayouts, mesh: Mesh) -> tuple[comm.Collective, ...]:
    """The forward reshard, the backward reshard of the gradient, and the forward reshard run
    again: a kept copy's re-gather, or the replay's."""
    calls = comm.reshard(spec.shape, spec.dtype_bytes, layouts.producer, layouts.consumer, mesh)
    calls += comm.reshard(spec.shape, spec.dtype_bytes, layouts.consumer_grad, layouts.producer_grad, mesh,
                          reverse=True)
    if layouts.kept or layouts.replayed:
        calls += comm.reshard(spec.shape, spec.dtype_bytes, layouts.producer, layouts.consumer, mesh)
    return calls


ZERO3_UNITS = ("op", "layer")  # what ZeRO-3 gathers at once: each op's weights, or a layer's


@functools.lru_cache(maxsize=4096)  # called per edge, per choice, in every solve
def without_partial(layout: Layout) -> Layout:
    return tuple(REPLICATE if isinstance(p, Partial) else p for p in layout)


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
