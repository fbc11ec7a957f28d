"""The least-memory search with recomputation at its default gap (3%) and at 0.2%.

    .venv/bin/python benchmarks/recompute_gap.py [--write]

With recomputation searched, a least-memory plan's bound is the LP relaxation of the peak
(the zero-redundancy floor lets every replayable tensor go for free), which stays 0.4-2.4%
below the plans found; so these searches stop at a plan proved within 3% by default
(``SearchOptions.gap``). Each job runs ``memshard plan --recompute auto`` once as a user would
(a fresh process, memshard byte-compiled first), at the default gap and with ``--gap 0.002`` (the 60 s default limit): the
wall time, the plan's peak, the gap it is proved within, its ZeRO-3 unit, and how much leaner
the closer search's plan is. ``--write`` puts the table into BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmarks_md import provenance, write_section  # noqa: E402
from plan_speed import byte_compile, run  # noqa: E402

JOBS = [  # model, mesh, batch, seq, more flags
    ("gpt3-175b", "8x8x16", 1536, 2048, ()),
    ("llama3-70b", "8x8", 64, 4096, ()),
    ("gpt3-13b", "2x8", 64, 2048, ()),
    ("gpt3-13b", "1x8", 16, 2048, ()),
    ("gpt3-6.7b", "1x8", 32, 2048, ()),
    ("gpt3-1.3b", "8", 8, 1024, ("--layers", "2")),
]


def searched(seconds: float, plan: dict) -> str:
    s = plan["solver"]
    proved = "optimal" if s["status"] == "optimal" else s["status"]
    return (f"{seconds:.1f} s | {plan['memory']['peak_bytes_per_device'] / 2**30:.3f} GiB | "
            f"{s['gap']:.2%} ({proved}), per {s['zero3_unit']}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    byte_compile()
    lines = [provenance("python benchmarks/recompute_gap.py --write"), "",
             "| job | mesh | default (3%): wall time | peak | proved within | `--gap 0.002`: wall time | peak "
             "| proved within | its plan leaner by |",
             "|---|---|---|---|---|---|---|---|---|"]
    for model, mesh, batch, seq, flags in JOBS:
        flags = ("--recompute", "auto", *flags)
        default = run(model, mesh, batch, seq, 1, flags)
        closer = run(model, mesh, batch, seq, 1, (*flags, "--gap", "0.002"))
        leaner = 1 - closer[1]["memory"]["peak_bytes_per_device"] / default[1]["memory"]["peak_bytes_per_device"]
        lines.append(f"| {model} b{batch} s{seq}{''.join(' ' + f for f in flags[2:])} | {mesh} | "
                     f"{searched(*default)} | {searched(*closer)} | {leaner:+.2%} |")
        print(lines[-1], flush=True)
    if args.write:
        write_section("recompute-gap", "Least memory with recomputation: the default gap", "\n".join(lines))


if __name__ == "__main__":
    main()
