"""Interleaved pipelines (several stages per rank: ``interleaved-1f1b``, ``interleaved-zb``,
``zbv``): the stages each rank holds, a rank's peak counted from torch's action list, the
step from the timeline, the JSON, the CLI's checks."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memshard.baselines.names import parse_strategy
from memshard.cli import SCHEDULE_CHOICES, main
from memshard.core.errors import MemshardError
from memshard.job import Job
from memshard.pipelining import (
    PIPELINE_SCHEDULES,
    PipelineOptions,
    auto_schedules,
    held_micro_batches,
    pipeline_degrees,
    pipelined_baseline,
    plan_pipelined,
    weight_share,
)
from memshard.planner import SearchOptions
from memshard.plans.pipelined import (
    PIPELINE_SCHEMA_V,
    PipelinedPlan,
    chunk_memory,
    load_any_plan,
    phase_evaluation,
)
from memshard.plans.plan import PIPELINE_SCHEMA
from memshard.problem.pipeline import (
    ChunkMemory,
    ChunkPhase,
    StageTimes,
    build_schedule,
    held_counts,
    held_phases,
    rank_memory_bytes,
    simulate,
)

FOUR = Job("tiny-gpt", "4", batch=8, micro_batches=4, overrides={"num_layers": 4})


@pytest.fixture(scope="module", params=["interleaved-1f1b", "interleaved-zb", "zbv"])
def interleaved(request) -> PipelinedPlan:
    return plan_pipelined(FOUR, SearchOptions(), PipelineOptions(2, request.param))


def in_flight(actions):
    """At each action, per stage: the micro-batches past F and not past B/I, and those past I
    and not past W, as sets (the running action's own included): a second count."""
    forward, weight, out = {}, {}, []
    for a in actions:
        forward.setdefault(a.stage, set())
        weight.setdefault(a.stage, set())
        if a.kind == "F":
            forward[a.stage].add(a.microbatch)
        if a.kind == "W":
            assert a.microbatch in weight[a.stage]
        out.append({s: (set(forward[s]), set(weight[s])) for s in forward})
        if a.kind in ("B", "I"):
            forward[a.stage].remove(a.microbatch)
        if a.kind == "I":
            weight[a.stage].add(a.microbatch)
        if a.kind == "W":
            weight[a.stage].remove(a.microbatch)
    return out


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["interleaved-1f1b", "interleaved-zb", "zbv"]), st.integers(2, 4), st.integers(1, 4),
       st.integers(1, 3))
def test_held_phases_count_what_each_action_list_holds(name, ranks, rounds, v):
    v = 2 if name == "zbv" else v
    schedule = build_schedule(name, ranks, ranks * rounds, v)
    for actions in schedule.actions:
        stages = sorted({a.stage for a in actions})
        phases, counts = held_phases(actions), held_counts(actions)
        for k, sets in enumerate(in_flight(actions)):
            for i, s in enumerate(stages):
                forward, weight = sets.get(s, (set(), set()))
                assert phases[k][i] == (len(forward), len(weight))
                assert sum(phases[k][i]) == counts[k][i]


def _chunk(s: int) -> ChunkMemory:
    base = 100.0 * (s + 1)
    return ChunkMemory(ChunkPhase(base, base + 5, base + 7 + s), ChunkPhase(base + 30, base + 36, base + 40 + s),
                       10.0 + s, 3.0 + s, base + 50, 2.0 + s)


