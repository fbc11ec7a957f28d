"""memshard's memory–time frontier: the least peak memory for each step-time budget, with
every baseline as a point beside it.

The sweep runs from the fastest plan (objective ``time`` with no memory limit) to the
least-memory plan (objective ``memory``), solving the memory objective under evenly spaced
step-time budgets in between; each point's plan is feasible under its budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from memshard.api import Model, job_and_options
from memshard.core.errors import MemshardError
from memshard.core.mesh import Mesh
from memshard.core.quantities import format_bytes, format_seconds
from memshard.job import Job
from memshard.planner import baseline_plans, baseline_problem, plan_job, searched_problem


@dataclass(frozen=True)
class FrontierPoint:
    budget_s: float | None
    step_time_s: float
    peak_bytes: float
    redundant_bytes: float


MAX_POINTS = 1000  # a solve each: a guard against runaway input


def frontier(model: Model | Job, mesh: str | Mesh | None = None, points: int = 8,
             **arguments) -> tuple[list[FrontierPoint], list[dict]]:
    """(frontier points ordered by budget, baseline points) for ``model`` on ``mesh`` with the
    keyword ``arguments`` :func:`memshard.plan` takes (or a :class:`Job`); no objective or
    budget: the sweep sets them."""
    given = sorted(set(arguments) & {"objective", "max_step_time_s", "memory_budget", "start"})
    if given:
        raise MemshardError(f"the frontier sweeps the step-time budget itself: give no {', '.join(given)}")
    if isinstance(points, bool) or not isinstance(points, int) or not 2 <= points <= MAX_POINTS:
        raise MemshardError(f"a frontier needs at least 2 points and at most {MAX_POINTS:,}, got {points!r}")
    job, options = job_and_options(model, mesh, arguments)
    # one setting of mesh views for every point: the fastest end is one the budgets can reach
    options = replace(options, mesh_views=bool(options.mesh_views))
    problem = searched_problem(job, options)
    least = plan_job(job, options, problem=problem)
    fastest = plan_job(job, replace(options, objective="time", memory_budget=math.inf), problem=problem)
    t_lo, t_hi = fastest.step_time_s, least.step_time_s
    out = [FrontierPoint(t_lo, fastest.step_time_s, fastest.peak_bytes, fastest.redundant_bytes)]
    for k in range(1, points - 1):
        budget = t_lo + (t_hi - t_lo) * k / (points - 1)
        p = plan_job(job, replace(options, max_step_time_s=budget), problem=problem)
        out.append(FrontierPoint(budget, p.step_time_s, p.peak_bytes, p.redundant_bytes))
    out.append(FrontierPoint(None, least.step_time_s, least.peak_bytes, least.redundant_bytes))
    base, _ = baseline_plans(job, baseline_problem(job, options, least))
    return out, [{"strategy": b.strategy, "step_time_s": b.step_time_s, "peak_bytes": b.peak_bytes} for b in base]


def draw(points: list[FrontierPoint], base: list[dict], title: str, capacity: float, path: str) -> None:
    """The frontier and the baselines as a PNG at ``path`` (see :func:`figure`)."""
    fig = figure(points, base, title, capacity)
    fig.savefig(path)
    import matplotlib.pyplot as plt

    plt.close(fig)


_MARKERS = "soD^vP*Xhp<>"
_BYTE_UNITS = (("TiB", 2.0**40), ("GiB", 2.0**30), ("MiB", 2.0**20), ("KiB", 2.0**10), ("B", 1.0))
_TIME_UNITS = (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6))


def figure(points: list[FrontierPoint], base: list[dict], title: str, capacity: float):
    """The frontier as a line and every baseline as a marker of its own, named (with its peak
    and step time) in a legend outside the axes: no label sits on a panel, so none covers a
    point, a tick or another label. When the baselines stretch the axes so far that the
    frontier is a dot, a second panel shows its neighbourhood. The device memory is a dashed
    line where it falls within the plot; otherwise the legend gives its figure. Axes are in
    the largest unit (GiB, MiB…; s, ms…) the data reach."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    every = [p.peak_bytes for p in points] + [b["peak_bytes"] for b in base]
    times = [p.step_time_s for p in points] + [b["step_time_s"] for b in base]
    mem = next(u for u in _BYTE_UNITS if max(every) >= u[1] or u[0] == "B")
    sec = next(u for u in _TIME_UNITS if max(times) >= u[1] or u[0] == "µs")
    front = [(p.step_time_s / sec[1], p.peak_bytes / mem[1]) for p in points]
    marks = [(b["step_time_s"] / sec[1], b["peak_bytes"] / mem[1]) for b in base]
    full, near = _bounds(front + marks), _bounds(front, pad=0.5)
    zoom = _span(full, 0) > 4 * _span(near, 0) or _span(full, 1) > 4 * _span(near, 1)
    fig, axes = plt.subplots(1, 2 if zoom else 1, figsize=(14 if zoom else 10, 5.5), dpi=120, squeeze=False,
                             layout="constrained")
    for k, ax in enumerate(axes[0]):
        handles = _panel(ax, front, marks, base, full if k == 0 else near, (capacity, mem[1]))
        ax.set_title(title if k == 0 else "close-up of the frontier", fontsize=10)
        ax.set_xlabel(f"estimated step time ({sec[0]})")
        ax.set_ylabel(f"peak memory per device ({mem[0]})")
    fig.legend(handles=handles, loc="outside right upper", fontsize=8, frameon=False)
    return fig


