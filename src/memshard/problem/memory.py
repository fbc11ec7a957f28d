"""The redundant-memory cost model: bytes per device of every item a training step holds.

For a tensor of shape ``S`` laid out as ``L`` on the mesh, one device holds
``local_numel(S, L) · dtype`` bytes, of which ``(1 − 1/replication(L))`` is redundant: the
same bytes sit on ``replication(L)`` devices. The model prices, per choice the planner makes:

- an op's strategy: private saved buffers (dropout masks), the gradients it produces for its
  activation inputs (none where it hands on its output's own: ``passes_gradient``; and, for a
  narrow input of a wide op, the wide gradient autograd casts: ``promoted_gradient``), the
  gradient of its output (``op_memory``);
- a parameter's layout and storage sharding (``storage_memory``): weight, gradient and
  optimizer states, each divided further by the mesh axes the storage shards over
  (ZeRO-1: optimizer states, ZeRO-2: + gradients, ZeRO-3/FSDP: + weights), plus the
  transients sharded storage needs (the gathered weight around each use, the unsharded
  gradient before its reduce-scatter);
- an activation held in a given layout: saved for backward or still needed in forward
  (``tensor_bytes``), counted once per distinct layout however many ops keep it.

A parameter's storage sharding is flat (ZeRO / FSDP flatten and split evenly), so its shard
is ``ceil(numel_local / ways)`` elements.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

from memshard.core.graph import LAYOUT_COPY, Graph, Op, Precision, TensorSpec
from memshard.core.mesh import Mesh
from memshard.core.placement import REPLICATE, Layout, Shard, local_numel, replication
from memshard.problem.strategies import Strategy

CATEGORIES = ("parameters", "gradients", "optimizer_states", "activations", "transients")

# Constants the runtime's kernels share with the cost model, so both price the same bytes.
STATS_BYTES = 4  # fp32 statistics
# fp32 statistics per row that backward all-reduces when the reduced dim is split: LayerNorm
# Σg·w and Σg·w·x̂, RMSNorm Σg·w·x̂, softmax Σg·y; cross-entropy's backward needs none.
STATS_IN_BACKWARD = {"layernorm": 2, "rmsnorm": 1, "softmax": 1}
# Cross-entropy's forward sums the exponentials of its logits in this many row chunks
# (``runtime.ops.SplitCrossEntropy``): it holds one chunk's buffer while it runs.
CROSS_ENTROPY_CHUNKS = 8


def tensor_bytes(spec: TensorSpec, layout: Layout, mesh: Mesh) -> int:
    return local_numel(spec.shape, layout, mesh.shape) * spec.dtype_bytes


def redundant_bytes(nbytes: float, layout: Layout, mesh: Mesh) -> float:
    return nbytes * (1.0 - 1.0 / replication(layout, mesh.shape))


def buffer_bytes(op: Op, strategy: Strategy) -> int:
    """Private buffers an op keeps for backward (dropout masks, attention logsumexp)."""
    local = strategy.local_sizes
    return sum(math.prod(local[d] for d in b.dims) * b.dtype_bytes for b in op.buffers)


def buffer_redundant_bytes(op: Op, strategy: Strategy, mesh: Mesh) -> float:
    """A buffer is copied on every axis that splits none of its dims."""
    local = strategy.local_sizes
    total = 0.0
    for b in op.buffers:
        copies = math.prod(
            m for d, m in zip(strategy.assignment, mesh.shape) if d is None or d not in b.dims
        )
        total += math.prod(local[d] for d in b.dims) * b.dtype_bytes * (1 - 1 / copies)
    return total


def buffer_global_bytes(graph: Graph, op: Op) -> int:
    sizes = graph.dim_sizes(op)
    return sum(math.prod(sizes[d] for d in b.dims) * b.dtype_bytes for b in op.buffers)


# -- parameters ----------------------------------------------------------------------------------
@dataclass(frozen=True, order=True)
class StorageOption:
    """ZeRO stage (0: none, 1: optimizer states, 2: + gradients, 3: + weights) and the mesh
    axes, among those where the parameter is not split, that the storage is sharded over."""

    stage: int
    axes: tuple[int, ...] = ()

    def name(self, mesh: Mesh) -> str:
        if self.stage == 0:
            return "none"
        if not self.axes:  # ZeRO-3's layout with nothing to shard over: the master weight kept alone
            return "master"
        return f"zero{self.stage}({','.join(mesh.axes[a].name for a in self.axes)})"

    def over(self, axes: tuple[int, ...]) -> StorageOption:
        """This option sharded over ``axes`` instead (the ones it keeps on another mesh or
        layout): the same stage where any remain, none where all are gone; the master alone
        (no axes to begin with) stays itself."""
        return StorageOption(self.stage if axes or not self.axes else 0, axes)


def param_layout(grad_layout: tuple[str, ...]) -> Layout:
    """The weight's compute layout from its gradient layout (``S<i>`` → Shard, else Replicate)."""
    return _param_layout(tuple(grad_layout))


