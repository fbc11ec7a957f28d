"""The ``memshard`` command line.

Every failure the user can cause (unknown model, bad mesh, impossible budget, solver limit)
prints one line ``memshard: error: …`` and exits with code 2; nothing is written then.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from memshard.errors import MemshardError

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one clear line, no usage dump
        raise MemshardError(message)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _seconds(text: str) -> float:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)\s*(ms|s|us|µs)?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a duration like 1.5s or 800ms, got {text!r}")
    scale = {"ms": 1e-3, "us": 1e-6, "µs": 1e-6}.get(m.group(2) or "s", 1.0)
    value = float(m.group(1)) * scale
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a duration must be positive, got {text!r}")
    return value


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _add_model_arguments(parser: argparse.ArgumentParser, required: bool) -> None:
    """One of: a preset, a Hugging Face config.json, a transformers model type."""
    group = parser.add_mutually_exclusive_group(required=required)
    group.add_argument("--model", help="preset name (see `memshard models`)")
    group.add_argument("--hf-config", metavar="PATH", help="a Hugging Face config.json (or its folder) to trace")
    group.add_argument("--hf-model", metavar="TYPE",
                       help="a transformers model type with a built-in config: gpt2, llama, mistral, qwen2, bert…")
    parser.add_argument("--attn-implementation", choices=("sdpa", "eager"),
                        help="with --hf-*: the attention kernel to trace (default: the model's)")


def _model_of(args):
    """The --model / --hf-config / --hf-model choice as what the API takes."""
    if getattr(args, "hf_config", None) or getattr(args, "hf_model", None):
        from memshard.api import HFModel

        return HFModel(args.hf_config or args.hf_model, args.attn_implementation)
    if getattr(args, "attn_implementation", None):
        raise MemshardError("--attn-implementation applies to --hf-config / --hf-model only")
    return args.model


def _add_zero3_unit_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--zero3-unit", choices=("op", "layer"), default="op",
                        help="what ZeRO-3 gathers at once: each op's weights (least memory, default) or a "
                             "whole layer's (FSDP's unit: far fewer collectives)")


def _add_job_arguments(parser: argparse.ArgumentParser) -> None:
    """The training job: model, mesh, batch, sequence length, micro-batches."""
    _add_model_arguments(parser, required=True)
    parser.add_argument("--mesh", required=True, help="mesh shape, e.g. 2x4 or 8x8x16 (last axis = within a node)")
    parser.add_argument("--batch", type=_positive_int, help="global batch in sequences (default: one per device)")
    parser.add_argument("--seq", type=_positive_int, help="sequence length (default: the preset's)")
    parser.add_argument("--micro-batches", type=_positive_int, default=1,
                        help="gradient accumulation: run the batch as this many equal micro-batches per step")
    _add_zero3_unit_argument(parser)


def _add_runtime_arguments(parser: argparse.ArgumentParser) -> None:
    """A job (or a saved plan) and the strategy to run it with."""
    parser.add_argument("--plan", help="a plan JSON written by `memshard plan --json` (replaces the job options)")
    _add_model_arguments(parser, required=False)
    parser.add_argument("--mesh", help="mesh shape, e.g. 2x2")
    parser.add_argument("--batch", type=_positive_int, help="global batch in sequences (default: one per device)")
    parser.add_argument("--seq", type=_positive_int, help="sequence length (default: the preset's)")
    parser.add_argument("--micro-batches", type=_positive_int, default=1)
    _add_zero3_unit_argument(parser)
    parser.add_argument("--strategy", default="memshard",
                        help="memshard (default) or a baseline: ddp, zero1, zero3-fsdp, megatron-tp4-sp… "
                             "(`memshard compare` lists them)")
    parser.add_argument("--objective", choices=("memory", "time"), default="memory")
    parser.add_argument("--precision", choices=("mixed", "fp32"),
                        help="the runtime executes fp32; defaults to fp32 for run and simulate")
    parser.add_argument("--json", metavar="PATH", help="write the per-rank reports as JSON")


def _runtime_plan(args):
    from memshard.api import runtime_plan

    return runtime_plan(args.plan, _model_of(args), args.mesh, strategy=args.strategy, objective=args.objective,
                        batch=args.batch, seq=args.seq, micro_batches=args.micro_batches,
                        precision=args.precision, zero3_unit=args.zero3_unit)


def _cmd_run(args, console) -> None:
    import json
    import tempfile

    from memshard.runtime.launch import launch
    from memshard.runtime.report import render_run

    _check_json_path(args.json)
    if args.steps < 2:
        raise MemshardError("--steps must be at least 2: the last step is measured with optimizer states in place")
    with console.status("planning…"):
        result = _runtime_plan(args)
    n = result.problem.mesh.num_devices
    with tempfile.TemporaryDirectory(prefix="memshard-run-") as tmp:
        path = os.path.join(tmp, "plan.json")
        result.save(path)
        with console.status(f"running {n} rank(s)…"):
            reports = launch("memshard.runtime.train", ["--plan", path, "--steps", str(args.steps)], n,
                             timeout_s=args.timeout)
    if args.json:
        from memshard.files import write_text_atomically

        write_text_atomically(args.json, json.dumps({"schema": "memshard.run/1", "ranks": reports}, indent=2) + "\n")
    render_run(reports, console)


def _cmd_simulate(args, console) -> None:
    import json

    from memshard.runtime.report import render_run
    from memshard.runtime.simulate import simulate

    _check_json_path(args.json)
    with console.status("planning…"):
        result = _runtime_plan(args)
    n = result.problem.mesh.num_devices
    if not 0 <= args.rank < n:
        raise MemshardError(f"--rank must be in [0, {n})")
    with console.status(f"simulating rank {args.rank} of {n}…"):
        report = simulate(result, rank=args.rank)
    if args.json:
        from memshard.files import write_text_atomically

        write_text_atomically(args.json, json.dumps({"schema": "memshard.simulate/1", "ranks": [report]}, indent=2) + "\n")
    render_run([report], console, title=f"memshard simulate ({n} ranks, fake process group)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="memshard", description="Find the parallelism strategy with the least per-device memory.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("plan", help="plan a model on a mesh and print the plan")
    _add_job_arguments(p)
    p.add_argument("--objective", choices=("memory", "time"), default="memory",
                   help="memory: least peak memory (default); time: fastest step within --memory-budget")
    p.add_argument("--max-step-time", type=_seconds, help="with --objective memory: step-time budget, e.g. 2.5s")
    p.add_argument("--memory-budget", help="with --objective time: bytes per device, e.g. 80GiB (default: --device-memory)")
    p.add_argument("--exact", action="store_true", help="solve without sharing variables across identical layers")
    p.add_argument("--full-mesh", action="store_true",
                   help="on 3+ axis meshes, search every axis separately (slow) instead of merging alike axes")
    p.add_argument("--time-limit", type=_seconds, default=60.0, help="solver time limit (default 60s)")
    p.add_argument("--gap", type=float, default=2e-3,
                   help="relative optimality gap the solver may stop at (default 0.002 = 0.2%%)")
    p.add_argument("--json", metavar="PATH", help="write the complete plan as JSON")
    p.add_argument("--top", type=_positive_int, default=10, help="how many of the most redundant ops to list")
    p.add_argument("--brief", action="store_true", help="omit the per-op strategy tables")
    g = p.add_argument_group("model knobs (override the preset)")
    g.add_argument("--layers", type=_positive_int, dest="num_layers")
    g.add_argument("--hidden", type=_positive_int)
    g.add_argument("--heads", type=_positive_int)
    g.add_argument("--kv-heads", type=_positive_int)
    g.add_argument("--ffn", type=_positive_int)
    g.add_argument("--vocab", type=_positive_int)
    g.add_argument("--precision", choices=("mixed", "fp32"))
    g.add_argument("--dropout", choices=("on", "off"))
    m = p.add_argument_group("hardware (defaults: A100/H100-class)")
    m.add_argument("--axis-names", help="comma-separated mesh axis names")
    m.add_argument("--bandwidth", type=_floats, help="GB/s per device for each mesh axis, comma-separated")
    m.add_argument("--latency", type=_floats, help="µs per collective step for each mesh axis, comma-separated")
    m.add_argument("--device-memory", help="memory per device (default 80GiB)")
    m.add_argument("--peak-tflops", type=float, help="peak TFLOP/s per device (default 312)")
    m.add_argument("--efficiency", type=float, help="fraction of peak reached (default 0.5)")

    c = sub.add_parser("compare", help="memshard's plans against DDP, ZeRO, Megatron TP/SP and TP×FSDP")
    _add_job_arguments(c)
    c.add_argument("--time-slack", type=float, default=1.1,
                   help="memshard's second row: least memory within this × the fastest baseline's time")
    c.add_argument("--time-limit", type=_seconds, default=60.0, help="solver time limit per plan")
    c.add_argument("--json", metavar="PATH", help="write the rows as JSON")

    f = sub.add_parser("pareto", help="memshard's memory–time frontier with the baselines, as a PNG and a table")
    _add_job_arguments(f)
    f.add_argument("--points", type=_positive_int, default=8, help="frontier points (at least 2)")
    f.add_argument("--time-limit", type=_seconds, default=60.0, help="solver time limit per plan")
    f.add_argument("--out", default="pareto.png", help="PNG path (default pareto.png)")

    r = sub.add_parser("run", help="plan (or load a plan), launch the ranks on this machine, train, "
                                   "and compare measured memory and communication with the prediction")
    _add_runtime_arguments(r)
    r.add_argument("--steps", type=_positive_int, default=3, help="optimizer steps (≥ 2; the last is measured)")
    r.add_argument("--timeout", type=_seconds, default=600.0, help="stop every rank after this long")

    s = sub.add_parser("simulate", help="measure one rank of a large job in one process "
                                        "(fake process group, no memory allocated)")
    _add_runtime_arguments(s)
    s.add_argument("--rank", type=int, default=0, help="the rank to play (default 0)")

    sub.add_parser("models", help="list the built-in model presets")
    return parser


def _mesh_from_args(args):
    from memshard.mesh import COMPUTE_EFFICIENCY, DEVICE_MEMORY, DEVICE_PEAK_FLOPS, parse_mesh
    from memshard.units import parse_bytes

    names = tuple(args.axis_names.split(",")) if args.axis_names else None
    mesh = parse_mesh(
        args.mesh,
        names=names,
        device_memory_bytes=parse_bytes(args.device_memory) if args.device_memory else DEVICE_MEMORY,
        peak_flops=args.peak_tflops * 1e12 if args.peak_tflops else DEVICE_PEAK_FLOPS,
        compute_efficiency=args.efficiency if args.efficiency is not None else COMPUTE_EFFICIENCY,
    )
    return mesh.with_links(
        bandwidths=tuple(b * 1e9 for b in args.bandwidth) if args.bandwidth else None,
        latencies=tuple(v * 1e-6 for v in args.latency) if args.latency else None,
    )


def _cmd_plan(args, console) -> None:
    from memshard.api import plan
    from memshard.report import render_plan

    mesh = _mesh_from_args(args)
    _check_json_path(args.json)
    knobs = {k: getattr(args, k) for k in ("num_layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "precision")}
    if args.dropout:
        knobs["dropout"] = args.dropout == "on"
    with console.status("solving…"):
        result = plan(
            _model_of(args), mesh, objective=args.objective, batch=args.batch, seq=args.seq,
            micro_batches=args.micro_batches,
            max_step_time_s=args.max_step_time, memory_budget=args.memory_budget, exact=args.exact,
            full_mesh=args.full_mesh, mip_gap=args.gap, zero3_unit=args.zero3_unit,
            time_limit_s=args.time_limit, **knobs,
        )
    if args.json:
        try:
            result.save(args.json)
        except OSError as e:
            raise MemshardError(f"cannot write {args.json}: {e.strerror}") from None
    render_plan(result, console, top=args.top, show_strategy=not args.brief)
    if args.json:
        console.print(f"plan written to {args.json}")


def _check_json_path(path: str | None) -> None:
    if path:
        directory = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(directory):
            raise MemshardError(f"cannot write {path}: directory {directory} does not exist")


def _cmd_compare(args, console) -> None:
    import json

    from memshard.api import compare
    from memshard.files import write_text_atomically
    from memshard.mesh import parse_mesh
    from memshard.report import render_comparison

    _check_json_path(args.json)
    if args.time_slack < 1:
        raise MemshardError("--time-slack must be at least 1")
    with console.status("solving…"):
        result = compare(_model_of(args), parse_mesh(args.mesh), batch=args.batch, seq=args.seq,
                         micro_batches=args.micro_batches, time_slack=args.time_slack,
                         time_limit_s=args.time_limit, zero3_unit=args.zero3_unit)
    if args.json:
        write_text_atomically(args.json, json.dumps(result, indent=2) + "\n")
    render_comparison(result, console)


def _cmd_pareto(args, console) -> None:
    from rich.table import Table

    from memshard.mesh import parse_mesh
    from memshard.pareto import draw, frontier
    from memshard.units import format_bytes, format_seconds

    _check_json_path(args.out)
    if args.points < 2:
        raise MemshardError("--points must be at least 2")
    mesh = parse_mesh(args.mesh)
    with console.status("sweeping the step-time budget…"):
        points, base = frontier(_model_of(args), mesh, points=args.points, batch=args.batch, seq=args.seq,
                                micro_batches=args.micro_batches, time_limit_s=args.time_limit,
                                zero3_unit=args.zero3_unit)
    draw(points, base, f"{args.model or args.hf_config or args.hf_model} on {args.mesh}", mesh.device_memory_bytes, args.out)
    t = Table(title="memshard frontier: least peak memory per step-time budget", title_justify="left")
    for col in ("budget", "step time", "peak / device", "redundant"):
        t.add_column(col, justify="right")
    for p in points:
        t.add_row("none" if p.budget_s is None else format_seconds(p.budget_s), format_seconds(p.step_time_s),
                  format_bytes(p.peak_bytes), format_bytes(p.redundant_bytes))
    console.print(t)
    console.print(f"plot written to {args.out}")


def _cmd_models(console) -> None:
    from rich.table import Table

    from memshard.models import PRESETS, build_graph

    t = Table(title="Built-in models")
    for col in ("name", "family", "parameters", "layers", "hidden", "heads", "kv-heads", "ffn", "vocab", "seq"):
        t.add_column(col, justify="left" if col in ("name", "family") else "right", no_wrap=True)
    for name, cfg in PRESETS.items():
        n = build_graph(cfg, batch=1, seq=8).num_parameters
        t.add_row(name, cfg.family, f"{n / 1e9:.3f}B" if n >= 1e9 else (f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}K"), str(cfg.num_layers),
                  str(cfg.hidden), str(cfg.heads), str(cfg.num_kv_heads), str(cfg.ffn), str(cfg.vocab), str(cfg.default_seq))
    console.print(t)


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    # Piped output gets a wide console: tables stay whole instead of being cut to 80 columns.
    console = Console() if sys.stdout.isatty() else Console(width=160)
    try:
        args = build_parser().parse_args(argv)
        if args.command == "plan":
            _cmd_plan(args, console)
        elif args.command == "compare":
            _cmd_compare(args, console)
        elif args.command == "pareto":
            _cmd_pareto(args, console)
        elif args.command == "run":
            _cmd_run(args, console)
        elif args.command == "simulate":
            _cmd_simulate(args, console)
        elif args.command == "models":
            _cmd_models(console)
        return 0
    except MemshardError as e:
        print(f"memshard: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("memshard: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
