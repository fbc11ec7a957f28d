"""The text report shows the figures of the plan it describes."""

from __future__ import annotations

import memshard
from memshard.units import format_bytes


def test_report_text_shows_peak_bound_and_strategy():
    plan = memshard.plan("gpt2", "4", batch=4, seq=32, num_layers=1, hidden=64, heads=2, vocab=128, ffn=128)
    text = memshard.format_plan(plan)
    assert format_bytes(plan.peak_bytes) in text
    assert format_bytes(plan.lower_bound_bytes) in text
    assert "zero-redundancy bound" in text
    for op in ("attn.q", "mlp.fc", "lm_head"):
        assert op in text
    assert "Parameter storage" in text
