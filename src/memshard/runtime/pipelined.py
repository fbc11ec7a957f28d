"""One rank of a pipelined plan: torch.distributed.pipelining's schedule around memshard's executor.

:func:`train_pipelined` is :func:`memshard.runtime.train.train` for a
:class:`~memshard.plans.pipelined.PipelinedPlan`; ``memshard run`` and the torchrun worker
(``python -m memshard.runtime.train --plan pp.json``) call it. It composes as it does because
each piece is the one the plan's model describes:

- **Ranks.** The world ``DeviceMesh`` is the plan's mesh, pipeline axis first. A rank's stage
  is its pipeline coordinate (with several stages per rank, the stages the schedule places
  there: ``PipelinedPlan.stage_ranks``, s mod p); the other axes are the stage's mesh, on which
  the stage's own plan runs. Where the stages lie on another view of the stage's devices (a node of 8 as
  2 × 4 …: ``PipelinedPlan.typed_stage_mesh``), the plan's mesh is the pipeline axis and the
  view's axes, so the world mesh lays each stage out on its view, as ``train`` lays an
  unpipelined plan out on its view. Point-to-point goes between ranks of neighbouring stages.
- **A stage's model** is memshard's executor (``ShardedGraphModel``) on the stage's graph under
  the stage's plan: its sharding, ZeRO storage and recomputation, exactly as an ordinary plan
  runs. Parameters are initialised from their names and the seed (``executor.init_parameter``),
  so a stage holds the values the one-process model of the whole graph starts from.
- **The schedule** is torch's: the stage is wrapped in torch's ``PipelineStage`` and run by
  ``Schedule1F1B`` or ``ScheduleGPipe`` with the plan's micro-batches, ``return_outputs=False``
  as torchtitan calls it; a rank of several stages wraps each and ``ScheduleInterleaved1F1B``
  runs them all (a :class:`Chunk` per stage, one optimizer and one meter over them). Its receive buffers (one per micro-batch, kept), its kept outputs and
  its pending sends are what the stage's memory model counts (docs/design.md "Pipeline stages").
  The stage's shapes are given to torch (static metadata): torch's shape inference would run a
  forward and a backward through the executor, accumulating gradients and reducing them.
- **The boundary.** A stage sends the tensor its last op makes, in that op's layout on the
  stage mesh (partial sums summed first); the next stage receives it in the layout of its
  ``RECEIVE`` op (``Graph.pipeline_stage``), which the planner fixes to the sent one
  (``pipelining.plan_pipelined``). So each rank sends its piece to the rank at the same stage
  coordinate, torch's own send and receive, and the gradient comes back the same way; a plan
  whose layouts differ there is refused in one line. The received piece (torch's buffer) is the
  ``RECEIVE`` op's output itself; the stage's readers reshard it as the plan says.
- **The loss.** The graph computes its own loss (its cross-entropy op reads the labels, a model
  input, in the layout its plan gives it), so the labels reach the last stage as a model input:
  a keyword argument of the schedule's ``step``, cut into micro-batches as torch cuts any
  input. Torch's ``loss_fn`` hands back what the stage returned (the loss); its ``target``, which
  torch requires on the last stage, is the same labels.
- **Gradient reduction.** Torch's stage runs a backward per micro-batch and says which is the
  last (``last_backward``), as it tells FSDP: the stage turns the executor's gradient sync on for
  that backward only, so the ZeRO-0/1 reductions run once per step, when the last backward ends
  (``loop.py``'s loop). ``scale_grads=False``: the gradients are the sum over micro-batches, as
  ``train.py``'s loop makes them. A parameter two stages hold (a tied embedding and head) has its
  gradient summed over them before the optimizer step, as Megatron-LM sums its embedding's.
- **Measurement.** As ``train.py``: ``LeanAdam``, the last of ``steps`` steps measured by
  ``MemoryMeter`` (torch's receive buffers, made in the first step, handed to it) and
  ``CommCounter`` (collectives); the point-to-point bytes the rank sends are counted by its
  stage (``report.P2P``), against the plan's activations times micro-batches. A rank of several
  stages is predicted its ``PipelinedPlan.rank_peaks`` entry and the sums of its stages' bytes.

Out of scope: the zero-bubble schedules (``UNRUN`` says why), traced modules, and
``memshard simulate`` (torch's stage moves its shapes and tensors by point-to-point, which
the fake process group does not).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from memshard.core.errors import MemshardError
from memshard.core.graph import RECEIVE, Origin, TensorKind
from memshard.core.placement import Layout, Shard, format_layout
from memshard.plans.plan import runnable
from memshard.problem.memory import param_layout, tensor_bytes
from memshard.runtime.executor import GraphModel, ShardedGraphModel, Shares, make_batch
from memshard.runtime.launch import die_if_asked
from memshard.runtime.measure import CommCounter, MemoryMeter
from memshard.runtime.ops import KERNELS, KernelTable
from memshard.runtime.optim import LeanAdam
from memshard.runtime.parallel import parallelize
from memshard.runtime.report import P2P, measured_figures, predicted_figures
from memshard.runtime.reshard import without_partial
from memshard.runtime.stores import compute_dtype

SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe, "interleaved-1f1b": ScheduleInterleaved1F1B}
# The schedules the runtime refuses, and why (docs/pipelining.md, "Running a pipelined plan")
ZERO_BUBBLE_WHY = (": torch's split backward (stage_backward_input, then stage_backward_weight) over memshard's "
                   "executor gives weight gradients other than the one-process run's, and torch's MemTracker cannot "
                   "measure its autograd.grad")
UNRUN = {"interleaved-zb": ZERO_BUBBLE_WHY, "zbv": ZERO_BUBBLE_WHY}
# memshard's kernels and a stage's RECEIVE op: its output is the received piece itself
STAGE_KERNELS = KernelTable({**KERNELS.kernels, RECEIVE: lambda ctx, x: x})

Box = tuple[tuple[int, int], ...]  # per dim of a tensor: (start, length)


# -- what crosses a stage boundary ------------------------------------------------------------
@dataclass(frozen=True)
class StageEnds:
    """How a stage meets its neighbours: the tensor it receives (None on the first stage) and
    its ``RECEIVE`` op's layout, which its gradient goes back in too; the tensor it sends (None
    on the last) and its layout, partial sums summed."""

    received: str | None
    received_layout: Layout | None
    sent: str | None
    sent_layout: Layout | None


def stage_ends(plan) -> StageEnds:
    """A stage plan's :class:`StageEnds`, or one MemshardError line where the runtime cannot
    run the stage: several tensors in or out."""
    problem, selection = plan.problem, plan.selection
    graph = problem.graph
    if len(graph.received) > 1 or len(graph.sent) > 1:
        raise MemshardError(f"stage {graph.name} receives or sends several tensors: the runtime runs stages that "
                            "pass one tensor on")
    sent = next(iter(graph.sent), None)
    if sent is not None and sent != graph.loss:
        raise MemshardError(f"stage {graph.name} sends a tensor other than its last op's output")
    received, layout = next(iter(graph.received), None), None
    if received is not None:
        ((i, j),) = graph.consumers[received]  # its RECEIVE op (``Graph.pipeline_stage``)
        layout = problem.strategy(selection, problem.op_group[i]).input_layouts[j]
    sent_layout = None
    if sent is not None:
        producer = graph.producer[sent]
        sent_layout = without_partial(problem.strategy(selection, problem.op_group[producer]).output_layout)
    return StageEnds(received, layout, sent, sent_layout)


def check_boundaries(ends: list[StageEnds]) -> None:
    """One MemshardError line where a stage does not receive what the stage before sends, in
    the layout it sends it in (the runtime passes each rank's piece as it is)."""
    for k, (a, b) in enumerate(zip(ends, ends[1:])):
        if a.sent != b.received:
            raise MemshardError(f"stage {k} sends {a.sent} and stage {k + 1} receives {b.received}")
        if a.sent_layout != b.received_layout:
            raise MemshardError(f"stage {k} sends {a.sent} in layout {format_layout(a.sent_layout)} and stage {k + 1} "
                                f"receives it in {format_layout(b.received_layout)}: the runtime passes each piece as "
                                "it is (plan it again: memshard plan receives as the stage before sends)")


def box(shape: tuple[int, ...], layout: Layout, mesh_shape: tuple[int, ...], coords: tuple[int, ...]) -> Box:
    """The part of a tensor of ``shape`` that the rank at ``coords`` holds in ``layout``: a dim
    split over several axes is split in axis order, each piece as ``torch.chunk`` cuts it (as
    DTensor and the executor cut it)."""
    out = []
    for d, n in enumerate(shape):
        start = 0
        for a, placement in enumerate(layout):
            if isinstance(placement, Shard) and placement.dim == d:
                size = -(-n // mesh_shape[a])
                start += coords[a] * size
                n = max(0, min(size, n - coords[a] * size))
        out.append((start, n))
    return tuple(out)


def _overlap(a: Box, b: Box) -> Box | None:
    out = []
    for (s, n), (t, m) in zip(a, b):
        lo, hi = max(s, t), min(s + n, t + m)
        if hi <= lo:
            return None
        out.append((lo, hi - lo))
    return tuple(out)


def routes(shape: tuple[int, ...], source: Layout, target: Layout,
           mesh_shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...], Box]]:
    """(sender coordinate, receiver coordinate, the part of the tensor it sends it) for a tensor
    held in ``source`` on one stage mesh and read in ``target`` on another of the same shape.
    Each receiver takes each part from the one sender that agrees with it on the axes
    ``source`` does not split (where the layouts agree: from the rank at its own coordinate)."""
    split = [a for a, p in enumerate(source) if isinstance(p, Shard)]
    out = []
    for receiver in itertools.product(*(range(n) for n in mesh_shape)):
        wanted = box(shape, target, mesh_shape, receiver)
        for choice in itertools.product(*(range(mesh_shape[a]) for a in split)):
            sender = list(receiver)
            for a, c in zip(split, choice):
                sender[a] = c
            part = _overlap(box(shape, source, mesh_shape, tuple(sender)), wanted)
            if part is not None and all(n for _, n in part):
                out.append((tuple(sender), receiver, part))
    return out


