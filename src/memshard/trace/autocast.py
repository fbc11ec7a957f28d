"""CUDA's ``torch.autocast`` policy, applied while a module is traced on CPU.

A DDP user trains in bf16 with ``torch.autocast("cuda", torch.bfloat16)`` over fp32 weights:
each op runs in the dtype autocast's per-op lists give it. memshard traces on CPU (fake
tensors), where ``torch.autocast("cpu")`` applies the CPU lists, which differ from CUDA's
(CUDA runs ``pow``, ``exp``, ``rsqrt``, ``layer_norm``, ``softmax``… in fp32; CPU keeps them
in bf16). :func:`cuda_policy` therefore registers, for the length of a trace, a kernel on the
``AutocastCPU`` dispatch key of every op on CUDA's lists (``ATen/autocast_mode.h``:
``AT_FORALL_LOWER_PRECISION_FP``, ``AT_FORALL_FP32``, ``AT_FORALL_FP32_SET_OPT_DTYPE``,
``AT_FORALL_PROMOTE``) that casts as CUDA's autocast kernel does, so the trace records CUDA's
casts: ``_to_copy`` nodes whose outputs are what the ops save for backward. A parameter's
cast is made once (autocast's cast cache), every other tensor's at each use. PyTorch's own
CPU kernels for ops on none of CUDA's lists are shadowed by a plain redispatch meanwhile.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
from torch.utils._pytree import tree_map

# CUDA's lists (torch 2.x, ``ATen/autocast_mode.h``), as ``name`` or ``name.overload``.
LOWER_PRECISION = (
    "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu", "addmm", "addmv", "addr", "matmul",
    "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention")
FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt", "sinh",
    "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm", "native_layer_norm",
    "rms_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss",
    "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm",
    "logsumexp")
FP32_SET_OPT_DTYPE = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList")
PROMOTE = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
           "tensordot", "scatter_add")

_KEY = "AutocastCPU"


def _eligible(x) -> bool:
    """What autocast casts: a floating tensor other than fp64."""
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64


def _overload(name: str):
    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload or "default")


class _Policy:
    """The kernels of one active policy, and its cast cache (parameters, by identity)."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id → (source kept alive, cast)

    def cast(self, x, dtype: torch.dtype):
        if not _eligible(x) or x.dtype == dtype:
            return x
        # autocast caches the casts of leaf tensors that require grad, the parameters; in the
        # trace (functionalised, no autograd) the parameters are the tensors that require grad
        if x.requires_grad and dtype == self.dtype:
            if id(x) not in self.cache:
                self.cache[id(x)] = (x, x.to(dtype))
            return self.cache[id(x)][1]
        return x.to(dtype)

    def kernel(self, op, policy: str):
        def run(*args, **kwargs):
            with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)):
                if policy == "lower":
                    args, kwargs = tree_map(lambda x: self.cast(x, self.dtype), (args, kwargs))
                elif policy == "fp32":
                    args, kwargs = tree_map(lambda x: self.cast(x, torch.float32), (args, kwargs))
                elif policy == "promote":
                    widest = max((x.dtype for x in _tensors(args, kwargs) if _eligible(x)),
                                 key=lambda d: torch.finfo(d).bits, default=None)
                    args, kwargs = tree_map(lambda x: self.cast(x, widest) if widest else x, (args, kwargs))
                elif policy == "set_dtype":
                    args, kwargs = _fp32_unless_given(op, args, kwargs)
                return op(*args, **kwargs)
        return run


def _fp32_unless_given(op, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """CUDA's ``fp32_set_opt_dtype``: an op on a floating input, given no dtype, runs with
    ``dtype=float32`` (its output fp32)."""
    position = next(i for i, a in enumerate(op._schema.arguments) if a.name == "dtype")
    given = args[position] if position < len(args) else kwargs.get("dtype")
    if given is not None or not _eligible(args[0]):
        return args, kwargs
    if position < len(args):
        return (*args[:position], torch.float32, *args[position + 1:]), kwargs
    return args, {**kwargs, "dtype": torch.float32}


def _tensors(args, kwargs) -> list:
    return [x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)]


@contextlib.contextmanager
def cuda_policy(dtype: torch.dtype = torch.bfloat16) -> Iterator[None]:
    """While active, ``torch.autocast("cpu", dtype)`` casts as CUDA's autocast does: a kernel
    per op of CUDA's lists, and CPU's own kernels (ops CUDA's lists do not hold) shadowed by
    one that only passes the op on."""
    state = _Policy(dtype)
    library = torch.library.Library("aten", "IMPL")
    lists = {"lower": LOWER_PRECISION, "fp32": FP32, "set_dtype": FP32_SET_OPT_DTYPE, "promote": PROMOTE}
    ours = {name for names in lists.values() for name in names}
    cpus = {name.removeprefix("aten::") for name in torch._C._dispatch_get_all_op_names()
            if name.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(name, _KEY)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel": CPU's own
        for kind, names in lists.items():
            for name in names:
                library.impl(name, state.kernel(_overload(name), kind), _KEY)
        for name in sorted(cpus - ours):
            library.impl(name, state.kernel(_overload(name), "none"), _KEY)
    try:
        yield
    finally:
        library._destroy()
