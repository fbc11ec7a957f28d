"""``memshard fit``: the largest value of a knob that fits, against every value searched one by
one, and its proof about the next value."""

from __future__ import annotations

import functools
import json
from dataclasses import replace

import pytest

import memshard
from memshard import fitting
from memshard.core.errors import MemshardError
from memshard.core.hardware import hardware_from_dict
from memshard.fitting import KNOBS, FitResult, KnobSearch, Probe, Prober, family, fit_job, job_at
from memshard.job import Job
from memshard.planner import SearchOptions, baseline_plans, plan_job
from memshard.search.stages import TimeOut
from tests.planner.test_cli import run

MIB = 2**20


def tiny_job(memory_mib: float, **kwargs) -> Job:
    mesh = memshard.parse_mesh("4", device_memory_bytes=int(memory_mib * MIB))
    return Job("tiny-gpt", mesh, precision="fp32", **kwargs)


def least_peaks(job: Job, knob: str, values, options: SearchOptions | None = None) -> dict[int, float]:
    return {v: plan_job(job_at(job, knob, v), options or SearchOptions()).peak_bytes for v in values}


@functools.cache  # (two tests read it: one unit of work, tests/conftest.py's TOGETHER)
def largest_batch_in_4_mib() -> FitResult:
    """memshard's largest batch of tiny GPT on 4 devices of 4 MiB, from one sequence per device."""
    return fit_job(tiny_job(4.0), "batch", baselines=False)


COARSE = SearchOptions(mip_gap=0.02, mesh_views=False)  # tiny problems: a 2% gap is quick; the mesh as typed


@functools.cache  # (two tests read it: one unit of work, tests/conftest.py's TOGETHER)
def largest_batch_in_5_mib() -> FitResult:
    """memshard's largest batch of tiny GPT on 4 devices of 5 MiB, to a 2% gap, from a batch
    of 16 (near the answer: few probes), no step-time budget."""
    return fit_job(tiny_job(5.0, batch=16), "batch", COARSE, baselines=False)


def test_the_largest_batch_is_the_last_one_a_full_scan_fits():
    job = tiny_job(4.0)  # (a batch of 4: one sequence per device)
    result = largest_batch_in_4_mib()
    memshard_answer = result.answers[0]
    peaks = least_peaks(job, "batch", range(1, memshard_answer.value + 3))
    fitting = [b for b, peak in peaks.items() if peak <= 4 * MIB]
    assert memshard_answer.value == max(fitting) and fitting == list(range(1, max(fitting) + 1))
    assert memshard_answer.plan.peak_bytes == pytest.approx(peaks[memshard_answer.value])
    after = memshard_answer.next_probe  # the proof: the next batch needs more than the device has
    assert after.value == memshard_answer.value + 1 and not after.fits
    assert 4 * MIB < after.bound_bytes <= peaks[after.value]
    assert len(memshard_answer.probes) <= 6  # far fewer than the values below the answer


def test_every_baselines_answer_is_its_own_scans():
    job = tiny_job(6.0, batch=4)
    result = fit_job(job, "batch")
    # The scan: each answer's value and the next, every value up to the largest answer's next
    # for a strategy that fits none (what the assertions read)
    scanned = {b: set() for b in range(1, max(a.value or 0 for a in result.answers) + 2)}
    for answer in result.answers[1:]:
        for b in scanned if answer.value is None else (answer.value, answer.value + 1):
            scanned[b].add(answer.strategy)
    plans = {}
    for b, names in scanned.items():
        at = job_at(job, "batch", b)
        problem = memshard.problem.pricing.build_problem(at.graph, job.mesh)
        for p in memshard.planner.baseline_plans(at, problem, names.__contains__)[0]:
            plans.setdefault(p.strategy, {})[b] = p.peak_bytes
    for answer in result.answers[1:]:
        fitting = [b for b, peak in plans.get(answer.strategy, {}).items() if peak <= 6 * MIB]
        if answer.value is None:
            assert not fitting, answer.strategy
            continue
        assert answer.value in fitting and answer.value + 1 not in fitting, answer.strategy
    assert result.answers[0].value >= max(a.value or 0 for a in result.answers[1:])  # memshard never worse


