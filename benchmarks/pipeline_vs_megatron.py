"""memshard's pipelined plans against Megatron-LM's fastest pipelined configuration within an
80 GiB device: GPT-3 175B on 8x8x16, GPT-3 13B on 4x8, LLaMA-3 70B on 8x8.

    .venv/bin/python benchmarks/pipeline_vs_megatron.py [--write]

Per job, Megatron-LM's configurations are enumerated as its users pick them: pipeline degree P
a divisor (≥ 2) of the outermost mesh axis (the pipeline runs across nodes), tensor
parallelism T ∈ {1, 2, 4, 8} within a node, data parallelism the rest of a stage's devices
(D), micro-batch size 1 or 2, so m = batch / (D · micro-batch size) micro-batches (at least
P), with and without sequence parallelism, the distributed optimizer with and without its
overlap, no, selective or full recomputation; each priced stage by stage under
Megatron-LM's 1F1B (``pipelining.pipelined_baselines``). The fastest whose every stage fits
80 GiB is Megatron-LM's. memshard's fastest pipelined plan within 80 GiB is searched at the
same degree and micro-batches (``--objective time --memory-budget 80GiB --recompute auto
--pipeline P``), timed; and ``--pipeline auto`` (the best of no pipeline and every degree) on
the same job. ``--write`` puts the table into BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import memshard
from memshard.baselines.names import parse_strategy
from memshard.core.errors import MemshardError
from memshard.pipelining import PipelineOptions, pipelined_baselines, plan_auto, plan_pipelined
from memshard.planner import SearchOptions

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmarks_md import provenance, write_section  # noqa: E402

BUDGET = 80 * 2**30
GIB = 2**30
JOBS = [  # model, mesh, batch, seq: as benchmarks/recompute*.py and fit.py run them
    ("gpt3-13b", "4x8", 64, 2048),
    ("llama3-70b", "8x8", 64, 4096),
    ("gpt3-175b", "8x8x16", 1536, 2048),
]
RECOMPUTATIONS = ("none", "selective", "full")
MICRO_BATCH_SIZES = (1, 2)
TENSOR_PARALLEL = (1, 2, 4, 8)


def megatron_names(micro_batches: int, stage_devices: int, batch: int, size: int):
    """Whether a Megatron-LM name is one the enumeration keeps for a micro-batch size
    ``size``: T within a node, its D giving that micro-batch size (not the block method)."""
    def wanted(text: str) -> bool:
        name = parse_strategy(text)
        if name.tensor_parallel not in TENSOR_PARALLEL or name.recompute not in RECOMPUTATIONS or name.block:
            return False
        dp = stage_devices // name.tensor_parallel
        return batch == micro_batches * dp * size
    return wanted


def fastest_megatron(model: str, mesh: str, batch: int, seq: int):
    """Megatron-LM's fastest pipelined configuration within 80 GiB, and how many were priced."""
    best, priced = None, 0
    outer = memshard.Job(model, mesh, batch=batch, seq=seq).mesh.shape[0]
    for degree in (p for p in range(2, outer + 1) if outer % p == 0):
        stage_devices = memshard.Job(model, mesh).mesh.num_devices // degree
        for tp in TENSOR_PARALLEL:
            for size in MICRO_BATCH_SIZES:
                dp = stage_devices // tp
                if stage_devices % tp or batch % (dp * size) or batch // (dp * size) < degree:
                    continue
                job = memshard.Job(model, mesh, batch=batch, seq=seq, micro_batches=batch // (dp * size))
                wanted = megatron_names(job.micro_batches, stage_devices, batch, size)
                plans, _ = pipelined_baselines(job, degree, wanted, recompute="auto")
                priced += len(plans)
                fitting = [p for p in plans if p.peak_bytes <= BUDGET]
                for plan in fitting:
                    if best is None or plan.step_time_s < best.step_time_s:
                        best = plan
                print(f"  {model} pp{degree} tp{tp} mbs{size}: {len(plans)} priced, {len(fitting)} fit", flush=True)
    return best, priced


def row(model: str, mesh: str, batch: int, seq: int) -> str:
    started = time.perf_counter()
    megatron, priced = fastest_megatron(model, mesh, batch, seq)
    enumerated_s = time.perf_counter() - started
    head = f"| {model} b{batch} s{seq} | {mesh} |"
    if megatron is None:
        return f"{head} none of {priced} fits | - | - | - | - |"
    job, degree = megatron.job, len(megatron.stages)
    mega = (f"{megatron.strategy}, {job.micro_batches} micro-batches: {megatron.step_time_s:.2f} s, "
            f"{megatron.peak_bytes / GIB:.1f} GiB ({priced} priced, {enumerated_s:.0f} s)")
    options = SearchOptions(objective="time", memory_budget=BUDGET, recompute="auto")
    started = time.perf_counter()
    try:
        ours = plan_pipelined(job, options, PipelineOptions(degree))
        planning_s = time.perf_counter() - started
        found = (f"{ours.step_time_s:.2f} s, {ours.peak_bytes / GIB:.1f} GiB, bubble {ours.bubble_s:.2f} s "
                 f"| **{ours.step_time_s / megatron.step_time_s:.2f}** | {planning_s:.1f} s")
    except MemshardError as e:
        found = f"{e} | - | {time.perf_counter() - started:.1f} s"
    started = time.perf_counter()
    try:
        auto = plan_auto(job, options)
        what = (f"{len(auto.stages)} stages" if hasattr(auto, "stages") else "no pipeline")
        best = (f"{what}: {auto.step_time_s:.2f} s, {auto.peak_bytes / GIB:.1f} GiB "
                f"(**{auto.step_time_s / megatron.step_time_s:.2f}**, {time.perf_counter() - started:.0f} s)")
    except MemshardError as e:
        best = str(e)
    return f"{head} {mega} | {found} | {best} |"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    lines = [provenance("python benchmarks/pipeline_vs_megatron.py --write"), "",
             "| job | mesh | fastest pipelined Megatron-LM configuration within 80 GiB (1F1B) | memshard, fastest "
             "pipelined plan within 80 GiB, same degree and micro-batches | step-time ratio | memshard's planning "
             "time | memshard `--pipeline auto` (ratio, planning time) |",
             "|---|---|---|---|---|---|---|"]
    for job in JOBS:
        lines.append(row(*job))
        print(lines[-1], flush=True)
    if args.write:
        write_section("pipeline-vs-megatron", "Pipelines: memshard against Megatron-LM at 80 GiB", "\n".join(lines))


if __name__ == "__main__":
    main()
