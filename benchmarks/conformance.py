"""memshard's FSDP2, DDP and TP × FSDP2 baselines against PyTorch's own (issue #20).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/conformance.py [--write]

Hugging Face LLaMA and GPT-2 (tiny configs, fp32, dropout off; attention on the kernel CUDA
takes: ``trace.kernels.cuda_attention``), ``fully_shard`` on every block
and on the root module, or ``DistributedDataParallel`` (defaults), ``torch.optim.Adam``
(foreach), with and without torchtitan's full activation checkpointing (``checkpoint_wrapper``,
``torch.utils.checkpoint``, around every block: ``fsdp2+full``, ``ddp+full``; with its per-op
selective policy: ``fsdp2+selective-op``, ``ddp+selective-op``, which have no idealised
counterpart), one sequence
of 32 tokens (and 256 for LLaMA) per rank, one rank of a 4- or 8-rank world under the fake
process group (and with the options ``fsdp2-noreshard`` and ``ddp-bucket-view`` name:
``reshard_after_forward=False``, ``gradient_as_bucket_view=True``); a step's peak as
``MemoryMeter`` (MemTracker) measures it
(``tests/test_conformance.py``) against the ``fsdp2`` and ``ddp`` baselines' predicted peaks,
and against the idealised plans memshard's runtime executes (``zero3-fsdp`` with
``--zero3-unit layer``, ``dp``, and their ``+full``).
The second table runs PyTorch's tensor parallelism as torchtitan applies it to LLaMA and Qwen2
(``parallelize_module``: vocabulary-parallel embedding, ``SequenceParallel`` norms,
``PrepareModuleInput`` gathering each block's attention and MLP input once,
``ColwiseParallel``/``RowwiseParallel`` projections, a vocabulary-parallel ``lm_head`` under
``loss_parallel``) × ``fully_shard`` over the data-parallel axis, against the
``torch-tp<T>-fsdp<D>`` baseline and the idealised ``tp<T>-fsdp<D>`` (TP + SP + ZeRO-3 as
memshard's runtime executes them), at 32 and 256 tokens per sequence, with and without
torchtitan's full activation checkpointing (``+full``), and with ``reshard_after_forward=False``
on every ``fully_shard`` (``-noreshard``), and with torchtitan's FSDP2 units (``-torchtitan``:
the embedding and the output layers apart from the root). The third table runs both in mixed
precision as torchtitan sets it (every ``fully_shard`` with ``MixedPrecisionPolicy(param_dtype=
bf16, reduce_dtype=fp32)``) against the baselines of the mixed-precision job, and memshard's
mixed-precision ZeRO-3 (bf16 shards beside fp32 masters). The fourth table runs FSDP2 with
explicit prefetching as PyTorch's FSDP2 example sets it (each block's
``set_modules_to_forward_prefetch`` of the next two blocks, ``set_modules_to_backward_prefetch``
of the two before it) on four-block models against ``fsdp2-prefetch2`` and against ``fsdp2``
(FSDP2's default prefetching). The fifth wraps untied decoders (LLaMA, Qwen2) as torchtitan's
``apply_fsdp`` does (the token embedding, the final norm with the output layer not resharded
after forward, every block, the root) against ``fsdp2-torchtitan`` and against ``fsdp2``
(the embedding and output layers in the root unit). ``--write`` puts the tables into
BENCHMARKS.md between its markers.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.baselines.test_conformance import (  # noqa: E402
    FAMILIES,
    MEASURED,
    SEQ,
    checkpointed,
    checkpointed_tensor_parallel_fsdp2,
    config,
    explicitly_prefetched,
    fully_shard_blocks,
    fully_sharded_peak,
    kept_after_forward,
    mixed_precision,
    recompute_of,
    tensor_parallel_fsdp2,
    tensor_parallel_torchtitan_wrapped,
    torchtitan_wrapped,
    tp_fsdp2_peak,
)
from torch.distributed.fsdp import fully_shard  # noqa: E402

import memshard  # noqa: E402
from benchmarks_md import provenance, write_section  # noqa: E402
from memshard.trace.hf import trace_hf  # noqa: E402

IDEALISED = {"fsdp2": ("zero3-fsdp", {"zero3_unit": "layer"}), "ddp": ("dp", {}),
             "fsdp2+full": ("zero3-fsdp+full", {"zero3_unit": "layer"}), "ddp+full": ("dp+full", {}),
             "fsdp2-noreshard": ("zero3-fsdp", {"zero3_unit": "layer"}), "ddp-bucket-view": ("dp", {}),
             "fsdp2-noreshard+full": ("zero3-fsdp+full", {"zero3_unit": "layer"})}


def rows() -> list[str]:
    out = ["| baseline | model | ranks | tokens per sequence | rank | measured (PyTorch) | predicted | error "
           "| idealised | its prediction | error |", "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for baseline, measure in sorted(MEASURED.items(), reverse=True):
        ideal_name, ideal_options = IDEALISED.get(baseline, (None, {}))
        for family, world, seq in itertools.product(sorted(FAMILIES), (4, 8), (SEQ, 256)):
            if seq > SEQ and family == "gpt2":  # its config has 64 positions
                continue
            graph = trace_hf(family, batch=world, seq=seq, precision="fp32", **FAMILIES[family])
            recompute = recompute_of(baseline)
            predicted = memshard.strategy_plan(graph, str(world), baseline, recompute=recompute).peak_bytes
            ideal = ideal_name and memshard.strategy_plan(graph, str(world), ideal_name, recompute=recompute,
                                                          **ideal_options).peak_bytes
            for rank in (0, world - 1):
                measured = measure(family, world, rank, seq=seq)
                idealised = f"{ideal_name} | {ideal:,.0f} | {ideal / measured - 1:+.2%}" if ideal else "- | - | -"
                out.append(f"| {baseline} | {family} | {world} | {seq} | {rank} | {measured:,} | {predicted:,.0f} | "
                           f"{predicted / measured - 1:+.2%} | {idealised} |")
    return out


def tensor_parallel_rows() -> list[str]:
    out = ["| baseline | model | mesh (DP × TP) | tokens per sequence | rank | measured (PyTorch) | predicted | error "
           "| idealised | its prediction | error |", "|---|---|---|---:|---:|---:|---:|---:|---|---:|---:|"]
    jobs = [(option, recompute) for option in ("", "-noreshard") for recompute in ("none", "full")]
    for (option, recompute), family, (dp, tp), seq in itertools.product(
            [*jobs, ("-torchtitan", "none")], ("llama", "qwen2"), ((2, 2), (4, 2)), (32, 256)):
        graph = trace_hf(family, batch=dp, seq=seq, precision="fp32", **FAMILIES[family])
        suffix = "+full" if recompute == "full" else ""
        name, ideal_name = f"torch-tp{tp}-fsdp{dp}{option}{suffix}", f"tp{tp}-fsdp{dp}{suffix}"
        predicted = memshard.strategy_plan(graph, f"{dp}x{tp}", name, recompute=recompute).peak_bytes
        ideal = memshard.strategy_plan(graph, f"{dp}x{tp}", ideal_name, recompute=recompute,  # (per-layer
                                       zero3_unit="layer" if suffix else "op").peak_bytes  # ZeRO-3 to replay)
        shard = functools.partial(fully_shard, reshard_after_forward=False) if option == "-noreshard" else None
        parallelize = (tensor_parallel_torchtitan_wrapped if option == "-torchtitan" else
                       functools.partial(checkpointed_tensor_parallel_fsdp2 if suffix else tensor_parallel_fsdp2,
                                         shard=shard))
        for rank in (0, dp * tp - 1):
            measured = tp_fsdp2_peak(dp, tp, rank, seq, family, parallelize=parallelize)
            out.append(f"| {name} | {family} | {dp} × {tp} | {seq} | {rank} | {measured:,} | {predicted:,.0f} | "
                       f"{predicted / measured - 1:+.2%} | {ideal_name} | {ideal:,.0f} | {ideal / measured - 1:+.2%} |")
    return out


def mixed_precision_rows() -> list[str]:
    out = ["| baseline | model | mesh | tokens per sequence | rank | measured (PyTorch) | predicted | error "
           "| idealised | its prediction | error |", "|---|---|---|---:|---:|---:|---:|---:|---|---:|---:|"]
    jobs = [("fsdp2", f, (w,), SEQ) for f in ("gpt2", "llama") for w in (4, 8)]
    jobs += [("fsdp2", "llama", (4,), 256), ("fsdp2+full", "llama", (4,), 256), ("fsdp2+full", "gpt2", (8,), SEQ),
             ("fsdp2-noreshard", "gpt2", (4,), SEQ), ("fsdp2-noreshard", "llama", (8,), 256),
             ("torch-tp", "llama", (2, 2), 256), ("torch-tp", "qwen2", (4, 2), SEQ)]
    for baseline, family, shape, seq in jobs:
        devices, batch = shape[0] * (shape[1] if len(shape) > 1 else 1), shape[0]
        mesh = "x".join(map(str, shape))
        graph = trace_hf(family, batch=batch, seq=seq, precision="mixed", **FAMILIES[family])
        recompute = recompute_of(baseline)
        if baseline == "torch-tp":
            name, ideal_name, options = f"torch-tp{shape[1]}-fsdp{shape[0]}", f"tp{shape[1]}-fsdp{shape[0]}", {}
            measure = functools.partial(tp_fsdp2_peak, shape[0], shape[1], seq=seq, family=family,
                                        parallelize=functools.partial(mixed_precision, parallelize=tensor_parallel_fsdp2))
        else:
            name, (ideal_name, options) = baseline, IDEALISED[baseline]
            parallelize = functools.partial(mixed_precision, parallelize=kept_after_forward if "noreshard" in baseline
                                            else fully_shard_blocks)
            parallelize = checkpointed(parallelize) if recompute == "full" else parallelize
            measure = functools.partial(fully_sharded_peak, family, devices, parallelize=parallelize, seq=seq)
        predicted = memshard.strategy_plan(graph, mesh, name, recompute=recompute).peak_bytes
        ideal = memshard.strategy_plan(graph, mesh, ideal_name, recompute=recompute, **options).peak_bytes
        for rank in (0, devices - 1):
            measured = measure(rank=rank)
            out.append(f"| {name} | {family} | {mesh} | {seq} | {rank} | {measured:,} | {predicted:,.0f} | "
                       f"{predicted / measured - 1:+.2%} | {ideal_name} | {ideal:,.0f} | {ideal / measured - 1:+.2%} |")
    return out


def prefetch_rows() -> list[str]:
    return _wrapped_rows("fsdp2-prefetch2", explicitly_prefetched, ("gpt2", "llama", "qwen2"),
                         [("gpt2", "mixed", "full", 4, SEQ)])


def torchtitan_rows() -> list[str]:
    return _wrapped_rows("fsdp2-torchtitan", torchtitan_wrapped, ("llama", "qwen2"), [])


def _wrapped_rows(baseline: str, wrap, families: tuple[str, ...], more: list[tuple]) -> list[str]:
    """``baseline`` against ``fully_sharded_peak`` under ``wrap``, and the ``fsdp2`` baseline."""
    out = ["| model (4 blocks) | precision | recompute | ranks | tokens per sequence | rank | measured (PyTorch) "
           f"| {baseline} | error | fsdp2 | error |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    jobs = [(f, "fp32", "none", w, seq) for f in families for w in (4, 8) for seq in (SEQ, 256)
            if not (f == "gpt2" and seq > SEQ)]
    jobs += [("llama", "mixed", "none", 4, 256), ("llama", "fp32", "full", 4, 256), *more]
    for family, precision, recompute, world, seq in jobs:
        graph = trace_hf(family, batch=world, seq=seq, precision=precision, **config(family, 4))
        suffix = "+full" if recompute == "full" else ""
        predicted, default = (memshard.strategy_plan(graph, str(world), name + suffix, recompute=recompute).peak_bytes
                              for name in (baseline, "fsdp2"))
        parallelize = wrap if precision == "fp32" else functools.partial(mixed_precision, parallelize=wrap)
        parallelize = checkpointed(parallelize) if suffix else parallelize
        for rank in (0, world - 1):
            measured = fully_sharded_peak(family, world, rank, parallelize=parallelize, seq=seq, layers=4)
            out.append(f"| {family} | {precision} | {recompute} | {world} | {seq} | {rank} | {measured:,} | "
                       f"{predicted:,.0f} | {predicted / measured - 1:+.2%} | {default:,.0f} | "
                       f"{default / measured - 1:+.2%} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    text = "\n".join([provenance("OMP_NUM_THREADS=1 python benchmarks/conformance.py --write"), "", *rows(), "",
                      "PyTorch's tensor parallelism (torchtitan's plan) × FSDP2:", "",
                      *tensor_parallel_rows(), "",
                      "Mixed precision (FSDP2's MixedPrecisionPolicy, bf16 compute, fp32 reduction):", "",
                      *mixed_precision_rows(), "",
                      "FSDP2 with explicit prefetching (two blocks each way):", "",
                      *prefetch_rows(), "",
                      "FSDP2 wrapped as torchtitan wraps a decoder (embedding, output layers, blocks, root):", "",
                      *torchtitan_rows()])
    print(text)
    if args.write:
        write_section("conformance", "Baselines against PyTorch's own implementations", text)


if __name__ == "__main__":
    main()
