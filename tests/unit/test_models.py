"""Model builders: parameter counts, graph structure, saved activations and input checks."""

from __future__ import annotations

from functools import cache

import pytest

from memshard.core.errors import MemshardError
from memshard.core.graph import FP32, Graph, Origin, TensorKind
from memshard.models import PRESETS, ModelConfig, build_graph, get_config
from memshard.models.bert import build_bert

SMALL = {"batch": 2, "seq": 16}


@cache
def small(name: str) -> Graph:
    return build_graph(name, **SMALL)


# -- parameter counts -------------------------------------------------------------------------
def closed_form_parameters(name: str | ModelConfig) -> int:
    """Parameter count derived layer by layer from the architecture, not from the graph."""
    c = PRESETS[name] if isinstance(name, str) else name
    L, h, f, V, P = c.num_layers, c.hidden, c.ffn, c.vocab, c.max_positions
    if c.family == "gpt":
        attn = 3 * (h * h + h) + (h * h + h)  # q, k, v, proj with biases
        mlp = (h * f + f) + (f * h + h)
        norms = 2 * 2 * h  # two LayerNorms, weight + bias
        # tied wte, learned wpe, final LayerNorm
        return V * h + P * h + L * (attn + mlp + norms) + 2 * h
    if c.family == "llama":
        kv = h * c.num_kv_heads // c.heads  # width of k and of v
        attn = h * h + 2 * h * kv + h * h  # q, k, v, o; no biases
        mlp = 3 * h * f  # gate, up, down
        norms = 2 * h  # two RMSNorms, weight only
        # untied embed_tokens and lm_head, final RMSNorm
        return 2 * V * h + L * (attn + mlp + norms) + h
    if c.family == "bert":
        embeddings = V * h + P * h + 2 * h + 2 * h  # words, positions, 2 token types, LayerNorm
        layer = 4 * (h * h + h) + (h * f + f) + (f * h + h) + 2 * 2 * h
        mlm_head = (h * h + h) + 2 * h + V  # dense, LayerNorm, decoder bias (weight tied)
        return embeddings + L * layer + mlm_head
    raise AssertionError(c.family)


@pytest.mark.parametrize("name", list(PRESETS))
def test_parameters_match_closed_form(name):
    assert small(name).num_parameters == closed_form_parameters(name)


@pytest.mark.parametrize("name", [n for n, c in PRESETS.items() if c.published_parameters])
def test_parameters_near_preset_figure(name):
    # GPT-3's smaller sizes are nominal in the paper (1.3B is really 1.316B): 2 %.
    published = PRESETS[name].published_parameters
    assert abs(small(name).num_parameters / published - 1) < 0.02


@pytest.mark.parametrize(
    "name, exact",
    [
        ("gpt2", 124_439_808),  # HF GPT2LMHeadModel
        ("llama2-7b", 6_738_415_616),  # HF LlamaForCausalLM
        ("llama2-70b", 68_976_648_192),
        ("llama3-8b", 8_030_261_248),
        ("llama3-70b", 70_553_706_496),
    ],
)
def test_parameters_exact_published(name, exact):
    assert small(name).num_parameters == exact


def test_gpt3_175b_parameters():
    assert abs(small("gpt3-175b").num_parameters / 174.6e9 - 1) < 1e-3


def test_bert_large_parameters():
    # HF bert-large-uncased BertModel: 335,141,888, of which the pooler is 1024·1024 + 1024.
    # The graph drops the pooler and adds the MLM head: dense 1024·1024 + 1024, LayerNorm
    # 2·1024 and the decoder bias 30,522 (its weight is the word embedding).
    expected = 335_141_888 - 1_049_600 + (1_049_600 + 2_048 + 30_522)
    assert expected == 335_174_458
    n = small("bert-large").num_parameters
    assert n == expected
    assert abs(n / (335_141_888 - 1_049_600) - 1) < 0.01


# -- structure --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["gpt2", "llama2-7b", "llama3-8b", "bert-large"])
def test_layers_repeat_the_same_roles(name):
    graph = small(name)
    graph.validate()
    assert len({op.name for op in graph.ops}) == len(graph.ops)
    per_layer: dict[int, list[str]] = {}
    for op in graph.ops:
        assert (op.layer is None) == (op.role is None)
        if op.layer is not None:
            assert op.name == f"layers.{op.layer}.{op.role}"
            per_layer.setdefault(op.layer, []).append(op.role)
    assert sorted(per_layer) == list(range(graph.num_layers))
    assert graph.num_layers == PRESETS[name].num_layers
    first = per_layer[0]
    assert all(roles == first for roles in per_layer.values())
    # each role occurs once per layer, and the layers are contiguous runs in forward order
    assert all(len(graph.roles[r]) == graph.num_layers for r in first)
    layers = [op.layer for op in graph.ops if op.layer is not None]
    assert layers == sorted(layers)


