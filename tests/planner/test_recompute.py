"""Recomputation in the planner: the policies price what Megatron-LM's paper derives, the ILP
prices recomputing plans as the evaluator does, the search uses the choice, baselines and
plans carry it, and ``none`` leaves the problem as it was."""

from __future__ import annotations

import functools
import json
import math
import random
import time

import numpy as np
import pytest

import memshard
from memshard.api import strategy_plan
from memshard.baselines.recipes import baselines
from memshard.core.errors import MemshardError
from memshard.core.mesh import parse_mesh
from memshard.models import build_graph
from memshard.plans.plan import plan_from_dict
from memshard.problem.evaluate import InconsistentPlan, evaluate
from memshard.problem.memory import CATEGORIES
from memshard.problem.pricing import build_problem
from memshard.problem.recompute import (
    core_attention,
    mlp_module,
    op_level_replayed,
    replay_flags,
    replayable_ops,
)
from memshard.problem.records import CACHED
from memshard.search.formulation import Formulation
from memshard.search.solve import SearchRequest, Solver, solve, solve_fixed
from tests.unit.test_ilp_pricing import random_plan


@functools.cache  # (a policy's problem on a mesh: read by two cases)
def _three_layers(policy: str, mesh: str, s: int, b: int, h: int, a: int):
    """GPT-3 1.3B's layers, three of them, at sequence ``s``, batch ``b``, hidden ``h``, ``a``
    heads, under recomputation ``policy`` on ``mesh``."""
    graph = build_graph("gpt3-1.3b", batch=b, seq=s, hidden=h, heads=a, ffn=4 * h, num_layers=3, precision="mixed")
    return build_problem(graph, parse_mesh(mesh), recompute=policy)


def _per_layer_activations(policy: str, mesh: str, strategy: str, s: int, b: int, h: int, a: int) -> float:
    """Activation bytes one layer adds to what the forward holds under a baseline, from its
    evaluation: live activations before layer 2's first op minus before layer 1's. (That
    baseline alone is built: the others' problems are not.)"""
    (fixed,), _ = baselines(_three_layers(policy, mesh, s, b, h, a), lambda name: name == strategy)
    ev = evaluate(fixed.problem, fixed.selection)
    activations = ev.category_bytes[CATEGORIES.index("activations")]
    # (the baseline's own problem: its framework's graph may have ops of its own, Megatron-LM's gathers)
    ops, schedule = fixed.problem.graph.ops, fixed.problem.schedule
    first = [min(i for i, op in enumerate(ops) if op.layer == k) for k in (1, 2)]
    return float(activations[schedule.reshard_in(first[1])] - activations[schedule.reshard_in(first[0])])


SUFFIX = {"none": "", "selective": "+selective", "full": "+full"}


@pytest.mark.parametrize("policy, per_layer", [
    ("none", lambda s, b, h, a: s * b * h * (34 + 5 * a * s / h)),
    ("selective", lambda s, b, h, a: 34 * s * b * h),
    ("full", lambda s, b, h, a: 2 * s * b * h),
])
def test_per_layer_activations_are_megatrons(policy, per_layer):
    """Korthikanti et al. 2022 (Reducing Activation Recomputation in Large Transformer
    Models), 16-bit activations, 1-byte dropout masks: a GPT layer keeps sbh(34 + 5as/h)
    bytes without recomputation, 34sbh with selective (core attention) recomputation, 2sbh
    (its input) with full recomputation. (Replayed as memshard's runtime and Megatron-LM
    replay: PyTorch's selective checkpoint, ``ddp+selective``, also caches the outputs it
    does not recompute until the block's recompute: 8sbh more, the attention's and the MLP's
    output projections and their dropouts, which only the residual adds read.)"""
    s, b, h, a = 256, 2, 256, 8
    got = _per_layer_activations(policy, "1", "dp" + SUFFIX[policy], s, b, h, a)
    assert got == pytest.approx(per_layer(s, b, h, a))
    if policy == "selective":
        cached = _per_layer_activations(policy, "1", "ddp+selective", s, b, h, a)
        assert cached == pytest.approx(per_layer(s, b, h, a) + 8 * s * b * h)


