"""The memory model against hand derivations: Megatron's activation formula, ZeRO's model
states, redundant bytes, local shard bytes, liveness over the schedule and the
zero-redundancy bound."""

from __future__ import annotations

import pytest

import memshard
from memshard.core.graph import FP32, MIXED, Graph, Op, Operand, TensorKind, TensorSpec
from memshard.core.mesh import make_mesh, parse_mesh
from memshard.core.placement import PARTIAL, REPLICATE, Shard
from memshard.models import build_graph
from memshard.plans.advice import redundancy_by_op
from memshard.plans.plan import build_plan
from memshard.problem.evaluate import evaluate
from memshard.problem.memory import (
    MASTER_ALONE,
    StorageOption,
    redundant_bytes,
    storage_memory,
    tensor_bytes,
)
from memshard.problem.pricing import build_problem
from memshard.problem.records import OpGroup, complete_selection
from memshard.search.solve import SearchRequest, solve

R, P = REPLICATE, PARTIAL


def op_groups(problem):
    return [g for g, grp in enumerate(problem.groups) if isinstance(grp, OpGroup)]


def pick(problem, choices: dict[int, tuple]):
    """Strategy index of each op group from its assignment tuple."""
    out = {}
    for gid in op_groups(problem):
        assignments = [s.assignment for s in problem.groups[gid].strategies]
        out[gid] = assignments.index(choices.get(gid, (None,) * problem.mesh.ndim))
    return out


# -- Megatron activations (Korthikanti et al. 2022, eq. 1) ----------------------------------------
@pytest.mark.parametrize(
    "hidden, heads, seq, batch",
    [(1024, 16, 512, 2), (768, 12, 1024, 1), (512, 8, 256, 4)],
)
def test_gpt_layer_saves_korthikanti_bytes(hidden, heads, seq, batch):
    graph = build_graph(
        "gpt2", batch=batch, seq=seq, num_layers=3, hidden=hidden, heads=heads,
        ffn=4 * hidden, vocab=256, dropout=True,
    )
    assert graph.precision is MIXED
    problem = build_problem(graph, make_mesh((1,)), shared_layers=False)
    selection = complete_selection(problem, {g: 0 for g in op_groups(problem)})
    ev = evaluate(problem, selection)
    first_op = [min(i for i, op in enumerate(graph.ops) if op.layer == k) for k in range(3)]
    s, b, h, a = seq, batch, hidden, heads
    per_layer = s * b * h * 34 + 5 * a * s * s * b  # = sbh(34 + 5as/h), bytes
    for k in range(2):
        point_k, point_next = problem.schedule.forward(first_op[k]), problem.schedule.forward(first_op[k + 1])
        assert ev.live_bytes[point_next] - ev.live_bytes[point_k] == per_layer


# -- ZeRO model states --------------------------------------------------------------------------------
PSI = 1024 * 96  # divisible by 8
SPEC = TensorSpec("w", (1024, 96), 2, TensorKind.PARAMETER)
MESH = parse_mesh("2x4")
N = 8


def model_states(grad, stage, precision, mesh=MESH, spec=SPEC, axes=(0, 1)):
    m = storage_memory(spec, grad, StorageOption(stage, axes if stage else ()), precision, mesh)
    return m.parameters + m.gradients + m.optimizer_states


@pytest.mark.parametrize("grad", [("P", "P"), ("R", "R"), ("P", "R")])
def test_zero_stages_mixed_precision(grad):
    # ZeRO paper, Ψ elements on N devices, K = 12 optimizer bytes per element
    assert model_states(grad, 0, MIXED) == 16 * PSI
    assert model_states(grad, 1, MIXED) == 4 * PSI + 12 * PSI // N
    assert model_states(grad, 2, MIXED) == 2 * PSI + 14 * PSI // N
    assert model_states(grad, 3, MIXED) == 16 * PSI // N


