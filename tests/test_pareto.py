"""The frontier is monotone and every point is feasible under its budget; the PNG is drawn."""

from __future__ import annotations

from memshard.pareto import draw, frontier

SHAPE = dict(batch=16, seq=1024, num_layers=2)
GAP = 1e-3  # each point is solved within the default relative gap


def test_frontier_is_monotone_and_feasible(tmp_path):
    points, base = frontier("gpt3-1.3b", "2x4", points=4, **SHAPE)
    assert len(points) == 4 and base
    for p in points:
        if p.budget_s is not None:
            assert p.step_time_s <= p.budget_s * (1 + 1e-6)
    # budgets grow, so the least peak memory may only fall (up to the solver's gap)
    for a, b in zip(points, points[1:]):
        assert b.peak_bytes <= a.peak_bytes * (1 + 2 * GAP)
        assert b.step_time_s >= a.step_time_s * (1 - 1e-6)
    # the least-memory end is no worse than any baseline
    assert points[-1].peak_bytes <= min(b["peak_bytes"] for b in base) * (1 + GAP)
    out = tmp_path / "pareto.png"
    draw(points, base, "test", 80 * 2**30, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
