"""The ``memshard`` command line.

Every subcommand that takes a job takes the same options, declared once: the model (a
preset, a Hugging Face config or model type) and its knobs, the mesh and its hardware, the
batch, sequence and micro-batches, and the search. Every failure the user can cause (unknown
model, bad mesh, impossible budget, solver limit) prints one line ``memshard: error: …`` and
exits with code 2; nothing is written then.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from memshard.core.errors import MemshardError
from memshard.core.quantities import check_bytes, parse_bytes, parse_count, parse_seconds

EXIT_USAGE = 2
# memshard's model knobs (``job.MODEL_KNOBS``) and their flags; kept here so that
# ``memshard --help`` imports nothing heavy (a test checks the two lists agree).
KNOB_FLAGS = {"num_layers": "--layers", "hidden": "--hidden", "heads": "--heads", "kv_heads": "--kv-heads",
              "ffn": "--ffn", "vocab": "--vocab", "dropout": "--dropout"}
KNOB_HELP = {
    "num_layers": "transformer layers",
    "hidden": "hidden size; the heads, kv-heads and MLP width follow it unless given too",
    "heads": "attention heads (with --hidden: default hidden / the model's head size)",
    "kv_heads": "key/value heads, grouped-query attention (with --hidden: default the model's heads per kv-head "
                "kept)",
    "ffn": "MLP width (with --hidden: default the model's ratio to the hidden size, rounded)",
    "vocab": "vocabulary size",
}
# Options that describe the job: a saved plan (--plan) replaces them all.
PLOT_FORMATS = ("png", "pdf", "svg")
FIT_KNOBS = ("batch", "seq", "layers", "hidden")  # ``fit.KNOBS`` (a test checks they agree)
SEARCH_DESTS = ("objective", "max_step_time", "memory_budget", "zero3_unit", "recompute", "exact", "full_mesh",
                "mesh_views", "time_limit", "gap")
JOB_DESTS = ("model", "hf_config", "hf_model", "attn_implementation", "mesh", "batch", "seq", "micro_batches",
             "precision", *KNOB_FLAGS, "gpu", "hardware", "axis_names", "bandwidth", "latency", "device_memory", "peak_tflops",
             "efficiency")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one clear line, no usage dump
        raise MemshardError(message)

    def parse_known_args(self, args=None, namespace=None):
        return super().parse_known_args(_negative_values(sys.argv[1:] if args is None else list(args)), namespace)


NEGATIVE = re.compile(r"-(\d|\.\d|inf|nan)", re.IGNORECASE)


def _negative_values(argv: list[str]) -> list[str]:
    """``--bandwidth -25,150`` as ``--bandwidth=-25,150``: argparse takes a value that starts
    with ``-`` for an option (unless it is a plain number), and says "expected one argument"
    where the value itself is what is wrong."""
    out: list[str] = []
    for token in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and NEGATIVE.match(token):
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


def _option_type(parse):
    """An argparse ``type`` from a parser of ``core/quantities.py``: its range and its one-line
    MemshardError (argparse prints it as the option's error)."""
    def read(text: str):
        try:
            return parse(text)
        except MemshardError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    read.__name__ = parse.__name__
    return read


def _size(text: str) -> int:
    """A size in bytes, at least one and at most ``MAX_BYTES``."""
    value = parse_bytes(text)
    check_bytes(value, "a size")
    return value


_positive_int = _option_type(parse_count)  # a count from 1 to MAX_COUNT


def _stages(text: str) -> int | str:
    """``--pipeline``: ``auto``, ``none`` or a number of stages."""
    return text if text in ("auto", "none") else parse_count(text)


_pipeline = _option_type(_stages)


def _split(text: str) -> str | tuple[int, ...]:
    """``--stage-layers``: ``even``, ``balanced`` or a count per stage (``10,11,11``)."""
    if text in ("even", "balanced"):
        return text
    try:
        return tuple(parse_count(part) for part in text.split(","))
    except MemshardError:
        raise MemshardError(f"expected even, balanced or a layer count per stage such as 10,11,11, got {text!r}"
                            ) from None


_stage_split = _option_type(_split)
_seconds = _option_type(parse_seconds)  # a duration, positive and at most MAX_SECONDS
_bytes = _option_type(_size)


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


# -- the shared vocabulary ---------------------------------------------------------------------------
def add_job_arguments(parser: argparse.ArgumentParser, required: bool) -> None:
    """The job: model source and knobs, mesh and hardware, batch, sequence, micro-batches."""
    group = parser.add_mutually_exclusive_group(required=required)
    group.add_argument("--model", help="preset name (see `memshard models`)")
    group.add_argument("--hf-config", metavar="PATH", help="a Hugging Face config.json (or its folder) to trace")
    group.add_argument("--hf-model", metavar="TYPE",
                       help="a transformers model type with a built-in config: gpt2, llama, mistral, qwen2, bert…")
    parser.add_argument("--attn-implementation", choices=("sdpa", "eager"),
                        help="with --hf-*: the attention kernel to trace (default: the model's)")
    parser.add_argument("--mesh", required=required, help="mesh shape, e.g. 2x4 or 8x8x16 (devices fill nodes from the last axis)")
    parser.add_argument("--batch", type=_positive_int, help="global batch in sequences (default: one per device)")
    parser.add_argument("--seq", type=_positive_int, help="sequence length (default: the model's)")
    parser.add_argument("--micro-batches", type=_positive_int,
                        help="gradient accumulation: run the batch as this many equal micro-batches per step")
    g = parser.add_argument_group(
        "model knobs (override the model's)",
        "--hidden resizes the model as `fit --max hidden` does: the heads keep their size, the kv-heads "
        "their group of heads, the MLP width its ratio to the hidden size; a knob given too wins. Every "
        "report then gives the resulting sizes and parameter count beside the model's name.")
    for knob, flag in KNOB_FLAGS.items():
        if knob == "dropout":
            g.add_argument(flag, choices=("on", "off"), help="dropout layers (built-in models)")
        else:
            g.add_argument(flag, type=_positive_int, dest=knob, metavar="N", help=KNOB_HELP[knob])
    g.add_argument("--precision", choices=("mixed", "fp32", "autocast"),
                   help="mixed (bf16 with fp32 master weights and Adam states; the default, but the tiny "
                        "models are fp32), fp32, or autocast (fp32 weights, torch.autocast to bf16 on CUDA, as "
                        "DDP users train in bf16; traced models only)")
    from memshard.core.hardware import DEFAULT_GPU, PRESETS

    m = parser.add_argument_group(f"hardware (default: {DEFAULT_GPU}, nodes of 8; docs/hardware.md)")
    m.add_argument("--gpu", choices=tuple(PRESETS), help=f"the device (default {DEFAULT_GPU})")
    m.add_argument("--hardware", metavar="FILE", help="the device as a JSON or TOML file of hardware fields")
    m.add_argument("--axis-names", help="comma-separated mesh axis names")
    m.add_argument("--bandwidth", type=_floats, help="NCCL bus GB/s per device for each mesh axis, comma-separated")
    m.add_argument("--latency", type=_floats, help="µs per ring step for each mesh axis, comma-separated")
    m.add_argument("--device-memory", type=_bytes, help="memory per device (default: the GPU's)")
    m.add_argument("--peak-tflops", type=float, help="dense 16-bit peak TFLOP/s per device (default: the GPU's)")
    m.add_argument("--efficiency", type=float, help="the best GEMMs' fraction of peak (default: the GPU's)")


def add_search_arguments(parser: argparse.ArgumentParser, objective: bool) -> None:
    """The search space and the solver; with ``objective``, the objective and its budget."""
    s = parser.add_argument_group("search")
    if objective:
        s.add_argument("--objective", choices=("memory", "time"),
                       help="memory: least peak memory (default); time: fastest step within --memory-budget")
        s.add_argument("--max-step-time", type=_seconds, help="with --objective memory: step-time budget, e.g. 2.5s")
        s.add_argument("--memory-budget", type=_bytes,
                       help="with --objective time: bytes per device, e.g. 80GiB (default: --device-memory)")
    s.add_argument("--zero3-unit", choices=("op", "layer"),
                   help="what ZeRO-3 gathers at once: each op's weights (least memory) or a whole layer's "
                        "(FSDP's unit: far fewer collectives); default: per op, and for the least memory with "
                        "--recompute both, the leaner plan kept")
    s.add_argument("--recompute", choices=("none", "selective", "full", "auto"),
                   help="activation recomputation: none (default), selective (core attention, as Megatron-LM), "
                        "full (every layer keeps only its input), auto (the search chooses per op; with "
                        "--objective time --memory-budget: the fastest plan that fits)")
    s.add_argument("--exact", action="store_true", help="solve without sharing variables across identical layers")
    s.add_argument("--full-mesh", action="store_true",
                   help="on 3+ axis meshes, search every axis separately (slow) instead of merging alike axes")
    s.add_argument("--mesh-views", choices=("on", "off"),
                   help="also search the other ways the devices form mesh axes (a node of 8 as 2x4); default: on "
                        "for --objective time, off for the least memory")
    s.add_argument("--time-limit", type=_seconds, help="solver time limit per plan (default 60s)")
    s.add_argument("--gap", type=float,
                   help="relative optimality gap the solver may stop at (default 0.002 = 0.2%%; the least memory with "
                        "--recompute: 0.03; run, simulate: 0.02)")


def job_of(args):
    """The job the options describe."""
    from memshard.job import Job

    knobs = {k: getattr(args, k) for k in KNOB_FLAGS if k != "dropout"}
    if args.dropout:
        knobs["dropout"] = args.dropout == "on"
    return Job(_model_of(args), _mesh_of(args), batch=args.batch, seq=args.seq, micro_batches=args.micro_batches or 1,
               overrides=knobs, precision=args.precision)


def options_of(args, gap: float | None = None):
    """The search the options ask for (``gap``: the default when none is given; None:
    ``SearchOptions.gap`` says)."""
    from memshard.planner import SearchOptions

    def given(name: str, default):
        value = getattr(args, name, None)
        return default if value is None else value

    return SearchOptions(objective=given("objective", "memory"), max_step_time_s=given("max_step_time", None),
                         memory_budget=given("memory_budget", None), exact=args.exact, full_mesh=args.full_mesh,
                         zero3_unit=given("zero3_unit", None), time_limit_s=given("time_limit", 60.0),
                         mip_gap=given("gap", gap), top=given("top", 10), recompute=given("recompute", "none"),
                         mesh_views=None if getattr(args, "mesh_views", None) is None else args.mesh_views == "on")


def _model_of(args):
    """The --model / --hf-config / --hf-model choice as what the job takes."""
    if args.hf_config is not None or args.hf_model is not None:
        from memshard.job import HFModel

        return HFModel(args.hf_model if args.hf_config is None else args.hf_config, args.attn_implementation)
    if args.attn_implementation:
        raise MemshardError("--attn-implementation applies to --hf-config / --hf-model only")
    return args.model


def _mesh_of(args):
    from memshard.core.hardware import load_hardware
    from memshard.core.mesh import parse_mesh

    _check_hardware(args)
    if args.gpu and args.hardware:
        raise MemshardError("give --gpu or --hardware, not both (a --hardware file names its preset as `base`)")
    names = tuple(args.axis_names.split(",")) if args.axis_names else None
    mesh = parse_mesh(
        args.mesh,
        names=names,
        device_memory_bytes=args.device_memory,
        peak_flops=args.peak_tflops * 1e12 if args.peak_tflops is not None else None,
        compute_efficiency=args.efficiency,
        hardware=load_hardware(args.hardware) if args.hardware else args.gpu,
    )
    return mesh.with_links(
        bandwidths=tuple(b * 1e9 for b in args.bandwidth) if args.bandwidth else None,
        latencies=tuple(v * 1e-6 for v in args.latency) if args.latency else None,
    )


# The most each hardware figure may be, in the unit its option takes (no device comes near).
MOST = {"--bandwidth": 1e6, "--latency": 1e6, "--peak-tflops": 1e6, "--efficiency": 1.0}


def _check_hardware(args) -> None:
    """Hardware figures in the units the user gave them, each named by its option: finite,
    positive (a latency may be 0) and at most ``MOST``."""
    import math

    def bad(values, low_ok: bool, most: float) -> bool:
        return any(not math.isfinite(v) or v < 0 or (v == 0 and not low_ok) or v > most for v in values)

    for flag, values, zero_ok, what in (("--bandwidth", args.bandwidth, False, "positive GB/s per mesh axis"),
                                        ("--latency", args.latency, True, "non-negative µs per mesh axis"),
                                        ("--peak-tflops", (args.peak_tflops,), False, "a positive number"),
                                        ("--efficiency", (args.efficiency,), False, "a fraction in (0, 1]")):
        if values is not None and values != (None,) and bad(values, zero_ok, MOST[flag]):
            most = "" if flag == "--efficiency" else f" of at most {MOST[flag]:,.0f}"
            raise MemshardError(f"{flag}: give {what}{most}, got {','.join(f'{v:g}' for v in values)}")


def _check_json_path(path: str | None) -> None:
    """Refuse a ``--json`` path that cannot be written, before any work."""
    if path is not None:
        from memshard.core.files import check_output_path

        check_output_path(path, "--json")


def _check_plot_path(path: str, flag: str = "--out") -> None:
    """A plot path matplotlib can write, by its extension, before any work."""
    from memshard.core.files import check_output_path

    check_output_path(path, flag)
    extension = os.path.splitext(path)[1].lower().lstrip(".")
    if extension not in PLOT_FORMATS:
        raise MemshardError(f"{flag} {path}: give a {', '.join('.' + f for f in PLOT_FORMATS)} file")


def _write_json(path: str, data) -> None:
    import json

    from memshard.core.files import write_text_atomically

    write_text_atomically(path, json.dumps(data, indent=2) + "\n")


# the pipeline schedules (``pipelining.PIPELINE_SCHEDULES``; ``memshard --help`` imports neither)
SCHEDULE_CHOICES = ("1f1b", "gpipe", "interleaved-1f1b", "interleaved-zb", "zbv")


# -- commands --------------------------------------------------------------------------------------
def _cmd_plan(args, console) -> None:
    from memshard.pipelining import plan_with_pipeline
    from memshard.plans.plan import Plan
    from memshard.plans.report import render_pipelined, render_plan

    _check_json_path(args.json)
    job, options = job_of(args), options_of(args)
    with console.status("solving…"):
        result = plan_with_pipeline(job, options, args.pipeline, args.schedule, split=args.stage_layers,
                                    stages_per_rank=args.virtual_stages)
    if args.json is not None:
        _write_json(args.json, result.to_dict())
    render = render_plan if isinstance(result, Plan) else render_pipelined
    render(result, console, top=args.top, show_strategy=not args.brief, show_stages=args.verbose)
    if args.json is not None:
        console.print(f"plan written to {args.json}")


def _cmd_compare(args, console) -> None:
    from memshard.api import compare
    from memshard.plans.report import render_comparison

    _check_json_path(args.json)
    job, options = job_of(args), options_of(args)
    with console.status("solving…"):
        result = compare(job, time_slack=args.time_slack, pipeline=args.pipeline, **_search_keywords(options))
    if args.json is not None:
        _write_json(args.json, result)
    render_comparison(result, console, job)


def _search_keywords(options) -> dict:
    """A SearchOptions as keyword arguments of the API."""
    from dataclasses import asdict

    return {k: v for k, v in asdict(options).items() if k not in ("objective", "max_step_time_s", "memory_budget")}


def _cmd_pareto(args, console) -> None:
    from memshard.pareto import draw, frontier, frontier_table

    _check_plot_path(args.out)
    job, options = job_of(args), options_of(args)
    with console.status("sweeping the step-time budget…"):
        points, base = frontier(job, points=args.points, **_search_keywords(options))
    draw(points, base, _title(args, job), job.mesh.device_memory_bytes, args.out)
    console.print(frontier_table(points))
    console.print(f"plot written to {args.out}")


def _cmd_fit(args, console) -> None:
    from memshard.fitting import draw_fit, fit_job
    from memshard.plans.report import render_fit

    _check_json_path(args.json)
    if args.plot is not None:
        _check_plot_path(args.plot, "--plot")
    job, options = job_of(args), options_of(args)
    with console.status(f"fitting the {args.knob}…"):
        result = fit_job(job, args.knob, options, step=args.step, baselines=not args.no_baselines,
                         max_slowdown=args.max_slowdown, pipeline=args.pipeline)
    if args.json is not None:
        _write_json(args.json, result.to_dict())
    if args.plot is not None:
        draw_fit(result, _title(args, job), args.plot)
    render_fit(result, console)
    for path, what in ((args.json, "fit"), (args.plot, "plot")):
        if path is not None:
            console.print(f"{what} written to {path}")


def _title(args, job) -> str:
    """A plot's title: the model (its sizes where overridden) on the mesh."""
    sizes = job.overridden_sizes()
    return f"{args.model or args.hf_config or args.hf_model}{f' ({sizes})' if sizes else ''} on {args.mesh}"


def _runtime_plan(args):
    """The plan ``run`` and ``simulate`` execute: ``--plan``, or the job's (pipelined with
    ``--pipeline N``)."""
    from memshard.api import runtime_plan

    if args.plan is not None:
        given = [f"--{d.replace('_', '-')}" for d in (*JOB_DESTS, *SEARCH_DESTS, "strategy", "pipeline", "schedule",
                                                         "stage_layers", "virtual_stages")
                 if getattr(args, d, None) not in (None, False)]
        if given:
            raise MemshardError(f"--plan replaces the job, its search and its strategy: give no {', '.join(given)}")
        from memshard.plans.pipelined import PipelinedPlan, load_any_plan
        from memshard.plans.plan import runnable

        plan = load_any_plan(args.plan)
        return plan if isinstance(plan, PipelinedPlan) else runnable(plan)
    if (args.model, args.hf_config, args.hf_model) == (None, None, None) or args.mesh is None:
        raise MemshardError("give --plan, or a model (--model, --hf-config or --hf-model) and --mesh")
    from memshard.plans.plan import check_runnable_precision

    check_runnable_precision(args.precision)  # before any planning
    if args.pipeline is not None:
        if args.strategy not in (None, "memshard"):
            raise MemshardError("--pipeline runs memshard's pipelined plan: give no --strategy")
        from memshard.pipelining import plan_with_pipeline

        return plan_with_pipeline(job_of(args), options_of(args, gap=0.02), args.pipeline, args.schedule,
                                  split=args.stage_layers, stages_per_rank=args.virtual_stages)
    if args.schedule is not None or args.stage_layers is not None or args.virtual_stages is not None:
        flag = next(f for f, d in (("--schedule", "schedule"), ("--stage-layers", "stage_layers"),
                                   ("--virtual-stages", "virtual_stages")) if getattr(args, d) is not None)
        raise MemshardError(f"{flag} orders or divides a pipeline's stages: give --pipeline too")
    return runtime_plan(job_of(args), args.strategy or "memshard", options_of(args, gap=0.02))


def _devices(plan) -> int:
    """The devices a plan (pipelined or not) runs on."""
    from memshard.plans.pipelined import PipelinedPlan

    return (plan.mesh if isinstance(plan, PipelinedPlan) else plan.job.mesh).num_devices


def _cmd_run(args, console) -> None:
    from memshard.core.quantities import counted
    from memshard.runtime.launch import launch, private_tempdir
    from memshard.runtime.report import render_run

    _check_json_path(args.json)
    if args.steps < 2:
        raise MemshardError("--steps must be at least 2: the last step is measured with optimizer states in place")
    with console.status("planning…"):
        result = _runtime_plan(args)
    n = _devices(result)
    with private_tempdir("memshard-run-") as tmp:  # removed even if a signal stops the run
        path = os.path.join(tmp, "plan.json")
        result.save(path)
        with console.status(f"running {counted(n, 'rank')}…"):
            reports = launch("memshard.runtime.train", ["--plan", path, "--steps", str(args.steps)], n,
                             timeout_s=args.timeout)
    if args.json:
        _write_json(args.json, {"schema": "memshard.run/1", "ranks": reports})
    render_run(reports, console)


def _cmd_simulate(args, console) -> None:
    from memshard.runtime.report import render_run
    from memshard.runtime.simulate import simulate

    _check_json_path(args.json)
    if args.rank < 0:  # before any planning
        raise MemshardError(f"--rank must be 0 or more, got {args.rank}")
    with console.status("planning…"):
        result = _runtime_plan(args)
    from memshard.plans.pipelined import PipelinedPlan

    if isinstance(result, PipelinedPlan):
        raise MemshardError("simulate runs ordinary plans: torch's pipeline stages move their tensors by "
                            "point-to-point, which the fake process group does not; run a pipelined plan with "
                            "`memshard run` (docs/pipelining.md)")
    n = result.job.mesh.num_devices
    if not 0 <= args.rank < n:
        raise MemshardError(f"--rank must be in [0, {n})")
    with console.status(f"simulating rank {args.rank} of {n}…"):
        report = simulate(result, rank=args.rank)
    if args.json is not None:
        _write_json(args.json, {"schema": "memshard.simulate/1", "ranks": [report]})
    render_run([report], console, title=f"memshard simulate ({n} ranks, fake process group)")


def _cmd_export(args, console) -> None:
    from memshard.api import export

    if args.out is not None:
        from memshard.core.files import check_output_path

        check_output_path(args.out, "--out")
        if os.path.isfile(args.out) and not args.force:
            raise MemshardError(f"--out {args.out} exists: give --force to replace it")
    elif args.force:
        raise MemshardError("--force replaces an --out file: give --out")
    text = export(job_of(args), strategy=args.strategy)
    if args.out is None:
        sys.stdout.write(text)
        return
    from memshard.core.files import write_text_atomically

    write_text_atomically(args.out, text)
    print(f"{args.strategy} written to {args.out}")


def _cmd_models(args, console) -> None:
    from rich.table import Table

    from memshard.core.quantities import format_count
    from memshard.models import PRESETS, build_graph

    t = Table(title="Built-in models")
    for col in ("name", "family", "parameters", "layers", "hidden", "heads", "kv-heads", "ffn", "vocab", "seq"):
        t.add_column(col, justify="left" if col in ("name", "family") else "right", no_wrap=True)
    for name, cfg in PRESETS.items():
        count = format_count(build_graph(cfg, batch=1, seq=8).num_parameters)
        t.add_row(name, cfg.family, count, str(cfg.num_layers), str(cfg.hidden), str(cfg.heads),
                  str(cfg.num_kv_heads), str(cfg.ffn), str(cfg.vocab), str(cfg.default_seq))
    console.print(t)


# -- the parser ------------------------------------------------------------------------------------
def _add_plan_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``memshard plan``."""
    add_job_arguments(p, required=True)
    add_search_arguments(p, objective=True)
    p.add_argument("--json", metavar="PATH", help="write the complete plan as JSON")
    p.add_argument("--top", type=_positive_int, default=10, help="how many of the most redundant ops to list")
    p.add_argument("--brief", action="store_true", help="omit the per-op strategy tables")
    p.add_argument("--verbose", action="store_true",
                   help="also list the search's stages: what each found and proved, its time, why it stopped")
    p.add_argument("--pipeline", type=_pipeline, metavar="N|auto|none",
                   help="split the layers into N pipeline stages along the outermost mesh axis, or search every "
                        "N and none for the best (auto); default none (docs/pipelining.md)")
    p.add_argument("--schedule", choices=SCHEDULE_CHOICES, help="the pipeline's schedule (default 1f1b)")
    p.add_argument("--virtual-stages", type=_positive_int, metavar="V",
                   help="stages per pipeline rank of an interleaved schedule (default 2; zbv: 2)")
    p.add_argument("--stage-layers", type=_stage_split, metavar="even|balanced|N,N,…",
                   help="how the pipeline's layers split: evenly (default), balanced (a split searched for the "
                        "objective), or a count per stage")


def _add_runtime_parsers(sub) -> None:
    """``memshard run`` and ``memshard simulate``."""
    for name, help_text in (("run", "plan (or load a plan), launch the ranks on this machine, train, and compare "
                                    "measured memory and communication with the prediction"),
                            ("simulate", "measure one rank of a large job in one process "
                                         "(fake process group, no memory allocated)")):
        r = sub.add_parser(name, help=help_text)
        r.add_argument("--plan", help="a plan JSON written by `memshard plan --json` (replaces the job options)")
        add_job_arguments(r, required=False)
        add_search_arguments(r, objective=True)
        r.add_argument("--strategy",
                       help="memshard (default) or a baseline: dp, zero1, zero3-fsdp, megatron-tp4-sp… "
                            "(`memshard compare` lists them)")
        r.add_argument("--json", metavar="PATH", help="write the per-rank reports as JSON")
        r.add_argument("--pipeline", type=_positive_int, metavar="N",
                       help="N pipeline stages along the outermost mesh axis (memshard's pipelined plan; "
                            "docs/pipelining.md)")
        r.add_argument("--schedule", choices=SCHEDULE_CHOICES, help="the pipeline's schedule (default 1f1b)")
        r.add_argument("--virtual-stages", type=_positive_int, metavar="V",
                       help="stages per pipeline rank of an interleaved schedule (default 2)")
        r.add_argument("--stage-layers", type=_stage_split, metavar="even|balanced|N,N,…",
                       help="how the pipeline's layers split (default even)")
        if name == "run":
            r.add_argument("--steps", type=_positive_int, default=3, help="optimizer steps (≥ 2; the last is measured)")
            r.add_argument("--timeout", type=_seconds, default=600.0, help="stop every rank after this long")
        else:
            r.add_argument("--rank", type=int, default=0, help="the rank to play (default 0)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="memshard", description="Find the parallelism strategy with the least per-device memory.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    _add_plan_arguments(sub.add_parser("plan", help="plan a model on a mesh and print the plan"))

    c = sub.add_parser("compare", help="memshard's plans against DDP, ZeRO, Megatron TP/SP and TP×FSDP")
    add_job_arguments(c, required=True)
    add_search_arguments(c, objective=False)
    c.add_argument("--time-slack", type=float,
                   help="memshard's second row: least memory within this × the fastest baseline's time (default 1.1)")
    c.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    c.add_argument("--pipeline", type=_positive_int, metavar="N",
                   help="N pipeline stages (1F1B) along the outermost mesh axis: memshard's pipelined plans against "
                        "every Megatron-LM configuration with N stages (megatron-tp<T>-pp<N>…)")

    f = sub.add_parser("pareto", help="memshard's memory–time frontier with the baselines, as a PNG and a table")
    add_job_arguments(f, required=True)
    add_search_arguments(f, objective=False)
    f.add_argument("--points", type=_positive_int, default=8, help="frontier points (at least 2)")
    f.add_argument("--out", default="pareto.png", help="PNG path (default pareto.png)")

    t = sub.add_parser("fit", help="the largest batch, sequence, layer count or hidden size, or the fewest devices, "
                                   "that fit the device memory, for memshard and every baseline")
    add_job_arguments(t, required=True)
    add_search_arguments(t, objective=False)
    which = t.add_mutually_exclusive_group(required=True)
    which.add_argument("--max", choices=FIT_KNOBS, dest="knob",
                       help="the knob to push: the global batch, the sequence length, the layers or the hidden "
                            "size (keeping the head size: heads, kv-heads and MLP width scale with it)")
    which.add_argument("--min", choices=("devices",), dest="knob",
                       help="the fewest devices: whole nodes of the mesh's inner axes, the outermost axis free, "
                            "the global batch kept")
    t.add_argument("--step", type=_positive_int,
                   help="search multiples of this (default: 1; the micro-batches for the batch; a whole group of "
                        "heads for the hidden size)")
    budget = t.add_mutually_exclusive_group()
    budget.add_argument("--max-step-time", type=_seconds, help="every strategy's step within this, e.g. 2.5s")
    budget.add_argument("--max-slowdown", type=float,
                        help="every strategy's step within this × memshard's fastest plan that fits at the same "
                             "value, e.g. 1.1")
    t.add_argument("--pipeline", type=_positive_int, metavar="N",
                   help="N pipeline stages (1F1B) along the outermost mesh axis: memshard's pipelined plans against "
                        "the pipelined Megatron-LM configurations of that degree (docs/pipelining.md)")
    t.add_argument("--no-baselines", action="store_true", help="memshard only (the baselines take most of the time)")
    t.add_argument("--json", metavar="PATH", help="write every strategy's answer and probes, and memshard's plan")
    t.add_argument("--plot", metavar="PATH", help="draw the knob against the peak of every strategy (.png/.pdf/.svg)")

    _add_runtime_parsers(sub)

    e = sub.add_parser("export", help="write a baseline for the framework it is named after: PyTorch code "
                                      "(fsdp2, ddp, torch-tp…) or Megatron-LM's arguments (megatron-…)")
    add_job_arguments(e, required=True)
    e.add_argument("--strategy", default="memshard",
                   help="fsdp2 (fully_shard per block and root), ddp (DistributedDataParallel), fsdp2-noreshard and "
                        "ddp-bucket-view (with reshard_after_forward=False, gradient_as_bucket_view=True), fsdp2-prefetch2 "
                        "(explicit prefetching of two blocks each way), fsdp2-torchtitan (torchtitan's units), fsdp2-reshard<n> (reshard_after_forward=n), "
                        "torch-tp…-fsdp…[-torchtitan] "
                        "(parallelize_module × fully_shard, traced models) or megatron-tp… "
                        "(`memshard compare` lists them); memshard's own plans run with memshard.parallelize")
    e.add_argument("--out", metavar="FILE", help="write to FILE, atomically, instead of standard output")
    e.add_argument("--force", action="store_true", help="replace an existing --out file")

    sub.add_parser("models", help="list the built-in model presets")
    return parser


COMMANDS = {"plan": _cmd_plan, "compare": _cmd_compare, "pareto": _cmd_pareto, "fit": _cmd_fit, "run": _cmd_run,
            "simulate": _cmd_simulate, "export": _cmd_export, "models": _cmd_models}


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    # Piped output gets a wide console: tables stay whole instead of being cut to 80 columns.
    console = Console() if sys.stdout.isatty() else Console(width=160)
    try:
        args = build_parser().parse_args(argv)
        from memshard.runtime.launch import interrupt_on_signals

        with interrupt_on_signals():  # SIGTERM and SIGHUP clean up like Ctrl-C
            COMMANDS[args.command](args, console)
        return 0
    except MemshardError as e:
        print(f"memshard: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (KeyboardInterrupt, OSError) as e:
        import signal

        # an OSError while the interrupt unwinds: the terminal is gone (SIGHUP), and so is the
        # spinner that tried to clear itself; the clean-up ran all the same
        interrupt = e if isinstance(e, KeyboardInterrupt) else e.__context__
        if not isinstance(interrupt, KeyboardInterrupt):
            raise
        signum = getattr(interrupt, "signum", signal.SIGINT)  # launch.Interrupted carries its signal
        try:
            print(f"memshard: interrupted{'' if signum == signal.SIGINT else f' by {interrupt}'}", file=sys.stderr)
        except OSError:
            pass
        return 128 + signum


if __name__ == "__main__":
    sys.exit(main())
