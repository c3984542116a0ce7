"""Plans are data (versioned JSON, never pickle) and explain themselves; limits parse strictly."""

import dataclasses
import json
import os
import warnings

import pytest
import torch
from support import sample_plan

import tapesac_core
from tapesac_core.config import MemoryLimit, TapeSACConfig, parse_memory_limit
from tapesac_core.plan.coords import Anchor, Coord
from tapesac_core.plan.plan import PLAN_VERSION, BlockKind, Plan, RegionPlan, Saved
from tapesac_core.units import GiB, MiB


def test_plan_json_round_trip() -> None:
    plan = sample_plan()
    text = plan.to_json()
    assert json.loads(text)["version"] == PLAN_VERSION == 6
    assert json.loads(text)["model"] == ["DecoderLayer"]  # a list, never text split back
    assert Plan.from_json(text, model=("DecoderLayer",), regions={"DecoderLayer": "abc-90"}) == plan
    assert plan.coordinates() == {
        "DecoderLayer": [frozenset(), frozenset({("aten.mm.default", 0, 0)})]
    }
    assert plan.budgets() == {"DecoderLayer": [0, 3 * MiB]}


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(model=("OtherLayer",)), "comes from another model"),
        (dict(regions={"DecoderLayer": "def-91"}), "op sequence changed"),
        (dict(regions={"DecoderLayer": "abc-90", "MoE": "x"}), "region set"),
    ],
)
def test_a_plan_from_another_model_or_region_set_is_refused(change, match) -> None:
    kwargs = dict(model=("DecoderLayer",), regions={"DecoderLayer": "abc-90"}) | change
    with pytest.raises(ValueError, match=match):
        Plan.from_json(sample_plan().to_json(), **kwargs)


def test_a_plan_from_another_version_is_refused() -> None:
    data = json.loads(sample_plan().to_json())
    data["version"] = 99
    with pytest.raises(ValueError, match="version 99.*Solve the plan again"):
        Plan.from_json(json.dumps(data))


def test_explain_is_a_table_with_bytes_time_and_speedups() -> None:
    text = sample_plan().explain()
    assert "predicted speedup 1.080x vs must-only, 1.210x vs full recomputation" in text
    assert "capacity 20.00 GiB, must-only peak 12.00 GiB, saves 3.00 MiB more" in text
    assert "values saved per block: [0, 1]" in text
    assert "aten.mm.default #0 out 0" in text and "self_attn.q_proj" in text
    assert "3.00 MiB" in text and "2.100 ms" in text
    assert text.startswith("TapeSAC plan for up to 4096 (DecoderLayer) tokens:")


def test_explain_keeps_columns_aligned_and_shows_an_ops_time_once() -> None:
    long_op = "aten._scaled_dot_product_flash_attention_for_cpu.default"
    saved = (
        Saved(coord=(long_op, 0, 0), module="self_attn", bytes=100 * 1024, time_removed=0.0012),
        Saved(coord=(long_op, 0, 1), module="self_attn", bytes=6 * 1024, time_removed=0.0012),
        Saved(
            coord=("aten.mm.default", 3, 0),
            module="mlp.very_long_module_name.down_proj",
            bytes=MiB,
            time_removed=0.0004,
        ),
    )
    region = RegionPlan(sequence="s", tokens=512, saved=saved, blocks=(frozenset(),))
    plan = Plan(
        model=("m",),
        regions={"DecoderLayer": region},
        capacity=GiB,
        base=MiB,
        saved_bytes=MiB,
        predicted_speedup=1.0,
        predicted_speedup_vs_full=1.0,
    )
    table = [line for line in plan.explain().splitlines() if line.startswith("  ")]
    assert len(table) == 4 and len({len(line) for line in table}) == 1
    assert [line.split()[-1] for line in table] == ["removed", "ms", "op)", "ms"]
    assert table[1].count("1.200 ms") == 1 and "(same op)" in table[2]


