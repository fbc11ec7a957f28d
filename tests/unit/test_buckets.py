"""Data-parallel buckets (``problem/buckets.py``) and Megatron-LM's ``--tp-comm-overlap``
(``problem/tp_overlap.py``): the DDP baseline pays one collective per bucket of PyTorch's own
bucket rule, the bytes unchanged; ``-tpoverlap`` hides TP collectives under the GEMMs."""

from __future__ import annotations

from dataclasses import replace

import pytest

from memshard.api import export, make_job
from memshard.baselines.names import parse_strategy
from memshard.baselines.recipes import as_run_by, baselines
from memshard.core.errors import MemshardError
from memshard.core.placement import local_numel
from memshard.problem import comm
from memshard.problem.evaluate import evaluate
from memshard.problem.memory import param_layout
from memshard.problem.pricing import build_problem
from memshard.problem.records import DDP, StorageGroup
from tests.unit.test_zero0_buckets import torch_buckets


def _baseline(job, name):
    problem = build_problem(job.graph, job.mesh, micro_batches=job.micro_batches)
    found, skipped = baselines(problem, lambda n: n == name)
    assert found, skipped
    return problem, found[0]


def test_ddp_pays_one_all_reduce_latency_per_bucket_of_torchs_rule():
    job = make_job("gpt3-1.3b", "2x4", batch=8, precision="fp32", num_layers=4)
    problem, ddp = _baseline(job, "ddp")
    assert ddp.problem.graph.precision.reduce_bytes == 4  # (the meta tensors' fp32)
    expected = len(torch_buckets(ddp.problem, ddp.selection))  # (its rule: test_zero0_buckets)
    assert 1 < expected < len(job.graph.parameters)
    mesh = ddp.problem.mesh
    latency = shares = 0.0
    per_call = None
    for group, k in zip(ddp.problem.groups, ddp.selection.choices):
        if not isinstance(group, StorageGroup):
            continue
        for c in group.choices[k].calls:
            assert c.kind == comm.ALL_REDUCE
            one_call = comm.collective_time(replace(c, buffer_bytes=0.0, share=1.0), mesh)
            per_call = one_call if per_call is None else per_call
            assert one_call == pytest.approx(per_call)  # one ring: every weight's over all the devices
            latency += group.instances * (comm.collective_time(c, mesh) - comm.collective_time(replace(c, share=0.0), mesh))
            shares += group.instances * c.share
    assert shares == pytest.approx(expected)  # the shares of each bucket sum to one call
    assert latency == pytest.approx(expected * per_call)
    assert evaluate(ddp.problem, ddp.selection).communication_by_kind["all_reduce"]["calls"] == expected
    # the bytes are the weights' own, as one call per weight sends them
    unbucketed = as_run_by(problem, DDP)
    before, after = evaluate(unbucketed, ddp.selection), evaluate(ddp.problem, ddp.selection)
    assert after.communication_bytes == pytest.approx(before.communication_bytes)
    assert after.peak_bytes == before.peak_bytes
    assert after.communication_time_s < before.communication_time_s


def _megatron_buckets(problem, selection, data_parallel: int) -> int:
    """Megatron-LM's buckets with ``--overlap-grad-reduce`` (``param_and_grad_buffer.py``): the
    local parameters in reverse order, a bucket closed once it holds max(40M, 1M × DP) elements."""
    first_use = {}
    for i, op in enumerate(problem.graph.ops):
        for t in op.inputs:
            if t.tensor in problem.graph.parameters:
                first_use.setdefault(t.tensor, i)
    cap, held, buckets = max(40_000_000, 1_000_000 * data_parallel), 0, 0
    for name in sorted(first_use, key=lambda n: -first_use[n]):
        gid = problem.storage_group[name]
        G, _ = problem.groups[gid].options[selection.choices[gid]]
        held += local_numel(problem.graph.tensors[name].shape, param_layout(G), problem.mesh.shape)
        if held >= cap:
            buckets, held = buckets + 1, 0
    return buckets + (held > 0)


