"""The peak-aware memory model on transformers' attention paths, eager and SDPA (issue 32).

Each family is a tiny config of a transformers causal LM, its decoder layer checkpointed, trained
under a Controller at a limit halfway between the must-only step's metered peak and that of a
step with every block plain (no checkpointing), margin 0, every planned step metered, the model's
correction off: the first planned step must meter within its predicted peak and under the limit,
and the prediction may not waste memory: at most 1% above the metered peak.

What eager attention taught the model: a block output its caller drops before backward (the
attention weights Falcon's eager path returns, kept by autograd alone) is charged to a plain block
(it was taken for alive anyway, and the step ran 10% over its prediction); values that outlive a
block's forward (those weights until the next block returns, keys and values a cache keeps until
the model returns) are measured where they are alive and not charged again there; a forward's
values live until Python lets go of them, not until their last read.

One gap is left, on eager paths only: the causal mask (batch x 1 x seq x seq) is every block's
input, which a recorded block keeps and a plain one lets go; the model does not credit that, so
there the prediction may exceed the metered peak by the mask's bytes (1-2% on these tiny models).
"""

import copy

import pytest
import torch
from support import SHORT_SCHEDULE, token_ids

import tapesac_core
from tapesac_core.control.controller import PLANNED, PROFILE, Controller
from tapesac_core.plan.peak import Option, predict
from tapesac_core.plan.peak_dp import solve_peak
from tapesac_core.plan.peak_timeline import (
    FORWARD_END,
    FORWARD_START,
    FREED,
    RELEASE,
    Event,
    TimelineBlock,
    timeline_of,
)

transformers = pytest.importorskip("transformers")

BATCH, SEQ, VOCAB = 4, 69, 128


def test_a_value_alive_after_its_forward_is_not_counted_twice_where_it_was_measured():
    """Block 0's value 7 outlived its forward until a FREED event: between its forward's end and
    that event the sample step measured it (peak 15), so an option keeping it (4 bytes, 3 of them
    value 7) adds only 1 there; the forward (14 + 4) sets the peak, and the solver sees the same."""
    events = [
        Event(kind=FORWARD_START, block=0, peak=5, current=5),
        Event(kind=FORWARD_END, block=0, peak=14, current=13),
        Event(kind=FREED, block=0, peak=15, current=10, vid=7),
        Event(kind=RELEASE, block=0, peak=11, current=11),
    ]
    block = TimelineBlock(region="r", index=0, sequence="s", lingering=(7,))
    timeline = timeline_of(events, [block], tokens=1, static=0, end_peak=6)
    assert [s.lingering for s in timeline.segments] == [(), (), ((0, 0),), (), (), ()]
    keeps = Option(bytes=4, gain=1.0, point=1, linger=(3,))
    assert predict(timeline, [keeps]).peak == 18
    assert predict(timeline, [Option(bytes=4, gain=1.0, point=1)]).peak == 19
    menu = [Option(bytes=0, gain=0.0, point=0), keeps]
    assert solve_peak(timeline, [menu], capacity=18) == (1,)


def _falcon(attn):
    from transformers.models.falcon.modeling_falcon import FalconDecoderLayer

    # Four heads of 8: the attention weights (4 x 4 x 69 x 69) are large against the rest, as
    # in the run, where the first planned step metered 10-14% over its prediction.
    config = transformers.FalconConfig(
        vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4
    )
    return transformers.FalconForCausalLM, config, FalconDecoderLayer


def _gpt2(attn):
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128, bos_token_id=0
    )
    config.eos_token_id = 0
    return transformers.GPT2LMHeadModel, config, GPT2Block


def _opt(attn):
    from transformers.models.opt.modeling_opt import OPTDecoderLayer

    config = transformers.OPTConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        ffn_dim=128,
        word_embed_proj_dim=64,
        max_position_embeddings=128,
    )
    return transformers.OPTForCausalLM, config, OPTDecoderLayer


def _phi(attn):
    from transformers.models.phi.modeling_phi import PhiDecoderLayer

    config = transformers.PhiConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
    )
    return transformers.PhiForCausalLM, config, PhiDecoderLayer


def _gemma(attn):
    from transformers.models.gemma.modeling_gemma import GemmaDecoderLayer

    config = transformers.GemmaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
    )
    return transformers.GemmaForCausalLM, config, GemmaDecoderLayer


def _gpt_neox(attn):
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXLayer

    config = transformers.GPTNeoXConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
    )
    return transformers.GPTNeoXForCausalLM, config, GPTNeoXLayer


def _mixtral(attn):
    from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer

    config = transformers.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    return transformers.MixtralForCausalLM, config, MixtralDecoderLayer


def _qwen2_moe(attn):
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeDecoderLayer

    config = transformers.Qwen2MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        num_experts=4,
        num_experts_per_tok=2,
    )
    return transformers.Qwen2MoeForCausalLM, config, Qwen2MoeDecoderLayer


FAMILIES = {
    "falcon": _falcon,
    "gpt2": _gpt2,
    "opt": _opt,
    "phi": _phi,
    "gemma": _gemma,
    "gpt_neox": _gpt_neox,
    "mixtral": _mixtral,
    "qwen2_moe": _qwen2_moe,
}


def _model(family: str, attn: str) -> torch.nn.Module:
    """The family's tiny causal LM with ``attn`` attention, its decoder layers checkpointed."""
    cls, config, layer = FAMILIES[family](attn)
    config._attn_implementation = attn
    torch.manual_seed(0)
    model = cls(config)
    model.train()
    tapesac_core.checkpoint_modules(model, {layer})
    return model


def _run(base: torch.nn.Module, limit) -> tuple[int, list[tuple[int, int]]]:
    """Four steps under ``limit``: the must-only profile step's metered peak, and per planned
    step its (metered, predicted) peak. Every step sees the same batch (its sample's)."""
    model = copy.deepcopy(base)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    controller = Controller(
        model, limit, **SHORT_SCHEDULE, margin=0.0, meter_every=1, peak_correction=False
    )
    ids = token_ids(0, batch=BATCH, seq=SEQ, vocab=model.config.vocab_size)
    must_only, planned = None, []
    for _ in range(4):
        with controller.step(tokens=ids.numel()) as report:
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if report.mode == PROFILE:
            must_only = report.peak
        elif report.mode == PLANNED:
            planned.append((report.peak, report.predicted_peak))
    assert must_only and planned, "four steps: warm-up, profile, control, planned"
    return must_only, planned


def _check(family: str, attn: str) -> None:
    base = _model(family, attn)
    must_only, planned = _run(base, "1GiB")
    everything = planned[0][0]  # every block plain: no checkpointing's peak
    assert everything > must_only
    limit = (must_only + everything) // 2
    _, planned = _run(base, limit)
    metered, predicted = planned[0]
    figures = (family, attn, limit, predicted, metered)
    assert metered <= predicted, figures
    assert metered <= limit, figures
    # Eager paths: the causal mask a plain block lets go is not credited (module docstring).
    mask = BATCH * SEQ * SEQ * 4 if attn == "eager" else 0
    assert predicted - metered <= 0.01 * metered + mask, figures


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_falcon_first_planned_step_within_its_prediction_and_the_limit(attn):
    """The issue's held-out case: Falcon's eager attention returns its attention weights, which
    the caller drops; run plain, a block keeps them for backward all the same."""
    _check("falcon", attn)


@pytest.mark.slow
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "falcon"])
def test_first_planned_step_within_its_prediction_and_the_limit(family, attn):
    _check(family, attn)
