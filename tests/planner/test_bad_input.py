"""The bad-input catalogue: every subcommand and the Python API, fed what a user gets wrong.

Each command line must end in one ``memshard: error: …`` line naming what was wrong, exit 2,
before any work, and leave an existing ``--json`` (or ``--out``) file as it was; each API call
must raise ``MemshardError`` naming the input. (A few cases with a real solve are in
``test_cli.py``: a budget no plan meets, a time limit hit.)
"""

from __future__ import annotations

import math

import pytest

import memshard
from memshard.cli import main
from memshard.core.errors import MemshardError
from memshard.core.quantities import parse_bytes
from memshard.job import HFModel, Job
from memshard.pareto import frontier
from memshard.plans.plan import load_plan, plan_from_dict

BASE = ["--model", "gpt2", "--mesh", "2x2"]
SMALL = ["--layers", "1", "--batch", "4", "--seq", "64"]
GPT = ["plan", *BASE, *SMALL]
LLAMA = ["plan", "--model", "llama3-8b", "--mesh", "2x2", *SMALL]

PIPELINED = ["plan", "--model", "tiny-gpt", "--mesh", "2x2", "--batch", "8", "--micro-batches", "4"]
# id → (command line, a word the error must contain); {tmp}, {dir}, {bin}, {foreign},
# {truncated}, {hf:<name>} are filled in by the test.
CLI = {
    # pipelines
    "pipeline-one-stage": (PIPELINED + ["--pipeline", "1"], "at least 2 stages"),
    "pipeline-not-dividing": (PIPELINED + ["--pipeline", "3"], "do not divide"),
    "pipeline-one-device-per-stage": (["plan", "--model", "tiny-gpt", "--mesh", "2", "--batch", "8",
                                       "--micro-batches", "4", "--pipeline", "2"], "one device per stage"),
    "pipeline-more-stages-than-layers": (["plan", "--model", "tiny-gpt", "--mesh", "4x2", "--batch", "8",
                                          "--micro-batches", "4", "--pipeline", "4"], "as many layers"),
    "pipeline-too-few-micro-batches": (PIPELINED[:-2] + ["--micro-batches", "1", "--pipeline", "2"], "1F1B"),
    "pipeline-step-time-budget": (PIPELINED + ["--pipeline", "2", "--max-step-time", "1s"], "--max-step-time"),
    "pipeline-mesh-views": (PIPELINED + ["--pipeline", "2", "--objective", "time", "--mesh-views", "on"],
                            "mesh views"),
    "schedule-without-pipeline": (PIPELINED + ["--schedule", "gpipe"], "--pipeline"),
    "schedule-with-no-pipeline": (PIPELINED + ["--pipeline", "none", "--schedule", "gpipe"], "--pipeline"),
    "pipeline-word": (PIPELINED + ["--pipeline", "many"], "many"),
    "pipeline-auto-step-time-budget": (PIPELINED + ["--pipeline", "auto", "--max-step-time", "1s"], "budget"),
    "schedule-unknown": (PIPELINED + ["--pipeline", "2", "--schedule", "looped-bfs"], "looped-bfs"),
    "compare-pipeline-not-dividing": (["compare", *PIPELINED[1:], "--pipeline", "3"], "do not divide"),
    "compare-pipeline-too-few-micro-batches": (["compare", *PIPELINED[1:-2], "--micro-batches", "1", "--pipeline",
                                                "2"], "needs at least 2 micro-batches"),
    "compare-pipeline-one-stage": (["compare", *PIPELINED[1:], "--pipeline", "1"], "at least 2 stages"),
    "compare-pipeline-auto": (["compare", *PIPELINED[1:], "--pipeline", "auto"], "auto"),
    "compare-pipeline-time-slack": (["compare", *PIPELINED[1:], "--pipeline", "2", "--time-slack", "2"],
                                    "no time slack"),
    # meshes
    "mesh-zero-axis": (["plan", "--model", "gpt2", "--mesh", "2x0"], "2x0"),
    "mesh-letters": (["plan", "--model", "gpt2", "--mesh", "abc"], "abc"),
    "mesh-empty": (["plan", "--model", "gpt2", "--mesh", ""], "mesh"),
    "mesh-zero": (["plan", "--model", "gpt2", "--mesh", "0"], "device"),
    "mesh-trailing-x": (["plan", "--model", "gpt2", "--mesh", "2x"], "2x"),
    "mesh-negative": (["plan", "--model", "gpt2", "--mesh", "-2"], "-2"),
    "mesh-fraction": (["plan", "--model", "gpt2", "--mesh", "2.5"], "2.5"),
    "mesh-absurd": (["plan", "--model", "gpt2", "--mesh", "1024x1024x1024"], "1,073,741,824"),
    "mesh-missing": (["plan", "--model", "gpt2"], "--mesh"),
    # sizes
    "batch-zero": (["plan", *BASE] + ["--batch", "0"], "--batch"),
    "batch-negative": (["plan", *BASE] + ["--batch", "-4"], "--batch"),
    "batch-fraction": (["plan", *BASE] + ["--batch", "2.5"], "2.5"),
    "batch-nan": (["plan", *BASE] + ["--batch", "nan"], "nan"),
    "seq-zero": (["plan", *BASE] + ["--seq", "0"], "--seq"),
    "seq-words": (["plan", *BASE] + ["--seq", "long"], "long"),
    "seq-too-long": (["plan", *BASE] + ["--seq", "4096"], "4096"),
    "micro-batches-zero": (GPT + ["--micro-batches", "0"], "--micro-batches"),
    "micro-batches-not-dividing": (GPT + ["--micro-batches", "3"], "3"),
    # model knobs
    "layers-zero": (GPT + ["--layers", "0"], "--layers"),
    "layers-absurd": (GPT + ["--layers", "100000"], "100000"),
    "hidden-zero": (GPT + ["--hidden", "0"], "--hidden"),
    "heads-not-dividing": (GPT + ["--hidden", "100", "--heads", "7"], "7"),
    "kv-heads-on-gpt": (GPT + ["--kv-heads", "4"], "kv-heads"),
    "kv-heads-not-dividing": (LLAMA + ["--kv-heads", "5"], "5"),
    "ffn-negative": (GPT + ["--ffn", "-1"], "--ffn"),
    "vocab-words": (GPT + ["--vocab", "many"], "many"),
    "dropout-on-llama": (LLAMA + ["--dropout", "on"], "dropout"),
    "dropout-maybe": (GPT + ["--dropout", "maybe"], "maybe"),
    "precision-unknown": (GPT + ["--precision", "bf16"], "bf16"),
    "unknown-model": (["plan", "--model", "gpt5", "--mesh", "2"], "gpt5"),
    "two-models": (["plan", "--model", "gpt2", "--hf-model", "gpt2", "--mesh", "2"], "--hf-model"),
    "attn-without-hf": (GPT + ["--attn-implementation", "sdpa"], "--attn-implementation"),
    # hardware
    "bandwidth-zero": (GPT + ["--bandwidth", "0,100"], "--bandwidth"),
    "bandwidth-negative": (GPT + ["--bandwidth", "-25,150"], "-25"),
    "bandwidth-nan": (GPT + ["--bandwidth", "nan,100"], "nan"),
    "bandwidth-inf": (GPT + ["--bandwidth", "inf,100"], "inf"),
    "bandwidth-count": (GPT + ["--bandwidth", "100"], "one value per mesh axis"),
    "bandwidth-words": (GPT + ["--bandwidth", "fast,slow"], "fast"),
    "latency-negative": (GPT + ["--latency", "-5,1"], "-5"),
    "latency-nan": (GPT + ["--latency", "nan,1"], "nan"),
    "latency-count": (GPT + ["--latency", "1,2,3"], "one value per mesh axis"),
    "device-memory-zero": (GPT + ["--device-memory", "0"], "0"),
    "device-memory-negative": (GPT + ["--device-memory", "-80GiB"], "-80GiB"),
    "device-memory-words": (GPT + ["--device-memory", "lots"], "lots"),
    "device-memory-nan": (GPT + ["--device-memory", "nan"], "nan"),
    "device-memory-unit": (GPT + ["--device-memory", "80GiBs"], "80GiBs"),
    "peak-tflops-zero": (GPT + ["--peak-tflops", "0"], "--peak-tflops"),
    "peak-tflops-negative": (GPT + ["--peak-tflops", "-1"], "--peak-tflops"),
    "peak-tflops-nan": (GPT + ["--peak-tflops", "nan"], "--peak-tflops"),
    "peak-tflops-inf": (GPT + ["--peak-tflops", "inf"], "--peak-tflops"),
    "efficiency-zero": (GPT + ["--efficiency", "0"], "--efficiency"),
    "efficiency-above-one": (GPT + ["--efficiency", "1.5"], "--efficiency"),
    "efficiency-nan": (GPT + ["--efficiency", "nan"], "--efficiency"),
    "axis-names-count": (GPT + ["--axis-names", "a,b,c"], "a"),
    "axis-names-repeated": (GPT + ["--axis-names", "a,a"], "a"),
    # search
    "gap-above-one": (GPT + ["--gap", "2"], "gap"),
    "gap-negative": (GPT + ["--gap", "-1"], "gap"),
    "gap-nan": (GPT + ["--gap", "nan"], "gap"),
    "gap-words": (GPT + ["--gap", "small"], "small"),
    "time-limit-zero": (GPT + ["--time-limit", "0"], "0"),
    "time-limit-negative": (GPT + ["--time-limit", "-1s"], "-1s"),
    "time-limit-words": (GPT + ["--time-limit", "soon"], "soon"),
    "max-step-time-zero": (GPT + ["--max-step-time", "0s"], "0s"),
    "memory-budget-with-memory": (GPT + ["--memory-budget", "80GiB"], "memory budget"),
    "step-time-with-time": (GPT + ["--objective", "time", "--max-step-time", "1s"], "step-time budget"),
    "memory-budget-zero": (GPT + ["--objective", "time", "--memory-budget", "0"], "0"),
    "objective-unknown": (GPT + ["--objective", "speed"], "speed"),
    "zero3-unit-unknown": (GPT + ["--zero3-unit", "block"], "block"),
    "recompute-unknown": (GPT + ["--recompute", "some"], "some"),
    "recompute-strategy-not-offered": (["simulate", *BASE, "--precision", "fp32", "--recompute", "full",
                                        "--strategy", "zero3-fsdp+full"], "--zero3-unit layer"),
    "recompute-strategy-needs-auto": (["simulate", *BASE, "--precision", "fp32", "--strategy", "fsdp2+selective-op"],
                                      "--recompute auto"),
    "full-mesh-on-two-axes": (GPT + ["--full-mesh"], "--full-mesh"),
    "mesh-views-without-views": (["plan", "--model", "tiny-gpt", "--mesh", "2", "--mesh-views", "on"], "--mesh-views on"),
    "mesh-views-unknown": (GPT + ["--mesh-views", "yes"], "yes"),
    "top-zero": (GPT + ["--top", "0"], "--top"),
    # outputs
    "json-empty": (GPT + ["--json", ""], "empty"),
    "json-directory": (GPT + ["--json", "{dir}"], "directory"),
    "json-missing-folder": (GPT + ["--json", "{dir}/missing/plan.json"], "does not exist"),
    "compare-json-directory": (["compare", *BASE, *SMALL, "--json", "{dir}"], "directory"),
    "pareto-out-directory": (["pareto", *BASE, *SMALL, "--out", "{dir}"], "directory"),
    "pareto-out-text": (["pareto", *BASE, *SMALL, "--out", "{dir}/frontier.txt"], ".png"),
    "pareto-out-empty": (["pareto", *BASE, *SMALL, "--out", ""], "empty"),
    "pareto-one-point": (["pareto", *BASE, *SMALL, "--points", "1"], "2"),
    "run-json-directory": (["run", "--model", "tiny-gpt", "--mesh", "2", "--json", "{dir}"], "directory"),
    "simulate-json-directory": (["simulate", "--model", "tiny-gpt", "--mesh", "2", "--json", "{dir}"], "directory"),
    # compare and pareto take no objective
    "compare-objective": (["compare", *BASE, *SMALL, "--objective", "time"], "--objective"),
    "compare-slack-below-one": (["compare", *BASE, *SMALL, "--time-slack", "0.5"], "0.5"),
    "compare-slack-nan": (["compare", *BASE, *SMALL, "--time-slack", "nan"], "nan"),
    "compare-slack-inf": (["compare", *BASE, *SMALL, "--time-slack", "inf"], "inf"),
    "pareto-budget": (["pareto", *BASE, *SMALL, "--max-step-time", "1s"], "--max-step-time"),
    # saved plans
    "plan-binary": (["run", "--plan", "{bin}"], "not a text file"),
    "plan-foreign": (["run", "--plan", "{foreign}"], "not a memshard plan"),
    "plan-truncated": (["run", "--plan", "{truncated}"], "not valid JSON"),
    "plan-missing": (["simulate", "--plan", "{dir}/nothing.json"], "cannot read"),
    "plan-and-model": (["run", "--plan", "{foreign}", "--model", "gpt2"], "--model"),
    "plan-and-objective": (["run", "--plan", "{foreign}", "--objective", "time"], "--objective"),
    "plan-and-strategy": (["simulate", "--plan", "{foreign}", "--strategy", "ddp"], "--strategy"),
    # run and simulate
    "run-no-model": (["run", "--mesh", "2"], "--plan"),
    "run-one-step": (["run", "--model", "tiny-gpt", "--mesh", "2", "--steps", "1"], "--steps"),
    "run-bert": (["run", "--model", "bert-large", "--mesh", "2", "--layers", "1", "--seq", "16"], "BERT"),
    "run-unknown-strategy": (["run", "--model", "tiny-gpt", "--mesh", "2", "--strategy", "nonsense"], "nonsense"),
    # fit
    "fit-unknown-knob": (["fit", "--model", "tiny-gpt", "--mesh", "4", "--max", "width"], "width"),
    "fit-no-knob": (["fit", "--model", "tiny-gpt", "--mesh", "4"], "--max"),
    "fit-nothing-fits": (["fit", "--model", "tiny-gpt", "--mesh", "4", "--device-memory", "1MiB", "--max", "batch"],
                         "no batch fits in 1 MiB per device: batch 1 needs"),
    "fit-impossible-step-time": (["fit", "--model", "tiny-gpt", "--mesh", "4", "--max", "batch", "--max-step-time",
                                  "0.1us", "--no-baselines"], "no plan runs a step within 100 ns"),
    "fit-layers-of-a-traced-model": (["fit", "--hf-model", "gpt2", "--mesh", "4", "--max", "layers"], "built-in"),
    "fit-step-not-a-multiple": (["fit", "--model", "tiny-gpt", "--mesh", "4", "--max", "hidden", "--step", "48"],
                                "multiple of 32"),
    "fit-plot-extension": (["fit", "--model", "tiny-gpt", "--mesh", "4", "--max", "batch", "--plot", "{dir}/x.txt"],
                           "--plot"),
    "fit-max-and-min": (["fit", "--model", "tiny-gpt", "--mesh", "4", "--max", "batch", "--min", "devices"], "--min"),
    "fit-min-batch": (["fit", "--model", "tiny-gpt", "--mesh", "4", "--min", "batch"], "batch"),
    "fit-slowdown-below-one": (["fit", "--model", "tiny-gpt", "--mesh", "4", "--max", "batch", "--max-slowdown",
                                "0.5"], "slowdown"),
    "fit-slowdown-and-step-time": (["fit", "--model", "tiny-gpt", "--mesh", "4", "--max", "batch", "--max-slowdown",
                                    "1.1", "--max-step-time", "1s"], "--max-step-time"),
    "run-fsdp2-baseline": (["simulate", "--model", "tiny-gpt", "--mesh", "2", "--precision", "fp32",
                            "--strategy", "fsdp2"], "fully_shard"),
    "simulate-autocast": (["simulate", "--hf-model", "gpt2", "--mesh", "2", "--precision", "autocast"], "autocast"),
    "run-timeout-zero": (["run", "--model", "tiny-gpt", "--mesh", "2", "--timeout", "0"], "0"),
    "simulate-rank-outside": (["simulate", "--model", "tiny-gpt", "--mesh", "2", "--rank", "7"], "--rank"),
    "simulate-rank-negative": (["simulate", "--model", "tiny-gpt", "--mesh", "2", "--rank", "-1"], "--rank"),
    # export (--out given: an export writes no --json)
    "export-memshard-plan": (["export", "--model", "tiny-gpt", "--mesh", "4", "--out", "{dir}/x.py"],
                             "memshard.parallelize"),
    "export-idealised-zero": (["export", "--model", "tiny-gpt", "--mesh", "4", "--strategy", "zero2", "--out",
                               "{dir}/x.py"], "memshard.parallelize"),
    "export-unknown-strategy": (["export", "--model", "tiny-gpt", "--mesh", "4", "--strategy", "nonsense", "--out",
                                 "{dir}/x.py"], "nonsense"),
    "export-fsdp2-recompute": (["export", "--model", "tiny-gpt", "--mesh", "4", "--strategy", "fsdp2+selective", "--out",
                                "{dir}/x.py"], "torch.utils.checkpoint"),
    "export-ddp-mixed": (["export", "--model", "tiny-gpt", "--mesh", "4", "--strategy", "ddp", "--precision",
                          "mixed", "--out", "{dir}/x.py"], "--precision fp32"),
    "export-megatron-hf": (["export", "--hf-model", "gpt2", "--mesh", "4", "--strategy", "megatron-tp4", "--out",
                            "{dir}/x.py"], "built-in"),
    "export-megatron-bert": (["export", "--model", "bert-large", "--mesh", "4", "--strategy", "megatron-tp4", "--out",
                              "{dir}/x.py"], "bert"),
    "export-megatron-batch": (["export", "--model", "tiny-gpt", "--mesh", "1x4", "--batch", "5", "--strategy",
                               "megatron-tp2-dp2", "--out", "{dir}/x.py"], "multiple"),
    "export-megatron-not-on-mesh": (["export", "--model", "tiny-gpt", "--mesh", "4", "--strategy", "megatron-tp8",
                                     "--out", "{dir}/x.py"], "megatron-tp8"),
    "export-out-exists": (["export", "--model", "tiny-gpt", "--mesh", "4", "--strategy", "fsdp2", "--out",
                           "{dir}/precious.json"], "--force"),
    "export-out-directory": (["export", "--model", "tiny-gpt", "--mesh", "4", "--strategy", "fsdp2", "--out",
                              "{dir}"], "directory"),
    "export-out-missing-folder": (["export", "--model", "tiny-gpt", "--mesh", "4", "--strategy", "fsdp2", "--out",
                                   "{dir}/missing/x.py"], "does not exist"),
    "export-out-empty": (["export", "--model", "tiny-gpt", "--mesh", "4", "--strategy", "fsdp2", "--out", ""],
                         "empty"),
    "export-no-mesh": (["export", "--model", "tiny-gpt", "--strategy", "fsdp2", "--out", "{dir}/x.py"], "--mesh"),
    # the parser
    "no-command": ([], "command"),
    "unknown-command": (["frobnicate"], "frobnicate"),
    "unknown-option": (GPT + ["--frobnicate"], "--frobnicate"),
}

