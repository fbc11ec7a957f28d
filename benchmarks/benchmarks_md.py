"""Write a benchmark's table into BENCHMARKS.md between its markers (or append a section)."""

from __future__ import annotations

import re
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "BENCHMARKS.md"


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
