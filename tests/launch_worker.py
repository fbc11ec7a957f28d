"""A minimal rank for the launcher tests: all-reduces, with ways to fail on purpose.

Run by ``memshard.runtime.launch.launch("tests.launch_worker", args, n)``. Each rank adds
``(rank + 1) * (step + 1)`` over ``LAUNCH_TEST_STEPS`` all-reduce steps and writes
``{"rank", "world_size", "sum", "args", "out_dir"}`` to ``$MEMSHARD_OUT_DIR/rank{RANK}.json``.

The all-reduce is a sum through rank 0 over TCP at the launcher's ``MASTER_ADDR`` and
``MASTER_PORT`` (where gloo's store would listen), each socket timing out after
``MEMSHARD_COLLECTIVE_TIMEOUT_S``: a rank waits on its peers as in a gloo collective, and a
peer's death breaks its wait. No torch: the launcher is what these tests check, and a rank
starts in a fraction of a second instead of importing torch. (Ranks that run gloo under the
launcher: ``memshard run`` in tests/runtime/test_run_cli.py and test_signals.py.)

Test knobs (environment):
``LAUNCH_TEST_PID_DIR``        write ``rank{RANK}.pid`` there first thing;
``LAUNCH_TEST_SLEEP_S``        sleep this long before anything else (to test timeouts);
``LAUNCH_TEST_IGNORE_SIGTERM`` ignore SIGTERM (only SIGKILL stops the rank);
``LAUNCH_TEST_GRANDCHILD``     start a ``sleep 300`` and leave it running, its pid in
                               ``child{RANK}.pid`` in the pid folder;
``LAUNCH_TEST_KILL_RANK/STEP`` that rank SIGKILLs itself in that step while the others wait in
                               the all-reduce;
``LAUNCH_TEST_RAISE_RANK/STEP`` that rank raises ``RuntimeError`` in that step;
``LAUNCH_TEST_NO_RESULT_RANK`` that rank exits 0 without writing its result.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import traceback


def _env_int(name: str, default: int = -1) -> int:
    return int(os.environ.get(name, default))


def run(argv: list[str]) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if os.environ.get("LAUNCH_TEST_PID_DIR"):
        with open(os.path.join(os.environ["LAUNCH_TEST_PID_DIR"], f"rank{rank}.pid"), "w") as f:
            f.write(str(os.getpid()))
    if os.environ.get("LAUNCH_TEST_IGNORE_SIGTERM"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if os.environ.get("LAUNCH_TEST_PID_DIR") and os.environ.get("LAUNCH_TEST_GRANDCHILD"):
        child = subprocess.Popen(["sleep", "300"])  # left running on purpose
        with open(os.path.join(os.environ["LAUNCH_TEST_PID_DIR"], f"child{rank}.pid"), "w") as f:
            f.write(str(child.pid))
    time.sleep(float(os.environ.get("LAUNCH_TEST_SLEEP_S", "0")))

    from memshard.core.files import write_text_atomically

    peers = _connect(rank, world, float(os.environ.get("MEMSHARD_COLLECTIVE_TIMEOUT_S", "60")))
    total = 0.0
    kill = (_env_int("LAUNCH_TEST_KILL_RANK"), _env_int("LAUNCH_TEST_KILL_STEP", 1))
    fail = (_env_int("LAUNCH_TEST_RAISE_RANK"), _env_int("LAUNCH_TEST_RAISE_STEP", 1))
    for step in range(_env_int("LAUNCH_TEST_STEPS", 3)):
        value = float((rank + 1) * (step + 1))
        if (rank, step) == kill:
            time.sleep(0.3)  # let the other ranks enter the all-reduce first
            os.kill(os.getpid(), signal.SIGKILL)
        if (rank, step) == fail:
            time.sleep(0.3)
            raise RuntimeError(f"launch test failure on rank {rank} in step {step}")
        total += _all_reduce(value, rank, peers)
    for peer in peers:
        peer.close()
    if rank != _env_int("LAUNCH_TEST_NO_RESULT_RANK"):
        out_dir = os.environ["MEMSHARD_OUT_DIR"]
        result = {"rank": rank, "world_size": world, "sum": total, "args": argv, "out_dir": out_dir}
        write_text_atomically(os.path.join(out_dir, f"rank{rank}.json"), json.dumps(result))


def _connect(rank: int, world: int, timeout_s: float) -> list:
    """Rank 0: every other rank's connection (in rank order); another rank: its connection to
    rank 0. Each reads and writes lines, and times out after ``timeout_s``."""
    address = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    if rank == 0:
        with socket.create_server(address) as server:
            server.settimeout(timeout_s)
            by_rank = {}
            for _ in range(world - 1):
                connection, _ = server.accept()
                connection.settimeout(timeout_s)
                peer = connection.makefile("rw")
                by_rank[int(_read(peer))] = peer
        return [by_rank[r] for r in sorted(by_rank)]
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            connection = socket.create_connection(address, timeout=timeout_s)
            break
        except OSError:  # rank 0 not listening yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    peer = connection.makefile("rw")
    _write(peer, rank)
    return [peer]


def _read(peer) -> str:
    line = peer.readline()
    if not line:
        raise ConnectionError("a peer closed its connection in the all-reduce")
    return line


def _write(peer, value) -> None:
    peer.write(f"{value!r}\n")
    peer.flush()


def _all_reduce(value: float, rank: int, peers: list) -> float:
    """The sum of every rank's ``value``, on every rank (rank 0 adds them and sends it back)."""
    if rank != 0:
        _write(peers[0], value)
        return float(_read(peers[0]))
    total = value + sum(float(_read(peer)) for peer in peers)
    for peer in peers:
        _write(peer, total)
    return total


def main() -> None:
    try:
        run(sys.argv[1:])
    except BaseException:
        # Exit at once: the peers, waiting in a collective, then fail only after this rank is
        # gone, and no process-group teardown at interpreter exit can hang.
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    main()
