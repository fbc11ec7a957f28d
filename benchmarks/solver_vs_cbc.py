"""HiGHS vs PuLP + CBC (the solver Alpa and autoparallel use) on memshard's ILP, in one run.

Builds memshard's ILP once (the peak-memory objective) and times, with the same relative gap,
one thread each:

- HiGHS as ``memshard plan`` runs it (``search.passes.first_pass``: the cheap bounds; the
  dive, then, where it leaves the gap open, branch and bound, on peak + 3% step time; the
  plan-independent or LP bound as proof);
- PuLP + CBC on the identical model, minimising the peak (PuLP's model building included);
- PuLP + CBC on the same ILP in Alpa's edge formulation (``pair_formulation``: a variable per
  producer-layout × consumer-layout pair of each edge, as Alpa and autoparallel build it).

``--lazy``: the ILP without its reshard rows, as ``memshard plan`` solves first
(``search.solve.solve``); the plan HiGHS finds is then checked to meet M with its reshards (else
that ILP is not the one memshard ends up solving, and the script says so).
``--same-objective``: one branch and bound each on the identical model, objective
(memshard's first-pass blend of peak and step time), gap and start; HiGHS without memshard's
bounds or dive around it: the solvers alone, like for like.

    .venv/bin/python benchmarks/solver_vs_cbc.py [--model gpt3-1.3b --mesh 2x4 --layers 4] [--lazy] [--same-objective]
    .venv/bin/python benchmarks/solver_vs_cbc.py --write     # the table's four ILPs, into BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import platform
import time
from importlib import metadata

import highspy
import numpy as np
import pulp

from benchmarks_md import provenance, write_section
from memshard.core.mesh import parse_mesh
from memshard.models import build_graph
from memshard.problem.pricing import build_problem
from memshard.search.formulation import Formulation
from memshard.search.highs import TIE_BREAK, TIE_RESOLUTION, HighsSearch, blend_objective
from memshard.search.model import LinearModel
from memshard.search.passes import Objectives, PassRules, first_pass
from memshard.search.solve import second_pass_cap
from memshard.search.stages import MEMORY


def build(args):
    graph = build_graph(args.model, batch=args.batch, seq=args.seq, num_layers=args.layers)
    problem = build_problem(graph, parse_mesh(args.mesh))
    f = Formulation(problem)
    f.add_plan_constraints(problem.candidate_points, reshard_rows=not args.lazy)
    return problem, f


def pair_formulation(f: Formulation):
    """The same ILP with Alpa's edge linearisation (also autoparallel's): one variable per
    (keep, producer layout, consumer layout) pair of each edge instead of memshard's flow
    over per-axis states. Each flow column z[e,k,a,σ] is the sum of the pair columns whose
    reshard passes through σ at step a; substituting that sum in every row and the objective
    gives a model with the same integer solutions and objective values (the conservation rows
    vanish, the flow's end rows become the pairs' marginals). The pair columns are continuous
    (Alpa declares them binary; with the choices integral they are 0/1 anyway).

    Returns (model, substitute): ``substitute(cols, vals)`` maps an expression over the
    original columns to one over the new."""
    m = f.model
    A = f.problem.mesh.ndim
    mapping: dict[int, list[int]] = {}  # original flow column → its pair columns (new indices)
    pair_count = 0
    pairs_of_edge = []
    for flow in f.flows:
        pairs = []
        for k in flow.keeps:
            first, _ = flow.steps[(k, 0)]
            last, _ = flow.steps[(k, A - 1)]
            prods = sorted({psuf for _, psuf, _ in first}, key=repr)
            conss = sorted({cpre + (cv,) for cpre, _, cv in last}, key=repr)
            index = {a: dict(zip(*flow.steps[(k, a)])) for a in range(A)}
            for L in prods:
                for K in conss:
                    path = [int(index[a][(K[:a], L[a:], K[a])]) for a in range(A)]
                    pairs.append(path)
        pairs_of_edge.append(pairs)
        pair_count += len(pairs)
    flow_cols = {int(c) for flow in f.flows for _, cols in flow.steps.values() for c in cols}
    kept = [c for c in range(len(m.lower)) if c not in flow_cols]
    new_of = {c: i for i, c in enumerate(kept)}
    nxt = len(kept)
    for pairs in pairs_of_edge:
        for path in pairs:
            for col in path:
                mapping.setdefault(col, []).append(nxt)
            nxt += 1

    def substitute(cols, vals):
        out: dict[int, float] = {}
        for c, v in zip(cols, vals):
            for n in mapping.get(int(c), ()) if int(c) in flow_cols else (new_of[int(c)],):
                out[n] = out.get(n, 0.0) + float(v)
        keys = np.array(sorted(k for k, v in out.items() if abs(v) > 1e-12), dtype=np.int64)
        return keys, np.array([out[int(k)] for k in keys])

    pm = LinearModel()
    pm.lower = [m.lower[c] for c in kept] + [0.0] * pair_count
    pm.upper = [m.upper[c] for c in kept] + [1.0] * pair_count
    pm.integer = [m.integer[c] for c in kept] + [0] * pair_count
    for cols, vals, lo, hi, tag in zip(m.row_columns, m.row_values, m.rows_lower, m.rows_upper, m.tags):
        cols2, vals2 = substitute(cols, vals)
        if len(cols2):  # a conservation row sums to nothing
            pm.row((cols2, vals2), lo, hi, tag)
        elif lo > 0 or hi < 0:
            raise AssertionError("an emptied row that is not 0 = 0")
    return pm, substitute


def solve_highs(problem, f: Formulation, gap: float, limit: float) -> tuple[float, float, bool, bool]:
    """memshard's search for the least peak (``passes.first_pass``), the cheap bounds
    it starts from included, and the tie-breaking second pass where ``search.solve.solve`` would
    run one: (seconds, peak, whether the plan's evaluated peak is within its M, whether the
    second pass ran)."""
    started = time.perf_counter()
    ref = f.reference
    floor = ref.memory_floor_bytes / f.bytes_unit
    search = HighsSearch(f.model, started + limit, f.disjunctions())
    peak, step_time = f.peak_expression(), f.time_expression()
    objectives = Objectives(peak, step_time, MEMORY, ref.least_peak_bytes / f.bytes_unit,
                            (floor, ref.time_estimate_s / f.time_unit))
    found = first_pass(search, objectives, PassRules(max(gap, TIE_RESOLUTION)), f.replicated_start())
    values = found.values
    if not found.ties_resolved:  # as search.solve.solve: the step time, the peak held within the gap
        tolerance = max(gap, TIE_RESOLUTION)
        search.add_row(peak, second_pass_cap(found.objective, found.objective * (1 - found.gap), tolerance))
        values = search.minimise(step_time, tolerance, start=values).values
    return time.perf_counter() - started, found.objective, not f.points_over_peak(values), not found.ties_resolved


def blend(f: Formulation):
    """memshard's first-pass objective: the peak plus TIE_BREAK-weighted step time."""
    ref = f.reference
    scales = (ref.memory_floor_bytes / f.bytes_unit, ref.time_estimate_s / f.time_unit)
    return blend_objective(f.peak_expression(), f.time_expression(), scales)[0]


