"""The strategies people use by hand, as fixed plans in memshard's own search space.

Each baseline is a short function that picks, for every op, which mesh axis splits which
dim, and for every parameter its ZeRO storage; the plan is then priced by the same model as
memshard's plans, so the comparison is like for like (and, being points of the search
space, no baseline beats memshard's minimal-memory plan by more than the solver's gap).

- ``dp``: every op splits the batch over every axis, gradients all-reduced in place (``ddp``:
  the same plan priced as PyTorch's DistributedDataParallel runs it, with its gradient
  buckets; ``ddp-bucket-view``: with ``gradient_as_bucket_view=True``, the buckets are the
  gradients); ``zero`` (stages 1/2/3): the same with
  optimizer states, + gradients, + weights sharded over all axes (ZeRO-3 = FSDP full shard),
  ZeRO-3 gathered as the search's ``zero3_unit`` says (``zero3-fsdp``: an idealised FSDP);
  ``fsdp2``: the same plan priced as PyTorch's ``fully_shard`` runs it, each layer and the
  root module wrapped, its defaults (``gathers.fsdp2_units``); ``fsdp2-noreshard``: every
  layer's ``fully_shard`` with ``reshard_after_forward=False`` (ZeRO-2's memory for a layer's
  weights between its forward and backward, one all-gather less); ``fsdp2-prefetch2``: each
  layer's ``fully_shard`` prefetching the next two layers in forward and the two before it in
  backward (``set_modules_to_forward_prefetch`` / ``…_backward_prefetch``, as PyTorch's FSDP2
  example sets them); ``fsdp2-torchtitan``: ``fully_shard`` as torchtitan wraps a decoder, the
  token embedding and the output layers (final norm and LM head, not resharded after forward)
  units of their own beside the blocks; ``fsdp2-reshard<N>``: every ``fully_shard`` with
  ``reshard_after_forward=N``, N the devices of a node (the innermost axis), where the mesh has
  more than one node.
- ``megatron_tp``, priced as Megatron-LM runs it (``framework="megatron"``: its gradient
  buffer, fp32 under bf16, all step): tensor parallelism over the innermost ``tp`` axes (column/row-parallel
  linears, attention split by heads, vocab-parallel embedding and loss; none at TP 1), data
  parallelism over the others; ``megatron_tp_sp`` also splits the sequence of the ops between
  (norms, dropouts, residuals) and keeps their outputs split for backward; with
  ``distributed_optimizer``, ZeRO-1 over the data-parallel axes (Megatron's
  ``--use-distributed-optimizer``), and ``-overlap`` its collectives beside the compute
  (``--overlap-grad-reduce --overlap-param-gather``, ``framework="megatron-overlap"``).
- ``tp_fsdp``: torchtitan's 2D recipe: tensor + sequence parallelism inside, FSDP outside,
  idealised; ``torch_tp_fsdp2``: the same as PyTorch runs it (``parallelize_module`` with
  torchtitan's plan × ``fully_shard``, on a problem built for ``TORCH_TP``; ``…-noreshard``:
  every ``fully_shard`` with ``reshard_after_forward=False``; ``…-torchtitan``: with
  torchtitan's units, as ``fsdp2-torchtitan``).

Recomputation (``recompute.py``): on a problem whose policy is ``selective`` or ``full`` every
baseline recomputes so; under ``auto`` each baseline comes without (its plain name), with
selective (``+selective``: Megatron-LM's core attention) and with full recomputation
(``+full``: Megatron-LM's full uniform, torchtitan's full activation checkpointing), PyTorch's
FSDP2 and DDP also with torchtitan's per-op selective checkpointing (``+selective-op``,
``recompute.op_level_replayed``), Megatron-LM's with its MLP module recomputed
(``+selective-mlp``, ``--recompute-modules mlp``, ``recompute.mlp_module``) and with it and
the core attention (``+selective-attn-mlp``, ``core_attn mlp``), and the
Megatron-LM and torchtitan recipes also with some of their layers recomputed in full
(``LayerSplit``: ``+full-blockN``, Megatron-LM's block method; ``+full-everyN``, torchtitan's
every N-th layer), on a problem whose layers are in two classes (``split_baseline``).

Tensor-parallel degrees below the node size are laid out on the same devices viewed as a
finer logical mesh (``split_innermost``), priced by the same model.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from memshard.baselines.names import Kind, StrategyName, parse_strategy
from memshard.baselines.rules import (
    SplitUnavailable,
    assign_strategies,
    data_parallel,
    uniform_storage,
)
from memshard.core.graph import AUTOCAST, PRECISIONS
from memshard.core.mesh import Mesh
from memshard.core.placement import local_numel
from memshard.problem.buckets import bucketed, data_axes_of
from memshard.problem.pricing import build_problem
from memshard.problem.recompute import core_attention, mlp_module, op_level_replayed, replayable_ops
from memshard.problem.records import (
    DDP,
    DDP_BUCKET_VIEW,
    FSDP2,
    FSDP2_NO_RESHARD,
    FSDP2_PREFETCH,
    FSDP2_RESHARD_NODE,
    FSDP2_TORCHTITAN,
    MEGATRON,
    MEGATRON_FRAMEWORKS,
    MEGATRON_OVERLAP,
    MEMSHARD,
    TORCH_TP,
    TORCH_TP_NO_RESHARD,
    TORCH_TP_TORCHTITAN,
    OpGroup,
    Problem,
    Selection,
    StorageGroup,
    complete_selection,
    explicit_prefetch,
)
from memshard.problem.tensor_parallel import (
    FUSED_GATHER,
    GATHERS,
    tensor_parallel_dim,
    tensor_parallel_dims,
    without_fused_gathers,
)
from memshard.problem.tp_overlap import tp_overlapped


@dataclass(frozen=True)
class Baseline:
    name: str  # ``str`` of its StrategyName
    selection: Selection
    problem: Problem  # the problem it is a plan of (a finer logical mesh for TP < a node)


def megatron_tp(
    problem: Problem,
    tp_axes: int,
    sequence_parallel: bool = False,
    distributed_optimizer: bool = False,
    fsdp: bool = False,
    replayed: Callable[[int], bool] = lambda i: False,
    keep_split: bool = True,
) -> Selection:
    mesh = problem.mesh
    n = mesh.ndim
    tp = set(range(n - tp_axes, n))
    dp = tuple(a for a in range(n) if a not in tp)
    tp_dims = tensor_parallel_dims(problem.graph)

    def per_op(op):
        tp_dim = tensor_parallel_dim(op, tp_dims)
        if tp_dim is None and sequence_parallel and "s" in op.dims and op.kind not in GATHERS:
            tp_dim = "s"
        return tuple(
            None if mesh.shape[a] == 1 else (tp_dim if a in tp else ("b" if "b" in op.dims else None))
            for a in range(n)
        )

    strategies = assign_strategies(problem, per_op, replayed)
    stage = 3 if fsdp else (1 if distributed_optimizer else 0)
    selection = complete_selection(problem, strategies, uniform_storage(problem, stage, dp))
    if not (sequence_parallel and keep_split):
        return selection
    # Sequence parallelism keeps the split activations for backward and gathers them again
    # (Korthikanti et al. 2022): keep wherever the producer's layout is the smaller one.
    keeps = {}
    for e, edge in enumerate(problem.edges):
        layouts = problem.edge_layouts(selection, e)
        lp, lc = layouts.producer, layouts.consumer
        shape = edge.tensor.shape
        if layouts.replayed or problem.replayed(selection, edge.consumer):
            continue  # a replay makes the copy again, or reads it whole
        if edge.can_keep(lp, lc) and local_numel(shape, lp, mesh.shape) < local_numel(shape, lc, mesh.shape):
            keeps[e] = 1
    return complete_selection(problem, strategies, uniform_storage(problem, stage, dp), keeps)


Replayed = Callable[[int], bool]  # op index → recomputed
OP_LEVEL = "selective-op"  # torchtitan's per-op selective activation checkpointing
MLP_MODULE = "selective-mlp"  # Megatron-LM's --recompute-modules mlp (granularity selective)
ATTENTION_AND_MLP = "selective-attn-mlp"  # … --recompute-modules core_attn mlp
TORCH_RECIPE, MEGATRON_RECIPE = "torch", "megatron"  # the recipes with a recomputation policy of their own


def ddp(problem: Problem, replayed: Replayed) -> Selection:
    return data_parallel(problem, 0, replayed)


def zero(problem: Problem, stage: int, replayed: Replayed) -> Selection:
    """ZeRO-1/2/3 (3 = FSDP full shard) over all axes."""
    return data_parallel(problem, stage, replayed)


def megatron_tp_sp(problem: Problem, tp_axes: int, replayed: Replayed) -> Selection:
    return megatron_tp(problem, tp_axes, sequence_parallel=True, replayed=replayed)


def tp_fsdp(problem: Problem, tp_axes: int, replayed: Replayed) -> Selection:
    """torchtitan's 2D recipe: TP + SP on the inner axes, FSDP (ZeRO-3) on the outer ones."""
    return megatron_tp(problem, tp_axes, sequence_parallel=True, fsdp=True, replayed=replayed)


