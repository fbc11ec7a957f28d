"""The device mesh: axis sizes and names, per-axis links, and the device (``core/hardware.py``).

A mesh is written ``2x4`` on the command line: the last axis is the innermost. Devices are
numbered innermost first and filled into nodes of ``hardware.gpus_per_node``: an axis whose
group stays within a node runs its collectives over NVLink-class links; one whose group spans
nodes runs them over the NICs, each node's share of the group (its GPUs of that group) using
as many NICs. Every figure is overridable.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, replace

from memshard.core.errors import MemshardError
from memshard.core.hardware import DEFAULT_GPU, Hardware, preset

MAX_DEVICES = 2**20  # a guard against runaway input: the largest clusters are far below it


@dataclass(frozen=True)
class MeshAxis:
    name: str
    size: int
    latency_s: float
    bandwidth_bytes_per_s: float
    per_node: int = 0  # devices of the axis within one node (its size: it stays within a node)
    parts: tuple[MeshAxis, ...] = ()  # a merged axis (search/coarsen.py): the real axes, outer first


@dataclass(frozen=True)
class Mesh:
    axes: tuple[MeshAxis, ...]
    device_memory_bytes: int
    hardware: Hardware

    def __hash__(self) -> int:
        """The generated hash (of the fields), computed once: meshes key the pricing caches."""
        try:
            return self.__dict__["_hash"]
        except KeyError:
            value = self.__dict__["_hash"] = hash((self.axes, self.device_memory_bytes, self.hardware))
            return value

    def __getstate__(self) -> dict:
        """Pickled without its hash (another process hashes its names differently)."""
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    @property
    def peak_flops(self) -> float:
        return self.hardware.peak_flops

    @property
    def compute_efficiency(self) -> float:
        """The best GEMMs' fraction of peak (``--efficiency``)."""
        return self.hardware.matmul_efficiency

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
        if self.real is self:
            return tuple(axes)
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


def resized(mesh: Mesh, shape: tuple[int, ...]) -> Mesh:
    """``mesh`` with new axis sizes: its names, device and capacity kept, each axis's links
    those of the new shape's nodes, unless they were set by hand (``with_links``)."""
    if len(shape) != mesh.ndim or mesh.real is not mesh:
        raise ValueError("a resized mesh keeps the axes of a mesh without merged axes")
    def build(sizes):
        return make_mesh(tuple(sizes), mesh.axis_names, device_memory_bytes=mesh.device_memory_bytes,
                         hardware=mesh.hardware)
    defaults, fresh = build(mesh.shape), build(shape)
    axes = tuple(new if (old.latency_s, old.bandwidth_bytes_per_s) == (default.latency_s, default.bandwidth_bytes_per_s)
                 else replace(new, latency_s=old.latency_s, bandwidth_bytes_per_s=old.bandwidth_bytes_per_s)
                 for new, old, default in zip(fresh.axes, mesh.axes, defaults.axes))
    return replace(fresh, axes=axes)


MAX_VIEW_AXES = 3  # a view of more axes multiplies the search; none is made


