"""ZeRO-3 gather units: when the weights gathered a layer at a time (``zero3_unit="layer"``,
FSDP's unit) or by PyTorch's ``fully_shard`` are held, and where their gradients are reduced
(``pipelined_units``: as torch.distributed.pipelining runs ``fully_shard`` in a pipeline
stage); and where a weight gathered per op is held (``gather_points``). ``pricing`` prices the
units' memory and collectives; the runtime gathers by the same units."""

from __future__ import annotations

from dataclasses import dataclass, replace

from memshard.core.graph import Graph
from memshard.problem.recompute import layer_ends
from memshard.problem.schedule import Schedule
from memshard.problem.strategies import activation_inputs, parameter_inputs

# Ops whose backward does not read their weight (a lookup's gradient is a scatter of the
# output gradient): under ZeRO-3 their weight is gathered for forward only.
NO_WEIGHT_IN_BACKWARD = frozenset({"embedding", "embedding_add"})


def gather_points(S: Schedule, graph: Graph, i: int) -> tuple[int, ...]:
    """The schedule points where ZeRO-3 holds op ``i``'s gathered weight: backward needs it
    only for the gradient of an activation input (a first layer on the raw input has none)."""
    op = graph.ops[i]
    if op.kind in NO_WEIGHT_IN_BACKWARD or not activation_inputs(graph, op):
        return (S.forward(i),)
    return (S.forward(i), S.backward(i))


@dataclass(frozen=True)
class LayerUnit:
    """The schedule of one layer's ZeRO-3 weights gathered as one unit (``zero3_unit="layer"``).

    Members are the parameters whose every use is an op of the layer. The gathered weights
    are held from the forward of the first op using a member to that of the last; again in
    backward from the backward of the last op that reads a member to that of the first; the
    members' gradients wait unsharded until the first op's backward, are copied into one flat
    buffer there and reduce-scattered together (at that op's gradient reshard point). The
    members are all ZeRO-3 alike or none is (``link_layer_units``): the runtime
    gathers the members it holds from the first use of one to the last, so a unit of only
    some of them would span less than priced."""

    forward_span: tuple[int, int]
    backward_span: tuple[int, int] | None
    reduce_point: int
    members: int
    # FSDP2 only (``fsdp2_units``): where its flat all-gather output is held besides the
    # gathered weights, in forward and in backward, and its flat reduce-scatter input after
    # the reduce point.
    forward_buffer: tuple[int, int] | None = None
    backward_buffer: tuple[int, int] | None = None
    scatter_buffer: tuple[int, int] | None = None
    root: bool = False  # FSDP2's root unit: its members' layouts need not agree
    # FSDP2 with ``reshard_after_forward`` = a group size: the shard of the gathered weights
    # over that group kept from the layer's post-forward to its backward copy-out
    post_forward: tuple[int, int] | None = None
    post_forward_group: int = 0
    # FSDP2 in a stage of torch.distributed.pipelining (``pipelined_units``): the gradients
    # accumulate unsharded over the step's micro-batches, from ``accumulated_from``, until
    # the reduce point, the step's end, where every unit's are reduce-scattered at once
    pipelined: bool = False
    accumulated_from: int | None = None  # None: from each weight's first gradient


def layer_units(graph: Graph, S: Schedule, recompute: str = "none") -> dict[str, LayerUnit]:
    """Parameter name → its layer's unit, for the parameters all of whose uses are in one
    layer. Where the layer may replay ops (``recompute``), its backward gather starts with the
    layer's backward, before the replay that needs the weights (FSDP2 gathers there too)."""
    ends = layer_ends(graph) if recompute != "none" else {}
    uses: dict[str, set[int]] = {}
    for i, op in enumerate(graph.ops):
        for j in parameter_inputs(graph, op):
            uses.setdefault(op.inputs[j].tensor, set()).add(i)
    members: dict[int, list[str]] = {}
    for name, ops_ in uses.items():
        layers = {graph.ops[i].layer for i in ops_}
        if len(layers) == 1 and None not in layers:
            members.setdefault(layers.pop(), []).append(name)
    units = {}
    for names in members.values():
        ops_ = sorted(set().union(*(uses[n] for n in names)))
        back = [i for i in ops_ if len(gather_points(S, graph, i)) > 1]
        layer = graph.ops[ops_[0]].layer
        back_from = S.backward_begins(ends[layer]) if layer in ends else S.backward(back[-1]) if back else None
        unit = LayerUnit(
            forward_span=(S.forward(ops_[0]), S.forward(ops_[-1])),
            backward_span=(back_from, S.backward(back[0])) if back else None,
            reduce_point=S.reshard_out(ops_[0]),
            members=len(names),
        )
        units.update(dict.fromkeys(names, unit))
    return units


