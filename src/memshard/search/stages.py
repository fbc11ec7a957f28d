"""The record of a search's stages: which ran, in order, what each found and proved, how long
it took and why it stopped (``docs/search.md`` lists the stages and what each proves).

A stage is one step of the search: a dive, the search within a relaxation's support,
reduced-cost fixing, a branch and bound, a relaxation, a round of lazy rows, the tie-break
pass. Each appends one :class:`StageRecord` to the :class:`StageLog` of its search as it ends;
the log is kept on the search's result (``SolveResult.stages``) and on the plan
(``SolverSummary.stages``), and ``memshard plan --verbose`` shows it. It changes nothing the
search does: it is what tests and users read to see what the search did. :class:`TimeOut` is
the test knob that makes time run out at a named stage's run (``docs/search.md``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

# What a stage's figures measure: the plan's peak (bytes), its step time (seconds), or a
# blend of the two (the model's units: the peak over its byte unit plus a small multiple of
# the step time over its time unit, or the other way round).
MEMORY, TIME, BLEND = "memory", "time", "blend"


@dataclass(frozen=True)
class StageRecord:
    """One stage of a search: its ``name``; what it minimised (``objective``: MEMORY, TIME or
    BLEND); the objective of the plan it found (``found``; None: none) and of the plan it
    started from (``start``; None: none given); the lower bound it proved on that objective
    (``bound``; None: none); its wall time; why it stopped; and, where several searches make
    one plan (both ZeRO-3 units), which search it belongs to (``scope``)."""

    name: str
    objective: str
    found: float | None
    bound: float | None
    time_s: float
    stopped: str
    start: float | None = None
    scope: str = ""

    def scaled(self, bytes_unit: float, time_unit: float) -> StageRecord:
        """This record with its figures in bytes or seconds instead of the model's units
        (a blend's stay in the model's units)."""
        unit = {MEMORY: bytes_unit, TIME: time_unit}.get(self.objective, 1.0)
        return replace(self, found=_times(self.found, unit), bound=_times(self.bound, unit),
                       start=_times(self.start, unit))


@dataclass(frozen=True)
class TimeOut:
    """A test knob (``SearchLimits.time_out``, ``SearchOptions.time_out``): time runs out at
    the ``run``-th run (from 0) of the stage ``stage``, as it starts (or, ``at_end``, as it
    ends), as though the deadline had passed then. A search never sets it: it lets a test
    see what a search out of time at that stage returns."""

    stage: str
    run: int = 0
    at_end: bool = False

    def hits(self, stage: str, run: int, at_end: bool = False) -> bool:
        """Whether time runs out at the ``run``-th run of ``stage``, at its start or end."""
        return (self.stage, self.run, self.at_end) == (stage, run, at_end)


def _times(value: float | None, unit: float) -> float | None:
    return None if value is None else value * unit


class StageLog:
    """The stages of one search, in the order they ended."""

    def __init__(self) -> None:
        self.records: list[StageRecord] = []

    def add(self, name: str, objective: str, started: float, stopped: str, found: float | None = None,
            bound: float | None = None, start: float | None = None) -> None:
        """Append the stage ``name`` that began at ``started`` (``time.perf_counter()``) and
        ends now."""
        self.records.append(StageRecord(name, objective, found, bound, time.perf_counter() - started, stopped,
                                        start))

    def extend(self, records: tuple[StageRecord, ...] | list[StageRecord]) -> None:
        """Append ``records`` of another log (a search beside this one)."""
        self.records.extend(records)

    def named(self, name: str) -> list[StageRecord]:
        """The records of the stages called ``name``, in order."""
        return [r for r in self.records if r.name == name]


def in_scope(records: tuple[StageRecord, ...], scope: str) -> tuple[StageRecord, ...]:
    """``records`` of the search ``scope`` (one of several that make one plan)."""
    return tuple(replace(r, scope=scope) for r in records)