def mesh_views(mesh: Mesh) -> tuple[Mesh, ...]:
    """The other ways the same devices form mesh axes, where the links allow (docs/search.md,
    *Mesh views*): an innermost axis that spans nodes split into nodes × the devices of a node;
    then the axes within a node (the innermost ones whose group stays in a node) as one axis,
    or as two of every pair of factors. Two axes of the same links in the other order are the
    same view (the smaller factor outer). Axes that span nodes are kept. A view's axes take
    the default names and links (``make_mesh``); none is made for a mesh whose links were set
    by hand, one of merged axes, or where a view would have more than ``MAX_VIEW_AXES``."""
    if mesh.real is not mesh or mesh != make_mesh(mesh.shape, mesh.axis_names, mesh.device_memory_bytes,
                                                  hardware=mesh.hardware):
        return ()
    shape, node = list(mesh.shape), mesh.hardware.gpus_per_node
    inner = mesh.axes[-1]
    if 1 < inner.per_node < inner.size:  # nodes × the devices of a node
        shape[-1:] = [inner.size // inner.per_node, inner.per_node]
    within = len(shape)  # the axes within a node: the innermost ones whose devices fit in one
    while within > 0 and math.prod(shape[within - 1:]) <= node:
        within -= 1
    outer, devices = tuple(s for s in shape[:within] if s > 1), math.prod(shape[within:])
    parts = [(devices,)] + [(a, devices // a) for a in range(2, math.isqrt(devices) + 1) if devices % a == 0]
    typed = _canonical(mesh.shape, node)
    views, seen = [], {typed}
    for part in parts:
        view = outer + tuple(p for p in part if p > 1)
        if len(view) <= MAX_VIEW_AXES and _canonical(view, node) not in seen:
            seen.add(_canonical(view, node))
            views.append(make_mesh(view, device_memory_bytes=mesh.device_memory_bytes, hardware=mesh.hardware))
    return tuple(views)


def _canonical(shape: tuple[int, ...], node: int) -> tuple[int, ...]:
    """``shape`` with its axes of size 1 dropped and the axes within a node in size order: the
    views that group the devices alike."""
    shape = tuple(s for s in shape if s > 1)
    within = len(shape)
    while within > 0 and math.prod(shape[within - 1:]) <= node:
        within -= 1
    return shape[:within] + tuple(sorted(shape[within:]))


def default_axis_names(ndim: int) -> tuple[str, ...]:
    """``dp``-free neutral names: the innermost axis is ``intra``, outer ones ``inter0``…"""
    if ndim == 1:
        return ("intra",)
    return tuple(f"inter{i}" for i in range(ndim - 1)) + ("intra",)


def axis_links(shape: tuple[int, ...], hardware: Hardware) -> tuple[tuple[float, float, int], ...]:
    """Per axis, its (step latency, bus bandwidth per device, devices per node). Devices fill
    nodes innermost axis first: an axis whose group fits in a node's share of the inner axes is
    within a node; otherwise its ring crosses nodes, each node holding ``k`` of its devices,
    whose ``k`` NICs carry it."""
    out = []
    for i, size in enumerate(shape):
        inner = math.prod(shape[i + 1:])
        if inner * size <= hardware.gpus_per_node:
            out.append((hardware.intra_node_step_latency_s, hardware.intra_node_bandwidth, size))
            continue
        per_node = max(1, hardware.gpus_per_node // inner)
        out.append((hardware.inter_node_step_latency_s,
                    min(hardware.intra_node_bandwidth, per_node * hardware.inter_node_bandwidth), per_node))
    return tuple(out)


def make_mesh(
    shape: tuple[int, ...],
    names: tuple[str, ...] | None = None,
    device_memory_bytes: int | None = None,
    peak_flops: float | None = None,
    compute_efficiency: float | None = None,
    hardware: Hardware | str | None = None,
) -> Mesh:
    """A mesh of ``shape`` on ``hardware`` (a preset's name or a record; default the default
    GPU); ``peak_flops`` and ``compute_efficiency`` override its figures, ``device_memory_bytes``
    its capacity."""
    if not isinstance(shape, (tuple, list)) or not shape or any(
            isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in shape):
        raise MemshardError(f"mesh axes must be positive integers, got {shape!r}")
    if math.prod(shape) > MAX_DEVICES:
        raise MemshardError(f"a mesh of {math.prod(shape):,} devices: memshard plans meshes of at most "
                            f"{MAX_DEVICES:,} devices")
    names = names or default_axis_names(len(shape))
    if len(names) != len(shape) or len(set(names)) != len(names):
        raise MemshardError(f"need {len(shape)} distinct axis names, got {names}")
    hardware = preset(hardware or DEFAULT_GPU) if not isinstance(hardware, Hardware) else hardware
    for value, what in ((device_memory_bytes, "device memory"), (peak_flops, "peak FLOP/s")):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise MemshardError(f"{what} must be a positive number, got {value!r}")
    if compute_efficiency is not None and not (0 < compute_efficiency <= 1):
        raise MemshardError(f"efficiency must be in (0, 1], got {compute_efficiency!r}")
    hardware = replace(hardware, peak_flops=float(peak_flops or hardware.peak_flops),
                       matmul_efficiency=float(compute_efficiency or hardware.matmul_efficiency))
    axes = tuple(MeshAxis(name, int(size), latency, bandwidth, per_node)
                 for name, size, (latency, bandwidth, per_node) in zip(names, shape, axis_links(tuple(shape), hardware)))
    return Mesh(axes, int(device_memory_bytes or hardware.memory_bytes), hardware)


def parse_mesh(text: str, **kwargs) -> Mesh:
    """``"2x4"`` → a 2×4 mesh; ``"8"`` → one axis of 8 devices."""
    if not re.fullmatch(r"\s*\d+(\s*[xX×]\s*\d+)*\s*", str(text)):
        raise MemshardError(f"bad mesh {text!r}: write axis sizes joined by 'x', e.g. 2x4 or 8x8x16")
    shape = tuple(int(p) for p in re.split(r"[xX×]", text.replace(" ", "")))
    if any(s < 1 for s in shape):
        raise MemshardError(f"bad mesh {text!r}: every axis needs at least one device")
    return make_mesh(shape, **kwargs)
