"""Every option of ``plan`` and ``compare`` either acts or is refused: given a value other
than its default, the plan JSON (or the report) changes, or the command says why not (exit 2)
— no option is recorded without effect. The walk covers every option the parsers declare,
so a new option must say here how it acts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memshard.cli import build_parser, main

BASE = ["--model", "gpt2", "--mesh", "4", "--layers", "1", "--batch", "4", "--seq", "64"]

# option → (arguments replacing its default; "json": the plan JSON changes, "text": the printed
# report changes, "refused": exit 2). Model sources are the job itself, --json the output.
PLAN = {
    "--mesh": (["--mesh", "2x2"], "json"),
    "--batch": (["--batch", "8"], "json"),
    "--seq": (["--seq", "32"], "json"),
    "--micro-batches": (["--micro-batches", "2"], "json"),
    "--layers": (["--layers", "2"], "json"),
    "--hidden": (["--hidden", "384"], "json"),
    "--heads": (["--heads", "6"], "json"),
    "--kv-heads": (["--kv-heads", "4"], "refused"),  # GPT-2 has no grouped-query attention
    "--ffn": (["--ffn", "1024"], "json"),
    "--vocab": (["--vocab", "51200"], "json"),
    "--dropout": (["--dropout", "off"], "json"),
    "--precision": (["--precision", "fp32"], "json"),
    "--attn-implementation": (["--attn-implementation", "eager"], "refused"),  # for --hf-* only
    "--axis-names": (["--axis-names", "dp"], "json"),
    "--bandwidth": (["--bandwidth", "10"], "json"),
    "--latency": (["--latency", "50"], "json"),
    "--device-memory": (["--device-memory", "1GiB"], "json"),
    "--peak-tflops": (["--peak-tflops", "50"], "json"),
    "--efficiency": (["--efficiency", "0.25"], "json"),
    "--gpu": (["--gpu", "a100-40gb"], "json"),
    "--hardware": (["--hardware", str(Path(__file__).parents[2] / "examples" / "hardware.toml")], "json"),
    "--objective": (["--objective", "time"], "json"),
    "--max-step-time": (["--max-step-time", "100s"], "json"),
    "--memory-budget": (["--memory-budget", "80GiB"], "refused"),  # the memory objective has none
    "--zero3-unit": (["--zero3-unit", "layer"], "json"),
    "--recompute": (["--recompute", "selective"], "json"),
    "--exact": (["--exact"], "json"),
    "--full-mesh": (["--full-mesh"], "refused"),  # nothing to merge on one axis
    "--mesh-views": (["--mesh-views", "on"], "json"),  # the plan lies on the 2x2 view
    "--time-limit": (["--time-limit", "1ms"], "refused"),  # no plan in a millisecond
    "--gap": (["--gap", "0.5"], "json"),
    "--top": (["--top", "1"], "json"),
    "--brief": (["--brief"], "text"),
    "--verbose": (["--verbose"], "text"),  # the search's stages: the JSON unchanged
    # a one-layer model has no two stages (tests/planner/test_pipelined.py plans pipelines)
    "--pipeline": (["--pipeline", "2"], "refused"),
    "--schedule": (["--schedule", "gpipe"], "refused"),  # it orders a pipeline's stages
    "--stage-layers": (["--stage-layers", "balanced"], "refused"),  # it divides a pipeline's layers
    "--virtual-stages": (["--virtual-stages", "2"], "refused"),  # it divides a pipeline's stages among its ranks
}
JOB_SOURCES = {"--model", "--hf-config", "--hf-model", "--json", "--help"}


def options_of(command: str) -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    return {s for a in sub._actions for s in a.option_strings if s.startswith("--")}


def run(args: list[str], tmp_path, capsys, name: str) -> tuple[int, dict | None, str]:
    out = tmp_path / f"{name}.json"
    rc = main([*args, "--json", str(out)])
    text, _ = capsys.readouterr()
    data = json.loads(out.read_text()) if rc == 0 else None
    if data is not None:
        data["solver"]["time_s"] = 0.0
    return rc, data, text.replace(str(out), "")


def with_option(option: str, values: list[str]) -> list[str]:
    args = list(BASE)
    if option in args:
        i = args.index(option)
        del args[i:i + 2]
    return args + values


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    import contextlib
    import io

    tmp = tmp_path_factory.mktemp("baseline")
    out = tmp / "plan.json"
    with contextlib.redirect_stdout(io.StringIO()) as text:
        assert main(["plan", *BASE, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    data["solver"]["time_s"] = 0.0
    return data, text.getvalue().replace(str(out), "")


def test_the_walk_covers_every_option_of_plan():
    assert options_of("plan") - JOB_SOURCES == set(PLAN)


@pytest.mark.parametrize("option", sorted(PLAN))
def test_every_plan_option_acts_or_is_refused(option, baseline, tmp_path, capsys):
    values, effect = PLAN[option]
    rc, data, text = run(["plan", *with_option(option, values)], tmp_path, capsys, "plan")
    if effect == "refused":
        assert rc == 2
        return
    assert rc == 0
    if effect == "json":
        assert data != baseline[0]
    else:
        assert data == baseline[0] and text != baseline[1]


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    import contextlib
    import io

    out = tmp_path_factory.mktemp("compare") / "compare.json"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["compare", *BASE, "--json", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("option, values", [("--zero3-unit", ["--zero3-unit", "layer"]),
                                            ("--recompute", ["--recompute", "full"]),
                                            ("--time-slack", ["--time-slack", "3"]),
                                            ("--device-memory", ["--device-memory", "1MiB"])])
def test_compare_options_act(option, values, compared, tmp_path, capsys):
    after = tmp_path / "after.json"
    assert main(["compare", *with_option(option, values), "--json", str(after)]) == 0
    capsys.readouterr()
    assert json.loads(after.read_text()) != compared


def test_compare_and_pareto_take_no_objective_or_budget():
    for command in ("compare", "pareto"):
        assert not {"--objective", "--max-step-time", "--memory-budget"} & options_of(command)
