"""Which kernel PyTorch runs for an op on the device memshard plans for, where the choice
changes what the op holds: scaled dot-product attention's.

``F.scaled_dot_product_attention`` picks a kernel per call. The fused ones (flash, cuDNN,
memory-efficient; CPU's flash) keep q, k, v, the output and the log-sum-exp for backward,
which is how ``rules.sdpa`` prices the op; the math fallback computes the scores' softmax
(batch × heads × seq²) and keeps it, with the scaled query, the scaled keys and the values
repeated to the query's heads. On a GPU PyTorch takes the math path for fp32 grouped-query
attention (no fused kernel takes fp32 with ``enable_gqa``) and for a few half-precision shapes;
CPU's flash kernel takes every case memshard traces. ``cuda_sdpa_backend`` is the choice,
checked against ``torch._fused_sdp_choice`` recorded on an H200 (``benchmarks/sdpa_backends.py``);
``math_attention`` rewrites those calls of a program into PyTorch's own math path
(``aten._scaled_dot_product_attention_math``'s composite kernel), so the lowering prices its ops
as it prices any other and the runtime runs them. ``cuda_attention`` makes eager PyTorch on CPU
take CUDA's path, for the tests that measure it.
"""

from __future__ import annotations

import contextlib

import torch

MATH = "math"
FUSED = "fused"
HALF = (torch.float16, torch.bfloat16)


def cuda_sdpa_backend(dtype: str | torch.dtype, head_dim: int, *, gqa: bool, mask: bool) -> str:
    """``MATH`` or ``FUSED``: the kind of kernel CUDA's SDPA runs (PyTorch 2.11–2.13, sm90).
    ``gqa``: key/value heads fewer than the query's, with ``enable_gqa``; ``mask``: a mask tensor.
    fp32 runs memory-efficient attention, which takes no grouped-query attention; fp16/bf16 run
    cuDNN or flash (head dims up to 256; flash pads a head dim that is not a multiple of 8 but
    takes no mask) or else memory-efficient attention (any head dim, no grouped-query attention)."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, dtype)
    if dtype not in HALF:
        return MATH if gqa else FUSED
    if head_dim > 256:
        return MATH if gqa else FUSED
    if head_dim % 8 and mask:
        return MATH
    return FUSED


def takes_math(query, key, attn_mask, enable_gqa) -> bool:
    """Whether CUDA runs these SDPA arguments (tensors or fake ones) on the math path."""
    gqa = bool(enable_gqa) and query.dim() > 2 and query.shape[-3] != key.shape[-3]
    return cuda_sdpa_backend(query.dtype, int(query.shape[-1]), gqa=gqa, mask=attn_mask is not None) == MATH


def _math_call(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if not takes_math(query, key, attn_mask, enable_gqa):
        return NotImplemented  # export keeps the op as it is
    # The math op's composite kernel, called directly: while re-tracing, export makes every
    # composite op return NotImplemented to keep it whole.
    out = torch.ops.aten._scaled_dot_product_attention_math.default._op_dk(
        torch._C.DispatchKey.CompositeImplicitAutograd, query, key, value, attn_mask, dropout_p, is_causal,
        scale=scale, enable_gqa=enable_gqa)
    return out[0]


def math_attention(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """``program`` with each SDPA call that takes the math path on CUDA written as that path's
    ops (the scaled query and keys, repeated keys and values, the causal mask, ``matmul``,
    ``_safe_softmax``, ``matmul``), each with the attention's module stack; unchanged when none does."""
    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    calls = [n for n in program.graph.nodes if n.op == "call_function" and n.target is sdpa]
    if not any(takes_math(n.args[0].meta["val"], n.args[1].meta["val"],
                          n.args[3] if len(n.args) > 3 else n.kwargs.get("attn_mask"), n.kwargs.get("enable_gqa"))
               for n in calls):
        return program
    return program.run_decompositions({sdpa: _math_call})


@contextlib.contextmanager
def cuda_attention():
    """While active, ``F.scaled_dot_product_attention`` on CPU takes the path CUDA takes: its
    math path where :func:`cuda_sdpa_backend` says so, else CPU's fused kernel, which keeps
    what CUDA's fused kernels keep. An eager module measured on CPU then holds what it holds
    on a GPU (the conformance tests). The function itself is replaced, not intercepted by a
    mode, so that ``torch.utils.checkpoint``'s replay in backward takes the same path."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fused = torch.nn.functional.scaled_dot_product_attention

    def as_on_cuda(*args, **kwargs):
        query, key = args[0], args[1]
        device = query.device.type
        if torch.is_autocast_enabled(device):  # the kernel sees autocast's dtype (SDPA is on its lists)
            query = query.to(torch.get_autocast_dtype(device))
        mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
        if takes_math(query, key, mask, kwargs.get("enable_gqa")):
            with sdpa_kernel(SDPBackend.MATH):
                return fused(*args, **kwargs)
        return fused(*args, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = as_on_cuda
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = fused
