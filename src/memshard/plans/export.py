"""``memshard export``: a baseline handed to the framework it is named after, as text.

This module owns which strategies can be exported and why the others cannot
(:func:`export_target`, :func:`check_exportable`), and the text written for each from its
plan (:func:`render`):

- ``fsdp2``: a Python function ``parallelize(model, mesh)`` applying PyTorch's ``fully_shard``
  to every transformer block, then to the root module, with its defaults: what the ``fsdp2``
  baseline prices (``gathers.fsdp2_units``). The blocks are the modules ``<container>.<i>``
  the graph's layer ops name (``model.layers.0.self_attn.q_proj``…).
- ``ddp``: the same function wrapping the model in ``DistributedDataParallel`` with its
  defaults (its gradient buckets priced).
- ``fsdp2-noreshard`` and ``ddp-bucket-view``: the same with the option their baselines price
  (``reshard_after_forward=False`` to every ``fully_shard``, ``gradient_as_bucket_view=True``);
  ``fsdp2-prefetch2``: with each block's explicit prefetching of the next two blocks in forward
  and the two before it in backward; ``fsdp2-torchtitan``: first ``fully_shard`` of the token
  embedding and of the output layers (``reshard_after_forward=False``) as torchtitan wraps a
  decoder, by the modules that hold those weights (``gathers.end_weights``);
  ``fsdp2-reshard<N>``: ``reshard_after_forward=N`` to every ``fully_shard``.
- ``torch-tp<T>-fsdp<D>``: ``parallelize_module`` with one ``ParallelStyle`` per module, read
  off the plan (:func:`tensor_parallel_styles`: column- and row-parallel projections,
  sequence-parallel norms, ``PrepareModuleInput`` where the plan gathers a block input once),
  on the inner mesh axis, then ``fully_shard`` over the outer one (``…-noreshard``: with
  ``reshard_after_forward=False``; ``…-torchtitan``: the ends first, as ``fsdp2-torchtitan``);
  for traced models, whose module names it writes.
- ``megatron-tp…``: Megatron-LM's command-line arguments for a built-in GPT or LLaMA preset,
  with the layout the baseline's name says (tensor, sequence and data parallelism, the
  distributed optimizer, recomputation).

memshard's own plans mix strategies per op, and the idealised baselines (``dp``, ``zero*``,
``tp*-fsdp*``) are priced as memshard's runtime executes them: neither is expressible with
PyTorch's public APIs as priced, so both are refused with a pointer to
``memshard.parallelize``. The code is text (no torch here); ``api.export`` makes the plan.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, replace

from memshard.baselines.names import Kind, StrategyName, parse_strategy
from memshard.core.errors import MemshardError
from memshard.core.graph import Graph, Origin, TensorKind
from memshard.core.quantities import counted, format_bytes
from memshard.job import HFModel, Job, TracedModule
from memshard.plans.pipelined import PipelinedPlan
from memshard.plans.plan import Plan
from memshard.plans.report import model_figures
from memshard.problem.gathers import end_weights
from memshard.problem.tensor_parallel import REDISTRIBUTE

TORCH_STRATEGIES = (Kind.FSDP2, Kind.DDP, Kind.TORCH_TP)  # PyTorch's APIs, exported as Python
CHECKPOINTED = ("full", "selective-op")  # the recomputation exported as torch.utils.checkpoint
BUILT_UNDER_AUTO = ("selective-op", "selective-mlp", "selective-attn-mlp")  # a recipe's own policies
# torchtitan's per-op selective activation checkpointing, as the ``+selective-op`` baselines price it
OP_LEVEL_POLICY = [
    "def op_level_policy():",
    "    \"\"\"torchtitan's per-op selective activation checkpointing (selective_ac_option = \"op\"): the outputs of",
    "    a block's compute-intensive ops (matmuls, fused attention) are saved, except every second aten.mm;",
    "    everything else is recomputed in backward.\"\"\"",
    "    aten = torch.ops.aten",
    "    saved = {op.default for op in get_default_op_list().compute_intensive_ops}",
    "    # cuDNN's fused attention (torchtitan saves it too) and the CPU one, so that the code runs as priced on CPU",
    "    saved |= {aten._scaled_dot_product_cudnn_attention.default, aten._scaled_dot_product_flash_attention_for_cpu.default}",
    "    matmuls = {False: 0, True: 0}  # counted apart in the forward and in the recompute",
    "",
    "    def policy(ctx, func, *args, **kwargs):",
    "        if func is aten.mm.default:",
    "            matmuls[ctx.is_recompute] += 1",
    "            if matmuls[ctx.is_recompute] % 2 == 0:",
    "                return CheckpointPolicy.PREFER_RECOMPUTE",
    "        return CheckpointPolicy.MUST_SAVE if func in saved else CheckpointPolicy.PREFER_RECOMPUTE",
    "    return policy",
    "",
    "",
]
# PrepareModuleInput gathering a sequence-parallel input once for the projections that read it
GATHER_POSITIONAL = "PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))"
GATHER_KEYWORD = ("PrepareModuleInput(input_kwarg_layouts={\"hidden_states\": Shard(1)}, "
                  "desired_input_kwarg_layouts={\"hidden_states\": Replicate()})")
LAYER_OP = re.compile(r"^(?P<container>.+?)\.(?P<index>\d+)\.")  # <container>.<i>.<op in the block>
# memshard's model knobs as the command line spells them (``cli.KNOB_FLAGS``)
KNOB_FLAGS = {"num_layers": "--layers", "hidden": "--hidden", "heads": "--heads", "kv_heads": "--kv-heads",
              "ffn": "--ffn", "vocab": "--vocab", "dropout": "--dropout"}
PARALLELIZE = ("run it with memshard.parallelize(model, plan) (README: \"Using a plan from Python\"), or export a "
               "baseline PyTorch or Megatron-LM runs as priced: --strategy fsdp2, ddp or megatron-tp… "
               "(memshard compare lists them)")


@dataclass(frozen=True)
class MegatronLayout:
    """The layout a ``megatron-tp<T>[-pp<P>][-dp<D>][-sp][-distopt[-overlap]][-tpoverlap]`` baseline's name says."""

    tensor_parallel: int
    data_parallel: int
    sequence_parallel: bool
    distributed_optimizer: bool
    overlap: bool = False
    pipeline_parallel: int = 1
    tp_overlap: bool = False  # --tp-comm-overlap
    virtual_pipeline: int = 1  # stages per pipeline rank, interleaved


