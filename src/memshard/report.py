"""Readable tables (rich) for plans and comparisons: memory, communication, solver, the most
redundant ops with their advice, the strategy. Formatting only: every figure is the plan's."""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table

from memshard.advice import RedundantOp
from memshard.graph import Graph
from memshard.job import TracedModule
from memshard.plans import Plan
from memshard.units import format_bytes, format_seconds

CATEGORY_LABELS = {
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer_states": "optimizer states",
    "activations": "activations",
    "transients": "transients",
}


def render_plan(plan: Plan, console: Console, top: int = 10, show_strategy: bool = True) -> None:
    console.print(_headline(plan))
    if plan.model.unknown_ops:
        ops = ", ".join(f"{name} ×{n}" for name, n in plan.model.unknown_ops.items())
        console.print(f"[yellow]ops memshard has no description for, kept whole (replicated):[/] {ops}")
    console.print(_memory_table(plan))
    console.print(_communication_table(plan))
    console.print(_solver_line(plan))
    red = [r for r in plan.most_redundant_ops[:top] if r.redundant_bytes > 0]
    if red:
        console.print(_redundancy_table(red))
    if show_strategy:
        console.print(_strategy_table(plan))
        console.print(_storage_table(plan))


def _headline(plan: Plan) -> str:
    job, model, mesh = plan.job, plan.model, plan.job.mesh
    extra = ""
    if not isinstance(job.model, (Graph, TracedModule)):
        extra = f", batch {job.global_batch}, seq {job.seq_length}"
        if job.micro_batches > 1:
            extra += f" in {job.micro_batches} micro-batches"
    elif isinstance(job.model, TracedModule) and job.micro_batches > 1:
        extra = f" in {job.micro_batches} micro-batches"
    return (f"[bold]{model.name}[/] ({model.num_parameters / 1e9:.3g}B parameters, {model.precision}{extra}) "
            f"on mesh [bold]{mesh}[/] ({mesh.num_devices} devices), objective [bold]{plan.objective or plan.strategy}[/]")


def _memory_table(plan: Plan) -> Table:
    mem = plan.memory
    t = Table(title="Memory per device", title_justify="left")
    t.add_column("category")
    t.add_column("bytes", justify="right")
    t.add_column("share", justify="right")
    for key, label in CATEGORY_LABELS.items():
        v = mem.breakdown[key]
        t.add_row(label, format_bytes(v), f"{v / mem.peak_bytes:.1%}" if mem.peak_bytes else "-")
    t.add_row("[bold]peak[/]", f"[bold]{format_bytes(mem.peak_bytes)}[/]", f"at {mem.peak_at}")
    t.add_row("zero-redundancy bound", format_bytes(mem.lower_bound_bytes),
              f"plan is {mem.above_lower_bound:+.2%} above it")
    t.add_row("redundant at the peak", format_bytes(mem.redundant_bytes),
              f"{mem.redundant_bytes / mem.peak_bytes:.1%}" if mem.peak_bytes else "-")
    fits = "[green]fits[/]" if mem.fits else "[red]does not fit[/]"
    t.add_row("device memory", format_bytes(mem.device_memory_bytes), fits)
    return t


def _communication_table(plan: Plan) -> Table:
    c = Table(title="Communication and time per step", title_justify="left")
    c.add_column("collective")
    c.add_column("calls", justify="right")
    c.add_column("bytes sent per device", justify="right")
    for kind, v in plan.communication.by_kind.items():
        if v["calls"]:
            c.add_row(kind.replace("_", "-"), f"{v['calls']:,}", format_bytes(v["wire_bytes"]))
    c.add_row("[bold]total[/]", "", f"[bold]{format_bytes(plan.communication.bytes_per_step)}[/]")
    c.add_row("estimated step time", "", format_seconds(plan.step_time_s))
    c.add_row("  compute / communication", "",
              f"{format_seconds(plan.compute_time_s)} / {format_seconds(plan.communication_time_s)}")
    return c