# Every numeric option × what a user gets wrong: not a number where one is needed, non-finite
# (nan, inf, 1e400 overflowing a float), negative, zero where it means nothing, fractional where a
# count is needed, or far past anything memshard plans (bytes or counts beyond a float's reach).
COUNTS = ("0", "-3", "2.5", "nan", "inf", "1e400", "99999999999999999999")
NUMBERS = ("nan", "inf", "-inf", "1e400", "-1", "1e30")
DURATIONS = ("0", "-1s", "nan", "inf", "1e400", "1e400s", "1e30s")
SIZES = ("0", "-1GiB", "0.5", "nan", "inf", "1e400", "1e400GiB", "1e300GiB", "1e30GiB")
FIT = ["fit", "--model", "tiny-gpt", "--mesh", "4", "--no-baselines", "--max", "batch"]
EXPORT = ["export", "--model", "tiny-gpt", "--mesh", "4", "--strategy", "fsdp2", "--out", "{dir}/x.py"]
# id → (the command line the option is added to, the option, what the error names, its bad values)
NUMERIC = {
    "batch": (GPT, "--batch", "--batch", COUNTS),
    "seq": (GPT, "--seq", "--seq", COUNTS),
    "micro-batches": (GPT, "--micro-batches", "--micro-batches", COUNTS),
    "layers": (GPT, "--layers", "--layers", COUNTS),
    "hidden": (GPT, "--hidden", "--hidden", COUNTS),
    "heads": (GPT, "--heads", "--heads", COUNTS),
    "kv-heads": (LLAMA, "--kv-heads", "--kv-heads", COUNTS),
    "ffn": (GPT, "--ffn", "--ffn", COUNTS),
    "vocab": (GPT, "--vocab", "--vocab", COUNTS),
    "top": (GPT, "--top", "--top", COUNTS),
    "bandwidth": (GPT, "--bandwidth", "--bandwidth", tuple(f"{v},{v}" for v in (*NUMBERS, "0"))),
    "latency": (GPT, "--latency", "--latency", tuple(f"{v},{v}" for v in NUMBERS)),
    "peak-tflops": (GPT, "--peak-tflops", "--peak-tflops", (*NUMBERS, "0")),
    "efficiency": (GPT, "--efficiency", "--efficiency", (*NUMBERS, "0", "1.5")),
    "device-memory": (GPT, "--device-memory", "--device-memory", SIZES),
    "memory-budget": (GPT + ["--objective", "time"], "--memory-budget", "--memory-budget", SIZES),
    "max-step-time": (GPT, "--max-step-time", "--max-step-time", DURATIONS),
    "time-limit": (GPT, "--time-limit", "--time-limit", DURATIONS),
    "gap": (GPT, "--gap", "gap", ("nan", "inf", "-inf", "1e400", "-0.1", "1", "1e30")),
    "time-slack": (["compare", *BASE, *SMALL], "--time-slack", "time slack", (*NUMBERS, "0", "0.5")),
    "points": (["pareto", *BASE, *SMALL], "--points", "points", (*COUNTS, "1", "5000")),
    "fit-step": (FIT, "--step", "--step", COUNTS),
    "fit-max-step-time": (FIT, "--max-step-time", "--max-step-time", DURATIONS),
    "fit-max-slowdown": (FIT, "--max-slowdown", "slowdown", (*NUMBERS, "0", "0.5")),
    "run-steps": (["run", "--model", "tiny-gpt", "--mesh", "2"], "--steps", "--steps", (*COUNTS, "1")),
    "run-timeout": (["run", "--model", "tiny-gpt", "--mesh", "2"], "--timeout", "--timeout", DURATIONS),
    "simulate-rank": (["simulate", "--model", "tiny-gpt", "--mesh", "2"], "--rank", "--rank",
                      ("-1", "2.5", "nan", "inf", "1e400", "99999999999999999999")),
    "export-batch": (EXPORT, "--batch", "--batch", COUNTS),
    "export-hidden": (EXPORT, "--hidden", "--hidden", COUNTS),
    "pipeline": (GPT, "--pipeline", "--pipeline", COUNTS),
    "stage-layers": (PIPELINED + ["--pipeline", "2"], "--stage-layers", "--stage-layers", (*COUNTS, "2,0", "1,,1")),
    "virtual-stages": (PIPELINED + ["--pipeline", "2", "--schedule", "interleaved-1f1b"], "--virtual-stages",
                       "--virtual-stages", COUNTS),
}
NUMERIC_CASES = {f"{case}={value}": (args + [option, value], expect)
                 for case, (args, option, expect, values) in NUMERIC.items() for value in values}