@dataclass(frozen=True)
class ExportTarget:
    """An exportable strategy, as its name says: ``kind`` is ``fsdp2``, ``ddp``, ``torch-tp`` or
    ``megatron``; ``recompute`` the policy its name carries (``+selective``, ``+full``), under
    which its baseline is built; ``precision`` the precision its code runs unless the job says
    otherwise (None: the model's); ``option`` a keyword argument given to every ``fully_shard``
    or to ``DistributedDataParallel``; ``split``/``count``: some layers recomputed in full,
    Megatron-LM's ``block`` (the first ``count``) or torchtitan's ``every`` (each
    ``count``-th), under recomputation ``auto`` (as torchtitan's per-op policy,
    ``selective-op``, is); ``prefetch``: the blocks each block's ``fully_shard`` prefetches
    explicitly each way (0: FSDP2's default); ``wrap_ends``: the embedding and the output
    layers wrapped first, as torchtitan does."""

    name: StrategyName

    @property
    def strategy(self) -> str:
        return str(self.name)

    @property
    def kind(self) -> str:
        return self.name.kind.value

    @property
    def recompute(self) -> str:
        return self.name.recompute

    @property
    def precision(self) -> str | None:
        return None if self.name.kind is Kind.MEGATRON else "fp32"

    @property
    def megatron(self) -> MegatronLayout | None:
        name = self.name
        if name.kind is not Kind.MEGATRON:
            return None
        return MegatronLayout(name.tensor_parallel, name.data_parallel or 1, name.sequence_parallel,
                              name.distributed_optimizer, name.overlap, name.pipeline_parallel, name.tp_overlap,
                              name.virtual_pipeline)

    @property
    def option(self) -> str:
        if self.name.bucket_view:
            return "gradient_as_bucket_view=True"
        reshard = self.name.reshard_after_forward
        return "" if reshard is True else f"reshard_after_forward={reshard}"

    @property
    def split(self) -> str:
        return "block" if self.name.block else "every" if self.name.every else ""

    @property
    def count(self) -> int:
        return self.name.block or self.name.every

    @property
    def prefetch(self) -> int:
        return self.name.prefetch

    @property
    def wrap_ends(self) -> bool:
        return self.name.torchtitan_units

    @property
    def policy(self) -> str:
        """The recomputation its baseline is built under."""
        return "auto" if self.split or self.recompute in BUILT_UNDER_AUTO else self.recompute

    @property
    def checkpoints(self) -> bool:
        """Whether its code wraps blocks in ``torch.utils.checkpoint``."""
        return self.recompute in CHECKPOINTED

    @property
    def per_op(self) -> bool:
        """Whether its checkpointing is torchtitan's per-op selective policy."""
        return self.recompute == "selective-op"


@dataclass(frozen=True)
class BlockContainer:
    """A module holding transformer blocks (``model.layers``) and how many the graph has."""

    path: str
    blocks: int


