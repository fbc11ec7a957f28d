"""memshard's memory–time frontier: the least peak memory for each step-time budget, with
every baseline as a point beside it.

The sweep runs from the fastest plan (objective ``time`` with no memory limit) to the
least-memory plan (objective ``memory``), solving the memory objective under evenly spaced
step-time budgets in between; each point's plan is feasible under its budget.
"""

from __future__ import annotations

from dataclasses import dataclass

from memshard.api import plan
from memshard.baselines import baselines
from memshard.plans import build_plan


@dataclass(frozen=True)
class FrontierPoint:
    budget_s: float | None
    step_time_s: float
    peak_bytes: float
    redundant_bytes: float


def frontier(model, mesh, points: int = 8, **kwargs) -> tuple[list[FrontierPoint], list[dict]]:
    """(frontier points ordered by budget, baseline points)."""
    least = plan(model, mesh, **kwargs)
    fastest = plan(model, least.problem.mesh, objective="time", memory_budget=float("inf"), **kwargs)
    t_lo, t_hi = fastest.step_time_s, least.step_time_s
    out = [FrontierPoint(t_lo, fastest.step_time_s, fastest.peak_bytes, fastest.redundant_bytes)]
    for k in range(1, points - 1):
        budget = t_lo + (t_hi - t_lo) * k / (points - 1)
        p = plan(model, least.problem.mesh, max_step_time_s=budget, **kwargs)
        out.append(FrontierPoint(budget, p.step_time_s, p.peak_bytes, p.redundant_bytes))
    out.append(FrontierPoint(None, least.step_time_s, least.peak_bytes, least.redundant_bytes))
    found, _ = baselines(least.problem)
    base = []
    for b in found:
        p = build_plan(b.problem, None, b.selection, strategy_name=b.name)
        base.append({"strategy": b.name, "step_time_s": p.step_time_s, "peak_bytes": p.peak_bytes})
    return out, base


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
