"""Pipeline schedules (``problem/pipeline.py``) against what torch.distributed.pipelining runs:
the action orders of torch's own schedule classes (its ``_step_microbatches`` for the
single-stage classes, its ``pipeline_order`` for the multi-stage ones), the sizes torch
accepts, the micro-batches held per stage against their definition and the published closed
forms, and the step time against the textbook bubbles."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.pipelining import schedules as torch_schedules

from memshard.core.errors import MemshardError
from memshard.problem.pipeline import (
    SCHEDULES,
    TORCH_SCHEDULE_CLASSES,
    Action,
    StageTimes,
    build_schedule,
    check_schedule,
    distinct_held_counts,
    held_counts,
    held_stages,
    maximal_held_counts,
    peak_held_counts,
    peak_held_total,
    rank_actions,
    simulate,
)

MULTI_STAGE = ("interleaved-1f1b", "interleaved-zb", "zbv")


# -- torch's own schedules, built without a process group --------------------------------------

class TorchStage:
    """What torch's multi-stage constructors read of a stage (this process is group rank 0)."""

    def __init__(self, index: int, num_stages: int, ranks: int):
        self.stage_index, self.num_stages = index, num_stages
        self.group_size, self.group_rank = ranks, 0
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.submod = None
        self.stage_index_to_group_rank: dict[int, int] = {}


class RecordingStage(TorchStage):
    """A single-stage schedule's stage that records the forwards and backwards torch runs on it,
    with no tensors to send or receive."""

    def __init__(self, index: int, ranks: int):
        super().__init__(index, ranks, ranks)
        self.calls: list[tuple[int, int, str]] = []

    def get_fwd_recv_ops(self, microbatch):
        return []

    get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = get_fwd_recv_ops

    def forward_one_chunk(self, microbatch, *args, **kwargs):
        self.calls.append((self.stage_index, microbatch, "F"))

    def backward_one_chunk(self, microbatch, **kwargs):
        self.calls.append((self.stage_index, microbatch, "B"))

    def perform_reduce_grad(self, *args):
        pass


def torch_class(name: str):
    return getattr(torch_schedules, TORCH_SCHEDULE_CLASSES[name])


def torch_runs_single_stage(name: str, ranks: int, microbatches: int, rank: int) -> list[tuple]:
    """The (stage, micro-batch, kind) of every compute call torch's ``_step_microbatches`` makes."""
    stage = RecordingStage(rank, ranks)
    schedule = torch_class(name)(stage, microbatches)
    schedule._initialize_stage = lambda *args, **kwargs: None  # no shapes to infer: no tensors
    schedule._step_microbatches()
    return stage.calls


def torch_multi_stage(name: str, ranks: int, microbatches: int, stages_per_rank: int):
    num_stages = ranks * stages_per_rank
    if name == "zbv" and stages_per_rank == 2:
        local = [0, num_stages - 1]  # the V: rank 0 holds the first and the last stage
    else:
        local = [k * ranks for k in range(stages_per_rank)]
    logging.disable(logging.WARNING)  # torch warns about the bubbles it adds
    try:
        return torch_class(name)([TorchStage(s, num_stages, ranks) for s in local], microbatches)
    finally:
        logging.disable(logging.NOTSET)


def torch_pipeline_order(name: str, ranks: int, microbatches: int, stages_per_rank: int) -> list[list[tuple]]:
    order = torch_multi_stage(name, ranks, microbatches, stages_per_rank).pipeline_order
    return [[(a.stage_index, a.microbatch_index, a.computation_type.value) for a in order[r] if a is not None]
            for r in range(ranks)]


def as_tuples(actions) -> list[tuple]:
    return [(a.stage, a.microbatch, a.kind) for a in actions]


# -- the orders ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("ranks, microbatches", [(1, 1), (1, 3), (2, 2), (2, 5), (3, 3), (4, 4), (4, 7), (4, 12), (6, 9)])
def test_single_stage_orders_are_what_torch_runs(name, ranks, microbatches):
    schedule = build_schedule(name, ranks, microbatches)
    for rank in range(ranks):
        assert as_tuples(schedule.actions[rank]) == torch_runs_single_stage(name, ranks, microbatches, rank)


def test_gpipe_runs_fewer_micro_batches_than_ranks_as_torch_does():
    for rank in range(4):
        assert as_tuples(rank_actions("gpipe", 4, 2, 1, rank)) == torch_runs_single_stage("gpipe", 4, 2, rank)