def export_target(strategy: str) -> ExportTarget:
    """What ``strategy`` exports as, or one MemshardError saying why it cannot be."""
    if not isinstance(strategy, str) or not strategy:
        raise MemshardError(f"a strategy is a name such as fsdp2, ddp or megatron-tp4-sp, got {strategy!r}")
    try:
        name = parse_strategy(strategy)
    except MemshardError as e:
        raise MemshardError(f"{strategy} cannot be exported: {e}; {PARALLELIZE}") from None
    target = ExportTarget(name)
    if target.split and (name.kind is Kind.MEGATRON) != (target.split == "block"):
        raise MemshardError(f"{strategy} cannot be exported: Megatron-LM recomputes some layers by block "
                            "(+full-blockN), torchtitan's recipes every N-th layer (+full-everyN)")
    if name.kind is Kind.MEGATRON:
        return target
    if name.kind in TORCH_STRATEGIES and name.pipeline_parallel > 1:
        raise MemshardError(f"{strategy} cannot be exported: torchtitan runs its pipeline (pipeline_parallel_degree "
                            f"= {name.pipeline_parallel}), which no parallelize(model, mesh) function applies; "
                            f"export each stage's recipe, {name.stage_recipe}")
    if name.kind in TORCH_STRATEGIES:
        # full and per-op recomputation are checked against torch.utils.checkpoint around every block
        if name.recompute not in ("none", *CHECKPOINTED):
            raise MemshardError(f"{strategy} cannot be exported: its recomputation is not "
                                "checked against torch.utils.checkpoint as exported (+full and "
                                f"+selective-op are); export {name.plain} or run it with "
                                "memshard.parallelize(model, plan) (README: \"Using a plan from "
                                "Python\")")
        return target
    raise MemshardError(f"{strategy} cannot be exported: {_why_not(name.plain)}; {PARALLELIZE}")


def _why_not(base: StrategyName) -> str:
    if base.kind is Kind.MEMSHARD:
        return ("memshard's plan picks each operator's sharding, each parameter's ZeRO storage and each reshard "
                "apart (per-op mixing), which PyTorch's public APIs cannot express")
    if base.kind is Kind.DP:
        return ("dp is data parallelism as memshard's runtime runs it (gradients all-reduced in place, no "
                "buckets); PyTorch's DistributedDataParallel is --strategy ddp")
    if base.kind is Kind.ZERO:
        return (f"{base} is an idealised ZeRO stage as memshard's runtime executes it, which no PyTorch API "
                "allocates as priced; PyTorch's fully_shard is --strategy fsdp2")
    return (f"{base} prices an idealised TP × FSDP (memshard's runtime); PyTorch's "
            f"parallelize_module × fully_shard is --strategy {replace(base, kind=Kind.TORCH_TP)}")


def check_exportable(target: ExportTarget, job: Job) -> None:
    """Refuse, before any planning, a job the target's code cannot run as priced."""
    given = isinstance(job.model, (Graph, TracedModule))  # the graph or module fixes its precision
    precision = job.graph.precision.name if given else job.precision
    if target.kind == "ddp" and precision not in (None, "fp32", "autocast"):
        raise MemshardError(f"{target.strategy} is exported as PyTorch's defaults run it, in fp32 or under "
                            "torch.autocast (the precisions memshard checks it in against PyTorch): give "
                            "--precision fp32 or autocast")
    traced = isinstance(job.model, (HFModel, TracedModule)) or (
        isinstance(job.model, Graph) and job.model.origin is Origin.TRACED)
    if target.kind == "torch-tp" and not traced:
        raise MemshardError(f"{target.strategy}: the tensor-parallel plan names the model's own modules; export it "
                            "for a traced model (--hf-config or --hf-model)")
    if target.megatron is None:
        return
    if isinstance(job.model, (Graph, HFModel, TracedModule)):
        raise MemshardError(f"{target.strategy}: Megatron-LM arguments are written for built-in models (--model), "
                            "whose sizes Megatron-LM builds its own model from")
    if job.config.family not in ("gpt", "llama"):
        raise MemshardError(f"{target.strategy}: Megatron-LM arguments are written for GPT and LLaMA presets, "
                            f"not {job.config.family}")
    layout, n = target.megatron, job.mesh.num_devices
    stages = layout.pipeline_parallel * layout.virtual_pipeline
    if stages > 1 and job.config.num_layers % stages:
        raise MemshardError(f"{target.strategy}: Megatron-LM splits the {job.config.num_layers} layers evenly over "
                            f"{stages} pipeline stages; give a layer count that {stages} divides")
    if layout.tensor_parallel * layout.data_parallel * stages == n:
        per_step = layout.data_parallel * job.micro_batches
        if job.global_batch % per_step:
            raise MemshardError(f"{target.strategy}: Megatron-LM needs the global batch ({job.global_batch}) to be a "
                                f"multiple of data-parallel size × micro-batches ({per_step})")

def block_containers(graph: Graph) -> tuple[BlockContainer, ...]:
    """The modules holding the graph's repeated blocks, from its layer ops' names
    (``model.layers.0.self_attn.q_proj/linear#0`` → ``model.layers``), in forward order."""
    found: dict[str, set[int]] = {}
    for op in graph.ops:
        if op.layer is None:
            continue
        m = LAYER_OP.match(op.name)
        if m is None or int(m["index"]) != op.layer:
            raise MemshardError(f"op {op.name} of layer {op.layer} is not in a <container>.{op.layer}. module: "
                                "cannot say which module fully_shard should wrap")
        found.setdefault(m["container"], set()).add(op.layer)
    return tuple(BlockContainer(path, len(layers)) for path, layers in found.items())


def render(target: ExportTarget, plan: Plan | PipelinedPlan) -> str:
    """The exported text of ``plan``, the target's baseline (a pipelined one for Megatron-LM's
    ``-pp<P>``): a header, then the code or arguments."""
    body = {"fsdp2": fsdp2_code, "ddp": ddp_code, "torch-tp": torch_tp_code,
            "megatron": megatron_script}[target.kind](target, plan)
    return "\n".join([*header(plan), *body]) + "\n"


