"""What a standard PyTorch training loop needs from a sharded model, in one place.

After ``memshard.parallelize``, the three lines of any training loop::

    loss = sharded(batch); loss.backward()
    optimizer.step(); optimizer.zero_grad()

train the plan exactly as one process trains the module, with any ``torch.optim`` optimizer
built over ``sharded.parameters()`` (this rank's shards):

- the gradient reductions run from the backward itself (``stores.ParamStore``): ZeRO-2
  reduce-scatters each gradient as soon as it is complete, ZeRO-3 reduces in the backward of
  its gather, and stages 0 and 1 reduce their accumulated gradients in the backward of the
  last micro-batch, unless gradient sync is off: stage 0 starts each all-reduce as soon as
  the gradient is final, and when the backward ends (a callback queued on autograd's engine)
  those are waited for and stage 1's run;
- the updated shards of stages 1 and 2 are gathered into the compute weights by a global
  optimizer step hook (:func:`install_optimizer_hooks`), and the model's step count (its
  dropout masks) moves on; a shard changed in place through its parameter otherwise is
  gathered before the next forward;
- a step that cannot be right fails at once with one :class:`MemshardError`: an optimizer that
  holds the unsharded module's parameters, stepping while gradients wait to be reduced, or a
  ``torch.optim`` optimizer over the bf16 shards of a mixed-precision plan (it would update
  them without fp32 master weights; ``optim.LeanAdam`` keeps them).

The parameters an optimizer sees are DTensors (``stores.ParamStore.opt``), so
``torch.nn.utils.clip_grad_norm_(sharded.parameters(), ...)`` reduces the norm over the mesh.
This module also holds the loss summed over the axes that split it (:class:`SumOverAxes`:
``loss.item()`` is the global loss on every rank).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from memshard.core.errors import MemshardError

# the sharded models alive in this process (``register``), which every optimizer step visits
_MODELS: weakref.WeakSet = weakref.WeakSet()
_HOOKS: list = []  # the two global optimizer hooks, installed once


def register(model) -> None:
    """Let every optimizer step in this process check and update ``model`` (a
    ``ShardedGraphModel``): its ``check_optimizer(held, keeps_masters)`` before,
    ``after_optimizer_step(held)`` after, ``held`` the ids of the optimizer's parameters and
    ``keeps_masters`` whether it keeps fp32 master weights of low-precision ones."""
    install_optimizer_hooks()
    _MODELS.add(model)


def install_optimizer_hooks() -> None:
    """Install the global optimizer step hooks (once per process)."""
    if not _HOOKS:
        _HOOKS.append(register_optimizer_step_pre_hook(_before_step))
        _HOOKS.append(register_optimizer_step_post_hook(_after_step))


def held_ids(optimizer: torch.optim.Optimizer) -> set[int]:
    """The ids of the parameters ``optimizer`` holds."""
    return {id(p) for group in optimizer.param_groups for p in group["params"]}


def _before_step(optimizer, args, kwargs) -> None:
    if not _MODELS:
        return
    held = held_ids(optimizer)
    keeps_masters = bool(getattr(optimizer, "keeps_master_weights", False))
    for model in list(_MODELS):
        model.check_optimizer(held, keeps_masters)


def _after_step(optimizer, args, kwargs) -> None:
    if not _MODELS:
        return
    held = held_ids(optimizer)
    for model in list(_MODELS):
        model.after_optimizer_step(held)


class SourceParameters:
    """The parameters of the module a sharded model was made from, by weak reference: an
    optimizer over them trains nothing the sharded model runs."""

    def __init__(self, parameters: Iterable[torch.Tensor]):
        self.refs = {id(p): weakref.ref(p) for p in parameters}

    def any_held(self, held: set[int]) -> bool:
        """Whether an optimizer holding the parameters of ids ``held`` holds one of these."""
        for key in held & self.refs.keys():
            ref = self.refs[key]()
            if ref is not None and id(ref) == key:
                return True
        return False


WRONG_PARAMETERS = ("this optimizer holds the parameters of the unsharded module, which the sharded "
                    "model does not use: build it over the sharded model's, "
                    "e.g. torch.optim.AdamW(sharded.parameters())")
NO_MASTERS = ("this optimizer would update the bf16 shards of a mixed-precision plan with no fp32 "
              "master weights, which the plan counts: use memshard.runtime.optim.LeanAdam, which "
              "keeps them, or plan in fp32 (precision='fp32')")
UNREDUCED = ("the optimizer steps while gradients wait to be reduced: gradient sync was off for the "
             "last backward; call sharded.set_requires_gradient_sync(True) before the last "
             "micro-batch's backward (or leave sharded.no_sync() before it)")


def check_step(source: SourceParameters, held: set[int], mine: set[int], has_gradients: bool,
               unreduced: bool, low_precision: set[int] = frozenset()) -> None:
    """Raise the one error a step that cannot be right gets (the messages above);
    ``low_precision``: the ids of this model's parameters that lack fp32 master weights
    under this optimizer."""
    if has_gradients and source.any_held(held):
        raise MemshardError(WRONG_PARAMETERS)
    if unreduced and held & mine:
        raise MemshardError(UNREDUCED)
    if held & low_precision:
        raise MemshardError(NO_MASTERS)


class SumOverAxes(torch.autograd.Function):
    """The loss summed over the mesh axes where each rank holds a partial sum of it: the same
    value on every rank. Backward hands each rank the gradient unchanged, the derivative of a
    sum with respect to each of its terms."""

    @staticmethod
    def forward(ctx, loss: torch.Tensor, groups: tuple) -> torch.Tensor:
        total = loss.detach().clone()
        for group in groups:
            dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None
