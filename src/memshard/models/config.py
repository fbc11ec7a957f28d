"""Model configurations, the built-in presets, and the one meaning of an override of a size.

A preset fixes the architecture (layers, hidden, heads, ffn, vocab); batch and sequence
length are given when a graph is built. Published parameter counts are kept next to each
preset so tests can check the builders against them.

Overriding the hidden size resizes the model the way ``memshard fit --max hidden`` grows it
(:func:`follow_hidden`): the attention heads keep their size, the key/value heads their group
of heads, the MLP width its ratio to the hidden size; a follower given too wins. Every command
and the Python API mean this, for presets, ``ModelConfig`` objects and Hugging Face configs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from memshard.core.errors import MemshardError
from memshard.core.graph import AUTOCAST, FP32, MIXED, PRECISIONS, Precision
from memshard.core.quantities import MAX_COUNT

MAX_LAYERS = 4096  # a guard against runaway input: no model comes near it


@dataclass(frozen=True)
class Width:
    """A model's hidden size and the sizes that follow it: attention heads, key/value heads and
    MLP width (None: the model derives it from the hidden size, as GPT-2's ``n_inner``)."""

    hidden: int
    heads: int
    kv_heads: int
    ffn: int | None


def follow_hidden(base: Width, hidden: int, given: Mapping[str, Any], name: str) -> Width:
    """``base`` resized to ``hidden``, as ``fit --max hidden`` grows a model: as many heads as
    keep the head size (``hidden × heads / base hidden``), as many key/value heads as keep the
    heads per key/value head, the MLP width in the same ratio to the hidden size (rounded). A
    follower in ``given`` (``heads``, ``kv_heads``, ``ffn``) wins over its resized value; the
    key/value heads then follow the heads given. ``name``: the model, for the messages."""
    size = base.hidden // base.heads
    heads = given.get("heads")
    if heads is None:
        if hidden * base.heads % base.hidden:
            raise MemshardError(f"{name}: hidden size {hidden} does not keep its head size {size}: give a multiple "
                                f"of {size}, or the heads too")
        heads = hidden * base.heads // base.hidden
    kv_heads = given.get("kv_heads")
    if kv_heads is None:
        group = max(1, base.heads // base.kv_heads)
        if heads % group:
            instead = "the kv-heads too" if "heads" in given else (
                f"a multiple of {size * group} (whole groups), or the kv-heads too")
            raise MemshardError(f"{name}: {heads} heads do not keep its {group} heads per kv-head: give {instead}")
        kv_heads = heads // group
    ffn = given.get("ffn")
    if ffn is None and base.ffn is not None:
        ffn = max(1, round(base.ffn * hidden / base.hidden))
    return Width(hidden, heads, kv_heads, ffn)


def describe_sizes(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int | None, vocab: int) -> str:
    """``40 layers, hidden 2304, 18 heads, ffn 9216, vocab 50257`` (the kv-heads where they differ
    from the heads; no ffn where it is unknown): what a report gives beside an overridden
    model's name."""
    kv = f", {kv_heads} kv-heads" if kv_heads != heads else ""
    mlp = f", ffn {ffn}" if ffn is not None else ""
    return (f"{layers} layer{'' if layers == 1 else 's'}, hidden {hidden}, {heads} head{'' if heads == 1 else 's'}"
            f"{kv}{mlp}, vocab {vocab}")


@dataclass(frozen=True)
class ModelConfig:
    name: str
    family: str  # "gpt", "llama" or "bert"
    num_layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    max_positions: int
    kv_heads: int | None = None  # grouped-query attention (LLaMA); None = heads
    dropout: bool = True
    # GPT: attention as one fused kernel (flash attention: scores never stored, no attention
    # dropout mask), as Megatron-Core runs it with Transformer Engine; else unfused (the 2021 runs)
    fused_attention: bool = False
    precision: Precision = MIXED
    default_seq: int = 2048
    published_parameters: float | None = field(default=None, compare=False)

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def width(self) -> Width:
        """The hidden size and the sizes that follow it (:func:`follow_hidden`)."""
        return Width(self.hidden, self.heads, self.num_kv_heads, self.ffn)

    @property
    def sizes(self) -> str:
        """``40 layers, hidden 2304, 18 heads, ffn 9216, vocab 50257``."""
        return describe_sizes(self.num_layers, self.hidden, self.heads, self.num_kv_heads, self.ffn, self.vocab)

    def check(self) -> None:
        sizes = (self.num_layers, self.hidden, self.heads, self.ffn, self.vocab, self.max_positions, self.default_seq)
        if any(isinstance(n, bool) or not isinstance(n, int) for n in (*sizes, self.num_kv_heads)):
            raise MemshardError(f"{self.name}: layers, hidden, heads, kv-heads, ffn and vocab must be integers")
        if min(sizes) < 1 or self.num_kv_heads < 1:
            raise MemshardError(f"{self.name}: layers, hidden, heads, kv-heads, ffn and vocab must be ≥ 1")
        if self.num_layers > MAX_LAYERS:
            raise MemshardError(f"{self.name}: {self.num_layers} layers; memshard plans models of at most "
                                f"{MAX_LAYERS:,} layers")
        if max(*sizes, self.num_kv_heads) > MAX_COUNT:
            raise MemshardError(f"{self.name}: hidden, heads, kv-heads, ffn, vocab and positions must be at most "
                                f"{MAX_COUNT:,}, got {max(*sizes, self.num_kv_heads):,}")
        if self.fused_attention not in (True, False) or (self.fused_attention and self.family != "gpt"):
            raise MemshardError(f"{self.name}: fused_attention is true or false, for GPT models (LLaMA's "
                                "attention is always fused)")
        if self.family != "llama" and self.num_kv_heads != self.heads:
            raise MemshardError(f"{self.name}: kv-heads (grouped-query attention) apply to LLaMA models only")

        if self.hidden % self.heads:
            raise MemshardError(
                f"{self.name}: hidden size {self.hidden} is not divisible by {self.heads} heads"
            )
        if self.heads % self.num_kv_heads:
            raise MemshardError(
                f"{self.name}: {self.heads} heads are not divisible by {self.num_kv_heads} kv-heads"
            )


def _gpt(name, layers, hidden, heads, published, vocab=50257, positions=2048, seq=2048):
    return ModelConfig(
        name, "gpt", layers, hidden, heads, 4 * hidden, vocab, positions,
        default_seq=seq, published_parameters=published,
    )


def _llama(name, layers, hidden, heads, kv, ffn, vocab, published, seq=4096):
    return ModelConfig(
        name, "llama", layers, hidden, heads, ffn, vocab, seq, kv_heads=kv, dropout=False,
        default_seq=seq, published_parameters=published,
    )


PRESETS: dict[str, ModelConfig] = {
    c.name: c
    for c in (
        _gpt("gpt2", 12, 768, 12, 124.44e6, positions=1024, seq=1024),
        _gpt("gpt2-medium", 24, 1024, 16, 354.82e6, positions=1024, seq=1024),
        _gpt("gpt2-large", 36, 1280, 20, 774.03e6, positions=1024, seq=1024),
        _gpt("gpt2-xl", 48, 1600, 25, 1557.6e6, positions=1024, seq=1024),
        _gpt("gpt3-1.3b", 24, 2048, 16, 1.3e9),
        _gpt("gpt3-2.7b", 32, 2560, 32, 2.7e9),
        _gpt("gpt3-6.7b", 32, 4096, 32, 6.7e9),
        _gpt("gpt3-13b", 40, 5120, 40, 13.0e9),
        _gpt("gpt3-175b", 96, 12288, 96, 174.6e9),
        _llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 6.74e9),
        _llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000, 13.02e9),
        _llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 68.98e9),
        _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8.03e9, seq=8192),
        _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 70.55e9, seq=8192),
        # Tiny fp32 models for running plans on CPU in seconds (memshard run, tests).
        ModelConfig("tiny-gpt", "gpt", 2, 128, 4, 512, 512, 128, precision=FP32, default_seq=32),
        ModelConfig("tiny-llama", "llama", 2, 128, 4, 256, 512, 128, kv_heads=2, dropout=False,
                    precision=FP32, default_seq=32),
        ModelConfig(
            "bert-large", "bert", 24, 1024, 16, 4096, 30522, 512,
            default_seq=512, published_parameters=335.1e6,
        ),
    )
}
ALIASES = {"gpt2-124m": "gpt2", "gpt2-355m": "gpt2-medium", "gpt2-774m": "gpt2-large", "gpt2-1.5b": "gpt2-xl"}


