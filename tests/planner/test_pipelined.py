"""Pipelined plans (``memshard.pipelining``): the pipeline axis, the stages' layers and held
micro-batches, each stage searched on its own problem, the step the schedule makes of them,
the report, the JSON and the CLI."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import memshard
from memshard.cli import main
from memshard.core.mesh import parse_mesh
from memshard.job import Job
from memshard.pipelining import (
    PipelineOptions,
    StageSearch,
    held_micro_batches,
    pipeline_degrees,
    pipeline_meshes,
    plan_auto,
    plan_pipelined,
    stage_layers,
)
from memshard.planner import SearchOptions, plan_job
from memshard.plans.pipelined import PipelinedPlan
from memshard.plans.plan import PIPELINE_SCHEMA, SCHEMA, Plan
from memshard.plans.report import render_pipelined
from memshard.problem.evaluate import evaluate
from memshard.problem.pricing import build_problem
from memshard.problem.records import PipelineStage

TINY = Job("tiny-gpt", "4", batch=8, micro_batches=4)


@pytest.fixture(scope="module")
def least():
    return plan_pipelined(TINY, SearchOptions(), PipelineOptions(2))


@pytest.fixture
def searched_once(monkeypatch):
    """In this test, each search made once (the search is deterministic): a stage's, by its
    job, options, view, layers, micro-batches held, layouts received and cutoff
    (``StageSearch.stage_plan``), and a whole job's without a pipeline (``plan_job`` as
    ``pipelining`` calls it, and the function returned, for the test's own). A split or an
    ``auto`` search asks again for what the test or another split already searched."""
    stages: dict[tuple, Plan] = {}
    stage_plan = StageSearch.stage_plan

    def stage_once(self, stage, received):
        key = (repr(self.stage_job), repr(self.stage_options), self.stage_mesh, stage,
               tuple(sorted(received.items())) if received else None, self.cutoff)
        if key not in stages:
            stages[key] = stage_plan(self, stage, received)
        return stages[key]

    jobs: dict[str, Plan] = {}

    def job_once(job, options, start=None, problem=None, cutoff=None):
        if start is not None or problem is not None or cutoff is not None:
            return plan_job(job, options, start, problem, cutoff)
        key = repr((job, options))
        if key not in jobs:
            jobs[key] = plan_job(job, options)
        return jobs[key]

    monkeypatch.setattr(StageSearch, "stage_plan", stage_once)
    monkeypatch.setattr("memshard.pipelining.plan_job", job_once)
    return job_once


def test_the_pipeline_runs_along_the_outermost_axis_across_nodes():
    full, stage = pipeline_meshes(parse_mesh("8x8"), 4)
    assert full.shape == (4, 2, 8) and stage.shape == (2, 8)
    typed = parse_mesh("8x8")
    assert stage.axes[-1] == typed.axes[-1]  # each stage keeps its node's links
    assert full.axes[0].per_node < full.axes[0].size  # the pipeline crosses nodes
    full, stage = pipeline_meshes(parse_mesh("16"), 4)
    assert full.shape == (4, 4) and stage.shape == (4,)
    full, stage = pipeline_meshes(parse_mesh("4x8"), 4)
    assert full.shape == (4, 8) and stage.axes == parse_mesh("4x8").axes[1:]


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 96), st.integers(2, 16))
def test_stages_split_the_layers_evenly_the_first_never_larger(layers, stages):
    if stages > layers:
        with pytest.raises(memshard.MemshardError):
            stage_layers(layers, stages)
        return
    split = stage_layers(layers, stages)
    assert split[0][0] == 0 and split[-1][1] == layers
    assert all(a[1] == b[0] for a, b in zip(split, split[1:]))
    sizes = [end - first for first, end in split]
    assert max(sizes) - min(sizes) <= 1 and sizes[0] == min(sizes)


@pytest.mark.parametrize("stages,micro_batches", [(2, 4), (4, 4), (4, 9), (8, 16)])
def test_held_micro_batches_are_torchs_1f1b_warm_up_and_gpipes_all(stages, micro_batches):
    assert held_micro_batches("1f1b", stages, micro_batches) == tuple(
        min(stages - i, micro_batches) for i in range(stages))
    assert held_micro_batches("gpipe", stages, micro_batches) == (micro_batches,) * stages


def test_each_stage_is_the_least_memory_plan_of_its_own_problem(least):
    assert [(s.first_layer, s.end_layer, s.held_micro_batches) for s in least.stages] == [(0, 1, 2), (1, 2, 1)]
    for s in least.stages:
        problem = s.plan.problem
        assert problem.stage == PipelineStage(s.first_layer, s.end_layer, s.held_micro_batches)
        assert problem.mesh.shape == (2,) and problem.micro_batches == 4
        # the peak the evaluator gives the plan, waiting micro-batches included
        assert evaluate(problem, s.plan.selection).peak_bytes == pytest.approx(s.plan.peak_bytes)
        # no plan of the stage's problem is leaner: the same problem searched to optimality
        exact = plan_job(s.plan.job, SearchOptions(mip_gap=0.0), problem=problem)
        assert s.plan.peak_bytes <= exact.peak_bytes * (1 + SearchOptions().gap) + 1
    assert least.peak_bytes == max(s.plan.peak_bytes for s in least.stages)
    assert least.peak_stage is least.stages[0]


def test_the_first_stage_holds_what_its_second_micro_batch_adds():
    """Stage 0 of two holds two micro-batches under 1F1B: its peak is above that of the same
    stage holding one, by at most one micro-batch's activations at the boundary."""
    graph, mesh = TINY.graph, parse_mesh("2")
    one, two = (build_problem(graph, mesh, micro_batches=4, stage=PipelineStage(0, 1, k)) for k in (1, 2))
    plan_one = plan_job(Job("tiny-gpt", "2", batch=8, micro_batches=4), SearchOptions(), problem=one)
    on_two = evaluate(two, plan_one.selection)
    boundary = evaluate(one, plan_one.selection).boundary_activation_bytes
    assert boundary > 0
    assert on_two.peak_bytes == pytest.approx(plan_one.peak_bytes + boundary)