def header(plan: Plan | PipelinedPlan) -> list[str]:
    """Comment lines: the strategy, the job, the predicted peak, the command that made it (of a
    pipelined plan, the whole model and its largest stage's peak)."""
    job = plan.job
    shape = ""
    if not isinstance(job.model, (Graph, TracedModule)):
        shape = f", global batch {job.global_batch} × {job.seq_length} tokens"
        if job.micro_batches > 1:
            shape += f" in {job.micro_batches} micro-batches"
    if isinstance(plan, PipelinedPlan):
        stage = plan.peak_stage
        name, num_parameters, precision = job.graph.name, job.graph.num_parameters, stage.plan.model.precision
        peak_at = (f"stage {plan.stages.index(stage)} of {len(plan.stages)} (layers {stage.first_layer}-"
                   f"{stage.end_layer - 1}), at {stage.plan.memory.peak_at}")
        if plan.stages_per_rank > 1:
            rank = plan.peak_rank
            mine = [str(i) for i, r in enumerate(plan.stage_ranks) if r == rank]
            peak_at = f"pipeline rank {rank} of {plan.ranks} (stages {', '.join(mine)})"
    else:
        name, num_parameters, precision = plan.model.name, plan.model.num_parameters, plan.model.precision
        peak_at = f"at {plan.memory.peak_at}"
    return [
        f"# memshard export: {plan.strategy}",
        f"# Job: {name} ({model_figures(job, num_parameters, precision)}){shape}, "
        f"on mesh {job.mesh} ({counted(job.mesh.num_devices, 'device')})",
        f"# Predicted peak per device: {format_bytes(plan.peak_bytes)} ({round(plan.peak_bytes):,} bytes), {peak_at}",
        f"# Made by: {command_of(job, plan.strategy)}",
        "#",
    ]


def command_of(job: Job, strategy: str) -> str:
    """The ``memshard export`` command that writes this export (a model the command line cannot
    name, such as a graph or a module, is described instead)."""
    model = job.model
    if isinstance(model, str) and set(job.overrides) <= set(KNOB_FLAGS):
        source = ["--model", model]
    elif isinstance(model, HFModel) and isinstance(model.source, str):
        is_path = model.source.endswith(".json") or os.sep in model.source or os.path.isdir(model.source)
        source = ["--hf-config" if is_path else "--hf-model", model.source]
        if model.attn_implementation:
            source += ["--attn-implementation", model.attn_implementation]
    else:
        return f"memshard.export(<{type(model).__name__}>, {str(job.mesh)!r}, strategy={strategy!r}) in Python"
    knobs = []
    for knob, value in job.overrides.items():
        knobs += [KNOB_FLAGS[knob], ("on" if value else "off") if isinstance(value, bool) else str(value)]
    micro = ["--micro-batches", str(job.micro_batches)] if job.micro_batches > 1 else []
    return shlex.join(["memshard", "export", *source, "--mesh", str(job.mesh), "--batch", str(job.global_batch),
                       "--seq", str(job.seq_length), *micro, *knobs, "--precision", job.graph.precision.name,
                       "--strategy", strategy])


# -- PyTorch ------------------------------------------------------------------------------------------
def _usage(plan: Plan, what: str) -> list[str]:
    """What the function applies, how to call it, and the optimizer the peak assumes."""
    n = plan.job.mesh.num_devices
    return [f"# {what}",
            "# On every rank: build the model in fp32, then call parallelize(model, mesh) with a 1-D DeviceMesh",
            f"# of all {n} devices (init_device_mesh(\"cuda\", ({n},))) and make the optimizer from the result:",
            "# torch.optim.Adam(model.parameters(), foreach=True). memshard prices Adam's foreach step (one",
            "# square root of every state at once, PyTorch's default on GPUs). Each rank trains on its share",
            "# of the global batch."]


def _mesh_check(plan: Plan, what: str) -> list[str]:
    n = plan.job.mesh.num_devices
    return [f"    if mesh.ndim != 1 or mesh.size() != {n}:",
            f"        raise ValueError(f\"memshard priced {what} over one mesh axis of {n} devices, got {{mesh}}\")"]


def _blocks_lines(plan: Plan, target: ExportTarget, per_block: list[str]) -> list[str]:
    """Per block container: its blocks counted against the graph's, each wrapped in
    ``checkpoint_wrapper`` (torchtitan's full activation checkpointing) under ``+full``, then
    ``per_block`` (lines applied to each ``block`` of the ``container``)."""
    lines = []
    for container in block_containers(plan.problem.graph):
        count, path = container.blocks, container.path
        lines += [f"    container = model.get_submodule(\"{path}\")",
                  f"    if len(container) != {count}:",
                  f"        raise ValueError(f\"memshard priced {count} blocks in {path}, the model has "
                  "{len(container)}\")"]
        if target.checkpoints:
            lines += _wrap_lines(target, "container", "container[k]")
        lines += per_block
    return lines