def torch_tp_fsdp2(problem: Problem, tp_axes: int, replayed: Replayed) -> Selection:
    """PyTorch's tensor parallelism with torchtitan's plan × ``fully_shard`` (on a problem
    built for ``TORCH_TP``): TP + SP on the inner axes, each block's attention and MLP input
    gathered once (the redistributions stay whole on them) and saved gathered, FSDP2 outside."""
    return megatron_tp(problem, tp_axes, sequence_parallel=True, fsdp=True, replayed=replayed, keep_split=False)


def recompute_variants(problem: Problem, recipe: str = "") -> list[tuple[str, Replayed]]:
    """(policy, which ops to recompute) of each recomputation a baseline is built with (its
    name's ``recompute``, ``names.RECOMPUTATIONS``);
    under ``auto`` also the recipe's own policy: ``torch``, torchtitan's per-op selective
    checkpointing (``+selective-op``); ``megatron``, Megatron-LM's MLP module
    (``+selective-mlp``, ``--recompute-modules mlp``), alone and with the core attention
    (``+selective-attn-mlp``, ``core_attn mlp``). On a problem whose layers are split
    (``layer_split``): full recomputation of the layers of class 0 only, policy ``full``
    (``split_baseline`` names it)."""
    graph = problem.graph
    replayable = replayable_ops(graph)
    selective = core_attention(graph) & replayable
    if len(set(graph.layer_classes)) > 1:
        return [("full", lambda i: i in replayable and graph.ops[i].layer_class == 0)]
    variants = {"none": [("none", lambda i: False)],
                "selective": [("selective", lambda i: i in selective)],
                "full": [("full", lambda i: i in replayable)]}
    if problem.recompute != "auto":
        return variants[problem.recompute]
    # (Megatron-LM's selective only where the model has core attention)
    listed = variants["none"] + (variants["selective"] if selective else []) + variants["full"]
    own = []  # the recipe's own policies, built only for that recipe
    if recipe == TORCH_RECIPE:
        own = [(OP_LEVEL, op_level_replayed(graph))]
    elif recipe == MEGATRON_RECIPE:
        mlp = mlp_module(graph)
        own = [(MLP_MODULE, mlp), (ATTENTION_AND_MLP, mlp | selective)]
    for policy, replayed in own:
        listed.append((policy, lambda i, replayed=replayed & replayable: i in replayed))
    return listed


