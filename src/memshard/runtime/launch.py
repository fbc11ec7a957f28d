"""Starting the ranks of a job on this machine, torchrun-style, and collecting their results.

This module owns the process side of a run: one ``python -m <module> <args…>`` process per
rank, the rendezvous environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), a private output folder
(``MEMSHARD_OUT_DIR``) into which each rank writes ``rank{RANK}.json``, and tearing every rank
down as soon as one fails, times out or the launcher is interrupted. It knows nothing of what
the ranks compute.
"""

from __future__ import annotations

import json
import math
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

from memshard.errors import MemshardError

OUT_DIR_ENV = "MEMSHARD_OUT_DIR"
#: Seconds a worker should give a collective before giving up (its process-group timeout);
#: the launcher sets it from ``fail_fast_s``.
COLLECTIVE_TIMEOUT_ENV = "MEMSHARD_COLLECTIVE_TIMEOUT_S"

_GRACE_S = 2.0  # between SIGTERM and SIGKILL
_TAIL_LINES = 20
_TAIL_CHARS = 4000


def is_under_torchrun() -> bool:
    """Whether this process is one rank of a launched job (by torchrun or ``launch``)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def launch(
    module: str,
    args: Sequence[str],
    nprocs: int,
    *,
    timeout_s: float = 600.0,
    env: dict[str, str] | None = None,
    fail_fast_s: float = 60.0,
) -> list[dict[str, Any]]:
    """Start ``nprocs`` ranks of ``python -m module args…`` on this machine, wait, and return the
    per-rank result dicts in rank order.

    ``env`` is added to this process's environment for every rank. ``fail_fast_s`` is passed to
    the ranks as ``MEMSHARD_COLLECTIVE_TIMEOUT_S`` for their process-group timeout, so a rank
    stuck in a collective gives up on its own; the launcher itself stops all ranks as soon as
    one of them fails. Raises ``MemshardError`` with one message naming the rank, its exit code
    or signal and the end of its stderr if any rank fails, writes no result, or the whole run
    exceeds ``timeout_s``. No rank process outlives the call, whatever happens.
    """
    if nprocs < 1:
        raise MemshardError(f"need at least one rank, got {nprocs}")
    if timeout_s <= 0 or fail_fast_s <= 0:
        raise MemshardError("timeout_s and fail_fast_s must be positive")
    job = _Job(module, nprocs)
    try:
        base = _base_env(env, job.workdir, nprocs, fail_fast_s)
        for rank in range(nprocs):
            rank_env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank))
            job.start([sys.executable, "-m", module, *args], rank_env)
        job.wait(timeout_s)
        return [job.result(rank) for rank in range(nprocs)]
    finally:
        job.stop()
        shutil.rmtree(job.workdir, ignore_errors=True)


def _base_env(extra: dict[str, str] | None, workdir: str, nprocs: int,
              fail_fast_s: float) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra or {})
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update({
        "WORLD_SIZE": str(nprocs),
        "LOCAL_WORLD_SIZE": str(nprocs),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        OUT_DIR_ENV: workdir,
        COLLECTIVE_TIMEOUT_ENV: f"{fail_fast_s:g}",
    })
    return env


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Job:
    """The rank processes of one launch, their logs and results in ``workdir``, and their exits
    as ``(time, rank)`` events, each timed by a thread waiting on that rank alone."""

    def __init__(self, module: str, nprocs: int) -> None:
        self.module, self.nprocs = module, nprocs
        self.workdir = tempfile.mkdtemp(prefix="memshard-launch-")
        self.procs: list[subprocess.Popen[bytes]] = []
        self.watchers: list[threading.Thread] = []
        self.exits: queue.Queue[tuple[float, int]] = queue.Queue()
        self.exited: list[tuple[float, int]] = []
        self.termed_at = self.killed_at = math.inf  # when stop() sent SIGTERM, SIGKILL

    def start(self, command: list[str], env: dict[str, str]) -> None:
        rank = len(self.procs)
        with open(self._log(rank, "stdout"), "wb") as out, \
                open(self._log(rank, "stderr"), "wb") as err:
            self.procs.append(subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL,
                                               stdout=out, stderr=err, start_new_session=True))
        self.watchers.append(threading.Thread(target=self._watch, args=(rank,), daemon=True))
        self.watchers[-1].start()

    def _watch(self, rank: int) -> None:
        self.procs[rank].wait()
        self.exits.put((time.monotonic(), rank))

    def _collect(self, timeout: float) -> None:
        """Wait up to ``timeout`` for exits; record all that came."""
        try:
            self.exited.append(self.exits.get(timeout=max(timeout, 0.0)))
            while True:
                self.exited.append(self.exits.get_nowait())
        except queue.Empty:
            pass

    def wait(self, timeout_s: float) -> None:
        """Return once every rank has exited 0; raise at the first failure or at the deadline.
        A poll loop, so a failure, the deadline and Ctrl-C are all noticed within 0.1 s."""
        deadline = time.monotonic() + timeout_s
        while len(self.exited) < self.nprocs:
            if time.monotonic() >= deadline:
                raise MemshardError(f"{self.module}: the {self.nprocs} ranks did not finish within "
                                    f"the {timeout_s:g} s timeout; all ranks were stopped")
            self._collect(min(deadline - time.monotonic(), 0.1))
            if any(self.procs[r].returncode != 0 for _, r in self.exited):
                self.stop()
                raise MemshardError(self._failure())

    def stop(self) -> None:
        """Stop every rank and whatever it started: SIGTERM to each process group, SIGKILL after
        a grace, and reap them all. Does nothing more once done."""
        if self.killed_at < math.inf:
            return
        self.termed_at = time.monotonic()
        self._signal(signal.SIGTERM, self._running())
        deadline = self.termed_at + _GRACE_S
        while self._running() and time.monotonic() < deadline:
            self._collect(deadline - time.monotonic())
        self.killed_at = time.monotonic()
        self._signal(signal.SIGKILL, range(len(self.procs)))  # also leftovers of exited ranks
        deadline = time.monotonic() + 10  # a process stuck in the kernel may outlive SIGKILL
        for w in self.watchers:
            w.join(timeout=max(deadline - time.monotonic(), 0.0))
        self._collect(0.0)

    def _running(self) -> list[int]:
        done = {r for _, r in self.exited}
        return [r for r in range(len(self.procs)) if r not in done]

    def _signal(self, sig: signal.Signals, ranks: Iterable[int]) -> None:
        for r in ranks:
            try:
                os.killpg(self.procs[r].pid, sig)  # start_new_session: group id = the rank's pid
            except (ProcessLookupError, PermissionError):
                pass

    def _failure(self) -> str:
        """The message for the rank that failed first of its own accord. The others fail a
        moment after it (their collective breaks), but exits are seen in an order that a loaded
        machine can swap; what a rank wrote last to stderr (its traceback, or nothing once
        killed) is not, so the earliest such write decides, then the order the exits were seen."""

        def by_us(t: float, r: int) -> bool:
            code = self.procs[r].returncode
            return (code == -signal.SIGTERM and t >= self.termed_at) or \
                (code == -signal.SIGKILL and t >= self.killed_at)

        failed = [(t, r) for t, r in self.exited
                  if self.procs[r].returncode != 0 and not by_us(t, r)]
        _, rank = min(failed, key=lambda e: (_mtime_ns(self._log(e[1], "stderr")), e[0]))
        code = self.procs[rank].returncode or 0
        if code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        else:
            how = f"exited with code {code}"
        others = " and the other ranks were stopped" if self.nprocs > 1 else ""
        tail = _tail(self._log(rank, "stderr"))
        said = f"; the end of its stderr:\n{tail}" if tail else "; its stderr was empty"
        return f"{self.module}: rank {rank} of {self.nprocs} {how}{others}{said}"

    def result(self, rank: int) -> dict[str, Any]:
        path = os.path.join(self.workdir, f"rank{rank}.json")
        where = f"{self.module}: rank {rank} of {self.nprocs}"
        try:
            with open(path) as f:
                result = json.load(f)
        except FileNotFoundError:
            raise MemshardError(f"{where} exited 0 but wrote no result "
                                f"($MEMSHARD_OUT_DIR/rank{rank}.json)") from None
        except (OSError, ValueError) as e:
            raise MemshardError(f"{where} wrote an unreadable result: {e}") from None
        if not isinstance(result, dict):
            raise MemshardError(f"{where} wrote a result that is not a JSON object")
        return result

    def _log(self, rank: int, stream: str) -> str:
        return os.path.join(self.workdir, f"rank{rank}.{stream}")


def _mtime_ns(path: str) -> int:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return 0


def _tail(path: str) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    lines = text.rstrip().splitlines()[-_TAIL_LINES:]
    return "\n".join("  " + line for line in lines)[-_TAIL_CHARS:]