def _panel(ax, front, marks, base, box, memory):
    """One panel: frontier, baselines and device memory (bytes, bytes per plotted unit)
    within ``box``; the legend handles."""
    import matplotlib.lines as mlines
    import matplotlib.pyplot as plt

    (x0, y0), (x1, y1) = box
    handles = ax.plot(*zip(*front), "-o", color="tab:blue", markersize=4, zorder=3,
                      label="memshard frontier\n(least memory per step-time budget)")
    colours = [c for k, c in enumerate(plt.get_cmap("tab20").colors) if k not in (0, 1)]  # (the frontier's blue)
    for i, (b, (x, y)) in enumerate(zip(base, marks)):
        handles.append(ax.scatter([x], [y], marker=_MARKERS[i % len(_MARKERS)], color=colours[i % len(colours)], s=36,
                                  zorder=2, label=f"{b['strategy']}: {format_bytes(b['peak_bytes'])}, "
                                                  f"{format_seconds(b['step_time_s'])}"))
    label, capacity = f"device memory ({format_bytes(memory[0])})", memory[0] / memory[1]
    if y0 <= capacity <= y1:
        handles.append(ax.axhline(capacity, color="grey", linestyle="--", linewidth=1, label=label))
    else:
        handles.append(mlines.Line2D([], [], color="grey", linestyle="--", linewidth=1,
                                     label=f"{label}: above the plot" if capacity > y1 else f"{label}: below"))
    ax.set_xlim(x0, x1)
    ax.set_ylim(y0, y1)
    ax.grid(True, alpha=0.3)
    return handles


def _bounds(xy: list[tuple[float, float]], pad: float = 0.06) -> tuple[tuple[float, float], tuple[float, float]]:
    """((x0, y0), (x1, y1)): the points' box, widened by ``pad`` of its span, from 0 at least."""
    out = []
    for values in ([x for x, _ in xy], [y for _, y in xy]):
        lo, hi = min(values), max(values)
        span = (hi - lo) or abs(hi) * 0.05 or 1.0
        out.append((max(0.0, lo - pad * span), hi + pad * span))
    return (out[0][0], out[1][0]), (out[0][1], out[1][1])


def _span(box, axis: int) -> float:
    return box[1][axis] - box[0][axis]


def frontier_table(points: list[FrontierPoint]):
    """The frontier as a table (rich)."""
    from rich.table import Table

    title = "memshard frontier: least peak memory per step-time budget"
    t = Table(title=title, title_justify="left", min_width=len(title))
    for col in ("budget", "step time", "peak / device", "redundant"):
        t.add_column(col, justify="right")
    for p in points:
        t.add_row("none" if p.budget_s is None else format_seconds(p.budget_s), format_seconds(p.step_time_s),
                  format_bytes(p.peak_bytes), format_bytes(p.redundant_bytes))
    return t