@pytest.mark.parametrize("policy, suffix, per_layer", [
    ("none", "", lambda s, b, h, a, t: s * b * h / t * (34 + 5 * a * s / h)),
    ("selective", "+selective", lambda s, b, h, a, t: 34 * s * b * h / t),
    ("full", "+full", lambda s, b, h, a, t: 2 * s * b * h / t),
    ("auto", "+selective-mlp", lambda s, b, h, a, t: s * b * h / t * (16 + 5 * a * s / h)),
    ("auto", "+selective-attn-mlp", lambda s, b, h, a, t: 16 * s * b * h / t),
])
def test_per_layer_activations_with_tensor_and_sequence_parallelism(policy, suffix, per_layer):
    """The same paper with tensor and sequence parallelism of degree t: every term ÷ t (the
    checkpointed input of full recomputation is the sequence-parallel piece). Megatron-LM's
    MLP module recomputed (``--recompute-modules mlp``) drops the paper's MLP terms but the
    dropout mask after it — the first linear's input 2sbh, the GeLU's input 8sbh, the second
    linear's input 8sbh — and keeps the norm's input (the checkpoint's), already counted:
    16sbh + 5as²b; with the core attention too (``core_attn mlp``) 16sbh."""
    s, b, h, a, t = 256, 2, 256, 8, 4
    got = _per_layer_activations(policy, "4", f"megatron-tp{t}-sp" + suffix, s, b, h, a)
    assert got == pytest.approx(per_layer(s, b, h, a, t))


def test_policies_pick_the_ops_megatron_recomputes():
    graph = build_graph("tiny-gpt", batch=2, seq=16)
    names = lambda ops: {graph.ops[i].name.split(".", 2)[-1] for i in ops}  # noqa: E731
    assert names(core_attention(graph)) == {"attn.scores", "attn.softmax", "attn.attn_dropout"}
    # --recompute-modules mlp: the MLP module, its norm fused into the first linear (Transformer Engine)
    assert names(mlp_module(graph)) == {"ln_2", "mlp.fc", "mlp.gelu", "mlp.proj"}
    llama = build_graph("tiny-llama", batch=2, seq=16)
    assert {llama.ops[i].name.split(".", 2)[-1] for i in mlp_module(llama)} == {
        "post_attention_layernorm", "mlp.gate", "mlp.up", "mlp.act", "mlp.mul", "mlp.down"}
    # Every op of a layer but its last (whose output the next layer saves): the layer keeps its input.
    assert names(replayable_ops(graph)) == {op.name.split(".", 2)[-1] for op in graph.ops
                                            if op.layer is not None} - {"mlp.residual"}
    assert all(f == (False,) for f in replay_flags(graph, "none"))
    assert {f for f in replay_flags(graph, "auto")} == {(False,), (False, True)}


@functools.cache
def _problem(model: str, mesh: str, policy: str, unit: str = "op"):
    return build_problem(build_graph(model, batch=8, precision="fp32"), parse_mesh(mesh), recompute=policy,
                         zero3_unit=unit)


@functools.cache  # (tiny GPT's on 2x2 with recomputation: read by two tests)
def _baselines(model: str, mesh: str, policy: str, unit: str = "op"):
    return baselines(_problem(model, mesh, policy, unit))


@pytest.mark.parametrize("model, mesh, unit", [("tiny-gpt", "2x2", "op"), ("tiny-llama", "4", "op"),
                                               ("tiny-gpt", "1x4", "op")])
