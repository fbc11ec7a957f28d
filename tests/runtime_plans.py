"""The runtime tests' searched plans, saved as JSON: the ranks start without a search.

Each plan is named by a :class:`Search` (what ``memshard.plan`` was asked) and saved under
``tests/data/plans/``. ``saved(search)`` loads one; ``fresh(search)`` runs its search now.
``tests/planner/test_runtime_plans.py`` checks every saved plan against a fresh search, so a
change to the planner that moves one of these plans fails there, with the command to run:

    python -m tests.runtime_plans        # writes every plan anew
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from pathlib import Path

import memshard
from memshard.plans.plan import Plan, load_plan

PLANS = Path(__file__).resolve().parent / "data" / "plans"
BATCH = 8
# every search's limit, far above the time the tests' searches take: the plan is the same on a
# loaded machine
SEARCH_LIMIT_S = 60
REWRITE = "python -m tests.runtime_plans"


@dataclass(frozen=True)
class Search:
    """One ``memshard.plan`` call. A time plan's memory budget is ``budget`` times the peak of
    the least-memory plan of the same job without recomputation (which is also its start, when
    ``start`` is set)."""

    model: str
    mesh: str
    objective: str = "memory"
    zero3_unit: str = "op"
    precision: str = "fp32"
    recompute: str = "none"
    seq: int | None = None
    batch: int = BATCH
    mip_gap: float = 0.05
    time_limit_s: float = SEARCH_LIMIT_S
    budget: float | None = None
    start: bool = False
    gpu: str | None = None  # None: the default GPU

    @property
    def name(self) -> str:
        parts = [self.model, self.mesh, self.objective, self.precision, f"unit-{self.zero3_unit}",
                 f"recompute-{self.recompute}", f"b{self.batch}"]
        if self.seq:
            parts.append(f"s{self.seq}")
        if self.budget:
            parts.append(f"budget{self.budget:g}" + ("-started" if self.start else ""))
        if self.gpu:
            parts.append(self.gpu)
        return "_".join(parts)

    def least_memory(self) -> Search:
        """The least-memory search of the same job without recomputation (a time plan's base)."""
        return Search(self.model, self.mesh, zero3_unit=self.zero3_unit, precision=self.precision,
                      seq=self.seq, batch=self.batch, gpu=self.gpu)


# Searches priced on another GPU than the default. Priced on H100s, the layer-unit search of
# tiny LLaMA on 2x2 runs past its minute with a 6.5% gap; on A100s it proves its plan within
# the gap in seconds. The runtime runs either alike.
GPU = {("tiny-llama", "2x2", "layer"): "a100-80gb"}


def least_memory(model: str, mesh: str, unit: str = "op", precision: str = "fp32", recompute: str = "none",
                 seq: int | None = None, time_limit_s: float = SEARCH_LIMIT_S) -> Search:
    return Search(model, mesh, zero3_unit=unit, precision=precision, recompute=recompute, seq=seq,
                  time_limit_s=time_limit_s, gpu=GPU.get((model, mesh, unit)))


def fastest(model: str, mesh: str, budget: float, unit: str = "op", precision: str = "fp32",
            recompute: str = "none", start: bool = True) -> Search:
    return Search(model, mesh, "time", zero3_unit=unit, precision=precision, recompute=recompute, budget=budget,
                  start=start)


@functools.cache
def fresh(search: Search) -> Plan:
    """The plan ``search`` finds now."""
    options = dict(batch=search.batch, seq=search.seq, precision=search.precision, zero3_unit=search.zero3_unit,
                   recompute=search.recompute, mip_gap=search.mip_gap, time_limit_s=search.time_limit_s, gpu=search.gpu)
    if search.objective == "memory":
        return memshard.plan(search.model, search.mesh, **options)
    base = fresh(search.least_memory())
    return memshard.plan(search.model, search.mesh, objective="time", memory_budget=int(base.peak_bytes * search.budget),
                         start=base if search.start else None, **options)


@functools.cache
def saved(search: Search) -> Plan:
    """The plan saved for ``search`` (written by :func:`write`)."""
    path = PLANS / f"{search.name}.json"
    if not path.exists():
        raise FileNotFoundError(f"no saved plan {path.name}: add its Search to SEARCHES and run `{REWRITE}`")
    return load_plan(str(path))


# Every searched plan the runtime tests run (tests/runtime/test_runtime.py and test_simulate.py).
SEARCHES = (
    *(least_memory(m, mesh) for m in ("tiny-gpt", "tiny-llama") for mesh in ("4", "2x2", "1x4", "2x2x2")),
    fastest("tiny-gpt", "2x2", 2.0), fastest("tiny-llama", "1x4", 1.3), fastest("tiny-llama", "2x2x2", 1.3),
    least_memory("tiny-llama", "2x2", "layer"),
    least_memory("tiny-gpt", "1x4", recompute="auto", seq=128, time_limit_s=120),
    least_memory("tiny-gpt", "4", recompute="full", time_limit_s=20),
    fastest("tiny-llama", "1x4", 1.02, recompute="auto", start=False),
    *(least_memory(m, mesh, precision="mixed") for m, mesh in
      (("tiny-gpt", "4"), ("tiny-llama", "2x2"), ("tiny-gpt", "2x2x2"))),
    least_memory("tiny-gpt", "4", precision="mixed", recompute="full"),
    fastest("tiny-llama", "1x4", 1.3, precision="mixed"),
    Search("gpt3-6.7b", "8x8", batch=64, seq=2048, precision="mixed", mip_gap=0.02),
    Search("llama3-8b", "4x8", batch=32, seq=2048, mip_gap=0.02),
)


def without_timing(plan: Plan) -> dict:
    """The plan's JSON less the one figure that varies from run to run: the search's time."""
    data = plan.to_dict()
    del data["solver"]["time_s"]
    return data


def write(searches=SEARCHES) -> None:
    PLANS.mkdir(parents=True, exist_ok=True)
    for search in searches:
        fresh(search).save(str(PLANS / f"{search.name}.json"))
        print("wrote", search.name)


if __name__ == "__main__":
    wanted = sys.argv[1:]
    write([s for s in SEARCHES if not wanted or s.name in wanted])