@dataclass(frozen=True)
class Link:
    """One message of a boundary, as one rank sees it: the peer's global rank and the part of
    the local tensor (slices of this rank's piece) it carries."""

    peer: int
    part: tuple[slice, ...]
    whole: bool  # the part is the whole local piece (sent or received in place)


def _links(shape, source: Layout, target: Layout, mesh_shape, me: tuple[int, ...], sending: bool,
           peer_rank: Callable[[tuple[int, ...]], int]) -> tuple[Link, ...]:
    """This rank's messages of a boundary: those it sends (``sending``: held in ``source``) or
    receives (read in ``target``), with their parts relative to its own piece."""
    mine = box(shape, source if sending else target, mesh_shape, me)
    out = []
    for sender, receiver, part in routes(shape, source, target, mesh_shape):
        if (sender if sending else receiver) != me:
            continue
        local = tuple(slice(s - m, s - m + n) for (s, n), (m, _) in zip(part, mine))
        out.append(Link(peer_rank(receiver if sending else sender), local, part == mine))
    return tuple(out)


# -- torch's stage around the executor ---------------------------------------------------------
class StageModule(nn.Module):
    """The module torch's ``PipelineStage`` runs: the executor on the stage's graph. The first
    stage takes its data inputs (their shares) as arguments; the others the received piece,
    and their data inputs (the labels) as keywords."""

    def __init__(self, model: ShardedGraphModel, ends: StageEnds, data: tuple[str, ...]):
        super().__init__()
        self.model, self.ends, self.data = model, ends, data

    def forward(self, *tensors: torch.Tensor, **data: torch.Tensor) -> torch.Tensor:
        if self.ends.received is None:
            return self.model(Shares(zip(self.data, tensors)))
        (piece,) = tensors
        mine = {name: value for name, value in data.items() if name in self.data}  # (a rank's stages share them)
        # (a callable: the executor reads it as it is, no copy of its own: ``executor.load``)
        return self.model(Shares(mine, **{self.ends.received: lambda: piece}))


