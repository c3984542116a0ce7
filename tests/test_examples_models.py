"""Tests of the example models and the standard-library text data."""

import ast
import dataclasses
import itertools
import random
from pathlib import Path

import pytest
import torch
from support import token_ids

from examples import data, models
from examples.models import DecoderLM, ModelConfig

CONFIGS = {
    "dense": ModelConfig.tiny(),
    "dense_no_gate_mha_tied": ModelConfig.tiny(
        attention_output_gate=False, num_kv_heads=4, tie_word_embeddings=True
    ),
    "dense_dropout": ModelConfig.tiny(dropout=0.1),
    "moe": ModelConfig.tiny(moe=True),
    "moe_weights_on_input": ModelConfig.tiny(moe=True, routing_weights_on_input=True),
    "moe_skip_empty": ModelConfig.tiny(moe=True, skip_empty_experts=True),
    "moe_no_shared_top1": ModelConfig.tiny(moe=True, shared_expert=False, top_k=1, dropout=0.1),
}


def build(config: ModelConfig, seed: int = 0) -> DecoderLM:
    torch.manual_seed(seed)
    return DecoderLM(config)


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_shape_and_layer_classes(name: str) -> None:
    config = CONFIGS[name]
    model = build(config)
    assert model(token_ids(1, batch=3, seq=11)).shape == (3, 11, config.vocab_size)
    expected = "MoEDecoderLayer" if config.moe else "DecoderLayer"
    assert [type(layer).__name__ for layer in model.layers] == [expected] * config.num_layers


@pytest.mark.parametrize("name", CONFIGS)
def test_backward_reaches_every_parameter(name: str) -> None:
    model = build(CONFIGS[name])
    loss = model.loss(token_ids(1, batch=4, seq=16))
    loss.backward()
    assert torch.isfinite(loss)
    # 64 tokens over 4 experts: every expert receives tokens, so even skip_empty_experts runs them all.
    for param_name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), param_name


def test_query_projection_also_produces_the_gate() -> None:
    config = ModelConfig()
    attention = DecoderLM(config).layers[0].self_attn
    assert attention.q_proj.out_features == 2 * config.num_heads * config.head_dim
    assert attention.k_proj.out_features == config.num_kv_heads * config.head_dim


@pytest.mark.parametrize("name", ["dense", "moe_skip_empty"])
def test_model_is_causal(name: str) -> None:
    model = build(CONFIGS[name])
    ids = token_ids(1, batch=2, seq=12)
    changed = ids.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % 256
    torch.testing.assert_close(model(ids)[:, :8], model(changed)[:, :8], rtol=0, atol=1e-6)


@pytest.mark.parametrize("skip", [False, True])
def test_skip_empty_experts_runs_only_routed_experts(skip: bool) -> None:
    config = ModelConfig.tiny(moe=True, skip_empty_experts=skip)
    model = build(config)
    calls = []
    for expert in model.layers[0].mlp.experts:
        expert.register_forward_hook(lambda module, args, output: calls.append(module))
    # One token is routed to exactly top_k experts.
    model(token_ids(1, batch=1, seq=1))
    assert len(calls) == (config.top_k if skip else config.num_experts)


def test_skip_empty_experts_does_not_change_the_result() -> None:
    ids = token_ids(1, batch=1, seq=3)
    dense_loop = build(ModelConfig.tiny(moe=True))(ids)
    skipping = build(ModelConfig.tiny(moe=True, skip_empty_experts=True))(ids)
    assert torch.equal(dense_loop, skipping)


def test_routing_weights_on_input_changes_the_result() -> None:
    ids = token_ids(1, batch=2, seq=8)
    on_output = build(ModelConfig.tiny(moe=True))(ids)
    on_input = build(ModelConfig.tiny(moe=True, routing_weights_on_input=True))(ids)
    assert not torch.equal(on_output, on_input)


