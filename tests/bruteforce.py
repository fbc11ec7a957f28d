"""Brute force over every complete plan of a small problem: the reference for the ILP."""

from __future__ import annotations

import itertools

from memshard.problem.evaluate import InconsistentPlan, evaluate
from memshard.problem.records import OpGroup, Problem, Selection, StorageGroup


def all_selections(problem: Problem):
    op_groups = [g for g, grp in enumerate(problem.groups) if isinstance(grp, OpGroup)]
    storage = [g for g, grp in enumerate(problem.groups) if isinstance(grp, StorageGroup)]
    storage_link = {link.a: link for link in problem.links if isinstance(problem.groups[link.a], StorageGroup)}
    for combo in itertools.product(*(range(len(problem.groups[g].choices)) for g in op_groups)):
        choices = [0] * len(problem.groups)
        for g, k in zip(op_groups, combo):
            choices[g] = k
        per_storage = []
        for g in storage:
            link = storage_link[g]
            want = link.b_labels[choices[link.b]]
            per_storage.append([k for k, lab in enumerate(link.a_labels) if lab == want])
        for st in itertools.product(*per_storage):
            for g, k in zip(storage, st):
                choices[g] = k
            base = Selection(tuple(choices), tuple(0 for _ in problem.edges))
            keep_options = []
            for e, edge in enumerate(problem.edges):
                lp, lc = problem.edge_layouts(base, e)[:2]
                keep_options.append([0, 1] if edge.can_keep(lp, lc) else [0])
            for keeps in itertools.product(*keep_options):
                yield Selection(tuple(choices), tuple(keeps))


def evaluate_all(problem: Problem):
    out = []
    for sel in all_selections(problem):
        try:
            out.append((sel, evaluate(problem, sel)))
        except InconsistentPlan:
            continue
    return out


def count_selections(problem: Problem, limit: int) -> int:
    n = 0
    for _ in all_selections(problem):
        n += 1
        if n > limit:
            break
    return n