@dataclass(frozen=True)
class LayerSplit:
    """Full recomputation of some of the layers, as a recipe picks them: ``block`` (Megatron-LM's
    ``--recompute-method block --recompute-num-layers N``: the first N layers) or ``every``
    (torchtitan's ``selective_ac_option = "N"``: the layers whose index is a multiple of N).
    Its count runs from the least memory to the most (``counts``)."""

    method: str

    def classes(self, layers: int, count: int) -> tuple[int, ...]:
        """Each layer's class: 0 recomputed, 1 not."""
        if self.method == "block":
            return tuple(0 if k < count else 1 for k in range(layers))
        return tuple(0 if k % count == 0 else 1 for k in range(layers))

    def counts(self, layers: int) -> range:
        """The counts that recompute some layers but not all, from the most recomputed."""
        return range(layers - 1, 0, -1) if self.method == "block" else range(2, layers + 1)

    def named(self, name: StrategyName, count: int) -> StrategyName:
        """``name`` with ``count`` of its layers fully recomputed this way (``+full-block<N>``,
        ``+full-every<N>``)."""
        return replace(name, recompute="full", **{self.method: count})


BLOCK, EVERY = LayerSplit("block"), LayerSplit("every")


def layer_split(name: StrategyName) -> LayerSplit | None:
    """How the recipe of baseline ``name`` recomputes some of the layers: Megatron-LM's by
    block, torchtitan's (FSDP2, PyTorch TP × FSDP2) every N-th layer; None for the others."""
    if name.kind is Kind.MEGATRON:
        return BLOCK
    if name.kind in (Kind.FSDP2, Kind.TORCH_TP):
        return EVERY
    return None


