"""Steady state: a module block recorded once per signature, then run from its tape under the
checking mode (``tapesac_core.tape.steady``): bitwise, holding and freeing what recording does,
recording again where the signature or the ops change, and never replaying a stale tape."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import os
import re
import tempfile
import warnings
from types import SimpleNamespace

import pytest
import torch
from support import (
    OpCounter,
    assert_bitwise,
    assert_replayed_as_predicted,
    block_paths,
    every_other_saved,
    hf_model,
    reference_and_copy,
    step,
    token_ids,
)

import tapesac_core
from examples.models import DecoderLayer
from tapesac_core.control.profile import RegionProfile, ReplayWall, with_forward_paths
from tapesac_core.control.solve import full_recompute_extra, region_menus
from tapesac_core.tape.block import PLAIN
from tapesac_core.tape.steady import Recorded

STEPS = 3  # a first call records; the later ones run in steady state


class InplaceViews(torch.nn.Module):
    """In-place ops, writes through views, a base read after a write through its view,
    ``index_add_`` into zeros, an empty buffer written by ``copy_``, transposes: no random op."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.d = d
        self.up = torch.nn.Linear(d, 2 * d)
        self.down = torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = self.d
        h = self.up(x)
        h[:, :d].relu_()
        s = h.sum(-1, keepdim=True)
        b = h[:, d:].clone()
        b[:, :2].add_(b[:, 2:4])
        idx = torch.arange(b.shape[0] - 1, -1, -1)
        c = torch.zeros_like(b)
        c.index_add_(0, idx, b * h[:, :d])
        c.masked_fill_(c.abs() < 0.05, 0.0)
        y = self.down(c.t().contiguous().t()) * torch.sigmoid(s)
        buf = torch.empty_like(y)
        buf.copy_(y)
        buf.add_(1.0)
        return buf + x


def _run(model: torch.nn.Module, ids: torch.Tensor, **trace: bool) -> tuple:
    with tapesac_core.trace(**trace) as blocks:
        got = step(model, lambda: model.loss(ids))
    return got, blocks


@pytest.mark.parametrize(
    "config, path",
    [
        (dict(), "steady"),
        (dict(attention_output_gate=False, num_kv_heads=4), "steady"),
        (dict(dropout=0.1), "steady"),  # dropout draws by layout: its states are derived
        # Sizes that follow the routing: recorded until a template binds them (data_sizes.py).
        (dict(moe=True), str(Recorded.DATA_SIZES)),
        (dict(moe=True, skip_empty_experts=True, dropout=0.1), str(Recorded.DATA_SIZES)),
    ],
    ids=["dense", "dense_mha", "dense_dropout", "moe", "moe_skip_dropout"],
)
def test_a_block_runs_in_steady_state_from_its_second_call_bitwise(config, path) -> None:
    reference, model = reference_and_copy(**config)
    ids = token_ids(1, seq=24)
    ref = step(reference, lambda: reference.loss(ids), seed=0)
    for i in range(STEPS):
        got, blocks = _run(model, ids)
        assert_bitwise(ref, got)
        assert_replayed_as_predicted(blocks)
        expected = str(Recorded.FIRST_CALL) if i == 0 else path
        assert block_paths(blocks) == [expected] * len(blocks), i


def test_a_bare_checkpoint_module_runs_in_steady_state_on_its_second_call() -> None:
    torch.manual_seed(0)
    block = InplaceViews()
    reference = copy.deepcopy(block)
    tapesac_core.checkpoint_module(block)
    x = torch.randn(8, 16, requires_grad=True)
    ref = step(reference, lambda: reference(x).pow(2).sum())
    for i in range(STEPS):
        with tapesac_core.trace() as blocks:
            got = step(block, lambda: block(x).pow(2).sum())
        assert_bitwise(ref, got)
        assert blocks[0].steady == (i > 0)
        assert blocks[0].replayed  # a must-only block of in-place ops replays from its tape


