"""Where a plan's redundant bytes sit, and what sharding an op further would cost.

``redundancy_by_op``: the redundant bytes live at a schedule point, per op (an op owns its
buffers and gradients, the weights it uses, the activations it produces or keeps);
``redundancy_parts``: the same bytes by what holds them (a saved input, the output, a
weight's optimizer states…) and the mesh axes that hold copies of it.
``advise``: the ops holding the most at the peak, each with the cheapest (in step time)
strategy that splits it over one more mesh axis, the plan re-priced with it, everything else
unchanged (``shard_alternative``), or, when there is none, why not (``why_not_split``): every
mesh axis already splits one of its dims (its redundant bytes are then copies of operands that
lack the dim an axis splits), or each dim left is smaller than a free axis, cannot be split by
the op's kernel, or a link (a tied weight, a layer unit) ties the op to another that would
have to change with it. A plan computes its advice when it is built.
"""

from __future__ import annotations

from dataclasses import dataclass

from memshard.core.placement import Shard
from memshard.problem.evaluate import Evaluation, InconsistentPlan, evaluate
from memshard.problem.memory import MASTER_ALONE
from memshard.problem.records import (
    DURING_RESHARDS,
    GROUP_KINDS,
    INPUT_COPY,
    REGATHER,
    REPLAY_INPUT,
    REPLAY_READ,
    REPLAYED,
    SAVED,
    SOURCE,
    OpGroup,
    Problem,
    Selection,
    StorageGroup,
    storage_links,
)

# Why a free mesh axis cannot split one of an op's dims (Blocked.why).
UNSPLITTABLE = "unsplittable"  # the op's kernel cannot split the dim (fused attention's key dim)
TOO_SMALL = "too_small"  # fewer elements left on a device than the axis has devices
LINKED = "linked"  # a link ties the op to another group that would have to change with it
REFUSED = "refused"  # the plan re-priced with it is inconsistent for another reason


@dataclass(frozen=True)
class Alternative:
    op: str
    split: dict[str, str]  # mesh axis → op dim, the new strategy
    peak_delta_bytes: float
    redundant_delta_bytes: float
    step_time_delta_s: float
    communication_delta_bytes: float


def reselect(problem: Problem, selection: Selection, gid: int, choice: int) -> Selection:
    """``selection`` with op group ``gid`` switched to strategy ``choice``; its parameters keep
    their ZeRO stage on the axes still free, and its edges stop keeping copies."""
    choices = list(selection.choices)
    choices[gid] = choice
    for link in storage_links(problem):
        if link.b != gid:
            continue
        options = problem.groups[link.a].options
        _, old = options[selection.choices[link.a]]
        new_g = link.b_labels[choice]
        free = {a for a, g in enumerate(new_g) if not g.startswith("S")}
        axes = tuple(a for a in old.axes if a in free)
        want = old.over(axes)
        if old.stage == 3 and not axes and (new_g, MASTER_ALONE) in options:  # ZeRO-3 with no axis left
            want = MASTER_ALONE
        choices[link.a] = options.index((new_g, want))
    keeps = tuple(0 if gid in (e.producer, e.consumer) else k for e, k in zip(problem.edges, selection.keeps))
    return Selection(tuple(choices), keeps)


def shard_alternative(problem: Problem, selection: Selection, gid: int, base: Evaluation) -> Alternative | None:
    """The cheapest (in step time) strategy that splits the op over one more mesh axis."""
    grp = problem.groups[gid]
    strategies = grp.strategies
    current = strategies[selection.choices[gid]].assignment
    best = None
    for k, s in enumerate(strategies):
        changed = [(a, b) for a, b in zip(current, s.assignment) if a != b]
        if len(changed) != 1 or changed[0][0] is not None:
            continue
        try:
            ev = evaluate(problem, reselect(problem, selection, gid, k))
        except (InconsistentPlan, ValueError):
            continue  # a tied weight or another link forbids it
        alt = Alternative(
            op=grp.key,
            split={problem.mesh.axis_names[a]: d for a, d in enumerate(s.assignment) if d is not None},
            peak_delta_bytes=ev.peak_bytes - base.peak_bytes,
            redundant_delta_bytes=ev.redundant_bytes - base.redundant_bytes,
            step_time_delta_s=ev.step_time_s - base.step_time_s,
            communication_delta_bytes=ev.communication_bytes - base.communication_bytes,
        )
        if best is None or (alt.step_time_delta_s, alt.peak_delta_bytes) < (best.step_time_delta_s, best.peak_delta_bytes):
            best = alt
    return best


@dataclass(frozen=True)
class Blocked:
    """One dim a free mesh axis might split, and why no strategy does."""

    axis: str
    dim: str
    why: str  # UNSPLITTABLE, TOO_SMALL, LINKED or REFUSED
    local_size: int  # the dim's size on one device under the op's strategy
    axis_size: int
    linked_to: str | None = None  # LINKED: the group (op, or parameter) that would disagree


