"""The graph IR: tensors and operators described by named dimensions.

An operator names the dimensions of its iteration space on every operand, einsum-style:
a linear layer is ``x[b,s,h] · w[h,f] → y[b,s,f]``. A dim that appears on inputs but not on
the output is *contracted* (splitting it leaves a partial sum), unless the op lists it in
``reduced_dims``: then the op computes statistics over it (norm, softmax, cross-entropy) and
splitting it costs a small all-reduce of those statistics instead.

Ops are kept in forward order. Ops of identical repeated blocks (transformer layers) carry the
same ``role`` and their ``layer`` index; the solver gives all copies of a role one set of
variables unless asked to solve exactly. Layers may be split into classes (``layer_class``,
``Graph.with_layer_classes``): then the copies of a role share variables within a class (the
first N layers recomputed and the others not: Megatron-LM's block recomputation).

A pipeline stage runs a slice of the layers (``Graph.pipeline_stage``): the first stage also
the ops before the layers (the embedding), the last the ops after them (final norm, head,
loss). Its graph is a graph like any other. A tensor it reads that another stage makes is one
of its inputs (``Graph.received``); what it makes for a later stage is ``Graph.sent``, and its
last op's output is the graph's output (``Graph.loss``) where it is not the last stage.
A received tensor has one reader, a :data:`RECEIVE` op: the rank receives one piece of it, in
the layout that op's strategy gives it, and the stage's readers read that op's output (the
piece itself, no copy), each resharding it as it reshards any activation.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field, replace
from enum import Enum
from functools import cached_property
from typing import Any

from memshard.core.errors import MemshardError


class TensorKind(str, Enum):
    PARAMETER = "parameter"
    ACTIVATION = "activation"
    INPUT = "input"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype_bytes: int
    kind: TensorKind

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype_bytes


@dataclass(frozen=True)
class Operand:
    """A tensor as one op sees it: the op-dim name of each tensor axis."""

    tensor: str
    dims: tuple[str, ...]


@dataclass(frozen=True)
class SavedBuffer:
    """A private buffer an op keeps for backward (a dropout mask), laid out like ``dims``."""

    name: str
    dims: tuple[str, ...]
    dtype_bytes: int


# Forward FLOPs per element of the activation functions, for built-in and traced models alike
# (so that an op costs the same time whichever path made it).
ACTIVATION_FLOPS_PER_POINT = {"gelu": 8.0, "silu": 8.0}
# Op kind: a copy that memshard's runtime makes (its reshards lay a tensor out in its dims'
# order) where eager PyTorch has a view of a kernel's output (the transposed output of a fused
# attention); priced as a view for the frameworks that run the eager module (``pricing``).
LAYOUT_COPY = "layout_copy"
# Op kind: what a pipeline stage receives, as the stage's readers read it (``Graph.pipeline_stage``):
# the received piece itself, in the layout its strategy gives it, no copy and no kernel.
RECEIVE = "receive"


@dataclass(frozen=True)
class Op:
    name: str
    kind: str
    inputs: tuple[Operand, ...]
    output: Operand
    reduced_dims: tuple[str, ...] = ()
    unsplittable_dims: tuple[str, ...] = ()  # dims the kernel cannot split (fused attention's key dim)
    stats_per_row: int = 0  # fp32 statistics per reduced row that a split reduced dim all-reduces
    saves_inputs: tuple[int, ...] = ()  # activation inputs kept for backward (by index)
    saves_output: bool = False
    buffers: tuple[SavedBuffer, ...] = ()
    flops_per_point: float = 1.0  # forward FLOPs per point of the iteration space
    backward_flops_ratio: float = 1.0
    causal: bool = False  # fused attention that skips the masked half of its scores
    layer: int | None = None
    role: str | None = None
    layer_class: int = 0  # the layers of a role share variables within a class (0 for all)

    @property
    def share_key(self) -> str | None:
        """What the copies of this op that share variables have in common: its role, and its
        layer's class where layers are split into classes."""
        if self.role is None or not self.layer_class:
            return self.role
        return f"{self.role}@{self.layer_class}"

    @property
    def operands(self) -> tuple[Operand, ...]:
        return (*self.inputs, self.output)

    @property
    def dims(self) -> tuple[str, ...]:
        """The op's named dims in first-appearance order (deterministic)."""
        seen: dict[str, None] = {}
        for operand in self.operands:
            for d in operand.dims:
                seen.setdefault(d, None)
        for buf in self.buffers:
            for d in buf.dims:
                seen.setdefault(d, None)
        return tuple(seen)

    @property
    def contracted_dims(self) -> tuple[str, ...]:
        out = set(self.output.dims)
        return tuple(d for d in self.dims if d not in out and d not in self.reduced_dims)


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter element of each model-state category.

    Mixed precision (ZeRO paper): 2 B bf16 weight, 2 B bf16 grad, 12 B of fp32 master weight
    and Adam m, v (``master_bytes`` of them the master). Plain fp32 Adam: 4 + 4 + 8.
    A ZeRO-3 shard of the weight is the master itself where there is one, as FSDP2's
    ``MixedPrecisionPolicy`` keeps it: 4 B fp32 shard (gathered in bf16), 8 B of Adam moments,
    and the reduced gradient stored sharded in the master's dtype (4 B) — 12 B held all step
    instead of 2 + 12. ``reduced_grad_bytes``: the dtype gradients are reduced in, where wider
    than they are computed in (FSDP2's ``reduce_dtype=fp32``; default the computed dtype).
    """

    name: str
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    master_bytes: int = 0
    reduced_grad_bytes: int | None = None

    @property
    def shard_bytes(self) -> int:
        """A ZeRO-3 shard of the weight: the master where there is one."""
        return self.master_bytes or self.param_bytes

    @property
    def sharded_optimizer_bytes(self) -> int:
        """The optimizer states beside a ZeRO-3 shard that is the master: the moments."""
        return self.optimizer_bytes - self.master_bytes

    @property
    def reduce_bytes(self) -> int:
        """The dtype gradients are reduced (and a ZeRO-2 gradient stored) in."""
        return self.reduced_grad_bytes or self.grad_bytes

    @property
    def sharded_grad_bytes(self) -> int:
        """A ZeRO-3 gradient shard: the dtype of the weight shard it updates."""
        return max(self.shard_bytes, self.reduce_bytes) if self.master_bytes else self.reduce_bytes


MIXED = Precision("mixed", 2, 2, 12, 2, master_bytes=4)
FP32 = Precision("fp32", 4, 4, 8, 4)
# ``torch.autocast`` to bf16 over fp32 weights (a DDP user's bf16): fp32 model states, each
# activation in the dtype autocast computes it in (a traced module's casts; ``trace.autocast``)
AUTOCAST = Precision("autocast", 4, 4, 8, 2)
PRECISIONS = {p.name: p for p in (MIXED, FP32, AUTOCAST)}


class Origin(str, Enum):
    """Where a graph comes from: memshard's builders (or by hand), or a traced module."""

    BUILT = "built"
    TRACED = "traced"


@dataclass(frozen=True)
class Graph:
    name: str
    tensors: dict[str, TensorSpec]
    ops: tuple[Op, ...]
    loss: str
    precision: Precision = MIXED
    num_layers: int = 0
    seq: int | None = None  # the sequence length it was built or traced for
    # A traced module: the ATen ops memshard has no rule for (op → count, planned replicated)
    unknown_ops: dict[str, int] = field(default_factory=dict, compare=False, hash=False)
    # A traced module: the inputs its code makes from no model input (the causal mask of a math
    # attention path), whole on every rank and alive while the ops that read them need them
    made_inputs: frozenset[str] = frozenset()
    # A traced module: its ``memshard.trace.TracedProgram`` (the exported program and each
    # op's ATen call), which the runtime runs; None for a built graph.
    traced: Any = field(default=None, compare=False, hash=False, repr=False)
    # A pipeline stage (``pipeline_stage``): the inputs it receives from the stage before (made
    # there) and the tensors it sends on. Not compared: the tensors and ops say the stage already,
    # and a whole graph is the record it was.
    received: frozenset[str] = field(default=frozenset(), compare=False, hash=False)
    sent: frozenset[str] = field(default=frozenset(), compare=False, hash=False)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def origin(self) -> Origin:
        return Origin.BUILT if self.traced is None else Origin.TRACED

    # -- structure --------------------------------------------------------------------------
    @cached_property
    def producer(self) -> dict[str, int]:
        return {op.output.tensor: i for i, op in enumerate(self.ops)}

    @cached_property
    def consumers(self) -> dict[str, tuple[tuple[int, int], ...]]:
        """tensor → ((op index, input index), ...) in forward order."""
        out: dict[str, list[tuple[int, int]]] = defaultdict(list)
        for i, op in enumerate(self.ops):
            for j, operand in enumerate(op.inputs):
                out[operand.tensor].append((i, j))
        return {k: tuple(v) for k, v in out.items()}

    @cached_property
    def loaded_inputs(self) -> dict[str, tuple[int, int]]:
        """The inputs a data loader gives each rank its share of — those one op reads (token
        ids, labels) — → that op (op index, input index). Those several ops read (a traced
        model's rotary tables) are made whole on every rank, and so are ``made_inputs``. A
        pipeline stage receives its share of what the stage before made (``received``) as a
        loader hands it the batch: in the layout of its one reader, its :data:`RECEIVE` op."""
        out = {}
        for name, spec in self.tensors.items():
            uses = self.consumers.get(name, ())
            if spec.kind is TensorKind.INPUT and name not in self.made_inputs and (
                    len(uses) == 1 or (uses and name in self.received)):
                out[name] = uses[0]
        return out

    @cached_property
    def parameters(self) -> tuple[str, ...]:
        return tuple(n for n, t in self.tensors.items() if t.kind is TensorKind.PARAMETER)

    @property
    def num_parameters(self) -> int:
        return sum(self.tensors[p].numel for p in self.parameters)

    def dim_sizes(self, op: Op) -> dict[str, int]:
        sizes: dict[str, int] = {}
        for operand in op.operands:
            for d, n in zip(operand.dims, self.tensors[operand.tensor].shape):
                sizes[d] = n
        return sizes

    def flops(self, op: Op) -> float:
        """Forward FLOPs of the whole (unsharded) op. A dim on two axes of one operand (a
        traced attention's scores ``[b, n, s, s]``: queries and keys over one sequence) runs
        over the iteration space once per axis."""
        sizes = self.dim_sizes(op)
        repeats = {d: max(o.dims.count(d) for o in op.operands) for d in sizes}
        return op.flops_per_point * math.prod(n ** repeats[d] for d, n in sizes.items())

    @cached_property
    def roles(self) -> dict[str, tuple[int, ...]]:
        """role → indices of its ops (one per layer); ops without a role map to themselves."""
        out: dict[str, list[int]] = defaultdict(list)
        for i, op in enumerate(self.ops):
            out[op.role if op.role is not None else f"#{op.name}"].append(i)
        return {k: tuple(v) for k, v in out.items()}

    @cached_property
    def layer_classes(self) -> tuple[int, ...]:
        """Each layer's class (``Op.layer_class``); all 0 unless split."""
        classes = [0] * self.num_layers
        for op in self.ops:
            if op.layer is not None:
                classes[op.layer] = op.layer_class
        return tuple(classes)

    def with_layer_classes(self, classes: tuple[int, ...]) -> Graph:
        """This graph with layer ``k``'s ops in class ``classes[k]``."""
        if len(classes) != self.num_layers or any(not isinstance(c, int) or c < 0 for c in classes):
            raise MemshardError(f"graph {self.name}: {len(classes)} layer classes for {self.num_layers} layers")
        ops = tuple(op if op.layer is None else replace(op, layer_class=classes[op.layer]) for op in self.ops)
        return replace(self, ops=ops)

    # -- pipeline stages --------------------------------------------------------------------
    def stage_of_ops(self, ends: tuple[int, ...]) -> tuple[int, ...]:
        """Each op's pipeline stage, the stages ending after layers ``ends`` (increasing, the
        last ``num_layers``): a layer's ops run on its stage; an op outside the layers on the
        stage of the next layer's ops (the embedding on the first), or the last after them."""
        if not ends or ends[-1] != self.num_layers or any(a >= b for a, b in zip((0, *ends), ends)):
            raise MemshardError(f"graph {self.name}: stages ending after layers {ends} do not split "
                                f"its {self.num_layers} layers")
        stage_of_layer = [next(k for k, end in enumerate(ends) if layer < end) for layer in range(self.num_layers)]
        out, following = [0] * len(self.ops), len(ends) - 1
        for i in reversed(range(len(self.ops))):
            layer = self.ops[i].layer
            if layer is not None:
                following = stage_of_layer[layer]
            out[i] = following
        return tuple(out)

    def pipeline_stage(self, first_layer: int, end_layer: int) -> Graph:
        """The graph a pipeline stage runs: the ops of layers [first_layer, end_layer), with
        those before the layers on the first stage and those after them on the last
        (``stage_of_ops``); layers numbered from 0 within the stage. The whole range is the
        graph itself.

        A tensor the stage reads and another stage makes is an input (``TensorKind.INPUT``,
        its dtype and shape kept, listed in ``received``): no op of the stage makes it, so it is
        no activation of the stage; the rank receives its share before its forward, as a data
        loader hands it the batch (``loaded_inputs``), keeps it until its backward, and sends
        its gradient back. Its one reader is a :data:`RECEIVE` op (``receive:<tensor>``, first):
        the share is that op's layout, and the stage's readers read that op's output
        (``received_name``), as they read any activation. A parameter read on two stages (a tied embedding and head) is on
        both, as Megatron-LM duplicates it. What the stage makes for a later stage is ``sent``;
        where the stage is not the last, its last op's output is the graph's output (``loss``)."""
        if not 0 <= first_layer < end_layer <= self.num_layers:
            raise MemshardError(f"graph {self.name}: no stage of layers [{first_layer}, {end_layer}) "
                                f"among its {self.num_layers}")
        if (first_layer, end_layer) == (0, self.num_layers):
            return self
        ends = tuple(sorted({first_layer, end_layer, self.num_layers} - {0}))
        stage = ends.index(end_layer)
        of_op = self.stage_of_ops(ends)
        mine = [i for i, k in enumerate(of_op) if k == stage]
        ops = tuple(op if op.layer is None else replace(op, layer=op.layer - first_layer)
                    for op in (self.ops[i] for i in mine))
        produced = {op.output.tensor for op in ops}
        sent = frozenset(t for t in produced if any(of_op[c] != stage for c, _ in self.consumers.get(t, ())))
        ops = _with_receive_ops(ops, produced, self.tensors)
        received = frozenset(op.inputs[0].tensor for op in ops if op.kind == RECEIVE)
        specs = {**self.tensors, **{t: replace(self.tensors[t], kind=TensorKind.INPUT) for t in received},
                 **{received_name(t): replace(self.tensors[t], name=received_name(t)) for t in received}}
        tensors = {operand.tensor: specs[operand.tensor] for op in ops for operand in op.operands}
        last = end_layer == self.num_layers
        return replace(self, name=f"{self.name}[{first_layer}:{end_layer}]", tensors=tensors, ops=ops,
                       loss=self.loss if last else ops[-1].output.tensor, num_layers=end_layer - first_layer,
                       made_inputs=self.made_inputs & set(tensors), received=received, sent=sent)

    # -- checks -----------------------------------------------------------------------------
    def validate(self) -> None:
        names = set()
        for op in self.ops:
            if op.name in names:
                raise MemshardError(f"graph {self.name}: duplicate op name {op.name}")
            names.add(op.name)
            sizes: dict[str, int] = {}
            for operand in op.operands:
                spec = self.tensors.get(operand.tensor)
                if spec is None:
                    raise MemshardError(f"op {op.name}: unknown tensor {operand.tensor}")
                if len(spec.shape) != len(operand.dims):
                    raise MemshardError(
                        f"op {op.name}: tensor {operand.tensor} has {len(spec.shape)} dims, "
                        f"named {operand.dims}"
                    )
                for d, n in zip(operand.dims, spec.shape):
                    if sizes.setdefault(d, n) != n:
                        raise MemshardError(f"op {op.name}: dim {d} is {sizes[d]} and {n}")
            for buf in op.buffers:
                if any(d not in sizes for d in buf.dims):
                    raise MemshardError(f"op {op.name}: buffer {buf.name} names an unknown dim")
        produced = set()
        for op in self.ops:
            for operand in op.inputs:
                kind = self.tensors[operand.tensor].kind
                if kind is TensorKind.ACTIVATION and operand.tensor not in produced:
                    raise MemshardError(f"op {op.name} reads {operand.tensor} before it is made")
            if op.output.tensor in produced:
                raise MemshardError(f"tensor {op.output.tensor} is produced twice")
            produced.add(op.output.tensor)
        if self.loss not in produced:
            raise MemshardError(f"graph {self.name}: loss tensor {self.loss} is not produced")
        if not self.sent <= produced or any(self.tensors.get(t) is None or self.tensors[t].kind is not TensorKind.INPUT
                                            for t in self.received):
            raise MemshardError(f"graph {self.name}: a stage sends a tensor it does not make or receives one "
                                f"that is not an input")


def received_name(tensor: str) -> str:
    """The name of the output of the :data:`RECEIVE` op of ``tensor``: what its readers read."""
    return f"{tensor}:received"


def _with_receive_ops(ops: tuple[Op, ...], produced: set[str], specs: dict[str, TensorSpec]) -> tuple[Op, ...]:
    """``ops`` after a :data:`RECEIVE` op per activation they read and do not make (in its
    first reader's dims, named ``receive:<tensor>``), their reads of it rewritten to read that
    op's output (:func:`received_name`)."""
    first: dict[str, Operand] = {}
    for op in ops:
        for x in op.inputs:
            if specs[x.tensor].kind is TensorKind.ACTIVATION and x.tensor not in produced:
                first.setdefault(x.tensor, x)

    def read(x: Operand) -> Operand:
        return replace(x, tensor=received_name(x.tensor)) if x.tensor in first else x

    receives = tuple(Op(f"receive:{t}", RECEIVE, (x,), replace(x, tensor=received_name(t))) for t, x in first.items())
    return (*receives, *(replace(op, inputs=tuple(read(x) for x in op.inputs)) for op in ops))
