"""The figures that scale the ILP and seed its search: plan-independent bounds and typical
values of the peak and the step time, and the units the model counts bytes and seconds in."""

from __future__ import annotations

import math
from dataclasses import dataclass

from memshard.baselines.rules import SplitUnavailable, data_parallel
from memshard.problem.bounds import peak_lower_bound, zero_redundancy_bound
from memshard.problem.evaluate import step_time
from memshard.problem.records import Problem


@dataclass(frozen=True)
class Reference:
    memory_floor_bytes: float  # zero-redundancy bound: no plan's peak is lower (and the scale)
    least_peak_bytes: float  # a tighter plan-independent bound (``bounds.peak_lower_bound``)
    time_floor_s: float  # every group at its fastest, no resharding, overlap all hidden: none faster
    time_estimate_s: float  # a typical memory-lean plan's step time (ZeRO-3 where it exists)
    time_scale_s: float  # the slowest choice of every group: an over-estimate, of the right order

    @property
    def units(self) -> tuple[float, float]:
        """Bytes and seconds per model unit: a power of two near the zero-redundancy bound and
        a power of ten near the step time, so the peak and the step time are O(1) in the model
        and HiGHS's absolute tolerances mean the same at any model size."""
        bytes_unit = 2.0 ** round(math.log2(max(self.memory_floor_bytes, 1.0)))
        # (a plan's step time, not the slowest choices': that one is 10³–10⁴× the step time of
        # a large job, and a time objective of 10⁻³ leaves HiGHS's simplex stalling on costs
        # below its dual tolerance)
        time_unit = 10.0 ** round(math.log10(max(self.time_estimate_s, self.time_scale_s / 100, 1e-12)))
        return bytes_unit, time_unit


def reference(problem: Problem) -> Reference:
    hidden = problem.overlaps
    time_floor = sum(g.instances * min(c.time_s - c.overlapped_s * hidden for c in g.choices) for g in problem.groups)
    try:
        time_estimate = step_time(problem, data_parallel(problem, 3))
    except (SplitUnavailable, ValueError):  # no ZeRO-3 here (e.g. a batch smaller than the mesh)
        time_estimate = time_floor
    zero_redundancy = zero_redundancy_bound(problem)
    return Reference(
        memory_floor_bytes=float(zero_redundancy.max()),
        least_peak_bytes=peak_lower_bound(problem, zero_redundancy),
        time_floor_s=time_floor,
        time_estimate_s=time_estimate,
        # even where latencies, not FLOPs, dominate (tiny models)
        time_scale_s=sum(g.instances * max(c.time_s for c in g.choices) for g in problem.groups),
    )
