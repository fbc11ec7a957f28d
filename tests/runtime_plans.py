"""The runtime tests' searched plans, saved as JSON: the ranks start without a search.

Each plan is named by a :class:`Search` (what ``memshard.plan`` was asked) and saved under
``tests/data/plans/``, with the fingerprint of its search's input (``fingerprint``) in
``tests/data/plans/inputs.json``. ``saved(search)`` loads one; ``fresh(search)`` runs its search
now. ``tests/planner/test_runtime_plans.py`` checks every saved plan against a fresh search
(against its fingerprint where the search is long, ``LONG``), so a change to the planner that
moves one of these plans fails there, with the command to run:

    python -m tests.runtime_plans        # writes every plan anew
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import hashlib
import importlib.metadata
import json
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import memshard
from memshard.api import make_job
from memshard.planner import SearchOptions, searched_problem
from memshard.plans.plan import Plan, load_plan
from memshard.search import highs, passes, reference, solve, stages
from memshard.search.formulation import Formulation

ROOT = Path(__file__).resolve().parents[1]
PLANS = ROOT / "tests" / "data" / "plans"
INPUTS = PLANS / "inputs.json"  # search name → the fingerprint of its input when its plan was written
BATCH = 8
# every search's limit, far above the time the tests' searches take: the plan is the same on a
# loaded machine
SEARCH_LIMIT_S = 60
REWRITE = "python -m tests.runtime_plans"
# the modules that run the search on a formulated problem (their code is in each fingerprint)
SEARCH_STAGES = (solve, passes, highs, stages, reference)


@dataclass(frozen=True)
class Search:
    """One ``memshard.plan`` call. ``model``: a preset's name, or a Hugging Face config.json
    (its path from the repository's root: the model traced). A time plan's memory budget is
    ``budget`` times the peak of the least-memory plan of the same job without recomputation
    (which is also its start, when ``start`` is set); it is searched on the mesh as typed (no
    other view: the runtime's tests are about the mesh they name)."""

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
    def source(self) -> str | memshard.HFModel:
        """What ``memshard.plan`` is given: the preset's name, or the Hugging Face model traced
        from the config's contents (as a saved plan holds it: the same plan from any checkout)."""
        if not self.model.endswith(".json"):
            return self.model
        return memshard.HFModel(json.loads((ROOT / self.model).read_text()))

    @property
    def name(self) -> str:
        model = f"hf-{Path(self.model).stem}" if self.model.endswith(".json") else self.model
        parts = [model, self.mesh, self.objective, self.precision, f"unit-{self.zero3_unit}",
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


def traced(config: str, mesh: str, batch: int, seq: int) -> Search:
    """The least-memory plan of a Hugging Face model in fp32 (``config``: its config.json from
    the repository's root), searched to a 2% gap."""
    return Search(config, mesh, seq=seq, batch=batch, mip_gap=0.02)


def job_options(search: Search) -> dict:
    """``memshard.plan``'s keywords for ``search``, less the objective, budget and start."""
    return dict(batch=search.batch, seq=search.seq, precision=search.precision, zero3_unit=search.zero3_unit,
                recompute=search.recompute, mip_gap=search.mip_gap, time_limit_s=search.time_limit_s, gpu=search.gpu)


def memory_budget(search: Search, base: Plan) -> int:
    """A time plan's memory budget: ``budget`` times the peak of ``base`` (its least-memory plan)."""
    return int(base.peak_bytes * search.budget)


@functools.cache
def fresh(search: Search) -> Plan:
    """The plan ``search`` finds now."""
    options = job_options(search)
    if search.objective == "memory":
        return memshard.plan(search.source, search.mesh, **options)
    base = fresh(search.least_memory())
    return memshard.plan(search.source, search.mesh, objective="time", memory_budget=memory_budget(search, base),
                         start=base if search.start else None, mesh_views=False, **options)


def canonical_tokens(value, seen: dict[int, int]):
    """``value`` as a stream of text tokens, the same for equal records in any process:
    dataclasses by their compared fields, other objects by their attributes, sets sorted,
    arrays by dtype, shape and bytes, floats exactly, tuples and frozen dataclasses by their
    items, however many hold them (a cache shared between records changes nothing); any other
    object met again by its first token's number (``seen``: the objects met so far)."""
    if value is None or isinstance(value, (bool, int, str, bytes)):
        yield repr(value)
        return
    if isinstance(value, float):
        yield value.hex()
        return
    if isinstance(value, enum.Enum):
        yield f"{type(value).__qualname__}.{value.name}"
        return
    if isinstance(value, np.generic):
        yield from canonical_tokens(value.item(), seen)
        return
    if isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType, types.MethodType)):
        yield f"callable {value.__module__}.{value.__qualname__}"
        return
    by_value = isinstance(value, tuple) or (dataclasses.is_dataclass(value) and value.__dataclass_params__.frozen)
    if not by_value and id(value) in seen:
        yield f"again {seen[id(value)]}"
        return
    if not by_value:
        seen[id(value)] = len(seen)
    yield f"<{type(value).__qualname__}"
    if isinstance(value, np.ndarray):
        yield f"{value.dtype.str} {value.shape}"
        yield np.ascontiguousarray(value).tobytes().hex() if value.dtype != object else ""
        if value.dtype == object:
            for item in value.ravel():
                yield from canonical_tokens(item, seen)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from canonical_tokens(key, seen)
            yield from canonical_tokens(item, seen)
    elif isinstance(value, (set, frozenset)):
        yield from sorted("".join(canonical_tokens(item, {})) for item in value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from canonical_tokens(item, seen)
    elif dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            if f.compare:
                yield f.name
                yield from canonical_tokens(getattr(value, f.name), seen)
    elif hasattr(value, "__dict__"):
        for name, item in sorted(vars(value).items()):
            yield name
            yield from canonical_tokens(item, seen)
    else:
        raise TypeError(f"no canonical form for {type(value).__qualname__}")
    yield ">"


def search_code() -> str:
    """The code of the search's stages (``SEARCH_STAGES``), as Python reads it: comments,
    docstrings and layout left out."""
    dumps = []
    for module in SEARCH_STAGES:
        tree = ast.parse(Path(module.__file__).read_text())
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                    and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                node.body = body[1:] or [ast.Pass()]
        dumps.append(ast.dump(tree))
    return "\n".join(dumps)


def fingerprint(search: Search) -> str:
    """A hash of everything ``search``'s search reads, as it stands now: the search as asked,
    the problem it searches (every group's priced choices, every slot, edge, link, conflict
    and reshard point of the priced graph, on the mesh searched), that problem's ILP (every
    column and row of its formulation, with the peak and step-time objectives), the code of
    the search's stages (``search_code``), HiGHS's version, and for a time plan its memory
    budget in bytes and its start (from its least-memory plan: the saved one, itself
    checked, where saved). The search is deterministic (each saved plan not in ``LONG`` is
    found again by a fresh search, in another process; test_cli's two plans are byte for
    byte the same): the same fingerprint, the same plan."""
    job = make_job(search.source, search.mesh, batch=search.batch, seq=search.seq, gpu=search.gpu,
                   precision=search.precision)
    options = SearchOptions(search.objective, zero3_unit=search.zero3_unit, time_limit_s=search.time_limit_s,
                            mip_gap=search.mip_gap, recompute=search.recompute, mesh_views=False)
    problem = searched_problem(job, options)
    formulation = Formulation(problem)
    formulation.add_plan_constraints(problem.candidate_points)
    parts: list = [search, options, problem, formulation.model, formulation.peak_expression(),
                   formulation.time_expression(), search_code(), importlib.metadata.version("highspy")]
    if search.objective == "time":
        least = search.least_memory()
        base = saved(least) if least in SEARCHES else fresh(least)
        parts += [memory_budget(search, base), base.searched_selection if search.start else None]
    digest = hashlib.sha256()
    for token in canonical_tokens(parts, {}):
        digest.update(token.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def recorded_fingerprints() -> dict[str, str]:
    """The fingerprints written with the saved plans (``inputs.json``)."""
    return json.loads(INPUTS.read_text()) if INPUTS.exists() else {}


def saved_path(search: Search) -> Path:
    """Where the plan of ``search`` is saved."""
    return PLANS / f"{search.name}.json"


@functools.cache
def saved(search: Search) -> Plan:
    """The plan saved for ``search`` (written by :func:`write`)."""
    path = saved_path(search)
    if not path.exists():
        raise FileNotFoundError(f"no saved plan {path.name}: add its Search to SEARCHES and run `{REWRITE}`")
    return load_plan(str(path))


# The README's tiny LLaMA (examples/tiny_llama.json), traced: the standard loop's run
# (tests/runtime/test_training_loop.py), and examples/train.py's on 2 ranks, whose every rank
# would search it otherwise.
TINY_LLAMA_LOOP = traced("examples/tiny_llama.json", "4", 4, 16)
TINY_LLAMA_EXAMPLE = traced("examples/tiny_llama.json", "2", 8, 32)
# The traced LLaMA that tests/baselines/test_baselines.py lays out for tensor parallelism: its
# least-memory plan, against which the baselines are checked (a long branch and bound).
LLAMA_TP = traced("tests/data/configs/llama_tp.json", "2x2", 4, 32)

# Every searched plan the runtime tests run (tests/runtime/test_runtime.py, test_simulate.py and
# test_training_loop.py), and LLAMA_TP.
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
    TINY_LLAMA_LOOP, TINY_LLAMA_EXAMPLE, LLAMA_TP,
)

# The searches that take longest (tiny models: their LP bound is loose, and branch and bound
# runs on): test_runtime_plans checks their plans against their input's fingerprint instead of
# a fresh search; the others' fresh searches (meshes of one, two and three axes, a time plan
# from a start, the two large models) check that the search finds the plans it saved.
LONG = frozenset({
    least_memory("tiny-gpt", "2x2"), fastest("tiny-gpt", "2x2", 2.0),
    least_memory("tiny-llama", "2x2"), least_memory("tiny-llama", "2x2", "layer"),
    least_memory("tiny-llama", "2x2", precision="mixed"),
    least_memory("tiny-gpt", "1x4", recompute="auto", seq=128, time_limit_s=120),
    fastest("tiny-llama", "1x4", 1.02, recompute="auto", start=False),
    fastest("tiny-llama", "2x2x2", 1.3), fastest("tiny-llama", "1x4", 1.3, precision="mixed"),
    TINY_LLAMA_LOOP, TINY_LLAMA_EXAMPLE, LLAMA_TP,  # (traced and priced, then several seconds of search)
})


def without_timing(plan: Plan | dict) -> dict:
    """The plan's JSON (a plan, or a plan's JSON as read) less the one figure that varies from
    run to run: the search's time."""
    data = plan.to_dict() if isinstance(plan, Plan) else {**plan, "solver": dict(plan["solver"])}
    del data["solver"]["time_s"]
    return data


def saved_json(search: Search) -> dict:
    """The saved plan's file as written (``saved`` prices its choices again)."""
    return json.loads(saved_path(search).read_text())


def write(searches=SEARCHES) -> None:
    """Search ``searches`` anew and save their plans, each with its input's fingerprint."""
    PLANS.mkdir(parents=True, exist_ok=True)
    fingerprints = recorded_fingerprints()
    for search in searches:
        fresh(search).save(str(saved_path(search)))
        saved.cache_clear()  # (a time plan's fingerprint reads its least-memory plan as saved)
        fingerprints[search.name] = fingerprint(search)
        print("wrote", search.name)
    names = {s.name for s in SEARCHES}
    INPUTS.write_text(json.dumps({k: v for k, v in sorted(fingerprints.items()) if k in names}, indent=1) + "\n")


if __name__ == "__main__":
    wanted = sys.argv[1:]
    write([s for s in SEARCHES if not wanted or s.name in wanted])
