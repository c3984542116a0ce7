"""Any plan is exact, and it takes effect exactly as the tape predicts (saved bytes, replayed nodes)."""

import pytest
import torch
from blocks import case
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import assert_bitwise, assert_replayed_as_predicted

import tapesac_core
from tapesac_core.measure.memory import profile_memory


def _forward_end_bytes(c, plan) -> tuple[int, tapesac_core.BlockTrace]:
    """Net bytes allocated by one forward of the block that are still live when it returns."""
    with tapesac_core.use_plan(plan), tapesac_core.trace() as blocks:
        torch.manual_seed(3)
        out, mem = profile_memory(lambda: c.module(*c.args))
    del out
    return mem.end, blocks[0]


# Ten random plans per kind take 10-20 s: the MoE and in-place kinds run in the second tier.
@pytest.mark.parametrize(
    "kind",
    [
        "dense",
        pytest.param("moe", marks=pytest.mark.slow),
        pytest.param("inplace", marks=pytest.mark.slow),
    ],
)
@settings(
    max_examples=10,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
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
    assert b.saved == {v for v in tape.needed_sources(tape.planned) if tape.values[v].kind == "op"}
    assert_replayed_as_predicted(blocks)

    # Measured: what forward leaves allocated is the block's output, its saved values and RNG states.
    end, traced = _forward_end_bytes(c, plan)
    assert traced.saved == b.saved
    assert end == tape.bytes_of(b.saved | tape.outputs) + traced.rng_bytes
    must_end, must = _forward_end_bytes(c, {})
    assert end - must_end == (
        tape.bytes_of(b.saved | tape.outputs)
        + traced.rng_bytes
        - tape.bytes_of(must.saved | tape.outputs)
        - must.rng_bytes
    )


@pytest.mark.parametrize("kind", ["dense", "moe", "inplace"])
def test_saving_everything_replays_nothing_the_plan_saved(kind) -> None:
    c = case(kind)
    with tapesac_core.use_plan({c.region: c.coords}), tapesac_core.trace() as blocks:
        got = c.step()
    assert_bitwise(c.ref, got)
    (b,) = blocks
    assert not set(b.replayed) & {b.tape.values[v].node for v in b.saved}
    assert len(b.replayed) < len(c.must_only.replay_nodes())


class _Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(x)).exp()


ADDMM, TANH = ("aten.addmm.default", 0, 0), ("aten.tanh.default", 0, 0)


def test_a_per_block_plan_serves_every_micro_batch_entry_i_mod_len() -> None:
    torch.manual_seed(0)
    plain = torch.nn.Sequential(_Layer(), _Layer())
    model = torch.nn.Sequential(_Layer(), _Layer())
    model.load_state_dict(plain.state_dict())
    tapesac_core.checkpoint_modules(model, {_Layer})
    batches = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    with tapesac_core.use_plan({"_Layer": [{ADDMM}, {TANH}]}), tapesac_core.trace() as blocks:
        for x in batches:  # gradient accumulation: three micro-batches inside one plan
            model(x).sum().backward()
    for x in batches:
        plain(x).sum().backward()
    assert [b.tape.name for b in blocks] == ["0", "1"] * 3
    assert [{b.tape.coord(v) for v in b.tape.planned} for b in blocks] == [{ADDMM}, {TANH}] * 3
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), model.parameters()))
    assert_replayed_as_predicted(blocks)


@pytest.mark.parametrize("kind", ["dense", "moe", "inplace"])
def test_a_plan_records_its_ops_on_the_same_path_as_must_only(kind, monkeypatch) -> None:
    """Holding what a plan names sends no op to the slower path: each op recording takes as
    must-only, the hot path included, it takes under the plan too (on the slower path, a plan's
    forward cost the MoE example 8.5 ms a step, half of what its replay saved)."""
    from tapesac_core.tape.recorder import Recorder

    slow: list[str] = []
    record = Recorder._record

    def counted(self, func, info, args, kwargs):
        slow.append(info.name)
        return record(self, func, info, args, kwargs)

    monkeypatch.setattr(Recorder, "_record", counted)
    c = case(kind)
    paths = {}
    for name, plan in (("must-only", {}), ("everything", {c.region: c.coords})):
        slow.clear()
        # Recorded, not steady: another test may have run this cached case's block already.
        with tapesac_core.use_plan(plan), tapesac_core.trace(record=True) as blocks:
            got = c.step()
        assert_bitwise(c.ref, got)
        paths[name] = list(slow)
        if plan:
            assert blocks[0].tape.planned == {blocks[0].tape.find(coord) for coord in c.coords}
    assert paths["everything"] == paths["must-only"]
    assert len(paths["must-only"]) < len(c.must_only.nodes)  # some take the hot path
