"""One rank of a large job, simulated in this process: ``memshard simulate``.

:func:`simulate` runs rank ``rank`` of the plan's mesh (64–1024 ranks and more) with no
hardware: the ``fake`` process group (collectives move no data and cost nothing) and
``FakeTensorMode`` (tensors carry shapes and dtypes, no storage, and ops compute nothing).
It executes the very same step as :func:`memshard.runtime.train.train`, which it calls:
:class:`~memshard.runtime.executor.ShardedGraphModel`, ``LeanAdam``, ``steps`` steps with the
last one measured by ``MemoryMeter`` (entered inside the fake mode, as it must be) and
``CommCounter``. So the plan's predicted peak memory, breakdown and communication can be
checked against what the executor really allocates and sends, for billion-parameter models,
on a laptop (docs/design.md, "The runtime"; docs/verification.md).

What differs from a real run: there are no values, so the losses are ``None``; the step
times are those of the fake execution, not of a device; and under fake tensors the executor
skips what only produces values (``ops.dropout`` allocates the local mask directly instead of
hashing element indices chunk by chunk; ``loss_value`` reads no value). The
command is ``memshard simulate --model gpt3-6.7b --mesh 8x8 --batch 64 --seq 2048 --rank 0``.
"""

from __future__ import annotations

import math

import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import init_device_mesh

from memshard.core.errors import MemshardError
from memshard.plans.plan import runnable
from memshard.runtime.measure import destroy, init_fake_world
from memshard.runtime.train import train

__all__ = ["simulate"]


def simulate(plan, rank: int = 0, steps: int = 2, seed: int = 0, lr: float = 1e-3) -> dict:
    """Rank ``rank`` of ``plan`` under the fake process group and ``FakeTensorMode``.

    Returns the report :func:`memshard.runtime.train.train` returns (``rank``,
    ``coordinate``, ``strategy``, ``losses`` — ``None`` here —, ``step_times_s``,
    ``predicted``, ``measured``) plus ``"simulated": True`` and ``"world_size"``.
    """
    mesh_spec = plan.problem.mesh
    world = mesh_spec.num_devices
    if not 0 <= rank < world:
        raise MemshardError(f"rank {rank} is outside the plan's {world} devices")
    plan = runnable(plan)
    if dist.is_initialized():
        raise MemshardError(
            "a process group is already initialised in this process; "
            "simulate needs its own (fake) one"
        )
    init_fake_world(rank, world)
    try:
        mesh = init_device_mesh("cpu", mesh_spec.shape, mesh_dim_names=mesh_spec.axis_names)
        with FakeTensorMode():
            report = train(plan, mesh, steps=steps, seed=seed, lr=lr)
    finally:
        destroy()
    report["losses"] = [
        None if isinstance(x, float) and math.isnan(x) else x for x in report["losses"]
    ]
    report["simulated"] = True
    report["world_size"] = world
    return report