# Overrides that leave an inconsistent shape (an override of the hidden size carries the heads,
# kv-heads and MLP width with it unless they are given too: models.follow_hidden).
SHAPES = {
    "hidden-not-whole-heads": (GPT + ["--hidden", "100"], "head size 64"),
    "hidden-not-whole-kv-groups": (LLAMA + ["--hidden", "640"], "multiple of 512"),
    "heads-not-whole-kv-groups": (LLAMA + ["--hidden", "2048", "--heads", "6"], "kv-heads too"),
    "hidden-and-heads": (GPT + ["--hidden", "128", "--heads", "3"], "3 heads"),
    "hidden-and-kv-heads": (LLAMA + ["--hidden", "1024", "--kv-heads", "3"], "3 kv-heads"),
    "export-hidden-not-whole-heads": (EXPORT + ["--hidden", "100"], "head size 32"),
    "fit-from-a-bad-shape": (FIT + ["--hidden", "100"], "head size 32"),
}

HF = {  # Hugging Face model sources: the error comes from reading the config
    "hf-model-empty": (["plan", "--hf-model", "", "--mesh", "2"], "''"),
    "hf-model-unknown": (["plan", "--hf-model", "nonsense-lm", "--mesh", "2"], "nonsense-lm"),
    "hf-config-missing": (["plan", "--hf-config", "{dir}/config.json", "--mesh", "2"], "cannot read"),
    "hf-config-binary": (["plan", "--hf-config", "{bin}", "--mesh", "2"], "not a text file"),
    "hf-config-not-a-config": (["plan", "--hf-config", "{foreign}", "--mesh", "2"], "model_type"),
    "hf-config-heads-zero": (["plan", "--hf-config", "{hf:heads0}", "--mesh", "2"], "num_attention_heads"),
    "hf-config-hidden-negative": (["plan", "--hf-config", "{hf:hidden-}", "--mesh", "2"], "hidden_size"),
    "hf-config-layers-absurd": (["plan", "--hf-config", "{hf:layers}", "--mesh", "2"], "100,000"),
    "hf-config-hidden-words": (["compare", "--hf-config", "{hf:words}", "--mesh", "2"], "hidden_size"),
    "hf-config-dropout": (["pareto", "--hf-model", "llama", "--mesh", "2", "--dropout", "off"], "dropout"),
}
HF_CONFIGS = {
    "heads0": '{"model_type": "llama", "num_attention_heads": 0}',
    "hidden-": '{"model_type": "llama", "hidden_size": -64}',
    "layers": '{"model_type": "llama", "num_hidden_layers": 100000}',
    "words": '{"model_type": "llama", "hidden_size": "wide"}',
}


