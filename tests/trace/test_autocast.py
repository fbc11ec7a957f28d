"""``--precision autocast``: a traced model under ``torch.autocast`` to bf16, with CUDA's op
lists applied while tracing on CPU (``memshard.trace.autocast``). What PyTorch allocates under
it is checked in ``test_conformance.py``; here, the lists, the casts and where the precision
is refused."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import memshard  # noqa: E402
from memshard.core.errors import MemshardError  # noqa: E402
from memshard.core.graph import TensorKind  # noqa: E402
from memshard.plans.plan import runnable  # noqa: E402
from memshard.trace import autocast  # noqa: E402
from memshard.trace.hf import trace_hf  # noqa: E402
from tests.planner.test_cli import assert_one_line_error, run  # noqa: E402

GPT2 = {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 256, "n_positions": 64}


@functools.cache
def traced_gpt2(precision: str):
    """The small GPT-2 of ``GPT2`` (batch 4, 32 tokens) traced in ``precision``, once in this
    process: a graph is a frozen record, and the tests only read it."""
    return trace_hf("gpt2", batch=4, seq=32, precision=precision, **GPT2)


def header_lists() -> dict[str, set[str]]:
    """CUDA's autocast lists as the installed PyTorch's ``ATen/autocast_mode.h`` defines them."""
    header = Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"
    if not header.exists():
        pytest.skip("this PyTorch ships no C++ headers")
    text = header.read_text().replace("\\\n", " ")
    lists = {}
    for macro in ("AT_FORALL_LOWER_PRECISION_FP", "AT_FORALL_FP32", "AT_FORALL_FP32_SET_OPT_DTYPE", "AT_FORALL_PROMOTE"):
        body = re.search(rf"#define {macro}\(_\)(.*)", text).group(1)
        lists[macro] = {f"{n}.{o}" if o else n for n, o in re.findall(r"_\((\w+)(?:,\s*(\w+))?\)", body)}
    return lists


def test_the_policy_lists_are_those_of_the_installed_pytorch():
    lists = header_lists()
    assert set(autocast.LOWER_PRECISION) == lists["AT_FORALL_LOWER_PRECISION_FP"] - {
        "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell"}
    assert set(autocast.FP32) == lists["AT_FORALL_FP32"] - {
        n for n in lists["AT_FORALL_FP32"] if n.startswith(("upsample", "_upsample"))}
    assert set(autocast.FP32_SET_OPT_DTYPE) == lists["AT_FORALL_FP32_SET_OPT_DTYPE"]
    assert set(autocast.PROMOTE) == lists["AT_FORALL_PROMOTE"]


def test_the_cuda_policy_casts_as_cudas_lists_say_then_cpus_lists_return():
    x = torch.randn(4, 8)
    half = x.bfloat16()
    with autocast.cuda_policy(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.mm(x, x.T).dtype == torch.bfloat16  # lower precision
        assert F.layer_norm(half, (8,)).dtype == torch.float32  # fp32 on CUDA, bf16 on CPU
        assert half.pow(3).dtype == torch.float32
        assert half.rsqrt().dtype == torch.float32
        assert torch.softmax(half, -1).dtype == torch.float32  # fp32 unless a dtype is given
        assert torch.softmax(half, -1, dtype=torch.bfloat16).dtype == torch.bfloat16
        assert half.sum().dtype == torch.float32
        assert torch.addcmul(x, half, half).dtype == torch.float32  # the widest input
        assert F.gelu(half).dtype == torch.bfloat16  # on no list
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert F.layer_norm(half, (8,)).dtype == torch.bfloat16
        assert half.pow(3).dtype == torch.bfloat16


def test_a_weights_autocast_copy_is_priced_as_its_consumers_saved_buffer():
    """The bf16 copy of a weight is no activation of its own: the consumer reads the weight, so
    the gradient (partial across the data-parallel ranks) and a tied weight's layout stay the
    weight's; the copy it saves for backward is its buffer, 2 bytes an element."""
    graph, fp32 = traced_gpt2("autocast"), traced_gpt2("fp32")
    assert graph.precision.name == "autocast" and graph.num_layers == 2
    weights = {name for name, t in graph.tensors.items() if t.kind is TensorKind.PARAMETER}
    assert weights == {name for name, t in fp32.tensors.items() if t.kind is TensorKind.PARAMETER}
    assert all(graph.tensors[w].dtype_bytes == 4 for w in weights)
    head = next(op for op in graph.ops if op.name.startswith("lm_head/") and op.kind == "matmul")
    assert "lm_head.weight" in {o.tensor for o in head.inputs}  # tied to the token embedding
    copies = [b for op in graph.ops for b in op.buffers if ".cast" in b.name]
    assert copies and all(b.dtype_bytes == 2 for b in copies)
    assert len(copies) == sum(1 for op in graph.ops if op.kind == "matmul" and any(o.tensor in weights for o in op.inputs))
    ddp, ddp_fp32 = (memshard.strategy_plan(g, "4", "ddp") for g in (graph, fp32))
    assert ddp.communication.bytes_per_step == pytest.approx(ddp_fp32.communication.bytes_per_step)  # in fp32


