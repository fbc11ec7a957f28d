"""Activation recomputation: which ops a layer's backward can replay, and the named policies.

A replayed op runs its forward twice: once in the forward pass, where nothing it produces is
kept for backward (its output's saved copies, its own saved output, its buffers such as a
dropout mask), and again when backward reaches its layer, before the layer's first backward
op. Everything it produces lives again from then until the backward that needs it. This is
PyTorch's non-reentrant activation checkpointing with a selective policy, the region being
one layer: the ops marked "recompute" are replayed, the others' saved tensors are kept.

The replay reads each input from the replayed producer, from the replayed op's own saved copy
(kept, as it is not replayed), or from the producer's tensor held from the forward until the
replay (the checkpoint's region inputs; priced as a holder of its own, ``problem.SOURCE``).

An op can be replayed when it belongs to a layer and every op that saves its output belongs
to the same layer (a saved copy is made again by the replay of its consumer's layer), and a
pipeline stage does not send its output on (``Graph.sent``: kept for the next stage's
gradient, as a layer keeps its output for the next layer). The policies:

- ``none``: nothing is replayed (the problem is the one without recomputation);
- ``selective``: Megatron-LM's core-attention recomputation — the attention scores, their
  softmax and its dropout are replayed (``core_attention``);
- Megatron-LM's MLP module (``--recompute-modules mlp``; ``mlp_module``, a baseline's variant,
  not a search policy): the pre-MLP norm, the MLP's linears and activation replayed;
- ``full``: every replayable op (Megatron-LM's full recomputation, torchtitan's full
  activation checkpointing: a layer keeps its input and nothing else);
- torchtitan's per-op selective checkpointing (``op_level_replayed``; a baseline's variant, not
  a search policy): the matmuls' and fused attention's outputs kept, every other op replayed;
- ``auto``: the ILP chooses, per op role shared by the identical layers, whether to replay.
"""

from __future__ import annotations

from memshard.core.graph import Graph

RECOMPUTE_POLICIES = ("none", "selective", "full", "auto")


def replayable_ops(graph: Graph) -> set[int]:
    """The ops that can be replayed: in a layer, their output saved only by ops of it and not
    sent to another pipeline stage."""
    out = set()
    for i, op in enumerate(graph.ops):
        if op.layer is None or op.output.tensor in graph.sent:
            continue
        savers = [graph.ops[c] for c, j in graph.consumers.get(op.output.tensor, ()) if j in graph.ops[c].saves_inputs]
        if all(c.layer == op.layer for c in savers):
            out.add(i)
    return out


def core_attention(graph: Graph) -> set[int]:
    """Megatron-LM's core attention: a softmax inside a layer, the matmul that makes its
    input (the attention scores) and a dropout applied to its output."""
    out = set()
    for i, op in enumerate(graph.ops):
        if op.kind != "softmax" or op.layer is None:
            continue
        out.add(i)
        scores = graph.producer.get(op.inputs[0].tensor)
        if scores is not None and graph.ops[scores].kind == "matmul":
            out.add(scores)
        for c, _ in graph.consumers.get(op.output.tensor, ()):
            if graph.ops[c].kind == "dropout":
                out.add(c)
    return out


NORMS = ("layernorm", "rmsnorm")


def mlp_module(graph: Graph) -> set[int]:
    """Megatron-LM's ``--recompute-modules mlp``: each layer's MLP module run under its
    checkpoint (``TransformerLayer._run_mlp``), from the pre-MLP norm (fused into the first
    linear by Transformer Engine, so recomputed with it; the checkpoint keeps the norm's
    input) to the MLP's last linear. The bias-dropout-add after it is not in the module. In
    memshard's graph: the ops of a layer from its last norm to its last linear."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, op in enumerate(graph.ops):
        if op.layer is None:
            continue
        if op.kind in NORMS:
            first[op.layer] = i
        elif op.kind == "linear":
            last[op.layer] = i
    return {i for layer, start in first.items() if layer in last for i in range(start, last[layer] + 1)}


# Op kinds whose output torchtitan's per-op policy saves: the compute-intensive aten ops
# (functorch's list: ``mm``, ``addmm``, ``bmm``, the fused attention kernels).
COMPUTE_INTENSIVE = ("linear", "matmul", "sdpa")


def op_level_replayed(graph: Graph) -> set[int]:
    """The ops torchtitan's per-op selective activation checkpointing recomputes
    (``selective_ac_option = "op"``: each block under ``torch.utils.checkpoint`` with a
    selective policy that must save the outputs of the compute-intensive ops and prefers to
    recompute the rest): every replayable op but the compute-intensive ones, and of those every
    second ``aten.mm`` of its block in forward order — a linear without a bias; one with a bias
    runs as ``aten.addmm``, which the policy saves without counting."""
    replayed, mm_count = set(), {}
    for i, op in enumerate(graph.ops):
        if op.layer is None:
            continue
        if op.kind == "linear" and len(op.inputs) == 2:  # (input, weight): aten.mm
            mm_count[op.layer] = mm_count.get(op.layer, 0) + 1
            if mm_count[op.layer] % 2 == 0:
                replayed.add(i)
        elif op.kind not in COMPUTE_INTENSIVE:
            replayed.add(i)
    return replayed & replayable_ops(graph)


def replay_flags(graph: Graph, policy: str) -> list[tuple[bool, ...]]:
    """Per op, whether it may be replayed: (False,) never, (True,) always (a fixed policy),
    (False, True) the search chooses. Decided per role, so identical layers agree."""
    if policy not in RECOMPUTE_POLICIES:
        raise ValueError(f"unknown recomputation policy {policy!r}")
    replayable = replayable_ops(graph)
    if policy == "selective":
        replayable &= core_attention(graph)
    by_role: dict[str, bool] = {}
    for i, op in enumerate(graph.ops):
        if op.role is not None:
            by_role[op.share_key] = by_role.get(op.share_key, True) and i in replayable
    flags = []
    for op in graph.ops:
        able = by_role.get(op.share_key, False) if op.role is not None else False
        if policy == "none" or not able:
            flags.append((False,))
        else:
            flags.append((False, True) if policy == "auto" else (True,))
    return flags


def layer_ends(graph: Graph) -> dict[int, int]:
    """Layer → the index of its last op (the replay runs before that op's backward)."""
    ends: dict[int, int] = {}
    for i, op in enumerate(graph.ops):
        if op.layer is not None:
            ends[op.layer] = i
    return ends


def replay_starts(graph: Graph, on_first_unpack: bool = False) -> dict[int, int]:
    """Layer → the op at whose backward the layer's replay runs (its replayed tensors live
    from there). memshard's runtime and Megatron-LM replay as the layer's backward begins:
    at its last op. PyTorch's non-reentrant checkpoint (``on_first_unpack``) recomputes when
    backward first unpacks a tensor the region saved: at the layer's last op that saves one
    (the ops after it, such as a residual add, run their backward before it)."""
    starts = layer_ends(graph)
    if on_first_unpack:
        for i, op in enumerate(graph.ops):
            if op.layer is not None and (op.saves_inputs or op.saves_output or op.buffers):
                starts[op.layer] = i
    return starts
