"""Planning large meshes on merged axes, and lifting the plan back to the real mesh.

Adjacent mesh axes with identical links (say the two inter-node axes of ``8x8x16``) can be
planned as one axis of their product size: the ILP then has two mesh axes instead of three,
and is solved far faster. A dim split over the merged axis becomes that
dim split over each of the original axes, in order; ZeRO storage over it becomes storage
over each. The lifted plan is priced again on the real mesh, so every reported figure is
exact for it; what the merge gives up is only choices that treat the merged axes
differently (e.g. batch over one, sequence over the other), and the plan says so.

A merged axis keeps its real axes (``MeshAxis.parts``): every collective and every reshard's
buffers are priced as they run on the real axes (a step over the merged axis is a step over
each part), so a plan of the merged mesh has exactly the peak, the step time and the
communication of its lift, and a budget (``--memory-budget``, ``--max-step-time``) met on
the merged mesh is met on the real one.
"""

from __future__ import annotations

import math
from dataclasses import replace

from memshard.core.mesh import Mesh, MeshAxis
from memshard.problem.records import OpGroup, Problem, Selection
from memshard.search.solve import SearchRequest, SolveResult, solve


def merge_groups(mesh: Mesh) -> list[tuple[int, ...]]:
    """Runs of adjacent axes (size > 1) with the same latency and bandwidth."""
    groups: list[list[int]] = []
    for a, axis in enumerate(mesh.axes):
        prev = mesh.axes[groups[-1][-1]] if groups else None
        if prev is not None and axis.size > 1 and prev.size > 1 and (
            (axis.latency_s, axis.bandwidth_bytes_per_s) == (prev.latency_s, prev.bandwidth_bytes_per_s)
        ):
            groups[-1].append(a)
        else:
            groups.append([a])
    return [tuple(g) for g in groups]


def merged_mesh(mesh: Mesh, groups: list[tuple[int, ...]]) -> Mesh:
    axes = []
    for g in groups:
        first = mesh.axes[g[0]]
        axes.append(first if len(g) == 1 else MeshAxis(
            "*".join(mesh.axes[a].name for a in g), math.prod(mesh.axes[a].size for a in g), first.latency_s,
            first.bandwidth_bytes_per_s, math.prod(mesh.axes[a].per_node for a in g),
            parts=tuple(mesh.axes[a] for a in g)))
    return replace(mesh, axes=tuple(axes))


def lift_selection(coarse: Problem, fine: Problem, selection: Selection, groups: list[tuple[int, ...]]) -> Selection:
    """The fine-mesh plan that splits and stores exactly as the merged-axis plan does."""
    coarse_axis = {a: k for k, g in enumerate(groups) for a in g}
    choices = []
    for gid, (cg, fg) in enumerate(zip(coarse.groups, fine.groups)):
        if cg.key != fg.key or type(cg) is not type(fg):
            raise ValueError(f"group {gid} differs between the meshes: {cg.key} vs {fg.key}")
        want = _lifted_choice(cg, selection.choices[gid], coarse_axis, fine.mesh)
        index = _choice_index(fg)
        if want not in index:
            raise ValueError(f"{cg.key}: {want} has no counterpart on the full mesh")
        choices.append(index[want])
    return Selection(tuple(choices), selection.keeps)


def lower_selection(coarse: Problem, fine: Problem, selection: Selection,
                    groups: list[tuple[int, ...]]) -> Selection | None:
    """The merged-axis plan that lifts to ``selection``; None if ``selection`` treats the axes
    of a merged group differently."""
    coarse_axis = {a: k for k, g in enumerate(groups) for a in g}
    choices = []
    for cg, fg, fine_choice in zip(coarse.groups, fine.groups, selection.choices):
        lifted = [_lifted_choice(cg, k, coarse_axis, fine.mesh) for k in range(len(cg.choices))]
        want = _choice_key(fg, fine_choice)
        if want not in lifted:
            return None
        choices.append(lifted.index(want))
    return Selection(tuple(choices), selection.keeps)


def _lifted_choice(cg, k: int, coarse_axis: dict[int, int], mesh: Mesh):
    """Coarse group ``cg``'s choice ``k`` as its fine group's choice key (``_choice_key``)."""
    fine_axes = range(mesh.ndim)
    if isinstance(cg, OpGroup):
        return tuple(cg.strategies[k].assignment[coarse_axis[a]] for a in fine_axes), cg.replayed(k)
    g, opt = cg.options[k]
    axes = tuple(a for a in fine_axes if coarse_axis[a] in opt.axes and mesh.shape[a] > 1)
    return tuple(g[coarse_axis[a]] for a in fine_axes), opt.over(axes)


def _choice_key(group, k: int):
    """What choice ``k`` of ``group`` is: an op's assignment of dims to mesh axes, or a
    parameter's gradient layout and storage option."""
    return (group.strategies[k].assignment, group.replayed(k)) if isinstance(group, OpGroup) else group.options[k]


def _choice_index(group) -> dict:
    return {_choice_key(group, k): k for k in range(len(group.choices))}


def solve_merged(request: SearchRequest) -> SolveResult:
    """Solve ``request``, whose problem is on merged axes (``merged_mesh``): priced as the real
    mesh runs it, so its plan meets the same budgets there."""
    result = solve(request)
    coarse = request.problem
    merged = " and ".join("×".join(p.name for p in axis.parts) for axis in coarse.mesh.axes if axis.parts)
    return replace(result, search_space=f"axes {merged} planned as one")