MULTI_STAGE_SIZES = [  # (ranks, micro-batches, stages per rank): p | m, p ∤ m, m < p, m < 2p − 1
    (1, 3, 2), (2, 2, 2), (2, 4, 2), (2, 6, 3), (3, 4, 2), (3, 6, 2), (4, 2, 2), (4, 3, 3),
    (4, 8, 2), (4, 10, 2), (4, 12, 3), (4, 16, 4), (5, 7, 2), (8, 16, 2),
]


@pytest.mark.parametrize("name", MULTI_STAGE)
@pytest.mark.parametrize("ranks, microbatches, stages_per_rank", MULTI_STAGE_SIZES)
def test_multi_stage_orders_are_torchs_pipeline_order(name, ranks, microbatches, stages_per_rank):
    if name == "zbv":
        stages_per_rank = 2
    schedule = build_schedule(name, ranks, microbatches, stages_per_rank)
    expected = torch_pipeline_order(name, ranks, microbatches, stages_per_rank)
    assert [as_tuples(actions) for actions in schedule.actions] == expected
    torch_schedule = torch_multi_stage(name, ranks, microbatches, stages_per_rank)
    assert schedule.stage_ranks == tuple(torch_schedule.stage_index_to_group_rank[s]
                                         for s in range(schedule.num_stages))


def torch_accepts(name: str, ranks: int, microbatches: int, stages_per_rank: int) -> bool:
    try:
        if name in ("gpipe", "1f1b"):
            torch_class(name)(RecordingStage(0, ranks), microbatches)
        else:
            torch_multi_stage(name, ranks, microbatches, stages_per_rank)
    except ValueError:
        return False
    return True


def memshard_accepts(name: str, ranks: int, microbatches: int, stages_per_rank: int) -> bool:
    try:
        check_schedule(name, ranks, microbatches, stages_per_rank)
    except MemshardError:
        return False
    return True


@pytest.mark.parametrize("name", SCHEDULES)
def test_the_sizes_accepted_are_those_torch_accepts(name):
    # Torch's single-stage classes have no notion of stages per rank: one is theirs.
    per_rank = (1,) if name in ("gpipe", "1f1b") else (1, 2, 3)
    sizes = [(p, m, v) for p in range(1, 6) for m in range(1, 14) for v in per_rank]
    disagree = [s for s in sizes if torch_accepts(name, *s) != memshard_accepts(name, *s)]
    assert not disagree
    assert any(not memshard_accepts(name, *s) for s in sizes) or name == "gpipe"


@pytest.mark.parametrize("args, words", [
    (("dualpipev", 4, 8, 2), "unknown pipeline schedule"),
    (("gpipe", 0, 8, 1), "pipeline ranks must be a positive integer"),
    (("1f1b", 4, 3, 1), "at least as many micro-batches"),
    (("1f1b", 4, 8, 2), "one stage per rank"),
    (("zbv", 4, 8, 3), "exactly 2 stages per rank"),
    (("interleaved-1f1b", 4, 9, 2), "multiple of the rounds"),
])
def test_bad_sizes_say_why_in_one_line(args, words):
    with pytest.raises(MemshardError, match=words) as raised:
        build_schedule(*args)
    assert "\n" not in str(raised.value)
    with pytest.raises(MemshardError):
        rank_actions(*args, 0)


def test_a_rank_outside_the_pipeline_is_refused():
    with pytest.raises(MemshardError, match="not one of the 4 pipeline ranks"):
        rank_actions("1f1b", 4, 8, 1, 4)


# -- invariants over small sizes -----------------------------------------------------------------

@st.composite
def schedules(draw):
    name = draw(st.sampled_from(SCHEDULES))
    ranks = draw(st.integers(1, 6))
    stages_per_rank = {"gpipe": 1, "1f1b": 1, "zbv": 2}.get(name) or draw(st.integers(1, 3))
    microbatches = draw(st.sampled_from([m for m in range(1, 15)
                                         if memshard_accepts(name, ranks, m, stages_per_rank)]))
    return build_schedule(name, ranks, microbatches, stages_per_rank)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(schedule=schedules())
