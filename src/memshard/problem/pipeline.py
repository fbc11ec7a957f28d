"""Pipeline schedules as action lists: which micro-batches each pipeline rank holds, and when
each of its actions runs in one step.

Notation: ``p`` pipeline ranks, ``m`` micro-batches per step, ``v`` stages per rank, ``S = p·v``
stages. Stage ``s`` runs on rank ``s mod p`` ("loop" placement) except for ZBV, whose V
placement puts stages ``r`` and ``2p − 1 − r`` on rank ``r``.

**Schedules.** One per class of ``torch.distributed.pipelining`` (2.13), in the order torch
runs them (``TORCH_SCHEDULE_CLASSES``). A schedule is, per rank, the ordered list of its
compute actions :class:`Action` ``(stage, microbatch, kind)``; kind ``F`` forward, ``B`` full
backward, ``I`` input-gradient backward, ``W`` weight-gradient backward. Torch's deliberate
idle slots (``None``) and its communication actions are not actions here: waiting is what
:func:`simulate` computes.

- ``gpipe`` (``ScheduleGPipe``, v = 1): rank r runs F of every micro-batch, then B of every one.
- ``1f1b`` (``Schedule1F1B``, v = 1, needs m ≥ p): ``min(m, p − r)`` forwards, then B and F
  alternate (a B first) until the forwards are done, then the remaining Bs.
- ``interleaved-1f1b`` (``ScheduleInterleaved1F1B``) and ``interleaved-zb``
  (``ScheduleInterleavedZeroBubble``, torch's ZB1P): with ``rounds = max(1, ⌊m/p⌋)`` torch
  needs ``m mod rounds = 0``; ``g = m / rounds`` micro-batches per round. Step ``k`` of rank r
  forwards local stage ``⌊k/g⌋ mod v``; warm-up ``w_r = min((v − 1)·g + f·(p − 1 − r), m·v)``
  forwards (f = 2 for 1F1B, 1 for ZB), then one F and one backward per step (1F1B: B; ZB: I,
  and from the (r + 1)-th of them on also the W of the oldest backward still without one),
  then the remaining backwards and Ws. Backward step ``k`` runs local stage
  ``v − 1 − (⌊(k − w_r)/g⌋ mod v)``. (Torch then pads the ZB lists with idle slots where an
  input is not ready; the order stays.)
- ``zbv`` (``ScheduleZBVZeroBubble``, v = 2, V placement): ``2(p − r) − 1`` forwards of stage
  r, r pairs (F of 2p − 1 − r, F of r), ``p − r`` triples (F, I, W of 2p − 1 − r), then
  steady (F, I, W of r; F, I, W of 2p − 1 − r) and a cool-down of Is and the pending Ws.
  Torch builds it for ``max(m, 2p − 1)`` micro-batches and drops the actions of those ≥ m.

**Micro-batches held.** A micro-batch of stage s is held on its rank from the start of its
F to the end of the action that releases it: its B, or for the ZB schedules its W. That is
where torch frees it: I (``stage_backward_input``) computes the input gradient with autograd's
graph retained, so every activation the forward saved stays; it also keeps, until W, the
gradients arriving at the weights' inputs. W (``stage_backward_weight``) runs the weight
gradient without retaining the graph and frees the saved activations and those gradients.
At the k-th action of a rank the count of stage s is

    n_s(k) = #{micro-batches whose F of s is at position ≤ k and whose release is at ≥ k},

so the running action's own micro-batch counts. A memory model needs one row per distinct
vector ``(n_s(k))_s`` (:func:`distinct_held_counts`); where a point's memory depends on the
counts alone and grows with each, the componentwise-maximal vectors suffice
(:func:`maximal_held_counts`). Peaks, as checks: GPipe m; 1F1B ``min(p − r, m)``;
interleaved 1F1B with p | m and m ≥ 2p: ``w_r + 1 = (v − 1)·p + 2(p − 1 − r) + 1`` on rank r
(``v·p + p − 1`` on rank 0); interleaved ZB with p | m: ``v·p`` on every rank (its shorter
warm-up and its Ws, delayed r steps, cancel); ZBV ``2p`` on every rank once m ≥ 2p.

**A rank's memory.** A rank holding several stages (chunks) holds, at the k-th action of its
list, every chunk's idle bytes (weights, gradients, optimizer states, buffers), and per chunk
``c`` its micro-batches in flight: ``a_c(k)`` past their F and before their B or I, each
holding ``S_c`` (what one micro-batch holds at the boundary), and ``w_c(k)`` past their I and
before their W (ZB schedules only), each holding ``S_c + G_c``, ``G_c`` the gradients arriving at
the weights' ops, which torch keeps for W. The running action's chunk holds its running peak
``R_s`` (one micro-batch at the worst point of its forward, for an F, or of its backward) in
place of its idle bytes and of the one micro-batch the action runs::

    M(k) = R_s + (a_s + w_s − 1)·S_s + w_s·G_s + Σ_{c ≠ s} (idle_c + a_c·S_c + w_c·(S_c + G_c))

(a running W counts its micro-batch's ``G_s`` too, the bytes its kernels read). Torch's
multi-stage schedules (``PipelineScheduleMulti``) keep each input gradient a stage sends back
until the step ends (measured under gloo: every one alive, no Python object referring to it;
``Schedule1F1B`` frees each when it sends the next): after ``b_s`` backwards (B or I) of a
stage that receives its input, ``b_s`` of them, ``R_s`` each, of which its later phase
counts one. Each chunk's
idle and running bytes are of one of two phases: until its first backward (or W) has ended,
no gradient of it is accumulated yet (that backward makes them); after it every gradient is
held, and each backward makes a new one beside it. The rank's peak
is the largest ``M(k)`` and its optimizer step (every chunk's idle bytes plus the largest
chunk's optimizer transients): :func:`rank_peak_bytes`.

**Step time.** :func:`simulate` replays the lists: each rank runs its actions in list order
on one compute stream; an action starts when the previous one of its rank has ended and

- F(s, b) after F(s − 1, b) has ended;
- B or I (s, b) after F(s, b), and after B or I (s + 1, b) has ended (s < S − 1);
- W(s, b) after I(s, b);

plus the point-to-point transfer time when the action waited on is on another rank (none
between V placement's two stages of one rank). Durations per stage: F ``t_F``, I ``t_I``,
W ``t_W``, B ``t_I + t_W``. The step's makespan is the last end; a rank's idle time is the
makespan less the sum of its durations. With equal stages and no transfer (checks, not the
model): GPipe and 1F1B idle ``(p − 1)(t_F + t_B)`` per rank, so the step takes
``(m + p − 1)(t_F + t_B)``; interleaved 1F1B with m ≥ p idles ``(p − 1)(t_F + t_B)`` of one
stage, i.e. the textbook ``(p − 1)(T_F + T_B)/v`` of a rank's share of the model; interleaved
ZB with one stage per rank and m ≥ p idles ``(p − 1)(t_F + t_I − t_W)`` for ``t_W ≤ t_I``
(ZB-H1); ZBV with ``t_F = t_I = t_W`` only the fill of rank p − 1, ``(p − 1)·t_F``. A transfer
``c`` adds ``2(p − 1)·c`` to GPipe; to 1F1B more, since its steady state waits on transfers.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from memshard.core.errors import MemshardError

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb", "zbv")
# The class of torch.distributed.pipelining each schedule is.
TORCH_SCHEDULE_CLASSES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "interleaved-zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
}
# Stages per rank when none is given: torchtitan's default of 2 for the multi-stage classes.
# How reports name each schedule.
SCHEDULE_TITLES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved-1f1b": "interleaved 1F1B",
                   "interleaved-zb": "interleaved zero bubble", "zbv": "ZBV"}
DEFAULT_STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2, "interleaved-zb": 2, "zbv": 2}
KINDS = ("F", "B", "I", "W")


@dataclass(frozen=True)
class Action:
    """One compute action of a rank: ``kind`` F, B, I or W of ``microbatch`` on ``stage``."""

    stage: int
    microbatch: int
    kind: str

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


@dataclass(frozen=True)
class PipelineSchedule:
    """A schedule for ``ranks`` × ``stages_per_rank`` stages and ``microbatches`` micro-batches:
    ``actions[r]`` is rank r's list, ``stage_ranks[s]`` the rank stage s runs on."""

    name: str
    ranks: int
    microbatches: int
    stages_per_rank: int
    actions: tuple[tuple[Action, ...], ...]
    stage_ranks: tuple[int, ...]

    @property
    def num_stages(self) -> int:
        return self.ranks * self.stages_per_rank

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages rank ``rank`` runs, ascending."""
        return tuple(s for s, r in enumerate(self.stage_ranks) if r == rank)


def check_schedule(name: str, ranks: int, microbatches: int, stages_per_rank: int) -> None:
    """Raise :class:`MemshardError` unless torch 2.13 builds schedule ``name`` for these sizes."""
    if name not in SCHEDULES:
        raise MemshardError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    for label, value in (("pipeline ranks", ranks), ("micro-batches", microbatches),
                         ("stages per rank", stages_per_rank)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise MemshardError(f"{name}: {label} must be a positive integer, got {value!r}")
    if name in ("gpipe", "1f1b") and stages_per_rank != 1:
        raise MemshardError(f"{name} runs one stage per rank, got {stages_per_rank}")
    if name == "zbv" and stages_per_rank != 2:
        raise MemshardError(f"zbv runs exactly 2 stages per rank, got {stages_per_rank}")
    if name == "1f1b" and microbatches < ranks:
        raise MemshardError(f"1f1b needs at least as many micro-batches as pipeline ranks "
                            f"({ranks}), got {microbatches}")
    if name.startswith("interleaved"):
        rounds = max(1, microbatches // ranks)
        if microbatches % rounds:
            raise MemshardError(f"{name} needs the micro-batches ({microbatches}) to be a multiple of "
                                f"the rounds, max(1, micro-batches // ranks) = {rounds}")


def stage_ranks(name: str, ranks: int, stages_per_rank: int) -> tuple[int, ...]:
    """The rank of every stage: ``s mod p``, or for ``zbv`` the V (``r`` and ``2p − 1 − r``)."""
    if name == "zbv":
        return tuple(s if s < ranks else 2 * ranks - 1 - s for s in range(2 * ranks))
    return tuple(s % ranks for s in range(ranks * stages_per_rank))


@functools.lru_cache(maxsize=8)
def build_schedule(name: str, ranks: int, microbatches: int,
                   stages_per_rank: int | None = None) -> PipelineSchedule:
    """Schedule ``name`` for ``ranks`` pipeline ranks and ``microbatches`` micro-batches, every
    rank's actions in the order torch.distributed.pipelining runs them."""
    if stages_per_rank is None:
        stages_per_rank = DEFAULT_STAGES_PER_RANK.get(name, 1)
    check_schedule(name, ranks, microbatches, stages_per_rank)
    actions = tuple(rank_actions(name, ranks, microbatches, stages_per_rank, rank) for rank in range(ranks))
    return PipelineSchedule(name, ranks, microbatches, stages_per_rank, actions,
                            stage_ranks(name, ranks, stages_per_rank))


