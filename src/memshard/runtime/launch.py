"""Starting the ranks of a job on this machine, torchrun-style, and collecting their results.

This module owns the process side of a run: one ``python -m <module> <args…>`` process per
rank (behind a few lines that tie it to the launcher, see :func:`rank_command`), the rendezvous
environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``), a private output folder (``MEMSHARD_OUT_DIR``) into which each rank writes
``rank{RANK}.json``, and tearing every rank down as soon as one fails, times out or the
launcher is interrupted. It knows nothing of what the ranks compute.

No rank outlives its launcher, however the launcher ends:

* **An exception** (a failed rank, the timeout, Ctrl-C): ``launch`` stops every rank (SIGTERM
  to its process group, SIGKILL after a grace) and removes its folder before it returns.
* **SIGINT, SIGTERM, SIGHUP**: inside :func:`interrupt_on_signals` (``memshard``'s ``main``
  runs every command in it) each of them raises :class:`Interrupted`, a ``KeyboardInterrupt``
  carrying the signal, so the same clean-up runs; a signal that arrives while a clean-up is
  under way is held until it is done. Signals ignored on entry (``nohup``) stay ignored.
* **Death without clean-up** (SIGKILL, a crash): every rank starts by setting the Linux
  parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGKILL)``), so the kernel kills it when the
  launcher dies; a rank whose launcher died before that (its parent is no longer the PID in
  ``MEMSHARD_LAUNCHER_PID``) exits at once. (The kernel sends it when the *thread* that
  started the rank ends: ``launch`` blocks that thread until its ranks are gone.) Elsewhere
  than Linux this step does nothing. Processes that a rank started itself are not covered.

Temporary folders: :func:`private_tempdir` makes ``$TMPDIR/memshard-…`` folders (``launch``'s
``memshard-launch-*``, ``memshard run``'s ``memshard-run-*``), removed on every exit path
above. Each holds a file ``.owner`` with the owner's PID, on which the owner holds an
exclusive ``flock`` for as long as it lives; the kernel drops the lock when the owner dies,
however it dies. :func:`remove_abandoned_tempdirs`, called by every ``launch``, removes the
``memshard-*`` folders whose lock it can take: those of SIGKILLed launchers. A folder whose
file system has no locks is never taken for abandoned.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from memshard.core.errors import MemshardError

OUT_DIR_ENV = "MEMSHARD_OUT_DIR"
#: Seconds a worker should give a collective before giving up (its process-group timeout);
#: the launcher sets it from ``fail_fast_s``.
COLLECTIVE_TIMEOUT_ENV = "MEMSHARD_COLLECTIVE_TIMEOUT_S"
#: The launcher's PID, as each rank should see it as its parent (see :func:`rank_command`).
LAUNCHER_PID_ENV = "MEMSHARD_LAUNCHER_PID"
#: "rank:step": that rank kills itself (SIGKILL) in the middle of that step (the fault tests;
#: :func:`die_if_asked`).
KILL_ENV = "MEMSHARD_TEST_KILL"
#: The file in a :func:`private_tempdir` folder that names and locks its owner.
OWNER_FILE = ".owner"
TEMPDIR_PREFIX = "memshard-"

_GRACE_S = 2.0  # between SIGTERM and SIGKILL
_TAIL_LINES = 20
_TAIL_CHARS = 4000
# What each rank runs first (then its module, as ``python -m`` would): the parent-death
# signal, and the check that the launcher did not die before it was set.
_RANK_BOOTSTRAP = f"""\
import os, runpy, sys
if sys.platform.startswith("linux"):
    try:
        import ctypes
        ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        pass
if str(os.getppid()) != os.environ.get("{LAUNCHER_PID_ENV}", str(os.getppid())):
    os._exit(1)  # the launcher is gone already
runpy.run_module(sys.argv.pop(1), run_name="__main__", alter_sys=True)
"""


def is_under_torchrun() -> bool:
    """Whether this process is one rank of a launched job (by torchrun or ``launch``)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def die_if_asked(rank: int, step: int) -> None:
    """Kill this process (SIGKILL, no clean-up) if ``KILL_ENV`` names this rank and step: a
    rank that dies mid-step, for the tests of what its peers and the launcher then do."""
    spec = os.environ.get(KILL_ENV)
    if spec:
        victim, at = (int(x) for x in spec.split(":"))
        if rank == victim and step == at:
            os.kill(os.getpid(), signal.SIGKILL)


