"""The peak-aware memory model on the example models, measured on CPU (live tensor bytes).

Each run trains under one absolute limit; every step has 4 x 69 = 276 tokens, the count its
bucket's plan is solved for (the most the bucket has seen), so "capacity used" compares like with
like. The correction of predicted peaks is switched off: the model alone is checked.
"""

import copy

import pytest
import torch
from support import BLOCK_CLASSES, SHORT_SCHEDULE, checkpointed_lm, token_ids

import tapesac_core
from examples.training import train_step
from tapesac_core.control.controller import CONTROL, PLANNED, Controller
from tapesac_core.control.solve import region_menus, scaled
from tapesac_core.measure.memory import LiveTensorMeter
from tapesac_core.plan.menus import menus_of
from tapesac_core.plan.peak import predict
from tapesac_core.plan.plan import BlockKind

SEQ = 69


def _model(**overrides):
    """The example model (dropout 0.1 unless overridden), its blocks checkpointed."""
    return checkpointed_lm(BLOCK_CLASSES, **({"dropout": 0.1} | overrides))


def _ids(step: int, vocab: int = 256, seq: int = SEQ):
    """A batch of 4 x ``seq`` tokens: the bucket's upper edge at ``SEQ``."""
    return token_ids(step, batch=4, seq=seq, vocab=vocab)


def _step_up(controller, plan) -> int | None:
    """The least the predicted peak rises when one block takes its next frontier point (the
    plan's granularity; after the frontier, running plain), or None when every block already
    runs its last option."""
    (region,) = plan.regions
    profile, tokens = controller.profiles[region], plan.regions[region].tokens
    points = scaled(
        profile.frontier(controller.config.beam_width, controller.config.max_set_size),
        tokens / profile.tokens,
    )
    timeline = controller.memory.timeline(tokens).scaled(plan.base)
    menus = menus_of(
        timeline,
        region_menus(
            controller.profiles,
            {region: points},
            {region: tokens},
            {region: (BlockKind.PLAIN,) * controller.config.plain_blocks},
        ),
    )
    chosen = [
        next(i for i, o in enumerate(m) if o.bytes == plan.regions[region].block_bytes[b.index])
        for m, b in zip(menus, timeline.blocks)
    ]
    now = predict(timeline, [m[c] for m, c in zip(menus, chosen)]).peak
    rises = [
        predict(timeline, [m[k + (j == i)] for j, (m, k) in enumerate(zip(menus, chosen))]).peak
        - now
        for i, c in enumerate(chosen)
        if c + 1 < len(menus[i])
    ]
    return min(rises) if rises else None


def _uses_its_capacity(controller, plan, measured, must_only) -> bool:
    """At least 85% of (capacity - must-only) measured, unless saving more would not help (every
    block saves all that removes time) or one step up would take more than the rest (15%)."""
    room = plan.capacity - must_only
    step = _step_up(controller, plan)
    if step is None or step > 0.15 * room:
        return True
    return measured - must_only >= 0.85 * room


def _run(base, limit, memory_model="peak", vocab=256, steps=5, fresh=False, controller_too=False):
    """Train ``steps`` steps; per planned step (measured peak, predicted peak), the must-only
    control step's measured peak, and the last report (and the controller)."""
    model = copy.deepcopy(base)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    controller = Controller(
        model,
        limit,
        **SHORT_SCHEDULE,
        memory_model=memory_model,
        peak_correction=False,
    )
    planned, must_only = [], None
    for step in range(steps):
        # The sample (profile) step and the first planned step see the same batch.
        ids = _ids(step if fresh else 0, vocab)
        with LiveTensorMeter() as meter:
            report, _ = train_step(model, optimizer, ids, controller)
        peak = meter.reading().peak
        if report.mode == PLANNED:
            planned.append((peak, report.predicted_peak))
        elif report.mode == CONTROL:
            must_only = peak
    assert report.mode == PLANNED
    return (
        (planned, must_only, report, controller) if controller_too else (planned, must_only, report)
    )


