"""Tracing real PyTorch modules into memshard's graph IR (needs torch; the core does not).

``trace_module(module, args, kwargs)`` exports the module's training forward with
``torch.export`` on the meta device (``export.py``) and lowers the ATen graph to the IR
(``lower.py``, dims algebra in ``dims.py``, saved tensors from ``probe.py``). ``hf.py`` builds
Hugging Face ``transformers`` models from configs, without downloading weights.
"""

from __future__ import annotations

from collections.abc import Mapping

from memshard.graph import FP32, MIXED, Graph, Precision


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
) -> Graph:
    """The training graph of ``module(*args, **kwargs)`` (which returns the loss).

    Model states are priced at ``precision`` (default: fp32 for fp32 parameters, else mixed
    precision); activations at the dtypes the module really computes in. ``graph.meta`` holds
    ``unknown_ops`` (ATen op → count, planned replicated), ``parameter_axes`` (parameter
    FQN → the IR dims of each of its torch axes, outermost first), and what the runtime needs
    (``program``, ``aten``: each op's ATen call, ``fixed_kwargs``).
    """
    from memshard.trace.export import export_training_forward, split_kwargs
    from memshard.trace.lower import lower

    ep = export_training_forward(module, tuple(args), kwargs)
    graph = lower(ep, name or type(module).__name__, precision or _precision_of(module))
    graph.traced["fixed_kwargs"] = split_kwargs(kwargs)[1]  # e.g. use_cache=False: part of the trace
    return graph
