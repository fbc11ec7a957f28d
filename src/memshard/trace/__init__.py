"""Tracing real PyTorch modules into memshard's graph IR (needs torch; the core does not).

``trace_module(module, args, kwargs)`` exports the module's training forward with
``torch.export`` on the meta device (``export.py``) and lowers the ATen graph to the IR
(``lower.py``: one dims rule per ATen op family in ``rules.py``, the dims algebra in
``dims.py``, saved tensors from ``probe.py``) into a graph whose ``traced`` is a
``program.TracedProgram``, what the runtime needs to run it. ``hf.py`` builds
Hugging Face ``transformers`` models from configs, without downloading weights.
"""

from __future__ import annotations

from collections.abc import Mapping

from memshard.core.errors import MemshardError
from memshard.core.graph import AUTOCAST, FP32, MIXED, Graph, Precision
from memshard.trace.program import AtenCall, TracedProgram

__all__ = ["AtenCall", "TracedProgram", "trace_module"]


def _precision_of(module) -> Precision:
    dtypes = {p.dtype.itemsize for p in module.parameters()}
    return FP32 if dtypes == {4} else MIXED


def trace_module(
    module,
    args: tuple,
    kwargs: Mapping | None = None,
    *,
    name: str | None = None,
    precision: Precision | None = None,
    autocast: bool = False,
    device: str = "cuda",
) -> Graph:
    """The training graph of ``module(*args, **kwargs)`` (which returns the loss).

    Model states are priced at ``precision`` (default: autocast's under ``autocast``, else fp32
    for fp32 parameters, else mixed precision); activations at the dtypes the module really
    computes in (``autocast``: under ``torch.autocast`` to bf16 with ``device``'s op lists; the
    module and inputs on CPU, fake or real) and with the attention kernels ``device`` ("cuda",
    what memshard plans for, or "cpu") runs (``kernels.py``). ``graph.unknown_ops`` counts
    the ATen ops without a rule (planned replicated); ``graph.traced`` is the
    :class:`~memshard.trace.program.TracedProgram` the runtime runs (the exported program,
    each op's ATen call, ``parameter_axes``: parameter FQN → the IR dims of each of its torch
    axes, outermost first).
    """
    from memshard.trace.export import export_training_forward, split_kwargs
    from memshard.trace.lower import lower

    if autocast and any(p.device.type == "meta" for p in module.parameters()):
        raise MemshardError("autocast casts CPU and CUDA tensors only: build the module on CPU (under "
                            "torch._subclasses.FakeTensorMode to allocate nothing), not on meta")
    ep = export_training_forward(module, tuple(args), kwargs, autocast, device)
    fixed = split_kwargs(kwargs)[1]  # e.g. use_cache=False: part of the trace
    precision = precision or (AUTOCAST if autocast else _precision_of(module))
    return lower(ep, name or type(module).__name__, precision, fixed)
