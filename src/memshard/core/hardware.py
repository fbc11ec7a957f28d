"""The device a job runs on: its peaks, its memory, its links, and how close kernels come to them.

A :class:`Hardware` record holds the figures the step-time model reads (``problem/kernels.py``
for compute, ``problem/comm.py`` for collectives). ``PRESETS`` names the common training GPUs;
``docs/hardware.md`` gives every figure's source. A user's own device is a JSON or TOML file of
the same fields (``load_hardware``), on top of a preset named by its ``base`` field.

Peaks are dense (no sparsity). Link figures are what NCCL reaches on large messages (its bus
bandwidth), not line rates. Efficiencies are fractions of a peak that the best kernels reach.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path

import tomllib

from memshard.core.errors import MemshardError

GiB = 2**30


@dataclass(frozen=True)
class Hardware:
    name: str
    memory_bytes: int  # capacity as sold; a process gets a little less (pass --device-memory)
    peak_flops: float  # dense 16-bit tensor-core FLOP/s
    peak_flops_fp32: float  # FP32 FLOP/s without TF32 (PyTorch's default for float32 matmuls)
    memory_bandwidth: float  # HBM bytes/s
    streaming_multiprocessors: int  # the waves a GEMM's tiles run in
    matmul_efficiency: float  # best-shape GEMM FLOP/s over peak_flops (its largest square GEMMs)
    attention_efficiency: float  # fused attention forward FLOP/s over peak_flops
    memory_efficiency: float  # streaming kernels' bytes/s over memory_bandwidth, large tensors
    kernel_overhead_s: float  # the least time a kernel takes (launch, ramp, tail)
    gpus_per_node: int
    intra_node_bandwidth: float  # NCCL bus bytes/s per GPU within a node, large messages
    inter_node_bandwidth: float  # NCCL bus bytes/s per GPU across nodes (its NIC), large messages
    collective_latency_s: float  # a collective's fixed start-up
    intra_node_step_latency_s: float  # per ring step within a node
    inter_node_step_latency_s: float  # per ring step across nodes
    peak_flops_fp8: float = 0.0  # dense FP8 tensor-core FLOP/s; 0: none

    def check(self) -> Hardware:
        """This record if every figure is a finite positive number (efficiencies at most 1)."""
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "name":
                if not isinstance(value, str) or not value:
                    raise MemshardError("hardware: name must be a non-empty string")
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise MemshardError(f"hardware {self.name}: {f.name} must be a number, got {value!r}")
            low_ok = f.name.endswith("latency_s") or f.name == "peak_flops_fp8"
            if value < 0 or (value == 0 and not low_ok):
                raise MemshardError(f"hardware {self.name}: {f.name} must be positive, got {value!r}")
            if f.name.endswith("efficiency") and value > 1:
                raise MemshardError(f"hardware {self.name}: {f.name} is a fraction of a peak, at most 1, got {value!r}")
        if self.streaming_multiprocessors != int(self.streaming_multiprocessors) or self.gpus_per_node != int(
                self.gpus_per_node):
            raise MemshardError(f"hardware {self.name}: streaming_multiprocessors and gpus_per_node are whole numbers")
        return self


# NCCL's ring: a start-up fitted to nccl-tests on 2–8 A100s (docs/hardware.md), per-step latencies
# as NCCL's own model (Simple protocol, NVLink and network); shared by every preset.
_NCCL = dict(collective_latency_s=25e-6, intra_node_step_latency_s=3.4e-6, inter_node_step_latency_s=14e-6)

PRESETS: dict[str, Hardware] = {h.name: h.check() for h in (
    Hardware("a100-40gb", 40 * GiB, 312e12, 19.5e12, 1.555e12, 108, 0.869, 0.60, 0.85, 4e-6, 8, 230e9, 24e9, **_NCCL),
    Hardware("a100-80gb", 80 * GiB, 312e12, 19.5e12, 2.039e12, 108, 0.869, 0.60, 0.85, 4e-6, 8, 230e9, 24e9, **_NCCL),
    Hardware("h100-sxm", 80 * GiB, 989e12, 67e12, 3.35e12, 132, 0.803, 0.60, 0.85, 4e-6, 8, 370e9, 48e9,
             peak_flops_fp8=1979e12, **_NCCL),
    Hardware("h100-pcie", 80 * GiB, 756e12, 51e12, 2.0e12, 114, 0.803, 0.60, 0.85, 4e-6, 8, 40e9, 24e9,
             peak_flops_fp8=1513e12, **_NCCL),
    Hardware("h200", 141 * GiB, 989e12, 67e12, 4.8e12, 132, 0.803, 0.60, 0.85, 4e-6, 8, 370e9, 48e9,
             peak_flops_fp8=1979e12, **_NCCL),
    Hardware("b200", 180 * GiB, 2250e12, 80e12, 8.0e12, 148, 0.776, 0.60, 0.85, 4e-6, 8, 740e9, 48e9,
             peak_flops_fp8=4500e12, **_NCCL),
    Hardware("mi300x", 192 * GiB, 1307e12, 163e12, 5.3e12, 304, 0.514, 0.45, 0.80, 4e-6, 8, 300e9, 48e9,
             peak_flops_fp8=2615e12, **_NCCL),
)}
DEFAULT_GPU = "h100-sxm"


def preset(name: str) -> Hardware:
    """The preset called ``name``."""
    if name not in PRESETS:
        raise MemshardError(f"unknown GPU {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[name]


def hardware_from_dict(data: dict, where: str = "hardware") -> Hardware:
    """A record from a mapping of its fields: those given replace the ``base`` preset's (default
    the default GPU's); a ``name`` is required unless ``base`` names the device."""
    if not isinstance(data, dict):
        raise MemshardError(f"{where}: expected a table of hardware fields")
    data = dict(data)
    base = preset(str(data.pop("base", DEFAULT_GPU)))
    known = {f.name for f in fields(Hardware)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise MemshardError(f"{where}: unknown field {unknown[0]!r}; known: base, {', '.join(sorted(known))}")
    return replace(base, **data).check()


def load_hardware(path: str) -> Hardware:
    """A device described in a JSON or TOML file (``.toml``: TOML; anything else: JSON)."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise MemshardError(f"--hardware {path}: {e.strerror or e}") from None
    try:
        data = tomllib.loads(text) if str(path).endswith(".toml") else json.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as e:
        raise MemshardError(f"--hardware {path}: not valid {'TOML' if str(path).endswith('.toml') else 'JSON'}: {e}") from None
    return hardware_from_dict(data, f"--hardware {path}")