@dataclass(frozen=True)
class NoFurtherSplit:
    """Why no strategy splits an op over one more mesh axis."""

    split: dict[str, str]  # mesh axis → op dim: the op's strategy
    free_axes: tuple[str, ...]  # axes (of size > 1) that split none of its dims; () if every one does
    blocked: tuple[Blocked, ...]  # per free axis and dim, why it cannot split it


@dataclass(frozen=True)
class Holding:
    """Part of an op's redundant bytes: what holds them, and the mesh axes over which that is
    copied (a tensor laid out ``S(0)R`` on a ``2x4`` mesh is copied over the second axis)."""

    what: str  # "output", "saved input (ln_2's output)", "mlp.fc.weight" (the weight), "mlp.fc.weight gradient"…
    redundant_bytes: float
    copied_over: tuple[str, ...]


@dataclass(frozen=True)
class RedundantOp:
    op: str
    redundant_bytes: float  # per device, at the peak
    alternative: Alternative | None  # None: no strategy splits it over one more axis (or not asked)
    why_not: NoFurtherSplit | None = None  # without an alternative (when advice was asked): why
    parts: tuple[Holding, ...] = ()  # what holds its redundant bytes, largest first


def why_not_split(problem: Problem, selection: Selection, gid: int) -> NoFurtherSplit:
    """Why op group ``gid`` has no strategy splitting it over one more axis (see the module)."""
    grp, mesh = problem.groups[gid], problem.mesh
    op = problem.graph.ops[grp.ops[0]]
    current = grp.strategies[selection.choices[gid]]
    index = {s.assignment: k for k, s in enumerate(grp.strategies) if grp.replayed(k) == grp.replayed(selection.choices[gid])}
    local = current.local_sizes
    free = [a for a, d in enumerate(current.assignment) if d is None and mesh.shape[a] > 1]
    blocked = []
    for a in free:
        for d in op.dims:
            k = index.get(current.assignment[:a] + (d,) + current.assignment[a + 1:])
            linked = None
            if d in op.unsplittable_dims:
                why = UNSPLITTABLE
            elif k is None:
                why = TOO_SMALL  # the enumerator leaves out only splits of too few elements
            else:
                linked = _linked_to(problem, selection, gid, k)
                why = LINKED if linked is not None else REFUSED
            blocked.append(Blocked(mesh.axis_names[a], d, why, local[d], mesh.shape[a], linked))
    return NoFurtherSplit({mesh.axis_names[a]: d for a, d in enumerate(current.assignment) if d is not None},
                          tuple(mesh.axis_names[a] for a in free), tuple(blocked))


def _linked_to(problem: Problem, selection: Selection, gid: int, choice: int) -> str | None:
    """The group a link ties to op group ``gid`` that would disagree with strategy ``choice``."""
    try:
        new = reselect(problem, selection, gid, choice)
    except ValueError:
        return None
    changed = {g for g, (a, b) in enumerate(zip(selection.choices, new.choices)) if a != b}
    for link in problem.links:
        if link.a_labels[new.choices[link.a]] != link.b_labels[new.choices[link.b]]:
            other = link.a if link.b in changed else link.b
            return problem.groups[other].key
    return None


def _owners(problem: Problem) -> dict[int, str]:
    """Group → the op role that owns its bytes: an op its own, a parameter's storage its op's."""
    owner = {gid: grp.key for gid, grp in enumerate(problem.groups) if isinstance(grp, OpGroup)}
    for link in storage_links(problem):
        owner[link.a] = problem.groups[link.b].key
    return owner


def _shared_gradients_at(problem: Problem, selection: Selection, point: int):
    """(op role, redundant bytes) of each output-gradient slot live at ``point`` that counts
    a gradient another producer holds too (``records.SharedGradient``), to take back."""
    for g in problem.shared_gradients:
        if g.start <= point <= g.end and g.shared(problem, selection):
            yield problem.groups[g.owner].key, float(g.redundant[selection.choices[g.group]])


def _held_at(problem: Problem, selection: Selection, point: int):
    """Each distinct activation held at ``point``: (a holder of it, its held tensor, the
    layout id, the layout, the op group that owns it — its producer, or the consumer whose
    copy it is)."""
    seen: dict[int, set] = {}
    for h in problem.holders:
        layout = problem.holder_layout(selection, h) if h.start <= point <= h.end else None
        if layout is None:
            continue
        held = problem.held[h.tensor]
        lid = held.layout_id(layout)
        if lid in seen.setdefault(h.tensor, set()):
            continue
        seen[h.tensor].add(lid)
        yield h, held, lid, layout, (h.source if h.kind in GROUP_KINDS else problem.edges[h.source].consumer)


def redundancy_by_op(problem: Problem, selection: Selection, point: int) -> dict[str, float]:
    """Redundant bytes live at ``point`` per op role: an op owns its buffers and gradients,
    the weights it uses, and the activations it produces or keeps."""
    owner = _owners(problem)
    out: dict[str, float] = {}
    for s in problem.slots:
        if s.start <= point <= s.end and s.phase != DURING_RESHARDS:  # (the moment before the reshards)
            key = owner[s.group]
            out[key] = out.get(key, 0.0) + float(s.redundant[selection.choices[s.group]])
    for key, nbytes in _shared_gradients_at(problem, selection, point):
        out[key] -= nbytes
    for _, held, lid, _, gid in _held_at(problem, selection, point):
        key = problem.groups[gid].key
        out[key] = out.get(key, 0.0) + float(held.redundant[lid])
    return out


