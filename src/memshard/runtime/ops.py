"""The kernels of every op kind of memshard's graph IR, run on one device's local shards.

An op runs on the local pieces its strategy gives it (``OpContext``): the local range of
every named dim, and the mesh axes that split each dim. Products (linear, matmul, embedding)
are computed locally and leave a partial sum when a contracted dim is split; terms that do
not involve the contracted dim (a bias, the residual of ``embedding_add``) are added on one
rank of that axis only, so the partial sums add up to the true result. Ops that reduce over a
split dim (norms, softmax, cross-entropy) all-reduce their per-row statistics, forward and
backward, as the cost model prices them (``memshard.problem.records.STATS_*``).

Every kernel keeps for backward exactly what the graph op says it saves (custom autograd
functions where PyTorch's composite would keep copies), so measured memory can match.
"""

from __future__ import annotations

import itertools
import math
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from memshard.core.graph import Graph, Op
from memshard.problem.memory import CROSS_ENTROPY_CHUNKS
from memshard.problem.strategies import Strategy

DROPOUT_P = 0.1
NORM_EPS = 1e-5
ROPE_BASE = 10000.0


@dataclass
class OpContext:
    """What one device knows about an op it runs."""

    graph: Graph
    op: Op
    index: int
    strategy: Strategy
    coords: tuple[int, ...]  # this device's coordinate on each mesh axis
    groups: tuple  # process group of each mesh axis
    sizes: dict[str, int]  # global dim sizes
    step_seed: int = 0
    device: torch.device = torch.device("cpu")  # where constants (masks, positions) are made

    def axes_of(self, dim: str) -> tuple[int, ...]:
        return tuple(a for a, d in enumerate(self.strategy.assignment) if d == dim)

    def dim_range(self, dim: str) -> tuple[int, int]:
        """(offset, length) of this device's piece of ``dim`` (torch.chunk, axes in order)."""
        start, n = 0, self.sizes[dim]
        for a in self.axes_of(dim):
            m = len_of(self.groups[a])
            c = -(-n // m)
            i = self.coords[a]
            start += i * c
            n = max(0, min(c, n - i * c))
        return start, n

    def split_axes(self, dims) -> tuple[int, ...]:
        return tuple(a for a, d in enumerate(self.strategy.assignment) if d in dims)

    def is_root_of(self, dims) -> bool:
        """True on the one rank, per axis splitting ``dims``, that adds terms without them."""
        return all(self.coords[a] == 0 for a in self.split_axes(dims))


@dataclass(frozen=True)
class KernelTable:
    """The kernel of each op kind, ``kernel(ctx, *inputs) → output``: the executor runs each
    op with ``table(op.kind)``; kinds not listed take ``default`` (an error without one)."""

    kernels: Mapping[str, Callable]
    default: Callable | None = None

    def __call__(self, kind: str) -> Callable:
        kernel = self.kernels.get(kind, self.default)
        if kernel is None:
            raise KeyError(kind)
        return kernel


def len_of(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def all_reduce(t: torch.Tensor, groups, op=dist.ReduceOp.SUM) -> torch.Tensor:
    for g in groups:
        dist.all_reduce(t, op=op, group=g)
    return t


def _letters(*dim_lists) -> dict[str, str]:
    out: dict[str, str] = {}
    for dims in dim_lists:
        for d in dims:
            out.setdefault(d, chr(ord("a") + len(out)))
    return out


def _eq(dims_a, dims_b, dims_out) -> str:
    L = _letters(dims_a, dims_b, dims_out)
    return "".join(L[d] for d in dims_a) + "," + "".join(L[d] for d in dims_b) + "->" + "".join(L[d] for d in dims_out)


class Einsum(torch.autograd.Function):
    """``out = scale·(a·b) + bias`` over named dims, saving exactly ``a`` and ``b``
    (torch.einsum would save permuted copies, which a kept edge could not re-gather). The
    scale and the bias (laid out as ``dims_bias``) are applied to the product in place: it
    allocates its output only, as the planner prices it."""

    @staticmethod
    def forward(ctx, a, b, dims_a, dims_b, dims_out, scale, bias, dims_bias):
        ctx.save_for_backward(a, b)
        ctx.dims = (dims_a, dims_b, dims_out, dims_bias)
        ctx.scale = scale
        y = torch.einsum(_eq(dims_a, dims_b, dims_out), a, b)
        if scale != 1.0:
            y.mul_(scale)
        if bias is not None:
            y.add_(_broadcast_to(bias, dims_bias, dims_out))
        return y

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        dims_a, dims_b, dims_out, dims_bias = ctx.dims
        gs = g * ctx.scale if ctx.scale != 1.0 else g
        ga = torch.einsum(_eq(dims_out, dims_b, dims_a), gs, b) if ctx.needs_input_grad[0] else None
        gb = torch.einsum(_eq(dims_a, dims_out, dims_b), a, gs) if ctx.needs_input_grad[1] else None
        gbias = None
        if ctx.needs_input_grad[6]:
            L = _letters(dims_out)
            gbias = torch.einsum("".join(L[d] for d in dims_out) + "->" + "".join(L[d] for d in dims_bias), g)
        return ga, gb, None, None, None, None, gbias, None


def _broadcast_to(t: torch.Tensor, dims, out_dims) -> torch.Tensor:
    """View ``t`` (laid out as ``dims``) so it broadcasts against ``out_dims``."""
    order = [d for d in out_dims if d in dims]
    t = t.permute(*[dims.index(d) for d in order])
    shape = [t.shape[order.index(d)] if d in order else 1 for d in out_dims]
    return t.reshape(shape)


# -- products ----------------------------------------------------------------------------------
def linear(ctx: OpContext, x, w, bias=None):
    op = ctx.op
    xd, wd, od = op.inputs[0].dims, op.inputs[1].dims, op.output.dims
    if bias is None:
        return Einsum.apply(x, w, xd, wd, od, 1.0, None, ())
    # a zero bias off the root keeps it in every rank's autograd graph (a zero gradient), so
    # every rank reduces its gradient in step
    return Einsum.apply(x, w, xd, wd, od, 1.0, bias * float(ctx.is_root_of(op.contracted_dims)), op.inputs[2].dims)


def matmul(ctx: OpContext, a, b):
    op = ctx.op
    # Megatron scales the raw attention scores by 1/sqrt(head dim)
    scale = 1.0 / math.sqrt(ctx.sizes["d"]) if op.role == "attn.scores" else 1.0
    return Einsum.apply(a, b, op.inputs[0].dims, op.inputs[1].dims, op.output.dims, scale, None, ())


def embedding(ctx: OpContext, ids, table):
    """``table[ids]``; with the vocab split, each rank looks up its rows and zeros the rest."""
    v_dim = ctx.op.inputs[1].dims[0]
    lo, n = ctx.dim_range(v_dim)
    if not ctx.split_axes((v_dim,)):
        return F.embedding(ids, table)
    inside = (ids >= lo) & (ids < lo + n)
    local = torch.where(inside, ids - lo, torch.zeros_like(ids))
    return F.embedding(local, table) * inside.unsqueeze(-1)


def embedding_add(ctx: OpContext, x, wpe):
    """``x + wpe[positions]``: positions are the local sequence range."""
    s_dim = ctx.op.inputs[0].dims[1]
    p_dim = ctx.op.inputs[1].dims[0]
    s0, sn = ctx.dim_range(s_dim)
    p0, pn = ctx.dim_range(p_dim)
    pos = torch.arange(s0, s0 + sn, device=ctx.device)
    inside = (pos >= p0) & (pos < p0 + pn)
    rows = F.embedding(torch.where(inside, pos - p0, torch.zeros_like(pos)), wpe) * inside.unsqueeze(-1)
    return torch.add(rows, x, alpha=float(ctx.is_root_of((p_dim,))))


# -- statistics over a split dim ---------------------------------------------------------------
def _row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Σ over the last dim of a·b, keepdim, without an a·b-sized temporary."""
    return (a.unsqueeze(-2) @ b.unsqueeze(-1)).squeeze(-1)


class SplitNorm(torch.autograd.Function):
    """LayerNorm / RMSNorm over a last dim split across ``groups`` (none: a plain norm that
    keeps only its input and statistics): one all-reduce of the per-row sums forward (2 for
    LayerNorm, 1 for RMSNorm) and the same backward. Forward and backward each allocate one
    input-sized buffer, their result, as PyTorch's fused kernels do."""

    @staticmethod
    def forward(ctx, x, weight, bias, n_global, groups, rms, eps):
        if rms:  # no mean: RMSNorm keeps one statistic per row
            mean = None
            stats = all_reduce(_row_dot(x, x).float(), groups)
            rstd = torch.rsqrt(stats / n_global + eps)
        else:
            stats = all_reduce(torch.cat([x.sum(-1, keepdim=True), _row_dot(x, x)], -1).float(), groups)
            mean = stats[..., :1] / n_global
            rstd = torch.rsqrt(stats[..., 1:] / n_global - mean * mean + eps)
        y = _centred(x, mean).mul_(rstd.to(x.dtype)).mul_(weight)
        if bias is not None:
            y.add_(bias)
        ctx.save_for_backward(x, weight, rstd, mean)
        ctx.meta = (n_global, groups, rms, bias is not None)
        return y

    @staticmethod
    def backward(ctx, g):
        x, weight, rstd, mean = ctx.saved_tensors
        n_global, groups, rms, has_bias = ctx.meta
        red = tuple(range(g.dim() - 1))
        r = rstd.to(x.dtype)
        grad_w = _centred(x, mean).mul_(r).mul_(g).sum(red)
        grad_b = g.sum(red) if has_bias else None
        gw = g * weight
        # x̂ = (x − μ)·r;  Σ gw·x̂ = r·(Σ gw·x − μ·Σ gw)
        s1 = None if rms else gw.sum(-1, keepdim=True).float()
        s2 = rstd * (_row_dot(gw, x).float() if rms else _row_dot(gw, x).float() - mean * s1)
        stats = all_reduce(s2 if rms else torch.cat([s1, s2], -1), groups)
        c2 = rstd * stats[..., -1:] / n_global
        # gx = r·(gw − Σgw/n − x̂·Σgw·x̂/n), built in gw's buffer (row statistics in fp32,
        # cast to gw's dtype before they meet it: no input-sized fp32 temporary)
        gw.addcmul_(x, c2.to(gw.dtype), value=-1)
        if not rms:
            gw.sub_((stats[..., :1] / n_global - mean * c2).to(gw.dtype))
        return gw.mul_(r), grad_w, grad_b, None, None, None, None


def _centred(x: torch.Tensor, mean: torch.Tensor | None) -> torch.Tensor:
    """``x − mean`` as a new tensor (a copy of ``x`` for RMSNorm, which has no mean)."""
    return x.clone() if mean is None else x - mean.to(x.dtype)


def norm(ctx: OpContext, x, weight, bias=None):
    h = ctx.op.reduced_dims[0]
    rms = ctx.op.kind == "rmsnorm"
    axes = ctx.split_axes((h,))
    if not axes and not rms:  # F.rms_norm is a composite that keeps a normalised copy too
        return F.layer_norm(x, (x.shape[-1],), weight, bias, NORM_EPS)
    return SplitNorm.apply(x, weight, bias, ctx.sizes[h], tuple(ctx.groups[a] for a in axes), rms, NORM_EPS)


def _causal_bias(ctx: OpContext, q_dim: str, k_dim: str, dtype: torch.dtype) -> torch.Tensor:
    """0 where key ≤ query (global positions), −inf above the diagonal: [s_local, t_local]."""
    s0, sn = ctx.dim_range(q_dim)
    t0, tn = ctx.dim_range(k_dim)
    q = torch.arange(s0, s0 + sn, device=ctx.device).unsqueeze(1)
    k = torch.arange(t0, t0 + tn, device=ctx.device).unsqueeze(0)
    return torch.zeros(sn, tn, device=ctx.device, dtype=dtype).masked_fill(k > q, float("-inf"))


class SplitSoftmax(torch.autograd.Function):
    """Softmax of ``x + bias`` over the last dim, split across ``groups`` (none: whole):
    all-reduce max and sum forward, one all-reduce of ``Σ g·y`` backward. Allocates its output
    only (the masked scores, exponentiated and normalised in place) and saves it."""

    @staticmethod
    def forward(ctx, x, bias, groups):
        e = x + bias
        m = all_reduce(e.amax(-1, keepdim=True).float(), groups, dist.ReduceOp.MAX)  # fp32 statistics
        e = e.sub_(m.to(e.dtype)).exp_()
        s = all_reduce(e.sum(-1, keepdim=True).float(), groups)
        y = e.div_(s.to(e.dtype))
        ctx.save_for_backward(y)
        ctx.groups = groups
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        # Σ g·y as a product of rows (no output-sized temporary), then (g − Σ)·y in place:
        # the input gradient is the one tensor it allocates, as torch's softmax backward
        s = all_reduce(torch.matmul(g.unsqueeze(-2), y.unsqueeze(-1)).squeeze(-1).float(), ctx.groups)
        return (g - s.to(g.dtype)).mul_(y), None, None


def softmax(ctx: OpContext, x):
    """Causal softmax of attention scores ``[b, n, s, t]`` over ``t``."""
    dims = ctx.op.output.dims
    axes = ctx.split_axes(ctx.op.reduced_dims)
    return SplitSoftmax.apply(x, _causal_bias(ctx, dims[-2], dims[-1], x.dtype), tuple(ctx.groups[a] for a in axes))


class SplitCrossEntropy(torch.autograd.Function):
    """Summed token loss over a vocab split across ``groups`` (Megatron's vocab-parallel
    cross-entropy): all-reduce the row max, then the row sum of exponentials and the target
    logit (3 statistics per row). Saves the logits; backward needs no communication. Rows
    whose label is ``ignore_index`` (when given) count nothing."""

    @staticmethod
    def forward(ctx, logits, labels, v0, groups, scale, ignore_index):
        # The row statistics are fp32 (3 per row), whatever the logits' dtype.
        m = all_reduce(logits.amax(-1, keepdim=True).detach().to(torch.float32, copy=True), groups, dist.ReduceOp.MAX)
        n = logits.shape[-1]
        inside = (labels >= v0) & (labels < v0 + n)
        idx = torch.where(inside, labels - v0, torch.zeros_like(labels)).unsqueeze(-1)
        target = torch.gather(logits, -1, idx).squeeze(-1) * inside
        sums = torch.stack([_sum_exp(logits, m), target.float()], -1)
        sums = all_reduce(sums, groups)
        rows = torch.log(sums[..., 0]) + m.squeeze(-1) - sums[..., 1]
        if ignore_index is not None:
            rows = rows * (labels != ignore_index)
        loss = rows.sum() * scale
        ctx.save_for_backward(logits, labels, m, sums[..., 0:1])
        ctx.meta = (v0, scale, ignore_index)
        return loss

    @staticmethod
    def backward(ctx, g):
        logits, labels, m, total = ctx.saved_tensors
        v0, scale, ignore_index = ctx.meta
        p = logits.sub(m.to(logits.dtype)).exp_().div_(total.to(logits.dtype))  # one buffer: the gradient
        n = logits.shape[-1]
        inside = (labels >= v0) & (labels < v0 + n)
        idx = torch.where(inside, labels - v0, torch.zeros_like(labels)).unsqueeze(-1)
        p.scatter_add_(-1, idx, -inside.to(p.dtype).unsqueeze(-1))
        if ignore_index is not None:
            p.mul_((labels != ignore_index).unsqueeze(-1))
        return p.mul_(g * scale), None, None, None, None, None


def _sum_exp(logits: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Σ_v exp(logits − m) per row, CROSS_ENTROPY_CHUNKS row chunks at a time: the buffer of
    exponentials is a chunk, not the logits' size (``memshard.problem.records`` prices one chunk)."""
    rows = logits.flatten(0, -2)
    shift = m.flatten(0, -2).to(rows.dtype)
    out = rows.new_empty(rows.shape[0], dtype=torch.float32)
    step = max(1, -(-rows.shape[0] // CROSS_ENTROPY_CHUNKS))
    for r in range(0, rows.shape[0], step):
        out[r:r + step] = rows[r:r + step].sub(shift[r:r + step]).exp_().sum(-1)
    return out.view(logits.shape[:-1])


def cross_entropy(ctx: OpContext, logits, labels):
    """Mean token loss; the local piece is a partial sum when batch or sequence is split."""
    v = ctx.op.reduced_dims[0]
    v0, _ = ctx.dim_range(v)
    axes = ctx.split_axes((v,))
    tokens = math.prod(ctx.sizes[d] for d in ctx.op.inputs[1].dims)
    return SplitCrossEntropy.apply(logits, labels, v0, tuple(ctx.groups[a] for a in axes), 1.0 / tokens, None)


# -- elementwise -------------------------------------------------------------------------------
_MASK64 = (1 << 64) - 1


def _to_signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _uniform_(z: torch.Tensor, seed: int) -> torch.Tensor:
    """A uniform number in [0, 1) per int64 index in ``z`` (SplitMix64, overwriting ``z``),
    the same on every rank."""
    z.mul_(_to_signed(0x9E3779B97F4A7C15)).add_(_to_signed((seed * 0xD1B54A32D192ED03) & _MASK64))
    for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        z.bitwise_xor_(z.bitwise_right_shift(shift).bitwise_and_((1 << 64 - shift) - 1)).mul_(_to_signed(mult))
    z.bitwise_xor_(z.bitwise_right_shift(31).bitwise_and_((1 << 33) - 1))
    return z.bitwise_right_shift_(40).bitwise_and_(0xFFFFFF).to(torch.float32).div_(float(1 << 24))


MASK_CHUNK = 1 << 18  # elements hashed at a time: bounded temporaries (a few MiB)


def _index_blocks(ranges: list[tuple[int, int]], strides: list[int], device):
    """The global flat index of this rank's elements (row-major over ``ranges``), as blocks
    of at most ~MASK_CHUNK elements in order, each built by broadcasting one arange per dim."""
    k = len(ranges) - 1  # the dim blocks are cut along: the last whose tail fits a chunk
    while k > 0 and math.prod(n for _, n in ranges[k:]) <= MASK_CHUNK:
        k -= 1
    tail = torch.zeros((), dtype=torch.int64, device=device)
    for (o, n), st in zip(ranges[k + 1:], strides[k + 1:]):
        tail = tail.unsqueeze(-1) + torch.arange(o, o + n, dtype=torch.int64, device=device) * st
    (ok, nk), stk = ranges[k], strides[k]
    rows = max(1, MASK_CHUNK // max(1, tail.numel()))
    for prefix in itertools.product(*(range(o, o + n) for o, n in ranges[:k])):
        base = sum(i * st for i, st in zip(prefix, strides))
        for r in range(ok, ok + nk, rows):
            lead = torch.arange(r, min(r + rows, ok + nk), dtype=torch.int64, device=device) * stk + base
            yield (lead.view(-1, *[1] * tail.dim()) + tail).view(-1)


def dropout(ctx: OpContext, x, p: float = DROPOUT_P):
    """Dropout whose mask is a function of the global element index, the step and the op, so
    every sharding of the model drops the same elements as the single-device run. Each rank
    hashes only its own elements, a bounded chunk at a time."""
    if is_fake(x):  # memshard simulate: no values to draw
        return _Dropout.apply(x, torch.empty(x.shape, dtype=torch.bool, device=x.device), p)
    seed = ctx.step_seed * 1_000_003 + zlib.crc32(ctx.op.name.encode())
    dims = ctx.op.output.dims
    ranges = [ctx.dim_range(d) for d in dims]
    strides = [math.prod(ctx.sizes[d] for d in dims[k + 1:]) for k in range(len(dims))]
    keep = torch.empty(x.numel(), dtype=torch.bool, device=ctx.device)
    start = 0
    for index in _index_blocks(ranges, strides, ctx.device):
        torch.ge(_uniform_(index, seed), p, out=keep[start:start + len(index)])
        start += len(index)
    return _Dropout.apply(x, keep.view(x.shape), p)


class _Dropout(torch.autograd.Function):
    """Saves the 1-byte mask only."""

    @staticmethod
    def forward(ctx, x, keep, p):
        ctx.save_for_backward(keep)
        ctx.p = p
        return (x * keep).mul_(1 / (1 - p))  # one output-sized tensor, no second for the scale

    @staticmethod
    def backward(ctx, g):
        (keep,) = ctx.saved_tensors
        return (g * keep).mul_(1 / (1 - ctx.p)), None, None


def rotary(ctx: OpContext, x):
    """Rotate-half rotary embedding of ``[b, s, heads…, d]`` at the global positions."""
    dims = ctx.op.output.dims
    s0, sn = ctx.dim_range(dims[1])
    d = ctx.sizes[dims[-1]]
    inv = 1.0 / (ROPE_BASE ** (torch.arange(0, d, 2, dtype=torch.float32, device=ctx.device) / d))
    angles = torch.outer(torch.arange(s0, s0 + sn, dtype=torch.float32, device=ctx.device), inv)
    shape = [1, sn] + [1] * (x.dim() - 3) + [d // 2]
    cos, sin = angles.cos().reshape(shape).to(x.dtype), angles.sin().reshape(shape).to(x.dtype)
    return _Rotary.apply(x, cos, sin)


class _Rotary(torch.autograd.Function):
    """``y = x·cos + rotate_half(x)·sin`` written into the output in place: it allocates the
    output only and saves only its cos/sin tables, no activation (as the planner prices it);
    backward applies the transposed rotation to the gradient the same way."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, 1.0)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, sin, -1.0), None, None


def _rotate(x, cos, sin, sign: float):
    """``[x1, x2] → [x1·c − sign·x2·s, x2·c + sign·x1·s]`` (sign −1: the transpose)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = x.new_empty(x.shape)
    torch.mul(x1, cos, out=out[..., :half])
    torch.mul(x2, cos, out=out[..., half:])
    out[..., :half].addcmul_(x2, sin, value=-sign)
    out[..., half:].addcmul_(x1, sin, value=sign)
    return out


def sdpa(ctx: OpContext, q, k, v):
    """Fused causal attention, with grouped queries (q ``[b,s,e,g,d]``, LLaMA) or without
    (q ``[b,s,n,d]``, GPT's fused attention); k/v ``[b,t,e,d]``."""
    b, s, *heads, d = q.shape
    qh = q.reshape(b, s, -1, d).transpose(1, 2)
    kh, vh = k.transpose(1, 2), v.transpose(1, 2)
    s0, _ = ctx.dim_range("s")
    if s0 == 0 and s == k.shape[1]:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
    else:
        mask = _causal_bias(ctx, "s", "t", q.dtype) == 0
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=True)
    return o.transpose(1, 2).unflatten(2, tuple(heads))  # a view: the saved output is the output


KERNELS = KernelTable({  # memshard's own op kinds (the built-in models)
    "linear": linear,
    "matmul": matmul,
    "embedding": embedding,
    "embedding_add": embedding_add,
    "layernorm": norm,
    "rmsnorm": norm,
    "softmax": softmax,
    "cross_entropy": cross_entropy,
    "dropout": dropout,
    "add": lambda ctx, a, b: a + b,
    "mul": lambda ctx, a, b: a * b,
    "gelu": lambda ctx, x: F.gelu(x, approximate="tanh"),
    "silu": lambda ctx, x: F.silu(x),
    "rotary": rotary,
    "sdpa": sdpa,
})
