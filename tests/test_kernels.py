"""register_kernel: an autograd.Function becomes one dispatcher op with the same values and gradients."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from fused_kernel import NAMESPACE, FusedRMSNormGate, fused, fused_fake
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from tapesac_core.tape.kernels import register_kernel


class ScaledTanh(torch.autograd.Function):
    """tanh(x * w) * scale, saving only its inputs, written with a separate setup_context."""

    @staticmethod
    def forward(x: Tensor, w: Tensor, scale: float) -> Tensor:
        return torch.tanh(x * w) * scale

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        x, w, scale = inputs
        ctx.save_for_backward(x, w)
        ctx.scale = scale

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, w = ctx.saved_tensors
        local = grad * ctx.scale * (1 - torch.tanh(x * w) ** 2)
        return local * w, local * x, None


scaled_tanh = register_kernel(
    f"{NAMESPACE}::scaled_tanh",
    ScaledTanh,
    schema="(Tensor x, Tensor w, float scale=2.0) -> Tensor",
    fake=lambda x, w, scale: torch.empty_like(x),
    ctx_attributes=lambda x, w, scale: {"scale": scale},
)


class RecordOps(TorchDispatchMode):
    """Records the name of every op that reaches the dispatcher."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def fused_inputs(requires_grad: bool = True) -> tuple[Tensor, Tensor, Tensor, float]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 8, generator=generator, dtype=torch.float64, requires_grad=requires_grad)
    w = torch.randn(8, generator=generator, dtype=torch.float64, requires_grad=requires_grad)
    g = torch.randn(3, 4, 8, generator=generator, dtype=torch.float64, requires_grad=requires_grad)
    return x, w, g, 1e-6


def grads_of(fn: Any, args: tuple[Any, ...], use_second_output: bool = True) -> list[Tensor | None]:
    outs = fn(*args)
    generator = torch.Generator().manual_seed(1)
    loss = (outs[0] * torch.randn(outs[0].shape, generator=generator, dtype=outs[0].dtype)).sum()
    if use_second_output:
        loss = (
            loss
            + (outs[1] * torch.randn(outs[1].shape, generator=generator, dtype=outs[1].dtype)).sum()
        )
    tensors = [a for a in args if isinstance(a, Tensor) and a.requires_grad]
    return list(torch.autograd.grad(loss, tensors))


def qualname(name: str) -> str:
    return f"{NAMESPACE}::{name}"


def test_outputs_bitwise_equal_to_apply() -> None:
    args = fused_inputs()
    expected = FusedRMSNormGate.apply(*args)
    actual = fused(*args)
    assert len(actual) == 2
    assert all(torch.equal(a, e) for a, e in zip(actual, expected, strict=True))


@pytest.mark.parametrize("use_second_output", [True, False])
def test_gradients_bitwise_equal_to_apply(use_second_output: bool) -> None:
    args = fused_inputs()
    expected = grads_of(FusedRMSNormGate.apply, args, use_second_output)
    actual = grads_of(fused, args, use_second_output)
    assert all(torch.equal(a, e) for a, e in zip(actual, expected, strict=True))


def test_needs_input_grad_reaches_backward() -> None:
    x, w, g, eps = fused_inputs()
    w = w.detach()
    expected = grads_of(FusedRMSNormGate.apply, (x, w, g, eps))
    actual = grads_of(fused, (x, w, g, eps))
    assert all(torch.equal(a, e) for a, e in zip(actual, expected, strict=True))


