"""Dead nodes are never replayed, where torch's block recomputation (early_stop on or off) reruns them.

Ops are counted with a dispatch mode during backward; "recomputed" is what a checkpointed backward
runs beyond the same backward without checkpointing.
"""

import copy
from collections import Counter

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from support import OpCounter, brute_force_block, brute_force_replay

import tapesac_core
from examples.models import DecoderLayer, ModelConfig, MoEDecoderLayer, rotary_cos_sin

MM = "aten.mm.default"
# Autograd's own bookkeeping, not recomputation: unpacked saved tensors are wrapped with a detach,
# and gradient accumulation uses add_ or add depending on buffer ownership.
BOOKKEEPING = ("aten.detach.default", "aten.add_.Tensor")


def _block(config: ModelConfig) -> tuple[torch.nn.Module, tuple]:
    torch.manual_seed(0)
    layer = (MoEDecoderLayer if config.moe else DecoderLayer)(config)
    x = torch.randn(2, 8, config.hidden_size, requires_grad=True)
    cos, sin = rotary_cos_sin(8, config.head_dim, config.rope_theta, x)
    return layer, (x, cos, sin)


def _backward_ops(run) -> Counter:
    torch.manual_seed(1)
    out = run()
    loss = (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum()
    with OpCounter() as counter:
        loss.backward()
    for name in BOOKKEEPING:
        counter.counts.pop(name, None)
    return counter.counts


def recomputed(config: ModelConfig) -> dict[str, Counter]:
    """Ops recomputed in backward by TapeSAC (must-only) and by torch.utils.checkpoint."""
    layer, args = _block(config)
    plain = _backward_ops(lambda: layer(*args))
    torch_runs = {
        f"torch_early_stop_{flag}": _backward_ops(
            lambda flag=flag: torch_checkpoint.checkpoint(
                layer, *args, use_reentrant=False, early_stop=flag
            )
        )
        for flag in (True, False)
    }
    tapesac_layer = tapesac_core.checkpoint_module(copy.deepcopy(layer))
    with tapesac_core.trace() as blocks:
        tapesac = _backward_ops(lambda: tapesac_layer(*args))
    result = {name: counts - plain for name, counts in torch_runs.items()}
    result["tapesac"] = tapesac - plain
    result["tape"] = blocks[0].tape
    return result


# Metadata-only ops are replayed from recorded metadata: an empty_strided, then a fill.
REBUILT_AS = {
    "aten.empty_like.default": ["aten.empty_strided.default"],
    "aten.zeros_like.default": ["aten.empty_strided.default", "aten.fill_.Scalar"],
}


def _names(tape: tapesac_core.Tape, nodes: list[int]) -> Counter:
    return Counter(
        name for i in nodes for name in REBUILT_AS.get(tape.nodes[i].name, [tape.nodes[i].name])
    )


def _torch_names(tape: tapesac_core.Tape, nodes: list[int]) -> Counter:
    return Counter(tape.nodes[i].name for i in nodes)


def test_decoder_block_never_replays_its_down_projection_or_residual_add() -> None:
    r = recomputed(ModelConfig())
    tape = r["tape"]
    assert r["tapesac"] == _names(tape, brute_force_replay(tape))
    # q (with gate), k, v, o, gate, up: the down projection and the final add are dead.
    assert r["tapesac"][MM] == 6
    assert r["torch_early_stop_False"][MM] == 7
    assert r["torch_early_stop_False"]["aten.add.Tensor"] == r["tapesac"]["aten.add.Tensor"] + 1
    # Without dropout the dead tail lies after the last saved tensor: early_stop skips it too.
    assert r["torch_early_stop_True"][MM] == 6


def test_projection_followed_by_dropout_is_not_replayed() -> None:
    r = recomputed(ModelConfig(dropout=0.1))
    tape = r["tape"]
    assert r["tapesac"] == _names(tape, brute_force_replay(tape))
    # Backward reads only the dropout masks after o_proj and down_proj; down_proj is dead but
    # comes before the last saved tensor (the mask), so early_stop still reruns it.
    assert r["tapesac"][MM] == 6
    assert r["torch_early_stop_True"][MM] == 7
    assert r["torch_early_stop_False"][MM] == 7
    # The mask is rebuilt from recorded metadata: dropout's empty_like does not need its input.
    assert r["tapesac"]["aten.bernoulli_.float"] == 2


def test_experts_whose_outputs_are_only_summed_are_not_replayed() -> None:
    config = ModelConfig(moe=True, routing_weights_on_input=True)
    r = recomputed(config)
    tape = r["tape"]
    assert r["tapesac"] == _names(tape, brute_force_replay(tape))
    experts = config.num_experts
    # Attention (4) + router (1) + per expert gate and up + shared gate and up; no down projection.
    assert r["tapesac"][MM] == 4 + 1 + 2 * experts + 2
    assert r["torch_early_stop_True"][MM] == 4 + 1 + 3 * experts + 2
    assert r["torch_early_stop_False"][MM] == 4 + 1 + 3 * experts + 3
    # The token dispatch indices are mandatory: backward never recomputes nonzero.
    assert r["tapesac"]["aten.nonzero.default"] == 0
    assert r["torch_early_stop_True"]["aten.nonzero.default"] == experts


def _full_checkpoint_nodes(tape: tapesac_core.Tape) -> list[int]:
    """Eq. 4 for torch's plain checkpoint, which saves nothing but the inputs (not even S0)."""
    leaves = tape.leaves
    last = max(tape.values[v].node for v in tape.demand - leaves)
    return [n.index for n in tape.nodes[: last + 1]]


@pytest.mark.parametrize(
    "config",
    [ModelConfig(), ModelConfig(dropout=0.1), ModelConfig(moe=True, routing_weights_on_input=True)],
    ids=["dense", "dropout", "moe"],
)
def test_block_nodes_predict_torch_block_recomputation(config) -> None:
    """Eq. 4 on the tape counts what torch's checkpoint (early_stop=True) really reruns."""
    r = recomputed(config)
    tape = r["tape"]
    assert _torch_names(tape, _full_checkpoint_nodes(tape)) == r["torch_early_stop_True"]
    assert set(brute_force_replay(tape)) <= set(tape.block_nodes())
    assert tape.replay_nodes() == brute_force_replay(tape)
    assert tape.block_nodes() == brute_force_block(tape)
