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
from memshard.errors import MemshardError
from memshard.job import Job
from memshard.mesh import Mesh
from memshard.planner import baseline_plans, plan_job, searched_problem
from memshard.units import format_bytes, format_seconds


@dataclass(frozen=True)
class FrontierPoint:
    budget_s: float | None
    step_time_s: float
    peak_bytes: float
    redundant_bytes: float


def frontier(model: Model | Job, mesh: str | Mesh | None = None, points: int = 8,
             **arguments) -> tuple[list[FrontierPoint], list[dict]]:
    """(frontier points ordered by budget, baseline points) for ``model`` on ``mesh`` with the
    keyword ``arguments`` :func:`memshard.plan` takes (or a :class:`Job`); no objective or
    budget: the sweep sets them."""
    given = sorted(set(arguments) & {"objective", "max_step_time_s", "memory_budget", "start"})
    if given:
        raise MemshardError(f"the frontier sweeps the step-time budget itself: give no {', '.join(given)}")
    if points < 2:
        raise MemshardError(f"a frontier needs at least 2 points, got {points}")
    job, options = job_and_options(model, mesh, arguments)
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
    base, _ = baseline_plans(job, least.problem)
    return out, [{"strategy": b.strategy, "step_time_s": b.step_time_s, "peak_bytes": b.peak_bytes} for b in base]


def draw(points: list[FrontierPoint], base: list[dict], title: str, capacity: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gib = 2.0**30
    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=120)
    ax.plot([p.step_time_s for p in points], [p.peak_bytes / gib for p in points], "-o", color="tab:blue",
            label="memshard frontier (least memory per step-time budget)", zorder=3)
    xs = [p.step_time_s for p in points] + [b["step_time_s"] for b in base]
    ys = [p.peak_bytes / gib for p in points] + [b["peak_bytes"] / gib for b in base]
    span_x, span_y = (max(xs) - min(xs)) or 1.0, (max(ys) - min(ys)) or 1.0
    placed: list[tuple[float, float]] = []
    for b in sorted(base, key=lambda b: (b["step_time_s"], b["peak_bytes"])):
        x, y = b["step_time_s"], b["peak_bytes"] / gib
        ax.scatter(x, y, marker="s", color="tab:orange", zorder=2)
        # Stack labels of points that sit close together instead of printing them on top of
        # each other.
        near = sum(1 for px, py in placed if abs(px - x) / span_x < 0.12 and abs(py - y) / span_y < 0.04)
        placed.append((x, y))
        ax.annotate(b["strategy"], (x, y), textcoords="offset points", xytext=(6, 4 - 11 * near), fontsize=8)
    ax.scatter([], [], marker="s", color="tab:orange", label="baselines")
    ax.axhline(capacity / gib, color="grey", linestyle="--", linewidth=1, label="device memory")
    ax.set_xlabel("estimated step time (s)")
    ax.set_ylabel("peak memory per device (GiB)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def frontier_table(points: list[FrontierPoint]):
    """The frontier as a table (rich)."""
    from rich.table import Table

    t = Table(title="memshard frontier: least peak memory per step-time budget", title_justify="left")
    for col in ("budget", "step time", "peak / device", "redundant"):
        t.add_column(col, justify="right")
    for p in points:
        t.add_row("none" if p.budget_s is None else format_seconds(p.budget_s), format_seconds(p.step_time_s),
                  format_bytes(p.peak_bytes), format_bytes(p.redundant_bytes))
    return t
