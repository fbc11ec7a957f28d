"""Step time of memshard's runtime vs the same 2D plan written by hand with PyTorch's own APIs.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/runtime_vs_handwritten.py [--write]

The issue's goal: memshard's runtime, running the ``tp2-fsdp2`` plan (torchtitan's 2D recipe:
tensor + sequence parallelism over the inner mesh axis, FSDP / ZeRO-3 over the outer one), is
at most 1.05× slower per step than the same plan written by hand. Both sides run the same GPT
(pre-LN, learned positions, tied embedding / lm_head, unfused causal attention, dropout 0.1,
GeLU tanh, biases; fp32) on the same 2×2 mesh of 4 gloo ranks on this machine, with the same
global batch, Adam and number of steps:

- **hand-written**: a plain ``nn.Module`` (``GPT`` below) on a ``("dp", "tp")`` DeviceMesh,
  ``parallelize_module`` over "tp" the way torchtitan does it: vocab-parallel embedding
  (``RowwiseParallel``, output sharded on the sequence), ``ColwiseParallel`` q / k / v and
  MLP fc, ``RowwiseParallel`` attention and MLP projections (output sharded on the sequence),
  ``SequenceParallel`` layer norms and position embedding, ``PrepareModuleInput`` gathering
  the sequence before attention and the MLP; dropouts run on whatever local piece they get
  (sequence shard or head shard: elementwise, no communication); the lm_head is
  ``ColwiseParallel`` (vocab-parallel, tied to the embedding) with **loss parallel**
  (``torch.distributed.tensor.parallel.loss_parallel``), as memshard's plan has a
  vocab-parallel cross-entropy. Then ``fully_shard`` (FSDP2) of every block and of the root
  over "dp"; ``torch.optim.Adam(foreach=False)``.
- **memshard**: ``strategy_plan(..., "tp2-fsdp2", zero3_unit="layer")`` run by
  ``memshard.runtime.train`` (its ``LeanAdam``, per-parameter, no foreach): ZeRO-3 gathers a
  block's weights at once, as FSDP2 does (the ratio the goal is about); and the same plan
  with memshard's default ``zero3_unit="op"`` (each op's weights gathered around it: less
  memory, a collective per weight).

Every rank is a fresh ``python -m`` process started by ``memshard.runtime.launch`` (the same
launcher for both). Each runs ``--steps`` steps timed with ``time.perf_counter`` around batch
+ forward + backward + optimizer step; the first step (warm-up) and the last (memshard
measures memory and collectives in it; the hand-written run measures memory in it with the
same ``MemoryMeter``) are left out, and the table shows the median of the rest over steps,
then the slowest rank. Peak memory is ``MemoryMeter``'s (MemTracker) peak on rank 0 in the
last step. Numerics are not compared (same initial distributions as memshard's
``init_parameter`` but other values, other dropout masks); the parameter counts printed show
both compute the same model, the losses that both train.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

MESH = (2, 2)  # ("dp", "tp")
NPROCS = math.prod(MESH)
MESH_SPEC = "x".join(map(str, MESH))
STRATEGY = f"tp{MESH[1]}-fsdp{MESH[0]}"
DROPOUT_P = 0.1  # memshard.runtime.ops.DROPOUT_P
HERE = os.path.dirname(os.path.abspath(__file__))
MODULE = os.path.splitext(os.path.basename(__file__))[0]
sys.path.insert(0, HERE)
from benchmarks_md import provenance, write_section  # noqa: E402


# -- the hand-written model ------------------------------------------------------------------
class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.head_dim = hidden // heads
        self.q, self.k, self.v, self.proj = (nn.Linear(hidden, hidden) for _ in range(4))
        self.attn_dropout, self.resid_dropout = nn.Dropout(DROPOUT_P), nn.Dropout(DROPOUT_P)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape  # x: replicated over TP; q, k, v: this rank's heads only (local)

        def heads(t):
            return t.view(b, s, -1, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        causal = torch.ones(s, s, dtype=torch.bool).triu_(1)
        probs = self.attn_dropout(torch.softmax(scores.masked_fill(causal, float("-inf")), -1))
        ctx = (probs @ v).transpose(1, 2).reshape(b, s, -1)
        return self.resid_dropout(self.proj(ctx))


class MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.fc, self.proj = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)
        self.dropout = nn.Dropout(DROPOUT_P)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(hidden), Attention(hidden, heads)
        self.ln_2, self.mlp = nn.LayerNorm(hidden), MLP(hidden, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """memshard's ``gpt`` family (``memshard/models/gpt.py``) as a plain module."""

    def __init__(self, vocab: int, positions: int, hidden: int, heads: int, ffn: int, layers: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, hidden), nn.Embedding(positions, hidden)
        self.drop = nn.Dropout(DROPOUT_P)
        self.blocks = nn.ModuleList(Block(hidden, heads, ffn) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        self.pos_offset = 0  # first position of this rank's sequence piece (sequence parallel)
        for name, p in self.named_parameters():  # as memshard's init_parameter
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif ".ln_" in name or name.startswith("ln_"):
                nn.init.ones_(p)
            else:
                nn.init.normal_(p, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids)  # under SP: this rank's sequence piece
        pos = torch.arange(self.pos_offset, self.pos_offset + x.shape[1])
        x = self.drop(x + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def parallelize_by_hand(model: GPT, mesh, seq: int) -> None:
    """torchtitan's 2D recipe: TP + SP over ``mesh["tp"]``, then FSDP2 over ``mesh["dp"]``."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    tp = mesh["tp"]
    parallelize_module(model, tp, {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "wpe": SequenceParallel(sequence_dim=0, use_local_output=True),  # local positions in
        "ln_f": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                   use_local_output=False),  # for loss_parallel
    })
    model.lm_head.weight = model.wte.weight  # both Shard(0) over the vocab: tie them again
    model.pos_offset = tp.get_local_rank() * (seq // tp.size())
    # The gathered input stays a DTensor (as in torchtitan): the partial input gradients of
    # q, k and v (fc) sum as DTensors and are reduce-scattered once, not all-reduced each.
    gather_seq = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    for block in model.blocks:
        parallelize_module(block, tp, {
            "ln_1": SequenceParallel(),
            "attn": gather_seq,
            "attn.q": ColwiseParallel(),
            "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
            "ln_2": SequenceParallel(),
            "mlp": gather_seq,
            "mlp.fc": ColwiseParallel(),
            "mlp.proj": RowwiseParallel(output_layouts=Shard(1)),
        })
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # unique parameters (tied counted once)


def make_batch(vocab: int, batch: int, seq: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step, the same on every rank (as ``memshard``'s ``make_batch``)."""
    gen = torch.Generator().manual_seed(step * 1009)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    return ids, torch.randint(0, vocab, (batch, seq), generator=gen)


def handwritten_rank(args) -> dict:
    """One rank of the hand-written run; returns its report."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from memshard.runtime.measure import CommCounter, MemoryMeter

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    mesh = init_device_mesh("cpu", MESH, mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = GPT(args.vocab, args.seq, args.hidden, args.heads, 4 * args.hidden, args.layers)
    count = parameter_count(model)
    parallelize_by_hand(model, mesh, args.seq)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
    dp, local = mesh["dp"], args.batch // MESH[0]
    lo = dp.get_local_rank() * local
    times, losses, measured = [], [], {}
    for step in range(args.steps):
        last = step == args.steps - 1
        meter = MemoryMeter(model, optimizer) if last else nullcontext()
        counter = CommCounter() if last else nullcontext()
        start = time.perf_counter()
        with meter, counter:
            ids, labels = make_batch(args.vocab, args.batch, args.seq, step)
            ids, labels = ids[lo:lo + local], labels[lo:lo + local]
            with loss_parallel():
                logits = model(ids)
                loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))
                loss.backward()
            value = loss.detach().to_local().clone()
            with counter.paused() if last else nullcontext():  # bookkeeping, as memshard's
                dist.all_reduce(value, group=dp.get_group())  # the global loss, as logged
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        losses.append(float(value) / MESH[0])
        if last:
            measured = {"peak_bytes": meter.peak_bytes, "collective_calls": counter.calls_by_kind}
    rank = dist.get_rank()
    dist.destroy_process_group()
    return {"rank": rank, "parameters": count, "step_times_s": times, "losses": losses,
            "measured": measured}


def worker(args) -> int:
    """The hand-written run's rank process (``--worker``): writes its report for ``launch``."""
    report = handwritten_rank(args)
    path = os.path.join(os.environ["MEMSHARD_OUT_DIR"], f"rank{os.environ['RANK']}.json")
    with open(path, "w") as f:
        json.dump(report, f)
    return 0


# -- the comparison ----------------------------------------------------------------------------
def step_time(reports: list[dict]) -> float:
    """Per rank, the median step time without the first and last steps; the slowest rank's."""
    return max(statistics.median(r["step_times_s"][1:-1]) for r in reports)


def run_memshard(args, unit: str) -> tuple[list[dict], int]:
    from memshard.api import strategy_plan
    from memshard.runtime.launch import launch

    plan = strategy_plan("tiny-gpt", MESH_SPEC, STRATEGY, batch=args.batch, seq=args.seq,
                         hidden=args.hidden, num_layers=args.layers, heads=args.heads,
                         ffn=4 * args.hidden, vocab=args.vocab, max_positions=args.seq,
                         precision="fp32", zero3_unit=unit)
    graph = plan.problem.graph
    count = sum(graph.tensors[p].numel for p in graph.parameters)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "plan.json")
        plan.save(path)
        reports = launch("memshard.runtime.train", ["--plan", path, "--steps", str(args.steps)],
                         NPROCS, timeout_s=args.timeout)
    return reports, count


def run_handwritten(args) -> list[dict]:
    from memshard.runtime.launch import launch

    path = os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p)
    knobs = [f"--{k}={getattr(args, k)}" for k in ("hidden", "layers", "heads", "vocab", "batch",
                                                   "seq", "steps")]
    return launch(MODULE, ["--worker", *knobs], NPROCS, timeout_s=args.timeout,
                  env={"PYTHONPATH": path})


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=10, help="≥ 3: the first and last are not timed")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    p.add_argument("--write", action="store_true", help="put the table into BENCHMARKS.md")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # a hand-written rank
    return p