@pytest.mark.parametrize(
    "value, expected",
    [
        (0.9, MemoryLimit(fraction=0.9)),
        (0.0, MemoryLimit(fraction=0.0)),
        (1.0, MemoryLimit(fraction=1.0)),
        ("20GiB", MemoryLimit(bytes=20 * GiB)),
        ("800MB", MemoryLimit(bytes=800_000_000)),
        (" 1.5 TiB", MemoryLimit(bytes=int(1.5 * 2**40))),
        (MiB, MemoryLimit(bytes=MiB)),
    ],
)
def test_memory_limits_parse(value, expected) -> None:
    assert parse_memory_limit(value) == expected


@pytest.mark.parametrize(
    "value, error, match",
    [
        (1.5, ValueError, r"must lie in \[0, 1\]"),
        (-0.1, ValueError, r"must lie in \[0, 1\]"),
        (1, ValueError, "at least 1 MiB"),
        (MiB - 1, ValueError, "at least 1 MiB"),
        ("lots", ValueError, "cannot read memory_limit 'lots'"),
        ("20 parsecs", ValueError, "cannot read"),
        (True, TypeError, "memory_limit"),
        ([1], TypeError, "memory_limit"),
    ],
)
def test_bad_memory_limits_name_the_fix(value, error, match) -> None:
    with pytest.raises(error, match=match):
        parse_memory_limit(value)


def test_config_is_frozen_and_validated() -> None:
    config = TapeSACConfig(memory_limit="8GiB")
    assert config.memory_limit == MemoryLimit(bytes=8 * GiB)
    with pytest.raises(AttributeError):
        config.margin = 0.5  # type: ignore[misc]
    with pytest.raises(ValueError, match="bucket factors must be > 1"):
        TapeSACConfig(memory_limit=0.9, primary_bucket_factor=1.0)
    with pytest.raises(TypeError):
        TapeSACConfig(0.9)  # type: ignore[misc]


def test_a_version_1_plan_still_reads_for_reports_and_explain_names_the_peak() -> None:
    data = json.loads(sample_plan().to_json())
    for key in ("memory_model", "predicted_peak", "peak_at", "static"):
        del data[key]
    old = Plan.from_json(json.dumps({**data, "version": 1}))
    assert old.version == 1 and old.memory_model == "sum" and old.predicted_peak == 0
    assert "predicted step peak" not in old.explain()
    plan = Plan(
        **{
            **vars(sample_plan()),
            "memory_model": "peak",
            "predicted_peak": 13 * GiB,
            "peak_at": "backward window of layers.3",
            "static": 10 * GiB,
        }
    )
    assert Plan.from_json(plan.to_json()) == plan
    assert (
        "predicted step peak 13.00 GiB (peak-aware timeline model), at backward window of layers.3"
    ) in plan.explain()
    # At a step of half the plan's tokens whose must-only peak is 11 GiB (the plan's is 12): that
    # peak plus half the 1 GiB the plan adds to it.
    assert plan.peak_at_tokens(11 * GiB, 0.5) == int(11.5 * GiB)


