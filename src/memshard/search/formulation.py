r"""The ILP of a :class:`~memshard.problem.records.Problem`: one strategy per op group, one storage
option per parameter group, the edges' keep flags, and the peak they lead to.

Bytes and seconds are counted in units scaled to the problem (``Reference.units``).
Variables::

    x[g,c] ∈ {0,1}     group g (op strategy, parameter storage) takes choice c
    z[e,k,a,σ] ≥ 0     edge e, copy k (0; 1 kept; 2, 3 replayed), resharding step a (mesh
                       axis a), in state σ                              (edges.py)
    κ[e] ∈ {0,1}       edge e keeps its saved copy in the producer's layout
    c[e,L,R], y[τ,H,L] ≥ 0   a consumer's own copy; the producer's tensor once its own
                       holder has ended                                 (memory.py)
    s[a,L] ∈ [0,1]     an add's gradient in layout L, received by both its producers (memory.py)
    ρ[e,f] ≥ 0         the reshard-buffer price f of edge e             (reshards.py)
    L_t                live bytes at candidate point t
    A ≥ 0              the activations one micro-batch holds at the forward/backward boundary,
                       where a pipeline stage's rank holds k − 1 more (memory.py)
    M ≥ 0              peak bytes per device
    E ≥ 0              the collectives run beside the compute that it does not hide
                       (only where the framework overlaps some: ``Problem.overlaps``)

Row families (each row is tagged with its family, see ``model.RowTag``), one method each:

  choice        Σ_c x[g,c] = 1                                         add_choice_constraints
  link          Σ_{c: ℓ_a(c)=ℓ} x[a,c] = Σ_{c: ℓ_b(c)=ℓ} x[b,c]  ∀ℓ   add_link_constraints
                (a storage option's gradient layout is the one its op's strategy gives; tied
                weights agree across their uses; a layer unit's members agree)
  conflict      Σ_{c∈A} x[a,c] + Σ_{c∈B} x[b,c] ≤ 1 (a replayed op, its weight gathered per
                op under ZeRO-3)                                      add_conflict_constraints
  edge-flow, keep, replay   Alpa's edge linearisation factored by mesh axis, a kept copy,
                recomputation's copies                                add_edge_constraints
  live-bytes, memory, copy, held, shared-gradient, in-flight   L_t chained (L_0 with
                (k − 1)·A), L_t + const_t ≤ M                         add_memory_constraints
  reshard, reshard-price   L_t + Σ_k ρ + S_t(x) + const_t ≤ M          add_reshard_constraints
  overlap       E ≥ Σ instances·overlapped(x) − Σ_op groups instances·compute(x),
                E ≥ Σ instances·overlapped_once(x) − Σ_op groups instances·compute(x)/m
                                                                      add_overlap_constraints
  budget        T ≤ step-time budget (objective memory), M ≤ memory budget (objective time)
                with T = Σ instances·(time(x) − overlapped(x)) + E + Σ executions·time(z)
                (evaluate's step time where E sits at its bound; above it T only grows)
                                                                      add_budget_constraints
"""

from __future__ import annotations

from collections import defaultdict

import highspy
import numpy as np

from memshard.problem.evaluate import Evaluation, evaluate
from memshard.problem.records import OpGroup, Problem, Selection, complete_selection
from memshard.search.edges import EdgeFlow, EdgeFlows
from memshard.search.memory import LiveBytes
from memshard.search.model import LinearModel, RowTag
from memshard.search.reference import Reference, reference
from memshard.search.reshards import ReshardRows

HIGHS_TOLERANCE = 1e-6  # HiGHS's integrality and MIP feasibility tolerances (defaults)
# A set of branches one of which every integral solution takes: (column, value it is fixed at).
Disjunction = tuple[tuple[int, float], ...]
Expression = tuple[np.ndarray, np.ndarray]  # (columns, coefficients)