def test_every_micro_batch_runs_once_per_kind_in_order(schedule):
    seen: dict[tuple, int] = {}
    for rank, actions in enumerate(schedule.actions):
        for position, a in enumerate(actions):
            assert a.kind in "FBIW" and 0 <= a.microbatch < schedule.microbatches
            assert schedule.stage_ranks[a.stage] == rank
            key = (a.stage, a.microbatch, a.kind)
            assert key not in seen, f"{key} twice"
            seen[key] = position
    for stage in range(schedule.num_stages):
        for b in range(schedule.microbatches):
            forward = seen[stage, b, "F"]
            if (stage, b, "B") in seen:
                assert (stage, b, "I") not in seen and (stage, b, "W") not in seen
                assert forward < seen[stage, b, "B"]
            else:
                assert forward < seen[stage, b, "I"] < seen[stage, b, "W"]
    expected = (3 if schedule.name in ("interleaved-zb", "zbv") else 2) * schedule.num_stages * schedule.microbatches
    assert len(seen) == expected


def held_by_definition(actions, stage: int) -> list[int]:
    """At each position k, the micro-batches of ``stage`` whose F is at ≤ k and whose release
    (its B, or its W) at ≥ k."""
    start = {a.microbatch: k for k, a in enumerate(actions) if a.stage == stage and a.kind == "F"}
    release = {a.microbatch: k for k, a in enumerate(actions) if a.stage == stage and a.kind in "BW"}
    return [sum(start[b] <= k <= release[b] for b in start) for k in range(len(actions))]


@settings(max_examples=150, deadline=None, derandomize=True)
@given(schedule=schedules())
def test_held_counts_are_the_definition_and_end_at_zero(schedule):
    for rank, actions in enumerate(schedule.actions):
        counts = held_counts(actions)
        stages = held_stages(actions)
        assert stages == schedule.stages_of(rank)
        for i, stage in enumerate(stages):
            assert [v[i] for v in counts] == held_by_definition(actions, stage)
        assert all(min(v) >= 0 for v in counts)
        assert all(v[stages.index(a.stage)] >= 1 for v, a in zip(counts, actions))  # the running one
        assert sum(counts[-1]) == 1  # the last action releases the last micro-batch held
        assert peak_held_counts(actions) == tuple(map(max, zip(*counts)))
        assert peak_held_total(actions) == max(map(sum, counts))
        distinct = distinct_held_counts(actions)
        assert set(distinct) == set(counts) and len(distinct) == len(set(counts))
        maximal = maximal_held_counts(actions)
        assert set(maximal) <= set(distinct)
        assert all(any(all(x <= y for x, y in zip(v, top)) for top in maximal) for v in distinct)
        assert not any(a != b and all(x <= y for x, y in zip(a, b)) for a in maximal for b in maximal)


# -- closed forms of the micro-batches held (pipeline.md §3.1) ---------------------------------

@pytest.mark.parametrize("ranks, microbatches", [(1, 3), (4, 2), (4, 4), (4, 9)])
def test_gpipe_holds_every_micro_batch(ranks, microbatches):
    schedule = build_schedule("gpipe", ranks, microbatches)
    assert [peak_held_total(a) for a in schedule.actions] == [microbatches] * ranks


@pytest.mark.parametrize("ranks, microbatches", [(1, 3), (4, 4), (4, 9), (8, 32)])
def test_1f1b_stage_i_holds_p_minus_i(ranks, microbatches):
    schedule = build_schedule("1f1b", ranks, microbatches)
    assert [peak_held_total(a) for a in schedule.actions] == [min(ranks - i, microbatches) for i in range(ranks)]
    # its rows: 1, 2, …, p − i micro-batches, the largest alone maximal
    for i, actions in enumerate(schedule.actions):
        assert sorted(distinct_held_counts(actions)) == [(k,) for k in range(1, ranks - i + 1)]
        assert maximal_held_counts(actions) == ((ranks - i,),)


@pytest.mark.parametrize("ranks, stages_per_rank, expected", [(4, 2, [11, 9, 7, 5]), (8, 4, [39, 37, 35, 33, 31, 29, 27, 25])])
def test_interleaved_1f1b_peaks_as_replayed_in_pipeline_md(ranks, stages_per_rank, expected):
    for microbatches in (2 * ranks, 4 * ranks):
        schedule = build_schedule("interleaved-1f1b", ranks, microbatches, stages_per_rank)
        assert [peak_held_total(a) for a in schedule.actions] == expected