def counted(actions, chunks: dict[int, ChunkMemory]) -> list[float]:
    """A rank's bytes at each action, summed from the in-flight sets: the running stage's
    forward or backward for one micro-batch, every other micro-batch's S (and G past its I),
    every other stage idle, each stage in its first phase until a backward (or W) of it has
    ended; the input gradients it sent back, all but the one its later phase holds."""
    out = []
    for k, (a, sets) in enumerate(zip(actions, in_flight(actions))):
        total = 0.0
        for s in sorted({b.stage for b in actions}):
            c = chunks[s]
            ended = any(b.stage == s and b.kind in ("B", "W") for b in actions[:k])
            sent = sum(b.stage == s and b.kind in ("B", "I") for b in actions[:k])
            phase = c.later if ended else c.first
            forward, weight = sets.get(s, (set(), set()))
            running = a.microbatch if s == a.stage else None
            if running is None:
                total += phase.idle_bytes
            else:
                total += phase.forward_bytes if a.kind == "F" else phase.backward_bytes
            total += sum(c.held_bytes + (c.weight_input_bytes if b in weight else 0.0)
                         for b in forward | weight if b != running)
            if running is not None and a.kind == "W":
                total += c.weight_input_bytes
            total += max(0, sent - 1) * c.sent_gradient_bytes
        out.append(total)
    return out


def test_a_rank_holds_its_stages_worst_point_from_the_action_list():
    chunks = {s: _chunk(s) for s in range(4)}
    for name in ("interleaved-1f1b", "interleaved-zb", "zbv"):
        for actions in build_schedule(name, 2, 4, 2).actions:
            assert rank_memory_bytes(actions, chunks) == pytest.approx(counted(actions, chunks))


@pytest.mark.parametrize("name,p,v", [("interleaved-1f1b", 2, 2), ("interleaved-1f1b", 4, 2), ("interleaved-1f1b", 4, 3),
                                      ("interleaved-zb", 4, 2), ("zbv", 4, 2)])
def test_equal_stages_give_the_published_counts(name, p, v):
    """Equal stages (S = 1, no idle bytes, running = 1): rank 0 holds Megatron-LM's
    (v·p + p − 1) stage-micro-batches under interleaved 1F1B, i.e. (1 + (p − 1)/(p·v)) of
    1F1B's first stage's layers; ZB1P v·p; ZBV 2p (problem.pipeline's closed forms)."""
    m = 2 * p
    schedule = build_schedule(name, p, m, v)
    chunks = {s: ChunkMemory(ChunkPhase(0.0, 1.0, 1.0), ChunkPhase(0.0, 1.0, 1.0), 1.0, 0.0, 0.0)
              for s in range(p * v)}
    peak = max(rank_memory_bytes(schedule.actions[0], chunks))
    expected = {"interleaved-1f1b": v * p + p - 1, "interleaved-zb": v * p, "zbv": 2 * p}[name]
    assert peak == expected
    if name == "interleaved-1f1b":  # in layers, each stage L/(p·v) of L, against 1F1B's first stage's p·L/p
        assert peak / (p * v) == pytest.approx((1 + (p - 1) / (p * v)) * p / p)


def test_each_stage_is_searched_holding_its_most_micro_batches(interleaved):
    plan = interleaved
    assert plan.stages_per_rank == 2 and plan.ranks == 2 and len(plan.stages) == 4
    assert [(s.first_layer, s.end_layer) for s in plan.stages] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    held = held_micro_batches(plan.schedule, 2, 4, 2)
    for stage, k in zip(plan.stages, held):
        assert stage.held_micro_batches == k == stage.plan.problem.stage.held_micro_batches
    expected_ranks = (0, 1, 1, 0) if plan.schedule == "zbv" else (0, 1, 0, 1)
    assert plan.stage_ranks == expected_ranks


def test_a_ranks_peak_is_counted_from_its_action_list(interleaved):
    """Each rank's peak: the most of ``counted`` over its actions, or its optimizer step (every
    stage idle, the largest optimizer transient above it)."""
    plan = interleaved
    schedule = build_schedule(plan.schedule, 2, 4, 2)
    zero_bubble = plan.schedule != "interleaved-1f1b"
    chunks = {s: chunk_memory(stage.plan, zero_bubble) for s, stage in enumerate(plan.stages)}
    assert chunks[0].sent_gradient_bytes == 0 < chunks[1].sent_gradient_bytes
    for rank, actions in enumerate(schedule.actions):
        mine = [s for s, r in enumerate(plan.stage_ranks) if r == rank]
        idle = sum(chunks[s].later.idle_bytes for s in mine)
        optimizer = idle + max(chunks[s].optimizer_bytes - chunks[s].later.idle_bytes for s in mine)
        assert plan.rank_peaks[rank] == pytest.approx(max(*counted(actions, chunks), optimizer))
    assert plan.peak_bytes == max(plan.rank_peaks)