def redundancy_parts(problem: Problem, selection: Selection, point: int, ops: set[str]) -> dict[str, list[Holding]]:
    """The redundant bytes :func:`redundancy_by_op` gives ``ops`` at ``point``, by what holds
    them (largest first), each with the mesh axes it is copied over."""
    owner = _owners(problem)
    parts: dict[str, dict[tuple, float]] = {op: {} for op in ops}

    def add(op: str, what: str, axes: tuple[str, ...], nbytes: float) -> None:
        if op in parts and nbytes > 0:
            parts[op][what, axes] = parts[op].get((what, axes), 0.0) + nbytes

    prefixes = {problem.graph.ops[grp.ops[0]].name + ".": grp.key for grp in problem.groups
                if isinstance(grp, OpGroup) and grp.instances > 1}
    for s in problem.slots:
        if s.start <= point <= s.end and s.phase != DURING_RESHARDS and owner[s.group] in parts:
            add(owner[s.group], *_slot_part(problem, selection, s.group, s.category, prefixes),
                float(s.redundant[selection.choices[s.group]]))
    for op, nbytes in _shared_gradients_at(problem, selection, point):
        if op in parts and nbytes > 0:  # (its slot's part, in the same layout: as large or larger)
            left = parts[op].pop(("transients", ()), 0.0) - nbytes
            if left > 0:
                parts[op]["transients", ()] = left
    for h, held, lid, layout, gid in _held_at(problem, selection, point):
        axes = tuple(problem.mesh.axis_names[a] for a, p in enumerate(layout)
                     if not isinstance(p, Shard) and problem.mesh.shape[a] > 1)
        what = ("output" if h.kind in GROUP_KINDS
                else f"{_HELD_AS[h.kind]} ({problem.groups[held.key].key}'s output)")
        add(problem.groups[gid].key, what, axes, float(held.redundant[lid]))
    return {op: [Holding(what, b, axes) for (what, axes), b in sorted(p.items(), key=lambda kv: (-kv[1], kv[0]))]
            for op, p in parts.items()}


_HELD_AS = {SAVED: "saved input", INPUT_COPY: "input", REGATHER: "re-gathered input", REPLAYED: "recomputed input",
            SOURCE: "input held for the replay", REPLAY_READ: "input read by the replay",
            REPLAY_INPUT: "input of the replay"}
_STORED_AS = {"parameters": "", "gradients": " gradient", "optimizer_states": " optimizer states",
              "transients": " (transient copy)", "activations": " (activation)"}
_ZERO_STAGE = {"parameters": 3, "gradients": 2, "optimizer_states": 1}  # the stage that shards it


def _slot_part(problem: Problem, selection: Selection, gid: int, category: str,
               prefixes: dict[str, str]) -> tuple[str, tuple[str, ...]]:
    """What a slot of group ``gid`` holds, and the axes it is copied over (known for a
    parameter's storage: its free axes less those its ZeRO stage shards it over). A shared
    layer's parameter is named by its role (``mlp.fc.weight``, not ``layers.0.mlp.fc.weight``):
    ``prefixes`` maps the first layer's op name and a dot to the role."""
    grp, names = problem.groups[gid], problem.mesh.axis_names
    if not isinstance(grp, StorageGroup):
        return category.replace("_", " "), ()
    grad, opt = grp.options[selection.choices[gid]]
    zero = opt.axes if opt.stage >= _ZERO_STAGE.get(category, 4) else ()
    axes = tuple(names[a] for a, g in enumerate(grad)
                 if not g.startswith("S") and problem.mesh.shape[a] > 1 and a not in zero)
    name = next((role + "." + grp.key[len(p):] for p, role in prefixes.items() if grp.key.startswith(p)), grp.key)
    return name + _STORED_AS[category], axes


def advise(problem: Problem, selection: Selection, evaluation: Evaluation, top: int,
           alternatives: bool = True) -> tuple[RedundantOp, ...]:
    """The ``top`` ops holding the most redundant bytes at the peak (ties by name), each with
    its alternative (``alternatives``; else none) or why there is none, and what holds its bytes."""
    by_op = redundancy_by_op(problem, selection, evaluation.peak_point)
    group_of = {g.key: i for i, g in enumerate(problem.groups) if isinstance(g, OpGroup)}
    chosen = sorted(by_op.items(), key=lambda kv: (-kv[1], kv[0]))[:top]
    parts = redundancy_parts(problem, selection, evaluation.peak_point, {op for op, _ in chosen})
    out = []
    for op, nbytes in chosen:
        alternative = why = None
        if alternatives and nbytes > 0:
            alternative = shard_alternative(problem, selection, group_of[op], evaluation)
            if alternative is None:
                why = why_not_split(problem, selection, group_of[op])
        out.append(RedundantOp(op, nbytes, alternative, why, tuple(parts[op])))
    return tuple(out)
