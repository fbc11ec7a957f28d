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

The optimizer's parameters are this rank's flat shards, one per parameter (a ZeRO-3 layer
unit's members are parts of the unit's one flat shard, ``GatherUnit``): each value is
gathered over the flat buffer's storage axes and cut at the members' bounds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor import Replicate as TorchReplicate
from torch.distributed.tensor import Shard as TorchShard

from memshard.core.placement import REPLICATE
from memshard.runtime.reshard import as_dtensor, local_of, reshard_local, to_torch


# -- one parameter's values: this rank's flat piece ⇄ a DTensor of the parameter's shape --------
def _whole(piece: torch.Tensor, numel: int, mesh, flat_sharded) -> torch.Tensor:
    """The whole flat buffer (a compute shard, or a unit's) from this rank's piece of it."""
    return reshard_local(piece.detach().reshape(-1), (numel,), mesh, flat_sharded,
                         tuple(REPLICATE for _ in flat_sharded), reverse=True)


def _dtensor(store, local_flat: torch.Tensor) -> DTensor:
    """A DTensor of the parameter's shape in the module: a traced module's graph may view a
    weight in another shape (its heads split), and a state dict holds the module's. That
    reshape may leave strided shards, which DCP does not place: those axes are replicated."""
    local = local_flat.reshape(store.local_shape)
    value = as_dtensor(local, store.mesh, store.compute, store.shape)
    if store.module_shape == store.shape:
        return value
    value = value.reshape(store.module_shape)
    plain = [p if type(p) in (TorchShard, TorchReplicate) else TorchReplicate() for p in value.placements]
    return value.redistribute(store.mesh, plain) if plain != list(value.placements) else value


def _local(store, value: torch.Tensor) -> torch.Tensor:
    """This rank's compute shard of a saved value: a DTensor (any placements on this mesh) or
    a full tensor (sliced here, no communication)."""
    placements = to_torch(store.compute)
    if isinstance(value, DTensor):
        if tuple(value.shape) != store.shape:
            value = value.reshape(store.shape)
        if tuple(value.placements) != tuple(placements):
            value = value.redistribute(store.mesh, placements)
        return value.to_local().reshape(store.local_shape)
    full = value.reshape(store.shape)
    return distribute_tensor(full, store.mesh, placements, src_data_rank=None).to_local()


def _entries(model) -> list[list]:
    """Each flat buffer's member stores (``stores.ParamStore``): a parameter's own, or a
    ZeRO-3 layer unit's members in order."""
    out = [[store] for store in model.stores.values() if store.unit is None]
    return out + [list(unit.stores) for unit in model.units]


def _holder(members) -> tuple[int, object, object, list[int]]:
    """(numel, mesh, flat layout, members' offsets) of the flat buffer the members share."""
    store = members[0]
    if store.unit is not None:
        return store.unit.numel, store.mesh, store.unit.flat_sharded, store.unit.offsets
    layout = store.flat_sharded if store.stage >= 1 else tuple(REPLICATE for _ in store.compute)
    return store.numel, store.mesh, layout, [0]


def _member_slices(members, length: int) -> list[tuple[int, int]]:
    """Each member's part of this rank's piece of the flat buffer (``length`` elements)."""
    unit = members[0].unit
    return unit.member_pieces() if unit is not None else [(0, length)]


def _split(members, pieces: list[torch.Tensor]) -> dict[str, DTensor]:
    """Values of the members' optimizer parameters' sizes (the parameters, or states of
    their sizes; this rank's ``pieces``) as one DTensor of each member's shape."""
    numel, mesh, flat_sharded, offsets = _holder(members)
    piece = torch.cat([p.reshape(-1) for p in pieces]) if len(pieces) > 1 else pieces[0]
    whole = _whole(piece, numel, mesh, flat_sharded)
    return {store.name: _dtensor(store, whole[start:start + store.numel])
            for store, start in zip(members, offsets)}


def _piece_range(members) -> tuple[int, int]:
    """Where this rank's piece lies in the flat buffer."""
    store = members[0]
    if store.unit is not None:
        return store.unit.piece_range()
    if store.stage == 0:
        return 0, store.numel
    return store.flat_start, store.flat_start + store.flat_len


def _join(members, values: Callable[[str], torch.Tensor], dtype, device) -> list[torch.Tensor]:
    """Each member's part of this rank's piece, from each member's saved value."""
    _, _, _, offsets = _holder(members)
    lo, hi = _piece_range(members)
    out = torch.empty(hi - lo, dtype=dtype, device=device)
    for store, start in zip(members, offsets):
        begin, stop = max(lo, start), min(hi, start + store.numel)
        if begin < stop:
            flat = _local(store, values(store.name)).reshape(-1)
            out[begin - lo:stop - lo].copy_(flat[begin - start:stop - start])
    return [out[a:b] for a, b in _member_slices(members, hi - lo)]