@pytest.mark.parametrize("ranks, stages_per_rank", [(2, 2), (3, 2), (4, 3), (6, 2)])
def test_interleaved_1f1b_peak_per_rank_and_megatrons_factor(ranks, stages_per_rank):
    """(v − 1)·p + 2(p − 1 − r) + 1 chunk-micro-batches on rank r with p | m, m ≥ 2p; rank 0's,
    in layers of one chunk (L / (p·v)), is Megatron's L·(1 + (p − 1)/(p·v))."""
    p, v = ranks, stages_per_rank
    for m in (2 * p, 3 * p):
        peaks = [peak_held_total(a) for a in build_schedule("interleaved-1f1b", p, m, v).actions]
        assert peaks == [(v - 1) * p + 2 * (p - 1 - r) + 1 for r in range(p)]
        assert peaks[0] / (p * v) == pytest.approx(1 + (p - 1) / (p * v))


@pytest.mark.parametrize("ranks, stages_per_rank", [(2, 1), (4, 1), (4, 2), (3, 3)])
def test_interleaved_zero_bubble_releases_at_w(ranks, stages_per_rank):
    """ZB1P holds what 1F1B's first stage does (p micro-batches with one stage per rank, the ZB
    paper's "1×"), on every rank: W is delayed by r steps, the warm-up shortened by r."""
    p, v = ranks, stages_per_rank
    for m in (p, 2 * p):
        schedule = build_schedule("interleaved-zb", p, m, v)
        assert [peak_held_total(a) for a in schedule.actions] == [v * p] * p
    # Were a micro-batch released at its I, the last rank (whose Ws wait longest) would hold fewer.
    last = schedule.actions[-1]
    released_at_input = tuple(Action(a.stage, a.microbatch, "B") if a.kind == "I" else a
                              for a in last if a.kind != "W")
    assert peak_held_total(released_at_input) < peak_held_total(last)


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 8])
def test_zbv_holds_2p_on_every_rank(ranks):
    for microbatches in (2 * ranks, 3 * ranks, 4 * ranks):
        schedule = build_schedule("zbv", ranks, microbatches)
        assert [peak_held_total(a) for a in schedule.actions] == [2 * ranks] * ranks


# -- the step's time ----------------------------------------------------------------------------

@settings(max_examples=80, deadline=None, derandomize=True)
@given(schedule=schedules(), forward=st.sampled_from([0.5, 1.0, 2.0]), backward_input=st.sampled_from([0.5, 1.0, 3.0]),
       backward_weight=st.sampled_from([0.0, 0.5, 1.0]), transfer=st.sampled_from([0.0, 0.25, 1.0]))
def test_every_action_starts_as_early_as_its_rank_and_inputs_allow(schedule, forward, backward_input,
                                                                   backward_weight, transfer):
    times = StageTimes(forward, backward_input, backward_weight)
    timeline = simulate(schedule.actions, times, transfer)
    end: dict[tuple, tuple[float, int]] = {}
    for rank, actions in enumerate(schedule.actions):
        for a, finish in zip(actions, timeline.ends_s[rank]):
            end[a.stage, a.microbatch, "G" if a.kind in "BI" else a.kind] = (finish, rank)
    last = schedule.num_stages - 1
    for rank, actions in enumerate(schedule.actions):
        previous = 0.0
        for a, start, finish in zip(actions, timeline.starts_s[rank], timeline.ends_s[rank]):
            inputs = {"F": [(a.stage - 1, "F")] if a.stage > 0 else [],
                      "W": [(a.stage, "G")]}.get(a.kind, [(a.stage, "F")] + ([(a.stage + 1, "G")] if a.stage < last else []))
            ready = [end[s, a.microbatch, k][0] + (transfer if end[s, a.microbatch, k][1] != rank else 0.0)
                     for s, k in inputs]
            assert start == max([previous] + ready)
            duration = {"F": forward, "I": backward_input, "W": backward_weight}.get(a.kind, backward_input + backward_weight)
            assert finish == pytest.approx(start + duration)
            previous = finish
        assert timeline.busy_s[rank] == pytest.approx(sum(
            {"F": forward, "I": backward_input, "W": backward_weight}.get(a.kind, backward_input + backward_weight)
            for a in actions))
        assert timeline.idle_s[rank] == pytest.approx(timeline.makespan_s - timeline.busy_s[rank])
    assert timeline.makespan_s == max(e[-1] for e in timeline.ends_s)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("ranks, microbatches", [(1, 4), (2, 2), (4, 4), (4, 8), (3, 7), (8, 16)])