@functools.lru_cache(maxsize=4096)  # asked for every storage option of every parameter
def _param_layout(grad_layout: tuple[str, ...]) -> Layout:
    return tuple(Shard(int(g[1:])) if g.startswith("S") else REPLICATE for g in grad_layout)


# ZeRO-3's layout over no axis: under mixed precision the fp32 master kept as the weight and
# cast for each use, instead of a bf16 weight beside it (what a weight split over every device
# needs most); the same as no ZeRO in fp32.
MASTER_ALONE = StorageOption(3)


def storage_options(grad_layout: tuple[str, ...], mesh: Mesh) -> tuple[StorageOption, ...]:
    """Every ZeRO stage over every set of the mesh axes that do not split the weight."""
    return _storage_options(tuple(grad_layout), mesh.shape)


@functools.lru_cache(maxsize=4096)
def _storage_options(grad_layout: tuple[str, ...], mesh_shape: tuple[int, ...]) -> tuple[StorageOption, ...]:
    free = [a for a, g in enumerate(grad_layout) if not g.startswith("S") and mesh_shape[a] > 1]
    out = [StorageOption(0)]
    for r in range(1, len(free) + 1):
        for subset in itertools.combinations(free, r):
            out.extend(StorageOption(stage, subset) for stage in (1, 2, 3))
    return tuple(out)



@dataclass(frozen=True)
class StorageMemory:
    parameters: int
    gradients: int
    optimizer_states: int
    gathered_weight: int  # transient around each use under ZeRO-3
    unsharded_gradient: int  # transient at each use's backward under ZeRO-2/3
    gradient_contributions: int  # transient when a tied weight's two gradients are summed
    redundant_parameters: float
    redundant_gradients: float
    redundant_optimizer_states: float


def storage_memory(
    spec: TensorSpec, grad_layout: tuple[str, ...], option: StorageOption, precision: Precision, mesh: Mesh
) -> StorageMemory:
    return _storage_memory(spec.shape, tuple(grad_layout), option, precision, mesh.shape)


@functools.lru_cache(maxsize=1 << 14)  # every option of every parameter, alike for a shape's every weight
def _storage_memory(shape: tuple[int, ...], grad_layout: tuple[str, ...], option: StorageOption,
                    precision: Precision, mesh_shape: tuple[int, ...]) -> StorageMemory:
    layout = param_layout(grad_layout)
    numel = local_numel(shape, layout, mesh_shape)
    ways = math.prod(mesh_shape[a] for a in option.axes)
    sharded = -(-numel // ways)
    copies = replication(layout, mesh_shape)  # devices holding the same compute shard
    copies_sharded = copies // ways

    def pick(is_sharded: bool, nbytes: int) -> tuple[int, float]:
        n = (sharded if is_sharded else numel) * nbytes
        c = copies_sharded if is_sharded else copies
        return n, n * (1 - 1 / c)

    zero3 = option.stage >= 3  # the shard is the master weight (``Precision``)
    p, rp = pick(zero3, precision.shard_bytes if zero3 else precision.param_bytes)
    g, rg = pick(option.stage >= 2, precision.sharded_grad_bytes if zero3 else
                 precision.reduce_bytes if option.stage >= 2 else precision.grad_bytes)
    o, ro = pick(option.stage >= 1, precision.sharded_optimizer_bytes if zero3 else precision.optimizer_bytes)
    return StorageMemory(
        parameters=p,
        gradients=g,
        optimizer_states=o,
        gathered_weight=numel * precision.param_bytes if option.stage >= 3 else 0,
        unsharded_gradient=numel * precision.grad_bytes if option.stage >= 2 else 0,
        gradient_contributions=2 * numel * precision.grad_bytes,
        redundant_parameters=rp,
        redundant_gradients=rg,
        redundant_optimizer_states=ro,
    )


# Ops whose gradient for an input is the output's gradient itself (before autograd casts it).
GRADIENT_PASSES_THROUGH = frozenset({"add", "copy", LAYOUT_COPY})


def promoted_gradient(op: Op, source: TensorSpec, out: TensorSpec) -> float:
    """An input narrower than the op's output of its size (bf16 times fp32 under autocast): its
    gradient is computed in the output's dtype, then autograd casts it to the input's, both
    alive at once. The extra tensor, per byte of the input's gradient (0: none)."""
    if source.dtype_bytes >= out.dtype_bytes or source.numel != out.numel or op.kind in GRADIENT_PASSES_THROUGH:
        return 0.0
    return out.dtype_bytes / source.dtype_bytes


def passes_gradient(op: Op, j: int, source: TensorSpec, out: TensorSpec) -> bool:
    """Whether op's backward hands its input ``j`` the output's gradient itself, no tensor of
    its own: an add's input of the output's dims and dtype (autograd's ``AddBackward`` returns
    the gradient it receives for both inputs; a broadcast input's is summed, a narrower one's
    cast, each a new tensor)."""
    return (op.kind == "add" and op.inputs[j].dims == op.output.dims
            and source.dtype_bytes == out.dtype_bytes)
