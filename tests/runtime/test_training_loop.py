"""A standard PyTorch training loop over ``memshard.parallelize``'s model, on 4 gloo ranks.

Every case runs ``loss = sharded(batch); loss.backward(); opt.step(); opt.zero_grad()`` with a
``torch.optim`` optimizer over ``sharded.parameters()`` (AdamW, SGD with momentum, Adam; foreach
and not; an LR scheduler), under memshard's least-memory plans and the baselines (ZeRO-1, -2, -3, ZeRO-3 by
layer, TP, SP, recomputation), and compares with the same loop in one process on the unsharded
model: every rank's ``loss.item()`` (no collective written by hand) equals the single process's
loss (fp32, rtol 1e-5) and the gradients of the second step are as close to the exact (float64)
ones as the single process's, as ``test_runtime.py`` judges them. Also: torch's own
``clip_grad_norm_`` over the DTensor shards returns the single-process norm; 4 micro-batches
accumulated with gradient sync off but for the last equal the full batch; an optimizer over the
unsharded module's parameters, a step while gradients wait to be reduced, or a ``torch.optim``
optimizer over a mixed-precision plan's bf16 shards fails with one ``MemshardError``; DCP
checkpoints move between plans, into one process, and to and from FSDP2 (``fully_shard``).
One forked world runs every case.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import memshard
from memshard.api import strategy_plan
from memshard.core.errors import MemshardError
from memshard.plans.plan import runnable
from memshard.runtime import loop
from memshard.runtime.executor import GraphModel, make_batch
from tests.runtime_harness import BATCH, INSPECT_STEP, assert_gradients_close, forked_world
from tests.runtime_plans import (
    TINY_LLAMA_EXAMPLE,
    TINY_LLAMA_LOOP,
    fastest,
    least_memory,
    saved,
    saved_path,
)

STEPS = 3
WORLD = 4
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TINY_LLAMA = EXAMPLES / "tiny_llama.json"
MAX_NORM = 0.05  # below every step's gradient norm: clipping changes the run


@dataclass(frozen=True)
class Case:
    """One run: the plan (how it is made), the optimizer, clipping and micro-batches per step."""

    model: str
    mesh: str
    strategy: str  # "memory" / "time": memshard's least-memory / fastest plan (saved), else a baseline
    optimizer: str = "adamw"
    clip: bool = False
    micro_batches: int = 1
    unit: str = "op"
    recompute: str = "none"
    schedule: bool = False  # the learning rate over steps: LambdaLR, 1 / (1 + step)


CASES = {
    "gpt-memshard-2x2-adamw": Case("tiny-gpt", "2x2", "memory", schedule=True),
    "llama-memshard-1x4-sgd": Case("tiny-llama", "1x4", "memory", "sgd", schedule=True),
    "llama-memshard-4-adam": Case("tiny-llama", "4", "memory", "adam"),
    "llama-memshard-layer-2x2-adamw": Case("tiny-llama", "2x2", "memory", unit="layer"),
    "llama-memshard-time-1x4-adamw": Case("tiny-llama", "1x4", "time"),
    "gpt-memshard-full-4-adamw": Case("tiny-gpt", "4", "memory", recompute="full"),
    "llama-zero1-4-adamw": Case("tiny-llama", "4", "zero1"),
    "gpt-zero2-4-sgd": Case("tiny-gpt", "4", "zero2", "sgd"),
    "llama-zero3-2x2-adamw": Case("tiny-llama", "2x2", "zero3-fsdp"),
    "gpt-fsdp-layer-2x2-sgd": Case("tiny-gpt", "2x2", "tp2-fsdp2", "sgd", unit="layer"),
    "gpt-tp-sp-1x4-adamw": Case("tiny-gpt", "1x4", "megatron-tp4-sp"),
    "llama-tp-dp-1x4-sgd": Case("tiny-llama", "1x4", "megatron-tp2-dp2", "sgd"),
    "gpt-recompute-2x2-adamw": Case("tiny-gpt", "2x2", "megatron-tp2-dp2-sp+full", recompute="full"),
    # clipping: the global norm over the plan's shards
    "gpt-dp-4-clip": Case("tiny-gpt", "4", "dp", clip=True),
    "llama-memshard-2x2-clip": Case("tiny-llama", "2x2", "memory", "sgd", clip=True),
    "gpt-fsdp-layer-2x2-clip": Case("tiny-gpt", "2x2", "tp2-fsdp2", clip=True, unit="layer"),
    "llama-tp-dp-1x4-clip": Case("tiny-llama", "1x4", "megatron-tp2-dp2", clip=True),
    # gradient accumulation over 4 micro-batches: sync off for the first 3
    "llama-zero1-4-accumulate": Case("tiny-llama", "4", "zero1", micro_batches=4),
    "gpt-dp-4-accumulate": Case("tiny-gpt", "4", "dp", "sgd", micro_batches=4),
    "gpt-memshard-2x2-accumulate": Case("tiny-gpt", "2x2", "memory", micro_batches=4),
}
CHECKPOINT_PLANS = ("llama-memshard-layer-2x2-adamw", "llama-tp-dp-1x4-sgd")  # saved, loaded
MISUSE = "llama-zero1-4-adamw"  # the plan of the misuse and collective counts (ZeRO-1)


def make_plan(case: Case):
    if case.strategy == "memory":  # (searched: memshard's least-memory and fastest plans, saved)
        return saved(least_memory(case.model, case.mesh, case.unit, recompute=case.recompute))
    if case.strategy == "time":
        return saved(fastest(case.model, case.mesh, 1.3, case.unit))
    return baseline(case.model, case.mesh, case.strategy, case.unit, case.recompute)


@functools.cache
def baseline(model: str, mesh: str, strategy: str, unit: str, recompute: str):
    """A Megatron-LM or FSDP layout as memshard's runtime runs it, made once for the cases
    that share it (another optimizer, clipping or micro-batches)."""
    return runnable(strategy_plan(model, mesh, strategy, batch=BATCH, precision="fp32", zero3_unit=unit,
                                  recompute=recompute))


def make_optimizer(kind: str, params):
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, foreach=True)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, foreach=True)
    return torch.optim.Adam(params, lr=1e-3, foreach=False)


def train_steps(model, optimizer, graph, case: Case, clip, inspect=None) -> tuple[list[float], list[float]]:
    """The loop every run shares, sharded or not: losses and (with ``clip``) gradient norms."""
    losses, norms = [], []
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (1 + s)) if case.schedule else None
    for step in range(STEPS):
        total = 0.0
        batches = make_batch(graph, case.micro_batches, step)
        for k, batch in enumerate(batches):
            if hasattr(model, "set_requires_gradient_sync"):
                model.set_requires_gradient_sync(k == len(batches) - 1)
            loss = model(batch) / case.micro_batches
            loss.backward()
            total += loss.item()
        losses.append(total)
        if inspect is not None and step == INSPECT_STEP:
            inspect()
        if case.clip:
            norms.append(float(clip(MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
    return losses, norms


# -- the ranks ---------------------------------------------------------------------------------
def _sharded_run(name: str, case: Case, plan, out_dir: Path) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", plan.problem.mesh.shape)
    graph = plan.problem.graph
    model = memshard.parallelize(GraphModel(graph, seed=0), plan, mesh)
    optimizer = make_optimizer(case.optimizer, model.parameters())

    def inspect():
        grads = {n: model.full_gradient(n).double() for n in graph.parameters}
        if dist.get_rank() == 0:
            torch.save(grads, out_dir / f"{name}.pt")

    def clip(max_norm):  # torch's own, over the DTensor shards
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    losses, norms = train_steps(model, optimizer, graph, case, clip, inspect)
    return {"losses": losses, "norms": norms, "step": model.step}


def _misuse_runs(plan, mixed: dict) -> dict:
    """The errors of steps that cannot be right and of some that can (None where no error
    came): an optimizer over the unsharded module, a step with gradients not reduced (both
    under ZeRO-1 in fp32), AdamW and LeanAdam under mixed-precision plans (``mixed``)."""
    from torch.distributed.device_mesh import init_device_mesh

    from memshard.runtime.optim import LeanAdam

    out = {}
    for what, use in (("source", plan), ("unreduced", plan), *mixed.items()):
        mesh = init_device_mesh("cpu", use.problem.mesh.shape)
        graph = use.problem.graph
        source = GraphModel(graph, seed=0)
        model = memshard.parallelize(source, use, mesh)
        params = source.parameters() if what == "source" else model.parameters()
        optimizer = (LeanAdam if "lean" in what else torch.optim.AdamW)(params)
        sync = what != "unreduced"
        model.set_requires_gradient_sync(sync)
        model(make_batch(graph, 1, 0)[0]).backward()
        try:
            optimizer.step()
            out[what] = None
        except MemshardError as e:
            out[what] = str(e)
        model.set_requires_gradient_sync(True)
        model.finish_gradients()
        optimizer.zero_grad()
        model.zero_grad()
    return out


@functools.cache
def mixed_plans() -> dict:
    """Mixed-precision plans: ZeRO-1 (bf16 shards) with AdamW and LeanAdam, ZeRO-3 (fp32 master
    shards, FSDP2's layout) with AdamW."""
    def plan(strategy):
        return runnable(strategy_plan("tiny-gpt", "4", strategy, batch=BATCH, precision="mixed"))

    zero1 = plan("zero1")
    return {"mixed zero1 adamw": zero1, "mixed zero1 lean": zero1, "mixed zero3 adamw": plan("zero3-fsdp")}


def _accumulation_calls(plan) -> dict:
    """Collective calls of one step of 4 micro-batches, with gradient sync on for the last one
    only and for every one."""
    from torch.distributed.device_mesh import init_device_mesh

    from memshard.runtime.measure import CommCounter

    mesh = init_device_mesh("cpu", plan.problem.mesh.shape)
    graph = plan.problem.graph
    model = memshard.parallelize(GraphModel(graph, seed=0), plan, mesh)
    out = {}
    for what in ("sync last", "sync every"):
        counter = CommCounter()
        with counter:
            for k, batch in enumerate(make_batch(graph, 4, 0)):
                model.set_requires_gradient_sync(what == "sync every" or k == 3)
                model(batch).backward()
        out[what] = sum(counter.calls_by_kind.values())
        model.zero_grad()
    return out


def _checkpoint_runs(out_dir: Path) -> dict:
    """Steps 1 and 2 of AdamW under plan A (ZeRO-3 by layer, 2x2) straight on, and after a
    DCP checkpoint of step 0 loaded under plan B (TP x DP, 1x4: other layouts, other mesh) into
    a model made with other weights and an optimizer with another learning rate."""
    from torch.distributed import checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from memshard.runtime.checkpoint import get_state_dict, set_state_dict

    def model_and_optimizer(plan, seed, lr):
        mesh = init_device_mesh("cpu", plan.problem.mesh.shape)
        model = memshard.parallelize(GraphModel(plan.problem.graph, seed=seed), plan, mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)

    def steps(model, optimizer, graph, first, last=STEPS):
        losses = []
        for step in range(first, last):
            loss = model(make_batch(graph, 1, step)[0])
            loss.backward()
            losses.append(loss.item())
            optimizer.step()
            optimizer.zero_grad()
        return losses

    plan_a, plan_b = (_plans()[name] for name in CHECKPOINT_PLANS)
    model, optimizer = model_and_optimizer(plan_a, 0, 1e-3)
    steps(model, optimizer, plan_a.problem.graph, 0, 1)
    model_state, optim_state = get_state_dict(model, optimizer)
    names_and_kinds = {name: type(value).__name__ for name, value in model.state_dict().items()}
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=out_dir / "checkpoint")
    straight = steps(model, optimizer, plan_a.problem.graph, 1)
    model, optimizer = model_and_optimizer(plan_b, 1, 5e-4)
    state = dict(zip(("model", "optim"), get_state_dict(model, optimizer)))
    dcp.load(state, checkpoint_id=out_dir / "checkpoint")
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return {"straight": straight, "resumed": steps(model, optimizer, plan_b.problem.graph, 1),
            "state_dict": names_and_kinds}


