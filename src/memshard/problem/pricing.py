"""Pricing a job into a :class:`~memshard.problem.records.Problem`.

``build_problem`` turns a graph and a mesh into the data both the ILP (``search/``) and the plan
evaluator (``evaluate.py``) read, so the two price every plan identically: for every op its
strategies (compute time, statistics all-reduces, buffers, gradients), for every activation
its edges and holders, for every parameter its storage options (weight, gradient, optimizer
states, the ZeRO-3 gathers and the gradients' reductions, alone or by layer unit:
``problem/storage.py``), the reshard points, and the adds whose gradient two producers share.
The records are described in ``records.py``.

A pipeline stage's received tensor (``Graph.pipeline_stage``) is read by its ``RECEIVE`` op
alone: torch's receive buffers hold that op's layout (``receive_buffers``), and its output is
the received piece itself, no copy and no kernel. The stage's readers reshard it as any
activation, copies and collectives priced by the edges. ``build_problem``'s
``received_layouts`` fixes the layout a stage receives a tensor in (the layout the stage
before sends it in): that op's strategies are then those of that layout alone.
"""

from __future__ import annotations

import math

import numpy as np

from memshard.core.errors import MemshardError
from memshard.core.graph import RECEIVE, Graph, Op, TensorKind
from memshard.core.mesh import Mesh
from memshard.core.placement import Layout, format_layout
from memshard.problem import comm
from memshard.problem.draft import ProblemDraft
from memshard.problem.kernels import KernelTime, op_time
from memshard.problem.memory import (
    STATS_BYTES,
    STATS_IN_BACKWARD,
    buffer_bytes,
    buffer_global_bytes,
    buffer_redundant_bytes,
    passes_gradient,
    promoted_gradient,
)
from memshard.problem.recompute import (
    RECOMPUTE_POLICIES,
)
from memshard.problem.records import (
    CACHED,
    DDP_FRAMEWORKS,
    FRAMEWORKS,
    FSDP2_FRAMEWORKS,
    INPUT_COPY,
    MEMSHARD,
    PRODUCER,
    READ_BY_REPLAY,
    REGATHER,
    REPLAY_INPUT,
    REPLAY_INPUTS,
    REPLAY_OUT,
    REPLAY_READ,
    REPLAY_TICKETS,
    REPLAYED,
    REPLAYED_AHEAD,
    REPLAYED_BY_PRODUCER,
    RETAINED,
    SAVED,
    SOURCE,
    TORCH_FRAMEWORKS,
    TORCH_TP_FRAMEWORKS,
    ZERO3_UNITS,
    Choice,
    Constant,
    Edge,
    HeldTensor,
    Holder,
    OpGroup,
    PipelineStage,
    Problem,
    ReshardPoint,
    SharedGradient,
    explicit_prefetch,
    framework_graph,
    without_partial,
)
from memshard.problem.schedule import candidate_points
from memshard.problem.storage import StoragePricing
from memshard.problem.strategies import (
    Strategy,
    activation_inputs,
    enumerate_strategies,
    input_grad_layout,
    parameter_inputs,
)
from memshard.problem.tensor_parallel import FUSED_GATHER, REDISTRIBUTIONS, redistribute_grad_layout


def _role_key(op: Op, shared: bool) -> str:
    return op.share_key if shared and op.role is not None else op.name