class SavesItsOutput(torch.nn.Module):
    """A block whose output autograd saves inside it (``sigmoid`` keeps its result): backward
    takes the output alive where the caller's graph keeps it, and replays it where it does not."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.lin(x).relu())


def test_steady_state_replays_by_what_each_call_has_at_hand() -> None:
    """Replay remembers a cached tape's read counts and closures (``ReplayMemo``) by the values
    at hand. Calls alternate between a caller that holds the block's output through backward
    (backward takes it alive) and one that drops it: each replays what it lacks, bitwise."""
    torch.manual_seed(0)
    block = SavesItsOutput()
    reference = copy.deepcopy(block)
    tapesac_core.checkpoint_module(block)
    x = torch.randn(8, 16, requires_grad=True)
    held: list[torch.Tensor] = []
    ref = step(reference, lambda: reference(x).pow(2).sum())
    replayed: dict[bool, list[list[int]]] = {False: [], True: []}
    for i in range(6):
        holds = i % 2 == 1
        with tapesac_core.trace() as blocks:
            got = step(block, lambda: (_keep(held, block(x)) if holds else block(x)).pow(2).sum())
        held.clear()
        assert_bitwise(ref, got)
        assert blocks[0].steady == (i > 0)
        assert bool(blocks[0].alive_taken) == holds
        replayed[holds].append(list(blocks[0].replayed))
    # Every call of a kind replays the same nodes; the output taken alive is not replayed.
    assert all(r == replayed[False][0] for r in replayed[False])
    assert all(r == replayed[True][0] for r in replayed[True])
    assert len(replayed[True][0]) < len(replayed[False][0])


def _keep(held: list[torch.Tensor], t: torch.Tensor) -> torch.Tensor:
    held.append(t)
    return t


class TwoDraws(torch.nn.Module):
    """Two dropouts on two branches: backward reaches the second branch first, so replaying its
    mask needs the generator state after the first dropout, whose mask is not replayed yet."""

    def __init__(self, value_dependent: bool = False) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
        self.value_dependent = value_dependent

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.dropout(self.a(x), 0.5, training=True)
        z = torch.nn.functional.dropout(self.b(x), 0.5, training=True)
        if self.value_dependent:  # poisson draws as many numbers as its rates ask for
            z = z * torch.poisson(self.b(x).detach().abs())
        return y + z


@pytest.mark.parametrize("value_dependent", [False, True])
def test_random_ops_replay_from_states_read_at_each_call(value_dependent) -> None:
    block = TwoDraws(value_dependent)
    reference = copy.deepcopy(block)
    tapesac_core.checkpoint_module(block)
    x = torch.randn(8, 16, requires_grad=True)
    for i in range(STEPS + 1):
        ref = step(reference, lambda: reference(x).pow(2).sum(), seed=i)
        with tapesac_core.trace() as blocks:
            got = step(block, lambda: block(x).pow(2).sum(), seed=i)
        assert_bitwise(ref, got)  # every mask replayed as drawn, under a new seed each step
        later = str(Recorded.RANDOM) if value_dependent else "steady"
        assert block_paths(blocks) == [str(Recorded.FIRST_CALL) if i == 0 else later]


def test_a_steady_state_backward_draws_each_mask_once() -> None:
    """Backward reads the second branch's mask first; each dropout's generator state was read
    in forward as it was dispatched, so no dropout runs twice in backward."""
    block = TwoDraws()
    reference = copy.deepcopy(block)
    tapesac_core.checkpoint_module(block)
    x = torch.randn(8, 16, requires_grad=True)
    for i in range(STEPS):
        ref = step(reference, lambda: reference(x).pow(2).sum(), seed=i)
        torch.manual_seed(i)
        with tapesac_core.trace() as blocks:
            loss = block(x).pow(2).sum()
        with OpCounter() as counter:
            loss.backward()
        grads = {n: p.grad for n, p in block.named_parameters()}
        assert_bitwise(ref, (loss.detach(), grads))
        block.zero_grad(set_to_none=True)
        assert blocks[0].steady == (i > 0)
        assert counter.counts["aten.bernoulli_.float"] == 2  # each mask once, in steady state too


def _forward_only(model: torch.nn.Module, ids: torch.Tensor, **trace: bool) -> tuple:
    """Forward inside a trace: the loss and each block's held tensors (before backward)."""
    with tapesac_core.trace(**trace) as blocks:
        loss = model.loss(ids)
    held = [{v: t.clone() for v, t in b.block().held.items()} for b in blocks]
    return loss, blocks, held


def _holdable_plan(model: torch.nn.Module, ids: torch.Tensor) -> dict:
    """Every value a block may keep that a steady-state call can hold: every other coordinate
    the recorded tape's saved-tensor or submodule storages carry."""
    _, blocks = _run(model, ids, record=True)
    return {"DecoderLayer": every_other_saved(blocks[0].tape)}


@pytest.mark.parametrize("planned", [False, True], ids=["must_only", "plan"])
def test_steady_state_holds_replays_and_frees_what_recording_does(planned: bool) -> None:
    reference, model = reference_and_copy()
    ids = token_ids(1, seq=24)
    ref = step(reference, lambda: reference.loss(ids), seed=0)
    plan = _holdable_plan(model, ids) if planned else {}
    with tapesac_core.use_plan(plan):
        _run(model, ids)  # records, and caches the tapes
        results = {}
        for name, trace in (("recorded", dict(record=True)), ("steady", {})):
            torch.manual_seed(0)
            loss, blocks, held = _forward_only(model, ids, **trace)
            assert [b.steady for b in blocks] == [name == "steady"] * len(blocks)
            loss.backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            model.zero_grad(set_to_none=True)
            assert_bitwise(ref, (loss.detach(), grads))
            results[name] = (blocks, held)
    (recorded, recorded_held), (steady, steady_held) = results["recorded"], results["steady"]
    for r, s, r_held, s_held in zip(recorded, steady, recorded_held, steady_held):
        assert r_held.keys() == s_held.keys()
        assert all(torch.equal(r_held[v], s_held[v]) for v in r_held)
        assert r.saved == s.saved
        assert (r.saved != frozenset()) == planned
        assert r.replayed == s.replayed
        assert r.alive_taken == s.alive_taken


