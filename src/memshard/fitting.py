"""Inverse queries: how far one knob of a job can go within a device's memory (``memshard fit``).

The knob is the global batch, the sequence length, the number of layers or the hidden size
(which keeps the model's head size: the heads, key/value heads and MLP width scale with it),
pushed as far as it fits; or the devices (whole nodes of the mesh's inner axes, the global
batch kept), pulled as low as fits. A value *fits* a strategy when the strategy's peak at that
value is within the device memory (and, with a step-time budget or a slowdown bound, its step
within it): for memshard the least peak any plan has (a full least-memory search), for a
baseline its own plan's peak. The answer for each strategy is the boundary value, its plan,
and the least peak of the next value (``step`` further): the proof it does not fit, by the
solver's bound for memshard.

Search, per strategy: the peak of the best plan changes nearly affinely with each knob (tokens
and layers hold activations; a layer's states grow with it), so after the job's own value the
next probe is where the line through the last two probes (one probe: through the model states,
which the knob does not change, for batch and sequence) meets the memory; once a value fits
and one does not, false position between them, halving instead where a side repeats, down to
adjacent values. A value whose plan-independent lower bound (``bounds.peak_lower_bound``)
exceeds the memory is rejected without a search. Values are multiples of ``step``. The
baselines' searches run in step (``run_together``): the recipes that ask for the same value in
a round are priced together, the problems they share built once; each asks for what it would
alone.

A baseline may not lay a job out at every value: a recipe's data-parallel degree grows with the
devices and cannot exceed the batch, so Megatron-LM's TP 8 runs LLaMA-3 70B at batch 64 on 512
devices and on no more. A value it cannot lay out on the easy side of every value that needs
too much memory is a *wall*: the strategy reaches no further that way, and the search looks
between the wall and the nearest value that does not fit (halving where the line through the
probes points past the wall) instead of counting the wall as a value that does not fit.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field, replace

from memshard.baselines.names import parse_strategy
from memshard.core.errors import Infeasible, MemshardError
from memshard.core.mesh import MAX_DEVICES, resized
from memshard.core.quantities import MAX_COUNT, check_factor, format_bytes
from memshard.job import HFModel, Job
from memshard.models import ModelConfig
from memshard.models.config import MAX_LAYERS, follow_hidden
from memshard.pipelining import (
    PipelineOptions,
    pipeline_meshes,
    pipelined_baselines,
    plan_pipelined,
)
from memshard.planner import (
    SearchOptions,
    baseline_plans,
    baseline_problem,
    plan_job,
    searched_problem,
)
from memshard.plans.pipelined import PipelinedPlan
from memshard.plans.plan import Plan
from memshard.problem.bounds import peak_lower_bound

KNOBS = ("batch", "seq", "layers", "hidden")  # pushed as far as they fit (--max)
DEVICES = "devices"  # pulled as low as fits (--min): nodes of the mesh's inner axes
GROWTH = 64  # one extrapolated probe goes at most this many times further; devices no further


@dataclass(frozen=True)
class Probe:
    """One value of the knob for one strategy: its peak (memshard: the least any plan has),
    the proved lower bound on that (the peak itself for a fixed plan), whether it fits."""

    value: int
    peak_bytes: float
    bound_bytes: float
    fits: bool
    step_time_s: float | None = None
    note: str = ""  # why it does not fit where that is not its peak
    laid_out: bool = True  # False: the strategy cannot lay the job out at this value


@dataclass
class Answer:
    """A strategy's largest fitting value, its plan, and the next value's probe (the proof)."""

    strategy: str
    value: int | None = None
    plan: Plan | None = None
    next_probe: Probe | None = None
    probes: list[Probe] = field(default_factory=list)


@dataclass(frozen=True)
class FitResult:
    knob: str
    step: int
    device_memory_bytes: float
    max_step_time_s: float | None
    answers: tuple[Answer, ...]  # memshard first, then the baselines by largest value
    time_s: float
    limit: int = MAX_COUNT  # the largest value the model takes (``knob_limit``)
    max_slowdown: float | None = None  # every step within this × memshard's fastest fitting plan
    pipeline: int | None = None  # every plan's pipeline stages (1F1B), None: no pipeline

    def to_dict(self) -> dict:
        def probe(p: Probe | None):
            return None if p is None else {"value": p.value, "peak_bytes": p.peak_bytes, "bound_bytes": p.bound_bytes,
                                           "fits": p.fits, "step_time_s": p.step_time_s, "note": p.note,
                                           "laid_out": p.laid_out}

        return {"schema": "memshard.fit/1", "knob": self.knob, "step": self.step, "limit": self.limit,
                "device_memory_bytes": self.device_memory_bytes, "max_step_time_s": self.max_step_time_s,
                "max_slowdown": self.max_slowdown, "pipeline": self.pipeline,
                "time_s": self.time_s,
                "answers": [{"strategy": a.strategy, "value": a.value,
                             "peak_bytes": a.plan.peak_bytes if a.plan else None,
                             "step_time_s": a.plan.step_time_s if a.plan else None,
                             "next": probe(a.next_probe), "probes": [probe(p) for p in a.probes],
                             "plan": a.plan.to_dict() if a.plan is not None and a.strategy == "memshard" else None}
                            for a in self.answers]}


# -- the knob -------------------------------------------------------------------------------------
def knob_value(job: Job, knob: str) -> int:
    """The job's own value of ``knob``."""
    if knob == DEVICES:
        return job.mesh.num_devices
    if knob == "batch":
        return job.global_batch
    if knob == "seq":
        return job.seq_length
    cfg = job.config
    return cfg.num_layers if knob == "layers" else cfg.hidden


