"""Checkpoints of a sharded model by the module's own names, in any plan's layouts.

A plan stores a parameter as a flat piece of its compute shard (ZeRO), which no DTensor
placement describes and which another plan cuts elsewhere. A checkpoint therefore holds every
parameter, and every optimizer state of a parameter's size, as a DTensor of the parameter's
own shape in its compute layout under the plan (``Shard``/``Replicate`` over the mesh), keyed
by the module's name (``lm_head.weight``): the values a ZeRO stage gathers over its storage
axes, one parameter at a time. ``torch.distributed.checkpoint`` (DCP) saves those as they
are and loads them into any other plan's DTensors, or into full tensors for one process.

The optimizer's state follows ``torch.distributed.checkpoint.state_dict``'s conventions:
``{"state": {name: {key: value}}, "param_groups": [{hyperparameters..., "params": [names]}]}``.
:func:`get_state_dict` and :func:`set_state_dict` take the sharded model and its optimizer
as that module's functions of the same names take a module and its optimizer::

    model_state, optim_state = get_state_dict(sharded, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    ...
    state = dict(zip(("model", "optim"), get_state_dict(sharded, optimizer)))
    dcp.load(state, checkpoint_id=path)
    set_state_dict(sharded, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

A ZeRO-3 layer unit (``GatherUnit``) holds several parameters in one flat shard: its states
are cut at its members' bounds into one entry per member.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from memshard.core.placement import REPLICATE
from memshard.runtime.reshard import as_dtensor, reshard_local, to_torch


# -- one parameter's values: this rank's flat piece ⇄ a DTensor of the parameter's shape --------
def _whole(piece: torch.Tensor, numel: int, mesh, flat_sharded) -> torch.Tensor:
    """The whole flat buffer (a compute shard, or a unit's) from this rank's piece of it."""
    if all(p == REPLICATE for p in flat_sharded):
        return piece.reshape(-1)
    return reshard_local(piece.detach().reshape(-1), (numel,), mesh, flat_sharded,
                         tuple(REPLICATE for _ in flat_sharded), reverse=True)


def _dtensor(store, local_flat: torch.Tensor) -> DTensor:
    local = local_flat.reshape(store.local_shape)
    return as_dtensor(local, store.mesh, store.compute, store.shape)


def _local(store, value: torch.Tensor) -> torch.Tensor:
    """This rank's compute shard of a saved value: a DTensor (any placements on this mesh) or
    a full tensor (sliced here, no communication)."""
    placements = to_torch(store.compute)
    if isinstance(value, DTensor):
        if tuple(value.placements) != tuple(placements):
            value = value.redistribute(store.mesh, placements)
        return value.to_local().reshape(store.local_shape)
    full = value.reshape(store.shape)
    return distribute_tensor(full, store.mesh, placements, src_data_rank=None).to_local()


def _entries(model) -> list[tuple[torch.Tensor, list[tuple[str, object, int, int]]]]:
    """Each optimizer parameter with its members: (name, store, start, end), the member's
    range in the flat buffer the parameter is this rank's piece of."""
    out = []
    for name, store in model.stores.items():
        if store.unit is None:
            out.append((store.opt, [(name, store, 0, store.numel)]))
    for unit in model.units:
        members = [(s.name, s, start, start + s.numel) for s, start in zip(unit.stores, unit.offsets)]
        out.append((unit.param, members))
    return out


def _holder(param: torch.Tensor, members) -> tuple[int, object, object]:
    """(numel, mesh, flat layout) of the flat buffer ``param`` is a piece of."""
    store = members[0][1]
    if store.unit is not None:
        return store.unit.numel, store.mesh, store.unit.flat_sharded
    stored = store.stage >= 1
    return store.numel, store.mesh, store.flat_sharded if stored else tuple(REPLICATE for _ in store.compute)


def _split(param, members, value: torch.Tensor) -> dict[str, DTensor]:
    """A tensor of ``param``'s shape (the parameter, or a state of its size) as one DTensor
    per member."""
    numel, mesh, flat_sharded = _holder(param, members)
    whole = _whole(value, numel, mesh, flat_sharded)
    return {name: _dtensor(store, whole[start:end]) for name, store, start, end in members}


def _piece_range(param, members) -> tuple[int, int]:
    """Where this rank's piece lies in the flat buffer."""
    store = members[0][1]
    if store.unit is not None:
        return store.unit.piece_range()
    if store.stage == 0:
        return 0, store.numel
    return store.flat_start, store.flat_start + store.flat_len


def _join(param, members, values: Callable[[str], torch.Tensor], dtype) -> torch.Tensor:
    """This rank's piece of ``param``'s flat buffer from each member's saved value."""
    lo, hi = _piece_range(param, members)
    out = torch.empty(hi - lo, dtype=dtype, device=param.device)
    for name, store, start, end in members:
        begin, stop = max(lo, start), min(hi, end)
        if begin < stop:
            flat = _local(store, values(name)).reshape(-1)
            out[begin - lo:stop - lo].copy_(flat[begin - start:stop - start])
    return out.view(param.shape)


# -- the model ---------------------------------------------------------------------------------
@torch.no_grad()
def model_state_dict(model) -> dict[str, DTensor]:
    """Every parameter by the module's name: a DTensor of its shape in its compute layout,
    in the dtype of the shard the optimizer updates (under mixed precision a ZeRO-3 shard is
    the fp32 master)."""
    out: dict[str, DTensor] = {}
    for param, members in _entries(model):
        out.update(_split(param, members, param.detach()))
    return {name: out[name] for name in model.graph.parameters}


@torch.no_grad()
def load_model_state_dict(model, state: Mapping[str, torch.Tensor]) -> None:
    """Write ``state`` (DTensors in any layout on this mesh, or full tensors) into the shards
    and the compute weights."""
    missing = [name for name in model.graph.parameters if name not in state]
    if missing:
        raise KeyError(f"the state dict lacks {', '.join(missing[:5])}")
    for param, members in _entries(model):
        param.copy_(_join(param, members, state.__getitem__, param.dtype))
        store = members[0][1]
        if store.unit is None and store.stage < 3:  # the compute weight around the shard
            store.param.to_local().copy_(_local(store, state[store.name]))
            store.gathered_version = store.opt._version


# -- the optimizer -----------------------------------------------------------------------------
def _init_optimizer_state(model, optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter its optimizer states, as ``torch.distributed.checkpoint`` does
    before loading into an optimizer that has not stepped: a step with zero gradients and a
    learning rate of zero (the model's step count kept)."""
    if all(p in optimizer.state for group in optimizer.param_groups for p in group["params"]):
        return
    step, rates = model.step, [group["lr"] for group in optimizer.param_groups]
    for param, _ in _entries(model):
        param.grad = torch.zeros_like(param)
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, rates):
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    model.step = step


def _is_sized(value, param) -> bool:
    return torch.is_tensor(value) and value.shape == param.shape and value.dim() > 0


@torch.no_grad()
def optimizer_state_dict(model, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state by the module's names (``get_state_dict``'s conventions): a
    state of a parameter's size as a DTensor like the parameter's, a scalar as it is."""
    _init_optimizer_state(model, optimizer)
    names: dict[int, list[str]] = {}
    state: dict[str, dict] = {}
    for param, members in _entries(model):
        names[id(param)] = [name for name, *_ in members]
        per_member: dict[str, dict] = {name: {} for name in names[id(param)]}
        for key, value in optimizer.state.get(param, {}).items():
            if _is_sized(value, param):
                for name, tensor in _split(param, members, value).items():
                    per_member[name][key] = tensor
            else:
                for name in per_member:
                    per_member[name][key] = value.clone() if torch.is_tensor(value) else value
        state.update(per_member)
    groups = []
    for group in optimizer.param_groups:
        params = [name for p in group["params"] for name in names.get(id(p), ())]
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    return {"state": {name: state[name] for name in model.graph.parameters if name in state},
            "param_groups": groups}


@torch.no_grad()
def load_optimizer_state_dict(model, optimizer: torch.optim.Optimizer, state: Mapping) -> None:
    """Set the optimizer's states and hyperparameters from ``state`` (the conventions of
    :func:`optimizer_state_dict`; DTensors in any layout on this mesh, or full tensors)."""
    _init_optimizer_state(model, optimizer)
    saved = state["state"]
    for param, members in _entries(model):
        current = optimizer.state[param]
        first = saved[members[0][0]]
        for key, value in current.items():
            if _is_sized(value, param):
                current[key] = _join(param, members, lambda name, key=key: saved[name][key], value.dtype)
            elif torch.is_tensor(value):
                value.copy_(torch.as_tensor(first[key]))
            else:
                current[key] = first[key]
    for group, saved_group in zip(optimizer.param_groups, state["param_groups"]):
        group.update({k: v for k, v in saved_group.items() if k != "params"})


def get_state_dict(model, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(model state, optimizer state), as ``torch.distributed.checkpoint.state_dict.get_state_dict``."""
    return model_state_dict(model), optimizer_state_dict(model, optimizer)


def set_state_dict(model, optimizer: torch.optim.Optimizer, *, model_state_dict: Mapping,
                   optim_state_dict: Mapping) -> None:
    """Load both, as ``torch.distributed.checkpoint.state_dict.set_state_dict``."""
    load_model_state_dict(model, model_state_dict)
    load_optimizer_state_dict(model, optimizer, optim_state_dict)
