"""Model builders: a preset name or a :class:`ModelConfig` → a :class:`~memshard.core.graph.Graph`."""

from __future__ import annotations

from memshard.core.errors import MemshardError
from memshard.core.graph import Graph
from memshard.models.config import PRESETS, ModelConfig, get_config

__all__ = ["PRESETS", "ModelConfig", "build_graph", "get_config"]


def build_graph(model: str | ModelConfig, batch: int = 8, seq: int | None = None, **overrides) -> Graph:
    """Build the training graph of ``model`` for a global batch of ``batch`` sequences."""
    cfg = get_config(model, **overrides) if isinstance(model, str) else model
    cfg.check()
    seq = cfg.default_seq if seq is None else seq
    if batch < 1 or seq < 1:
        raise MemshardError(f"batch and sequence length must be positive, got {batch} and {seq}")
    if seq > cfg.max_positions and cfg.family != "llama":
        raise MemshardError(f"{cfg.name} has {cfg.max_positions} positions; --seq {seq} is longer")
    if cfg.family == "gpt":
        from memshard.models.gpt import build_gpt as builder
    elif cfg.family == "llama":
        from memshard.models.llama import build_llama as builder
    elif cfg.family == "bert":
        from memshard.models.bert import build_bert as builder
    else:
        raise MemshardError(f"unknown model family {cfg.family!r}")
    return builder(cfg, batch, seq)
