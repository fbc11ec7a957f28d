"""Collectives run once a step hide under one micro-batch's compute at most
(``Choice.overlapped_once_s``, ``evaluate.hidden_communication``): with gradient accumulation,
DDP and Megatron-LM's ``--overlap-grad-reduce`` reduce in the last micro-batch's backward only,
and the updated shards of ZeRO-1/2 are gathered before the first forward; FSDP2 gathers and
reduces every micro-batch. The ILP prices the same step time as the evaluator."""

from __future__ import annotations

import functools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import memshard
from memshard.core.mesh import parse_mesh
from memshard.models import build_graph
from memshard.problem import comm
from memshard.problem.evaluate import evaluate
from memshard.problem.pricing import build_problem
from memshard.problem.records import StorageGroup
from memshard.search.solve import SearchRequest, solve
from tests.unit.test_ilp_pricing import random_plan
from tests.unit.test_overlap import overlapped_and_window

SLOW = parse_mesh("8").with_links((2e9,))  # links slow enough that the reductions outlast a micro-batch


@pytest.mark.parametrize("strategy", ["ddp", "megatron-tp1-dp8-distopt-overlap"])
def test_a_once_a_step_reduction_hides_under_one_micro_batch(strategy):
    """DDP's all-reduces and Megatron-LM's overlapped reduce-scatters and gathers run once a
    step: with 4 micro-batches at most a quarter of the compute hides them; with one, all of it."""
    one, four = (memshard.strategy_plan("tiny-gpt", SLOW, strategy, batch=32, micro_batches=m) for m in (1, 4))
    for plan, m in ((one, 1), (four, 4)):
        overlapped, _, compute = overlapped_and_window(plan)
        assert overlapped > compute / 4 > 0
        assert plan.hidden_communication_s == pytest.approx(min(overlapped, compute / m))
        assert plan.step_time_s == pytest.approx(plan.compute_time_s + plan.communication_time_s
                                                 - plan.hidden_communication_s)
    assert four.hidden_communication_s < one.hidden_communication_s


def test_fsdp2s_collectives_every_micro_batch_hide_under_the_whole_step():
    """FSDP2 gathers and reduce-scatters every micro-batch: none of them is once a step."""
    plan = memshard.strategy_plan("tiny-gpt", SLOW, "fsdp2", batch=32, micro_batches=4)
    groups = [(g, g.choices[k]) for g, k in zip(plan.problem.groups, plan.selection.choices)]
    assert all(c.overlapped_once_s == 0 for g, c in groups if isinstance(g, StorageGroup))
    overlapped, _, compute = overlapped_and_window(plan)
    assert plan.hidden_communication_s == pytest.approx(min(overlapped, compute))


def test_a_choices_once_a_step_share_is_its_zero_stages():
    """memshard's problem with 4 micro-batches: of the collectives a choice runs beside the
    compute, those run once a step (recounted from its calls: those that do not appear once per
    micro-batch) are its once-a-step share; ZeRO-0 and ZeRO-1 choices have one."""
    problem = build_problem(build_graph("tiny-gpt", batch=8), parse_mesh("8"), micro_batches=4)
    seen = set()
    for group in problem.groups:
        if not isinstance(group, StorageGroup):
            continue
        for choice, (_, option) in zip(group.choices, group.options):
            kinds = [c.kind for c in choice.calls]  # (one axis: a call per micro-batch appears 4 times)
            once = comm.total_time(tuple(c for c in choice.calls if kinds.count(c.kind) < 4), problem.mesh)
            if choice.overlapped_s == 0:
                assert choice.overlapped_once_s == 0
                continue
            assert choice.overlapped_once_s <= choice.overlapped_s * (1 + 1e-12)
            assert choice.overlapped_once_s == pytest.approx(min(once, choice.overlapped_s)), option
            seen.add(option.stage)
    assert {0, 1} <= seen


@functools.cache
def _problem(framework: str):
    return build_problem(build_graph("tiny-llama", batch=8, precision="fp32"), SLOW, micro_batches=4,
                         framework=framework)


@settings(max_examples=8, deadline=None, derandomize=True)
@given(framework=st.sampled_from(["ddp", "memshard"]), seed=st.integers(0, 2**32 - 1))
def test_the_ilp_prices_a_micro_batched_step_as_the_evaluator(framework, seed):
    """Any plan pinned in the ILP with 4 micro-batches: its proved bound is the evaluator's step."""
    problem = _problem(framework)
    plan = random_plan(problem, random.Random(seed))
    forced = solve(SearchRequest(problem, "time", fixed=plan, mip_gap=0.0, memory_budget_bytes=float("inf")))
    assert forced.selection == plan
    assert forced.bound == pytest.approx(evaluate(problem, plan).step_time_s, rel=1e-6)
