"""torch.export of a training step's forward: a module and example inputs → an ExportedProgram.

The module runs on the meta device (no real memory) and must return its loss: a scalar
tensor, or an output object with a ``.loss`` (Hugging Face models given ``labels``). Export is
non-strict (Python runs as usual), so ordinary ``nn.Module`` code traces without changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch

from memshard.core.errors import MemshardError
from memshard.trace.kernels import math_attention

WRAPPER_PREFIX = "module."


class _LossOf(torch.nn.Module):
    """Calls the wrapped module and returns only its loss, so export sees one output.
    Tensor arguments are traced inputs; other keyword arguments (``use_cache=False``) are fixed."""

    def __init__(self, module: torch.nn.Module, fixed: Mapping):
        super().__init__()
        self.module = module
        self.fixed = dict(fixed)

    def forward(self, *args, **kwargs):
        out = self.module(*args, **kwargs, **self.fixed)
        loss = getattr(out, "loss", None)
        if loss is None and isinstance(out, (tuple, list)) and out:
            loss = out[0]
        if loss is None and isinstance(out, torch.Tensor):
            loss = out
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise MemshardError(
                "the module must return its training loss (a scalar tensor, or an output with "
                ".loss: pass labels to a Hugging Face model)"
            )
        return loss


def split_kwargs(kwargs: Mapping | None) -> tuple[dict, dict]:
    """(tensor keyword arguments: traced inputs, the rest: fixed)."""
    kwargs = dict(kwargs or {})
    tensors = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    return tensors, {k: v for k, v in kwargs.items() if k not in tensors}


def export_training_forward(
    module: torch.nn.Module, args: tuple, kwargs: Mapping | None = None, autocast: bool = False,
    device: str = "cuda",
) -> torch.export.ExportedProgram:
    """Export ``module(*args, **kwargs)`` up to its loss, in training mode, without running it.

    ``autocast``: the forward and the loss under ``torch.autocast(device, torch.bfloat16)`` as a
    bf16 user runs them, its casts written into the program (the module and inputs must then be
    fake CPU tensors, not meta: autocast casts CPU tensors only). Attention runs as on
    ``device``, "cuda" or "cpu" (``kernels.math_attention``). Parameter names in the
    program keep the module's FQNs behind :data:`WRAPPER_PREFIX`.
    """
    if not isinstance(module, torch.nn.Module):
        raise MemshardError(f"expected an nn.Module, got {type(module).__name__}")
    tensors, fixed = split_kwargs(kwargs)
    was_training = module.training
    module.train()
    try:
        program = torch.export.export(_LossOf(module, fixed), tuple(args), kwargs=tensors, strict=False)
        program = _autocast(program, device) if autocast else program
        return math_attention(program) if device == "cuda" else program
    except MemshardError:
        raise
    except Exception as exc:  # export's own errors are long; keep the first line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise MemshardError(f"torch.export could not trace {type(module).__name__}: {first}") from exc
    finally:
        module.train(was_training)


def _autocast(program: torch.export.ExportedProgram, device: str) -> torch.export.ExportedProgram:
    """The program re-traced op by op under autocast, with an empty decomposition table: each
    op stays as it was, autocast's casts are written before it and the module stack of each
    cast is its op's. (Export ignores an autocast entered around it; one entered inside the
    forward becomes a single region that loses the module stacks.) The program's dtype
    assertions, true of the fp32 trace, are dropped; a decision the module's Python took on a
    dtype (``x.to(y.dtype)``) stays as the fp32 trace took it. CPU autocast applies CUDA's op
    lists where ``device`` is "cuda" (``autocast.cuda_policy``)."""
    from memshard.trace.autocast import cuda_policy

    graph = program.graph_module.graph
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten._assert_tensor_metadata.default:
            graph.erase_node(node)
    program.graph_module.recompile()
    with cuda_policy() if device == "cuda" else contextlib.nullcontext(), \
            torch.autocast("cpu", dtype=torch.bfloat16):
        return program.run_decompositions({})
