"""Merged-axis planning: the lifted plan is a valid plan of the real mesh, it splits dims as
the merged plan does, the merged problem prices it exactly as the real mesh does (so budgets
hold there), and the full search never does worse."""

from __future__ import annotations

import functools
import random

import numpy as np
import pytest

import memshard
from memshard.api import job_and_options
from memshard.baselines.recipes import baselines
from memshard.core.mesh import parse_mesh
from memshard.models import build_graph
from memshard.planner import plan_job
from memshard.problem.evaluate import evaluate
from memshard.problem.pricing import build_problem
from memshard.search.coarsen import lift_selection, lower_selection, merge_groups, merged_mesh
from memshard.search.highs import SearchLimits
from memshard.search.solve import SearchRequest, solve, solve_fixed
from memshard.search.stages import TimeOut
from tests.unit.test_ilp_pricing import random_plan

# GPT-2's own widths (a tiny model's loose LP bound made these searches 20–40 s, this one's ~1 s)
SHAPE = dict(batch=8, seq=256, num_layers=2, mip_gap=1e-2)
# Where a search's first pass (the objective's plan, within the gap) is what a test reads: time runs
# out as the first branch and bound starts (the test knob), here the tie-break pass's (these first
# passes need none), whose secondary objective nothing here reads: the first pass's plan stands.
FIRST_PASS = TimeOut("branch and bound")


def two_inter_node_axes():
    """Two inter-node axes of 2 with the same links, merged, and a third axis of size 1: the
    full search is as small as a two-axis one."""
    return memshard.make_mesh((2, 2, 1)).with_links(bandwidths=(25e9, 25e9, 150e9), latencies=(2e-5, 2e-5, 5e-6))


@functools.cache  # (two tests read it)
def least_memory_merged():
    """GPT-2's least-memory plan on ``two_inter_node_axes``, the inter-node axes planned as one."""
    return memshard.plan("gpt2", two_inter_node_axes(), **SHAPE)


def test_merge_groups_joins_alike_adjacent_axes():
    mesh = parse_mesh("2x4x8")  # two inter-node axes (25 GB/s), one intra-node
    assert merge_groups(mesh) == [(0, 1), (2,)]
    coarse = merged_mesh(mesh, merge_groups(mesh))
    assert coarse.shape == (8, 8)
    assert coarse.axis_names == ("inter0*inter1", "intra")
    faster = mesh.with_links(bandwidths=(25e9, 50e9, 150e9))
    assert merge_groups(faster) == [(0,), (1,), (2,)]


def test_lifted_plan_is_priced_on_the_real_mesh_and_full_search_is_no_worse():
    merged = least_memory_merged()
    # the full search's least-memory plan: its first pass's (what memshard.plan searches first)
    full = plan_job(*job_and_options("gpt2", two_inter_node_axes(), dict(SHAPE, full_mesh=True, time_out=FIRST_PASS)))
    assert merged.to_dict()["mesh"]["shape"] == [2, 2, 1]
    assert merged.to_dict()["solver"]["search_space"] == "axes inter0×inter1 planned as one"
    assert full.to_dict()["solver"]["search_space"] == "full"
    # Whatever the merged plan splits over the merged axis, it splits over both real axes.
    for op in merged.to_dict()["ops"]:
        split = op["split"]
        assert split.get("inter0") == split.get("inter1"), op
    # The full search contains every lifted plan.
    assert full.peak_bytes <= merged.peak_bytes * (1 + 1e-2)  # both solved to a 1% gap
    assert merged.peak_bytes >= merged.lower_bound_bytes


def _evaluations_agree(coarse_ev, fine_ev) -> None:
    """Every figure the evaluator derives: the peak, its point and breakdown, every
    category's bytes at every schedule point, the step time and the bytes of each kind of
    collective."""
    assert coarse_ev.peak_bytes == fine_ev.peak_bytes
    assert coarse_ev.peak_point == fine_ev.peak_point
    np.testing.assert_array_equal(coarse_ev.category_bytes, fine_ev.category_bytes)
    assert coarse_ev.step_time_s == pytest.approx(fine_ev.step_time_s, rel=1e-12)
    for kind, figures in fine_ev.communication_by_kind.items():
        assert coarse_ev.communication_by_kind[kind] == pytest.approx(figures, rel=1e-12), kind


