"""DDP under ``torch.autocast`` (a DDP user's bf16) against memshard's ``--precision autocast``.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/ddp_autocast.py [--write]
    python3 benchmarks/ddp_autocast.py --measure --device cuda --out benchmarks/ddp_autocast_cuda.json

Hugging Face GPT-2, LLaMA and Qwen2 (small configs, fp32 weights, dropout off) wrapped in
``DistributedDataParallel`` (defaults) on one rank of a fake process group, trained as a DDP
user trains in bf16: the forward and the loss under ``torch.autocast(device, torch.bfloat16)``,
backward and ``torch.optim.Adam`` (foreach) outside it; also without autocast (fp32), and
FSDP2 in mixed precision as torchtitan sets it. ``--measure`` only measures (the planner is not
imported, so it runs wherever PyTorch, transformers and pytest do: the GPU machine) and writes each
run's peak (``MemoryMeter``, DDP's third step, FSDP2's second) with its breakdown, and each
family's op dtypes in an autocast forward. Without it, the script measures on this machine's
CPU, reads the CUDA measurements recorded in ``benchmarks/ddp_autocast_cuda.json``, and sets
memshard's predictions beside both (``--precision autocast`` traced with the device's autocast
lists; the ``ddp`` baseline of the mixed-precision job, memshard's bf16 layout, for contrast);
``--write`` puts the table into BENCHMARKS.md.
"""

from __future__ import annotations

import datetime
import json
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from tests.baselines.test_conformance import seen_buckets  # noqa: E402

from benchmarks_md import gpu_or_here, provenance, write_section  # noqa: E402
from memshard.runtime.measure import MemoryMeter, destroy, init_fake_world  # noqa: E402
from memshard.trace.hf import build_model, load_config  # noqa: E402

VOCAB = 512
FAMILIES = {
    "llama": {"num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 256, "vocab_size": VOCAB},
    "qwen2": {"num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 256, "vocab_size": VOCAB},
    "gpt2": {"n_layer": 2, "n_embd": 128, "n_head": 4, "vocab_size": VOCAB, "n_positions": 1024,
             "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
}
RECORDED = ROOT / "benchmarks" / "ddp_autocast_cuda.json"
CASES = [(family, world, seq) for family in FAMILIES for world, seq in ((4, 256), (8, 1024))]


def step(module, opt, seed: int, seq: int, device: str, autocast: bool) -> None:
    ids = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(seed)).to(device)
    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
        loss = module(ids, labels=ids, use_cache=False).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


# Each PyTorch run measured: (its label, memshard's precision, baseline and recomputation for it)
RUNS = {
    "ddp-autocast": ("DDP, autocast", "autocast", "ddp", "none"),
    "ddp+full-autocast": ("DDP, autocast, checkpointed blocks", "autocast", "ddp+full", "full"),
    "fsdp2-autocast": ("FSDP2, autocast", "autocast", "fsdp2", "none"),
    "ddp-fp32": ("DDP, fp32", "fp32", "ddp", "none"),
    "ddp+full-fp32": ("DDP, fp32, checkpointed blocks", "fp32", "ddp+full", "full"),
    "fsdp2-fp32": ("FSDP2, fp32", "fp32", "fsdp2", "none"),
    "fsdp2-mixed": ("FSDP2, MixedPrecisionPolicy", "mixed", "fsdp2", "none"),
}


def blocks(model) -> torch.nn.ModuleList:
    inner = getattr(model, "model", None) or model.transformer
    return getattr(inner, "layers", None) or inner.h


def wrap(run: str, model, world: int, device: str):
    """The model as ``run`` trains it: (the module stepped, the tensors DDP allocated in C++,
    where MemTracker cannot see them: its buckets, handed to the meter as the conformance
    tests do)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.nn.parallel import DistributedDataParallel

    if run.startswith("fsdp2"):
        mesh = init_device_mesh(device, (world,))
        options = {"mesh": mesh}
        if run == "fsdp2-mixed":  # torchtitan's policy
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in blocks(model):
            fully_shard(block, **options)
        return fully_shard(model, **options), {}
    if "+full" in run:  # torchtitan's full activation checkpointing
        layers = blocks(model)
        for k, block in enumerate(layers):
            layers[k] = checkpoint_wrapper(block, preserve_rng_state=False)
    wrapped = DistributedDataParallel(model)
    return wrapped, seen_buckets(wrapped, world)


def peak(run: str, family: str, world: int, seq: int, device: str) -> dict:
    """Rank 0's peak in its last step (DDP's third: it rebuilds its buckets in the second;
    FSDP2's second)."""
    init_fake_world(0, world)
    try:
        torch.manual_seed(0)
        model = build_model(load_config(family, **FAMILIES[family]), "fp32", device=device)
        module, buckets = wrap(run, model, world, device)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)
        autocast = run.endswith("autocast")
        steps = 2 if run.startswith("fsdp2") else 3
        for seed in range(steps - 1):
            step(module, opt, seed, seq, device, autocast)
        meter = MemoryMeter(model, opt, *buckets.values(), device=device)
        with meter:
            step(module, opt, steps - 1, seq, device, autocast)
        return {"run": run, "family": family, "config": FAMILIES[family], "world": world, "seq": seq,
                "peak": meter.peak_bytes,
                "breakdown": meter.breakdown, "cuda_peak": meter.cuda_peak_bytes}
    finally:
        destroy()


class DtypeLog(TorchDispatchMode):
    """Every op's name, its tensor inputs' dtypes and its outputs' dtypes."""

    def __init__(self):
        super().__init__()
        self.calls: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        dtypes = lambda xs: ",".join(str(x.dtype).removeprefix("torch.") for x in xs if isinstance(x, torch.Tensor))  # noqa: E731
        flat_in = torch.utils._pytree.tree_leaves((args, kwargs))
        flat_out = torch.utils._pytree.tree_leaves(out)
        self.calls[f"{func.overloadpacket.__name__}({dtypes(flat_in)}) -> {dtypes(flat_out)}"] += 1
        return out


def op_dtypes(family: str, device: str, seq: int = 64) -> dict:
    """The ops of one autocast forward and loss, with their dtypes, and the bytes saved for
    backward by dtype (storages counted once)."""
    torch.manual_seed(0)
    model = build_model(load_config(family, **FAMILIES[family]), "fp32", device=device)
    ids = torch.randint(0, VOCAB, (1, seq)).to(device)
    saved: dict[int, tuple[str, int]] = {}

    def pack(t):
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = (str(t.dtype).removeprefix("torch."), storage.nbytes())
        return t

    log = DtypeLog()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), log:
        with torch.autocast(device, dtype=torch.bfloat16):
            model(ids, labels=ids, use_cache=False)
    by_dtype: Counter = Counter()
    for dtype, nbytes in saved.values():
        by_dtype[dtype] += nbytes
    return {"family": family, "seq": seq, "ops": dict(sorted(log.calls.items())), "saved_bytes": dict(by_dtype)}


