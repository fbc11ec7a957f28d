"""The command line, run as a user runs it: a subprocess, its exit code, stdout and stderr.

The bad inputs are refused in this process, by ``memshard.cli.main`` (the code a subprocess
runs, without an interpreter started for each): its exit status, stdout and stderr. A
subprocess's exit status 2 and its one line are checked by the refusals after them (an
infeasible budget, a too-short time limit, an unwritable path)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

import memshard
from memshard.cli import main
from memshard.models import PRESETS

# Small knobs that keep a plan to a second or two (one mesh axis; see test_planner.py).
SMALL = ["--layers", "2", "--hidden", "128", "--heads", "2", "--vocab", "1024", "--ffn", "256",
         "--batch", "4", "--seq", "64", "--mesh", "4"]


def cli_env(columns: int | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "FORCE_COLOR")}
    env["NO_COLOR"] = "1"
    if columns is not None:
        env["COLUMNS"] = str(columns)
    return env


def memshard_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "memshard.cli", *args]


def run(*args: str, columns: int | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(memshard_cmd(*args), capture_output=True, text=True, timeout=timeout,
                          env=cli_env(columns))


# -- models ----------------------------------------------------------------------------------------
def closed_form_parameters(name: str) -> int:
    c = PRESETS[name]
    L, h, f, V, P = c.num_layers, c.hidden, c.ffn, c.vocab, c.max_positions
    if c.family == "gpt":
        return V * h + P * h + L * (4 * (h * h + h) + (h * f + f) + (f * h + h) + 4 * h) + 2 * h
    if c.family == "llama":
        kv = h * c.num_kv_heads // c.heads
        return 2 * V * h + L * (2 * h * h + 2 * h * kv + 3 * h * f + 2 * h) + h
    if c.family == "bert":
        layer = 4 * (h * h + h) + (h * f + f) + (f * h + h) + 4 * h
        return V * h + P * h + 4 * h + L * layer + (h * h + h) + 2 * h + V
    raise AssertionError(c.family)


def test_closed_form_matches_published_exact_counts():
    # HF GPT2LMHeadModel / LlamaForCausalLM, so the reference below is itself checked
    assert closed_form_parameters("gpt2") == 124_439_808
    assert closed_form_parameters("llama2-7b") == 6_738_415_616
    assert closed_form_parameters("llama3-8b") == 8_030_261_248
    assert closed_form_parameters("llama3-70b") == 70_553_706_496


def parse_count(text: str) -> float:
    m = re.fullmatch(r"([0-9.]+)\s*([KMBT])", text.strip())
    assert m, f"cannot read a parameter count from {text!r}"
    return float(m.group(1)) * {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}[m.group(2)]


@pytest.mark.parametrize("columns", [200, None], ids=["wide-terminal", "pipe-default-width"])
def test_models_lists_every_preset_with_its_parameter_count(columns):
    """Each preset's name in full and its parameter count (to the printed precision), also when
    the output goes to a pipe (no terminal: rich's default width of 80 columns)."""
    r = run("models", columns=columns)
    assert r.returncode == 0, r.stderr
    rows = {}
    for line in r.stdout.splitlines():
        cells = [c.strip() for c in re.split(r"[│┃|]", line)]
        cells = [c for c in cells if c]
        if cells and cells[0] in PRESETS:
            rows[cells[0]] = cells
    assert set(rows) == set(PRESETS), f"presets missing or truncated in:\n{r.stdout}"
    for name, cells in rows.items():
        counts = [c for c in cells if re.fullmatch(r"[0-9.]+\s*[KMBT]", c)]
        assert len(counts) == 1, cells
        shown = parse_count(counts[0])
        exact = closed_form_parameters(name)
        # three significant digits at least
        assert abs(shown - exact) <= 5e-3 * exact, (name, counts[0], exact)


# -- plan and its JSON ----------------------------------------------------------------------------
def test_plan_json_is_deterministic(tmp_path):
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    # What is checked is that two runs write the same file, not memshard's optimum: a 2% gap
    # (the search's first pass and tie-break pass, a tenth of the default gap's time)
    args = ["plan", "--model", "gpt2", "--mesh", "2x2", "--batch", "4", "--seq", "128", "--gap", "0.02"]
    # both runs at once: two cores
    procs = [subprocess.Popen(memshard_cmd(*args, "--json", str(p)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=cli_env(120)) for p in paths]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    texts = [p.read_text() for p in paths]
    docs = [json.loads(t) for t in texts]
    d = docs[0]
    assert d["schema"] == "memshard.plan/3"
    assert d["mesh"]["shape"] == [2, 2]
    assert d["model"]["num_parameters"] == 124_439_808
    assert d["model"]["batch"] == 4 and d["model"]["seq"] == 128
    # the one wall-clock field differs at most; replace it, then the files are byte-identical
    times = [doc["solver"]["time_s"] for doc in docs]
    assert all(isinstance(t, float) and t > 0 for t in times)
    normalised = []
    for text, t in zip(texts, times, strict=True):
        solver_at = text.index('"solver": {')
        m = re.compile(r'"time_s": ([0-9.eE+-]+)').search(text, solver_at)
        assert m and m.start() < text.index("}", solver_at) and float(m.group(1)) == t
        normalised.append(text[: m.start(1)] + "0" + text[m.end(1):])
    assert normalised[0] == normalised[1]
    # and that field really is the only one touched
    for doc in docs:
        doc["solver"]["time_s"] = 0
    assert docs[0] == docs[1]
    # the text report says where the plan went
    assert f"plan written to {paths[0]}" in " ".join(outs[0][0].split())


# -- errors ------------------------------------------------------------------------------------------
BAD = {
    "unknown-model": ["plan", "--model", "gpt5", "--mesh", "2x2"],
    "mesh-2x0": ["plan", "--model", "gpt2", "--mesh", "2x0"],
    "mesh-abc": ["plan", "--model", "gpt2", "--mesh", "abc"],
    "negative-batch": ["plan", "--model", "gpt2", "--mesh", "2x2", "--batch", "-4"],
    "heads-not-dividing-hidden": ["plan", "--model", "gpt2", "--mesh", "2x2", "--hidden", "100", "--heads", "7"],
    "bandwidth-not-a-number": ["plan", "--model", "gpt2", "--mesh", "2x2", "--bandwidth", "100,fast"],
    "bandwidth-wrong-count": ["plan", "--model", "gpt2", "--mesh", "2x2", "--bandwidth", "100"],
    "bandwidth-zero": ["plan", "--model", "gpt2", "--mesh", "2x2", "--bandwidth", "0,100"],
    "bandwidth-negative": ["plan", "--model", "gpt2", "--mesh", "2x2", "--bandwidth=-5,100"],
    # On the small model: if these are not refused, the test fails in seconds, not minutes.
    "bandwidth-nan": ["plan", "--model", "gpt2", *SMALL, "--bandwidth", "nan"],
    "latency-negative": ["plan", "--model", "gpt2", *SMALL, "--latency=-5"],
    "peak-tflops-nan": ["plan", "--model", "gpt2", *SMALL, "--peak-tflops", "nan"],
    "peak-tflops-negative": ["plan", "--model", "gpt2", *SMALL, "--peak-tflops=-1"],
    "device-memory-unreadable": ["plan", "--model", "gpt2", *SMALL, "--device-memory", "lots"],
    "gap-out-of-range": ["plan", "--model", "gpt2", *SMALL, "--gap", "2"],
    "micro-batches-not-dividing": ["plan", "--model", "gpt2", *SMALL, "--micro-batches", "3"],
    "axis-names-miscounted": ["plan", "--model", "gpt2", *SMALL, "--axis-names", "a,b"],
    "no-command": [],
    "unknown-option": ["plan", "--model", "gpt2", "--mesh", "2x2", "--frobnicate"],
}


def assert_one_line_error(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout
    lines = r.stderr.strip("\n").splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("memshard: error:"), lines[0]
    return lines[0]


def run_here(args: list[str], capsys) -> subprocess.CompletedProcess:
    """``memshard <args>`` run by ``main`` in this process, as a subprocess's result."""
    capsys.readouterr()
    code = main(args)
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, captured.out, captured.err)


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line_exit_2_and_leaves_json_alone(case, tmp_path, capsys):
    target = tmp_path / "plan.json"
    target.write_text("precious\n")
    args = BAD[case] + (["--json", str(target)] if BAD[case] else [])
    # a bad input must be refused before any solving: a few seconds at most
    start = time.perf_counter()
    r = run_here(args, capsys)
    assert time.perf_counter() - start < 10
    line = assert_one_line_error(r)
    assert target.read_text() == "precious\n"
    assert list(tmp_path.iterdir()) == [target]  # no temporary file left behind either
    if case == "unknown-model":
        assert "gpt5" in line
    if case.startswith("mesh"):
        assert BAD[case][-1] in line


def test_memory_budget_below_the_minimum_states_the_minimum(tmp_path):
    target = tmp_path / "plan.json"
    target.write_text("precious\n")
    r = run("plan", "--model", "gpt2", *SMALL, "--objective", "time", "--memory-budget", "1MiB",
            "--mesh-views", "off", "--json", str(target))
    line = assert_one_line_error(r)
    assert target.read_text() == "precious\n"
    m = re.search(r"least any plan needs is ([0-9.]+) (KiB|MiB|GiB)", line)
    assert m, line
    least = float(m.group(1)) * {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[m.group(2)]
    # Ψ of this GPT by hand (2 layers, h 128, f 256, V 1024, 1024 positions): 527,360.
    # The least any plan needs is at least its model states spread over the 4 devices.
    h, f, V, P, L = 128, 256, 1024, 1024, 2
    psi = V * h + P * h + L * (4 * (h * h + h) + (h * f + f) + (f * h + h) + 4 * h) + 2 * h
    assert psi == 527_360
    assert least >= 16 * psi / 4 * (1 - 5e-3)  # printed to three digits
    assert least > 2**20
    # and it is the least-memory plan's peak (to the three digits printed), not some bound
    best = memshard.plan("gpt2", "4", batch=4, seq=64, num_layers=2, hidden=128, heads=2,
                         vocab=1024, ffn=256)
    assert least == pytest.approx(best.peak_bytes, rel=5e-3)


def test_time_limit_too_short_says_so(tmp_path):
    target = tmp_path / "plan.json"
    target.write_text("precious\n")
    r = run("plan", "--model", "gpt2", "--mesh", "2x2", "--batch", "4", "--seq", "128",
            "--time-limit", "1ms", "--json", str(target))
    line = assert_one_line_error(r)
    assert "time limit" in line and "--time-limit" in line
    assert target.read_text() == "precious\n"


def test_unwritable_json_path_is_a_clean_error(tmp_path):
    r = run("plan", "--model", "gpt2", *SMALL, "--json", str(tmp_path / "missing-dir" / "plan.json"))
    assert_one_line_error(r)


# -- startup -----------------------------------------------------------------------------------------
def test_help_is_fast_and_imports_no_solver_or_torch():
    start = time.perf_counter()
    r = subprocess.run(memshard_cmd("--help"), capture_output=True, text=True, timeout=30, env=cli_env())
    elapsed = time.perf_counter() - start
    assert r.returncode == 0
    assert "plan" in r.stdout and "models" in r.stdout
    assert elapsed < 1.0, elapsed
    code = ("import memshard.cli, sys; memshard.cli.build_parser(); "
            "print('highspy' in sys.modules, 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, env=cli_env())
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "False"]


def test_plan_help_is_fast():
    start = time.perf_counter()
    r = subprocess.run(memshard_cmd("plan", "--help"), capture_output=True, text=True, timeout=30, env=cli_env())
    assert r.returncode == 0 and "--mesh" in r.stdout
    assert time.perf_counter() - start < 1.0


def test_plan_with_zero3_per_layer(tmp_path):
    out = tmp_path / "plan.json"
    r = run("plan", "--model", "tiny-gpt", "--mesh", "2x2", "--zero3-unit", "layer", "--gap", "0.05",
            "--json", str(out), "--brief")
    assert r.returncode == 0, r.stderr
    assert "ZeRO-3 weights gathered per layer" in r.stdout
    assert json.loads(out.read_text())["solver"]["zero3_unit"] == "layer"
    bad = run("plan", "--model", "tiny-gpt", "--mesh", "2x2", "--zero3-unit", "block")
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