def traced_plan():
    """memshard's plan of the README's Hugging Face LLaMA (examples/tiny_llama.json), traced:
    ``memshard.plan(memshard.HFModel("examples/tiny_llama.json"), "4", batch=4, seq=16,
    precision="fp32", mip_gap=0.02)``, searched once and saved (tests/runtime_plans.py)."""
    return saved(TINY_LLAMA_LOOP)


def traced_module(plan):
    from memshard.trace.hf import seeded_model

    job = plan.job
    return seeded_model(job.model.source, job.precision, job.model.attn_implementation, job.hf_overrides())


def traced_losses(model, optimizer, graph) -> list[float]:
    """The standard loop over the module's own arguments (the sharded model, or the module)."""
    from memshard.runtime import traced

    losses = []
    for step in range(STEPS):
        (args, kwargs), = traced.make_batch(graph, 1, step)
        out = model(*args, **kwargs)
        loss = getattr(out, "loss", out)
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return losses


def _traced_run() -> list[float]:
    from torch.distributed.device_mesh import init_device_mesh

    plan = traced_plan()
    model = memshard.parallelize(traced_module(plan), plan, init_device_mesh("cpu", plan.problem.mesh.shape))
    return traced_losses(model, torch.optim.AdamW(model.parameters(), lr=1e-3), plan.problem.graph)


