"""Adam that needs no memory beyond its states: the step's workspace is the gradient itself.

``torch.optim.Adam`` allocates temporaries the size of each parameter (or of all of them,
with ``foreach``) to form ``sqrt(v̂) + ε``; memshard's memory model holds parameters,
gradients and the two moment buffers at the optimizer step and nothing else. This Adam
writes the denominator into the gradient buffer once the moments have consumed it, so the
step allocates nothing. Same update as ``torch.optim.Adam`` (no weight decay, no amsgrad);
the step count is a Python int, not a tensor.
"""

from __future__ import annotations

import math

import torch


class LeanAdam(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                t = state["step"]
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.lerp_(g, 1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                denom = g.copy_(v).sqrt_().div_(math.sqrt(1 - beta2**t)).add_(group["eps"])
                p.addcdiv_(m, denom, value=-group["lr"] / (1 - beta1**t))
                p.grad = None  # its buffer now holds the denominator
