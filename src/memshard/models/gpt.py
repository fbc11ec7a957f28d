"""GPT (GPT-2 / GPT-3 / Megatron-LM) as a graph: pre-LN layers, learned positions, GeLU MLP,
unfused attention with dropout (or fused, ``ModelConfig.fused_attention``), tied input/output
embeddings, vocab-parallel-able loss.

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
        x = g.add("attn.residual", x, g.attention_block(y, cfg.dropout, cfg.fused_attention), bsh)
        y = g.norm("ln_2", x, bsh, "h", bias=True)
        x = g.add("mlp.residual", x, g.gelu_mlp_block(y, cfg.dropout), bsh)

    g.begin_layer(None)
    y = g.norm("ln_f", x, bsh, "h", bias=True)
    logits = g.linear("lm_head", y, bsh, ("v", "h"), ("b", "s", "v"), bias=False, weight=wte)
    loss = g.cross_entropy("loss", logits, ("b", "s", "v"), labels, ("b", "s"), "v")
    return g.build(loss, cfg.num_layers, seq)
