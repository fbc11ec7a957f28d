"""The roofline per op (``problem/kernels.py``): what a kernel of each kind costs, and the
orders it must get right (Korthikanti et al.: sequence parallelism divides the norms' and
dropouts' time by the TP degree)."""

from __future__ import annotations

import math

import pytest

from memshard.core.hardware import preset
from memshard.models import build_graph
from memshard.problem.kernels import gemm_time, op_time, optimizer_step_time, streaming_time

A100 = preset("a100-80gb")


def test_a_large_gemm_runs_at_the_best_rate_and_a_small_one_below_it():
    big = gemm_time(1, 8192, 8192, 8192, 2, A100)
    assert big == pytest.approx(2 * 8192**3 / (A100.peak_flops * A100.matmul_efficiency), rel=0.02)
    # a TP-8 slice of the same GEMM: its output tiles fill the waves less well
    small = gemm_time(1, 8192, 1024, 8192, 2, A100)
    assert small > big / 8
    # fp32 runs at the FP32 rate
    assert gemm_time(1, 4096, 4096, 4096, 4, A100) > 10 * gemm_time(1, 4096, 4096, 4096, 2, A100)


def test_a_skinny_gemm_is_memory_bound():
    t = gemm_time(1, 1, 8192, 8192, 2, A100)
    moved = (8192 * 8192 + 2 * 8192) * 2
    assert t == pytest.approx(A100.kernel_overhead_s + moved / (A100.memory_bandwidth * A100.memory_efficiency))


def _layer_ops(name, **knobs):
    graph = build_graph(name, batch=4, seq=2048, num_layers=1, **knobs)
    return graph, [op for op in graph.ops if op.layer == 0]


def _sizes(op, graph, split: dict[str, int]):
    shape = {}
    for operand in (*op.inputs, op.output):
        for d, n in zip(operand.dims, graph.tensors[operand.tensor].shape):
            shape[d] = n
    for buf in op.buffers:
        shape.update({d: shape.get(d, 1) for d in buf.dims})
    return {d: n // split.get(d, 1) for d, n in shape.items()}


def test_norms_and_dropouts_cost_their_bytes_and_split_with_the_sequence():
    graph, ops = _layer_ops("gpt3-13b")
    norm = next(op for op in ops if op.kind == "layernorm")
    whole = op_time(norm, graph, _sizes(norm, graph, {}), A100)
    tokens = 4 * 2048 * 5120
    assert whole.forward_s == pytest.approx(streaming_time(2 * tokens * 2 + 2 * 5120 * 2, A100), rel=1e-9)
    split = op_time(norm, graph, _sizes(norm, graph, {"s": 8}), A100)  # sequence parallel, TP 8
    assert split.forward_s < whole.forward_s / 6 and split.backward_s < whole.backward_s / 6


def test_causal_fused_attention_costs_half_its_scores():
    graph, ops = _layer_ops("llama3-8b")
    sdpa = next(op for op in ops if op.kind == "sdpa")
    sizes = _sizes(sdpa, graph, {})
    t = op_time(sdpa, graph, sizes, A100)
    flops = 4 * math.prod(sizes[d] for d in sdpa.dims) / 2
    assert t.forward_s == pytest.approx(flops / (A100.peak_flops * A100.attention_efficiency), rel=0.02)
    assert t.backward_s == pytest.approx(2.5 / 0.85 * t.forward_s, rel=0.02)


def test_adam_moves_its_states_twice():
    assert optimizer_step_time(12e9, 2e9, 2e9, A100) == pytest.approx(streaming_time(28e9, A100))
    assert optimizer_step_time(0, 0, 0, A100) == 0.0


def test_the_steps_breakdown_adds_up_to_its_time():
    """A plan's compute by kind sums to its compute, its collectives' times to its
    communication; a GPT has no fused attention, a LLaMA has."""
    from memshard.api import strategy_plan

    for model, attention in (("tiny-gpt", False), ("tiny-llama", True)):
        plan = strategy_plan(model, "2x2", "ddp", batch=4)
        assert sum(plan.compute_by_kind.values()) == pytest.approx(plan.compute_time_s, rel=1e-12)
        assert plan.compute_by_kind["matmuls"] > 0 and plan.compute_by_kind["optimizer step"] > 0
        assert (plan.compute_by_kind["attention"] > 0) == attention
        by_kind = plan.communication.by_kind.values()
        assert sum(v["time_s"] for v in by_kind) == pytest.approx(plan.communication_time_s, rel=1e-12)
