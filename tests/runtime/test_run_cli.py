"""`memshard run` end to end, saved plans, and a rank that dies mid-step."""

from __future__ import annotations

import json
import time

import pytest

import memshard
from memshard.api import strategy_plan
from memshard.cli import main
from memshard.core.errors import MemshardError
from memshard.plans.plan import load_plan
from memshard.runtime.launch import launch
from memshard.runtime.train import KILL_ENV
from tests.runtime_plans import least_memory, saved


def test_a_saved_plan_loads_back_to_the_same_choices(tmp_path):
    # memshard.plan("tiny-llama", "2x2", batch=8, precision="fp32", mip_gap=0.05): the runtime
    # tests' saved search, which test_runtime_plans.py checks is what a fresh search finds
    plan = saved(least_memory("tiny-llama", "2x2"))
    path = tmp_path / "plan.json"
    plan.save(str(path))
    loaded = load_plan(str(path))
    assert loaded.selection == plan.selection
    assert loaded.peak_bytes == plan.peak_bytes
    assert loaded.to_dict()["communication"] == plan.to_dict()["communication"]


def test_a_baseline_on_a_finer_logical_mesh_loads_back(tmp_path):
    plan = strategy_plan("tiny-gpt", "1x4", "megatron-tp2-dp2-sp", batch=4, precision="fp32")
    path = tmp_path / "plan.json"
    plan.save(str(path))
    loaded = load_plan(str(path))
    assert loaded.problem.mesh.shape == plan.problem.mesh.shape == (1, 2, 2)
    assert loaded.selection == plan.selection


@pytest.mark.parametrize("text, message", [
    ("{", "not valid JSON"),
    ('{"schema": "other"}', "not a memshard plan"),
    ('{"schema": "memshard.plan/1", "model": {}}', "does not match"),
])
def test_bad_plan_files_give_one_clear_error(tmp_path, capsys, text, message):
    path = tmp_path / "plan.json"
    path.write_text(text)
    assert main(["run", "--plan", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_run_refuses_an_unknown_strategy(capsys):
    assert main(["run", "--model", "tiny-gpt", "--mesh", "2", "--strategy", "nonsense"]) == 2
    assert "unknown strategy" in capsys.readouterr().err


@pytest.fixture(scope="module")
def zero3_mixed_run(tmp_path_factory) -> tuple[str, dict]:
    """``memshard run`` of ZeRO-3 over 2 ranks in mixed precision, once for the tests that read
    it: what it printed and its ``--json``."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("run") / "run.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["run", "--model", "tiny-gpt", "--mesh", "2", "--strategy", "zero3-fsdp", "--precision", "mixed",
                     "--steps", "2", "--json", str(out)])
    assert code == 0
    return printed.getvalue(), json.loads(out.read_text())


def test_memshard_run_runs_a_mixed_precision_plan(zero3_mixed_run):
    """ZeRO-3 in mixed precision keeps the fp32 master as the weight shard (4 bytes per element,
    half of each over 2 ranks) beside its moments (8 bytes), gathered in bf16: the command runs
    them as planned."""
    rank = zero3_mixed_run[1]["ranks"][0]
    numel = memshard.build_graph("tiny-gpt", batch=2, precision="mixed").num_parameters
    breakdown = rank["measured"]["breakdown"]
    assert 2 * numel <= breakdown["parameters"] <= 2 * numel + 4 * 64
    assert breakdown["optimizer_states"] == pytest.approx(rank["predicted"]["breakdown"]["optimizer_states"], rel=0.01)
    assert 4 * numel <= breakdown["optimizer_states"] <= 4 * numel + 8 * 64


def test_memshard_run_trains_and_reports_every_rank(zero3_mixed_run):
    """(The mixed-precision run: its weight shards are fp32 masters, as an fp32 run's are.)"""
    text, data = zero3_mixed_run
    assert "predicted vs measured" in text and "rank 1" in text
    assert data["schema"] == "memshard.run/1" and [r["rank"] for r in data["ranks"]] == [0, 1]
    first = data["ranks"][0]
    assert len(first["losses"]) == 2 and first["losses"] == data["ranks"][1]["losses"]
    # ZeRO-3 over 2 ranks: each holds half of every (flattened, padded) weight
    params = first["measured"]["breakdown"]["parameters"]
    total = memshard.build_graph("tiny-gpt", batch=2, precision="fp32").num_parameters * 4
    assert total / 2 <= params <= total / 2 + 4 * 64


def test_a_rank_that_dies_mid_step_stops_the_run_with_a_message(tmp_path):
    """Rank 1 of 2 dies in its second step, after its backward, while rank 0 goes on into the
    next collective. (A middle rank of 4 dying: tests/runtime/test_launch.py.)"""
    plan = strategy_plan("tiny-gpt", "2", "dp", batch=4, precision="fp32")
    path = tmp_path / "plan.json"
    plan.save(str(path))
    start = time.monotonic()
    with pytest.raises(MemshardError) as info:
        launch("memshard.runtime.train", ["--plan", str(path), "--steps", "3"], 2,
               env={KILL_ENV: "1:1"}, timeout_s=120)
    assert time.monotonic() - start < 60
    assert "rank 1 of 2" in str(info.value) and "SIGKILL" in str(info.value)
