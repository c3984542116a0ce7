"""A diverged call's backward runs its forward again, checked against what the forward ran
(``tape/rerun_checks.py``): a forward that changes Python state it reads (a counter, Python's
``random``), or a loop that changes it between forward and backward, would give other saved
tensors the second time and wrong gradients silently (torch's checkpoint gives them); it is a
``TapeSACError`` naming the fix. A forward that runs the same again stays bitwise."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from support import assert_bitwise, hf_model, step

import tapesac_core
from tapesac_core.errors import TapeSACError

D = 8


class Counting(torch.nn.Module):
    """A forward that counts its calls and scales by the count, or draws its scale from
    Python's ``random``; ``ops``: under autocast, which its calls cannot be checked under, so
    that its ops are checked one by one."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.lin = torch.nn.Linear(D, D)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.how == "ops"):
            h = self.lin(x).float()
        if self.how == "random":
            scale = 1.0 + random.random()
        else:
            self.calls += 1
            scale = 1.0 + 0.01 * self.calls
        return torch.tanh(h * scale) * h


@pytest.mark.parametrize("how", ["calls", "ops", "random"])
def test_a_forward_that_changes_what_it_reads_is_refused_not_wrong(how: str) -> None:
    """Each call after the first departs from its tape (another scale); its backward's run of
    the forward would scale by yet another number. Without the check (before this module)
    every such step gave wrong gradients silently."""
    torch.manual_seed(0)
    random.seed(0)
    block = tapesac_core.checkpoint_module(Counting(how))
    x = torch.randn(4, D, requires_grad=True)
    block(x).sum().backward()  # recorded
    with pytest.raises(TapeSACError) as raised:
        block(x).sum().backward()
    message = str(raised.value)
    assert "ran differently when run again in backward than in forward" in message
    unit = "op" if how == "ops" else "call"
    assert f"{unit} " in message and ": argument 1 is " in message and "the forward's" in message
    assert "update such state in the training loop" in message


