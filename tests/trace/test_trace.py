"""Tracing real modules: torch.export → graph IR → plan, checked against the built-in models,
Hugging Face's own parameter counts, and what the ops really save."""

from __future__ import annotations

import functools
import json
import math
from collections import Counter

import pytest

pytest.importorskip("transformers")
import torch  # noqa: E402

import memshard  # noqa: E402
from memshard.core.errors import MemshardError  # noqa: E402
from memshard.core.graph import TensorKind  # noqa: E402
from memshard.models import build_graph  # noqa: E402
from memshard.plans.report import format_plan  # noqa: E402
from memshard.problem.pricing import build_problem  # noqa: E402
from memshard.problem.records import OpGroup  # noqa: E402
from memshard.trace import trace_module  # noqa: E402
from memshard.trace.hf import build_model, load_config, trace_hf  # noqa: E402
from tests.planner.test_cli import assert_one_line_error, run  # noqa: E402
from tests.runtime.test_traced_runtime import UnknownOpNet  # noqa: E402
from tests.unit.test_models import saved_bytes_per_layer  # noqa: E402

TINY = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
        "vocab_size": 256}
FAMILIES = {
    "gpt2": {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 256, "n_positions": 64},
    "llama": {**TINY, "num_key_value_heads": 2},
    "mistral": {**TINY, "num_key_value_heads": 2, "sliding_window": None},
    "qwen2": {**TINY, "num_key_value_heads": 2},
    "bert": {**TINY, "max_position_embeddings": 64},
}


def hf_parameter_count(source, **overrides) -> int:
    model = build_model(load_config(source, **overrides), "fp32")
    return sum(p.numel() for p in model.parameters())  # parameters() lists tied weights once


def test_gpt2_124m_traced_has_the_builders_and_hfs_parameter_count():
    traced = trace_hf("gpt2", batch=1, seq=64)
    assert traced.num_parameters == build_graph("gpt2", batch=1, seq=64).num_parameters == 124_439_808
    assert traced.num_parameters == hf_parameter_count("gpt2")
    assert traced.unknown_ops == {}


def test_gpt2_traced_layer_saves_what_the_builder_says():
    """Unfused attention and exact GeLU are the builder's GPT layer (Megatron's 34sbh + 5as²b);
    the traced layer's saved activations agree within 2%."""
    traced = trace_hf("gpt2", batch=2, seq=256, attn_implementation="eager", activation_function="gelu")
    built = build_graph("gpt2", batch=2, seq=256)
    for layer in (0, 11):
        t, b = saved_bytes_per_layer(traced, layer), saved_bytes_per_layer(built, layer)
        assert t == pytest.approx(b, rel=0.02)
    s, bsz, h, a = 256, 2, 768, 12  # and both are Megatron's formula
    assert saved_bytes_per_layer(traced, 3) == pytest.approx(s * bsz * h * (34 + 5 * a * s / h), rel=0.02)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_traces_without_unknown_ops_and_plans(family):
    graph = trace_hf(family, batch=4, seq=32, precision="fp32", **FAMILIES[family])
    assert graph.unknown_ops == {}
    assert graph.num_parameters == hf_parameter_count(family, **FAMILIES[family])
    # one mesh axis: tiny traced graphs on two axes make the ILP slow (docs/models.md, "Limits")
    plan = memshard.plan(graph, "4", time_limit_s=30)
    assert plan.to_dict()["solver"]["status"] == "optimal"
    assert plan.peak_bytes >= plan.lower_bound_bytes
    assert plan.peak_bytes <= 1.1 * plan.lower_bound_bytes


def test_identical_layers_share_solver_variables_and_dims():
    graph = trace_hf("llama", batch=2, seq=32, **{**FAMILIES["llama"], "num_hidden_layers": 3})
    per_layer = [[op for op in graph.ops if op.layer == i] for i in range(3)]
    assert len({len(ops) for ops in per_layer}) == 1
    for ops in zip(*per_layer):  # same role, same dims, in every layer
        assert len({op.role for op in ops}) == 1
        assert len({tuple(o.dims for o in op.operands) for op in ops}) == 1
    problem = build_problem(graph, memshard.parse_mesh("2x2"))
    op_groups = [g for g in problem.groups if isinstance(g, OpGroup)]
    outside = sum(op.layer is None for op in graph.ops)
    assert len(op_groups) == len(per_layer[0]) + outside


def test_gqa_projection_weights_are_split_by_kv_head():
    graph = trace_hf("llama", batch=2, seq=32, **FAMILIES["llama"])
    axes = graph.traced.parameter_axes
    q = axes["model.layers.0.self_attn.q_proj.weight"]
    k = axes["model.layers.0.self_attn.k_proj.weight"]
    assert q[1] == k[1]  # both read the hidden dim
    assert q[0][0] == k[0][0]  # the outermost dim of both outputs is the kv-head
    sizes = {d: n for op in graph.ops for d, n in graph.dim_sizes(op).items()}
    assert sizes[q[0][0]] == 2 and sizes[q[0][1]] == 2  # 4 heads = 2 kv-heads × 2 per group
    assert math.prod(sizes[d] for d in q[0]) == 64


