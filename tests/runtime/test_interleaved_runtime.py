"""Interleaved pipelined plans run on real gloo ranks: each rank holds two stages, torch's
``ScheduleInterleaved1F1B`` runs them, each stage by memshard's executor
(``runtime/pipelined.py``).

Each case plans a tiny model of 4 layers (8 sequences of 32 tokens, 4 micro-batches, fp32) on
2 pipeline ranks of 2 stages each (tiny GPT, its tied weights on ranks 0 and 1; tiny LLaMA,
each stage on 2 ranks of data parallelism), and runs 2 steps on forked ranks (one OpenMP thread each);
every rank's report is compared with

- the single process (``GraphModel`` and ``torch.optim.Adam``, the micro-batches' gradients
  summed): every rank's losses equal its (rtol 1e-5);
- the plan: the rank's collectives within 1% of its stages' plans' (a tied weight's all-reduce
  is extra, as ``test_pipelined_runtime.py`` counts it), its point-to-point bytes within 1% of
  its stages' activations and their gradients times the micro-batches, its measured peak within
  2% of ``PipelinedPlan.rank_peaks`` (counted from torch's action list).

The zero-bubble schedules are refused in one line, saying why.
"""

from __future__ import annotations

import functools

import pytest
import torch

import memshard
from memshard.api import make_job
from memshard.pipelining import plan_with_pipeline
from memshard.planner import SearchOptions
from memshard.plans.pipelined import PipelinedPlan
from memshard.problem.memory import param_layout, tensor_bytes
from memshard.runtime.report import P2P, error
from tests.runtime_harness import run_pipelined

STEPS = 2  # the second measured, its loss after one update
BATCH, SEQ, LAYERS, MICRO_BATCHES = 8, 32, 4, 4
# id → (model, mesh): 2 pipeline ranks, each of the mesh's other axis
CASES = {
    "gpt-2x1": ("tiny-gpt", "2x1"),  # a tied embedding and head, on stages 0 and 3 (ranks 0 and 1)
    "llama-2x2": ("tiny-llama", "2x2"),  # each stage on 2 ranks
}


@functools.cache
def _plan(case: str, schedule: str = "interleaved-1f1b") -> PipelinedPlan:
    model, mesh = CASES[case]
    job = make_job(model, mesh, batch=BATCH, seq=SEQ, micro_batches=MICRO_BATCHES, precision="fp32",
                   num_layers=LAYERS)
    return plan_with_pipeline(job, SearchOptions(mip_gap=0.02), 2, schedule)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, list[dict]]:
    """Every case's reports (rank order): one forked world per world size."""
    return run_pipelined({case: _plan(case) for case in CASES}, STEPS, tmp_path_factory.mktemp("interleaved"))


def test_every_rank_runs_two_stages_as_the_plan_places_them(results):
    for case in CASES:
        plan = _plan(case)
        assert plan.stages_per_rank == 2 and plan.stage_ranks == (0, 1, 0, 1)
        for r in results[case]:
            assert r["stage"] == [r["coordinate"][0], r["coordinate"][0] + 2]


@pytest.mark.parametrize("case", sorted(CASES))
def test_losses_equal_the_single_process_run(results, case):
    expected = torch.tensor(_reference(case))
    for r in results[case]:
        torch.testing.assert_close(torch.tensor(r["losses"]), expected, rtol=1e-5, atol=0)


@functools.cache
def _reference(case: str) -> list[float]:
    """The single process: each step's loss, the mean over its micro-batches."""
    from memshard.runtime.executor import GraphModel, make_batch

    graph = _plan(case).job.graph
    model = GraphModel(graph, seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for step in range(STEPS):
        model.step = step
        total = 0.0
        for batch in make_batch(graph, MICRO_BATCHES, step):
            loss = model(batch)
            loss.backward()
            total += loss.item()
        losses.append(total / MICRO_BATCHES)
        optimizer.step()
        optimizer.zero_grad()
    return losses


def _tied_bytes(case: str, stages: list[int]) -> float:
    """The bytes a rank's all-reduce of a tied weight's gradient sends (the buffer once, over
    the two ranks), which the stage plans do not price: where both stages store it alike."""
    plans = [s.plan for s in _plan(case).stages]
    out = 0.0
    for index in stages:
        mine = plans[index]
        for other in (p for k, p in enumerate(plans) if k != index):
            for name in mine.problem.graph.parameters:
                if name in other.problem.graph.parameters and _layout(mine, name) == _layout(other, name):
                    out += tensor_bytes(mine.problem.graph.tensors[name], _layout(mine, name), mine.problem.mesh)
    return out


def _layout(plan, name: str):
    problem = plan.problem
    gid = problem.storage_group[name]
    grad, option = problem.groups[gid].options[plan.selection.choices[gid]]
    assert option.stage == 0
    return param_layout(grad)


@pytest.mark.parametrize("case", sorted(CASES))
def test_collective_and_point_to_point_bytes_match_the_prediction(results, case):
    for r in results[case]:
        p, m = r["predicted"], r["measured"]
        assert p[P2P] > 0 and m[P2P] == pytest.approx(p[P2P], rel=0.01), (case, r["rank"])
        extra = _tied_bytes(case, r["stage"])
        assert m["communication_bytes"] == pytest.approx(p["communication_bytes"] + extra, rel=0.01, abs=1)


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_ranks_peak_is_within_2_percent_of_its_count_from_the_action_list(results, case):
    plan = _plan(case)
    for r in results[case]:
        assert r["predicted"]["peak_bytes"] == plan.rank_peaks[r["coordinate"][0]]
        e = error(r["measured"]["peak_bytes"], r["predicted"]["peak_bytes"])
        assert abs(e) <= 0.02, f"{case} rank {r['rank']}: measured peak {e:+.2%} off the prediction"


@pytest.mark.parametrize("schedule", ["interleaved-zb", "zbv"])
def test_the_zero_bubble_schedules_are_refused_in_one_line(schedule):
    from torch.distributed.device_mesh import DeviceMesh

    from memshard.runtime.pipelined import build_rank

    plan = _plan("gpt-2x1", schedule)
    with pytest.raises(memshard.MemshardError, match="split backward") as raised:
        build_rank(plan, object.__new__(DeviceMesh), 0)
    assert "\n" not in str(raised.value)
