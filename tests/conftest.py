"""One marker per folder, the kind of test it holds: ``unit`` (records, parsers, pricing and
the code's shape; no real-model search: ``make test-fast``), ``planner`` (searches, the CLI and
the inverse queries), ``baselines`` (the hand-made strategies, their export, PyTorch's own
FSDP2 and DDP measured against them), ``runtime`` (plans run with PyTorch: gloo ranks, the
fake process group, MemTracker), ``trace`` (modules traced with torch.export and
transformers) and ``docs`` (the README's examples, run as written)."""

from __future__ import annotations

from pathlib import Path

import pytest

KINDS = ("unit", "planner", "baselines", "runtime", "trace", "docs")
TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        kind = Path(item.fspath).resolve().relative_to(TESTS).parts[0]
        assert kind in KINDS, f"{item.nodeid}: a test sits in one of the folders {KINDS}"
        item.add_marker(getattr(pytest.mark, kind))