# Plan.to_json() of the plan below, written by the code at commit 27189ec (before Coord and
# Anchor were NamedTuples): plan files already on disk must keep loading, and mean the same.
PLAN_27189EC = (
    '{"base": 12884901888, "capacity": 21474836480, "memory_model": "peak", '
    '"model": "DecoderLayer", "notes": ["a note"], "peak_at": "backward window of layers.3", '
    '"predicted_peak": 13958643712, "predicted_speedup": 1.08, '
    '"predicted_speedup_vs_full": 1.21, "regions": {"DecoderLayer": {"anchors": [[], '
    '[["mlp.down_proj", "aten.mm.default", 0, 0], ["self_attn", '
    '"aten._scaled_dot_product_flash_attention_for_cpu.default", 0, 1], ["self_attn.q_proj", '
    '"aten.mm.default", 0, 0]]], "block_bytes": [0, 7340032], "blocks": [[], '
    '[["aten._scaled_dot_product_flash_attention_for_cpu.default", 0, 1], '
    '["aten.mm.default", 0, 0], ["aten.mm.default", 12, 0]]], '
    '"modules": {"mlp.down_proj": "5e6f7a8b-2", "self_attn": "0badcafe-9", '
    '"self_attn.q_proj": "1a2b3c4d-3"}, "note": "", "saved": [{"bytes": 4096, '
    '"coord": ["aten._scaled_dot_product_flash_attention_for_cpu.default", 0, 1], '
    '"module": "self_attn", "time_removed": 0.0}, {"bytes": 3145728, '
    '"coord": ["aten.mm.default", 0, 0], "module": "self_attn.q_proj", '
    '"time_removed": 0.0021}, {"bytes": 4194304, "coord": ["aten.mm.default", 12, 0], '
    '"module": "mlp.down_proj", "time_removed": 0.00125}], "sequence": "abc-90", '
    '"tokens": 4096}}, "replay_time": 0.03, "saved_bytes": 7340032, "static": 10737418240, '
    '"step_time": 0.25, "version": 2}'
)


def test_a_plan_file_written_before_coord_was_a_type_loads_equal_and_writes_the_same() -> None:
    mm, sdpa = "aten.mm.default", "aten._scaled_dot_product_flash_attention_for_cpu.default"
    saved = (
        Saved(coord=Coord(sdpa, 0, 1), module="self_attn", bytes=4096, time_removed=0.0),
        Saved(coord=Coord(mm, 0, 0), module="self_attn.q_proj", bytes=3 * MiB, time_removed=0.0021),
        Saved(coord=Coord(mm, 12, 0), module="mlp.down_proj", bytes=4 * MiB, time_removed=0.00125),
    )
    region = RegionPlan(
        sequence="abc-90",
        tokens=4096,
        blocks=(frozenset(), frozenset(s.coord for s in saved)),
        block_bytes=(0, 7 * MiB),
        anchors=(
            frozenset(),
            frozenset(
                {
                    Anchor("self_attn.q_proj", mm, 0, 0),
                    Anchor("mlp.down_proj", mm, 0, 0),
                    Anchor("self_attn", sdpa, 0, 1),
                }
            ),
        ),
        modules={
            "self_attn.q_proj": "1a2b3c4d-3",
            "mlp.down_proj": "5e6f7a8b-2",
            "self_attn": "0badcafe-9",
        },
        saved=saved,
    )
    expected = Plan(
        model=("DecoderLayer",),
        regions={"DecoderLayer": region},
        capacity=20 * GiB,
        base=12 * GiB,
        saved_bytes=7 * MiB,
        predicted_speedup=1.08,
        predicted_speedup_vs_full=1.21,
        notes=("a note",),
        step_time=0.25,
        replay_time=0.03,
        memory_model="peak",
        predicted_peak=13 * GiB,
        peak_at="backward window of layers.3",
        static=10 * GiB,
    )
    plan = Plan.from_json(PLAN_27189EC)
    # Version 2 plans are used as they are (they have no plain blocks).
    assert plan == dataclasses.replace(expected, version=2) and PLAN_VERSION == 6
    loaded = plan.regions["DecoderLayer"]
    assert all(type(c) is Coord for b in loaded.blocks for c in b)
    assert all(type(a) is Anchor for b in loaded.anchors for a in b)
    assert all(type(s.coord) is Coord for s in loaded.saved)
    # Written the same, but for the model: its region types as a list since version 5.
    assert plan.to_json() == PLAN_27189EC.replace(
        '"DecoderLayer", "notes"', '["DecoderLayer"], "notes"'
    )


