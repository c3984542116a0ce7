"""Offload chosen by the controller's plans (issue 42): with a link to host memory, the planner
offloads blocks where that gains, and their steps copy exactly those blocks' values out and back,
bitwise, within the predicted peak and the limit, from one host pool. On CPU no link is measured:
plans never offload, and explain() says so. (CPU tests set a link by hand: the pool's buffers
stand for host memory there, outside the meter.)"""

import copy
import warnings
from collections.abc import Container

import pytest
import torch
import torch.nn.functional as F
from support import SHORT_SCHEDULE, SMALL, tiny_lm, token_ids

import tapesac_core
from benchmarks.measure import live_bytes
from examples.models import DecoderLayer, rotary_cos_sin
from tapesac_core import Controller
from tapesac_core.control.profiling import Profiling
from tapesac_core.control.solving import NO_HOST_MEMORY
from tapesac_core.control.step_report import PLANNED, PROFILE
from tapesac_core.plan.offload_choice import Link
from tapesac_core.plan.plan import BlockKind
from tapesac_core.tape.host_pool import HostPool
from tapesac_core.tape.offload import Offload
from tapesac_lightning.tracking import step_metrics

FAST = Link(to_host=1e12, to_device=1e12)  # every copy hidden
# Every metered step, a limit the plans may fill: what is checked is the prediction itself.
METERED = dict(meter_every=1, near_limit=1.0, peak_correction=False, margin=0.0)


def _models(layers: int = 4):
    reference = tiny_lm(**dict(SMALL, num_layers=layers))
    model = copy.deepcopy(reference)
    tapesac_core.checkpoint_modules(model, {DecoderLayer})
    return reference, model


def _bitwise_step(reference, model, controller, ids, seed):
    """One controller step of ``model`` beside ``reference`` without checkpointing, compared
    bitwise (nothing of either kept past the step)."""
    losses = []
    for m, context in ((reference, None), (model, controller)):
        m.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        if context is None:
            loss = m.loss(ids)
            loss.backward()
        else:
            with context.step(tokens=ids.numel()) as report:
                loss = m.loss(ids)
                loss.backward()
        losses.append(loss.detach())
    assert torch.equal(losses[0], losses[1])
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        assert torch.equal(p.grad, q.grad), name
    reference.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    return report


def _must_only_peak(reference, model, controller, ids) -> int:
    peak = None
    for seed in range(4):
        report = _bitwise_step(reference, model, controller, ids, seed)
        if report.mode == PROFILE:
            peak = report.peak
    assert peak is not None
    return peak


