"""HiGHS vs PuLP + CBC (the solver Alpa and autoparallel use) on the same ILP.

Builds memshard's ILP once (the peak-memory objective), hands the identical model to HiGHS
and to CBC through PuLP, and times both in one run with the same relative gap. ``--lazy``:
the ILP without its reshard rows, as ``memshard plan`` solves first (``solver.solve``); the
plan HiGHS finds is then checked to meet M with its reshards (else that ILP is not the one
memshard ends up solving, and the script says so). ``--same-objective``: one branch and bound
each on the identical model, objective (memshard's first-pass blend of peak and step time),
gap and start; HiGHS without memshard's bounds around it.

    .venv/bin/python benchmarks/solver_vs_cbc.py [--model gpt3-1.3b --mesh 2x4 --layers 4] [--lazy] [--same-objective]
"""

from __future__ import annotations

import argparse
import platform
import time

import highspy
import numpy as np
import pulp

from memshard.mesh import parse_mesh
from memshard.models import build_graph
from memshard.problem import build_problem
from memshard.solver import TIE_BREAK, IlpBuilder, _Highs, _reference, blend_objective


def build(args):
    graph = build_graph(args.model, batch=args.batch, seq=args.seq, num_layers=args.layers)
    problem = build_problem(graph, parse_mesh(args.mesh))
    b = IlpBuilder(problem)
    b.add_choice_rows()
    b.add_link_rows()
    b.add_edge_rows()
    b.add_memory_rows(problem.candidate_points)
    if not args.lazy:
        b.add_reshard_rows()
    return problem, b


def solve_highs(problem, b: IlpBuilder, gap: float, limit: float) -> tuple[float, float, bool]:
    """memshard's search for the least peak (``solver._Highs.first_pass``), the cheap bounds
    it starts from included; and whether the plan's evaluated peak is within its M."""
    started = time.perf_counter()
    ref = _reference(problem)
    floor = ref.memory_floor_bytes / b.bytes_unit
    hs = _Highs(b.m, started + limit)
    values, obj, _, _, _ = hs.first_pass((np.array([b.peak]), np.array([1.0])), b.time_expression(),
                                         ref.least_peak_bytes / b.bytes_unit,
                                         (floor, ref.time_estimate_s / b.time_unit), gap, b.replicated_start())
    return time.perf_counter() - started, obj, not b.over_m(values)


def blend(b: IlpBuilder):
    """memshard's first-pass objective: the peak plus TIE_BREAK-weighted step time."""
    ref = b.reference
    scales = (ref.memory_floor_bytes / b.bytes_unit, ref.time_estimate_s / b.time_unit)
    return blend_objective((np.array([b.peak]), np.array([1.0])), b.time_expression(), scales)[0]


def solve_highs_alone(b: IlpBuilder, objective, gap: float, limit: float) -> tuple[float, float]:
    """One HiGHS branch and bound on ``objective`` from the replicated start, nothing around it."""
    started = time.perf_counter()
    _, obj, _, _ = _Highs(b.m, started + limit).run(objective, gap, start=b.replicated_start())
    return time.perf_counter() - started, obj


def solve_cbc(b: IlpBuilder, gap: float, limit: float, objective=None) -> tuple[float, float | None, str]:
    """CBC on the peak alone, or on ``objective`` (columns, coefficients) from the same start
    HiGHS gets."""
    m = b.m
    started = time.perf_counter()
    prob = pulp.LpProblem("memshard", pulp.LpMinimize)
    xs = [
        pulp.LpVariable(f"v{i}", lowBound=None if lo == -highspy.kHighsInf else lo,
                        upBound=None if hi == highspy.kHighsInf else hi,
                        cat="Integer" if integer else "Continuous")
        for i, (lo, hi, integer) in enumerate(zip(m.lower, m.upper, m.integer))
    ]
    if objective is None:
        prob += xs[b.peak]
    else:
        prob += pulp.LpAffineExpression([(xs[int(c)], float(v)) for c, v in zip(*objective)])
        for c, v in zip(*b.replicated_start()):
            xs[int(c)].setInitialValue(float(v))
    for k, (cols, vals, lo, hi) in enumerate(zip(m.row_cols, m.row_vals, m.rows_lo, m.rows_hi)):
        expr = pulp.LpAffineExpression([(xs[int(c)], float(v)) for c, v in zip(cols, vals)])
        if lo == hi:
            prob += (expr == lo), f"r{k}"
        else:
            if lo != -highspy.kHighsInf:
                prob += (expr >= lo), f"l{k}"
            if hi != highspy.kHighsInf:
                prob += (expr <= hi), f"u{k}"
    status = prob.solve(pulp.PULP_CBC_CMD(msg=False, gapRel=gap, timeLimit=limit, threads=1,
                                          warmStart=objective is not None))
    elapsed = time.perf_counter() - started
    return elapsed, pulp.value(prob.objective), pulp.LpStatus[status]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt3-1.3b")
    ap.add_argument("--mesh", default="2x4")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--gap", type=float, default=2e-3)  # memshard plan's default
    ap.add_argument("--limit", type=float, default=600.0)
    ap.add_argument("--lazy", action="store_true", help="without the reshard rows, as memshard solves first")
    ap.add_argument("--same-objective", action="store_true",
                    help="both solvers minimise memshard's first-pass blend to its gap from the same start")
    args = ap.parse_args()
    problem, b = build(args)
    nnz = sum(len(c) for c in b.m.row_cols)
    print(f"{args.model} ({args.layers} layers) on {args.mesh}: {len(b.m.lower):,} variables "
          f"({sum(b.m.integer):,} integer), {len(b.m.rows_lo):,} constraints, {nnz:,} nonzeros")
    if args.same_objective:
        objective, gap = blend(b), args.gap * TIE_BREAK
        t_h, obj_h = solve_highs_alone(b, objective, gap, args.limit)
        print(f"blend objective (peak + {TIE_BREAK:g} weight of step time), gap {gap:.1e}, replicated start")
        print(f"HiGHS: {t_h:.2f} s, objective {obj_h:.6f}")
        t_c, obj_c, status = solve_cbc(b, gap, args.limit, objective)
        print(f"PuLP {pulp.__version__} + CBC: {t_c:.2f} s ({status}), objective "
              f"{obj_c if obj_c is None else f'{obj_c:.6f}'}")
        print(f"ratio CBC/HiGHS: {t_c / t_h:.1f}x")
        return
    t_h, obj_h, meets_m = solve_highs(problem, b, args.gap, args.limit)
    print(f"HiGHS {highspy.Highs().version() if hasattr(highspy.Highs(), 'version') else ''}: {t_h:.2f} s, "
          f"peak {obj_h * b.bytes_unit / 2**30:.4f} GiB")
    if not meets_m:
        print("the plan's reshards exceed M: memshard adds the reshard rows and solves again")
    t_c, obj_c, status = solve_cbc(b, args.gap, args.limit)
    peak_c = f"{obj_c * b.bytes_unit / 2**30:.4f} GiB" if obj_c is not None else "none"
    print(f"PuLP {pulp.__version__} + CBC: {t_c:.2f} s ({status}), peak {peak_c}")
    print(f"ratio CBC/HiGHS: {t_c / t_h:.1f}x   (machine: {platform.processor() or platform.machine()}, "
          f"{platform.python_version()})")


if __name__ == "__main__":
    main()