@pytest.fixture
def files(tmp_path):
    (tmp_path / "binary.json").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "foreign.json").write_text('{"schema": "other/1", "data": []}')
    (tmp_path / "truncated.json").write_text('{"schema": "memshard.plan/1", "model": {')
    names = {"dir": str(tmp_path), "bin": str(tmp_path / "binary.json"), "foreign": str(tmp_path / "foreign.json"),
             "truncated": str(tmp_path / "truncated.json")}
    for name, text in HF_CONFIGS.items():
        (tmp_path / f"{name}.json").write_text(text)
        names[f"hf:{name}"] = str(tmp_path / f"{name}.json")
    return names


def fill(args: list[str], names: dict[str, str]) -> list[str]:
    out = []
    for a in args:
        for key, value in names.items():
            a = a.replace("{" + key + "}", value)
        out.append(a)
    return out


def check_one_line_error(argv: list[str], expect: str, tmp_path, capsys) -> None:
    precious = tmp_path / ("precious.png" if argv[:1] == ["pareto"] else "precious.json")
    precious.write_text("precious\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    with_json = argv if any(a in ("--json", "--out", "--plan") for a in argv) or not argv or argv[0] in (
        "frobnicate",) else argv + (["--out", str(precious)] if argv[0] == "pareto" else ["--json", str(precious)])
    assert main(with_json) == 2
    out, err = capsys.readouterr()
    lines = err.strip("\n").splitlines()
    assert len(lines) == 1 and lines[0].startswith("memshard: error: "), err
    assert "Traceback" not in err + out
    assert expect in lines[0], (expect, lines[0])
    assert precious.read_text() == "precious\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written, no temporary file


