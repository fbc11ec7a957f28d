"""The planning problem and its memory and time model: a job priced into decision groups,
their choices and costs.

- ``records.py``: the problem's records (groups, choices, edges, selections);
- ``strategies.py``, ``tensor_parallel.py``, ``eager.py``: the per-op strategies and the
  framework views of a graph (the gathers tensor parallelism adds, the eager module's ops);
- ``schedule.py``, ``recompute.py``, ``gathers.py``: the training schedule and liveness,
  activation recomputation, ZeRO-3 gather units;
- ``memory.py``, ``comm.py``, ``reshard_memory.py``: bytes per device, collectives and their
  time, a reshard's transient buffers;
- ``pricing.py``, ``storage.py``: a job priced into a :class:`records.Problem` (ops, then
  parameters' storage);
- ``evaluate.py``, ``bounds.py``: one complete plan priced, and plan-independent lower bounds;
- ``pipeline.py``: pipeline schedules as each rank's action list, the micro-batches each
  stage holds, and the step's timeline.
"""
