"""The README stays true: its commands run, its output blocks are what memshard prints now.

Every ``memshard …`` command in the README's code blocks is either run here (``COMMANDS``) or
listed in ``NOT_RUN`` with the reason (a new command must be put in one or the other). The
worked example's output is compared line by line (the solver's time masked), the simulate
example's predicted column and the comparison's figures against freshly made plans, and the
Python blocks are executed, or, where they need a cluster or minutes, compiled. Commands that
start gloo ranks are marked ``runtime`` and those that trace a module ``trace``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import memshard
from memshard.cli import main
from memshard.core.quantities import format_bytes, format_seconds

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```(\w*)\n(.*?)```", README, re.S)

WORKED = "memshard plan --model gpt3-6.7b --mesh 2x4 --batch 16 --seq 2048 --brief"
SIMULATED = "memshard simulate --model gpt3-1.3b --mesh 2x4 --batch 8 --seq 1024"

# command → pytest marks (the command runs in a fresh folder; it must exit with 0)
COMMANDS = {
    "memshard models": (),
    "memshard plan --model llama3-8b --mesh 8x8 --batch 64 --seq 4096": (),
    "memshard plan --model gpt3-175b --mesh 8x8x16 --batch 1536 --seq 2048 --micro-batches 48 "
    "--memory-budget 80GiB --objective time": (),
    "memshard plan --model gpt3-6.7b --mesh 2x4 --json plan.json": (),
    "memshard compare --model gpt3-6.7b --mesh 2x4 --batch 16 --seq 2048": (),
    "memshard plan --hf-model gpt2 --mesh 4 --batch 8 --seq 1024": (),
    "memshard compare --hf-model llama --layers 2 --hidden 64 --heads 4 --kv-heads 2 --vocab 256 --mesh 4 "
    "--batch 4 --seq 64 --precision autocast": (),
    "memshard run --model tiny-gpt --mesh 2x2 --steps 3": (),
    "memshard plan --model gpt3-13b --mesh 1x8 --batch 16 --seq 2048 --objective time --memory-budget 80GiB "
    "--recompute auto": (),
    "memshard fit --model llama3-8b --mesh 8x8 --seq 8192 --max batch --no-baselines": (),
}
NOT_RUN = {
    "memshard export --hf-config examples/tiny_llama.json --mesh 4 --batch 4 --seq 32 --strategy fsdp2":
        "run and compared with its output block in tests/test_export.py",
    "memshard export --model gpt3-6.7b --mesh 2x4 --batch 16 --seq 2048 --strategy megatron-tp4-dp2-sp-distopt":
        "run and compared with its output block in tests/test_export.py",
    "memshard fit --model llama3-8b --mesh 8x8 --seq 8192 --max batch --plot fit.png --json fit.json":
        "40 s of baselines; tests/test_fit.py checks every baseline's answer against a full scan",
    "memshard fit --model llama3-8b --mesh 8x8 --seq 8192 --max batch":
        "the same as with --plot and --json",
    "memshard fit --model llama3-70b --mesh 8x8 --batch 64 --seq 4096 --min devices":
        "100 s of baselines; tests/test_fit.py checks the fewest devices against a full scan",
    "memshard pareto --model gpt3-2.7b --mesh 2x4 --batch 16 --seq 2048 --out pareto.png":
        "minutes of solving; tests/test_pareto.py sweeps smaller jobs and checks the PNG",
    "memshard simulate --model gpt3-6.7b --mesh 8x8 --batch 64 --seq 2048":
        "a billion-parameter simulate; tests/test_simulate.py runs such ranks",
    WORKED: "run and compared line by line in test_the_worked_example_prints_what_the_readme_shows",
    SIMULATED: "a billion-parameter simulate: its predicted column is checked against the plan instead",
    "memshard run --model tiny-gpt --mesh 1x4 --strategy megatron-tp4-sp":
        "the same runtime as the tiny-gpt run; every baseline runs in tests/test_runtime.py",
    "memshard run --plan plan.json --json run.json": "needs an fp32 plan.json of a small job",
    "memshard run --hf-config examples/tiny_llama.json --mesh 4 --batch 4 --seq 16 --steps 2":
        "4 gloo ranks for 15 s: the shipped config is traced and planned in test_the_shipped_llama_config_plans; "
        "traced LLaMA runs on gloo ranks in tests/test_traced_runtime.py",
    "memshard plan --hf-config path/to/config.json --mesh 2x4 --batch 8 --seq 2048": "a placeholder path",
    "memshard plan --model gpt3-6.7b --mesh 2x8 --batch 32 --seq 2048 --json plan.json":
        "the cluster example's first step (its torchrun step needs 16 ranks)",
}


def readme_commands() -> list[str]:
    """Every ``memshard …`` command of the README's code blocks (comments and ``$`` dropped,
    continued lines joined)."""
    out = []
    for lang, body in BLOCKS:
        if lang not in ("", "sh", "bash", "console"):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            line = line.removeprefix("$ ").split("#")[0]
            if line.startswith("memshard ") and " --" in line or line.strip() == "memshard models":
                out.append(" ".join(line.split()))
    return out


def _block_after(command: str) -> list[str]:
    """The output printed under ``$ command`` in the README."""
    body = next(body for _, body in BLOCKS if body.startswith(f"$ {command}\n"))
    return [line.rstrip() for line in body.splitlines()[1:]]


def _run(argv: list[str], capsys) -> list[str]:
    capsys.readouterr()
    assert main(argv) == 0
    return [line.rstrip() for line in capsys.readouterr().out.splitlines()]


def test_every_command_is_run_or_says_why_not():
    commands = readme_commands()
    assert WORKED in commands and SIMULATED in commands
    unknown = [c for c in commands if c not in COMMANDS and c not in NOT_RUN]
    assert not unknown, f"README commands neither run nor listed in NOT_RUN: {unknown}"
    assert not set(COMMANDS) & set(NOT_RUN)
    stale = [c for c in (*COMMANDS, *NOT_RUN) if c not in commands]
    assert not stale, f"no longer in the README: {stale}"


@pytest.mark.parametrize("command", [pytest.param(c, marks=m, id=c.removeprefix("memshard ")[:60])
                                     for c, m in COMMANDS.items()])
def test_the_command_runs(command, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    out = _run(command.split()[1:], capsys)
    assert out
    if command.startswith("memshard run"):
        # every rank's peak within 2% of the prediction: no rank is named below the tables
        assert not [line for line in out if line.startswith("! rank")], out


def test_the_shipped_llama_config_plans(capsys):
    out = _run(["plan", "--hf-config", str(ROOT / "examples" / "tiny_llama.json"), "--mesh", "4", "--batch", "4",
                "--seq", "16", "--precision", "fp32", "--brief"], capsys)
    assert out[0].startswith("hf:tiny_llama.json (")


def test_the_worked_example_prints_what_the_readme_shows(capsys):
    mask = re.compile(r"(solver: HiGHS \w+), [0-9.]+ s,")
    expected = [mask.sub(r"\1, … s,", line) for line in _block_after(WORKED)]
    printed = [mask.sub(r"\1, … s,", line) for line in _run(WORKED.split()[1:], capsys)]
    assert printed == expected


def test_the_simulate_example_predicts_what_the_readme_shows():
    """The predicted column is the plan's (the measured one needs the 1.3B simulate itself)."""
    from memshard.api import runtime_plan

    plan = runtime_plan(memshard.Job("gpt3-1.3b", "2x4", batch=8, seq=1024))  # mixed precision
    rows = {row.split("│")[1].strip(): row.split("│")[2].strip()
            for row in _block_after(SIMULATED) if row.startswith("│")}
    predicted = {"peak memory": plan.peak_bytes, "communication / step": plan.communication.bytes_per_step}
    predicted |= plan.memory.breakdown
    predicted |= {kind: v["wire_bytes"] for kind, v in plan.communication.by_kind.items() if v["wire_bytes"]}
    for what, nbytes in predicted.items():
        assert rows[what] == format_bytes(nbytes), what


