"""Recomputation on the jobs that do not fit an 80 GiB device without it.

    .venv/bin/python benchmarks/recompute.py [--write]

For each job: the least peak any plan reaches without recomputation; memshard's fastest plan
within 80 GiB with recomputation searched (``--objective time --memory-budget 80GiB
--recompute auto``: its peak, step time, the recomputation's share and the planning time);
the fastest Megatron-LM configuration that fits (TP × DP × sequence parallelism ×
distributed optimizer × no / selective / full recomputation, of every layer or of as few
as fit by Megatron-LM's block method, priced by the same model); and
memshard's least-memory plan with full recomputation, and with recomputation searched
(``--recompute auto``), each against the lower bound its search proves (the best of branch and
bound's, the LP relaxation of the peak alone and the plan-independent bounds) and the first
against the zero-redundancy bound (which counts a replayable tensor only where every plan
holds it, so is loose where replays hold much). ``--write`` puts the table into BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import memshard
from memshard.core.errors import MemshardError
from memshard.planner import SearchOptions, baseline_plans, plan_job
from memshard.problem.pricing import build_problem

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmarks_md import provenance, write_section  # noqa: E402

BUDGET = 80 * 2**30
JOBS = [  # model, mesh, batch, seq
    ("gpt3-13b", "1x8", 16, 2048),
    ("llama3-70b", "8x8", 64, 4096),
    ("gpt3-175b", "8x8x16", 1536, 2048),
]


def timed(make):
    started = time.perf_counter()
    out = make()
    return out, time.perf_counter() - started


def fastest_megatron(job) -> memshard.Plan | None:
    """The fastest Megatron-LM configuration of ``job`` that fits, every recomputation."""
    plans, _ = baseline_plans(job, build_problem(job.graph, job.mesh, micro_batches=job.micro_batches,
                                                 recompute="auto"))
    fitting = [p for p in plans if p.strategy.startswith("megatron") and p.peak_bytes <= BUDGET]
    return min(fitting, key=lambda p: p.step_time_s, default=None)


def row(model: str, mesh: str, batch: int, seq: int) -> str:
    job = memshard.Job(model, mesh, batch=batch, seq=seq)
    without = plan_job(job, SearchOptions())
    started = time.perf_counter()
    try:
        fits = plan_job(job, SearchOptions(objective="time", memory_budget=BUDGET, recompute="auto"))
    except MemshardError as e:  # the search may find no plan within its time limit
        fits = str(e)
    seconds = time.perf_counter() - started
    least, _ = timed(lambda: plan_job(job, SearchOptions(recompute="full")))
    searched, searched_s = timed(lambda: plan_job(job, SearchOptions(recompute="auto")))
    megatron = fastest_megatron(job)
    gib = 2**30
    mega = ("none fits" if megatron is None else
            f"{megatron.strategy}: {megatron.peak_bytes / gib:.1f} GiB, {megatron.step_time_s:.2f} s")
    if isinstance(fits, str):
        found, ratio = fits, "-"
    else:
        replayed = sum(op.recomputed for op in fits.ops)
        found = (f"{fits.peak_bytes / gib:.1f} GiB, {fits.step_time_s:.2f} s ({fits.recompute_time_s / fits.step_time_s:.1%}"
                 f" recomputing; {replayed} ops per layer replayed)")
        ratio = f"{fits.step_time_s / megatron.step_time_s:.2f}" if megatron is not None else "-"
    return (f"| {model} b{batch} s{seq} | {mesh} | {without.peak_bytes / gib:.1f} GiB | {found} | "
            f"{seconds:.1f} s | {mega} | {ratio} | {least.peak_bytes / gib:.1f} GiB: {least.solver.status}, "
            f"within {least.solver.gap:.1%} of the solver's bound, {least.memory.above_lower_bound:+.1%} above the "
            f"zero-redundancy bound | {searched.peak_bytes / gib:.1f} GiB, {searched.step_time_s:.2f} s: "
            f"{searched.solver.status}, within {searched.solver.gap:.1%} of the proved bound ({searched_s:.0f} s) |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    lines = [provenance("python benchmarks/recompute.py --write"), "",
             "| job | mesh | least peak without recomputation | memshard, fastest within 80 GiB (`--recompute "
             "auto`) | planning | fastest Megatron-LM configuration that fits | step-time ratio | least peak, "
             "full recomputation | least peak, recomputation searched (`--recompute auto`) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for job in JOBS:
        lines.append(row(*job))
        print(lines[-1], flush=True)
    if args.write:
        write_section("recompute", "Recomputation: jobs that fit only with it", "\n".join(lines))


if __name__ == "__main__":
    main()
