"""Predicted against measured, per rank: the tables `memshard run` and `simulate` print."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from memshard.cost.comm import KINDS
from memshard.cost.memory import CATEGORIES
from memshard.units import format_bytes


def error(measured: float, predicted: float) -> float | None:
    """Relative error of the measurement against the prediction (None when both are 0)."""
    if predicted == 0:
        return None if measured == 0 else float("inf")
    return measured / predicted - 1


def _err(measured: float, predicted: float) -> str:
    e = error(measured, predicted)
    return "–" if e is None else f"{e:+.2%}"


def comparison_rows(report: dict) -> list[tuple[str, float, float]]:
    """(what, predicted, measured) for peak, each category and each collective kind."""
    p, m = report["predicted"], report["measured"]
    rows = [("peak memory", p["peak_bytes"], m["peak_bytes"])]
    rows += [(f"  {c}", p["breakdown"][c], m["breakdown"][c]) for c in CATEGORIES]
    rows.append(("communication / step", p["communication_bytes"], m["communication_bytes"]))
    rows += [(f"  {k}", p["communication_by_kind"][k], m["communication_by_kind"][k]) for k in KINDS
             if p["communication_by_kind"][k] or m["communication_by_kind"][k]]
    return rows


def render_run(reports: list[dict], console: Console, title: str = "memshard run") -> None:
    first = reports[0]
    console.print(f"[bold]{title}[/bold]: strategy {first['strategy']}, {len(reports)} rank(s) reported")
    for r in reports:
        t = Table(title=f"rank {r['rank']} {tuple(r['coordinate'])}: predicted vs measured (last step)",
                  title_justify="left")
        for col in ("", "predicted", "measured", "error"):
            t.add_column(col, justify="left" if not col else "right")
        for what, pred, meas in comparison_rows(r):
            t.add_row(what, format_bytes(pred), format_bytes(meas), _err(meas, pred))
        console.print(t)
    losses = first.get("losses") or []
    if losses and all(x is not None for x in losses):
        console.print("loss per step: " + ", ".join(f"{x:.6f}" for x in losses))
    times = first.get("step_times_s") or []
    if times:
        console.print("step time: " + ", ".join(f"{x * 1e3:.1f} ms" for x in times))
