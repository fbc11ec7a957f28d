"""Strategy names as one typed record: memshard's own plan (``memshard``) and each baseline
(``dp``, ``ddp-bucket-view``, ``zero3-fsdp``, ``fsdp2-noreshard``, ``megatron-tp4-dp2-sp-distopt``,
``megatron-tp8-pp8-dp16-sp-distopt``, ``fsdp2-pp4-noreshard``, ``torch-tp4-pp2-fsdp2`` (pipelined),
``tp4-fsdp2``, ``torch-tp4-fsdp2-torchtitan``…, with a recomputation such as ``+full``, ``+selective-op`` or ``+full-block12``).

This module owns the names' grammar. :func:`parse_strategy` reads a name once into a
:class:`StrategyName`, whose fields the other modules read; ``str`` writes it back
(``str(parse_strategy(s)) == s`` for every name memshard writes). A text that is not such a
name raises one MemshardError line.

A name is its kind's head (``HEADS``: ``zero<k>``, ``megatron-tp<T>``, ``tp<T>-fsdp``…), then
the parts its kind takes, in the order of ``PARTS`` (``-dp<D>``, ``-sp``, ``-noreshard``…,
then the recomputation ``+<policy>`` and its layers ``-block<N>``/``-every<N>``); a part of no
field is text its kind always writes (``torch-tp<T>``'s ``-fsdp``, after its pipeline degree). A
new part is a field with a default and a row of ``PARTS``; the readers of the other fields do
not change.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields, replace
from enum import Enum
from typing import Any

from memshard.core.errors import MemshardError


class Kind(str, Enum):
    """What a name is of: memshard's searched plan, or a baseline's recipe."""

    MEMSHARD = "memshard"  # memshard's own plan
    DP = "dp"  # data parallelism as memshard's runtime runs it
    DDP = "ddp"  # PyTorch's DistributedDataParallel
    ZERO = "zero"  # an idealised ZeRO stage (memshard's runtime)
    FSDP2 = "fsdp2"  # PyTorch's fully_shard
    MEGATRON = "megatron"  # Megatron-LM's tensor, sequence and data parallelism
    TP_FSDP = "tp-fsdp"  # torchtitan's 2D recipe, idealised (memshard's runtime)
    TORCH_TP = "torch-tp"  # PyTorch's parallelize_module × fully_shard


# Recomputation policies a name carries after ``+`` (``none``: no suffix): Megatron-LM's
# selective (core attention) and its MLP module alone or with the core attention, full,
# torchtitan's per-op selective checkpointing
RECOMPUTATIONS = ("none", "selective", "full", "selective-op", "selective-mlp",
                  "selective-attn-mlp")
BASELINES = tuple(k for k in Kind if k is not Kind.MEMSHARD)
NUMBER = r"[1-9][0-9]*"
FLOAT = r"[0-9]+(?:\.[0-9]+)?(?:e[+-][0-9]+)?"  # a float as Python's ``g`` format writes it


@dataclass(frozen=True)
class Head:
    """How a kind's names begin: ``text`` with ``{}`` where its ``field``'s value goes."""

    text: str
    field: str = ""

    @property
    def hint(self) -> str:
        return self.text.replace("{}", "<N>")


HEADS = {
    Kind.MEMSHARD: Head("memshard"),
    Kind.DP: Head("dp"),
    Kind.DDP: Head("ddp"),
    Kind.ZERO: Head("zero{}", "zero_stage"),
    Kind.FSDP2: Head("fsdp2"),
    Kind.MEGATRON: Head("megatron-tp{}", "tensor_parallel"),
    Kind.TP_FSDP: Head("tp{}-fsdp", "tensor_parallel"),
    Kind.TORCH_TP: Head("torch-tp{}", "tensor_parallel"),  # then its pipeline, then ``-fsdp``
}


@dataclass(frozen=True)
class Part:
    """One optional part of a name after its head: ``text``, with ``{}`` where the ``field``'s
    value goes (``value``: its pattern, ``read``: its type, ``spec``: its format), or without
    (a flag: present where the field is ``flag``); the kinds whose names take it. A part of
    no field is text every name of its kinds writes there (``literal``)."""

    field: str
    text: str
    kinds: tuple[Kind, ...]
    value: str = NUMBER
    read: type = int
    spec: str = ""
    flag: Any = True

    @property
    def literal(self) -> bool:
        return not self.field

    @property
    def pattern(self) -> str:
        before, brace, after = self.text.partition("{}")
        return re.escape(before) + (f"({self.value})" + re.escape(after) if brace else "")

    def written(self, value: Any, default: Any) -> str:
        """The part as a name with the field at ``value`` writes it ("" where it does not)."""
        if "{}" not in self.text:
            shown = value == self.flag and isinstance(value, bool) == isinstance(self.flag, bool)
            return self.text if shown else ""
        if value == default or value is None or isinstance(value, bool):
            return ""
        return self.text.replace("{}", format(value, self.spec))

    @property
    def hint(self) -> str:
        """The part as an error message shows it."""
        placeholder = {NUMBER: "<N>", FLOAT: "<x>"}.get(self.value, f"<{self.field}>")
        return self.text.replace("{}", placeholder).strip() if not self.literal else self.text

    def value_of(self, match: re.Match) -> Any:
        return self.flag if "{}" not in self.text else self.read(match.group(1))


# In the order a name writes them; two parts of one field write its different values.
PARTS = (
    Part("time_slack", " ≤{}× fastest", (Kind.MEMSHARD,), FLOAT, float, "g"),
    Part("fastest", " fastest", (Kind.MEMSHARD,)),
    Part("pipeline_parallel", "-pp{}", (Kind.MEGATRON, Kind.FSDP2, Kind.TORCH_TP)),
    Part("virtual_pipeline", "-vpp{}", (Kind.MEGATRON,)),
    Part("", "-fsdp", (Kind.TORCH_TP,)),  # torch-tp<T>[-pp<P>]-fsdp[<D>]
    Part("data_parallel", "-dp{}", (Kind.MEGATRON,)),
    Part("data_parallel", "{}", (Kind.TP_FSDP, Kind.TORCH_TP)),
    Part("zero_stage", "-fsdp", (Kind.ZERO,), flag=3),  # ZeRO-3, FSDP's full shard, is zero3-fsdp
    Part("sequence_parallel", "-sp", (Kind.MEGATRON,)),
    Part("distributed_optimizer", "-distopt", (Kind.MEGATRON,)),
    Part("overlap", "-overlap", (Kind.MEGATRON,)),
    Part("tp_overlap", "-tpoverlap", (Kind.MEGATRON,)),
    Part("bucket_view", "-bucket-view", (Kind.DDP,)),
    Part("reshard_after_forward", "-noreshard", (Kind.FSDP2, Kind.TORCH_TP), flag=False),
    Part("reshard_after_forward", "-reshard{}", (Kind.FSDP2,)),
    Part("prefetch", "-prefetch{}", (Kind.FSDP2,)),
    Part("torchtitan_units", "-torchtitan", (Kind.FSDP2, Kind.TORCH_TP)),
    Part("recompute", "+{}", BASELINES, "|".join(sorted(RECOMPUTATIONS[1:], key=len, reverse=True)),
         str),
    Part("block", "-block{}", BASELINES),
    Part("every", "-every{}", BASELINES),
)


@dataclass(frozen=True)
class StrategyName:
    """A strategy's name, field by field (each field's default: not in the name).

    ``tensor_parallel``: ``tp<T>`` (Megatron-LM's, and the TP × FSDP recipes', which also split
    the sequence); ``pipeline_parallel``: Megatron-LM's ``-pp<P>``
    (``--pipeline-model-parallel-size``), torchtitan's (``fsdp2-pp<P>``, ``torch-tp<T>-pp<P>-fsdp<D>``:
    ``pipeline_parallel_degree``, each stage under torch.distributed.pipelining): P stages along
    the outermost mesh axis, the rest of the name each stage's recipe; 1: no pipeline;
    ``virtual_pipeline``: Megatron-LM's ``-vpp<V>``, V stages per pipeline rank, interleaved
    (``--num-layers-per-virtual-pipeline-stage`` L/(P·V)); a
    pipelined ``fully_shard`` takes no ``-prefetch<N>`` or ``-reshard<N>``); ``data_parallel``: ``-dp<D>`` (Megatron-LM's,
    within a stage; None: 1) or ``-fsdp<D>`` (TP ×
    FSDP's), None where the name leaves it out (``fitting.family``: the recipe on any number of
    devices); ``zero_stage``: ``zero<k>``; ``sequence_parallel``, ``distributed_optimizer``:
    Megatron-LM's ``-sp``, ``-distopt`` (``--use-distributed-optimizer``); ``overlap``: its
    ``-overlap`` (``--overlap-grad-reduce --overlap-param-gather``); ``tp_overlap``: its
    ``-tpoverlap`` (``--tp-comm-overlap``, with ``-sp`` only); ``bucket_view``: DDP's
    ``gradient_as_bucket_view=True``; ``reshard_after_forward``: ``fully_shard``'s, False
    (``-noreshard``) or a group of devices (``-reshard<N>``); ``prefetch``: the blocks each
    ``fully_shard`` prefetches explicitly each way; ``torchtitan_units``: the embedding and the
    output layers wrapped as torchtitan does; ``time_slack``: memshard's plan within that × the
    fastest baseline's step time (``memshard ≤1.1× fastest``); ``fastest``: memshard's
    fastest plan within the device memory (``memshard fastest``); ``recompute``: the policy
    (``RECOMPUTATIONS``); ``block``/``every``: full recomputation of the first N layers
    (Megatron-LM's block method) or of every N-th (torchtitan's)."""

    kind: Kind
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    virtual_pipeline: int = 1
    data_parallel: int | None = None
    zero_stage: int = 0
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    overlap: bool = False
    tp_overlap: bool = False
    bucket_view: bool = False
    reshard_after_forward: bool | int = True
    prefetch: int = 0
    torchtitan_units: bool = False
    time_slack: float | None = None
    fastest: bool = False
    recompute: str = "none"
    block: int = 0
    every: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.kind, Kind):
            known = [k.value for k in Kind]
            if self.kind not in known:
                raise MemshardError(f"unknown strategy kind {self.kind!r}; "
                                    f"known: {', '.join(known)}")
            object.__setattr__(self, "kind", Kind(self.kind))
        why = self.flaw()
        if why:
            raise MemshardError(why)

    def flaw(self) -> str:
        """Why these fields name no strategy ("" where they do)."""
        head = HEADS[self.kind]
        taken = {head.field} | {p.field for p in PARTS if self.kind in p.kinds}
        extra = [f.name for f in fields(self)[1:]
                 if f.name not in taken and getattr(self, f.name) != f.default]
        if extra:
            return f"{self.kind.value} strategies have no {' or '.join(extra)}"
        least = {"tensor_parallel": 1, "pipeline_parallel": 1, "virtual_pipeline": 1, "data_parallel": 1,
                 "prefetch": 0, "block": 0, "every": 0}
        for field, low in least.items():
            value = getattr(self, field)
            if not (value is None and field == "data_parallel") and not whole(value, low):
                return f"{field} is a whole number of at least {low}, not {value!r}"
        if self.kind is Kind.ZERO and self.zero_stage not in (1, 2, 3):
            return f"ZeRO's stages are 1, 2 and 3, not {self.zero_stage!r}"
        reshard, slack = self.reshard_after_forward, self.time_slack
        if not (isinstance(reshard, bool) or whole(reshard, 2)):
            return ("reshard_after_forward is True, False or a group of at least 2 devices, "
                    f"not {reshard!r}")
        if slack is not None and not (isinstance(slack, (int, float)) and 0 < slack < math.inf):
            return f"a time slack is a positive number, not {slack!r}"
        if self.recompute not in RECOMPUTATIONS:
            return f"unknown recomputation {self.recompute!r}; known: {', '.join(RECOMPUTATIONS)}"
        if self.fastest and slack is not None:
            return "memshard's plan is the fastest or the least memory within a time slack, not both"
        if self.overlap and not self.distributed_optimizer:
            return "Megatron-LM overlaps its weight gathers with the distributed optimizer: -distopt-overlap"
        if self.tp_overlap and not self.sequence_parallel:
            return "Megatron-LM overlaps its TP communication with the GEMMs under sequence parallelism: -sp…-tpoverlap"
        if self.pipeline_parallel > 1 and (self.prefetch or not isinstance(reshard, bool)):
            return ("a pipelined fully_shard keeps its weights gathered from its first backward to the step's last "
                    "(torch's PipelineStage): it takes no -prefetch<N> or -reshard<N>")
        if self.virtual_pipeline > 1 and self.pipeline_parallel == 1:
            return "an interleaved pipeline (-vpp<V>) needs a pipeline (-pp<P>, P ≥ 2)"
        if (self.block or self.every) and (self.recompute != "full" or (self.block and self.every)):
            return ("some layers are recomputed in full as +full-block<N> or +full-every<N>, "
                    "one of them")
        return ""

    def __str__(self) -> str:
        head = HEADS[self.kind]
        text = head.text.replace("{}", str(getattr(self, head.field))) if head.field else head.text
        defaults = {f.name: f.default for f in fields(self)}
        return text + "".join(p.text if p.literal else p.written(getattr(self, p.field), defaults[p.field])
                              for p in PARTS if self.kind in p.kinds)

    @property
    def plain(self) -> StrategyName:
        """The same strategy without recomputation."""
        return replace(self, recompute="none", block=0, every=0)

    @property
    def stage_recipe(self) -> StrategyName:
        """What each pipeline stage runs: the same strategy without its pipeline degree."""
        return replace(self, pipeline_parallel=1, virtual_pipeline=1)


def whole(value: Any, least: int) -> bool:
    """Whether ``value`` is an int (not a bool) of at least ``least``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def head_pattern(kind: Kind) -> str:
    """How the names of ``kind`` begin: its head, its number where it has one."""
    head = HEADS[kind]
    before, _, after = head.text.partition("{}")
    return re.escape(before) + (f"({NUMBER})" + re.escape(after) if head.field else "")