@pytest.mark.parametrize("knob", ["seq", "layers", "hidden"])
def test_other_knobs_find_their_boundary(knob):
    job = tiny_job(8.0, batch=4) if knob != "seq" else replace(tiny_job(8.0, batch=4), model="tiny-llama")
    answer = fit_job(job, knob, baselines=False).answers[0]
    step = 1 if knob != "hidden" else 32
    assert answer.value % step == 0
    fits, after = least_peaks(job, knob, [answer.value, answer.value + step]).values()
    assert fits <= 8 * MIB < after
    if knob == "hidden":  # the head size stays 32: heads scale, and the MLP keeps its ratio
        cfg = job_at(job, knob, answer.value).config
        assert cfg.hidden // cfg.heads == 32 and cfg.ffn == 4 * cfg.hidden


def test_the_fewest_devices_are_the_first_node_count_a_scan_fits():
    """Nodes of 2 (the inner axis), the global batch kept at 120: more nodes, less per device."""
    nodes_of_2 = hardware_from_dict({"base": "a100-80gb", "gpus_per_node": 2})
    mesh = memshard.parse_mesh("2x2", device_memory_bytes=12 * MIB, hardware=nodes_of_2)
    job = Job("tiny-gpt", mesh, batch=120, precision="fp32")
    coarse = SearchOptions(mip_gap=0.02)  # tiny two-axis problems: a 2% gap is quick, and the scan uses it too
    answer = fit_job(job, "devices", coarse, baselines=False).answers[0]
    peaks = least_peaks(job, "devices", range(2, answer.value + 3, 2), coarse)
    assert answer.value == min(d for d, peak in peaks.items() if peak <= 12 * MIB)
    assert answer.value % 2 == 0 and answer.plan.job.mesh.shape == (answer.value // 2, 2)
    assert answer.plan.job.global_batch == 120 and answer.next_probe.value == answer.value - 2
    assert not answer.next_probe.fits and answer.next_probe.bound_bytes > 12 * MIB


def _walled(peak, reach: int, memory: float = 80.0):
    """A probe of a recipe that lays a job out only up to ``reach`` devices."""
    def probe(value: int):
        if value > reach:
            return Probe(value, float("inf"), float("inf"), False, laid_out=False), None
        return Probe(value, peak(value), peak(value), peak(value) <= memory), None
    return probe


@pytest.mark.parametrize("reach", [504, 512, 600, 2048])
@pytest.mark.parametrize("fits_from", [300, 500, 1000])
def test_a_fewest_devices_search_looks_below_where_the_recipe_stops(reach, fits_from):
    """Peaks falling faster and faster with the devices: the line through the first probes
    points past the last node count the recipe lays out (its data-parallel degree would exceed
    the batch). The answer is still the first value a scan of the values it lays out fits, and
    none where none of them does."""
    def peak(v):
        return 120 - 40 * (v / fits_from) ** 2
    answer = KnobSearch("recipe", _walled(peak, reach), 80.0, 8, None, limit=4096, rising=False).run(64)
    scan = [v for v in range(8, reach + 1, 8) if peak(v) <= 80.0]
    assert answer.value == (min(scan) if scan else None)
    if scan:
        assert answer.next_probe.value == answer.value - 8 and not answer.next_probe.fits
    else:  # the proof: the least peak of any value it lays out that was probed
        assert answer.next_probe.laid_out and answer.next_probe.peak_bytes > 80.0
    assert len(answer.probes) <= 16


def test_a_search_starting_where_the_recipe_stops_comes_back():
    answer = KnobSearch("recipe", _walled(lambda v: 8000 / v, 160), 80.0, 8, None, limit=4096,
                        rising=False).run(1024)
    assert answer.value == 104


def test_megatron_reaches_the_node_count_where_its_data_parallel_degree_is_the_batch(monkeypatch):
    """Megatron-LM's TP 2 × DP runs a batch of 8 on at most 8 nodes of 2 (the scan: it lays
    out nothing larger); its column is the first node count a scan fits. (The fit and the
    scan lay out that recipe alone: each column is its own family's search, and the others'
    recipes, built at every node count, were most of the time. memshard's own column, listed
    first, is not what is checked here: time runs out where its searches would start branch
    and bound (the test knob ``TimeOut``), each with the plan it has then.)"""
    def megatron_tp2_only(job, problem, wanted=None, **kwargs):
        return baseline_plans(job, problem, lambda n: family(n) == "megatron-tp2" and (wanted is None or wanted(n)),
                              **kwargs)

    monkeypatch.setattr("memshard.fitting.baseline_plans", megatron_tp2_only)
    mesh = memshard.parse_mesh("1x2", device_memory_bytes=int(4.5 * MIB))
    job = Job("tiny-gpt", mesh, batch=8, precision="fp32")
    coarse = SearchOptions(mip_gap=0.02, time_out=TimeOut("branch and bound"))  # (the baselines' pricing ignores both)
    result = fit_job(job, "devices", coarse)
    assert [a.strategy for a in result.answers] == ["memshard", "megatron-tp2"]
    answer = next(a for a in result.answers if a.strategy == "megatron-tp2")
    prober = Prober(job, "devices", coarse, mesh.device_memory_bytes)
    scan = {v: prober.baseline("megatron-tp2", v)[0] for v in range(2, 34, 2)}
    assert max(v for v, p in scan.items() if p.laid_out) == 16
    fitting = [v for v, p in scan.items() if p.fits]
    assert fitting == [16] and answer.value == 16


def test_a_baseline_on_more_devices_is_the_same_recipe():
    assert [family(n) for n in ("megatron-tp8-dp16-sp-distopt", "tp8-fsdp16", "torch-tp8-fsdp16", "fsdp2",
                                "zero3-fsdp", "dp")] == [
        "megatron-tp8-sp-distopt", "tp8-fsdp", "torch-tp8-fsdp", "fsdp2", "zero3-fsdp", "dp"]


def test_learned_positions_bound_the_sequence():
    result = fit_job(tiny_job(64.0, batch=4), "seq", baselines=False)
    assert result.limit == 128 and result.answers[0].value == 128 and result.answers[0].next_probe is None


def test_a_step_time_budget_bounds_every_answer():
    """A budget of 0.6 × the step of memshard's plan at its largest batch without one
    (``largest_batch_in_5_mib``, which the slowdown test reads too)."""
    free = largest_batch_in_5_mib().answers[0]
    budget = free.plan.step_time_s * 0.6
    bound = fit_job(tiny_job(5.0, batch=4), "batch", SearchOptions(max_step_time_s=budget, mip_gap=0.01))
    for answer in bound.answers:
        if answer.plan is not None:
            assert answer.plan.step_time_s <= budget, answer.strategy
    assert bound.answers[0].value < free.value


def test_a_slowdown_bound_is_against_memshards_fastest_plan_at_each_value(monkeypatch):
    # (starts near the answer: few probes; the fastest plans on the mesh as typed)
    job, coarse = tiny_job(5.0, batch=16), COARSE
    searched: dict[str, object] = {}  # (job, options) → its plan: each search of a whole job made once

    def searched_once(job, options, start=None, problem=None, cutoff=None):
        """``plan_job``; a job's fastest plan, which the fit, the prober and the checks below
        all ask for, searched once (the search is deterministic)."""
        if start is not None or problem is not None or cutoff is not None:
            return plan_job(job, options, start, problem, cutoff)
        key = repr((job, options))
        if key not in searched:
            searched[key] = plan_job(job, options)
        return searched[key]

    monkeypatch.setattr(fitting, "plan_job", searched_once)
    answer = fit_job(job, "batch", coarse, baselines=False, max_slowdown=1.05).answers[0]

    def fastest(value):
        return searched_once(job_at(job, "batch", value),
                             SearchOptions(objective="time", memory_budget=5 * MIB, mip_gap=0.02, mesh_views=False))

    assert answer.plan.step_time_s <= 1.05 * fastest(answer.value).step_time_s * (1 + 1e-6)
    assert answer.value <= largest_batch_in_5_mib().answers[0].value  # (the same job and search, no bound)
    # a baseline, against the same (at the answer, whose fastest plan is searched already)
    prober = Prober(job, "batch", coarse, 5 * MIB, slowdown=1.05)
    probe, plan = prober.baseline("zero3-fsdp", answer.value)
    fast = fastest(answer.value).step_time_s
    assert probe.fits == (plan.peak_bytes <= 5 * MIB and plan.step_time_s <= 1.05 * fast)
    assert probe.note == ("" if plan.step_time_s <= 1.05 * fast else "over the step-time budget")


def test_fit_is_deterministic():
    job = tiny_job(5.0, batch=4)
    a, b = (fit_job(job, "layers").to_dict() for _ in range(2))
    for d in (a, b):
        d.pop("time_s")
        for answer in d["answers"]:
            if answer["plan"]:
                answer["plan"]["solver"].pop("time_s")
    assert a == b


def test_nothing_fits_is_an_error_with_the_least_figure():
    with pytest.raises(MemshardError, match=r"no batch fits in 1 MiB per device: batch 1 needs .* at least"):
        fit_job(tiny_job(1.0), "batch")


def test_the_cli_writes_the_answers_and_the_plot(tmp_path):
    out, plot = tmp_path / "fit.json", tmp_path / "fit.png"
    r = run("fit", "--model", "tiny-gpt", "--mesh", "4", "--precision", "fp32", "--device-memory", "4MiB",
            "--max", "batch", "--json", str(out), "--plot", str(plot))
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert data["schema"] == "memshard.fit/1" and data["answers"][0]["strategy"] == "memshard"
    assert data["answers"][0]["value"] == largest_batch_in_4_mib().answers[0].value
    assert "largest batch" in r.stdout and plot.stat().st_size > 10_000


def test_the_api_takes_plans_keywords():
    result = memshard.fit("tiny-gpt", memshard.parse_mesh("4", device_memory_bytes=4 * MIB), knob="batch",
                          baselines=False, precision="fp32", num_layers=1)
    cfg = result.answers[0].plan.job.config
    assert cfg.num_layers == 1 and result.answers[0].plan.job.global_batch == result.answers[0].value


def test_the_cli_and_the_module_list_the_same_knobs():
    from memshard.cli import FIT_KNOBS

    assert FIT_KNOBS == KNOBS


# -- with a pipeline ---------------------------------------------------------------------------------
def test_a_pipelined_fit_is_the_boundary_of_pipelined_plans_for_memshard_and_megatron(monkeypatch, capsys):
    """``pipeline=2``: memshard's pipelined least-memory plan and each pipelined Megatron-LM
    configuration at its largest batch fits, and the next batch, planned again, does not.
    The fit is docs/fit.md's pipelined example, made once: run as the page types it, what it
    prints compared with the page's block (tests/docs/test_readme.py's check), its result read
    here."""
    from memshard.cli import main
    from memshard.pipelining import PipelineOptions, pipelined_baseline, plan_pipelined
    from tests.docs.markdown import assert_prints_the_block, blocks, output_block, pages
    from tests.docs.test_readme import PIPELINED_FIT

    made = []

    def recorded(job, *args, **kwargs):
        made.append((job, fit_job(job, *args, **kwargs)))
        return made[-1][1]

    monkeypatch.setattr("memshard.fitting.fit_job", recorded)
    (shown,) = [b for page in pages() for block in blocks(page) if (b := output_block(block)) and b.command == PIPELINED_FIT]
    capsys.readouterr()
    assert main(shown.command.split()[1:]) == 0
    assert_prints_the_block(shown, [line.rstrip() for line in capsys.readouterr().out.splitlines()])
    ((job, result),) = made
    mesh = job.mesh
    assert (job.model, mesh.shape, mesh.device_memory_bytes) == ("tiny-gpt", (2, 2), 6 * MIB)
    assert (job.global_batch, job.micro_batches, job.graph.precision.name) == (8, 4, "fp32")
    assert result.pipeline == 2 and result.to_dict()["pipeline"] == 2
    names = [a.strategy for a in result.answers]
    assert names[0] == "memshard" and len(names) > 2
    assert all("-pp2" in name for name in names[1:])
    for answer in result.answers:
        assert answer.value is not None and len(answer.plan.stages) == 2, answer.strategy
        assert answer.plan.peak_bytes <= 6 * MIB and answer.plan.job.global_batch == answer.value
        nxt = answer.next_probe.value
        assert nxt == answer.value + 4 and not answer.next_probe.fits, answer.strategy
        again = job_at(job, "batch", nxt)
        peak = (plan_pipelined(again, SearchOptions(), PipelineOptions(2)) if answer.strategy == "memshard"
                else pipelined_baseline(again, answer.strategy)).peak_bytes
        assert peak > 6 * MIB, answer.strategy


@pytest.mark.parametrize("arguments, message", [
    (dict(knob="devices"), "resizes the outermost mesh axis, which a pipeline runs along"),
    (dict(max_slowdown=1.5), "does not yet bound a pipelined plan"),
    (dict(pipeline=3), "3 pipeline stages do not divide the outermost axis"),
])
def test_a_pipelined_fit_refuses_what_it_cannot_do_in_one_line(arguments, message):
    job = Job("tiny-gpt", memshard.parse_mesh("2x2", device_memory_bytes=6 * MIB), batch=8, micro_batches=4)
    with pytest.raises(MemshardError, match=message):
        fit_job(job, **{"knob": "batch", "pipeline": 2, **arguments})
