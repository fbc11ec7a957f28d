"""Readable tables (rich) for plans and comparisons: memory, communication, solver, the most
redundant ops with their advice, the strategy. Formatting only: every figure is the plan's."""

from __future__ import annotations

import io
import itertools

from rich.console import Console
from rich.table import Table

from memshard.core.graph import Graph, TensorKind
from memshard.core.quantities import counted, format_bytes, format_parameters, format_seconds
from memshard.job import Job, TracedModule
from memshard.plans.advice import (
    LINKED,
    TOO_SMALL,
    UNSPLITTABLE,
    Holding,
    NoFurtherSplit,
    RedundantOp,
)
from memshard.plans.pipelined import PipelinedPlan
from memshard.plans.plan import Plan
from memshard.problem.pipeline import SCHEDULE_TITLES

CATEGORY_LABELS = {
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer_states": "optimizer states",
    "activations": "activations",
    "transients": "transients",
}


def render_plan(plan: Plan, console: Console, top: int = 10, show_strategy: bool = True,
                show_stages: bool = False) -> None:
    console.print(_headline(plan))
    if plan.model.unknown_ops:
        ops = ", ".join(f"{name} ×{n}" for name, n in plan.model.unknown_ops.items())
        console.print(f"[yellow]ops memshard has no description for, kept whole (replicated):[/] {ops}")
    console.print(_memory_table(plan))
    console.print(_communication_table(plan))
    if plan.solver.recompute != "none":
        console.print(_recompute_line(plan))
    console.print(_solver_line(plan))
    if show_stages and plan.solver.stages:
        console.print(_stages_table(plan))
    red = [r for r in plan.most_redundant_ops[:top] if r.redundant_bytes > 0]
    if red:
        console.print(_redundancy_table(red))
        console.print(REDUNDANCY_NOTE, style="dim")
    if show_strategy:
        console.print(_strategy_table(plan))
        console.print(_storage_table(plan))
    if plan.model.unknown_ops is not None and (show_strategy or red):
        console.print(_dims_table(plan))


def render_pipelined(plan: PipelinedPlan, console: Console, top: int = 10, show_strategy: bool = True,
                     show_stages: bool = False) -> None:
    """The pipeline (its stages, the step the schedule makes of them), then the plan of the
    stage whose ranks hold the most, as ``render_plan`` shows a plan."""
    job, mesh = plan.job, plan.mesh
    name = job.model if isinstance(job.model, str) else plan.stages[0].plan.model.name
    console.print(f"[bold]{name}[/] (batch {job.global_batch}, seq {job.seq_length} in "
                  f"{counted(job.micro_batches, 'micro-batch', 'micro-batches')}) on mesh [bold]{job.mesh}[/] "
                  f"({counted(mesh.num_devices, 'device')}), "
                  f"{'objective' if plan.objective else 'strategy'} [bold]{plan.objective or plan.strategy}[/]: "
                  f"{len(plan.stages)} pipeline stages, {SCHEDULE_TITLES[plan.schedule]}, each on mesh {plan.stage_mesh}"
                  + (f", {plan.stages_per_rank} per rank on {plan.ranks} ranks" if plan.stages_per_rank > 1 else "")
                  + (f" (the best view of mesh {plan.typed_stage_mesh})" if plan.typed_stage_mesh is not None else ""))
    several = plan.stages_per_rank > 1
    t = _table("Pipeline stages", ("stage", *(("rank",) if several else ()), "layers", "micro-batches held",
                                   "peak memory", "forward / backward", "send", "idle"))
    for i, stage in enumerate(plan.stages):
        layers = str(stage.first_layer) if stage.num_layers == 1 else f"{stage.first_layer}–{stage.end_layer - 1}"
        t.add_row(str(i), *((str(plan.stage_ranks[i]),) if several else ()), layers, str(stage.held_micro_batches),
                  format_bytes(stage.plan.peak_bytes),
                  f"{format_seconds(stage.forward_s)} / {format_seconds(stage.backward_s)}",
                  format_seconds(stage.transfer_s) if i + 1 < len(plan.stages) else "-", format_seconds(stage.idle_s))
    console.print(t)
    if several:
        console.print("each rank's peak, its stages' at the schedule's worst point: " + ", ".join(
            f"rank {r} {format_bytes(peak)}" for r, peak in enumerate(plan.rank_peaks)))
    fits = "[green]fits[/]" if plan.fits else "[red]does not fit[/]"
    console.print(f"estimated step time {format_seconds(plan.step_time_s)}: the schedule "
                  f"{format_seconds(plan.makespan_s)} (bubble {format_seconds(plan.bubble_s)}), then the optimizer "
                  f"step {format_seconds(plan.optimizer_s)}; peak {format_bytes(plan.peak_bytes)} per device, "
                  f"{format_bytes(plan.mesh.device_memory_bytes)} each: {fits}")
    peak = plan.peak_stage
    largest = "the largest stage plan's peak" if several else "the largest peak"
    console.print(f"\n[bold]Stage {plan.stages.index(peak)}[/] ({largest}), its plan on mesh {plan.stage_mesh}:")
    render_plan(peak.plan, console, top=top, show_strategy=show_strategy, show_stages=show_stages)