def _planned_at(share: int, layers: int = 4, seq: int = 128):
    """The examples' decoder of ``layers`` beside its copy under a controller with a fast link,
    profiled on 2 x ``seq`` tokens, then at ``share`` percent of its must-only peak:
    (reference, model, controller, ids, must-only peak)."""
    reference, model = _models(layers)
    ids = token_ids(0, batch=2, seq=seq)
    controller = Controller(model, "1GiB", **(SHORT_SCHEDULE | METERED))
    controller.solver.link = FAST
    must_only = _must_only_peak(reference, model, controller, ids)
    controller.replan(memory_limit=must_only * share // 100)
    return reference, model, controller, ids, must_only


def test_a_plan_offloads_where_that_gains_and_its_steps_are_bitwise_within_the_limit() -> None:
    reference, model = _models()
    ids = token_ids(0, batch=2, seq=128)
    controller = Controller(model, "1GiB", **(SHORT_SCHEDULE | METERED))
    controller.solver.link = FAST
    must_only = _must_only_peak(reference, model, controller, ids)
    # A little above must-only: keeping values alone leaves little room, and offloading blocks
    # whose copies hide behind the next block makes room for others to keep more.
    limit = must_only * 105 // 100
    controller.solver.link = None
    controller.replan(memory_limit=limit)
    kept_only = controller.plan_for(ids.numel())
    assert not kept_only.offloading()
    controller.solver.link = FAST
    controller.replan(memory_limit=limit)
    plan = controller.plan_for(ids.numel())
    offloading = plan.offloading()["DecoderLayer"]
    assert any(offloading) and plan.offloaded_bytes > 0
    assert plan.predicted_speedup > kept_only.predicted_speedup
    assert "blocks offloaded: [" in plan.explain() and "to host memory" in plan.explain()
    allocations = []
    for seed in range(4):
        report = _bitwise_step(reference, model, controller, ids, seed)
        assert report.mode == PLANNED and report.plan is plan
        assert report.peak is not None and report.predicted_peak is not None
        assert report.peak <= report.predicted_peak <= limit, (report.peak, report.predicted_peak)
        assert report.offloaded_bytes > 0
        assert step_metrics(report)["tapesac/offloaded_bytes"] == report.offloaded_bytes
        pool = controller._host_pool
        assert pool is not None and pool.outstanding == 0  # every buffer back after the step
        allocations.append(pool.allocations)
    assert allocations == [allocations[0]] * 4  # the pool reused from the first step on


def test_below_must_only_s_peak_a_plan_fits_by_offloading_block_inputs_and_holds() -> None:
    """The examples' dense layers hold no value of their own must-only (S0 is empty): below
    must-only's peak, only their inputs (the hidden states kept between blocks) can go. Each
    block's input goes to host memory once the next block has started."""
    reference, model = _models(layers=6)
    ids = token_ids(0, batch=2, seq=512)
    controller = Controller(model, "1GiB", **(SHORT_SCHEDULE | METERED))
    controller.solver.link = FAST
    must_only = _must_only_peak(reference, model, controller, ids)
    # Measured per layer: each holds its input alone once the next started, but the last.
    assert controller.profiles["DecoderLayer"].inputs_alone == (2 * 512 * 32 * 4,) * 5 + (0,)
    limit = must_only * 96 // 100
    controller.solver.link = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no plan fits: said once
        controller.replan(memory_limit=limit)
    assert controller.plan_for(ids.numel()).predicted_peak > limit
    controller.solver.link = FAST
    controller.replan(memory_limit=limit)
    plan = controller.plan_for(ids.numel())
    assert plan.predicted_peak <= limit and any(plan.offloading()["DecoderLayer"])
    for seed in range(3):
        report = _bitwise_step(reference, model, controller, ids, seed)
        assert report.mode == PLANNED and report.peak is not None
        assert report.peak <= report.predicted_peak <= limit, (report.peak, report.predicted_peak)


def test_below_must_only_s_peak_a_link_too_slow_is_refused_with_a_clear_message(caplog) -> None:
    reference, model = _models(layers=6)
    ids = token_ids(0, batch=2, seq=512)
    controller = Controller(model, "1GiB", **(SHORT_SCHEDULE | METERED))
    must_only = _must_only_peak(reference, model, controller, ids)
    controller.solver.link = Link(to_host=1e3, to_device=1e3)  # 1 KB/s: nothing hides
    with caplog.at_level("WARNING", logger="tapesac_core"):
        controller.replan(memory_limit=must_only * 96 // 100)
    plan = controller.plan_for(ids.numel())
    assert not plan.offloading() and plan.predicted_peak > must_only * 96 // 100
    assert plan.offload_refused == 5  # every block but the last, which nothing follows
    assert "offloading refused for 5 blocks: the link to host memory is too slow" in (
        plan.explain()
    )
    said = [r.getMessage() for r in caplog.records if "no plan fits" in r.getMessage()]
    assert (
        len(said) == 1
        and (
            "Offloading to host memory was refused for 5 blocks: the link, measured at 1000 B/s "
            "to the host and 1000 B/s back, is too slow"
        )
        in said[0]
    )
    # A host pool with no room offloads nothing either, and says nothing of the link.
    controller.solver.link, controller.solver.host_room = FAST, 0
    controller.replan(memory_limit=must_only * 96 // 100)
    plan = controller.plan_for(ids.numel())
    assert not plan.offloading() and not plan.offload_refused


def test_a_failed_offloading_step_leaves_nothing_behind_and_training_goes_on() -> None:
    reference, model, controller, ids, _ = _planned_at(105)
    assert controller.plan_for(ids.numel()).offloading()
    _bitwise_step(reference, model, controller, ids, 0)  # the pool's buffers made
    before = live_bytes(torch.device("cpu"))

    def fail(*_):
        raise RuntimeError("a hook failed")

    for where in ("forward", "backward"):
        hook = (
            model.layers[2].register_forward_hook(fail)
            if where == "forward"
            else model.layers[1].register_full_backward_hook(fail)
        )
        with pytest.raises(RuntimeError, match="a hook failed"):
            with controller.step(tokens=ids.numel()):
                model.loss(ids).backward()
        hook.remove()
        model.zero_grad(set_to_none=True)
        assert controller._host_pool is not None and controller._host_pool.outstanding == 0
        assert live_bytes(torch.device("cpu")) == before, where
    report = _bitwise_step(reference, model, controller, ids, 1)
    assert report.mode == PLANNED and report.offloaded_bytes > 0


def test_the_step_frontier_with_offload_reaches_lower_peaks_than_without() -> None:
    _, _, controller, ids, must_only = _planned_at(105, layers=6, seq=512)
    plan = controller.plan_for(ids.numel())
    frontier = controller.step_frontier(controller.buckets.key({"DecoderLayer": ids.numel()}))
    assert frontier.kept_only and frontier.with_offload
    lowest = min(p for p, _ in frontier.with_offload)
    assert lowest < min(p for p, _ in frontier.kept_only) and lowest < must_only
    # Each curve is a frontier: slower only where it needs less memory.
    for curve in (frontier.kept_only, frontier.with_offload):
        assert all(a[0] < b[0] and a[1] > b[1] for a, b in zip(curve, curve[1:]))
    assert plan.predicted_peak <= plan.capacity


def _loss(model, ids, keep: Container[int]):
    """The examples' decoder loss, its caller keeping the inputs of the layers in ``keep`` until
    the loss (all: as a model returning all hidden states does; the first: as Hugging Face
    models keep the embeddings)."""
    h = model.embed_tokens(ids)
    cos, sin = rotary_cos_sin(ids.shape[1], model.config.head_dim, model.config.rope_theta, h)
    kept = []
    for i, layer in enumerate(model.layers):
        if i in keep:
            kept.append(h)
        h = layer(h, cos, sin)
    logits = model.lm_head(model.norm(h))[:, :-1].float()
    loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    return loss + 0.0 * sum(k.sum() for k in kept) if kept else loss


def test_inputs_a_caller_keeps_after_profiling_are_measured_and_plans_solved_again(caplog) -> None:
    """Profiled with the caller letting go of each layer's input, then kept: the first planned
    step finds them held outside the blocks, says so once, and the plans after it count on none
    of them (metered within their prediction)."""
    _, model = _models(layers=6)
    ids = token_ids(0, batch=2, seq=512)
    controller = Controller(model, "1GiB", **(SHORT_SCHEDULE | METERED))
    controller.solver.link = FAST
    keep, reports = range(0), []
    for step in range(9):
        if step == 4:
            must_only = next(r.peak for r in reports if r.mode == PROFILE)
            controller.replan(memory_limit=must_only * 105 // 100)
            assert any(controller.profiles["DecoderLayer"].inputs_alone)
            keep = range(len(model.layers))
        with caplog.at_level("INFO", logger="tapesac_core"):
            with controller.step(tokens=ids.numel()) as report:
                _loss(model, ids, keep).backward()
        model.zero_grad(set_to_none=True)
        reports.append(report)
    assert not any(controller.profiles["DecoderLayer"].inputs_alone)
    # The step that found them kept was planned counting them gone, and peaked above that.
    assert reports[4].mode == PLANNED and reports[4].peak > reports[4].predicted_peak
    said = [r for r in caplog.records if "inputs were still held outside" in r.getMessage()]
    assert len(said) == 1
    later = [r for r in reports[5:] if r.mode == PLANNED]
    assert later and all(r.peak <= r.predicted_peak for r in later), [
        (r.peak, r.predicted_peak) for r in later
    ]


def test_a_caller_keeping_the_first_layer_s_input_leaves_the_others_to_offload() -> None:
    """Hugging Face models keep the first layer's input (the embeddings) to the end of forward:
    that layer's input stays, and below must-only's peak a plan fits by offloading the others'
    (measured per layer: the least over the region would count none of them)."""
    reference, model = _models(layers=6)
    ids = token_ids(0, batch=2, seq=512)
    controller = Controller(model, "1GiB", **(SHORT_SCHEDULE | METERED))
    controller.solver.link = FAST
    reports = []
    for step in range(8):
        if step == 4:
            must_only = next(r.peak for r in reports if r.mode == PROFILE)
            controller.replan(memory_limit=must_only * 96 // 100)
        for m in (reference, model):
            m.zero_grad(set_to_none=True)
        torch.manual_seed(step)
        expected = _loss(reference, ids, {0})
        expected.backward()
        with controller.step(tokens=ids.numel()) as report:
            loss = _loss(model, ids, {0})
            loss.backward()
        assert torch.equal(loss, expected)
        for (name, p), q in zip(reference.named_parameters(), model.parameters()):
            assert torch.equal(p.grad, q.grad), name
        reports.append(report)
    alone = (0,) + (2 * 512 * 32 * 4,) * 4 + (0,)
    assert controller.profiles["DecoderLayer"].inputs_alone == alone
    assert any(controller.plan_for(ids.numel()).offloading()["DecoderLayer"][1:])
    planned = reports[4:]
    assert all(r.mode == PLANNED and r.offloaded_bytes > 0 for r in planned)
    assert all(r.peak <= r.predicted_peak <= must_only * 96 // 100 for r in planned), [
        (r.peak, r.predicted_peak) for r in planned
    ]


def test_blocks_run_plain_keep_their_place_in_the_region_s_measured_inputs() -> None:
    """The caller keeps layer 2's input. An offloading step whose plan runs layer 0 plain (it
    has no trace) measures each later layer at its own place: nothing is lowered (counted by
    trace, layer 1's entry took layer 2's 0)."""
    _, model = _models(layers=6)
    ids = token_ids(0, batch=2, seq=64)
    tokens = {"DecoderLayer": ids.numel()}

    with tapesac_core.trace(time_nodes=True) as profiled:
        _loss(model, ids, {2}).backward()
    profiling = Profiling(steps=1, tolerance=0.5)
    profiling.take(list(profiled), tokens)
    alone = 2 * 64 * 32 * 4
    measured = (alone, alone, 0, alone, alone, 0)
    assert profiling.profiles["DecoderLayer"].inputs_alone == measured
    plan = {"DecoderLayer": [BlockKind.PLAIN] + [set()] * 5}
    offload = Offload(HostPool(torch.device("cpu")), regions=frozenset({"DecoderLayer"}))
    with tapesac_core.use_plan(plan), tapesac_core.trace(offload=offload) as step:
        _loss(model, ids, {2}).backward()
    assert [t.position for t in step] == [1, 2, 3, 4, 5]
    assert not profiling.held_inputs_less(list(step), tokens)
    assert profiling.profiles["DecoderLayer"].inputs_alone == measured


class ReluLayer(DecoderLayer):
    """A layer whose last op saves its result for backward, as ``relu(out + identity)`` in a
    residual network: a plan may keep the block's output, which stays on the device with the
    next block (nothing copies a storage the block does not hold alone)."""

    def forward(self, h, cos, sin):
        return torch.relu(super().forward(h, cos, sin))


def test_blocks_whose_output_backward_reads_stay_within_the_prediction() -> None:
    reference = tiny_lm(**dict(SMALL, num_layers=6))
    for layer in reference.layers:
        layer.__class__ = ReluLayer
    model = copy.deepcopy(reference)
    tapesac_core.checkpoint_modules(model, {ReluLayer})
    ids = token_ids(0, batch=2, seq=512)
    controller = Controller(model, "1GiB", **(SHORT_SCHEDULE | METERED))
    controller.solver.link = FAST
    must_only = _must_only_peak(reference, model, controller, ids)
    for share in (96, 103, 110):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # where no plan fits, said once
            controller.replan(memory_limit=must_only * share // 100)
        for seed in range(2):
            report = _bitwise_step(reference, model, controller, ids, seed)
            assert report.mode == PLANNED and report.peak is not None
            assert report.peak <= report.predicted_peak, (share, report.peak, report.predicted_peak)
    assert any(controller.profiles["ReluLayer"].inputs_alone)


def test_only_the_blocks_the_plan_names_offload() -> None:
    _, model, controller, ids, _ = _planned_at(105)
    offloading = controller.plan_for(ids.numel()).offloading()["DecoderLayer"]
    assert any(offloading) and not all(offloading)
    with controller.step(tokens=ids.numel()) as report:
        loss = model.loss(ids)
        assert controller._open is not None
        blocks = [t.block() for t in controller._open.blocks]
        assert [b.offloaded is not None for b in blocks] == offloading
        loss.backward()
    model.zero_grad(set_to_none=True)
    assert report.mode == PLANNED


def test_on_cpu_plans_never_offload_and_explain_says_so_once() -> None:
    reference, model = _models()
    ids = token_ids(0, batch=2, seq=128)
    controller = Controller(model, "1GiB", **SHORT_SCHEDULE)
    assert controller.solver.link is None
    must_only = _must_only_peak(reference, model, controller, ids)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # below must-only's peak: no plan fits, said once
        controller.replan(memory_limit=must_only * 9 // 10)
    plan = controller.plan_for(ids.numel())
    assert not plan.offloading() and plan.offloaded_bytes == 0
    assert plan.explain().count(NO_HOST_MEMORY) == 1
    report = _bitwise_step(reference, model, controller, ids, 9)
    assert step_metrics(report)["tapesac/copy_time"] == 0.0
    assert report.offloaded_bytes == 0 and controller._host_pool is None


def test_a_plan_with_room_for_everything_offloads_nothing() -> None:
    reference, model = _models()
    ids = token_ids(0, batch=2, seq=128)
    controller = Controller(model, "1GiB", **SHORT_SCHEDULE)
    controller.solver.link = FAST
    _must_only_peak(reference, model, controller, ids)
    assert not controller.plan_for(ids.numel()).offloading()
