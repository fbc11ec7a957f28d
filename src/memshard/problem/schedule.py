"""The training schedule and liveness intervals.

One step runs every op's forward in graph order, every op's backward in reverse order, then
the optimizer. Each op's forward is preceded by the reshards of its inputs into its layouts,
and its backward followed by the reshards of its input gradients back to the producers'
layouts. With ``n`` ops and no recomputation the schedule points are numbered::

    RF(i) = 2i              the inputs of op i being resharded for its forward
    F(i)  = 2i + 1          forward of op i
    B(i)  = 4n − 2 − 2i     backward of op i
    RB(i) = 4n − 1 − 2i     op i's input gradients being resharded
    O     = 4n              optimizer step

With recomputation a layer's replay runs just before the backward of its start op ``s``
(``recompute.replay_starts``): two points per op k of the layer that may be replayed, in
forward order, between RB(s + 1) and B(s) — RR(k), its inputs resharded again, and R(k), its
forward run again: the replay is a forward pass of its own, and what it makes lives from the
moment it is made. Every later point moves on by the replay points before it.

The *boundary* between the forward and the backward is point 2n, the backward's first: B(n−1),
or the first RR of a replay that runs before it. Nothing of the backward is made there yet
(re-gathered copies are transients), so the activations live there are what one micro-batch
holds between its forward and its backward; recomputation makes them fewer, not the point.

Every memory item is live on a closed interval of points; an item spanning a reshard point
is live during it (what is held while the reshard runs), and the reshard's own buffers are
priced at its point. The peak is the largest sum of live bytes over the points, never the
sum of everything.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memshard.core.graph import Graph


@dataclass(frozen=True)
class Schedule:
    num_ops: int
    # (start op s, the ops its replay may run in forward order), one entry per replaying layer
    replays: tuple[tuple[int, tuple[int, ...]], ...] = ()
    _backward: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _replay: dict[int, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n, before = self.num_ops, dict(self.replays)
        backward, replay, point = [0] * n, {}, 2 * n
        for i in reversed(range(n)):
            for k in before.get(i, ()):
                replay[k] = point + 1
                point += 2
            backward[i] = point
            point += 2
        object.__setattr__(self, "_backward", tuple(backward))
        object.__setattr__(self, "_replay", replay)

    def reshard_in(self, i: int) -> int:
        return 2 * i

    def forward(self, i: int) -> int:
        return 2 * i + 1

    def backward(self, i: int) -> int:
        return self._backward[i]

    def reshard_out(self, i: int) -> int:
        return self._backward[i] + 1

    def replay_reshard(self, k: int) -> int:
        """RR(k): op k's inputs resharded again by its layer's replay."""
        return self._replay[k] - 1

    def replay(self, k: int) -> int:
        """R(k): op k's forward run again by its layer's replay."""
        return self._replay[k]

    def backward_begins(self, i: int) -> int:
        """The first point of op i's backward: its layer's replay if one runs before it."""
        ops = dict(self.replays).get(i, ())
        return self.replay_reshard(ops[0]) if ops else self._backward[i]

    @property
    def boundary(self) -> int:
        """The backward's first point: what one micro-batch holds between its forward and its
        backward (see the module docstring)."""
        return 2 * self.num_ops

    @property
    def optimizer(self) -> int:
        return 4 * self.num_ops + 2 * len(self._replay)

    @property
    def num_points(self) -> int:
        return self.optimizer + 1

    def describe(self, point: int, graph: Graph) -> str:
        n = self.num_ops
        if point == self.optimizer:
            return "optimizer step"
        if point < 2 * n:
            name = graph.ops[point // 2].name
            return f"forward {name}" if point % 2 else f"resharding the inputs of {name}"
        for k, p in self._replay.items():
            if p == point:
                return f"recomputing {graph.ops[k].name}"
            if p - 1 == point:
                return f"resharding the inputs of {graph.ops[k].name} for its recomputation"
        i = min(i for i in range(n) if self._backward[i] <= point)  # the latest backward begun
        name = graph.ops[i].name
        return f"backward {name}" if point == self._backward[i] else f"resharding the input gradients of {name}"


def candidate_points(graph: Graph, schedule: Schedule, shared_layers: bool, prefetch: int = 0) -> list[int]:
    """Points that can hold the peak.

    With identical layers sharing variables, the live bytes at the same op of layer k are
    affine in k (k layers of saved activations below it; in backward also L−1−k layers of
    finished gradients), so their maximum is at the first or the last layer: the middle
    layers' points are never needed. Layers split into two classes (``Graph.layer_classes``)
    make them affine in (k, how many of the k layers below are of class 1) for the layers of
    one class: the maximum is at a vertex of those points' convex hull (``peak_layers``).
    ``prefetch`` = 1: in backward every layer but the first also holds the layer below's
    gathered weights (FSDP2's backward prefetch), a step after layer 0 that the affine argument
    covers for layers 1… only, so layer 0 is a candidate of its own. Deeper (explicit)
    prefetching holds fewer layers' weights near both ends: every point is a candidate.
    """
    if not shared_layers or graph.num_layers <= 2 or prefetch > 1:
        return list(range(schedule.num_points))
    keep_layers = peak_layers(graph.layer_classes, bool(prefetch))
    points = []
    for i, op in enumerate(graph.ops):
        if op.layer is None or op.layer in keep_layers:
            points += [schedule.reshard_in(i), schedule.forward(i),
                       schedule.backward(i), schedule.reshard_out(i)]
            if i in schedule._replay:
                points += [schedule.replay_reshard(i), schedule.replay(i)]
    points.append(schedule.optimizer)
    return sorted(points)


def peak_layers(classes: tuple[int, ...], first_apart: bool = False) -> set[int]:
    """The layers whose points can hold the peak, given each layer's class: per class, the
    vertices of the convex hull of (k, layers of class 1 below k) over its layers k (the first
    and the last layer with one class; every layer with more than two). ``first_apart``: the
    hull is of the layers after the first, which is a candidate itself."""
    if len(set(classes)) > 2:
        return set(range(len(classes)))
    top = max(classes)
    below, points = 0, {}
    for k, c in enumerate(classes):
        if k or not first_apart:
            points.setdefault(c, []).append((k, below))
        below += c == top
    return {k for layers in points.values() for k, _ in _hull(layers)} | ({0} if first_apart else set())


def _hull(points: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The vertices of the convex hull of ``points`` sorted by x (Andrew's monotone chain)."""
    if len(points) <= 2:
        return points

    def chain(ps):
        out: list[tuple[int, int]] = []
        for p in ps:
            while len(out) >= 2 and ((out[-1][0] - out[-2][0]) * (p[1] - out[-2][1])
                                     - (out[-1][1] - out[-2][1]) * (p[0] - out[-2][0])) <= 0:
                out.pop()
            out.append(p)
        return out

    return chain(points) + chain(points[::-1])
