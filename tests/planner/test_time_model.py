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


def test_megatron_cores_h100_rows_grow_as_published_and_overlap_never_costs():
    """Megatron-Core on H100 (DP 48, one sequence per micro-batch, 4 micro-batches; TP 2 and up
    with ``-tpoverlap``): the steps grow with the model as the published ones do, and each row
    overlapped is no slower than in line. No row is within the goal yet: with the data-parallel
    collectives bucketed, as Megatron-LM runs them, the compute alone of TP 1–4 is below the
    published steps (docs/time-model.md). The TP 1 row's earlier agreement came from a ring
    latency per weight that Megatron-LM does not pay."""
    overlapped, in_line = [], []
    for name, *job, _published in MEGATRON_CORE:
        overlapped.append(megatron_core_step(name, *job))
        in_line.append(megatron_core_step(name, *job, overlap=False))
    assert [row[-1] for row in MEGATRON_CORE] == sorted(row[-1] for row in MEGATRON_CORE)
    assert overlapped == sorted(overlapped)
    assert all(o <= i for o, i in zip(overlapped, in_line))