@pytest.mark.parametrize("family", ["example", "qwen3"])
def test_steady_state_peaks_at_the_bytes_recording_peaks_at(family: str) -> None:
    if family == "example":
        _, model = reference_and_copy(hidden_size=128, intermediate_size=256)
        ids = token_ids(1, seq=64)
        loss = lambda: model.loss(ids)  # noqa: E731
    else:
        model, layer = hf_model("qwen3", 0.0)
        tapesac_core.checkpoint_modules(model, {layer})
        ids = torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(1))
        loss = lambda: model(input_ids=ids, labels=ids, use_cache=False).loss  # noqa: E731
    loss().backward()  # records, and caches the tapes
    model.zero_grad(set_to_none=True)

    def one_step(**trace: bool) -> None:
        with tapesac_core.trace(**trace) as blocks:
            loss().backward()
        model.zero_grad(set_to_none=True)
        assert [b.steady for b in blocks] == [not trace] * len(blocks)

    _, recorded = tapesac_core.profile_memory(lambda: one_step(record=True))
    _, steady = tapesac_core.profile_memory(one_step)
    assert steady.peak == recorded.peak
    assert steady.end == recorded.end == 0


def test_a_new_signature_records_and_an_old_one_runs_steady_again() -> None:
    reference, model = reference_and_copy()
    seen = []
    for length, train in ((24, True), (24, True), (16, True), (16, True), (24, True), (24, False)):
        ids = token_ids(1, seq=length)
        reference.train(train)
        model.train(train)
        ref = step(reference, lambda: reference.loss(ids), seed=0)
        got, blocks = _run(model, ids)
        assert_bitwise(ref, got)
        seen.append(set(block_paths(blocks)))
    first, steady = {str(Recorded.FIRST_CALL)}, {"steady"}
    assert seen == [first, steady, first, steady, steady, first]


def test_a_plan_change_between_steps_records_once_then_runs_steady() -> None:
    reference, model = reference_and_copy()
    ids = token_ids(1, seq=24)
    ref = step(reference, lambda: reference.loss(ids), seed=0)
    plan = _holdable_plan(model, ids)
    seen = []
    for entry in (plan["DecoderLayer"], plan["DecoderLayer"], set(), set(), [tapesac_core.PLAIN]):
        with tapesac_core.use_plan({"DecoderLayer": entry}):
            got, blocks = _run(model, ids)
        assert_bitwise(ref, got)
        seen.append(block_paths(blocks)[0] if blocks else "plain")
    # must-only was cached by _holdable_plan's recording
    assert seen == [str(Recorded.FIRST_CALL), "steady", "steady", "steady", "plain"]


class Branchy(torch.nn.Module):
    """Its forward depends on something outside its arguments and attributes: a global switch."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if SWITCH["op"] == "relu":
            h = h.relu()
        elif SWITCH["op"] == "sigmoid":
            h = h.sigmoid()  # saves its output, as relu does: the same pack shapes
        else:
            h = h.unsqueeze(0).exp().squeeze(0)  # saves an output of another shape
        return self.lin(h).tanh()


SWITCH = {"op": "relu"}


@pytest.mark.parametrize("second", ["sigmoid", "exp"], ids=["same_packs", "other_packs"])
def test_a_forward_that_diverges_under_one_signature_gets_no_wrong_gradient(
    second: str, caplog
) -> None:
    torch.manual_seed(0)
    block = Branchy()
    reference = copy.deepcopy(block)
    tapesac_core.checkpoint_module(block)
    x = torch.randn(4, 8, requires_grad=True)
    seen = []
    with caplog.at_level(logging.WARNING, logger="tapesac_core"):
        for op in ("relu", "relu", second, second, second):
            SWITCH["op"] = op
            ref = step(reference, lambda: reference(x).sum())
            with tapesac_core.trace() as blocks:
                got = step(block, lambda: block(x).sum())
            assert_bitwise(ref, got)
            seen.append("diverged" if blocks[0].diverged else block_paths(blocks)[0])
    SWITCH["op"] = "relu"
    first = str(Recorded.FIRST_CALL)
    assert seen == [first, "steady", "diverged", first, "steady"]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "Branchy" in warnings[0].getMessage()
    assert "recomputes its forward" in warnings[0].getMessage()


def test_a_number_read_from_a_global_is_checked_and_a_new_tape_replaces_the_old(caplog) -> None:
    """A Python number read from a global changes no pack and no autograd node: the steady
    call's check of the op's arguments sees it (the call is recomputed, said once), and the
    next recorded call's tape replaces the cached one, quietly."""
    torch.manual_seed(0)
    scale = {"value": 2.0}

    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (self.lin(x) * scale["value"]).sin()

    reference = Scaled()
    block = tapesac_core.checkpoint_module(copy.deepcopy(reference))
    x = torch.randn(4, 8, requires_grad=True)
    paths = []
    with caplog.at_level(logging.WARNING, logger="tapesac_core"):
        for value in (2.0, 2.0, 3.0, 3.0, 3.0):
            scale["value"] = value
            ref = step(reference, lambda: reference(x).sum())
            with tapesac_core.trace() as blocks:
                got = step(block, lambda: block(x).sum())
            assert_bitwise(ref, got)
            paths.append(block_paths(blocks)[0])
    first = str(Recorded.FIRST_CALL)
    assert paths == [first, "steady", "diverged", first, "steady"]
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(messages) == 1
    assert "argument 1 is 3.0, the tape's 2.0" in messages[0]


