"""The README and docs/ stay true: their commands run, their output blocks are what memshard
prints now, their Python blocks run.

Every ``memshard …`` command in the README's code blocks is run here (``COMMANDS``), is an
output block (run and compared), or is listed in ``NOT_RUN`` with the reason: a new command
must be put in one or the other. Every output block of the README and docs/ (``$ memshard …``
and what it prints) is run and compared line by line, the timings masked; a last line ``…``
leaves the rest out. The export blocks are compared in tests/baselines/test_export.py, and the
simulate block's predicted column against a freshly made plan (its measured one needs the 1.3B
simulate itself). Every Python block is run, or, where it needs ranks, compiled. The other
commands of docs/ are parsed in test_docs.py.
"""

from __future__ import annotations

import pytest

import memshard
from memshard.cli import main
from memshard.core.quantities import format_bytes
from tests.docs.markdown import (
    README,
    ROOT,
    assert_prints_the_block,
    blocks,
    commands,
    output_block,
    page_name,
    pages,
)

README_BLOCKS = blocks(README)
ALL_BLOCKS = [block for page in pages() for block in blocks(page)]
OUTPUT_BLOCKS = [shown for block in ALL_BLOCKS if (shown := output_block(block))]

WORKED = "memshard plan --model gpt3-6.7b --mesh 2x4 --batch 16 --seq 2048 --brief"
SIMULATED = "memshard simulate --model gpt3-1.3b --mesh 2x4 --batch 8 --seq 1024"
PIPELINED_FIT = ("memshard fit --model tiny-gpt --mesh 2x2 --batch 8 --micro-batches 4 --max batch --pipeline 2 "
                 "--device-memory 6MiB")
COMPARED_ELSEWHERE = {
    SIMULATED: "a billion-parameter simulate: its predicted column is checked against the plan instead",
    "memshard export --hf-config examples/tiny_llama.json --mesh 4 --batch 4 --seq 32 --strategy fsdp2":
        "run and compared with its output block in tests/baselines/test_export.py",
    "memshard export --model gpt3-6.7b --mesh 2x4 --batch 16 --seq 2048 --strategy megatron-tp4-dp2-sp-distopt":
        "run and compared with its output block in tests/baselines/test_export.py",
    PIPELINED_FIT: "run and compared with its output block in tests/planner/test_fit.py, whose fit it is",
}

# command (in the README or docs/) → pytest marks; it runs in a fresh folder and must exit with 0
COMMANDS = {
    "memshard models": (),
    "memshard plan --model llama3-8b --mesh 8x8 --batch 64 --seq 4096": (),
    "memshard plan --model gpt3-175b --mesh 8x8x16 --batch 1536 --seq 2048 --micro-batches 48 "
    "--memory-budget 80GiB --objective time": (),
    "memshard plan --model gpt3-6.7b --mesh 2x4 --json plan.json": (),
    "memshard plan --hf-model gpt2 --mesh 4 --batch 8 --seq 1024": (),
    "memshard compare --hf-model llama --layers 2 --hidden 64 --heads 4 --kv-heads 2 --vocab 256 --mesh 4 "
    "--batch 4 --seq 64 --precision autocast": (),
    "memshard run --model tiny-gpt --mesh 2x2 --steps 3": (),
}
# README commands that are neither run above nor an output block of the README, and why
NOT_RUN = {
    "memshard compare --model gpt3-6.7b --mesh 2x4 --batch 16 --seq 2048":
        "run and compared with its output block in docs/baselines.md",
    "memshard fit --model llama3-8b --mesh 8x8 --seq 8192 --max batch --no-baselines":
        "run and compared with its output block in docs/fit.md",
    "memshard plan --model gpt3-6.7b --mesh 2x8 --batch 32 --seq 2048 --json plan.json":
        "the cluster example's first step (its torchrun step needs 16 ranks)",
}


def readme_commands() -> list[str]:
    return [c for block in README_BLOCKS for c in commands(block)]


def docs_commands() -> set[str]:
    return {c for block in ALL_BLOCKS for c in commands(block)}


def test_every_command_is_run_or_says_why_not():
    commands_here = readme_commands()
    shown = {b.command for b in OUTPUT_BLOCKS if b.page == "README.md"}
    assert WORKED in shown
    unknown = [c for c in commands_here if c not in COMMANDS and c not in NOT_RUN and c not in shown]
    assert not unknown, f"README commands neither run nor listed in NOT_RUN: {unknown}"
    assert not set(COMMANDS) & set(NOT_RUN) and not set(NOT_RUN) & shown
    assert not [c for c in NOT_RUN if c not in commands_here], "NOT_RUN lists commands no longer in the README"
    assert not [c for c in COMMANDS if c not in docs_commands()], "COMMANDS lists commands no longer in the docs"


def test_the_command_check_can_fail(monkeypatch):
    listed = readme_commands()
    monkeypatch.setattr(f"{__name__}.readme_commands", lambda: [*listed, "memshard plan --model new"])
    with pytest.raises(AssertionError, match="neither run nor listed"):
        test_every_command_is_run_or_says_why_not()


def _run(argv: list[str], capsys, code: int = 0) -> list[str]:
    capsys.readouterr()
    assert main(argv) == code
    captured = capsys.readouterr()
    return [line.rstrip() for line in (captured.out if code == 0 else captured.err).splitlines()]


@pytest.mark.parametrize("command", [pytest.param(c, marks=m, id=c.removeprefix("memshard ")[:60])
                                     for c, m in COMMANDS.items()])