@functools.lru_cache(maxsize=512)
def rank_actions(name: str, ranks: int, microbatches: int, stages_per_rank: int,
                 rank: int) -> tuple[Action, ...]:
    """Rank ``rank``'s list alone: what a memory model of one rank needs, for 1/p of the cost."""
    check_schedule(name, ranks, microbatches, stages_per_rank)
    if not isinstance(rank, int) or not 0 <= rank < ranks:
        raise MemshardError(f"{name}: rank {rank!r} is not one of the {ranks} pipeline ranks")
    return tuple(_GENERATORS[name](ranks, microbatches, stages_per_rank, rank))


# -- the generators, one per torch class -----------------------------------------------------------

def _gpipe_rank(ranks: int, microbatches: int, stages_per_rank: int, rank: int) -> list[Action]:
    return ([Action(rank, b, "F") for b in range(microbatches)]
            + [Action(rank, b, "B") for b in range(microbatches)])


def _one_f_one_b_rank(ranks: int, microbatches: int, stages_per_rank: int, rank: int) -> list[Action]:
    """``Schedule1F1B._step_microbatches``: warm-up forwards, then B and F alternate, then Bs."""
    warmup = min(microbatches, ranks - rank)
    out = [Action(rank, b, "F") for b in range(warmup)]
    forwards, backwards = warmup, 0
    while True:
        out.append(Action(rank, backwards, "B"))
        backwards += 1
        if forwards == microbatches:
            break
        out.append(Action(rank, forwards, "F"))
        forwards += 1
    out.extend(Action(rank, b, "B") for b in range(backwards, microbatches))
    return out


