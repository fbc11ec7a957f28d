"""Adam that needs no memory beyond its states, in fp32 or with fp32 master weights.

``torch.optim.Adam`` allocates temporaries the size of each parameter (or of all of them,
with ``foreach``) to form ``sqrt(v̂) + ε``; memshard's memory model holds parameters,
gradients and the optimizer states at the optimizer step and nothing else, as a fused GPU
kernel does. :class:`LeanAdam` therefore allocates nothing of a parameter's size:

- an fp32 parameter: the denominator is written into the gradient buffer once the moments
  have consumed it;
- a bf16 (or fp16) parameter, mixed precision as ZeRO and Megatron-LM's distributed optimizer
  lay it out: the optimizer states are an fp32 master copy and the two fp32 moments (12 bytes
  per element), the gradient stays in the parameter's dtype, and the update runs in fp32 over
  chunks of at most 1/256 of the parameter (at least ``CHUNK`` elements) through one small
  fp32 workspace, then writes the rounded master back into the parameter. (On CPU an
  elementwise op mixing bf16 and fp32 makes a full-size fp32 copy of its bf16 operand; a fused
  kernel such as Apex's multi-tensor Adam with master weights reads it in place.)

Same update as ``torch.optim.Adam`` (no weight decay, no amsgrad) on the fp32 values; the
step count is a Python int, not a tensor.

A sharded model does not need it: any ``torch.optim`` optimizer over its ``parameters()``
trains the plan alike (``loop.py``). What LeanAdam saves is the step's temporaries (so the
measured peak is the plan's, ``memshard run``) and, under mixed precision, the fp32 master
weights a ``torch.optim`` optimizer over bf16 shards would not keep.
"""

from __future__ import annotations

import math

import torch

from memshard.runtime.reshard import local_of

CHUNK = 1024  # the least chunk of a mixed-precision update (elements)


class LeanAdam(torch.optim.Optimizer):
    """Adam over local tensors (a DTensor parameter's local shard): states of its local size."""

    keeps_master_weights = True  # (``loop.py``: a mixed-precision plan's step is allowed)

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            workspace = None
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                p = local_of(param)
                if not state:
                    state["step"] = 0
                    if p.dtype != torch.float32:
                        state["master"] = p.detach().float()
                    master = state.get("master", p)
                    state["exp_avg"] = torch.zeros_like(master)
                    state["exp_avg_sq"] = torch.zeros_like(master)
                state["step"] += 1
                grad = local_of(param.grad)
                if "master" not in state:
                    self._update(group, state, grad, p, grad)
                    param.grad = None  # its buffer now holds the denominator
                    continue
                chunk = max(CHUNK, -(-p.numel() // 256))
                if workspace is None or workspace.numel() < chunk:
                    workspace = p.new_empty(chunk, dtype=torch.float32)
                self._update_mixed(group, state, p, grad, workspace)
                param.grad = None

    @staticmethod
    def _update(group, state, g, master, denom_buffer) -> None:
        """One Adam update of ``master`` from ``g`` (fp32), the denominator in ``denom_buffer``."""
        beta1, beta2 = group["betas"]
        t = state["step"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = denom_buffer.copy_(v).sqrt_().div_(math.sqrt(1 - beta2**t)).add_(group["eps"])
        master.addcdiv_(m, denom, value=-group["lr"] / (1 - beta1**t))

    def _update_mixed(self, group, state, p, grad, workspace) -> None:
        """Chunk by chunk: the bf16 gradient read into the fp32 workspace, the master and the
        moments updated, the master rounded back into the parameter."""
        flat_p, flat_g = p.detach().view(-1), grad.detach().reshape(-1)
        master, m, v = (state[k].view(-1) for k in ("master", "exp_avg", "exp_avg_sq"))
        n = flat_p.numel()
        size = workspace.numel()
        for start in range(0, n, size):
            k = min(size, n - start)
            part = {"step": state["step"], "exp_avg": m[start:start + k], "exp_avg_sq": v[start:start + k]}
            g = workspace[:k].copy_(flat_g[start:start + k])
            self._update(group, part, g, master[start:start + k], g)
            flat_p[start:start + k].copy_(master[start:start + k])