def test_the_command_runs(command, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    out = _run(command.split()[1:], capsys)
    assert out
    if command.startswith("memshard run"):
        # every rank's peak within 2% of the prediction: no rank is named below the tables
        assert not [line for line in out if line.startswith("! rank")], out


COMPARED = [b for b in OUTPUT_BLOCKS if b.command not in COMPARED_ELSEWHERE]


def test_the_output_blocks_are_where_they_should_be():
    assert {(b.page, b.command) for b in OUTPUT_BLOCKS if b.command in (WORKED, SIMULATED)} == {
        ("README.md", WORKED), ("docs/runtime.md", SIMULATED)}
    assert {b.page for b in COMPARED} >= {"README.md", "docs/baselines.md", "docs/recomputation.md", "docs/fit.md"}
    assert sorted(c for c in COMPARED_ELSEWHERE) == sorted(b.command for b in OUTPUT_BLOCKS if b not in COMPARED)


@pytest.mark.parametrize("shown", COMPARED, ids=[f"{b.page}: {b.command[9:70]}" for b in COMPARED])
def test_the_output_block_is_what_memshard_prints(shown, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    error = shown.lines[0].startswith("memshard: error:")
    assert_prints_the_block(shown, _run(shown.command.split()[1:], capsys, code=2 if error else 0))


def test_the_shipped_llama_config_plans(capsys):
    out = _run(["plan", "--hf-config", str(ROOT / "examples" / "tiny_llama.json"), "--mesh", "4", "--batch", "4",
                "--seq", "16", "--precision", "fp32", "--brief"], capsys)
    assert out[0].startswith("hf:tiny_llama.json (")


def test_the_simulate_example_predicts_what_the_docs_show():
    """The predicted column is the plan's (the measured one needs the 1.3B simulate itself)."""
    from memshard.api import runtime_plan

    plan = runtime_plan(memshard.Job("gpt3-1.3b", "2x4", batch=8, seq=1024))  # mixed precision
    shown = next(b for b in OUTPUT_BLOCKS if b.command == SIMULATED)
    rows = {row.split("│")[1].strip(): row.split("│")[2].strip() for row in shown.lines if row.startswith("│")}
    predicted = {"peak memory": plan.peak_bytes, "communication / step": plan.communication.bytes_per_step}
    predicted |= plan.memory.breakdown
    predicted |= {kind: v["wire_bytes"] for kind, v in plan.communication.by_kind.items() if v["wire_bytes"]}
    for what, nbytes in predicted.items():
        assert rows[what] == format_bytes(nbytes), what


# -- the Python blocks ---------------------------------------------------------------------------
def python_blocks() -> dict[tuple[str, int], str]:
    """(page, index among the page's Python blocks) → the block."""
    out = {}
    for page in pages():
        for k, body in enumerate(b.body for b in blocks(page) if b.lang == "python"):
            out[(page_name(page), k)] = body
    return out


PYTHON = python_blocks()
RUN = {("README.md", 0), ("docs/guide.md", 0), ("docs/guide.md", 1), ("docs/models.md", 0),
       ("docs/pipelining.md", 0)}
COMPILED_ONLY = {
    ("README.md", 1): "needs torchrun's ranks and a plan.json of them (tests/runtime runs parallelize)",
    ("docs/runtime.md", 0): "needs a process group of 4 ranks (tests/runtime/test_traced_runtime.py runs one)",
    **{("docs/training.md", k): "needs ranks (tests/runtime/test_training_loop.py runs this loop)" for k in range(4)},
}


def test_every_python_block_is_run_or_says_why_not():
    assert set(PYTHON) == RUN | set(COMPILED_ONLY), set(PYTHON) ^ (RUN | set(COMPILED_ONLY))


@pytest.mark.parametrize("key", sorted(PYTHON), ids=[f"{p} {k}" for p, k in sorted(PYTHON)])
def test_the_python_block_compiles(key):
    compile(PYTHON[key], f"{key[0]} python block {key[1]}", "exec")


def _exec(keys, scope: dict) -> dict:
    for key in keys:
        exec(compile(PYTHON[key], f"{key[0]} python block {key[1]}", "exec"), scope)
    return scope


def test_the_readme_api_block_runs(tmp_path, monkeypatch, searched_once):
    """(``searched_once``: the guide's block makes some of its calls.)"""
    monkeypatch.chdir(tmp_path)
    scope = _exec([("README.md", 0)], {})
    assert scope["again"].peak_bytes == scope["plan"].peak_bytes
    assert scope["fast"].step_time_s <= scope["plan"].step_time_s * (1 + 2e-3)
    assert scope["rows"][0]["peak_bytes_per_device"] == scope["plan"].peak_bytes


def test_the_guide_api_blocks_run(tmp_path, monkeypatch, searched_once):
    """The Python API block and the job-as-objects block that continues it (built-in models;
    most of the time goes to the plan under a step-time budget)."""
    monkeypatch.chdir(tmp_path)
    scope = _exec([("docs/guide.md", 0), ("docs/guide.md", 1)], {})
    assert (tmp_path / "plan.json").exists()
    assert scope["tight"].step_time_s <= scope["fast"].step_time_s * 1.2 * (1 + 1e-9)
    assert scope["most"].answers[0].value == 111


def test_the_traced_llama_block_runs(capsys):
    """LLaMA-3 8B's shapes traced on the meta device and planned on 8x8 (seconds)."""
    _exec([("docs/models.md", 0)], {})
    assert "Dims (names the trace gave" in capsys.readouterr().out


def test_the_pipeline_schedule_block_prints_what_the_page_shows(capsys):
    """docs/pipelining.md's schedule example, and the text block after it."""
    page = next(p for p in pages() if page_name(p) == "docs/pipelining.md")
    shown = next(b.body for b in blocks(page) if b.lang == "text")
    _exec([("docs/pipelining.md", 0)], {})
    assert capsys.readouterr().out.strip() == shown.strip()