def test_ilp_prices_random_recomputing_plans_as_the_evaluator(model, mesh, unit):
    """Random strategies, storage, keep flags and recompute choices, every choice pinned:
    the ILP's peak is the evaluator's (plans the rules refuse are skipped)."""
    problem = _problem(model, mesh, "auto", unit)
    rng = random.Random(7)
    plans, expected = [], []
    while len(plans) < 6:
        plan = random_plan(problem, rng)
        try:
            expected.append(evaluate(problem, plan).peak_bytes)
        except InconsistentPlan:
            continue
        plans.append(plan)
    # (one formulation, pinned to each plan in turn)
    for plan, peak, forced in zip(plans, expected, solve_fixed(SearchRequest(problem, "memory", mip_gap=0.0), plans),
                                  strict=True):
        assert forced.selection == plan
        assert forced.ilp_peak_bytes == pytest.approx(peak, rel=1e-6)


def test_none_prices_every_plan_as_before():
    """A plan that recomputes nothing costs the same in an ``auto`` problem (ZeRO-3 per op)."""
    none, auto = _problem("tiny-gpt", "2x2", "none"), _problem("tiny-gpt", "2x2", "auto")
    assert len(none.groups) == len(auto.groups) and len(none.edges) == len(auto.edges)
    in_auto = {b.name: b for b in _baselines("tiny-gpt", "2x2", "auto")[0]}
    for a in _baselines("tiny-gpt", "2x2", "none")[0]:
        b = in_auto[a.name]
        ea, eb = evaluate(a.problem, a.selection), evaluate(b.problem, b.selection)
        assert (ea.peak_bytes, ea.step_time_s) == pytest.approx((eb.peak_bytes, eb.step_time_s))


SHAPE_1_3B = dict(batch=8, seq=1024, num_layers=2, precision="mixed")  # GPT-3 1.3B's layers, two of them, on 8


@functools.cache
def _recomputing_plan_1_3b():
    """memshard's least-memory plan of ``SHAPE_1_3B`` with recomputation searched, ZeRO-3
    gathered per layer (the unit that serves a replay), to a 1% gap: searched once, read by
    the two tests below."""
    return memshard.plan("gpt3-1.3b", "8", recompute="auto", zero3_unit="layer", mip_gap=0.01, **SHAPE_1_3B)


@functools.cache
def _least_memory_1_3b():
    """memshard's least-memory plan of ``SHAPE_1_3B`` without recomputation, to a 1% gap:
    searched once, read by the two tests below (the least memory is searched on the mesh as
    typed, mesh views or not: ``SearchOptions.mesh_views``)."""
    return memshard.plan("gpt3-1.3b", "8", mip_gap=0.01, time_limit_s=30, **SHAPE_1_3B)


def test_search_uses_recomputation():
    """The least-memory plan with recomputation searched needs less than without, and no
    more than full recomputation; its step time pays the replays. (Searched with ZeRO-3 by
    layer: no more than full recomputation over both units. The leaner of both units is
    test_planner's ``test_the_least_memory_with_recomputation_is_the_leaner_of_both_zero3_units``.)"""
    kw = dict(SHAPE_1_3B, mip_gap=0.01, time_limit_s=30)
    none = _least_memory_1_3b()
    full = memshard.plan("gpt3-1.3b", "8", recompute="full", **kw)
    auto = _recomputing_plan_1_3b()
    assert full.peak_bytes < 0.8 * none.peak_bytes
    assert auto.peak_bytes <= full.peak_bytes * 1.011
    assert full.recompute_time_s > 0 and none.recompute_time_s == 0
    assert all(op.recomputed for op in full.ops if op.instances == 2 and op.name != "mlp.residual")


def test_time_objective_recomputes_only_what_the_budget_needs():
    """Under a memory budget below what any plan without recomputation needs (5% under the
    least-memory plan, proved within 1%), the fastest plan recomputes some ops, fits the
    budget and is no slower than full recomputation's fastest plan."""
    kw = dict(batch=8, seq=1024, num_layers=2, precision="mixed", mip_gap=0.01, time_limit_s=30, mesh_views=False)
    least = _least_memory_1_3b()  # (the same job and search)
    budget = 0.95 * least.peak_bytes
    full = memshard.plan("gpt3-1.3b", "8", objective="time", memory_budget=budget, recompute="full", **kw)
    auto = memshard.plan("gpt3-1.3b", "8", objective="time", memory_budget=budget, recompute="auto", **kw)
    assert auto.peak_bytes <= budget
    assert auto.step_time_s <= full.step_time_s * 1.011
    assert 0 < sum(op.recomputed for op in auto.ops) < sum(op.recomputed for op in full.ops)


