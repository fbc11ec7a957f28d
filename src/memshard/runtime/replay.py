"""Activation recomputation in the executor: a plan's replayed ops run their forward again
when backward reaches their layer (``memshard.problem.recompute`` says what the model prices).

Forward: a replayed op's kernel runs under saved-tensor hooks that keep, instead of what it
saves, a ticket for the tensor the replay will make (its output, a dropout mask, an input that
a replayed producer makes again); the saved inputs it reads from ops that are not replayed
are kept as they are. An op that is not replayed but saves an input a replayed producer
makes gets a ticket for that input too. Whatever a replay will read from an op that is not
replayed is held from the forward until the replay: the op's own saved copy, or the
producer's tensor (``problem.SOURCE``).

Backward: a hook on the gradient of the layer's last output replays the layer's replayed ops
in forward order, before any backward op of the layer runs, with the same kernels, inputs
resharded again where the forward resharded them, and the same dropout masks (a function of
the op and the step). Each ticket's tensor is handed to the backward op that unpacks it and
dropped by the replay then; what no ticket needs is freed as the replay goes.

Why not ``torch.utils.checkpoint``: the executor already saves some tensors through its own
saved-tensor hooks (ZeRO-3 weights gathered again, sequence-parallel copies gathered again),
and PyTorch calls only the innermost pair of hooks, so a checkpoint around a layer would
not see the tensors those kernels save; a selective policy also picks ops by ATen function,
while the plan picks memshard's ops (a role in every layer) and prices the replay's
reshards, which a region checkpoint would re-run or not depending on where it is drawn.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from memshard.core.graph import Graph, TensorKind
from memshard.problem.recompute import layer_ends


def storage_id(t: torch.Tensor) -> int:
    """Identity of a tensor's storage, shared by its views (works for fake tensors too)."""
    return t.untyped_storage()._cdata


@dataclass
class _Ticket:
    """A saved tensor the replay makes: unpacked once, by the backward op that saved it."""

    replay: LayerReplay
    key: tuple
    size: torch.Size
    stride: tuple[int, ...]
    offset: int

    def __call__(self) -> torch.Tensor:
        return self.replay.hand_out(self.key).as_strided(self.size, self.stride, self.offset)


@dataclass
class ReplayLinks:
    """What the replay needs from the executor: the kernel table and each op's context, a
    model input in an op's layout, a weight for one replayed use (and how to let it go), an
    activation resharded from its producer's layout to an op's, and the layouts."""

    kernel: Callable[[int], Callable]
    context: Callable[[int], object]
    model_input: Callable[[int, int], torch.Tensor]
    weight: Callable[[int, int], tuple[torch.Tensor, Callable[[], None] | None]]
    reshard: Callable[[int, int, torch.Tensor], torch.Tensor]
    same_layout: Callable[[int, int], bool]
    # A layer's ZeRO-3 unit, gathered for its backward when the replay runs (returns how to
    # let it go), and the layers that have one.
    layer_hold: Callable[[int], Callable[[], None]] = lambda layer: lambda: None
    unit_layers: frozenset[int] = frozenset()


