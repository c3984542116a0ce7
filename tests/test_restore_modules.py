"""restore_modules undoes checkpoint_modules: the blocks' own forwards back, nothing left behind."""

import copy

import pytest
import torch
from support import SMALL, assert_bitwise, reference_and_copy, step, token_ids

import tapesac_core
from examples.models import DecoderLayer, ModelConfig
from tapesac_core import TapeSACError


def _attributes(model: torch.nn.Module) -> list[dict[str, int | None]]:
    """Each module's own attributes, a registry (of hooks, parameters, ...) by its size."""
    return [
        {k: len(v) if isinstance(v, dict) else None for k, v in vars(m).items()}
        for m in model.modules()
    ]


def _train(model: torch.nn.Module, seeds: range) -> list[tuple]:
    """One forward and backward per seed (the second call of a block runs in steady state)."""
    return [step(model, lambda: model.loss(token_ids(s)), seed=s) for s in seeds]


def _recorded(model: torch.nn.Module) -> list[str]:
    """The blocks one forward and backward of ``model`` records, by name."""
    with tapesac_core.trace() as blocks:
        _train(model, range(1))
    return [b.tape.name for b in blocks]


def test_restored_model_is_the_never_checkpointed_one() -> None:
    reference, model = reference_and_copy(**SMALL)
    _train(model, range(2))
    assert _attributes(model) != _attributes(reference)

    paths = tapesac_core.restore_modules(model)

    assert paths == ["layers.0", "layers.1", "layers.2"]
    assert _attributes(model) == _attributes(reference)  # no attribute, mark, hook or cache
    assert all(m.forward.__func__ is type(m).forward for m in model.modules())
    assert all(tapesac_core.block_config(m) is None for m in model.modules())
    assert _recorded(model) == []
    for ref, got in zip(_train(reference, range(2, 4)), _train(model, range(2, 4))):
        assert_bitwise(ref, got)


def test_restored_model_can_be_checkpointed_again() -> None:
    reference, model = reference_and_copy(**SMALL)
    _train(model, range(2))
    tapesac_core.restore_modules(model)

    assert tapesac_core.checkpoint_modules(model, {DecoderLayer}) == [
        "layers.0",
        "layers.1",
        "layers.2",
    ]
    assert len(_recorded(model)) == 3
    for ref, got in zip(_train(reference, range(2, 4)), _train(model, range(2, 4))):
        assert_bitwise(ref, got)
    tapesac_core.restore_modules(model)
    assert _attributes(model) == _attributes(reference)


def test_a_deep_copy_restores_its_own_blocks() -> None:
    reference, model = reference_and_copy(**SMALL)
    _train(model, range(2))
    checkpointed = _attributes(model)
    twin = copy.deepcopy(model)

    tapesac_core.restore_modules(twin)

    assert _attributes(twin) == _attributes(reference)
    assert _attributes(model) == checkpointed  # the original keeps its hooks
    assert len(_recorded(model)) == 3
    assert _recorded(twin) == []
    tapesac_core.restore_modules(model)
    assert _attributes(model) == _attributes(reference)


def test_a_forward_patched_before_checkpointing_comes_back() -> None:
    layer = DecoderLayer(ModelConfig(**SMALL))
    own = layer.forward
    layer.forward = lambda *args, **kwargs: own(*args, **kwargs)  # e.g. a library's hook
    patched = layer.forward
    tapesac_core.checkpoint_module(layer)

    assert tapesac_core.restore_modules(layer) == [""]
    assert layer.forward is patched


def test_restoring_a_model_without_blocks_names_the_fix() -> None:
    reference, model = reference_and_copy(**SMALL)
    with pytest.raises(TapeSACError, match=r"no module of DecoderLM is checkpointed.*Fix: pass"):
        tapesac_core.restore_modules(reference)
    tapesac_core.restore_modules(model)
    with pytest.raises(TapeSACError, match="restored already"):
        tapesac_core.restore_modules(model)