def test_a_stages_phases_differ_in_its_gradients_alone(interleaved):
    """Before its first backward a stage holds no gradient; after it, all of them: the idle
    bytes differ by its gradients' bytes (its plan's breakdown)."""
    for stage in interleaved.stages:
        c = chunk_memory(stage.plan)
        gradients = phase_evaluation(stage.plan, stage.plan.problem.micro_batches - 1).breakdown["gradients"]
        assert c.later.idle_bytes - c.first.idle_bytes == pytest.approx(gradients, rel=0.05)
        assert c.first.idle_bytes < c.first.forward_bytes and c.later.idle_bytes < c.later.backward_bytes


def test_one_stage_in_its_own_phase_gives_its_own_plans_peak(interleaved):
    """A stage alone on its rank, holding its k micro-batches, in the phase its problem prices
    (all m held: the first; fewer: the later): its plan's own peak."""
    for stage in interleaved.stages:
        c, ev = chunk_memory(stage.plan), stage.plan.evaluation
        k, m = stage.held_micro_batches, stage.plan.problem.micro_batches
        phase = c.first if k == m else c.later
        running = max(phase.forward_bytes, phase.backward_bytes) + (k - 1) * c.held_bytes
        assert max(running, c.optimizer_bytes) == pytest.approx(ev.peak_bytes)


def test_the_step_is_the_timeline_of_each_stages_times(interleaved):
    plan = interleaved
    times = [StageTimes(s.forward_s, s.backward_s, 0.0) for s in plan.stages]
    if plan.schedule != "interleaved-1f1b":
        shares = [weight_share(s.plan) for s in plan.stages]
        times = [StageTimes(s.forward_s, s.backward_s - w * (s.forward_s + s.backward_s), w * (s.forward_s + s.backward_s))
                 for s, w in zip(plan.stages, shares)]
        assert all(0 < w < 0.5 for w in shares)
    timeline = simulate(build_schedule(plan.schedule, 2, 4, 2).actions, times,
                        max(s.transfer_s for s in plan.stages))
    assert [s.idle_s for s in plan.stages] == pytest.approx([timeline.idle_s[r] for r in plan.stage_ranks])
    assert plan.makespan_s >= timeline.makespan_s * (1 - 1e-9)
    # what the once-a-step collectives add past the timeline: at most their whole time
    from memshard.pipelining import once_per_step
    extra = sum(once_per_step(s.plan).reductions_s + once_per_step(s.plan).gathers_s for s in plan.stages)
    assert plan.makespan_s <= timeline.makespan_s + extra + 1e-12


def test_the_json_records_the_stages_per_rank_and_reads_back(interleaved, tmp_path):
    data = interleaved.to_dict()
    assert data["schema"] == PIPELINE_SCHEMA_V and data["pipeline"]["stages_per_rank"] == 2
    assert data["rank_peak_bytes"] == list(interleaved.rank_peaks)
    path = tmp_path / "pp.json"
    interleaved.save(str(path))
    back = load_any_plan(str(path))
    assert isinstance(back, PipelinedPlan) and back.stages_per_rank == 2
    assert back.rank_peaks == pytest.approx(interleaved.rank_peaks)
    assert back.schedule == interleaved.schedule and back.step_time_s == interleaved.step_time_s


