"""The training job: which model, on which mesh, with what batch, sequence and precision.

A :class:`Job` is what every command shares — ``plan``, ``compare``, ``pareto``, ``simulate``,
``run`` and a saved plan all describe one — and the one place a model source becomes a graph
(``Job.graph``): a preset name or :class:`~memshard.models.ModelConfig` (built by
``memshard.models``), a hand-built :class:`~memshard.core.graph.Graph`, a Hugging Face config
(:class:`HFModel`, traced) or an ``nn.Module`` with example inputs (:class:`TracedModule`).
``to_dict`` / ``from_dict`` are its part of the plan JSON (``model`` and ``mesh``).

Its ``overrides`` are recorded as given; what they mean is ``models.resized``'s (a preset or a
``ModelConfig``) and ``hf_overrides``' (a Hugging Face config): an override of the hidden size
carries the heads, key/value heads and MLP width with it unless they are given too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from functools import cached_property
from typing import Any

from memshard.core.errors import MemshardError
from memshard.core.graph import AUTOCAST, PRECISIONS, Graph
from memshard.core.hardware import Hardware, hardware_from_dict
from memshard.core.mesh import Mesh, make_mesh, parse_mesh
from memshard.core.quantities import MAX_COUNT
from memshard.models import ModelConfig, build_graph, get_config
from memshard.models.config import Width, describe_sizes, follow_hidden, resized

# memshard's model knobs, in the order they are recorded, with the name transformers gives
# each in a config (None: a knob of the built-in models only).
MODEL_KNOBS: dict[str, str | None] = {
    "num_layers": "num_hidden_layers",
    "hidden": "hidden_size",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "ffn": "intermediate_size",
    "vocab": "vocab_size",
    "dropout": None,
}

# The sizes among the knobs, as a message names them.
SIZE_WORDS = {"num_layers": "the number of layers", "hidden": "the hidden size", "heads": "the number of heads",
              "kv_heads": "the number of kv-heads", "ffn": "the MLP width (ffn)", "vocab": "the vocabulary size"}

# What else the Python API may override in a built-in model's config (``ModelConfig``).
CONFIG_FIELDS = tuple(sorted(f.name for f in fields(ModelConfig)
                             if f.name not in (*MODEL_KNOBS, "name", "family", "precision", "published_parameters")))


@dataclass(frozen=True)
class HFModel:
    """A Hugging Face ``transformers`` model to trace: a config.json path, a config dict, or
    a model type whose default config ships with transformers (``gpt2``, ``llama``…).
    ``attn_implementation`` picks the attention kernel (default: the model's, usually sdpa)."""

    source: str | dict
    attn_implementation: str | None = None


@dataclass(frozen=True)
class TracedModule:
    """An ``nn.Module`` that returns its loss, traced on ``example_inputs`` (a tuple of
    positional arguments, a dict of keyword arguments, or one tensor: one micro-batch)."""

    module: Any
    example_inputs: Any


ModelSource = str | ModelConfig | Graph | HFModel | TracedModule


def is_module(model) -> bool:
    """An ``nn.Module``, recognised without importing torch."""
    return any(c.__module__ == "torch.nn.modules.module" and c.__name__ == "Module" for c in type(model).__mro__)


def _positive_int(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MemshardError(f"{what} must be a positive integer, got {value!r}")
    if value > MAX_COUNT:
        raise MemshardError(f"{what} must be at most {MAX_COUNT:,}, got {value!r}")
    return value


@dataclass(frozen=True)
class Job:
    """One training step: ``batch`` sequences of ``seq`` tokens (``None``: one sequence per
    device; the model's default length), run as ``micro_batches`` accumulated micro-batches,
    of ``model`` with its knobs ``overrides`` (``num_layers=4``…) at ``precision`` (``mixed``
    or ``fp32``; None: the model's own), on ``mesh``."""

    model: ModelSource
    mesh: Mesh
    batch: int | None = None
    seq: int | None = None
    micro_batches: int = 1
    overrides: Mapping[str, Any] = field(default_factory=dict)
    precision: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "mesh", as_mesh(self.mesh))
        _positive_int(self.micro_batches, "the number of micro-batches")
        for value, what in ((self.batch, "the batch"), (self.seq, "the sequence length")):
            if value is not None:
                _positive_int(value, what)
        if self.precision is not None and self.precision not in PRECISIONS:
            raise MemshardError(f"unknown precision {self.precision!r}; use mixed, fp32 or autocast")
        knobs = {k: v for k, v in self.overrides.items() if v is not None}
        known = MODEL_KNOBS if isinstance(self.model, HFModel) else {**MODEL_KNOBS, **dict.fromkeys(CONFIG_FIELDS)}
        unknown = sorted(set(knobs) - set(known))
        if unknown:
            raise MemshardError(f"unknown model option {', '.join(unknown)}; known: {', '.join(known)}")
        for knob, what in SIZE_WORDS.items():
            if knob in knobs:
                _positive_int(knobs[knob], what)
        object.__setattr__(self, "overrides", {k: knobs[k] for k in known if k in knobs})
        self._check_source()

    def _check_source(self) -> None:
        model = self.model
        if isinstance(model, (Graph, TracedModule)):
            if self.batch is not None or self.seq is not None:
                raise MemshardError("the graph or example inputs fix the batch and sequence: give no batch or seq")
            if self.overrides:
                raise MemshardError(f"a graph or module takes no {', '.join(self.overrides)} option")
        elif isinstance(model, HFModel):
            if not (isinstance(model.source, dict) or (isinstance(model.source, str) and model.source.strip())):
                raise MemshardError(f"a Hugging Face model is a config.json path, a config dict or a model type, "
                                    f"got {model.source!r}")
            fixed = [k for k in self.overrides if MODEL_KNOBS[k] is None]
            if fixed:
                raise MemshardError(f"Hugging Face models take no {', '.join(fixed)} option")
        elif isinstance(model, (str, ModelConfig)):
            if self.precision == AUTOCAST.name:  # its casts are what a traced module makes
                raise MemshardError("--precision autocast prices the casts torch.autocast makes in a traced model: "
                                    "give a Hugging Face config (--hf-config) or an nn.Module")
            if self.overrides.get("dropout") and self.config.family == "llama":
                raise MemshardError(f"{self.config.name}: LLaMA models have no dropout")
        else:
            raise MemshardError(f"a model is a preset name, a ModelConfig, a Graph, an HFModel or an nn.Module, "
                                f"got {type(model).__name__}")
        if self.global_batch % self.micro_batches:
            raise MemshardError(f"a batch of {self.global_batch} does not split into {self.micro_batches} "
                                "equal micro-batches")

    @property
    def global_batch(self) -> int:
        """Sequences per step over all devices (a graph or module: its own batch)."""
        if self.batch is not None:
            return self.batch
        if isinstance(self.model, (Graph, TracedModule)):
            return self.micro_batches
        return self.mesh.num_devices

    @cached_property
    def config(self) -> ModelConfig:
        """A built-in model's config, its knobs applied (presets and ``ModelConfig`` only)."""
        if isinstance(self.model, str):
            return get_config(self.model, precision=self.precision, **self.overrides)
        if isinstance(self.model, ModelConfig):
            knobs = {**self.overrides, **({"precision": PRECISIONS[self.precision]} if self.precision else {})}
            return resized(self.model, knobs)
        raise MemshardError("only a preset or a ModelConfig has a built-in config")

    @cached_property
    def graph(self) -> Graph:
        """The graph of one micro-batch (built or traced once per job)."""
        micro = self.global_batch // self.micro_batches
        model = self.model
        if isinstance(model, Graph):
            return model
        if isinstance(model, TracedModule):
            from memshard.trace import trace_module

            args, kwargs = _call_arguments(model.example_inputs)
            return trace_module(model.module, args, kwargs, precision=PRECISIONS.get(self.precision),
                                autocast=self.precision == AUTOCAST.name)
        if isinstance(model, HFModel):
            from memshard.trace.hf import trace_hf

            return trace_hf(model.source, micro, self.seq, self.precision or "mixed", model.attn_implementation,
                            **self.hf_overrides())
        return build_graph(self.config, batch=micro, seq=self.seq)

    def on_mesh(self, mesh: Mesh) -> Job:
        """The same job on another view of its devices (a baseline's finer logical mesh); the
        graph, which depends on the device count only, is kept."""
        if mesh.num_devices != self.mesh.num_devices:
            raise ValueError(f"{mesh} is not a view of the job's {self.mesh.num_devices} devices")
        if mesh == self.mesh:
            return self
        job = replace(self, mesh=mesh)
        if "graph" in self.__dict__:
            job.__dict__["graph"] = self.__dict__["graph"]
        return job

    def hf_overrides(self) -> dict[str, Any]:
        """The knobs as the transformers config names them (GPT-2's MLP width: ``n_inner``), an
        override of the hidden size carrying the heads, key/value heads and MLP width with it as
        for a preset (``models.follow_hidden``) unless they are given too."""
        return dict(self._hf_knobs)

    @cached_property
    def _hf_knobs(self) -> dict[str, Any]:
        """:meth:`hf_overrides`, worked out once (the config read where the knobs need it)."""
        knobs = dict(self.overrides)
        if not {"hidden", "kv_heads", "ffn"} & set(knobs):
            return {MODEL_KNOBS[k]: v for k, v in knobs.items()}
        from memshard.trace.hf import config_label, load_config

        base = load_config(self.model.source)
        names = {**MODEL_KNOBS, "ffn": _hf_ffn_name(base)}
        label = config_label(self.model.source)
        if "kv_heads" in knobs and not hasattr(base, "num_key_value_heads"):
            raise MemshardError(f"the {label} config has no kv-heads (grouped-query attention): give no kv-heads")
        if "ffn" in knobs and names["ffn"] is None:
            raise MemshardError(f"the {label} config names no MLP width memshard knows (intermediate_size, n_inner): "
                                "give no ffn")
        if "hidden" in knobs:
            width = follow_hidden(_hf_width(base, names["ffn"]), knobs["hidden"], knobs, label)
            knobs = {**knobs, "heads": width.heads, **({"ffn": width.ffn} if width.ffn is not None else {})}
            if hasattr(base, "num_key_value_heads"):
                knobs["kv_heads"] = width.kv_heads
        return {names[k]: v for k, v in knobs.items()}

    def overridden_sizes(self) -> str | None:
        """The model's sizes after its overrides (``40 layers, hidden 2304, 18 heads, ffn 9216,
        vocab 50257``) where the job overrides any; None where it overrides none (dropout is no
        size) or the model is a graph or a module."""
        if isinstance(self.model, (Graph, TracedModule)) or not set(self.overrides) - {"dropout"}:
            return None
        if not isinstance(self.model, HFModel):
            return self.config.sizes
        from memshard.trace.hf import load_config

        cfg = load_config(self.model.source, **self.hf_overrides())
        ffn_name = _hf_ffn_name(cfg)
        width = _hf_width(cfg, ffn_name)
        ffn = 4 * width.hidden if ffn_name == "n_inner" and width.ffn is None else width.ffn  # GPT-2's default
        return describe_sizes(cfg.num_hidden_layers, width.hidden, width.heads, width.kv_heads, ffn, cfg.vocab_size)

    @property
    def seq_length(self) -> int | None:
        """The sequence length the graph is built for (the model's default if none was given)."""
        return self.graph.seq

    # -- the plan JSON's "model" (the job's part) and "mesh" -----------------------------------
    def to_dict(self) -> dict[str, dict]:
        model = self.model
        if isinstance(model, TracedModule):
            job = {"traced_module": type(model.module).__name__, "micro_batches": self.micro_batches}
        elif isinstance(model, Graph):
            job = {}
        else:
            source = {}
            if isinstance(model, HFModel):
                from memshard.trace.hf import read_source

                source = {"hf": read_source(model.source), "attn_implementation": model.attn_implementation}
            overrides = dict(self.overrides)
            if self.precision is not None:  # recorded among the knobs, before dropout
                overrides = {k: v for k, v in overrides.items() if k != "dropout"}
                overrides["precision"] = self.precision
                if "dropout" in self.overrides:
                    overrides["dropout"] = self.overrides["dropout"]
            job = {**source, "batch": self.global_batch, "micro_batches": self.micro_batches,
                   "seq": self.seq_length, "overrides": overrides}
        return {"model": job, "mesh": mesh_to_dict(self.mesh)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Job:
        """The job a plan JSON records (its ``model`` and ``mesh``)."""
        model, mesh = data["model"], mesh_from_dict(data["mesh"])
        if "traced_module" in model:
            raise MemshardError(f"this plan was made from the module {model['traced_module']}: plan it again from "
                                "the module (memshard.plan(module, example_inputs, mesh=...))")
        overrides = dict(model.get("overrides", {}))
        precision = overrides.pop("precision", None)
        source = HFModel(model["hf"], model.get("attn_implementation")) if "hf" in model else model["name"]
        return cls(source, mesh, batch=int(model["batch"]), seq=int(model["seq"]),
                   micro_batches=int(model.get("micro_batches", 1)), overrides=overrides, precision=precision)


def _hf_ffn_name(cfg) -> str | None:
    """The attribute a transformers config keeps its MLP width in (None: none memshard knows)."""
    return next((name for name in ("intermediate_size", "n_inner") if hasattr(cfg, name)), None)


def _hf_width(cfg, ffn_name: str | None) -> Width:
    """A transformers config's hidden size and what follows it (an MLP width of None: the model's
    default, four times the hidden size, which follows it by itself)."""
    heads = cfg.num_attention_heads
    return Width(cfg.hidden_size, heads, getattr(cfg, "num_key_value_heads", None) or heads,
                 getattr(cfg, ffn_name) if ffn_name else None)


def as_mesh(mesh, gpu: str | Hardware | None = None) -> Mesh:
    """A mesh from what the API accepts: ``"2x4"``, ``8`` (one axis), ``(2, 4)``, or a Mesh;
    ``gpu``: the device (a preset's name or a record), for a mesh not given as a Mesh."""
    if isinstance(mesh, Mesh):
        if gpu is not None:
            raise MemshardError("a Mesh has its hardware already: give no gpu")
        return mesh
    if isinstance(mesh, str):
        return parse_mesh(mesh, hardware=gpu)
    if isinstance(mesh, int) and not isinstance(mesh, bool):
        return make_mesh((mesh,), hardware=gpu)
    if isinstance(mesh, (tuple, list)):
        return make_mesh(tuple(mesh), hardware=gpu)
    raise MemshardError(f"a mesh is a string like '2x4', an int, a tuple of ints or a memshard Mesh, got {mesh!r}")


def _call_arguments(example_inputs) -> tuple[tuple, dict]:
    if example_inputs is None:
        raise MemshardError("planning an nn.Module needs example inputs: memshard.plan(model, example_inputs, mesh=...)")
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def mesh_to_dict(mesh: Mesh) -> dict[str, Any]:
    return {
        "shape": list(mesh.shape),
        "axis_names": list(mesh.axis_names),
        "num_devices": mesh.num_devices,
        "bandwidth_bytes_per_s": [a.bandwidth_bytes_per_s for a in mesh.axes],
        "latency_s": [a.latency_s for a in mesh.axes],
        "device_memory_bytes": mesh.device_memory_bytes,
        "hardware": asdict(mesh.hardware),
    }


def mesh_from_dict(data: Mapping[str, Any]) -> Mesh:
    if "hardware" not in data:
        raise MemshardError("the plan was written before memshard recorded the mesh's hardware: plan it again")
    mesh = make_mesh(tuple(data["shape"]), tuple(data["axis_names"]), device_memory_bytes=data["device_memory_bytes"],
                     hardware=hardware_from_dict(dict(data["hardware"]), "the plan's hardware"))
    if math.prod(mesh.shape) != data.get("num_devices", mesh.num_devices):
        raise MemshardError("the mesh's shape and device count disagree")
    return mesh.with_links(tuple(data["bandwidth_bytes_per_s"]), tuple(data["latency_s"]))