def test_the_step_is_the_schedules_makespan_then_the_slowest_optimizer_step(least):
    from memshard.pipelining import once_per_step

    m, p = TINY.micro_batches, len(least.stages)
    slowest = max(s.forward_s + s.backward_s for s in least.stages)
    transfer = max(s.transfer_s for s in least.stages)
    once = [once_per_step(s.plan) for s in least.stages]
    ends = sum(o.reductions_s + o.gathers_s for o in once)
    assert m * slowest <= least.makespan_s <= (m + p - 1) * slowest + 2 * (p - 1) * transfer + ends + 1e-12
    optimizer = max(s.plan.compute_by_kind["optimizer step"] for s in least.stages)
    assert least.step_time_s == pytest.approx(least.makespan_s + optimizer)
    for s, o in zip(least.stages, once):  # its micro-batches, once-a-step collectives and optimizer step:
        assert m * (s.forward_s + s.backward_s) + o.in_step_s + s.plan.compute_by_kind[  # its planned step
            "optimizer step"] == pytest.approx(s.plan.step_time_s)
        assert s.idle_s >= least.bubble_s > 0
    assert least.stages[0].transfer_s > 0 and least.stages[-1].transfer_s == 0


def test_gpipe_holds_every_micro_batch_and_the_fastest_is_no_slower():
    gpipe = plan_pipelined(TINY, SearchOptions(), PipelineOptions(2, "gpipe"))
    one_f_one_b = plan_pipelined(TINY, SearchOptions(), PipelineOptions(2))
    assert [s.held_micro_batches for s in gpipe.stages] == [4, 4]
    assert gpipe.peak_bytes > one_f_one_b.peak_bytes
    fastest = plan_pipelined(TINY, SearchOptions(objective="time"), PipelineOptions(2))
    assert fastest.step_time_s <= one_f_one_b.step_time_s * (1 + 1e-9)
    assert fastest.peak_bytes >= one_f_one_b.peak_bytes * (1 - SearchOptions().gap)