def test_one_stage_per_rank_is_still_written_and_read_as_before():
    plan = plan_pipelined(Job("tiny-gpt", "4", batch=8, micro_batches=4), SearchOptions(), PipelineOptions(2))
    data = plan.to_dict()
    assert data["schema"] == PIPELINE_SCHEMA and "stages_per_rank" not in data["pipeline"]
    assert "rank_peak_bytes" not in data
    back = PipelinedPlan.from_dict(data)
    assert back.stages_per_rank == 1 and back.rank_peaks == tuple(s.plan.peak_bytes for s in plan.stages)
    assert back.peak_bytes == plan.peak_bytes


@pytest.mark.parametrize("kwargs,words", [
    ({"schedule": "1f1b", "stages_per_rank": 3}, "1f1b runs one stage per rank"),
    ({"schedule": "gpipe", "stages_per_rank": 2}, "gpipe runs one stage per rank"),
    ({"schedule": "zbv", "stages_per_rank": 3}, "zbv runs exactly 2 stages"),
    ({"schedule": "interleaved-1f1b", "stages_per_rank": 0}, "at least 1 stage"),
    ({"schedule": "interleaved-1f1b", "split": (1, 1)}, "4 pipeline stages take 4 layer counts"),
])
def test_contradictory_options_are_refused(kwargs, words):
    with pytest.raises(MemshardError, match=words):
        PipelineOptions(2, **kwargs)


def test_a_pipeline_needs_a_layer_per_stage_and_micro_batches_its_schedule_takes():
    two = Job("tiny-gpt", "4", batch=8, micro_batches=4)
    with pytest.raises(MemshardError, match="need at least 4 layers; the model has 2"):
        plan_pipelined(two, SearchOptions(), PipelineOptions(2, "interleaved-1f1b"))
    # torch's rounds: max(1, m // p) must divide m (p = 2, m = 6: 3 rounds of 2; p = 4: 1 round)
    five = Job("tiny-gpt", "8", batch=20, micro_batches=5, overrides={"num_layers": 8})
    with pytest.raises(MemshardError, match="multiple of"):
        plan_pipelined(five, SearchOptions(), PipelineOptions(2, "interleaved-1f1b"))
    six = Job("tiny-gpt", "8", batch=24, micro_batches=6, overrides={"num_layers": 8})
    assert pipeline_degrees(six, "interleaved-1f1b", 2) == (2, 4)
    assert pipeline_degrees(five, "interleaved-1f1b", 2) == (4,)
    assert pipeline_degrees(Job("tiny-gpt", "8", batch=24, micro_batches=6, overrides={"num_layers": 6}),
                            "interleaved-1f1b", 2) == (2,)  # 4 ranks × 2 stages need 8 layers


def test_auto_tries_interleaving_for_the_fastest_step_only():
    assert auto_schedules(SearchOptions(), None, None) == (("1f1b", 1),)
    assert auto_schedules(SearchOptions(objective="time"), None, None) == (("1f1b", 1), ("interleaved-1f1b", 2))
    assert auto_schedules(SearchOptions(), "zbv", None) == (("zbv", 2),)
    with pytest.raises(MemshardError, match="give --schedule too"):
        auto_schedules(SearchOptions(), None, 3)


def test_the_cli_offers_every_schedule():
    assert SCHEDULE_CHOICES == PIPELINE_SCHEDULES


@pytest.mark.parametrize("flags,words", [
    (["--pipeline", "2", "--schedule", "1f1b", "--virtual-stages", "3"], "1f1b runs one stage per rank"),
    (["--pipeline", "2", "--schedule", "zbv", "--virtual-stages", "3"], "zbv runs exactly 2 stages"),
    (["--pipeline", "2", "--schedule", "interleaved-1f1b"], "need at least 4 layers"),
    (["--virtual-stages", "2"], "give --pipeline too"),
])
def test_the_cli_says_what_contradicts_in_one_line(flags, words, capsys):
    assert main(["plan", "--model", "tiny-gpt", "--mesh", "4", "--batch", "8", "--micro-batches", "4", *flags]) != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("memshard: error:") and words in err and "\n" not in err


