"""The frontier is monotone and every point is feasible under its budget; the PNG is drawn."""

from __future__ import annotations

import pytest

from memshard.pareto import FrontierPoint, draw, figure, frontier, frontier_table

SHAPE = dict(batch=16, seq=1024, num_layers=2)
GAP = 1e-3  # each point is solved within the default relative gap


def test_frontier_is_monotone_and_feasible(tmp_path):
    # (on 2x4 the budgets between the two ends take HiGHS 10-15 s each to prove)
    points, base = frontier("gpt3-1.3b", "1x8", points=4, **SHAPE)
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


# -- the PNG: every label legible ------------------------------------------------------------------
def _crowded(n_base: int, scale_bytes: float, scale_s: float):
    """A frontier and ``n_base`` baselines, most of them bunched next to it, one far away."""
    points = [FrontierPoint(None if k == 5 else k, (1 + 0.03 * k) * scale_s, (8.4 - 0.1 * k) * scale_bytes, 0.0)
              for k in range(6)]
    base = [{"strategy": f"megatron-tp{k}-dp{k}-sp-distopt", "step_time_s": (1.05 + 0.01 * k) * scale_s,
             "peak_bytes": (8 + 0.05 * k) * scale_bytes} for k in range(n_base - 1)]
    base.append({"strategy": "megatron-tp8-sp", "step_time_s": 3.9 * scale_s, "peak_bytes": 13 * scale_bytes})
    return points, base


def _text_boxes(fig) -> list[tuple[str, object]]:
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    texts = [t for ax in fig.axes for t in (ax.title, ax.xaxis.label, ax.yaxis.label)]
    for ax in fig.axes:  # the tick labels drawn: those within the axis' limits
        for axis, (lo, hi) in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
            texts += [tick.label1 for tick in axis.get_major_ticks() if lo <= tick.get_loc() <= hi]
    texts += [t for legend in fig.legends for t in legend.get_texts()]
    return [(t.get_text(), t.get_window_extent(renderer)) for t in texts if t.get_visible() and t.get_text()]


@pytest.mark.parametrize(("scale_bytes", "scale_s", "capacity"), [
    (2.0**30, 0.1, 80 * 2**30),   # GiB and ms, the device memory far above
    (2.0**20, 1e-4, 9 * 2**20),   # MiB and µs, the device memory within the plot
])
def test_no_label_overlaps_another_or_a_panel(scale_bytes, scale_s, capacity):
    points, base = _crowded(14, scale_bytes, scale_s)
    fig = figure(points, base, "crowded", capacity)
    try:
        boxes = _text_boxes(fig)
        whole = fig.bbox
        for name, box in boxes:
            assert whole.x0 - 1 <= box.x0 and box.x1 <= whole.x1 + 1 and whole.y0 - 1 <= box.y0 and box.y1 <= whole.y1 + 1, name
        for i, (a, box_a) in enumerate(boxes):
            for b, box_b in boxes[i + 1:]:
                assert not box_a.overlaps(box_b), (a, b)
        renderer = fig.canvas.get_renderer()
        for ax in fig.axes:
            assert not ax.texts  # no label on the axes, where it could cover a point or a tick
            for legend in fig.legends:
                assert not legend.get_window_extent(renderer).overlaps(ax.get_window_extent(renderer))
        # every baseline is named in the legend, with its peak and step time
        legend = " ".join(t.get_text() for t in fig.legends[0].get_texts())
        for b in base:
            assert b["strategy"] in legend
        assert "device memory" in legend
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_the_table_title_is_one_line():
    from rich.console import Console

    console = Console(width=160, color_system=None, record=True)
    console.print(frontier_table(_crowded(2, 2.0**30, 0.1)[0]))
    assert "memshard frontier: least peak memory per step-time budget\n" in console.export_text()
