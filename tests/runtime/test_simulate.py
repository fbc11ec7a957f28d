"""memshard simulate: one rank of a large job under the fake process group and FakeTensorMode.

Two claims (docs/verification.md):

- a simulated rank measures what the same rank measures in a real gloo run: the same bytes
  and calls per collective kind, and the peak at the low end of the real run's run-to-run
  jitter (gloo frees collective buffers from its own thread);
- for billion-parameter models (GPT-3 6.7B in mixed precision, LLaMA-3 8B in fp32) the
  executor's measured step matches the plan's prediction: peak within 2 %, each category
  within 5 %, communication within 1 %. What does not hold
  yet is an explicit strict xfail naming the discrepancy (``KNOWN_CATEGORY_GAPS``).

Each big model is simulated once per module. Under fake tensors the sequence length costs
nothing: time goes with the number of ops.
"""

from __future__ import annotations

import math

import pytest
import torch.distributed as dist

from memshard.api import strategy_plan
from memshard.core.errors import MemshardError
from memshard.problem.comm import KINDS
from memshard.problem.memory import CATEGORIES
from memshard.runtime.simulate import simulate
from tests.runtime_harness import forked_world
from tests.runtime_plans import Search, saved

# MemTracker's own post-accumulate-grad hook reads ``p.grad`` after ZeRO-2's hook has moved
# the gradient away (ParamStore._reduce_now sets it to None); harmless, so not noise here.
pytestmark = pytest.mark.filterwarnings("ignore:Expected a tensor or a traceable wrapper-subclass")

PEAK_TOL, CATEGORY_TOL, COMM_TOL = 0.02, 0.05, 0.01

# Where the measured breakdown at the peak differs from the plan: a strict xfail naming why.
# (The kept lm_head input's re-gathered copy, once filed as activations by the model and as
# transients by MemTracker, is now a transient in both.)
KNOWN_CATEGORY_GAPS: dict[tuple[str, str], str] = {}


def _table(report: dict) -> str:
    """measured vs predicted, one line per figure (printed for the record)."""
    m, p = report["measured"], report["predicted"]
    rows = [("peak", m["peak_bytes"], p["peak_bytes"])]
    rows += [(c, m["breakdown"][c], p["breakdown"][c]) for c in CATEGORIES]
    rows += [("communication", m["communication_bytes"], p["communication_bytes"])]
    rows += [(k, m["communication_by_kind"][k], p["communication_by_kind"][k]) for k in KINDS]
    lines = []
    for name, a, b in rows:
        rel = f"{(a - b) / b:+.3%}" if b else ("exact" if a == b else "inf")
        lines.append(f"{name:18s} measured {a:>16,.0f}  predicted {b:>16,.0f}  {rel}")
    return "\n".join(lines)


def _close(measured: float, predicted: float, tol: float) -> bool:
    return math.isclose(measured, predicted, rel_tol=tol, abs_tol=0.0) or measured == predicted


# ------------------------------------------------------------------ simulate == real gloo


@pytest.fixture(scope="module")
def tiny():
    """Megatron-LM's TP × DP with sequence parallelism, tiny GPT on 2x2 (made once)."""
    return strategy_plan("tiny-gpt", "2x2", "megatron-tp2-dp2-sp", batch=8)


def _train_command_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    """One rank of ``python -m memshard.runtime.train --plan plan.json --steps 2`` as the
    launcher starts it (its environment), forked: its report to ``out_dir/rank<r>.json``."""
    import os

    from memshard.runtime.launch import COLLECTIVE_TIMEOUT_ENV, OUT_DIR_ENV
    from memshard.runtime.train import main

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
                       OUT_DIR_ENV: out_dir, COLLECTIVE_TIMEOUT_ENV: "60"})
    assert main(["--plan", os.path.join(out_dir, "plan.json"), "--steps", "2"]) == 0