def test_baselines_come_with_each_recomputation():
    names = {b.name for b in _baselines("tiny-gpt", "2x2", "auto")[0]}
    for base in ("ddp", "zero2", "megatron-tp2-dp2-sp", "megatron-tp2-dp2-sp-distopt"):
        assert {base, base + "+selective", base + "+full"} <= names
    # ZeRO-3 weights gathered per op do not serve a replay: FSDP recomputes with per-layer units.
    assert "zero3-fsdp+full" not in names
    layer = {b.name for b in baselines(_problem("tiny-gpt", "2x2", "auto", "layer"))[0]}
    assert {"zero3-fsdp+full", "zero3-fsdp+selective", "tp2-fsdp2+full"} <= layer
    llama = {b.name for b in baselines(_problem("tiny-llama", "2x2", "auto"))[0]}
    assert "ddp+full" in llama and "ddp+selective" not in llama  # fused attention: no core attention
    full = {b.name for b in baselines(_problem("tiny-gpt", "2x2", "full"))[0]}
    assert all(name.endswith("+full") for name in full)


def test_a_replayed_op_cannot_keep_or_gather_per_op():
    """Rules the ILP and the evaluator share: a replayed op reads its saved input whole (no
    sequence-parallel copy), and its ZeRO-3 weight is not gathered per op."""
    problem = _problem("tiny-gpt", "4", "full")
    assert problem.conflicts
    skipped = dict(baselines(problem)[1])
    assert "gathered per op (ZeRO-3)" in skipped["zero3-fsdp+full"]
    with pytest.raises(MemshardError, match="zero3-fsdp\\+full does not fit"):
        strategy_plan("tiny-gpt", "4", "zero3-fsdp+full", batch=8, precision="fp32", recompute="full")
    layer = strategy_plan("tiny-gpt", "4", "zero3-fsdp+full", batch=8, precision="fp32", recompute="full",
                          zero3_unit="layer")
    assert layer.peak_bytes > 0
    plan = {b.name: b for b in baselines(_problem("tiny-gpt", "1x4", "full"))[0]}["megatron-tp4-sp+full"]
    sp = plan.problem  # (Megatron-LM's framework: its graph has the fused GEMMs' gathers)
    kept = [e for e in range(len(sp.edges)) if plan.selection.keeps[e]]
    assert all(not sp.replayed(plan.selection, sp.edges[e].consumer) for e in kept)
    forced = list(plan.selection.keeps)
    forced[next(e for e, edge in enumerate(sp.edges) if edge.saves and sp.groups[edge.consumer].always_replays)] = 1
    with pytest.raises(InconsistentPlan, match="keeps its copy for a recomputed op"):
        evaluate(sp, type(plan.selection)(plan.selection.choices, tuple(forced)))


def test_plan_json_records_recomputation_and_old_plans_load():
    plan = strategy_plan("tiny-gpt", "2x2", "megatron-tp2-dp2-sp+selective", batch=8, recompute="selective")
    data = plan.to_dict()
    assert data["schema"] == "memshard.plan/3" and data["solver"]["recompute"] == "selective"
    assert {o["name"] for o in data["ops"] if o["recomputed"]} == {"attn.scores", "attn.softmax", "attn.attn_dropout"}
    again = plan_from_dict(json.loads(json.dumps(data)))
    assert again.selection == plan.selection and again.peak_bytes == pytest.approx(plan.peak_bytes)
    old = strategy_plan("tiny-gpt", "2x2", "megatron-tp2-dp2-sp", batch=8).to_dict()
    old["schema"] = "memshard.plan/1"
    del old["solver"]["recompute"], old["recompute_time_s"]
    for o in old["ops"]:
        del o["recomputed"]
    assert plan_from_dict(old).solver.recompute == "none"