class _Builder(ProblemDraft):
    """The ops' half of the builder: op groups and their slots, edges, holders, inputs and
    the frameworks' buffers (the parameters' half: :class:`StoragePricing`)."""

    received_layouts: dict[str, Layout] = {}  # (``build_problem``'s, set per builder)

    # -- ops ---------------------------------------------------------------------------------

    def received_strategies(self, op: Op, strategies: list[Strategy]) -> list[Strategy]:
        """``strategies`` of a ``RECEIVE`` op whose tensor is received in a fixed layout
        (``received_layouts``): those that lay it out so; every other op's as they are."""
        wanted = self.received_layouts.get(op.inputs[0].tensor) if op.kind == RECEIVE else None
        if wanted is None:
            return strategies
        kept = [s for s in strategies if without_partial(s.output_layout) == without_partial(wanted)]
        if not kept:
            raise MemshardError(f"stage {self.graph.name} cannot receive {op.inputs[0].tensor} in layout "
                                f"{format_layout(wanted)}: no strategy of {op.name} lays it out so")
        return kept

    def op_choices(self, op: Op, strategies: list[Strategy], replayed: bool = False) -> list[Choice]:
        """Each strategy's compute (``kernels.py``) and statistics all-reduces per step; a
        replayed op runs its forward (and its forward's all-reduces) a second time."""
        out = []
        for s in strategies:
            local = s.local_sizes
            kernels = receive_time(op) or op_time(op, self.graph, local, self.mesh.hardware)
            calls: tuple[comm.Collective, ...] = ()
            stats: tuple[comm.Collective, ...] = ()
            if op.stats_per_row:
                rows = math.prod(n for d, n in local.items() if d not in op.reduced_dims)
                axes = tuple(a for a, d in enumerate(s.assignment) if d in op.reduced_dims)
                calls = stats = comm.all_reduce_over(rows * op.stats_per_row * STATS_BYTES, axes, self.mesh)
                if op.kind in STATS_IN_BACKWARD:
                    calls += comm.all_reduce_over(rows * STATS_IN_BACKWARD[op.kind] * STATS_BYTES, axes, self.mesh)
            replay = (kernels.forward_s + self.time(stats)) * self.micro_batches if replayed else 0.0
            compute = (kernels.forward_s * (1 + replayed) + kernels.backward_s) * self.micro_batches
            calls = (calls + stats * replayed) * self.micro_batches
            label = (s.name(), "recomputed") if replayed else s.name()
            out.append(Choice(label, compute, calls, compute + self.time(calls), replay))
        return out

    def op_group(self, op: Op, flags: tuple[bool, ...]) -> OpGroup:
        """The group of ``op``'s role: every strategy, once per recompute flag allowed (a
        ``RECEIVE`` op's of its fixed layout alone: ``received_strategies``)."""
        strategies = self.received_strategies(op, list(enumerate_strategies(self.graph, op, self.mesh)))
        choices, every, replays = [], [], []
        for replayed in flags:
            choices += self.op_choices(op, strategies, replayed)
            every += strategies
            replays += [replayed] * len(strategies)
        if op.kind in REDISTRIBUTIONS:
            input_grads = [[redistribute_grad_layout(s.output_layout, self.mesh.shape) for s in every]]
        else:
            input_grads = [[input_grad_layout(s, op, j) for s in every] for j in range(len(op.inputs))]
        return OpGroup(key=_role_key(op, self.shared), choices=choices, strategies=every, input_grads=input_grads,
                       replays=replays if any(replays) else [])

    def add_ops(self) -> list[int]:
        op_group = []
        for i, op in enumerate(self.graph.ops):
            key = ("op", _role_key(op, self.shared))
            if key not in self.index:
                self.index[key] = len(self.groups)
                self.groups.append(self.op_group(op, self.replay_flags[i]))
            gid = self.index[key]
            self.groups[gid].instances += 1
            self.groups[gid].ops.append(i)
            op_group.append(gid)
        return op_group

    def op_slots(self, op_group: list[int]) -> None:
        S, mesh = self.sched, self.mesh
        for i, op in enumerate(self.graph.ops):
            gid = op_group[i]
            strategies = self.groups[gid].strategies
            buffers = self.cached((gid, "buffers"), lambda op=op, strategies=strategies: (
                [buffer_bytes(op, s) for s in strategies],
                [buffer_redundant_bytes(op, s, mesh) for s in strategies]))
            self.buffer_slots(i, gid, buffers)
            if op.kind == "cross_entropy":
                self.loss_slots(i, gid)
                self.kept_stage_output(i, gid)
            out = self.graph.tensors[op.output.tensor]
            if op.output.tensor in self.last_consumer or op.output.tensor in self.graph.sent:
                # The gradient of the output in our layout, from its last consumer's reshard of
                # it (the consumers' own layouts before: their input-gradient slots) to ours.
                prices = self.cached((gid, "output_grad"), lambda out=out, strategies=strategies: self.layout_prices(
                    out, [without_partial(s.output_layout) for s in strategies]))
                if op.output.tensor in self.graph.sent and self.torch_pipeline:
                    self.receive_buffers(gid, prices, out.nbytes)
                elif op.output.tensor in self.graph.sent:  # received as the backward begins
                    self.slot(gid, S.boundary, S.backward(i), "transients", *prices, out.nbytes)
                else:
                    self.slot(gid, S.reshard_out(self.last_consumer[op.output.tensor]), S.backward(i), "transients",
                              *prices, out.nbytes)
            for j in (*activation_inputs(self.graph, op), *self.received_inputs(op)):
                t = op.inputs[j].tensor
                if passes_gradient(op, j, self.graph.tensors[t], out) or op.kind == RECEIVE:
                    continue  # its gradient is the output's, priced above
                prices = self.cached((gid, "input_grad", j), lambda t=t, gid=gid, j=j: self.layout_prices(
                    self.graph.tensors[t], [without_partial(L) for L in self.groups[gid].input_grads[j]]))
                # The last consumer's is the tensor's whole gradient until it is resharded.
                unique = self.graph.tensors[t].nbytes if self.last_consumer[t] == i else 0.0
                self.slot(gid, S.backward(i), S.backward(i), "transients", *prices, unique)
                wider = promoted_gradient(op, self.graph.tensors[t], out)
                if wider:
                    # A replayed op's saved tensors are the checkpoint's, freed as its backward
                    # returns, before the cast: its peak is then the wide gradient alone.
                    grp = self.groups[gid]
                    net = wider - (np.array(grp.replays, float) if grp.may_replay else 0.0)
                    self.slot(gid, S.backward(i), S.backward(i), "transients", *(x * net for x in prices), 0.0)

    def received_inputs(self, op: Op) -> tuple[int, ...]:
        """The inputs of ``op`` its pipeline stage received (``Graph.received``): it makes their
        gradients as it makes an activation input's, and the stage sends them back."""
        return tuple(j for j, x in enumerate(op.inputs) if x.tensor in self.graph.received)

    def received_gradients(self, op_group: list[int]) -> None:
        """The gradient of each input a pipeline stage received, sent back when the stage's
        backward ends: from its last reader's input-gradient reshards (its readers' own
        gradients before: their input-gradient slots) to the backward's last point, in that
        reader's input-gradient layout. (Where that reader is an add, the other input's
        producer may hold the same tensor meanwhile: counted twice, unlike
        ``SharedGradient``'s two activations.)"""
        S = self.sched
        # Holding fewer micro-batches than the step's (1F1B), the rank runs a forward and a
        # backward while the gradient it sent back for the micro-batch before is still held:
        # torch's schedule keeps that send's tensors until the next backward's sends replace them.
        pending = self.micro_batches > 1 and not self.forwards_first and self.torch_pipeline
        for t in sorted(self.graph.received):
            i, j = self.graph.consumers[t][-1]
            gid, spec = op_group[i], self.graph.tensors[t]
            prices = self.cached((gid, "input_grad", j), lambda spec=spec, gid=gid, j=j: self.layout_prices(
                spec, [without_partial(L) for L in self.groups[gid].input_grads[j]]))
            self.slot(gid, S.reshard_out(i), S.optimizer - 1, "transients", *prices, spec.nbytes)
            if pending:
                self.slot(gid, 0, S.optimizer - 1, "transients", *prices)

    def receive_buffers(self, gid: int, prices: tuple[np.ndarray, np.ndarray], nbytes: float) -> None:
        """What a pipeline stage receives (an input, or the gradient of what it sends), into
        torch's receive buffers (``PipelineStage``): one per micro-batch of the step, made once
        and kept, buffers rather than one micro-batch's activations."""
        m = self.micro_batches
        self.slot(gid, 0, self.sched.optimizer, "transients", *(x * m for x in prices), nbytes * m)

    def accumulated_contributions(self, storage_group: dict[str, int]) -> None:
        """A pipeline stage's weight gradient while the step's micro-batches accumulate into it,
        under memshard's runtime: stored whole (ZeRO-0/1), the gradient autograd makes in a
        backward is a tensor of its own beside the ``.grad`` it is added to, at the backward
        of the weight's first use (where its uses' contributions are summed). Priced where
        every backward but the first holds as many micro-batches as the first (1F1B holding
        fewer than the step's): a GPipe rank's later backwards hold fewer, and the model
        prices its first (docs/pipelining.md)."""
        if self.framework != MEMSHARD or not (self.graph.received or self.graph.sent) or self.forwards_first \
                or self.micro_batches == 1:
            return
        first_use: dict[str, int] = {}
        for i, op in enumerate(self.graph.ops):
            for j in parameter_inputs(self.graph, op):
                first_use.setdefault(op.inputs[j].tensor, i)
        storage = StoragePricing(self)
        for name, gid in storage_group.items():
            grp = self.groups[gid]
            nbytes, red = self.cached((gid, "storage"), lambda grp=grp: storage.storage_prices(grp))["gradients"]
            whole = np.array([opt.stage < 2 for _, opt in grp.options], float)
            point = self.sched.backward(first_use[name])
            self.slot(gid, point, point, "transients", nbytes * whole, red * whole)

    def kept_stage_output(self, i: int, gid: int) -> None:
        """The last pipeline stage's output, the logits its loss reads: torch's
        ``PipelineStage`` keeps it until the stage's backward ends. Under PyTorch's loss the
        tensor the loss saves is its log-probabilities, so the logits are one tensor more
        from the loss's forward on; a loss that saves the logits keeps them itself until its
        backward. Under memshard's runtime the stage's own graph computes the loss
        (``runtime/pipelined.py``): the output torch keeps is that scalar, none of the logits."""
        if not self.graph.received or self.graph.sent or not self.torch_pipeline or self.framework == MEMSHARD:
            return  # (memshard's runtime: the stage's graph computes its loss; torch keeps that scalar)
        S, logits = self.sched, self.graph.tensors[self.graph.ops[i].inputs[0].tensor]
        prices = self.cached((gid, "kept output"), lambda: self.layout_prices(
            logits, [s.input_layouts[0] for s in self.groups[gid].strategies]))
        start = S.forward(i) + 1 if self.framework in TORCH_FRAMEWORKS else S.backward(i) + 1
        self.slot(gid, start, S.optimizer - 1, "activations", *prices, logits.nbytes)

    def loss_slots(self, i: int, gid: int) -> None:
        """The loss's working set besides its saved logits and their gradient. memshard's and
        Megatron-LM's kernels: a row chunk of exponentials in forward. PyTorch's
        ``F.cross_entropy`` (``log_softmax``, then ``nll_loss``): its log-probabilities beside
        the logits forward, their gradient beside the logits' backward, one logits tensor more
        each way. ``loss_parallel`` (classes split, torch-tp) holds a second extra tensor each
        way: forward the shifted logits beside their exponentials, then beside the
        log-probabilities (its ``_log_softmax``); backward its ``(zeros + exp(x)) * grad`` (four
        logits-sized at its peak; both measured in ``tests/test_conformance.py``)."""
        S, op = self.sched, self.graph.ops[i]
        logits = self.graph.tensors[op.inputs[0].tensor]
        classes = op.inputs[0].dims[-1]

        def prices():
            strategies = self.groups[gid].strategies
            layouts = [s.input_layouts[0] for s in strategies]
            chunk = self.chunk_prices(logits, layouts)
            if self.framework not in TORCH_FRAMEWORKS:
                return chunk, (np.zeros(len(layouts)), np.zeros(len(layouts)))
            whole = self.layout_prices(logits, layouts)
            split = np.array([self.framework in TORCH_TP_FRAMEWORKS and classes in s.assignment for s in strategies], float)
            return tuple(w * (1 + split) for w in whole), tuple(w * (1 + split) for w in whole)

        forward, backward = self.cached((gid, "loss"), prices)
        self.slot(gid, S.forward(i), S.forward(i), "transients", *forward)
        if self.framework in TORCH_FRAMEWORKS:  # (memshard's problems as they were: no empty slot)
            self.slot(gid, S.backward(i), S.backward(i), "transients", *backward)

    def buffer_slots(self, i: int, gid: int, buffers: tuple[list, list]) -> None:
        """An op's private buffers (a dropout mask) from its forward to its backward; a
        replayed op's are dropped after the forward and made again by its layer's replay."""
        S, op, grp = self.sched, self.graph.ops[i], self.groups[gid]
        unique = buffer_global_bytes(self.graph, op)
        if not grp.may_replay:
            self.slot(gid, S.forward(i), S.backward(i), "activations", *buffers, unique)
            return
        kept = np.array([not r for r in grp.replays], float)
        nbytes, redundant = np.asarray(buffers[0]), np.asarray(buffers[1])
        replay = S.replay(i)
        self.slot(gid, S.forward(i), replay - 1, "activations", nbytes * kept, redundant * kept,
                  0.0 if kept.min() == 0 else unique)
        # From the replay on: the kept buffer (an activation), or the one the replay made.
        self.slot(gid, replay, S.backward(i), "activations", nbytes * kept, redundant * kept, unique * kept.min())
        self.slot(gid, replay, S.backward(i), "transients", nbytes * (1 - kept), redundant * (1 - kept),
                  unique * (1 - kept.max()))

    # -- activations flowing between ops ----------------------------------------------------
    def add_edges(self, op_group: list[int]) -> dict[tuple[int, int], int]:
        S = self.sched
        edge_of_input = {}
        holders: dict[str, list[tuple[str, int, int, int]]] = {}
        for i, op in enumerate(self.graph.ops):
            for j in activation_inputs(self.graph, op):
                t = op.inputs[j].tensor
                pg, cg = op_group[self.graph.producer[t]], op_group[i]
                key = (self.groups[pg].key, self.groups[cg].key, j)
                saves = j in op.saves_inputs
                if key not in self.edge_index:
                    self.edge_index[key] = len(self.edges)
                    through = self.graph.ops[self.graph.producer[t]].kind in REDISTRIBUTIONS
                    self.edges.append(Edge(f"{key[0]} -> {key[1]}[{j}]", self.graph.tensors[t], pg, cg, j, saves,
                                           replay=self.edge_replay(pg, cg, saves), gradient_through=through))
                e = self.edge_index[key]
                self.edges[e].instances += 1
                edge_of_input[(i, j)] = e
                entry = holders.setdefault(t, [])
                entry.append((INPUT_COPY, e, S.forward(i), S.forward(i)))
                if saves:
                    entry.append((SAVED, e, S.forward(i), S.backward(i)))
                    entry.append((REGATHER, e, S.backward(i), S.backward(i)))
                entry += self.replay_holders(i, j, e)
        self.add_holders(op_group, holders)
        return edge_of_input

    def replay_holders(self, i: int, j: int, e: int) -> list[tuple[str, int, int, int]]:
        """Who holds op ``i``'s input ``j`` (edge ``e``) for recomputation. A ticket (a saved
        copy the replay makes) lives from its producer's replay; a replaying consumer reads
        the producer's tensor held since the forward (or, where every plan holds it, the
        producer's own holder), or the replayed producer's output, kept from that op's
        replay to its reader's; a reader that does not save it makes its copy there."""
        S, edge = self.sched, self.edges[e]
        p = self.graph.producer[self.graph.ops[i].inputs[j].tensor]
        producer, consumer = self.groups[edge.producer], self.groups[edge.consumer]
        out = []
        if edge.replay == REPLAYED_BY_PRODUCER and not consumer.may_replay:
            out.append((REPLAYED, e, S.replay(p), S.backward(i)))
        elif edge.replay == REPLAYED_BY_PRODUCER:  # made by its own replay, or (not replayed) by p's
            out.append((REPLAYED, e, S.replay(i), S.backward(i)))
            if not consumer.always_replays:
                out.append((REPLAYED_AHEAD, e, S.replay(p), S.replay_reshard(i)))
        elif edge.replay == READ_BY_REPLAY and not producer.may_replay and consumer.always_replays:
            out.append((PRODUCER, edge.producer, S.forward(p), S.replay(i)))
        elif edge.replay == READ_BY_REPLAY:
            out.append((SOURCE, e, S.forward(p), S.replay(i)))
        if edge.replay and producer.may_replay and consumer.may_replay and self.graph.ops[p].layer == self.graph.ops[i].layer:
            out.append((REPLAY_READ, e, S.replay(p), S.replay(i)))
        if edge.replay == READ_BY_REPLAY:
            out.append((REPLAY_INPUT, e, S.replay(i), S.replay(i)))
        return out

    def edge_replay(self, producer: int, consumer: int, saves: bool) -> str:
        """How recomputation touches an edge (``problem.Edge.replay``)."""
        if saves and self.groups[producer].may_replay:
            return REPLAYED_BY_PRODUCER
        if not saves and self.groups[consumer].may_replay:
            return READ_BY_REPLAY
        return ""

    def shared_gradients(self, op_group: list[int],
                         edge_of_input: dict[tuple[int, int], int]) -> list[SharedGradient]:
        """The adds whose output gradient two producers may receive as it is
        (``records.SharedGradient``): the last consumer of both its inputs (two tensors), each
        of the output's dims and dtype, neither edge out of a redistribution."""
        S, graph, out = self.sched, self.graph, []
        for i, op in enumerate(graph.ops):
            spec = graph.tensors[op.output.tensor]
            inputs = activation_inputs(graph, op)
            tensors = [op.inputs[j].tensor for j in inputs]
            if (len(inputs) != 2 or len(set(tensors)) != 2
                    or op.output.tensor not in self.last_consumer
                    or any(self.last_consumer[t] != i
                           or not passes_gradient(op, j, graph.tensors[t], spec)
                           for j, t in zip(inputs, tensors))):
                continue
            edges = (edge_of_input[(i, inputs[0])], edge_of_input[(i, inputs[1])])
            if any(self.edges[e].gradient_through for e in edges):
                continue
            gid, strategies = op_group[i], self.groups[op_group[i]].strategies
            nbytes, redundant = self.cached(  # (the output gradient's prices, as op_slots')
                (gid, "output_grad"), lambda spec=spec, strategies=strategies: self.layout_prices(
                    spec, [without_partial(s.output_layout) for s in strategies]))
            first = max(graph.producer[t] for t in tensors)  # the first backward of the two
            out.append(SharedGradient(gid, edges, S.reshard_out(i), S.backward(first), op_group[first],
                                      nbytes, redundant, float(spec.nbytes)))
        return out

    def add_reshard_points(self, edge_of_input: dict[tuple[int, int], int]) -> list[ReshardPoint]:
        S = self.sched
        points = []
        for i, op in enumerate(self.graph.ops):
            inputs = activation_inputs(self.graph, op)
            if not inputs:
                continue
            edges = tuple(edge_of_input[(i, j)] for j in inputs)
            last = tuple(self.last_consumer[op.inputs[j].tensor] == i for j in inputs)
            points.append(ReshardPoint(S.reshard_in(i), False, edges, last))
            points.append(ReshardPoint(S.reshard_out(i), True, edges, last))
            kept = tuple(e for e, j in zip(edges, inputs) if j in op.saves_inputs)
            if kept and i + 1 < len(self.graph.ops):  # re-gathers don't use ``last``
                points.append(ReshardPoint(S.reshard_out(i + 1), False, kept, (False,) * len(kept), regather=True))
        return points + self.replay_reshard_points(edge_of_input)

    def replay_reshard_points(self, edge_of_input: dict[tuple[int, int], int]) -> list[ReshardPoint]:
        """The replay's reshards: a replayed op's inputs at RR(i); the saved copies its output
        is resharded into for consumers that are not replayed, at R(i)."""
        S, graph, points = self.sched, self.graph, []
        for i, op in enumerate(graph.ops):
            if True not in self.replay_flags[i]:
                continue
            edges = tuple(edge_of_input[(i, j)] for j in activation_inputs(graph, op)
                          if self.edges[edge_of_input[(i, j)]].replay)
            if edges:
                points.append(ReshardPoint(S.replay_reshard(i), False, edges, (False,) * len(edges), replay=REPLAY_INPUTS))
            tickets = tuple(e for c, j in graph.consumers.get(op.output.tensor, ()) if (c, j) in edge_of_input
                            and self.edges[e := edge_of_input[(c, j)]].replay == REPLAYED_BY_PRODUCER
                            and not self.groups[self.edges[e].consumer].always_replays)
            if tickets:
                points.append(ReshardPoint(S.replay(i), False, tickets, (False,) * len(tickets), replay=REPLAY_TICKETS))
        return points

    def add_holders(self, op_group: list[int], edge_holders: dict[str, list[tuple]]) -> None:
        S = self.sched
        for p, op in enumerate(self.graph.ops):
            t = op.output.tensor
            spec = self.graph.tensors[t]
            pg = op_group[p]
            forward_end = S.forward(self.last_consumer.get(t, p))
            # (a tensor sent to the next pipeline stage is kept until the stage's backward
            # ends, as torch's PipelineStage keeps its outputs)
            kept_to = S.optimizer - 1 if self.torch_pipeline else S.backward(p)
            end = kept_to if t in self.graph.sent else S.backward(p) if op.saves_output or op.kind == RECEIVE \
                else forward_end
            edges = tuple(sorted({e for kind, e, _, _ in edge_holders.get(t, []) if kind != PRODUCER}))

            def prices(pg=pg, edges=edges, spec=spec):
                layouts = [s.output_layout for s in self.groups[pg].strategies]
                for e in edges:
                    edge = self.edges[e]
                    layouts += [s.input_layouts[edge.input_index] for s in self.groups[edge.consumer].strategies]
                layouts = list(dict.fromkeys(without_partial(L) for L in layouts))
                return (layouts, *self.layout_prices(spec, layouts))

            layouts, nbytes, red = self.cached(("held", pg, edges), prices)
            hid = len(self.held)
            self.held.append(HeldTensor(t, pg, tuple(layouts), nbytes, red, float(spec.nbytes)))
            if self.groups[pg].may_replay:  # its output as its replay makes it
                self.holders.append(Holder(hid, REPLAY_OUT, pg, S.replay(p), S.replay(p)))
            if op.saves_output and self.groups[pg].always_replays:
                replay = S.replay(p)
                self.holders += [Holder(hid, PRODUCER, pg, S.forward(p), forward_end),
                                 Holder(hid, PRODUCER, pg, replay, end)]
            elif op.saves_output and self.groups[pg].may_replay:
                # Dropped after its last forward use unless kept; made again by the replay.
                replay = S.replay(p)
                self.holders += [Holder(hid, PRODUCER, pg, S.forward(p), forward_end),
                                 Holder(hid, RETAINED, pg, forward_end + 1, replay - 1),
                                 Holder(hid, PRODUCER, pg, replay, end)]
            else:
                self.holders.append(Holder(hid, PRODUCER, pg, S.forward(p), end))
                if p in self.cached_ops and not self.groups[pg].always_replays:
                    self.holders.append(Holder(hid, CACHED, pg, forward_end + 1, S.replay(p)))
            if op.kind == RECEIVE:
                self.received_piece(p, pg, spec, end)
            for kind, source, start, stop in edge_holders.get(t, []):
                self.holders.append(Holder(hid, kind, source, start, stop))

    def received_piece(self, p: int, pg: int, spec, end: int) -> None:
        """A ``RECEIVE`` op's output is the received piece, which ``add_inputs`` prices (torch's
        receive buffer): its own tensor is taken back where it is held, from the op's forward to
        its backward (``add_holders`` holds it so, and every reader that reads it in its layout
        or keeps a copy in it reads it within), and no other holder's copy is."""
        nbytes, redundant = self.cached((pg, "received piece"), lambda: self.layout_prices(
            spec, [without_partial(s.output_layout) for s in self.groups[pg].strategies]))
        self.slot(pg, self.sched.forward(p), end, "activations", -nbytes, -redundant, -float(spec.nbytes))

    def add_inputs(self, op_group: list[int]) -> None:
        """The model's inputs, held all step: a data loader's share of the batch in the layout
        its consumer reads (a rank keeps only its sequences, or its slice of them); the rest
        whole on every rank."""
        n = self.mesh.num_devices
        loaded = self.graph.loaded_inputs
        for name, spec in self.graph.tensors.items():
            if spec.kind is not TensorKind.INPUT:
                continue
            if name in self.graph.made_inputs:
                self.constants.append(Constant(*self.made_span(name), "activations", spec.nbytes,
                                               spec.nbytes * (1 - 1 / n), spec.nbytes))
                continue
            if name not in loaded:
                self.constants.append(Constant(0, self.sched.optimizer, "activations", spec.nbytes,
                                               spec.nbytes * (1 - 1 / n), spec.nbytes))
                continue
            i, j = loaded[name]
            gid = op_group[i]
            prices = self.cached((gid, "loaded", j), lambda spec=spec, gid=gid, j=j: self.layout_prices(
                spec, [s.input_layouts[j] for s in self.groups[gid].strategies]))
            if name in self.graph.received and self.torch_pipeline:
                self.receive_buffers(gid, prices, spec.nbytes)
            else:
                self.slot(gid, 0, self.sched.optimizer, "activations", *prices, spec.nbytes)

    def made_span(self, name: str) -> tuple[int, int]:
        """Where a made input lives: from its first reader's forward to its last reader's
        forward, or to the backward of a reader that keeps it."""
        S, uses = self.sched, self.graph.consumers[name]
        ends = [S.backward(i) if j in self.graph.ops[i].saves_inputs else S.forward(i) for i, j in uses]
        return S.forward(uses[0][0]), max(ends)

    def add_framework_buffers(self) -> None:
        """DistributedDataParallel's gradient buckets: every parameter's gradient once more,
        allocated when DDP wraps the model and kept all step (the ``ddp`` baselines replicate
        every parameter; any ``bucket_cap_mb`` allocates them all). Under its default
        ``gradient_as_bucket_view=False`` besides the gradients; under ``True`` they are them."""
        if self.framework not in DDP_FRAMEWORKS:
            return
        n, grad_bytes = self.mesh.num_devices, self.graph.precision.grad_bytes
        buckets = sum(self.graph.tensors[p].numel for p in self.graph.parameters) * grad_bytes
        self.constants.append(Constant(0, self.sched.optimizer, "gradients", buckets, buckets * (1 - 1 / n), buckets))