def _headline(plan: Plan) -> str:
    job, model, mesh = plan.job, plan.model, plan.job.mesh
    view = f", the best view of mesh {plan.solver.typed_mesh}" if plan.solver.typed_mesh else ""
    extra = ""
    micro = f" in {counted(job.micro_batches, 'micro-batch', 'micro-batches')}"
    if not isinstance(job.model, (Graph, TracedModule)):
        extra = f", batch {job.global_batch}, seq {job.seq_length}"
        if job.micro_batches > 1:
            extra += micro
    elif isinstance(job.model, TracedModule) and job.micro_batches > 1:
        extra = micro
    return (f"[bold]{model.name}[/] ({model_figures(job, model.num_parameters, model.precision)}{extra}) "
            f"on mesh [bold]{mesh}[/] ({counted(mesh.num_devices, 'device')}{view}), "
            f"objective [bold]{plan.objective or plan.strategy}[/]")


def model_figures(job: Job, num_parameters: int, precision: str) -> str:
    """What a report gives in brackets beside the model's name: the sizes where the job
    overrides any (``overridden: 40 layers, hidden 2304, 18 heads, ffn 9216, vocab 50257;``),
    then the parameter count and the precision."""
    figures = f"{format_parameters(num_parameters)}, {precision}"
    sizes = job.overridden_sizes()
    return f"overridden: {sizes}; {figures}" if sizes else figures


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
    c.add_column("time", justify="right")
    for kind, v in plan.communication.by_kind.items():
        if v["calls"]:
            c.add_row(kind.replace("_", "-"), f"{v['calls']:,}", format_bytes(v["wire_bytes"]),
                      format_seconds(v.get("time_s", 0.0)))
    c.add_row("[bold]total[/]", "", f"[bold]{format_bytes(plan.communication.bytes_per_step)}[/]",
              format_seconds(plan.communication_time_s))
    if plan.hidden_communication_s:
        c.add_row("  of which under the compute", "", "", format_seconds(plan.hidden_communication_s))
    c.add_row("compute", "", "", format_seconds(plan.compute_time_s))
    for kind, seconds in plan.compute_by_kind.items():
        if seconds:
            c.add_row(f"  {kind}", "", "", format_seconds(seconds))
    if plan.solver.recompute != "none":
        share = plan.recompute_time_s / plan.step_time_s if plan.step_time_s else 0.0
        c.add_row("  of which recomputation", "", "", f"{format_seconds(plan.recompute_time_s)} ({share:.1%})")
    c.add_row("[bold]estimated step time[/]", "", "", f"[bold]{format_seconds(plan.step_time_s)}[/]")
    return c