def default_step(job: Job, knob: str) -> int:
    """The granularity of ``knob``: whole micro-batches of the batch; for the hidden size a
    whole number of heads per key/value head; whole nodes (the inner axes) of devices; else 1."""
    if knob == DEVICES:
        return math.prod(job.mesh.shape[1:])
    if knob == "batch":
        return job.micro_batches
    if knob == "hidden":
        cfg = job.config
        return cfg.hidden // cfg.heads * (cfg.heads // math.gcd(cfg.heads, cfg.num_kv_heads))
    return 1


def knob_limit(job: Job, knob: str) -> int:
    """The largest value the model takes: learned positions bound the sequence, memshard's
    guard the layers."""
    if knob == "layers":
        return MAX_LAYERS
    if knob == DEVICES:
        return min(MAX_DEVICES, GROWTH * job.mesh.num_devices)
    if knob != "seq":
        return MAX_COUNT
    if isinstance(job.model, HFModel):
        from memshard.trace.hf import load_config, max_positions

        limit = max_positions(load_config(job.model.source, **job.hf_overrides()))
    else:
        cfg = job.config
        limit = None if cfg.family == "llama" else cfg.max_positions
    return min(limit or MAX_COUNT, MAX_COUNT)


def job_at(job: Job, knob: str, value: int) -> Job:
    """``job`` with ``knob`` at ``value`` (devices: the outermost mesh axis resized, the
    global batch kept)."""
    if knob == DEVICES:
        shape = (value // default_step(job, DEVICES), *job.mesh.shape[1:])
        return replace(job, mesh=resized(job.mesh, shape), batch=job.global_batch)
    if knob == "batch":
        return replace(job, batch=value)
    if knob == "seq":
        return replace(job, seq=value)
    cfg = job.config
    if knob == "layers":
        return replace(job, overrides={**job.overrides, "num_layers": value})
    # the job's own model resized, as an override of the hidden size means everywhere
    width = follow_hidden(cfg.width, value, {}, cfg.name)
    return replace(job, overrides={**job.overrides, "hidden": value, "heads": width.heads, "kv_heads": width.kv_heads,
                                   "ffn": width.ffn})


def _check(job: Job, knob: str, step: int | None) -> int:
    if knob not in (*KNOBS, DEVICES):
        raise MemshardError(f"fit varies one of {', '.join((*KNOBS, DEVICES))}, got {knob!r}")
    if not isinstance(job.model, (str, ModelConfig, HFModel)):
        raise MemshardError("fit rebuilds the job at every value: give a preset, a ModelConfig or a Hugging Face "
                            "model, not a graph or a module")
    if knob in ("layers", "hidden") and isinstance(job.model, HFModel):
        raise MemshardError(f"--max {knob} needs a built-in model (--model): a traced model's size is its own")
    natural = default_step(job, knob)
    if step is None:
        return natural
    if isinstance(step, bool) or not isinstance(step, int) or step < 1 or step % natural:
        raise MemshardError(f"the step of {knob} must be a positive multiple of {natural}, got {step!r}")
    if step > knob_limit(job, knob):
        raise MemshardError(f"the step of {knob} must be at most {knob_limit(job, knob):,}, got {step!r}")
    return step


# -- one strategy's search ---------------------------------------------------------------------------
class KnobSearch:
    """The boundary multiple of ``step`` whose ``probe`` fits (see the module docstring): the
    largest where a larger value needs more memory (``rising``), else (devices) the smallest.
    ``fixed_bytes``: what the probes' peaks hold whatever the knob (for the first
    extrapolation), ``memory``: the device memory the peaks are held against."""

    def __init__(self, strategy: str, probe: Callable[[int], tuple[Probe, Plan | None]], memory: float, step: int,
                 fixed_bytes: Callable[[Plan], float] | None, limit: int = MAX_COUNT, rising: bool = True):
        self.answer = Answer(strategy)
        self.probe, self.memory, self.step, self.fixed_bytes = probe, memory, step, fixed_bytes
        self.limit, self.rising = _round(limit, step), rising
        self.seen: dict[int, Probe] = {}
        self.plans: dict[int, Plan | None] = {}
        self.sides: list[bool] = []
        self.wall: int | None = None  # the value nearest the demanding side it cannot lay out (module docstring)

    def easier(self, a: int, b: int) -> bool:
        """Whether value ``a`` asks less of memory than ``b``."""
        return a < b if self.rising else a > b

    def run(self, start: int) -> Answer:
        """The answer, each value probed by ``probe`` as the search asks for it."""
        return run_together([self], start)[0]

    def steps(self, start: int) -> Generator[int, tuple[Probe, Plan | None], Answer]:
        """The search from ``start`` as a generator: it yields each value it needs probed and
        is sent that value's probe and plan; it returns the answer."""
        good = bad = None  # the best fitting and the nearest failing value so far
        value = min(_round(start, self.step), self.limit)
        demanding, easy = (self.limit, self.step) if self.rising else (self.step, self.limit)  # the two ends
        while True:
            p = yield from self.look(value)
            if not p.laid_out and good is None and (bad is None or self.easier(value, bad)):
                if self.wall is None or self.easier(self.wall, value):
                    self.wall = value
                if value == demanding or (bad is not None and abs(value - bad) <= self.step):
                    break  # nothing it can lay out is left between
                value = self.next_value(good, bad)
                continue
            self.sides.append(p.fits)
            good, bad = (value, bad) if p.fits else (good, value)
            if good is not None and bad is not None and abs(bad - good) <= self.step:
                break
            if (good is None and value == easy) or (bad is None and value == demanding):
                break
            if good is None and self.wall is not None and abs(self.wall - value) <= self.step:
                break
            value = self.next_value(good, bad)
        a = self.answer
        a.value, a.plan = good, self.plans.get(good)
        if good is not None:  # the proof: the next, more demanding value
            a.next_probe = self.seen.get(good + (self.step if self.rising else -self.step))
        else:  # nothing fits: the least any value seen needs
            a.next_probe = min(self.seen.values(), key=lambda p: (not math.isfinite(p.bound_bytes), p.bound_bytes))
        return a

    def look(self, value: int) -> Generator[int, tuple[Probe, Plan | None], Probe]:
        """The probe of ``value``: asked for (yielded) the first time only."""
        if value not in self.seen:
            self.seen[value], self.plans[value] = yield value
            self.answer.probes.append(self.seen[value])
            # A plan holds its whole problem: keep only the best fitting one, and the first
            # probe's while it alone places the next (its fixed bytes)
            fitting = [v for v, p in self.seen.items() if p.fits]
            keep = {(max if self.rising else min)(fitting)} if fitting else set()
            if len(self.seen) == 1:
                keep.add(value)
            self.plans = {v: p for v, p in self.plans.items() if v in keep}
        return self.seen[value]

    def next_value(self, good: int | None, bad: int | None) -> int:
        """False position between the two sides, halving where a side came up twice in a
        row; before both sides are known, the line through the two probes nearest the unknown
        side (or through the first one and its fixed bytes), at most GROWTH times further."""
        step = self.step
        if good is not None and bad is not None:
            lo, hi = sorted((good, bad))
            guess = None if self.sides[-1] == self.sides[-2] else self.crossing(self.seen[good], self.seen[bad])
            return min(max(_round(guess if guess is not None else (lo + hi) / 2, step), lo + step), hi - step)
        if good is None and bad is None:  # only walls so far: towards the demanding side
            return min(2 * self.wall, self.limit) if self.rising else max(_round(self.wall / 2, step), step)
        upwards = (good is not None) == self.rising  # towards larger values
        known = sorted((p for p in self.seen.values() if p.laid_out), key=lambda p: p.value)
        pair = known[-2:] if upwards else known[:2]
        if len(known) >= 2:
            guess = self.crossing(*pair)
        elif self.fixed_bytes is not None and self.plans.get(known[0].value) is not None:
            fixed = self.fixed_bytes(self.plans[known[0].value])
            guess = self.crossing(Probe(0, fixed, fixed, True), known[0])
        else:
            guess = None
        wall = self.wall if good is None else None  # walls lie on the easy side
        if upwards:
            last = known[-1].value
            guess = guess if guess is not None and guess > last else 2 * last
            if wall is not None and wall > last:
                guess = guess if guess < wall else (last + wall) / 2
                return min(max(_round(guess, step), last + step), wall - step)
            return min(max(_round(guess, step), last + step), GROWTH * last, self.limit)
        first = known[0].value
        guess = guess if guess is not None and 0 < guess < first else first / 2
        if wall is not None and wall < first:
            guess = guess if guess > wall else (first + wall) / 2
            return max(min(_round(guess, step), first - step), wall + step)
        return min(max(_round(guess, step), step, first // GROWTH), first - step)

    def crossing(self, a: Probe, b: Probe) -> float | None:
        """Where the line through two probes' peaks reaches the memory."""
        if not (math.isfinite(a.peak_bytes) and math.isfinite(b.peak_bytes)) or b.peak_bytes == a.peak_bytes:
            return None
        return a.value + (self.memory - a.peak_bytes) * (b.value - a.value) / (b.peak_bytes - a.peak_bytes)


def _round(value: float, step: int) -> int:
    return int(min(max(step, value // step * step), MAX_COUNT))


def run_together(searches: list[KnobSearch], start: int,
                 prepare: Callable[[int, set[str]], None] | None = None) -> list[Answer]:
    """The answer of each of ``searches`` from ``start``, the searches run in step: each
    round, the values they ask for next go to ``prepare`` (value → the strategies asking for
    it: the baselines' plans priced together, ``Prober.prepare``), then each search is sent
    its probe. A search asks for the values it would alone: its answer is the same."""
    steps = {k: search.steps(start) for k, search in enumerate(searches)}
    asked, answers = {}, {}
    for k, step in steps.items():
        _advance(k, step, None, asked, answers)
    while asked:
        if prepare is not None:
            wanted: dict[int, set[str]] = {}
            for k, value in asked.items():
                wanted.setdefault(value, set()).add(searches[k].answer.strategy)
            for value, names in wanted.items():
                prepare(value, names)
        for k, value in list(asked.items()):
            _advance(k, steps[k], searches[k].probe(value), asked, answers)
    return [answers[k] for k in range(len(searches))]


def _advance(k: int, step: Generator, sent: tuple[Probe, Plan | None] | None, asked: dict[int, int],
             answers: dict[int, Answer]) -> None:
    """Send search ``k`` its probe (None: start it): the next value it asks for goes to
    ``asked``, its answer, once it has one, to ``answers``."""
    try:
        asked[k] = step.send(sent)
    except StopIteration as done:
        asked.pop(k, None)
        answers[k] = done.value


# -- probes ------------------------------------------------------------------------------------------
def _model_states(plan: Plan | PipelinedPlan) -> float:
    b = (plan.peak_stage.plan if isinstance(plan, PipelinedPlan) else plan).memory.breakdown
    return b["parameters"] + b["gradients"] + b["optimizer_states"]


class Prober:
    """The probes of one job's knob: memshard's least-memory search and every baseline's plan
    at a value, each job built once. With ``pipeline``: memshard's pipelined plan of that many
    stages and the pipelined Megatron-LM configurations of that degree instead."""

    def __init__(self, job: Job, knob: str, options: SearchOptions, memory: float, slowdown: float | None = None,
                 pipeline: PipelineOptions | None = None):
        self.job, self.knob, self.options, self.memory, self.slowdown = job, knob, options, memory, slowdown
        self.pipeline = pipeline
        self.jobs: dict[int, tuple[Job, object]] = {}  # value → (job, its problem on the real mesh)
        self.baselines: dict[tuple[int, str], Plan | None] = {}
        self.pipelined: dict[int, dict[str, PipelinedPlan]] = {}  # value → the pipelined baselines' plans
        self.fastest: dict[int, float] = {}  # value → memshard's fastest step within the memory

    def step_budget(self, value: int) -> float | None:
        """The step-time budget at ``value``: the given one, or ``slowdown`` × memshard's
        fastest plan that fits the memory there (infinite where none fits: then nothing does)."""
        if self.slowdown is None:
            return self.options.max_step_time_s
        if value not in self.fastest:
            job = job_at(self.job, self.knob, value)
            try:
                fastest = plan_job(job, replace(self.options, objective="time", memory_budget=self.memory))
                self.fastest[value] = fastest.step_time_s * self.slowdown
            except MemshardError:  # no plan fits: the least-memory search proves it
                self.fastest[value] = math.inf
        return self.fastest[value]

    def memshard(self, value: int) -> tuple[Probe, Plan | PipelinedPlan | None]:
        job = job_at(self.job, self.knob, value)
        if self.pipeline is not None:
            return self.memshard_pipelined(job, value)
        problem = searched_problem(job, self.options)
        bound = peak_lower_bound(problem)
        if bound > self.memory:
            return Probe(value, bound, bound, False, note="its lower bound is over the memory: not searched"), None
        budget = self.step_budget(value)
        options = replace(self.options, max_step_time_s=None if budget == math.inf else budget)
        try:
            plan = plan_job(job, options, problem=problem)
        except Infeasible:
            return Probe(value, math.inf, bound, False, note="no plan within the step-time budget"), None
        except MemshardError as e:
            if "step" not in str(e):
                raise
            return Probe(value, math.inf, bound, False, note=str(e)), None
        proved = max(bound, plan.peak_bytes * (1 - plan.solver.gap))
        return Probe(value, plan.peak_bytes, proved, plan.peak_bytes <= self.memory, plan.step_time_s), plan

    def memshard_pipelined(self, job: Job, value: int) -> tuple[Probe, PipelinedPlan | None]:
        """memshard's pipelined plan of the least memory at ``value``; its bound: the largest of
        the stages' proved bounds (each stage searched to its gap)."""
        if self.knob == "layers" and value < self.pipeline.stages:
            return Probe(value, math.inf, math.inf, False, note=f"fewer layers than {self.pipeline.stages} stages",
                         laid_out=False), None
        plan = plan_pipelined(job, self.options, self.pipeline)
        proved = max(stage.plan.peak_bytes * (1 - stage.plan.solver.gap) for stage in plan.stages)
        return Probe(value, plan.peak_bytes, proved, plan.peak_bytes <= self.memory, plan.step_time_s), plan

    def pipelined_plans(self, value: int) -> dict[str, PipelinedPlan]:
        """The pipelined Megatron-LM configurations of the job at ``value``, priced once (each
        taken out by the probe that reads it)."""
        if value not in self.pipelined:
            found = []
            if self.knob != "layers" or value >= self.pipeline.stages:
                found, _ = pipelined_baselines(job_at(self.job, self.knob, value), self.pipeline.stages,
                                               zero3_unit=self.options.priced_unit, recompute=self.options.recompute,
                                               exact=self.options.exact)
            self.pipelined[value] = {plan.strategy: plan for plan in found}
        return self.pipelined[value]

    def job_and_problem(self, value: int):
        """The job at ``value`` and its problem on the real mesh, built once."""
        if value not in self.jobs:
            job = job_at(self.job, self.knob, value)
            self.jobs[value] = job, baseline_problem(job, self.options)
        return self.jobs[value]

    def baseline_plans(self, value: int, names: set[str] | None = None) -> dict[str, Plan]:
        """The baselines' plans of the job at ``value`` (``names``: only these), priced on
        the real mesh; those not priced yet together (the problems they share built once)."""
        missing = None if names is None else {n for n in names if (value, n) not in self.baselines}
        if missing is None or missing:
            job, problem = self.job_and_problem(value)
            # (a recipe with some layers recomputed fits less than with all: never the answer)
            plans = baseline_plans(job, problem, None if missing is None else missing.__contains__,
                                   layer_splits=False)[0]
            self.baselines.update(((value, p.strategy), p) for p in plans)
            self.baselines.update(((value, n), self.baselines.get((value, n))) for n in missing or ())
        return {n: p for (v, n), p in self.baselines.items() if v == value and p is not None
                and (names is None or n in names)}

    def family_plans(self, value: int, names: set[str]) -> None:
        """Price the baselines of the families ``names`` (see :func:`family`) at ``value``
        not priced yet, together."""
        missing = {name for name in names if not any(v == value and family(n) == name for v, n in self.baselines)}
        if missing:
            job, problem = self.job_and_problem(value)
            plans = baseline_plans(job, problem, lambda n: family(n) in missing)[0]
            self.baselines.update(((value, p.strategy), p) for p in plans)
            for name in sorted(missing):
                self.baselines.setdefault((value, name), None)

    def family_plan(self, name: str, value: int) -> Plan | None:
        """The plan of the baseline of family ``name`` (see :func:`family`) at ``value``."""
        self.family_plans(value, {name})
        return next((p for (v, n), p in self.baselines.items() if v == value and family(n) == name and p is not None),
                    None)

    def prepare(self, value: int, names: set[str]) -> None:
        """Price the baselines ``names`` at ``value`` together, before their probes read them
        (``run_together``)."""
        if self.pipeline is not None:
            return  # (``pipelined_plans`` prices every one at once)
        if self.knob == DEVICES:
            self.family_plans(value, names)
        else:
            self.baseline_plans(value, names)

    def baseline(self, name: str, value: int) -> tuple[Probe, Plan | PipelinedPlan | None]:
        if self.pipeline is not None:  # (its search keeps what it needs)
            plan = self.pipelined_plans(value).pop(name, None)
        elif self.knob == DEVICES:  # the data-parallel degree follows the devices
            plan = self.family_plan(name, value)
        else:
            plan = self.baseline_plans(value, {name}).get(name)
            self.baselines.pop((value, name), None)  # its search keeps what it needs
        if plan is None:
            return Probe(value, math.inf, math.inf, False, note=f"{name} does not lay out this job",
                         laid_out=False), None
        budget = self.step_budget(value)
        slow = budget is not None and plan.step_time_s > budget
        return (Probe(value, plan.peak_bytes, plan.peak_bytes, plan.peak_bytes <= self.memory and not slow,
                      plan.step_time_s, note="over the step-time budget" if slow else ""), plan)


def family(name: str) -> str:
    """A baseline's name without its data-parallel degree (``megatron-tp8-dp16-sp`` →
    ``megatron-tp8-sp``, ``tp8-fsdp16`` → ``tp8-fsdp``, ``torch-tp8-fsdp16`` → ``torch-tp8-fsdp``):
    the same recipe on more devices."""
    return str(replace(parse_strategy(name), data_parallel=None))


def fit_job(job: Job, knob: str = "batch", options: SearchOptions | None = None, step: int | None = None,
            baselines: bool = True, max_slowdown: float | None = None, pipeline: int | None = None) -> FitResult:
    """The largest value of ``knob`` (``KNOBS``; the fewest ``devices``) that fits ``job``'s
    device memory, for memshard and (``baselines``) every baseline; ``options``: memshard's
    search (its ``max_step_time_s`` bounds every strategy's step time; the objective is least
    memory); ``max_slowdown``: instead, every strategy's step within that many times memshard's
    fastest plan that fits at the same value. ``pipeline``: that many 1F1B stages along the
    outermost mesh axis, for memshard's plans and the baselines (pipelined Megatron-LM)."""
    started = time.perf_counter()
    step = _check(job, knob, step)
    options = options or SearchOptions()
    # one setting of mesh views for every search of the scan: the fastest plans a slowdown
    # bound is against lie on the views the least-memory probes search (the mesh as typed
    # unless views are asked for)
    options = replace(options, mesh_views=bool(options.mesh_views))
    if options.objective != "memory":
        raise MemshardError("fit searches the least memory at each value; bound the step time with --max-step-time")
    if max_slowdown is not None:
        check_factor(max_slowdown, "the slowdown bound")
        if options.max_step_time_s is not None:
            raise MemshardError("give a step-time budget or a slowdown bound, not both")
    stages = _pipeline(job, knob, options, max_slowdown, pipeline)
    memory = job.mesh.device_memory_bytes
    prober = Prober(job, knob, options, memory, max_slowdown, stages)
    fixed = _model_states if knob in ("batch", "seq") else None
    start, limit, rising = knob_value(job, knob), knob_limit(job, knob), knob != DEVICES
    answers = [KnobSearch("memshard", prober.memshard, memory, step, fixed, limit, rising).run(start)]
    if answers[0].value is None:
        p = answers[0].next_probe
        what = f"{knob} fits" if rising else f"mesh of up to {limit:,} devices fits this job"
        raise MemshardError(f"no {what} in {format_bytes(memory)} per device: {knob} {p.value:,} needs "
                            f"{format_bytes(p.bound_bytes)} at least" + (f" ({p.note})" if p.note else ""))
    if baselines:
        first = min(_round(start, step), limit)
        if stages is not None:
            names = dict.fromkeys(sorted(prober.pipelined_plans(first)))
        else:
            names = dict.fromkeys((family(n) if knob == DEVICES else n) for n in prober.baseline_plans(first))
        found = run_together([KnobSearch(name, lambda v, n=name: prober.baseline(n, v), memory, step, fixed, limit,
                                         rising) for name in names], start, prober.prepare)
        answers += sorted(found, key=lambda a: (a.value is None, -(a.value or 0) if rising else a.value or 0,
                                                a.strategy))
    return FitResult(knob, step, memory, options.max_step_time_s, tuple(answers), time.perf_counter() - started,
                     limit, max_slowdown, pipeline)


def _pipeline(job: Job, knob: str, options: SearchOptions, max_slowdown: float | None,
              stages: int | None) -> PipelineOptions | None:
    """``stages`` as the pipeline every probe runs, or one MemshardError saying why not."""
    if stages is None:
        return None
    pipeline = PipelineOptions(stages)
    if knob == DEVICES:
        raise MemshardError("fit --min devices resizes the outermost mesh axis, which a pipeline runs along: "
                            "give --max batch, seq, layers or hidden with --pipeline")
    if max_slowdown is not None or options.max_step_time_s is not None:
        raise MemshardError("a step-time budget or slowdown bound does not yet bound a pipelined plan: its step is "
                            "the schedule's, not a stage's")
    if options.mesh_views:
        raise MemshardError("mesh views (--mesh-views on) are not yet searched with a pipeline")
    pipeline_meshes(job.mesh, stages)  # (the mesh splits into that many stages)
    return pipeline


def draw_fit(result: FitResult, title: str, path: str) -> None:
    """The knob against the peak of every probe of every strategy (a line each, memshard's
    bold), the device memory dashed, each strategy's largest fitting value marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5.5), dpi=120, layout="constrained")
    gib = 2.0**30
    for a in result.answers:
        probes = sorted((p for p in a.probes if math.isfinite(p.peak_bytes)), key=lambda p: p.value)
        if not probes:
            continue
        first = a.strategy == "memshard"
        (line,) = ax.plot([p.value for p in probes], [p.peak_bytes / gib for p in probes], marker=".",
                          linewidth=2.5 if first else 1, zorder=3 if first else 2,
                          label=f"{a.strategy}: {'none' if a.value is None else f'{a.value:,}'}")
        if a.plan is not None:
            ax.plot([a.value], [a.plan.peak_bytes / gib], marker="*", markersize=12, color=line.get_color(), zorder=4)
    ax.axhline(result.device_memory_bytes / gib, linestyle="--", color="gray",
               label=f"device memory {format_bytes(result.device_memory_bytes)}")
    ax.set_xlabel(result.knob)
    ax.set_ylabel("peak memory per device (GiB)")
    ax.set_title(f"{title}: the largest {result.knob} that fits (*)", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.savefig(path)
    plt.close(fig)