def test_megatron_reduces_per_bucket_with_overlap_and_in_one_without():
    """Megatron-LM: ``--overlap-grad-reduce`` buckets of max(40M, 1M × DP) parameters; without
    it one bucket for the whole buffer; its distributed optimizer's gathers per bucket alike."""
    job = make_job("gpt3-1.3b", "2x4", batch=8, num_layers=8)
    _, in_line = _baseline(job, "megatron-tp2-dp4-sp-distopt")
    _, overlapped = _baseline(job, "megatron-tp2-dp4-sp-distopt-overlap")
    expected = _megatron_buckets(overlapped.problem, overlapped.selection, 4)
    assert expected > 1
    for b, buckets in ((in_line, 1), (overlapped, expected)):
        data_axes = set(b.problem.mesh.to_real_axes(tuple(range(b.problem.mesh.ndim - 1))))
        calls = {comm.REDUCE_SCATTER: 0.0, comm.ALL_GATHER: 0.0}
        for group, k in zip(b.problem.groups, b.selection.choices):
            if isinstance(group, StorageGroup):
                for c in group.choices[k].calls:
                    if set(c.axes) <= data_axes:
                        calls[c.kind] += group.instances * c.share
        assert calls == {comm.REDUCE_SCATTER: pytest.approx(buckets), comm.ALL_GATHER: pytest.approx(buckets)}


def test_tpoverlap_is_a_name_part_with_sequence_parallelism_only():
    name = parse_strategy("megatron-tp4-dp2-sp-distopt-overlap-tpoverlap")
    assert name.tp_overlap and name.overlap and str(name) == "megatron-tp4-dp2-sp-distopt-overlap-tpoverlap"
    assert parse_strategy("megatron-tp4-sp-tpoverlap").tp_overlap
    with pytest.raises(MemshardError, match="sequence parallelism"):
        parse_strategy("megatron-tp4-tpoverlap")


@pytest.mark.parametrize("name", ["megatron-tp4-dp2-sp-distopt-overlap", "megatron-tp8-sp"])
def test_tpoverlap_hides_tp_collectives_up_to_the_gemms(name):
    job = make_job("gpt3-1.3b", "2x4" if "dp2" in name else "8", batch=8, num_layers=2)
    _, plain = _baseline(job, name)
    _, hidden = _baseline(job, name + "-tpoverlap")
    a, b = evaluate(plain.problem, plain.selection), evaluate(hidden.problem, hidden.selection)
    assert b.communication_time_s == pytest.approx(a.communication_time_s)  # the same collectives
    assert b.compute_time_s == pytest.approx(a.compute_time_s)
    assert b.peak_bytes == a.peak_bytes
    assert b.step_time_s < a.step_time_s
    own = b.hidden_communication_s - a.hidden_communication_s
    tp_axes = set(plain.problem.mesh.to_real_axes((plain.problem.mesh.ndim - 1,)))
    tp_time = sum(e.executions * comm.total_time([c for c in plain.problem.edge_calls(plain.selection, i)
                                                   if set(c.axes) <= tp_axes], plain.problem.mesh)
                  for i, e in enumerate(plain.problem.edges))
    assert 0 < own <= tp_time


def test_tpoverlap_hides_all_where_the_gemms_outlast_the_collectives():
    """A wide model at TP 2: each linear's GEMMs outlast its all-gather and reduce-scatter on
    NVLink, so every one of those collectives hides (what stays: the embedding's, the head's,
    the loss's)."""
    job = make_job("gpt3-1.3b", "2", batch=8, seq=2048, num_layers=1, hidden=8192, heads=64, ffn=4 * 8192,
                   gpu="h100-sxm")
    _, plain = _baseline(job, "megatron-tp2-sp")
    _, hidden = _baseline(job, "megatron-tp2-sp-tpoverlap")
    from memshard.problem.tp_overlap import edge_gemms, gemm_seconds, tp_calls
    problem, selection = hidden.problem, hidden.selection
    tp_axes = set(problem.mesh.to_real_axes((problem.mesh.ndim - 1,)))
    overlappable = 0.0
    for e, edge in enumerate(problem.edges):
        gemms = edge_gemms(problem, e)
        if gemms:
            forward, backward = tp_calls(problem, selection, e, tp_axes)
            times = [gemm_seconds(problem, selection, g) for g in gemms]
            assert comm.total_time(forward, problem.mesh) <= sum(t[0] for t in times)
            assert comm.total_time(backward, problem.mesh) <= sum(t[1] for t in times)
            overlappable += edge.executions * comm.total_time(forward + backward, problem.mesh)
    a, b = evaluate(plain.problem, plain.selection), evaluate(problem, selection)
    assert overlappable > 0
    assert b.hidden_communication_s - a.hidden_communication_s == pytest.approx(overlappable)


def test_export_writes_tp_comm_overlap():
    text = export("gpt3-1.3b", "2x4", "megatron-tp4-dp2-sp-distopt-overlap-tpoverlap", batch=8, num_layers=2)
    assert "--tp-comm-overlap" in text
    assert "--tp-comm-overlap" not in export("gpt3-1.3b", "2x4", "megatron-tp4-dp2-sp-distopt-overlap", batch=8,
                                              num_layers=2)