class Stage(PipelineStage):
    """Torch's ``PipelineStage`` (its own send and receive over the pipeline axis's group) with
    gradient sync on for the last backward only, its sent bytes counted (``sent_bytes``), and
    the fault tests' mid-schedule death (``launch.die_if_asked``)."""

    def __init__(self, module: StageModule, index: int, stages: int, device: torch.device, group,
                 shapes: tuple[torch.Tensor, torch.Tensor], micro_batches: int):
        super().__init__(module, index, stages, device, input_args=shapes[0], output_args=shapes[1], group=group)
        self.model = module.model
        self.micro_batches = micro_batches
        self.sent_bytes = 0
        self.step_index = 0

    def _counted(self, ops: list[dist.P2POp]) -> list[dist.P2POp]:
        self.sent_bytes += sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
        return ops

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self._counted(super().get_fwd_send_ops(fwd_chunk_id))

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return self._counted(super().get_bwd_send_ops(bwd_chunk_id))

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        self.model.set_requires_gradient_sync(last_backward)
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)

    def forward_one_chunk(self, fwd_chunk_id: int, args, kwargs=None, save_forward_output: bool = True):
        if fwd_chunk_id == self.micro_batches // 2:
            die_if_asked(dist.get_rank(), self.step_index)
        return super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)

    def receive_buffers(self) -> list[torch.Tensor]:
        """The buffers torch receives into, made at the first step and kept: the input's and the
        output gradient's, one per micro-batch."""
        infos = [*self.args_recv_info.values(), *(self.grad_recv_info or {}).values()]
        return [info.buffer for group in infos for info in group if getattr(info, "buffer", None) is not None]