@pytest.mark.parametrize(
    "name, role", [("gpt2", "mlp.fc"), ("llama3-8b", "mlp.up"), ("bert-large", "mlp.fc")]
)
def test_linear_flops(name, role):
    graph = small(name)
    c = PRESETS[name]
    op = graph.ops[graph.roles[role][0]]
    assert op.kind == "linear"
    assert graph.flops(op) == 2 * SMALL["batch"] * SMALL["seq"] * c.hidden * c.ffn
    assert op.contracted_dims == ("h",)


def saved_bytes_per_layer(graph: Graph, layer: int) -> int:
    """Unique bytes the ops of one layer keep for backward, with no parallelism."""
    saved: set[str] = set()
    buffers = 0
    for op in graph.ops:
        if op.layer != layer:
            continue
        saved.update(op.inputs[i].tensor for i in op.saves_inputs)
        if op.saves_output:
            saved.add(op.output.tensor)
        sizes = graph.dim_sizes(op)
        for buf in op.buffers:
            n = buf.dtype_bytes
            for d in buf.dims:
                n *= sizes[d]
            buffers += n
    kinds = {graph.tensors[t].kind for t in saved}
    assert kinds <= {TensorKind.ACTIVATION}
    return sum(graph.tensors[t].nbytes for t in saved) + buffers


@pytest.mark.parametrize("name", ["gpt2", "bert-large"])
def test_saved_activations_korthikanti(name):
    # s·b·h·(34 + 5·a·s/h) bytes per layer in fp16 with dropout (Korthikanti et al., eq. 1);
    # post-LN BERT saves the same tensors as pre-LN GPT, just in another order.
    c = PRESETS[name]
    b, s, h, a = SMALL["batch"], SMALL["seq"], c.hidden, c.heads
    expected = s * b * h * 34 + 5 * a * s * s * b
    graph = small(name)
    assert saved_bytes_per_layer(graph, 0) == expected
    assert saved_bytes_per_layer(graph, graph.num_layers - 1) == expected


