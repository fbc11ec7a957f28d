"""The text report shows the figures of the plan it describes, in words a reader can check:
plain units and counts, why an op cannot be sharded further, what holds its redundant bytes,
and a key to a traced graph's dim names."""

from __future__ import annotations

import re

import pytest

import memshard
from memshard.core.quantities import format_bytes, format_parameters
from memshard.plans.advice import LINKED, TOO_SMALL, UNSPLITTABLE, reselect, why_not_split
from memshard.problem.records import OpGroup

SMALL = dict(batch=4, seq=32, num_layers=1, hidden=64, heads=2, vocab=128, ffn=128)


@pytest.fixture(scope="module")
def small_plan():
    return memshard.plan("gpt2", "4", **SMALL)


@pytest.fixture(scope="module")
def fastest_2x4():
    """Replicates almost everything: many ops could be split further, a tied embedding cannot."""
    return memshard.plan("gpt2", "2x4", batch=2, seq=64, num_layers=1, hidden=64, heads=2, vocab=128, ffn=128,
                         objective="time", memory_budget=float("inf"), mesh_views=False)


def _group(problem, key: str) -> int:
    return next(g for g, grp in enumerate(problem.groups) if isinstance(grp, OpGroup) and grp.key == key)


def _row(text: str, op: str) -> str:
    """The table row of ``op``, its wrapped cells joined: ``│ op │ cell │ cell …``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"│ {op} "))
    block = [lines[start]]
    for line in lines[start + 1:]:
        if not line.startswith("│ ") or line.split("│")[1].strip():
            break
        block.append(line)
    cells = zip(*(line.split("│")[1:-1] for line in block))
    return "│ " + " │ ".join(" ".join(c.strip() for c in column if c.strip()) for column in cells) + " │"


def test_report_text_shows_peak_bound_and_strategy(small_plan):
    text = memshard.format_plan(small_plan)
    assert format_bytes(small_plan.peak_bytes) in text
    assert format_bytes(small_plan.lower_bound_bytes) in text
    assert "zero-redundancy bound" in text
    for op in ("attn.q", "mlp.fc", "lm_head"):
        assert op in text
    assert "Parameter storage" in text


def test_no_scientific_notation_and_counted_nouns(small_plan):
    text = memshard.format_plan(small_plan, width=200)
    assert not re.search(r"\d[eE][+-]\d", text)
    headline = text.splitlines()[0]
    # an overridden model: its sizes, then its parameter count, beside its name
    assert (f"(overridden: 1 layer, hidden 64, 2 heads, ffn 128, vocab 128; "
            f"{format_parameters(small_plan.model.num_parameters)}, mixed") in headline
    assert "(4 devices)" in headline
    one = memshard.format_plan(memshard.plan("tiny-gpt", "1x2", batch=2, seq=8, micro_batches=1)).splitlines()[0]
    assert "(2 devices)" in one and "micro-batch" not in one
    two = memshard.format_plan(memshard.plan("tiny-gpt", "2", batch=4, seq=8, micro_batches=2)).splitlines()[0]
    assert "in 2 micro-batches" in two


def test_the_redundant_bytes_are_split_by_what_holds_them(small_plan, fastest_2x4):
    for plan in (small_plan, fastest_2x4):
        for row in plan.most_redundant_ops:
            assert sum(p.redundant_bytes for p in row.parts) == pytest.approx(row.redundant_bytes, rel=1e-9)
            assert [p.redundant_bytes for p in row.parts] == sorted((p.redundant_bytes for p in row.parts),
                                                                    reverse=True)
            axes = set(plan.searched.mesh.axis_names)
            assert all(set(p.copied_over) <= axes for p in row.parts)


def test_every_op_without_advice_says_why(small_plan, fastest_2x4):
    for plan in (small_plan, fastest_2x4):
        text = memshard.format_plan(plan, width=250)
        assert "no further split" not in text
        for row in plan.most_redundant_ops:
            if row.redundant_bytes > 0 and row.alternative is None:
                why = row.why_not
                assert why is not None
                op = plan.searched.graph.ops[plan.searched.groups[_group(plan.searched, row.op)].ops[0]]
                # every (free axis, dim) is accounted for
                assert len(why.blocked) == len(why.free_axes) * len(op.dims)
                assert "none: " in _row(text, row.op)
                if not why.free_axes:
                    assert "each axis splits a dim" in _row(text, row.op)


def test_a_tied_embedding_says_it_is_linked_and_a_small_dim_too_small(fastest_2x4):
    row = next(r for r in fastest_2x4.most_redundant_ops if r.op == "embed")
    assert row.alternative is None
    reasons = {(b.axis, b.dim): (b.why, b.linked_to) for b in row.why_not.blocked}
    assert reasons[("intra", "b")] == (TOO_SMALL, None)  # batch 2 on an axis of 4
    assert reasons[("inter0", "v")] == (LINKED, "lm_head")  # the weight is lm_head's too
    line = _row(memshard.format_plan(fastest_2x4, width=250), "embed")
    assert "linked to lm_head" in line and "intra:b 2 < 4" in line


def test_an_unsplittable_dim_is_named():
    plan = memshard.plan("tiny-llama", "2", batch=2, seq=8)
    problem, selection = plan.searched, plan.searched_selection
    gid = next(g for g, grp in enumerate(problem.groups) if isinstance(grp, OpGroup)
               and problem.graph.ops[grp.ops[0]].unsplittable_dims)
    replicated = next(k for k, s in enumerate(problem.groups[gid].strategies) if not any(s.assignment))
    why = why_not_split(problem, reselect(problem, selection, gid, replicated), gid)
    op = problem.graph.ops[problem.groups[gid].ops[0]]
    assert why.free_axes == tuple(problem.mesh.axis_names)  # replicated: every axis is free
    assert {b.dim for b in why.blocked if b.why == UNSPLITTABLE} == set(op.unsplittable_dims)


def test_the_biggest_holding_is_shown_with_its_axes(fastest_2x4):
    text = memshard.format_plan(fastest_2x4, width=250)
    for row in fastest_2x4.most_redundant_ops[:3]:
        top = row.parts[0]
        assert f"{top.what}: {format_bytes(top.redundant_bytes)}" in _row(text, row.op)
    assert "held as: what holds an op's redundant bytes" in text


def test_a_traced_plan_has_a_key_to_its_dim_names():
    plan = memshard.plan(memshard.HFModel("gpt2"), "4", batch=8, seq=64, num_layers=1, hidden=64, heads=2, vocab=128)
    text = memshard.format_plan(plan, width=160)
    key = text[text.index("Dims (names the trace gave"):]
    dims = {d for op in plan.searched.graph.ops for d in op.dims}
    for d in dims:
        assert re.search(rf"│ {re.escape(d)} +│", key), d
    assert re.search(r"│ b +│ +8 │ batch", key)
    assert re.search(r"│ s +│ +64 │ sequence", key)
    assert "on attention's key side" in key
    assert re.search(r"│ d\d+ +│ +128 │ axis \d of (lm_head|transformer\.wte)\.weight", key)  # the vocabulary
    built = memshard.format_plan(memshard.plan("gpt2", "4", **SMALL))
    assert "Dims (names" not in built
