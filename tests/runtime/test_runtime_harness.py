"""The multi-rank harness retries a world once when a rank dies of a signal, and only then:
a Python error in a rank fails at once, and a rank that crashes twice fails the run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from tests.runtime_harness import forked_world


def _abort_once(rank: int, world: int, port: int, out_dir: str) -> None:
    marker = Path(out_dir) / "crashed"
    if rank == 1 and not marker.exists():
        marker.touch()
        os.abort()
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps({"rank": rank}))


def _abort_always(rank: int, world: int, port: int, out_dir: str) -> None:
    if rank == 1:
        os.abort()
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps({"rank": rank}))


def _python_error(rank: int, world: int, port: int, out_dir: str) -> None:
    marker = Path(out_dir) / f"tried{rank}"
    if marker.exists():
        raise AssertionError("a Python error was retried")
    marker.touch()
    raise ValueError("a rank's own error")


def test_a_world_whose_rank_crashed_once_runs_again(tmp_path):
    with pytest.warns(RuntimeWarning, match="SIGABRT"):
        reports = forked_world(_abort_once, 2, tmp_path)
    assert reports == [{"rank": 0}, {"rank": 1}]


def test_a_rank_crashing_twice_fails(tmp_path):
    with pytest.warns(RuntimeWarning), pytest.raises(mp.ProcessExitedException):
        forked_world(_abort_always, 2, tmp_path)


def test_a_python_error_is_not_retried(tmp_path):
    with pytest.raises(mp.ProcessRaisedException, match="a rank's own error"):
        forked_world(_python_error, 2, tmp_path)