def test_gpipe_and_1f1b_take_m_plus_p_minus_1_steps(name, ranks, microbatches):
    t_forward, t_backward = 1.0, 2.0
    timeline = simulate(build_schedule(name, ranks, microbatches).actions, StageTimes(t_forward, 1.5, 0.5))
    assert timeline.makespan_s == (microbatches + ranks - 1) * (t_forward + t_backward)
    assert timeline.idle_s == ((ranks - 1) * (t_forward + t_backward),) * ranks


@pytest.mark.parametrize("ranks, microbatches, stages_per_rank", [
    (2, 4, 2), (4, 4, 2), (4, 8, 2), (4, 8, 4), (4, 12, 2), (8, 16, 2), (8, 16, 4),  # p | m
    (3, 4, 2), (4, 6, 2), (4, 10, 2), (4, 6, 4)])  # p ∤ m, as torch allows since 2.6
def test_interleaving_divides_the_bubble_by_v(ranks, microbatches, stages_per_rank):
    """Narayanan et al.: with p | m the bubble is (p − 1)(t_F + t_B)/v, t_F and t_B one rank's
    share of the model (v chunks of t_F/v, t_B/v). Exact for torch's order, and still so for
    the m ≥ p that p does not divide."""
    t_forward, t_backward, v = 1.0, 2.0, stages_per_rank
    chunk = StageTimes(t_forward / v, t_backward / v, 0.0)
    timeline = simulate(build_schedule("interleaved-1f1b", ranks, microbatches, v).actions, chunk)
    bubble = (ranks - 1) * (t_forward + t_backward) / v
    assert timeline.idle_s == pytest.approx((bubble,) * ranks, abs=1e-12)
    assert timeline.makespan_s == pytest.approx((microbatches * v + ranks - 1) * (t_forward + t_backward) / v)


def test_with_fewer_micro_batches_than_ranks_interleaving_is_a_chain():
    """Worked by hand: p = 2, v = 2, m = 1 runs F of stages 0, 1, 2, 3 then B of 3, 2, 1, 0, one
    after the other (each waits for the last), so 4·(t_F + t_B)/v = 6, not the textbook
    (m·v + p − 1)(t_F + t_B)/v = 4.5; a transfer adds 2·3 crossings."""
    chunk = StageTimes(0.5, 1.0, 0.0)
    schedule = build_schedule("interleaved-1f1b", 2, 1, 2)
    assert simulate(schedule.actions, chunk).makespan_s == 6.0
    assert simulate(schedule.actions, chunk, transfer_s=0.25).makespan_s == 6.0 + 6 * 0.25


@pytest.mark.parametrize("ranks, microbatches", [(2, 4), (4, 4), (4, 6), (4, 8), (4, 12), (8, 16)])
@pytest.mark.parametrize("forward, backward_input, backward_weight", [(1.0, 1.0, 1.0), (1.0, 2.0, 1.0), (2.0, 1.0, 1.0), (1.0, 1.0, 0.5)])
def test_interleaved_zero_bubble_matches_zb_h1(ranks, microbatches, forward, backward_input, backward_weight):
    """One stage per rank, torch's ZB1P is the ZB paper's ZB-H1: a bubble of
    (p − 1)(t_F + t_I − t_W) (DualPipe's table: (PP − 1)(F + B − 2W), B = t_I + t_W), for
    t_W ≤ t_I and m ≥ p; 1F1B's is (p − 1)(t_F + t_I + t_W)."""
    times = StageTimes(forward, backward_input, backward_weight)
    zb = simulate(build_schedule("interleaved-zb", ranks, microbatches, 1).actions, times)
    assert zb.idle_s == pytest.approx(((ranks - 1) * (forward + backward_input - backward_weight),) * ranks)
    one_f_one_b = simulate(build_schedule("1f1b", ranks, microbatches).actions, times)
    assert one_f_one_b.idle_s[0] == (ranks - 1) * (forward + backward_input + backward_weight)


