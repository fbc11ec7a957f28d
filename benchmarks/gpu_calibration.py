"""Measure the device the step-time model prices, and compare the model with it.

    .venv/bin/python benchmarks/gpu_calibration.py --gpu h100-sxm --out calibration.json

On one GPU, in a few minutes: the best bf16 GEMM rate over a sweep of shapes, the HBM
bandwidth of a large copy, the causal fused attention rate (forward and backward), and one
GPT and one LLaMA layer at the local shapes of TP 1, 2, 4 and 8 with micro-batches of 1, 2
and 4 sequences: every op's forward and backward timed with CUDA events, beside what
``problem/kernels.py`` predicts for it. It writes a hardware file that ``--hardware`` loads
(the preset's figures, with the measured efficiencies and bandwidth) and the per-op table.

Without CUDA it runs the same code on the CPU at toy sizes (``--quick``), to check the script;
its figures then describe nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import asdict, replace

import torch
import torch.nn.functional as F

from memshard.core.hardware import hardware_from_dict, preset
from memshard.models import build_graph
from memshard.problem.kernels import op_time

GEMMS = [(8192, 8192, 8192), (4096, 4096, 4096), (16384, 4096, 4096), (8192, 1024, 8192), (2048, 2048, 2048)]
QUICK_GEMMS = [(256, 256, 256), (128, 256, 128)]


def timed(fn, repeat: int, device: str) -> float:
    """Median seconds of ``fn()`` over ``repeat`` runs, after one warm-up."""
    fn()
    samples = []
    for _ in range(repeat):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def gemm_rate(device: str, dtype, shapes, repeat: int) -> dict:
    best = 0.0
    rows = []
    for m, n, k in shapes:
        a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
        seconds = timed(lambda a=a, b=b: a @ b, repeat, device)
        rows.append({"m": m, "n": n, "k": k, "seconds": seconds, "flops_per_s": 2 * m * n * k / seconds})
        best = max(best, rows[-1]["flops_per_s"])
    return {"best_flops_per_s": best, "shapes": rows}


def copy_bandwidth(device: str, nbytes: int, repeat: int) -> float:
    src = torch.empty(nbytes // 2, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), repeat, device)
    return 2 * nbytes / seconds  # read and written


def attention_rate(device: str, dtype, shape: tuple[int, int, int, int], repeat: int) -> tuple[float, float]:
    """Causal fused attention, forward and forward + backward: FLOP/s of each (causal: half)."""
    b, h, s, d = shape
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    flops = 4 * b * h * s * s * d / 2
    forward = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), repeat, device)

    def both():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    total = timed(both, repeat, device)
    return flops / forward, 2.5 * flops / max(total - forward, 1e-9)


def layer_ops(model: str, hidden: int, heads: int, ffn: int, batch: int, seq: int, tp: int):
    """memshard's ops of one layer, with the local sizes of a Megatron-style TP split (heads
    and the MLP width divided by ``tp``)."""
    graph = build_graph(model, batch=batch, seq=seq, num_layers=1, hidden=hidden, heads=heads, ffn=ffn,
                        vocab=1024, precision="mixed")
    split = {"n": tp, "e": tp, "f": tp}
    for op in (o for o in graph.ops if o.layer == 0):
        sizes = graph.dim_sizes(op)
        yield graph, op, {d: n // split.get(d, 1) if d in split else n for d, n in sizes.items()}


def measured_op(graph, op, local: dict, device: str, repeat: int) -> tuple[float, float] | None:
    """Forward and backward seconds of ``op`` run with PyTorch at its local sizes (the kinds a
    layer has; None for one not measured here)."""
    def tensor(operand, grad=True):
        shape = [local[d] for d in operand.dims]
        dtype = torch.float32 if graph.tensors[operand.tensor].dtype_bytes == 4 else torch.bfloat16
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=grad)
    inputs = [tensor(x) for x in op.inputs]
    kind = op.kind
    if kind in ("linear", "matmul"):
        letters = {d: chr(97 + i) for i, d in enumerate(op.dims)}
        spec = ",".join("".join(letters[d] for d in x.dims) for x in op.inputs[:2])
        spec += "->" + "".join(letters[d] for d in op.output.dims)
        run = lambda: torch.einsum(spec, inputs[0], inputs[1])  # noqa: E731
    elif kind in ("layernorm", "rmsnorm"):
        norm = F.layer_norm if kind == "layernorm" else F.rms_norm
        run = lambda: norm(inputs[0], (inputs[0].shape[-1],), inputs[1])  # noqa: E731
    elif kind in ("gelu", "silu"):
        run = lambda: (F.gelu if kind == "gelu" else F.silu)(inputs[0])  # noqa: E731
    elif kind in ("add", "mul"):
        run = lambda: inputs[0] + inputs[1] if kind == "add" else inputs[0] * inputs[1]  # noqa: E731
    elif kind == "dropout":
        run = lambda: F.dropout(inputs[0], 0.1)  # noqa: E731
    elif kind == "softmax":
        run = lambda: torch.softmax(inputs[0], -1)  # noqa: E731
    else:
        return None
    forward = timed(run, repeat, device)
    out = run()
    grad = torch.randn_like(out)
    backward = timed(lambda: torch.autograd.grad(out, inputs, grad, retain_graph=True, allow_unused=True), repeat,
                     device)
    return forward, backward


def layer_table(hardware, device: str, quick: bool, repeat: int) -> list[dict]:
    layers = ([("tiny-gpt", 128, 4, 512), ("tiny-llama", 128, 4, 256)] if quick
              else [("gpt3-1.3b", 4096, 32, 16384), ("llama3-8b", 4096, 32, 14336)])
    rows = []
    for model, hidden, heads, ffn in layers:
        for tp in ((1, 2) if quick else (1, 2, 4, 8)):
            for batch in ((1,) if quick else (1, 2, 4)):
                seq = 32 if quick else 2048
                for graph, op, local in layer_ops(model, hidden, heads, ffn, batch, seq, tp):
                    measured = measured_op(graph, op, local, device, repeat)
                    if measured is None:
                        continue
                    predicted = op_time(op, graph, local, hardware)
                    rows.append({"model": model, "tp": tp, "batch": batch, "op": op.name, "kind": op.kind,
                                 "predicted_s": [predicted.forward_s, predicted.backward_s],
                                 "measured_s": list(measured)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default="h100-sxm", help="the preset the device is (its peaks are read)")
    parser.add_argument("--out", default="calibration.json", help="the hardware file to write")
    parser.add_argument("--table", default="calibration_ops.json", help="the per-op table to write")
    parser.add_argument("--quick", action="store_true", help="toy sizes (the default without CUDA)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    quick = args.quick or device == "cpu"
    repeat = 3 if quick else 20
    base = preset(args.gpu)
    gemm = gemm_rate(device, torch.bfloat16, QUICK_GEMMS if quick else GEMMS, repeat)
    bandwidth = copy_bandwidth(device, 2**24 if quick else 2**31, repeat)
    attention = attention_rate(device, torch.bfloat16, (1, 2, 64, 32) if quick else (4, 32, 2048, 128), repeat)
    fields = {"base": base.name, "name": f"{base.name}-measured",
              "matmul_efficiency": min(1.0, gemm["best_flops_per_s"] / base.peak_flops),
              "attention_efficiency": min(1.0, attention[0] / base.peak_flops),
              "memory_bandwidth": base.memory_bandwidth,
              "memory_efficiency": min(1.0, bandwidth / base.memory_bandwidth)}
    hardware = hardware_from_dict(dict(fields))
    rows = layer_table(hardware, device, quick, repeat)
    with open(args.out, "w") as f:
        json.dump(fields, f, indent=2)
    with open(args.table, "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "quick": quick,
                   "gemm": gemm, "copy_bytes_per_s": bandwidth, "attention_flops_per_s": attention,
                   "hardware": asdict(replace(hardware)), "ops": rows}, f, indent=1)
    errors = [abs(sum(r["predicted_s"]) / sum(r["measured_s"]) - 1) for r in rows if sum(r["measured_s"]) > 0]
    print(f"{device}: best GEMM {gemm['best_flops_per_s'] / 1e12:.1f} TFLOP/s, copy {bandwidth / 1e9:.0f} GB/s, "
          f"attention {attention[0] / 1e12:.1f} / {attention[1] / 1e12:.1f} TFLOP/s; {len(rows)} ops, "
          f"median |error| {statistics.median(errors) if errors else math.nan:.1%}; wrote {args.out}, {args.table}")


if __name__ == "__main__":
    main()
