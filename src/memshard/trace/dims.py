"""Named dims of a traced graph: atoms, their unions and their refinements.

Every axis of every traced tensor is a sequence of *atoms* (outermost first); an atom is a
dimension of the iteration space with a size. ``view(x, [b, s, n, d])`` of ``x[b, s, h]``
refines the atom ``h`` into ``(n, d)`` everywhere ``h`` appears (the q-projection weight
``[h_out, h]`` becomes ``[n, d, h]``), and a broadcast or a contraction unifies two atoms into
one. Views, transposes and broadcasts therefore cost nothing in the IR: they only rename.

The algebra is pure Python (no torch): a union-find over atom ids where a root may be refined
into a list of finer atoms. Size-1 atoms are never made; a size-1 axis is an empty sequence.
"""

from __future__ import annotations

import math


class DimConflict(Exception):
    """Two axes cannot be the same dims (their sizes do not factor alike)."""


class Atoms:
    def __init__(self) -> None:
        self.size: list[int] = []
        self.parent: list[int] = []
        self.factors: dict[int, tuple[int, ...]] = {}

    def new(self, size: int) -> int:
        if size < 2:
            raise ValueError("atoms have size ≥ 2")
        self.size.append(size)
        self.parent.append(len(self.parent))
        return len(self.parent) - 1

    def axis(self, size: int) -> tuple[int, ...]:
        """A fresh axis of ``size``: one new atom, or none for size 1."""
        return () if size == 1 else (self.new(size),)

    def find(self, a: int) -> int:
        root = a
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[a] != root:  # path compression
            self.parent[a], a = root, self.parent[a]
        return root

    def leaves(self, atoms: tuple[int, ...] | list[int]) -> tuple[int, ...]:
        out: list[int] = []
        for a in atoms:
            r = self.find(a)
            if r in self.factors:
                out.extend(self.leaves(self.factors[r]))
            else:
                out.append(r)
        return tuple(out)

    def numel(self, atoms) -> int:
        return math.prod(self.size[a] for a in self.leaves(atoms))

    def _split(self, leaf: int, outer: int) -> tuple[int, int]:
        """Refine a leaf of size ``outer·inner`` into ``(outer, inner)``."""
        n = self.size[leaf]
        if n % outer or outer in (1, n):
            raise DimConflict(f"cannot split a dim of {n} into {outer} × {n // max(outer, 1)}")
        pair = (self.new(outer), self.new(n // outer))
        self.factors[leaf] = pair
        return pair

    def _union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return
        if self.size[ra] != self.size[rb]:
            raise DimConflict(f"dims of {self.size[ra]} and {self.size[rb]} cannot be one")
        if ra in self.factors or rb in self.factors:  # unify their refinements instead
            fa = self.factors.get(ra, (ra,))
            fb = self.factors.get(rb, (rb,))
            keep, other = (ra, rb) if ra in self.factors else (rb, ra)
            self.parent[other] = keep
            self.unify(fa, fb)
            return
        lo, hi = min(ra, rb), max(ra, rb)
        self.parent[hi] = lo

    def unify(self, xs, ys) -> None:
        """Make two atom sequences of equal size the same dims, refining where they differ."""
        xs, ys = list(self.leaves(xs)), list(self.leaves(ys))
        if self.numel(xs) != self.numel(ys):
            raise DimConflict(f"axes of {self.numel(xs)} and {self.numel(ys)} elements cannot be one")
        i = j = 0
        while i < len(xs) and j < len(ys):
            a, b = self.find(xs[i]), self.find(ys[j])
            na, nb = self.size[a], self.size[b]
            if na == nb:
                self._union(a, b)
                i += 1
                j += 1
            elif na > nb:
                outer, inner = self._split(a, nb)
                self._union(outer, b)
                xs[i] = inner
                j += 1
            else:
                outer, inner = self._split(b, na)
                self._union(a, outer)
                ys[j] = inner
                i += 1

    def regroup(self, axes: list[tuple[int, ...]], sizes: list[int]) -> list[tuple[int, ...]]:
        """The axes of ``view(x, sizes)`` given x's axes: the same atoms, regrouped, refined
        where a new boundary falls inside one."""
        flat = list(self.leaves([a for axis in axes for a in axis]))
        out: list[tuple[int, ...]] = []
        for n in sizes:
            group: list[int] = []
            have = 1
            while have < n:
                if not flat:
                    raise DimConflict(f"view to {sizes} does not match the input's size")
                a = self.find(flat.pop(0))
                m = self.size[a]
                if have * m <= n and n % (have * m) == 0:
                    group.append(a)
                    have *= m
                else:
                    need = n // have
                    if n % have or m % need:
                        raise DimConflict(f"view to {sizes} splits a dim of {m} unevenly")
                    outer, inner = self._split(a, need)
                    group.append(outer)
                    have *= need
                    flat.insert(0, inner)
            out.append(tuple(group))
        if flat:
            raise DimConflict(f"view to {sizes} does not match the input's size")
        return out