def test_the_json_carries_every_stage_and_the_runtime_refuses_it(least, tmp_path):
    data = json.loads(json.dumps(least.to_dict()))
    assert data["schema"] == PIPELINE_SCHEMA
    assert data["pipeline"] == {**data["pipeline"], "stages": 2, "schedule": "1f1b", "micro_batches": 4}
    assert [s["layers"] for s in data["stages"]] == [[0, 1], [1, 2]]
    assert all(s["plan"]["schema"] == SCHEMA for s in data["stages"])
    assert data["step_time_s"] == least.step_time_s and data["peak_bytes_per_device"] == least.peak_bytes
    least.save(str(tmp_path / "p.json"))
    with pytest.raises(memshard.MemshardError, match="pipelined plan"):
        memshard.load_plan(str(tmp_path / "p.json"))


def test_the_cli_plans_a_pipeline_and_writes_it(tmp_path, capsys):
    path = tmp_path / "plan.json"
    argv = ["plan", "--model", "tiny-gpt", "--mesh", "4", "--batch", "8", "--micro-batches", "4",
            "--pipeline", "2", "--schedule", "gpipe", "--brief", "--json", str(path)]
    assert main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())  # (the console wraps its lines)
    assert "2 pipeline stages, GPipe, each on mesh 2" in out and "(the largest peak)" in out
    data = json.loads(path.read_text())
    assert data["pipeline"]["schedule"] == "gpipe" and len(data["stages"]) == 2
    api = memshard.plan("tiny-gpt", "4", batch=8, micro_batches=4, pipeline=2, schedule="gpipe")
    assert api.step_time_s == pytest.approx(data["step_time_s"])


def test_the_report_names_each_stage(least):
    import io

    from rich.console import Console

    buffer = io.StringIO()
    render_pipelined(least, Console(file=buffer, width=160, color_system=None), show_strategy=False)
    text = buffer.getvalue()
    assert "Pipeline stages" in text and "estimated step time" in text
    rows = [line for line in text.splitlines() if line.startswith("│ 0") or line.startswith("│ 1")]
    assert len(rows) >= 2


def test_auto_tries_every_degree_the_mesh_layers_and_micro_batches_allow():
    assert pipeline_degrees(Job("gpt3-1.3b", "8x8", micro_batches=8)) == (2, 4, 8)
    assert pipeline_degrees(Job("gpt3-1.3b", "8x8", micro_batches=4)) == (2, 4)
    assert pipeline_degrees(Job("gpt3-1.3b", "8x8", micro_batches=4), "gpipe") == (2, 4, 8)
    assert pipeline_degrees(Job("tiny-gpt", "8", batch=8, micro_batches=8)) == (2,)  # two layers
    assert pipeline_degrees(TINY) == (2,)  # four devices: four stages would leave one each


@pytest.mark.parametrize("objective", ["memory", "time"])
def test_auto_keeps_the_better_of_no_pipeline_and_each_degree(objective, least, searched_once):
    options = SearchOptions(objective=objective)
    flat = searched_once(TINY, options)
    pipelined = least if objective == "memory" else plan_pipelined(TINY, options, PipelineOptions(2))
    best = plan_auto(TINY, options)
    figure = (lambda p: p.peak_bytes) if objective == "memory" else (lambda p: p.step_time_s)
    assert figure(best) == pytest.approx(min(figure(flat), figure(pipelined)))
    assert isinstance(best, PipelinedPlan) == (figure(pipelined) < figure(flat))


