"""Traced modules run under their plans: Hugging Face GPT-2, LLaMA and Qwen2 (tiny configs)
and a module with an op memshard does not know, on 4 gloo ranks, against the single-process
module itself (fp32 or bf16 with fp32 master weights, and float64), the plan's communication
and its memory."""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("transformers")
import torch  # noqa: E402

import memshard  # noqa: E402
from memshard.runtime import traced  # noqa: E402
from memshard.runtime.simulate import simulate  # noqa: E402
from memshard.trace.hf import seeded_model  # noqa: E402
from tests.runtime_harness import INSPECT_STEP, run_plans  # noqa: E402

STEPS = 3
TINY = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
        "vocab_size": 256}
CONFIGS = {
    "gpt2": {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 256, "n_positions": 64,
             "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
    "llama": {"model_type": "llama", **TINY, "num_key_value_heads": 2},
    "qwen2": {"model_type": "qwen2", **TINY, "num_key_value_heads": 2},
}
RUNS = {**{family: (family, "none", "fp32") for family in CONFIGS},  # run → (config, recomputation, precision)
        "llama-recompute-full": ("llama", "full", "fp32"),
        "llama-mixed": ("llama", "none", "mixed"), "gpt2-mixed": ("gpt2", "none", "mixed")}
def _cast(t, dtype):
    return t.to(dtype) if t.is_floating_point() else t


def reference(graph, module_factory, dtype):
    """The module itself, one process, torch.optim.Adam: losses and step-2 gradients. In
    bf16, Adam updates fp32 master weights and the module's weights are those rounded."""
    module = module_factory().to(dtype)
    params = dict(module.named_parameters(remove_duplicate=False))
    weights = list(module.parameters())
    masters = [w.detach().float() for w in weights] if dtype == torch.bfloat16 else weights
    opt = torch.optim.Adam(masters, lr=1e-3)
    losses, grads = [], {}
    for step in range(STEPS):
        (args, kwargs), = traced.make_batch(graph, 1, step)
        args = [_cast(t, dtype) for t in args]
        kwargs = {k: _cast(v, dtype) for k, v in kwargs.items()}
        out = module(*args, **kwargs, **graph.traced.fixed_kwargs)
        loss = getattr(out, "loss", out)
        loss.backward()
        losses.append(loss.item())
        if step == INSPECT_STEP:
            grads = {n: params[n].grad.double().clone() for n in graph.parameters}
        if masters is not weights:
            for w, master in zip(weights, masters):
                master.grad, w.grad = w.grad.float(), None
        opt.step()
        opt.zero_grad()
        if masters is not weights:
            with torch.no_grad():
                for w, master in zip(weights, masters):
                    w.copy_(master)
    return losses, grads


def check_run(plan, reports, module_factory):
    """Losses equal the module's (fp32: rtol 1e-5; bf16: 1e-3), gradients as close to the
    exact ones (float64 from the same initial weights) as the module's own, within 10×."""
    graph = plan.problem.graph
    mixed = graph.precision.name == "mixed"
    losses, own_grads = reference(graph, module_factory, torch.bfloat16 if mixed else torch.float32)
    _, grads64 = reference(graph, module_factory, torch.float64)
    for r in reports:
        np.testing.assert_allclose(r["losses"], losses, rtol=1e-3 if mixed else 1e-5)
    got = reports[0]["gradients"]
    for name, g64 in grads64.items():
        g = torch.from_numpy(got[name]).double().reshape(g64.shape)
        own = (own_grads[name] - g64).abs().max().item()  # the single run's own rounding
        bound = max(10 * own, 1e-6 * g64.abs().max().item())
        assert (g - g64).abs().max().item() <= bound, name
    for r in reports:
        pred, meas = r["predicted"], r["measured"]
        assert meas["communication_bytes"] == pytest.approx(pred["communication_bytes"], rel=0.01, abs=64)


@pytest.fixture(scope="module")
def hf_runs():
    plans = {name: memshard.plan(memshard.HFModel(CONFIGS[family]), "4", batch=4, seq=16, precision=precision,
                                 mip_gap=0.02, recompute=recompute)
             for name, (family, recompute, precision) in RUNS.items()}
    return plans, dict(zip(plans, run_plans(list(plans.values()), STEPS)))


@pytest.mark.parametrize("family", sorted(RUNS))
def test_hf_model_under_its_plan_equals_the_model(family, hf_runs):
    """(Recomputing plans replay ops of every layer and still equal the module.)"""
    plans, runs = hf_runs
    plan = plans[family]
    assert any(op.recomputed for op in plan.ops) == (RUNS[family][1] != "none")
    assert plan.problem.graph.unknown_ops == {}
    check_run(plan, runs[family], lambda: seeded_model(
        plan.job.model.source, plan.job.precision, plan.job.model.attn_implementation, plan.job.hf_overrides()))




@pytest.mark.parametrize("family", sorted(RUNS))
def test_hf_model_peak_memory_is_the_planned_one(family, hf_runs):
    """Every rank within 2%, as ``test_runtime.py`` judges it: its real gloo run's peak, or,
    where that misses, the same step measured with ``simulate`` (the fake process group:
    deterministic, where a real gloo rank's peak moves by a few percent from run to run with
    the moment gloo's worker thread frees a collective's buffers, see BENCHMARKS.md). Rank 0
    is simulated in every case, whatever its real peak: each family's step runs under
    ``simulate`` and must match there too."""
    plans, runs = hf_runs
    for real in runs[family]:
        rank = real["rank"]
        if rank != 0 and real["measured"]["peak_bytes"] == pytest.approx(real["predicted"]["peak_bytes"], rel=0.02):
            continue
        r = simulate(plans[family], rank=rank)
        assert r["measured"]["peak_bytes"] == pytest.approx(r["predicted"]["peak_bytes"], rel=0.02), rank


def test_a_traced_llama_at_its_default_length_allocates_what_it_plans():
    """At 2,048 tokens attention dominates a tiny model's activations: SDPA there runs as an
    eager step runs it (``is_causal``, grouped-query, no mask, no repeated keys)."""
    plan = memshard.plan(memshard.HFModel(CONFIGS["llama"]), "4", batch=4, precision="fp32", mip_gap=0.02)
    assert plan.problem.graph.seq == 2048
    for rank in (0, 3):
        r = simulate(plan, rank=rank)
        assert r["measured"]["peak_bytes"] == pytest.approx(r["predicted"]["peak_bytes"], rel=0.02)


class UnknownOpNet(torch.nn.Module):
    """Two linears around an op memshard has no rule for: ``cumsum``, or ``sort`` (two
    outputs: values and indices)."""

    def __init__(self, op: str):
        super().__init__()
        torch.manual_seed(0)
        self.op = op
        self.a = torch.nn.Linear(32, 64)
        self.b = torch.nn.Linear(64, 32)

    def forward(self, x):
        y = self.a(x)
        y = torch.cumsum(y, dim=-1) if self.op == "cumsum" else torch.sort(y, dim=-1)[0]
        return self.b(y).pow(2).mean()


@pytest.mark.parametrize("op, mesh", [("cumsum", "4"), ("sort", "2")])
def test_a_module_with_an_unknown_op_plans_and_runs(op, mesh):
    with torch.device("meta"):
        meta = UnknownOpNet(op)
    plan = memshard.plan(meta, (torch.empty(8, 16, 32, device="meta"),), mesh=mesh)
    graph = plan.problem.graph
    assert graph.unknown_ops == {f"aten.{op}": 1}
    unknown = [o for o in graph.ops if o.kind == f"aten.{op}"]
    assert unknown and all(set(o.unsplittable_dims) == set(o.dims) for o in unknown)
    reports = run_plans([plan], STEPS, module_factory=lambda: UnknownOpNet(op))[0]
    check_run(plan, reports, lambda: UnknownOpNet(op))
    assert not math.isnan(reports[0]["losses"][-1])