@pytest.mark.parametrize(("model", "shape"), [("tiny-gpt", (2, 2, 2)), ("tiny-llama", (2, 4, 2)), ("tiny-gpt", (2, 2, 2, 2))])
def test_merged_mesh_prices_a_plan_as_the_real_mesh_runs_it(model, shape):
    # Each reshard over a merged axis runs as a step over each real axis, which allocates and
    # sends differently from one step over a ring of the product size (gathering 2x2 → R goes
    # through a half-gathered buffer; an all-reduce over 2x2 sends its buffer twice over).
    mesh = memshard.make_mesh(shape)
    graph = build_graph(model, batch=mesh.num_devices)
    fine = build_problem(graph, mesh)
    groups = merge_groups(mesh)
    coarse = build_problem(graph, merged_mesh(mesh, groups))
    assert len(coarse.mesh.shape) < len(shape)
    # (the baselines priced on problems of their own, as their frameworks run them, are left out)
    on_fine = baselines(fine, lambda name: not name.startswith(("ddp", "fsdp2", "megatron", "torch-tp")))[0]
    lowered = {b.name: lower_selection(coarse, fine, b.selection, groups) for b in on_fine if b.problem is fine}
    plans = [sel for sel in lowered.values() if sel is not None]
    assert lowered["zero3-fsdp"] is not None and lowered["dp"] is not None
    assert len(plans) > 2  # e.g. Megatron's TP within the node, data parallel over both inter-node axes
    rng = random.Random(0)
    randoms = [random_plan(coarse, rng) for _ in range(3)]
    if coarse.mesh.ndim == 2:  # and a plan of memshard's own (a quick one: the fastest, its first pass's, the same each run)
        plans.append(solve(SearchRequest(coarse, "time", memory_budget_bytes=float("inf"), mip_gap=0.05,
                                         limits=SearchLimits(time_out=FIRST_PASS))).selection)
    for sel in plans + randoms:
        lifted = lift_selection(coarse, fine, sel, groups)
        assert lower_selection(coarse, fine, lifted, groups) == sel
        _evaluations_agree(evaluate(coarse, sel), evaluate(fine, lifted))
    # and the ILP, every choice pinned (one formulation, pinned to each in turn), prices them so too
    for sel, forced in zip(randoms, solve_fixed(SearchRequest(coarse, "memory", mip_gap=0.0), randoms), strict=True):
        assert forced.ilp_peak_bytes == pytest.approx(evaluate(fine, lift_selection(coarse, fine, sel, groups)).peak_bytes,
                                                      rel=1e-6)


def test_a_plan_that_splits_merged_axes_differently_has_no_merged_counterpart():
    mesh = memshard.make_mesh((2, 2, 2))
    graph = build_graph("tiny-gpt", batch=8)
    fine = build_problem(graph, mesh)
    groups = merge_groups(mesh)
    coarse = build_problem(graph, merged_mesh(mesh, groups))
    # tensor parallel over inter1 and intra, data parallel over inter0
    (tp4,), _ = baselines(fine, lambda name: name == "megatron-tp4-dp2")
    assert lower_selection(coarse, fine, tp4.selection, groups) is None


def test_budgets_hold_on_the_real_mesh():
    # Before merged axes were priced as the real mesh runs them, the time plan under 1.6× the
    # least peak lifted to a plan 4% over its budget (the gathers over both inter-node axes
    # went through half-gathered buffers the merged problem did not see).
    mesh = two_inter_node_axes()
    least = least_memory_merged()
    budget = int(1.6 * least.peak_bytes)
    fast = memshard.plan("gpt2", mesh, objective="time", memory_budget=budget, **SHAPE)
    assert fast.to_dict()["solver"]["search_space"] == "axes inter0×inter1 planned as one"
    assert least.peak_bytes < fast.peak_bytes <= budget
    assert fast.step_time_s < least.step_time_s
    within = memshard.plan("gpt2", mesh, max_step_time_s=0.8 * least.step_time_s, **SHAPE)
    assert within.step_time_s <= 0.8 * least.step_time_s
