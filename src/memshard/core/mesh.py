"""The device mesh: axis sizes and names, per-axis links, device memory and speed.

A mesh is written ``2x4`` on the command line: the last axis is the innermost (devices of
one node, fast links), the others cross nodes. Defaults describe an A100/H100-class cluster
and are all overridable.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, replace

from memshard.core.errors import MemshardError

INTRA_NODE_BANDWIDTH = 150e9  # bytes/s per device, NVLink-class
INTER_NODE_BANDWIDTH = 25e9  # bytes/s per device, 200 Gb/s InfiniBand-class
INTRA_NODE_LATENCY = 5e-6
INTER_NODE_LATENCY = 20e-6
DEVICE_MEMORY = 80 * 2**30
DEVICE_PEAK_FLOPS = 312e12  # dense bf16
COMPUTE_EFFICIENCY = 0.5  # fraction of peak a well-shaped kernel reaches
MAX_DEVICES = 2**20  # a guard against runaway input: the largest clusters are far below it


@dataclass(frozen=True)
class MeshAxis:
    name: str
    size: int
    latency_s: float
    bandwidth_bytes_per_s: float
    parts: tuple[MeshAxis, ...] = ()  # a merged axis (search/coarsen.py): the real axes, outer first


@dataclass(frozen=True)
class Mesh:
    axes: tuple[MeshAxis, ...]
    device_memory_bytes: int = DEVICE_MEMORY
    peak_flops: float = DEVICE_PEAK_FLOPS
    compute_efficiency: float = COMPUTE_EFFICIENCY

    @functools.cached_property  # asked for by every layout price
    def shape(self) -> tuple[int, ...]:
        return tuple(a.size for a in self.axes)

    @functools.cached_property
    def real(self) -> Mesh:
        """The mesh collectives run on: merged axes (``MeshAxis.parts``) split again."""
        if not any(a.parts for a in self.axes):
            return self
        return replace(self, axes=tuple(p for a in self.axes for p in (a.parts or (a,))))

    @functools.cached_property
    def real_axes(self) -> tuple[tuple[int, ...], ...]:
        """Per axis, its axes in ``real``."""
        out, start = [], 0
        for a in self.axes:
            n = len(a.parts) or 1
            out.append(tuple(range(start, start + n)))
            start += n
        return tuple(out)

    def to_real_axes(self, axes: tuple[int, ...]) -> tuple[int, ...]:
        """Axes of this mesh as axes of ``real``."""
        return tuple(r for a in axes for r in self.real_axes[a])

    def on_real_axes(self, layout: tuple) -> tuple:
        """A layout of this mesh as a layout of ``real``: a merged axis's placement on each part."""
        return tuple(p for p, axes in zip(layout, self.real_axes) for _ in axes)

    @property
    def ndim(self) -> int:
        return len(self.axes)

    @property
    def num_devices(self) -> int:
        return math.prod(self.shape)

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.axes)

    def __str__(self) -> str:
        return "x".join(str(s) for s in self.shape)

    def with_links(
        self,
        bandwidths: tuple[float, ...] | None = None,
        latencies: tuple[float, ...] | None = None,
    ) -> Mesh:
        """Override per-axis bandwidth (bytes/s) and latency (s); one value per axis."""
        axes = list(self.axes)
        for values, field in ((bandwidths, "bandwidth_bytes_per_s"), (latencies, "latency_s")):
            if values is None:
                continue
            if len(values) != len(axes):
                raise MemshardError(
                    f"{field}: give one value per mesh axis ({len(axes)}), got {len(values)}"
                )
            if field == "bandwidth_bytes_per_s" and not all(math.isfinite(v) and v > 0 for v in values):
                raise MemshardError(f"bandwidths must be positive numbers, got {values}")
            if field == "latency_s" and not all(math.isfinite(v) and v >= 0 for v in values):
                raise MemshardError(f"latencies must be non-negative numbers, got {values}")
            axes = [replace(a, **{field: float(v)}) for a, v in zip(axes, values)]
        return replace(self, axes=tuple(axes))


def default_axis_names(ndim: int) -> tuple[str, ...]:
    """``dp``-free neutral names: the innermost axis is ``intra``, outer ones ``inter0``…"""
    if ndim == 1:
        return ("intra",)
    return tuple(f"inter{i}" for i in range(ndim - 1)) + ("intra",)


def make_mesh(
    shape: tuple[int, ...],
    names: tuple[str, ...] | None = None,
    device_memory_bytes: int = DEVICE_MEMORY,
    peak_flops: float = DEVICE_PEAK_FLOPS,
    compute_efficiency: float = COMPUTE_EFFICIENCY,
) -> Mesh:
    if not isinstance(shape, (tuple, list)) or not shape or any(
            isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in shape):
        raise MemshardError(f"mesh axes must be positive integers, got {shape!r}")
    if math.prod(shape) > MAX_DEVICES:
        raise MemshardError(f"a mesh of {math.prod(shape):,} devices: memshard plans meshes of at most "
                            f"{MAX_DEVICES:,} devices")
    names = names or default_axis_names(len(shape))
    if len(names) != len(shape) or len(set(names)) != len(names):
        raise MemshardError(f"need {len(shape)} distinct axis names, got {names}")
    axes = []
    for i, (size, name) in enumerate(zip(shape, names)):
        inner = i == len(shape) - 1
        axes.append(
            MeshAxis(
                name=name,
                size=int(size),
                latency_s=INTRA_NODE_LATENCY if inner else INTER_NODE_LATENCY,
                bandwidth_bytes_per_s=INTRA_NODE_BANDWIDTH if inner else INTER_NODE_BANDWIDTH,
            )
        )
    if not (math.isfinite(device_memory_bytes) and device_memory_bytes > 0
            and math.isfinite(peak_flops) and peak_flops > 0 and 0 < compute_efficiency <= 1):
        raise MemshardError("device memory and peak FLOP/s must be positive numbers, efficiency in (0, 1]")
    return Mesh(tuple(axes), int(device_memory_bytes), float(peak_flops), float(compute_efficiency))


def parse_mesh(text: str, **kwargs) -> Mesh:
    """``"2x4"`` → a 2×4 mesh; ``"8"`` → one axis of 8 devices."""
    if not re.fullmatch(r"\s*\d+(\s*[xX×]\s*\d+)*\s*", str(text)):
        raise MemshardError(f"bad mesh {text!r}: write axis sizes joined by 'x', e.g. 2x4 or 8x8x16")
    shape = tuple(int(p) for p in re.split(r"[xX×]", text.replace(" ", "")))
    if any(s < 1 for s in shape):
        raise MemshardError(f"bad mesh {text!r}: every axis needs at least one device")
    return make_mesh(shape, **kwargs)