def _interleaved_rank(ranks: int, microbatches: int, stages_per_rank: int, rank: int,
                      zero_bubble: bool = False) -> list[Action]:
    """``_get_1f1b_rank_ops`` as ``ScheduleInterleaved1F1B`` and ``ScheduleInterleavedZeroBubble``
    call it (their ``_calculate_single_rank_operations``)."""
    v = stages_per_rank
    per_round = microbatches // max(1, microbatches // ranks)
    total = microbatches * v
    warmup = min((v - 1) * per_round + (1 if zero_bubble else 2) * (ranks - 1 - rank), total)

    def forward_stage(step: int) -> int:
        return (step // per_round) % v * ranks + rank

    def backward_stage(step: int) -> int:
        return (v - 1 - (step - warmup) // per_round % v) * ranks + rank

    counters: dict[tuple[str, int], int] = defaultdict(int)
    out: list[Action] = []

    def add(stage: int, kind: str) -> None:
        out.append(Action(stage, counters[kind, stage], kind))
        counters[kind, stage] += 1

    backward_steps: list[int] = []
    weights = 0
    for step in range(total + warmup):
        if step < total:
            add(forward_stage(step), "F")
        if step >= warmup:
            add(backward_stage(step), "I" if zero_bubble else "B")
            backward_steps.append(step)
            if zero_bubble and step - warmup >= rank:
                add(backward_stage(backward_steps[weights]), "W")
                weights += 1
    while zero_bubble and weights < len(backward_steps):
        add(backward_stage(backward_steps[weights]), "W")
        weights += 1
    return out


def _interleaved_zero_bubble_rank(ranks: int, microbatches: int, stages_per_rank: int,
                                  rank: int) -> list[Action]:
    return _interleaved_rank(ranks, microbatches, stages_per_rank, rank, zero_bubble=True)


def _zbv_rank(ranks: int, microbatches: int, stages_per_rank: int, rank: int) -> list[Action]:
    """``ScheduleZBVZeroBubble._calculate_single_rank_operations``."""
    built = max(2 * ranks - 1, microbatches)  # torch's n_micro
    first, second = rank, 2 * ranks - 1 - rank
    counters: dict[tuple[str, int], int] = defaultdict(int)
    out: list[Action] = []

    def add(stage: int, *kinds: str) -> None:
        for kind in kinds:
            out.append(Action(stage, counters[kind, stage], kind))
            counters[kind, stage] += 1

    for _ in range(2 * (ranks - rank) - 1):
        add(first, "F")
    for _ in range(rank):
        add(second, "F")
        add(first, "F")
    for _ in range(ranks - rank):
        add(second, "F", "I", "W")
    while counters["F", second] < counters["F", first] or counters["F", first] < built:
        if counters["F", first] < built:
            add(first, "F")
        add(first, "I", "W")
        add(second, "F", "I", "W")
    for _ in range(rank):
        add(first, "I")
        add(second, "I")
    for _ in range(ranks - rank):
        add(first, "I", "W")
    for stage in (second, first):
        while counters["W", stage] < counters["I", stage]:
            add(stage, "W")
    return [a for a in out if a.microbatch < microbatches]


_GENERATORS = {
    "gpipe": _gpipe_rank,
    "1f1b": _one_f_one_b_rank,
    "interleaved-1f1b": _interleaved_rank,
    "interleaved-zb": _interleaved_zero_bubble_rank,
    "zbv": _zbv_rank,
}


# -- micro-batches held -------------------------------------------------------------------------

def held_stages(actions: Iterable[Action]) -> tuple[int, ...]:
    """The stages of a rank's list, ascending: the positions of every count vector."""
    return tuple(sorted({a.stage for a in actions}))


def held_counts(actions: Sequence[Action]) -> tuple[tuple[int, ...], ...]:
    """At each action of a rank's list, the micro-batches held per stage (positions as
    :func:`held_stages`), the running action's own micro-batch included."""
    stages = held_stages(actions)
    position = {s: i for i, s in enumerate(stages)}
    counts = [0] * len(stages)
    out = []
    for a in actions:
        i = position[a.stage]
        if a.kind == "F":
            counts[i] += 1
        elif a.kind not in KINDS:
            raise MemshardError(f"action {a}: kind {a.kind!r} is none of {', '.join(KINDS)}")
        out.append(tuple(counts))
        if a.kind == "B" or a.kind == "W":
            counts[i] -= 1
    return tuple(out)


def distinct_held_counts(actions: Sequence[Action]) -> tuple[tuple[int, ...], ...]:
    """The distinct count vectors of :func:`held_counts`, in the order they first occur."""
    return tuple(dict.fromkeys(held_counts(actions)))


def maximal_held_counts(actions: Sequence[Action]) -> tuple[tuple[int, ...], ...]:
    """The distinct count vectors no other one is componentwise at least as large as, in the
    order they first occur."""
    vectors = distinct_held_counts(actions)
    maximal: list[tuple[int, ...]] = []
    for x in sorted(vectors, key=sum, reverse=True):  # a vector above x has a larger sum
        if not any(all(b >= a for a, b in zip(x, y)) for y in maximal):
            maximal.append(x)
    kept = set(maximal)
    return tuple(x for x in vectors if x in kept)


def peak_held_counts(actions: Sequence[Action]) -> tuple[int, ...]:
    """The most micro-batches of each stage held at once (positions as :func:`held_stages`)."""
    vectors = held_counts(actions)
    return tuple(max(column) for column in zip(*vectors)) if vectors else ()


def peak_held_total(actions: Sequence[Action]) -> int:
    """The most stage-micro-batches held at once, all of the rank's stages together."""
    return max((sum(v) for v in held_counts(actions)), default=0)


# -- the step's time --------------------------------------------------------------------------

@dataclass(frozen=True)
class StageTimes:
    """Compute time of one micro-batch on one stage: forward, input-gradient backward (I) and
    weight-gradient backward (W); a full backward B takes both."""

    forward_s: float
    backward_input_s: float
    backward_weight_s: float

    def of(self, kind: str) -> float:
        if kind == "F":
            return self.forward_s
        if kind == "I":
            return self.backward_input_s
        if kind == "W":
            return self.backward_weight_s
        return self.backward_input_s + self.backward_weight_s


@dataclass(frozen=True)
class StepTimeline:
    """When every action of one step starts and ends (``starts_s[r][k]``: rank r's k-th action),
    the step's makespan, and per rank the time it computes and the time it waits."""

    starts_s: tuple[tuple[float, ...], ...]
    ends_s: tuple[tuple[float, ...], ...]
    makespan_s: float
    busy_s: tuple[float, ...]
    idle_s: tuple[float, ...]


def _replay(actions: Sequence[Sequence[Action]], durations: Sequence[dict[str, float]],
            owner: Sequence[int], transfer_s: float) -> tuple[list[list[float]], list[list[float]]]:
    """Every action's start and end. Events are numbered ``2·(stage·M + micro-batch) + e``, M the
    micro-batches seen, e 0 for a forward's end and 1 for an input gradient's (B or I); a rank
    that reaches an action whose event has not happened yet waits until that event's rank
    produces it."""
    last_stage = len(owner) - 1
    width = 1 + max(a.microbatch for rank_actions in actions for a in rank_actions)
    ended: dict[int, float] = {}
    blocked: dict[int, int] = {}  # event → the rank waiting for it
    starts: list[list[float]] = [[] for _ in actions]
    ends: list[list[float]] = [[] for _ in actions]
    ready = list(range(len(actions)))
    while ready:
        rank = ready.pop()
        rank_starts, rank_ends, todo = starts[rank], ends[rank], actions[rank]
        clock = rank_ends[-1] if rank_ends else 0.0
        for index in range(len(rank_ends), len(todo)):
            action = todo[index]
            stage, kind = action.stage, action.kind
            here = 2 * (stage * width + action.microbatch)
            if kind == "F":  # (event waited on, its stage) twice; −1: none
                first, first_stage, second, second_stage, produced = here - 2 * width, stage - 1, -1, 0, here
                if stage == 0:
                    first = -1
            elif kind == "W":
                first, first_stage, second, second_stage, produced = here + 1, stage, -1, 0, -1
            else:
                first, first_stage, produced = here, stage, here + 1
                second, second_stage = (here + 2 * width + 1, stage + 1) if stage < last_stage else (-1, 0)
            start = clock
            if first >= 0:
                if first not in ended:
                    blocked[first] = rank
                    break
                start = max(start, ended[first] + (transfer_s if owner[first_stage] != rank else 0.0))
            if second >= 0:
                if second not in ended:
                    blocked[second] = rank
                    break
                start = max(start, ended[second] + (transfer_s if owner[second_stage] != rank else 0.0))
            clock = start + durations[stage][kind]
            rank_starts.append(start)
            rank_ends.append(clock)
            if produced >= 0:
                ended[produced] = clock
                if produced in blocked:
                    ready.append(blocked.pop(produced))
    return starts, ends


def simulate(actions: Sequence[Sequence[Action]], stage_times: StageTimes | Sequence[StageTimes],
             transfer_s: float = 0.0) -> StepTimeline:
    """Run the per-rank lists on one compute stream per rank (dependencies and transfers as
    the module says); ``stage_times`` one for every stage, or one per stage."""
    owner_of = {a.stage: r for r, rank_actions in enumerate(actions) for a in rank_actions}
    if not owner_of:
        raise MemshardError("a pipeline step needs at least one action")
    unknown = {a.kind for rank_actions in actions for a in rank_actions} - set(KINDS)
    if unknown:
        raise MemshardError(f"action kinds {sorted(unknown)} are none of {', '.join(KINDS)}")
    num_stages = max(owner_of) + 1
    times = [stage_times] * num_stages if isinstance(stage_times, StageTimes) else list(stage_times)
    if len(times) < num_stages:
        raise MemshardError(f"stage times for {len(times)} stages, the schedule has {num_stages}")
    durations = [{kind: t.of(kind) for kind in KINDS} for t in times]
    owner = [owner_of.get(s, -1) for s in range(num_stages)]
    starts, ends = _replay(actions, durations, owner, transfer_s)
    stuck = next((r for r in range(len(actions)) if len(ends[r]) < len(actions[r])), None)
    if stuck is not None:
        raise MemshardError(f"the pipeline schedule deadlocks: rank {stuck} waits forever at "
                            f"{actions[stuck][len(ends[stuck])]}")
    busy = tuple(sum(e - s for s, e in zip(rs, re)) for rs, re in zip(starts, ends))
    makespan = max((e[-1] for e in ends if e), default=0.0)
    return StepTimeline(tuple(map(tuple, starts)), tuple(map(tuple, ends)), makespan, busy,
                        tuple(makespan - b for b in busy))


# -- a rank's memory ----------------------------------------------------------------------------

def held_phases(actions: Sequence[Action]) -> tuple[tuple[tuple[int, int], ...], ...]:
    """At each action of a rank's list, per stage (positions as :func:`held_stages`), the
    micro-batches (a, w) held: a past their F and not past their B or I, w past their I and not
    past their W; the running action's own micro-batch included (in w for a W)."""
    stages = held_stages(actions)
    position = {s: i for i, s in enumerate(stages)}
    forward, weight = [0] * len(stages), [0] * len(stages)
    out = []
    for a in actions:
        i = position[a.stage]
        if a.kind == "F":
            forward[i] += 1
        elif a.kind not in KINDS:
            raise MemshardError(f"action {a}: kind {a.kind!r} is none of {', '.join(KINDS)}")
        out.append(tuple(zip(forward, weight)))
        if a.kind in ("B", "I"):
            forward[i] -= 1
        if a.kind == "I":
            weight[i] += 1
        elif a.kind == "W":
            weight[i] -= 1
    return tuple(out)


@dataclass(frozen=True)
class ChunkPhase:
    """What one stage of a rank holds in one phase of the step, bytes per device: ``idle_bytes``
    with none of its micro-batches in flight (weights, gradients, optimizer states, buffers),
    ``forward_bytes`` and ``backward_bytes`` at the worst point of one micro-batch's forward and
    backward (its idle bytes included)."""

    idle_bytes: float
    forward_bytes: float
    backward_bytes: float


@dataclass(frozen=True)
class ChunkMemory:
    """One stage (chunk) of a rank (the module's "A rank's memory"): ``first`` until its first
    backward (or W) has ended, no gradient accumulated yet (that backward makes them), ``later``
    after it, every gradient held and autograd's new one beside it in each backward; S
    (``held_bytes``) per micro-batch waiting for its backward, G (``weight_input_bytes``) per
    micro-batch waiting for its W, its bytes at the optimizer step, and R
    (``sent_gradient_bytes``), the input gradient each of its backwards sends back, which
    torch's multi-stage schedules keep until the step ends (``rank_memory_bytes``)."""

    first: ChunkPhase
    later: ChunkPhase
    held_bytes: float
    weight_input_bytes: float
    optimizer_bytes: float
    sent_gradient_bytes: float = 0.0  # the input gradient one backward sends back (0 on the first stage)


def rank_memory_bytes(actions: Sequence[Action], chunks: dict[int, ChunkMemory]) -> tuple[float, ...]:
    """``M(k)`` at each action of a rank's list (``chunks``: each of its stages' memory)."""
    stages = held_stages(actions)
    done: set[int] = set()  # the stages whose first backward (or W) has ended
    sent: dict[int, int] = dict.fromkeys(stages, 0)  # input gradients sent back so far, per stage
    out = []
    for action, phases in zip(actions, held_phases(actions)):
        total = 0.0
        for stage, (waiting, weights) in zip(stages, phases):
            c = chunks[stage]
            phase = c.later if stage in done else c.first
            total += max(0, sent[stage] - 1) * c.sent_gradient_bytes  # (the later phase holds one)
            if stage == action.stage:
                running = phase.forward_bytes if action.kind == "F" else phase.backward_bytes
                total += running + (waiting + weights - 1) * c.held_bytes + weights * c.weight_input_bytes
            else:
                total += phase.idle_bytes + waiting * c.held_bytes + weights * (c.held_bytes + c.weight_input_bytes)
        out.append(total)
        if action.kind in ("B", "W"):
            done.add(action.stage)
        if action.kind in ("B", "I"):
            sent[action.stage] += 1
    return tuple(out)


def rank_peak_bytes(actions: Sequence[Action], chunks: dict[int, ChunkMemory]) -> float:
    """A rank's peak: the largest :func:`rank_memory_bytes`, or its optimizer step (every
    chunk's idle bytes, the largest chunk's optimizer transients above its idle bytes)."""
    stages = held_stages(actions)
    idle = sum(chunks[s].later.idle_bytes for s in stages)
    optimizer = idle + max(chunks[s].optimizer_bytes - chunks[s].later.idle_bytes for s in stages)
    return max(*rank_memory_bytes(actions, chunks), optimizer)
