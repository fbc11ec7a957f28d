"""The search's stage record on the plan (``search/stages.py``), ``memshard plan --verbose``,
and the plain single-MIP search the staged one is checked against."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from memshard.api import make_job
from memshard.cli import build_parser
from memshard.core.errors import MemshardError
from memshard.planner import SearchOptions, plan_job
from memshard.plans.report import render_plan

STAGES = {"dive", "support search", "reduced-cost fixing", "branch and bound", "relaxation", "rounded relaxation",
          "relaxation beside", "lazy rows", "first pass", "tie-break pass", "unit's search"}


@pytest.mark.parametrize("model, mesh, job, options", [
    ("tiny-gpt", "4", dict(batch=8, seq=64), dict()),
    ("tiny-llama", "4", dict(batch=8, seq=64), dict(recompute="selective")),
    ("tiny-llama", "2x2", dict(batch=8, seq=64), dict(objective="time", memory_budget="80GiB", mesh_views=False)),
    ("tiny-gpt", "4", dict(batch=8, seq=64), dict(recompute="auto", objective="time", memory_budget="80GiB",
                                                  mesh_views=False)),
])
def test_the_staged_search_and_the_plain_mip_agree_on_the_optimum_within_the_gap(model, mesh, job, options):
    """The plain search (one HiGHS branch and bound on the whole formulation, the primary
    objective alone) is the reference: on small jobs both prove their plans, and each plan's
    primary objective lies within its gap of the other's (ties in the primary objective may
    give different plans). The plain search runs one stage, a branch and bound (per ZeRO-3
    unit searched)."""
    job = make_job(model, mesh, **job)
    staged = plan_job(job, SearchOptions(time_limit_s=120, **options))
    plain = plan_job(job, SearchOptions(time_limit_s=120, search="plain", **options))
    assert staged.solver.status == plain.solver.status == "optimal"
    primary = (lambda p: p.step_time_s) if options.get("objective") == "time" else (lambda p: p.peak_bytes)
    assert primary(staged) * (1 - staged.solver.gap) <= primary(plain) * (1 + 1e-6)
    assert primary(plain) * (1 - plain.solver.gap) <= primary(staged) * (1 + 1e-6)
    # (one per ZeRO-3 unit searched: both for the least memory with recomputation)
    assert {stage.name for stage in plain.solver.stages} - {"unit's search"} == {"branch and bound"}
    assert "dive" in {stage.name for stage in staged.solver.stages}


def test_a_plans_stage_record_says_what_each_stage_did_and_stays_out_of_its_json():
    """Every stage has a known name, a time, and why it stopped; the first pass's last round
    found the plan's primary objective (the ILP's M) with a bound at most it; the plan's JSON
    is the same with or without the record (it is not written)."""
    plan = plan_job(make_job("tiny-gpt", "4", batch=8, seq=64), SearchOptions())
    stages = plan.solver.stages
    assert stages and {stage.name for stage in stages} <= STAGES
    assert all(stage.time_s >= 0 and stage.stopped for stage in stages)
    last = [stage for stage in stages if stage.name == "first pass"][-1]
    assert last.objective == "memory" and last.bound <= last.found * (1 + 1e-9)
    # the plan is the first pass's, or the tie-break pass's held within the gap of its bound
    # (``solve.second_pass_cap``: a faster plan for a little more memory)
    if last.found != pytest.approx(plan.peak_bytes, rel=1e-4):
        assert "tie-break pass" in {stage.name for stage in stages}
        assert last.found < plan.peak_bytes <= last.bound / (1 - SearchOptions().gap) + 1e-6
    assert plan.peak_bytes * (1 - plan.solver.gap) <= last.found
    text = json.dumps(plan.to_dict())
    assert "stages" not in text and "first pass" not in text


def test_memshard_plan_verbose_shows_the_stages():
    """``memshard plan --verbose`` adds the stage table to the report; without it, none."""
    assert build_parser().parse_args(["plan", "--model", "tiny-gpt", "--mesh", "4", "--verbose"]).verbose
    plan = plan_job(make_job("tiny-gpt", "4", batch=8, seq=64), SearchOptions())
    shown = []
    for verbose in (True, False):
        buffer = io.StringIO()
        render_plan(plan, Console(file=buffer, width=160, color_system=None), show_stages=verbose)
        shown.append(buffer.getvalue())
    assert "Search stages" in shown[0] and "first pass" in shown[0] and "Search stages" not in shown[1]


def test_an_unknown_search_is_refused():
    with pytest.raises(MemshardError, match="search must be one of staged, plain"):
        SearchOptions(search="fast")
