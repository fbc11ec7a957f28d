"""Recipes that recompute some of their layers (Megatron-LM's block method, torchtitan's every
N-th layer): the layers in two classes, each sharing its variables; priced as the exact
problem prices them, as Megatron-LM's paper derives, forced through the ILP as built, listed
by ``compare`` with the fewest layers recomputed that fit, and carried by the plan's JSON."""

from __future__ import annotations

import functools
import json

import pytest

from memshard.api import make_job, strategy_plan
from memshard.baselines.recipes import split_baseline
from memshard.core.errors import MemshardError
from memshard.core.mesh import parse_mesh
from memshard.models import build_graph
from memshard.planner import baseline_plans
from memshard.plans.plan import plan_from_dict
from memshard.problem.evaluate import evaluate
from memshard.problem.memory import CATEGORIES
from memshard.problem.pricing import build_problem
from memshard.problem.schedule import peak_layers
from memshard.search.solve import SearchRequest, solve


def test_the_peak_layers_are_the_hull_vertices_of_each_class():
    assert peak_layers((0,) * 10) == {0, 9}
    assert peak_layers((0,) * 3 + (1,) * 7) == {0, 2, 3, 9}  # block: each class's ends
    assert peak_layers((0, 1) * 6) == {0, 1, 10, 11}
    assert peak_layers((0, 1, 1) * 6) == {0, 1, 2, 15, 16, 17}  # every 3rd: the first and last period
    assert peak_layers((0, 1, 2, 0)) == {0, 1, 2, 3}  # three classes: every layer


@functools.cache
def _root(model: str, mesh: str, layers: int, shared: bool):
    graph = build_graph(model, batch=4, seq=128, num_layers=layers, precision="fp32")
    return build_problem(graph, parse_mesh(mesh), shared_layers=shared, recompute="auto")


@pytest.mark.parametrize("model, mesh, name, count", [
    ("tiny-gpt", "2x2", "megatron-tp2-dp2-sp", 1),
    ("tiny-gpt", "2x2", "megatron-tp2-dp2-sp-distopt", 4),
    ("tiny-llama", "4", "megatron-tp2-dp2", 3),
    ("tiny-llama", "4", "fsdp2", 2),
    ("tiny-gpt", "2x2", "fsdp2", 3),
    ("tiny-llama", "2x2", "torch-tp2-fsdp2", 2),
])
def test_two_classes_price_as_the_exact_problem(model, mesh, name, count):
    """Two classes of shared layers price a recipe as the exact problem (every layer its own
    variables) does: the same peak, step time and communication, eight layers. The ILP looks
    at the hull layers' points only (``peak_layers``): their largest live bytes are the
    peak, and the recipe forced through it prices as built."""
    shared = split_baseline(_root(model, mesh, 8, True), name, count)
    exact = split_baseline(_root(model, mesh, 8, False), name, count)
    assert shared.name == exact.name == name + ("+full-block" if name.startswith("megatron") else "+full-every") + str(count)
    a, b = evaluate(shared.problem, shared.selection), evaluate(exact.problem, exact.selection)
    assert a.peak_bytes == b.peak_bytes
    assert a.step_time_s == pytest.approx(b.step_time_s, rel=1e-9)
    assert a.communication_bytes == pytest.approx(b.communication_bytes, rel=1e-9)
    points = shared.problem.candidate_points
    assert len(points) < len(a.live_bytes) and a.live_bytes[points].max() == a.peak_bytes
    # per class, the live bytes at each op of its layers are largest at a hull layer (for a
    # block split, the last recomputed layer's, which first-and-last alone would miss)
    graph, schedule = shared.problem.graph, shared.problem.schedule
    hull, classes = peak_layers(graph.layer_classes), graph.layer_classes
    by_layer = [[i for i, op in enumerate(graph.ops) if op.layer == k] for k in range(graph.num_layers)]
    for c in set(classes):
        layers = [k for k in range(graph.num_layers) if classes[k] == c]
        for position in range(len(by_layer[0])):
            for point in (schedule.forward, schedule.backward):
                live = {k: a.live_bytes[point(by_layer[k][position])] for k in layers}
                assert max(live.values()) == max(v for k, v in live.items() if k in hull)
    forced = solve(SearchRequest(shared.problem, "memory", fixed=shared.selection, mip_gap=0.0))
    assert forced.ilp_peak_bytes == pytest.approx(a.peak_bytes, rel=1e-6)


