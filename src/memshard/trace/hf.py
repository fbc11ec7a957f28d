"""Hugging Face ``transformers`` models from a config, on the meta device (no download).

A source is a ``config.json`` path (or a folder holding one) or a model type whose default
config ships with ``transformers`` (``gpt2``, ``llama``, ``mistral``, ``qwen2``, ``bert``…).
Decoder models train as causal LMs, encoders (BERT) as masked LMs; both take ``labels`` so
the model returns its loss. ``transformers`` is optional: ``pip install memshard[hf]``.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import replace

from memshard.core.errors import MemshardError
from memshard.core.files import read_json
from memshard.core.graph import PRECISIONS, Graph
from memshard.models.config import MAX_LAYERS
from memshard.trace import trace_module

# The sizes a config must give as positive integers (attribute maps cover GPT-2's n_*).
SIZES = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
         "vocab_size", "max_position_embeddings")
GPT2_SIZES = ("n_layer", "n_embd", "n_head", "n_inner", "n_positions", "n_ctx")


def _transformers():
    try:
        import transformers
    except ImportError:
        raise MemshardError("Hugging Face models need transformers: pip install 'memshard[hf]'") from None
    return transformers


def read_source(source: str | dict) -> str | dict:
    """A config file's contents (so a saved plan does not depend on the file), or the model type."""
    if isinstance(source, dict):
        return dict(source)
    if not (os.path.isdir(source) or source.endswith(".json") or os.path.sep in source):
        return source
    path = os.path.join(source, "config.json") if os.path.isdir(source) else source
    data = read_json(path, "config")
    if not isinstance(data, dict) or "model_type" not in data:
        raise MemshardError(f"{path} has no \"model_type\": is it a transformers config.json?")
    return data


def load_config(source: str | dict, **overrides):
    """A ``PretrainedConfig`` from a config.json path, a folder, a dict or a model type."""
    tf = _transformers()
    source = read_source(source)
    data = dict(source) if isinstance(source, dict) else {"model_type": source}
    model_type = data.pop("model_type", None)
    # Overrides go in before the config derives its other fields (LLaMA's head_dim).
    data.update({k: v for k, v in overrides.items() if v is not None})
    if not isinstance(model_type, str) or not model_type:
        raise MemshardError(f"a Hugging Face config names its model type, got {model_type!r}")
    for name, value in data.items():  # before transformers divides by them
        if name in (*SIZES, *GPT2_SIZES) and value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise MemshardError(f"the {model_type} config's {name} must be a positive integer, got {value!r}")
    try:
        cfg = tf.AutoConfig.for_model(model_type, **data)
    except (ValueError, KeyError):
        raise MemshardError(
            f"transformers has no model type {model_type!r} (e.g. gpt2, llama, mistral, qwen2, bert)"
        ) from None
    except (TypeError, ArithmeticError) as e:
        raise MemshardError(f"transformers cannot read this {model_type} config: {e}") from None
    _check_sizes(cfg)
    return cfg


