"""The step-time model against published Megatron-LM measurements (``benchmarks/time_model.py``
prices them all; ``docs/time-model.md`` gives the figures): what it already gets right stays
right. Nothing here is fitted: the presets' figures are the vendors' and nccl-tests'."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from time_model import (  # noqa: E402
    KORTHIKANTI,
    MEGATRON_CORE,
    NARAYANAN,
    layer_ms,
    megatron_core_step,
    narayanan_step,
)


@pytest.mark.parametrize("row", NARAYANAN, ids=[row[0] for row in NARAYANAN])
def test_the_data_parallel_rows_of_narayanan_table_1_within_10_percent(row):
    """GPT 1.7B to 18.4B on 32 to 256 A100s (TP 1 to 8, DP 32, full recomputation): Megatron-LM's
    fused QKV and its gradient buffer reduced in one bucket (in line), as it runs them."""
    *job, published = row
    assert narayanan_step(*job) == pytest.approx(published, rel=0.10)  # the goal per row


def test_korthikantis_recomputation_overheads_in_order_and_size():
    """One 22B layer (TP 8): full recomputation costs most (published +39%), selective little
    (+7%); each within 10 points of the published overhead."""
    published = {strategy: ms for _, strategy, _, ms in KORTHIKANTI}
    ours = {strategy: layer_ms(strategy, recompute) for _, strategy, recompute, _ in KORTHIKANTI
            if strategy in ("megatron-tp8", "megatron-tp8+full", "megatron-tp8+selective")}
    base = ours["megatron-tp8"]
    overhead = {s: ours[s] / base - 1 for s in ours}
    assert 0 < overhead["megatron-tp8+selective"] < overhead["megatron-tp8+full"]
    for strategy in ("megatron-tp8+full", "megatron-tp8+selective"):
        assert overhead[strategy] == pytest.approx(published[strategy] / published["megatron-tp8"] - 1, abs=0.10)


def test_overlap_brings_megatron_cores_data_parallel_rows_to_their_published_steps():
    """Megatron-Core on H100 with ``--overlap-grad-reduce --overlap-param-gather`` (DP 48, one
    sequence per micro-batch, 4 micro-batches): priced with its collectives in line, TP 2 and 4
    are 29% and 66% slow; overlapped, both closer. The TP 1 row within the goal: its gradient
    reduce-scatters run in the last micro-batch's backward only and its gathers in the first
    forward, as Megatron-LM runs them (hidden under the whole step, it was priced 35% fast)."""
    for name, *job, published in MEGATRON_CORE[1:3]:
        overlapped, in_line = megatron_core_step(name, *job), megatron_core_step(name, *job, overlap=False)
        assert abs(overlapped / published - 1) < abs(in_line / published - 1), name
    name, *job, published = MEGATRON_CORE[0]
    assert megatron_core_step(name, *job) == pytest.approx(published, rel=0.10)  # the goal per row
