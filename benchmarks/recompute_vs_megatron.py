"""memshard with recomputation searched against the fastest Megatron-LM configuration that fits
an 80 GiB device, GPT-3 1.3B–175B and LLaMA-3 8B/70B on 8–1024 devices.

    .venv/bin/python benchmarks/recompute_vs_megatron.py [--write]

Per job: the fastest Megatron-LM configuration within 80 GiB (every TP degree × DP × sequence
parallelism × distributed optimizer × no / selective / full recomputation, of every layer or
of as few as fit by Megatron-LM's block method, priced by memshard's model); memshard's
fastest plan within 80 GiB (``--objective time --memory-budget 80GiB --recompute auto``) and
its step-time ratio to Megatron's; and memshard's least-memory
plan within 1.1× Megatron's step time (``--max-step-time … --recompute auto --gap 0.002``:
the closest plans, not the 3% such a search stops at by default; searched from the fastest plan) and its peak against Megatron's, and the least peak ratio any plan on the meshes searched could
have there (the search's proved bound on its peak, over Megatron's peak). Both memshard
searches run on every view of the devices (``core.mesh.mesh_views``: a node of 8 as 8 and as
2 × 4, where Megatron's TP 2 or 4 splits it), the plan on the best; a plan on a view shows its
mesh. The mean
and the best ratios close the table. ``--write`` puts it into BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import memshard
from memshard.core.errors import MemshardError
from memshard.core.mesh import mesh_views
from memshard.planner import DEFAULT_GAP, SearchOptions, plan_job

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmarks_md import provenance, write_section  # noqa: E402
from recompute import BUDGET, fastest_megatron  # noqa: E402

JOBS = [  # model, mesh, batch, seq
    ("gpt3-1.3b", "8", 64, 2048),
    ("gpt3-6.7b", "1x8", 32, 2048),
    ("gpt3-13b", "2x8", 64, 2048),
    ("llama3-8b", "1x8", 16, 8192),
    ("llama3-8b", "8x8", 64, 8192),
    ("llama3-70b", "8x8", 64, 4096),
    ("gpt3-175b", "8x8x16", 1536, 2048),
]
SLACK = 1.1


def row(model: str, mesh: str, batch: int, seq: int) -> tuple[str, float | None, float | None]:
    """The table row, the step-time ratio and the peak ratio at 1.1× Megatron's time."""
    gib = 2**30
    job = memshard.Job(model, mesh, batch=batch, seq=seq)
    megatron = fastest_megatron(job)
    head = f"| {model} b{batch} s{seq} | {mesh} ({job.mesh.num_devices}) |"
    try:  # on every view of the devices (the planner's mesh views)
        fastest = plan_job(job, SearchOptions(objective="time", memory_budget=BUDGET, recompute="auto"))
    except MemshardError as e:  # a search may find nothing in its time limit
        print(f"{model} on {job.mesh}: {e}", file=sys.stderr)
        mega = "none fits" if megatron is None else f"{megatron.strategy}: {megatron.step_time_s:.2f} s"
        return f"{head} {mega} | {e} | - | - | - | - |", None, None
    on = "" if fastest.job.mesh == job.mesh else f" (on {'x'.join(map(str, fastest.job.mesh.shape))})"
    ours = f"{fastest.step_time_s:.2f} s, {fastest.peak_bytes / gib:.1f} GiB{on}"
    if megatron is None:
        return f"{head} none fits | {ours} | - | - | - | - |", None, None
    time_ratio = fastest.step_time_s / megatron.step_time_s
    mega = f"{head} {megatron.strategy}: {megatron.step_time_s:.2f} s, {megatron.peak_bytes / gib:.1f} GiB | {ours}"
    budget = SLACK * megatron.step_time_s
    if fastest.step_time_s > budget:
        return f"{mega} | **{time_ratio:.2f}** | - | - | - |", time_ratio, None
    try:  # from the fastest plan, which meets the step-time budget: a plan however soon time runs out
        lean = plan_job(job, SearchOptions(max_step_time_s=budget, recompute="auto", mip_gap=DEFAULT_GAP,
                                           mesh_views=bool(mesh_views(job.mesh)) or None),
                        start=fastest)
    except MemshardError as e:
        return f"{mega} | **{time_ratio:.2f}** | {e} | - | - |", time_ratio, None
    peak_ratio = lean.peak_bytes / megatron.peak_bytes
    # no plan on the meshes searched is below the search's proved bound
    least = lean.peak_bytes * (1 - lean.solver.gap) / megatron.peak_bytes
    status = "" if lean.solver.status == "optimal" else f" ({lean.solver.status}, gap {lean.solver.gap:.1%})"
    lean_on = "" if lean.job.mesh == job.mesh else f", on {'x'.join(map(str, lean.job.mesh.shape))}"
    return (f"{mega} | **{time_ratio:.2f}** | {lean.peak_bytes / gib:.1f} GiB at {lean.step_time_s:.2f} s{status}"
            f"{lean_on} | **{peak_ratio:.2f}** | {least:.2f} |"), time_ratio, peak_ratio


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    lines = [provenance("python benchmarks/recompute_vs_megatron.py --write"), "",
             "| job | mesh (devices) | fastest Megatron-LM configuration within 80 GiB | memshard, fastest within "
             "80 GiB | step-time ratio | memshard, least memory within 1.1× Megatron's time | peak ratio | "
             "least peak ratio possible (proved) |",
             "|---|---|---|---|---|---|---|---|"]
    times, peaks = [], []
    for job in JOBS:
        line, time_ratio, peak_ratio = row(*job)
        lines.append(line)
        print(line, flush=True)
        if time_ratio is not None:
            times.append(time_ratio)
        if peak_ratio is not None:
            peaks.append(peak_ratio)
    lines.append(f"| mean / best | | | | {statistics.mean(times):.2f} / {min(times):.2f} | | "
                 f"{statistics.mean(peaks):.2f} / {min(peaks):.2f} | |")
    print(lines[-1])
    if args.write:
        write_section("recompute-vs-megatron", "Recomputation: memshard against Megatron-LM at 80 GiB",
                      "\n".join(lines))


if __name__ == "__main__":
    main()
