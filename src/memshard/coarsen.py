"""Planning large meshes on merged axes, and lifting the plan back to the real mesh.

Adjacent mesh axes with identical links (say the two inter-node axes of ``8x8x16``) can be
planned as one axis of their product size: the ILP then has two mesh axes instead of three,
and is solved in seconds instead of minutes. A dim split over the merged axis becomes that
dim split over each of the original axes, in order; ZeRO storage over it becomes storage
over each. The lifted plan is priced again on the real mesh, so every reported figure is
exact for it; what the merge gives up is only choices that treat the merged axes
differently (e.g. batch over one, sequence over the other), and the plan says so.
"""

from __future__ import annotations

import math
from dataclasses import replace

from memshard.cost.memory import StorageOption
from memshard.mesh import Mesh, MeshAxis
from memshard.problem import Problem, Selection


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
        axes.append(MeshAxis("*".join(mesh.axes[a].name for a in g), math.prod(mesh.axes[a].size for a in g),
                             first.latency_s, first.bandwidth_bytes_per_s))
    return replace(mesh, axes=tuple(axes))


def lift_selection(coarse: Problem, fine: Problem, selection: Selection, groups: list[tuple[int, ...]]) -> Selection:
    """The fine-mesh plan that splits and stores exactly as the merged-axis plan does."""
    coarse_axis = {a: k for k, g in enumerate(groups) for a in g}
    fine_axes = range(fine.mesh.ndim)
    choices = []
    for gid, (cg, fg) in enumerate(zip(coarse.groups, fine.groups)):
        if cg.key != fg.key or cg.kind != fg.kind:
            raise ValueError(f"group {gid} differs between the meshes: {cg.key} vs {fg.key}")
        k = selection.choices[gid]
        if cg.kind == "op":
            want = tuple(cg.meta["strategies"][k].assignment[coarse_axis[a]] for a in fine_axes)
            index = {s.assignment: i for i, s in enumerate(fg.meta["strategies"])}
        else:
            g, opt = cg.meta["options"][k]
            want_g = tuple(g[coarse_axis[a]] for a in fine_axes)
            axes = tuple(a for a in fine_axes if coarse_axis[a] in opt.axes and fine.mesh.shape[a] > 1)
            want = (want_g, StorageOption(opt.stage if axes else 0, axes))
            index = {o: i for i, o in enumerate(fg.meta["options"])}
        if want not in index:
            raise ValueError(f"{cg.key}: {want} has no counterpart on the full mesh")
        choices.append(index[want])
    return Selection(tuple(choices), selection.keeps)
