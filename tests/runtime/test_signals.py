"""`memshard run` ended by SIGINT, SIGTERM, SIGHUP or SIGKILL: no rank survives it (checked by
PID) and no ``memshard-run-*`` / ``memshard-launch-*`` folder is left in its TMPDIR (after a
SIGKILL, once the next launch has swept it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memshard.core.errors import MemshardError
from memshard.runtime.launch import (
    LAUNCHER_PID_ENV,
    launch,
    private_tempdir,
    rank_command,
    remove_abandoned_tempdirs,
)

ROOT = Path(__file__).resolve().parents[2]
# memshard's entry point, with the signals at their defaults even if pytest was started
# ignoring some (a background job ignores SIGINT, nohup SIGHUP): those stay ignored otherwise.
ENTRY = ("import signal, sys\n"
         "for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP): signal.signal(s, signal.SIG_DFL)\n"
         "from memshard.cli import main\n"
         "sys.exit(main())\n")
RUN = ["run", "--model", "tiny-gpt", "--mesh", "2", "--steps", "100000", "--timeout", "120"]


def _env(tmp: Path) -> dict[str, str]:
    paths = [str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, TMPDIR=str(tmp), OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join(p for p in paths if p))


def _stat(pid: int) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name: state, ppid, …; [] if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _alive(pid: int) -> bool:
    fields = _stat(pid)
    return bool(fields) and fields[0] not in ("Z", "X")  # a zombie is dead, just not reaped


def _children(pid: int) -> list[int]:
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    return [p for p in pids if (fields := _stat(p)) and fields[1] == str(pid)]


def _sockets(pid: int) -> int:
    try:
        return sum(os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:") for fd in os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def _ranks_at_work(launcher: subprocess.Popen, n: int, wait_s: float = 90) -> list[int]:
    """The launcher's ``n`` rank processes, once each has joined the process group (holds
    sockets: the rendezvous store and gloo's connections)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and launcher.poll() is None:
        ranks = _children(launcher.pid)
        if len(ranks) == n and all(_sockets(p) for p in ranks):
            return ranks
        time.sleep(0.05)
    pytest.fail(f"the {n} ranks did not start (launcher exit code {launcher.poll()})")


def _ours(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith(("memshard-run-", "memshard-launch-")))


def _wait_gone(pids: list[int], wait_s: float) -> list[int]:
    deadline = time.monotonic() + wait_s
    while [p for p in pids if _alive(p)] and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; the parent-death signal is Linux's")
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGKILL],
                         ids=lambda s: s.name)
