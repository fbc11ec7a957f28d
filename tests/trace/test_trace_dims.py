"""The dims algebra of traced graphs (pure Python): views regroup atoms, unification refines."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from memshard.trace.dims import Atoms, DimConflict


def sizes(atoms: Atoms, axis) -> list[int]:
    return [atoms.size[a] for a in atoms.leaves(axis)]


def test_view_splits_an_axis_and_the_split_is_seen_everywhere():
    A = Atoms()
    b, s, h = A.axis(2), A.axis(8), A.axis(128)
    w_out = h  # a weight that shares h with the activation
    out = A.regroup([b, s, h], [2, 8, 4, 32])
    assert [sizes(A, ax) for ax in out] == [[2], [8], [4], [32]]
    assert sizes(A, w_out) == [4, 32]  # the weight's axis is now heads × head_dim
    merged = A.regroup(out, [16, 128])
    assert [sizes(A, ax) for ax in merged] == [[2, 8], [4, 32]]


def test_unify_refines_both_sides_to_a_common_factorisation():
    A = Atoms()
    x, y = A.axis(24), A.axis(24)
    A.regroup([x], [4, 6])
    A.regroup([y], [2, 12])
    A.unify(x, y)
    assert sizes(A, x) == sizes(A, y) == [2, 2, 6]
    assert A.leaves(x) == A.leaves(y)


def test_conflicting_sizes_are_refused():
    A = Atoms()
    with pytest.raises(DimConflict):
        A.unify(A.axis(6), A.axis(4))
    with pytest.raises(DimConflict):
        A.regroup([A.axis(6)], [4, 2])  # 6 elements cannot become 8


@given(st.lists(st.integers(2, 5), min_size=1, max_size=5), st.data())
def test_any_regrouping_keeps_the_atoms_in_order(factors, data):
    A = Atoms()
    axis = A.axis(math.prod(factors))
    A.regroup([axis], factors)  # refine into the given factors
    # any consecutive grouping of those factors is a valid view of the same atoms
    cuts = sorted(data.draw(st.sets(st.integers(1, len(factors) - 1), max_size=len(factors) - 1))) if len(factors) > 1 else []
    bounds = [0, *cuts, len(factors)]
    view = [math.prod(factors[a:b]) for a, b in zip(bounds, bounds[1:])]
    out = A.regroup([axis], view)
    assert [a for ax in out for a in A.leaves(ax)] == list(A.leaves(axis))
    assert [A.numel(ax) for ax in out] == view
