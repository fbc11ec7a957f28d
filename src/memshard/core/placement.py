"""Placements and layouts with DTensor semantics, and the arithmetic on them.

A layout holds one placement per mesh axis: ``Shard(d)`` splits tensor dim ``d`` over that
axis, ``Replicate()`` copies, ``Partial()`` holds a partial sum. Uneven splits follow
``torch.chunk`` as DTensor does: shards of ``ceil(n/m)`` with a short (or empty) tail; the
memory figures use the largest shard, the one rank 0 holds.
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass

from memshard.core.mesh import Mesh

# Placements are interned: one object per kind and dim, its hash computed once (the value the
# generated one gives). Layouts are compared and hashed hundreds of thousands of times while a
# problem is built and formulated: equal placements are then identical, which tuples compare
# without calling __eq__, and hashing costs one attribute read instead of a new tuple.
_SHARDS: dict[int, Shard] = {}
_ONE: dict[type, Replicate | Partial] = {}


def _the_one(cls):
    return _ONE.setdefault(cls, object.__new__(cls))


def _no_fields_hash(self) -> int:
    return _NO_FIELDS_HASH


_NO_FIELDS_HASH = hash(())


@dataclass(frozen=True, order=True, init=False)  # (set once, here: not again by each call)
class Shard:
    dim: int

    def __new__(cls, dim: int):
        shard = _SHARDS.get(dim)
        if shard is None:
            shard = object.__new__(cls)
            object.__setattr__(shard, "dim", operator.index(dim))
            object.__setattr__(shard, "_hash", hash((shard.dim,)))
            object.__setattr__(shard, "_repr", f"Shard(dim={shard.dim!r})")
            _SHARDS[shard.dim] = shard
        return shard

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:  # (the generated one's text: layouts are sorted by it)
        return self._repr

    def __reduce__(self):
        return Shard, (self.dim,)

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, order=True)
class Replicate:
    __new__ = _the_one
    __hash__ = _no_fields_hash

    def __repr__(self) -> str:
        return "Replicate()"

    def __reduce__(self):
        return Replicate, ()

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True, order=True)
class Partial:
    __new__ = _the_one
    __hash__ = _no_fields_hash

    def __repr__(self) -> str:
        return "Partial()"

    def __reduce__(self):
        return Partial, ()

    def __str__(self) -> str:
        return "P"


Placement = Shard | Replicate | Partial
Layout = tuple[Placement, ...]

REPLICATE = Replicate()
PARTIAL = Partial()


def format_layout(layout: Layout) -> str:
    """``(Shard(0), Replicate())`` → ``S(0)R``; the empty layout (one device) → ``-``."""
    return "".join(str(p) for p in layout) or "-"


def parse_layout(text: str) -> Layout:
    """Inverse of :func:`format_layout`."""
    out: list[Placement] = []
    i = 0
    while i < len(text):
        if text[i] == "R":
            out.append(REPLICATE)
            i += 1
        elif text[i] == "P":
            out.append(PARTIAL)
            i += 1
        elif text.startswith("S(", i):
            j = text.index(")", i)
            out.append(Shard(int(text[i + 2 : j])))
            i = j + 1
        elif text == "-":
            break
        else:
            raise ValueError(f"bad layout {text!r}")
    return tuple(out)


def chunk_size(n: int, parts: int) -> int:
    """Largest piece ``torch.chunk(n, parts)`` makes (what rank 0 holds)."""
    return -(-n // parts) if n else 0


def local_shape(shape: tuple[int, ...], layout: Layout, mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Local shape on rank 0; shards of one dim over several axes are split in axis order."""
    out = list(shape)
    for placement, m in zip(layout, mesh_shape):
        if isinstance(placement, Shard):
            out[placement.dim] = chunk_size(out[placement.dim], m)
    return tuple(out)


@functools.lru_cache(maxsize=1 << 16)  # the planner prices every layout of every tensor, often
def local_numel(shape: tuple[int, ...], layout: Layout, mesh_shape: tuple[int, ...]) -> int:
    return math.prod(local_shape(shape, layout, mesh_shape))


def replication(layout: Layout, mesh_shape: tuple[int, ...]) -> int:
    """Product of the mesh axes on which the tensor is not split (docs/design.md): on those axes
    every device holds a full-size piece, a copy (Replicate) or a summand (Partial); either way
    all but one of them are bytes beyond the tensor's unique size."""
    return math.prod(m for p, m in zip(layout, mesh_shape) if not isinstance(p, Shard))


def redundant_fraction(layout: Layout, mesh_shape: tuple[int, ...]) -> float:
    return 1.0 - 1.0 / replication(layout, mesh_shape)


def is_valid(layout: Layout, shape: tuple[int, ...], mesh: Mesh) -> bool:
    """Every shard dim exists and is at least as large as the number of pieces (torch.chunk
    may still leave the last devices an empty piece, e.g. 5 over 4 gives 2, 2, 1)."""
    sizes = list(shape)
    for placement, m in zip(layout, mesh.shape):
        if isinstance(placement, Shard):
            if placement.dim >= len(shape) or sizes[placement.dim] < m:
                return False
            sizes[placement.dim] = chunk_size(sizes[placement.dim], m)
    return True
