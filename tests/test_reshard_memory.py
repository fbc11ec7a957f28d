"""The reshard's own memory (``cost.reshard_memory``) against what the runtime allocates.

Every layout change on meshes 4, 2×2 and 2×3 (and a sample on 2×2×2), forward and in the
gradients' reverse axis order, runs ``runtime.reshard.reshard_local`` on one rank of a fake
process group under ``FakeTensorMode``; MemTracker's peak over the call, minus the input the
caller holds, must equal the model's bytes exactly (even splits; DTensor pads uneven ones).
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import init_device_mesh

from memshard.cost.reshard_memory import reshard_peak_bytes
from memshard.mesh import parse_mesh
from memshard.placement import Partial, Replicate, Shard, format_layout, local_shape
from memshard.runtime.measure import MemoryMeter, destroy, init_fake_world
from memshard.runtime.reshard import reshard_local


def _pairs(ndim: int, dims: int, sample: int | None):
    sources = [Replicate(), Partial()] + [Shard(d) for d in range(dims)]
    targets = [p for p in sources if not isinstance(p, Partial)]
    pairs = [(s, d) for s in itertools.product(sources, repeat=ndim)
             for d in itertools.product(targets, repeat=ndim) if s != d]
    return random.Random(0).sample(pairs, sample) if sample else pairs


@pytest.mark.parametrize("mesh_text, shape, sample", [
    ("4", (8, 32, 64), None),
    ("2x2", (8, 32, 64), None),
    ("2x3", (6, 12, 18), 120),
    ("2x2x2", (8, 16, 8), 120),
])
def test_reshard_peak_bytes_equal_the_measured_allocation(mesh_text, shape, sample):
    spec = parse_mesh(mesh_text)
    init_fake_world(0, spec.num_devices)
    try:
        mesh = init_device_mesh("cpu", spec.shape)
        wrong = []
        with FakeTensorMode():
            for src, dst in _pairs(spec.ndim, len(shape), sample):
                for reverse in (False, True):
                    x = torch.empty(local_shape(shape, src, spec.shape))
                    with MemoryMeter(None, None, x) as meter:
                        y = reshard_local(x, shape, mesh, src, dst, reverse=reverse)
                        del y
                    measured = meter.peak_bytes - x.numel() * x.element_size()
                    predicted = reshard_peak_bytes(shape, 4, src, dst, spec, reverse=reverse)
                    if measured != predicted:
                        wrong.append((format_layout(src), format_layout(dst), reverse, measured, predicted))
        assert not wrong, wrong[:10]
    finally:
        destroy()


def test_nothing_to_change_allocates_nothing():
    spec = parse_mesh("2x2")
    layout = (Shard(0), Replicate())
    assert reshard_peak_bytes((8, 8), 4, layout, layout, spec) == 0
