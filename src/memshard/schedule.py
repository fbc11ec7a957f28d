"""The training schedule and liveness intervals.

One step runs every op's forward in graph order, every op's backward in reverse order, then
the optimizer. Each op's forward is preceded by the reshards of its inputs into its layouts,
and its backward followed by the reshards of its input gradients back to the producers'
layouts. With ``n`` ops the schedule points are numbered::

    RF(i) = 2i              the inputs of op i being resharded for its forward
    F(i)  = 2i + 1          forward of op i
    B(i)  = 4n − 2 − 2i     backward of op i
    RB(i) = 4n − 1 − 2i     op i's input gradients being resharded
    O     = 4n              optimizer step

Every memory item is live on a closed interval of F, B and O points; an item spanning a
reshard point is live during it (what is held while the reshard runs), and the reshard's own
buffers are priced at its point. The peak is the largest sum of live bytes over the points,
never the sum of everything.
"""

from __future__ import annotations

from dataclasses import dataclass

from memshard.graph import Graph


@dataclass(frozen=True)
class Schedule:
    num_ops: int

    def reshard_in(self, i: int) -> int:
        return 2 * i

    def forward(self, i: int) -> int:
        return 2 * i + 1

    def backward(self, i: int) -> int:
        return 4 * self.num_ops - 2 - 2 * i

    def reshard_out(self, i: int) -> int:
        return 4 * self.num_ops - 1 - 2 * i

    @property
    def optimizer(self) -> int:
        return 4 * self.num_ops

    @property
    def num_points(self) -> int:
        return 4 * self.num_ops + 1

    def describe(self, point: int, graph: Graph) -> str:
        n = self.num_ops
        if point == self.optimizer:
            return "optimizer step"
        if point < 2 * n:
            name = graph.ops[point // 2].name
            return f"forward {name}" if point % 2 else f"resharding the inputs of {name}"
        name = graph.ops[(4 * n - 1 - point) // 2].name
        return f"resharding the input gradients of {name}" if point % 2 else f"backward {name}"


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
            points += [schedule.reshard_in(i), schedule.forward(i),
                       schedule.backward(i), schedule.reshard_out(i)]
    points.append(schedule.optimizer)
    return sorted(points)
