"""The errors that reach the user: :class:`MemshardError`, which the CLI turns into one line
``memshard: error: …`` and exit code 2, and its kinds the search raises."""


class MemshardError(ValueError):
    """Bad input or an unsolvable request; the message is meant for the user as it is."""


class SolverTimeLimit(MemshardError):
    """The search ran out of time before it found any plan."""

    def __init__(self, limit_s: float | None = None):
        within = f" ({limit_s:g} s)" if limit_s is not None else ""
        super().__init__(f"solver time limit{within} hit before any plan was found; raise --time-limit")


class Infeasible(MemshardError):
    """No plan meets the constraints (a memory budget, a step-time budget)."""

    def __init__(self, objective: str):
        super().__init__(f"no plan satisfies the {objective} constraints")
        self.objective = objective


class NoBetterPlan(MemshardError):
    """The search's bound shows that no plan is below the cutoff it was given (``bound``, in
    the objective's units; ``by``: what bound it is)."""

    def __init__(self, bound: float, by: str = "the search's bound"):
        super().__init__("no plan is better than the cutoff")
        self.bound = bound
        self.by = by