def _fsdp2_runs(out_dir: Path) -> dict:
    """The traced LLaMA under memshard's plan: steps 0 to 2, a DCP checkpoint after step 0.
    That checkpoint loaded into the module under PyTorch's FSDP2 (``fully_shard`` on a 1-D
    mesh, each rank a quarter of the batch) with ``torch.distributed.checkpoint.state_dict``:
    steps 1 and 2, a checkpoint after step 1. That one loaded under memshard's plan: step 2."""
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as torch_state
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from memshard.runtime import traced
    from memshard.runtime.checkpoint import get_state_dict, set_state_dict

    plan = traced_plan()
    graph = plan.problem.graph

    def memshard_model():
        model = memshard.parallelize(traced_module(plan), plan, init_device_mesh("cpu", plan.problem.mesh.shape))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step_of(model, optimizer, step, share=lambda t: t, **fixed):
        (args, kwargs), = traced.make_batch(graph, 1, step)
        out = model(*map(share, args), **{k: share(v) for k, v in kwargs.items()}, **fixed)
        loss = getattr(out, "loss", out)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    model, optimizer = memshard_model()
    straight = [step_of(model, optimizer, 0).item()]
    dcp.save(dict(zip(("model", "optim"), get_state_dict(model, optimizer))), checkpoint_id=out_dir / "memshard")
    straight += [step_of(model, optimizer, step).item() for step in (1, 2)]

    module = traced_module(plan)
    fully_shard(module, mesh=init_device_mesh("cpu", (WORLD,)))
    optimizer = torch.optim.AdamW(module.parameters(), lr=5e-4)  # the checkpoint's 1e-3 replaces it
    state = dict(zip(("model", "optim"), torch_state.get_state_dict(module, optimizer)))
    dcp.load(state, checkpoint_id=out_dir / "memshard")
    torch_state.set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    fsdp2 = []
    for step in (1, 2):
        loss = step_of(module, optimizer, step, lambda t: t.chunk(WORLD)[dist.get_rank()], **graph.traced.fixed_kwargs)
        dist.all_reduce(loss)  # each rank's mean over its quarter: the batch's mean is their mean
        fsdp2.append(loss.item() / WORLD)
        if step == 1:
            dcp.save(dict(zip(("model", "optim"), torch_state.get_state_dict(module, optimizer))),
                     checkpoint_id=out_dir / "fsdp2")

    model, optimizer = memshard_model()
    state = dict(zip(("model", "optim"), get_state_dict(model, optimizer)))
    dcp.load(state, checkpoint_id=out_dir / "fsdp2")
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    model.step = 2
    return {"straight": straight, "fsdp2": fsdp2, "back": [step_of(model, optimizer, 2).item()]}


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    plans = _plans()
    report = {name: _sharded_run(name, case, plans[name], Path(out_dir)) for name, case in CASES.items()}
    report["misuse"] = _misuse_runs(plans[MISUSE], mixed_plans())
    report["accumulation_calls"] = _accumulation_calls(plans[MISUSE])
    report["checkpoint"] = _checkpoint_runs(Path(out_dir))
    report["traced"] = _traced_run()
    report["fsdp2"] = _fsdp2_runs(Path(out_dir))
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


