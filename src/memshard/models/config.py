"""Model configurations and the built-in presets.

A preset fixes the architecture (layers, hidden, heads, ffn, vocab); batch and sequence
length are given when a graph is built. Published parameter counts are kept next to each
preset so tests can check the builders against them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from memshard.core.errors import MemshardError
from memshard.core.graph import AUTOCAST, FP32, MIXED, PRECISIONS, Precision

MAX_LAYERS = 4096  # a guard against runaway input: no model comes near it


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
    precision: Precision = MIXED
    default_seq: int = 2048
    published_parameters: float | None = field(default=None, compare=False)

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    def check(self) -> None:
        sizes = (self.num_layers, self.hidden, self.heads, self.ffn, self.vocab, self.max_positions, self.default_seq)
        if any(isinstance(n, bool) or not isinstance(n, int) for n in (*sizes, self.num_kv_heads)):
            raise MemshardError(f"{self.name}: layers, hidden, heads, kv-heads, ffn and vocab must be integers")
        if min(sizes) < 1 or self.num_kv_heads < 1:
            raise MemshardError(f"{self.name}: layers, hidden, heads, kv-heads, ffn and vocab must be ≥ 1")
        if self.num_layers > MAX_LAYERS:
            raise MemshardError(f"{self.name}: {self.num_layers} layers; memshard plans models of at most "
                                f"{MAX_LAYERS:,} layers")
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


def get_config(name: str, **overrides) -> ModelConfig:
    """A preset by name, with knobs overridden (``num_layers=4``, ``precision="fp32"``…)."""
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
    cfg = replace(PRESETS[key], **overrides)
    if overrides:
        cfg = replace(cfg, published_parameters=None)
    cfg.check()
    return cfg