def test_hugging_face_layers_reach_steady_state_bitwise_without_dropout() -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
        )
    )
    model.train()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    loss = lambda: model(input_ids=ids, labels=ids).loss  # noqa: E731
    ref = step(model, loss)
    tapesac_core.checkpoint_modules(model, {Qwen3DecoderLayer})
    for i in range(STEPS):
        with tapesac_core.trace() as blocks:
            got = step(model, loss)
        assert_bitwise(ref, got)
        assert [b.steady for b in blocks] == [i > 0, i > 0]


def test_the_controller_records_measuring_and_verifying_steps_and_runs_steady_between() -> None:
    _, model = reference_and_copy()
    controller = tapesac_core.Controller(
        model, 0.0, warmup_steps=2, profile_steps=1, control_every=0, meter_every=3
    )
    ids = token_ids(1, seq=24)
    seen = []
    for _ in range(10):
        with controller.step(tokens=ids.numel()) as report:
            model.loss(ids).backward()
        seen.append((str(report.mode), report.steady_blocks))
    assert seen == [
        ("warmup", 0),  # verifies
        ("warmup", 4),  # a must-only control step too
        ("profile", 0),  # times every op
        ("planned", 0),  # a bucket's first planned step records and compares
        ("planned", 4),
        ("planned", 4),
        ("planned", 0),  # then one in meter_every
        ("planned", 4),
        ("planned", 4),
        ("planned", 0),
    ]


def _profile(recording_overhead: float) -> RegionProfile:
    return RegionProfile(
        region="r",
        tape=SimpleNamespace(fingerprint="seq"),
        tokens=10,
        node_time={0: 1.0},
        forward_time={0: 0.5, 1: 1.5},
        shares_reference=(True,),
        recording_overhead=recording_overhead,
    )


def test_a_blocks_forward_overhead_is_priced_by_the_paths_its_region_took() -> None:
    profile = _profile(recording_overhead=0.5)
    walls = [
        # steady at 10 tokens: 2.0 s of ops, 0.1 s over; at 5 tokens: 1.0 s of ops, 0.3 s over
        ReplayWall("seq", (), 0.0, 10, steady=True, forward_seconds=2.1),
        ReplayWall("seq", (), 0.0, 5, steady=True, forward_seconds=1.3),
        ReplayWall("seq", (), 0.0, 10, steady=True, forward_seconds=2.2),
        ReplayWall("seq", (), 0.0, 10, steady=False),
        ReplayWall("other", (), 0.0, 10, steady=True, forward_seconds=99.0),
    ]
    priced = with_forward_paths(profile, walls)
    assert priced.steady_share == 3 / 4
    assert priced.steady_overhead == pytest.approx(0.2)  # the median excess
    assert priced.forward_overhead == pytest.approx(3 / 4 * 0.2 + 1 / 4 * 0.5)
    assert with_forward_paths(priced, walls) is priced
    assert with_forward_paths(profile, []) is profile
    assert profile.forward_overhead == 0.5  # nothing seen: every block recorded


def test_full_checkpointing_and_plain_blocks_are_priced_without_the_forward_overhead() -> None:
    _, model = reference_and_copy()
    controller = tapesac_core.Controller(model, 0.0, warmup_steps=1, profile_steps=1)
    ids = token_ids(1, seq=24)
    for _ in range(3):
        with controller.step(tokens=ids.numel()):
            model.loss(ids).backward()
    profile = controller.profiles["DecoderLayer"]
    tokens = {"DecoderLayer": profile.tokens}
    steady = dataclasses.replace(profile, steady_share=1.0, steady_overhead=0.25)
    recorded = dataclasses.replace(profile, steady_share=0.0, recording_overhead=1.0)
    extra = {
        name: full_recompute_extra({"DecoderLayer": p}, tokens)
        for name, p in (("steady", steady), ("recorded", recorded))
    }
    assert extra["recorded"] == pytest.approx(extra["steady"] - profile.blocks * 0.75)
    for p in (steady, recorded):
        points = p.frontier(24, 12)
        menu = region_menus({"r": p}, {"r": points}, {"r": p.tokens}, {"r": (PLAIN,)})["r"]
        assert menu.gains[-1] == pytest.approx(points[0].time + p.forward_overhead)


