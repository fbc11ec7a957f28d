"""Baselines: their bytes match the published formulas, they lie in memshard's search space
(the ILP prices each, forced, exactly as the evaluator does), and memshard beats them."""

from __future__ import annotations

import re

import pytest

import memshard
from memshard.baselines.recipes import as_run_by, baselines, megatron_tp
from memshard.baselines.rules import data_parallel
from memshard.core.errors import MemshardError
from memshard.core.mesh import make_mesh, parse_mesh
from memshard.models import build_graph
from memshard.plans.plan import build_plan, runnable
from memshard.problem.evaluate import evaluate
from memshard.problem.pricing import build_problem
from memshard.problem.records import MEMSHARD
from memshard.problem.schedule import Schedule
from memshard.search.solve import SearchRequest, solve_fixed
from tests.runtime_plans import LLAMA_TP, saved

SMALL = dict(num_layers=2, hidden=128, heads=8, vocab=512, ffn=512)


def forced_through_ilp(found) -> dict:
    """Each baseline's plan priced through the ILP, every choice pinned (what ``solve`` with
    ``fixed`` returns), by name: one formulation per problem, pinned to each of its plans."""
    by_problem: dict[int, list] = {}
    for b in found:
        by_problem.setdefault(id(b.problem), []).append(b)
    forced = {}
    for group in by_problem.values():
        results = solve_fixed(SearchRequest(group[0].problem, "memory", mip_gap=0.0), [b.selection for b in group])
        forced.update(zip((b.name for b in group), results, strict=True))
    assert len(forced) == len(found)  # (one result per baseline: their names differ)
    return forced


def _model_state_bytes(plan) -> float:
    return sum(p["instances"] * sum(p["bytes_per_device"].values()) for p in plan.to_dict()["parameters"])


@pytest.mark.parametrize("stage, formula", [
    (0, lambda psi, n: 16 * psi),
    (1, lambda psi, n: 4 * psi + 12 * psi / n),
    (2, lambda psi, n: 2 * psi + 14 * psi / n),
    (3, lambda psi, n: 16 * psi / n),
])
def test_zero_stages_match_the_zero_paper(stage, formula):
    graph = build_graph("gpt2", batch=8, seq=64, **SMALL)
    problem = build_problem(graph, parse_mesh("8"))
    plan = build_plan(problem, data_parallel(problem, stage))
    psi, n = graph.num_parameters, 8
    # every tensor here divides by 8 except the 50257-free vocab (512) and positions (1024): exact
    assert _model_state_bytes(plan) == pytest.approx(formula(psi, n), rel=1e-9)


def _layer_activation_bytes(problem, selection) -> float:
    """Saved bytes one layer adds: live bytes at layer 1's first forward minus layer 0's."""
    ev = evaluate(problem, selection)
    firsts = [next(i for i, op in enumerate(problem.graph.ops) if op.layer == k) for k in (0, 1)]
    sched = Schedule(len(problem.graph.ops))
    return ev.live_bytes[sched.forward(firsts[1])] - ev.live_bytes[sched.forward(firsts[0])]


@pytest.mark.parametrize("tp", [2, 4])
def test_megatron_tensor_parallel_activations_match_korthikanti(tp):
    s, b, h, a = 64, 2, 128, 4
    graph = build_graph("gpt2", batch=b, seq=s, num_layers=2, hidden=h, heads=a, vocab=512, ffn=4 * h)
    problem = build_problem(graph, make_mesh((tp,)), shared_layers=False)
    # Korthikanti et al. 2022, eq. 2 (TP) and eq. 4 (TP + SP), fp16 activations
    plain = s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp))
    seq_par = s * b * h / tp * (34 + 5 * a * s / h)
    assert _layer_activation_bytes(problem, megatron_tp(problem, 1)) == pytest.approx(plain, rel=1e-12)
    assert _layer_activation_bytes(problem, megatron_tp(problem, 1, sequence_parallel=True)) == pytest.approx(
        seq_par, rel=1e-12)


def test_every_baseline_is_in_the_search_space_and_memshard_is_no_worse():
    # A real layer shape (tiny ones make HiGHS slow: their LP bound is loose)
    shape = dict(batch=16, seq=2048, num_layers=2)
    graph = build_graph("gpt3-1.3b", **shape)
    problem = build_problem(graph, parse_mesh("2x4"))
    found, skipped = baselines(problem)
    names = {b.name for b in found}
    assert {"dp", "ddp", "fsdp2", "zero1", "zero2", "zero3-fsdp", "megatron-tp4-dp2", "megatron-tp4-dp2-sp",
            "megatron-tp4-dp2-sp-distopt", "tp4-fsdp2", "megatron-tp8", "megatron-tp8-sp",
            "megatron-tp2-dp4", "megatron-tp2-dp4-sp", "tp2-fsdp4"} <= names
    assert not skipped
    best = memshard.plan("gpt3-1.3b", "2x4", **shape)  # within the default 0.1% gap
    forced = forced_through_ilp(found)
    for b in found:
        direct = evaluate(b.problem, b.selection)
        assert forced[b.name].ilp_peak_bytes == pytest.approx(direct.peak_bytes, rel=1e-6), b.name
        assert best.peak_bytes <= direct.peak_bytes * (1 + 1e-3), b.name