def test_block_recomputation_keeps_megatrons_bytes_per_layer():
    """Korthikanti et al. 2022 with tensor and sequence parallelism of degree t: the first N
    layers (recomputed) keep their input, 2sbh/t each; the others sbh/t·(34 + 5as/h)."""
    s, b, h, a, t, layers, count = 256, 2, 256, 8, 4, 4, 2
    graph = build_graph("gpt3-1.3b", batch=b, seq=s, hidden=h, heads=a, ffn=4 * h, num_layers=layers,
                        precision="mixed")
    root = build_problem(graph, parse_mesh("4"), recompute="auto")
    fixed = split_baseline(root, "megatron-tp4-sp", count)
    activations = evaluate(fixed.problem, fixed.selection).category_bytes[CATEGORIES.index("activations")]
    ops = fixed.problem.graph.ops  # (Megatron-LM's framework graph: its fused GEMMs' gathers)
    first = [min(i for i, op in enumerate(ops) if op.layer == k) for k in range(layers)]
    held = [activations[fixed.problem.schedule.reshard_in(i)] for i in first]
    assert [held[k + 1] - held[k] for k in range(layers - 1)] == pytest.approx(
        [2 * s * b * h / t] * count + [s * b * h / t * (34 + 5 * a * s / h)] * (layers - 1 - count))


def test_compare_lists_the_fewest_layers_recomputed_that_fit():
    """Where a recipe fits with full recomputation and not without, ``compare`` lists it with
    the fewest layers recomputed that fit: one fewer does not (two device memories)."""
    job = dict(batch=8, seq=128, num_layers=6, precision="fp32", recompute="auto")
    plain, full = (strategy_plan("tiny-gpt", "2x2", s, **job).peak_bytes
                   for s in ("megatron-tp2-dp2-sp", "megatron-tp2-dp2-sp+full"))
    for memory in ((plain + full) // 2, (3 * plain + full) // 4):
        mesh = parse_mesh("2x2", device_memory_bytes=memory)
        listed = make_job("tiny-gpt", mesh, batch=8, seq=128, num_layers=6, precision="fp32")
        rows = baseline_plans(listed, build_problem(listed.graph, mesh, recompute="auto"))[0]
        block = [p for p in rows if p.strategy.startswith("megatron-tp2-dp2-sp+full-block")]
        assert len(block) == 1 and block[0].memory.fits
        count = int(block[0].strategy.removeprefix("megatron-tp2-dp2-sp+full-block"))
        assert 1 <= count < 6
        fewer = strategy_plan(listed, strategy=f"megatron-tp2-dp2-sp+full-block{count - 1}", recompute="auto"
                              ).peak_bytes if count > 1 else plain  # (no layer recomputed: the plain recipe)
        assert fewer > memory >= block[0].peak_bytes
        times = {p.strategy: p.step_time_s for p in rows}
        assert times["megatron-tp2-dp2-sp"] < times[block[0].strategy] < times["megatron-tp2-dp2-sp+full"]


def test_a_split_plan_round_trips_through_json():
    plan = strategy_plan("tiny-llama", "4", "fsdp2+full-every2", num_layers=4, recompute="auto")
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["schema"] == "memshard.plan/3" and data["solver"]["layer_classes"] == [0, 1, 0, 1]
    again = plan_from_dict(data)
    assert again.peak_bytes == plan.peak_bytes and again.solver.layer_classes == (0, 1, 0, 1)
    assert sum(op.recomputed for op in again.ops) > 0


def test_split_names_outside_the_recipes_range_are_unknown():
    for name in ("megatron-tp2-dp2-sp+full-block2", "megatron-tp2-dp2-sp+full-block0", "fsdp2+full-every1",
                 "dp+full-block1"):
        with pytest.raises(MemshardError, match="unknown strategy"):
            strategy_plan("tiny-gpt", "2x2", name, recompute="auto")  # 2 layers
    with pytest.raises(MemshardError, match="unknown strategy"):
        strategy_plan("tiny-gpt", "2x2", "megatron-tp2-dp2-sp+full-block1")  # no recomputation asked for