def test_a_job_that_does_not_fit_points_to_recomputation():
    with pytest.raises(MemshardError, match="--recompute auto"):
        memshard.plan("gpt3-1.3b", "8", batch=8, seq=1024, num_layers=2, objective="time", memory_budget="700MiB",
                      mesh_views=False)


def test_unknown_policy_is_refused():
    with pytest.raises(MemshardError, match="recompute must be one of"):
        memshard.plan("tiny-gpt", "2x2", recompute="some")


def test_recomputing_baselines_are_in_the_search_space_and_memshard_is_no_worse():
    """Each baseline with selective or full recomputation, forced through the ILP, prices as
    built; the least-memory plan with recomputation searched is no worse than any."""
    problem = build_problem(build_graph("gpt3-1.3b", **SHAPE_1_3B), parse_mesh("8"), recompute="auto",
                            zero3_unit="layer")
    found = [b for b in baselines(problem)[0] if b.name.endswith(("+selective", "+full", "+selective-op"))]
    assert len(found) >= 20
    best = _recomputing_plan_1_3b()
    forced_ones = {"ddp+full", "zero3-fsdp+full", "megatron-tp4-dp2-sp+selective", "megatron-tp8-sp+full",
                   "tp2-fsdp4+selective", "megatron-tp2-dp4-sp-distopt+full", "fsdp2+selective-op",
                   "fsdp2+selective", "ddp+selective-op"}
    for b in found:
        direct = evaluate(b.problem, b.selection)
        assert best.peak_bytes <= direct.peak_bytes * 1.011, b.name
        if b.name in forced_ones:
            forced = solve(SearchRequest(b.problem, "memory", fixed=b.selection, mip_gap=0.0))
            assert forced.ilp_peak_bytes == pytest.approx(direct.peak_bytes, rel=1e-6), b.name
    assert forced_ones <= {b.name for b in found}


def test_a_budget_the_unsplit_plan_breaks_starts_from_the_least_memory_relaxation_rounded():
    """Under a memory budget every-op-unsplit breaks, the search's fallback start is the
    least-memory relaxation rounded: an integral solution of every row, within the budget."""
    graph = build_graph("tiny-gpt", batch=8, seq=128, precision="fp32")
    problem = build_problem(graph, parse_mesh("2x2"), recompute="auto")
    f = Formulation(problem)
    f.add_plan_constraints(problem.candidate_points)
    budget = 0.5 * evaluate(problem, f.replicated()).peak_bytes
    solver = Solver(SearchRequest(problem, "time", memory_budget_bytes=budget), None, time.perf_counter() + 60)
    start = solver.fallback_start()
    assert callable(start)  # made only if the dive finds no plan
    values = start()
    assert isinstance(values, np.ndarray)
    model = solver.formulation.model
    assert not model.violated(values)
    integer = np.array(model.integer, dtype=bool)
    assert np.allclose(values[integer], np.round(values[integer]))
    assert evaluate(problem, solver.formulation.selection(values)).peak_bytes <= budget


def test_a_step_time_budget_the_unsplit_plan_breaks_starts_from_the_fastest_relaxation_rounded():
    """Likewise for the least-memory plan under a step-time budget the unsplit plan breaks."""
    graph = build_graph("gpt3-1.3b", batch=8, seq=1024, num_layers=2, precision="mixed")
    problem = build_problem(graph, parse_mesh("8"), recompute="auto")
    f = Formulation(problem)
    f.add_plan_constraints(problem.candidate_points)
    fastest = solve(SearchRequest(problem, "time", memory_budget_bytes=math.inf))
    budget = 2 * evaluate(problem, fastest.selection).step_time_s
    assert evaluate(problem, f.replicated()).step_time_s > budget
    solver = Solver(SearchRequest(problem, "memory", max_step_time_s=budget), None, time.perf_counter() + 60)
    values = solver.fallback_start()()
    model = solver.formulation.model
    assert not model.violated(values)
    assert evaluate(problem, solver.formulation.selection(values)).step_time_s <= budget * (1 + 1e-9)