def split_baseline(problem: Problem, name: str, count: int) -> Baseline | None:
    """Baseline ``name`` with ``count`` of its layers fully recomputed as its recipe picks them
    (``layer_split``), on ``problem`` (recomputation ``auto``) with its layers split in two
    classes, each sharing its own variables; None where the baseline does not fit."""
    named = parse_strategy(name)
    split = layer_split(named)
    graph = problem.graph
    if split is None or problem.recompute != "auto" or count not in split.counts(graph.num_layers):
        return None
    classes = split.classes(graph.num_layers, count)
    on = build_problem(graph.with_layer_classes(classes), problem.mesh, problem.shared_layers,
                       problem.micro_batches, problem.zero3_unit, problem.recompute, split_framework(named, problem),
                       problem.stage)
    full = str(replace(named, recompute="full"))
    found, _ = baselines(on, lambda n: n == full)
    return next((replace(b, name=str(split.named(named, count))) for b in found), None)


def split_framework(name: StrategyName, problem: Problem) -> str:
    """The framework a layer split of recipe ``name`` on ``problem`` is built for: the one
    ``baselines`` prices the recipe as run by, Megatron-LM's or a PyTorch ``fully_shard``'s,
    where that problem built straight from memshard's graph is the one ``as_run_by`` would
    build from memshard's problem (one build, not two); else ``problem``'s own. (Not TP ×
    FSDP2: its finer layouts are built from the problem's graph; nor under autocast, which
    refuses some recipes by the graph's precision.)"""
    if problem.framework != MEMSHARD or problem.graph.precision == AUTOCAST:
        return problem.framework
    if name.kind is Kind.MEGATRON:
        return MEGATRON  # (its -overlap twin relabels Megatron-LM's problem)
    if name.kind is Kind.FSDP2:
        return next((framework for listed, framework in fully_sharded(problem.mesh) if listed == name),
                    problem.framework)
    return problem.framework


def priced_as_run(problem: Problem, selection: Selection, name: StrategyName) -> Problem:
    """``problem`` priced for baseline ``name``'s plan ``selection`` as its framework runs its
    collectives: the data-parallel ones per bucket (DDP's, Megatron-LM's: ``problem.buckets``),
    its data-parallel axes those outside its tensor parallelism; with ``-tpoverlap`` the layer
    linears' TP collectives beside their GEMMs (``problem.tp_overlap``)."""
    data_axes = data_axes_of(problem.mesh.shape, name.tensor_parallel)
    problem = bucketed(problem, selection, data_axes)
    if name.tp_overlap:
        problem = tp_overlapped(problem, selection, tuple(a for a in range(problem.mesh.ndim) if a not in data_axes))
    return problem