def test_a_recipe_on_a_stage_keeps_the_stage_and_what_it_holds():
    """A baseline priced on a stage's problem is rebuilt for its framework on that stage's
    graph, holding the same micro-batches (not cut again, not the whole model)."""
    from memshard.baselines.recipes import baselines

    stage = PipelineStage(0, 1, 2)
    problem = build_problem(TINY.graph, parse_mesh("2"), micro_batches=4, stage=stage)
    fixed, _ = baselines(problem, lambda name: name.startswith("megatron-tp2"))
    assert fixed
    for b in fixed:
        assert b.problem.stage == stage and b.problem.graph.num_layers == 1
        one = build_problem(TINY.graph, parse_mesh("2"), micro_batches=4, stage=PipelineStage(0, 1, 1),
                            framework=b.problem.framework)
        held, alone = evaluate(b.problem, b.selection), evaluate(one, b.selection)
        assert held.peak_bytes == pytest.approx(alone.peak_bytes + alone.boundary_activation_bytes)


def test_the_forward_takes_its_kernels_share_about_a_third_of_a_layers_gemms():
    """A GEMM's backward computes two GEMMs of its size: a stage of matmul-bound layers runs
    about a third of its compute forward (a little more: element-wise ops' backwards are less
    than twice their forwards); recomputation moves a forward into the backward."""
    from memshard.pipelining import forward_share

    job = Job("gpt3-1.3b", "2x8", batch=16, seq=2048, micro_batches=4)
    # (each stage on its mesh as typed: a stage's kernels are its layers' whichever view it lies
    # on, and the views' searches were nearly all the time; views: the tests below)
    fastest, recomputing = (SearchOptions(objective="time", recompute=r, mesh_views=False) for r in ("none", "full"))
    plain = plan_pipelined(job, fastest, PipelineOptions(2))
    share = forward_share(plain.stages[1].plan)
    assert 1 / 3 < share < 0.4
    full = plan_pipelined(job, recomputing, PipelineOptions(2))
    assert forward_share(full.stages[1].plan) < share
    for s in plain.stages:
        assert s.forward_s == pytest.approx((s.forward_s + s.backward_s) * forward_share(s.plan))


# -- stage boundaries -------------------------------------------------------------------------------
SIX_LAYERS = Job("tiny-llama", "2x2", batch=16, seq=128, micro_batches=4, overrides={"num_layers": 6})


def test_a_split_by_counts_gives_each_stage_its_layers():
    plan = plan_pipelined(SIX_LAYERS, SearchOptions(), PipelineOptions(2, split=(2, 4)))
    assert [(s.first_layer, s.end_layer) for s in plan.stages] == [(0, 2), (2, 6)]
    assert [s["layers"] for s in plan.to_dict()["stages"]] == [[0, 2], [2, 6]]
    assert plan.stages[1].plan.problem.graph.num_layers == 4


def test_the_balanced_split_of_two_stages_is_the_best_of_every_split(searched_once):
    """Two stages: each stage's peak grows with its layers, so moving a layer off the binding
    stage until it no longer helps reaches the least of the peaks over every split, which the
    splits searched one by one show. (``searched_once``: the balanced search's splits are
    among those searched one by one.)"""
    options = SearchOptions()
    every = {n: plan_pipelined(SIX_LAYERS, options, PipelineOptions(2, split=(n, 6 - n))).peak_bytes
             for n in range(1, 6)}
    balanced = plan_pipelined(SIX_LAYERS, options, PipelineOptions(2, split="balanced"))
    assert balanced.peak_bytes == min(every.values())
    assert balanced.peak_bytes < every[3]  # the even split: stage 0 holds two micro-batches, stage 1 one


