"""Which kernel ``F.scaled_dot_product_attention`` runs on a GPU, and what it saves for backward.

    python3 benchmarks/sdpa_backends.py --measure --out benchmarks/sdpa_backends_cuda.json   (GPU machine)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/sdpa_backends.py [--write]

PyTorch picks SDPA's kernel per call from the inputs' dtype, head dimension, mask, dropout and
whether grouped-query attention is asked for (``enable_gqa``); the fused kernels save the inputs,
the output and the log-sum-exp, the math fallback saves the scores' softmax (batch × heads ×
seq²). ``--measure`` (torch only: it runs on the GPU machine) records ``torch._fused_sdp_choice``
over a grid of such calls and, for a few of them, the bytes autograd saves and the peak of one
forward and backward. Without it, the script checks memshard's rule
(``memshard.trace.kernels.cuda_sdpa_backend``: the math path or a fused kernel) against every
recorded choice and sets the saved bytes of the same calls on this machine's CPU (the math
kernel where the GPU took it) beside the GPU's; ``--write`` puts that into BENCHMARKS.md.
"""

from __future__ import annotations

import datetime
import itertools
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from benchmarks_md import gpu_or_here, provenance, write_section  # noqa: E402

RECORDED = ROOT / "benchmarks" / "sdpa_backends_cuda.json"
BACKENDS = {-1: "error", 0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
HEADS = 8


def inputs(case: dict, device: str, grad: bool = False):
    batch, seq, dim = case["batch"], case["seq"], case["head_dim"]
    dtype = DTYPES[case["dtype"]]
    make = lambda heads: torch.randn(batch, heads, seq, dim, device=device, dtype=dtype, requires_grad=grad)  # noqa: E731
    q, k, v = make(HEADS), make(case["kv_heads"]), make(case["kv_heads"])
    mask = None
    if case["mask"] == "bool":
        mask = torch.ones(seq, seq, device=device, dtype=torch.bool).tril()
    elif case["mask"] == "float":
        mask = torch.zeros(batch, 1, seq, seq, device=device, dtype=dtype)
    return q, k, v, mask


def grid() -> list[dict]:
    cases = []
    for dtype, kv_heads, gqa, mask, causal, dim, dropout in itertools.product(
            DTYPES, (8, 2), (False, True), (None, "bool", "float"), (False, True),
            (32, 36, 60, 64, 80, 96, 128, 160, 192, 256, 288, 512), (0.0, 0.1)):
        if (kv_heads != HEADS and not gqa) or (mask and causal):
            continue  # torch refuses both
        cases.append({"dtype": dtype, "kv_heads": kv_heads, "enable_gqa": gqa, "mask": mask, "is_causal": causal,
                      "head_dim": dim, "dropout": dropout, "batch": 2, "seq": 128})
    return cases


def choice(case: dict, device: str) -> str:
    q, k, v, mask = inputs(case, device)
    picked = torch._fused_sdp_choice(q, k, v, mask, case["dropout"], case["is_causal"], scale=None,
                                     enable_gqa=case["enable_gqa"])
    return BACKENDS[int(picked)]


def saved_and_peak(case: dict, device: str, backend: str | None = None) -> dict:
    """Bytes autograd saves for one SDPA call (storages once) and, on CUDA, the peak above
    the inputs during its forward and backward."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, mask = inputs(case, device, grad=True)
    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    forced = sdpa_kernel(getattr(SDPBackend, backend)) if backend else torch.autograd.graph.saved_tensors_hooks(
        lambda t: t, lambda t: t)
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with forced, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=case["dropout"], is_causal=case["is_causal"],
            enable_gqa=case["enable_gqa"])
    out.backward(torch.ones_like(out))
    result = {"case": case, "saved_bytes": sum(saved.values())}
    if cuda:
        torch.cuda.synchronize()
        result["peak_above_inputs"] = torch.cuda.max_memory_allocated() - base
    return result


MEMORY_CASES = [
    {"dtype": dtype, "kv_heads": kv, "enable_gqa": kv != HEADS, "mask": None, "is_causal": True, "head_dim": 64,
     "dropout": 0.0, "batch": 2, "seq": seq}
    for dtype in ("fp32", "bf16") for kv in (2, 8) for seq in (256, 1024)]


def measure(device: str) -> dict:
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    result = {"measured": when, "device": device, "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
              "capability": list(torch.cuda.get_device_capability()) if device == "cuda" else None,
              "choices": [], "memory": []}
    for case in grid():
        result["choices"].append({**case, "backend": choice(case, device)})
    for case in MEMORY_CASES:
        result["memory"].append({**saved_and_peak(case, device), "backend": choice(case, device)})
        print(result["memory"][-1], flush=True)
    return result


def check() -> list[str]:
    sys.path.insert(0, str(ROOT / "src"))
    from memshard.trace.kernels import MATH, cuda_sdpa_backend

    recorded = json.loads(RECORDED.read_text())
    wrong = [c for c in recorded["choices"] if (cuda_sdpa_backend(
        c["dtype"], c["head_dim"], gqa=c["kv_heads"] != HEADS and c["enable_gqa"], mask=c["mask"] is not None)
        == MATH) != (c["backend"] == "math")]
    lines = [f"{recorded['gpu']}, torch {recorded['torch']}, {recorded['measured']}: memshard's rule (math path or "
             f"fused kernel) agrees with {len(recorded['choices']) - len(wrong)} of {len(recorded['choices'])} "
             "recorded choices.", "",
             "| GPU kernel | dtype | key/value heads of 8 | seq | saved on the GPU (bytes) | saved on CPU (bytes) |",
             "|---|---|---:|---:|---:|---:|"]
    lines += [f"| differs: {c} |" for c in wrong[:20]]
    for row in recorded["memory"]:
        cpu = saved_and_peak(row["case"], "cpu", backend={"math": "MATH"}.get(row["backend"]))
        case = row["case"]
        lines.append(f"| {row['backend']} | {case['dtype']} | {case['kv_heads']} | {case['seq']} "
                     f"| {row['saved_bytes']:,} | {cpu['saved_bytes']:,} |")
    return lines


def main() -> None:
    write = gpu_or_here(__doc__.splitlines()[0], measure)
    if write is None:
        return
    text = "\n".join([provenance("OMP_NUM_THREADS=1 python benchmarks/sdpa_backends.py --write"), *check()])
    print(text)
    if write:
        write_section("sdpa-backends", "Which attention kernel CUDA runs", text)

if __name__ == "__main__":
    main()