@functools.cache
def _plans() -> dict:
    return {name: make_plan(case) for name, case in CASES.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    _plans(), traced_plan(), mixed_plans()  # made here, before the fork: the ranks inherit them
    out_dir = tmp_path_factory.mktemp("training_loop")
    reports = forked_world(_worker, WORLD, out_dir)
    return reports, out_dir


# -- the single process ------------------------------------------------------------------------
def reference(name: str, dtype: torch.dtype = torch.float32):
    """The same loop on the unsharded model in one process: losses, norms, gradients (run once
    for the cases of the same graph, optimizer, clipping, micro-batches and schedule)."""
    case = CASES[name]
    alike = next(other for other, same in CASES.items() if replace(same, mesh=case.mesh, strategy=case.strategy,
                                                                   unit=case.unit, recompute=case.recompute) == case
                 and _plans()[other].problem.graph == _plans()[name].problem.graph)
    return _single_process(alike, dtype)


@functools.cache
def _single_process(name: str, dtype: torch.dtype):
    case = CASES[name]
    graph = _plans()[name].problem.graph
    model = GraphModel(graph, seed=0).to(dtype)
    optimizer = make_optimizer(case.optimizer, model.parameters())
    grads = {}

    def inspect():
        grads.update({n: model.parameter(n).grad.double().clone() for n in graph.parameters})

    def clip(max_norm):
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    model.step = 0  # moved on by each step, as the sharded model's step hook does (dropout masks)
    hook = optimizer.register_step_post_hook(lambda *args: setattr(model, "step", model.step + 1))
    losses, norms = train_steps(model, optimizer, graph, case, clip, inspect)
    hook.remove()
    return losses, norms, grads


def assert_gradients_match(grads: dict, name: str) -> None:
    """The rule of ``test_runtime.py`` (``runtime_harness.assert_gradients_close``)."""
    _, _, single = reference(name)
    _, _, exact = reference(name, torch.float64)
    assert set(grads) == set(exact)
    assert_gradients_close(grads, single, exact, name)


# -- the tests ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(CASES))
def test_the_standard_loop_equals_one_process(name, runs):
    """Every rank's ``loss.item()`` is the single process's loss at every step; the gradients
    match; the model's step count moved on with each optimizer step (its hook)."""
    reports, out_dir = runs
    losses, _, _ = reference(name)
    for r in reports:
        torch.testing.assert_close(torch.tensor(r[name]["losses"]), torch.tensor(losses), rtol=1e-5, atol=0)
        assert r[name]["step"] == STEPS
    assert_gradients_match(torch.load(out_dir / f"{name}.pt"), name)


@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if c.clip))
def test_clip_grad_norm_returns_the_single_process_norm(name, runs):
    reports, _ = runs
    _, norms, _ = reference(name)
    assert min(norms) > MAX_NORM  # (clipping changed every step)
    for r in reports:
        torch.testing.assert_close(torch.tensor(r[name]["norms"]), torch.tensor(norms), rtol=1e-5, atol=0)