def _recompute_line(plan: Plan) -> str:
    """Which op roles are recomputed, under the policy searched."""
    replayed = [op for op in plan.ops if op.recomputed]
    if not replayed:
        return f"recomputation ({plan.solver.recompute}): nothing recomputed"
    layers = max(op.instances for op in replayed)
    names = ", ".join(op.name for op in replayed)
    layers_text = counted(layers, "layer")
    which = [k for k, c in enumerate(plan.solver.layer_classes) if c == 0]
    if which:  # a recipe recomputing some of its layers: which, counted from 0, in runs
        runs = [[k for _, k in run] for _, run in itertools.groupby(enumerate(which), lambda p: p[1] - p[0])]
        layers_text += f" ({', '.join(str(r[0]) if len(r) == 1 else f'{r[0]}–{r[-1]}' for r in runs)})"
    return (f"recomputation ({plan.solver.recompute}): {counted(len(replayed), 'op')} of each of "
            f"{layers_text} replayed before the layer's backward: {names}")


def _solver_line(plan: Plan) -> str:
    s = plan.solver
    return (f"solver: HiGHS {s.status}, {s.time_s:.2f} s, gap {s.gap:.2%}, "
            f"{s.variables:,} variables, {s.constraints:,} constraints"
            + ("" if s.shared_layers else " (exact: no shared layers)")
            + ("; ZeRO-3 weights gathered per layer" if s.zero3_unit == "layer" else "")
            + ("" if s.search_space == "full" else f"; {s.search_space} (--full-mesh to search all)"))


def _stages_table(plan: Plan) -> Table:
    """The search's stages in the order they ended (a stage within another ends first)."""
    stages = plan.solver.stages
    scoped = any(stage.scope for stage in stages)
    t = _table("Search stages", ("search",) * scoped + ("stage", "minimises", "found", "bound", "time", "stopped"))
    for stage in stages:
        t.add_row(*(stage.scope,) * scoped, stage.name, stage.objective, _stage_figure(stage.objective, stage.found),
                  _stage_figure(stage.objective, stage.bound), format_seconds(stage.time_s), stage.stopped)
    return t


def _stage_figure(objective: str, value: float | None) -> str:
    """A stage's figure: bytes for the peak, seconds for the step time, a blend's in the model's units."""
    if value is None:
        return "–"
    if objective == "memory":
        return format_bytes(value)
    return format_seconds(value) if objective == "time" else f"{value:.6g}"


REDUNDANCY_NOTE = (
    "held as: what holds an op's redundant bytes, over the mesh axes it is whole along (every device of "
    "such an axis holds a copy); a ZeRO stage over them would shard a weight, gradient or optimizer state, "
    "a split of the op over them an activation. shard further: the cheapest strategy that splits the op "
    "over one more axis, priced with everything else kept; none: why no strategy does.")


def _redundancy_table(rows: list[RedundantOp]) -> Table:
    r = Table(title=f"Ops holding the most redundant memory at the peak (top {len(rows)})", title_justify="left")
    r.add_column("op")
    r.add_column("redundant", justify="right")
    r.add_column("held as")
    r.add_column("shard further", justify="left")
    r.add_column("Δ peak", justify="right")
    r.add_column("Δ step time", justify="right")
    for row in rows:
        alt, held = row.alternative, _held_as(row.parts, row.redundant_bytes)
        if alt is None:
            why = _why_not(row.why_not) if row.why_not is not None else "–"
            r.add_row(row.op, format_bytes(row.redundant_bytes), held, why, "", "")
        else:
            split = " ".join(f"{ax}:{dim}" for ax, dim in alt.split.items())
            delta = alt.step_time_delta_s
            r.add_row(row.op, format_bytes(row.redundant_bytes), held, split, format_bytes(alt.peak_delta_bytes),
                      format_seconds(delta) if delta >= 0 else "-" + format_seconds(-delta))
    return r