# -- one rank ---------------------------------------------------------------------------------
def _stage_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Torch's ``loss_fn``: the loss the last stage's graph computed (``target``: its labels,
    already read by the graph)."""
    return output


@dataclass
class Chunk:  # (built by ``build_rank``)
    """One stage a rank runs: its index, plan, ends and executor, torch's stage around them,
    its data inputs, and the parameters another stage holds too."""

    index: int
    plan: object  # the stage's Plan, as the runtime runs it
    ends: StageEnds
    module: StageModule
    stage: Stage
    data: tuple[str, ...]
    ties: tuple[Tie, ...]

    @property
    def model(self) -> ShardedGraphModel:
        return self.module.model


@dataclass
class RankStage:  # (built by ``build_rank``)
    """What one rank runs: its stages (one, or several for the interleaved schedules), torch's
    schedule around them, its coordinate on the stage mesh, and its pipeline group."""

    chunks: tuple[Chunk, ...]
    schedule: object
    coordinate: tuple[int, ...]  # on the stage mesh
    pipeline_group: object
    rank: int  # on the pipeline axis
    last_rank: int  # the pipeline rank of the last stage

    @property
    def first(self) -> Chunk | None:
        """The model's first stage, where this rank runs it."""
        return next((c for c in self.chunks if c.ends.received is None), None)

    @property
    def last(self) -> Chunk | None:
        """The model's last stage, where this rank runs it."""
        return next((c for c in self.chunks if c.stage.is_last), None)

    @property
    def modules(self) -> nn.ModuleList:
        return nn.ModuleList([c.module for c in self.chunks])