class Scaled(torch.nn.Module):
    """Reads a scale the training loop sets; ``tail``: ops after the scaled one that a trail
    logs (a list argument, a random op, an in-place op, a parameter read again)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(D, D)
        self.b = torch.nn.Linear(D, D)
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x) * self.scale
        h = torch.cat([h, torch.nn.functional.dropout(h, 0.25)], dim=0)
        h = self.b(h).relu_()
        return h + self.a.weight.sum() * 0.1


def test_a_loop_change_between_forward_and_backward_of_a_diverged_call_is_refused() -> None:
    torch.manual_seed(0)
    block = tapesac_core.checkpoint_module(Scaled())
    x = torch.randn(4, D, requires_grad=True)
    block(x).sum().backward()
    block.scale = 2.0
    loss = block(x).sum()  # departs: another scale
    block.scale = 3.0
    with pytest.raises(TapeSACError, match=r"argument 1 is 3\.0, the forward's 2\.0"):
        loss.backward()


def test_diverged_calls_that_run_the_same_again_stay_bitwise() -> None:
    """The scale changes between calls, never between a forward and its backward: each call
    that departs runs its trail again (a list argument, dropout, an in-place op) and passes."""
    torch.manual_seed(0)
    reference = Scaled()
    block = tapesac_core.checkpoint_module(copy.deepcopy(reference))
    diverged = 0
    for i, scale in enumerate((1.0, 1.0, 2.0, 2.0, 2.0, 0.5, 0.5)):
        reference.scale = block.scale = scale
        x = torch.randn(4, D, generator=torch.Generator().manual_seed(i), requires_grad=True)
        ref = step(reference, lambda: reference(x).pow(2).sum(), seed=i)
        with tapesac_core.trace() as blocks:
            got = step(block, lambda: block(x).pow(2).sum(), seed=i)
        assert_bitwise(ref, got)
        diverged += blocks[0].diverged is not None
    assert diverged >= 2, "no call departed: the test checks nothing"


def _diverged_calls_bitwise(
    reference: torch.nn.Module, block: torch.nn.Module, x: torch.Tensor, nargs: int = 1
) -> None:
    """``block``'s calls (a checkpointed copy of ``reference``) at scales 1, 1, 2, 2, 0.5, set
    between calls: every call bitwise with ``reference``'s, at least two departing from their
    tape."""
    diverged = 0
    for i, scale in enumerate((1.0, 1.0, 2.0, 2.0, 0.5)):
        reference.scale = block.scale = scale
        inputs = x.detach().requires_grad_()
        ref = step(reference, lambda: reference(*[inputs] * nargs).float().pow(2).sum(), seed=i)
        ref_input = inputs.grad
        inputs.grad = None
        with tapesac_core.trace() as blocks:
            got = step(block, lambda: block(*[inputs] * nargs).float().pow(2).sum(), seed=i)
        assert_bitwise(ref, got)
        assert torch.equal(ref_input, inputs.grad)
        diverged += blocks[0].diverged is not None
    assert diverged >= 2, "no call departed: the test checks nothing"


class SelfAttention(torch.nn.Module):
    """``nn.MultiheadAttention`` called with one tensor as query, key and value: its fast path
    and its packs depend on ``query is key``."""

    def __init__(self) -> None:
        super().__init__()
        self.mha = torch.nn.MultiheadAttention(D, 2, batch_first=True)
        self.scale = 1.0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.mha(q * self.scale, k, v, need_weights=False)[0]


def test_a_tensor_passed_twice_is_one_tensor_when_the_forward_runs_again() -> None:
    """The run in backward detaches each input object once: ``attn(x, x, x)`` runs the path it
    ran in forward (before, it ran another and failed on the saved tensors' count)."""
    torch.manual_seed(0)
    reference = SelfAttention()
    block = tapesac_core.checkpoint_module(copy.deepcopy(reference))
    _diverged_calls_bitwise(reference, block, torch.randn(1, 4, D), nargs=3)


class AutocastInside(torch.nn.Module):
    """Enters autocast itself and casts one weight twice (no autocast around the block)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(D, D)
        self.scale = 1.0
        # The reference casts as TapeSAC's forward does (its cache off); None: autocast's default.
        self.cache: bool | None = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=self.cache):
            h = self.lin(x * self.scale)
            return self.lin(h.relu()).float()


def test_the_forward_runs_again_without_autocasts_weight_cache_as_it_ran() -> None:
    torch.manual_seed(0)
    reference = AutocastInside()
    block = tapesac_core.checkpoint_module(copy.deepcopy(reference))
    block.cache = None
    _diverged_calls_bitwise(reference, block, torch.randn(4, D))


class StopGradient(torch.nn.Module):
    """Reads a parameter through ``.detach()``, as stop-gradient tricks do."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(D, D)
        self.b = torch.nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return torch.nn.functional.linear(h, self.b.weight.detach(), self.b.bias).tanh() * h


def test_a_parameter_read_through_detach_is_that_parameter_to_the_call_check() -> None:
    """At the torch-function level a detached parameter is its ``Leaf``: calls in steady state
    (before, each departed from its tape, and its run in backward could not be checked)."""
    torch.manual_seed(0)
    reference = StopGradient()
    block = tapesac_core.checkpoint_module(copy.deepcopy(reference))
    x = torch.randn(4, D, requires_grad=True)
    paths = []
    for i in range(4):
        ref = step(reference, lambda: reference(x).pow(2).sum(), seed=i)
        with tapesac_core.trace() as blocks:
            got = step(block, lambda: block(x).pow(2).sum(), seed=i)
        assert_bitwise(ref, got)
        paths.append(blocks[0].steady)
    assert paths == [False, True, True, True]


class Tables(torch.nn.Module):
    """Reads a plain tensor attribute (not a buffer): ``tables[calls % 2]``, its call counter
    counted by the forward, or ``mask``, which the loop may replace."""

    def __init__(self, counted: bool) -> None:
        super().__init__()
        self.counted = counted
        self.lin = torch.nn.Linear(D, D)
        self.tables = [torch.randn(D), torch.randn(D)]
        self.mask = torch.randn(D)
        self.calls = 0
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x) * self.scale
        if self.counted:
            self.calls += 1
            t = self.tables[self.calls % 2]
        else:
            t = self.mask
        return torch.tanh(h * t) * h


@pytest.mark.parametrize("counted", [True, False])
def test_the_forward_run_again_must_read_the_forwards_outside_tensors(counted: bool) -> None:
    """Tensors read from outside the block are known to the checks by layout only: the run in
    backward must read the very tensors the forward read (two tables of one layout picked by a
    counter, or a mask the loop replaced between forward and backward)."""
    torch.manual_seed(0)
    block = tapesac_core.checkpoint_module(Tables(counted))
    x = torch.randn(4, D, requires_grad=True)
    block(x).sum().backward()
    block.scale = 2.0  # the next call departs from its tape
    loss = block(x).sum()
    if not counted:
        block.mask = torch.randn(D)
    with pytest.raises(TapeSACError, match="from outside the block, another than the forward's"):
        loss.backward()