def receive_time(op: Op) -> KernelTime | None:
    """A ``RECEIVE`` op's seconds: none (the piece torch received, as it is); a
    ``FUSED_GATHER``'s: none (the all-gather writes the buffer the fused GEMM reads, whose one
    input gradient needs no sum); None for another op."""
    return KernelTime(0.0, 0.0) if op.kind in (RECEIVE, FUSED_GATHER) else None


def build_problem(graph: Graph, mesh: Mesh, shared_layers: bool = True, micro_batches: int = 1,
                  zero3_unit: str = "op", recompute: str = "none", framework: str = MEMSHARD,
                  stage: PipelineStage | None = None, received_layouts: dict[str, Layout] | None = None) -> Problem:
    """``graph`` describes one micro-batch; a step runs ``micro_batches`` of them (gradient
    accumulation) and one optimizer update. ``zero3_unit``: see :class:`LayerUnit`;
    ``recompute``: which ops may be replayed (``recompute.RECOMPUTE_POLICIES``); ``stage``: the
    problem of that pipeline stage's rank (its graph, cut from ``graph`` unless ``graph`` is a
    stage's already, and the micro-batches it holds); ``received_layouts``: the layout the stage
    receives each of these tensors in (``Graph.received``), the others chosen by the search."""
    if stage is not None:
        if not 1 <= stage.held_micro_batches <= micro_batches:
            raise MemshardError(f"a pipeline stage holds 1 to {micro_batches} micro-batches (the step's), "
                                f"not {stage.held_micro_batches}")
        if not (graph.received or graph.sent):  # (a stage's graph, rebuilt for a framework, is cut already)
            graph = graph.pipeline_stage(stage.first_layer, stage.end_layer)
    if zero3_unit not in ZERO3_UNITS:
        raise MemshardError(f"the ZeRO-3 gather unit must be one of {', '.join(ZERO3_UNITS)}, got {zero3_unit!r}")
    if framework not in FRAMEWORKS:
        raise MemshardError(f"the framework must be one of {', '.join(FRAMEWORKS)}, got {framework!r}")
    if recompute not in RECOMPUTE_POLICIES:
        raise MemshardError(f"recompute must be one of {', '.join(RECOMPUTE_POLICIES)}, got {recompute!r}")
    graph = framework_graph(graph, framework)
    b = _Builder(graph, mesh, shared_layers, micro_batches, zero3_unit, recompute, framework,
                 1 if stage is None else stage.held_micro_batches)
    b.received_layouts = dict(received_layouts or {})
    op_group = b.add_ops()
    b.op_slots(op_group)
    b.received_gradients(op_group)
    edge_of_input = b.add_edges(op_group)
    for edge in b.edges:
        edge.executions = edge.instances * micro_batches
    storage_group = StoragePricing(b).add_storage(op_group)
    b.accumulated_contributions(storage_group)
    b.add_inputs(op_group)
    b.add_framework_buffers()
    return Problem(
        graph=graph, mesh=mesh, schedule=b.sched, shared_layers=shared_layers, groups=b.groups,
        links=b.links, edges=b.edges, slots=b.slots, held=b.held, holders=b.holders,
        constants=b.constants, candidate_points=candidate_points(
            graph, b.sched, shared_layers, prefetch=max(explicit_prefetch(framework), framework in FSDP2_FRAMEWORKS)),
        op_group=op_group, micro_batches=micro_batches, edge_of_input=edge_of_input,
        storage_group=storage_group, reshard_points=b.add_reshard_points(edge_of_input),
        zero3_unit=zero3_unit, recompute=recompute, conflicts=b.conflicts, framework=framework,
        shared_gradients=b.shared_gradients(op_group, edge_of_input), stage=stage,
    )
