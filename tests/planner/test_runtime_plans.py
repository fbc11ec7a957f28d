"""The runtime tests' saved plans are what memshard finds now: each saved plan
(``tests/runtime_plans.py``) against a fresh search of the same job, JSON for JSON (less the
search's own time); a long search's plan (``LONG``) against the fingerprint of its search's
input instead, with the plan's file priced again. A planner change that moves one fails here,
naming the command that writes them anew."""

from __future__ import annotations

import json

import pytest

from tests.runtime_plans import (
    LONG,
    REWRITE,
    SEARCHES,
    fingerprint,
    fresh,
    recorded_fingerprints,
    saved,
    saved_json,
    without_timing,
)


def test_every_search_has_its_own_name():
    assert len({s.name for s in SEARCHES}) == len(SEARCHES)
    assert LONG < set(SEARCHES)  # (every long search is one of them, and some are searched again)


@pytest.mark.parametrize("search", SEARCHES, ids=lambda s: s.name)
def test_a_saved_plan_was_solved_within_its_gap(search):
    """(Not stopped by the time limit: a fresh search on any machine finds the same plan.)"""
    assert saved(search).solver.status == "optimal"


@pytest.mark.parametrize("search", [s for s in SEARCHES if s not in LONG], ids=lambda s: s.name)
def test_a_saved_plan_is_what_a_fresh_search_finds(search):
    assert without_timing(saved(search)) == without_timing(fresh(search)), f"run `{REWRITE}`"


@pytest.mark.parametrize("search", SEARCHES, ids=lambda s: s.name)
def test_a_saved_plans_search_input_is_as_it_was(search):
    """Everything the search reads (``fingerprint``: the problem and its ILP, the options,
    the code of the search's stages, HiGHS's version, a time plan's budget and start) is what
    it was when the plan was written, and the plan's file is its choices priced now: the same
    search, deterministic, would write the same file."""
    assert fingerprint(search) == recorded_fingerprints().get(search.name), f"run `{REWRITE}`"
    as_priced_now = json.loads(saved(search).to_json())
    assert without_timing(as_priced_now) == without_timing(saved_json(search)), f"run `{REWRITE}`"


def test_a_fingerprint_moves_with_any_figure_the_search_reads(monkeypatch):
    """One choice's step time one ulp off, another HiGHS, a stage's code changed: each moves
    the fingerprint (the same search's twice over does not)."""
    import math
    from dataclasses import replace

    import tests.runtime_plans as plans

    search = next(s for s in SEARCHES if s not in LONG and s.objective == "memory")
    first = fingerprint(search)
    assert fingerprint(search) == first
    built, code = plans.searched_problem, plans.search_code()

    def nudged(job, options):
        problem = built(job, options)
        group = problem.groups[0]  # (a copy of it: nothing built elsewhere changes)
        choice = replace(group.choices[0], time_s=math.nextafter(group.choices[0].time_s, math.inf))
        problem.groups = [replace(group, choices=[choice, *group.choices[1:]]), *problem.groups[1:]]
        return problem

    with monkeypatch.context() as patch:
        patch.setattr(plans, "searched_problem", nudged)
        assert fingerprint(search) != first
    with monkeypatch.context() as patch:
        patch.setattr(plans.importlib.metadata, "version", lambda name: "0.0.0")
        assert fingerprint(search) != first
    with monkeypatch.context() as patch:
        patch.setattr(plans, "search_code", lambda: code.replace("Constant(value=2", "Constant(value=3", 1))
        assert fingerprint(search) != first