@pytest.mark.parametrize("argv, message", [
    (["--stage-layers", "2,2"], "layer counts (2, 2) add up to 4, not the model's 6 layers"),
    (["--stage-layers", "2,2,2"], "2 pipeline stages take 2 layer counts of at least 1 each"),
    (["--stage-layers", "0,6"], "expected even, balanced or a layer count per stage"),
    (["--stage-layers", "uneven"], "expected even, balanced or a layer count per stage"),
])
def test_a_split_that_does_not_fit_the_stages_is_one_line(argv, message, capsys):
    code = main(["plan", "--model", "tiny-llama", "--layers", "6", "--mesh", "2x2", "--batch", "16",
                 "--micro-batches", "4", "--pipeline", "2", *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err


def test_a_split_without_a_pipeline_is_refused():
    with pytest.raises(memshard.MemshardError, match="give --pipeline too"):
        memshard.plan("tiny-gpt", "4", batch=8, stage_layers="balanced")


# -- mesh views inside the stages ---------------------------------------------------------------------
# Two stages of one node of 8: a stage mesh of 8, whose view 2 × 4 (``core.mesh.mesh_views``)
# holds plans one axis of 8 does not (at batch 16 the view's stages are about 28% faster; at
# batch 64 both views' fastest is data parallelism, its ZeRO-0 all-reduces one coalesced bucket)
ONE_NODE_STAGES = Job("tiny-gpt", "2x8", batch=16, seq=128, micro_batches=4)


@pytest.fixture(scope="module")
def on_views():
    return plan_pipelined(ONE_NODE_STAGES, SearchOptions(objective="time"), PipelineOptions(2))


def test_the_fastest_stages_lie_on_the_view_that_planning_each_view_by_hand_finds(on_views):
    """For the fastest step the stages are searched on each view of the stage mesh, all on one;
    planned by hand on each (views off: the stage mesh as typed; the job's mesh typed so that a
    stage's mesh is the view), the view's plan is strictly faster, and it is the one kept."""
    gap = SearchOptions().gap
    typed = plan_pipelined(ONE_NODE_STAGES, SearchOptions(objective="time", mesh_views=False), PipelineOptions(2))
    by_hand = plan_pipelined(Job("tiny-gpt", "2x2x4", batch=16, seq=128, micro_batches=4),
                             SearchOptions(objective="time", mesh_views=False), PipelineOptions(2))
    assert typed.stage_mesh.shape == (8,) and typed.typed_stage_mesh is None
    def links(mesh):
        return [(a.size, a.latency_s, a.bandwidth_bytes_per_s, a.per_node) for a in mesh.axes]
    assert by_hand.stage_mesh.shape == (2, 4) and links(by_hand.stage_mesh) == links(on_views.stage_mesh)
    assert by_hand.step_time_s < typed.step_time_s * (1 - gap)
    assert on_views.step_time_s == pytest.approx(by_hand.step_time_s, rel=gap)
    assert on_views.stage_mesh.shape == (2, 4) and on_views.typed_stage_mesh.shape == (8,)
    assert on_views.mesh.shape == (2, 2, 4) and on_views.mesh.axes[0] == typed.mesh.axes[0]
    for s in on_views.stages:  # every stage on the view, recording the stage mesh as typed
        assert s.plan.problem.mesh.shape == (2, 4) and s.plan.job.mesh.shape == (2, 4)
        assert s.plan.solver.typed_mesh == "8"


def test_a_pipelined_plan_on_a_view_round_trips_through_its_json(on_views):
    data = json.loads(on_views.to_json())
    assert data["pipeline"]["stage_mesh"]["shape"] == [2, 4] and data["pipeline"]["typed_stage_mesh"]["shape"] == [8]
    loaded = PipelinedPlan.from_dict(data)
    assert loaded.to_dict() == data
    assert loaded.typed_stage_mesh == on_views.typed_stage_mesh and loaded.stage_mesh == on_views.stage_mesh
    assert [s.plan.selection for s in loaded.stages] == [s.plan.selection for s in on_views.stages]
    assert "typed_stage_mesh" not in json.loads(json.dumps(plan_pipelined(
        ONE_NODE_STAGES, SearchOptions(objective="time", mesh_views=False), PipelineOptions(2)).to_dict()))["pipeline"]


def test_views_follow_the_objective_and_mesh_views_as_without_a_pipeline():
    """The least memory stays on the stage mesh as typed unless ``--mesh-views on``; a stage mesh
    whose devices form no other axes takes no ``--mesh-views on``, in one line."""
    from memshard.pipelining import stage_views

    pipeline = PipelineOptions(2)
    assert stage_views(ONE_NODE_STAGES, SearchOptions(), pipeline) == (None,)
    assert stage_views(ONE_NODE_STAGES, SearchOptions(objective="time", mesh_views=False), pipeline) == (None,)
    views = stage_views(ONE_NODE_STAGES, SearchOptions(mesh_views=True), pipeline)
    assert [v.shape for v in views[1:]] == [(2, 4)] and views[0] is None
    with pytest.raises(memshard.MemshardError, match="change nothing on the stage mesh 2") as raised:
        plan_pipelined(TINY, SearchOptions(objective="time", mesh_views=True), pipeline)
    assert "\n" not in str(raised.value)
    assert plan_pipelined(TINY, SearchOptions(objective="time"), pipeline).typed_stage_mesh is None


def test_the_cli_plans_stages_on_a_view_and_auto_keeps_it(on_views, tmp_path, capsys):
    path = tmp_path / "plan.json"
    argv = ["plan", "--model", "tiny-gpt", "--mesh", "2x8", "--batch", "16", "--seq", "128", "--micro-batches", "4",
            "--pipeline", "2", "--objective", "time", "--mesh-views", "on", "--brief", "--json", str(path)]
    assert main(argv) == 0
    assert "each on mesh 2x4 (the best view of mesh 8)" in " ".join(capsys.readouterr().out.split())
    data = json.loads(path.read_text())
    assert data["pipeline"]["stage_mesh"]["shape"] == [2, 4]
    assert data["step_time_s"] == pytest.approx(on_views.step_time_s)
    assert main([*argv[:-4], "off", "--brief"]) == 0
    assert "each on mesh 8" in " ".join(capsys.readouterr().out.split())


def test_a_stages_once_a_step_collectives_end_its_step_as_torchs_schedule_runs_them():
    """Torch's stage syncs gradients in its last backward only, and under 1F1B stage 0 runs the
    step's last backward: a ZeRO-1 (distributed optimizer) stage's gradient reduce-scatter runs
    once, after it, beside that backward alone, not spread over the micro-batches (where the fill
    and drain would count it (m + p − 1)/m times); its updated shards are gathered once, before
    its first forward."""
    from memshard.pipelining import once_per_step, pipelined_baseline
    from memshard.problem.pipeline import StageTimes, build_schedule, simulate

    job = Job("tiny-gpt", "2x4", batch=16, seq=128, micro_batches=8)
    plan = pipelined_baseline(job, "megatron-tp2-pp2-dp2-sp-distopt")
    once = [once_per_step(s.plan) for s in plan.stages]
    assert all(o.reductions_s > 0 and o.gathers_s > 0 for o in once)  # ZeRO-1: reduce-scatter, all-gather
    for o in once:  # not beside the compute (no -overlap): all of it in the step
        assert o.credited_s == 0 and o.in_step_s == pytest.approx(o.reductions_s + o.gathers_s)
    times = [StageTimes(s.forward_s, s.backward_s, 0.0) for s in plan.stages]
    timeline = simulate(build_schedule("1f1b", 2, 8, 1).actions, times, plan.stages[0].transfer_s)
    assert timeline.ends_s[0][-1] == timeline.makespan_s  # stage 0 runs the last backward
    # its gathers delay the whole pipeline, its reductions follow it (stage 1's end within the drain)
    assert plan.makespan_s == pytest.approx(once[0].gathers_s + timeline.makespan_s + once[0].reductions_s)
    spread = simulate(build_schedule("1f1b", 2, 8, 1).actions,
                      [StageTimes(t.forward_s, t.backward_input_s + (o.in_step_s / 8), 0.0)
                       for t, o in zip(times, once)], plan.stages[0].transfer_s).makespan_s
    assert plan.makespan_s < spread  # counted once, not once per slot of the schedule