@pytest.fixture(scope="module")
def dense():
    base = _model()
    _, must_only, report = _run(base, "1GiB")
    plan = report.plan  # the largest useful plan
    return base, must_only, plan.saved_bytes  # must-only peak, and all that is worth saving


@pytest.mark.slow
@pytest.mark.parametrize("fraction", [0.1, 0.3, 0.6, 1.0])
def test_predicted_peak_within_3_percent_never_above_the_limit_and_the_capacity_used(
    dense, fraction, caplog
):
    base, must_only, everything = dense
    limit = int((must_only + fraction * everything) / 0.98)
    with caplog.at_level("WARNING"):
        planned, measured_must_only, report, controller = _run(base, limit, controller_too=True)
    # A plan that fills its capacity (limit - margin) as predicted does not trip the near-limit
    # watch, which sits above it (near_limit 0.99 > 1 - margin 0.98).
    assert "raising the fragmentation estimate" not in caplog.text
    plan = report.plan
    measured, predicted = planned[0]
    # Where the peak falls depends on the plan (and so on measured op times): a block's window
    # or the loss, which all saved values reach.
    assert plan.memory_model == "peak" and (
        plan.peak_at.startswith("backward window of layers.")
        or plan.peak_at == "between forward and backward (the loss)"
    )
    assert abs(predicted - measured) <= 0.03 * measured, (predicted, measured)
    assert max(p for p, _ in planned) <= limit
    # Every saved value removes replay time (no memory filled with values of zero gain).
    assert all(s.time_removed > 0 for p in plan.regions.values() for s in p.saved)
    # The plan spends the memory the limit gives, unless no block's next frontier point fits
    # (it saves everything useful, or the next step up is too large).
    assert _uses_its_capacity(controller, plan, measured, measured_must_only), (
        measured,
        measured_must_only,
        plan.capacity,
        _step_up(controller, plan),
    )


@pytest.mark.slow
def test_a_zero_limit_runs_must_only_under_the_peak_aware_model(dense, caplog):
    """Nothing fits a limit of 0, but it asks for must-only: not for the plan of the lowest peak."""
    base, must_only, _ = dense
    with caplog.at_level("INFO"):
        planned, _, report = _run(base, 0.0)
    assert report.plan.memory_model == "peak" and report.plan.empty and report.saved_bytes == 0
    # The must-only step (a planned step reads ~10 KB above a control step on this model).
    assert abs(max(p for p, _ in planned) - must_only) <= 0.005 * must_only
    assert "memory_limit is 0" in caplog.text and "no plan fits" not in caplog.text


@pytest.mark.slow
def test_eq8_overcharges_the_same_step(dense):
    base, must_only, everything = dense
    limit = int((must_only + 0.6 * everything) / 0.98)
    planned, measured_must_only, report = _run(base, limit, memory_model="sum")
    measured, predicted = planned[0]
    assert report.plan.memory_model == "sum"
    # Eq. 8 charges every saved byte at the must-only peak: far above what the step measures
    # (the peak-aware model is within 3% on the same steps, above).
    assert predicted - measured > 0.05 * measured, (predicted, measured)
    assert max(p for p, _ in planned) <= limit


@pytest.mark.slow
def test_a_peak_at_the_loss_is_located_and_the_plan_uses_the_memory_beside_it():
    vocab = 16384  # logits of 276 x 16384 floats (and their float copy) set the peak
    base = _model(vocab_size=vocab)
    _, must_only, report = _run(base, "1GiB", vocab=vocab)
    everything = report.plan.saved_bytes
    assert report.plan.peak_at == "between forward and backward (the loss)"
    limit = int((must_only + 0.5 * everything) / 0.98)
    planned, measured_must_only, report, controller = _run(
        base, limit, vocab=vocab, controller_too=True
    )
    plan = report.plan
    measured, predicted = planned[0]
    assert plan.peak_at == "between forward and backward (the loss)"
    assert abs(predicted - measured) <= 0.03 * measured, (predicted, measured)
    assert measured <= limit
    assert 0 < plan.saved_bytes
    assert _uses_its_capacity(controller, plan, measured, measured_must_only)