@pytest.mark.parametrize("case", list(CLI))
def test_a_bad_command_line_is_one_clear_line(case, files, tmp_path, capsys):
    args, expect = CLI[case]
    check_one_line_error(fill(args, files), expect, tmp_path, capsys)


@pytest.mark.parametrize("case", list(NUMERIC_CASES))
def test_a_numeric_option_out_of_range_is_one_clear_line(case, files, tmp_path, capsys):
    args, expect = NUMERIC_CASES[case]
    check_one_line_error(fill(args, files), expect, tmp_path, capsys)


def test_every_numeric_option_of_every_command_is_in_the_table():
    from memshard.cli import build_parser

    flags = {option for _, option, _, _ in NUMERIC.values()}
    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    for name, parser in commands.items():
        for action in parser._actions:
            text = (action.help or "") + " ".join(action.option_strings)
            takes_a_value = action.nargs != 0 and action.choices is None
            numeric = action.type is not None or any(w in text for w in ("bytes", "memory", "GB/s", "µs"))
            if takes_a_value and numeric:
                assert set(action.option_strings) & flags, (name, action.option_strings)


@pytest.mark.parametrize("case", list(SHAPES))
def test_an_inconsistent_shape_is_one_clear_line(case, files, tmp_path, capsys):
    args, expect = SHAPES[case]
    check_one_line_error(fill(args, files), expect, tmp_path, capsys)


