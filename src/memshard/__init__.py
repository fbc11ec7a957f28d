"""memshard: the parallelism strategy with the least per-device memory.

The planner core (this package minus ``runtime/`` and ``trace/``) imports no torch.
Heavy modules load on first use, so ``memshard --help`` stays fast.
"""

from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "Plan": ("memshard.plans.plan", "Plan"),
    "PipelinedPlan": ("memshard.plans.pipelined", "PipelinedPlan"),
    "Mesh": ("memshard.core.mesh", "Mesh"),
    "parse_mesh": ("memshard.core.mesh", "parse_mesh"),
    "make_mesh": ("memshard.core.mesh", "make_mesh"),
    "Hardware": ("memshard.core.hardware", "Hardware"),
    "PRESETS": ("memshard.core.hardware", "PRESETS"),
    "load_hardware": ("memshard.core.hardware", "load_hardware"),
    "compare": ("memshard.api", "compare"),
    "export": ("memshard.api", "export"),
    "fit": ("memshard.api", "fit"),
    "build_graph": ("memshard.models", "build_graph"),
    "get_config": ("memshard.models", "get_config"),
    "MemshardError": ("memshard.core.errors", "MemshardError"),
    "load_plan": ("memshard.plans.plan", "load_plan"),
    "HFModel": ("memshard.job", "HFModel"),
    "Job": ("memshard.job", "Job"),
    "SearchOptions": ("memshard.planner", "SearchOptions"),
    "plan_job": ("memshard.planner", "plan_job"),
    "strategy_plan": ("memshard.api", "strategy_plan"),
    "format_plan": ("memshard.plans.report", "format_plan"),
    "parallelize": ("memshard.runtime.parallel", "parallelize"),  # needs torch
}

__all__ = sorted([*_LAZY, "plan"])


def plan(model, *args, **kwargs):
    """Plan ``model`` on a mesh: ``plan("llama3-8b", "8x8", batch=64)``, or for an
    ``nn.Module`` ``plan(module, example_inputs, mesh="2x4")``; see :func:`memshard.api.plan`."""
    from memshard.api import plan as _plan
    from memshard.job import is_module

    if is_module(model) and args:
        kwargs["example_inputs"], args = args[0], args[1:]
    return _plan(model, *args, **kwargs)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'memshard' has no attribute {name!r}")