def solve_highs_alone(f: Formulation, objective, gap: float, limit: float) -> tuple[float, float]:
    """One HiGHS branch and bound on ``objective`` from the replicated start, nothing around it."""
    started = time.perf_counter()
    found = HighsSearch(f.model, started + limit).minimise(objective, gap, start=f.replicated_start())
    return time.perf_counter() - started, found.objective


def solve_cbc(m: LinearModel, objective, gap: float, limit: float, start=None) -> tuple[float, float, float | None, str]:
    """PuLP + CBC on model ``m`` and ``objective`` (columns, coefficients), from ``start``
    (columns, values) if given: (time building the PuLP model, total time, objective, status)."""
    started = time.perf_counter()
    prob = pulp.LpProblem("memshard", pulp.LpMinimize)
    xs = [
        pulp.LpVariable(f"v{i}", lowBound=None if lo == -highspy.kHighsInf else lo,
                        upBound=None if hi == highspy.kHighsInf else hi,
                        cat="Integer" if integer else "Continuous")
        for i, (lo, hi, integer) in enumerate(zip(m.lower, m.upper, m.integer))
    ]
    prob += pulp.LpAffineExpression([(xs[int(c)], float(v)) for c, v in zip(*objective)])
    if start is not None:
        for c, v in zip(*start):
            xs[int(c)].setInitialValue(float(v))
    for k, (cols, vals, lo, hi) in enumerate(zip(m.row_columns, m.row_values, m.rows_lower, m.rows_upper)):
        expr = pulp.LpAffineExpression([(xs[int(c)], float(v)) for c, v in zip(cols, vals)])
        if lo == hi:
            prob += (expr == lo), f"r{k}"
        else:
            if lo != -highspy.kHighsInf:
                prob += (expr >= lo), f"l{k}"
            if hi != highspy.kHighsInf:
                prob += (expr <= hi), f"u{k}"
    built = time.perf_counter() - started
    status = prob.solve(pulp.PULP_CBC_CMD(msg=False, gapRel=gap, timeLimit=limit, threads=1,
                                          warmStart=start is not None))
    elapsed = time.perf_counter() - started
    return built, elapsed, pulp.value(prob.objective), pulp.LpStatus[status]


def sizes(m: LinearModel) -> str:
    return (f"{m.num_columns:,} variables ({sum(m.integer):,} integer), {m.num_rows:,} constraints, "
            f"{sum(len(c) for c in m.row_columns):,} nonzeros")


