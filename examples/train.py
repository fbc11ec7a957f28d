"""Train a Hugging Face model under memshard's plan with a standard PyTorch loop (torchrun).

    torchrun --nproc-per-node 4 examples/train.py --config examples/tiny_llama.json --mesh 4 \\
        --steps 4 --save-at 2 --checkpoint ckpt
    torchrun --nproc-per-node 4 examples/train.py --config examples/tiny_llama.json --mesh 4 \\
        --steps 4 --checkpoint ckpt --resume

Every rank plans the job (planning is deterministic: every rank gets the same plan), or loads
the plan given with ``--plan`` (saved with ``memshard plan --json`` or ``Plan.save``), builds the
model from its config with the same seed, and hands both to ``memshard.parallelize``. Then it
is the usual loop: AdamW over the sharded model's parameters, a warm-up schedule, gradient
clipping (torch's own, the global norm), and a DCP checkpoint (model and optimizer by the
module's names, the scheduler and the step) that resumes under any plan, or under FSDP2
(docs/training.md). Rank 0 prints each step's loss, the same on every rank. Random token
batches stand in for a data loader (the same on every rank, drawn per step).
"""

from __future__ import annotations

import argparse
import gc
import json
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh

import memshard
from memshard.runtime.checkpoint import get_state_dict, set_state_dict
from memshard.trace.hf import seeded_model


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="examples/tiny_llama.json", help="a Hugging Face config.json")
    p.add_argument("--mesh", default="4", help="the device mesh, e.g. 4 or 2x2 (its size: the ranks)")
    p.add_argument("--plan", help="a saved plan of this job to load (default: every rank plans it)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (with --plan: the plan's)")
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence (with --plan: the plan's)")
    p.add_argument("--steps", type=int, default=4, help="train up to this step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=2, help="steps of linear learning-rate warm-up")
    p.add_argument("--clip", type=float, default=1.0, help="the global gradient norm's limit")
    p.add_argument("--checkpoint", help="a DCP checkpoint folder")
    p.add_argument("--save-at", type=int, help="save the checkpoint after this many steps")
    p.add_argument("--resume", action="store_true", help="start from the checkpoint")
    p.add_argument("--losses", help="rank 0 writes each step's loss to this JSON file")
    return p.parse_args(argv)


def batch(vocab: int, job, step: int, device) -> torch.Tensor:
    """Step ``step``'s token ids (the plan's batch and length), the same on every rank."""
    generator = torch.Generator().manual_seed(step)
    return torch.randint(0, vocab, (job.global_batch, job.seq), generator=generator).to(device)


def save(path: str, sharded, optimizer, scheduler, step: int) -> None:
    model_state, optim_state = get_state_dict(sharded, optimizer)
    dcp.save({"model": model_state, "optim": optim_state, "scheduler": scheduler.state_dict(), "step": step},
             checkpoint_id=path)


def load(path: str, sharded, optimizer, scheduler) -> int:
    """Load the checkpoint into the sharded model (whatever plan saved it); its step."""
    model_state, optim_state = get_state_dict(sharded, optimizer)
    state = {"model": model_state, "optim": optim_state, "scheduler": scheduler.state_dict(), "step": 0}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(sharded, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    scheduler.load_state_dict(state["scheduler"])
    sharded.step = state["step"]  # (it seeds the dropout masks)
    return state["step"]


def main(argv=None) -> None:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    train(args, "cuda" if cuda else "cpu")
    # The mesh, the model and the optimizer are gone now: their process group is destroyed
    # here, not at interpreter exit (where gloo's threads abort the process).
    gc.collect()
    dist.destroy_process_group()


def train(args, device: str) -> None:
    """The loop: plan, shard, train, checkpoint; the losses to ``args.losses``."""
    if args.plan:
        plan = memshard.load_plan(args.plan)
    else:
        plan = memshard.plan(memshard.HFModel(args.config), args.mesh, batch=args.batch, seq=args.seq,
                             precision="fp32")
    mesh = init_device_mesh(device, plan.problem.mesh.shape)
    job = plan.job
    module = seeded_model(job.model.source, job.precision, job.model.attn_implementation, job.hf_overrides(),
                          device, seed=0)
    vocab = module.config.vocab_size
    sharded = memshard.parallelize(module, plan, mesh)
    del module  # the shards are the model now
    optimizer = torch.optim.AdamW(sharded.parameters(), lr=args.lr, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / args.warmup))
    start = load(args.checkpoint, sharded, optimizer, scheduler) if args.resume else 0
    losses = {}
    for step in range(start, args.steps):
        ids = batch(vocab, job, step, device)
        loss = sharded(ids, labels=ids)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(sharded.parameters(), args.clip)  # the global norm
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses[step] = loss.item()
        if dist.get_rank() == 0:
            print(f"step {step}  loss {losses[step]:.5f}  grad norm {norm.item():.4f}", flush=True)
        if args.checkpoint and step + 1 == args.save_at:
            save(args.checkpoint, sharded, optimizer, scheduler, step + 1)
    if args.losses and dist.get_rank() == 0:
        with open(args.losses, "w") as f:
            json.dump(losses, f)


if __name__ == "__main__":
    main()
