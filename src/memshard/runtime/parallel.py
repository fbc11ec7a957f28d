"""A plan's model on one rank: the one place that tells a built graph from a traced module.

A built graph runs memshard's reference model (``executor.GraphModel``, the kernels of
``ops.py``) on random token batches; a traced one runs the module it traced (its parameters by
FQN, the kernels of ``traced.py``) on random arguments of the traced shapes. Both run on the
same executor (``executor.ShardedGraphModel``).

The result trains in a standard loop with any ``torch.optim`` optimizer over its
``parameters()`` (this rank's shards): ``loss.backward(); opt.step(); opt.zero_grad()``.
Gradient accumulation, clipping and checkpoints: ``loop.py``, ``checkpoint.py`` and
docs/training.md.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from memshard.core.graph import Origin
from memshard.runtime import traced
from memshard.runtime.executor import GraphModel, ShardedGraphModel, make_batch
from memshard.trace.hf import seeded_model

# (graph, micro-batches, seed, device) → each micro-batch's (args, kwargs) for the model
Batches = Callable[..., list[tuple[tuple, dict]]]


def _is_traced(plan) -> bool:
    return plan.problem.graph.origin is Origin.TRACED


def parallelize(model: nn.Module, plan, device_mesh: DeviceMesh, seed: int = 0) -> ShardedGraphModel:
    """``model`` laid out on ``device_mesh`` as ``plan`` (a :class:`~memshard.plans.plan.Plan`) says.

    ``model`` is a :class:`~memshard.runtime.executor.GraphModel` of the plan's graph, or the
    module the plan traced (its parameters are read by name; call the result like the
    module, it returns the loss; ``seed`` seeds its dropout masks).

    Train it with ``torch.optim.AdamW(result.parameters())`` (or any optimizer) in the standard
    loop; the loss it returns is the global loss on every rank. An optimizer over ``model``'s
    own parameters fails at its first step."""
    if isinstance(model, GraphModel):
        return ShardedGraphModel(model, plan.problem, plan.selection, device_mesh)
    if not _is_traced(plan):
        raise ValueError("this plan is not of a traced module")
    reference = traced.TracedReference(plan.problem.graph, model, seed)
    return traced.ShardedTracedModel(reference, plan.problem, plan.selection, device_mesh)


def _token_batches(graph, micro_batches: int, seed: int, device="cpu") -> list[tuple[tuple, dict]]:
    return [((batch,), {}) for batch in make_batch(graph, micro_batches, seed, device)]


def sharded_model(plan, device_mesh: DeviceMesh, seed: int = 0,
                  module: nn.Module | None = None) -> tuple[ShardedGraphModel, Batches]:
    """This rank's model of ``plan`` and how to make its micro-batches, same on every rank.

    A plan of a traced module runs ``module`` (default: the Hugging Face model its job
    names, built with ``seed``); a built graph runs its reference model (``seed``)."""
    graph = plan.problem.graph
    if not _is_traced(plan):
        return parallelize(GraphModel(graph, seed), plan, device_mesh), _token_batches
    if module is None:
        job = plan.job
        module = seeded_model(job.model.source, job.precision or "mixed", job.model.attn_implementation,
                              job.hf_overrides(), device_mesh.device_type, seed)
    return parallelize(module, plan, device_mesh), traced.make_batch
