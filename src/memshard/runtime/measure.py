"""What one rank really does in a training step: collectives sent and memory held.

This module owns the measuring side of memshard's verification
(docs/verification.md); nothing here knows about plans.

- :class:`CommCounter` is a ``TorchDispatchMode`` that records every collective issued while
  it is active: the c10d ops (``torch.ops.c10d.*``, what ``torch.distributed.all_reduce`` and
  FSDP2 call), the functional collectives (``torch.ops._c10d_functional*``, what DTensor
  calls) and DTensor's ``shard_dim_alltoall``. Each call gets a memshard kind, its group size
  ``m`` and its buffer ``B`` as :mod:`memshard.problem.comm` defines them (all-gather: the
  gathered output; reduce-scatter: the input; all-reduce: the buffer; all-to-all: the local
  buffer), and the bytes one device sends, ``(m−1)/m · B`` (twice that for all-reduce), the
  formula of :func:`memshard.problem.comm.wire_bytes`; broadcast, reduce, gather and scatter get
  the same one-way formula (an average per device, not what the root sends). Sizes come from
  tensor metadata, so it works on real gloo/NCCL groups, on the ``fake`` process group and
  under ``FakeTensorMode`` (inside or around it). ``paused()`` leaves bookkeeping collectives
  out. DTensor on a CPU mesh turns ``Shard(i) → Shard(j)`` into an all-gather of the whole
  tensor plus a local chunk instead of an all-to-all; the counter records what ran.
- :class:`MemoryMeter` wraps ``torch.distributed._tools.mem_tracker.MemTracker`` to give one
  rank's peak bytes over a region and the breakdown by category *at the moment of that peak*.
  MemTracker keeps a snapshot at its peak, but with its categories as they stood then: a
  parameter's gradient is still "Temp" until the gradient hook fires after the allocation,
  and everything allocated inside ``optimizer.step`` is "Optstate", temporaries included.
  The meter therefore logs every storage's size changes and, on exit, replays the log,
  attributing each storage to its *final* category (an optimizer-step allocation counts as
  optimizer state only if it ends up in ``optimizer.state``). The log is written on every
  size change, not only after each op as MemTracker's own peak is, so a storage grown by
  ``resize_`` (FSDP2) counts at once. On CPU process groups (gloo) a collective's ``Work``
  keeps references to its tensors, and gloo's worker thread drops its own reference to the
  ``Work`` a moment after the collective completes, when it gets the GIL: a buffer only that
  ``Work`` still held would then be freed at a random later moment, several allocations
  after the wait, and one rank's peak would come out a few percent high in one run and not
  the next. The meter therefore waits, at each collective's wait, with the GIL released,
  until the ``Work`` is gone: its buffers are freed at the wait, on this thread, in every
  run, as under the fake process group. A functional collective's wait is its
  ``wait_tensor``; a c10d collective's is the first op after the caller dropped its handle
  (a blocking call drops it before it returns; one started beside the compute, once it has
  been waited): while the caller holds the ``Work`` nothing it holds can be freed, and the
  meter does not wait. The ops a ``Work.wait()`` runs on the caller's thread are the
  backend's, not the program's, and are not tracked: gloo's reduce-scatter all-reduces a
  copy of its input on its own thread and, in the wait, copies this rank's chunk of that
  copy into the output; the copy is gloo's buffer, as invisible to the meter as its others
  (and as the same collective's through ``wait_tensor``). MemTracker counts storages at
  ``numel · element_size`` on CPU (fake or real), rounded up to 512 bytes on CUDA; it counts
  DTensor local shards.
  Under ``FakeTensorMode`` the meter ignores the global-shape fake tensors DTensor's sharding
  propagation creates (MemTracker would count them). On CUDA the meter also records
  ``torch.cuda.max_memory_allocated`` over the region.
- :func:`init_fake_world` / :func:`destroy` set up the ``fake`` process group so one process
  plays one rank of a large job (``memshard simulate``).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn, optim
from torch._C._distributed_c10d import FakeWork
from torch._guards import active_fake_mode
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _UpdateType
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from memshard.problem.comm import ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, REDUCE_SCATTER

BROADCAST = "broadcast"
REDUCE = "reduce"
GATHER = "gather"
SCATTER = "scatter"

PARAMETERS = "parameters"
GRADIENTS = "gradients"
OPTIMIZER_STATES = "optimizer_states"
ACTIVATIONS = "activations"
TRANSIENTS = "transients"
CATEGORIES = (PARAMETERS, GRADIENTS, OPTIMIZER_STATES, ACTIVATIONS, TRANSIENTS)

__all__ = [
    "CATEGORIES",
    "CommCall",
    "CommCounter",
    "MemoryMeter",
    "destroy",
    "init_fake_world",
]


# --------------------------------------------------------------------------- collectives


@dataclass(frozen=True)
class _Spec:
    kind: str
    buffer_arg: str  # schema name of the tensor (list) whose bytes are B
    times_group: bool = False  # B is that argument's bytes times the group size


_FUNCTIONAL: dict[str, _Spec] = {
    "all_reduce": _Spec(ALL_REDUCE, "input"),
    "all_reduce_": _Spec(ALL_REDUCE, "input"),
    "all_reduce_coalesced": _Spec(ALL_REDUCE, "inputs"),
    "all_reduce_coalesced_": _Spec(ALL_REDUCE, "inputs"),
    "all_gather_into_tensor": _Spec(ALL_GATHER, "input", times_group=True),
    "all_gather_into_tensor_out": _Spec(ALL_GATHER, "input", times_group=True),
    "all_gather_into_tensor_coalesced": _Spec(ALL_GATHER, "inputs", times_group=True),
    "reduce_scatter_tensor": _Spec(REDUCE_SCATTER, "input"),
    "reduce_scatter_tensor_out": _Spec(REDUCE_SCATTER, "input"),
    "reduce_scatter_tensor_coalesced": _Spec(REDUCE_SCATTER, "inputs"),
    "all_to_all_single": _Spec(ALL_TO_ALL, "input"),
    "broadcast": _Spec(BROADCAST, "input"),
    "broadcast_": _Spec(BROADCAST, "input"),
}

_C10D: dict[str, _Spec] = {
    "allreduce_": _Spec(ALL_REDUCE, "tensors"),
    "allreduce_coalesced_": _Spec(ALL_REDUCE, "tensors"),
    "_allgather_base_": _Spec(ALL_GATHER, "output_tensor"),
    "allgather_": _Spec(ALL_GATHER, "output_tensors"),
    "allgather_coalesced_": _Spec(ALL_GATHER, "output_lists"),
    "allgather_into_tensor_coalesced_": _Spec(ALL_GATHER, "outputs"),
    "_reduce_scatter_base_": _Spec(REDUCE_SCATTER, "input_tensor"),
    "reduce_scatter_": _Spec(REDUCE_SCATTER, "input_tensors"),
    "reduce_scatter_tensor_coalesced_": _Spec(REDUCE_SCATTER, "inputs"),
    "alltoall_base_": _Spec(ALL_TO_ALL, "input"),
    "alltoall_": _Spec(ALL_TO_ALL, "input_tensors"),
    "broadcast_": _Spec(BROADCAST, "tensors"),
    "reduce_": _Spec(REDUCE, "tensors"),
    "gather_": _Spec(GATHER, "input_tensors", times_group=True),
    "scatter_": _Spec(SCATTER, "output_tensors", times_group=True),
}


def _collective_specs() -> dict[Any, _Spec]:
    """Overload packet → spec, for every collective op this torch build has."""
    table: dict[Any, _Spec] = {}
    sources: list[tuple[str, Mapping[str, _Spec]]] = [
        ("_c10d_functional", _FUNCTIONAL),
        ("_c10d_functional_autograd", _FUNCTIONAL),
        ("c10d", _C10D),
        ("_dtensor", {"shard_dim_alltoall": _Spec(ALL_TO_ALL, "input")}),
    ]
    for namespace, specs in sources:
        ns = getattr(torch.ops, namespace)
        for name, spec in specs.items():
            try:
                table[getattr(ns, name)] = spec
            except (AttributeError, RuntimeError):
                continue  # not in this build (or not registered yet)
    return table


def _nbytes(obj: Any) -> int:
    """Bytes of a tensor or a (nested) list of tensors, from metadata only."""
    if isinstance(obj, torch.Tensor):
        return int(obj.numel()) * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    return 0


def _group_size(group: Any) -> int:
    """Size of a group given as a name (functional ops) or a ProcessGroup (c10d ops)."""
    if isinstance(group, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        return int(_resolve_process_group(group).size())
    if isinstance(group, torch.ScriptObject):
        return int(dist.ProcessGroup.unbox(group).size())
    return int(group.size())


def _bind(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """An op call's arguments by schema name."""
    bound: dict[str, Any] = {}
    for i, arg in enumerate(func._schema.arguments):
        if i < len(args) and not arg.kwarg_only:
            bound[arg.name] = args[i]
        elif arg.name in kwargs:
            bound[arg.name] = kwargs[arg.name]
    return bound


