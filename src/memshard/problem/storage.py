"""Pricing a job's parameters: the storage half of the problem builder (``pricing.py``).

For every parameter role a storage group (``StoragePricing.add_storage``): its options (every
gradient layout its first use's strategies give × every ZeRO storage over the free axes, and
the fp32 master alone), each priced as it runs — the weight and optimizer states all step, the
gradient from its first contribution to the optimizer as autograd, ZeRO's reductions and
micro-batches hold it, ZeRO-3's gathered weight around each use or over its layer unit's
spans (FSDP2's flat buffers among them), the reductions' and gathers' collectives — and the
links and conflicts that tie it to its ops, added to a :class:`~memshard.problem.draft.ProblemDraft`
(whose context it reads and whose records it extends).

memshard's runtime all-reduces its ZeRO-0 gradients per bucket, by DDP's rule (written once
here: :data:`DDP_BUCKET_CAPS`, :func:`assign_buckets`, in :func:`ready_order`), each bucket in
one coalesced call. A choice is priced before the other weights' choices are known, so a
ZeRO-0 all-reduce is the share of its bucket's call it would be were every weight ZeRO-0 and
split as this one (:func:`zero0_shares`): exact where all are, split alike (data parallelism);
an estimate elsewhere, where a bucket holding only some of those weights runs one call but is
priced at their shares. The evaluator and the ILP read the same shares.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import numpy as np

from memshard.core.graph import Graph, Precision, TensorKind, TensorSpec
from memshard.core.mesh import Mesh
from memshard.core.placement import PARTIAL, REPLICATE, Shard, local_numel, replication
from memshard.problem import comm
from memshard.problem.draft import ProblemDraft
from memshard.problem.gathers import LayerUnit, gather_points
from memshard.problem.kernels import optimizer_step_time
from memshard.problem.memory import (
    MASTER_ALONE,
    StorageMemory,
    StorageOption,
    param_layout,
    redundant_bytes,
    storage_memory,
    storage_options,
)
from memshard.problem.records import (
    ALWAYS,
    BEFORE_RESHARDS,
    DDP_BUCKET_VIEW,
    DURING_RESHARDS,
    MEGATRON_FRAMEWORKS,
    MEMSHARD,
    TORCH_FRAMEWORKS,
    Choice,
    Conflict,
    Link,
    StorageGroup,
)
from memshard.problem.reshard_memory import reshard_peak_bytes
from memshard.problem.strategies import grad_layout, parameter_inputs

ADAM_SQRT_BYTES = 4  # one fp32 element per parameter element: torch Adam's sqrt(exp_avg_sq)
# PyTorch DDP's bucket caps (``buckets.py``), by which memshard's runtime buckets its ZeRO-0
# all-reduces too: the first bucket holds 1 MiB of gradient bytes, every later one 25 MiB.
MIB = 1 << 20
DDP_FIRST_BUCKET_BYTES = 1 * MIB  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
DDP_BUCKET_BYTES = 25 * MIB  # torch.nn.parallel.distributed._DEFAULT_BUCKET_CAP_MB
DDP_BUCKET_CAPS = (DDP_FIRST_BUCKET_BYTES, DDP_BUCKET_BYTES)


def assign_buckets(sizes: list[float], caps: tuple[float, ...] = DDP_BUCKET_CAPS) -> list[int]:
    """Each size's bucket, sizes in the order they are packed: a bucket closes once it holds
    its cap (``caps[k]`` for the k-th bucket, the last cap for every later one)."""
    out, bucket, held = [], 0, 0.0
    for size in sizes:
        out.append(bucket)
        held += size
        if held >= caps[min(bucket, len(caps) - 1)]:
            bucket, held = bucket + 1, 0.0
    return out


def ready_order(graph: Graph) -> list[str]:
    """The parameters in the order the backward makes their gradients final: by their first
    use, last first (a parameter no op reads: left out)."""
    first_use: dict[str, int] = {}
    for i, op in enumerate(graph.ops):
        for t in op.inputs:
            if graph.tensors[t.tensor].kind is TensorKind.PARAMETER:
                first_use.setdefault(t.tensor, i)
    names = [n for n in reversed(graph.parameters) if n in first_use]
    return sorted(names, key=lambda n: -first_use[n])


def zero0_shares(graph: Graph, fraction: float, reduce_bytes: int) -> dict[str, float]:
    """Parameter → the share of its bucket's call that its ZeRO-0 all-reduce is, where every
    parameter is ZeRO-0 with ``fraction`` of its elements local: its elements over its
    bucket's, the buckets packed in :func:`ready_order` by :func:`assign_buckets`, as memshard's
    runtime packs them (``runtime/stores.py``). The shares of a bucket sum to 1."""
    names = ready_order(graph)
    numel = [graph.tensors[n].numel for n in names]
    buckets = assign_buckets([n * fraction * reduce_bytes for n in numel])
    totals: dict[int, int] = {}
    for b, n in zip(buckets, numel):
        totals[b] = totals.get(b, 0) + n
    return {name: n / totals[b] for name, b, n in zip(names, buckets, numel)}


def with_calls(choice: Choice, calls: tuple[comm.Collective, ...], beside: tuple[comm.Collective, ...],
               stage: int, mesh: Mesh) -> Choice:
    """``choice`` with ``calls`` for its collectives (``beside``: those of them run beside the
    compute), its seconds priced again."""
    once = tuple(c for c in beside if once_a_step(c, stage))
    before, after = comm.total_time(choice.calls, mesh), comm.total_time(calls, mesh)
    return replace(choice, calls=calls, time_s=choice.time_s - before + after,
                   overlapped_s=comm.total_time(beside, mesh), overlapped_once_s=comm.total_time(once, mesh))


# What memshard's runtime runs beside the compute (``runtime/stores.py`` says how), of a weight
# of ``numel`` local elements under ZeRO ``stage`` over ``axes`` of a mesh whose axes are made of
# real axes of ``axis_sizes`` (``real_axis_sizes``: one each, but a merged axis's parts):
def real_axis_sizes(mesh: Mesh) -> tuple[tuple[int, ...], ...]:
    """The sizes of the real axes each axis of ``mesh`` is (a merged axis: its parts'; the
    runtime runs on the real mesh)."""
    return tuple(tuple(part.size for part in (axis.parts or (axis,))) for axis in mesh.axes)


def gather_overlaps(stage: int, axes: tuple[int, ...], axis_sizes: tuple[tuple[int, ...], ...], numel: int) -> bool:
    """ZeRO-1/2: the all-gather of the updated shards after the optimizer step, waited for at
    the weight's first use in the next forward. Only over one real storage axis splitting the
    local weight evenly: the shard is then its own slot of the compute weight, gathered in place."""
    return (stage in (1, 2) and len(axes) == 1 and len(axis_sizes[axes[0]]) == 1
            and numel % axis_sizes[axes[0]][0] == 0)


def reduction_overlaps(stage: int, axes: tuple[int, ...], partial_axes: tuple[int, ...],
                       axis_sizes: tuple[tuple[int, ...], ...], numel: int, in_pipeline: bool = False) -> bool:
    """The gradient's reduction in the backward that syncs, waited for at its end: ZeRO-0's
    all-reduces; ZeRO-1's all-reduces and reduce-scatter where its gather overlaps and the
    gradient is a partial sum over the storage axis (the shard it makes is held from the
    reduce-scatter's start: ``StoragePricing.storage_slots``), off a pipeline (``in_pipeline``:
    a stage's backward that syncs is its last, holding fewer micro-batches than the one its
    problem prices, which would price the shard where it is not held). ZeRO-2 reduces in line:
    it frees its whole gradient at once, where a reduction beside the compute would hold it
    until waited for."""
    return stage == 0 or (stage == 1 and not in_pipeline and gather_overlaps(stage, axes, axis_sizes, numel)
                          and axes[0] in partial_axes)


def overlapped_calls(calls: tuple[comm.Collective, ...], G: tuple[str, ...], opt: StorageOption, numel: int,
                     mesh: Mesh, in_pipeline: bool = False) -> tuple[comm.Collective, ...]:
    """Of a storage option's ``calls`` (``_sync_calls``), those memshard's runtime runs beside
    the compute (:func:`gather_overlaps`, :func:`reduction_overlaps`)."""
    partial_axes = tuple(a for a, g in enumerate(G) if g == "P")
    sizes = real_axis_sizes(mesh)
    reduces = reduction_overlaps(opt.stage, opt.axes, partial_axes, sizes, numel, in_pipeline)
    gathers = gather_overlaps(opt.stage, opt.axes, sizes, numel)
    return tuple(c for c in calls if (gathers if c.kind == comm.ALL_GATHER else reduces))


def once_a_step(call: comm.Collective, stage: int) -> bool:
    """Whether a storage option of ZeRO ``stage`` runs ``call`` (one of ``_sync_calls``) once a
    step, not once a micro-batch: ZeRO-0/1 reduce in the backward that syncs (the last
    micro-batch's), ZeRO-1/2 gather their updated shards before the first forward."""
    return stage in (1, 2) if call.kind == comm.ALL_GATHER else stage <= 1


class StoragePricing:
    """The parameters' storage groups and slots (see the module docstring), added to ``draft``."""

    def __init__(self, draft: ProblemDraft):
        self.draft = draft

    def add_storage(self, op_group: list[int]) -> dict[str, int]:
        """A storage group per parameter role, and its slots; returns parameter → group."""
        uses_of: dict[str, list[tuple[int, int]]] = {}
        for i, op in enumerate(self.draft.graph.ops):
            for j in parameter_inputs(self.draft.graph, op):
                uses_of.setdefault(op.inputs[j].tensor, []).append((i, j))
        storage_group = {}
        for name in self.draft.graph.parameters:
            uses = uses_of.get(name)
            if not uses:
                continue
            gid = self.storage_group(name, uses, op_group)
            grp = self.draft.groups[gid]
            grp.instances += 1
            grp.params.append(name)
            storage_group[name] = gid
            self.storage_slots(gid, name, uses)
            self.replay_conflicts(gid, name, uses, op_group)
        self.link_layer_units(storage_group)
        if self.draft.framework == MEMSHARD:
            for gid in dict.fromkeys(storage_group.values()):
                self.bucket_zero0(gid)
        return storage_group

    def bucket_zero0(self, gid: int) -> None:
        """A group's ZeRO-0 choices with each all-reduce a share of its bucket's call
        (:func:`zero0_shares`, every parameter split as this choice splits its weights; the
        mean over the group's instances): latency once per bucket, the bytes as they were."""
        grp, mesh, graph = self.draft.groups[gid], self.draft.mesh, self.draft.graph
        spec = graph.tensors[grp.params[0]]
        for k, (G, opt) in enumerate(grp.options):
            choice = grp.choices[k]
            if opt.stage != 0 or not choice.calls:
                continue
            fraction = local_numel(spec.shape, param_layout(G), mesh.shape) / spec.numel
            shares = self.draft.cached(("zero-0 shares", fraction), lambda fraction=fraction: zero0_shares(
                graph, fraction, graph.precision.reduce_bytes))
            share = sum(shares[name] for name in grp.params) / len(grp.params)
            calls = tuple(replace(c, share=share) if c.kind == comm.ALL_REDUCE else c for c in choice.calls)
            grp.choices[k] = with_calls(choice, calls, calls if choice.overlapped_s > 0 else (), opt.stage, mesh)

    def replay_conflicts(self, gid: int, name: str, uses: list[tuple[int, int]], op_group: list[int]) -> None:
        """A ZeRO-3 weight gathered per op cannot serve a replay (gathered a third time, around
        it): its op is not replayed then. A layer unit's replay uses the unit's backward gather."""
        if name in self.draft.units:
            return
        stage3 = tuple(c for c, (_, opt) in enumerate(self.draft.groups[gid].options) if opt.stage == 3)
        for og in dict.fromkeys(op_group[i] for i, _ in uses):
            grp = self.draft.groups[og]
            if grp.may_replay and stage3 and not any(c.a == og and c.b == gid for c in self.draft.conflicts):
                self.draft.conflicts.append(Conflict(og, grp.replay_choices, gid, stage3,
                                               f"{grp.key} is recomputed and {name} is gathered per op (ZeRO-3)"))

    def storage_group(self, name: str, uses: list[tuple[int, int]], op_group: list[int]) -> int:
        """The group of parameter ``name`` (made for the first of its role): its options are
        every gradient layout its first use's strategies give × every ZeRO storage; linked to
        that op's group, and a tied weight's uses to each other."""
        mesh, spec = self.draft.mesh, self.draft.graph.tensors[name]
        i0, j0 = uses[0]
        og = op_group[i0]
        key = ("storage", self.draft.groups[og].key, j0)
        if key in self.draft.index:
            return self.draft.index[key]
        g_labels = [grad_layout(self.draft.graph.ops[i0], j0, s) for s in self.draft.groups[og].strategies]
        options = [(G, opt) for G in dict.fromkeys(g_labels) for opt in storage_options(G, mesh)]
        if self.draft.framework == MEMSHARD and self.draft.graph.precision.master_bytes:  # after the others: a
            # baseline's choices index the same options in every framework's problem. Only for a
            # layout with no axis left to shard: elsewhere ZeRO over a free axis holds less.
            options += [(G, MASTER_ALONE) for G in dict.fromkeys(g_labels) if len(storage_options(G, mesh)) == 1]
        precision = self.draft.graph.precision
        mems = [storage_memory(spec, G, opt, precision, mesh) for G, opt in options]
        # a layer's gathers and reductions may run beside the compute (the root's may not);
        # memshard's runtime: what ``overlapped_calls`` says (``runtime/stores.py``)
        layered = self.draft.graph.ops[i0].layer is not None
        n_gathers = self.gathers_per_pass(name, uses)
        unit_share = 1 / self.draft.units[name].members if name in self.draft.units else None
        grouped = self.draft.framework != MEMSHARD
        choices = []
        for (G, opt), m in zip(options, mems):
            # (the unit's calls, shared)
            calls, collectives = _option_calls(spec.shape, G, opt, n_gathers, unit_share if opt.stage == 3 else None,
                                               grouped, self.draft.micro_batches, precision, mesh)
            step = optimizer_step_time(m.optimizer_states, m.gradients, m.parameters, mesh.hardware)
            if not layered:
                beside = ()
            elif self.draft.framework != MEMSHARD:
                beside = calls
            else:
                numel = local_numel(spec.shape, param_layout(G), mesh.shape)
                in_pipeline = bool(self.draft.graph.received or self.draft.graph.sent)
                beside = overlapped_calls(calls, G, opt, numel, mesh, in_pipeline)
            once = tuple(c for c in beside if once_a_step(c, opt.stage))
            choices.append(Choice((G, opt.stage, opt.axes), step, calls, step + collectives,
                                  overlapped_s=comm.total_time(beside, mesh),
                                  overlapped_once_s=comm.total_time(once, mesh)))
        gid = self.draft.index[key] = len(self.draft.groups)
        self.draft.groups.append(StorageGroup(name, choices, options, mems))
        self.draft.links.append(Link(gid, tuple(G for G, _ in options), og, tuple(g_labels)))
        for i, j in uses[1:]:  # tied weights: every use agrees on the layout
            other = op_group[i]
            self.draft.links.append(Link(og, tuple(g_labels), other, tuple(
                grad_layout(self.draft.graph.ops[i], j, s) for s in self.draft.groups[other].strategies)))
        return gid

    def storage_slots(self, gid: int, name: str, uses: list[tuple[int, int]]) -> None:
        """Weight and optimizer states all step; the gradient from its first contribution to
        the optimizer, as autograd, ZeRO's reductions and micro-batches hold it; ZeRO-3's
        gathered weight around each use or over its layer unit's spans."""
        S, prec, grp = self.draft.sched, self.draft.graph.precision, self.draft.groups[gid]
        spec = self.draft.graph.tensors[name]
        v = self.draft.cached((gid, "storage"), lambda: self.storage_prices(grp))
        # (the zero-redundancy bound's share: the least layout's, a ZeRO-3 shard that is the master)
        self.draft.slot(gid, 0, S.optimizer, "parameters", *v["parameters"], spec.numel * prec.shard_bytes)
        self.draft.slot(gid, 0, S.optimizer, "optimizer_states", *v["optimizer_states"],
                  spec.numel * prec.sharded_optimizer_bytes)
        if self.draft.framework in TORCH_FRAMEWORKS:
            # torch.optim.Adam as it runs by default on GPUs (foreach): the step's square roots
            # of every local exp_avg_sq at once, fp32 (memshard's runtime updates in place;
            # Megatron-LM's fused Adam too).
            states, red = v["optimizer_states"]
            per_element = np.array([prec.sharded_optimizer_bytes if opt.stage >= 3 else prec.optimizer_bytes
                                    for _, opt in grp.options], float)
            self.draft.slot(gid, S.optimizer, S.optimizer, "transients", *(x * ADAM_SQRT_BYTES / per_element
                                                                     for x in (states, red)))
        # With several micro-batches the gradients accumulate across them: live all step
        # (a pipeline stage running every forward first: from the first backward on).
        # Stored sharded (ZeRO-2/3), the gradient exists once every use's contribution is
        # reduce-scattered, after the first use's backward (the last one to run); until
        # then the whole local gradient waits, from the last use's backward on.
        first, last = uses[-1][0], uses[0][0]
        accumulated = S.backward(first) if self.draft.forwards_first else 0
        grads_from = S.backward(first) if self.draft.micro_batches == 1 else accumulated
        reduced_at = S.reshard_out(last) if self.draft.micro_batches == 1 else accumulated
        # A tied weight's gradient waits in autograd's input buffer, not yet the
        # parameter's .grad, until its last contribution (the first use's backward):
        # a transient until then (as MemTracker files it).
        summed_at = S.backward(last)
        grad_bytes = spec.numel * prec.grad_bytes
        for i, _ in uses[:-1]:
            # A tied weight's earlier uses (later in backward): autograd sums their two
            # gradient contributions into a new buffer while both are still alive.
            self.draft.slot(gid, S.backward(i), S.backward(i), "transients", *v["contributions"])
        if self.draft.framework == DDP_BUCKET_VIEW:
            # The gradient is a view of DDP's bucket (``add_framework_buffers``): autograd's
            # result lives until DDP's hook copies it in, at its last contribution.
            self.draft.slot(gid, grads_from if self.draft.micro_batches == 1 else summed_at, summed_at, "transients",
                      *v["gradients"])
            return
        if reduced_at > grads_from:
            whole = np.array([opt.stage < 2 for _, opt in grp.options], float)
            nbytes, red = v["gradients"]
            # Megatron-LM's contiguous gradient buffer holds every gradient all step
            held_from = 0 if self.draft.framework in MEGATRON_FRAMEWORKS else summed_at
            self.draft.slot(gid, grads_from, held_from - 1, "transients", nbytes * whole, red * whole, grad_bytes)
            self.draft.slot(gid, held_from, reduced_at - 1, "gradients", nbytes * whole, red * whole, grad_bytes)
        unit = self.draft.units.get(name)
        stages = np.array([opt.stage for _, opt in grp.options])
        # A layer unit's member under ZeRO-3: gathered for the unit's spans, its gradient
        # reduced with the unit's (after a copy into the unit's flat buffer); every other
        # option reduces its own gradient after the first use's backward.
        in_unit = (stages == 3) & (unit is not None)
        # (the bound's share from the reduction on: a ZeRO-3 shard's, in the master's dtype)
        self.reduced_gradient(gid, v, stages, ~in_unit, reduced_at, spec.numel * prec.sharded_grad_bytes,
                              before_reshards=True)
        # memshard's runtime reduce-scatters a ZeRO-1 gradient beside the backward that syncs
        # (``reduction_overlaps``): the shard it makes, from its start to the backward's end
        # (the optimizer's gradient then: MemTracker files it so)
        self.draft.slot(gid, S.reshard_out(last), S.optimizer - 1, "gradients", *v["scattering_beside"])
        self.unsharded_gradient_slots(gid, v, stages, in_unit, first, last)
        if unit is None:
            for i, _ in uses:
                for point in gather_points(S, self.draft.graph, i):
                    self.draft.slot(gid, point, point, "transients", *v["gathered"])
                    self.draft.slot(gid, point, point, "transients", *v["cast"])
        else:
            self.unit_slots(gid, v, unit, in_unit, S.backward(first))

    def unsharded_gradient_slots(self, gid: int, v: dict, stages: np.ndarray, in_unit: np.ndarray, first: int,
                                 last: int) -> None:
        """ZeRO-2/3 (not in a layer unit): the whole local gradient from the backward of the
        weight's last use (``first``) until its reduce-scatter, at its first use's (``last``),
        freed before that op's reshards; under ZeRO-2 the parameter's .grad from its last
        contribution on (ZeRO-3 reduces its own)."""
        S = self.draft.sched
        summed_at = S.backward(last)
        unsharded, red = v["unsharded"]
        zero2 = stages == 2
        zero3_per_op = ~in_unit & ~zero2  # (the unsharded bytes are 0 below ZeRO-2)
        self.draft.slot(gid, S.backward(first), S.reshard_out(last), "transients", unsharded * zero3_per_op,
                  red * zero3_per_op, phase=BEFORE_RESHARDS)
        self.draft.slot(gid, S.backward(first), summed_at - 1, "transients", unsharded * zero2, red * zero2)
        self.draft.slot(gid, summed_at, S.reshard_out(last), "gradients", unsharded * zero2, red * zero2,
                  phase=BEFORE_RESHARDS)

    def unit_slots(self, gid: int, v: dict, unit: LayerUnit, in_unit: np.ndarray, first_backward: int) -> None:
        """A layer unit's member under ZeRO-3 (``in_unit``): its gradient reduced with the
        unit's, the unit's gathered weights over its spans."""
        if unit.pipelined:
            self.pipelined_unit_slots(gid, v, unit, in_unit, first_backward)
            return
        stages = np.array([opt.stage for _, opt in self.draft.groups[gid].options])
        unsharded, red = v["unsharded"]
        prec = self.draft.graph.precision
        flat, flat_red = (x * in_unit * prec.reduce_bytes / prec.grad_bytes for x in (unsharded, red))
        # FSDP2 frees the gradients once they are copied into its flat buffer, before the
        # reduce-scatter's output exists (``foreach_reduce``); memshard's runtime holds all three.
        fsdp2 = unit.scatter_buffer is not None
        accumulated = first_backward if self.draft.forwards_first else 0
        self.reduced_gradient(gid, v, stages, in_unit, unit.reduce_point if self.draft.micro_batches == 1 else accumulated,
                              0.0, before_reshards=False, after_copy_in=fsdp2)
        self.draft.slot(gid, first_backward, unit.reduce_point, "transients", unsharded * in_unit, red * in_unit,
                  phase=BEFORE_RESHARDS if fsdp2 else ALWAYS)
        # the unit's gradients copied into one flat buffer (in the reduce dtype) to be reduced
        self.draft.slot(gid, unit.reduce_point, unit.reduce_point, "transients", flat, flat_red)
        for span in (unit.forward_span, unit.backward_span):
            if span is not None:
                self.draft.slot(gid, *span, "transients", *v["gathered"])
                # Gathered over several axes, one at a time: the partial results too.
                self.draft.slot(gid, span[0], span[0], "transients", *v["gathering"])
                self.draft.slot(gid, span[0], span[0], "transients", *v["cast"])
        self.draft.slot(gid, unit.reduce_point, unit.reduce_point, "transients", *v["scattering"])
        # FSDP2's flat buffers, and its post-forward shard under ``reshard_after_forward`` = N
        for buffer, share in ((unit.forward_buffer, 1), (unit.backward_buffer, 1),
                              (unit.post_forward, 1 / max(unit.post_forward_group, 1))):
            if buffer is not None:
                self.draft.slot(gid, *buffer, "transients", *(x * share for x in v["gathered"]))
        if unit.scatter_buffer is not None:
            self.draft.slot(gid, *unit.scatter_buffer, "transients", flat, flat_red)

    def pipelined_unit_slots(self, gid: int, v: dict, unit: LayerUnit, in_unit: np.ndarray,
                             first_backward: int) -> None:
        """A layer unit's member under ZeRO-3 in a stage of torch's pipelining
        (``gathers.pipelined_units``): its unsharded gradient (in the reduce dtype) from the unit's
        ``accumulated_from`` (else its first contribution; from the start, a micro-batch's
        gradient is made beside it, then added in) to the step's end, where the unit's
        post-backward reduce-scatters it (copied into the flat input as the gathered weights
        are freed, so neither buffer outlives it); its shard from there to the optimizer; the
        gathered weights over the unit's spans, a gather's partial results where one runs."""
        S = self.draft.sched
        unsharded, red = v["unsharded"]
        sharded, sharded_red = v["gradients"]
        start = first_backward if unit.accumulated_from is None else unit.accumulated_from
        # accumulated in the reduce dtype (``to_accumulated_grad_if_needed``: fp32 under bf16)
        prec = self.draft.graph.precision
        accumulated = in_unit * prec.reduce_bytes / prec.grad_bytes
        self.draft.slot(gid, start, unit.reduce_point, "gradients", unsharded * accumulated, red * accumulated,
                        phase=BEFORE_RESHARDS)
        if unit.accumulated_from is not None:  # autograd's new gradient until added in (MemTracker's Gradient)
            self.draft.slot(gid, first_backward, first_backward, "gradients", unsharded * in_unit, red * in_unit)
        self.draft.slot(gid, unit.reduce_point, unit.reduce_point, "gradients", sharded * in_unit,
                        sharded_red * in_unit, phase=DURING_RESHARDS)
        self.draft.slot(gid, unit.reduce_point + 1, S.optimizer, "gradients", sharded * in_unit, sharded_red * in_unit)
        gathered = tuple(x * in_unit for x in v["gathered"])
        for span in (unit.forward_span, unit.backward_span):
            if span is not None:
                self.draft.slot(gid, *span, "transients", *gathered,
                                phase=BEFORE_RESHARDS if span[1] == unit.reduce_point else ALWAYS)
                if span[0] > 0:  # (from the step's start: gathered by an earlier micro-batch)
                    self.draft.slot(gid, span[0], span[0], "transients", *(x * in_unit for x in v["gathering"]))
        for buffer in (unit.forward_buffer, unit.backward_buffer):
            if buffer is not None:
                self.draft.slot(gid, *buffer, "transients", *gathered)

    def link_layer_units(self, storage_group: dict[str, int]) -> None:
        """A layer unit is all or nothing, as FSDP's: every member ZeRO-3 over the same axes
        (and partial over them alike), gathered as one flat buffer; or none ZeRO-3. The
        runtime gathers the members it holds from the first use of one to the last; with a
        layer's parameters all in one unit that is the layer's span the unit is priced over."""
        def label(G, opt):
            return ("unit", opt.axes, tuple(G[a] == "P" for a in opt.axes)) if opt.stage == 3 else "apart"

        linked = set()
        by_unit: dict[int, list[int]] = {}
        for name, unit in self.draft.units.items():
            if name in storage_group and not unit.root:
                by_unit.setdefault(id(unit), []).append(storage_group[name])
        for gids in by_unit.values():
            gids = sorted(set(gids))
            if len(gids) < 2 or tuple(gids) in linked:
                continue
            linked.add(tuple(gids))
            labels = {g: tuple(label(G, opt) for G, opt in self.draft.groups[g].options) for g in gids}
            for g in gids[1:]:
                self.draft.links.append(Link(gids[0], labels[gids[0]], g, labels[g]))

    def reduced_gradient(self, gid: int, v: dict, stages: np.ndarray, options: np.ndarray, at: int,
                         global_bytes: float, before_reshards: bool, after_copy_in: bool = False) -> None:
        """The stored gradient of ``options`` from its reduction at point ``at`` on. A ZeRO-2/3
        reduce-scatter's result is a transient there (the optimizer's .grad once it returns;
        ``before_reshards``: it returns before the reshards at ``at`` run); with micro-batches
        each one's is added to the gradient kept all step."""
        nbytes, red = v["gradients"]
        scattered = options & (stages >= 2) & (self.draft.micro_batches == 1)
        kept = options & ~scattered
        self.draft.slot(gid, at, self.draft.sched.optimizer, "gradients", nbytes * kept, red * kept,
                  global_bytes)
        # the reduce-scatter's output, in the reduce dtype: a ZeRO-3 shard's fp32 gradient
        # (the master's dtype) is cast from it once the reduction returns (as FSDP2 does)
        prec = self.draft.graph.precision
        out = scattered * np.where(stages >= 3, prec.reduce_bytes / prec.sharded_grad_bytes, 1.0)
        if before_reshards:  # reduced before the reshards at ``at``: .grad while they run
            self.draft.slot(gid, at, at, "transients", nbytes * out, red * out, phase=BEFORE_RESHARDS)
            self.draft.slot(gid, at, at, "gradients", nbytes * scattered, red * scattered, phase=DURING_RESHARDS)
            # a cast shard (``out`` < 1) is made while autograd still holds the whole gradient
            # and the reduced one: .grad before the reshards too
            cast = scattered * (out < 1)
            self.draft.slot(gid, at, at, "gradients", nbytes * cast, red * cast, phase=BEFORE_RESHARDS)
        else:  # (``after_copy_in``: the point's second moment, once the inputs are freed)
            self.draft.slot(gid, at, at, "transients", nbytes * out, red * out,
                      phase=DURING_RESHARDS if after_copy_in else ALWAYS)
        self.draft.slot(gid, at + 1, self.draft.sched.optimizer, "gradients", nbytes * scattered, red * scattered)

    def gathers_per_pass(self, name: str, uses: list[tuple[int, int]]) -> int:
        """All-gathers of a ZeRO-3 weight per micro-batch: one per use and gather point, or
        its layer unit's (one for forward, one for backward if any op there reads it)."""
        unit = self.draft.units.get(name)
        if unit is None:
            return sum(len(gather_points(self.draft.sched, self.draft.graph, i)) for i, _ in uses)
        return 1 + (unit.backward_span is not None)

    def storage_prices(self, grp: StorageGroup) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        shape = self.draft.graph.tensors[grp.params[0]].shape
        prices = _storage_prices(shape, tuple(grp.options), tuple(grp.memory), self.draft.framework == MEMSHARD,
                                 bool(self.draft.units), self.draft.graph.precision, self.draft.mesh,
                                 bool(self.draft.graph.received or self.draft.graph.sent))
        return {key: (nbytes.copy(), red.copy()) for key, (nbytes, red) in prices.items()}  # (the caller's own)

    def sync_calls(self, spec: TensorSpec, G: tuple[str, ...], opt: StorageOption, n_gathers: int):
        """Gradient reduction and weight gathers one step needs for this storage option.

        Gradients are reduced once per step (accumulated locally over micro-batches) unless
        they are stored sharded (ZeRO-2/3), which reduces them after every micro-batch;
        ZeRO-3 gathers the weight ``n_gathers`` times per micro-batch (``gathers_per_pass``)."""
        return _sync_calls(spec.shape, tuple(G), opt, n_gathers, self.draft.framework != MEMSHARD,
                           self.draft.micro_batches, self.draft.graph.precision, self.draft.mesh)


# Pure functions of records (shapes, layouts, options, the precision, the mesh) behind the
# methods above, memoised: the weights of one shape (q, k, v, the layers' projections) and the
# problems of one job (its frameworks, recompute policies, micro-batch counts) share them.
@functools.lru_cache(maxsize=1 << 14)
def _sync_calls(shape: tuple[int, ...], G: tuple[str, ...], opt: StorageOption, n_gathers: int, grouped: bool,
                micro_batches: int, prec: Precision, mesh: Mesh) -> tuple[comm.Collective, ...]:
    """``StoragePricing.sync_calls``; ``grouped``: over one communicator (the frameworks), not
    axis by axis (memshard's runtime, as DTensor's redistribute)."""
    group = comm.one_communicator if grouped else tuple
    numel = local_numel(shape, param_layout(G), mesh.shape)
    partial_axes = tuple(a for a, g in enumerate(G) if g == "P")
    sharded = set(opt.axes) if opt.stage >= 1 else set()
    reduce = group(comm.all_reduce_over(numel * prec.reduce_bytes,
                                        tuple(a for a in partial_axes if a not in sharded), mesh))
    if sharded:
        reduce += group(comm.reduce_scatter_flat(numel, prec.reduce_bytes,
                                                 tuple(a for a in opt.axes if a in partial_axes), mesh))
    calls = reduce * (micro_batches if opt.stage >= 2 else 1)
    if opt.stage in (1, 2):
        calls += group(comm.gather_flat(numel, prec.param_bytes, opt.axes, mesh))
    elif opt.stage == 3:
        calls += group(comm.gather_flat(numel, prec.param_bytes, opt.axes, mesh)) * (n_gathers * micro_batches)
    return calls


@functools.lru_cache(maxsize=1 << 14)
def _option_calls(shape: tuple[int, ...], G: tuple[str, ...], opt: StorageOption, n_gathers: int,
                  unit_share: float | None, grouped: bool, micro_batches: int, prec: Precision,
                  mesh: Mesh) -> tuple[tuple[comm.Collective, ...], float]:
    """A storage option's collectives (a layer unit's gathers and reductions a ``unit_share``
    of one call each) and their seconds."""
    calls = _sync_calls(shape, G, opt, n_gathers, grouped, micro_batches, prec, mesh)
    if unit_share is not None:
        calls = tuple(replace(c, share=unit_share) if c.kind != comm.ALL_REDUCE else c for c in calls)
    return calls, comm.total_time(calls, mesh)


@functools.lru_cache(maxsize=1024)
def _storage_prices(shape: tuple[int, ...], options: tuple[tuple[tuple[str, ...], StorageOption], ...],
                    mems: tuple[StorageMemory, ...], memshard: bool, units: bool, prec: Precision,
                    mesh: Mesh, in_pipeline: bool = False) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``StoragePricing.storage_prices`` of a group of these options (``memshard``: run by
    memshard's runtime; ``units``: the problem gathers ZeRO-3 weights by layer unit)."""
    layouts = [param_layout(G) for G, _ in options]

    def vec(field: str, red_field: str | None = None):
        nbytes = np.array([getattr(m, field) for m in mems], float)
        red = (np.array([getattr(m, red_field) for m in mems]) if red_field
               else np.array([redundant_bytes(b, L, mesh) for b, L in zip(nbytes, layouts)]))
        return nbytes, red

    # memshard's runtime casts a ZeRO-3 shard that is the fp32 master into its place in
    # the all-gather's bf16 output and gathers there (``stores.gather_flat``, as FSDP2
    # does); a shard split unevenly is cast apart, then gathered by reshards
    casting = memshard and prec.shard_bytes != prec.param_bytes
    gathering, scattering, cast, beside, beside_red = [], [], [], [], []
    for (G, opt), m, layout in zip(options, mems, layouts):
        numel = local_numel(shape, layout, mesh.shape)
        partial_axes = tuple(a for a, g in enumerate(G) if g == "P")
        scattered = (memshard and opt.stage == 1
                     and reduction_overlaps(opt.stage, opt.axes, partial_axes, real_axis_sizes(mesh), numel, in_pipeline))
        ways = math.prod(mesh.shape[a] for a in opt.axes)
        beside.append(scattered * -(-numel // ways) * prec.grad_bytes)
        beside_red.append(beside[-1] * (1 - ways / replication(layout, mesh.shape)))
        in_place = casting and numel % math.prod(mesh.shape[a] for a in opt.axes) == 0
        cast.append(m.parameters * prec.param_bytes / prec.shard_bytes
                    if opt.stage >= 3 and casting and not in_place else 0.0)
        if opt.stage < 3 or not units:
            gathering.append(0.0)
            scattering.append(0.0)
            continue
        flat = tuple(Shard(0) if a in opt.axes else REPLICATE for a in range(mesh.ndim))
        whole = tuple(REPLICATE for _ in flat)
        partial = tuple(PARTIAL if a in opt.axes and g == "P" else REPLICATE for a, g in enumerate(G))
        gathering.append(0.0 if in_place else (reshard_peak_bytes((numel,), prec.param_bytes, flat, whole,
                                                                  mesh, reverse=True)
                                               - numel * prec.param_bytes))
        scattering.append(reshard_peak_bytes((numel,), prec.reduce_bytes, partial, flat, mesh)
                          - local_numel((numel,), flat, mesh.shape) * prec.reduce_bytes)
    zeros = np.zeros(len(mems))
    return {
        "gathering": (np.array(gathering, float), zeros),
        "cast": (np.array(cast, float), zeros),
        "scattering": (np.array(scattering, float), zeros),
        "scattering_beside": (np.array(beside, float), np.array(beside_red, float)),
        "parameters": vec("parameters", "redundant_parameters"),
        "optimizer_states": vec("optimizer_states", "redundant_optimizer_states"),
        "gradients": vec("gradients", "redundant_gradients"),
        "gathered": vec("gathered_weight"),
        "unsharded": vec("unsharded_gradient"),
        "contributions": vec("gradient_contributions"),
    }