def _fsdp2_rank(rank: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    def sharded(model: torch.nn.Module) -> torch.nn.Module:
        for layer in model.layers:
            fully_shard(layer)
        return fully_shard(model)

    def one_step(model: torch.nn.Module, ids: torch.Tensor) -> tuple:
        loss = model.loss(ids)
        loss.backward()
        grads = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        return loss.detach(), grads

    dist.init_process_group(
        "gloo", init_method=f"file://{os.path.join(out, 'store')}", rank=rank, world_size=2
    )
    try:
        reference, model = reference_and_copy(num_layers=4)
        reference, model = sharded(reference), sharded(model)
        plan = {"DecoderLayer": [set(), {("aten.mm.default", 0, 0)}, set(), set()]}
        results = []
        for step_index in range(4):
            ids = token_ids(step_index, seq=24 + 8 * rank)
            ref_loss, ref_grads = one_step(reference, ids)
            with tapesac_core.trace() as blocks, tapesac_core.use_plan(plan):
                loss, grads = one_step(model, ids)
            differ = [n for n in ref_grads if not torch.equal(ref_grads[n], grads[n])]
            results.append(
                dict(equal=torch.equal(ref_loss, loss) and not differ, steady=block_paths(blocks))
            )
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.launch
def test_steady_state_under_fsdp2_is_bitwise_on_two_ranks() -> None:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_fsdp2_rank, args=(out,), nprocs=2, join=True)
        ranks = [json.loads(open(os.path.join(out, f"rank{r}.json")).read()) for r in range(2)]
    first = str(Recorded.FIRST_CALL)
    for results in ranks:
        assert [r["equal"] for r in results] == [True] * 4
        assert [r["steady"] for r in results] == [[first] * 4] + [["steady"] * 4] * 3


def test_a_dispatch_mode_around_a_steady_state_call_is_not_a_divergence(caplog) -> None:
    """Under any dispatch mode (the recorder's, a user's FlopCounterMode) ``reshape``
    decomposes to ``view``, without one to ``_reshape_alias``: not a change of the forward."""
    from torch.utils.flop_counter import FlopCounterMode

    reference, model = reference_and_copy()
    ids = token_ids(1, seq=24)
    with caplog.at_level(logging.WARNING, logger="tapesac_core"):
        for counting in (False, True, False):
            # Under a mode composite ops may run other kernels: the reference runs under it too.
            with FlopCounterMode(display=False) if counting else contextlib.nullcontext():
                ref = step(reference, lambda: reference.loss(ids), seed=0)
                got, blocks = _run(model, ids)
            assert_bitwise(ref, got)
            assert not any(b.diverged for b in blocks)
    assert block_paths(blocks) == ["steady"] * 4
    assert not caplog.records


class ReadsAFloat(torch.nn.Module):
    """A block that computes with a float it reads from a tensor (``.item()``): a number no
    steady-state call could check, so its calls record."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * x.detach().abs().mean().item()


def test_explain_says_when_a_regions_blocks_record_every_call() -> None:
    """A float read from a tensor keeps a region's blocks recorded, and the plan says so; the
    examples' MoE, whose sizes follow its routing, runs in steady state and says nothing."""
    for config, says in ((None, True), (dict(moe=True), False), (dict(dropout=0.1), False)):
        if config is None:
            model = torch.nn.Sequential(ReadsAFloat(), ReadsAFloat())
            tapesac_core.checkpoint_modules(model, {ReadsAFloat})
            x = torch.randn(8, 16, requires_grad=True)
            loss, tokens = (lambda: model(x).sum()), 8
        else:
            _, model = reference_and_copy(**config)
            ids = token_ids(1, seq=24)
            loss, tokens = (lambda: model.loss(ids)), ids.numel()
        controller = tapesac_core.Controller(model, 0.0, warmup_steps=1, profile_steps=1)
        for _ in range(4):
            with controller.step(tokens=tokens) as report:
                loss().backward()
        text = report.plan.explain()
        assert ("record every call, not only the first: a host sync" in text) == says, text


@pytest.mark.parametrize("dropout", [0.1, 0.0], ids=["dropout", "no_dropout"])
@pytest.mark.parametrize("family", ["qwen3", "llama", "gpt2"])
def test_hugging_face_models_are_bitwise_over_five_steps(family: str, dropout: float) -> None:
    reference, layer = hf_model(family, dropout)
    model = copy.deepcopy(reference)
    reference.train()
    model.train()
    tapesac_core.checkpoint_modules(model, {layer})
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    seen = []
    for i in range(5):
        ref = step(reference, lambda: reference(input_ids=ids, labels=ids).loss, seed=i)
        with tapesac_core.trace() as blocks:
            got = step(model, lambda: model(input_ids=ids, labels=ids).loss, seed=i)
        assert_bitwise(ref, got)
        assert_replayed_as_predicted(blocks)
        seen.append(set(block_paths(blocks)))
    later = {"steady"}  # with dropout too: its draws are replayed from derived states
    assert seen == [{str(Recorded.FIRST_CALL)}] + [later] * 4