def _wrap_lines(target: ExportTarget, blocks: str, assign: str) -> list[str]:
    """The blocks of ``blocks`` (each, or every ``count``-th) wrapped in ``checkpoint_wrapper``
    (with torchtitan's per-op policy under ``selective-op``), the result assigned to ``assign``."""
    wrap = f"{assign} = checkpoint_wrapper(block, preserve_rng_state=False)"
    if target.per_op:
        return ["    for k, block in enumerate(" + blocks + "):  # recomputed in backward as op_level_policy says",
                f"        {assign} = checkpoint_wrapper(block, preserve_rng_state=False, early_stop=False,",
                " " * (len(assign) + 30) + "context_fn=lambda: create_selective_checkpoint_contexts(op_level_policy()))"]
    if target.split != "every":
        return [f"    for k, block in enumerate({blocks}):  # recomputed in backward from its input", f"        {wrap}"]
    return [f"    for k, block in enumerate({blocks}):  # every {_ordinal(target.count)} recomputed in backward from its input",
            f"        if k % {target.count} == 0:", f"            {wrap}"]


def _checkpoint_import(target: ExportTarget) -> list[str]:
    if not target.checkpoints:
        return []
    wrapper = "from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper"
    if target.recompute == "full":
        return [wrapper]
    return ["from torch._functorch.partitioners import get_default_op_list", wrapper]


def _policy_import(target: ExportTarget) -> list[str]:
    if not target.per_op:
        return []
    return ["from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts"]


def _policy_lines(target: ExportTarget) -> list[str]:
    return OP_LEVEL_POLICY if target.per_op else []


def _checkpointing(target: ExportTarget) -> str:
    if target.per_op:
        return (" Every transformer block recomputes in backward what torchtitan's per-op selective activation "
                "checkpointing does not save (op_level_policy, torch.utils.checkpoint).")
    if target.recompute != "full":
        return ""
    which = f"Every {_ordinal(target.count)} transformer block" if target.split else "Every transformer block"
    return (f" {which} is recomputed in backward from its input (torchtitan's "
            f"{'selective_ac_option' if target.split else 'full activation checkpointing'}, torch.utils.checkpoint).")


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _mixed(plan: Plan) -> bool:
    return plan.problem.graph.precision.name == "mixed"


def _fsdp_import(plan: Plan) -> str:
    return f"from torch.distributed.fsdp import {'MixedPrecisionPolicy, ' if _mixed(plan) else ''}fully_shard"


def _fsdp_policy(plan: Plan) -> list[str]:
    """FSDP2's mixed precision as the ``fsdp2`` baseline of a mixed-precision job prices it."""
    if not _mixed(plan):
        return []
    return ["    # bf16 compute; the fp32 shards are the master weights, gradients are reduced in fp32",
            "    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)"]


def _shard(plan: Plan, module: str, mesh: str, option: str = "") -> str:
    return f"fully_shard({module}, mesh={mesh}{', mp_policy=mp_policy' if _mixed(plan) else ''}{', ' * bool(option)}{option})"


def _precision_note(plan: Plan) -> str:
    if plan.problem.graph.precision.name == "autocast":
        return (" Train in bf16 as priced: the forward and the loss under torch.autocast(\"cuda\", "
                "dtype=torch.bfloat16), backward and the optimizer step after it.")
    return (" Mixed precision: FSDP2's MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
            "reduce_dtype=torch.float32).") if _mixed(plan) else ""


def fsdp2_code(target: ExportTarget, plan: Plan) -> list[str]:
    """``fully_shard`` on every block of each container, then on the root (FSDP2's defaults)."""
    graph = plan.problem.graph
    named = []
    if graph.origin is Origin.BUILT:  # memshard's own module names, not necessarily the user's
        named = [f"# The blocks' container is named as memshard's built-in {plan.model.name} names it; give your "
                 "model's."]
    options = (f"with {target.option}" if target.option else f"with explicit prefetching of {target.prefetch} blocks"
               if target.prefetch else _ends_note(plan) if target.wrap_ends else "with its defaults")
    lines = [*_usage(plan, "PyTorch's fully_shard (FSDP2) on every transformer block, then on the root module, "
                           f"{options}." + _precision_note(plan) + _checkpointing(target)),
             *named,
             "",
             *(["import torch"] if _mixed(plan) or _policy_lines(target) else []),
             "from torch import nn",
             *_checkpoint_import(target),
             "from torch.distributed.device_mesh import DeviceMesh",
             _fsdp_import(plan),
             *_policy_import(target),
             "",
             "",
             *_policy_lines(target),
             "def parallelize(model: nn.Module, mesh: DeviceMesh) -> nn.Module:",
             "    \"\"\"FSDP2 as memshard priced it: fully_shard on every transformer block, then on the root module.\"\"\"",
             *_mesh_check(plan, "fsdp2"),
             *_fsdp_policy(plan),
             *(_end_lines(plan) if target.wrap_ends else [])]
    lines += _blocks_lines(plan, target, ["    for block in container:",
                                          f"        {_shard(plan, 'block', 'mesh', target.option)}",
                                          *_prefetch_lines(target.prefetch)])
    return [*lines, f"    {_shard(plan, 'model', 'mesh', target.option)}", "    return model"]