SUITE = (  # the ILPs of BENCHMARKS.md's table: model, mesh, layers, batch, seq
    ("gpt3-1.3b", "2x4", 4, 16, 2048),
    ("llama3-8b", "8x8", 32, 64, 4096),
    ("gpt3-6.7b", "2x4", 32, 16, 2048),
    ("gpt3-6.7b", "2x4", 32, 8, 2048),
)


def same_objective(f: Formulation, args) -> None:
    objective, gap = blend(f), args.gap * TIE_BREAK
    t_h, obj_h = solve_highs_alone(f, objective, gap, args.limit)
    print(f"blend objective (peak + {TIE_BREAK:g} weight of step time), gap {gap:.1e}, replicated start")
    print(f"HiGHS: {t_h:.2f} s, objective {obj_h:.6f}")
    _, t_c, obj_c, status = solve_cbc(f.model, objective, gap, args.limit, f.replicated_start())
    print(f"PuLP + CBC: {t_c:.2f} s ({status}), objective {obj_c if obj_c is None else f'{obj_c:.6f}'}")
    print(f"ratio CBC/HiGHS: {t_c / t_h:.1f}x")


def race(problem, f: Formulation, args) -> dict:
    """memshard's search against CBC on the identical ILP and on Alpa's formulation of it."""
    gib = f.bytes_unit / 2**30
    t_h, obj_h, meets_m, second_pass = solve_highs(problem, f, args.gap, args.limit)
    passes = "both passes" if second_pass else "one pass: ties resolved"
    print(f"HiGHS, memshard's search: {t_h:.2f} s ({passes}), peak {obj_h * gib:.4f} GiB")
    if not meets_m:
        print("the plan's reshards exceed M: memshard adds the reshard rows and solves again")
    peak = f.peak_expression()
    pm, substitute = pair_formulation(f)
    print(f"Alpa's edge formulation of the same ILP: {sizes(pm)}")
    out = {"highs_s": t_h, "sizes": sizes(f.model), "alpa_sizes": sizes(pm)}
    for key, name, m, objective in (("cbc", "memshard's ILP", f.model, peak),
                                    ("alpa", "Alpa's formulation", pm, substitute(*peak))):
        built, t_c, obj_c, status = solve_cbc(m, objective, args.gap, args.limit)
        peak_c = f"{obj_c * gib:.4f} GiB" if obj_c is not None else "none"
        print(f"PuLP + CBC on {name}: {t_c:.2f} s ({built:.2f} s building the PuLP model; {status}), "
              f"peak {peak_c}; ratio to HiGHS {t_c / t_h:.1f}x", flush=True)
        out[f"{key}_s"] = t_c
    return out


def write_suite(args) -> None:
    lines = [provenance("python benchmarks/solver_vs_cbc.py --write") + f" PuLP {pulp.__version__} + CBC, "
             f"gap {args.gap:g}, one thread each.", "",
             "| ILP (memory objective) | memshard's ILP | Alpa's formulation | HiGHS, memshard's search "
             "| CBC, identical ILP | CBC, Alpa's formulation |", "|---|---|---|---:|---:|---:|"]
    for model, mesh, layers, batch, seq in SUITE:
        suite_args = argparse.Namespace(**{**vars(args), "model": model, "mesh": mesh, "layers": layers,
                                           "batch": batch, "seq": seq})
        print(f"== {model} {layers} layers on {mesh}, batch {batch} × {seq}", flush=True)
        problem, f = build(suite_args)
        r = race(problem, f, suite_args)
        lines.append(f"| {model}, {layers} layers, {mesh}, batch {batch} × {seq} | {r['sizes']} | {r['alpa_sizes']} "
                     f"| {r['highs_s']:.2f} s | {r['cbc_s']:.2f} s ({r['cbc_s'] / r['highs_s']:.1f}×) "
                     f"| {r['alpa_s']:.2f} s ({r['alpa_s'] / r['highs_s']:.1f}×) |")
    write_section("solver-vs-cbc", "HiGHS vs PuLP + CBC", "\n".join(lines))


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
    ap.add_argument("--write", action="store_true", help="run the table's four ILPs and write it to BENCHMARKS.md")
    args = ap.parse_args()
    if args.write:
        write_suite(args)
        return
    problem, f = build(args)
    print(f"{args.model} ({args.layers} layers) on {args.mesh}, machine {platform.processor() or platform.machine()}, "
          f"Python {platform.python_version()}, highspy {metadata.version('highspy')}, "
          f"PuLP {pulp.__version__} + CBC")
    print(f"memshard's ILP: {sizes(f.model)}")
    if args.same_objective:
        same_objective(f, args)
    else:
        race(problem, f, args)


if __name__ == "__main__":
    main()