def test_the_cli_plans_and_reports_an_interleaved_pipeline(tmp_path, capsys):
    path = tmp_path / "pp.json"
    main(["plan", "--model", "tiny-gpt", "--layers", "4", "--mesh", "4", "--batch", "8", "--micro-batches", "4",
          "--pipeline", "2", "--schedule", "interleaved-1f1b", "--brief", "--json", str(path)])
    out = " ".join(capsys.readouterr().out.split())
    assert "2 per rank on 2 ranks" in out and "rank 0" in out and "rank 1" in out
    data = json.loads(path.read_text())
    assert data["pipeline"]["stages_per_rank"] == 2 and len(data["stages"]) == 4


# -- Megatron-LM's interleaved pipeline (-vpp<V>) ---------------------------------------------------

def test_a_megatron_name_takes_its_virtual_stages_after_its_pipeline():
    name = parse_strategy("megatron-tp8-pp8-vpp2-dp4-sp-distopt")
    assert (name.pipeline_parallel, name.virtual_pipeline, name.data_parallel) == (8, 2, 4)
    assert str(name) == "megatron-tp8-pp8-vpp2-dp4-sp-distopt"
    assert str(name.stage_recipe) == "megatron-tp8-dp4-sp-distopt"
    with pytest.raises(MemshardError, match="needs a pipeline"):
        parse_strategy("megatron-tp2-vpp2")
    with pytest.raises(MemshardError):
        parse_strategy("fsdp2-pp2-vpp2")


@pytest.fixture(scope="module")
def megatron_interleaved() -> PipelinedPlan:
    return pipelined_baseline(FOUR, "megatron-tp2-pp2-vpp2")


def test_megatrons_interleaving_is_priced_with_the_interleaved_schedule(megatron_interleaved):
    plan = megatron_interleaved
    assert plan.strategy == "megatron-tp2-pp2-vpp2" and plan.schedule == "interleaved-1f1b"
    assert plan.stages_per_rank == 2 and len(plan.stages) == 4
    assert tuple(s.held_micro_batches for s in plan.stages) == held_micro_batches("interleaved-1f1b", 2, 4, 2)
    assert all(s.plan.problem.framework.startswith("megatron") for s in plan.stages)


def test_megatrons_first_rank_holds_its_theoretical_memory_usage_factor(megatron_interleaved):
    """Megatron-LM's ``theoretical_memory_usage.py`` multiplies the first stage's activations
    by 1 + (p − 1)/(p·v) under interleaving (p in-flight micro-batches of L/p layers without):
    rank 0's most layer-micro-batches held at once, counted from its action list and the
    plan's stages, is L·(1 + (p − 1)/(p·v))."""
    plan, p, v = megatron_interleaved, 2, 2
    layers = FOUR.graph.num_layers
    actions = build_schedule(plan.schedule, p, FOUR.micro_batches, v).actions[0]
    stages = sorted({a.stage for a in actions})
    held = max(sum(n * plan.stages[s].num_layers for s, n in zip(stages, counts)) for counts in held_counts(actions))
    assert held == layers * (1 + (p - 1) / (p * v))
    # and the plan's peak on rank 0 exceeds the non-interleaved pipeline's first stage's
    assert plan.rank_peaks[0] > pipelined_baseline(FOUR, "megatron-tp2-pp2").rank_peaks[0]


def test_export_writes_megatrons_virtual_stages(megatron_interleaved):
    from memshard.plans.export import export_target, render

    text = render(export_target("megatron-tp2-pp2-vpp2"), megatron_interleaved)
    assert "--pipeline-model-parallel-size 2" in text
    assert "--num-layers-per-virtual-pipeline-stage 1" in text  # 4 layers over 2 ranks × 2
    assert "pipeline rank 0 of 2 (stages 0, 2)" in text
