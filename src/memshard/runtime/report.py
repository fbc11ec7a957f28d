"""Predicted against measured, per rank: the report each rank writes (``predicted_figures``,
``measured_figures``: one shape for both) and the tables `memshard run` and `simulate` print.
A pipelined plan's rank adds the point-to-point bytes it sends (``P2P``) to both.

A rank whose measured peak is more than ``PEAK_TOLERANCE`` off the prediction (the bound the
README states and the runtime tests check) is named below the tables, with what to run to
measure it again deterministically.
"""

from __future__ import annotations

import math

from rich.console import Console
from rich.table import Table

from memshard.core.quantities import counted, format_bytes, format_seconds
from memshard.problem.comm import KINDS
from memshard.problem.memory import CATEGORIES

PEAK_TOLERANCE = 0.02
P2P = "point_to_point_bytes"  # a pipeline stage's sends per step (not a collective: not in the total)


def predicted_figures(plan) -> dict:
    """A plan's figures for one device, in the shape of :func:`measured_figures`."""
    mem, comm = plan.memory, plan.communication
    return {
        "peak_bytes": mem.peak_bytes,
        "breakdown": dict(mem.breakdown),
        "communication_bytes": comm.bytes_per_step,
        "communication_by_kind": {k: comm.by_kind.get(k, {}).get("wire_bytes", 0.0) for k in KINDS},
    }


def measured_figures(meter, counter) -> dict:
    """A measured step (a ``MemoryMeter``'s and a ``CommCounter``'s), in the shape of
    :func:`predicted_figures`."""
    return {
        "peak_bytes": meter.peak_bytes,
        "breakdown": {c: meter.breakdown.get(c, 0) for c in CATEGORIES},
        "communication_bytes": counter.total_wire_bytes,
        "communication_by_kind": {kind: counter.wire_bytes_by_kind.get(kind, 0.0) for kind in KINDS},
        "collective_calls": counter.calls_by_kind,
        "cuda_peak_bytes": meter.cuda_peak_bytes,
    }


def error(measured: float, predicted: float) -> float | None:
    """Relative error of the measurement against the prediction (None when both are 0)."""
    if predicted == 0:
        return None if measured == 0 else float("inf")
    return measured / predicted - 1


def _err(measured: float, predicted: float) -> str:
    e = error(measured, predicted)
    if e is None:
        return "–"
    return "+∞" if math.isinf(e) else f"{e:+.2%}"


def comparison_rows(report: dict) -> list[tuple[str, float, float]]:
    """(what, predicted, measured) for peak, each category, each collective kind and, for a
    pipeline stage, the point-to-point sends."""
    p, m = report["predicted"], report["measured"]
    rows = [("peak memory", p["peak_bytes"], m["peak_bytes"])]
    rows += [(f"  {c}", p["breakdown"][c], m["breakdown"][c]) for c in CATEGORIES]
    rows.append(("communication / step", p["communication_bytes"], m["communication_bytes"]))
    rows += [(f"  {k}", p["communication_by_kind"][k], m["communication_by_kind"][k]) for k in KINDS
             if p["communication_by_kind"][k] or m["communication_by_kind"][k]]
    if P2P in p and P2P in m:
        rows.append(("point-to-point / step", p[P2P], m[P2P]))
    return rows


def peak_misses(reports: list[dict]) -> list[tuple[int, float]]:
    """(rank, peak error) of every rank whose measured peak is more than PEAK_TOLERANCE off."""
    out = []
    for r in reports:
        e = error(r["measured"]["peak_bytes"], r["predicted"]["peak_bytes"])
        if e is not None and abs(e) > PEAK_TOLERANCE:
            out.append((r["rank"], e))
    return out


def render_run(reports: list[dict], console: Console, title: str = "memshard run") -> None:
    first = reports[0]
    console.print(f"[bold]{title}[/bold]: strategy {first['strategy']}, {counted(len(reports), 'rank')} reported")
    misses = dict(peak_misses(reports))
    for r in reports:
        stage = f", pipeline stage {r['stage']}" if "stage" in r else ""
        t = Table(title=f"rank {r['rank']} {tuple(r['coordinate'])}{stage}: predicted vs measured (last step)",
                  title_justify="left")
        for col in ("", "predicted", "measured", "error"):
            t.add_column(col, justify="left" if not col else "right")
        for what, pred, meas in comparison_rows(r):
            flag = " [bold red]![/]" if what == "peak memory" and r["rank"] in misses else ""
            t.add_row(what, format_bytes(pred), format_bytes(meas), _err(meas, pred) + flag)
        console.print(t)
    for rank, e in misses.items():
        console.print(_miss_note(rank, e, simulated=bool(first.get("simulated")), pipelined="stage" in first))
    losses = first.get("losses") or []
    if losses and all(x is not None for x in losses):
        console.print("loss per step: " + ", ".join(f"{x:.6f}" for x in losses))
    times = first.get("step_times_s") or []
    if times:
        console.print("step time: " + ", ".join(format_seconds(x) for x in times))


def _miss_note(rank: int, e: float, simulated: bool, pipelined: bool = False) -> str:
    off = "+∞" if math.isinf(e) else f"{e:+.2%}"
    head = f"[bold red]![/] rank {rank}: measured peak {off} off the prediction (more than {PEAK_TOLERANCE:.0%}). "
    if simulated:
        return head + "This measurement is deterministic (no threads): the memory model misses something here."
    if pipelined:
        return head + "docs/pipelining.md lists the pipeline stages the memory model does not yet match."
    return head + (
        "A real rank's measurement can depend on when a communication thread releases buffers; "
        f"`memshard simulate` with the same options and `--rank {rank}` measures the same step of "
        "that rank deterministically (fake process group), as memshard's tests do.")
