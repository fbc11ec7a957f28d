"""The runtime tests' saved plans are what memshard finds now: each saved plan
(``tests/runtime_plans.py``) against a fresh search of the same job, JSON for JSON (less the
search's own time). A planner change that moves one fails here, naming the command that writes
them anew."""

from __future__ import annotations

import pytest

from tests.runtime_plans import REWRITE, SEARCHES, fresh, saved, without_timing


def test_every_search_has_its_own_name():
    assert len({s.name for s in SEARCHES}) == len(SEARCHES)


@pytest.mark.parametrize("search", SEARCHES, ids=lambda s: s.name)
def test_a_saved_plan_was_solved_within_its_gap(search):
    """(Not stopped by the time limit: a fresh search on any machine finds the same plan.)"""
    assert saved(search).solver.status == "optimal"


@pytest.mark.parametrize("search", SEARCHES, ids=lambda s: s.name)
def test_a_saved_plan_is_what_a_fresh_search_finds(search):
    assert without_timing(saved(search)) == without_timing(fresh(search)), f"run `{REWRITE}`"