@pytest.mark.parametrize("ranks, microbatches", [(2, 4), (3, 6), (4, 8), (4, 16), (8, 16), (8, 32)])
def test_zbv_bubble_is_only_the_unavoidable_fill(ranks, microbatches):
    """With t_F = t_I = t_W = t, rank p − 1 cannot start before stages 0 … p − 2 have forwarded
    micro-batch 0, (p − 1)·t; ZBV idles exactly that on every rank (the zero-bubble tables
    count no fill). 1F1B on the same model (one stage per rank of twice the work) idles
    (p − 1)·6t: ZBV's bubble is a sixth of it."""
    t = 1.0
    zbv = simulate(build_schedule("zbv", ranks, microbatches).actions, StageTimes(t, t, t))
    assert zbv.idle_s == ((ranks - 1) * t,) * ranks
    one_f_one_b = simulate(build_schedule("1f1b", ranks, microbatches).actions, StageTimes(2 * t, 2 * t, 2 * t))
    assert one_f_one_b.busy_s == zbv.busy_s
    assert one_f_one_b.idle_s[0] == 6 * zbv.idle_s[0]


@pytest.mark.parametrize("ranks, microbatches", [(2, 2), (4, 4), (4, 8), (3, 7)])
def test_a_transfer_adds_to_the_fill_and_the_drain(ranks, microbatches):
    """GPipe: micro-batch 0's forwards cross p − 1 rank boundaries on the way down, the last
    backwards as many on the way up: 2(p − 1) transfers."""
    times = StageTimes(1.0, 1.0, 1.0)
    schedule = build_schedule("gpipe", ranks, microbatches)
    base = simulate(schedule.actions, times).makespan_s
    for transfer in (0.25, 1.0, 4.0):
        assert simulate(schedule.actions, times, transfer).makespan_s == base + 2 * (ranks - 1) * transfer
        assert simulate(build_schedule("1f1b", ranks, microbatches).actions, times, transfer).makespan_s \
            >= base + 2 * (ranks - 1) * transfer


def test_v_placement_sends_nothing_between_the_two_stages_of_a_rank():
    """Rank p − 1 holds stages p − 1 and p. With p = 2: F(1, 0) starts after F(0, 0) and one
    transfer (t_F + c); F(2, 0) follows on the same rank with no transfer: 2·t_F + c."""
    forward, transfer = 1.0, 0.25
    schedule = build_schedule("zbv", 2, 4)
    timeline = simulate(schedule.actions, StageTimes(forward, 1.0, 1.0), transfer)
    starts = {a: s for a, s in zip(schedule.actions[1], timeline.starts_s[1])}
    assert starts[Action(1, 0, "F")] == forward + transfer
    assert starts[Action(2, 0, "F")] == 2 * forward + transfer
    # One rank: no boundary crosses ranks, so a transfer changes nothing.
    alone = build_schedule("zbv", 1, 3)
    assert simulate(alone.actions, StageTimes(1.0, 1.0, 1.0), 5.0) == simulate(alone.actions, StageTimes(1.0, 1.0, 1.0))


def test_per_stage_times_are_the_slowest_stage_s_for_1f1b_steady_state():
    """Uneven stages: 1F1B's steady state runs at the slowest stage's pace; for m ≫ p the step
    grows by (t_F + t_B) of the slowest stage per extra micro-batch."""
    fast, slow = StageTimes(1.0, 1.0, 1.0), StageTimes(2.0, 2.0, 2.0)
    times = [fast, slow, fast, fast]
    short = simulate(build_schedule("1f1b", 4, 16).actions, times).makespan_s
    long = simulate(build_schedule("1f1b", 4, 17).actions, times).makespan_s
    assert long - short == slow.forward_s + slow.backward_input_s + slow.backward_weight_s


def test_a_list_that_cannot_run_deadlocks_in_one_line():
    # Rank 0 wants stage 1's input gradient before stage 1 has even run its forward.
    actions = [(Action(0, 0, "F"), Action(0, 0, "B")), (Action(1, 0, "B"), Action(1, 0, "F"))]
    with pytest.raises(MemshardError, match="deadlocks") as raised:
        simulate(actions, StageTimes(1.0, 1.0, 1.0))
    assert "\n" not in str(raised.value)
    with pytest.raises(MemshardError, match="stage times for 1 stages"):
        simulate(build_schedule("gpipe", 2, 2).actions, [StageTimes(1.0, 1.0, 1.0)])
