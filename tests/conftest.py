"""Markers by kind of test: ``runtime`` (plans run with PyTorch: gloo ranks, the fake process
group, MemTracker), ``trace`` (modules traced with torch.export and transformers) and
``readme`` (the README's examples, run as written); the rest test the planner alone
(``make test-fast``: ``-m "not runtime and not trace and not readme"``)."""

from __future__ import annotations

import pytest

RUNTIME = {"test_runtime", "test_traced_runtime", "test_simulate", "test_run_cli", "test_launch", "test_signals",
           "test_measure", "test_measure_frees", "test_reshard_memory"}
TRACE = {"test_trace"}
README = {"test_readme"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1]
        if module in RUNTIME:
            item.add_marker(pytest.mark.runtime)
        elif module in TRACE:
            item.add_marker(pytest.mark.trace)
        elif module in README:
            item.add_marker(pytest.mark.readme)