def test_the_plans_cover_zero_stages_tp_sp_and_recomputation():
    plans = _plans()
    stages = set()
    for plan in plans.values():
        problem = plan.problem
        for name in problem.graph.parameters:
            group = problem.storage_group[name]
            stages.add(problem.groups[group].options[plan.selection.choices[group]][1].stage)
    assert stages == {0, 1, 2, 3}
    assert any(plan.problem.recompute != "none" for plan in plans.values())
    assert any(plan.problem.zero3_unit == "layer" for plan in plans.values())


def test_accumulation_reduces_once_per_step(runs):
    """4 micro-batches with gradient sync on for the last only (their losses and gradients equal
    the full batch's: ``test_the_standard_loop_equals_one_process``) reduce ZeRO-1's gradients
    once: fewer collectives than with sync on for every micro-batch."""
    reports, _ = runs
    for r in reports:
        calls = r["accumulation_calls"]
        assert 0 < calls["sync last"] < calls["sync every"], calls


def test_an_optimizer_over_the_unsharded_module_fails_loudly(runs):
    reports, _ = runs
    for r in reports:
        assert r["misuse"]["source"] == loop.WRONG_PARAMETERS


def test_a_step_with_gradients_not_reduced_fails_loudly(runs):
    reports, _ = runs
    for r in reports:
        assert r["misuse"]["unreduced"] == loop.UNREDUCED