@pytest.fixture(scope="module")
def compared(tmp_path_factory) -> tuple[int, dict, str]:
    """``memshard compare`` run once: its exit code, the JSON it wrote and what it printed. A
    GPT-2 of one layer (hidden 64, 4 heads: Megatron's TP 4 lays it out), 4 sequences of 32
    tokens on 4 devices: what the tests read (the rows' order and figures against each other,
    the file's shape, the table) holds at any size; a small model's searches are quick."""
    import contextlib
    import io
    import json

    from memshard.cli import main

    out = tmp_path_factory.mktemp("compare") / "compare.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["compare", "--model", "gpt2", "--mesh", "4", "--batch", "4", "--seq", "32", "--layers", "1",
                     "--hidden", "64", "--heads", "4", "--vocab", "128", "--ffn", "128", "--json", str(out)])
    return code, json.loads(out.read_text()), printed.getvalue()


def test_compare_rows_and_json_shape(compared):
    rows = compared[1]["rows"]
    assert rows[0]["strategy"] == "memshard"
    assert rows[1]["strategy"].startswith("memshard ≤1.1×")
    baseline_rows = rows[2:]
    fastest = min(r["estimated_step_time_s"] for r in baseline_rows)
    assert rows[1]["estimated_step_time_s"] <= fastest * 1.1 * (1 + 1e-6)
    for r in rows:
        assert set(r) >= {"strategy", "peak_bytes_per_device", "redundant_bytes_per_device",
                          "communication_bytes_per_step_per_device", "estimated_step_time_s"}
        assert r["peak_bytes_per_device"] >= rows[0]["peak_bytes_per_device"] * (1 - 1e-3)
    peaks = [r["peak_bytes_per_device"] for r in baseline_rows]
    assert peaks == sorted(peaks)


def test_compare_command_writes_json(compared):
    code, data, printed = compared
    assert code == 0
    assert data["schema"] == "memshard.compare/1"
    assert [r["strategy"] for r in data["rows"][:1]] == ["memshard"]
    assert "megatron-tp4-sp" in printed


def traced_and_best(family: str):
    """The traced model's graph (4 sequences of 32 tokens, fp32) and memshard's least peak on
    2x2, searched to a 2% gap (the default 0.1% costs several times as long on these tiny traced
    models). The LLaMA's plan is searched once and saved (``tests/runtime_plans.LLAMA_TP``, its
    config tests/data/configs/llama_tp.json: its search is a long branch and bound), its graph
    traced as it loads; GPT-2's is searched here."""
    from memshard.trace.hf import trace_hf

    if family == "llama":
        plan = saved(LLAMA_TP)
        return plan.job.graph, plan.peak_bytes
    graph = trace_hf(family, batch=4, seq=32, precision="fp32", n_layer=2, n_embd=128, n_head=4, vocab_size=512,
                     n_positions=64)
    return graph, memshard.plan(graph, "2x2", mip_gap=0.02).peak_bytes


@pytest.mark.parametrize("family, sizes", [
    # LLaMA: vocabulary (embedding), kv heads (q as kv head × group), MLP width, vocabulary (lm_head)
    ("llama", [512, 2, 256, 512]),
    # GPT-2: the tied vocabulary, heads (c_attn's [3, heads, head dim]: the fusion atom passed
    # over), MLP width; the position table stays whole
    ("gpt2", [512, 4, 512]),
])
def test_a_traced_model_is_laid_out_for_tensor_parallelism_by_its_weights(family, sizes):
    from memshard.problem.tensor_parallel import tensor_parallel_dims

    graph, best = traced_and_best(family)
    dims = tensor_parallel_dims(graph)
    size = {d: n for op in graph.ops for d, n in graph.dim_sizes(op).items()}
    assert [size[d] for d in dims] == sizes
    problem = build_problem(graph, parse_mesh("2x2"))
    found, skipped = baselines(problem)
    names = {b.name for b in found}
    assert {"megatron-tp2-dp2", "megatron-tp2-dp2-sp", "megatron-tp2-dp2-sp-distopt", "tp2-fsdp2"} <= names
    # Megatron needs the kv heads divisible by TP (2 kv heads: no TP 4), as torch's Colwise does
    assert ({s for s, _ in skipped} == {"megatron-tp4", "megatron-tp4-sp"}) == (family == "llama")
    tp = next(b for b in found if b.name == "megatron-tp2-dp2")
    for p in build_plan(tp.problem, tp.selection).to_dict()["parameters"]:
        # every matrix split in two on the TP axis (weights and their biases), norms and positions whole
        whole = p["names"][0].endswith(("norm.weight", "ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias",
                                        "ln_f.weight", "ln_f.bias", "wpe.weight", "c_proj.bias"))
        assert (p["layout"] == "RR") == whole, p
    # no worse than any baseline here, the default gap's plan no worse within its gap
    forced = forced_through_ilp(found)
    for b in found:
        direct = evaluate(b.problem, b.selection)
        assert forced[b.name].ilp_peak_bytes == pytest.approx(direct.peak_bytes, rel=1e-6), b.name
        assert best <= direct.peak_bytes * (1 + 1e-3), b.name