def flops_by_kind(graph) -> dict[str, Counter]:
    out: dict[str, Counter] = {}
    for op in graph.ops:
        out.setdefault(op.kind, Counter())[round(graph.flops(op))] += 1
    return out


# (traced source and overrides, built-in preset of the same shapes, kinds whose ops agree one to
# one, kinds with the same total (GPT-2 fuses q, k, v into one projection)). Adds and muls the
# builder has are among the traced ones (the trace also has norms' and rotary's pieces).
SAME_SHAPES = [
    (("llama", dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=256, vocab_size=512)), "tiny-llama",
     ("sdpa", "silu", "linear", "cross_entropy", "embedding"), ()),
    (("gpt2", dict(attn_implementation="eager", activation_function="gelu", n_layer=2, n_embd=128, n_head=4,
                   n_inner=512, vocab_size=512, n_positions=32)), "tiny-gpt",
     ("matmul", "softmax", "dropout", "gelu", "layernorm", "cross_entropy"), ("linear",)),
]


@pytest.mark.parametrize("source, preset, same, same_total", SAME_SHAPES, ids=["llama", "gpt2"])
def test_traced_ops_cost_the_builders_flops(source, preset, same, same_total):
    """Every op kind both paths make costs the same forward FLOPs for the same shapes: fused
    attention once over the head dim, an unfused attention's scores over both sequences, the
    activation functions the builder's per-element count."""
    family, overrides = source
    traced = flops_by_kind(trace_hf(family, batch=2, seq=32, precision="mixed", **overrides))
    built = flops_by_kind(build_graph(preset, batch=2, seq=32))
    for kind in same:
        assert traced[kind] == built[kind], kind
    for kind in same_total:
        assert sum(f * n for f, n in traced[kind].items()) == sum(f * n for f, n in built[kind].items()), kind
    for kind in ("add", "mul"):
        assert not built.get(kind, Counter()) - traced[kind], kind


def test_a_traced_llamas_step_computes_as_long_as_the_builders():
    """The same job, built in and traced, prices its GEMMs and its causal fused attention the
    same for the same plan. Eager Hugging Face runs each RMSNorm and rotary embedding as
    several small kernels (pow, mean, rsqrt, mul; slices, neg, cat): the traced step is
    slower by those kernels' bytes, as it runs."""
    overrides = dict(num_hidden_layers=4, hidden_size=512, num_attention_heads=8, num_key_value_heads=2,
                     intermediate_size=1536, vocab_size=1024)
    traced = trace_hf("llama", batch=8, seq=512, precision="mixed", **overrides)
    built = build_graph("tiny-llama", batch=8, seq=512, num_layers=4, hidden=512, heads=8, kv_heads=2, ffn=1536,
                        vocab=1024, precision="mixed")
    by_kind = []
    for graph in (traced, built):
        plan = memshard.strategy_plan(graph, "2x4", "ddp")
        kinds: dict[str, float] = {}
        for group, k in zip(plan.problem.groups, plan.selection.choices):
            if isinstance(group, OpGroup):
                kind = plan.problem.graph.ops[group.ops[0]].kind
                kinds[kind] = kinds.get(kind, 0.0) + group.instances * group.choices[k].compute_s
        by_kind.append((plan.compute_time_s, kinds))
    (traced_s, traced_kinds), (built_s, built_kinds) = by_kind
    for kind in ("linear", "sdpa"):
        assert traced_kinds[kind] == pytest.approx(built_kinds[kind], rel=0.01), kind
    assert {"pow", "rsqrt", "neg", "cat"} <= set(traced_kinds) and "rmsnorm" in built_kinds
    assert traced_s > built_s


def test_traced_llama_attention_takes_the_eager_path():
    """An eager training step on whole sequences has no mask: SDPA is causal and reads the
    key/value heads themselves (grouped-query), saving neither a mask nor repeated keys. The
    query heads are (key/value head × group); the query sequence stays whole (is_causal). (In
    bf16 on a GPU, or in fp32 on CPU: CUDA runs fp32 grouped-query attention unfused, below.)"""
    graph = trace_hf("llama", batch=2, seq=32, precision="mixed", **FAMILIES["llama"])
    assert not any(t.kind is TensorKind.INPUT and t.shape[-2:] == (32, 32) for t in graph.tensors.values())
    sdpa = next(op for op in graph.ops if op.kind == "sdpa" and op.layer == 0)
    sizes = graph.dim_sizes(sdpa)
    q, k, v = (sdpa.inputs[i].dims for i in range(3))
    assert len(sdpa.inputs) == 3 and graph.tensors[sdpa.inputs[1].tensor].numel == 2 * 2 * 32 * 16
    on_cpu = [op.kind for op in trace_hf("llama", batch=2, seq=32, precision="fp32", device="cpu",
                                         **FAMILIES["llama"]).ops]
    assert on_cpu.count("sdpa") == 2 and "matmul" not in on_cpu
    kv_head = k[1]  # [b, kv heads, s, head dim]: the query reads each of its groups' heads
    assert sizes[kv_head] == 2 and kv_head in q and kv_head in v
    assert math.prod(sizes[d] for d in q) == 2 * 32 * 64
    assert {"s", "s_k"} <= set(sdpa.unsplittable_dims)
    producers = {op.output.tensor: op for op in graph.ops}
    assert producers[sdpa.inputs[1].tensor].kind != "copy" and producers[sdpa.inputs[2].tensor].kind == "linear"


