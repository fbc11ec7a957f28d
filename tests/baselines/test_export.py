"""``memshard export``: baselines written for the frameworks they are named after.

The exported ``fsdp2`` and ``ddp`` code (and their ``+full``, with ``torch.utils.checkpoint``) is executed on tiny Hugging Face LLaMA and GPT-2
models, one rank of a 4-rank world under the ``fake`` process group, and must allocate what
the plan predicts (``MemoryMeter``, within 2%, as ``test_conformance.py`` checks the
baselines); the Megatron-LM arguments must say the preset's sizes and the baseline's layout;
``--out`` is written atomically and never replaces a file unasked; memshard's own plans and the
idealised baselines are refused with a pointer to ``memshard.parallelize``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

import memshard
from memshard.cli import main
from memshard.core.errors import MemshardError
from memshard.core.quantities import format_bytes
from memshard.models import get_config
from tests.docs.markdown import pages

ROOT = Path(__file__).resolve().parents[2]
WORLD = 4


def megatron_arguments(text: str) -> dict[str, str | None]:
    """The ``MEGATRON_ARGS=( … )`` array of an export: flag → value (None for a switch; a
    flag's several values joined by spaces)."""
    body = re.search(r"^MEGATRON_ARGS=\(\n(.*?)^\)$", text, re.S | re.M)
    assert body, text
    out: dict[str, str | None] = {}
    for line in body.group(1).splitlines():
        flag, *value = line.split()
        assert flag.startswith("--") and flag not in out, line
        out[flag] = " ".join(value) if value else None
    return out


def parallelize_of(text: str):
    """The ``parallelize`` function an fsdp2 or ddp export defines."""
    scope: dict = {}
    exec(compile(text, "exported", "exec"), scope)
    return scope["parallelize"]


# -- the exported PyTorch code allocates what the plan predicts ------------------------------------------
@pytest.fixture(scope="module")
def traced():
    """The conformance tests' tiny HF models, traced once: one sequence of 32 tokens per rank."""
    pytest.importorskip("transformers")
    from tests.baselines.test_conformance import FAMILIES, SEQ, traced_graph

    return {f: traced_graph(f, batch=WORLD, seq=SEQ, precision="fp32", **FAMILIES[f]) for f in FAMILIES}


def measured(strategy: str, parallelize, family: str, rank: int, autocast: bool = False) -> int:
    """The measured peak of rank ``rank`` with the exported function applied, as
    ``test_conformance`` measures the baseline (DDP's buckets and comm hook included)."""
    from tests.baselines.test_conformance import ddp_peak, fully_sharded_peak

    return {"fsdp2": fully_sharded_peak, "ddp": ddp_peak}[strategy.split("+")[0].split("-")[0]](
        family, WORLD, rank, parallelize, autocast=autocast)


MEASURED = ("ddp", "fsdp2", "ddp+full", "fsdp2+full", "ddp-bucket-view", "fsdp2-noreshard", "fsdp2+selective-op",
            "ddp+selective-op")
OPTIONS = {"ddp-bucket-view": "gradient_as_bucket_view=True", "fsdp2-noreshard": "reshard_after_forward=False"}
CONTAINERS = {"llama": "model.layers", "gpt2": "transformer.h"}


@pytest.mark.parametrize("strategy", sorted(MEASURED))
@pytest.mark.parametrize("family", sorted(CONTAINERS))
def test_the_exported_code_allocates_what_the_plan_predicts(strategy, family, traced):
    """(``+full``: every block wrapped in ``checkpoint_wrapper``, as the conformance test's
    ``torch.utils.checkpoint`` run; ``+selective-op`` with torchtitan's per-op policy.)"""
    from tests.baselines.test_conformance import recompute_of

    graph = traced[family]
    text = memshard.export(graph, str(WORLD), strategy=strategy)
    recompute = recompute_of(strategy)
    predicted = memshard.strategy_plan(graph, str(WORLD), strategy, recompute=recompute).peak_bytes
    assert f"# Predicted peak per device: {format_bytes(predicted)} ({round(predicted):,} bytes)" in text
    assert (text.count("checkpoint_wrapper(") == 1) == (recompute != "none")
    assert ("create_selective_checkpoint_contexts(op_level_policy())" in text) == (recompute == "auto")
    code = "\n".join(line for line in text.splitlines() if not line.startswith("#"))
    assert not re.search(r"\.\d+\b", code)  # no block named one by one
    if strategy.startswith("fsdp2"):  # the blocks come from the graph: a loop over their container
        assert text.count("fully_shard(") == 2
        assert f'model.get_submodule("{CONTAINERS[family]}")' in text
    for name, option in OPTIONS.items():  # given to every fully_shard, or to DDP, by its variant only
        assert code.count(f", {option})") == (name == strategy) * (2 if strategy.startswith("fsdp2") else 1)
    for rank in (0, WORLD - 1):
        peak = measured(strategy, parallelize_of(text), family, rank)
        print(f"{strategy} {family} rank {rank}: measured {peak:,} B, predicted {round(predicted):,} B, "
              f"{peak / predicted - 1:+.2%}")
        assert peak == pytest.approx(predicted, rel=0.02), rank


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2+full"])
def test_an_autocast_export_says_how_to_train_and_allocates_what_is_predicted(strategy):
    """Under ``--precision autocast`` the code is the fp32 one; its header says to train under
    ``torch.autocast``, as the step measured here does (CPU's, whose lists the trace takes)."""
    from tests.baselines.test_conformance import FAMILIES, SEQ, recompute_of, traced_graph

    graph = traced_graph("llama", batch=WORLD, seq=SEQ, precision="autocast", device="cpu", **FAMILIES["llama"])
    text = memshard.export(graph, str(WORLD), strategy=strategy)
    assert 'torch.autocast("cuda", dtype=torch.bfloat16)' in text and "mp_policy" not in text
    predicted = memshard.strategy_plan(graph, str(WORLD), strategy, recompute=recompute_of(strategy)).peak_bytes
    for rank in (0, WORLD - 1):
        assert measured(strategy, parallelize_of(text), "llama", rank, autocast=True) == pytest.approx(
            predicted, rel=0.02), rank


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_an_explicitly_prefetching_fsdp2_export_allocates_what_is_predicted(family):
    """``fsdp2-prefetch2`` on four blocks: each block's ``set_modules_to_forward_prefetch``
    and ``set_modules_to_backward_prefetch`` written from its container, as priced."""
    from tests.baselines.test_conformance import SEQ, config, fully_sharded_peak, traced_graph

    graph = traced_graph(family, batch=WORLD, seq=SEQ, precision="fp32", **config(family, 4))
    text = memshard.export(graph, str(WORLD), strategy="fsdp2-prefetch2")
    assert "block.set_modules_to_forward_prefetch(blocks[k + 1:k + 3])" in text
    assert "block.set_modules_to_backward_prefetch([blocks[k - j] for j in range(1, 3)])" in text
    predicted = memshard.strategy_plan(graph, str(WORLD), "fsdp2-prefetch2").peak_bytes
    for rank in (0, WORLD - 1):
        peak = fully_sharded_peak(family, WORLD, rank, parallelize_of(text), layers=4)
        assert peak == pytest.approx(predicted, rel=0.02), rank


@pytest.mark.parametrize("family, precision", [("llama", "fp32"), ("qwen2", "mixed")])
def test_a_torchtitan_wrapped_fsdp2_export_allocates_what_is_predicted(family, precision):
    """``fsdp2-torchtitan``: the embedding and the output layers sharded first, by the modules
    that hold those weights, read off the traced graph."""
    from tests.baselines.test_conformance import SEQ, config, fully_sharded_peak, traced_graph

    graph = traced_graph(family, batch=WORLD, seq=SEQ, precision=precision, **config(family, 3))
    text = memshard.export(graph, str(WORLD), strategy="fsdp2-torchtitan")
    assert 'fully_shard(model.get_submodule("model.embed_tokens"), mesh=mesh' in text
    assert ('fully_shard([model.get_submodule("model.norm"), model.get_submodule("lm_head")], mesh=mesh'
            in text and text.count("reshard_after_forward=False)") == 1)
    predicted = memshard.strategy_plan(graph, str(WORLD), "fsdp2-torchtitan").peak_bytes
    for rank in (0, WORLD - 1):
        peak = fully_sharded_peak(family, WORLD, rank, parallelize_of(text), layers=3)
        assert peak == pytest.approx(predicted, rel=0.02), rank


def test_an_fsdp2_export_resharded_within_a_node_allocates_what_is_predicted():
    """``fsdp2-reshard2`` on a 2x2 mesh: ``reshard_after_forward=2`` to every ``fully_shard``."""
    from tests.baselines.test_conformance import SEQ, config, fully_sharded_peak, traced_graph

    graph = traced_graph("llama", batch=WORLD, seq=SEQ, precision="fp32", **config("llama", 3))
    text = memshard.export(graph, "2x2", strategy="fsdp2-reshard2")
    assert text.count(", reshard_after_forward=2)") == 2
    predicted = memshard.strategy_plan(graph, "2x2", "fsdp2-reshard2").peak_bytes
    for rank in (0, WORLD - 1):
        assert fully_sharded_peak("llama", WORLD, rank, parallelize_of(text), layers=3) == pytest.approx(predicted,
                                                                                                         rel=0.02)


@pytest.mark.parametrize("strategy, family", [("fsdp2", "gpt2"), ("fsdp2+full", "llama"), ("torch-tp2-fsdp2", "llama")])
def test_a_mixed_precision_export_runs_fsdp2_mixed_precision_and_allocates_what_is_predicted(strategy, family):
    """A mixed-precision job's FSDP2 export gives every ``fully_shard`` the policy its
    baseline prices (bf16 compute, fp32 shards and gradient reduction)."""
    from tests.baselines.test_conformance import FAMILIES, SEQ, tp_fsdp2_peak, traced_graph

    tensor_parallel = strategy.startswith("torch-tp")
    mesh, batch = ("2x2", 2) if tensor_parallel else (str(WORLD), WORLD)  # a sequence per replica
    graph = traced_graph(family, batch=batch, seq=SEQ, precision="mixed", **FAMILIES[family])
    text = memshard.export(graph, mesh, strategy=strategy)
    assert text.count("mp_policy=mp_policy)") == 2
    assert "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)" in text
    recompute = "full" if strategy.endswith("+full") else "none"
    predicted = memshard.strategy_plan(graph, mesh, strategy, recompute=recompute).peak_bytes
    for rank in (0, WORLD - 1):
        exported = parallelize_of(text)
        peak = (tp_fsdp2_peak(2, 2, rank, SEQ, family, exported) if tensor_parallel
                else measured(strategy, exported, family, rank))
        assert peak == pytest.approx(predicted, rel=0.02), rank


@pytest.mark.parametrize("family, recompute", [("llama", "none"), ("qwen2", "none"), ("llama", "full")])
def test_the_exported_tensor_parallel_code_is_torchtitans_plan_and_allocates_what_is_predicted(family, recompute):
    """(``+full``: the blocks wrapped in ``checkpoint_wrapper`` between tensor parallelism and
    ``fully_shard``, as the conformance test applies it.)"""
    from torch.distributed.device_mesh import init_device_mesh

    from tests.baselines.test_conformance import (
        FAMILIES,
        SEQ,
        WORLDS,
        checkpointed_tensor_parallel_fsdp2,
        fake_rank,
        tensor_parallel_fsdp2,
        tp_fsdp2_peak,
        traced_graph,
    )

    graph = traced_graph(family, batch=2, seq=SEQ, precision="fp32", **FAMILIES[family])  # a sequence per replica
    strategy = "torch-tp2-fsdp2" + ("+full" if recompute == "full" else "")
    text = memshard.export(graph, "2x2", strategy=strategy)
    predicted = memshard.strategy_plan(graph, "2x2", strategy, recompute=recompute).peak_bytes
    exported = parallelize_of(text)
    reference = checkpointed_tensor_parallel_fsdp2 if recompute == "full" else tensor_parallel_fsdp2
    placements = []
    for parallelize in (exported, reference):  # every weight laid out (and wrapped) as torchtitan's plan
        with fake_rank(family, WORLD, 0) as model:
            n = next(WORLDS)
            model = parallelize(model, init_device_mesh("cpu", (2, 2), mesh_dim_names=(f"dp{n}", f"tp{n}")))
            placements.append({name: tuple(map(repr, p.placements)) for name, p in model.named_parameters()})
    assert placements[0] == placements[1]
    assert any(p[1].startswith("Shard") for p in placements[0].values())  # split on the TP axis too
    for rank in (0, WORLD - 1):
        peak = tp_fsdp2_peak(2, 2, rank, SEQ, family, exported)
        assert peak == pytest.approx(predicted, rel=0.02), rank


def test_the_exported_tensor_parallel_code_with_torchtitans_units_allocates_what_is_predicted():
    """``torch-tp2-fsdp2-torchtitan``: the embedding and the output layers sharded over the
    data-parallel axis first, then the blocks and the root."""
    from tests.baselines.test_conformance import FAMILIES, SEQ, tp_fsdp2_peak, traced_graph

    graph = traced_graph("llama", batch=2, seq=SEQ, precision="fp32", **FAMILIES["llama"])
    text = memshard.export(graph, "2x2", strategy="torch-tp2-fsdp2-torchtitan")
    assert 'fully_shard(model.get_submodule("model.embed_tokens"), mesh=dp_mesh)' in text
    assert text.count(", reshard_after_forward=False)") == 1
    predicted = memshard.strategy_plan(graph, "2x2", "torch-tp2-fsdp2-torchtitan").peak_bytes
    for rank in (0, WORLD - 1):
        assert tp_fsdp2_peak(2, 2, rank, SEQ, "llama", parallelize_of(text)) == pytest.approx(predicted, rel=0.02)


def test_the_exported_tensor_parallel_code_kept_after_forward_allocates_what_is_predicted():
    """``torch-tp2-fsdp2-noreshard``: every ``fully_shard`` given ``reshard_after_forward=False``."""
    from tests.baselines.test_conformance import FAMILIES, SEQ, tp_fsdp2_peak, traced_graph

    graph = traced_graph("llama", batch=2, seq=SEQ, precision="fp32", **FAMILIES["llama"])
    text = memshard.export(graph, "2x2", strategy="torch-tp2-fsdp2-noreshard")
    assert text.count(", reshard_after_forward=False)") == 2
    predicted = memshard.strategy_plan(graph, "2x2", "torch-tp2-fsdp2-noreshard").peak_bytes
    assert tp_fsdp2_peak(2, 2, 0, SEQ, "llama", parallelize_of(text)) == pytest.approx(predicted, rel=0.02)


def test_the_exported_code_refuses_a_model_or_mesh_it_was_not_planned_for(traced):
    """The function checks what the prediction depends on: the block count and the mesh."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from tests.baselines.test_conformance import fake_rank

    fsdp2 = parallelize_of(memshard.export(traced["llama"], str(WORLD), strategy="fsdp2"))
    with fake_rank("llama", WORLD, 0) as model:
        with pytest.raises(ValueError, match="one mesh axis of 4 devices"):
            fsdp2(model, init_device_mesh("cpu", (2, 2)))
        del model.model.layers[1]
        with pytest.raises(ValueError, match="2 blocks in model.layers, the model has 1"):
            fsdp2(model, init_device_mesh("cpu", (WORLD,)))
        assert not any(type(p).__name__ == "DTensor" for p in model.parameters())
        assert isinstance(model, torch.nn.Module)


def test_a_hugging_face_config_exports_in_fp32_with_its_command(tmp_path, capsys):
    """From a config file: fp32 by default (what PyTorch's defaults run), and the header's
    command writes the very same text."""
    config = ROOT / "examples" / "tiny_llama.json"
    text = memshard.export(memshard.HFModel(str(config)), "4", strategy="fsdp2", batch=4, seq=32)
    plan = memshard.strategy_plan(memshard.HFModel(str(config)), "4", "fsdp2", batch=4, seq=32, precision="fp32")
    assert f"({round(plan.peak_bytes):,} bytes)" in text
    command = re.search(r"^# Made by: (.*)$", text, re.M).group(1)
    assert command == (f"memshard export --hf-config {config} --mesh 4 --batch 4 --seq 32 --precision fp32 "
                       "--strategy fsdp2")
    assert main(command.split()[1:]) == 0
    assert capsys.readouterr().out == text
    with pytest.raises(MemshardError, match="--precision fp32"):
        memshard.export(memshard.HFModel(str(config)), "4", strategy="ddp", precision="mixed")


# -- Megatron-LM ---------------------------------------------------------------------------------------
def test_megatron_arguments_say_the_preset_and_the_layout():
    name = "megatron-tp4-dp2-sp-distopt"
    text = memshard.export("gpt3-6.7b", "2x4", strategy=name, batch=16, seq=2048)
    cfg = get_config("gpt3-6.7b")
    assert megatron_arguments(text) == {
        "--tensor-model-parallel-size": "4", "--pipeline-model-parallel-size": "1", "--sequence-parallel": None,
        "--use-distributed-optimizer": None, "--num-layers": str(cfg.num_layers), "--hidden-size": str(cfg.hidden),
        "--num-attention-heads": str(cfg.heads), "--ffn-hidden-size": str(cfg.ffn), "--seq-length": "2048",
        "--max-position-embeddings": str(cfg.max_positions), "--micro-batch-size": "8",  # 16 over 2 replicas
        "--global-batch-size": "16", "--bf16": None,  # a preset's own precision: mixed
    }
    assert (cfg.num_layers, cfg.hidden, cfg.heads, cfg.ffn) == (32, 4096, 32, 16384)
    assert text.rstrip().endswith('torchrun --nnodes 2 --nproc-per-node 4 pretrain_gpt.py "${MEGATRON_ARGS[@]}"')
    predicted = memshard.strategy_plan("gpt3-6.7b", "2x4", name, batch=16, seq=2048).peak_bytes
    assert f"({round(predicted):,} bytes)" in text


def test_megatron_arguments_for_llama_with_recomputation_and_micro_batches():
    """LLaMA's architecture flags (grouped-query attention), the name's recomputation, the
    micro-batches; without -sp and -distopt neither switch; fp32 without --bf16."""
    args = megatron_arguments(memshard.export("llama3-8b", "1x8", strategy="megatron-tp2-dp4+selective", batch=32,
                                              seq=1024, micro_batches=2))
    assert args["--tensor-model-parallel-size"] == "2" and args["--micro-batch-size"] == "4"  # 32 / (4 × 2)
    assert args["--num-query-groups"] == "8" and args["--ffn-hidden-size"] == "14336"
    for switch in ("--group-query-attention", "--swiglu", "--disable-bias-linear",
                   "--untie-embeddings-and-output-weights"):
        assert switch in args and args[switch] is None, switch
    assert args["--normalization"] == "RMSNorm" and args["--position-embedding-type"] == "rope"
    assert args["--recompute-granularity"] == "selective" and "--recompute-method" not in args
    assert "--sequence-parallel" not in args and "--use-distributed-optimizer" not in args

    full = megatron_arguments(memshard.export("tiny-gpt", "4", strategy="megatron-tp4-sp+full"))
    assert (full["--recompute-granularity"], full["--recompute-method"], full["--recompute-num-layers"]) == (
        "full", "uniform", "1")
    assert "--bf16" not in full and "--swiglu" not in full and "--sequence-parallel" in full
    assert full["--micro-batch-size"] == "4" and full["--global-batch-size"] == "4"  # one replica


def test_megatron_mlp_recomputation_is_its_mlp_module():
    text = memshard.export("tiny-llama", "2", strategy="megatron-tp2-sp+selective-mlp")
    args = megatron_arguments(text)
    assert (args["--recompute-granularity"], args["--recompute-modules"]) == ("selective", "mlp")
    assert "--recompute-method" not in args
    predicted = memshard.strategy_plan("tiny-llama", "2", "megatron-tp2-sp+selective-mlp", recompute="auto")
    assert f"({round(predicted.peak_bytes):,} bytes)" in text
    assert {op.name for op in predicted.ops if op.recomputed} == {  # (gate and up: fc1, one GEMM and its gather)
        "post_attention_layernorm", "mlp.gate/gather", "mlp.gate", "mlp.up", "mlp.act", "mlp.mul", "mlp.down"}
    both = megatron_arguments(memshard.export("tiny-gpt", "2", strategy="megatron-tp2-sp+selective-attn-mlp"))
    assert (both["--recompute-granularity"], both["--recompute-modules"]) == ("selective", "core_attn mlp")


def test_megatron_block_recomputation_is_its_block_method():
    block = megatron_arguments(memshard.export("tiny-gpt", "4", strategy="megatron-tp4-sp+full-block3", num_layers=6))
    assert (block["--recompute-granularity"], block["--recompute-method"], block["--recompute-num-layers"]) == (
        "full", "block", "3")
    for wrong in ("megatron-tp4-sp+full-every2", "fsdp2+full-block2"):
        with pytest.raises(MemshardError, match="by block"):
            memshard.export("tiny-gpt", "4", strategy=wrong, num_layers=6)


def test_checkpointing_every_nth_block_is_exported_and_allocates_what_is_predicted():
    """``fsdp2+full-every2``: the exported loop wraps the blocks of even index only, and the
    function run under the fake process group allocates the prediction (LLaMA, 4 blocks)."""
    from tests.baselines.test_conformance import SEQ, config, fully_sharded_peak, traced_graph

    graph = traced_graph("llama", batch=WORLD, seq=SEQ, precision="fp32", **config("llama", 4))
    text = memshard.export(graph, str(WORLD), strategy="fsdp2+full-every2")
    assert "if k % 2 == 0:" in text and text.count("checkpoint_wrapper(") == 1
    predicted = memshard.strategy_plan(graph, str(WORLD), "fsdp2+full-every2", recompute="auto").peak_bytes
    peak = fully_sharded_peak("llama", WORLD, 0, parallelize_of(text), layers=4)
    assert peak == pytest.approx(predicted, rel=0.02)


def test_a_pipelined_megatron_configuration_exports_its_stages(capsys):
    """``-pp2``: Megatron-LM's pipeline size, the micro-batch size over data parallelism and the
    micro-batches, the largest stage's predicted peak in the header, whose command writes the
    same text; layers Megatron-LM cannot split evenly refused in one line."""
    name = "megatron-tp4-pp2-dp4-sp-distopt"
    job = dict(batch=32, seq=2048, micro_batches=8)
    text = memshard.export("gpt3-6.7b", "4x8", strategy=name, **job)
    args = megatron_arguments(text)
    assert (args["--tensor-model-parallel-size"], args["--pipeline-model-parallel-size"]) == ("4", "2")
    assert args["--micro-batch-size"] == "1" and args["--global-batch-size"] == "32"  # 32 / (4 replicas × 8)
    assert "--sequence-parallel" in args and "--use-distributed-optimizer" in args and "--bf16" in args
    plan = memshard.strategy_plan("gpt3-6.7b", "4x8", name, **job)
    assert len(plan.stages) == 2 and plan.peak_bytes == max(s.plan.peak_bytes for s in plan.stages)
    assert f"({round(plan.peak_bytes):,} bytes), stage 0 of 2 (layers 0-15)" in text
    assert "2 pipeline stages of 16 layers under 1F1B" in text
    assert text.rstrip().endswith('torchrun --nnodes 4 --nproc-per-node 8 pretrain_gpt.py "${MEGATRON_ARGS[@]}"')
    command = re.search(r"^# Made by: (.*)$", text, re.M).group(1)
    assert main(command.split()[1:]) == 0 and capsys.readouterr().out == text
    with pytest.raises(MemshardError, match="splits the 31 layers evenly over 2 pipeline stages"):
        memshard.export("gpt3-6.7b", "4x8", strategy="megatron-tp4-pp2-dp4", num_layers=31, **job)


def test_megatron_needs_a_batch_its_replicas_split_evenly():
    with pytest.raises(MemshardError, match=r"global batch \(6\) to be a multiple of .* \(4\)"):
        memshard.export("tiny-gpt", "1x8", strategy="megatron-tp2-dp4", batch=6)


# -- what cannot be exported ----------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["memshard", "dp", "zero1", "zero2", "zero3-fsdp", "tp2-fsdp2",
                                      "fsdp2+selective", "ddp+selective"])
def test_what_pytorch_cannot_run_as_priced_points_to_parallelize(strategy):
    with pytest.raises(MemshardError) as raised:
        memshard.export("tiny-gpt", "2x2", strategy=strategy)
    message = str(raised.value)
    assert message.startswith(f"{strategy} cannot be exported: ") and "memshard.parallelize(model, plan)" in message
    assert "\n" not in message


def test_tensor_parallelism_is_exported_for_a_traced_model_only():
    # its plan names the model's own modules; a built-in preset's are memshard's
    with pytest.raises(MemshardError, match=r"torch-tp2-fsdp2: .*traced model \(--hf-config or --hf-model\)"):
        memshard.export("tiny-llama", "2x2", strategy="torch-tp2-fsdp2")
    with pytest.raises(MemshardError, match="torch-tp2-fsdp2\\+selective cannot be exported"):
        memshard.export("tiny-llama", "2x2", strategy="torch-tp2-fsdp2+selective")


def test_tensor_parallelism_needs_linear_projections(traced):
    # GPT-2's projections are Conv1D modules, which torch's tensor-parallel styles cannot take
    with pytest.raises(MemshardError, match=r"torch-tp2-fsdp2 cannot be exported: .*transformer\.h\.0\.attn\.c_attn"):
        memshard.export(traced["gpt2"], "2x2", strategy="torch-tp2-fsdp2")


def test_the_default_is_memshards_own_plan_which_is_refused(capsys):
    assert main(["export", "--model", "tiny-gpt", "--mesh", "4"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith("memshard: error: memshard cannot be exported: memshard's plan picks each operator's")
    assert "memshard.parallelize(model, plan)" in err


# -- the text: deterministic, the same from the command line and the API --------------------------------
def test_the_same_job_gives_the_same_text_from_the_api_and_the_command_line(capsys):
    argv = ["export", "--model", "tiny-llama", "--mesh", "2x2", "--strategy", "fsdp2"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    text = memshard.export("tiny-llama", "2x2", strategy="fsdp2")
    assert printed == text == memshard.export(memshard.Job("tiny-llama", "2x2"), strategy="fsdp2")
    assert main(argv) == 0 and capsys.readouterr().out == printed
    assert "# Made by: memshard export --model tiny-llama --mesh 2x2 --batch 4 --seq 32 --precision fp32 " \
           "--strategy fsdp2\n" in text
    compile(text, "exported", "exec")  # a Python module


def test_the_header_names_the_job_and_the_peak():
    plan = memshard.strategy_plan("tiny-gpt", "4", "ddp", batch=8, num_layers=3)
    text = memshard.export("tiny-gpt", "4", strategy="ddp", batch=8, num_layers=3)
    assert text.splitlines()[:4] == [
        "# memshard export: ddp",
        "# Job: tiny-gpt (overridden: 3 layers, hidden 128, 4 heads, ffn 512, vocab 512; 677K parameters, fp32), "
        "global batch 8 × 32 tokens, on mesh 4 (4 devices)",
        f"# Predicted peak per device: {format_bytes(plan.peak_bytes)} ({round(plan.peak_bytes):,} bytes), "
        f"at {plan.memory.peak_at}",
        "# Made by: memshard export --model tiny-gpt --mesh 4 --batch 8 --seq 32 --layers 3 --precision fp32 "
        "--strategy ddp",
    ]
    assert "torch.optim.Adam(model.parameters(), foreach=True)" in text
    assert "return DistributedDataParallel(model, device_mesh=mesh)" in text


# -- --out ---------------------------------------------------------------------------------------------
FSDP2 = ["export", "--model", "tiny-gpt", "--mesh", "4", "--strategy", "fsdp2"]


def test_out_writes_the_file_and_replaces_one_only_with_force(tmp_path, capsys):
    out = tmp_path / "parallelize.py"
    assert main([*FSDP2, "--out", str(out)]) == 0
    assert capsys.readouterr().out == f"fsdp2 written to {out}\n"
    assert out.read_text() == memshard.export("tiny-gpt", "4", strategy="fsdp2")

    out.write_text("mine\n")
    assert main([*FSDP2, "--out", str(out)]) == 2
    assert f"--out {out} exists: give --force to replace it" in capsys.readouterr().err
    assert out.read_text() == "mine\n"

    assert main([*FSDP2, "--force"]) == 2  # --force without --out: nothing to replace
    assert capsys.readouterr() == ("", "memshard: error: --force replaces an --out file: give --out\n")

    assert main([*FSDP2, "--strategy", "ddp", "--out", str(out), "--force"]) == 0
    assert out.read_text() == memshard.export("tiny-gpt", "4", strategy="ddp")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["parallelize.py"]


def test_out_is_never_half_written(tmp_path, monkeypatch, capsys):
    """The text goes to a temporary file renamed over the target: a failure before the rename
    leaves the old file whole and no temporary file behind."""
    import memshard.core.files

    out = tmp_path / "parallelize.py"
    out.write_text("mine\n")

    def fail(src, dst):
        assert Path(src).read_text() == memshard.export("tiny-gpt", "4", strategy="fsdp2")  # written in full
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(memshard.core.files.os, "replace", fail)
    assert main([*FSDP2, "--out", str(out), "--force"]) == 2
    err = capsys.readouterr().err
    assert err == f"memshard: error: cannot write {out}: No space left on device\n"
    assert out.read_text() == "mine\n"
    assert os.listdir(tmp_path) == ["parallelize.py"]


# -- the README and docs/ -------------------------------------------------------------------------------
DOCS_TEXT = "".join(page.read_text() for page in pages())  # README.md first, then docs/runtime.md
EXAMPLES = re.findall(r"```console\n\$ (memshard export [^\n]*)\n(.*?)```", DOCS_TEXT, re.S)


def test_the_export_examples_print_what_the_docs_show(monkeypatch, capsys):
    """The README's fsdp2 example and docs/runtime.md's Megatron-LM one, run and compared."""
    assert [c.split("--strategy ")[1].split()[0] for c, _ in EXAMPLES] == ["fsdp2", "megatron-tp4-dp2-sp-distopt"]
    monkeypatch.chdir(ROOT)  # the example's config path is relative to the clone
    for command, shown in EXAMPLES:
        assert main(command.split()[1:]) == 0
        assert capsys.readouterr().out == shown, command