def test_a_torch_optimizer_over_bf16_shards_fails_loudly(runs):
    """Under mixed precision a ``torch.optim`` optimizer over ZeRO-1's bf16 shards would keep no
    fp32 master weights: it fails at its first step. LeanAdam (masters in its states) steps;
    so does AdamW over ZeRO-3's fp32 master shards."""
    reports, _ = runs
    for r in reports:
        assert r["misuse"]["mixed zero1 adamw"] == loop.NO_MASTERS
        assert r["misuse"]["mixed zero1 lean"] is None
        assert r["misuse"]["mixed zero3 adamw"] is None


def test_state_dict_is_keyed_by_the_modules_names(runs):
    reports, _ = runs
    graph = _plans()[CHECKPOINT_PLANS[0]].problem.graph
    for r in reports:
        assert r["checkpoint"]["state_dict"] == dict.fromkeys(graph.parameters, "DTensor")
    assert "lm_head.weight" in graph.parameters


def test_a_checkpoint_loads_under_another_plan(runs):
    """Saved under ZeRO-3 by layer on 2x2, loaded under TP x DP on 1x4: the next steps'
    losses are those of the run that went on (and of the single process)."""
    reports, _ = runs
    for r in reports:
        torch.testing.assert_close(torch.tensor(r["checkpoint"]["resumed"]),
                                   torch.tensor(r["checkpoint"]["straight"]), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(reports[0]["checkpoint"]["straight"]),
                               torch.tensor(reference(CHECKPOINT_PLANS[0])[0][1:]), rtol=1e-5, atol=0)


def test_a_checkpoint_loads_as_a_full_state_dict_into_one_process(runs, tmp_path):
    """The DCP checkpoint as one full state dict (``dcp_to_torch_save``) into the unsharded
    model and a plain ``torch.optim.AdamW`` (its state by parameter index): the same next losses."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    reports, out_dir = runs
    dcp_to_torch_save(out_dir / "checkpoint", tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt", weights_only=False)
    graph = _plans()[CHECKPOINT_PLANS[0]].problem.graph
    model = GraphModel(graph, seed=1)
    with torch.no_grad():
        for name in graph.parameters:
            model.parameter(name).copy_(full["model"][name])
    params = [model.parameter(name) for name in graph.parameters]
    optimizer = torch.optim.AdamW(params, lr=5e-4, weight_decay=0.1)
    index = {name: i for i, name in enumerate(graph.parameters)}
    groups = [{**g, "params": sorted(index[n] for n in g["params"])} for g in full["optim"]["param_groups"]]
    optimizer.load_state_dict({"state": {index[n]: v for n, v in full["optim"]["state"].items()},
                               "param_groups": groups})
    losses = []
    for step in range(1, STEPS):
        loss = model(make_batch(graph, 1, step)[0])
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reports[0]["checkpoint"]["straight"]),
                               rtol=1e-5, atol=0)


def test_a_traced_hugging_face_llama_trains_as_the_module(runs):
    """The README's traced LLaMA in the standard loop with AdamW: every rank's ``loss.item()``
    is the module's own loss at every step (the module in one process, the same loop)."""
    reports, _ = runs
    plan = traced_plan()
    module = traced_module(plan)
    losses = traced_losses(lambda *a, **k: module(*a, **k, **plan.problem.graph.traced.fixed_kwargs),
                           torch.optim.AdamW(module.parameters(), lr=1e-3), plan.problem.graph)
    for r in reports:
        torch.testing.assert_close(torch.tensor(r["traced"]), torch.tensor(losses), rtol=1e-5, atol=0)


