"""How far a job can go within 80 GiB per device: ``memshard fit`` (issue #21).

    .venv/bin/python benchmarks/fit.py [--write]

For GPT-3 and LLaMA-3 jobs on 8–1024 devices (mixed precision, no recomputation): the largest
global batch (or the longest sequence) whose least-memory plan fits an 80 GiB device (and the
fewest devices some of them need), for
memshard, for the best Megatron-LM configuration (every TP degree × DP × sequence parallelism
× distributed optimizer, priced by the same model) and for FSDP2 (``fully_shard`` as it runs,
``fsdp2``); the ratio memshard / Megatron; and the search's own time (memshard alone, and with
every baseline). ``--write`` puts the table into BENCHMARKS.md between its markers.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks_md import provenance, write_section  # noqa: E402
from memshard.core.quantities import format_bytes  # noqa: E402
from memshard.fitting import fit_job  # noqa: E402
from memshard.job import Job  # noqa: E402

JOBS = (  # (model, mesh, batch, seq, knob, step: None = the mesh's data-parallel degree)
    ("gpt3-1.3b", "1x8", 8, 2048, "batch", None),
    ("gpt3-13b", "2x8", 16, 2048, "batch", None),
    ("llama3-8b", "8x8", 64, 8192, "batch", None),
    ("llama3-8b", "8x8", 64, 8192, "seq", None),
    ("llama3-8b", "1x8", 8, 8192, "seq", None),
    ("llama3-70b", "8x8", 64, 4096, "batch", None),
    ("llama3-70b", "8x8", 64, 4096, "seq", None),
    ("gpt3-175b", "8x8x16", 1536, 2048, "batch", 128),
)


def row(model: str, mesh: str, batch: int, seq: int, knob: str, step: int | None) -> str:
    job = Job(model, mesh, batch=batch, seq=seq)
    started = time.perf_counter()
    fit_job(job, knob, step=step, baselines=False)
    alone_s = time.perf_counter() - started
    # the step-time bound: within 1.1× memshard's fastest plan that fits at the same value
    # (at most the fastest fitting baseline's time, the baselines being in its search space)
    bounded = fit_job(job, knob, step=step, baselines=False, max_slowdown=1.1).answers[0]
    result = fit_job(job, knob, step=step)
    ours = result.answers[0]
    by_name = {a.strategy: a for a in result.answers[1:]}
    megatron = max((a for a in result.answers[1:] if a.strategy.startswith("megatron")),
                   key=lambda a: (a.value or 0, -(a.plan.step_time_s if a.plan else 0)))
    fsdp2 = by_name.get("fsdp2")

    def cell(a):
        return "none" if a is None or a.value is None else f"{a.value:,} ({format_bytes(a.plan.peak_bytes)})"

    best_megatron = f"{megatron.strategy}: {cell(megatron)}" if megatron.value else "none fits"
    ratio = f"{ours.value / megatron.value:.2f}" if megatron.value else "∞"
    bounded_ratio = f"{bounded.value / megatron.value:.2f}" if megatron.value else "∞"
    nxt = ours.next_probe
    proof = f"{nxt.value:,}: ≥ {format_bytes(nxt.bound_bytes)}" if nxt is not None else "model's limit"
    fixed = f"batch {batch}" if knob == "seq" else f"seq {seq}"
    return (f"| {model} {fixed} | {mesh} | {knob} | {cell(ours)} | {proof} | {best_megatron} | "
            f"{cell(fsdp2)} | **{ratio}** | {cell(bounded)}: **{bounded_ratio}** | "
            f"{alone_s:.1f} s ({len(ours.probes)} probes) | {result.time_s:.0f} s |")


DEVICE_JOBS = (  # (model, mesh to start from, batch, seq): the fewest devices
    ("gpt3-13b", "2x8", 16, 2048),
    ("llama3-8b", "8x8", 64, 8192),
    ("llama3-70b", "8x8", 64, 4096),
)  # (GPT-3 175B's, every baseline's plans at each node count held, outgrew a 24 GiB machine)


def devices_row(model: str, mesh: str, batch: int, seq: int) -> str:
    job = Job(model, mesh, batch=batch, seq=seq)
    # the step-time bound: within 1.1× memshard's fastest plan that fits on as many devices
    bounded = fit_job(job, "devices", baselines=False, max_slowdown=1.1).answers[0]
    result = fit_job(job, "devices")
    ours, others = result.answers[0], result.answers[1:]
    megatron = min((a for a in others if a.strategy.startswith("megatron") and a.value is not None),
                   key=lambda a: a.value, default=None)
    best = min((a for a in others if a.value is not None), key=lambda a: a.value, default=None)

    def cell(a):
        return "none" if a is None or a.value is None else f"{a.strategy}: {a.value:,}"

    fsdp2 = next((a for a in others if a.strategy == "fsdp2"), None)
    within = "none" if bounded.value is None else f"{bounded.value:,} ({format_bytes(bounded.plan.peak_bytes)})"
    return (f"| {model} {batch} × {seq} | {ours.value:,} ({format_bytes(ours.plan.peak_bytes)}) | "
            f"{ours.next_probe.value:,}: ≥ {format_bytes(ours.next_probe.bound_bytes)} | {within} | {cell(megatron)} | "
            f"{cell(best)} | {'none' if fsdp2 is None or fsdp2.value is None else f'{fsdp2.value:,}'} | "
            f"{result.time_s:.0f} s |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    lines = [provenance("python benchmarks/fit.py --write"), "",
             "| job | mesh | knob | memshard: largest (its peak) | next value needs | best Megatron-LM configuration "
             "| FSDP2 | memshard / Megatron | memshard ≤ 1.1× its fastest / Megatron | memshard's search "
             "| with every baseline |",
             "|---|---|---|---|---|---|---|---:|---:|---:|---:|"]
    for job in JOBS:
        lines.append(row(*job))
        print(lines[-1], flush=True)
    lines += ["", "The fewest devices (whole nodes of 8, the global batch kept):", "",
              "| job | memshard: fewest (its peak) | one node fewer needs | memshard ≤ 1.1× its fastest "
              "| best Megatron-LM configuration | best baseline | FSDP2 | search with every baseline |",
              "|---|---|---|---|---|---|---|---:|"]
    for job in DEVICE_JOBS:
        lines.append(devices_row(*job))
        print(lines[-1], flush=True)
    text = "\n".join(lines)
    print(text)
    if args.write:
        write_section("fit", "How far a job can go within 80 GiB: memshard fit", text)


if __name__ == "__main__":
    main()
