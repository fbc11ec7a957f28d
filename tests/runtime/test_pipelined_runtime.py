"""Pipelined plans run on real gloo ranks: torch's ``PipelineStage`` and ``Schedule1F1B`` /
``ScheduleGPipe``, each stage by memshard's executor (``runtime/pipelined.py``).

Each case plans a tiny model (8 sequences of 32 tokens, fp32) in 2 stages of 1, 2 or 4 ranks
(those of 4 on the view 2 × 2 of their mesh: ``PipelinedPlan.typed_stage_mesh``) and runs 3
steps on forked ranks; every rank's report is compared with

- the single process: the whole graph's reference model (``GraphModel``, the same seed) and
  ``torch.optim.Adam`` over the same micro-batches (their gradients summed, as memshard's loop
  sums them), its loss per step the mean of its micro-batches': every rank's losses equal it
  (rtol 1e-5, as ``test_runtime.py``);
- the rank's stage plan: the collectives' bytes per kind within 1%; the bytes it sends by
  point-to-point within 1% of its activations (forward) and their gradients (backward) in
  its plan's layouts, times the micro-batches; its measured peak within 2%.

Each stage receives its input in the layout the stage before sends it (its ``RECEIVE`` op's,
fixed by the planner), so each rank passes its piece to one rank; a plan whose layouts differ
there is refused in one line. A rank killed in the middle of the schedule ends
``python -m memshard.runtime.train`` on a pipelined plan within seconds, with one error naming
it.
"""

from __future__ import annotations

import functools
import json
import time

import pytest
import torch

import memshard
from memshard.api import make_job
from memshard.core.graph import RECEIVE, Graph
from memshard.core.placement import Replicate, Shard
from memshard.pipelining import plan_with_pipeline
from memshard.planner import SearchOptions
from memshard.plans.pipelined import PipelinedPlan, load_any_plan
from memshard.problem.memory import param_layout, tensor_bytes
from memshard.runtime.executor import GraphModel, make_batch
from memshard.runtime.launch import KILL_ENV, launch
from memshard.runtime.report import P2P, error
from tests.runtime_harness import run_pipelined

STEPS = 3
BATCH, SEQ = 8, 32
# id → (model, mesh, schedule, micro-batches, objective)
CASES = {
    "llama-2x1-1f1b-2": ("tiny-llama", "2x1", "1f1b", 2, "memory"),
    "llama-2x1-gpipe-2": ("tiny-llama", "2x1", "gpipe", 2, "memory"),
    "gpt-2x1-1f1b-2": ("tiny-gpt", "2x1", "1f1b", 2, "memory"),  # a tied embedding and head
    "llama-2x2-1f1b-4": ("tiny-llama", "2x2", "1f1b", 4, "time"),
    # its readers read the received tensor in S(2) and S(0) (refused before the RECEIVE op)
    "llama-2x2-1f1b-4-memory": ("tiny-llama", "2x2", "1f1b", 4, "memory"),
    "llama-2x2-gpipe-4": ("tiny-llama", "2x2", "gpipe", 4, "memory"),  # hidden split on the boundary
    "gpt-2x2-1f1b-4": ("tiny-gpt", "2x2", "1f1b", 4, "memory"),  # layouts differ across the boundary
    # each stage of 4 ranks on the view 2 x 2 of its mesh of 4 (the fastest plan searches views)
    "llama-2x4-1f1b-4-view": ("tiny-llama", "2x4", "1f1b", 4, "time"),
}
VIEWS = {"llama-2x4-1f1b-4-view": (2, 2)}  # case → the view its stages lie on
# Ranks whose measured peak misses the stage plan's by more than 2% (pipeline stage → why):
# docs/pipelining.md "Running a pipelined plan". Under GPipe every forward runs first and the
# model prices the first backward (the other micro-batches waiting, the gradients being made);
# the measured peak is in a later one: every gradient accumulated and autograd's new one beside
# it, with a micro-batch fewer waiting, which is more where the gradients outweigh what a
# micro-batch holds (tiny LLaMA, 2x2).
LATER_BACKWARD = "over: a later GPipe backward (all gradients and the new one, a micro-batch fewer waiting)"
PEAK_MISSES = {
    "llama-2x2-gpipe-4": {0: LATER_BACKWARD, 1: LATER_BACKWARD},
}