def _held_as(parts: tuple[Holding, ...], total: float, most: int = 2, share: float = 0.1) -> str:
    """The largest parts (at most ``most``, each at least ``share`` of the op's bytes)."""
    shown = [p for p in parts[:most] if p.redundant_bytes >= share * total] or list(parts[:1])
    text = "; ".join(f"{p.what}: {format_bytes(p.redundant_bytes)}"
                     + (f" over {', '.join(p.copied_over)}" if p.copied_over else "") for p in shown)
    return text + ("; …" if len(parts) > len(shown) else "")


def _why_not(why: NoFurtherSplit) -> str:
    """Why no strategy splits the op over one more axis, in a line."""
    if not why.free_axes:
        split = " ".join(f"{ax}:{dim}" for ax, dim in why.split.items())
        return f"none: each axis splits a dim ({split})"
    reasons = []
    for other in dict.fromkeys(b.linked_to for b in why.blocked if b.why == LINKED):
        reasons.append(f"linked to {other}, which would have to change alike: "
                       + _pairs([b for b in why.blocked if b.why == LINKED and b.linked_to == other]))
    small = [b for b in why.blocked if b.why == TOO_SMALL]
    if small:
        reasons.append("too few elements: " + ", ".join(f"{b.axis}:{b.dim} {b.local_size:,} < {b.axis_size}"
                                                         for b in small))
    kernel = [b for b in why.blocked if b.why == UNSPLITTABLE]
    if kernel:
        reasons.append("its kernel cannot split " + _pairs(kernel))
    refused = [b for b in why.blocked if b.why not in (LINKED, TOO_SMALL, UNSPLITTABLE)]
    if refused:
        reasons.append("the re-priced plan is inconsistent: " + _pairs(refused))
    return "none: " + "; ".join(reasons)


def _pairs(blocked: list) -> str:
    """``inter0:b,s intra:h``: dims grouped by axis."""
    axes: dict[str, list[str]] = {}
    for b in blocked:
        axes.setdefault(b.axis, []).append(b.dim)
    return " ".join(f"{axis}:{','.join(dims)}" for axis, dims in axes.items())


def _strategy_table(plan: Plan) -> Table:
    o = _table("Strategy (per op; identical layers share one row; ↻ recomputed)",
               ("op", "×", "einsum", "split (axis:dim)", "inputs → output"))
    for op in plan.ops:
        split = " ".join(f"{ax}:{dim}" for ax, dim in op.split.items()) or "replicated"
        o.add_row(op.name + (" ↻" if op.recomputed else ""), str(op.instances), op.einsum, split,
                  " ".join(op.input_layouts.values()) + " → " + op.output_layout)
    return o


def _dims_table(plan: Plan) -> Table:
    """The key to a traced graph's dim names: size and, where known, meaning."""
    graph = plan.searched.graph
    t = _table("Dims (names the trace gave the graph's dimensions)", ("dim", "size", "meaning"))
    for name, (size, meaning) in sorted(_dim_key(graph).items(), key=lambda kv: _dim_order(kv[0])):
        t.add_row(name, f"{size:,}", meaning)
    t.columns[1].justify = "right"
    return t


DIM_MEANINGS = {"b": "batch (sequences)", "s": "sequence (tokens)"}


def _dim_key(graph: Graph) -> dict[str, tuple[int, str]]:
    """dim → (size, meaning): batch and sequence; ``X_k``: X on attention's key side; any
    other dim by the first parameter (else tensor) axis it names."""
    out: dict[str, tuple[int, str]] = {}
    for kind_first in (TensorKind.PARAMETER, None):
        for op in graph.ops:
            for operand in op.operands:
                spec = graph.tensors[operand.tensor]
                if kind_first is not None and spec.kind is not kind_first:
                    continue
                for axis, (d, n) in enumerate(zip(operand.dims, spec.shape)):
                    if d not in out:
                        base = d.removesuffix("_k")
                        if base in DIM_MEANINGS or d != base:
                            meaning = DIM_MEANINGS.get(base, base)
                            meaning += ", on attention's key side" if d != base else ""
                        else:
                            meaning = f"axis {axis} of {operand.tensor}"
                        out[d] = (n, meaning)
    return out