@pytest.mark.slow
def test_moe_routing_on_fresh_batches_stays_under_the_limit():
    base = _model(moe=True, num_layers=3)
    _, must_only, report = _run(base, "1GiB", fresh=True)
    everything = report.plan.saved_bytes
    for fraction in (0.3, 1.0):
        limit = int((must_only + fraction * everything) / 0.98)
        planned, _, _ = _run(base, limit, fresh=True, steps=8)
        assert max(p for p, _ in planned) <= limit
    # On the batch it was sampled on, without dropout (the same routing), the MoE's predicted
    # peak is never below the metered one: the 0.45% the harness reads low (131,328 B) is SDPA's
    # CPU backward workspace (allocated and freed inside the op), which torch's profiler counts
    # and no dispatcher-level meter can see; allocator statistics on accelerators do.
    base = _model(moe=True, num_layers=3, dropout=0.0)
    _, must_only, report = _run(base, "1GiB")
    everything = report.plan.saved_bytes
    planned, _, _ = _run(base, int((must_only + 0.3 * everything) / 0.98))
    for measured, predicted in planned:
        assert measured <= predicted + 1e-4 * measured, (predicted, measured)
        assert predicted <= 1.03 * measured, (predicted, measured)


@pytest.mark.slow
def test_a_longer_sequence_mid_run_samples_again_and_stays_under_the_limit(dense):
    base, must_only, everything = dense
    limit = int((must_only + 0.6 * everything) / 0.98)
    model = copy.deepcopy(base)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    controller = Controller(
        model,
        limit,
        **SHORT_SCHEDULE,
        peak_correction=False,
    )
    for step in range(3):
        train_step(model, optimizer, _ids(0), controller)
    modes, peaks = [], []
    for step in range(3, 7):
        seq = 104  # x 1.5: a new bucket, whose memory is sampled again (a new timeline)
        with LiveTensorMeter() as meter:
            report, _ = train_step(model, optimizer, _ids(0, seq=seq), controller)
        modes.append(report.mode)
        peaks.append(meter.reading().peak)
    assert modes[0] == "sample" and modes[-1] == PLANNED
    plan = report.plan
    assert plan.memory_model == "peak" and plan.predicted_peak <= plan.capacity
    assert sorted(controller.memory.timelines) == [4 * SEQ, 4 * 104]
    assert max(peaks) <= limit


def _qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=192,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            attention_dropout=0.1,
        )
    )
    model.train()
    tapesac_core.checkpoint_modules(model, {Qwen3DecoderLayer})
    return model


def _qwen3_run(base, limit):
    model = copy.deepcopy(base)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    controller = Controller(
        model,
        limit,
        **SHORT_SCHEDULE,
        peak_correction=False,
    )
    ids = _ids(0, vocab=128)
    planned, must_only = [], None
    for _ in range(5):
        with LiveTensorMeter() as meter:
            with controller.step(tokens=ids.numel()) as report:
                model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if report.mode == PLANNED:
            planned.append((meter.reading().peak, report.predicted_peak))
        elif report.mode == CONTROL:
            must_only = meter.reading().peak
    return planned, must_only, report


@pytest.mark.slow
def test_hugging_face_qwen3_predicted_within_3_percent_and_under_the_limit():
    pytest.importorskip("transformers")
    base = _qwen3()
    _, must_only, report = _qwen3_run(base, "1GiB")
    everything = report.plan.saved_bytes
    assert everything > 0
    for fraction in (0.2, 0.6):
        limit = int((must_only + fraction * everything) / 0.98)
        planned, measured_must_only, report = _qwen3_run(base, limit)
        measured, predicted = planned[0]
        assert report.plan.memory_model == "peak"
        assert abs(predicted - measured) <= 0.03 * measured, (fraction, predicted, measured)
        assert max(p for p, _ in planned) <= limit


