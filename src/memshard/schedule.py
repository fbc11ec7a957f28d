"""The training schedule and liveness intervals.

One step runs every op's forward in graph order, every op's backward in reverse order, then
the optimizer. With ``n`` ops the schedule points are numbered::

    F(i) = i            forward of op i
    B(i) = 2n − 1 − i   backward of op i
    O    = 2n           optimizer step

Every memory item is live on a closed interval of points; the peak is the largest sum of
live bytes over the points, never the sum of everything.
"""

from __future__ import annotations

from dataclasses import dataclass

from memshard.graph import Graph


@dataclass(frozen=True)
class Schedule:
    num_ops: int

    def forward(self, i: int) -> int:
        return i

    def backward(self, i: int) -> int:
        return 2 * self.num_ops - 1 - i

    @property
    def optimizer(self) -> int:
        return 2 * self.num_ops

    @property
    def num_points(self) -> int:
        return 2 * self.num_ops + 1

    def describe(self, point: int, graph: Graph) -> str:
        if point == self.optimizer:
            return "optimizer step"
        if point < self.num_ops:
            return f"forward {graph.ops[point].name}"
        return f"backward {graph.ops[2 * self.num_ops - 1 - point].name}"


def candidate_points(graph: Graph, schedule: Schedule, shared_layers: bool) -> list[int]:
    """Points that can hold the peak.

    With identical layers sharing variables, the live bytes at the same op of layer k are
    affine in k (k layers of saved activations below it; in backward also L−1−k layers of
    finished gradients), so their maximum is at the first or the last layer: the middle
    layers' points are never needed.
    """
    if not shared_layers or graph.num_layers <= 2:
        return list(range(schedule.num_points))
    keep_layers = {0, graph.num_layers - 1}
    points = []
    for i, op in enumerate(graph.ops):
        if op.layer is None or op.layer in keep_layers:
            points.append(schedule.forward(i))
            points.append(schedule.backward(i))
    points.append(schedule.optimizer)
    return sorted(points)
