"""Random ops replay bitwise: generator state captured at record time, restored around replay."""

import pytest
import torch
import torch.nn.functional as F
from support import assert_bitwise, step

import tapesac_core
from examples.kernels import FusedDropout
from tapesac_core import TapeSACError
from tapesac_core.tape.ops import op_info


class Noisy(torch.nn.Module):
    """Dropout, attention dropout, rand_like noise and a random op on a user generator."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 48)
        self.generator = generator

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.proj(x).view(2, 4, 8, 48).chunk(3, dim=-1)
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3)
        noise = torch.rand_like(a)
        gate = torch.empty_like(a).bernoulli_(0.5, generator=self.generator)
        return F.dropout(a * noise * gate, 0.2, training=True)


def _case(generator=None):
    torch.manual_seed(0)
    module = Noisy(generator)
    x = torch.randn(64, 16, requires_grad=True)
    return module, x, lambda: (module(x) ** 2).sum()


def test_random_ops_replay_bitwise_and_leave_generators_where_they_were() -> None:
    generator = torch.Generator().manual_seed(7)
    module, x, loss = _case(generator)
    ref = step(module, loss)
    after_ref = (torch.rand(4), torch.rand(4, generator=generator))
    generator.manual_seed(7)
    tapesac_core.checkpoint_module(module)
    with tapesac_core.trace() as blocks:
        got = step(module, loss)
    after = (torch.rand(4), torch.rand(4, generator=generator))
    assert_bitwise(ref, got)
    # Replay restored the streams it borrowed: training continues on the same random numbers.
    assert all(torch.equal(a, b) for a, b in zip(after_ref, after))
    tape = blocks[0].tape
    random_nodes = {n.name for n in tape.nodes if n.rng is not None}
    # On CPU, attention with dropout takes the math path: its dropout is a bernoulli_ too.
    assert random_nodes == {"aten.rand_like.default", "aten.bernoulli_.float"}
    assert sum(n.rng is not None for n in tape.nodes) == 4
    user = [
        n.rng[0]
        for n in tape.nodes
        if n.name == "aten.bernoulli_.float" and n.kwargs.get("generator") is not None
    ]
    # The dispatcher hands over a new wrapper of the same generator.
    assert [g.initial_seed() for g in user] == [7]
    replayed = {tape.nodes[i].name for i in blocks[0].replayed}
    assert random_nodes <= replayed


def test_attention_without_dropout_is_not_treated_as_random() -> None:
    q = torch.randn(1, 2, 8, 4, requires_grad=True)
    tape = tapesac_core.record(lambda q: F.scaled_dot_product_attention(q, q, q, dropout_p=0.0), q)
    (node,) = [n for n in tape.nodes if "attention" in n.name]
    assert node.rng is None


def test_a_random_op_whose_generator_cannot_be_captured_is_an_error() -> None:
    x = torch.randn(4, requires_grad=True)

    def meta_noise(x):
        return x * torch.rand(4, device="meta").sum().to("cpu", copy=False).new_zeros(()) + x

    with pytest.raises(TapeSACError, match="random generator of device meta"):
        tapesac_core.checkpoint(meta_noise, x)


class _FusedNoise(torch.autograd.Function):
    """``x * noise`` with Gaussian noise drawn inside forward; no ``dropout_p`` to tell."""

    @staticmethod
    def forward(ctx, x, scale):
        noise = 1 + scale * torch.randn_like(x)
        ctx.save_for_backward(noise)
        return x * noise

    @staticmethod
    def backward(ctx, grad):
        (noise,) = ctx.saved_tensors
        return grad * noise, None


def _two_returns(x, _):
    return x.new_empty(x.shape), x.new_empty(x.shape)


_RANDOM_KERNELS = {
    # Taken as random by its schema: a dropout probability above 0.
    "dropout_p": (
        FusedDropout,
        tapesac_core.register_kernel(
            "tapesac_test_random::fused_dropout",
            FusedDropout,
            schema="(Tensor x, float dropout_p) -> (Tensor, Tensor)",
            fake=_two_returns,
        ),
        0.5,
    ),
    # Declared random at registration.
    "random=True": (
        _FusedNoise,
        tapesac_core.register_kernel(
            "tapesac_test_random::fused_noise",
            _FusedNoise,
            schema="(Tensor x, float scale) -> (Tensor, Tensor)",
            fake=_two_returns,
            random=True,
        ),
        0.5,
    ),
}


@pytest.mark.parametrize("kind", list(_RANDOM_KERNELS))
def test_custom_op_that_draws_random_numbers_replays_bitwise(kind) -> None:
    function, kernel, p = _RANDOM_KERNELS[kind]
    torch.manual_seed(0)
    x = torch.randn(8, 16, requires_grad=True)
    module = torch.nn.Linear(16, 16)

    def block(fused):
        return lambda x: (fused(module(x).sin(), p) ** 2).tanh()

    ref = step(module, lambda: block(function.apply)(x).sum())
    with tapesac_core.trace() as blocks:
        got = step(module, lambda: tapesac_core.checkpoint(block(kernel), x).sum())
    assert_bitwise(ref, got)
    (node,) = [n for n in blocks[0].tape.nodes if n.name.startswith("tapesac_test_random")]
    assert node.rng is not None and node.index in blocks[0].replayed


def test_custom_op_with_dropout_zero_captures_no_generator() -> None:
    _, kernel, _ = _RANDOM_KERNELS["dropout_p"]
    x = torch.randn(4, requires_grad=True)
    tape = tapesac_core.record(lambda x: kernel(x.sin(), 0.0).sin(), x)
    (node,) = [n for n in tape.nodes if n.name.startswith("tapesac_test_random")]
    assert node.rng is None


def test_an_untagged_op_taking_a_generator_counts_as_random() -> None:
    lib = torch.library.Library("tapesac_test_random_gen", "DEF")
    lib.define("noisy(Tensor x, Generator? g) -> Tensor")
    info = op_info(torch.ops.tapesac_test_random_gen.noisy.default)
    assert (info.random, info.generator_arg, info.plain) == (True, (1, "g"), False)
    assert not op_info(torch.ops.aten.add.Tensor).random


@torch.library.custom_op("tapesac_test_unannounced::noise", mutates_args=())
def unannounced_noise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` times noise drawn inside the kernel: no tag, no Generator, no dropout_p says so."""
    noise = 1 + 0.5 * torch.rand_like(x)
    return x * noise, noise