# -- the model ---------------------------------------------------------------------------------
@torch.no_grad()
def model_state_dict(model) -> dict[str, DTensor]:
    """Every parameter by the module's name: a DTensor of its shape in its compute layout,
    in the dtype of the shard the optimizer updates (under mixed precision a ZeRO-3 shard is
    the fp32 master)."""
    model.wait_gathered()  # (an optimizer step's gathers, run beside the compute)
    out: dict[str, DTensor] = {}
    for members in _entries(model):
        out.update(_split(members, [local_of(store.opt) for store in members]))
    return {name: out[name] for name in model.graph.parameters}


@torch.no_grad()
def load_model_state_dict(model, state: Mapping[str, torch.Tensor]) -> None:
    """Write ``state`` (DTensors in any layout on this mesh, or full tensors) into the shards
    and the compute weights."""
    model.wait_gathered()  # (an optimizer step's gathers, run beside the compute)
    missing = [name for name in model.graph.parameters if name not in state]
    if missing:
        raise KeyError(f"the state dict lacks {', '.join(missing[:5])}")
    for members in _entries(model):
        shard = local_of(members[0].opt)
        for store, piece in zip(members, _join(members, state.__getitem__, shard.dtype, shard.device)):
            local_of(store.opt).copy_(piece)
        store = members[0]
        if store.unit is None and store.stage < 3:  # the compute weight around the shard
            store.param.to_local().copy_(_local(store, state[store.name]))
            store.gathered_version = store.version()


# -- the optimizer -----------------------------------------------------------------------------
def _init_optimizer_state(model, optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter its optimizer states, as ``torch.distributed.checkpoint`` does
    before loading into an optimizer that has not stepped: a step with zero gradients and a
    learning rate of zero (the model's step count kept)."""
    if all(p in optimizer.state for group in optimizer.param_groups for p in group["params"]):
        return
    step, rates = model.step, [group["lr"] for group in optimizer.param_groups]
    for store in model.stores.values():
        store.opt.grad = torch.zeros_like(store.opt)
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, rates):
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    model.step = step


def _is_sized(value, store) -> bool:
    """Whether an optimizer state is of its parameter's size (a DTensor like it, or local)."""
    return torch.is_tensor(value) and value.dim() > 0 and local_of(value).shape == local_of(store.opt).shape


@torch.no_grad()
def optimizer_state_dict(model, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state by the module's names (``get_state_dict``'s conventions): a
    state of a parameter's size as a DTensor like the parameter's, a scalar as it is."""
    _init_optimizer_state(model, optimizer)
    names = {id(store.opt): name for name, store in model.stores.items()}
    state: dict[str, dict] = {}
    for members in _entries(model):
        per_member: dict[str, dict] = {store.name: {} for store in members}
        for key, value in optimizer.state.get(members[0].opt, {}).items():
            if _is_sized(value, members[0]):
                pieces = [local_of(optimizer.state[store.opt][key]) for store in members]
                for name, tensor in _split(members, pieces).items():
                    per_member[name][key] = tensor
                continue
            for store in members:
                own = optimizer.state[store.opt][key]
                per_member[store.name][key] = own.clone() if torch.is_tensor(own) else own
        state.update(per_member)
    groups = []
    for group in optimizer.param_groups:
        params = [names[id(p)] for p in group["params"] if id(p) in names]
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    return {"state": {name: state[name] for name in model.graph.parameters if name in state},
            "param_groups": groups}


@torch.no_grad()
def load_optimizer_state_dict(model, optimizer: torch.optim.Optimizer, state: Mapping) -> None:
    """Set the optimizer's states and hyperparameters from ``state`` (the conventions of
    :func:`optimizer_state_dict`; DTensors in any layout on this mesh, or full tensors)."""
    _init_optimizer_state(model, optimizer)
    saved = state["state"]
    for members in _entries(model):
        for key, value in list(optimizer.state[members[0].opt].items()):
            if _is_sized(value, members[0]):
                local = local_of(value)
                pieces = _join(members, lambda name, key=key: saved[name][key], local.dtype, local.device)
                for store, piece in zip(members, pieces):
                    local_of(optimizer.state[store.opt][key]).copy_(piece)
                continue
            for store in members:
                current = optimizer.state[store.opt]
                if torch.is_tensor(current[key]):
                    current[key].copy_(torch.as_tensor(saved[store.name][key]))
                else:
                    current[key] = saved[store.name][key]
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
