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

from memshard.core.graph import TensorKind, TensorSpec
from memshard.core.mesh import parse_mesh
from memshard.core.placement import Partial, Replicate, Shard, format_layout, local_shape
from memshard.problem.records import reshard_price, reshard_price_table
from memshard.problem.reshard_memory import reshard_peak_bytes
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


def test_a_price_table_is_each_pairs_price_with_sides_repeated_and_kinds_shared():
    """``reshard_price_table`` prices each distinct layout pair once and shares a table among
    kinds priced alike: every cell must still be that pair's own ``reshard_price``."""
    mesh = parse_mesh("2x2")
    spec = TensorSpec("x", (8, 32, 64), 2, TensorKind.ACTIVATION)
    placements = [Replicate(), Partial(), Shard(0), Shard(2)]
    layouts = list(itertools.product(placements, repeat=2))
    producers = layouts[::3] + layouts[:4]  # repeated sides, as a replay's (layout, flag) pairs give
    consumers = [c for c in layouts if Partial() not in c][::2] * 2
    kinds = ("after", "during", "held", "held+during", "regathered", "regathering", "replay-after",
             "replay-during", "ticket-during")
    for kind, last in itertools.product(kinds, (False, True)):
        table = reshard_price_table(spec, kind, producers, consumers, mesh, last)
        expected = [[reshard_price(spec, kind, a, c, mesh, last) for c in consumers] for a in producers]
        assert table.tolist() == expected, (kind, last)