def test_a_checkpoint_moves_between_memshard_and_fsdp2(runs):
    """A DCP checkpoint of memshard's plan (model and AdamW) loads into the same Hugging Face
    module under FSDP2 (``fully_shard``, ``torch.distributed.checkpoint.state_dict``): its next
    steps' losses are those of the memshard run that went on. FSDP2's checkpoint loads back
    under memshard's plan alike."""
    reports, _ = runs
    for r in reports:
        runs_of = r["fsdp2"]
        torch.testing.assert_close(torch.tensor(runs_of["fsdp2"]), torch.tensor(runs_of["straight"][1:]),
                                   rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.tensor(runs_of["back"]), torch.tensor(runs_of["straight"][2:]),
                                   rtol=1e-5, atol=0)
    assert reports[0]["fsdp2"]["straight"] == pytest.approx(reports[0]["traced"], rel=1e-5)


def _example_rank(rank: int, world: int, port: int, out_dir: str, argv: list[str]) -> None:
    """One rank of ``torchrun --nproc-per-node <world> examples/train.py <argv>``, forked: the
    environment torchrun gives a rank, then the script's own ``main``."""
    import importlib.util

    torch.set_num_threads(1)  # (OMP_NUM_THREADS=1, as the command ran under torchrun)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0", ROLE_RANK=str(rank),
                      ROLE_WORLD_SIZE=str(world))
    spec = importlib.util.spec_from_file_location("memshard_example_train", EXAMPLES / "train.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.main(argv)
    (Path(out_dir) / f"rank{rank}.json").write_text("{}")


def test_the_example_trains_saves_and_resumes(tmp_path):
    """examples/train.py on 2 gloo ranks: 4 steps with a checkpoint after the second, then the
    same command resumed from it: the resumed steps' losses are the first run's (the model,
    AdamW's states, the scheduler and the step restored). Each rank loads the example's job's
    plan (``--plan``: 8 sequences of 32 tokens on 2 ranks, searched once and saved,
    tests/runtime_plans.py) instead of searching it again. The ranks are forked, each with the
    environment torchrun gives it, and run the script's ``main`` with the command's arguments:
    torchrun's own processes (its agent, an interpreter per rank) would only import torch
    again."""
    saved(TINY_LLAMA_EXAMPLE)  # (traced here once: each forked rank's own load is then quick)
    command = ["--config", str(TINY_LLAMA), "--mesh", "2", "--steps", "4",
               "--plan", str(saved_path(TINY_LLAMA_EXAMPLE)), "--checkpoint", str(tmp_path / "checkpoint")]
    for run, extra in (("straight", ["--save-at", "2"]), ("resumed", ["--resume"])):
        argv = command + extra + ["--losses", str(tmp_path / f"{run}.json")]
        out_dir = tmp_path / f"{run}-ranks"
        out_dir.mkdir()
        forked_world(lambda r, w, p, o, argv=argv: _example_rank(r, w, p, o, argv), 2, out_dir)
    straight = json.loads((tmp_path / "straight.json").read_text())
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    assert list(straight) == ["0", "1", "2", "3"] and list(resumed) == ["2", "3"]
    assert resumed == pytest.approx({step: straight[step] for step in resumed}, rel=1e-6)