@functools.cache
def _plan(case: str) -> PipelinedPlan:
    model, mesh, schedule, m, objective = CASES[case]
    job = make_job(model, mesh, batch=BATCH, seq=SEQ, micro_batches=m, precision="fp32")
    return plan_with_pipeline(job, SearchOptions(mip_gap=0.02, objective=objective), 2, schedule)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, list[dict]]:
    """Every case's reports (rank order): one forked world per world size."""
    return run_pipelined({case: _plan(case) for case in CASES}, STEPS, tmp_path_factory.mktemp("pipelined"))


@functools.cache
def _single_process(model: str, micro_batches: int) -> tuple[Graph, list[float]]:
    """The single process of every case of ``model`` in ``micro_batches`` (the job's graph, the
    same on any mesh): each step's loss, the mean over its micro-batches."""
    case = next(c for c, (name, *_, m, _) in CASES.items() if (name, m) == (model, micro_batches))
    graph = _plan(case).job.graph
    reference = GraphModel(graph, seed=0)
    optimizer = torch.optim.Adam(reference.parameters(), lr=1e-3)
    losses = []
    for step in range(STEPS):
        reference.step = step
        total = 0.0
        for batch in make_batch(graph, micro_batches, step):
            loss = reference(batch)
            loss.backward()
            total += loss.item()
        losses.append(total / micro_batches)
        optimizer.step()
        optimizer.zero_grad()
    return graph, losses


def _reference(case: str) -> list[float]:
    """The case's single-process losses (run once for the cases of the same graph)."""
    model, _, _, m, _ = CASES[case]
    graph, losses = _single_process(model, m)
    assert _plan(case).job.graph == graph
    return losses


@pytest.mark.parametrize("case", sorted(CASES))
def test_losses_equal_the_single_process_run(results, case):
    expected = torch.tensor(_reference(case))
    for r in results[case]:
        torch.testing.assert_close(torch.tensor(r["losses"]), expected, rtol=1e-5, atol=0)


def _tied_bytes(case: str, stage: int) -> float:
    """The bytes a rank's all-reduce of a tied weight's gradient with the other stage sends (the
    buffer once, over 2 ranks), which the stage plans do not price: where both stages store it
    alike (ZeRO-0 here); stored in other layouts, the runtime exchanges its parts by
    point-to-point instead (not a collective)."""
    plans = [s.plan for s in _plan(case).stages]
    mine, other = plans[stage], plans[1 - stage]
    out = 0.0
    for name in mine.problem.graph.parameters:
        if name not in other.problem.graph.parameters:
            continue
        (layout, zero), (theirs, their_zero) = (_storage(p, name) for p in (mine, other))
        assert zero == their_zero == 0
        if layout == theirs:
            out += tensor_bytes(mine.problem.graph.tensors[name], layout, mine.problem.mesh)
    return out


def _storage(plan, name: str):
    problem = plan.problem
    gid = problem.storage_group[name]
    grad, option = problem.groups[gid].options[plan.selection.choices[gid]]
    return param_layout(grad), option.stage


@pytest.mark.parametrize("case", sorted(CASES))
def test_collective_and_point_to_point_bytes_match_the_prediction(results, case):
    for r in results[case]:
        p, m = r["predicted"], r["measured"]
        assert m[P2P] == pytest.approx(p[P2P], rel=0.01), (case, r["rank"])
        assert p[P2P] > 0
        extra = _tied_bytes(case, r["stage"])
        assert m["communication_bytes"] == pytest.approx(p["communication_bytes"] + extra, rel=0.01, abs=1)
        for kind, predicted in p["communication_by_kind"].items():
            added = extra if kind == "all_reduce" else 0.0
            assert m["communication_by_kind"][kind] == pytest.approx(predicted + added, rel=0.01, abs=1), kind