def test_the_comparison_figures_in_the_text():
    text = " ".join(README.split())
    found = re.search(r"lists memshard at (\S+ \S+), ZeRO-3 at (\S+ \S+), FSDP2 at (\S+ \S+), PyTorch's TP2 × FSDP4 at "
                      r"(\S+ \S+), Megatron-LM's TP8 \+ SP at (\S+ \S+) and TP4 \+ SP \+ distributed optimizer at "
                      r"(\S+ \S+), Megatron TP4 × DP2 at (\S+ \S+) and DDP at (\S+ \S+)\.", text)
    assert found, "the comparison sentence changed: update this test"
    rows = {r["strategy"]: r["peak_bytes_per_device"]
            for r in memshard.compare("gpt3-6.7b", "2x4", batch=16, seq=2048)["rows"]}
    names = ("memshard", "zero3-fsdp", "fsdp2", "torch-tp2-fsdp4", "megatron-tp8-sp", "megatron-tp4-dp2-sp-distopt",
             "megatron-tp4-dp2", "ddp")
    assert list(found.groups()) == [format_bytes(rows[n]) for n in names]


def test_the_recomputation_figures_in_the_text():
    text = " ".join(README.split())
    found = re.search(r"this job needs (\S+ \S+) per device at least; with `auto` the fastest plan that fits needs "
                      r"(\S+ \S+), takes an estimated (\S+ \S+) per step, of which (\S+ \S+) \((\S+)\) is "
                      r"recomputation, and replays (\d+) cheap ops of each of the (\d+) layers", text)
    assert found, "the recomputation sentence changed: update this test"
    job = dict(batch=16, seq=2048)
    least = memshard.plan("gpt3-13b", "1x8", **job)
    fits = memshard.plan("gpt3-13b", "1x8", objective="time", memory_budget="80GiB", recompute="auto", **job)
    replayed = [op for op in fits.ops if op.recomputed]
    assert list(found.groups()) == [
        format_bytes(least.peak_bytes), format_bytes(fits.peak_bytes), format_seconds(fits.step_time_s),
        format_seconds(fits.recompute_time_s), f"{fits.recompute_time_s / fits.step_time_s:.1%}",
        str(len(replayed)), str(replayed[0].instances)]