def split_innermost(mesh: Mesh, tp: int) -> Mesh:
    """The same devices with the innermost axis (a node) viewed as (m/tp) × tp, both parts
    with the node's links: how Megatron runs TP < GPUs per node."""
    inner = mesh.axes[-1]
    parts = (replace(inner, name=f"{inner.name}-dp", size=inner.size // tp), replace(inner, name=f"{inner.name}-tp", size=tp))
    return replace(mesh, axes=mesh.axes[:-1] + parts)


def as_run_by(problem: Problem, framework: str) -> Problem:
    """``problem`` priced as ``framework`` (``problem.FRAMEWORKS``) runs its plans."""
    if problem.framework == framework:
        return problem
    if {problem.framework, framework} == set(MEGATRON_FRAMEWORKS):  # the same problem, overlapped or not
        return replace(problem, framework=framework)
    graph = problem.graph
    if problem.framework in MEGATRON_FRAMEWORKS:  # its fp32 gradient buffer is Megatron-LM's, not the job's
        graph = replace(graph, precision=PRECISIONS[graph.precision.name])
    return build_problem(graph, problem.mesh, problem.shared_layers, problem.micro_batches,
                         problem.zero3_unit, problem.recompute, framework, problem.stage)


def run_by_memshard(problem: Problem, selection: Selection) -> tuple[Problem, Selection]:
    """A Megatron-LM baseline's ``selection`` of ``problem`` as memshard's runtime runs it: its
    graph without the fused GEMMs' gathers (``tensor_parallel.without_fused_gathers``: the
    runtime runs each projection on its own), each op's strategy and each parameter's storage
    as chosen, a projection keeping its input where its gather kept its own."""
    old_graph = problem.graph
    run = as_run_by(replace(problem, graph=without_fused_gathers(old_graph)), MEMSHARD)
    group_of = {op.name: problem.op_group[i] for i, op in enumerate(old_graph.ops)}
    kept = {(old_graph.ops[i].name, j): selection.keeps[e] for (i, j), e in problem.edge_of_input.items()}
    for op in old_graph.ops:
        if op.kind == FUSED_GATHER:
            for reader, j in old_graph.consumers[op.output.tensor]:
                kept[(old_graph.ops[reader].name, j)] = kept[(op.name, 0)]
    storage_of = {grp.key: g for g, grp in enumerate(problem.groups) if isinstance(grp, StorageGroup)}
    strategies, storage = {}, {}
    for g, grp in enumerate(run.groups):
        if isinstance(grp, OpGroup):
            old = group_of[run.graph.ops[grp.ops[0]].name]
            label = problem.groups[old].choices[selection.choices[old]].label
            strategies[g] = [c.label for c in grp.choices].index(label)
        else:
            old = storage_of[grp.key]
            storage[g] = problem.groups[old].options[selection.choices[old]][1]
    keeps = {e: kept[(run.graph.ops[i].name, j)] for (i, j), e in run.edge_of_input.items()}
    return run, complete_selection(run, strategies, storage, keeps)


def baselines(problem: Problem, wanted: Callable[[str], bool] | None = None
              ) -> tuple[list[Baseline], list[tuple[str, str]]]:
    """Every baseline that fits the model and mesh, and (name, reason) for those that don't;
    with ``wanted``, only the names it accepts (the problems the others need are not built).

    Tensor parallelism takes every degree that divides the node (the innermost axis), then
    whole nodes and more (the innermost axes); data parallelism takes the rest."""
    out, skipped, bases = [], [], []
    mesh = problem.mesh
    policies = {recipe: [policy for policy, _ in recompute_variants(problem, recipe)]
                for recipe in ("", TORCH_RECIPE, MEGATRON_RECIPE)}

    def add(base: StrategyName, make, on: Callable[[], Problem] = lambda: problem,
            recipe: str = "", asked_only: bool = False):
        """(``asked_only``: built only where ``wanted`` asks for it by name)"""
        bases.append(base)
        named = [replace(base, recompute=policy) for policy in policies[recipe]]
        names = [(str(name), name) for name in named]
        names = [(text, name) for text, name in names if (not asked_only if wanted is None else wanted(text))]
        if problem.graph.precision == AUTOCAST:
            refused = [(text, why) for text, name in names
                       if (why := unpriced_under_autocast(name, recipe))]
            skipped.extend(refused)
            names = [(text, name) for text, name in names if text not in dict(refused)]
        if names:
            on = on()
            replayed_by = dict(recompute_variants(on, recipe))  # its own op indices (torch-tp adds ops)
        for full_name, name in names:
            try:
                selection = make(on, replayed_by[name.recompute])
            except SplitUnavailable as e:
                skipped.append((full_name, str(e)))
                continue
            clash = next((c.why for c in on.conflicts
                          if selection.choices[c.a] in c.a_choices and selection.choices[c.b] in c.b_choices), None)
            if clash is not None:
                skipped.append((full_name, f"{clash}; recompute with ZeRO-3 gathered per layer (--zero3-unit layer)"))
            else:
                out.append(Baseline(full_name, selection, priced_as_run(on, selection, name)))

    add(StrategyName(Kind.DP), ddp)
    # torchtitan's per-op policy where no activation collective runs in a block (with tensor
    # parallelism it saves reduce-scatters' outputs, a reshard's result the model does not keep)
    add(StrategyName(Kind.DDP), ddp, lambda: as_run_by(problem, DDP), recipe=TORCH_RECIPE)
    add(StrategyName(Kind.DDP, bucket_view=True), ddp, lambda: as_run_by(problem, DDP_BUCKET_VIEW),
        recipe=TORCH_RECIPE)
    for stage in (1, 2, 3):
        add(StrategyName(Kind.ZERO, zero_stage=stage), lambda p, r, s=stage: zero(p, s, r))
    for name, framework in fully_sharded(mesh):
        add(name, lambda p, r: zero(p, 3, r), lambda f=framework: as_run_by(problem, f),
            recipe=TORCH_RECIPE)
    add_tensor_parallel(problem, add)
    if wanted is not None:  # the layer splits asked for by name (``compare`` finds its own)
        layers = problem.graph.num_layers
        for base in bases:
            split = layer_split(base)
            for count in split.counts(layers) if split and problem.recompute == "auto" else ():
                named = str(split.named(base, count))
                if wanted(named) and (b := split_baseline(problem, str(base), count)):
                    out.append(b)
    return out, skipped


def fully_sharded(mesh: Mesh) -> list[tuple[StrategyName, str]]:
    """(name, framework) of each PyTorch ``fully_shard`` baseline on ``mesh``: its defaults, not
    resharded after forward, prefetching explicitly, torchtitan's units, and resharded within a
    node after forward where the mesh has more than one node."""
    fsdp2 = StrategyName(Kind.FSDP2)
    listed = [(fsdp2, FSDP2), (replace(fsdp2, reshard_after_forward=False), FSDP2_NO_RESHARD),
              (replace(fsdp2, prefetch=explicit_prefetch(FSDP2_PREFETCH)), FSDP2_PREFETCH),
              (replace(fsdp2, torchtitan_units=True), FSDP2_TORCHTITAN)]
    if 1 < mesh.shape[-1] < mesh.num_devices:
        listed.append((replace(fsdp2, reshard_after_forward=mesh.shape[-1]), FSDP2_RESHARD_NODE))
    return listed


def torch_tensor_parallel(tp: int, dp: int) -> list[tuple[StrategyName, str]]:
    """(name, framework) of each PyTorch ``parallelize_module`` × ``fully_shard`` baseline of
    degrees ``tp`` × ``dp``: its defaults, not resharded after forward, torchtitan's units."""
    torch_tp = StrategyName(Kind.TORCH_TP, tensor_parallel=tp, data_parallel=dp)
    return [(torch_tp, TORCH_TP),
            (replace(torch_tp, reshard_after_forward=False), TORCH_TP_NO_RESHARD),
            (replace(torch_tp, torchtitan_units=True), TORCH_TP_TORCHTITAN)]


def unpriced_under_autocast(name: StrategyName, recipe: str) -> str | None:
    """Why baseline ``name`` is not offered under ``torch.autocast``, if it is not: PyTorch's
    implementations are offered where checked against PyTorch under autocast (DDP, FSDP2, with
    full checkpointing); Megatron-LM does not train under it."""
    if recipe == MEGATRON_RECIPE:
        return "Megatron-LM trains bf16 in its own layout (--precision mixed), not under torch.autocast"
    if name.kind is Kind.TORCH_TP:
        return "not checked against PyTorch under torch.autocast (--precision mixed or fp32 are)"
    if name.recompute == OP_LEVEL or name.reshard_after_forward is False:
        return ("under torch.autocast PyTorch keeps its weights' bf16 copies otherwise than memshard prices them "
                "(measured 4–9% off; --precision mixed or fp32 are checked)")
    return None


def add_tensor_parallel(problem: Problem, add: Callable) -> None:
    """Give ``add`` (``baselines``' own) every Megatron-LM layout, without tensor parallelism
    too (its data parallelism, its gradient buffer), and the TP × FSDP recipes. The layouts on
    ``problem``'s own mesh (TP 1, whole inner axes) share one problem priced as Megatron-LM runs
    it, built once."""
    as_megatron_of: dict[Callable[[], Problem], Callable[[], Problem]] = {}  # a layout's problem → as Megatron-LM's
    for on, k, tp in tensor_parallel_layouts(problem):
        dp = problem.mesh.num_devices // tp
        megatron = StrategyName(Kind.MEGATRON, tensor_parallel=tp,
                                data_parallel=dp if dp > 1 else None)
        as_megatron = as_megatron_of.setdefault(on, functools.cache(lambda on=on: as_run_by(on(), MEGATRON)))
        add(megatron, lambda p, r, k=k: megatron_tp(p, k, replayed=r), as_megatron, MEGATRON_RECIPE)
        # each sequence-parallel layout also with --tp-comm-overlap, where asked for by name
        tp_overlaps = (False, True) if tp > 1 else (False,)
        if tp > 1:
            for tp_overlap in tp_overlaps:
                add(replace(megatron, sequence_parallel=True, tp_overlap=tp_overlap),
                    lambda p, r, k=k: megatron_tp_sp(p, k, r), as_megatron, MEGATRON_RECIPE, tp_overlap)
        if dp > 1:
            distopt = replace(megatron, sequence_parallel=tp > 1, distributed_optimizer=True)

            def sharded_optimizer(p, r, k=k, sp=tp > 1):
                return megatron_tp(p, k, sequence_parallel=sp, distributed_optimizer=True, replayed=r)
            overlapped = functools.cache(lambda megatron=as_megatron: as_run_by(megatron(), MEGATRON_OVERLAP))
            for tp_overlap in tp_overlaps:
                add(replace(distopt, tp_overlap=tp_overlap), sharded_optimizer, as_megatron, MEGATRON_RECIPE,
                    tp_overlap)
                add(replace(distopt, overlap=True, tp_overlap=tp_overlap), sharded_optimizer,  # (relabelled)
                    overlapped, MEGATRON_RECIPE, tp_overlap)
        if dp > 1 and tp > 1:
            add(StrategyName(Kind.TP_FSDP, tensor_parallel=tp, data_parallel=dp),
                lambda p, r, k=k: tp_fsdp(p, k, r), on)
            for name, framework in torch_tensor_parallel(tp, dp):
                add(name, lambda p, r, k=k: torch_tp_fsdp2(p, k, r),
                    lambda on=on, f=framework: as_run_by(on(), f))


def tensor_parallel_layouts(problem: Problem) -> list[tuple[Callable[[], Problem], int, int]]:
    """(the problem it is laid out on, built once when first asked for; tensor-parallel mesh
    axes; degree) of every tensor-parallel degree: 1 (none) where the mesh has more than one
    device, those dividing the node on a finer view of it, then whole inner axes (those on
    ``problem``'s own mesh give the same callable)."""
    def itself() -> Problem:
        return problem

    mesh = problem.mesh
    layouts = [(itself, 0, 1)] * (mesh.num_devices > 1)
    node = mesh.shape[-1]
    for tp in range(2, node):
        if node % tp == 0:
            finer = functools.cache(lambda tp=tp: build_problem(
                problem.graph, split_innermost(mesh, tp), problem.shared_layers, problem.micro_batches,
                problem.zero3_unit, problem.recompute, problem.framework, problem.stage))
            layouts.append((finer, 1, tp))
    for k in range(1, mesh.ndim + 1):
        tp = math.prod(mesh.shape[mesh.ndim - k:])
        if tp > 1 and (k == 1 or mesh.shape[mesh.ndim - k] > 1):
            layouts.append((itself, k, tp))
    return layouts
