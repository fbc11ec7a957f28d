"""A baseline's plan saved as JSON loads priced as it was planned: its data-parallel collectives
per bucket (DDP's, Megatron-LM's) and, under ``-tpoverlap``, its TP collectives beside their
GEMMs (``recipes.priced_as_run``), not one call per weight in line."""

from __future__ import annotations

import json

import pytest

import memshard
from memshard.plans.plan import plan_from_dict

NAMES = ("ddp", "fsdp2", "torch-tp2-fsdp2", "zero2", "megatron-tp2-dp2-sp", "megatron-tp2-dp2-sp-tpoverlap",
         "megatron-tp2-dp2-sp-distopt-overlap", "megatron-tp2-dp2-sp+full-block1")


@pytest.mark.parametrize("name", NAMES)
def test_a_saved_baseline_loads_with_the_step_time_and_peak_it_was_planned_with(name):
    plan = memshard.strategy_plan("tiny-gpt", "2x2", name, batch=8, precision="mixed", recompute="auto")
    again = plan_from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again.strategy == name
    assert again.step_time_s == plan.step_time_s
    assert again.peak_bytes == plan.peak_bytes
    assert again.hidden_communication_s == plan.hidden_communication_s