def test_a_simulated_rank_measures_what_the_real_gloo_rank_measures(tmp_path, tiny) -> None:
    # 4 real gloo ranks (the train command's own code, forked: no interpreter started per
    # rank; the launcher is tests/runtime/test_launch.py's), then the same 4 ranks simulated.
    plan = tiny
    plan.save(str(tmp_path / "plan.json"))
    real = forked_world(_train_command_rank, 4, tmp_path)
    for rank in range(4):
        sim = simulate(plan, rank=rank)
        assert not dist.is_initialized()
        assert sim["rank"] == real[rank]["rank"] == rank
        assert sim["coordinate"] == real[rank]["coordinate"]
        assert sim["predicted"] == real[rank]["predicted"]
        # Same bytes sent. The real peak is not exactly repeatable: gloo's worker thread drops
        # its reference to a collective's buffers at a moment of its own, so a freshly started
        # real run measured 4,710,680 B on most ranks and 4,711,704, 4,750,616 or 4,808,984 B
        # on some (4 runs × 4 ranks); the simulated rank always measures the low figure. The
        # simulated peak is therefore checked to lie within the real run's jitter (+0/−2.5%).
        for key in ("communication_bytes", "communication_by_kind", "collective_calls"):
            assert sim["measured"][key] == real[rank]["measured"][key], (rank, key)
        real_peak = real[rank]["measured"]["peak_bytes"]
        assert 0.975 * real_peak <= sim["measured"]["peak_bytes"] <= real_peak * 1.001, rank
        assert sim["simulated"] is True and sim["world_size"] == 4
        assert sim["losses"] == [None, None]
        assert all(math.isfinite(x) for x in real[rank]["losses"])
    assert real[0]["measured"]["peak_bytes"] > 0


def test_zero3_per_layer_on_a_big_model_matches_the_plan() -> None:
    """GPT-3 6.7B, TP8 + ZeRO-3 over 8 gathered a layer at a time, one rank of 8x8 (~12 s):
    peak and every category within 0.1%, bytes exact, and one all-gather / reduce-scatter per
    unit as the plan counts them (its all-reduces are priced per weight, run per unit)."""
    plan = strategy_plan("gpt3-6.7b", "8x8", "tp8-fsdp8", batch=64, seq=2048, precision="fp32",
                         zero3_unit="layer")
    report = simulate(plan, rank=0)
    m, p = report["measured"], report["predicted"]
    assert _close(m["peak_bytes"], p["peak_bytes"], 0.001), _table(report)
    for category in CATEGORIES:
        assert _close(m["breakdown"][category], p["breakdown"][category], 0.001), category
    assert _close(m["communication_bytes"], p["communication_bytes"], 0.001)
    calls = plan.to_dict()["communication"]["by_kind"]
    for kind in ("all_gather", "reduce_scatter"):
        assert m["collective_calls"][kind] == calls[kind]["calls"], kind


# ------------------------------------------------------------------------ refusals, cleanup


def test_simulate_refuses_a_rank_outside_the_mesh(tiny) -> None:
    with pytest.raises(MemshardError, match="outside"):
        simulate(tiny, rank=4)
    assert not dist.is_initialized()


def test_simulate_tears_the_fake_world_down_when_the_step_fails(tiny) -> None:
    with pytest.raises(MemshardError, match="at least 2 steps"):
        simulate(tiny, steps=1)  # train refuses inside the fake world
    assert not dist.is_initialized()


# ------------------------------------------------------------- billion-parameter models


@pytest.fixture(scope="module")
def gpt3_6_7b() -> dict:
    # The plan as `memshard simulate` makes it (mip_gap 0.02), saved; rank 0 of 64 simulated
    # (two fake steps of 32 layers). Mixed precision: bf16 weights, activations
    # and gradients, fp32 master weights and Adam moments (LeanAdam's chunked update).
    plan = saved(Search("gpt3-6.7b", "8x8", batch=64, seq=2048, precision="mixed", mip_gap=0.02))
    report = simulate(plan, rank=0)
    print("\ngpt3-6.7b 8x8 mixed precision rank 0\n" + _table(report))
    return report


@pytest.fixture(scope="module")
def llama3_8b() -> dict:
    # The plan saved as for gpt3-6.7b; rank 0 of 32 simulated. fp32.
    plan = saved(Search("llama3-8b", "4x8", batch=32, seq=2048, mip_gap=0.02))
    report = simulate(plan, rank=0)
    print("\nllama3-8b 4x8 rank 0\n" + _table(report))
    return report


@pytest.fixture(params=["gpt3_6_7b", "llama3_8b"])
def big(request) -> dict:
    return request.getfixturevalue(request.param)


def test_big_model_communication_matches_the_plan(big) -> None:
    m, p = big["measured"], big["predicted"]
    assert _close(m["communication_bytes"], p["communication_bytes"], COMM_TOL), _table(big)
    for kind in KINDS:
        assert _close(
            m["communication_by_kind"][kind], p["communication_by_kind"][kind], COMM_TOL
        ), kind


def test_big_model_peak_matches_the_plan(big) -> None:
    m, p = big["measured"], big["predicted"]
    assert _close(m["peak_bytes"], p["peak_bytes"], PEAK_TOL), _table(big)
    assert sum(m["breakdown"].values()) == m["peak_bytes"]


