"""Any plan is exact, and it takes effect exactly as the tape predicts (saved bytes, replayed nodes)."""

import pytest
import torch
from blocks import case
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import assert_bitwise, assert_replayed_as_predicted

import tapesac_core
from tapesac_core.memory import profile_memory


def _forward_end_bytes(c, plan) -> tuple[int, tapesac_core.BlockTrace]:
    """Net bytes allocated by one forward of the block that are still live when it returns."""
    with tapesac_core.use_plan(plan), tapesac_core.trace() as blocks:
        torch.manual_seed(3)
        out, mem = profile_memory(lambda: c.module(*c.args))
    del out
    return mem.end, blocks[0]


@pytest.mark.parametrize("kind", ["dense", "moe", "inplace"])
@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_plan_is_exact_and_takes_effect(kind, data) -> None:
    c = case(kind)
    chosen = data.draw(st.sets(st.sampled_from(c.coords)), label="saved coordinates")
    plan = {c.region: chosen}
    with tapesac_core.use_plan(plan), tapesac_core.trace() as blocks:
        got = c.step()
    assert_bitwise(c.ref, got)
    (b,) = blocks
    tape = b.tape
    assert tape.op_sequence() == c.must_only.op_sequence()
    assert tape.planned == {tape.find(coord) for coord in chosen}
    assert b.saved == {v for v in tape.needed_sources(tape.planned)
                       if tape.values[v].kind == "op"}
    assert_replayed_as_predicted(blocks)

    # Measured: what forward leaves allocated is the block's output, its saved values and RNG states.
    end, traced = _forward_end_bytes(c, plan)
    assert traced.saved == b.saved
    assert end == tape.bytes_of(b.saved | tape.outputs) + tape.rng_bytes
    must_end, must = _forward_end_bytes(c, {})
    assert end - must_end == (tape.bytes_of(b.saved | tape.outputs)
                              - tape.bytes_of(must.saved | tape.outputs))


@pytest.mark.parametrize("kind", ["dense", "moe", "inplace"])
def test_saving_everything_replays_nothing_the_plan_saved(kind) -> None:
    c = case(kind)
    with tapesac_core.use_plan({c.region: c.coords}), tapesac_core.trace() as blocks:
        got = c.step()
    assert_bitwise(c.ref, got)
    (b,) = blocks
    assert not set(b.replayed) & {b.tape.values[v].node for v in b.saved}
    assert len(b.replayed) < len(c.must_only.replay_nodes())