@unannounced_noise.register_fake
def _(x):
    return torch.empty_like(x), torch.empty_like(x)


def _noise_context(ctx, inputs, output):
    ctx.save_for_backward(output[1])


def _noise_backward(ctx, grad, _):
    (noise,) = ctx.saved_tensors
    return grad * noise


unannounced_noise.register_autograd(_noise_backward, setup_context=_noise_context)


class NoisyLayer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = unannounced_noise(self.proj(x).sin())  # autograd saves the noise
        return (y**2).tanh()


class NoisyStack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([NoisyLayer(), NoisyLayer()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


NOISE = ("tapesac_test_unannounced.noise.default", 0, 1)  # the noise output's coordinate


@pytest.mark.parametrize("plan", [None, {"NoisyLayer": {("aten.sin.default", 0, 0)}}])
def test_a_custom_op_drawing_random_numbers_unannounced_replays_bitwise(plan) -> None:
    torch.manual_seed(0)
    model, x = NoisyStack(), torch.randn(8, 16, requires_grad=True)
    ref = step(model, lambda: model(x).sum())
    tapesac_core.checkpoint_modules(model, {NoisyLayer})
    with tapesac_core.use_plan(plan or {}), tapesac_core.trace() as blocks:
        got = step(model, lambda: model(x).sum())
    assert_bitwise(ref, got)  # no controller, no verifying step
    for block in blocks:
        (node,) = [n for n in block.tape.nodes if n.name == NOISE[0]]
        assert node.rng is not None and node.index in block.replayed  # recomputed, same noise
    assert not op_info(torch.ops.tapesac_test_unannounced.noise.default).plain


def test_a_custom_op_declared_deterministic_captures_no_generator() -> None:
    model = NoisyStack()
    tapesac_core.checkpoint_modules(model, {NoisyLayer}, deterministic_ops={"mylib::other"})
    with tapesac_core.trace() as blocks:
        model(torch.randn(2, 16, requires_grad=True)).sum().backward()
    assert all(n.rng is not None for b in blocks for n in b.tape.nodes if n.name == NOISE[0])
    declared = tapesac_core.checkpoint_module(
        NoisyLayer(), deterministic_ops={"tapesac_test_unannounced::noise"}
    )
    with tapesac_core.trace() as blocks:
        declared(torch.randn(2, 16, requires_grad=True)).sum().backward()
    # Taken at its word (here a false one: the op does draw).
    assert [n.rng for n in blocks[0].tape.nodes if n.name == NOISE[0]] == [None]
    with pytest.raises(TapeSACError, match="'namespace::name'"):
        tapesac_core.checkpoint_module(NoisyLayer(), deterministic_ops={"noise"})