def build_rank(plan, world: DeviceMesh, seed: int) -> RankStage:
    """This rank's stages of ``plan`` (a ``PipelinedPlan``) on ``world`` (its mesh, pipeline axis
    first), or one MemshardError line saying why the runtime cannot run it."""
    if plan.job.graph.origin is Origin.TRACED:
        raise MemshardError("a pipelined plan of a traced or Hugging Face model: the runtime runs the stages of "
                            "built-in models")
    if plan.schedule not in SCHEDULES:
        why = UNRUN.get(plan.schedule, "")
        raise MemshardError(f"the runtime runs the schedules {', '.join(SCHEDULES)}, not {plan.schedule}{why}")
    if tuple(world.shape) != plan.mesh.shape:
        raise MemshardError(f"device mesh {tuple(world.shape)} ≠ the pipelined plan's mesh {plan.mesh.shape}")
    plans = [runnable(stage.plan) for stage in plan.stages]
    for k, p in enumerate(plans):  # each stage on the plan's stage axes: its view, where it lies on one
        if p.problem.mesh.shape != plan.mesh.shape[1:]:
            raise MemshardError(f"stage {k}'s plan lies on mesh {p.problem.mesh}, not on the pipelined plan's stage "
                                f"axes {'x'.join(map(str, plan.mesh.shape[1:]))}")
    ends = [stage_ends(p) for p in plans]
    check_boundaries(ends)
    coords = tuple(world.get_coordinate())
    rank, me = coords[0], coords[1:]
    names = world.mesh_dim_names
    stage_mesh = world[names[1]] if len(names) == 2 else world[tuple(names[1:])]
    owners = plan.stage_ranks

    def rank_of(stage: int) -> Callable[[tuple[int, ...]], int]:
        return lambda c: int(world.mesh[(owners[stage], *c)].item())

    device = torch.device(world.device_type, torch.cuda.current_device()) if world.device_type == "cuda" \
        else torch.device(world.device_type)
    chunks = []
    for index in (s for s, r in enumerate(owners) if r == rank):
        mine, graph = plans[index], plans[index].problem.graph
        reference = GraphModel(graph, seed)
        reference.kernels = STAGE_KERNELS
        model = parallelize(reference, mine, stage_mesh)
        model.replicate_loss = index < len(plans) - 1  # a partial output is summed before it is sent
        data = tuple(n for n, t in graph.tensors.items() if t.kind is TensorKind.INPUT and n not in graph.received)
        module = StageModule(model, ends[index], data)
        stage = Stage(module, index, len(plans), device, world.get_group(0), _shapes(mine, ends[index], data, me),
                      plan.job.micro_batches)
        chunks.append(Chunk(index, mine, ends[index], module, stage, data,
                            _ties(plans, owners, index, me, rank_of, world.get_group(0))))
    kind = SCHEDULES[plan.schedule]
    schedule = kind(chunks[0].stage if len(chunks) == 1 and plan.stages_per_rank == 1 else [c.stage for c in chunks],
                    plan.job.micro_batches, loss_fn=_stage_loss, scale_grads=False)
    return RankStage(tuple(chunks), schedule, me, world.get_group(0), rank, owners[-1])


def _meta(shape: tuple[int, ...], layout: Layout, mesh_shape, me, dtype, grad: bool = False) -> torch.Tensor:
    lengths = tuple(n for _, n in box(shape, layout, mesh_shape, me))
    return torch.empty(lengths, dtype=dtype, device="meta", requires_grad=grad)


def _shapes(plan, ends: StageEnds, data: tuple[str, ...], me) -> tuple:
    """Torch's static metadata of the stage: its inputs (the first stage's data shares, or the
    received piece) and its output (the sent piece, or the loss), this rank's local shapes."""
    graph, mesh_shape = plan.problem.graph, plan.problem.mesh.shape
    dtype = compute_dtype(graph)
    if ends.received is None:
        inputs = tuple(_data_share(plan, name, torch.empty(graph.tensors[name].shape, device="meta"), me)
                       for name in data)
    else:
        inputs = (_meta(graph.tensors[ends.received].shape, ends.received_layout, mesh_shape, me, dtype, True),)
    if ends.sent is None:
        output = torch.empty((), dtype=torch.float32, device="meta")
    else:
        output = _meta(graph.tensors[ends.sent].shape, ends.sent_layout, mesh_shape, me, dtype, True)
    return inputs, output


def _data_share(plan, name: str, full: torch.Tensor, me) -> torch.Tensor:
    """This rank's share of a data input, as a data loader hands it out: the piece its one
    reader reads (``Graph.loaded_inputs``), or the whole input where several ops read it."""
    problem = plan.problem
    reader = problem.graph.loaded_inputs.get(name)
    if reader is None:
        return full
    i, j = reader
    layout = problem.strategy(plan.selection, problem.op_group[i]).input_layouts[j]
    part = box(tuple(full.shape), layout, problem.mesh.shape, me)
    return full[tuple(slice(s, s + n) for s, n in part)]


@dataclass(frozen=True)
class Tie:
    """A parameter this stage and one other hold (a tied embedding and head): its gradient is
    the sum of theirs. Where both stages store it alike, an all-reduce over the two (``group``);
    where both keep it whole on the stage mesh (ZeRO-0) in different layouts, each rank sends
    the other stage's ranks the parts of its gradient they hold (``send``, ``receive``)."""

    name: str
    group: object | None
    send: tuple[Link, ...] = ()
    receive: tuple[Link, ...] = ()


