"""Pipelined baselines (``pipelining.pipelined_baseline``): Megatron-LM's and torchtitan's. Each
stage runs the recipe the rest of the name says, on that stage's problem, holding the
micro-batches 1F1B makes it hold; Megatron-LM's stage 0 checked against Megatron-LM's
``theoretical_memory_usage.py``; torchtitan's ``fully_shard`` as torch's ``PipelineStage`` runs
it (measured against PyTorch in tests/baselines/test_pipeline_fsdp2.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import memshard
from memshard.api import runtime_plan
from memshard.baselines.recipes import baselines
from memshard.job import Job
from memshard.pipelining import (
    PipelineOptions,
    held_micro_batches,
    megatron_held_micro_batches,
    once_per_step,
    pipelined_baseline,
    pipelined_baselines,
    plan_pipelined,
)
from memshard.planner import SearchOptions
from memshard.plans.pipelined import PipelinedPlan
from memshard.problem.evaluate import evaluate
from memshard.problem.pricing import build_problem
from memshard.problem.records import PipelineStage

# tiny-gpt with 4 layers in bf16 (Megatron-LM's precision): h 128, ffn 512, V 512, 128 positions, s 32
JOB = Job("tiny-gpt", "2x4", batch=16, micro_batches=4, overrides={"num_layers": 4}, precision="mixed")
H, FFN, V, POSITIONS, S, LAYERS = 128, 512, 512, 128, 32, 4


@settings(max_examples=80, deadline=None)
@given(st.integers(2, 16), st.integers(1, 40))
def test_megatrons_warm_up_plus_one_in_flight_is_torchs_1f1b(stages, micro_batches):
    """Megatron-LM's ``num_warmup = min(p − i − 1, m)``, one more forward in the steady state,
    is what torch's ``Schedule1F1B`` action list holds: min(p − i, m)."""
    assert megatron_held_micro_batches(stages, micro_batches) == tuple(
        min(stages - i, micro_batches) for i in range(stages))
    if micro_batches >= stages:  # (torch's 1F1B refuses fewer micro-batches than stages)
        assert megatron_held_micro_batches(stages, micro_batches) == held_micro_batches(
            "1f1b", stages, micro_batches)


@pytest.fixture(scope="module")
def distopt() -> PipelinedPlan:
    return memshard.strategy_plan(JOB, strategy="megatron-tp2-pp2-dp2-sp-distopt")


def test_each_stage_is_the_recipe_on_its_own_problem_holding_what_1f1b_makes_it(distopt):
    assert isinstance(distopt, PipelinedPlan) and distopt.strategy == "megatron-tp2-pp2-dp2-sp-distopt"
    assert distopt.objective is None and distopt.schedule == "1f1b"
    assert distopt.mesh.shape == (2, 4) and distopt.stage_mesh.shape == (4,)
    for s, held in zip(distopt.stages, (2, 1)):
        problem = s.plan.problem
        assert problem.framework == "megatron"
        assert problem.stage == PipelineStage(s.first_layer, s.end_layer, held)
        assert s.plan.strategy == distopt.strategy
        # the recipe as ``baselines`` lays it out on the stage's own problem
        stage_problem = build_problem(JOB.graph, distopt.stage_mesh, micro_batches=4, stage=problem.stage)
        recipe, _ = baselines(stage_problem, lambda name: name == "megatron-tp2-dp2-sp-distopt")
        assert recipe[0].selection == s.plan.selection
        assert evaluate(problem, s.plan.selection).peak_bytes == pytest.approx(s.plan.peak_bytes)
    assert [(s.first_layer, s.end_layer) for s in distopt.stages] == [(0, 2), (2, 4)]


def test_stage_0s_peak_holds_its_waiting_micro_batch(distopt):
    first = distopt.stages[0].plan
    alone = build_problem(JOB.graph, first.problem.mesh, micro_batches=4, stage=PipelineStage(0, 2, 1),
                          framework="megatron")
    one = evaluate(alone, first.selection)
    assert one.boundary_activation_bytes > 0
    assert first.peak_bytes == pytest.approx(one.peak_bytes + one.boundary_activation_bytes)


def megatron_weight_and_optimizer_bytes(tp: int, pp: int, dp: int) -> float:
    """``compute_weight_and_optimizer_memory`` of Megatron-LM's theoretical_memory_usage.py for
    a GPT (LayerNorm, no GQA, no SwiGLU, tied embeddings) with --use-distributed-optimizer."""
    norm_size = 2
    self_attn_term = 2 * H * H * ((1 + 1) * 1)
    layer = 2 * H * (FFN + norm_size) + self_attn_term
    block = layer * LAYERS + norm_size * H  # (the final layernorm)
    most_loaded = (block / pp + H * V) / tp
    return most_loaded * (6 + 12 / dp)