def test_a_resumed_run_records_its_blocks_once_then_runs_steady_bitwise() -> None:
    reference, model = reference_and_copy()
    settings = dict(warmup_steps=1, profile_steps=1, control_every=0, meter_every=4)
    controller = tapesac_core.Controller(model, 0.0, **settings)
    ids = token_ids(1, seq=24)
    for _ in range(4):
        with controller.step(tokens=ids.numel()):
            step(model, lambda: model.loss(ids))
    state = controller.state_dict()
    resumed = copy.deepcopy(reference)
    tapesac_core.checkpoint_modules(resumed, {DecoderLayer})
    controller = tapesac_core.Controller(resumed, 0.0, **settings)
    controller.load_state_dict(state)
    ref = step(reference, lambda: reference.loss(ids))
    seen = []
    for _ in range(3):
        with controller.step(tokens=ids.numel()) as report:
            got = step(resumed, lambda: resumed.loss(ids))
        assert_bitwise(ref, got)
        seen.append((str(report.mode), report.steady_blocks, report.blocks))
    assert seen == [("planned", 0, 4), ("planned", 4, 4), ("planned", 4, 4)]


def test_numpy_numbers_are_arguments_by_value() -> None:
    """A numpy scalar steering an op's arguments makes a new signature, as a float does: the
    steady path could not tell 0.5 from 3.0 (same packs, same autograd nodes)."""
    import numpy as np

    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor, scale: object) -> torch.Tensor:
            return (self.lin(x) * scale).tanh()

    torch.manual_seed(0)
    block = Scaled()
    reference = copy.deepcopy(block)
    tapesac_core.checkpoint_module(block)
    x = torch.randn(4, 8, requires_grad=True)
    for scale in (np.float64(0.5), np.float64(0.5), np.float64(3.0), 3.0, np.int64(2)):
        ref = step(reference, lambda: reference(x, scale).sum())
        with tapesac_core.trace() as blocks:
            got = step(block, lambda: block(x, scale).sum())
        assert_bitwise(ref, got)
        assert not blocks[0].diverged


class TwoOut(torch.nn.Module):
    """A submodule returning two tensors, both kept by a plan (neither is saved by autograd)."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(8, 8))
        self.w2 = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x @ self.w1, x @ self.w2


class PairBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pair = TwoOut()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.pair(x)
        return (a + b).sin()


def test_values_held_from_one_submodule_call_are_all_held_in_steady_state() -> None:
    torch.manual_seed(0)
    block = PairBlock()
    reference = copy.deepcopy(block)
    tapesac_core.checkpoint_module(block)
    x = torch.randn(4, 8, requires_grad=True)
    ref = step(reference, lambda: reference(x).sum())
    both = {("aten.mm.default", 0, 0), ("aten.mm.default", 1, 0)}
    with tapesac_core.use_plan({"PairBlock": both}):
        for i in range(3):
            with tapesac_core.trace() as blocks:
                loss = block(x).sum()
                saved = set(blocks[0].block().held)
            loss.backward()
            got = (loss.detach(), {n: p.grad.clone() for n, p in block.named_parameters()})
            block.zero_grad(set_to_none=True)
            x.grad = None
            assert_bitwise(ref, got)
            assert blocks[0].steady == (i > 0)
            assert len(saved & blocks[0].saved) == 2, saved


def test_a_divergence_under_autocast_recomputes_under_the_forwards_autocast() -> None:
    torch.manual_seed(0)
    block = Branchy()
    reference = copy.deepcopy(block)
    tapesac_core.checkpoint_module(block)
    x = torch.randn(4, 8, requires_grad=True)
    try:
        for op in ("relu", "relu", "sigmoid"):
            SWITCH["op"] = op
            # Without autocast's weight cache, as TapeSAC blocks run (a cast recorded per use).
            with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
                ref_loss = reference(x).float().sum()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                with tapesac_core.trace() as blocks:
                    loss = block(x).float().sum()
            ref = step(reference, lambda: ref_loss)
            got = step(block, lambda: loss)
            assert_bitwise(ref, got)
        assert blocks[0].diverged
    finally:
        SWITCH["op"] = "relu"


class LinearTwice(torch.nn.Module):
    def __init__(self, twice: bool = True) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.twice = twice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x).relu()
        return self.b(self.a(h).relu() if self.twice else h)


@pytest.mark.parametrize("twice", [True, False])
@pytest.mark.parametrize("cache", [True, False])
def test_a_parameter_cast_twice_under_autocast_is_said_where_not_bitwise(twice, cache) -> None:
    """Blocks run with autocast's weight cache off: where the user's autocast caches (its
    default), a parameter used twice is cast twice, its gradient summed in float32: said once
    (before, silently not bitwise). With the cache off, or each parameter used once, bitwise."""
    torch.manual_seed(0)
    reference = LinearTwice(twice)
    block = tapesac_core.checkpoint_module(copy.deepcopy(reference), region="twice")
    x = torch.randn(4, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache):
        ref = step(reference, lambda: reference(x).float().square().sum())
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            got = step(block, lambda: block(x).float().square().sum())
    warned = [w for w in said if "twice under autocast" in str(w.message)]
    assert len(warned) == (twice and cache)
    if warned:
        assert re.search(r"'a\.(weight|bias)' to torch\.bfloat16", str(warned[0].message))
    else:
        assert_bitwise(ref, got)


@pytest.mark.parametrize("between", [False, True], ids=["one_graph", "backward_between"])
@pytest.mark.parametrize("cache", [True, False])
def test_a_module_called_again_under_autocast_before_its_backward_is_said(cache, between) -> None:
    """A module called twice in one autocast region (a shared layer, a siamese encoder): without
    checkpointing, autocast's weight cache casts its parameters once for both calls, and their
    gradients sum in bfloat16; blocks cast per call. Said once (before, silently not bitwise);
    bitwise with the cache off, and with each call's backward before the next call."""
    torch.manual_seed(0)
    reference = LinearTwice(twice=False)
    block = tapesac_core.checkpoint_module(copy.deepcopy(reference), region="shared")
    x = torch.randn(4, 8, requires_grad=True)

    def losses(model: torch.nn.Module) -> list:
        if between:  # two steps: each call's graph is freed before the next call
            return [step(model, lambda: model(x).float().square().sum()) for _ in range(2)]
        return [step(model, lambda: model(model(x)).float().square().sum())]

    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache):
        ref = losses(reference)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            got = losses(block)
    warned = [w for w in said if "ran again under autocast" in str(w.message)]
    assert len(warned) == (cache and not between)
    if warned:
        assert "a checkpointed LinearTwice" in str(warned[0].message)
        assert not all(torch.equal(ref[0][1][n], got[0][1][n]) for n in ref[0][1])
    else:
        for r, g in zip(ref, got):
            assert_bitwise(r, g)