def test_hand_written_backward_matches_autograd() -> None:
    x, w, g, eps = fused_inputs()

    def reference(x: Tensor, w: Tensor, g: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
        return y, y * torch.sigmoid(g)

    expected = grads_of(reference, (x, w, g, eps))
    actual = grads_of(fused, (x, w, g, eps))
    assert all(torch.allclose(a, e) for a, e in zip(actual, expected, strict=True))


def test_opcheck_passes() -> None:
    fused(*fused_inputs())
    torch.library.opcheck(torch.ops.tapesac_test_kernels.fused_rmsnorm_gate.default, fused_inputs())


@pytest.mark.parametrize("requires_grad", [True, False])
def test_is_one_dispatcher_call(requires_grad: bool) -> None:
    args = fused_inputs(requires_grad)
    with RecordOps() as wrapped:
        fused(*args)
    with RecordOps() as plain:
        FusedRMSNormGate.apply(*args)
    # Autograd itself detaches an output that backward saves (y here), for the op and for apply alike.
    saved_output_detach = ["aten.detach.default"] if requires_grad else []
    assert wrapped.names == [
        "tapesac_test_kernels.fused_rmsnorm_gate.default",
        *saved_output_detach,
    ]
    assert "aten.rsqrt.default" in plain.names


def test_ctx_only_tensors_are_saved_where_hooks_see_them() -> None:
    packed: list[Tensor] = []

    def pack(t: Tensor) -> Tensor:
        packed.append(t)
        return t

    x, w, g, eps = fused_inputs()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        FusedRMSNormGate.apply(x, w, g, eps)
    assert len(packed) == 4  # ctx.rstd is invisible to the hooks

    packed.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fused(x, w, g, eps)
    assert len(packed) == 5
    assert packed[-1].shape == (3, 4, 1)  # rstd


def test_function_saving_only_inputs() -> None:
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(5, 6, generator=generator, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, generator=generator, dtype=torch.float64, requires_grad=True)
    expected = ScaledTanh.apply(x, w, 2.0)
    actual = scaled_tanh(x, w)  # the schema default fills scale
    assert isinstance(actual, Tensor) and torch.equal(actual, expected)
    grad = torch.randn(5, 6, generator=generator, dtype=torch.float64)
    actual_grads = torch.autograd.grad(actual, (x, w), grad)
    expected_grads = torch.autograd.grad(expected, (x, w), grad)
    assert all(torch.equal(a, e) for a, e in zip(actual_grads, expected_grads, strict=True))
    torch.library.opcheck(torch.ops.tapesac_test_kernels.scaled_tanh.default, (x, w, 0.5))


FUSED_SCHEMA = "(Tensor x, Tensor w, Tensor g, float eps) -> (Tensor, Tensor, Tensor, Tensor)"
TANH_SCHEMA = "(Tensor x, Tensor w, float scale) -> Tensor"


def register_fused(name: str, schema: str = FUSED_SCHEMA, **overrides: Any) -> Any:
    options: dict[str, Any] = {
        "fake": fused_fake,
        "outputs": 2,
        "ctx_attributes": lambda x, w, g, eps: {"eps": eps},
    }
    return register_kernel(
        qualname(name), FusedRMSNormGate, schema=schema, **{**options, **overrides}
    )


def register_tanh(name: str, **overrides: Any) -> Any:
    options: dict[str, Any] = {
        "fake": lambda x, w, scale: torch.empty_like(x),
        "ctx_attributes": lambda x, w, scale: {"scale": scale},
    }
    return register_kernel(
        qualname(name), ScaledTanh, schema=TANH_SCHEMA, **{**options, **overrides}
    )


def test_duplicate_registration_is_refused() -> None:
    with pytest.raises(RuntimeError, match="already registered"):
        register_tanh("scaled_tanh")


def test_outputs_beyond_schema_returns_is_refused() -> None:
    with pytest.raises(ValueError, match="outputs=3 but the schema has 2 returns"):
        register_fused(
            "too_many_outputs",
            "(Tensor x, Tensor w, Tensor g, float eps) -> (Tensor, Tensor)",
            outputs=3,
        )


def test_schema_arguments_must_match_forward() -> None:
    with pytest.raises(ValueError, match=re.escape("takes 4 (x, w, g, eps)")):
        register_fused(
            "missing_argument", "(Tensor x, Tensor w, Tensor g) -> (Tensor, Tensor, Tensor, Tensor)"
        )


def test_schema_without_room_for_ctx_tensors_is_refused() -> None:
    kernel = register_fused(
        "no_ctx_returns", "(Tensor x, Tensor w, Tensor g, float eps) -> (Tensor, Tensor, Tensor)"
    )
    with pytest.raises(
        ValueError, match="keeps 2 tensors only on ctx but the schema has room for 1"
    ):
        kernel(*fused_inputs())


def test_wrong_fake_return_count_is_refused() -> None:
    kernel = register_tanh(
        "short_fake", fake=lambda x, w, scale: (torch.empty_like(x), torch.empty_like(x))
    )
    with (
        FakeTensorMode(),
        pytest.raises(ValueError, match="fake returned 2 tensors but the schema declares 1"),
    ):
        kernel(torch.randn(2), torch.randn(2), 1.0)


def test_attribute_missing_from_ctx_attributes_is_refused() -> None:
    kernel = register_fused("no_eps", ctx_attributes=None)
    with pytest.raises(
        ValueError,
        match=re.escape("forward sets ctx.eps = 1e-06, which ctx_attributes does not provide"),
    ):
        kernel(*fused_inputs())


def test_attribute_disagreeing_with_ctx_attributes_is_refused() -> None:
    kernel = register_fused("wrong_eps", ctx_attributes=lambda x, w, g, eps: {"eps": 2 * eps})
    with pytest.raises(ValueError, match="ctx_attributes returns 2e-06; they must agree"):
        kernel(*fused_inputs())


def test_fake_call_before_any_real_call_is_refused() -> None:
    kernel = register_tanh("never_ran")
    with FakeTensorMode(), pytest.raises(RuntimeError, match="has not run on real tensors yet"):
        kernel(torch.randn(2, requires_grad=True), torch.randn(2), 1.0)


class SavesInFlaggedOrder(torch.autograd.Function):
    """Saves its tensors in an order set by `swap`, so its ctx layout depends on an argument."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, swap: bool) -> Tensor:
        doubled = x * 2
        ctx.save_for_backward(*((doubled, x) if swap else (x, doubled)))
        ctx.swap = swap
        return x.sin()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        x = ctx.saved_tensors[1 if ctx.swap else 0]
        return grad * x.cos(), None


def test_layout_change_between_calls_is_refused() -> None:
    kernel = register_kernel(
        qualname("flagged"),
        SavesInFlaggedOrder,
        schema="(Tensor x, bool swap) -> (Tensor, Tensor)",
        fake=lambda x, swap: (torch.empty_like(x), torch.empty_like(x)),
        ctx_attributes=lambda x, swap: {"swap": swap},
    )
    kernel(torch.randn(3), False)
    with pytest.raises(RuntimeError, match="different tensors on ctx than on its first call"):
        kernel(torch.randn(3), True)


class SavesAView(torch.autograd.Function):
    """Saves a reshaped view of its input, as some Triton kernels do."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        flat = x.view(-1)
        ctx.save_for_backward(flat)
        return flat.exp().view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (flat,) = ctx.saved_tensors
        return grad * flat.exp().view_as(grad)


def test_ctx_view_of_input_is_refused() -> None:
    kernel = register_kernel(
        qualname("saves_view"),
        SavesAView,
        schema="(Tensor x) -> (Tensor, Tensor)",
        fake=lambda x: (torch.empty_like(x), x.new_empty(x.numel())),
    )
    with pytest.raises(ValueError, match="keeps a view of input x on ctx"):
        kernel(torch.randn(2, 3))


class SortWithIndices(torch.autograd.Function):
    """Sorted values and their (non-differentiable) indices; records what grads backward received."""

    materialize = True
    received: list[tuple[str, ...]] = []

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> tuple[Tensor, Tensor]:
        values, indices = torch.sort(x, dim=-1)
        ctx.mark_non_differentiable(indices)
        ctx.set_materialize_grads(SortWithIndices.materialize)
        ctx.save_for_backward(indices)
        return values, indices

    @staticmethod
    def backward(
        ctx: Any, grad_values: Tensor | None, grad_indices: Tensor | None
    ) -> Tensor | None:
        SortWithIndices.received.append(
            tuple(
                "none" if g is None else ("zeros" if not g.any() else "grad")
                for g in (grad_values, grad_indices)
            )
        )
        if grad_values is None:
            return None
        (indices,) = ctx.saved_tensors
        return torch.zeros_like(grad_values).scatter(-1, indices, grad_values)


def _sort_kernel(name: str, materialize: bool):
    SortWithIndices.materialize = materialize
    return register_kernel(
        qualname(name),
        SortWithIndices,
        schema="(Tensor x) -> (Tensor, Tensor)",
        fake=lambda x: (torch.empty_like(x), torch.empty_like(x, dtype=torch.long)),
        outputs=2,
    )


def _received(fn: Any, x: Tensor) -> tuple[list, Tensor, bool]:
    """Backward of a loss on the values only: what backward received, x's gradient, and
    whether the indices require grad."""
    SortWithIndices.received = []
    values, indices = fn(x)
    (grad,) = torch.autograd.grad((values * 3.0).sum(), x)
    return SortWithIndices.received, grad, indices.requires_grad


@pytest.mark.parametrize("materialize", [True, False])
def test_mark_non_differentiable_and_set_materialize_grads_behave_as_with_apply(
    materialize,
) -> None:
    kernel = _sort_kernel(f"sort_materialize_{materialize}", materialize)
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(0), requires_grad=True)
    got = _received(kernel, x)
    ref = _received(SortWithIndices.apply, x)
    assert got[0] == ref[0] == [("grad", "zeros" if materialize else "none")]
    assert torch.equal(got[1], ref[1])
    assert got[2] is ref[2] is False  # the indices get no gradient


class AddsInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        ctx.mark_dirty(x)
        return x.add_(1.0)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad


class KeepsAPair(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        ctx.pair = (x.sin(), x.cos())
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad * 2


def test_mark_dirty_is_refused_naming_the_fix() -> None:
    kernel = register_kernel(
        qualname("adds_in_place"),
        AddsInPlace,
        schema="(Tensor x) -> Tensor",
        fake=lambda x: torch.empty_like(x),
    )
    with pytest.raises(TypeError, match="called ctx.mark_dirty: return a new tensor instead"):
        kernel(torch.randn(3))


def test_a_container_of_tensors_on_ctx_is_refused_naming_the_fix() -> None:
    kernel = register_kernel(
        qualname("keeps_a_pair"),
        KeepsAPair,
        schema="(Tensor x) -> Tensor",
        fake=lambda x: torch.empty_like(x),
    )
    with pytest.raises(TypeError, match="ctx.pair to a container of tensors.*its own attribute"):
        kernel(torch.randn(3))
