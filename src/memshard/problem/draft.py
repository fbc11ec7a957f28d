"""The problem under construction, shared by the two halves of the builder: the ops'
(``pricing.py``) and the parameters' storage (``storage.py``).

A :class:`ProblemDraft` holds the job's context (graph, mesh, schedule, layer units, framework,
micro-batches, the ops a policy may replay) and the records both halves append to (groups,
links, edges, slots, holders, conflicts), with the pricing helpers both use (a slot's bytes, a
layout's bytes and redundancy, collectives' time). ``build_problem`` turns a finished draft
into a :class:`~memshard.problem.records.Problem`.
"""

from __future__ import annotations

import math

import numpy as np

from memshard.core.graph import Graph, TensorSpec
from memshard.core.mesh import Mesh
from memshard.core.placement import Layout, local_shape
from memshard.problem import comm
from memshard.problem.gathers import fsdp2_units, layer_units, pipelined_units
from memshard.problem.memory import CROSS_ENTROPY_CHUNKS, redundant_bytes, tensor_bytes
from memshard.problem.recompute import replay_flags, replay_starts, replayable_ops
from memshard.problem.records import (
    ALWAYS,
    FSDP2_FRAMEWORKS,
    MEGATRON_FRAMEWORKS,
    MEMSHARD,
    TORCH_FRAMEWORKS,
    Conflict,
    Constant,
    Edge,
    Group,
    HeldTensor,
    Holder,
    Link,
    Slot,
    fsdp2_options,
)
from memshard.problem.schedule import Schedule


class ProblemDraft:
    """The context and the records of a problem being priced (see the module docstring)."""

    def __init__(self, graph: Graph, mesh: Mesh, shared: bool, micro_batches: int, zero3_unit: str = "op",
                 recompute: str = "none", framework: str = MEMSHARD, held_micro_batches: int = 1):
        self.graph = graph
        self.mesh = mesh
        self.shared = shared
        self.micro_batches = micro_batches
        # A pipeline stage's rank holds ``held_micro_batches`` at its peak; holding all of the
        # step's (GPipe), it runs every forward before the first backward: while they wait,
        # no gradient has been accumulated yet.
        self.held_micro_batches = held_micro_batches
        self.forwards_first = 1 < micro_batches == held_micro_batches
        self.framework = framework
        # A stage run by torch.distributed.pipelining (``PipelineStage``): its receive buffers,
        # its outputs kept until its backward ends. Megatron-LM's schedule receives into a
        # tensor per micro-batch in flight and frees what it sent.
        self.torch_pipeline = framework not in MEGATRON_FRAMEWORKS
        self.replay_flags = replay_flags(graph, recompute)
        # Where each layer's replay runs: PyTorch's checkpoint at its first unpack.
        starts = replay_starts(graph, on_first_unpack=framework in TORCH_FRAMEWORKS)
        self.cached_ops = self.checkpoint_cached(recompute)
        replayed: dict[int, tuple[int, ...]] = {}
        for i, op in enumerate(graph.ops):
            if True in self.replay_flags[i] or i in self.cached_ops:
                replayed[starts[op.layer]] = (*replayed.get(starts[op.layer], ()), i)
        self.sched = Schedule(len(graph.ops), tuple(sorted(replayed.items())))
        if framework in FSDP2_FRAMEWORKS:
            self.units = fsdp2_units(graph, self.sched, recompute, **fsdp2_options(framework, mesh.shape[-1]))
            if graph.received or graph.sent:  # a pipeline stage: as torch's PipelineStage runs fully_shard
                self.units = pipelined_units(self.units, graph, self.sched, micro_batches, self.forwards_first)
        else:
            self.units = layer_units(graph, self.sched, recompute) if zero3_unit == "layer" else {}
        self.conflicts: list[Conflict] = []
        self.groups: list[Group] = []
        self.index: dict[tuple, int] = {}
        self.links: list[Link] = []
        self.edges: list[Edge] = []
        self.edge_index: dict[tuple, int] = {}
        self.slots: list[Slot] = []
        self.held: list[HeldTensor] = []
        self.holders: list[Holder] = []
        self.constants: list[Constant] = []
        self.last_consumer = {t: c[-1][0] for t, c in graph.consumers.items()}
        self.cache: dict[tuple, object] = {}

    def time(self, calls) -> float:
        return comm.total_time(calls, self.mesh)

    def slot(self, group, start, end, category, nbytes, redundant=None, global_bytes=0.0, phase=ALWAYS) -> None:
        nbytes = np.asarray(nbytes, float)
        if start <= end and (np.count_nonzero(nbytes) or global_bytes):  # (count_nonzero: a quarter of any's cost)
            red = np.zeros_like(nbytes) if redundant is None else np.asarray(redundant, float)
            self.slots.append(Slot(group, start, end, category, nbytes, red, float(global_bytes), phase))

    def redundant(self, nbytes, layouts) -> list[float]:
        return [redundant_bytes(b, L, self.mesh) for b, L in zip(nbytes, layouts)]

    def cached(self, key: tuple, make):
        """Per-group price vectors: every instance of a shared group has the same shapes."""
        if key not in self.cache:
            self.cache[key] = make()
        return self.cache[key]

    def layout_prices(self, spec: TensorSpec, layouts: list[Layout]) -> tuple[np.ndarray, np.ndarray]:
        nbytes = np.array([tensor_bytes(spec, L, self.mesh) for L in layouts], float)
        return nbytes, np.array(self.redundant(nbytes, layouts))

    def checkpoint_cached(self, recompute: str) -> set[int]:
        """The ops whose output PyTorch's selective checkpoint caches where they are not replayed
        (``problem.CACHED``): under a framework it runs, the replayable ops of a layer some of
        whose ops may be replayed (each gets a point in the replay, where the recompute reaches it)."""
        if self.framework not in TORCH_FRAMEWORKS or recompute == "none":
            return set()
        replaying = {self.graph.ops[i].layer for i, flags in enumerate(self.replay_flags) if True in flags}
        return {i for i in replayable_ops(self.graph) if self.graph.ops[i].layer in replaying}

    def chunk_prices(self, spec: TensorSpec, layouts: list[Layout]) -> tuple[np.ndarray, np.ndarray]:
        """One row chunk of the local logits (see CROSS_ENTROPY_CHUNKS) in each layout."""
        nbytes = []
        for L in layouts:
            shape = local_shape(spec.shape, L, self.mesh.shape)
            rows = math.prod(shape[:-1])
            nbytes.append(-(-rows // CROSS_ENTROPY_CHUNKS) * shape[-1] * spec.dtype_bytes)
        nbytes = np.array(nbytes, float)
        return nbytes, np.array(self.redundant(nbytes, layouts))