class HookCounting(torch.nn.Linear):
    """A linear layer that notes how many forward hooks it carries at each call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.hooks.append(len(self._forward_pre_hooks) + len(self._forward_hooks))
        return super().forward(x)


class TwoLinears(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = HookCounting(8, 8)
        self.b = HookCounting(8, 8)
        self.a.hooks, self.b.hooks = [], []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.a(x) + self.b(x)).sin()


def _checkpointed_holding_a(block: torch.nn.Module, hold_returned: bool) -> tuple:
    """``block`` checkpointed, its reference copy, an input, a plan that keeps ``block.a``'s
    output (or must-only), and the reference's loss and gradients."""
    reference = copy.deepcopy(block)
    tapesac_core.checkpoint_module(block)
    x = torch.randn(4, 8, requires_grad=True)
    region = type(block).__name__
    plan = {region: {("aten.addmm.default", 0, 0)}} if hold_returned else {}
    return reference, x, plan, step(reference, lambda: reference(x).sum())


@pytest.mark.parametrize("hold_returned", [False, True], ids=["must_only", "holds_returned"])
def test_steady_state_calls_hook_submodules_only_to_hold_what_they_return(
    hold_returned: bool,
) -> None:
    """Any forward hook sends a module down nn.Module's slower path: a recorded call hooks the
    block's submodules (names, exits), a steady-state call only when it holds a value a
    submodule returns (``a``'s output, read by an add alone, is never packed)."""
    torch.manual_seed(0)
    block = TwoLinears()
    reference, x, plan, ref = _checkpointed_holding_a(block, hold_returned)
    with tapesac_core.use_plan(plan):
        for i in range(3):
            with tapesac_core.trace() as blocks:
                got = step(block, lambda: block(x).sum())
            assert_bitwise(ref, got)
            assert blocks[0].steady == (i > 0)
            assert (len(blocks[0].saved) == 1) == hold_returned
    expected = [2, 2, 2] if hold_returned else [2, 0, 0]
    assert block.a.hooks == expected and block.b.hooks == expected
    assert not block.a._forward_pre_hooks and not block.a._forward_hooks  # none left behind