def _ties(plans, owners: tuple[int, ...], index: int, me, rank_of, pipeline_group) -> tuple[Tie, ...]:
    """This stage's :class:`Tie` s, or one MemshardError line for a parameter the runtime cannot
    sum: held by more than two stages, by two stages of one rank, or stored by ZeRO stages 1–3
    in different layouts. ``owners``: each stage's pipeline rank."""
    out = []
    for name in plans[index].problem.graph.parameters:
        having = tuple(s for s, p in enumerate(plans) if name in p.problem.graph.parameters)
        if len(having) == 1:
            continue
        if len({owners[s] for s in having}) < len(having):
            raise MemshardError(f"stages {', '.join(map(str, having))} hold {name} on one rank: the runtime sums a "
                                "tied weight's gradients over two ranks")
        storage = {s: _storage(plans[s], name) for s in having}
        if len(set(storage.values())) == 1 and len(having) == 2 and len(set(owners)) == 2:
            out.append(Tie(name, pipeline_group))  # (the pipeline group is the two ranks)
            continue
        if len(having) > 2 or any(stage for _, stage, _ in storage.values()):
            raise MemshardError(f"stages {', '.join(map(str, having))} hold {name} in different layouts or more than "
                                "two stages hold it: the runtime sums a tied weight's gradients over two stages, "
                                "stored alike or whole on each stage mesh")
        (other,) = (s for s in having if s != index)
        shape, mesh_shape = plans[index].problem.graph.tensors[name].shape, plans[index].problem.mesh.shape
        mine, theirs = storage[index][0], storage[other][0]
        out.append(Tie(name, None, _links(shape, mine, theirs, mesh_shape, me, True, rank_of(other)),
                       _links(shape, theirs, mine, mesh_shape, me, False, rank_of(other))))
    return tuple(out)


def _storage(plan, name: str) -> tuple[Layout, int, tuple[int, ...]]:
    """(compute layout, ZeRO stage, storage axes) of a parameter under a stage's plan."""
    problem = plan.problem
    gid = problem.storage_group[name]
    grad, option = problem.groups[gid].options[plan.selection.choices[gid]]
    return param_layout(grad), option.stage, option.axes