def _category_cases():
    """(model, category), with a strict xfail where the figures are known to differ."""
    for model in ("gpt3_6_7b", "llama3_8b"):
        for category in CATEGORIES:
            reason = KNOWN_CATEGORY_GAPS.get((model, category))
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            yield pytest.param(model, category, marks=marks, id=f"{model}-{category}")


@pytest.mark.parametrize(("model", "category"), list(_category_cases()))
def test_big_model_category_at_the_peak_matches_the_plan(
    request, model: str, category: str
) -> None:
    report = request.getfixturevalue(model)
    m, p = report["measured"]["breakdown"][category], report["predicted"]["breakdown"][category]
    assert _close(m, p, CATEGORY_TOL), _table(report)


@pytest.mark.parametrize(("strategy", "mesh", "share"), [
    ("dp", "4", 4), ("megatron-tp4-sp", "1x4", 1), ("megatron-tp2-dp2", "2x2", 2), ("zero3-fsdp", "2x2", 4)])
def test_a_rank_keeps_its_share_of_the_batch_as_priced(strategy: str, mesh: str, share: int) -> None:
    """A data loader hands a data-parallel rank its own sequences (tensor-parallel ranks read the
    same ones): the plan prices the token ids and labels at that share, and the runtime keeps
    only it, in memory of its own."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from memshard.plans.plan import runnable
    from memshard.runtime.executor import GraphModel, ShardedGraphModel, make_batch
    from memshard.runtime.measure import destroy, init_fake_world

    plan = runnable(strategy_plan("tiny-gpt", mesh, strategy, batch=8, precision="fp32"))
    problem, graph = plan.problem, plan.problem.graph
    assert set(graph.loaded_inputs) == {"input_ids", "labels"}
    share_bytes = graph.tensors["input_ids"].nbytes // share
    priced = [s.nbytes[plan.selection.choices[s.group]] for s in problem.slots
              if s.start == 0 and s.category == "activations" and s.global_bytes == graph.tensors["input_ids"].nbytes]
    assert priced == [share_bytes] * 2
    assert not problem.constants
    init_fake_world(0, problem.mesh.num_devices)
    try:
        device_mesh = init_device_mesh("cpu", problem.mesh.shape)
        model = ShardedGraphModel(GraphModel(graph, 0), problem, plan.selection, device_mesh)
        batch = make_batch(graph, 1, 0)[0]
        kept = model.load(model.shares(batch))
        for name in graph.loaded_inputs:
            assert kept[name].untyped_storage().nbytes() == share_bytes, name
            assert kept[name].untyped_storage().data_ptr() != batch[name].untyped_storage().data_ptr(), name
        torch.testing.assert_close(kept["input_ids"], batch["input_ids"][: 8 // share])  # rank 0: the first sequences
    finally:
        destroy()


def test_a_gathered_weight_is_let_go_before_the_next_op_reshards_its_inputs() -> None:
    """A plan a time-limited search returned (tiny LLaMA on 2x2, ZeRO-3 by layer): the output
    layer's ZeRO-3 weight is gathered for its forward, then its logits are resharded for the
    loss. The executor once kept the gathered weight (the last input of the op before) through
    that reshard: the peak measured 4.5% above the plan's. Now within 0.5%."""
    from pathlib import Path

    from memshard.plans.plan import load_plan

    plan = load_plan(str(Path(__file__).parents[1] / "data" / "tiny_llama_2x2_gathered_lm_head.json"))
    report = simulate(plan, rank=0)
    measured, predicted = report["measured"]["peak_bytes"], report["predicted"]["peak_bytes"]
    assert abs(measured - predicted) <= 0.005 * predicted, (measured, predicted)


def test_a_residual_adds_gradient_is_one_tensor_for_both_its_inputs() -> None:
    """A plan a time search returned (tiny LLaMA on 1x4, layers.1's MLP and attention recomputed):
    its peak is in the last layer's backward. An add's backward hands its output's gradient
    itself to both inputs (autograd makes no tensor), so the residual's two producers hold one
    gradient until the first of their backwards. The model once counted three tensors at the
    add's backward and two after it: the peak predicted 3.4% above the measured one, at the
    add's backward instead of the MLP's. Now the peak and its breakdown agree within 0.5%."""
    from pathlib import Path

    from memshard.plans.plan import load_plan

    path = Path(__file__).parents[1] / "data" / "tiny_llama_1x4_shared_residual_gradient.json"
    report = simulate(load_plan(str(path)), rank=0)
    measured, predicted = report["measured"], report["predicted"]
    assert _close(measured["peak_bytes"], predicted["peak_bytes"], 0.005), _table(report)
    for category in CATEGORIES:
        assert _close(measured["breakdown"][category], predicted["breakdown"][category], 0.005), (
            _table(report))