def _check_sizes(cfg) -> None:
    """The sizes memshard plans with must be positive integers (and the layers not absurd)."""
    for name in SIZES:
        value = getattr(cfg, name, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise MemshardError(f"the {cfg.model_type} config's {name} must be a positive integer, got {value!r}")
    layers = getattr(cfg, "num_hidden_layers", 0) or 0
    if layers > MAX_LAYERS:
        raise MemshardError(f"the {cfg.model_type} config has {layers:,} layers; memshard plans models of at most "
                            f"{MAX_LAYERS:,} layers")
    heads = getattr(cfg, "num_attention_heads", None)
    if heads and getattr(cfg, "hidden_size", 0) % heads:
        raise MemshardError(f"the {cfg.model_type} config's hidden_size {cfg.hidden_size} is not divisible by its "
                            f"{heads} attention heads")


def _model_class(cfg):
    from transformers.models.auto import modeling_auto as auto

    tf = _transformers()
    if cfg.model_type in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(cfg, "is_decoder", False):
        return tf.AutoModelForMaskedLM, False
    if cfg.model_type in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return tf.AutoModelForCausalLM, True
    raise MemshardError(f"{cfg.model_type}: memshard trains causal or masked language models only")


def max_positions(cfg) -> int | None:
    """Learned position embeddings bound the sequence; rotary ones do not."""
    if getattr(cfg, "n_positions", None):
        return cfg.n_positions
    rotary = any(getattr(cfg, a, None) is not None for a in ("rope_theta", "rope_parameters", "rope_scaling"))
    return None if rotary else getattr(cfg, "max_position_embeddings", None)


def build_model(cfg, precision: str = "mixed", attn_implementation: str | None = None, device="meta"):
    """The model on ``device`` (meta: no memory), in bf16 for mixed precision, else fp32."""
    import torch

    auto_class, _ = _model_class(cfg)
    if attn_implementation:
        cfg._attn_implementation = attn_implementation
    dtype = torch.bfloat16 if precision == "mixed" else torch.float32
    with torch.device(device):
        model = auto_class.from_config(cfg, dtype=dtype)
    return model


def example_inputs(cfg, batch: int, seq: int, device="meta") -> tuple[tuple, dict]:
    import torch

    limit = max_positions(cfg)
    if limit is not None and seq > limit:
        raise MemshardError(f"{cfg.model_type} has {limit} positions; --seq {seq} is longer")
    ids = torch.zeros(batch, seq, dtype=torch.long, device=device)
    kwargs = {"labels": torch.zeros(batch, seq, dtype=torch.long, device=device)}
    if _model_class(cfg)[1]:
        kwargs["use_cache"] = False
    return (ids,), kwargs


def config_label(source: str | dict) -> str:
    if isinstance(source, dict):
        return source.get("model_type", "hf")
    return os.path.basename(os.path.normpath(source)) if os.path.exists(source) else source


def trace_hf(source: str | dict, batch: int, seq: int | None = None, precision: str = "mixed",
             attn_implementation: str | None = None, device: str = "cuda", **overrides) -> Graph:
    """Trace a Hugging Face model for a micro-batch of ``batch`` sequences of ``seq`` tokens,
    priced as it runs on ``device`` ("cuda" or "cpu": its attention kernels and, for
    ``precision="autocast"`` — fp32 weights under ``torch.autocast`` — its op lists)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if precision not in PRECISIONS:
        raise MemshardError(f"unknown precision {precision!r}; use mixed, fp32 or autocast")
    cfg = load_config(source, **overrides)
    seq = seq or min(max_positions(cfg) or 2048, 2048)
    autocast = precision == "autocast"
    # autocast casts CPU tensors only: its trace runs on fake CPU tensors, the others on meta
    with FakeTensorMode() if autocast else contextlib.nullcontext():
        where = "cpu" if autocast else "meta"
        model = build_model(cfg, precision, attn_implementation, device=where)
        args, kwargs = example_inputs(cfg, batch, seq, device=where)
    with eager_masks():
        graph = trace_module(model, args, kwargs, name=f"hf:{config_label(source)}",
                             precision=PRECISIONS[precision], autocast=autocast, device=device)
    return replace(graph, seq=seq)


@contextlib.contextmanager
def eager_masks():
    """Trace the attention path an eager training step takes. Exporting, transformers builds
    the causal mask as a tensor (an exported program must not hard-code ``is_causal`` for
    other shapes) and, with a mask, repeats the key/value heads for grouped-query attention;
    eagerly, a batch of whole sequences (no padding mask, one sequence per row: what memshard
    plans) has no mask at all: SDPA runs with ``is_causal`` and ``enable_gqa``, saving neither
    a mask nor repeated keys and values. The traced program is for these shapes only, so it
    takes the eager path; transformers versions without these hooks trace as exported."""
    from transformers import masking_utils

    hooks = {"is_torchdynamo_exporting": lambda: False, "find_packed_sequence_indices": lambda position_ids: None}
    saved = {name: getattr(masking_utils, name) for name in hooks if hasattr(masking_utils, name)}
    try:
        for name in saved:
            setattr(masking_utils, name, hooks[name])
        yield
    finally:
        for name, value in saved.items():
            setattr(masking_utils, name, value)


def seeded_model(source: str | dict, precision: str, attn_implementation: str | None, overrides: dict,
                 device="cpu", seed: int = 0):
    """The real module (randomly initialised with ``seed``) of a config; ``overrides`` by their
    transformers names."""
    import torch

    cfg = load_config(source, **overrides)
    torch.manual_seed(seed)
    return build_model(cfg, precision, attn_implementation, device=device)