def sum_tied_gradients(model: ShardedGraphModel, ties: tuple[Tie, ...]) -> None:
    """Each tied parameter's reduced gradient on this stage, plus the other stage's."""
    for tie in ties:
        store = model.stores[tie.name]
        local = store.opt.grad.to_local()
        if tie.group is not None:
            dist.all_reduce(local, group=tie.group)
            continue
        piece = local.view(store.local_shape)
        parts = [piece.new_empty(piece[link.part].shape) for link in tie.receive]
        ops = [dist.P2POp(dist.isend, piece if link.whole else piece[link.part].contiguous(), link.peer)
               for link in tie.send]
        ops += [dist.P2POp(dist.irecv, part, link.peer) for part, link in zip(parts, tie.receive)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        with torch.no_grad():
            for part, link in zip(parts, tie.receive):
                piece[link.part] += part


def train_pipelined(plan, device_mesh: DeviceMesh, steps: int = 2, seed: int = 0, lr: float = 1e-3) -> dict:
    """Run ``steps`` steps of this rank's stages of ``plan`` (a ``PipelinedPlan``) on
    ``device_mesh`` (the world mesh, pipeline axis first); measure the last one. Returns this
    rank's report in ``train``'s shape, plus its ``stage`` (a list where it runs several) and the
    point-to-point bytes (``report.P2P``) predicted and measured; the losses are the whole
    model's, on every rank."""
    if steps < 2:
        raise MemshardError("run at least 2 steps: the last one is measured with optimizer states in place")
    rank = build_rank(plan, device_mesh, seed)
    chunks, last = rank.chunks, rank.last
    optimizer = LeanAdam(list(itertools.chain.from_iterable(c.model.parameters() for c in chunks)), lr=lr)
    modules = rank.modules
    losses, times = [], []
    for step in range(steps):
        measured = step == steps - 1
        buffers = [b for c in chunks for b in c.stage.receive_buffers()]
        meter = MemoryMeter(modules, optimizer, *buffers) if measured else None
        counter = CommCounter()
        args, kwargs = _step_inputs(rank, plan, seed + step)  # the data loader's read: not measured
        held: list[torch.Tensor] = []
        start = time.perf_counter()
        with meter or nullcontext(), counter if measured else nullcontext():
            for c in chunks:
                c.stage.step_index, c.stage.sent_bytes = step, 0
                c.model.step = step
                c.model.watch_gradients(meter.mark_gradient if measured else None)
            rank.schedule.step(*args, target=kwargs[last.data[0]] if last is not None else None,
                               losses=held if last is not None else None, return_outputs=False, **kwargs)
            for c in chunks:
                sum_tied_gradients(c.model, c.ties)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        losses.append(_step_loss(rank, held, plan.job.micro_batches))
    return {
        "rank": dist.get_rank(),
        "coordinate": list(device_mesh.get_coordinate()),
        "stage": chunks[0].index if len(chunks) == 1 else [c.index for c in chunks],
        "strategy": plan.strategy,
        "losses": losses,
        "step_times_s": times,
        "predicted": {**_predicted(plan, rank), P2P: sum(predicted_sends(c.plan, c.ends, plan.job.micro_batches)
                                                          for c in chunks)},
        "measured": {**measured_figures(meter, counter), P2P: sum(c.stage.sent_bytes for c in chunks)},
    }


def _predicted(plan, rank: RankStage) -> dict:
    """The rank's predicted figures: its stage plan's, or over its several stages the rank's
    peak (``PipelinedPlan.rank_peaks``), the stages' breakdowns at their own peaks summed, and
    their collectives summed."""
    if len(rank.chunks) == 1 and plan.stages_per_rank == 1:
        return predicted_figures(rank.chunks[0].plan)
    figures = [predicted_figures(c.plan) for c in rank.chunks]
    return {
        "peak_bytes": plan.rank_peaks[rank.rank],
        "breakdown": {k: sum(f["breakdown"][k] for f in figures) for k in figures[0]["breakdown"]},
        "communication_bytes": sum(f["communication_bytes"] for f in figures),
        "communication_by_kind": {k: sum(f["communication_by_kind"][k] for f in figures)
                                  for k in figures[0]["communication_by_kind"]},
    }


def _step_inputs(rank: RankStage, plan, seed: int) -> tuple[tuple, dict]:
    """This rank's data for a step: the global batch's micro-batches, drawn alike on every rank
    (``make_batch`` of the whole graph: the one process's numbers), each cut to this rank's
    share and stacked along the first dim, which torch cuts back into the micro-batches. The
    first stage takes them as arguments, the last (the labels) as keywords."""
    batches = make_batch(plan.job.graph, plan.job.micro_batches, seed, rank.chunks[0].model.device)

    def stacked(chunk: Chunk) -> dict[str, torch.Tensor]:
        return {name: torch.cat([_data_share(chunk.plan, name, b[name], rank.coordinate) for b in batches])
                for name in chunk.data}

    first, last = rank.first, rank.last
    args = tuple(stacked(first).values()) if first is not None else ()
    return args, stacked(last) if last is not None and last is not first else {}


def _step_loss(rank: RankStage, held: list[torch.Tensor], micro_batches: int) -> float:
    """The step's loss (the mean over its micro-batches), from the last stage's rank to every
    rank (outside the measured step)."""
    value = torch.zeros(1, dtype=torch.float64, device=rank.chunks[0].model.device)
    if rank.last is not None:
        value += sum(rank.last.model.loss_value(loss) for loss in held) / micro_batches
    dist.broadcast(value, group=rank.pipeline_group, group_src=rank.last_rank)
    return float(value.item())


def predicted_sends(plan, ends: StageEnds, micro_batches: int) -> float:
    """The bytes a rank of this stage sends per step by point-to-point: each micro-batch's
    activations on (its piece in its plan's layout), and the gradient of what it received back."""
    graph, mesh = plan.problem.graph, plan.problem.mesh
    out = 0.0
    if ends.sent is not None:
        out += tensor_bytes(graph.tensors[ends.sent], ends.sent_layout, mesh)
    if ends.received is not None:
        out += tensor_bytes(graph.tensors[ends.received], ends.received_layout, mesh)
    return out * micro_batches
