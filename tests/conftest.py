"""One marker per folder, the kind of test it holds: ``unit`` (records, parsers, pricing and
the code's shape; no real-model search: ``make test-fast``), ``planner`` (searches, the CLI and
the inverse queries), ``baselines`` (the hand-made strategies, their export, PyTorch's own
FSDP2 and DDP measured against them), ``runtime`` (plans run with PyTorch: gloo ranks, the
fake process group, MemTracker), ``trace`` (modules traced with torch.export and
transformers) and ``docs`` (the README's examples, run as written).

How ``make test`` (``--dist loadgroup``) spreads the tests over its workers: a test file is
one unit, run on one worker (its module's cached searches and forked worlds made once),
except the files in ``SPLIT``, whose tests go one by one to whichever worker is free, but
for those listed in ``TOGETHER`` (they read the same cached state). Units are handed out in
``HEAVIEST_FIRST``'s order, then the others in collection order, so the workers end together.
(xdist's own ``loadgroup`` renames a test to group it, which pytest 9 ignores: a test's id
is its path. ``GroupScheduling`` groups by the id as it is.)"""

from __future__ import annotations

from pathlib import Path

import pytest

import memshard

KINDS = ("unit", "planner", "baselines", "runtime", "trace", "docs")
TESTS = Path(__file__).resolve().parent

# Files whose tests are independent: each its own unit, but for those in TOGETHER.
SPLIT = frozenset({"docs/test_readme.py", "planner/test_fit.py", "planner/test_time_search.py"})
TOGETHER = {  # test (file::function) → the unit it shares with the others that read the same state
    "docs/test_readme.py::test_the_readme_api_block_runs": "searched once",  # (the searched_once fixture)
    "docs/test_readme.py::test_the_guide_api_blocks_run": "searched once",
    "planner/test_time_search.py::test_the_fastest_plan_over_both_views_is_proved": "searched once",  # (the README's)
    "planner/test_fit.py::test_the_largest_batch_is_the_last_one_a_full_scan_fits": "largest batch in 4 MiB",
    "planner/test_fit.py::test_the_cli_writes_the_answers_and_the_plot": "largest batch in 4 MiB",
    "planner/test_fit.py::test_a_step_time_budget_bounds_every_answer": "largest batch in 5 MiB",
    "planner/test_fit.py::test_a_slowdown_bound_is_against_memshards_fastest_plan_at_each_value": "largest batch in 5 MiB",
}
# The costliest files, most first (from `pytest --durations=0`); the rest follow in collection order.
HEAVIEST_FIRST = (
    "docs/test_readme.py", "planner/test_fit.py", "runtime/test_training_loop.py", "runtime/test_simulate.py",
    "baselines/test_baselines.py", "runtime/test_runtime.py", "baselines/test_conformance.py", "planner/test_cli.py",
    "planner/test_recompute.py", "runtime/test_traced_runtime.py", "planner/test_highs_search.py",
    "planner/test_planner.py", "baselines/test_export.py", "trace/test_trace.py", "planner/test_pipelined.py",
    "planner/test_solver_bruteforce.py", "planner/test_pipeline_stage_search.py", "planner/test_job.py",
    "trace/test_autocast.py", "baselines/test_layer_split.py",
)  # (test_cli: its determinism test alone is two searches in two processes; test_solver_bruteforce and
# test_pipeline_stage_search: one long test each, which, collected late, would end one worker's run alone)


def unit_of(nodeid: str) -> str:
    """The unit of work the test ``nodeid`` (``tests/<file>::<test>[<parameters>]``) runs in."""
    if nodeid.rfind("@") > nodeid.rfind("]"):  # (an xdist_group, where xdist could name it)
        return nodeid.rsplit("@", 1)[1]
    path, _, test = nodeid.partition("::")
    path = path.removeprefix("tests/")
    if path not in SPLIT:
        return path
    return TOGETHER.get(f"{path}::{test.split('[')[0]}", nodeid)


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup``: the units of ``unit_of``, in the order collected (``HEAVIEST_FIRST``'s)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    config.option.loadscopereorder = False  # (else the units with the most tests go first)
    return GroupScheduling(config, log)


def relative(item: pytest.Item) -> str:
    return Path(item.fspath).resolve().relative_to(TESTS).as_posix()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {path: k for k, path in enumerate(HEAVIEST_FIRST)}
    for item in items:
        path = relative(item)
        kind = path.split("/")[0]
        assert kind in KINDS, f"{item.nodeid}: a test sits in one of the folders {KINDS}"
        item.add_marker(getattr(pytest.mark, kind))
        if "searched_once" in getattr(item, "fixturenames", ()) and path in SPLIT:
            assert unit_of(item.nodeid) == "searched once", f"{item.nodeid}: list it in TOGETHER"
    items.sort(key=lambda item: rank.get(relative(item), len(rank)))  # (stable: each file's order kept)


SEARCHED: dict[str, object] = {}  # a call to memshard.plan or memshard.compare → its result, in this process


def searched_once_each(name: str, search):
    """``search`` (``memshard.<name>``), each distinct call searched once: later ones read
    ``SEARCHED``."""
    def once(*args, **kwargs):
        key = repr((name, args, sorted(kwargs.items())))
        if key not in SEARCHED:
            SEARCHED[key] = search(*args, **kwargs)
        return SEARCHED[key]
    return once


@pytest.fixture
def searched_once(monkeypatch) -> None:
    """``memshard.plan`` and ``memshard.compare`` search each distinct call once in this worker:
    the README's API block and the guide's make some of the same calls and only read what they
    return (the search is deterministic). Its users share one unit (``TOGETHER``)."""
    for name in ("plan", "compare"):
        monkeypatch.setattr(memshard, name, searched_once_each(name, getattr(memshard, name)))
