"""Readable tables (rich) for plans: memory, communication, solver, the most redundant ops."""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table

from memshard.advice import shard_alternative
from memshard.plans import Plan
from memshard.problem import OpGroup
from memshard.units import format_bytes, format_seconds

CATEGORY_LABELS = {
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer_states": "optimizer states",
    "activations": "activations",
    "transients": "transients",
}


def render_plan(plan: Plan, console: Console, top: int = 10, show_strategy: bool = True) -> None:
    d = plan.data
    mem = d["memory"]
    model = d["model"]
    mesh = d["mesh"]
    shape = "x".join(str(s) for s in mesh["shape"])
    extra = "".join(f", {k} {model[k]}" for k in ("batch", "seq") if k in model)
    if model.get("micro_batches", 1) > 1:
        extra += f" in {model['micro_batches']} micro-batches"
    console.print(
        f"[bold]{model['name']}[/] ({model['num_parameters'] / 1e9:.3g}B parameters, "
        f"{model['precision']}{extra}) on mesh [bold]{shape}[/] ({mesh['num_devices']} devices), "
        f"objective [bold]{d['objective'] or d['strategy']}[/]"
    )
    if model.get("unknown_ops"):
        ops = ", ".join(f"{name} ×{n}" for name, n in model["unknown_ops"].items())
        console.print(f"[yellow]ops memshard has no description for, kept whole (replicated):[/] {ops}")

    t = Table(title="Memory per device", title_justify="left")
    t.add_column("category")
    t.add_column("bytes", justify="right")
    t.add_column("share", justify="right")
    for key, label in CATEGORY_LABELS.items():
        v = mem["breakdown"][key]
        t.add_row(label, format_bytes(v), f"{v / mem['peak_bytes_per_device']:.1%}" if mem["peak_bytes_per_device"] else "-")
    t.add_row("[bold]peak[/]", f"[bold]{format_bytes(mem['peak_bytes_per_device'])}[/]", f"at {mem['peak_at']}")
    t.add_row("zero-redundancy bound", format_bytes(mem["lower_bound_bytes_per_device"]),
              f"plan is {mem['above_lower_bound']:+.2%} above it")
    t.add_row("redundant at the peak", format_bytes(mem["redundant_bytes_per_device"]),
              f"{mem['redundant_bytes_per_device'] / mem['peak_bytes_per_device']:.1%}" if mem["peak_bytes_per_device"] else "-")
    fits = "[green]fits[/]" if mem["fits"] else "[red]does not fit[/]"
    t.add_row("device memory", format_bytes(mem["device_memory_bytes"]), fits)
    console.print(t)

    c = Table(title="Communication and time per step", title_justify="left")
    c.add_column("collective")
    c.add_column("calls", justify="right")
    c.add_column("bytes sent per device", justify="right")
    for kind, v in d["communication"]["by_kind"].items():
        if v["calls"]:
            c.add_row(kind.replace("_", "-"), f"{v['calls']:,}", format_bytes(v["wire_bytes"]))
    c.add_row("[bold]total[/]", "", f"[bold]{format_bytes(d['communication']['bytes_per_step_per_device'])}[/]")
    c.add_row("estimated step time", "", format_seconds(d["estimated_step_time_s"]))
    c.add_row("  compute / communication", "",
              f"{format_seconds(d['compute_time_s'])} / {format_seconds(d['communication_time_s'])}")
    console.print(c)

    s = d["solver"]
    console.print(
        f"solver: HiGHS {s['status']}, {s['time_s']:.2f} s, gap {s['gap']:.2%}, "
        f"{s['variables']:,} variables, {s['constraints']:,} constraints"
        + ("" if s["shared_layers"] else " (exact: no shared layers)")
        + ("; ZeRO-3 weights gathered per layer" if s.get("zero3_unit") == "layer" else "")
        + ("" if s["search_space"] == "full" else f"; {s['search_space']} (--full-mesh to search all)")
    )

    red = [r for r in d["most_redundant_ops"][:top] if r["redundant_bytes_per_device"] > 0]
    if red:
        r = Table(title=f"Ops holding the most redundant memory at the peak (top {len(red)})", title_justify="left")
        r.add_column("op")
        r.add_column("redundant", justify="right")
        r.add_column("shard further", justify="left")
        r.add_column("Δ peak", justify="right")
        r.add_column("Δ step time", justify="right")
        base = plan.evaluation
        group_of = {g.key: i for i, g in enumerate(plan.problem.groups) if isinstance(g, OpGroup)}
        for row in red:
            alt = shard_alternative(plan.problem, plan.selection, group_of[row["op"]], base)
            if alt is None:
                r.add_row(row["op"], format_bytes(row["redundant_bytes_per_device"]), "no further split", "", "")
            else:
                split = " ".join(f"{ax}:{dim}" for ax, dim in alt.split.items())
                r.add_row(row["op"], format_bytes(row["redundant_bytes_per_device"]), split,
                          format_bytes(alt.peak_delta_bytes), format_seconds(alt.step_time_delta_s)
                          if alt.step_time_delta_s >= 0 else "-" + format_seconds(-alt.step_time_delta_s))
        console.print(r)

    if show_strategy:
        o = Table(title="Strategy (per op; identical layers share one row)", title_justify="left")
        o.add_column("op")
        o.add_column("×", justify="right")
        o.add_column("einsum")
        o.add_column("split (axis:dim)")
        o.add_column("inputs → output")
        for op in d["ops"]:
            split = " ".join(f"{ax}:{dim}" for ax, dim in op["split"].items()) or "replicated"
            o.add_row(op["name"], str(op["instances"]), op["einsum"], split,
                      " ".join(op["input_layouts"].values()) + " → " + op["output_layout"])
        console.print(o)
        p = Table(title="Parameter storage", title_justify="left")
        p.add_column("parameter")
        p.add_column("×", justify="right")
        p.add_column("layout")
        p.add_column("storage")
        for prm in d["parameters"]:
            p.add_row(prm["names"][0], str(prm["instances"]), prm["layout"], prm["storage"])
        console.print(p)


def render_plan_text(plan: Plan, top: int = 10, width: int = 120) -> str:
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