def _ends_note(plan: Plan) -> str:
    if end_weights(plan.problem.graph)[0] is None:
        return ("as torchtitan wraps a decoder: its tied embedding, final norm and output layer in one unit not "
                "resharded after forward, which FSDP2 gathers and reduces as the root module's")
    return "with the token embedding and the output layers wrapped first, as torchtitan wraps a decoder"


def _end_lines(plan: Plan, mesh: str = "mesh") -> list[str]:
    """torchtitan's units at the ends of a decoder, by the modules holding their weights: the
    token embedding, then the final norm and output layer, not resharded after forward
    (backward needs them at once). Tied embeddings share one unit with the root's schedule:
    nothing is written for them."""
    before, after = end_weights(plan.problem.graph)
    if not before:
        return []
    modules = [", ".join(f"model.get_submodule(\"{name.rpartition('.')[0]}\")" for name in names)
               for names in (before, after)]
    lines = [f"    {_shard(plan, modules[0] if len(before) == 1 else f'[{modules[0]}]', mesh)}"]
    if after:
        lines.append(f"    {_shard(plan, f'[{modules[1]}]', mesh, 'reshard_after_forward=False')}")
    return lines


def _prefetch_lines(depth: int) -> list[str]:
    """Each block's explicit prefetching as ``gathers.fsdp2_units`` prices it: the next
    ``depth`` blocks in forward, from block ``depth`` on the ``depth`` before it in backward."""
    if not depth:
        return []
    return ["    blocks = list(container)",
            f"    for k, block in enumerate(blocks):  # all-gathers issued {depth} blocks ahead each way",
            f"        block.set_modules_to_forward_prefetch(blocks[k + 1:k + {depth + 1}])",
            f"        if k >= {depth}:",
            f"            block.set_modules_to_backward_prefetch([blocks[k - j] for j in range(1, {depth + 1})])"]


def ddp_code(target: ExportTarget, plan: Plan) -> list[str]:
    """``DistributedDataParallel`` with its defaults: 25 MiB buckets holding a second copy of the
    gradients all step (``gradient_as_bucket_view=False``), which the ``ddp`` baseline prices;
    or with the buckets as the gradients (``ddp-bucket-view``)."""
    checkpointing = _blocks_lines(plan, target, []) if target.checkpoints else []
    held = ("its gradients are views of its buckets" if target.option
            else "its gradient buckets hold a second copy of the gradients all step")
    options = f"with {target.option}" if target.option else "with its defaults"
    return [*_usage(plan, f"PyTorch's DistributedDataParallel {options}; train the module it returns."
                    + _precision_note(plan) + _checkpointing(target)),
            "",
            *(["import torch"] if _policy_lines(target) else []),
            "from torch import nn",
            *_checkpoint_import(target),
            "from torch.distributed.device_mesh import DeviceMesh",
            "from torch.nn.parallel import DistributedDataParallel",
            *_policy_import(target),
            "",
            "",
            *_policy_lines(target),
            "def parallelize(model: nn.Module, mesh: DeviceMesh) -> nn.Module:",
            f"    \"\"\"DistributedDataParallel {options}, as memshard priced it",
            f"    ({held}).\"\"\"",
            *_mesh_check(plan, "ddp"),
            *checkpointing,
            f"    return DistributedDataParallel(model, device_mesh=mesh{', ' * bool(target.option)}{target.option})"]


def _feeds_the_loss(graph: Graph, op) -> bool:
    """Whether ``op``'s output reaches a cross-entropy directly or through copies (the fp32
    upcast of bf16 logits)."""
    for c, _ in graph.consumers.get(op.output.tensor, ()):
        consumer = graph.ops[c]
        if consumer.kind == "cross_entropy" or (consumer.kind == "copy" and _feeds_the_loss(graph, consumer)):
            return True
    return False


def tensor_parallel_styles(plan: Plan) -> dict[str, str]:
    """Module path → the ``ParallelStyle`` (as code) that lays it out as the ``torch-tp``
    baseline's plan does, from each op's split on the tensor-parallel (innermost) axis."""
    problem, selection = plan.problem, plan.selection
    graph, axis = problem.graph, problem.mesh.ndim - 1
    styles: dict[str, str] = {}
    for i, op in enumerate(graph.ops):
        module = op.name.split("/")[0]
        split = problem.strategy(selection, problem.op_group[i]).assignment[axis]
        weights = [o for o in op.inputs if graph.tensors[o.tensor].kind is TensorKind.PARAMETER]
        inputs = [o for o in op.inputs if graph.tensors[o.tensor].kind is TensorKind.ACTIVATION]
        if op.kind == REDISTRIBUTE:  # HF attention modules take their input as a keyword
            styles[module] = (GATHER_KEYWORD if module.endswith("self_attn") else GATHER_POSITIONAL)
        elif not weights or split is None:
            continue
        elif split == "s":
            styles[module] = "SequenceParallel()"
        elif not re.search(r"/(linear|embedding)#", op.name):  # the aten op the module ran
            raise MemshardError(f"{plan.strategy} cannot be exported: PyTorch's ColwiseParallel and RowwiseParallel "
                                f"take nn.Linear and nn.Embedding modules, and {module} is neither (GPT-2's Conv1D "
                                "is one such); run it with memshard.parallelize(model, plan)")
        elif op.kind == "embedding":
            styles[module] = "RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))"
        elif any(split in o.dims for o in inputs):
            styles[module] = "RowwiseParallel(output_layouts=Shard(1))"
        elif any(graph.ops[graph.producer[o.tensor]].kind == REDISTRIBUTE for o in inputs):
            styles[module] = "ColwiseParallel()"
        elif _feeds_the_loss(graph, op):
            styles[module] = "ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)"
        else:
            styles[module] = "ColwiseParallel(input_layouts=Shard(1))"
    return styles