@dataclass(frozen=True)
class CommCall:
    """One collective as one rank saw it."""

    op: str  # the op overload, e.g. "_c10d_functional.all_gather_into_tensor.default"
    kind: str  # memshard.problem.comm's kind names, or "broadcast", "reduce", "gather", "scatter"
    group_size: int
    buffer_bytes: int
    wire_bytes: float  # bytes this device sends: (m−1)/m · B, ×2 for all-reduce


def _wire_bytes(kind: str, m: int, buffer_bytes: int) -> float:
    factor = 2.0 if kind == ALL_REDUCE else 1.0
    return factor * (m - 1) / m * buffer_bytes


class CommCounter(TorchDispatchMode):
    """Records every collective issued while active (see the module docstring).

    Usage::

        with CommCounter() as comm:
            step()
            with comm.paused():
                dist.all_reduce(loss)  # bookkeeping, not counted
        comm.wire_bytes_by_kind, comm.calls_by_kind, comm.total_wire_bytes, comm.calls
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[CommCall] = []
        self._specs = _collective_specs()
        self._paused = 0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Collectives issued inside this block are not recorded."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def reset(self) -> None:
        self.calls.clear()

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar into local ops and collectives first
        spec = self._specs.get(func._overloadpacket)
        if spec is not None and not self._paused:
            self.calls.append(self._record(func, spec, args, kwargs))
        return func(*args, **kwargs)

    def _record(
        self, func: Any, spec: _Spec, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> CommCall:
        bound = _bind(func, args, kwargs)
        if "group_size" in bound:
            m = int(bound["group_size"])
        elif "process_group" in bound:
            m = _group_size(bound["process_group"])
        else:
            m = _group_size(bound["group_name"])
        nbytes = _nbytes(bound[spec.buffer_arg]) * (m if spec.times_group else 1)
        return CommCall(str(func), spec.kind, m, nbytes, _wire_bytes(spec.kind, m, nbytes))

    @property
    def wire_bytes_by_kind(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for c in self.calls:
            out[c.kind] = out.get(c.kind, 0.0) + c.wire_bytes
        return out

    @property
    def calls_by_kind(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.calls:
            out[c.kind] = out.get(c.kind, 0) + 1
        return out

    @property
    def wire_bytes_by_kind_and_group_size(self) -> dict[tuple[str, int], float]:
        out: dict[tuple[str, int], float] = {}
        for c in self.calls:
            key = (c.kind, c.group_size)
            out[key] = out.get(key, 0.0) + c.wire_bytes
        return out

    @property
    def total_wire_bytes(self) -> float:
        return sum(c.wire_bytes for c in self.calls)


# --------------------------------------------------------------------------------- memory


@contextlib.contextmanager
def _flag_sharding_propagation(tracker: _LoggingMemTracker) -> Iterator[None]:
    """Raise ``tracker.propagating`` while DTensor runs sharding propagation.

    To learn an op's output shape DTensor runs it on fake tensors of the *global* shapes,
    under ``detect_fake_mode() or FakeTensorMode()``. MemTracker skips those ops by checking
    that the active fake mode is not the one it was entered under, which fails when the
    whole run is already under ``FakeTensorMode`` (memshard simulate): DTensor then reuses
    that mode and the global-shape tensors would count as this rank's memory.
    """
    from torch.distributed.tensor._sharding_prop import ShardingPropagator as Prop

    original = Prop._propagate_tensor_meta_non_cached

    @functools.wraps(original)
    def propagate(prop: Any, op_schema: Any) -> Any:
        tracker.propagating += 1
        try:
            return original(prop, op_schema)
        finally:
            tracker.propagating -= 1

    Prop._propagate_tensor_meta_non_cached = propagate  # type: ignore[method-assign]
    try:
        yield
    finally:
        Prop._propagate_tensor_meta_non_cached = original  # type: ignore[method-assign]


@contextlib.contextmanager
def _flag_work_waits(tracker: _LoggingMemTracker) -> Iterator[None]:
    """Note in ``tracker.waiting`` which threads are inside a ``Work.wait()`` called from
    Python: the ops it dispatches on that thread are the backend's own (gloo's reduce-scatter
    copies this rank's chunk of its internal copy of the input into the output there), not
    the program's."""
    original = dist.Work.wait

    @functools.wraps(original)
    def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
        thread = threading.get_ident()
        tracker.waiting[thread] = tracker.waiting.get(thread, 0) + 1
        try:
            return original(work, *args, **kwargs)
        finally:
            tracker.waiting[thread] -= 1

    dist.Work.wait = wait  # type: ignore[method-assign]
    try:
        yield
    finally:
        dist.Work.wait = original  # type: ignore[method-assign]


