"""Traced models (issue #5): tracing and planning time at real sizes, and traced runs measured.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/traced_models.py [--write]

1. Trace (torch.export on meta) and plan Hugging Face configs at full size, mixed precision:
   LLaMA-3 8B on 8x8 (batch 64 × 4096; goal: "within a few seconds"), LLaMA-2 7B, Mistral 7B
   and Qwen2 defaults on 2x4, GPT-2 124M on 4 — against memshard's own builder where it has
   the same model (peak and zero-redundancy bound of both, and the compute time a step of the
   plan prices: each op kind costs the same FLOPs traced or built).
2. Tiny GPT-2, LLaMA and Qwen2 (fp32, batch 4 × 16) planned on 4 ranks and run on forked gloo
   ranks (3 Adam steps, the last measured): predicted vs measured peak and communication.
``--write`` puts the tables into BENCHMARKS.md between their markers.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.runtime.test_traced_runtime import CONFIGS, STEPS  # noqa: E402
from tests.runtime_harness import run_plans  # noqa: E402

import memshard  # noqa: E402
from benchmarks_md import provenance, write_section  # noqa: E402
from memshard.job import HFModel, Job  # noqa: E402
from memshard.runtime.report import error  # noqa: E402

LLAMA3_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
             "num_key_value_heads": 8, "num_hidden_layers": 32, "vocab_size": 128256, "rope_theta": 500000.0}
FULL = (  # (label, source, mesh, batch, seq, the builder's preset or None)
    ("LLaMA-3 8B", LLAMA3_8B, "8x8", 64, 4096, "llama3-8b"),
    ("LLaMA-2 7B (LlamaConfig())", "llama", "2x4", 8, 2048, "llama2-7b"),
    ("Mistral 7B (MistralConfig())", "mistral", "2x4", 8, 2048, None),
    ("Qwen2 (Qwen2Config())", "qwen2", "2x4", 8, 2048, None),
    ("GPT-2 124M (GPT2Config())", "gpt2", "4", 8, 1024, "gpt2"),
)


def gib(x: float) -> str:
    return f"{x / 2**30:.2f}"


def full_size_rows() -> list[str]:
    rows = ["| model | mesh, batch × seq | params | trace s | plan s | ops | unknown ops | peak GiB "
            "| bound GiB | builder peak GiB | compute / step | builder's |",
            "|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for label, source, mesh, batch, seq, preset in FULL:
        t = time.time()
        graph = Job(HFModel(source), mesh, batch=batch, seq=seq).graph
        traced = time.time() - t
        t = time.time()
        plan = memshard.plan(graph, mesh)
        planned = time.time() - t
        built = memshard.plan(preset, mesh, batch=batch, seq=seq) if preset else None
        unknown = ", ".join(f"{k} ×{v}" for k, v in graph.unknown_ops.items()) or "none"
        rows.append(f"| {label} | {mesh}, {batch} × {seq} | {graph.num_parameters / 1e9:.2f}B | {traced:.1f} | "
                    f"{planned:.1f} | {len(graph.ops)} | {unknown} | {gib(plan.peak_bytes)} | "
                    f"{gib(plan.lower_bound_bytes)} | {gib(built.peak_bytes) if built else '–'} | "
                    f"{plan.compute_time_s:.2f} s | {f'{built.compute_time_s:.2f} s' if built else '–'} |")
    return rows


def run_rows() -> list[str]:
    plans = {name: memshard.plan(HFModel(cfg), "4", batch=4, seq=16, precision="fp32", mip_gap=0.02)
             for name, cfg in CONFIGS.items()}
    runs = dict(zip(plans, run_plans(list(plans.values()), STEPS)))
    rows = ["| model (tiny, 4 ranks) | predicted peak KiB | measured KiB | error | worst rank | "
            "predicted comm KiB/step | measured | comm error |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, reports in runs.items():
        p, m = reports[0]["predicted"], reports[0]["measured"]
        worst = max((error(r["measured"]["peak_bytes"], r["predicted"]["peak_bytes"]) for r in reports), key=abs)
        rows.append(f"| {name} | {p['peak_bytes'] / 1024:.1f} | {m['peak_bytes'] / 1024:.1f} | "
                    f"{error(m['peak_bytes'], p['peak_bytes']):+.2%} | {worst:+.2%} | "
                    f"{p['communication_bytes'] / 1024:.1f} | {m['communication_bytes'] / 1024:.1f} | "
                    f"{error(m['communication_bytes'], p['communication_bytes']) or 0:+.2%} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    start = time.time()
    full = full_size_rows()
    runs = run_rows()
    lines = [provenance("OMP_NUM_THREADS=1 python benchmarks/traced_models.py --write")
             + f" transformers; {time.time() - start:.0f} s.",
             "", "Full-size Hugging Face configs, traced on the meta device, mixed precision, memory objective:",
             "", *full, "", "Tiny configs run on gloo (fp32):", "", *runs]
    text = "\n".join(lines)
    print(text)
    if args.write:
        write_section("traced-models", "Traced models", text)


if __name__ == "__main__":
    main()