def torch_tp_code(target: ExportTarget, plan: Plan) -> list[str]:
    """``parallelize_module`` with the plan's styles on the inner axis, then ``fully_shard`` on
    every block and the root over the outer one: what the ``torch-tp`` baseline prices."""
    containers = block_containers(plan.problem.graph)
    if len(containers) != 1:
        raise MemshardError(f"{target.strategy} cannot be exported: its code is written for one stack of blocks, "
                            f"the model has {len(containers)}")
    (container,) = containers
    tp = target.name.tensor_parallel
    defaults = f"with {target.option}" if target.option else _ends_note(plan) if target.wrap_ends else "with their defaults"
    dp = plan.job.mesh.num_devices // tp
    prefix = f"{container.path}.0."
    styles = tensor_parallel_styles(plan)
    root = {m: s for m, s in styles.items() if not m.startswith(f"{container.path}.")}
    block = {m[len(prefix):]: s for m, s in styles.items() if m.startswith(prefix)}

    def entries(plan_of: dict[str, str]) -> list[str]:
        return [f"        \"{m}\": {s}," for m, s in plan_of.items()]

    return ["# PyTorch's tensor parallelism (parallelize_module, torchtitan's plan) on the inner mesh axis, then",
            f"# fully_shard (FSDP2) on every block and the root module over the outer axis, {defaults}."
            + _precision_note(plan),
            f"# On every rank: build the model in fp32, call parallelize(model, mesh) with a 2-D DeviceMesh of {dp} × {tp}",
            f"# devices (init_device_mesh(\"cuda\", ({dp}, {tp}), mesh_dim_names=(\"dp\", \"tp\"))), make",
            "# torch.optim.Adam(model.parameters(), foreach=True), and run each step's forward and backward under",
            "# torch.distributed.tensor.parallel.loss_parallel(), passing position_ids (a Hugging Face model",
            "# derives them from the sequence-sharded embedding otherwise). Each data-parallel rank trains on its",
            "# share of the global batch; the ranks of one tensor-parallel group read the same sequences.",
            *(["#" + _checkpointing(target)] if target.recompute == "full" else []),
            "",
            *(["import torch"] if _mixed(plan) else []),
            "from torch import nn",
            *_checkpoint_import(target),
            "from torch.distributed.device_mesh import DeviceMesh",
            _fsdp_import(plan),
            "from torch.distributed.tensor import Replicate, Shard",
            "from torch.distributed.tensor.parallel import (",
            "    ColwiseParallel,",
            "    PrepareModuleInput,",
            "    RowwiseParallel,",
            "    SequenceParallel,",
            "    parallelize_module,",
            ")",
            "",
            "",
            "def parallelize(model: nn.Module, mesh: DeviceMesh) -> nn.Module:",
            f"    \"\"\"{target.strategy} as memshard priced it: TP × SP inside, FSDP2 outside.\"\"\"",
            f"    if mesh.ndim != 2 or tuple(mesh.shape) != ({dp}, {tp}) or mesh.mesh_dim_names is None:",
            f"        raise ValueError(f\"memshard priced a named {dp} × {tp} mesh (data, tensor parallel), got {{mesh}}\")",
            "    dp_mesh, tp_mesh = (mesh[name] for name in mesh.mesh_dim_names)",
            "    parallelize_module(model, tp_mesh, {",
            *entries(root),
            "    })",
            f"    blocks = list(model.get_submodule(\"{container.path}\").children())",
            f"    if len(blocks) != {container.blocks}:",
            f"        raise ValueError(f\"memshard priced {container.blocks} blocks in {container.path}, the model has "
            "{len(blocks)}\")",
            "    for block in blocks:",
            "        parallelize_module(block, tp_mesh, {",
            *("    " + e for e in entries(block)),
            "        })",
            *([f"    container = model.get_submodule(\"{container.path}\")",
               *_wrap_lines(target, "blocks", "container[k] = blocks[k]")]
              if target.recompute == "full" else []),
            *_fsdp_policy(plan),
            *(_end_lines(plan, "dp_mesh") if target.wrap_ends else []),
            "    for block in blocks:",
            f"        {_shard(plan, 'block', 'dp_mesh', target.option)}",
            f"    {_shard(plan, 'model', 'dp_mesh', target.option)}",
            "    return model"]


