"""What the runtime needs of a traced module: ``Graph.traced`` of a traced graph.

:class:`TracedProgram` keeps the exported program (its parameter-free nodes compute the IR's
inputs on every device) and, per IR op, the ATen call it came from (:class:`AtenCall`): the
runtime makes that call on local shards, viewing each local IR tensor (one axis per dim) as
the torch argument (``in_axes``) and the result back (``out_axes``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple


@dataclass(frozen=True)
class InputSlot:
    """An argument slot filled at run time with the op's input ``index`` (local shard)."""

    index: int


@dataclass(frozen=True)
class AtenCall:
    """How the runtime calls one IR op on local shards."""

    target: Any  # the ATen overload; None for a piece of a split (the kernel selects it)
    args: tuple  # tensors as InputSlot, other nodes as their meta values
    kwargs: dict[str, Any]
    item: int | None  # one output of a multi-output op without a rule
    in_axes: list[list[tuple[str, ...]]]  # per input: the IR dims of each torch axis
    out_axes: list[tuple[str, ...]]
    dtype: Any  # the result's torch dtype
    index: int  # select: which piece
    pieces: tuple[str, ...]  # select, cat: the dim that counts the pieces
    sizes: dict[str, int]  # every dim the call touches → its global size
    # cross-entropy only: torch's reduction enum (1: mean), the ignored label, and why the
    # split kernel cannot run it (class weights, label smoothing), if it cannot
    reduction: int = 1
    ignore_index: int = -100
    unsupported: str | None = None


class TokenCount(NamedTuple):
    """A synthetic input: how many labels of node ``labels`` are not ``ignore_index`` (the
    divisor of a mean cross-entropy, counted on the full labels)."""

    labels: str
    ignore_index: int


@dataclass
class TracedProgram:
    program: Any  # torch.export.ExportedProgram
    aten: dict[str, AtenCall]  # IR op name → its call
    synthetic: dict[str, TokenCount]  # IR input name → how to count it
    parameter_axes: dict[str, tuple[tuple[str, ...], ...]]  # FQN → IR dims of each torch axis
    fixed_kwargs: dict[str, Any] = field(default_factory=dict)  # non-tensor call arguments (use_cache)