def test_loss_decreases_on_stdlib_text() -> None:
    model = build(ModelConfig.tiny())
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for input_ids in itertools.islice(data.batches(8, 64, seed=0), 30):
        optimizer.zero_grad()
        loss = model.loss(input_ids)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    # Starts near ln(256) = 5.55; learning byte statistics of Python source alone gets well below.
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        ({"num_kv_heads": 3}, ValueError, "multiple of num_kv_heads"),
        ({"num_kv_heads": 0}, ValueError, "num_kv_heads must be a positive int"),
        ({"hidden_size": 32.0}, ValueError, "hidden_size must be a positive int"),
        ({"head_dim": 7}, ValueError, "head_dim must be even"),
        ({"top_k": 5}, ValueError, "top_k"),
        ({"attention_output_gate": 1}, TypeError, "attention_output_gate must be a bool"),
        ({"moe": "yes"}, TypeError, "moe must be a bool"),
        ({"dropout": 1.0}, ValueError, "dropout"),
        ({"rms_norm_eps": 0.0}, ValueError, "rms_norm_eps"),
    ],
)
def test_config_validation(changes: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        ModelConfig(**changes)


def test_config_is_frozen_and_keyword_only() -> None:
    config = ModelConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.hidden_size = 8
    with pytest.raises(TypeError):
        ModelConfig(256)
    with pytest.raises(ValueError, match="num_kv_heads"):
        dataclasses.replace(config, num_kv_heads=3)


@pytest.mark.parametrize("name", ["dense_dropout", "moe_no_shared_top1"])
def test_same_seed_gives_bitwise_same_loss_and_gradients(name: str) -> None:
    ids = token_ids(1, batch=2, seq=16)
    runs = []
    for _ in range(2):
        model = build(CONFIGS[name], seed=7)
        torch.manual_seed(3)  # dropout masks
        loss = model.loss(ids)
        loss.backward()
        runs.append((loss, [param.grad for param in model.parameters()]))
    (loss_a, grads_a), (loss_b, grads_b) = runs
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True))


@pytest.mark.parametrize("name", ["dense", "moe_skip_empty"])
def test_forward_depends_on_no_global_state(name: str) -> None:
    model = build(CONFIGS[name])
    ids = token_ids(1, batch=2, seq=9)
    reference = model(ids)
    # Earlier calls with other shapes, other seeds and another default dtype must not matter.
    model(token_ids(5, batch=3, seq=17))
    random.seed(99)
    torch.manual_seed(99)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        again = model(ids)
    finally:
        torch.set_default_dtype(default_dtype)
    assert torch.equal(reference, again)


def test_models_module_does_not_use_tapesac() -> None:
    tree = ast.parse(Path(models.__file__).read_text())
    imported = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not any(name.startswith("tapesac") for name in imported), imported


def test_batches_are_deterministic_bytes_of_varying_length() -> None:
    first = list(itertools.islice(data.batches(4, 48, seed=0), 6))
    second = list(itertools.islice(data.batches(4, 48, seed=0), 6))
    other = next(data.batches(4, 48, seed=1))
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert not torch.equal(first[0], other)
    assert len({batch.shape[1] for batch in first}) > 1
    for batch in first:
        assert batch.dtype == torch.long and batch.shape[0] == 4 and 16 <= batch.shape[1] <= 48
        assert 0 <= batch.min() and batch.max() < 256


def test_documents_are_stdlib_sources() -> None:
    paths = data.stdlib_sources()
    assert paths == tuple(sorted(paths)) and len(paths) > 100
    assert not any("site-packages" in path.parts for path in paths)
    assert next(data.documents()) == paths[0].read_bytes()


def test_batches_rejects_bad_lengths() -> None:
    with pytest.raises(ValueError, match="min_len"):
        next(data.batches(2, 8, seed=0, min_len=1))
    with pytest.raises(ValueError, match="min_len"):
        next(data.batches(2, 8, seed=0, min_len=9))