@pytest.mark.parametrize("case", sorted(CASES))
def test_peak_memory_matches_the_prediction(results, case):
    """Every rank within 2%, but the ranks ``PEAK_MISSES`` names (each must still miss: the
    list is what is left to model, not a tolerance)."""
    for r in results[case]:
        e = error(r["measured"]["peak_bytes"], r["predicted"]["peak_bytes"])
        known = PEAK_MISSES.get(case, {}).get(r["stage"])
        if known is None:
            assert abs(e) <= 0.02, f"{case} rank {r['rank']}: measured peak {e:+.2%} off the prediction"
        else:
            assert abs(e) > 0.02, f"{case} rank {r['rank']} now within 2% ({e:+.2%}): drop it from PEAK_MISSES"


@pytest.mark.parametrize("case", sorted(VIEWS))
def test_a_case_on_a_view_lays_every_stage_out_on_it(results, case):
    """The world mesh is the pipeline axis and the view's axes: every rank ran its stage's plan
    on the view (the reports' coordinates), the stage mesh as typed one axis of 4."""
    plan = _plan(case)
    assert plan.stage_mesh.shape == VIEWS[case] and plan.typed_stage_mesh.shape == (4,)
    assert all(s.plan.problem.mesh.shape == VIEWS[case] for s in plan.stages)
    coordinates = sorted(tuple(r["coordinate"]) for r in results[case])
    assert coordinates == sorted((p, a, b) for p in range(2) for a in range(2) for b in range(2))


def test_a_pipelined_plan_round_trips_through_its_json(tmp_path):
    plan = _plan("gpt-2x2-1f1b-4")
    path = tmp_path / "pp.json"
    plan.save(str(path))
    loaded = load_any_plan(str(path))
    assert isinstance(loaded, PipelinedPlan)
    assert loaded.to_dict() == json.loads(path.read_text())
    assert [s.plan.selection for s in loaded.stages] == [s.plan.selection for s in plan.stages]


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_stage_receives_one_piece_in_the_layout_the_stage_before_sends(case):
    """The received tensor's one reader is its RECEIVE op; its layout is the sent one."""
    from memshard.runtime.pipelined import check_boundaries, stage_ends

    ends = [stage_ends(s.plan) for s in _plan(case).stages]
    check_boundaries(ends)
    graph = _plan(case).stages[1].plan.problem.graph
    ((i, _),) = graph.consumers[ends[1].received]
    assert graph.ops[i].kind == RECEIVE and ends[0].sent_layout == ends[1].received_layout


def test_a_plan_whose_stages_lay_the_boundary_out_differently_is_refused_in_one_line():
    from memshard.runtime.pipelined import StageEnds, check_boundaries

    sender = StageEnds(None, None, "x", (Shard(2), Replicate()))
    with pytest.raises(memshard.MemshardError, match="layout") as raised:
        check_boundaries([sender, StageEnds("x", (Shard(1), Replicate()), None, None)])
    assert "\n" not in str(raised.value)
    check_boundaries([sender, StageEnds("x", (Shard(2), Replicate()), None, None)])


def test_a_rank_killed_mid_schedule_stops_the_run_with_one_error(tmp_path):
    """Rank 1 (the last stage) dies in its second step, between its micro-batches, while rank 0
    waits on it for a gradient."""
    path = tmp_path / "pp.json"
    _plan("llama-2x1-1f1b-2").save(str(path))
    start = time.monotonic()
    with pytest.raises(memshard.MemshardError) as raised:
        launch("memshard.runtime.train", ["--plan", str(path), "--steps", "3"], 2, env={KILL_ENV: "1:1"},
               timeout_s=120, fail_fast_s=20)
    assert time.monotonic() - start < 60
    assert "rank 1 of 2 was killed by SIGKILL" in str(raised.value)
