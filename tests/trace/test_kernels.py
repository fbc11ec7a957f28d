"""Attention as CUDA runs it: the kernel choice against a GPU's, the math path's trace, and the
causal mask it makes priced where it lives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
import torch  # noqa: E402

import memshard  # noqa: E402
from memshard.core.graph import TensorKind  # noqa: E402
from memshard.trace.hf import trace_hf  # noqa: E402
from memshard.trace.kernels import MATH, cuda_attention, cuda_sdpa_backend  # noqa: E402
from tests.baselines.test_conformance import FAMILIES  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RECORDED = json.loads((ROOT / "benchmarks" / "sdpa_backends_cuda.json").read_text())


def test_the_kernel_choice_is_the_one_pytorch_made_on_a_gpu():
    """Every SDPA call of the grid recorded on an H200 (``benchmarks/sdpa_backends.py --measure``:
    dtypes, head dims 32-512, grouped-query or not, masks, dropout): math where PyTorch chose
    its math path, fused where it chose flash, cuDNN or memory-efficient attention."""
    assert RECORDED["device"] == "cuda" and len(RECORDED["choices"]) > 500
    kinds = {c["backend"] for c in RECORDED["choices"]}
    assert {"math", "flash", "efficient", "cudnn"} <= kinds
    for c in RECORDED["choices"]:
        gqa = c["enable_gqa"] and c["kv_heads"] != 8
        picked = cuda_sdpa_backend(c["dtype"], c["head_dim"], gqa=gqa, mask=c["mask"] is not None)
        assert (picked == MATH) == (c["backend"] == "math"), c


def test_the_math_path_saves_what_it_saved_on_a_gpu():
    """CPU's math kernel keeps, byte for byte, what the GPU's math path kept (the recorded
    fp32 grouped-query calls), and CPU's fused kernel what the GPU's fused ones kept, but for
    a 16-byte random seed (``cuda_attention`` picks between them as CUDA does)."""
    for row in RECORDED["memory"]:
        case = row["case"]
        q = torch.randn(case["batch"], 8, case["seq"], case["head_dim"], requires_grad=True)
        kv = [torch.randn(case["batch"], case["kv_heads"], case["seq"], case["head_dim"], requires_grad=True)
              for _ in range(2)]
        if case["dtype"] == "bf16":
            q, kv = q.detach().bfloat16().requires_grad_(), [x.detach().bfloat16().requires_grad_() for x in kv]
        saved: dict[int, int] = {}

        def pack(t, saved=saved):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with cuda_attention(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            torch.nn.functional.scaled_dot_product_attention(q, *kv, is_causal=True, enable_gqa=case["enable_gqa"])
        assert 0 <= row["saved_bytes"] - sum(saved.values()) <= (0 if row["backend"] == "math" else 16), row


def test_fp32_grouped_query_attention_is_traced_as_cudas_math_path():
    """Priced for CUDA, an fp32 LLaMA's attention is PyTorch's math path: the scores' softmax
    (batch × heads × seq²) kept for backward, keys and values repeated to the query's heads,
    and a causal mask made in every layer, whole on every rank and not a data loader's share
    (alive while its layer's attention runs: held all step, the recorded GPU runs would be
    priced 10% high); priced for CPU, the fused kernel."""
    graph = trace_hf("llama", batch=2, seq=32, precision="fp32", **FAMILIES["llama"])
    kinds = [op.kind for op in graph.ops]
    assert "sdpa" not in kinds and kinds.count("softmax") == 2 and kinds.count("matmul") == 4
    softmax = next(op for op in graph.ops if op.kind == "softmax")
    assert softmax.saves_output and graph.tensors[softmax.output.tensor].numel == 2 * 4 * 32 * 32
    masks = sorted(graph.made_inputs)
    assert [graph.tensors[m].shape for m in masks if len(graph.tensors[m].shape) == 2] == [(32, 32)] * 2
    assert all(graph.tensors[m].kind is TensorKind.INPUT and m not in graph.loaded_inputs for m in masks)
    fused = trace_hf("llama", batch=2, seq=32, precision="fp32", device="cpu", **FAMILIES["llama"])
    assert "sdpa" in [op.kind for op in fused.ops] and not fused.made_inputs & set(masks)
    longer = [trace_hf("llama", batch=2, seq=256, precision="fp32", device=device, **FAMILIES["llama"])
              for device in ("cpu", "cuda")]
    peaks = [memshard.strategy_plan(g, "2", "ddp").peak_bytes for g in longer]
    assert peaks[1] > 1.1 * peaks[0]


def test_the_math_path_runs_split_over_heads():
    """Megatron-LM's tensor parallelism on a traced fp32 LLaMA: the math path's ops run on
    each rank's key/value heads (the repeat's copies stay whole), under ``simulate`` (the fake
    process group, every op on local shards) within 2% of the predicted peak, collectives exact."""
    from memshard.runtime.simulate import simulate

    config = {"model_type": "llama", **FAMILIES["llama"], "hidden_size": 64, "intermediate_size": 128,
              "vocab_size": 256}
    plan = memshard.strategy_plan(memshard.HFModel(config), "2x2", "megatron-tp2-dp2", batch=4, seq=64,
                                  precision="fp32")
    math_ops = [op for op in plan.ops if op.kind in ("matmul", "softmax") or "repeat_interleave" in op.name]
    assert len(math_ops) == 5 and all(op.split.get("intra") for op in math_ops)
    report = simulate(plan, rank=0)
    assert report["measured"]["peak_bytes"] == pytest.approx(report["predicted"]["peak_bytes"], rel=0.02)
    assert report["measured"]["communication_bytes"] == report["predicted"]["communication_bytes"]