def _solver_line(plan: Plan) -> str:
    s = plan.solver
    return (f"solver: HiGHS {s.status}, {s.time_s:.2f} s, gap {s.gap:.2%}, "
            f"{s.variables:,} variables, {s.constraints:,} constraints"
            + ("" if s.shared_layers else " (exact: no shared layers)")
            + ("; ZeRO-3 weights gathered per layer" if s.zero3_unit == "layer" else "")
            + ("" if s.search_space == "full" else f"; {s.search_space} (--full-mesh to search all)"))


def _redundancy_table(rows: list[RedundantOp]) -> Table:
    r = Table(title=f"Ops holding the most redundant memory at the peak (top {len(rows)})", title_justify="left")
    r.add_column("op")
    r.add_column("redundant", justify="right")
    r.add_column("shard further", justify="left")
    r.add_column("Δ peak", justify="right")
    r.add_column("Δ step time", justify="right")
    for row in rows:
        alt = row.alternative
        if alt is None:
            r.add_row(row.op, format_bytes(row.redundant_bytes), "no further split", "", "")
        else:
            split = " ".join(f"{ax}:{dim}" for ax, dim in alt.split.items())
            delta = alt.step_time_delta_s
            r.add_row(row.op, format_bytes(row.redundant_bytes), split, format_bytes(alt.peak_delta_bytes),
                      format_seconds(delta) if delta >= 0 else "-" + format_seconds(-delta))
    return r


def _strategy_table(plan: Plan) -> Table:
    o = _table("Strategy (per op; identical layers share one row)", ("op", "×", "einsum", "split (axis:dim)",
                                                                      "inputs → output"))
    for op in plan.ops:
        split = " ".join(f"{ax}:{dim}" for ax, dim in op.split.items()) or "replicated"
        o.add_row(op.name, str(op.instances), op.einsum, split,
                  " ".join(op.input_layouts.values()) + " → " + op.output_layout)
    return o


def _storage_table(plan: Plan) -> Table:
    p = _table("Parameter storage", ("parameter", "×", "layout", "storage"))
    for prm in plan.parameters:
        p.add_row(prm.names[0], str(prm.instances), prm.layout, prm.storage)
    return p


def _table(title: str, columns: tuple[str, ...]) -> Table:
    t = Table(title=title, title_justify="left")
    for column in columns:
        t.add_column(column, justify="right" if column == "×" else "left")
    return t


def format_plan(plan: Plan, top: int = 10, width: int = 120) -> str:
    """The plan's tables as plain text (``memshard.format_plan``)."""
    buffer = io.StringIO()
    render_plan(plan, Console(file=buffer, width=width, color_system=None), top=top)
    return buffer.getvalue()


def render_comparison(result: dict, console: Console) -> None:
    model, mesh = result["model"], result["mesh"]
    console.print(f"[bold]{model['name']}[/] on mesh [bold]{'x'.join(map(str, mesh['shape']))}[/]: "
                  "every strategy priced by the same memory and communication model")
    t = Table(title_justify="left")
    for col in ("strategy", "peak", "params+grads+opt", "activations", "transients", "redundant",
                "comm / step", "step time", "memshard saves"):
        t.add_column(col, justify="left" if col == "strategy" else "right")
    for r in result["rows"]:
        b = r["breakdown"]
        states = b["parameters"] + b["gradients"] + b["optimizer_states"]
        style = "" if r["fits"] else "[red]"
        t.add_row(r["strategy"], f"{style}{format_bytes(r['peak_bytes_per_device'])}", format_bytes(states),
                  format_bytes(b["activations"]), format_bytes(b["transients"]),
                  format_bytes(r["redundant_bytes_per_device"]),
                  format_bytes(r["communication_bytes_per_step_per_device"]),
                  format_seconds(r["estimated_step_time_s"]), f"{r['memshard_saving']:.1%}")
    console.print(t)
    for s in result["skipped"]:
        console.print(f"skipped {s['strategy']}: {s['reason']}")