@dataclass
class LayerReplay:
    """One forward pass's recomputation (one micro-batch)."""

    graph: Graph
    replayed: list[bool]
    links: ReplayLinks
    sources: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    requires_grad: dict[tuple[int, int], bool] = field(default_factory=dict)
    wanted: dict[tuple, None] = field(default_factory=dict)  # ticket keys still to make
    made: dict[tuple, torch.Tensor] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.ends = layer_ends(self.graph)
        self.layer_ops: dict[int, tuple[int, ...]] = {}
        for k, op in enumerate(self.graph.ops):
            if op.layer is not None:
                self.layer_ops[op.layer] = (*self.layer_ops.get(op.layer, ()), k)

    # -- forward -----------------------------------------------------------------------------
    def record(self, i: int, j: int, produced: torch.Tensor | None, fed: torch.Tensor) -> None:
        """Op ``i``'s input ``j`` as the forward gave it (``produced``: the producer's tensor,
        None for a model input or weight): keep what its replay will read."""
        self.requires_grad[(i, j)] = fed.requires_grad
        op = self.graph.ops[i]
        if produced is None or not self.replayed[i]:
            return
        if self.replayed[self.graph.producer[op.inputs[j].tensor]]:
            return
        # Held until the replay: the op's own saved copy, or the producer's tensor.
        self.sources[(i, j)] = (fed if j in op.saves_inputs else produced).detach()

    def hooks(self, i: int, args: list[torch.Tensor], again: dict[int, Callable]):
        """The saved-tensor hooks op ``i``'s kernel runs under (None: none needed)."""
        op, graph = self.graph.ops[i], self.graph
        tickets: dict[int, tuple] = {}
        kept: set[int] = set()
        for j, operand in enumerate(op.inputs):
            spec = graph.tensors[operand.tensor]
            if spec.kind is not TensorKind.ACTIVATION:
                kept.add(storage_id(args[j]))
                continue
            from_replay = self.replayed[graph.producer[operand.tensor]]
            if from_replay and not self.replayed[i] and j in op.saves_inputs:
                tickets[storage_id(args[j])] = ("input", i, j)
            elif not from_replay:
                kept.add(storage_id(args[j]))
        if not (again or tickets or self.replayed[i]):
            return None
        position = [0]

        def pack(t: torch.Tensor):
            m = position[0]
            position[0] += 1
            packed = pack_again(again, t)
            if packed is not None:
                return packed
            sid = storage_id(t)
            key = tickets.get(sid) or (("saved", i, m) if self.replayed[i] and sid not in kept else None)
            if key is None:
                return t
            self.wanted[key] = None
            return _Ticket(self, key, t.size(), t.stride(), t.storage_offset())

        return pack, unpack_saved

    def produced(self, i: int, out: torch.Tensor) -> None:
        """After op ``i``'s forward: at the last op of a layer that replays, the replay waits
        for the gradient of its output."""
        layer = self.graph.ops[i].layer
        if layer is None or self.ends[layer] != i or not out.requires_grad:
            return
        ops = self.layer_ops[layer]
        if any(self.replayed[k] for k in ops) or layer in self.links.unit_layers:
            out.register_hook(lambda grad: self.run(ops))

    # -- backward ----------------------------------------------------------------------------
    def hand_out(self, key: tuple) -> torch.Tensor:
        return self.made.pop(key)

    def run(self, layer_ops: tuple[int, ...]) -> None:
        """Replay the layer's replayed ops, making every ticket of the layer."""
        layer = self.graph.ops[layer_ops[0]].layer
        if layer in self.done:
            return
        self.done.add(layer)
        release = self.links.layer_hold(layer) if layer in self.links.unit_layers else None
        graph = self.graph
        ops = [i for i in layer_ops if self.replayed[i]]
        readers: dict[int, int] = {}  # replayed op → replayed ops still to read its output
        for i in ops:
            for operand in graph.ops[i].inputs:
                p = graph.producer.get(operand.tensor)
                if p is not None and self.replayed[p]:
                    readers[p] = readers.get(p, 0) + 1
        outs: dict[int, torch.Tensor] = {}
        with torch.enable_grad():
            for i in ops:
                outs[i] = self.replay_op(i, outs)
                self.make_inputs(i, outs[i])
                if not readers.get(i):
                    del outs[i]
                for operand in graph.ops[i].inputs:
                    p = graph.producer.get(operand.tensor)
                    if p in readers:
                        readers[p] -= 1
                        if not readers[p]:
                            outs.pop(p, None)
        if release is not None:
            release()

    def replay_op(self, i: int, outs: dict[int, torch.Tensor]) -> torch.Tensor:
        """Op ``i``'s forward again; its tickets' tensors kept, its output returned."""
        graph, links = self.graph, self.links
        op = graph.ops[i]
        args, releases = [], []
        for j, operand in enumerate(op.inputs):
            kind = graph.tensors[operand.tensor].kind
            if kind is TensorKind.INPUT:
                x = links.model_input(i, j)
            elif kind is TensorKind.PARAMETER:
                x, let_go = links.weight(i, j)
                if let_go is not None:
                    releases.append(let_go)
            else:
                p = graph.producer[operand.tensor]
                if self.replayed[p]:
                    x = outs[p] if links.same_layout(i, j) else links.reshard(i, j, outs[p])
                else:
                    src = self.sources.pop((i, j))
                    x = src if j in op.saves_inputs or links.same_layout(i, j) else links.reshard(i, j, src)
            if self.requires_grad.get((i, j)) and not x.requires_grad:
                x = x.detach().requires_grad_()
            args.append(x)
        saved: list[torch.Tensor] = []

        def keep(t):
            saved.append(t)
            return len(saved) - 1

        with torch.autograd.graph.saved_tensors_hooks(keep, _never):
            out = links.kernel(i)(links.context(i), *args)
        for key in [k for k in self.wanted if k[0] == "saved" and k[1] == i]:
            self.made[key] = saved[key[2]].detach()
            del self.wanted[key]
        # The replay's graph holds its hook, the hook this list, the list the graph's tensors:
        # a cycle through autograd's C++ nodes that no garbage collection breaks.
        saved.clear()
        for let_go in releases:
            let_go()
        return out.detach()

    def make_inputs(self, p: int, out: torch.Tensor) -> None:
        """The tickets of ops that are not replayed for the output of replayed op ``p``, in
        their layouts (the forward's reshard, run again)."""
        graph = self.graph
        for c, j in graph.consumers.get(graph.ops[p].output.tensor, ()):
            key = ("input", c, j)
            if key in self.wanted:
                self.made[key] = out if self.links.same_layout(c, j) else self.links.reshard(c, j, out)
                del self.wanted[key]


def pack_again(recipes: dict[int, Callable[[], torch.Tensor]], t: torch.Tensor):
    """What a saved-tensor hook keeps instead of ``t`` when ``recipes`` can make it again (a
    ZeRO-3 weight gathered again, a kept copy re-gathered); None if they cannot."""
    make = recipes.get(storage_id(t))
    if make is None:
        return None
    if hasattr(make, "packed"):  # a layer unit counts the views it will make again
        make.packed()
    return (make, t.size(), t.stride(), t.storage_offset())


def unpack_saved(packed):
    """The saved tensor back: as it was, from a replay's ticket, or made again."""
    if isinstance(packed, torch.Tensor):
        return packed
    if isinstance(packed, _Ticket):
        return packed()
    make, size, stride, offset = packed
    return make().as_strided(size, stride, offset)


def again_hooks(recipes: dict[int, Callable[[], torch.Tensor]]):
    """Saved-tensor hooks that keep, instead of a tensor, a way to make it again."""

    def pack(t: torch.Tensor):
        packed = pack_again(recipes, t)
        return t if packed is None else packed

    return pack, unpack_saved


def _never(packed):
    raise RuntimeError("the replay's own autograd graph is never run backward")