# -- Megatron-LM --------------------------------------------------------------------------------------
def megatron_arguments(target: ExportTarget, plan: Plan | PipelinedPlan) -> list[str]:
    """Megatron-LM's arguments (``megatron/training/arguments.py``) for the layout and the model."""
    layout, job = target.megatron, plan.job
    cfg = job.config
    args = [f"--tensor-model-parallel-size {layout.tensor_parallel}",
            f"--pipeline-model-parallel-size {layout.pipeline_parallel}"]
    if layout.virtual_pipeline > 1:  # (Megatron-LM's interleaved schedule)
        per_stage = cfg.num_layers // (layout.pipeline_parallel * layout.virtual_pipeline)
        args += [f"--num-layers-per-virtual-pipeline-stage {per_stage}"]
    args += ["--sequence-parallel"] * layout.sequence_parallel
    args += ["--use-distributed-optimizer"] * layout.distributed_optimizer
    args += ["--overlap-grad-reduce", "--overlap-param-gather"] * layout.overlap
    args += ["--tp-comm-overlap"] * layout.tp_overlap  # (Transformer Engine's userbuffers)
    args += [f"--num-layers {cfg.num_layers}", f"--hidden-size {cfg.hidden}",
             f"--num-attention-heads {cfg.heads}", f"--ffn-hidden-size {cfg.ffn}",
             f"--seq-length {job.seq_length}", f"--max-position-embeddings {cfg.max_positions}"]
    if cfg.family == "llama":  # Megatron-LM's defaults are GPT's: LayerNorm, GeLU, biases, tied, learned
        args += ["--normalization RMSNorm", "--swiglu", "--position-embedding-type rope", "--disable-bias-linear",
                 "--untie-embeddings-and-output-weights"]
        if cfg.num_kv_heads != cfg.heads:
            args += ["--group-query-attention", f"--num-query-groups {cfg.num_kv_heads}"]
    if not cfg.dropout:
        args += ["--hidden-dropout 0", "--attention-dropout 0"]
    micro = job.global_batch // (layout.data_parallel * job.micro_batches)
    args += [f"--micro-batch-size {micro}", f"--global-batch-size {job.global_batch}"]
    if target.recompute == "selective":  # Megatron-LM's selective recomputes the core attention
        args += ["--recompute-granularity selective"]
    elif target.recompute in ("selective-mlp", "selective-attn-mlp"):  # the MLP module (and the core attention)
        modules = "mlp" if target.recompute == "selective-mlp" else "core_attn mlp"
        args += ["--recompute-granularity selective", f"--recompute-modules {modules}"]
    elif target.split:  # the first layers keep their input, the others everything
        args += ["--recompute-granularity full", "--recompute-method block", f"--recompute-num-layers {target.count}"]
    elif target.recompute == "full":  # every layer keeps its input
        args += ["--recompute-granularity full", "--recompute-method uniform", "--recompute-num-layers 1"]
    if _precision(plan) == "mixed":
        args += ["--bf16"]
    return args


def _precision(plan: Plan | PipelinedPlan) -> str:
    return (plan.stages[0].plan if isinstance(plan, PipelinedPlan) else plan).model.precision


def megatron_script(target: ExportTarget, plan: Plan | PipelinedPlan) -> list[str]:
    """A bash fragment: the arguments as an array and the launch with ``torchrun``."""
    job, layout = plan.job, target.megatron
    per_node = job.mesh.shape[-1]
    notes = [f"# Megatron-LM: tensor parallelism {layout.tensor_parallel}"
             + (" with sequence parallelism" if layout.sequence_parallel else "")
             + f", data parallelism {layout.data_parallel}"
             + (" with the distributed optimizer" if layout.distributed_optimizer else "")
             + (", its collectives overlapped" if layout.overlap else "")
             + (", its TP communication overlapped with the GEMMs" if layout.tp_overlap else "") + ",",
             (f"# {layout.pipeline_parallel} pipeline stages of {plan.job.config.num_layers // layout.pipeline_parallel} layers "
              "under 1F1B (no virtual stages)" if layout.pipeline_parallel > 1 and layout.virtual_pipeline == 1 else
              f"# {layout.pipeline_parallel} pipeline ranks of {layout.virtual_pipeline} virtual stages of "
              f"{plan.job.config.num_layers // (layout.pipeline_parallel * layout.virtual_pipeline)} layers, "
              "interleaved 1F1B" if layout.pipeline_parallel > 1 else "# no pipeline")
             + ", Adam (Megatron-LM's default optimizer).",
             f"# Add your data, tokenizer (the vocabulary is {job.config.vocab:,} tokens; Megatron-LM pads it to a "
             "multiple of 128 × TP),",
             "# learning-rate schedule and checkpointing arguments."]
    if _precision(plan) == "mixed":
        notes += ["# memshard prices Megatron-LM's gradient buffer: with --bf16 it accumulates and reduces",
                  "# gradients in fp32 (4 bytes per parameter, all step)."]
    return [*notes,
            "MEGATRON_ARGS=(",
            *(f"    {a}" for a in megatron_arguments(target, plan)),
            ")",
            f"torchrun --nnodes {job.mesh.num_devices // per_node} --nproc-per-node {per_node} pretrain_gpt.py "
            "\"${MEGATRON_ARGS[@]}\""]