def grammar(kind: Kind) -> re.Pattern:
    """The names of ``kind``: its head, then each part it takes, in order, each optional but
    the literal ones."""
    pattern = head_pattern(kind)
    parts = "".join(f"(?P<p{i}>{p.pattern})" + ("" if p.literal else "?")
                    for i, p in enumerate(PARTS) if kind in p.kinds)
    return re.compile(pattern + parts)


GRAMMARS = {kind: grammar(kind) for kind in Kind}
STARTS = ", ".join(h.hint for h in HEADS.values())


def parse_strategy(text: str) -> StrategyName:
    """The record of the strategy name ``text``; a MemshardError line where it is none."""
    if not isinstance(text, str):
        raise MemshardError(f"a strategy name is text, got {text!r}")
    found = next(((k, m) for k, g in GRAMMARS.items() if (m := g.fullmatch(text))), None)
    if found is None:
        started = [k for k in GRAMMARS if re.match(head_pattern(k), text)]
        if not started:
            raise MemshardError(f"unknown strategy {text!r}: a strategy name starts {STARTS}")
        kind = started[-1]
        takes = ", ".join(p.hint for p in PARTS if kind in p.kinds)
        written = "".join(f" but {p.text}" for p in PARTS if kind in p.kinds and p.literal)
        raise MemshardError(f"unknown strategy {text!r}: after {HEADS[kind].hint} a name takes "
                            f"{takes}, each optional{written}, in that order")
    kind, match = found
    values: dict[str, Any] = {}
    head = HEADS[kind]
    if head.field:
        values[head.field] = int(match.group(1))
    for i, part in enumerate(PARTS):
        written = match.groupdict().get(f"p{i}")
        if written is not None and not part.literal:
            values.setdefault(part.field, part.value_of(re.fullmatch(part.pattern, written)))
    try:
        name = StrategyName(kind, **values)
    except MemshardError as e:
        raise MemshardError(f"unknown strategy {text!r}: {e}") from None
    if str(name) != text:
        raise MemshardError(f"unknown strategy {text!r}: memshard writes it {str(name)!r}")
    return name
