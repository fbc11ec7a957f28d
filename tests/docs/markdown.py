"""The docs as the tests read them: the pages (README.md, BENCHMARKS.md, docs/*.md), their code
blocks, the ``memshard …`` commands in those blocks, the output blocks (``$ memshard …`` then
what it prints), and their headings' anchors and relative links."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
BENCHMARKS = ROOT / "BENCHMARKS.md"
DOCS = ROOT / "docs"
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
GENERATED = re.compile(r"<!-- (\S+):begin -->.*?<!-- \1:end -->", re.S)
SHELL = ("", "sh", "bash", "console")
# the timings an output block shows, masked on both sides
TIMINGS = (re.compile(r"(solver: HiGHS \w+), [0-9.]+ s,"), re.compile(r"(found in) [0-9.]+ m?s$"))


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page: its language tag and its text."""

    page: str
    lang: str
    body: str


@dataclass(frozen=True)
class OutputBlock:
    """A block that opens with ``$ memshard …``: the command and the lines shown under it. A
    last line ``…`` means the rest of the output is left out (``partial``)."""

    page: str
    command: str
    lines: tuple[str, ...]
    partial: bool


def pages() -> list[Path]:
    """Every page a user reads: the README, BENCHMARKS.md and docs/*.md."""
    return [README, BENCHMARKS, *sorted(DOCS.glob("*.md"))]


def page_name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def prose_of(text: str) -> str:
    """The text a person wrote: the tables the benchmark scripts write between their markers
    left out."""
    return GENERATED.sub("", text)


def blocks(path: Path) -> list[Block]:
    return [Block(page_name(path), lang, body) for lang, body in BLOCK.findall(path.read_text())]


def commands(block: Block) -> list[str]:
    """The ``memshard …`` commands of a shell block: ``$`` and comments dropped, continued
    lines joined, spaces normalised."""
    if block.lang not in SHELL:
        return []
    shown = output_block(block)
    if shown:
        return [shown.command]
    out = []
    for line in block.body.replace("\\\n", " ").splitlines():
        line = line.removeprefix("$ ").split("#")[0].strip()
        if line.startswith("memshard ") or line == "memshard":
            out.append(" ".join(line.split()))
    return out


def output_block(block: Block) -> OutputBlock | None:
    lines = block.body.splitlines()
    if block.lang not in SHELL or len(lines) < 2 or not lines[0].startswith("$ memshard "):
        return None
    shown = [line.rstrip() for line in lines[1:]]
    partial = shown[-1] == "…"
    return OutputBlock(block.page, " ".join(lines[0][2:].split()), tuple(shown[:-1] if partial else shown), partial)


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces as
    hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = BLOCK.sub("", path.read_text())
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def links(path: Path) -> list[str]:
    """The targets of the page's markdown links, outside code."""
    text = re.sub(r"`[^`\n]*`", "", BLOCK.sub("", path.read_text()))
    return re.findall(r"\]\(([^)\s]+)\)", text)


def masked(lines) -> list[str]:
    for timing in TIMINGS:
        lines = [timing.sub(r"\1 …", line) for line in lines]
    return list(lines)


def assert_prints_the_block(shown: OutputBlock, printed: list[str]) -> None:
    """``printed`` (what ``shown.command`` printed, line by line) is what the block shows, the
    timings masked; of a partial block, the lines it shows come first and more follow."""
    printed, expected = masked(printed), masked(shown.lines)
    if shown.partial:
        assert len(printed) > len(expected), "the block ends with … but shows everything"
        printed = printed[:len(expected)]
    assert printed == expected, f"{shown.page}: {shown.command}"