def test_zero_stages_fp32():
    grad = ("P", "P")
    assert model_states(grad, 0, FP32) == 16 * PSI
    assert model_states(grad, 1, FP32) == 8 * PSI + 8 * PSI // N
    assert model_states(grad, 2, FP32) == 4 * PSI + 12 * PSI // N
    assert model_states(grad, 3, FP32) == 16 * PSI // N


def test_zero_categories_separately():
    m = storage_memory(SPEC, ("P", "P"), StorageOption(2, (0, 1)), MIXED, MESH)
    assert (m.parameters, m.gradients, m.optimizer_states) == (2 * PSI, 2 * PSI // 8, 12 * PSI // 8)
    # ZeRO-2 needs the whole gradient before reducing it, no gathered weight
    assert m.unsharded_gradient == 2 * PSI and m.gathered_weight == 0
    m = storage_memory(SPEC, ("P", "P"), StorageOption(3, (0, 1)), MIXED, MESH)
    assert m.gathered_weight == 2 * PSI and m.unsharded_gradient == 2 * PSI
    m = storage_memory(SPEC, ("P", "P"), StorageOption(0), MIXED, MESH)
    assert m.gathered_weight == 0 and m.unsharded_gradient == 0


def test_zero_redundancy_of_model_states():
    # stage 0: all 16Ψ are on 8 devices → 7/8 redundant
    m = storage_memory(SPEC, ("R", "R"), StorageOption(0), MIXED, MESH)
    redundant = m.redundant_parameters + m.redundant_gradients + m.redundant_optimizer_states
    assert redundant == pytest.approx(16 * PSI * 7 / 8)
    # stage 3 over all axes: nothing is repeated
    m = storage_memory(SPEC, ("R", "R"), StorageOption(3, (0, 1)), MIXED, MESH)
    assert m.redundant_parameters == m.redundant_gradients == m.redundant_optimizer_states == 0
    # stage 1 over the node axis only (4 ways): optimizer shard 12Ψ/4, still on 2 devices
    m = storage_memory(SPEC, ("R", "R"), StorageOption(1, (1,)), MIXED, MESH)
    assert m.optimizer_states == 12 * PSI // 4
    assert m.redundant_optimizer_states == pytest.approx(12 * PSI / 4 / 2)
    assert m.parameters == 2 * PSI and m.redundant_parameters == pytest.approx(2 * PSI * 7 / 8)


def test_zero_on_top_of_a_compute_shard():
    # (64, 32) split S(0) over the node pair: local (32, 32) = 1024 elements; ZeRO-3 over the
    # 4 devices of the node: 256 elements each, the fp32 shard the master weight (4 B), its
    # gradient in fp32 (4 B), Adam's moments (8 B): 12 B held all step where ZeRO-2 holds 14
    spec = TensorSpec("w", (64, 32), 2, TensorKind.PARAMETER)
    m = storage_memory(spec, ("S0", "P"), StorageOption(3, (1,)), MIXED, MESH)
    assert (m.parameters, m.gradients, m.optimizer_states) == (1024, 1024, 2048)
    m2 = storage_memory(spec, ("S0", "P"), StorageOption(2, (1,)), MIXED, MESH)
    assert (m2.parameters, m2.gradients, m2.optimizer_states) == (2048, 512, 3072)
    assert m.parameters + m.optimizer_states < m2.parameters + m2.optimizer_states
    assert sum((m.parameters, m.gradients, m.optimizer_states)) == 16 * 256
    assert m.gathered_weight == 2 * 1024
    assert m.redundant_parameters == m.redundant_optimizer_states == 0


SMALL_GPT = dict(num_layers=2, hidden=64, heads=4, ffn=256, vocab=512)


def test_the_master_alone_is_zero3s_layout_over_no_axis():
    """A weight split over every device (S(0) over the pair, S(1) over the node): its fp32
    master kept as the weight (4 B), Adam's moments (8 B), its gradient in fp32 (4 B), cast to
    bf16 for each use: 2 B per element less than a bf16 weight beside the master until the
    gradient exists. A choice in mixed precision only, and in memshard's problems only."""
    spec = TensorSpec("w", (64, 32), 2, TensorKind.PARAMETER)
    m = storage_memory(spec, ("S0", "S1"), MASTER_ALONE, MIXED, MESH)
    local = 64 * 32 // 8
    assert (m.parameters, m.gradients, m.optimizer_states, m.gathered_weight) == (4 * local, 4 * local, 8 * local,
                                                                                  2 * local)
    plain = storage_memory(spec, ("S0", "S1"), StorageOption(0), MIXED, MESH)
    assert plain.parameters + plain.optimizer_states == m.parameters + m.optimizer_states + 2 * local
    graph = build_graph("gpt2", batch=8, seq=64, precision="mixed", **SMALL_GPT)
    for precision, framework, offered in (("mixed", "memshard", True), ("fp32", "memshard", False),
                                          ("mixed", "fsdp2", False), ("mixed", "megatron", False)):
        g = graph if precision == "mixed" else build_graph("gpt2", batch=8, seq=64, precision="fp32", **SMALL_GPT)
        problem = build_problem(g, parse_mesh("2x4"), framework=framework)
        found = any(opt == MASTER_ALONE for grp in problem.groups if not isinstance(grp, OpGroup)
                    for _, opt in grp.options)
        assert found == offered, (precision, framework)


def test_zero_uneven_shard_rounds_up():
    # 1001 elements over 8 devices: flat shards of ceil(1001/8) = 126
    spec = TensorSpec("w", (7, 143), 2, TensorKind.PARAMETER)
    assert model_states(("P", "P"), 3, MIXED, spec=spec) == 16 * 126
    assert model_states(("P", "P"), 1, MIXED, spec=spec) == 4 * 1001 + 12 * 126


# -- redundant bytes and local bytes ---------------------------------------------------------------
def test_redundant_bytes_of_layouts():
    mesh = parse_mesh("8")
    assert redundant_bytes(800.0, (R,), mesh) == pytest.approx(700.0)
    assert redundant_bytes(800.0, (Shard(0),), mesh) == 0.0
    assert redundant_bytes(800.0, (Shard(0), Shard(1)), MESH) == 0.0
    assert redundant_bytes(800.0, (Shard(0), R), MESH) == pytest.approx(600.0)  # 4 copies
    # a partial sum is not split either: all 8 devices hold a full-size piece (docs/design.md)
    assert redundant_bytes(800.0, (R, P), MESH) == pytest.approx(700.0)


@pytest.mark.parametrize(
    "layout, expected",
    [
        ((R, R), 6 * 10 * 16 * 2),
        ((Shard(0), Shard(2)), 3 * 10 * 4 * 2),
        ((Shard(1), Shard(2)), 6 * 5 * 4 * 2),
        ((Shard(2), Shard(2)), 6 * 10 * 2 * 2),  # 16 → 8 → 2
        ((Shard(1), Shard(0)), 2 * 5 * 16 * 2),  # 6 over 4: pieces of 2
        ((Shard(0), Shard(0)), 1 * 10 * 16 * 2),  # 6 → 3 → 1
    ],
)
def test_local_bytes_3d_on_2x4(layout, expected):
    spec = TensorSpec("t", (6, 10, 16), 2, TensorKind.ACTIVATION)
    assert tensor_bytes(spec, layout, MESH) == expected


# -- liveness on a hand-sized graph ---------------------------------------------------------------
def hand_graph() -> Graph:
    """x[8,16] (fp16 input) · w[16,32] → y[8,32] → cross-entropy with labels[8] (int64).

    Schedule with n = 2 ops: F(lin)=0, F(loss)=1, B(loss)=2, B(lin)=3, optimizer=4.
    """
    tensors = {
        "x": TensorSpec("x", (8, 16), 2, TensorKind.INPUT),  # 256 B
        "labels": TensorSpec("labels", (8,), 8, TensorKind.INPUT),  # 64 B
        "w": TensorSpec("w", (16, 32), 2, TensorKind.PARAMETER),  # Ψ = 512
        "y": TensorSpec("y", (8, 32), 2, TensorKind.ACTIVATION),  # 512 B
        "loss": TensorSpec("loss", (), 4, TensorKind.ACTIVATION),
    }
    ops = (
        Op("lin", "linear", (Operand("x", ("a", "b")), Operand("w", ("b", "c"))), Operand("y", ("a", "c")),
           saves_inputs=(0,), flops_per_point=2.0, backward_flops_ratio=2.0),
        Op("loss", "cross_entropy", (Operand("y", ("a", "c")), Operand("labels", ("a",))), Operand("loss", ()),
           reduced_dims=("c",), stats_per_row=3, saves_inputs=(0, 1)),
    )
    return Graph("hand", tensors, ops, "loss", precision=MIXED)


def op_points(problem, ev) -> list[float]:
    """Live bytes at F(lin), F(loss), B(loss), B(lin), O (the hand graph's reshard points
    hold only what spans them: nothing is resharded in these plans)."""
    S = problem.schedule
    return [ev.live_bytes[t] for t in (S.forward(0), S.forward(1), S.backward(1), S.backward(0), S.optimizer)]


# Constant per point: inputs 256 + 64 (a data loader's share: whole here, each op replicated),
# weight 2Ψ = 1024 and optimizer states 12Ψ = 6144.
BASE = 320 + 1024 + 6144
SPLIT_INPUTS = 320 // 4 - 320  # the inputs split with the batch over 4 devices


def test_liveness_replicated_plan():
    # y lives from F(lin) to B(loss) (producer, then the loss's saved copy); the loss scalar and
    # cross-entropy's exponentials of one row chunk of y (⌈8/8⌉ rows × 32 × 2 B = 64 B) at
    # F(loss); y's gradient from B(loss) to B(lin); w's gradient 2Ψ from B(lin) to the step.
    problem = build_problem(hand_graph(), parse_mesh("4"))
    ev = evaluate(problem, complete_selection(problem, pick(problem, {})))
    expected = [BASE + 512, BASE + 512 + 4 + 64, BASE + 512 + 512, BASE + 512 + 1024, BASE + 1024]
    assert op_points(problem, ev) == expected
    assert ev.peak_bytes == BASE + 1536 and ev.peak_point == problem.schedule.backward(0)
    # everything is on all 4 devices: 3/4 of it is redundant
    assert ev.redundant_bytes == pytest.approx(0.75 * ev.peak_bytes)
    assert ev.breakdown == {
        "parameters": 1024, "gradients": 1024, "optimizer_states": 6144,
        "activations": 320, "transients": 512,
    }


def test_liveness_data_parallel_plan():
    # split a (the batch) 4 ways: y and its gradient are 512/4 = 128 B, the inputs 80 B (each
    # rank loads its rows); w stays whole
    problem = build_problem(hand_graph(), parse_mesh("4"))
    sel = complete_selection(problem, pick(problem, {0: ("a",), 1: ("a",)}))
    ev = evaluate(problem, sel)
    base = BASE + SPLIT_INPUTS
    assert op_points(problem, ev) == [base + 128, base + 132 + 64, base + 256, base + 1024 + 128, base + 1024]
    # redundant at B(lin): w, its gradient and optimizer states (3/4 each); y's grad is sharded
    assert ev.redundant_bytes == pytest.approx(0.75 * (1024 + 1024 + 6144))
    # w's gradient is a partial sum over the batch axis: one all-reduce of 2Ψ = 1024 B on 4 devices
    assert ev.communication_bytes == pytest.approx(2 * 3 / 4 * 1024)


def test_liveness_zero3_plan():
    # as above with w under ZeRO-3 over the 4 devices: its 128 elements per device are the
    # fp32 master weight (512 B) with Adam's moments (1024 B); the weight is gathered (1024 B,
    # bf16) at F(lin) only — lin reads the model input, which needs no gradient, so its
    # backward never reads w. The whole gradient (1024 B) is made at B(lin) and
    # reduce-scattered after it (RB(lin)) into a 256 B bf16 shard, cast to fp32 (512 B) there
    # while autograd still holds the whole gradient (as the runtime measures: test_traced_runtime's
    # llama-mixed), kept in fp32 from then.
    problem = build_problem(hand_graph(), parse_mesh("4"))
    storage = {problem.storage_group["w"]: StorageOption(3, (0,))}
    sel = complete_selection(problem, pick(problem, {0: ("a",), 1: ("a",)}), storage=storage)
    ev = evaluate(problem, sel)
    base = 320 // 4 + 512 + 1024
    assert op_points(problem, ev) == [base + 128 + 1024, base + 128 + 4 + 64, base + 256,
                                      base + 128 + 1024, base + 512]
    assert ev.live_bytes[problem.schedule.reshard_out(0)] == base + 1024 + 256 + 512
    assert ev.peak_point == problem.schedule.reshard_out(0)
    # redundant at the peak: the 1024 B unreduced gradient, 3/4 of it
    assert ev.redundant_bytes == pytest.approx(0.75 * 1024)


def test_zero_redundancy_bound_hand_graph():
    # unique bytes per point, each tensor held once in its least layout (w's 512 elements as
    # ZeRO-3 keeps them: 4 + 8 B each all step, its gradient 4 B once reduced): at B(lin) the
    # inputs 320, w's states 6144, the whole gradient 1024 and the saved 512 = 8000; at
    # RB(lin) and the optimizer step 320 + 6144 + 2048 = 8512. The bound is the largest over
    # N = 4 devices, whatever the plan.
    graph = hand_graph()
    problem = build_problem(graph, parse_mesh("4"))
    for choice in ({}, {0: ("a",), 1: ("a",)}, {0: ("c",), 1: ("c",)}):
        ev = evaluate(problem, complete_selection(problem, pick(problem, choice)))
        assert ev.lower_bound_bytes == 8512 / 4
        assert ev.lower_bound_point == problem.schedule.reshard_out(0)
        assert ev.peak_bytes >= ev.lower_bound_bytes
    plan = memshard.plan(graph, "4")
    assert plan.lower_bound_bytes == 8512 / 4
    # the optimum is at least the bound and at most the ZeRO-3 data-parallel plan's 3136 B
    assert 8512 / 4 <= plan.peak_bytes <= 3136


def gpt_parameters(L, h, f, V, P):
    return V * h + P * h + L * (4 * (h * h + h) + (h * f + f) + (f * h + h) + 4 * h) + 2 * h


def test_zero_redundancy_bound_gpt2_two_layers():
    # The bound does not depend on the plan, so a fixed plan (everything replicated) gives it
    # without running the solver (whose time on this size varies from seconds to a minute).
    b, s, L = 4, 128, 2
    graph = build_graph("gpt2", batch=b, seq=s, num_layers=L)
    problem = build_problem(graph, parse_mesh("2x2"))
    plan = build_plan(problem, complete_selection(problem, pick(problem, {})))
    h, a, f, V, P = 768, 12, 3072, 50257, 1024
    psi = gpt_parameters(L, h, f, V, P)
    assert plan.to_dict()["model"]["num_parameters"] == psi
    n = 4
    inputs = 2 * b * s * 8  # input ids and labels, int64
    # model states alone, at the optimizer step
    assert plan.lower_bound_bytes >= (16 * psi + inputs) / n
    assert plan.lower_bound_bytes >= 16 * psi / n
    # at the backward of the loss: weights and optimizer states (12Ψ as ZeRO-3 keeps them: the
    # fp32 master shard and Adam's moments), every saved activation
    # (L layers of sbh(34 + 5as/h), the embedding dropout mask sbh, ln_f's and lm_head's
    # inputs 2sbh each, the logits 2sbv) and the logits' gradient 2sbv
    saved = L * (s * b * h * 34 + 5 * a * s * s * b) + s * b * h + 4 * s * b * h + 2 * s * b * V
    at_loss_backward = 12 * psi + inputs + saved + 2 * s * b * V
    assert plan.lower_bound_bytes >= at_loss_backward / n
    assert plan.peak_bytes >= plan.lower_bound_bytes


def residual_graph():
    """x[64,16] · w1 → h; h · w2 → f; h + f → y; cross-entropy of y (fp32, each activation
    4096 B): the add is the last reader of both its inputs, as a transformer's residual is."""
    tensors = {
        "x": TensorSpec("x", (64, 16), 4, TensorKind.INPUT),
        "labels": TensorSpec("labels", (64,), 8, TensorKind.INPUT),
        "w1": TensorSpec("w1", (16, 16), 4, TensorKind.PARAMETER),
        "w2": TensorSpec("w2", (16, 16), 4, TensorKind.PARAMETER),
        "h": TensorSpec("h", (64, 16), 4, TensorKind.ACTIVATION),
        "f": TensorSpec("f", (64, 16), 4, TensorKind.ACTIVATION),
        "y": TensorSpec("y", (64, 16), 4, TensorKind.ACTIVATION),
        "loss": TensorSpec("loss", (), 4, TensorKind.ACTIVATION),
    }
    linear = dict(saves_inputs=(0,), flops_per_point=2.0, backward_flops_ratio=2.0)
    ab, bc, ac = ("a", "b"), ("b", "c"), ("a", "c")
    ops = (
        Op("lin1", "linear", (Operand("x", ab), Operand("w1", bc)), Operand("h", ac), **linear),
        Op("lin2", "linear", (Operand("h", ab), Operand("w2", bc)), Operand("f", ac), **linear),
        Op("residual", "add", (Operand("h", ac), Operand("f", ac)), Operand("y", ac)),
        Op("loss", "cross_entropy", (Operand("y", ac), Operand("labels", ("a",))),
           Operand("loss", ()), reduced_dims=("c",), stats_per_row=3, saves_inputs=(0, 1)),
    )
    return Graph("residual", tensors, ops, "loss", precision=FP32)


def test_an_add_hands_its_output_gradient_itself_to_both_inputs():
    # Autograd's AddBackward returns the gradient it receives for both inputs: the add's
    # backward makes nothing, and h's and f's producers, each reading it as it is, hold one
    # 4096 B tensor until lin2's backward (which adds lin2's gradient for h, 4096 B, and w2's,
    # 1024 B). Counted as three tensors at the add's backward and two after it, the peak was
    # 28160 B.
    problem = build_problem(residual_graph(), parse_mesh("4"))
    S = problem.schedule
    plan = complete_selection(problem, pick(problem, {}))
    ev = evaluate(problem, plan)
    before = ev.live_bytes[S.reshard_out(3)]  # y's gradient made by the loss's backward
    assert ev.live_bytes[S.backward(2)] == ev.live_bytes[S.reshard_out(2)] == before
    assert ev.live_bytes[S.backward(1)] == before + 4096 + 1024 == ev.peak_bytes == 24064
    assert ev.breakdown["transients"] == 2 * 4096
    # per op, the redundant bytes at the peak add up to the plan's (the shared gradient once)
    by_op = redundancy_by_op(problem, plan, ev.peak_point)
    assert sum(by_op.values()) == pytest.approx(ev.redundant_bytes) == 0.75 * 24064
    # the ILP pinned to the plan prices the same peak
    forced = solve(SearchRequest(problem, "memory", fixed=plan, mip_gap=0.0))
    assert forced.ilp_peak_bytes == pytest.approx(ev.peak_bytes, rel=1e-9)


def test_a_resharded_input_gradient_is_a_tensor_of_its_own():
    # lin2 split over its output columns: f is S(1) and its gradient is resharded from the
    # add's (R) into a 1024 B piece of its own, beside the add's gradient h keeps.
    problem = build_problem(residual_graph(), parse_mesh("4"))
    S = problem.schedule
    plan = complete_selection(problem, pick(problem, {problem.op_group[1]: ("c",)}))
    ev = evaluate(problem, plan)
    assert ev.breakdown_at(S.backward(1))["transients"] == 4096 + 1024 + 4096  # and lin2's for h