class Formulation:
    """The model of ``problem``, built family by family (the order matters only for HiGHS's
    determinism: the same input gives the same model, so the same plan)."""

    def __init__(self, problem: Problem, reference_figures: Reference | None = None):
        self.problem = problem
        self.model = LinearModel()
        self.reference = reference_figures or reference(problem)
        self.bytes_unit, self.time_unit = self.reference.units
        self.choice_columns = [self.model.columns(len(g.choices), integer=True) for g in problem.groups]
        self.peak = int(self.model.columns(1, integer=False, hi=highspy.kHighsInf)[0])
        self.flows: list[EdgeFlow] = []
        self.keep_columns: dict[int, int] = {}
        self.live: LiveBytes | None = None
        self.reshards: ReshardRows | None = None
        self.exposed: int | None = None  # E's column

    def add_plan_constraints(self, points: list[int], reshard_rows: bool = True) -> None:
        """Every family that makes a solution a plan and prices its peak at ``points`` (the
        reshard rows too unless they are added lazily); the budgets are the caller's."""
        self.add_time_constraints()
        self.add_memory_constraints(points)
        if reshard_rows:
            self.add_reshard_constraints()

    def add_time_constraints(self) -> None:
        """Every family that makes a solution a plan and prices its step time: the plan's rows
        without its memory rows (alone, a relaxation of the step time)."""
        self.add_choice_constraints()
        self.add_link_constraints()
        self.add_conflict_constraints()
        self.add_edge_constraints()
        self.add_overlap_constraints()

    # -- row families --------------------------------------------------------------------------
    def add_choice_constraints(self) -> None:
        for g, cols in enumerate(self.choice_columns):
            self.model.row((cols, np.ones(len(cols))), 1.0, 1.0, RowTag("choice", item=self.problem.groups[g].key))

    def add_link_constraints(self) -> None:
        x = self.choice_columns
        for link in self.problem.links:
            by_label: dict = defaultdict(dict)
            for c, label in enumerate(link.a_labels):
                by_label[label][int(x[link.a][c])] = 1.0
            for c, label in enumerate(link.b_labels):
                coefs = by_label[label]
                col = int(x[link.b][c])
                coefs[col] = coefs.get(col, 0.0) - 1.0
            item = f"{self.problem.groups[link.a].key} ~ {self.problem.groups[link.b].key}"
            for label in sorted(by_label, key=repr):
                self.model.row(by_label[label], 0.0, 0.0, RowTag("link", item=item))

    def add_conflict_constraints(self) -> None:
        x = self.choice_columns
        for c in self.problem.conflicts:
            coefs = {int(x[c.a][k]): 1.0 for k in c.a_choices}
            coefs.update({int(x[c.b][k]): 1.0 for k in c.b_choices})
            self.model.row(coefs, -highspy.kHighsInf, 1.0, RowTag("conflict", item=c.why))

    def add_edge_constraints(self) -> None:
        flows = EdgeFlows(self.problem, self.model, self.choice_columns, self.time_unit)
        for e in range(len(self.problem.edges)):
            flow = flows.add(e)
            self.flows.append(flow)
            if flow.keep_column is not None:
                self.keep_columns[e] = flow.keep_column

    def add_overlap_constraints(self) -> None:
        """E, the overlapped collectives the compute does not hide: E ≥ 0,
        E − Σ instances·overlapped(x) + Σ_op groups instances·compute(x) ≥ 0 and, with m
        micro-batches, E − Σ instances·overlapped_once(x) + Σ_op groups instances·compute(x)/m ≥ 0
        (those run once a step hide under one micro-batch's compute; none where no choice
        overlaps: the model is as without)."""
        groups = self.problem.groups
        if not self.problem.overlaps or not any(c.overlapped_s for g in groups for c in g.choices):
            return
        self.exposed = int(self.model.columns(1, integer=False, hi=highspy.kHighsInf)[0])
        m = self.problem.micro_batches
        rows = [("step", lambda c: c.overlapped_s, 1.0)]
        if m > 1 and any(c.overlapped_once_s for g in groups for c in g.choices):
            rows.append(("once a step", lambda c: c.overlapped_once_s, 1.0 / m))
        for item, overlapped, share in rows:
            cols, vals = [np.array([self.exposed])], [np.array([1.0])]
            for g, grp in enumerate(groups):
                window = share * isinstance(grp, OpGroup)
                cols.append(self.choice_columns[g])
                vals.append(np.array([(c.compute_s * window - overlapped(c)) * grp.instances / self.time_unit
                                      for c in grp.choices]))
            self.model.row((np.concatenate(cols), np.concatenate(vals)), 0.0, highspy.kHighsInf,
                           RowTag("overlap", item=item))

    def add_memory_constraints(self, points: list[int]) -> list[int]:
        """The ``memory`` rows of ``points`` (after add_edge_constraints)."""
        self.live = LiveBytes(self.problem, self.model, self.choice_columns, self.flows, self.peak, self.bytes_unit)
        self.reshards = ReshardRows(self.problem, self.model, self.choice_columns, self.keep_columns, self.bytes_unit)
        return self.live.add(points)

    def add_reshard_constraints(self, points: set[int] | None = None) -> None:
        """The reshard rows at ``points`` (default every candidate point), after the memory rows."""
        self.reshards.add(self.live.live_column, self.peak, self.live.constants_at, points)

    def add_budget_constraints(self, objective: str, time: Expression, max_step_time_s: float | None,
                               memory_budget_bytes: float | None) -> None:
        if objective == "memory" and max_step_time_s is not None:
            self.model.row(time, -highspy.kHighsInf, max_step_time_s / self.time_unit, RowTag("budget", item="time"))
        if objective == "time":
            budget = memory_budget_bytes if memory_budget_bytes is not None else self.problem.mesh.device_memory_bytes
            self.model.row({self.peak: 1.0}, -highspy.kHighsInf, budget / self.bytes_unit,
                           RowTag("budget", item="memory"))

    # -- expressions ---------------------------------------------------------------------------
    def time_expression(self) -> Expression:
        """T: the step time in model units."""
        cols = [f.time_columns for f in self.flows]
        vals = [f.time_values for f in self.flows]
        hidden = self.exposed is not None  # the overlapped collectives counted in E instead
        for g, grp in enumerate(self.problem.groups):
            cols.append(self.choice_columns[g])
            vals.append(np.array([(c.time_s - c.overlapped_s * hidden) * grp.instances / self.time_unit
                                  for c in grp.choices]))
        if self.exposed is not None:
            cols.append(np.array([self.exposed]))
            vals.append(np.array([1.0]))
        unique, inverse = np.unique(np.concatenate(cols), return_inverse=True)
        return unique, np.bincount(inverse, weights=np.concatenate(vals))

    def peak_expression(self) -> Expression:
        return np.array([self.peak]), np.array([1.0])

    # -- solutions and plans -------------------------------------------------------------------
    def selection(self, values: np.ndarray) -> Selection:
        """The plan a solution's columns say."""
        choices = tuple(int(np.argmax(values[cols])) for cols in self.choice_columns)
        keeps = tuple(int(round(values[self.keep_columns[e]])) if e in self.keep_columns else 0
                      for e in range(len(self.problem.edges)))
        return Selection(choices, keeps)

    def selection_start(self, selection: Selection) -> Expression:
        """A complete plan as a partial MIP start: its choice and keep columns."""
        cols, vals = [], []
        for g, group_cols in enumerate(self.choice_columns):
            cols.extend(int(c) for c in group_cols)
            vals.extend(float(k == selection.choices[g]) for k in range(len(group_cols)))
        for e, col in self.keep_columns.items():
            cols.append(int(col))
            vals.append(float(selection.keeps[e]))
        return np.array(cols), np.array(vals)

    def replicated(self) -> Selection:
        """Every op unsplit, nothing stored sharded, nothing kept: a plan that exists whenever
        any does without a memory budget."""
        ops = {g: 0 for g, grp in enumerate(self.problem.groups) if isinstance(grp, OpGroup)}
        return complete_selection(self.problem, ops)

    def fix(self, selection: Selection) -> None:
        """Pin every choice and keep flag to ``selection``'s."""
        m = self.model
        for g, cols in enumerate(self.choice_columns):
            for c, col in enumerate(cols):
                m.lower[col] = m.upper[col] = float(c == selection.choices[g])
        for e, col in self.keep_columns.items():
            m.lower[col] = m.upper[col] = float(selection.keeps[e])

    def disjunctions(self) -> list[Disjunction]:
        """Each group's choices and each keep flag's two values, as branches of the ILP."""
        return ([tuple((int(c), 1.0) for c in cols) for cols in self.choice_columns]
                + [((int(col), 1.0), (int(col), 0.0)) for _, col in sorted(self.keep_columns.items())])

    def points_over_peak(self, values: np.ndarray, evaluation: Evaluation | None = None) -> set[int]:
        """The reshard points where the plan of a solution, priced by the evaluator (its
        reshards included; ``evaluation`` if already priced), holds more than the solution's
        M: the lazy reshard rows it violates. Empty: the plan meets every row, those not in
        the model too."""
        live = (evaluation or evaluate(self.problem, self.selection(values))).live_bytes
        m = values[self.peak] * self.bytes_unit * (1 + HIGHS_TOLERANCE) + 1.0
        return {rp.point for rp in self.problem.reshard_points if live[rp.point] > m}

    def peak_bytes(self, values: np.ndarray) -> float:
        return float(values[self.peak]) * self.bytes_unit