@pytest.mark.slow
def test_two_micro_batches_in_one_step_the_second_starts_from_freed_memory(dense):
    base, must_only, everything = dense
    model = copy.deepcopy(base)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    limit = int((must_only + 0.6 * everything) / 0.98)
    controller = Controller(
        model,
        limit,
        **SHORT_SCHEDULE,
        peak_correction=False,
    )
    planned = []
    for _ in range(4):
        with LiveTensorMeter() as meter:
            with controller.step(tokens=4 * SEQ) as report:
                for micro in range(2):  # gradient accumulation: two micro-batches, one step
                    model.loss(_ids(micro)).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if report.mode == PLANNED:
            planned.append((meter.reading().peak, report.predicted_peak))
    timeline = controller.memory.timeline(4 * SEQ)
    assert len(timeline.blocks) == 8 and report.plan.regions["DecoderLayer"].blocks.__len__() == 8
    # No segment holds blocks of both micro-batches: the first's are freed before the second's.
    assert all(s.last < 4 or s.first >= 4 for s in timeline.segments if s.first <= s.last)
    measured, predicted = planned[0]
    assert abs(predicted - measured) <= 0.03 * measured, (predicted, measured)
    assert measured <= limit


def test_measuring_the_timeline_leaves_the_step_bitwise_and_sees_every_block():
    from support import assert_bitwise, step

    from tapesac_core.blocks.trace_scope import trace
    from tapesac_core.measure.timeline import StepProbe

    model = _model()
    ids = _ids(0)
    ref = step(model, lambda: model.loss(ids))
    meter = LiveTensorMeter()
    with meter:
        probe = StepProbe(meter.mark)
        with trace(probe=probe) as blocks:
            probe.start()
            got = step(model, lambda: model.loss(ids))
        end = probe.close()
    assert_bitwise(ref, got)
    timeline = probe.timeline(blocks, end, tokens=ids.numel(), static=0)
    kinds = [e.kind for e in probe.events]
    assert kinds.count("forward_start") == kinds.count("release") == 4
    assert (
        kinds.count("unpack_start")
        == kinds.count("unpack_end")
        == sum(len(b.unpacks) for b in timeline.blocks)
        > 0
    )
    assert timeline.peak == meter.reading().peak  # the segments cover the whole window


@pytest.mark.slow
@pytest.mark.parametrize("fraction", [0.97, 0.5])  # 0.5: no plan reaches that low
def test_a_limit_below_the_must_only_peak_warns_only_when_no_plan_fits_below_it(
    dense, caplog, fraction
):
    """Saving a value also removes the replay temporaries it would cost, so under the peak-aware
    model a limit below the must-only peak may still be met. Whether a plan reaches that low
    depends on the frontier (measured op times); either way the controller must say the truth:
    a plan predicted within the capacity runs with no warning and stays under the limit,
    otherwise one warning says nothing fits and the plan of the lowest predicted peak runs."""
    base, must_only, _ = dense
    model = copy.deepcopy(base)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    limit = int(must_only * fraction)
    # The default 2% margin: the first planned step can read up to ~1% above its prediction
    # (within the model's 3%), so with margin 0 a plan that fills the capacity may cross the limit.
    controller = Controller(
        model,
        limit,
        **SHORT_SCHEDULE,
        peak_correction=False,
    )
    planned = []
    with caplog.at_level("WARNING"):
        for _ in range(5):
            with LiveTensorMeter() as meter:
                report, _ = train_step(model, optimizer, _ids(0), controller)
            if report.mode == PLANNED:
                planned.append(meter.reading().peak)
    plan = report.plan
    assert plan.memory_model == "peak" and plan.capacity <= limit < must_only
    if plan.predicted_peak <= plan.capacity:
        assert plan.saved_bytes > 0 and "no plan fits" not in caplog.text
        assert planned and max(planned) <= limit < must_only, (planned, limit, must_only)
        assert "remove more replay temporaries than they keep" in plan.explain()
    else:  # the plan of the lowest predicted peak runs, never above must-only's
        assert caplog.text.count("no plan fits") == 1
        assert plan.predicted_peak <= plan.base and max(planned) <= 1.02 * must_only  # the margin
        assert (
            "has the lowest predicted peak" if plan.saved_bytes else "nothing more is saved"
        ) in plan.explain()