def fsdp2_units(graph: Graph, S: Schedule, recompute: str = "none", reshard_after_forward: bool = True,
                prefetch: int = 0, wrap_ends: bool = False, post_forward_group: int = 0) -> dict[str, LayerUnit]:
    """PyTorch's ``fully_shard`` applied to every layer, then to the root module, with its
    defaults (torch 2.13, ``_fully_shard/_fsdp_param_group.py``): the layer units of
    :func:`layer_units` and a root unit of every other weight, with what FSDP2 holds besides.

    - A layer unit is gathered by its module's hooks: from before the layer's first op in
      forward and before its last op's backward (its pre-backward), not at the first op
      that reads a weight.
    - The root is not resharded after forward: its weights are gathered from its first use
      to the end of backward, its gradients wait unsharded until then (its post-backward
      runs last).
    - Forward: a unit's flat all-gather output is kept (``all_gather_state``) until the next
      unit's copy-out; the last one until the root's post-forward (the end of forward).
    - Backward: each unit's pre-backward, after its own copy-out, prefetches the previous
      layer's all-gather (the root's prefetches the last layer's), held until that layer's
      copy-out.
    - A unit's flat reduce-scatter input is kept (``reduce_scatter_states``) until the next
      unit's post-backward; the first layer's until the root's.
    - ``reshard_after_forward=False`` (given to every layer's ``fully_shard``): a layer's
      weights stay gathered from its forward to its post-backward, gathered once a step, and
      no backward prefetch is needed.
    - ``prefetch`` = N > 0: explicit prefetching as PyTorch's FSDP2 example sets it, each
      layer's ``set_modules_to_forward_prefetch`` the next N layers and, from layer N on,
      ``set_modules_to_backward_prefetch`` the N before it. A layer's pre-forward, after its
      own copy-out, issues the next N layers' all-gathers: each flat output is held from the
      first of those pre-forwards. In backward a layer is prefetched by the earliest of its
      prefetchers: layer min(k + N, L − 1) where that one has an explicit list, else (layers
      below N keep FSDP2's default) the layer after it; the last layer by the root.
    - ``wrap_ends``: the modules before the first layer and those after the last are units of
      their own, as torchtitan wraps a decoder (``_end_units``); the root keeps the rest.
    - ``post_forward_group`` = N (``reshard_after_forward=N``): a layer's post-forward keeps a
      clone of its gathered weights' 1/N shard (made before the gathered copy is freed) until
      its pre-backward's copy-out, which frees it before the layer's first backward op (the
      all-gather over the N devices read it)."""
    layers = layer_units(graph, S, recompute)
    ordered = sorted({id(u): u for u in layers.values()}.values(), key=lambda u: u.forward_span[0])
    first_op, last_op = {}, {}
    for i, op in enumerate(graph.ops):
        first_op.setdefault(op.layer, i)
        last_op[op.layer] = i
    of_layer = [graph.ops[(u.forward_span[0] - 1) // 2].layer for u in ordered]
    pre_forward = [S.reshard_in(first_op[k]) for k in of_layer]
    pre_backward = [S.backward_begins(last_op[k]) for k in of_layer]
    root_names = [n for n in graph.parameters if n not in layers and graph.consumers.get(n)]
    embedding, head = (_end_units(graph, S, root_names, (first_op[of_layer[0]], last_op[of_layer[-1]]), pre_backward[0])
                       if wrap_ends and ordered else (None, None))
    root_names = [n for n in root_names if not any(n in end.names for end in (embedding, head) if end)]
    first_use = min((i for n in root_names for i, _ in graph.consumers[n]), default=0)
    end, n = S.reshard_out(0), len(graph.ops)
    root = LayerUnit((S.forward(first_use), end), None, end, len(root_names), root=True,
                     forward_buffer=(S.forward(first_use), (embedding.unit.forward_span[0] if embedding else
                                                           pre_forward[0] if ordered else end)))
    units = dict.fromkeys(root_names, root)
    below = root  # the unit below the first layer, whose reduce-scatter follows the first layer's
    if embedding:
        below = replace(embedding.unit, scatter_buffer=(embedding.unit.reduce_point + 1, root.reduce_point - 1))
        units.update(dict.fromkeys(embedding.names, below))
    last = len(ordered) - 1
    for k, unit in enumerate(ordered):
        later = k + 1 < len(ordered)  # a next unit in forward
        backward_span = (pre_backward[k], unit.backward_span[1]) if unit.backward_span else None
        forward_span = (pre_forward[k], unit.forward_span[1])
        if not reshard_after_forward:
            forward_span, backward_span = (pre_forward[k], backward_span[1] if backward_span else unit.reduce_point), None
        fsdp = replace(
            unit, forward_span=forward_span, backward_span=backward_span,
            forward_buffer=(pre_forward[max(k - prefetch, 0)], pre_forward[k + 1] if later else
                            head.unit.forward_span[0] if head else S.forward(n - 1)),
            backward_buffer=((pre_backward[_backward_prefetcher(k, last, prefetch)] + 1 if later else
                              head.pre_backward + 1 if head else S.backward(n - 1), pre_backward[k])
                             if backward_span else None),
            scatter_buffer=(unit.reduce_point + 1, (ordered[k - 1] if k else below).reduce_point - 1),
            post_forward=(forward_span[1], pre_backward[k] - 1) if post_forward_group and backward_span else None,
            post_forward_group=post_forward_group)
        units.update((name, fsdp) for name, u in layers.items() if u is unit)
    if head:
        units.update(dict.fromkeys(head.names, replace(
            head.unit, scatter_buffer=(head.unit.reduce_point + 1, ordered[-1].reduce_point - 1))))
    return units


@dataclass(frozen=True)
class EndUnit:
    """The unit of the modules before the first layer or after the last (``_end_units``)."""

    names: tuple[str, ...]
    unit: LayerUnit
    pre_backward: int


def end_weights(graph: Graph, names: list[str] | None = None, layer_ops: tuple[int, int] | None = None
                ) -> tuple[tuple[str, ...] | None, tuple[str, ...]]:
    """Of the weights ``names`` (default: those no layer owns alone), those used only before
    the first layer's first op and those used only after the last layer's last op
    (``layer_ops``, default the graph's); (None, ()) where one is used on both sides or
    among the layers (tied embeddings)."""
    layer_of = [i for i, op in enumerate(graph.ops) if op.layer is not None]
    layer_ops = layer_ops or ((layer_of[0], layer_of[-1]) if layer_of else (0, -1))
    if names is None:
        owners = {name: {graph.ops[i].layer for i, _ in graph.consumers.get(name, ())} for name in graph.parameters}
        names = [n for n, layers in owners.items() if layers and (None in layers or len(layers) > 1)]
    uses = {name: sorted(i for i, _ in graph.consumers[name]) for name in names}
    before = tuple(name for name in names if uses[name][-1] < layer_ops[0])
    after = tuple(name for name in names if uses[name][0] > layer_ops[1])
    return (before, after) if len(before) + len(after) == len(names) else (None, ())


def _end_units(graph: Graph, S: Schedule, names: list[str], layer_ops: tuple[int, int], first_layer_back: int
               ) -> tuple[EndUnit | None, EndUnit | None]:
    """torchtitan's units at the ends of a decoder (``apply_fsdp``): ``fully_shard`` of the
    modules whose weights are used only before the first layer (the token embedding),
    resharded after forward and gathered again at its pre-backward (FSDP2 gathers there though
    a lookup's backward does not read its weight) after the first layer's pre-backward
    prefetched it; and of those used only after the last (final norm and output layer) with
    ``reshard_after_forward=False``: gathered from its pre-forward to its post-backward, early
    in backward, where its gradients are reduced. Where a weight is used on both sides (tied
    embeddings) torchtitan puts all of them in one unit that is not resharded after forward,
    gathered and reduced as the root's are: no end units. ``layer_ops``: the first layer's
    first op and the last layer's last."""
    uses = {name: sorted(i for i, _ in graph.consumers[name]) for name in names}
    before, after = end_weights(graph, names, layer_ops)
    if before is None:
        return None, None
    ends = []
    for members, resharded in ((before, True), (after, False)):
        ops = sorted({i for name in members for i in uses[name]})
        if not ops:
            ends.append(None)
            continue
        pre_forward, pre_backward, reduce_point = S.reshard_in(ops[0]), S.backward_begins(ops[-1]), S.reshard_out(ops[0])
        unit = LayerUnit(
            forward_span=(pre_forward, S.forward(ops[-1]) if resharded else S.backward(ops[0])),
            backward_span=(pre_backward, S.backward(ops[0])) if resharded else None,
            reduce_point=reduce_point, members=len(members),
            forward_buffer=(pre_forward, S.reshard_in(layer_ops[0]) if resharded else S.forward(len(graph.ops) - 1)),
            backward_buffer=(first_layer_back + 1, pre_backward) if resharded else None)
        ends.append(EndUnit(members, unit, pre_backward))
    return ends[0], ends[1]


def _backward_prefetcher(k: int, last: int, prefetch: int) -> int:
    """The layer whose pre-backward first prefetches layer ``k`` < ``last`` (``fsdp2_units``):
    FSDP2's default is the layer after it; with ``prefetch`` = N the furthest one whose
    explicit list (layers N…) reaches it."""
    furthest = min(k + prefetch, last)
    return furthest if prefetch and furthest >= prefetch else k + 1


def pipelined_units(units: dict[str, LayerUnit], graph: Graph, S: Schedule, micro_batches: int,
                    forwards_first: bool) -> dict[str, LayerUnit]:
    """``fsdp2_units`` as torch.distributed.pipelining runs a stage module wrapped by
    ``fully_shard`` (torch 2.13, ``stage.py``): every micro-batch's backward runs with
    ``set_requires_gradient_sync(False)`` and ``set_reshard_after_backward(False)``, and the
    schedule's last action (``perform_reduce_grad``) runs every unit's post-backward at once.

    - Gradients accumulate unsharded in each parameter's ``.grad`` over the micro-batches,
      reduce-scattered once, at the step's end (the reduce point of every unit: the last
      backward point); a rank that runs a micro-batch's backward after another's holds them
      from the start (``accumulated_from``), one running every forward first (GPipe) from its
      first backward.
    - A unit's weights gathered in backward stay gathered until the step's end. Not resharded
      after forward (torchtitan's default under a pipeline), they stay from the first
      forward: with several micro-batches every point of one but the first forward's holds
      them, and no forward gathers (no flat all-gather buffer). Resharded after forward, a
      forward frees them at its end, so its unit holds them from the previous backward
      (every point up to its forward's end, unless every forward runs first) and again from
      its backward's gather on.
    - The flat reduce-scatter input replaces, unit by unit, the gradients it copies: no
      buffer of its own at the step's end.
    - The last stage's loss runs outside its module (the schedule's ``loss_fn``): the root's
      pre-backward, which prefetches the last layer's weights, runs at the backward of the
      module's output (the logits), after the loss's."""
    steady = micro_batches > 1
    end = S.reshard_out(0)
    n = len(graph.ops)
    if graph.received and not graph.sent:  # the last stage: its module ends at what the loss reads
        output = graph.producer[graph.ops[graph.producer[graph.loss]].inputs[0].tensor]
    else:
        output = n - 1
    accumulated_from = 0 if steady and not forwards_first else None
    out: dict[int, LayerUnit] = {}
    for unit in {id(u): u for u in units.values()}.values():
        start, forward_end = unit.forward_span
        kept = unit.backward_span is None  # not resharded after forward (the root neither)
        held_from = 0 if steady and (kept or not forwards_first) else start
        prefetched = unit.backward_buffer
        if prefetched is not None and prefetched[0] == S.backward(n - 1):  # by the root's pre-backward
            prefetched = (S.backward(output), prefetched[1])
        out[id(unit)] = replace(
            unit, forward_span=(held_from, end if kept else forward_end),
            backward_span=None if kept else (unit.backward_span[0], end),
            forward_buffer=None if held_from == 0 else unit.forward_buffer, backward_buffer=prefetched,
            scatter_buffer=None, reduce_point=end, pipelined=True,
            accumulated_from=accumulated_from)
    return {name: out[id(u)] for name, u in units.items()}