def test_pytorch_tensor_parallelism_gathers_each_block_input_once():
    """PrepareModuleInput before a block's attention and MLP: one redistribution per input
    that several column-parallel projections read, the projections reading its output."""
    from memshard.problem.tensor_parallel import REDISTRIBUTE, with_input_gathers

    graph = build_graph("tiny-llama", batch=4, seq=32, num_layers=2)
    gathered = with_input_gathers(graph)
    gathers = [op for op in gathered.ops if op.kind == REDISTRIBUTE]
    readers = [[gathered.ops[i].name for i, _ in gathered.consumers[op.output.tensor]] for op in gathers]
    assert [len(r) for r in readers] == [3, 2, 3, 2]  # q, k, v; gate, up — per layer
    for op, names in zip(gathers, readers):
        # the projections read the gathered copy only, after it is made
        assert not {gathered.ops[i].name for i, _ in gathered.consumers[op.inputs[0].tensor]} & set(names)
        assert gathered.producer[op.output.tensor] < min(i for i, _ in gathered.consumers[op.output.tensor])
    assert len(gathered.ops) == len(graph.ops) + 4
    # the projections' input gradients reach the gathered copy unreduced, the embedding's
    # readers' the scattered one (RowwiseParallel reduce-scatters its output once)
    problem = build_problem(graph, parse_mesh("2x4"), framework="torch-tp")
    assert {e.key.split(" -> ")[1] for e in problem.edges if e.gradient_through} == {
        "attn.q[0]", "attn.k[0]", "attn.v[0]", "mlp.gate[0]", "mlp.up[0]", "input_layernorm[0]", "attn.residual[0]"}
    assert list(problem.graph.consumers["embed.out"]) == [(1, 0)]  # the scatter, then its two readers
    assert len(problem.graph.consumers["embed.out.scattered"]) == 2


@pytest.mark.parametrize("precision, plain, distributed", [
    # Megatron-LM's distributed-optimizer guide: bytes per parameter, d the data-parallel size
    ("mixed", lambda d: 18, lambda d: 6 + 12 / d),  # bf16 parameters, fp32 gradients
    ("fp32", lambda d: 16, lambda d: 8 + 8 / d),
])
def test_megatron_model_states_are_megatrons_bytes_per_parameter(precision, plain, distributed):
    graph = build_graph("gpt2", batch=8, seq=64, precision=precision, **SMALL)
    problem = build_problem(graph, parse_mesh("2x4"))
    found = {b.name: b for b in baselines(problem, lambda n: n in ("megatron-tp2-dp4-sp",
                                                                   "megatron-tp2-dp4-sp-distopt"))[0]}
    param_bytes = {"mixed": 2, "fp32": 4}[precision]
    for name, formula in (("megatron-tp2-dp4-sp", plain), ("megatron-tp2-dp4-sp-distopt", distributed)):
        b = found[name]
        plan = build_plan(b.problem, b.selection)
        local_numel = sum(p["instances"] * p["bytes_per_device"]["parameters"] for p in plan.to_dict()["parameters"]
                          ) / param_bytes
        assert _model_state_bytes(plan) == pytest.approx(formula(4) * local_numel, rel=1e-9), name
        # its contiguous gradient buffer holds every gradient from the step's start
        ev = evaluate(b.problem, b.selection)
        assert ev.breakdown_at(0)["gradients"] == pytest.approx(4 * local_numel, rel=1e-9)
        # memshard's runtime runs the layout with gradients in the job's precision (no buffer)
        ours = as_run_by(b.problem, MEMSHARD)
        assert ours.graph.precision is graph.precision
        ev = evaluate(ours, b.selection)
        assert ev.breakdown_at(0)["gradients"] == 0
        assert _model_state_bytes(build_plan(ours, b.selection)) == pytest.approx(
            (param_bytes + graph.precision.grad_bytes + graph.precision.optimizer_bytes / (4 if "distopt" in name else 1))
            * local_numel, rel=1e-9), name


@pytest.mark.parametrize("name, recompute, instead", [
    ("fsdp2-torchtitan", "none", "zero3-fsdp with --zero3-unit layer"), ("ddp-bucket-view", "none", "dp"),
    ("torch-tp2-fsdp2-torchtitan+full", "full", "tp2-fsdp2+full"), ("torch-tp2-fsdp2-noreshard", "none", "tp2-fsdp2")])
def test_a_baseline_priced_as_pytorch_runs_it_points_to_the_layout_memshards_runtime_runs(name, recompute, instead):
    plan = memshard.strategy_plan("tiny-llama", "2x2", name, batch=4, seq=32, recompute=recompute)
    with pytest.raises(MemshardError, match=f"run {re.escape(instead)} \\(memshard's runtime of the same layout\\)"):
        runnable(plan)