@pytest.mark.parametrize("name", ["llama2-7b", "llama3-8b"])
def test_saved_activations_llama(name):
    # bf16: x and y at both norms / linears (8 sbh), rotated q and attention output (4 sbh),
    # rotated k and v (4 sbh·kv/heads), gate, silu and up and the product (8 sbf),
    # plus the fp32 logsumexp (4 b·heads·s) and the two rotary ops' bf16 cos/sin tables
    # (head_dim / 2 each per position: 2 · 2 s·head_dim).
    c = PRESETS[name]
    b, s, h, f = SMALL["batch"], SMALL["seq"], c.hidden, c.ffn
    expected = 12 * s * b * h + 4 * s * b * h * c.num_kv_heads // c.heads + 8 * s * b * f
    expected += 4 * b * c.heads * s + 4 * s * (h // c.heads)
    assert saved_bytes_per_layer(small(name), 0) == expected


def test_llama_attention_is_one_fused_gqa_op():
    graph = small("llama3-8b")
    c = PRESETS["llama3-8b"]
    d = c.hidden // c.heads
    t = graph.tensors
    assert t["layers.0.attn.q.weight"].shape == (c.hidden, 8, 4, d)
    assert t["layers.0.attn.k.weight"].shape == (c.hidden, 8, d)
    assert t["layers.0.attn.v.weight"].shape == (c.hidden, 8, d)
    assert t["layers.0.attn.o.weight"].shape == (8, 4, d, c.hidden)
    sdpa = [op for op in graph.ops if op.kind == "sdpa"]
    assert len(sdpa) == c.num_layers
    op = sdpa[0]
    assert [o.dims for o in op.inputs] == [
        ("b", "s", "e", "g", "d"),
        ("b", "t", "e", "d"),
        ("b", "t", "e", "d"),
    ]
    assert op.output.dims == ("b", "s", "e", "g", "d")
    assert op.inputs[0].tensor == "layers.0.attn.rope_q.out"
    assert op.inputs[1].tensor == "layers.0.attn.rope_k.out"
    assert op.inputs[2].tensor == "layers.0.attn.v.out"
    assert op.reduced_dims == ("t",) and set(op.unsplittable_dims) == {"t", "d"}
    assert op.contracted_dims == ()
    assert op.saves_inputs == (0, 1, 2) and op.saves_output
    (lse,) = op.buffers
    assert lse.dims == ("b", "e", "g", "s") and lse.dtype_bytes == 4
    b, s = SMALL["batch"], SMALL["seq"]
    assert graph.flops(op) == 4 * b * s * s * c.heads * d
    assert op.backward_flops_ratio == 2.5
    assert len({o.buffers[0].name for o in sdpa}) == c.num_layers
    rope = graph.ops[graph.roles["attn.rope_q"][0]]
    assert rope.kind == "rotary" and not rope.saves_inputs and not rope.saves_output
    assert graph.flops(rope) == 3 * b * s * c.hidden


def test_llama_has_no_bias_dropout_or_tied_head():
    graph = small("llama2-7b")
    assert not [p for p in graph.parameters if p.endswith(".bias")]
    assert not [op for op in graph.ops if op.kind in ("dropout", "layernorm", "softmax")]
    assert {op.kind for op in graph.ops if "norm" in op.name} == {"rmsnorm"}
    head = graph.ops[graph.roles["#lm_head"][0]]
    assert head.inputs[1].tensor == "lm_head.weight" != "embed_tokens.weight"
    assert graph.tensors["lm_head.weight"].shape == (4096, 32000)
    assert graph.origin is Origin.BUILT and graph.name == "llama2-7b" and graph.seq == SMALL["seq"]
    assert graph.ops[-1].kind == "cross_entropy" and graph.loss == "loss.out"


def test_bert_is_post_ln_with_tied_decoder():
    graph = small("bert-large")
    layer0 = [op for op in graph.ops if op.layer == 0]
    assert layer0[0].role == "attn.q" and layer0[-1].role == "ln_2"  # ends in its LayerNorm
    dense = graph.ops[graph.roles["#mlm.dense"][0]]
    assert dense.inputs[0].tensor == f"layers.{graph.num_layers - 1}.ln_2.out"
    for residual, norm in (("attn.residual", "ln_1"), ("mlp.residual", "ln_2")):
        op = graph.ops[graph.roles[norm][0]]
        assert op.kind == "layernorm"
        assert op.inputs[0].tensor == graph.ops[graph.roles[residual][0]].output.tensor
    decoder = graph.ops[graph.roles["#mlm.decoder"][0]]
    assert decoder.inputs[1].tensor == "word_embeddings.weight"
    assert graph.tensors["mlm.decoder.bias"].shape == (30522,)
    assert "mlm.decoder.weight" not in graph.tensors
    assert not [p for p in graph.parameters if "pooler" in p]
    types = graph.ops[graph.roles["#type_embed"][0]]
    assert types.inputs[1].tensor == "token_type_ids"
    assert graph.tensors["token_type_embeddings.weight"].shape == (2, 1024)
    assert graph.flops(dense) == 2 * SMALL["batch"] * SMALL["seq"] * 1024 * 1024
    assert graph.origin is Origin.BUILT and graph.name == "bert-large" and graph.seq == SMALL["seq"]


def test_dropout_off_removes_dropout_ops():
    for name in ("gpt2", "bert-large"):
        graph = build_graph(name, dropout=False, num_layers=2, **SMALL)
        assert not [op for op in graph.ops if op.kind == "dropout"]
        assert not [op for op in graph.ops if op.buffers]


def test_fp32_precision():
    graph = build_graph("llama3-8b", num_layers=1, precision="fp32", **SMALL)
    assert graph.precision is FP32
    assert graph.tensors["lm_head.weight"].dtype_bytes == 4
    assert graph.tensors["layers.0.mlp.up.out"].dtype_bytes == 4


# -- input checks -----------------------------------------------------------------------------
@pytest.mark.parametrize("name, positions", [("gpt2", 1024), ("bert-large", 512)])
def test_sequence_longer_than_positions(name, positions):
    build_graph(name, batch=1, seq=positions, num_layers=1)
    with pytest.raises(MemshardError, match="positions"):
        build_graph(name, batch=1, seq=positions + 1, num_layers=1)


def test_bert_builder_checks_positions_itself():
    with pytest.raises(MemshardError, match="positions"):
        build_bert(get_config("bert-large", num_layers=1), 1, 513)


def test_llama_sequence_is_not_limited_by_positions():
    graph = build_graph("llama2-7b", batch=1, seq=8192, num_layers=1)
    assert graph.tensors["layers.0.attn.sdpa.out"].shape[1] == 8192


def test_get_config_overrides():
    cfg = get_config("llama3-8b", num_layers=2)
    assert cfg.num_layers == 2 and cfg.kv_heads == 8 and cfg.published_parameters is None
    graph = build_graph(cfg, batch=1, seq=32)
    assert graph.num_layers == 2
    assert len(graph.roles["attn.sdpa"]) == 2
    assert get_config("GPT2-124M").name == "gpt2"
    assert get_config("gpt2").published_parameters == PRESETS["gpt2"].published_parameters


@pytest.mark.parametrize(
    "call",
    [
        lambda: get_config("gpt5"),
        lambda: build_graph("no-such-model"),
        lambda: get_config("gpt2", precision="fp8"),
        lambda: build_graph("gpt2", batch=0),
        lambda: get_config("llama2-7b", kv_heads=5),
        lambda: get_config("gpt2", heads=7),
    ],
)
def test_bad_requests_raise(call):
    with pytest.raises(MemshardError):
        call()


# -- what an override of the hidden size means (models.follow_hidden) ----------------------------
def sizes(cfg: ModelConfig) -> tuple[int, ...]:
    return cfg.num_layers, cfg.hidden, cfg.heads, cfg.num_kv_heads, cfg.ffn, cfg.vocab


@pytest.mark.parametrize("name, knobs, expected", [
    # the head size (5120 / 40 = 128) and the MLP's ratio (4×) kept
    ("gpt3-13b", dict(hidden=2304), (40, 2304, 18, 18, 9216, 50257)),
    # a knob given too wins; the others still follow
    ("gpt3-13b", dict(hidden=2304, ffn=8000), (40, 2304, 18, 18, 8000, 50257)),
    ("gpt3-13b", dict(hidden=2304, heads=36), (40, 2304, 36, 36, 9216, 50257)),
    # grouped-query attention: 4 heads per kv-head kept, 14336 / 4096 = 3.5× kept
    ("llama3-8b", dict(hidden=2048), (32, 2048, 16, 4, 7168, 128256)),
    ("llama3-8b", dict(hidden=2048, heads=32), (32, 2048, 32, 8, 7168, 128256)),
    ("llama3-8b", dict(hidden=2048, kv_heads=16), (32, 2048, 16, 16, 7168, 128256)),
    # LLaMA-2 7B's MLP is 2.6875× its hidden size
    ("llama2-7b", dict(hidden=1024, num_layers=2), (2, 1024, 8, 8, 2752, 32000)),
    # the preset's own hidden size is the preset; without --hidden nothing follows
    ("gpt2", dict(hidden=768), (12, 768, 12, 12, 3072, 50257)),
    ("llama3-8b", dict(heads=16), (32, 4096, 16, 8, 14336, 128256)),
])
def test_an_overridden_hidden_size_carries_the_heads_and_mlp_width(name, knobs, expected):
    cfg = get_config(name, **knobs)
    assert sizes(cfg) == expected
    graph = build_graph(cfg, **SMALL)
    assert graph.num_parameters == closed_form_parameters(cfg)


def test_a_model_config_is_resized_as_a_preset_is():
    from memshard.models.config import resized

    assert sizes(resized(PRESETS["gpt3-13b"], {"hidden": 2304})) == sizes(get_config("gpt3-13b", hidden=2304))
    assert sizes(resized(PRESETS["tiny-llama"], {"hidden": 256})) == (2, 256, 8, 4, 512, 512)


def test_the_overridden_sizes_read_as_the_flags_take_them():
    assert get_config("gpt3-13b", hidden=2304).sizes == "40 layers, hidden 2304, 18 heads, ffn 9216, vocab 50257"
    assert get_config("llama3-8b", num_layers=1).sizes == "1 layer, hidden 4096, 32 heads, 8 kv-heads, ffn 14336, " \
                                                           "vocab 128256"


@pytest.mark.parametrize("name, knobs, message", [
    ("gpt3-13b", dict(hidden=2300), "head size 128"),  # not whole heads
    ("llama3-8b", dict(hidden=640), "multiple of 512"),  # 5 heads: not whole groups of 4 per kv-head
    ("llama3-8b", dict(hidden=2048, heads=6), "kv-heads too"),
    ("gpt2", dict(hidden=128, heads=3), "not divisible by 3 heads"),
    ("llama3-8b", dict(hidden=1024, kv_heads=3), "not divisible by 3 kv-heads"),
    ("gpt2", dict(vocab=1 << 25), "16,777,216"),
])
def test_an_inconsistent_override_is_one_clear_error(name, knobs, message):
    with pytest.raises(MemshardError, match=message):
        get_config(name, **knobs)
