"""BENCHMARKS.md's generated tables: each opens with where it came from (``provenance``) and
is written between its markers (``write_section``)."""

from __future__ import annotations

import datetime
import os
import platform
import re
import subprocess
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "BENCHMARKS.md"


def provenance(command: str) -> str:
    """The line a table opens with: the command, the commit (marked if the tree differs from
    it), the machine and the date."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    if git("status", "--porcelain", "--untracked-files=no", "--", "src", "benchmarks"):
        commit += " with uncommitted changes"
    versions = ", ".join(f"{p} {metadata.version(p)}" for p in ("highspy", "torch") if _installed(p))
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, {versions}"
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return f"`{command}` — commit `{commit}`, {machine}, {date}."


def _installed(package: str) -> bool:
    try:
        metadata.version(package)
    except metadata.PackageNotFoundError:
        return False
    return True


def write_section(name: str, title: str, text: str) -> None:
    """Replace what lies between ``<!-- name:begin -->`` and ``<!-- name:end -->`` with
    ``text``; without those markers, append a ``## title`` section holding them."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    doc = BENCHMARKS.read_text()
    block = f"{begin}\n{text}\n{end}"
    if begin in doc:
        doc = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: block, doc, flags=re.S)
    else:
        doc = doc.rstrip() + f"\n\n## {title}\n\n{block}\n"
    BENCHMARKS.write_text(doc)


def gpu_or_here(description: str, measure) -> bool | None:
    """The options of a benchmark measured on the GPU machine and tabled here: with
    ``--measure``, ``measure(--device)`` is written to ``--out`` and None returned; otherwise
    whether ``--write`` was given."""
    import argparse
    import json

    import torch

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--measure", action="store_true", help="measure only, into --out")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    if args.measure:
        Path(args.out).write_text(json.dumps(measure(args.device), indent=1))
        return None
    return args.write