# A gloo worker thread drops its reference to a finished Work within microseconds once it runs
# and holds the GIL. After a wait the meter polls the Work's tensors until their reference
# counts have fallen and then held still for SETTLED_S (or, if the Work holds none of them,
# held still for SETTLE_MIN_S), and gives up after SETTLE_TIMEOUT_S.
SETTLED_S = 1e-3
SETTLE_MIN_S = 0.02
SETTLE_TIMEOUT_S = 0.5
_POLL_S = 5e-5
_WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor


def _on_gloo(args: Any, kwargs: Any) -> bool:
    """Whether a collective runs on gloo (the default group's backend) with real CPU tensors:
    not under the fake process group, fake or meta tensors, or NCCL."""
    if active_fake_mode() is not None or not dist.is_initialized() or dist.get_backend() != "gloo":
        return False
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    return bool(tensors) and all(t.device.type == "cpu" for t in tensors)


def _holders(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    """Per tensor: references to it and to its storage (a Work holds one or the other:
    gloo's all-gather holds chunks of its output, i.e. the storage)."""
    return [(t._use_count(), torch._C._storage_Use_Count(t.untyped_storage()._cdata)) for t in tensors]


class _HeldByWork:
    """The tensors of one collective (weakly): what its ``Work`` may hold until it is
    destroyed; for a c10d collective the ``Work`` itself, for a functional one its output."""

    def __init__(self, tracker: _LoggingMemTracker) -> None:
        self.tracker = tracker
        self.tensors: list[weakref.ref] = []
        self.work: Any = None
        self.output: weakref.ref | None = None

    @contextlib.contextmanager
    def released(self) -> Iterator[None]:
        """Run the block (the wait), then wait, with the GIL released, until the Work is gone:
        a buffer only it held is then freed when this block ends, on this thread. (Nothing to
        wait for when none of its tensors is left.)"""
        tensors = [t for ref in self.tensors if (t := ref()) is not None]
        before = _holders(tensors)  # the Work alive: the meter, the caller or the registry holds it
        self.work = None
        yield
        if tensors and not _settle(tensors, before):
            self.tracker.unsettled += 1
        del tensors  # the last references to buffers only the Work held: freed now, here


def _held_elsewhere(work: torch.ScriptObject) -> bool:
    """Whether Python code besides the meter holds a c10d ``Work`` (as ``dist.Work``, the
    handle pybind hands back for the same Work while that handle lives)."""
    handle = dist.Work.unbox(work)
    return sys.getrefcount(handle) > 2  # (``handle`` and the call's argument)


def _settle(tensors: list[torch.Tensor], before: list[tuple[int, int]]) -> bool:
    """Poll until the references have fallen below ``before`` and held still (see SETTLED_S)."""
    start = since = time.monotonic()
    last = None
    while True:
        now = time.monotonic()
        counts = _holders(tensors)
        if counts != last:
            last, since = counts, now
        fallen = any(c < b for held, was in zip(counts, before) for c, b in zip(held, was))
        if now - since >= (SETTLED_S if fallen else SETTLE_MIN_S):
            return True
        if now - start > SETTLE_TIMEOUT_S:
            return False
        time.sleep(_POLL_S)


def _output_tensors(result: Any) -> list[torch.Tensor]:
    """An op's output tensors in pytree order: a lone tensor, a flat tuple or list read
    directly, anything else flattened."""
    if isinstance(result, torch.Tensor):
        return [result]
    if type(result) in (tuple, list) and not any(isinstance(x, (tuple, list, dict)) for x in result):
        return [x for x in result if isinstance(x, torch.Tensor)]
    return [x for x in tree_leaves(result) if isinstance(x, torch.Tensor)]


class _LoggingMemTracker(MemTracker):
    """MemTracker that logs every change of a storage's tracked bytes, in order, and knows
    which storages are real optimizer state."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[Any, int]] = []  # (_WeakRefInfo, its bytes after the change)
        self.optimizer_state: set[Any] = set()  # _WeakRefInfo of tensors in optimizer.state
        self.propagating = 0  # depth inside DTensor's sharding propagation
        self.waiting: dict[int, int] = {}  # thread id → its depth inside a Work.wait() called from Python
        self._patches = contextlib.ExitStack()
        self._collectives = set(_collective_specs())
        self._works: dict[int, _HeldByWork] = {}  # id(functional collective's output) → its Work's hold
        self._c10d_works: list[_HeldByWork] = []  # c10d collectives not settled yet, in issue order
        self.unsettled = 0  # Works still alive after SETTLE_TIMEOUT_S (their buffers freed late)

    def __enter__(self) -> _LoggingMemTracker:
        if self._depth == 0:
            self._patches.enter_context(_flag_sharding_propagation(self))
            self._patches.enter_context(_flag_work_waits(self))
        super().__enter__()
        return self

    def __exit__(self, *args: Any) -> None:
        super().__exit__(*args)
        if self._depth == 0:
            self._patches.close()

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if self.propagating or self.waiting.get(threading.get_ident()):  # DTensor's propagation; a backend's wait
            return func(*args, **(kwargs or {}))
        if any(t == DTensor for t in types):
            return NotImplemented  # DTensor desugars into local ops first
        self.settle_c10d()
        if func._overloadpacket in self._collectives and _on_gloo(args, kwargs):
            return self._collective(func, args, kwargs)
        if func._overloadpacket is _WAIT_TENSOR:
            held = self._works.pop(id(args[0]), None)
            if held is not None and held.output is not None and held.output() is args[0]:
                with held.released():
                    return self._run_and_track(func, args, kwargs)
        return self._run_and_track(func, args, kwargs)

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        """A root module called again in forward is a new call, as a pipeline stage runs
        each micro-batch: its module stats start again (MemTracker refuses the call; the
        meter reads no module stats)."""
        tracker = self._mod_tracker
        name = tracker.get_known_fqn(module)
        if module in self.memory_tracking and not tracker.is_bw and set(tracker.parents) - {name} == {"Global"}:
            del self.memory_tracking[module]
        super()._pre_fw_hook(module, inputs)

    def _run_and_track(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> Any:
        """MemTracker's own dispatch for a local op: run it, then track its output tensors,
        in the order MemTracker visits them. Two things it also does are left out: the
        update of each module's peak after every op (the meter replays its log instead and
        reads no MemTracker peak), and the pytree rebuilt around the outputs."""
        if func is _WAIT_TENSOR.default and active_fake_mode():
            result = args[0]  # (MemTracker's stand-in for wait_tensor's meta kernel)
        else:
            result = func(*args, **(kwargs or {}))
        if active_fake_mode() is self._fake_mode_on_entry:  # not DTensor's propagation
            if self._in_opt:
                reftype = _MemRefType.OPT
            elif self._mod_tracker.is_bw and not self._in_ac:
                reftype = _MemRefType.TEMP
            else:
                reftype = _MemRefType.ACT
            for tensor in _output_tensors(result):
                self._track(reftype, tensor)
        return result

    def _collective(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> Any:
        """Issue the collective and remember its tensors, to settle its Work at its wait."""
        out = self._run_and_track(func, args, kwargs)
        held = _HeldByWork(self)
        held.tensors = [weakref.ref(t) for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        works = [w for w in tree_leaves(out) if isinstance(w, torch.ScriptObject)]
        if works:  # c10d: the caller waits on the Work it returns, then drops it (before the next op)
            held.work = works[0]
            self._c10d_works.append(held)
        elif isinstance(out, torch.Tensor):  # functional: the Work lives until wait_tensor(output)
            held.output = weakref.ref(out)
            self._works[id(out)] = held
        return out

    def settle_c10d(self) -> None:
        """Wait until the c10d collectives whose handle the caller has dropped (a blocking call
        waits and drops it before it returns; one started beside the compute, once waited) have
        released their Works. A Work the caller still holds stays pending: nothing it holds can
        be freed meanwhile."""
        if not self._c10d_works:
            return
        pending = []
        for held in self._c10d_works:
            if _held_elsewhere(held.work):
                pending.append(held)
                continue
            with held.released():
                pass
        self._c10d_works = pending

    def forget_works(self) -> None:
        """Settle what can be settled; forget the rest (Works the caller holds past the region)."""
        self.settle_c10d()
        self._c10d_works.clear()
        self._works.clear()

    def _update_snap(self, u_type: _UpdateType, winfo: Any, *args: Any, **kwargs: Any) -> None:
        super()._update_snap(u_type, winfo, *args, **kwargs)
        if u_type == _UpdateType.DEL:
            self.events.append((winfo, 0))
        elif u_type in (_UpdateType.ADD, _UpdateType.SIZE):
            self.events.append((winfo, winfo.mem_consumed))

    def _track_optimizer_states(self, reftype: Any, optimizer: optim.Optimizer) -> None:
        super()._track_optimizer_states(reftype, optimizer)
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    for st in get_untyped_storages(value):
                        winfo, _ = self._WINFO.get(st, (None, None))
                        if winfo is not None:
                            self.optimizer_state.add(winfo)

    def live(self) -> list[tuple[Any, int]]:
        """(winfo, bytes) of every tracked storage alive now."""
        return [
            (winfo, winfo.mem_consumed)
            for winfo, ref in list(self._WINFO.values())
            if ref() is not None and winfo.mem_consumed > 0
        ]


def _measured_device(
    module: nn.Module | None, device: torch.device | str | None
) -> torch.device | None:
    """The device asked for, else the module's first CUDA device; CUDA indices explicit."""
    dev = torch.device(device) if device is not None else None
    if dev is None and module is not None:
        dev = next((p.device for p in module.parameters() if p.device.type == "cuda"), None)
    if dev is not None and dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