def test_autocast_is_priced_for_traced_models_and_run_by_none():
    assert "traced" in assert_one_line_error(run("plan", "--model", "tiny-gpt", "--mesh", "2", "--precision",
                                                 "autocast"))
    graph = traced_gpt2("autocast")  # (the batch the plan is made for is not what is refused)
    with pytest.raises(MemshardError, match="autocast plan"):
        runnable(memshard.strategy_plan(graph, "2", "ddp"))
    # (the rows' names, the reasons and the notes are checked here, not memshard's plans: a loose gap)
    compared = memshard.compare(graph, "2x2", mip_gap=0.5)
    names = {row["strategy"]: row for row in compared["skipped"]}
    assert "autocast" in names["megatron-tp2-dp2"]["reason"]
    assert {"fsdp2-noreshard", "torch-tp2-fsdp2"} <= set(names)  # measured off, or not checked, under it
    offered = {row["strategy"] for row in compared["rows"]}
    assert {"ddp", "ddp-bucket-view", "fsdp2", "fsdp2-torchtitan", "zero3-fsdp"} <= offered
    assert not compared["notes"]
    mixed = memshard.compare(traced_gpt2("mixed"), "2", mip_gap=0.5)
    assert any("--precision autocast" in note for note in mixed["notes"])  # what its ddp row is not


class ThriceRead(torch.nn.Module):
    """One weight read by three matmuls: autocast casts it once per forward (its cache)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16, 16))

    def forward(self, x):
        return (((x @ self.w).relu() @ self.w).relu() @ self.w).square().mean()


def test_a_weight_read_thrice_has_one_bf16_copy_priced_with_the_first_reader_that_keeps_it():
    """(The first matmul reads the input, which needs no gradient: it keeps no weight.)"""
    from memshard.trace import trace_module

    graph = trace_module(ThriceRead(), (torch.randn(8, 16),), autocast=True, device="cpu")
    assert graph.precision.name == "autocast"
    readers = [op for op in graph.ops if op.kind == "matmul"]
    assert len(readers) == 3 and all("w" in {o.tensor for o in op.inputs} for op in readers)
    assert [len([b for b in op.buffers if ".cast" in b.name]) for op in readers] == [0, 1, 0]
    with pytest.raises(MemshardError, match="not on meta"):
        trace_module(ThriceRead().to("meta"), (torch.randn(8, 16, device="meta"),), autocast=True)
    planned = memshard.plan(ThriceRead(), (torch.randn(8, 16),), mesh="2", precision="autocast")  # CUDA's lists
    assert planned.model.precision == "autocast"


class Widening(torch.nn.Module):
    """Blocks whose bf16 activation meets an fp32 one in a product, as GPT-2's GELU under CUDA's
    autocast (``0.5 * x`` in bf16 times ``1 + tanh(…pow(x, 3)…)`` in fp32)."""

    def __init__(self, checkpointed: bool = False):
        super().__init__()
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        blocks = [self.Block() for _ in range(2)]
        self.layers = torch.nn.ModuleList([checkpoint_wrapper(b, preserve_rng_state=False) if checkpointed else b
                                           for b in blocks])

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(256, 1024), torch.nn.Linear(1024, 256)

        def forward(self, x):
            h = self.up(x).to(torch.bfloat16)
            return x + self.down((0.5 * h) * (1.0 + torch.tanh(torch.pow(h.float(), 3.0))))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_narrow_input_of_a_wide_product_gets_a_wide_gradient_then_its_cast(checkpointed):
    """The bf16 input's gradient is computed in fp32 and cast by autograd after the op's
    backward, both alive at once; in a checkpointed block the op's saved tensors (the
    checkpoint's) are freed before that cast, so the peak is the fp32 gradient with them.
    Priced as PyTorch allocates it on CPU (``MemoryMeter``, second step; the input added,
    made before the meter)."""
    from memshard.runtime.measure import MemoryMeter
    from memshard.trace import trace_module

    x = torch.randn(512, 256)
    torch.manual_seed(0)
    graph = trace_module(Widening(), (x,), device="cpu")
    predicted = memshard.strategy_plan(graph, "1", "dp+full" if checkpointed else "dp",
                                       recompute="full" if checkpointed else "none").peak_bytes
    torch.manual_seed(0)
    model = Widening(checkpointed)
    opt = torch.optim.Adam(model.parameters(), foreach=True)
    for _ in range(2):
        meter = MemoryMeter(model, opt)
        with meter:
            model(x).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert meter.peak_bytes + x.nbytes == pytest.approx(predicted, rel=0.001)