def measure(device: str) -> dict:
    import transformers

    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    result = {"measured": when, "device": device, "torch": torch.__version__, "transformers": transformers.__version__,
              "gpu": torch.cuda.get_device_name() if device == "cuda" else None, "runs": [], "dtypes": []}
    for family in FAMILIES:
        result["dtypes"].append(op_dtypes(family, device))
    for family, world, seq in CASES:
        for run in RUNS:
            result["runs"].append(peak(run, family, world, seq, device))
            print(result["runs"][-1], flush=True)
    return result


def table(measured: list[dict]) -> list[str]:
    import memshard
    from memshard.trace.hf import trace_hf

    rows = ["| device | model | ranks | seq | PyTorch run | measured MiB | memshard MiB | error "
            "| `ddp` of the mixed job (bf16 layout) MiB | its error |", "|" + "---|" * 10]
    for result in measured:
        for run in result["runs"]:
            family, world, seq = run["family"], run["world"], run["seq"]
            label, precision, baseline, recompute = RUNS[run["run"]]
            graph = trace_hf(family, batch=world, seq=seq, precision=precision, device=result["device"], **run["config"])
            predicted = memshard.strategy_plan(graph, str(world), baseline, recompute=recompute).peak_bytes
            contrast = ""
            if run["run"] == "ddp-autocast":
                mixed = trace_hf(family, batch=world, seq=seq, precision="mixed", **run["config"])
                layout = memshard.strategy_plan(mixed, str(world), "ddp").peak_bytes
                contrast = f"{layout / 2**20:.2f} | {layout / run['peak'] - 1:+.1%}"
            rows.append(f"| {result['device']} | {family} | {world} | {seq} | {label} | {run['peak'] / 2**20:.2f} "
                        f"| {predicted / 2**20:.2f} | {predicted / run['peak'] - 1:+.2%} | {contrast or '— | —'} |")
    return rows


def main() -> None:
    write = gpu_or_here(__doc__.splitlines()[0], measure)
    if write is None:
        return
    cuda = json.loads(RECORDED.read_text())
    text = "\n".join([provenance("OMP_NUM_THREADS=1 python benchmarks/ddp_autocast.py --write"),
                      f"CUDA rows: `--measure --device cuda` on the GPU machine ({cuda['gpu']}, torch {cuda['torch']}, "
                      f"transformers {cuda['transformers']}), {cuda['measured']}, recorded in "
                      f"`benchmarks/ddp_autocast_cuda.json`{' (' + cuda['note'] + ')' if 'note' in cuda else ''}; "
                      "CPU rows measured by this run (torch.autocast on CPU, whose op lists memshard then traces).", "",
                      *table([cuda, measure("cpu")])])
    print(text)
    if write:
        write_section("ddp-autocast", "DDP under torch.autocast", text)

if __name__ == "__main__":
    main()
