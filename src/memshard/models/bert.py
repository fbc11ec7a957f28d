"""BERT (BERT-large, as HF ``BertForMaskedLM``) as a graph: post-LN layers (LayerNorm after each
residual add), learned positions and token-type embeddings, GeLU MLP, unfused bidirectional
attention with dropout, biases everywhere, and the masked-LM head (dense, GeLU, LayerNorm,
decoder tied to the word embeddings with its own bias).

The pooler and the next-sentence-prediction head are left out: pre-training with MLM alone (as
RoBERTa does and as HF ``BertForMaskedLM`` builds it) does not use them. The loss is taken over
every position (the masked-position gather is not modelled).

Dims: ``b`` batch, ``s``/``t`` query/key sequence, ``h`` hidden, ``n`` heads, ``d`` head dim,
``f`` MLP width, ``v`` vocabulary, ``p`` position-table rows, ``y`` token types (2), and ``c``,
a second name for the hidden size, for the input side of the square ``h→h`` MLM dense layer.

With dropout on and no parallelism one layer saves ``s·b·h·(34 + 5·a·s/h)`` bytes in fp16, the
same as the pre-LN GPT layer: each LayerNorm saves its input (the residual sum) and its output is
what the next linears save.
"""

from __future__ import annotations

from memshard.core.errors import MemshardError
from memshard.core.graph import Graph
from memshard.models.builder import GraphBuilder
from memshard.models.config import ModelConfig

TOKEN_TYPES = 2


def build_bert(cfg: ModelConfig, batch: int, seq: int) -> Graph:
    if seq > cfg.max_positions:
        raise MemshardError(f"{cfg.name} has {cfg.max_positions} positions; --seq {seq} is longer")
    head_dim = cfg.hidden // cfg.heads
    g = GraphBuilder(
        cfg.name,
        cfg.precision,
        {
            "b": batch,
            "s": seq,
            "t": seq,
            "h": cfg.hidden,
            "c": cfg.hidden,
            "n": cfg.heads,
            "d": head_dim,
            "f": cfg.ffn,
            "v": cfg.vocab,
            "p": cfg.max_positions,
            "y": TOKEN_TYPES,
        },
    )
    bsh = ("b", "s", "h")
    ids = g.input("input_ids", ("b", "s"))
    token_types = g.input("token_type_ids", ("b", "s"))
    labels = g.input("labels", ("b", "s"))
    word = g.param("word_embeddings.weight", ("v", "h"))
    x = g.embedding("embed", ids, ("b", "s"), word, ("v", "h"), bsh)
    wpe = g.param("position_embeddings.weight", ("p", "h"))
    x = g.op(
        "pos_embed",
        "embedding_add",
        [(x, bsh), (wpe, ("p", "h"))],
        (g.activation("pos_embed.out", bsh), bsh),
        flops_per_point=0.0,
    )
    wtt = g.param("token_type_embeddings.weight", ("y", "h"))
    # Unlike positions (an arange), token types are data: backward needs the ids to scatter
    # the table's gradient, so the op reads and keeps them.
    x = g.op(
        "type_embed",
        "embedding_add",
        [(x, bsh), (token_types, ("b", "s")), (wtt, ("y", "h"))],
        (g.activation("type_embed.out", bsh), bsh),
        saves_inputs=(1,),
        flops_per_point=0.0,
    )
    x = g.norm("embed_ln", x, bsh, "h", bias=True)
    if cfg.dropout:
        x = g.dropout("embed_dropout", x, bsh)

    for i in range(cfg.num_layers):
        g.begin_layer(i, f"layers.{i}.")
        x = g.add("attn.residual", x, g.attention_block(x, cfg.dropout), bsh)
        x = g.norm("ln_1", x, bsh, "h", bias=True)  # post-LN: the norm follows the add
        x = g.add("mlp.residual", x, g.gelu_mlp_block(x, cfg.dropout), bsh)
        x = g.norm("ln_2", x, bsh, "h", bias=True)

    g.begin_layer(None)
    y = g.linear("mlm.dense", x, ("b", "s", "c"), ("c", "h"), bsh, bias=True)
    y = g.activation_fn("mlm.gelu", "gelu", y, bsh)
    y = g.norm("mlm.ln", y, bsh, "h", bias=True)
    logits = g.linear("mlm.decoder", y, bsh, ("v", "h"), ("b", "s", "v"), bias=True, weight=word)
    loss = g.cross_entropy("loss", logits, ("b", "s", "v"), labels, ("b", "s"), "v")
    return g.build(loss, cfg.num_layers, seq)