PYTHON = [body for lang, body in BLOCKS if lang == "python"]


def test_the_python_blocks_compile():
    assert len(PYTHON) == 5
    for k, body in enumerate(PYTHON):
        compile(body, f"README python block {k}", "exec")


def test_the_api_blocks_run(tmp_path, monkeypatch):
    """The Python API block and the job-as-objects block that continues it (built-in models;
    most of the time goes to the plan under a step-time budget)."""
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    for k in (0, 1):
        exec(compile(PYTHON[k], f"README python block {k}", "exec"), scope)
    assert (tmp_path / "plan.json").exists()
    assert scope["tight"].step_time_s <= scope["fast"].step_time_s * 1.2 * (1 + 1e-9)


def test_the_traced_llama_block_runs(capsys):
    """LLaMA-3 8B's shapes traced on the meta device and planned on 8x8 (seconds)."""
    exec(compile(PYTHON[2], "README python block 2", "exec"), {})
    assert "Dims (names the trace gave" in capsys.readouterr().out


def test_the_fit_figures_in_the_text():
    from memshard.fitting import fit_job

    text = " ".join(README.split())
    found = re.search(r"memshard fits a batch of (\S+) sequences in (\S+ \S+); batch (\S+) needs (\S+ \S+) at least; "
                      r"found in (\d+) probes", text)
    assert found, "the fit sentence changed: update this test"
    answer = fit_job(memshard.Job("llama3-8b", "8x8", seq=8192), "batch", baselines=False).answers[0]
    assert list(found.groups()) == [f"{answer.value:,}", format_bytes(answer.plan.peak_bytes),
                                    f"{answer.next_probe.value:,}", format_bytes(answer.next_probe.bound_bytes),
                                    str(len(answer.probes))]


def test_the_large_mesh_fit_figures_in_the_text():
    from memshard.fitting import fit_job

    text = " ".join(README.split())
    found = re.search(r"GPT-3 175B on 8x8x16: `--step 128` finds batch (\S+) in \d+ s, batch (\S+) needing (\S+ \S+) at "
                      r"least", text)
    assert found, "the large-mesh fit sentence changed: update this test"
    answer = fit_job(memshard.Job("gpt3-175b", "8x8x16", seq=2048), "batch", step=128, baselines=False).answers[0]
    assert list(found.groups()) == [f"{answer.value:,}", f"{answer.next_probe.value:,}",
                                    format_bytes(answer.next_probe.bound_bytes)]
