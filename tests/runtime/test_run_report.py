"""The run report: a rank whose measured peak is more than 2% off the prediction is named
below the tables with the command that measures it deterministically; counts are words."""

from __future__ import annotations

from rich.console import Console

from memshard.problem.comm import KINDS
from memshard.problem.memory import CATEGORIES
from memshard.runtime.report import PEAK_TOLERANCE, peak_misses, render_run

MIB = 2**20


def _report(rank: int, measured_peak: float, simulated: bool = False) -> dict:
    breakdown = dict.fromkeys(CATEGORIES, 0.0) | {"activations": 2 * MIB}
    comm = dict.fromkeys(KINDS, 0.0) | {"all_gather": 1.1 * MIB}
    return {"rank": rank, "coordinate": [rank // 2, rank % 2], "strategy": "memshard", "simulated": simulated,
            "losses": [6.29, 6.26], "step_times_s": [0.5424, 1.2985],
            "predicted": {"peak_bytes": 2 * MIB, "breakdown": breakdown, "communication_bytes": 1.1 * MIB,
                          "communication_by_kind": comm},
            "measured": {"peak_bytes": measured_peak, "breakdown": breakdown, "communication_bytes": 1.1 * MIB,
                         "communication_by_kind": comm}}


def _text(reports: list[dict], **kwargs) -> str:
    console = Console(width=160, color_system=None, record=True)
    render_run(reports, console, **kwargs)
    return console.export_text()


def test_a_rank_off_by_more_than_two_percent_is_named_with_how_to_confirm():
    reports = [_report(r, 2 * MIB * (1.0298 if r == 2 else 1.0017)) for r in range(4)]
    assert peak_misses(reports) == [(2, reports[2]["measured"]["peak_bytes"] / (2 * MIB) - 1)]
    text = _text(reports)
    assert "4 ranks reported" in text
    assert "! rank 2: measured peak +2.98% off the prediction (more than 2%)" in text
    assert "--rank 2" in text and "memshard simulate" in text
    assert "rank 0:" not in text and "rank 1:" not in text
    assert "│ peak memory          │     2 MiB │ 2.06 MiB │ +2.98% ! │" in text
    assert "step time: 542 ms, 1.3 s" in text


def test_ranks_within_the_tolerance_are_not_named():
    text = _text([_report(0, 2 * MIB * (1 + PEAK_TOLERANCE * 0.99))])
    assert "1 rank reported" in text
    assert "!" not in text


def test_a_simulated_rank_off_is_a_model_miss_not_timing():
    text = _text([_report(0, 2.2 * MIB, simulated=True)], title="memshard simulate (8 ranks, fake process group)")
    assert "! rank 0: measured peak +10.00% off" in text
    assert "deterministic" in text and "--rank" not in text