@pytest.mark.parametrize("tp, dp", [(1, 4), (2, 2)])
def test_stage_0s_weights_and_optimizer_are_megatrons_term_where_the_terms_agree(tp, dp):
    """Megatron-LM's term: (the block's parameters / p + the embedding) / TP × (6 + 12/DP) bytes
    (bf16 weight, fp32 gradient buffer, fp32 master weight and Adam states sharded over DP).
    memshard prices the same bytes per parameter on stage 0's real parameters; the terms
    differ where the formula leaves parameters out or divides them all by TP: the linears'
    biases (9h a layer), the learned positions (positions × h), the final layernorm (on the
    last stage, not 2h/p on each), and under TP the parameters every TP rank keeps whole (the
    layernorms, 4h, and the row-parallel linears' biases, 2h, of each layer; the positions)."""
    name = f"megatron-tp{tp}-pp2" + (f"-dp{dp}" if dp > 1 else "") + ("-sp" if tp > 1 else "") + "-distopt"
    plan = memshard.strategy_plan(JOB, strategy=name)
    breakdown = plan.stages[0].plan.memory.breakdown
    states = breakdown["parameters"] + breakdown["gradients"] + breakdown["optimizer_states"]
    per_parameter = 6 + 12 / dp
    layers = LAYERS // 2
    omitted = 9 * H * layers + POSITIONS * H - 2 * H / 2  # biases, positions, less the final norm's share
    whole = (6 * H * layers + POSITIONS * H) * (1 - 1 / tp)  # kept whole by every TP rank
    assert states == megatron_weight_and_optimizer_bytes(tp, 2, dp) + (omitted / tp + whole) * per_parameter


def megatron_activation_bytes(tp: int, pp: int, micro_batch: int, micro_batches: int) -> float:
    """``compute_activation_memory`` of theoretical_memory_usage.py (sequence parallelism with
    selective recomputation; the first stage, the non-interleaved schedule)."""
    sbh = S * micro_batch * H
    activations = sbh * (18 + 4 * FFN / H) * LAYERS  # L/p layers × p micro-batches in flight
    activations += 8 * S * micro_batch * pp + sbh * pp  # the embedding's input and its dropout
    activations *= min(1, micro_batches / pp)
    return activations / tp


