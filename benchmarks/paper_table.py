"""The paper's comparison: memshard against the best Megatron-LM configuration.

    .venv/bin/python benchmarks/paper_table.py [--write]

For GPT-3 1.3B/2.7B/6.7B/13B and LLaMA-3 8B on meshes 1x8, 2x4, 2x8, 4x8 and 8x8 (two
sequences of 2048 tokens per device, mixed precision, Adam): the best Megatron configuration
(TP × DP, with sequence parallelism and the distributed optimizer as options) by memory and
by step time, memshard's least-memory plan, and memshard's least-memory plan within 1.1× the
fastest Megatron time. ``--write`` puts the table into BENCHMARKS.md between its markers.
"""

from __future__ import annotations

import argparse
import time

import memshard
from benchmarks_md import provenance, write_section
from memshard.core.errors import MemshardError
from memshard.planner import baseline_plans

MODELS = ("gpt3-1.3b", "gpt3-2.7b", "gpt3-6.7b", "gpt3-13b", "llama3-8b")
MESHES = ("1x8", "2x4", "2x8", "4x8", "8x8")
SEQ = 2048


def gib(x: float) -> str:
    return f"{x / 2**30:.1f}"


def row(model: str, mesh: str) -> str:
    n = memshard.parse_mesh(mesh).num_devices
    batch = 2 * n
    best = memshard.plan(model, mesh, batch=batch, seq=SEQ)
    megatron = [p for p in baseline_plans(best.job, best.problem)[0] if p.strategy.startswith("megatron")]
    if not megatron:
        return f"| {model} | {mesh} | no Megatron layout fits the head count | | | | | |"
    by_mem = min(megatron, key=lambda p: (p.peak_bytes, p.step_time_s))
    by_time = min(megatron, key=lambda p: (p.step_time_s, p.peak_bytes))
    try:
        timed = memshard.plan(model, mesh, batch=batch, seq=SEQ, max_step_time_s=by_time.step_time_s * 1.1)
        within = (f"{gib(timed.peak_bytes)} GiB, {timed.step_time_s:.2f} s",
                  f"{1 - timed.peak_bytes / by_time.peak_bytes:.0%} at {timed.step_time_s / by_time.step_time_s:.2f}×")
    except MemshardError as e:  # no plan within 1.1× Megatron's fastest
        within = (f"none ({str(e).partition(': ')[2]})", "-")
    return (
        f"| {model} | {mesh} | {by_mem.strategy}: {gib(by_mem.peak_bytes)} GiB, {by_mem.step_time_s:.2f} s "
        f"| {by_time.strategy}: {gib(by_time.peak_bytes)} GiB, {by_time.step_time_s:.2f} s "
        f"| {gib(best.peak_bytes)} GiB, {best.step_time_s:.2f} s | {within[0]} "
        f"| {1 - best.peak_bytes / by_mem.peak_bytes:.0%} / {1 - best.peak_bytes / by_time.peak_bytes:.0%} "
        f"| {within[1]} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    started = time.perf_counter()
    lines = [
        provenance("python benchmarks/paper_table.py --write") + f" Batch 2 × devices, seq {SEQ}, mixed precision.",
        "",
        "| model | mesh | best Megatron by memory | best Megatron by time | memshard least memory "
        "| memshard ≤1.1× fastest Megatron | saving vs Megatron (memory / time config) "
        "| saving at ≤1.1× time (time ratio) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for model in MODELS:
        for mesh in MESHES:
            line = row(model, mesh)
            print(line, flush=True)
            lines.append(line)
    lines.append("")
    lines.append(f"({time.perf_counter() - started:.0f} s for the whole table.)")
    table = "\n".join(lines)
    if args.write:
        write_section("paper-table", "The paper's table", table)
    print(table)


if __name__ == "__main__":
    main()
