"""Steady-state calls checked at the torch-function level (``tape/call_checks.py``): which tapes
take that check, and the changes it must still catch, bitwise with no checkpointing."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from support import assert_bitwise, block_paths, hf_model, step, token_ids
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

import tapesac_core
from tapesac_core.tape.steady import SteadyTape
from tapesac_core.tape.steady_cache import steady_cache

D = 8


def _entries(model: torch.nn.Module) -> list[SteadyTape]:
    return [
        e
        for m in model.modules()
        for e in steady_cache(m)._entries.values()
        if isinstance(e, SteadyTape)
    ]


@pytest.mark.parametrize(("family", "dropout"), [("qwen3", 0.0), ("gpt2", 0.1)])
def test_hugging_face_layers_are_checked_by_their_calls(family: str, dropout: float) -> None:
    model, layer = hf_model(family, dropout)
    reference = copy.deepcopy(model)
    tapesac_core.checkpoint_modules(model, {layer})
    ids = token_ids(0, batch=2, seq=16, vocab=128)
    with tapesac_core.trace() as blocks:
        for seed in range(3):
            ref = step(reference, lambda: reference(input_ids=ids, labels=ids).loss, seed)
            got = step(model, lambda: model(input_ids=ids, labels=ids).loss, seed)
            assert_bitwise(ref, got)
    assert block_paths(blocks)[-4:] == ["steady"] * 4
    entries = _entries(model)
    assert entries and all(e.calls is not None for e in entries), [
        e.calls_not_checked for e in entries
    ]


class Toggles(torch.nn.Module):
    """A block whose forward turns autocast on, or changes the default dtype, when the training
    loop says so: state below the torch-function level that changes the ops."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(D, D)
        self.autocast = False
        self.double = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            h = self.proj(x).tanh()
        saved = torch.get_default_dtype()
        if self.double:
            torch.set_default_dtype(torch.float64)
        try:
            scale = torch.tensor(1.5)  # float32 or float64: the default dtype decides
        finally:
            torch.set_default_dtype(saved)
        return (h.float() * scale).sin()


@pytest.mark.parametrize("knob", ["autocast", "double"])
def test_autocast_or_a_default_dtype_turned_on_inside_the_forward_is_a_divergence(knob) -> None:
    torch.manual_seed(0)
    reference = Toggles()
    block = tapesac_core.checkpoint_module(copy.deepcopy(reference))
    x = torch.randn(4, D)
    paths, why = [], []
    for call in range(4):
        for m in (reference, block):
            setattr(m, knob, call == 2)
        ref = step(reference, lambda: reference(x).sum())
        with tapesac_core.trace() as blocks:
            got = step(block, lambda: block(x).sum())
        assert_bitwise(ref, got)
        paths.extend(block_paths(blocks))
        why.extend(b.diverged for b in blocks)
    assert paths[1] == "steady" and paths[2] == "diverged"
    expected = "autocast is on" if knob == "autocast" else "the default dtype is torch.float64"
    assert why[2].startswith(expected), why[2]


class Reads(torch.nn.Module):
    """A block that runs under autocast, or runs an op with torch functions off. (Blocks whose
    sizes follow their data, ``.item()`` say, are checked op by op too: ``test_steady_checks``.)"""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.proj, self.how = torch.nn.Linear(D, D), how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        if self.how == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.proj(h).float()
        with torch._C.DisableTorchFunction():
            h = h.tanh()
        return h.sin()


@pytest.mark.parametrize(
    ("how", "why"),
    [
        ("autocast", "autocast is on"),
        ("hidden", "ran outside any torch function"),
    ],
)
def test_tapes_whose_calls_cannot_tell_are_checked_op_by_op(how: str, why: str) -> None:
    torch.manual_seed(0)
    reference = Reads(how)
    block = tapesac_core.checkpoint_module(copy.deepcopy(reference))
    x = torch.randn(4, D)
    with tapesac_core.trace() as blocks:
        for _ in range(3):
            assert_bitwise(
                step(reference, lambda: reference(x).sum()), step(block, lambda: block(x).sum())
            )
    assert block_paths(blocks)[-1] == "steady"
    (entry,) = _entries(block)
    assert entry.calls is None and why in str(entry.calls_not_checked)


