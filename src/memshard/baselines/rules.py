"""Complete plans from simple rules: each op split by a function of the op, every parameter
stored alike; data parallelism (with ZeRO stage 0–3 over every axis) is the first such rule.
The baselines (``baselines/recipes.py``) are built from these; the search uses data parallelism as
its step-time reference (``search/reference.py``)."""

from __future__ import annotations

from collections.abc import Callable

from memshard.core.graph import Op
from memshard.problem.memory import StorageOption
from memshard.problem.records import OpGroup, Problem, Selection, StorageGroup, complete_selection


class SplitUnavailable(ValueError):
    """The rule cannot be laid out on this model and mesh (e.g. heads not divisible)."""


def assign_strategies(problem: Problem, per_op: Callable[[Op], tuple],
                      replayed: Callable[[int], bool] = lambda i: False) -> dict[int, int]:
    """Strategy index per op group from ``per_op(op) -> assignment tuple`` (the dim each
    mesh axis splits, None for none); ``replayed(op index)``: whether to recompute it (where
    the problem lets its group choose)."""
    out = {}
    graph = problem.graph
    for gid, grp in enumerate(problem.groups):
        if not isinstance(grp, OpGroup):
            continue
        want = per_op(graph.ops[grp.ops[0]])
        choice = grp.choice_of(want, replayed(grp.ops[0]))
        if choice is None:
            raise SplitUnavailable(f"{grp.key} cannot be split as {want} on mesh {problem.mesh}")
        out[gid] = choice
    return out


def uniform_storage(problem: Problem, stage: int, axes: tuple[int, ...]) -> dict[int, StorageOption]:
    """Every parameter with ZeRO ``stage`` over ``axes`` (those of size one dropped)."""
    axes = tuple(a for a in axes if problem.mesh.shape[a] > 1)
    option = StorageOption(stage if axes else 0, axes if stage else ())
    return {gid: option for gid, grp in enumerate(problem.groups) if isinstance(grp, StorageGroup)}


def data_parallel(problem: Problem, zero_stage: int = 0, replayed: Callable[[int], bool] = lambda i: False) -> Selection:
    """The batch split over every axis, parameters replicated (``zero_stage`` 0) or with
    ZeRO-1/2/3 over every axis (3 = FSDP's full shard); ``replayed``: as ``assign_strategies``."""
    axes = tuple(range(problem.mesh.ndim))
    split = tuple("b" if m > 1 else None for m in problem.mesh.shape)
    strategies = assign_strategies(problem, lambda op: split if "b" in op.dims else (None,) * len(split), replayed)
    return complete_selection(problem, strategies, uniform_storage(problem, zero_stage, axes))