SHIFT = torch.ones(D)


class Shifted(torch.nn.Module):
    """Scales by a tensor from outside the block, which autograd saves."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(D, D)
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x) * self.scale
        return torch.tanh(h * SHIFT) * h


def test_the_forward_run_again_must_read_outside_tensors_unwritten() -> None:
    """The loop writes the tensor between a diverged call's forward and its backward: run
    again, the forward would read the written values."""
    torch.manual_seed(0)
    block = tapesac_core.checkpoint_module(Shifted())
    x = torch.randn(4, D, requires_grad=True)
    block(x).sum().backward()
    block.scale = 2.0
    loss = block(x).sum()
    SHIFT.add_(1.0)
    with pytest.raises(TapeSACError, match=r"was written since the forward read it \(version"):
        loss.backward()


@pytest.mark.parametrize("family", ["gpt2", "qwen3"])
def test_hugging_face_layers_run_without_their_cache_in_training(family: str) -> None:
    """A Hugging Face model at its default ``use_cache=True``: the layers' cache is left out of
    checkpointed training calls (GPT-2 takes it by position, Qwen3 by keyword), as Hugging
    Face's checkpointing leaves it out, so that a call that departs from its tape (dropout's
    ``p`` changed) runs again without appending its keys twice. Every step bitwise."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

    model, layer = hf_model(family, 0.1)
    assert model.config.use_cache
    reference = copy.deepcopy(model)
    tapesac_core.checkpoint_modules(model, {layer})
    diverged = 0
    for i, p in enumerate((0.1, 0.1, 0.2, 0.2, 0.0)):
        for m in (reference, model):
            for module in m.modules():
                if isinstance(module, torch.nn.Dropout):
                    module.p = p
                if isinstance(module, Qwen3Attention):
                    module.attention_dropout = p
        ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(i))
        ref = step(reference, lambda: reference(input_ids=ids, labels=ids).loss, seed=i)
        with tapesac_core.trace() as blocks, pytest.warns(UserWarning, match="cache is off"):
            got = step(model, lambda: model(input_ids=ids, labels=ids).loss, seed=i)
        assert_bitwise(ref, got)
        diverged += sum(b.diverged is not None for b in blocks)
    assert diverged >= 2, "no call departed: the test checks nothing"


def test_a_hugging_face_cache_that_holds_keys_is_kept() -> None:
    """A cache the user filled (a prefix, as prefix tuning passes) is read by the layers: kept,
    where an empty one is left out of a training call."""
    from transformers import DynamicCache

    from tapesac_core.blocks.hf_cache import without_hf_cache

    layer = torch.nn.Linear(D, D)
    prefix = DynamicCache()
    prefix.update(torch.randn(1, 2, 3, D), torch.randn(1, 2, 3, D), 0)
    empty = DynamicCache()
    args, kwargs = without_hf_cache(layer, (prefix,), {"cache": prefix, "use_cache": True})
    assert args == (prefix,) and kwargs == {"cache": prefix, "use_cache": True}
    with pytest.warns(UserWarning, match="cache is off"):
        args, kwargs = without_hf_cache(layer, (empty,), {"cache": empty, "use_cache": True})
    assert args == (None,) and kwargs == {"cache": None, "use_cache": False}
    layer.eval()
    assert without_hf_cache(layer, (empty,), {}) == ((empty,), {})


def test_a_hugging_face_cache_passed_to_the_next_training_call_is_refused() -> None:
    """The cache a training call returns stays empty (its layers left it out): passed to the
    next training call (segment recurrence), it would give no context, silently; it is a
    ``TapeSACError`` naming the fix."""
    model, layer = hf_model("llama", 0.0)
    tapesac_core.checkpoint_modules(model, {layer})
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with pytest.warns(UserWarning, match="cache is off"):
        first = model(input_ids=ids[:, :8], labels=ids[:, :8], use_cache=True)
    assert first.past_key_values.get_seq_length() == 0
    with pytest.raises(TapeSACError, match="do not pass caches between training calls"):
        model(input_ids=ids[:, 8:], labels=ids[:, 8:], past_key_values=first.past_key_values)