class Hooked(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(D, D)
        self.hook = False
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        if self.hook:  # a tool's hook on some steps only: no op, no tensor made
            h.register_hook(self.seen.append)
        assert h.shape[0] == x.size(0) and h.dim() == 2
        return h.tanh()


def test_calls_that_dispatch_nothing_are_not_compared() -> None:
    torch.manual_seed(0)
    block = tapesac_core.checkpoint_module(Hooked())
    x = torch.randn(4, D, requires_grad=True)
    with tapesac_core.trace() as blocks:
        for call in range(4):
            block.hook = call == 2
            block(x).sum().backward()
    assert block_paths(blocks)[1:] == ["steady"] * 3
    assert len(block.seen) == 1 and block.seen[0].shape == (4, D)


class Cast(torch.nn.Module):
    """Casts a buffer and a frozen weight to the input's dtype: a no-op while their dtypes
    match, a copy once the training loop changes them (the ops differ, the calls do not)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(D, D)
        self.base = torch.nn.Parameter(torch.randn(D, D), requires_grad=False)
        self.register_buffer("scale", torch.full((D,), 0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x) + F.linear(x, self.base.to(x.dtype))
        return (h * self.scale.to(h.dtype)).tanh()


def _each_step(make, change, loss, steps: int = 4, around=None):
    """``make()`` and a checkpointed copy, ``change(model, i)`` before step ``i`` (``around(i)``:
    a context for both); per step whether loss and gradients were bitwise, and the paths."""
    torch.manual_seed(0)
    reference = make()
    block = tapesac_core.checkpoint_module(copy.deepcopy(reference))
    bitwise, paths, why = [], [], []
    for i in range(steps):
        change(reference, i)
        change(block, i)
        with around(i) if around else contextlib.nullcontext():
            ref = step(reference, lambda: loss(reference), seed=i)
        with tapesac_core.trace() as blocks, around(i) if around else contextlib.nullcontext():
            got = step(block, lambda: loss(block), seed=i)
        bitwise.append(
            torch.equal(ref[0], got[0]) and all(torch.equal(ref[1][n], got[1][n]) for n in ref[1])
        )
        paths.extend(block_paths(blocks))
        why.extend(b.diverged for b in blocks)
    return bitwise, paths, why


@pytest.mark.parametrize("leaf", ["scale", "base"])
def test_a_buffer_or_frozen_weight_of_another_dtype_is_a_divergence(leaf: str) -> None:
    x = torch.randn(4, D)

    def change(m, i):
        if i == 2 and leaf == "scale":
            m.scale = m.scale.double()
        if i == 2 and leaf == "base":
            m.base = torch.nn.Parameter(m.base.double(), requires_grad=False)

    bitwise, paths, why = _each_step(Cast, change, lambda m: m(x).sum())
    assert all(bitwise)
    assert paths[:3] == [str(tapesac_core.tape.steady.Recorded.FIRST_CALL), "steady", "diverged"]
    assert f"{leaf!r} with another layout" in why[2]


def test_an_attention_backend_chosen_inside_is_a_divergence() -> None:
    """A frozen attention over an input that needs no grad makes no autograd node and saves
    nothing: only the backends ``sdpa_kernel`` allows tell its ops apart."""

    class FrozenAttention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = torch.nn.Linear(D, 3 * D).requires_grad_(False)
            self.head = torch.nn.Linear(D, D)

        def forward(self, mem):
            q, k, v = self.qkv(mem).view(1, -1, 3, 2, D // 2).permute(2, 0, 3, 1, 4)
            ctx = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(-1, D)
            return self.head(ctx).tanh()

    mem = torch.randn(6, D)
    math_from_2 = lambda i: sdpa_kernel(SDPBackend.MATH) if i >= 2 else contextlib.nullcontext()  # noqa: E731
    bitwise, paths, why = _each_step(
        FrozenAttention, lambda m, i: None, lambda m: m(mem).sum(), around=math_from_2
    )
    assert all(bitwise)
    assert paths[1:3] == ["steady", "diverged"] and "dispatches by" in why[2]


class _TanhGelu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is F.gelu:
            kwargs["approximate"] = "tanh"
        return func(*args, **kwargs)


def test_a_torch_function_mode_of_the_user_s_turns_the_call_check_off() -> None:
    """A mode below TapeSAC's rewrites calls after they are checked: a steady-state call under
    one diverges, and a call recorded under one is checked op by op. The diverged call's
    recomputation runs without the user's mode, as ``torch.utils.checkpoint``'s does (modes are
    off in backward): that step alone is not bitwise, for either."""

    class MLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(D, D), torch.nn.Linear(D, D)

        def forward(self, x):
            return self.b(F.gelu(self.a(x)))

    x = torch.randn(4, D)
    bitwise, paths, why = _each_step(
        MLP,
        lambda m, i: None,
        lambda m: m(x).sum(),
        steps=5,
        around=lambda i: _TanhGelu() if i >= 2 else contextlib.nullcontext(),
    )
    assert paths[1:4] == ["steady", "diverged", str(tapesac_core.tape.steady.Recorded.FIRST_CALL)]
    assert why[2].startswith("another torch-function mode is on")
    assert paths[4] == "steady" and bitwise[:2] + bitwise[3:] == [True] * 4


def test_a_monitor_that_detaches_on_some_steps_is_no_divergence() -> None:
    class Monitored(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(D, D), torch.nn.Linear(D, D)
            self.log_now, self.seen = False, []
            self.a.register_forward_hook(self._monitor)

        def _monitor(self, module, args, out):
            if self.log_now:
                self.seen.append(out.detach())
                self.seen.append(out.data)

        def forward(self, x):
            return self.b(self.a(x).tanh()).tanh()

    x = torch.randn(4, D)
    bitwise, paths, _ = _each_step(
        Monitored, lambda m, i: setattr(m, "log_now", i % 3 == 2), lambda m: m(x).sum(), steps=6
    )
    assert all(bitwise) and paths[1:] == ["steady"] * 5


def test_a_long_list_argument_is_checked_op_by_op() -> None:
    class Gather(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(D, D)

        def forward(self, x):
            return self.proj(x)[:, [i % D for i in range(1000)]].tanh()

    x = torch.randn(4, D)
    bitwise, paths, _ = _each_step(Gather, lambda m, i: None, lambda m: m(x).sum(), steps=3)
    assert all(bitwise) and paths[1:] == ["steady"] * 2