def test_stage_0s_activations_are_megatrons_first_stage_term_term_by_term():
    """Under sequence parallelism with selective recomputation each held micro-batch keeps, on
    stage 0, what the formula counts (34sbh/t a layer, Korthikanti et al. Table 2; the
    embedding's dropout mask sbh/t) and two terms it does not: the token ids whole on every TP
    rank (8sb, the formula 8sb/t) and the activations sent to the next stage (2sbh/t bytes of
    bf16), which memshard keeps until their backward as torch's pipelining does, while
    Megatron-LM frees them once sent (``deallocate_pipeline_outputs``). At the peak (in the
    backward) the total is within 2% of the formula's."""
    plan = memshard.strategy_plan(JOB, strategy="megatron-tp2-pp2-dp2-sp-distopt+selective", recompute="selective")
    first = plan.stages[0].plan
    tp, micro_batch = 2, JOB.global_batch // (JOB.micro_batches * 2)
    sbh = S * micro_batch * H
    held = evaluate(first.problem, first.selection).boundary_activation_bytes
    counted = 34 * sbh / tp * (LAYERS // 2) + sbh / tp
    assert held == counted + 8 * S * micro_batch + 2 * sbh / tp
    formula = megatron_activation_bytes(tp, 2, micro_batch, JOB.micro_batches)
    assert formula == pytest.approx(2 * (counted + 8 * S * micro_batch / tp))
    assert first.memory.breakdown["activations"] == pytest.approx(formula, rel=0.02)


def test_the_step_is_priced_as_memshards_pipelined_plans(distopt):
    """The same schedule and pricing as memshard's own pipelined plans: the step is the
    makespan (once-a-step collectives at its ends, ``once_per_step``) and the slowest optimizer
    step; memshard's fastest pipelined plan of the same degree, each stage searched, is no
    slower (the recipe is one point of its search)."""
    m, p = JOB.micro_batches, 2
    slowest = max(s.forward_s + s.backward_s for s in distopt.stages)
    transfer = max(s.transfer_s for s in distopt.stages)
    once = [once_per_step(s.plan) for s in distopt.stages]
    ends = sum(o.reductions_s + o.gathers_s for o in once)
    assert all(o.reductions_s > 0 and o.gathers_s > 0 for o in once)  # (the distributed optimizer: ZeRO-1)
    assert m * slowest <= distopt.makespan_s <= (m + p - 1) * slowest + 2 * (p - 1) * transfer + ends + 1e-12
    for s, o in zip(distopt.stages, once):
        assert m * (s.forward_s + s.backward_s) + o.in_step_s + s.plan.compute_by_kind.get(
            "optimizer step", 0.0) == pytest.approx(s.plan.step_time_s)
    assert distopt.step_time_s == pytest.approx(distopt.makespan_s + distopt.optimizer_s)
    fastest = plan_pipelined(JOB, SearchOptions(objective="time", memory_budget=float("inf")), PipelineOptions(2))
    assert fastest.step_time_s <= distopt.step_time_s * (1 + SearchOptions().gap)


@pytest.mark.parametrize("strategy", ["fsdp2-pp2-noreshard", "fsdp2-pp2", "torch-tp2-pp2-fsdp2-noreshard"])
def test_a_pipelined_fully_shard_accumulates_unsharded_gradients_until_the_steps_end(strategy):
    """torch's ``PipelineStage`` runs each micro-batch's backward without gradient sync: every
    weight's gradient waits unsharded, in FSDP2's reduce dtype (fp32 under bf16), until the
    step's last backward point; then only its shard over the stage's devices is left."""
    plan = memshard.strategy_plan(JOB, strategy=strategy)
    assert isinstance(plan, PipelinedPlan) and plan.strategy == strategy
    for stage in plan.stages:
        problem = stage.plan.problem
        graph, schedule, precision = problem.graph, problem.schedule, problem.graph.precision
        assert problem.framework.startswith(strategy.split("-pp2")[0].replace("-tp2", "-tp"))
        local = sum(graph.tensors[p].numel for p in graph.parameters if graph.consumers.get(p))
        tensor_parallel = 2 if strategy.startswith("torch-tp2") else 1
        evaluation = evaluate(problem, stage.plan.selection)
        gradients = [evaluation.breakdown_at(point)["gradients"] for point in (schedule.reshard_out(0),
                                                                               schedule.optimizer)]
        # (tensor parallelism splits the linears' weights, not the norms': within a few %)
        assert gradients[0] == pytest.approx(local * precision.reduce_bytes / tensor_parallel,
                                             rel=0.05 if tensor_parallel > 1 else 1e-9)
        assert gradients[1] == pytest.approx(gradients[0] / (4 // tensor_parallel) * precision.sharded_grad_bytes
                                             / precision.reduce_bytes, rel=0.02)


def test_not_resharded_after_forward_a_stage_holds_its_weights_gathered_all_step():
    """torchtitan's default under a pipeline (``reshard_after_forward=False``): gathered by the
    first forward, kept over every micro-batch until the step's end, where resharding after
    forward frees them between a forward and its backward (and gathers them again in
    backward, with FSDP2's flat buffers: not always the smaller peak, as PyTorch measures)."""
    kept, resharded = (memshard.strategy_plan(JOB, strategy=s) for s in ("fsdp2-pp2-noreshard", "fsdp2-pp2"))
    for a, b in zip(kept.stages, resharded.stages):
        problem = a.plan.problem
        gathered = sum(problem.graph.tensors[p].numel for p in problem.graph.parameters
                       if problem.graph.consumers.get(p)) * problem.graph.precision.param_bytes
        boundary = problem.schedule.boundary - 1  # the forward's last point
        at = [evaluate(s.plan.problem, s.plan.selection).breakdown_at(boundary)["transients"] for s in (a, b)]
        assert at[0] - at[1] > 0.5 * gathered  # the layers' weights (the root's stay)


def test_torchtitans_pipelines_are_listed_beside_megatrons_and_not_exported():
    found, skipped = pipelined_baselines(JOB, 2)
    names = {p.strategy for p in found}
    assert {"fsdp2-pp2", "fsdp2-pp2-noreshard", "fsdp2-pp2-torchtitan", "torch-tp2-pp2-fsdp2",
            "torch-tp2-pp2-fsdp2-noreshard", "torch-tp2-pp2-fsdp2-torchtitan"} <= names
    assert not any("prefetch" in n or "-reshard" in n or n.startswith("tp") for n in names) and not skipped
    with pytest.raises(memshard.MemshardError, match="export each stage's recipe, fsdp2-noreshard") as raised:
        memshard.export(JOB, strategy="fsdp2-pp2-noreshard")
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("strategy, why", [
    ("megatron-tp2-dp4", "not a pipelined baseline"),
    ("fsdp2-noreshard", "not a pipelined baseline"),
    ("megatron-tp4-pp2-sp-distopt", "each stage runs megatron-tp4-sp-distopt, which its mesh does not lay out"),
    ("megatron-tp2-pp4-sp", "4 pipeline stages do not divide the outermost axis"),
])
def test_a_configuration_the_job_does_not_lay_out_is_one_line(strategy, why):
    with pytest.raises(memshard.MemshardError, match=why) as raised:
        pipelined_baseline(JOB, strategy)
    assert "\n" not in str(raised.value)


def test_too_few_micro_batches_and_the_runtime_are_one_line():
    with pytest.raises(memshard.MemshardError, match="needs at least 2 micro-batches"):
        memshard.strategy_plan(Job("tiny-gpt", "2x4", batch=16), strategy="megatron-tp2-pp2-dp2")
    with pytest.raises(memshard.MemshardError, match="its runtime does not run them"):
        runtime_plan(JOB, "megatron-tp2-pp2-dp2")


def test_compare_with_a_pipeline_lists_memshards_plans_and_every_megatron_configuration(tmp_path, capsys):
    """``memshard compare --pipeline 2``: memshard's least-memory and fastest pipelined plans,
    then every Megatron-LM configuration with 2 stages that the stage mesh lays out, each the
    plan ``strategy_plan`` gives by its name."""
    import json

    from memshard.baselines.names import Kind, parse_strategy
    from memshard.cli import main

    path = tmp_path / "compare.json"
    argv = ["compare", "--model", "tiny-gpt", "--mesh", "2x4", "--layers", "4", "--precision", "mixed",
            "--batch", "16", "--micro-batches", "4", "--pipeline", "2", "--json", str(path)]
    assert main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "in 2 pipeline stages (1F1B, 4 micro-batches), each on mesh 4" in out
    result = json.loads(path.read_text())
    names = [row["strategy"] for row in result["rows"]]
    assert names[:2] == ["memshard", "memshard fastest"]
    assert result["pipeline"]["stages"] == 2 and result["pipeline"]["stage_mesh"]["shape"] == [4]
    pipelined = {name: parse_strategy(name) for name in names[2:]}
    assert all(n.pipeline_parallel == 2 for n in pipelined.values())
    # every Megatron-LM layout of a stage mesh of 4: TP 1, 2, 4 (-sp), with -distopt(-overlap) where DP > 1
    assert {name for name, n in pipelined.items() if n.kind is Kind.MEGATRON} == {"megatron-tp1-pp2-dp4", "megatron-tp1-pp2-dp4-distopt",
                              "megatron-tp1-pp2-dp4-distopt-overlap", "megatron-tp2-pp2-dp2",
                              "megatron-tp2-pp2-dp2-sp", "megatron-tp2-pp2-dp2-sp-distopt",
                              "megatron-tp2-pp2-dp2-sp-distopt-overlap", "megatron-tp4-pp2", "megatron-tp4-pp2-sp"}
    # torchtitan's: fully_shard alone and under TP 2, its defaults, not resharded after forward, its units
    assert {name for name, n in pipelined.items() if n.kind is not Kind.MEGATRON} == {
        "fsdp2-pp2", "fsdp2-pp2-noreshard", "fsdp2-pp2-torchtitan", "torch-tp2-pp2-fsdp2",
        "torch-tp2-pp2-fsdp2-noreshard", "torch-tp2-pp2-fsdp2-torchtitan"}
    peaks = [row["peak_bytes_per_device"] for row in result["rows"][2:]]
    assert peaks == sorted(peaks)
    memory, fastest = result["rows"][:2]
    assert memory["peak_bytes_per_device"] <= min(peaks) * (1 + SearchOptions().gap)
    assert fastest["estimated_step_time_s"] <= min(r["estimated_step_time_s"] for r in result["rows"][2:]) * (
        1 + SearchOptions().gap)
    for row in result["rows"][2:4]:
        plan = memshard.strategy_plan(JOB, strategy=row["strategy"])
        assert row["peak_bytes_per_device"] == pytest.approx(plan.peak_bytes)
        assert row["estimated_step_time_s"] == pytest.approx(plan.step_time_s)