def resized(config: ModelConfig, overrides: Mapping[str, Any]) -> ModelConfig:
    """``config`` with its fields ``overrides`` (None: not given); an override of the hidden
    size carries the heads, key/value heads and MLP width with it (:func:`follow_hidden`)
    unless they are given too. Unchecked (:meth:`ModelConfig.check`)."""
    knobs = {k: v for k, v in overrides.items() if v is not None}
    whole = all(isinstance(knobs[k], int) and not isinstance(knobs[k], bool) and knobs[k] >= 1
                for k in ("hidden", "heads", "kv_heads", "ffn") if k in knobs)  # else check() says what is wrong
    if "hidden" in knobs and whole:
        config.check()  # the sizes it resizes
        width = follow_hidden(config.width, knobs["hidden"], knobs, config.name)
        followers = {"heads": width.heads, "ffn": width.ffn}
        if config.kv_heads is not None or "kv_heads" in knobs or width.kv_heads != width.heads:
            followers["kv_heads"] = width.kv_heads
        knobs = {**followers, **knobs}
    return replace(config, **knobs) if knobs else config


def get_config(name: str, **overrides) -> ModelConfig:
    """A preset by name, with knobs overridden (``num_layers=4``, ``precision="fp32"``…; an
    override of the hidden size resizes the model, :func:`resized`)."""
    key = ALIASES.get(name.lower(), name.lower())
    if key not in PRESETS:
        raise MemshardError(
            f"unknown model {name!r}; known: {', '.join(PRESETS)} (see `memshard models`)"
        )
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if isinstance(overrides.get("precision"), str):
        if overrides["precision"] not in PRECISIONS or overrides["precision"] == AUTOCAST.name:
            raise MemshardError(f"a built-in model's precision is mixed or fp32, not {overrides['precision']!r} "
                                "(autocast: a Hugging Face config or an nn.Module, traced)")
        overrides["precision"] = PRECISIONS[overrides["precision"]]
    cfg = resized(PRESETS[key], overrides)
    if overrides:
        cfg = replace(cfg, published_parameters=None)
    cfg.check()
    return cfg
