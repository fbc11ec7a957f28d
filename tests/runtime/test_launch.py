"""The multi-process launcher: results in rank order, and every way a rank can fail is reported
clearly and fast, with no rank process left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from memshard.core.errors import MemshardError
from memshard.runtime.launch import is_under_torchrun, launch

ROOT = Path(__file__).resolve().parents[2]
WORKER = "tests.launch_worker"


def _env(pid_dir: Path | None = None, **knobs: object) -> dict[str, str]:
    """The worker is ``tests.launch_worker`` whatever the current directory is."""
    paths = [str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]
    env = {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    if pid_dir is not None:
        env["LAUNCH_TEST_PID_DIR"] = str(pid_dir)
    env.update({f"LAUNCH_TEST_{k.upper()}": str(v) for k, v in knobs.items()})
    return env


def _pids(pid_dir: Path, n: int, wait_s: float = 0.0) -> list[int]:
    deadline = time.monotonic() + wait_s
    while True:
        files = [pid_dir / f"rank{r}.pid" for r in range(n)]
        texts = [f.read_text() if f.exists() else "" for f in files]
        if all(texts) or time.monotonic() >= deadline:
            return [int(t) for t in texts if t]
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie whose parent (not the launcher, which reaps its ranks) has not reaped it
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _assert_all_gone(pid_dir: Path, n: int) -> None:
    pids = _pids(pid_dir, n)
    assert len(pids) == n, "every rank should have started"
    assert not [p for p in pids if _alive(p)], "rank processes survived the launcher"


@pytest.mark.parametrize("world", [2, 4])
def test_results_come_back_in_rank_order(world: int, tmp_path: Path) -> None:
    env = _env(tmp_path, grandchild=1)
    results = launch(WORKER, ["--flag", "x y"], world, timeout_s=60, env=env)
    expected = world * (world + 1) / 2 * (1 + 2 + 3)  # all-reduce sums of (rank+1)*(step+1)
    assert [r["rank"] for r in results] == list(range(world))
    assert all(r["world_size"] == world and r["sum"] == expected for r in results)
    assert all(r["args"] == ["--flag", "x y"] for r in results)
    assert not os.path.exists(results[0]["out_dir"]), "the temporary folder is removed"
    _assert_all_gone(tmp_path, world)
    grandchildren = [int((tmp_path / f"child{r}.pid").read_text()) for r in range(world)]
    deadline = time.monotonic() + 5  # SIGKILL has been sent; dying takes a moment
    while [p for p in grandchildren if _alive(p)] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in grandchildren if _alive(p)], "processes the ranks started survived"


@pytest.mark.parametrize("world, victim", [(2, 0), (4, 2)])
def test_a_killed_rank_stops_everything_fast(world: int, victim: int, tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(MemshardError) as err:
        launch(WORKER, [], world, timeout_s=60,
               env=_env(tmp_path, kill_rank=victim, kill_step=1))
    assert time.monotonic() - start < 60
    message = str(err.value)
    assert f"rank {victim} of {world} was killed by SIGKILL" in message
    _assert_all_gone(tmp_path, world)


def test_a_raising_rank_reports_its_exception(tmp_path: Path) -> None:
    with pytest.raises(MemshardError) as err:
        launch(WORKER, [], 4, timeout_s=60, env=_env(tmp_path, raise_rank=3))
    message = str(err.value)
    assert "rank 3 of 4 exited with code 1" in message
    assert "RuntimeError: launch test failure on rank 3 in step 1" in message
    _assert_all_gone(tmp_path, 4)


def test_a_rank_without_a_result_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(MemshardError, match=r"rank 1 of 2 exited 0 but wrote no result"):
        launch(WORKER, [], 2, timeout_s=60, env=_env(tmp_path, no_result_rank=1))
    _assert_all_gone(tmp_path, 2)


def test_an_unknown_module_fails_clearly() -> None:
    with pytest.raises(MemshardError, match=r"(?s)rank \d of 2 exited with code 1.*No module"):
        launch("tests.no_such_worker", [], 2, timeout_s=60, env=_env())


def test_the_overall_timeout_stops_every_rank(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(MemshardError, match=r"did not finish within the 1\.5 s timeout"):
        # the ranks ignore SIGTERM: only SIGKILL, after the grace, stops them
        launch(WORKER, [], 2, timeout_s=1.5, env=_env(tmp_path, sleep_s=120, ignore_sigterm=1))
    assert time.monotonic() - start < 10
    _assert_all_gone(tmp_path, 2)


def test_interrupting_the_launcher_stops_every_rank(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import json, signal, sys
        from memshard.runtime.launch import launch
        signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started ignoring it
        launch({WORKER!r}, [], 2, timeout_s=60, env=json.loads(sys.argv[1]))
    """)
    env = dict(os.environ, **_env())
    knobs = json.dumps(_env(tmp_path, sleep_s=120))
    launcher = subprocess.Popen([sys.executable, "-c", script, knobs],
                                env=env, stderr=subprocess.PIPE, text=True)
    try:
        assert len(_pids(tmp_path, 2, wait_s=15)) == 2, "the ranks did not start"
        launcher.send_signal(signal.SIGINT)
        _, stderr = launcher.communicate(timeout=15)
    finally:
        launcher.kill()
        launcher.wait()
    assert launcher.returncode != 0 and "KeyboardInterrupt" in stderr
    _assert_all_gone(tmp_path, 2)


def test_bad_arguments() -> None:
    with pytest.raises(MemshardError, match="at least one rank"):
        launch(WORKER, [], 0)


def test_is_under_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    assert not is_under_torchrun()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert not is_under_torchrun()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert is_under_torchrun()
