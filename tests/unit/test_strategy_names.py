"""Strategy names (``baselines/names.py``): every name memshard writes reads back as the
same text, every record writes a name that reads back as the same record, and a text that is
not a name is one MemshardError line (on the command line, one ``memshard: error:`` line)."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memshard.baselines.names import BASELINES, RECOMPUTATIONS, Kind, StrategyName, parse_strategy
from memshard.baselines.recipes import baselines, layer_split
from memshard.cli import main
from memshard.core.errors import MemshardError
from memshard.fitting import family
from memshard.job import Job
from memshard.problem.pricing import build_problem

# (model, mesh, recomputation, model options): a few jobs whose baselines cover every recipe
JOBS = [("tiny-gpt", "2x4", "auto", {}), ("tiny-llama", "2x2x4", "auto", {"num_layers": 4}),
        ("tiny-gpt", "8", "none", {}), ("tiny-llama", "3x6", "full", {}),
        ("tiny-gpt", "2x2", "selective", {})]


def baseline_names(model: str, mesh: str, recompute: str, overrides: dict) -> list[str]:
    """Every name ``baselines`` offers the job, without building a plan: ``wanted`` sees each
    name (the layer splits' too, under ``auto``) and accepts none."""
    job = Job(model, mesh, overrides=overrides)
    problem = build_problem(job.graph, job.mesh, micro_batches=job.micro_batches,
                            recompute=recompute)
    seen: list[str] = []
    found, _ = baselines(problem, lambda name: seen.append(name) or False)
    assert found == []
    return seen


@pytest.fixture(scope="module")
def written() -> list[str]:
    names = [name for job in JOBS for name in baseline_names(*job)]
    return ["memshard", str(StrategyName(Kind.MEMSHARD, time_slack=1.1)), *names]


def test_every_name_memshard_writes_reads_back_as_itself(written):
    assert len(written) > 300 and "memshard ≤1.1× fastest" in written
    for text in written:
        name = parse_strategy(text)
        assert str(name) == text
        assert str(name.plain) == text.partition("+")[0]
        assert parse_strategy(family(text)) == replace(name, data_parallel=None)
    kinds = {parse_strategy(text).kind for text in written}
    assert kinds == set(Kind)
    policies = {parse_strategy(text).recompute for text in written}
    assert policies == set(RECOMPUTATIONS)
    assert {"megatron-tp2-dp8-sp-distopt+full-block1", "torch-tp4-fsdp4-torchtitan+full-every2",
            "megatron-tp2-dp4-sp-distopt-overlap+selective", "megatron-tp1-dp16-distopt-overlap",
            "zero3-fsdp", "fsdp2-reshard4+selective-op", "ddp-bucket-view+selective-op",
            "torch-tp6-fsdp3-noreshard+full", "fsdp2-prefetch2"} <= set(written)


def test_the_fields_say_what_the_text_does():
    name = parse_strategy("megatron-tp4-dp2-sp-distopt+full-block12")
    assert name == StrategyName(Kind.MEGATRON, tensor_parallel=4, data_parallel=2,
                                sequence_parallel=True, distributed_optimizer=True,
                                recompute="full", block=12)
    assert parse_strategy("torch-tp4-fsdp2-noreshard+selective") == StrategyName(
        Kind.TORCH_TP, tensor_parallel=4, data_parallel=2, reshard_after_forward=False,
        recompute="selective")
    assert parse_strategy("fsdp2-reshard8").reshard_after_forward == 8
    assert parse_strategy("megatron-tp1-dp8-distopt-overlap") == StrategyName(
        Kind.MEGATRON, tensor_parallel=1, data_parallel=8, distributed_optimizer=True, overlap=True)
    assert parse_strategy("zero3-fsdp").zero_stage == 3 and parse_strategy("zero1").zero_stage == 1
    assert parse_strategy("tp8-fsdp") == StrategyName(Kind.TP_FSDP, tensor_parallel=8)
    assert parse_strategy("memshard ≤1.5× fastest").time_slack == 1.5
    assert parse_strategy("memshard fastest") == StrategyName(Kind.MEMSHARD, fastest=True)
    assert layer_split(parse_strategy("megatron-tp2-sp")).method == "block"
    assert layer_split(parse_strategy("fsdp2-noreshard")).method == "every"
    assert layer_split(parse_strategy("zero3-fsdp")) is None


DEGREE = st.integers(1, 4096)


@st.composite
def records(draw) -> StrategyName:
    """Any record that names a strategy, drawn field by field as each kind takes them."""
    kind = draw(st.sampled_from(Kind))
    fields: dict = {}
    if kind in (Kind.MEGATRON, Kind.TP_FSDP, Kind.TORCH_TP):
        fields |= {"tensor_parallel": draw(DEGREE), "data_parallel": draw(st.none() | DEGREE)}
    if kind is Kind.ZERO:
        fields["zero_stage"] = draw(st.integers(1, 3))
    if kind in (Kind.MEGATRON, Kind.FSDP2, Kind.TORCH_TP):
        fields["pipeline_parallel"] = draw(DEGREE)
    if kind is Kind.MEGATRON:
        fields |= {"sequence_parallel": draw(st.booleans()),
                   "distributed_optimizer": draw(st.booleans())}
    if kind is Kind.DDP:
        fields["bucket_view"] = draw(st.booleans())
    if kind in (Kind.FSDP2, Kind.TORCH_TP):
        # (a pipelined fully_shard is resharded after forward or not, its prefetching torch's)
        flat = kind is Kind.FSDP2 and fields["pipeline_parallel"] == 1
        groups = st.integers(2, 1024) if flat else st.nothing()
        fields |= {"reshard_after_forward": draw(st.booleans() | groups),
                   "torchtitan_units": draw(st.booleans())}
        if flat:
            fields["prefetch"] = draw(st.integers(0, 16))
    if kind is Kind.MEMSHARD:  # as the ``g`` format writes it
        fields["time_slack"] = draw(st.none() | st.floats(1, 1e6).map(lambda x: float(f"{x:g}")))
        fields["fastest"] = fields["time_slack"] is None and draw(st.booleans())
    if kind in BASELINES:
        fields["recompute"] = draw(st.sampled_from(RECOMPUTATIONS))
        if fields["recompute"] == "full":
            fields |= draw(st.sampled_from([{}, {"block": draw(DEGREE)}, {"every": draw(DEGREE)}]))
    return StrategyName(kind, **fields)


@settings(max_examples=300, deadline=None)
@given(records())
def test_every_record_writes_a_name_that_reads_back_as_it(name):
    text = str(name)
    assert parse_strategy(text) == name
    assert str(parse_strategy(text)) == text


# the characters of names, and a few others
NAME_TEXT = st.text(alphabet="abdefilmnoprstvwxz0123456789-+ ≤×.", max_size=40)


@settings(max_examples=300, deadline=None)
@given(st.one_of(NAME_TEXT, records().map(str).flatmap(
    lambda text: st.integers(0, len(text)).map(lambda k: text[:k] + text[k + 1:]))))
def test_a_text_is_a_name_memshard_writes_or_one_error(text):
    try:
        name = parse_strategy(text)
    except MemshardError as e:
        assert "\n" not in str(e) and str(e).startswith("unknown strategy ")
    else:
        assert str(name) == text


@pytest.mark.parametrize("text, why", [
    ("", "a strategy name starts memshard, dp, ddp"),
    ("nonsense", "a strategy name starts"),
    ("FSDP2", "a strategy name starts"),
    (" fsdp2", "a strategy name starts"),
    ("zero3", "memshard writes it 'zero3-fsdp'"),
    ("zero1-fsdp", "memshard writes it 'zero1'"),
    ("zero4", "ZeRO's stages are 1, 2 and 3"),
    ("megatron-tp0", "a strategy name starts"),
    ("megatron-tp04-sp", "a strategy name starts"),
    ("megatron-tp4-dp02", "after megatron-tp<N> a name takes -pp<N>, -vpp<N>, -dp<N>, -sp, -distopt"),
    ("megatron-tp4-sp-dp2", "each optional, in that order"),
    ("megatron-tp4-dp2-pp2", "after megatron-tp<N> a name takes -pp<N>, -vpp<N>, -dp<N>, -sp"),
    ("megatron-tp4-pp1-dp2", "memshard writes it 'megatron-tp4-dp2'"),
    ("megatron-tp4-pp0-dp2", "after megatron-tp<N>"),
    ("fsdp2-noreshard-pp2", "after fsdp2 a name takes -pp<N>, -noreshard"),
    ("fsdp2-pp1", "memshard writes it 'fsdp2'"),
    ("fsdp2-pp2-prefetch2", "it takes no -prefetch<N> or -reshard<N>"),
    ("fsdp2-pp2-reshard4", "it takes no -prefetch<N> or -reshard<N>"),
    ("tp4-pp2-fsdp2", "a strategy name starts"),
    ("torch-tp4", "after torch-tp<N> a name takes -pp<N>, -fsdp, <N>, -noreshard, -torchtitan, "
                  "+<recompute>, -block<N>, -every<N>, each optional but -fsdp, in that order"),
    ("torch-tp4-fsdp2-pp2", "each optional but -fsdp"),
    ("torch-tp4-pp2", "each optional but -fsdp"),
    ("torch-tp4-fsdp-fsdp2", "each optional but -fsdp"),
    ("fsdp2-foo", "after fsdp2 a name takes -pp<N>, -noreshard, -reshard<N>, -prefetch<N>, -torchtitan, "
                  "+<recompute>, -block<N>, -every<N>, each optional, in that order"),
    ("fsdp2+full-block0", "after fsdp2"),
    ("fsdp2+full-every2x", "after fsdp2"),
    ("fsdp2+full+full", "after fsdp2"),
    ("fsdp2-block2", "+full-block<N> or +full-every<N>"),
    ("fsdp2+selective-every2", "+full-block<N> or +full-every<N>"),
    ("fsdp2+full-block2-every2", "one of them"),
    ("fsdp2-reshard1", "a group of at least 2 devices"),
    ("fsdp2-noreshard-reshard4", "memshard writes it 'fsdp2-noreshard'"),
    ("dp-sp", "after dp a name takes +<recompute>"),
    ("memshard+full", "after memshard a name takes ≤<x>× fastest"),
    ("memshard ≤1.10× fastest", "memshard writes it 'memshard ≤1.1× fastest'"),
    ("tp4-fsdp02", "after tp<N>-fsdp"),
])
def test_a_text_that_is_no_name_is_one_error_saying_why(text, why):
    with pytest.raises(MemshardError) as raised:
        parse_strategy(text)
    message = str(raised.value)
    assert message.startswith(f"unknown strategy {text!r}: ")
    assert why in message and "\n" not in message


@pytest.mark.parametrize("value", [None, 4, ("fsdp2",)])
def test_a_name_is_text(value):
    with pytest.raises(MemshardError, match="a strategy name is text"):
        parse_strategy(value)


@pytest.mark.parametrize("fields, why", [
    ({"kind": "fsdp3"}, "unknown strategy kind 'fsdp3'"),
    ({"kind": Kind.DP, "tensor_parallel": 2}, "dp strategies have no tensor_parallel"),
    ({"kind": Kind.MEMSHARD, "recompute": "full"}, "memshard strategies have no recompute"),
    ({"kind": Kind.FSDP2, "sequence_parallel": True}, "fsdp2 strategies have no sequence_parallel"),
    ({"kind": Kind.ZERO}, "ZeRO's stages are 1, 2 and 3, not 0"),
    ({"kind": Kind.MEGATRON, "tensor_parallel": 0}, "tensor_parallel is a whole number"),
    ({"kind": Kind.MEGATRON, "data_parallel": True}, "data_parallel is a whole number"),
    ({"kind": Kind.FSDP2, "prefetch": -1}, "prefetch is a whole number of at least 0"),
    ({"kind": Kind.FSDP2, "reshard_after_forward": 1}, "a group of at least 2 devices"),
    ({"kind": Kind.FSDP2, "recompute": "most"}, "unknown recomputation 'most'"),
    ({"kind": Kind.FSDP2, "recompute": "full", "block": 2, "every": 2}, "one of them"),
    ({"kind": Kind.MEMSHARD, "time_slack": float("inf")}, "a time slack is a positive number"),
    ({"kind": Kind.MEGATRON, "overlap": True}, "with the distributed optimizer: -distopt-overlap"),
    ({"kind": Kind.MEMSHARD, "fastest": True, "time_slack": 1.1}, "not both"),
    ({"kind": Kind.FSDP2, "fastest": True}, "fsdp2 strategies have no fastest"),
    ({"kind": Kind.MEGATRON, "pipeline_parallel": 0}, "pipeline_parallel is a whole number of at least 1"),
    ({"kind": Kind.FSDP2, "pipeline_parallel": 2, "prefetch": 2}, "takes no -prefetch<N> or -reshard<N>"),
    ({"kind": Kind.FSDP2, "pipeline_parallel": 2, "reshard_after_forward": 8}, "takes no -prefetch<N>"),
    ({"kind": Kind.TP_FSDP, "pipeline_parallel": 2}, "tp-fsdp strategies have no pipeline_parallel"),
    ({"kind": Kind.DDP, "pipeline_parallel": 2}, "ddp strategies have no pipeline_parallel"),
    ({"kind": Kind.FSDP2, "overlap": True}, "fsdp2 strategies have no overlap"),
])
def test_a_record_that_names_no_strategy_is_refused(fields, why):
    with pytest.raises(MemshardError, match=re.escape(why)):
        StrategyName(**fields)


def test_a_pipeline_degree_is_a_field_and_the_rest_is_each_stages_recipe():
    text = "megatron-tp8-pp8-dp16-sp-distopt+selective"
    name = parse_strategy(text)
    assert name == StrategyName(Kind.MEGATRON, tensor_parallel=8, pipeline_parallel=8,
                                data_parallel=16, sequence_parallel=True,
                                distributed_optimizer=True, recompute="selective")
    assert str(name) == text
    assert str(name.stage_recipe) == "megatron-tp8-dp16-sp-distopt+selective"
    assert parse_strategy("megatron-tp2-dp4").pipeline_parallel == 1  # absent: no pipeline
    assert str(parse_strategy("megatron-tp1-pp4-distopt-overlap+full-block3").plain) == (
        "megatron-tp1-pp4-distopt-overlap")
    assert family("megatron-tp2-pp2-dp2-sp") == "megatron-tp2-pp2-sp"


def test_torchtitans_pipelines_are_named_as_their_stages_recipe_with_a_degree():
    name = parse_strategy("torch-tp4-pp2-fsdp8-noreshard-torchtitan+full-every2")
    assert name == StrategyName(Kind.TORCH_TP, tensor_parallel=4, pipeline_parallel=2, data_parallel=8,
                                reshard_after_forward=False, torchtitan_units=True, recompute="full", every=2)
    assert str(name.stage_recipe) == "torch-tp4-fsdp8-noreshard-torchtitan+full-every2"
    assert parse_strategy("fsdp2-pp4-noreshard") == StrategyName(Kind.FSDP2, pipeline_parallel=4,
                                                                 reshard_after_forward=False)
    assert str(parse_strategy("fsdp2-pp4+selective-op").stage_recipe) == "fsdp2+selective-op"
    assert family("torch-tp2-pp2-fsdp4") == "torch-tp2-pp2-fsdp"
    assert parse_strategy("torch-tp2-fsdp").data_parallel is None


def test_a_kind_may_be_given_as_its_text():
    assert StrategyName("fsdp2", prefetch=2) == parse_strategy("fsdp2-prefetch2")


@pytest.mark.parametrize("text", ["fsdp2+full-every2x", "zero3", "megatron-tp4-sp-dp2"])
def test_the_command_line_says_a_bad_name_in_one_error_line(tmp_path, capsys, text):
    assert main(["export", "--model", "tiny-gpt", "--mesh", "4", "--strategy", text,
                 "--out", str(tmp_path / "x.py")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith(f"memshard: error: {text} cannot be exported: "
                          f"unknown strategy {text!r}: ")
    assert not (tmp_path / "x.py").exists()


def test_a_pipelined_megatron_name_exports_its_pipeline_degree():
    from memshard.plans.export import export_target

    assert export_target("megatron-tp2-pp2-dp2").megatron.pipeline_parallel == 2
    assert export_target("megatron-tp2-dp2").megatron.pipeline_parallel == 1