def test_a_margin_that_lets_plans_reach_near_limit_is_told_once_with_the_fix() -> None:
    with pytest.warns(UserWarning, match=r"fill 100\.0% of the limit.*Fix: near_limit=1\.0"):
        TapeSACConfig(memory_limit="1GiB", margin=0.0)
    # A fractional limit's margin is a share of device memory: 0.004 of it is 0.8% of 0.5.
    with pytest.warns(UserWarning, match=r"fill 99\.2% .* margin=0\.005 or more"):
        TapeSACConfig(memory_limit=0.5, margin=0.004)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TapeSACConfig(memory_limit="1GiB", margin=0.0, near_limit=1.0)
        TapeSACConfig(memory_limit=0.9)  # the defaults: plans fill 97.8%, below 0.99
        TapeSACConfig(memory_limit=0.0, margin=0.0)  # must-only: nothing is planned to fill


def test_the_margin_warning_names_the_users_line_whoever_built_the_config() -> None:
    """Built directly, by a Controller from keyword settings, or by ``dataclasses.replace``."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    tapesac_core.checkpoint_modules(model, {torch.nn.Linear})
    builders = [
        lambda: TapeSACConfig(memory_limit="1GiB", margin=0.0),
        lambda: tapesac_core.Controller(model, "1GiB", margin=0.0),
        lambda: dataclasses.replace(TapeSACConfig(memory_limit="1GiB"), margin=0.0),
    ]
    for build in builders:
        with pytest.warns(UserWarning, match="lets plans fill") as caught:
            build()
        assert [w.filename for w in caught] == [__file__]
    # A user's script beside the packages, its name starting as theirs do, is the user's line.
    script = os.path.join(os.path.dirname(os.path.dirname(tapesac_core.__file__)), "tapesac_job.py")
    code = compile("TapeSACConfig(memory_limit='1GiB', margin=0.0)", script, "exec")
    with pytest.warns(UserWarning, match="lets plans fill") as caught:
        exec(code, {"TapeSACConfig": TapeSACConfig})
    assert [w.filename for w in caught] == [script]


def test_a_plan_that_offloads_round_trips_and_explains_what_it_copies() -> None:
    plan = sample_plan()
    region = dataclasses.replace(plan.regions["DecoderLayer"], offloaded=(True, False))
    offloading = dataclasses.replace(
        plan, regions={"DecoderLayer": region}, offloaded_bytes=5 * MiB, copy_time=0.0015
    )
    text = offloading.to_json()
    assert Plan.from_json(text) == offloading and offloading.offloading() == {
        "DecoderLayer": [True, False]
    }
    assert not offloading.empty
    explained = offloading.explain()
    assert "offloads about 5.00 MiB a step to host memory; its copies add 1.500 ms" in explained
    assert "blocks offloaded: [0]" in explained
    assert "MiB more (offloads about 5.00 MiB to host memory); predicted" in explained
    assert "offloads" not in plan.explain()
    # A plan that offloads nothing writes no offload fields: files written before stay the same.
    assert "offload" not in plan.to_json() and not plan.offloading()


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(offloaded=(True,)), "one offload flag per block"),
        (
            dict(offloaded=(False, True), kinds=(BlockKind.TAPE, BlockKind.PLAIN)),
            "only recorded blocks offload",
        ),
    ],
)
def test_offload_flags_must_name_recorded_blocks_one_each(change, match) -> None:
    region = sample_plan().regions["DecoderLayer"]
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(region, **change)


def test_the_host_limit_of_offloading_parses_as_a_limit_and_errors_name_it() -> None:
    assert TapeSACConfig(memory_limit=0.9).parsed_offload_host_limit == MemoryLimit(fraction=0.5)
    config = TapeSACConfig(memory_limit=0.9, offload_host_limit="64GiB")
    assert config.parsed_offload_host_limit == MemoryLimit(bytes=64 * GiB)
    with pytest.raises(ValueError, match="offload_host_limit 2.0 as a float"):
        TapeSACConfig(memory_limit=0.9, offload_host_limit=2.0)
