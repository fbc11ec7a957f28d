"""A minimal rank for the launcher tests: gloo all-reduces, with ways to fail on purpose.

Run by ``memshard.runtime.launch.launch("tests.launch_worker", args, n)``. Each rank adds
``(rank + 1) * (step + 1)`` over ``LAUNCH_TEST_STEPS`` all-reduce steps and writes
``{"rank", "world_size", "sum", "args", "out_dir"}`` to ``$MEMSHARD_OUT_DIR/rank{RANK}.json``.

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

    import datetime

    import torch
    import torch.distributed as dist

    from memshard.core.files import write_text_atomically

    seconds = float(os.environ.get("MEMSHARD_COLLECTIVE_TIMEOUT_S", "60"))
    timeout = datetime.timedelta(seconds=seconds)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    total = 0.0
    kill = (_env_int("LAUNCH_TEST_KILL_RANK"), _env_int("LAUNCH_TEST_KILL_STEP", 1))
    fail = (_env_int("LAUNCH_TEST_RAISE_RANK"), _env_int("LAUNCH_TEST_RAISE_STEP", 1))
    for step in range(_env_int("LAUNCH_TEST_STEPS", 3)):
        t = torch.tensor([float((rank + 1) * (step + 1))])
        if (rank, step) == kill:
            time.sleep(0.3)  # let the other ranks enter the all-reduce first
            os.kill(os.getpid(), signal.SIGKILL)
        if (rank, step) == fail:
            time.sleep(0.3)
            raise RuntimeError(f"launch test failure on rank {rank} in step {step}")
        dist.all_reduce(t)
        total += float(t.item())
    dist.destroy_process_group()
    if rank != _env_int("LAUNCH_TEST_NO_RESULT_RANK"):
        out_dir = os.environ["MEMSHARD_OUT_DIR"]
        result = {"rank": rank, "world_size": world, "sum": total, "args": argv, "out_dir": out_dir}
        write_text_atomically(os.path.join(out_dir, f"rank{rank}.json"), json.dumps(result))


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