def rank_command(module: str, args: Sequence[str]) -> list[str]:
    """The command line of one rank: ``python -m module args…`` behind the parent-death set-up
    (which expects ``MEMSHARD_LAUNCHER_PID`` to be this process's PID, as ``launch`` sets it)."""
    return [sys.executable, "-c", _RANK_BOOTSTRAP, module, *args]


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
    exceeds ``timeout_s``. No rank process outlives the call, whatever happens, nor the
    launcher if it is killed (see the module's notes); first, the folders of killed launchers
    are removed (:func:`remove_abandoned_tempdirs`).
    """
    if nprocs < 1:
        raise MemshardError(f"need at least one rank, got {nprocs}")
    if timeout_s <= 0 or fail_fast_s <= 0:
        raise MemshardError("timeout_s and fail_fast_s must be positive")
    remove_abandoned_tempdirs()
    with private_tempdir("memshard-launch-") as workdir:
        job = _Job(module, nprocs, workdir)
        try:
            base = _base_env(env, job.workdir, nprocs, fail_fast_s)
            for rank in range(nprocs):
                rank_env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank))
                job.start(rank_command(module, args), rank_env)
            job.wait(timeout_s)
            results = [job.result(rank) for rank in range(nprocs)]
        except BaseException as e:
            with _held_signals(e):
                job.stop()
            raise
        with _held_signals():
            job.stop()
        return results


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
        LAUNCHER_PID_ENV: str(os.getpid()),
    })
    return env


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- signals ------------------------------------------------------------------------------------
class Interrupted(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP arrived inside :func:`interrupt_on_signals`; ``signum`` says
    which. A ``KeyboardInterrupt``, so whatever cleans up after Ctrl-C cleans up after it."""

    def __init__(self, signum: int) -> None:
        super().__init__(_signal_name(signum))
        self.signum = signum


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class _SignalState:
    """Clean-ups under way (``_held_signals`` depth) and the signal that arrived during them."""

    depth = 0
    pending: int | None = None


_SIGNALS = _SignalState()


def _on_signal(signum: int, frame: object) -> None:
    if _SIGNALS.depth:
        _SIGNALS.pending = _SIGNALS.pending or signum  # raised once the clean-up is done
        return
    raise Interrupted(signum)


@contextlib.contextmanager
def interrupt_on_signals() -> Iterator[None]:
    """While the block runs (in the main thread), SIGINT, SIGTERM and SIGHUP raise
    :class:`Interrupted` instead of killing the process, so that ``finally`` blocks, and with
    them ``launch``'s clean-up, run; the previous handlers come back after it. A signal ignored
    on entry stays ignored. Does nothing in another thread (handlers belong to the main one)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    names = ("SIGINT", "SIGTERM", "SIGHUP")
    previous = {getattr(signal, n): signal.getsignal(getattr(signal, n)) for n in names
                if hasattr(signal, n)}
    for s, old in previous.items():
        if old is not signal.SIG_IGN:
            signal.signal(s, _on_signal)
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, signal.SIG_DFL if old is None else old)


@contextlib.contextmanager
def _held_signals(unwinding: BaseException | None = None) -> Iterator[None]:
    """A clean-up that a signal must not cut short: one that arrives meanwhile is raised once it
    is done, unless what the clean-up is for (``unwinding``) is an interrupt already."""
    _SIGNALS.depth += 1
    try:
        yield
    finally:
        _SIGNALS.depth -= 1
        pending = None
        if not _SIGNALS.depth:
            pending, _SIGNALS.pending = _SIGNALS.pending, None
    if pending is not None and not isinstance(unwinding, KeyboardInterrupt):
        raise Interrupted(pending)


# -- temporary folders --------------------------------------------------------------------------
@contextlib.contextmanager
def private_tempdir(prefix: str) -> Iterator[str]:
    """A new folder ``$TMPDIR/<prefix>XXXXXXXX`` (``prefix`` starts with ``memshard-``) for the
    block, removed after it; it holds ``.owner``, locked by this process while the folder is in
    use, so that :func:`remove_abandoned_tempdirs` can tell when its owner was killed."""
    if not prefix.startswith(TEMPDIR_PREFIX):
        raise ValueError(f"a private folder's prefix starts with {TEMPDIR_PREFIX!r}")
    path = tempfile.mkdtemp(prefix=prefix)
    lock = -1
    try:
        lock = _take_ownership(path)
        yield path
    except BaseException as e:
        _remove_owned(path, lock, e)
        raise
    _remove_owned(path, lock)


def _remove_owned(path: str, lock: int, unwinding: BaseException | None = None) -> None:
    with _held_signals(unwinding):
        shutil.rmtree(path, ignore_errors=True)
        if lock >= 0:
            os.close(lock)


def _take_ownership(path: str) -> int:
    """Create ``path/.owner``, lock it (blocking: a sweeper may hold it a moment) and write our
    PID in it; an empty ``.owner`` (no locks on this file system) marks a folder as never
    abandoned. Returns the descriptor that holds the lock (not inherited by the ranks)."""
    import fcntl

    fd = os.open(os.path.join(path, OWNER_FILE), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        return fd
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def remove_abandoned_tempdirs(parent: str | None = None) -> list[str]:
    """Remove the :func:`private_tempdir` folders in ``parent`` (default: the temporary
    directory) whose owner is dead: those of a launcher killed by SIGKILL. Returns their paths.
    Folders of live owners, of other users, and anything else are left alone."""
    parent = parent or tempfile.gettempdir()
    try:
        names = sorted(n for n in os.listdir(parent) if n.startswith(TEMPDIR_PREFIX))
    except OSError:
        return []
    return [path for path in (os.path.join(parent, n) for n in names) if _remove_if_abandoned(path)]


def _remove_if_abandoned(path: str) -> bool:
    import fcntl

    try:
        info = os.lstat(path)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            return False
        fd = os.open(os.path.join(path, OWNER_FILE), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fails while the owner lives
        if not os.read(fd, 64):  # its owner is just creating it, or has no locks
            return False
        shutil.rmtree(path, ignore_errors=True)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


class _Job:
    """The rank processes of one launch, their logs and results in ``workdir``, and their exits
    as ``(time, rank)`` events, each timed by a thread waiting on that rank alone."""

    def __init__(self, module: str, nprocs: int, workdir: str) -> None:
        self.module, self.nprocs, self.workdir = module, nprocs, workdir
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
                with _held_signals():
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
