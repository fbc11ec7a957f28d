"""Runtime accuracy: predicted against measured peak memory and communication, per plan.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/runtime_accuracy.py [--write]

Runs the 48 plans of ``tests/test_runtime.py`` (tiny GPT and LLaMA, batch 8 × 32 tokens;
memshard's plans under both objectives on meshes 4, 2x2, 1x4, 2x2x2, baselines, plans with
ZeRO-3 gathered per layer, ten recomputing ones; fp32, and twelve in mixed precision, named
``…-mixed``) on forked gloo ranks, 3 Adam steps, the last one measured on every rank; then
``simulate`` (fake process group, one process) for rank 0 of memshard's plans of GPT-3 6.7B on
8x8 and LLaMA-3 8B on 4x8 (mixed precision and fp32), and of GPT-3 6.7B's TP8 + ZeRO-3 plan
with ZeRO-3 gathered per layer (fp32).
The figures are rank 0's; "worst rank" is the largest peak error over the ranks; "worst
category" the largest error of a category at the peak over the ranks, as the test measures
it (against the category, or a fifth of the peak if smaller; at the best-matching point of
those within 0.5% of the peak).
``--write`` puts the tables into BENCHMARKS.md between their markers.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.runtime.test_runtime import CASES, STEPS, _make, category_errors  # noqa: E402
from tests.runtime_harness import run_cases  # noqa: E402

import memshard  # noqa: E402
from benchmarks_md import provenance, write_section  # noqa: E402
from memshard.api import strategy_plan  # noqa: E402
from memshard.problem.evaluate import evaluate  # noqa: E402
from memshard.runtime.report import error  # noqa: E402
from memshard.runtime.simulate import simulate  # noqa: E402

SIMULATED = (  # model, mesh, batch, strategy, ZeRO-3 unit, precision
    ("gpt3-6.7b", "8x8", 64, "memshard", "op", "mixed"),
    ("llama3-8b", "4x8", 32, "memshard", "op", "mixed"),
    ("gpt3-6.7b", "8x8", 64, "memshard", "op", "fp32"),
    ("llama3-8b", "4x8", 32, "memshard", "op", "fp32"),
    ("gpt3-6.7b", "8x8", 64, "tp8-fsdp8", "layer", "fp32"),
)


def mib(x: float) -> str:
    return f"{x / 2**20:.2f}"


def pct(e: float | None) -> str:
    return "–" if e is None else f"{e:+.2%}"


def row(name: str, plan, reports: list[dict]) -> str:
    r0 = reports[0]
    p, m = r0["predicted"], r0["measured"]
    worst = max((error(r["measured"]["peak_bytes"], r["predicted"]["peak_bytes"]) for r in reports), key=abs)
    ev = evaluate(plan.problem, plan.selection)
    breakdowns = (r["measured"]["breakdown"] for r in reports)
    category = max((e for b in breakdowns for e in category_errors(ev, b, plan.problem.schedule)[1].values()), key=abs)
    comm = max(abs(error(r["measured"]["communication_bytes"], r["predicted"]["communication_bytes"]) or 0.0)
                for r in reports)
    return (f"| {name} | {mib(p['peak_bytes'])} | {mib(m['peak_bytes'])} | "
            f"{pct(error(m['peak_bytes'], p['peak_bytes']))} | {pct(worst)} | {pct(category)} | "
            f"{mib(p['communication_bytes'])} | {mib(m['communication_bytes'])} | {comm:.2%} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    start = time.time()
    plans = {case: _make(case) for case in CASES}
    results = run_cases(plans, STEPS)
    lines = [
        provenance("OMP_NUM_THREADS=1 python benchmarks/runtime_accuracy.py --write")
        + f" gloo; {time.time() - start:.0f} s. Plans ending in `-mixed` run in mixed precision (bf16 weights, "
        "activations and gradients, fp32 master weights and Adam moments), the others in fp32.",
        "",
        "| plan (model-strategy-mesh) | predicted peak MiB | measured MiB | error | worst rank "
        "| worst category | predicted comm MiB/step | measured | worst comm error |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [row(case, plans[case], results[case]) for case in sorted(results)]
    lines += ["", "Simulated (fake process group, rank 0, seq 2048):", "",
              "| model | mesh | plan | precision | predicted peak GiB | measured GiB | error | comm error | "
              + " | ".join(f"{c} error" for c in ("parameters", "gradients", "optimizer_states",
                                                   "activations", "transients")) + " | time |",
              "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for model, mesh, batch, strategy, unit, precision in SIMULATED:
        t = time.time()
        if strategy == "memshard":
            plan = memshard.plan(model, mesh, batch=batch, seq=2048, precision=precision, mip_gap=0.02)
        else:
            plan = strategy_plan(model, mesh, strategy, batch=batch, seq=2048, precision=precision, zero3_unit=unit)
        r = simulate(plan)
        p, m = r["predicted"], r["measured"]
        cats = " | ".join(pct(error(m["breakdown"][c], p["breakdown"][c]))
                          for c in ("parameters", "gradients", "optimizer_states", "activations", "transients"))
        name = strategy + (", ZeRO-3 per layer" if unit == "layer" else "")
        lines.append(f"| {model} | {mesh} | {name} | {precision} | {p['peak_bytes'] / 2**30:.2f} | {m['peak_bytes'] / 2**30:.2f} | "
                     f"{pct(error(m['peak_bytes'], p['peak_bytes']))} | "
                     f"{pct(error(m['communication_bytes'], p['communication_bytes']))} | {cats} | "
                     f"{time.time() - t:.0f} s |")
    text = "\n".join(lines)
    print(text)
    if args.write:
        write_section("runtime-accuracy", "Runtime accuracy", text)


if __name__ == "__main__":
    main()
