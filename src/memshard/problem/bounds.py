"""Lower bounds on the peak of every plan of a problem, plan-independent: the
zero-redundancy bound (every live tensor split evenly over all devices, held once) and the
least-choice bound (every live item at its own smallest choice). The evaluator reports the
first beside each plan's peak; the search proves plans optimal with both."""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from memshard.problem.records import DURING_RESHARDS, Problem


def _held_once(problem: Problem, out: np.ndarray, nbytes_of) -> None:
    """Add each held tensor's ``nbytes_of(held)`` over the union of its holders' intervals."""
    n_points = problem.schedule.num_points
    spans = defaultdict(list)
    for h in problem.holders:
        if not problem.may_drop(h):
            spans[h.tensor].append((h.start, h.end))
    for t, intervals in spans.items():
        intervals.sort()
        nbytes = nbytes_of(problem.held[t])
        lo, hi = intervals[0]
        for start, end in [*intervals[1:], (n_points + 1, n_points + 1)]:
            if start > hi + 1:  # a gap: the tensor is not live in between
                out[lo] += nbytes
                out[hi + 1] -= nbytes
                lo, hi = start, end
            else:
                hi = max(hi, end)


def least_choice_bound(problem: Problem) -> np.ndarray:
    """Per schedule point, the live bytes per device if every item there took its own
    smallest choice (held tensors once, in their smallest layout; no copies, no reshard
    buffers): a lower bound on any plan's live bytes there, plan-independent like the
    zero-redundancy bound and tighter where items cannot be split evenly (a replicated op,
    a dim no mesh axis divides). Where an item is priced by whichever of two slots its
    choice selects, each slot's minimum may be zero: :func:`peak_lower_bound` takes the larger
    of the two bounds at each point."""
    n_points = problem.schedule.num_points
    least = np.zeros(n_points + 1)
    for c in problem.constants:
        least[c.start] += c.nbytes
        least[c.end + 1] -= c.nbytes
    for s in problem.slots:
        if s.phase == DURING_RESHARDS:  # instead of another slot, not beside it
            continue
        m = float(s.nbytes.min())
        least[s.start] += m
        least[s.end + 1] -= m
    for g in problem.shared_gradients:  # what a plan may take back from the slots
        m = float(g.nbytes.max())
        least[g.start] -= m
        least[g.end + 1] += m
    _held_once(problem, least, lambda held: float(np.min(held.nbytes)))
    return np.cumsum(least)[:n_points]


def peak_lower_bound(problem: Problem, zero_redundancy: np.ndarray | None = None) -> float:
    """No plan's peak is lower: the larger of the two plan-independent bounds, point by point
    (``zero_redundancy``: :func:`zero_redundancy_bound`, if already computed)."""
    if zero_redundancy is None:
        zero_redundancy = zero_redundancy_bound(problem)
    return float(np.maximum(zero_redundancy, least_choice_bound(problem)).max())


def zero_redundancy_bound(problem: Problem) -> np.ndarray:
    """Per schedule point, the live bytes per device if every live tensor were split evenly
    over all devices, held once: a lower bound on any plan's live bytes there. Which tensors
    live when does not depend on the plan (a re-gathered copy lives only where its saved copy
    does), so neither does the bound."""
    n_points = problem.schedule.num_points
    unique = np.zeros(n_points + 1)
    for item in (*problem.constants, *problem.slots):
        unique[item.start] += item.global_bytes
        unique[item.end + 1] -= item.global_bytes
    for g in problem.shared_gradients:  # held once
        unique[g.start] -= g.global_bytes
        unique[g.end + 1] += g.global_bytes
    _held_once(problem, unique, lambda held: held.global_bytes)
    return np.cumsum(unique)[:n_points] / problem.mesh.num_devices