class MaybeIdentity(torch.nn.Module):
    """``a``'s output, read by an add alone, is held from its submodule's exit when a plan keeps
    it; ``extra`` calls one more submodule (an identity: no op, no saved tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)
        self.same = torch.nn.Identity()
        self.extra = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x) + self.b(x)
        return (self.same(h) if self.extra else h).sin()


@pytest.mark.parametrize("hold_returned", [False, True], ids=["must_only", "holds_returned"])
def test_a_call_holding_what_submodules_return_checks_their_calls(hold_returned, caplog) -> None:
    """Where a steady-state call holds a value a submodule returns, its submodule calls are
    counted against the tape's (the k-th exit is where that value comes from): one more is a
    divergence. Without such a value nothing is hooked, and an identity changes nothing replay
    reads."""
    torch.manual_seed(0)
    block = MaybeIdentity()
    reference, x, plan, ref = _checkpointed_holding_a(block, hold_returned)
    diverged = []
    with caplog.at_level(logging.WARNING, logger="tapesac_core"), tapesac_core.use_plan(plan):
        for extra in (False, False, True):
            block.extra = extra
            with tapesac_core.trace() as blocks:
                got = step(block, lambda: block(x).sum())
            assert_bitwise(ref, got)
            diverged.append(blocks[0].diverged)
    assert [bool(d) for d in diverged] == [False, False, hold_returned]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == int(hold_returned)
    if hold_returned:
        assert "3 submodule calls, the tape has 2" in warnings[0], warnings


def test_a_forward_that_raises_leaves_no_hook_on_its_submodules() -> None:
    class Raising(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.lin(x)
            raise ValueError("the user's error")

    block = tapesac_core.checkpoint_module(Raising())
    with pytest.raises(ValueError, match="the user's error"):
        block(torch.randn(2, 8, requires_grad=True))
    assert not block.lin._forward_pre_hooks and not block.lin._forward_hooks


def test_functional_call_with_other_parameters_is_bitwise_recorded_and_steady() -> None:
    """``torch.func.functional_call`` swaps other tensors in for a block's parameters during the
    forward and back before backward: backward takes the ones the forward used (not the
    module's own, fetched by name), on the recorded call, the steady-state calls after it and
    a call that diverged (its forward run again), and a plain call afterwards uses the module's
    own again. Every call bitwise; before, the gradients were off by up to 6.7."""
    torch.manual_seed(0)
    reference = torch.nn.Sequential(
        torch.nn.LayerNorm(16), torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16)
    )
    block = copy.deepcopy(reference)
    tapesac_core.checkpoint_module(block)
    x = torch.randn(4, 16, requires_grad=True)

    def swapped(module: torch.nn.Module) -> dict[str, torch.Tensor]:
        torch.manual_seed(1)  # the same swapped-in values for both modules
        return {
            name: (p.detach() * torch.rand_like(p) + 0.1).requires_grad_()
            for name, p in module.named_parameters()
        }

    ours, theirs = swapped(block), swapped(reference)
    for i in range(4):
        # A call whose eps changed diverges: its backward runs the forward again, with the
        # swapped-in tensors put back for it.
        reference[0].eps = block[0].eps = 1e-5 if i < 3 else 1e-3
        with tapesac_core.trace() as blocks:
            got = torch.func.functional_call(block, ours, (x,)).pow(2).sum()
            grads = torch.autograd.grad(got, [x, *ours.values()])
        expected = torch.func.functional_call(reference, theirs, (x,)).pow(2).sum()
        want = torch.autograd.grad(expected, [x, *theirs.values()])
        assert torch.equal(got, expected)
        assert all(torch.equal(a, b) for a, b in zip(grads, want)), i
        assert blocks[0].steady == (0 < i < 3) and (blocks[0].diverged is not None) == (i == 3)
    ref = step(reference, lambda: reference(x).pow(2).sum())
    assert_bitwise(ref, step(block, lambda: block(x).pow(2).sum()))


@pytest.mark.parametrize("how", ["del", "none"])
def test_a_parameter_removed_between_forward_and_backward_is_the_forwards(how: str) -> None:
    """A parameter deleted from its module (or set to None) after the forward and put back
    after the backward: the backward takes the one the forward used, recorded and steady,
    bitwise (before, the replay failed on the missing attribute)."""
    torch.manual_seed(0)
    reference = torch.nn.Sequential(
        torch.nn.LayerNorm(16), torch.nn.Linear(16, 16), torch.nn.Tanh()
    )
    block = copy.deepcopy(reference)
    tapesac_core.checkpoint_module(block)
    x = torch.randn(4, 16, requires_grad=True)
    for _ in range(3):
        grads = []
        for m in (reference, block):
            bias = m[1].bias
            loss = m(x).pow(2).sum()
            if how == "del":
                del m[1].bias
            else:
                m[1].bias = None
            grads.append(torch.autograd.grad(loss, [x, bias, m[1].weight]))
            m[1].bias = bias
        assert all(torch.equal(a, b) for a, b in zip(*grads))


class _Decaying(torch.nn.Module):
    """A block whose forward replaces a buffer it read, out of place (a schedule kept as a
    buffer, as TapeSAC's refusal of in-place writes to buffers suggests)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)
        self.register_buffer("scale", torch.full((16,), 2.0))
        self.eps = 1e-5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.layer_norm(self.linear(x), (16,), eps=self.eps) * self.scale
        self.scale = self.scale * 0.5
        return torch.tanh(y)


def test_a_buffer_the_forward_replaces_is_the_one_it_read_for_backward() -> None:
    """Backward takes the buffer as the forward first read it, not the one the forward left on
    the module: recorded, steady and diverged calls bitwise (a diverged call's forward, run
    again in backward, reads it as the forward did, and leaves the module as it was), and the
    buffer advances once per call as without checkpointing. Before, backward fetched the
    replaced one: wrong gradients on every call."""
    torch.manual_seed(0)
    reference = _Decaying()
    block = copy.deepcopy(reference)
    tapesac_core.checkpoint_module(block)
    x = torch.randn(4, 16, requires_grad=True)
    paths = []
    for i in range(5):
        reference.eps = block.eps = 1e-3 if i == 3 else 1e-5
        ref = step(reference, lambda: reference(x).pow(2).sum())
        with tapesac_core.trace() as blocks:
            got = step(block, lambda: block(x).pow(2).sum())
        assert_bitwise(ref, got)
        assert torch.equal(block.scale, reference.scale)
        paths.append("diverged" if blocks[0].diverged else "steady" if blocks[0].steady else "")
    assert paths == ["", "steady", "steady", "diverged", ""]
