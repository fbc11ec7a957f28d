"""The search: the integer linear program that picks a plan, its search with HiGHS, and
planning large meshes on merged axes (``coarsen.py``).

- ``model.py``: columns and tagged rows, collected in Python and handed to HiGHS once;
- ``formulation.py``: the ILP of a :class:`~memshard.problem.records.Problem` — its variables and
  row families, documented there, each built by one ``add_*_constraints`` method (edge flows
  in ``edges.py``, live bytes in ``memory.py``, reshard buffers in ``reshards.py``);
- ``reference.py``: the figures that scale the ILP and seed its search;
- ``highs.py``: one minimisation on one HiGHS model (a dive, the support search, reduced-cost
  fixing, branch and bound, relaxations);
- ``passes.py``: the first pass (the blend, then its proof);
- ``solve.py``: one request (``SearchRequest``) searched by the stages in order — the
  relaxation beside the search, then one loop over ``STAGES``: the first pass's rounds of
  lazy reshard rows, the tie-break pass — behind :func:`memshard.search.solve.solve`, and the
  plain single MIP they are checked against (``solve_plain``);
- ``stages.py``: the record of the stages run, kept on the result and the plan, and the test
  knob that makes time run out at a stage (``TimeOut``).
"""
