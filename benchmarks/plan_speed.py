"""End-to-end planning time and plan quality for the issue's reference jobs.

    .venv/bin/python benchmarks/plan_speed.py [--write]

Each case runs ``memshard plan`` as a user would (a fresh process, so imports count) and
reports the median wall time of three runs, the ILP size, the peak memory per device and how
far it is above the zero-redundancy bound. ``--write`` puts the table into BENCHMARKS.md.

The package is byte-compiled first, as an installed one is (pip compiles it at install, and
Python caches what it compiles on a first import): where PYTHONDONTWRITEBYTECODE is set, as
on the machine these figures come from, every run would otherwise compile memshard's sources
again (about 0.1 s), which no user pays.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CASES = [  # model, mesh, batch, seq (None: the CLI's defaults), micro-batches, goal (s), more flags
    ("llama3-8b", "8x8", None, None, 1, 1.0, ()),  # the command: batch 64, seq 8192
    ("llama3-8b", "8x8", 64, 4096, 1, None, ()),
    ("gpt3-6.7b", "2x4", 16, 2048, 1, None, ()),
    ("gpt3-175b", "8x8x16", None, None, 1, 10.0, ()),  # the command: batch 1024, seq 2048
    ("gpt3-175b", "8x8x16", 1536, 2048, 1, None, ()),
    ("gpt3-175b", "8x8x16", 1536, 2048, 48, None, ()),
    # the time-objective command (the whole batch at once needs 390 GiB: as micro-batches)
    ("gpt3-175b", "8x8x16", 1536, 2048, 48, None, ("--objective", "time", "--memory-budget", "80GiB")),
    # with recomputation searched: the fastest plan within 80 GiB, and the least memory
    ("llama3-8b", "8x8", None, None, 1, 2.0, ("--recompute", "auto", "--objective", "time", "--memory-budget", "80GiB")),
    ("gpt3-175b", "8x8x16", 1536, 2048, 1, 10.0,
     ("--recompute", "auto", "--objective", "time", "--memory-budget", "80GiB")),
    ("llama3-8b", "8x8", None, None, 1, 2.0, ("--recompute", "auto")),
    ("gpt3-175b", "8x8x16", 1536, 2048, 1, 10.0, ("--recompute", "auto")),
]
MEMSHARD = [sys.executable, "-m", "memshard.cli"]
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmarks_md import provenance, write_section  # noqa: E402


def run(model: str, mesh: str, batch: int | None, seq: int | None, micro: int, flags=()) -> tuple[float, dict]:
    sizes = ["--batch", str(batch)] * (batch is not None) + ["--seq", str(seq)] * (seq is not None)
    sizes += ["--micro-batches", str(micro)] * (micro > 1)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "plan.json")
        started = time.perf_counter()
        subprocess.run(MEMSHARD + ["plan", "--model", model, "--mesh", mesh, *sizes, *flags, "--json", out],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        elapsed = time.perf_counter() - started
        with open(out) as f:
            return elapsed, json.load(f)


def byte_compile() -> None:
    """Compile memshard's sources as an installed package is (see the module docstring)."""
    import memshard

    subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.dirname(memshard.__file__)], check=True)


def status(solver: dict) -> str:
    """Nothing for a proved plan; else the solver's status and the gap it stopped at."""
    return "" if solver["status"] == "optimal" else f" ({solver['status']}, gap {solver['gap']:.2%})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    byte_compile()
    lines = [provenance("python benchmarks/plan_speed.py --write"), "",
             "| job | mesh | wall time (median of 3) | goal | ILP variables / constraints | search | peak / device "
             "| above bound | step time |",
             "|---|---|---|---|---|---|---|---|---|"]
    for model, mesh, batch, seq, micro, goal, flags in CASES:
        times, plan = [], None
        for _ in range(3):
            t, plan = run(model, mesh, batch, seq, micro, flags)
            times.append(t)
        s = plan["solver"]
        m = plan["memory"]
        job = plan["model"]
        lines.append(
            f"| {model} b{job['batch']} s{job['seq']}{f' ×{micro} micro-batches' if micro > 1 else ''}"
            f"{''.join(' ' + f for f in flags)} | {mesh} | {statistics.median(times):.2f} s | "
            f"{f'≤ {goal:g} s' if goal else '-'} | {s['variables']:,} / {s['constraints']:,} | {s['search_space']}"
            f"{status(s)} | "
            f"{m['peak_bytes_per_device'] / 2**30:.2f} GiB | {m['above_lower_bound']:+.2%} | "
            f"{plan['estimated_step_time_s']:.2f} s |")
        print(lines[-1], flush=True)
    if args.write:
        write_section("plan-speed", "Planning time and plan quality", "\n".join(lines))


if __name__ == "__main__":
    main()