def main() -> int:
    args = build_parser().parse_args()
    if args.worker:
        return worker(args)
    if args.steps < 3:
        sys.exit("--steps must be at least 3")
    dp, tp = MESH
    if args.batch % dp or args.seq % tp or args.heads % tp or args.hidden % args.heads:
        sys.exit(f"batch must divide by {MESH[0]}, seq and heads by {MESH[1]}, hidden by heads")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    lines = [provenance("OMP_NUM_THREADS=1 python benchmarks/runtime_vs_handwritten.py --write")
             + f" gloo, {NPROCS} ranks on a {MESH_SPEC} mesh (dp × tp).", "",
             f"Model: GPT, {args.layers} layers, hidden {args.hidden}, {args.heads} heads, ffn {4 * args.hidden}, "
             f"vocab {args.vocab}, fp32; global batch {args.batch} × seq {args.seq}; {args.steps} steps, median of "
             f"steps 2..{args.steps - 1}, slowest rank.", ""]
    print(lines[0], flush=True)
    mine, count = run_memshard(args, "layer")
    per_op, _ = run_memshard(args, "op")
    hand = run_handwritten(args)
    t_mine, t_op, t_hand = step_time(mine), step_time(per_op), step_time(hand)
    rows = [
        (f"memshard runtime ({STRATEGY} plan, ZeRO-3 per layer)", count, t_mine, mine[0]["measured"]),
        (f"memshard runtime ({STRATEGY} plan, ZeRO-3 per op)", count, t_op, per_op[0]["measured"]),
        ("hand-written (parallelize_module + FSDP2)", hand[0]["parameters"], t_hand,
         hand[0]["measured"]),
    ]
    lines += ["| run | parameters | step time (median) | peak memory, rank 0 "
              "| collectives in the last step, rank 0 (AG / RS / AR) |", "|---|---|---|---|---|"]
    for name, n, t, m in rows:
        calls = [m["collective_calls"].get(k, 0) for k in ("all_gather", "reduce_scatter", "all_reduce")]
        lines.append(f"| {name} | {n:,} | {t * 1e3:.1f} ms | {m['peak_bytes'] / 2**20:.1f} MiB "
                     f"| {' / '.join(map(str, calls))} |")
    lines += ["", f"Ratio memshard (per layer, as FSDP2) / hand-written: {t_mine / t_hand:.2f}×; per op: "
              f"{t_op / t_hand:.2f}×."]
    print("\n".join(lines[1:]))
    for name, reports in (("memshard per layer", mine), ("memshard per op", per_op), ("hand-written", hand)):
        per_rank = ", ".join(" ".join(f"{t * 1e3:.0f}" for t in r["step_times_s"]) for r in reports)
        print(f"{name} step times (ms), per rank: {per_rank}")
        print(f"{name} losses: {' '.join(f'{x:.3f}' for x in reports[0]['losses'])}")
    if args.write:
        write_section("runtime-vs-handwritten", "Runtime step time against hand-written TP + FSDP2", "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