@pytest.mark.parametrize("case", list(HF))
def test_a_bad_hugging_face_source_is_one_clear_line(case, files, tmp_path, capsys):
    pytest.importorskip("transformers")
    args, expect = HF[case]
    check_one_line_error(fill(args, files), expect, tmp_path, capsys)


# -- the Python API ----------------------------------------------------------------------------------
API = {
    "model-none": (lambda: memshard.plan(None, "2"), "NoneType"),
    "model-number": (lambda: memshard.plan(42, "2"), "int"),
    "mesh-none": (lambda: memshard.plan("gpt2", None), "None"),
    "mesh-float": (lambda: memshard.plan("gpt2", 2.5), "2.5"),
    "mesh-tuple-zero": (lambda: memshard.plan("gpt2", (2, 0)), "(2, 0)"),
    "batch-string": (lambda: memshard.plan("gpt2", "2", batch="8"), "'8'"),
    "batch-fraction": (lambda: memshard.plan("gpt2", "2", batch=2.5), "2.5"),
    "batch-bool": (lambda: memshard.plan("gpt2", "2", batch=True), "True"),
    "seq-negative": (lambda: memshard.plan("gpt2", "2", seq=-1), "-1"),
    "micro-batches-zero": (lambda: memshard.plan("gpt2", "2", micro_batches=0), "0"),
    "unknown-keyword": (lambda: memshard.plan("gpt2", "2", layers=2), "layers"),
    "precision": (lambda: memshard.plan("gpt2", "2", precision="int8"), "int8"),
    "objective": (lambda: memshard.plan("gpt2", "2", objective="speed"), "speed"),
    "pipeline-stages-bool": (lambda: memshard.plan("tiny-gpt", "4", pipeline=True), "True"),
    "pipeline-schedule": (lambda: memshard.plan("tiny-gpt", "4", pipeline=2, schedule="dualpipe"), "dualpipe"),
    "pipeline-schedule-alone": (lambda: memshard.plan("tiny-gpt", "4", schedule="gpipe"), "pipeline"),
    "pipeline-word": (lambda: memshard.plan("tiny-gpt", "4", pipeline="many"), "many"),
    "pipeline-start": (lambda: memshard.plan("tiny-gpt", "4", batch=8, micro_batches=4, pipeline=2,
                                             start=memshard.plan("tiny-gpt", "4")), "start"),
    "memory-budget-words": (lambda: memshard.plan("gpt2", "2", objective="time", memory_budget="lots"), "lots"),
    "memory-budget-negative": (lambda: memshard.plan("gpt2", "2", objective="time", memory_budget=-1), "-1"),
    "memory-budget-with-memory": (lambda: memshard.plan("gpt2", "2", memory_budget="80GiB"), "memory budget"),
    "max-step-time-nan": (lambda: memshard.plan("gpt2", "2", max_step_time_s=math.nan), "nan"),
    "time-limit-zero": (lambda: memshard.plan("gpt2", "2", time_limit_s=0), "0"),
    "gap-one": (lambda: memshard.plan("gpt2", "2", mip_gap=1.0), "1.0"),
    "zero3-unit": (lambda: memshard.plan("gpt2", "2", zero3_unit="block"), "block"),
    "recompute": (lambda: memshard.plan("gpt2", "2", recompute="partly"), "partly"),
    "strategy-recompute": (lambda: memshard.strategy_plan("gpt2", "2", "ddp", recompute="always"), "always"),
    "top-zero": (lambda: memshard.plan("gpt2", "2", top=0), "0"),
    "example-inputs-without-module": (lambda: memshard.plan("gpt2", "2", example_inputs=(1,)), "nn.Module"),
    # numbers out of range, as keywords (the command line's in NUMERIC)
    "batch-absurd": (lambda: memshard.plan("gpt2", "2", batch=10**30), "16,777,216"),
    "seq-inf": (lambda: memshard.plan("gpt2", "2", seq=math.inf), "inf"),
    "micro-batches-fraction": (lambda: memshard.plan("gpt2", "2", micro_batches=2.5), "2.5"),
    "layers-zero": (lambda: memshard.plan("gpt2", "2", num_layers=0), "layers"),
    "hidden-fraction": (lambda: memshard.plan("gpt2", "2", hidden=2.5), "hidden size"),
    "hidden-absurd": (lambda: memshard.plan("gpt2", "2", hidden=10**30), "hidden size"),
    "heads-nan": (lambda: memshard.plan("gpt2", "2", heads=math.nan), "heads"),
    "kv-heads-bool": (lambda: memshard.plan("llama3-8b", "2", kv_heads=True), "kv-heads"),
    "ffn-negative": (lambda: memshard.plan("gpt2", "2", ffn=-1), "MLP width"),
    "vocab-inf": (lambda: memshard.plan("gpt2", "2", vocab=math.inf), "vocabulary"),
    "hidden-not-whole-heads": (lambda: memshard.plan("gpt2", "2", hidden=100), "head size 64"),
    "max-step-time-inf": (lambda: memshard.plan("gpt2", "2", max_step_time_s=math.inf), "step-time budget"),
    "time-limit-inf": (lambda: memshard.plan("gpt2", "2", time_limit_s=1e400), "time limit"),
    "time-limit-bool": (lambda: memshard.plan("gpt2", "2", time_limit_s=True), "time limit"),
    "memory-budget-nan": (lambda: memshard.plan("gpt2", "2", objective="time", memory_budget=math.nan), "nan"),
    "memory-budget-overflow": (lambda: memshard.plan("gpt2", "2", objective="time", memory_budget="1e400GiB"),
                               "too large"),
    "memory-budget-absurd": (lambda: memshard.plan("gpt2", "2", objective="time", memory_budget=1e30), "1,024 PiB"),
    "gap-inf": (lambda: memshard.plan("gpt2", "2", mip_gap=math.inf), "gap"),
    "compare-slack-absurd": (lambda: memshard.compare("gpt2", "2", time_slack=1e30), "1e+30"),
    "fit-slowdown-inf": (lambda: memshard.fit("tiny-gpt", "4", max_slowdown=math.inf), "slowdown"),
    "fit-step-absurd": (lambda: memshard.fit("tiny-gpt", "4", knob="layers", step=10**6), "4,096"),
    "frontier-points-fraction": (lambda: frontier("gpt2", "2", points=2.5), "2.5"),
    "frontier-points-absurd": (lambda: frontier("gpt2", "2", points=10**6), "1,000"),
    "config-vocab-absurd": (lambda: memshard.get_config("gpt2", vocab=1 << 25), "16,777,216"),
    "parse-bytes-overflow": (lambda: parse_bytes("1e400GiB"), "too large"),
    "compare-slack-nan": (lambda: memshard.compare("gpt2", "2", time_slack=math.nan), "nan"),
    "compare-objective": (lambda: memshard.compare("gpt2", "2", max_step_time_s=1.0), "max_step_time_s"),
    "compare-pipeline-not-dividing": (lambda: memshard.compare("tiny-gpt", "2x2", batch=8, micro_batches=4,
                                                               pipeline=3), "do not divide"),
    "compare-pipeline-too-few-micro-batches": (lambda: memshard.compare("tiny-gpt", "2x2", batch=8, pipeline=2),
                                               "needs at least 2 micro-batches"),
    "compare-pipeline-word": (lambda: memshard.compare("tiny-gpt", "2x2", batch=8, micro_batches=4,
                                                       pipeline="auto"), "auto"),
    "strategy-pipelined-not-laid-out": (lambda: memshard.strategy_plan("tiny-gpt", "2x4", "megatron-tp4-pp2-sp-distopt",
                                                                       batch=8, micro_batches=4), "does not lay out"),
    "frontier-one-point": (lambda: frontier("gpt2", "2", points=1), "1"),
    "fit-a-graph": (lambda: memshard.fit(memshard.build_graph("tiny-gpt"), "4"), "rebuilds the job"),
    "fit-unknown-knob": (lambda: memshard.fit("tiny-gpt", "4", knob="width"), "width"),
    "fit-step-zero": (lambda: memshard.fit("tiny-gpt", "4", knob="seq", step=0), "step"),
    "fit-objective-time": (lambda: memshard.fit("tiny-gpt", "4", objective="time"), "--max-step-time"),
    "strategy-unknown": (lambda: memshard.strategy_plan("gpt2", "2", "nonsense", num_layers=1), "nonsense"),
    "job-knob-unknown": (lambda: Job("gpt2", "2", overrides={"depth": 2}), "depth"),
    "hf-source-empty": (lambda: Job(HFModel(""), "2"), "''"),
    "job-batch-with-graph": (lambda: Job(memshard.build_graph("tiny-gpt", batch=2), "2", batch=4), "batch"),
    "config-unknown": (lambda: memshard.get_config("gpt5"), "gpt5"),
    "parse-mesh": (lambda: memshard.parse_mesh("two by four"), "two by four"),
    "load-plan-not-a-path": (lambda: load_plan(None), "None"),
    "plan-from-foreign-dict": (lambda: plan_from_dict({"schema": "other/1"}), "not a memshard plan"),
    "export-memshard-plan": (lambda: memshard.export("tiny-gpt", "4"), "memshard.parallelize"),
    "export-strategy-none": (lambda: memshard.export("tiny-gpt", "4", strategy=None), "None"),
    "export-tp-fsdp": (lambda: memshard.export("tiny-gpt", "2x2", strategy="tp2-fsdp2"), "parallelize_module"),
    "export-search-option": (lambda: memshard.export("tiny-gpt", "4", strategy="ddp", objective="time"), "objective"),
    "export-ddp-mixed-graph": (lambda: memshard.export(memshard.build_graph("gpt2", batch=2, seq=16), "2",
                                                       strategy="ddp"), "fp32"),
    "export-megatron-graph": (lambda: memshard.export(memshard.build_graph("tiny-gpt", batch=4), "4",
                                                      strategy="megatron-tp4"), "built-in"),
}


@pytest.mark.parametrize("case", list(API))
def test_a_bad_api_call_raises_one_clear_error(case):
    call, expect = API[case]
    with pytest.raises(MemshardError) as raised:
        call()
    assert expect in str(raised.value), str(raised.value)


def test_files_that_are_not_plans(files, tmp_path):
    for path, expect in ((files["bin"], "not a text file"), (files["truncated"], "not valid JSON"),
                         (files["foreign"], "not a memshard plan"), (files["dir"], "cannot read")):
        with pytest.raises(MemshardError, match=expect):
            load_plan(path)


def test_a_plan_saved_to_a_directory_names_the_path(tmp_path):
    plan = memshard.plan("gpt2", "4", batch=4, seq=64, num_layers=1)
    with pytest.raises(MemshardError, match=f"cannot write {tmp_path}: it is a directory"):
        plan.save(str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_the_catalogue_has_over_80_cases():
    assert len(CLI) + len(HF) + len(API) >= 120