def _dim_order(name: str) -> tuple:
    base = name.removesuffix("_k")
    digits = base.lstrip("abcdefghijklmnopqrstuvwxyz_")
    return (base not in DIM_MEANINGS, int(digits) if digits.isdigit() else -1, base, name != base)


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


def render_comparison(result: dict, console: Console, job: Job | None = None) -> None:
    """``memshard compare``'s table; ``job``: the job compared, whose overridden sizes the
    headline gives (with the parameter count) beside the model's name."""
    model, mesh = result["model"], result["mesh"]
    figures = ""
    if job is not None and job.overridden_sizes():
        figures = f" ({model_figures(job, model['num_parameters'], model['precision'])})"
    pipeline, stages = result.get("pipeline"), ""
    if pipeline:
        stage_mesh = "x".join(map(str, pipeline["stage_mesh"]["shape"]))
        stages = (f" in {pipeline['stages']} pipeline stages ({SCHEDULE_TITLES[pipeline['schedule']]}, "
                  f"{pipeline['micro_batches']} micro-batches), each on mesh {stage_mesh}")
    console.print(f"[bold]{model['name']}[/]{figures} on mesh [bold]{'x'.join(map(str, mesh['shape']))}[/]{stages}: "
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
    for note in result.get("notes", ()):
        console.print(f"note: {note}")


def render_fit(result, console: Console) -> None:
    """``memshard fit``: each strategy's largest value of the knob and the proof about the
    next one, then memshard's plan at its largest value."""
    knob, memory = result.knob, format_bytes(result.device_memory_bytes)
    budget = (f" and a step within {format_seconds(result.max_step_time_s)}" if result.max_step_time_s else
              f" and a step within {result.max_slowdown:g}× memshard's fastest" if result.max_slowdown else "")
    most = "fewest" if knob == "devices" else "largest"
    stages = f", {result.pipeline} pipeline stages (1F1B)" if result.pipeline else ""
    console.print(f"the {most} {knob} (in steps of {result.step:,}) that fits in {memory} per device{budget}{stages}, "
                  f"found in {format_seconds(result.time_s)}")
    t = Table(title_justify="left")
    for col in ("strategy", f"{most} {knob}", "peak", "step time", f"next {knob}", "needs at least", "probes"):
        t.add_column(col, justify="left" if col == "strategy" else "right")
    for a in result.answers:
        nxt = a.next_probe
        proof = ""
        if nxt is not None:
            figure = format_bytes(nxt.bound_bytes) if nxt.bound_bytes < float("inf") else ""
            proof = f"{figure} ({nxt.note})".strip() if nxt.note else figure
        t.add_row(a.strategy, "none" if a.value is None else f"{a.value:,}",
                  format_bytes(a.plan.peak_bytes) if a.plan else "-",
                  format_seconds(a.plan.step_time_s) if a.plan else "-",
                  "-" if nxt is None else f"{nxt.value:,}", proof, str(len(a.probes)))
    console.print(t)
    at_limit = [a.strategy for a in result.answers if a.value == result.limit]
    if at_limit:
        console.print(f"{', '.join(at_limit)}: {knob} {result.limit:,} is the most the model takes")
    best = result.answers[0]
    if best.plan is not None:
        console.print(f"memshard's plan at {knob} {best.value:,}:")
        if result.pipeline:
            render_pipelined(best.plan, console, top=3, show_strategy=False)
        else:
            render_plan(best.plan, console, top=3, show_strategy=False)