def test_a_signalled_run_leaves_no_rank_and_no_folder(sig: signal.Signals, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    launcher = subprocess.Popen([sys.executable, "-c", ENTRY, *RUN], env=_env(tmp_path),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ranks: list[int] = []
    try:
        ranks = _ranks_at_work(launcher, 2)
        assert len(_ours(tmp_path)) == 2, "a run folder and a launch folder while it runs"
        start = time.monotonic()
        launcher.send_signal(sig)
        _, stderr = launcher.communicate(timeout=30)
        left = _wait_gone(ranks, 5.0)
        elapsed = time.monotonic() - start
    finally:
        for pid in [launcher.pid, *ranks]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        launcher.wait()
    assert not left, f"ranks {left} outlived the launcher ({sig.name})"
    assert elapsed < 10, elapsed
    if sig == signal.SIGKILL:  # nothing could clean up: the next launch does
        assert launcher.returncode == -signal.SIGKILL
        assert len(_ours(tmp_path)) == 2
        monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
        with pytest.raises(MemshardError, match="No module"):  # a launch that fails at once
            launch("tests.no_such_worker", [], 1, timeout_s=60, env=_env(tmp_path))
    else:
        assert launcher.returncode == 128 + sig
        expected = "memshard: interrupted" + ("" if sig == signal.SIGINT else f" by {sig.name}")
        assert stderr.strip().splitlines() == [expected], stderr
    assert _ours(tmp_path) == []


def test_only_folders_whose_owner_died_are_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = ("import time\n"
              "from memshard.runtime.launch import private_tempdir\n"
              "with private_tempdir('memshard-run-') as a, private_tempdir('memshard-launch-') as b:\n"
              "    print(a, b, flush=True)\n"
              "    time.sleep(120)\n")
    owner = subprocess.Popen([sys.executable, "-c", script], env=_env(tmp_path), stdout=subprocess.PIPE,
                             text=True)
    try:
        folders = sorted(owner.stdout.readline().split())
        assert len(folders) == 2 and all(os.path.isdir(f) for f in folders)
        assert remove_abandoned_tempdirs(str(tmp_path)) == [], "their owner is alive"
    finally:
        owner.kill()
        owner.wait()
        owner.stdout.close()
    (tmp_path / "memshard-not-private").mkdir()  # no .owner: not made by private_tempdir
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    with private_tempdir("memshard-run-") as live:  # this process's own, in use
        assert remove_abandoned_tempdirs() == folders
        assert os.path.isdir(live)
    assert [p.name for p in tmp_path.iterdir()] == ["memshard-not-private"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death check")
def test_a_rank_whose_launcher_is_already_gone_does_not_run(tmp_path: Path) -> None:
    """As when the launcher died before the rank could set its parent-death signal: the rank's
    parent is not the launcher it was started by."""
    env = dict(_env(tmp_path), RANK="0", WORLD_SIZE="1", LAUNCH_TEST_PID_DIR=str(tmp_path),
               **{LAUNCHER_PID_ENV: "1"})
    r = subprocess.run(rank_command("tests.launch_worker", []), env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and r.stderr == ""
    assert not (tmp_path / "rank0.pid").exists(), "the module did not run"


def test_signals_during_the_clean_up_do_not_cut_it_short(tmp_path: Path) -> None:
    """Ranks that ignore SIGTERM keep the launcher in its grace period; more signals then (an
    impatient Ctrl-C, ``timeout``'s second SIGTERM) wait for the clean-up to finish."""
    script = ("import json, sys\n"
              "from memshard.runtime.launch import interrupt_on_signals, launch\n"
              "with interrupt_on_signals():\n"
              "    launch('tests.launch_worker', [], 2, timeout_s=60, env=json.loads(sys.argv[1]))\n")
    knobs = {"PYTHONPATH": _env(tmp_path)["PYTHONPATH"], "LAUNCH_TEST_PID_DIR": str(tmp_path / "pids"),
             "LAUNCH_TEST_SLEEP_S": "120", "LAUNCH_TEST_IGNORE_SIGTERM": "1"}
    (tmp_path / "pids").mkdir()
    launcher = subprocess.Popen([sys.executable, "-c", "import signal\n"
                                 "for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP): signal.signal(s, signal.SIG_DFL)\n"
                                 + script, json.dumps(knobs)],
                                env=_env(tmp_path), stderr=subprocess.PIPE, text=True)
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 30
        while len(ranks) < 2 and time.monotonic() < deadline:
            ranks = [int(p.read_text()) for p in (tmp_path / "pids").glob("rank*.pid") if p.read_text()]
            time.sleep(0.05)
        assert len(ranks) == 2, "the ranks did not start"
        time.sleep(0.2)  # the ranks ignore SIGTERM from now on
        launcher.send_signal(signal.SIGTERM)
        start = time.monotonic()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            time.sleep(0.3)  # within the 2 s grace
            launcher.send_signal(sig)
        _, stderr = launcher.communicate(timeout=30)
        elapsed = time.monotonic() - start
    finally:
        for pid in [launcher.pid, *ranks]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        launcher.wait()
    assert launcher.returncode == 1, stderr
    assert stderr.strip().splitlines()[-1] == "memshard.runtime.launch.Interrupted: SIGTERM", stderr
    assert "SIGINT" not in stderr and "SIGHUP" not in stderr, "the later signals were dropped"
    assert elapsed > 1.9, "the launcher waited out the grace before SIGKILL"
    assert not [p for p in ranks if _alive(p)], "the clean-up was cut short"
    assert _ours(tmp_path) == []