class MemoryMeter:
    """One rank's peak memory over a region, broken down by category at the peak.

    ``MemoryMeter(module, optimizer, *tensors)`` tracks the module's parameters, buffers and
    gradients and the optimizer's states from the start; tensors created inside the region
    are tracked as they are allocated (so create the batch inside it to count it as an
    activation); ``tensors`` created before it count as transients. Use it as a context
    manager; each ``with`` block is one measurement. After the block:

    - ``peak_bytes``: the largest tracked total on the measured device;
    - ``breakdown``: the five categories of :data:`CATEGORIES` at that moment (they sum to
      ``peak_bytes``): parameters (MemTracker's Parameter), gradients (Gradient),
      optimizer_states (Optstate tensors held in ``optimizer.state``), activations
      (Activation: allocated in forward), transients (Temp, Buffer, Other, and
      optimizer-step temporaries);
    - ``category_peaks``: each category's own maximum over the region;
    - ``peak_bytes_by_device``: the peak of every device seen;
    - ``cuda_peak_bytes``: ``torch.cuda.max_memory_allocated`` over the region, or None;
    - ``unsettled``: gloo collectives whose ``Work`` outlived ``SETTLE_TIMEOUT_S`` after
      their wait (their buffers may have been freed late).

    ``device`` is the device measured; by default the module's CUDA device if it has one,
    else the device with the largest peak (CPU scalars such as Adam's ``step`` live beside
    CUDA tensors). CUDA is touched only when that device is CUDA and no ``FakeTensorMode``
    is active, so CPU runs in forked processes stay CUDA-free. ``cuda_peak_bytes`` also
    counts memory the tracker does not see (tensors made before the meter and not given to
    it, allocator-internal buffers). Enter the meter inside ``FakeTensorMode``, not around
    it: MemTracker tracks only ops under the fake mode it was entered in.
    """

    def __init__(
        self,
        module: nn.Module | None = None,
        optimizer: optim.Optimizer | None = None,
        *tensors: torch.Tensor,
        device: torch.device | str | None = None,
    ) -> None:
        self._tracker = _LoggingMemTracker()
        self._tracker.track_external(*(o for o in (module, optimizer, *tensors) if o is not None))
        self._device = _measured_device(module, device)
        self._start = 0
        self._cuda_device: int | None = None
        self.peak_bytes = 0
        self.breakdown: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self.category_peaks: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self.peak_bytes_by_device: dict[str, int] = {}
        self.cuda_peak_bytes: int | None = None
        self.unsettled = 0

    def __enter__(self) -> MemoryMeter:
        tracker = self._tracker
        tracker.reset_mod_stats()  # MemTracker refuses a second iteration of a known module
        tracker.events = list(tracker.live())  # the state at entry, then every change
        self._start = len(tracker.events)
        self._cuda_device = None
        dev = self._device
        if dev is not None and dev.type == "cuda" and active_fake_mode() is None:
            self._cuda_device = dev.index
            torch.cuda.synchronize(self._cuda_device)
            torch.cuda.reset_peak_memory_stats(self._cuda_device)
        tracker.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._tracker.forget_works()  # the last c10d collective's buffers, freed inside the region
        self._tracker.__exit__(*exc)
        self.unsettled = self._tracker.unsettled
        if self._cuda_device is not None:
            torch.cuda.synchronize(self._cuda_device)
            self.cuda_peak_bytes = int(torch.cuda.max_memory_allocated(self._cuda_device))
        self._replay(self._tracker.events[:])

    def mark_gradient(self, t: torch.Tensor) -> None:
        """Count ``t`` as a gradient: one an optimizer reads that is not a module
        parameter's ``.grad`` (a ZeRO shard's reduced gradient)."""
        self._tracker._update_and_maybe_create_winfos(t, _MemRefType.GRAD)

    def _category(self, winfo: Any) -> str:
        ref = winfo.reftype
        if ref == _MemRefType.PARAM:
            return PARAMETERS
        if ref == _MemRefType.GRAD:
            return GRADIENTS
        if ref == _MemRefType.OPT and winfo in self._tracker.optimizer_state:
            return OPTIMIZER_STATES
        if ref == _MemRefType.ACT:
            return ACTIVATIONS
        return TRANSIENTS

    def _replay(self, events: list[tuple[Any, int]]) -> None:
        """Walk the log in order with each storage's final category; keep the state at each
        device's peak and each category's own peak."""
        current: dict[Any, int] = {}
        totals: dict[torch.device, int] = {}
        by_cat: dict[torch.device, dict[str, int]] = {}

        def apply(winfo: Any, nbytes: int) -> tuple[torch.device, str]:
            dev, cat = winfo.device, self._category(winfo)
            delta = nbytes - current.get(winfo, 0)
            current[winfo] = nbytes
            totals[dev] = totals.get(dev, 0) + delta
            by_cat.setdefault(dev, dict.fromkeys(CATEGORIES, 0))[cat] += delta
            return dev, cat

        for winfo, nbytes in events[: self._start]:  # the state at entry
            apply(winfo, nbytes)
        peaks = dict(totals)
        at_peak = {dev: dict(cats) for dev, cats in by_cat.items()}
        own_peaks = {dev: dict(cats) for dev, cats in by_cat.items()}
        for winfo, nbytes in events[self._start :]:
            dev, cat = apply(winfo, nbytes)
            own = own_peaks.setdefault(dev, dict.fromkeys(CATEGORIES, 0))
            own[cat] = max(own[cat], by_cat[dev][cat])
            if totals[dev] > peaks.get(dev, 0):
                peaks[dev] = totals[dev]
                at_peak[dev] = dict(by_cat[dev])
        self.peak_bytes_by_device = {str(dev): peak for dev, peak in peaks.items()}
        if not peaks:
            return
        dev = self._device if self._device in peaks else max(peaks, key=peaks.__getitem__)
        self.peak_bytes = peaks[dev]
        self.breakdown = at_peak.get(dev, dict.fromkeys(CATEGORIES, 0))
        self.category_peaks = own_peaks.get(dev, dict.fromkeys(CATEGORIES, 0))


# ---------------------------------------------------------------------------- fake world


def init_fake_world(rank: int, world_size: int) -> dist.ProcessGroup:
    """Initialise the default process group on the ``fake`` backend, so this one process
    plays rank ``rank`` of ``world_size``: collectives cost nothing and move no data."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    group = dist.group.WORLD
    assert group is not None
    return group


@torch.library.register_fake("c10d::allreduce_coalesced_")
def _fake_allreduce_coalesced(tensors, process_group, reduce_op, async_op=True, timeout=-1):
    """Under fake tensors, the coalesced all-reduce memshard's runtime starts per bucket
    (``stores.all_reduce_together``), which torch gives no fake kernel: in place, a finished
    handle, as the fake process group's other collectives."""
    return FakeWork().boxed()


def destroy() -> None:
    """Tear down the default process group, if one is initialised."""
    if dist.is_initialized():
        dist.destroy_process_group()
