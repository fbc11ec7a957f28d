"""What one ATen op keeps for backward, found by running it on fake tensors.

The op runs once under ``FakeTensorMode`` (no memory, any size) with
``saved_tensors_hooks`` watching what autograd packs: each packed tensor is one of the op's
inputs, its output, or a private buffer (statistics, a mask). This is what eager PyTorch holds,
so the planner prices exactly that. Results are cached by op and shapes, so the identical
layers of a model are probed once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.autograd.graph import saved_tensors_hooks


@dataclass(frozen=True)
class Saved:
    inputs: tuple[int, ...]  # positions among the op's tensor arguments
    output: bool
    buffers: tuple[tuple[tuple[int, ...], int], ...]  # (shape, bytes per element) of each


@dataclass(frozen=True)
class ArgSpec:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


_MODE: FakeTensorMode | None = None
_CACHE: dict[tuple, Saved | None] = {}


def _fake(spec: ArgSpec) -> torch.Tensor:
    t = torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype)
    return t.requires_grad_(spec.requires_grad)


def probe(target, args: tuple, kwargs: dict, specs: list[ArgSpec]) -> Saved | None:
    """Run ``target`` with the tensor arguments replaced, in order, by fakes of ``specs``
    (``args``/``kwargs`` hold ``ArgSpec`` placeholders); ``None`` when the op cannot run."""
    key = (str(target), repr(args), repr(sorted(kwargs.items())), tuple(specs))
    if key in _CACHE:
        return _CACHE[key]
    global _MODE
    if _MODE is None:
        _MODE = FakeTensorMode(allow_non_fake_inputs=False)
    packed: list[torch.Tensor] = []
    with _MODE:
        fakes = [_fake(s) for s in specs]
        it = iter(fakes)

        def fill(a):
            if isinstance(a, ArgSpec):
                return next(it)
            if isinstance(a, (list, tuple)):
                return type(a)(fill(x) for x in a)
            return a

        real_args = fill(args)
        real_kwargs = {k: fill(v) for k, v in kwargs.items()}
        try:
            with saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
                out = target(*real_args, **real_kwargs)
        except Exception:  # an op fake mode cannot run: priced as saving nothing
            _CACHE[key] = None
            return None
    outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor)]
    inputs, output, buffers, seen = set(), False, [], []
    for t in packed:
        if any(torch._C._is_alias_of(t, u) for u in seen):  # one buffer packed twice
            continue
        seen.append(t)
        hit = next((i for i, f in enumerate(fakes) if torch._C._is_alias_of(t, f)), None)
        if hit is not None:
            inputs.add(hit)
        elif any(torch._C._is_alias_of(t, o) for o in outs):
            output = True
        else:
            buffers.append((tuple(t.shape), t.element_size()))
    result = Saved(tuple(sorted(inputs)), output, tuple(buffers))
    _CACHE[key] = result
    return result