def test_a_dropout_at_zero_probability_is_no_op():
    """torch returns a p = 0 dropout's input itself: no op, no mask to price."""
    no_dropout = dict(FAMILIES["gpt2"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    kinds = [[op.kind for op in trace_hf("gpt2", batch=2, seq=32, **overrides).ops].count("dropout")
             for overrides in (FAMILIES["gpt2"], no_dropout)]
    assert kinds == [5, 0]  # embeddings', each layer's attention output's and MLP's; none


CumsumNet = functools.partial(UnknownOpNet, "cumsum")  # an op memshard has no rule for


def test_an_unknown_op_is_planned_replicated_and_listed():
    module = CumsumNet()
    plan = memshard.plan(module, (torch.randn(8, 16, 32),), mesh="2")
    graph = plan.problem.graph
    assert graph.unknown_ops == {"aten.cumsum": 1}
    op = next(op for op in graph.ops if op.kind == "aten.cumsum")
    assert set(op.unsplittable_dims) == set(op.dims)
    assert plan.to_dict()["model"]["unknown_ops"] == {"aten.cumsum": 1}
    assert "aten.cumsum ×1" in format_plan(plan)


def test_module_api_traces_on_meta_and_prices_fp32_states():
    with torch.device("meta"):
        module = CumsumNet()
    graph = trace_module(module, (torch.empty(8, 16, 32, device="meta"),))
    params = sum(p.numel() for p in module.parameters())
    assert graph.num_parameters == params
    assert graph.precision.name == "fp32"
    assert {graph.tensors[p].kind for p in graph.parameters} == {TensorKind.PARAMETER}


def test_tracing_is_deterministic():
    a = trace_hf("gpt2", batch=2, seq=32, **FAMILIES["gpt2"])
    b = trace_hf("gpt2", batch=2, seq=32, **FAMILIES["gpt2"])
    assert a.ops == b.ops and a.tensors == b.tensors


@pytest.mark.parametrize("source, message", [
    ("no-such-arch", "no model type"),
    ("missing/config.json", "cannot read config"),
])
def test_bad_hf_sources_are_one_clear_error(source, message):
    with pytest.raises(MemshardError, match=message):
        trace_hf(source, batch=1, seq=8)


def test_bad_config_files_and_lengths(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(MemshardError, match="not valid JSON"):
        trace_hf(str(bad), batch=1, seq=8)
    nameless = tmp_path / "nameless.json"
    nameless.write_text('{"hidden_size": 8}')
    with pytest.raises(MemshardError, match="model_type"):
        trace_hf(str(nameless), batch=1, seq=8)
    with pytest.raises(MemshardError, match="positions"):
        trace_hf("gpt2", batch=1, seq=4096)


def test_cli_plans_an_hf_config_and_the_saved_plan_reloads(tmp_path):
    cfg = tmp_path / "tiny_llama.json"
    cfg.write_text(json.dumps({"model_type": "llama", **FAMILIES["llama"]}))
    out = tmp_path / "plan.json"
    r = run("plan", "--hf-config", str(cfg), "--mesh", "4", "--batch", "4", "--seq", "32",
            "--precision", "fp32", "--json", str(out), "--brief", columns=160)
    assert r.returncode == 0, r.stderr
    assert "hf:tiny_llama.json" in r.stdout
    data = json.loads(out.read_text())
    assert data["model"]["hf"]["model_type"] == "llama"  # the config itself, not its path
    cfg.unlink()
    assert memshard.load_plan(str(out)).peak_bytes == data["memory"]["peak_bytes_per_device"]


def test_cli_hf_errors_are_one_line():
    assert "no model type" in assert_one_line_error(run("plan", "--hf-model", "nope", "--mesh", "2"))
    assert "not allowed with" in assert_one_line_error(
        run("plan", "--hf-model", "gpt2", "--model", "gpt2", "--mesh", "2"))


def test_compare_on_a_traced_model_lays_out_every_baseline():
    # tensor parallelism splits GPT-2's heads (not c_attn's fused q/k/v index) by its weights
    graph = trace_hf("gpt2", batch=4, seq=32, **FAMILIES["gpt2"])
    result = memshard.compare(graph, "4", time_limit_s=30)
    names = [r["strategy"] for r in result["rows"]]
    assert {"dp", "ddp", "zero1", "zero2", "zero3-fsdp", "fsdp2", "megatron-tp4", "megatron-tp4-sp",
            "megatron-tp2-dp2-sp-distopt", "tp2-fsdp2", "torch-tp2-fsdp2"} <= set(names)
    assert not result["skipped"]
    best = result["rows"][0]["peak_bytes_per_device"]
    assert all(best <= r["peak_bytes_per_device"] * (1 + 1e-9) for r in result["rows"])
