"""LLaMA (LLaMA-2 / LLaMA-3) as a graph: pre-RMSNorm layers without biases or dropout, rotary
positions, grouped-query attention through one fused flash-attention op, SwiGLU MLP, untied
input and output embeddings.

Dims: ``b`` batch, ``s`` query sequence, ``t`` key sequence (= ``s``), ``h`` hidden, ``e``
kv-heads, ``g`` query heads per kv-head (``heads // kv_heads``; 1 without GQA), ``d`` head dim,
``f`` MLP width, ``v`` vocabulary. Queries are ``[b,s,e,g,d]`` and keys/values ``[b,t,e,d]``, so
splitting ``e`` splits the kv-heads together with their query groups (Megatron's GQA tensor
parallelism) and splitting ``g`` keeps keys and values whole on every device.

Attention is ``attn.sdpa``, a fused kernel (FlashAttention / torch SDPA): it never materialises
the ``[s,t]`` scores, keeps q, k, v, its output and an fp32 logsumexp per query row for backward,
and cannot split the key sequence or the head dim. Its FLOPs count the ``s×t`` square (4 per
point: 2 for QKᵀ, 2 for PV); its time, the causal half the kernel computes.

With no parallelism one layer saves, in bf16,
``s·b·h·(12 + 4·kv/heads) + 8·s·b·f`` bytes plus ``4·b·heads·s`` bytes of logsumexp.
"""

from __future__ import annotations

from memshard.core.graph import Graph, SavedBuffer
from memshard.models.builder import GraphBuilder
from memshard.models.config import ModelConfig


def build_llama(cfg: ModelConfig, batch: int, seq: int) -> Graph:
    head_dim = cfg.hidden // cfg.heads
    kv_heads = cfg.num_kv_heads
    g = GraphBuilder(
        cfg.name,
        cfg.precision,
        {
            "b": batch,
            "s": seq,
            "t": seq,
            "h": cfg.hidden,
            "e": kv_heads,
            "g": cfg.heads // kv_heads,
            "d": head_dim,
            "f": cfg.ffn,
            "v": cfg.vocab,
        },
    )
    bsh = ("b", "s", "h")
    bsf = ("b", "s", "f")
    q_dims = ("b", "s", "e", "g", "d")
    kv_dims = ("b", "s", "e", "d")  # as produced; attention names the key sequence "t"
    ids = g.input("input_ids", ("b", "s"))
    labels = g.input("labels", ("b", "s"))
    embed = g.param("embed_tokens.weight", ("v", "h"))
    x = g.embedding("embed", ids, ("b", "s"), embed, ("v", "h"), bsh)

    for i in range(cfg.num_layers):
        g.begin_layer(i, f"layers.{i}.")
        y = g.norm("input_layernorm", x, bsh, "h", bias=False)
        q = g.linear("attn.q", y, bsh, ("h", "e", "g", "d"), q_dims, bias=False)
        k = g.linear("attn.k", y, bsh, ("h", "e", "d"), kv_dims, bias=False)
        v = g.linear("attn.v", y, bsh, ("h", "e", "d"), kv_dims, bias=False)
        q = _rotary(g, "attn.rope_q", q, q_dims)
        k = _rotary(g, "attn.rope_k", k, kv_dims)
        o = g.flash_attention("attn.sdpa", q, k, v, q_dims, ("b", "t", "e", "d"))
        a = g.linear("attn.o", o, q_dims, ("e", "g", "d", "h"), bsh, bias=False)
        x = g.add("attn.residual", x, a, bsh)
        y = g.norm("post_attention_layernorm", x, bsh, "h", bias=False)
        gate = g.linear("mlp.gate", y, bsh, ("h", "f"), bsf, bias=False)
        up = g.linear("mlp.up", y, bsh, ("h", "f"), bsf, bias=False)
        act = g.activation_fn("mlp.act", "silu", gate, bsf)
        u = g.mul("mlp.mul", act, up, bsf)
        o = g.linear("mlp.down", u, bsf, ("f", "h"), bsh, bias=False)
        x = g.add("mlp.residual", x, o, bsh)

    g.begin_layer(None)
    y = g.norm("norm", x, bsh, "h", bias=False)
    logits = g.linear("lm_head", y, bsh, ("h", "v"), ("b", "s", "v"), bias=False)
    loss = g.cross_entropy("loss", logits, ("b", "s", "v"), labels, ("b", "s"), "v")
    return g.build(loss, cfg.num_layers, seq)


def _rotary(g: GraphBuilder, name: str, x: str, dims: tuple[str, ...]) -> str:
    """Rotary embedding: backward needs only its cos/sin tables (d/2 each per position, in
    the activations' dtype), no activation. It mixes the two halves of each head, so it cannot
    split the head dim."""
    return g.op(
        name,
        "rotary",
        [(x, dims)],
        (g.activation(f"{name}.out", dims), dims),
        unsplittable_dims=("d",),
        buffers=(SavedBuffer(g.prefix + f"{name}.cos_sin", ("s", "d"), g.precision.activation_bytes),),
        flops_per_point=3.0,
    )
