"""The job every command shares, the search options, the plan as data and its JSON mirror,
one CLI vocabulary, and the ILP's tagged rows."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import memshard
from memshard.cli import build_parser
from memshard.core.errors import MemshardError
from memshard.core.hardware import hardware_from_dict
from memshard.core.mesh import parse_mesh
from memshard.job import HFModel, Job
from memshard.planner import SearchOptions, plan_job
from memshard.plans.advice import reselect
from memshard.plans.plan import load_plan, plan_from_dict
from memshard.problem.evaluate import evaluate
from memshard.problem.records import OpGroup
from memshard.search.formulation import Formulation
from memshard.search.highs import HighsSearch

TINY = dict(batch=4, seq=32, num_layers=2, hidden=64, heads=2, vocab=128, ffn=128)
TINY_FLAGS = ["--batch", "4", "--seq", "32", "--layers", "2", "--hidden", "64", "--heads", "2", "--vocab", "128",
              "--ffn", "128"]


# -- the job ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("job", [
    Job("gpt2", "2x2", batch=8, seq=64, micro_batches=2, overrides={"num_layers": 2, "dropout": False},
        precision="fp32"),
    Job("llama3-8b", memshard.parse_mesh("8x8", device_memory_bytes=40 * 2**30).with_links((10e9, 100e9))),
    pytest.param(Job(HFModel({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                              "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
                              "vocab_size": 256}, "sdpa"), "4", batch=4, seq=16)),
], ids=["preset-knobs", "hardware", "hf-config"])
def test_a_job_reads_back_what_it_writes(job):
    if isinstance(job.model, HFModel):
        pytest.importorskip("transformers")
    data = job.to_dict()
    again = Job.from_dict({**data, "model": {**data["model"], "name": job.graph.name}})
    assert again.to_dict() == data
    assert again.mesh == job.mesh
    assert again.graph.num_parameters == job.graph.num_parameters
    assert (again.global_batch, again.graph.seq) == (job.global_batch, job.graph.seq)


def test_the_job_records_its_resolved_batch_and_sequence():
    job = Job("gpt2", "2x4")
    assert job.global_batch == 8  # one sequence per device
    assert job.to_dict()["model"]["seq"] == 1024 == job.graph.seq  # the preset's


@pytest.mark.parametrize("kwargs, message", [
    (dict(batch=6, micro_batches=4), "does not split"),
    (dict(batch=0), "positive"),
    (dict(batch="8"), "positive integer"),
    (dict(precision="bf16"), "unknown precision"),
    (dict(overrides={"layers": 2}), "unknown model option"),
])
def test_a_bad_job_is_one_clear_error(kwargs, message):
    with pytest.raises(MemshardError, match=message):
        Job("gpt2", "2x2", **kwargs)


def test_a_model_config_takes_the_knobs_it_is_given():
    cfg = memshard.get_config("gpt2")
    job = Job(cfg, "2", batch=2, seq=16, overrides={"num_layers": 1}, precision="fp32")
    assert job.graph.num_layers == 1 and job.graph.precision.name == "fp32"


# -- an override of the hidden size: one meaning, as fit --max hidden grows a model ----------------
def shape(job: Job) -> tuple[int, ...]:
    cfg = job.config
    return cfg.num_layers, cfg.hidden, cfg.heads, cfg.num_kv_heads, cfg.ffn, cfg.vocab


@pytest.mark.parametrize("name, hidden", [("gpt3-13b", 2304), ("llama3-8b", 2048), ("tiny-llama", 256)])
def test_an_overridden_hidden_size_is_the_model_fit_probes_at_that_size(name, hidden):
    from memshard.fitting import job_at

    fitted = job_at(Job(name, "2", batch=2, seq=32), "hidden", hidden)
    job = Job(name, "2", batch=2, seq=32, overrides={"hidden": hidden})
    assert shape(job) == shape(fitted) and shape(job)[1] == hidden
    assert job.graph.num_parameters == fitted.graph.num_parameters


def test_plan_with_an_overridden_hidden_size_reports_the_shape_and_count_fit_uses(tmp_path, capsys):
    from memshard.cli import main
    from memshard.core.quantities import format_parameters
    from memshard.fitting import job_at

    path = tmp_path / "plan.json"
    assert main(["plan", "--model", "gpt3-13b", "--hidden", "2304", "--mesh", "2", "--batch", "2", "--seq", "64",
                 "--brief", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    fitted = job_at(Job("gpt3-13b", "2", batch=2, seq=64), "hidden", 2304)
    assert (fitted.config.heads, fitted.config.ffn) == (18, 9216)  # the head size 128 and the 4× MLP kept
    count = fitted.graph.num_parameters
    data = json.loads(path.read_text())
    assert data["model"]["num_parameters"] == count
    assert data["model"]["overrides"] == {"hidden": 2304}  # recorded as given: it reads back to the same model
    assert plan_from_dict(data).model.num_parameters == count
    assert ("gpt3-13b (overridden: 40 layers, hidden 2304, 18 heads, ffn 9216, vocab 50257; "
            f"{format_parameters(count)}, mixed, batch 2, seq 64)") in out
    # what the preset's own MLP width of 20480 would make of it (the trap this meaning closes)
    assert count < Job("gpt3-13b", "2", batch=2, seq=64, overrides={"hidden": 2304, "ffn": 20480}).graph.num_parameters


def test_an_explicit_mlp_width_or_head_count_wins(tmp_path, capsys):
    from memshard.cli import main

    assert main(["plan", "--model", "gpt3-13b", "--hidden", "2304", "--ffn", "8000", "--layers", "1", "--mesh", "2",
                 "--batch", "2", "--seq", "64", "--brief"]) == 0
    assert "1 layer, hidden 2304, 18 heads, ffn 8000, vocab 50257;" in capsys.readouterr().out
    job = Job("llama3-8b", "2", batch=2, seq=32, overrides={"hidden": 2048, "heads": 32})
    assert shape(job) == (32, 2048, 32, 8, 7168, 128256)  # the kv-heads follow the heads given


def test_compare_and_export_state_the_overridden_shape_and_count(tmp_path, capsys):
    from memshard.cli import main
    from memshard.core.quantities import format_parameters

    job = Job("tiny-gpt", "4", batch=4, seq=32, overrides={"hidden": 256})
    figures = f"(overridden: 2 layers, hidden 256, 8 heads, ffn 1024, vocab 512; " \
              f"{format_parameters(job.graph.num_parameters)}, fp32)"
    assert main(["compare", "--model", "tiny-gpt", "--hidden", "256", "--mesh", "4", "--batch", "4"]) == 0
    assert f"tiny-gpt {figures} on mesh 4" in capsys.readouterr().out
    out = tmp_path / "x.py"
    assert main(["export", "--model", "tiny-gpt", "--hidden", "256", "--mesh", "4", "--batch", "4", "--strategy",
                 "fsdp2", "--out", str(out)]) == 0
    assert f"# Job: tiny-gpt {figures}, global batch 4" in out.read_text()
    # not overridden: the headline as before, no sizes
    assert main(["compare", "--model", "tiny-gpt", "--mesh", "4", "--batch", "4"]) == 0
    assert "overridden" not in capsys.readouterr().out


def test_a_hugging_face_config_is_resized_as_a_preset_is():
    pytest.importorskip("transformers")
    job = Job(HFModel("llama"), "2", batch=2, seq=16, overrides={"num_layers": 1, "hidden": 256})
    # LLaMA's default config: hidden 4096, 32 heads (of 128), 32 kv-heads, MLP 11008 (2.6875×)
    assert job.hf_overrides() == {"num_hidden_layers": 1, "hidden_size": 256, "num_attention_heads": 2,
                                  "num_key_value_heads": 2, "intermediate_size": 688}
    assert job.overridden_sizes() == "1 layer, hidden 256, 2 heads, ffn 688, vocab 32000"
    given = Job(HFModel("llama"), "2", batch=2, seq=16, overrides={"num_layers": 1, "hidden": 256, "ffn": 100})
    assert given.hf_overrides()["intermediate_size"] == 100
    # GPT-2 keeps its MLP width in n_inner (None: 4× the hidden size, which follows by itself)
    gpt2 = Job(HFModel("gpt2"), "2", batch=2, seq=16, overrides={"num_layers": 1, "hidden": 128})
    assert gpt2.hf_overrides() == {"num_hidden_layers": 1, "hidden_size": 128, "num_attention_heads": 2}
    assert Job(HFModel("gpt2"), "2", overrides={"ffn": 100}).hf_overrides() == {"n_inner": 100}
    with pytest.raises(MemshardError, match="no kv-heads"):
        Job(HFModel("gpt2"), "2", overrides={"kv_heads": 2}).hf_overrides()
    with pytest.raises(MemshardError, match="head size 128"):
        Job(HFModel("llama"), "2", overrides={"hidden": 100}).hf_overrides()


# -- search options --------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs", [
    dict(objective="memory", memory_budget="80GiB"),  # a budget the least-memory plan would ignore
    dict(objective="time", max_step_time_s=1.0),
    dict(objective="speed"),
    dict(mip_gap=1.0),
    dict(time_limit_s=0),
    dict(zero3_unit="block"),
])
def test_contradictory_or_bad_search_options_are_errors(kwargs):
    with pytest.raises(MemshardError):
        SearchOptions(**kwargs)


def test_the_gap_is_the_one_given_else_looser_for_the_least_memory_with_recomputation():
    """(whose bound is the peak's LP relaxation: ``SearchOptions.gap``)"""
    assert SearchOptions().gap == SearchOptions(objective="time", recompute="auto").gap == 2e-3
    assert SearchOptions(recompute="auto").gap == SearchOptions(recompute="full").gap == 0.03
    assert SearchOptions(recompute="auto", mip_gap=0.0).gap == 0.0 and SearchOptions(mip_gap=0.05).gap == 0.05


# -- the plan as data ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_plan():
    return memshard.plan("gpt2", "4", batch=8, seq=128, num_layers=1, precision="fp32")


def test_a_plan_reads_back_from_its_json(tiny_plan, tmp_path):
    data = tiny_plan.to_dict()
    assert plan_from_dict(json.loads(json.dumps(data))).to_dict() == data
    path = tmp_path / "plan.json"
    tiny_plan.save(str(path))
    assert load_plan(str(path)).to_dict() == data


def test_the_plan_carries_its_advice_and_the_report_only_formats_it(tiny_plan):
    assert [r.op for r in tiny_plan.most_redundant_ops] == [r["op"] for r in tiny_plan.to_dict()["most_redundant_ops"]]
    # the fastest plan replicates (a batch of 2 on 4 devices), so sharding some op further saves memory
    fastest = memshard.plan("gpt2", "4", batch=2, seq=128, num_layers=1, precision="fp32", objective="time",
                            memory_budget=float("inf"), mesh_views=False)
    advised = [r for r in fastest.most_redundant_ops if r.alternative is not None]
    assert advised
    text = memshard.format_plan(fastest)
    problem, selection = fastest.searched, fastest.searched_selection
    for row in advised:
        # the advice is the plan re-priced with that op split further, everything else kept
        gid = next(g for g, grp in enumerate(problem.groups) if isinstance(grp, OpGroup) and grp.key == row.op)
        choice = next(k for k, st in enumerate(problem.groups[gid].strategies)
                      if {problem.mesh.axis_names[a]: d for a, d in enumerate(st.assignment) if d} == row.alternative.split)
        again = evaluate(problem, reselect(problem, selection, gid, choice))
        assert row.alternative.peak_delta_bytes == again.peak_bytes - fastest.peak_bytes
        assert row.alternative.step_time_delta_s == again.step_time_s - fastest.step_time_s
        line = next(line for line in text.splitlines() if line.startswith(f"│ {row.op} "))
        assert " ".join(f"{a}:{d}" for a, d in row.alternative.split.items()) in line


def test_a_merged_mesh_plan_builds_the_real_problem_only_when_asked(monkeypatch):
    import memshard.planner
    import memshard.plans.plan

    built = []
    for module in (memshard.planner, memshard.plans.plan):
        original = module.build_problem
        monkeypatch.setattr(module, "build_problem", lambda *a, _f=original, **k: built.append(a[1]) or _f(*a, **k))
    # GPT-2's own dims, two layers: tiny dims make the ILP slow (a loose LP bound); nodes of
    # 2, so the two outer axes both cross nodes on one NIC each, and merge
    nodes_of_2 = hardware_from_dict({"base": "a100-80gb", "gpus_per_node": 2})
    job = Job("gpt2", parse_mesh("2x2x2", hardware=nodes_of_2), batch=8, seq=128, precision="fp32",
              overrides={"num_layers": 2})
    plan = plan_job(job, SearchOptions(mip_gap=0.01))
    assert [str(m) for m in built] == ["4x2"]  # the merged problem only
    assert plan.to_dict()["mesh"]["shape"] == [2, 2, 2]
    assert plan.problem.mesh.shape == (2, 2, 2) and [str(m) for m in built] == ["4x2", "2x2x2"]
    lifted = evaluate(plan.problem, plan.selection)
    assert lifted.peak_bytes == pytest.approx(plan.peak_bytes, rel=1e-12)
    assert lifted.step_time_s == pytest.approx(plan.step_time_s, rel=1e-12)


# -- the ILP's rows have names -----------------------------------------------------------------------
def test_a_binding_or_violated_row_is_named_by_family_and_point(tiny_plan):
    problem, selection = tiny_plan.searched, tiny_plan.searched_selection
    f = Formulation(problem)
    f.add_plan_constraints(problem.candidate_points)
    f.fix(selection)
    import time

    found = HighsSearch(f.model, time.perf_counter() + 60).minimise(f.peak_expression(), 0.0)
    peak_point = evaluate(problem, selection).peak_point
    assert f.model.violated(found.values) == []
    binding = f.model.binding(found.values, "memory") + f.model.binding(found.values, "reshard")
    assert peak_point in {tag.point for tag in binding}
    shrunk = found.values.copy()
    shrunk[f.peak] *= 0.5
    assert {tag.family for tag in f.model.violated(shrunk)} <= {"memory", "reshard"}
    assert any(tag.point == peak_point for tag in f.model.violated(shrunk))
    assert str(f.model.tags[0]).startswith("choice")


# -- one CLI vocabulary ----------------------------------------------------------------------------
def options_of(command: str) -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    return {s for a in sub._actions for s in a.option_strings if s.startswith("--")}


@pytest.mark.parametrize("command", ["compare", "pareto", "run", "simulate"])
def test_every_command_takes_the_job_options_plan_takes(command):
    plan_only = {"--objective", "--max-step-time", "--memory-budget", "--json", "--top", "--brief", "--verbose",
                 "--pipeline", "--schedule", "--stage-layers", "--virtual-stages"}  # (a pipeline: plan's, run's and simulate's)
    missing = options_of("plan") - plan_only - options_of(command)
    assert not missing, missing


def test_compare_prices_the_job_as_plan_plans_it(tmp_path):
    hardware = ["--precision", "fp32", "--bandwidth", "40", "--latency", "3", "--device-memory", "1GiB",
                "--peak-tflops", "100", "--efficiency", "0.4", "--axis-names", "dp", "--mesh", "4"]
    plan_json, compare_json = tmp_path / "plan.json", tmp_path / "compare.json"
    for command, out in (("plan", plan_json), ("compare", compare_json)):
        r = subprocess.run([sys.executable, "-m", "memshard.cli", command, "--model", "gpt2", *TINY_FLAGS, *hardware,
                            "--json", str(out)], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
    planned, compared = json.loads(plan_json.read_text()), json.loads(compare_json.read_text())
    assert compared["mesh"] == planned["mesh"] and compared["mesh"]["axis_names"] == ["dp"]
    assert compared["mesh"]["device_memory_bytes"] == 2**30
    assert compared["model"] == planned["model"] and compared["model"]["precision"] == "fp32"
    memshard_row = compared["rows"][0]
    assert memshard_row["strategy"] == "memshard"
    assert memshard_row["peak_bytes_per_device"] == planned["memory"]["peak_bytes_per_device"]
    assert memshard_row["estimated_step_time_s"] == planned["estimated_step_time_s"]


@pytest.mark.parametrize("args, message", [
    (["plan", "--model", "gpt2", "--mesh", "2", "--memory-budget", "80GiB"], "memory budget"),
    (["plan", "--model", "gpt2", "--mesh", "2", "--objective", "time", "--max-step-time", "1s"], "step-time budget"),
    (["run", "--plan", "plan.json", "--model", "gpt2"], "--plan replaces the job"),
    (["simulate", "--plan", "plan.json", "--mesh", "2x2"], "--plan replaces the job"),
])
def test_contradictory_options_are_refused(args, message, capsys):
    from memshard.cli import main

    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_the_compare_api_takes_a_job_and_search_keywords():
    job = Job("gpt2", "4", precision="fp32", **{k: TINY[k] for k in ("batch", "seq")},
              overrides={k: v for k, v in TINY.items() if k not in ("batch", "seq")})
    result = memshard.compare(job, time_limit_s=30, mip_gap=0.01)
    assert result["rows"][0]["strategy"] == "memshard"
    with pytest.raises(MemshardError, match="give no max_step_time_s"):
        memshard.compare(job, max_step_time_s=1.0)
    with pytest.raises(MemshardError, match="a Job fixes the job"):
        memshard.compare(job, batch=8)
    assert np.isfinite(result["rows"][0]["peak_bytes_per_device"])
