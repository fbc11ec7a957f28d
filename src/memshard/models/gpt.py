"""GPT (GPT-2 / GPT-3 / Megatron-LM) as a graph: pre-LN layers, learned positions, GeLU MLP,
unfused attention with dropout, tied input/output embeddings, vocab-parallel-able loss.

With dropout on and no parallelism one layer saves ``s·b·h·(34 + 5·a·s/h)`` bytes in fp16,
exactly Korthikanti et al. (2022), eq. 1: every op below says what it keeps.
"""

from __future__ import annotations

from memshard.models.builder import GraphBuilder
from memshard.models.config import ModelConfig


def build_gpt(cfg: ModelConfig, batch: int, seq: int):
    head_dim = cfg.hidden // cfg.heads
    g = GraphBuilder(
        cfg.name,
        cfg.precision,
        {
            "b": batch, "s": seq, "t": seq, "h": cfg.hidden, "n": cfg.heads, "d": head_dim,
            "f": cfg.ffn, "v": cfg.vocab, "p": cfg.max_positions,
        },
    )
    bsh = ("b", "s", "h")
    ids = g.input("input_ids", ("b", "s"))
    labels = g.input("labels", ("b", "s"))
    wte = g.param("wte.weight", ("v", "h"))
    x = g.embedding("embed", ids, ("b", "s"), wte, ("v", "h"), bsh)
    wpe = g.param("wpe.weight", ("p", "h"))
    x = g.op(
        "pos_embed", "embedding_add", [(x, bsh), (wpe, ("p", "h"))],
        (g.activation("pos_embed.out", bsh), bsh), flops_per_point=0.0,
    )
    if cfg.dropout:
        x = g.dropout("embed_dropout", x, bsh)

    for i in range(cfg.num_layers):
        g.begin_layer(i, f"layers.{i}.")
        y = g.norm("ln_1", x, bsh, "h", bias=True)
        q = g.linear("attn.q", y, bsh, ("h", "n", "d"), ("b", "s", "n", "d"), bias=True)
        k = g.linear("attn.k", y, bsh, ("h", "n", "d"), ("b", "s", "n", "d"), bias=True)
        v = g.linear("attn.v", y, bsh, ("h", "n", "d"), ("b", "s", "n", "d"), bias=True)
        scores = g.matmul("attn.scores", (q, ("b", "s", "n", "d")), (k, ("b", "t", "n", "d")), ("b", "n", "s", "t"))
        probs = g.softmax("attn.softmax", scores, ("b", "n", "s", "t"), "t")
        if cfg.dropout:
            probs = g.dropout("attn.attn_dropout", probs, ("b", "n", "s", "t"))
        ctx = g.matmul("attn.context", (probs, ("b", "n", "s", "t")), (v, ("b", "t", "n", "d")), ("b", "s", "n", "d"))
        a = g.linear("attn.proj", ctx, ("b", "s", "n", "d"), ("n", "d", "h"), bsh, bias=True)
        if cfg.dropout:
            a = g.dropout("attn.resid_dropout", a, bsh)
        x = g.add("attn.residual", x, a, bsh)
        y = g.norm("ln_2", x, bsh, "h", bias=True)
        u = g.linear("mlp.fc", y, bsh, ("h", "f"), ("b", "s", "f"), bias=True)
        u = g.activation_fn("mlp.gelu", "gelu", u, ("b", "s", "f"))
        o = g.linear("mlp.proj", u, ("b", "s", "f"), ("f", "h"), bsh, bias=True)
        if cfg.dropout:
            o = g.dropout("mlp.resid_dropout", o, bsh)
        x = g.add("mlp.residual", x, o, bsh)

    g.begin_layer(None)
    y = g.norm("ln_f", x, bsh, "h", bias=True)
    logits = g.linear("lm_head", y, bsh, ("v", "h"), ("b", "s", "v"), bias=False, weight=wte)
    loss = g.cross_entropy("loss", logits, ("b", "s", "v"), labels, ("b", "s"), "v")
    return g.build(loss, cfg.num_layers, family="gpt", config=cfg.name)