@pytest.mark.parametrize("model, kept", [
    # every linear has a bias (aten.addmm: saved, not counted); the attention's matmuls are bmm
    ("tiny-gpt", {"attn.q", "attn.k", "attn.v", "attn.scores", "attn.context", "attn.proj", "mlp.fc", "mlp.proj"}),
    # no bias (aten.mm): the 1st, 3rd, 5th and 7th of the block saved; the fused attention saved
    ("tiny-llama", {"attn.q", "attn.v", "attn.sdpa", "mlp.gate", "mlp.down"}),
])
def test_torchtitans_per_op_policy_keeps_the_compute_intensive_outputs_but_every_second_mm(model, kept):
    """torchtitan's ``selective_ac_option = "op"`` read by hand: a block's mm (every second one
    recomputed), addmm, bmm and fused-attention outputs are saved, everything else is
    recomputed — but the block's last op, whose output the next block saves (its input)."""
    graph = build_graph(model, batch=4, seq=32, num_layers=3)
    replayed = op_level_replayed(graph)
    for i, op in enumerate(graph.ops):
        role = op.name.split(".", 2)[-1]
        expected = op.layer is not None and role not in kept and role != "mlp.residual"
        assert (i in replayed) == expected, op.name


def test_pytorchs_selective_checkpoint_caches_what_it_saves_until_the_recompute():
    """``fsdp2+selective-op`` as ``torch.utils.checkpoint`` runs it: the outputs its policy
    saves (q, v, gate and down projections) are cached from the forward until the block's
    recompute, needed or not — at the peak, in the last block's backward, those of every
    block below it. The down projection's (read only by the residual add after it) is what
    memshard's own replay, which frees it, does not hold."""
    graph = build_graph("tiny-llama", batch=8, seq=256, num_layers=4)
    problem = build_problem(graph, parse_mesh("4"), recompute="auto", zero3_unit="layer")
    (fsdp2,), _ = baselines(problem, lambda name: name == "fsdp2+selective-op")
    on, selection = fsdp2.problem, fsdp2.selection
    peak = evaluate(on, selection).peak_point
    assert on.schedule.describe(peak, graph) == "backward layers.3.mlp.mul"
    cached = {on.held[h.tensor].name for h in on.holders
              if h.kind == CACHED and h.start <= peak <= h.end and on.holder_layout(selection, h) is not None}
    assert cached == {f"layers.{k}.{p}.out" for k in range(3) for p in ("attn.q", "attn.v", "mlp.gate", "mlp.down")}
    assert evaluate(on, selection).peak_bytes > evaluate(problem, selection).peak_bytes


@pytest.mark.parametrize("policy", ["full", "auto"])
def test_fsdp2s_backward_prefetch_makes_layer_one_a_candidate_peak(policy):
    """FSDP2 gathers the layer below's weights during every layer's backward but the first's:
    over the layers the live bytes at an op are affine plus a step after layer 0, so the
    second layer's points can hold the peak (here its MLP's backward, with every layer
    recomputed); the plan forced through the ILP prices as the evaluator does."""
    graph = build_graph("tiny-gpt", batch=8, seq=128, num_layers=4)
    problem = build_problem(graph, parse_mesh("2x2"), recompute=policy)
    (fsdp2,), _ = baselines(problem, lambda name: name == "fsdp2+full")
    direct = evaluate(fsdp2.problem, fsdp2.selection)
    assert fsdp2.problem.schedule.describe(direct.peak_point, graph) == "backward layers.1.mlp.proj"
    assert direct.peak_point in fsdp2.problem.candidate_points
    forced = solve(SearchRequest(fsdp2.problem, "memory", fixed=fsdp2.selection, mip_gap=0.0))
    assert forced.ilp_peak_bytes == pytest.approx(direct.peak_bytes, rel=1e-6)
