"""``tapesac_core.checkpoint`` as a drop-in for ``torch.utils.checkpoint.checkpoint``: torch's
keywords, the cases of PyTorch's own non-reentrant checkpoint tests that apply to CPU (told in
our words), double backward, and the wrappers that take a checkpoint function."""

import copy
import functools
import gc
import random
import weakref

import pytest
import torch
from support import assert_bitwise, block_paths, hf_model, step, token_ids
from torch import nn

import tapesac_core
from tapesac_core import TapeSACError

TORCH_KEYWORDS = {
    "use_reentrant": False,
    "preserve_rng_state": False,
    "determinism_check": "none",
    "debug": True,
    "early_stop": False,
    "context_fn": torch.utils.checkpoint.noop_context_fn,
}


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(100, 50), nn.ReLU(), nn.Linear(50, 20), nn.Tanh(), nn.Linear(20, 5), nn.ReLU()
    )


def test_no_torch_keyword_reaches_the_checkpointed_function() -> None:
    received = []

    def fn(x, **kwargs):
        received.append(kwargs)
        return x.sin()

    x = torch.randn(3, requires_grad=True)
    tapesac_core.checkpoint(fn, x, scale=2, **TORCH_KEYWORDS).sum().backward()
    assert received == [{"scale": 2}]
    assert torch.equal(x.grad, x.detach().cos())


@pytest.mark.parametrize(
    ("keyword", "value", "message"),
    [
        ("use_reentrant", True, "use_reentrant=False"),
        ("context_fn", lambda: (None, None), "context_fn"),
        ("determinism_check", "strict", "determinism_check='strict'"),
        ("debug", "yes", "debug must be a bool"),
    ],
)
def test_keywords_tapesac_cannot_honour_are_refused_naming_the_fix(keyword, value, message):
    called = []

    def fn(x):
        called.append(x)
        return x * 2

    with pytest.raises(TapeSACError, match=message):
        tapesac_core.checkpoint(fn, torch.ones(2, requires_grad=True), **{keyword: value})
    assert not called


def test_sequential_chunks_match_no_checkpointing() -> None:
    """Torch's ``test_checkpoint``/``test_checkpoint_module_list``: a sequential model run in two
    checkpointed chunks gives the uncheckpointed outputs and gradients."""
    model = _mlp()
    chunks = [nn.Sequential(*list(model)[:3]), nn.Sequential(*list(model)[3:])]
    x = torch.randn(1, 100)

    def plain():
        return model(x).sum()

    def chunked():
        h = x
        for chunk in chunks:
            h = tapesac_core.checkpoint(chunk, h, use_reentrant=False)
        return h.sum()

    for seed in range(3):  # recorded, then steady-state calls
        assert_bitwise(step(model, plain, seed), step(model, chunked, seed))


def test_the_forward_runs_once() -> None:
    """Torch's ``test_checkpoint_trigger`` counts a second forward in backward; TapeSAC replays
    the tape instead, so the Python forward runs once."""

    class Counted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return x * torch.tensor(2.0)

    blocks = [Counted() for _ in range(4)]
    h = x = torch.randn(3, 4, requires_grad=True)
    for b in blocks:
        h = tapesac_core.checkpoint(b, h.sin(), use_reentrant=False)
    h.sum().backward()
    assert [b.calls for b in blocks] == [1, 1, 1, 1]
    assert x.grad is not None


@pytest.mark.parametrize("preserve_rng_state", [True, False])
def test_dropout_draws_the_forward_s_numbers(preserve_rng_state: bool) -> None:
    """Torch's ``test_checkpoint_rng_cpu`` (and, where it needs a GPU, ``..._not_preserve_rng_
    state_and_without_reentrant``): dropout inside and around the block, gradients equal to no
    checkpointing's from the same generator state."""
    phase1, phase2 = nn.Dropout(), nn.Dropout()
    for _ in range(3):
        x = torch.randn(2000, requires_grad=True)
        state = torch.get_rng_state()
        out = tapesac_core.checkpoint(
            phase2, phase1(x), use_reentrant=False, preserve_rng_state=preserve_rng_state
        )
        out.sum().backward()
        with_checkpoint, x.grad = x.grad, None
        torch.set_rng_state(state)
        phase2(phase1(x)).sum().backward()
        assert torch.equal(with_checkpoint, x.grad)


def test_none_among_the_inputs() -> None:
    def fn(t1, t2):
        return t1 if t2 is None else t1 + t2

    x = torch.randn(1, 100, requires_grad=True)
    tapesac_core.checkpoint(fn, x, None, use_reentrant=False).sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


def _mixed(t1, t2, scale, t3):
    t4 = t1 + t2 * t3
    t5 = t1 * t2 + t3
    t4 *= scale
    t5 *= scale
    return scale, t4, None, True, t5, "bar", t1


def test_non_tensor_inputs_and_outputs_pass_through() -> None:
    """Torch's ``test_checkpoint_non_tensor_inputs_outputs``: numbers, None, bools and strings
    in and out, in-place writes, and three backward calls over the outputs."""
    t1, t2, t3 = (
        torch.rand(10, requires_grad=True),
        torch.rand(10, requires_grad=True),
        torch.rand(10),
    )
    scale = random.Random(0).randint(1, 10)
    res = tapesac_core.checkpoint(_mixed, t1, t2, scale, t3, use_reentrant=False)
    assert (res[0], res[2], res[3], res[5]) == (scale, None, True, "bar")
    assert res[6] is t1
    assert torch.equal(res[1], (t1 + t2 * t3) * scale)
    assert torch.equal(res[4], (t1 * t2 + t3) * scale)
    res[1].sum().backward(retain_graph=True)
    res[4].sum().backward(retain_graph=True)
    res[6].sum().backward()
    grads = t1.grad, t2.grad
    t1.grad = t2.grad = None
    ref = _mixed(t1, t2, scale, t3)
    torch.autograd.backward([ref[1].sum(), ref[4].sum(), ref[6].sum()])
    assert torch.equal(grads[0], t1.grad) and torch.equal(grads[1], t2.grad)


def test_a_call_with_no_tensors_returns_the_function_s_values() -> None:
    """Torch's ``test_checkpoint_no_tensors``."""
    rng = random.Random(1)
    t1, t2, t3, scale = rng.random(), rng.random(), rng.random(), rng.randint(1, 10)
    with torch.enable_grad():
        res = tapesac_core.checkpoint(_mixed, t1, t2, scale, t3, use_reentrant=False)
    assert res == _mixed(t1, t2, scale, t3)


def test_an_output_that_needs_no_grad_is_left_alone() -> None:
    """Torch's ``test_checkpoint_partial_grad``: backward from the output that requires grad."""

    def fn(t1, t2):
        return t1.exp(), t2

    x, other = torch.randn(1, 4, requires_grad=True), torch.randn(1, 4)
    out = tapesac_core.checkpoint(fn, x, other, use_reentrant=False)
    assert out[1] is other
    out[0].sum().backward()
    assert torch.equal(x.grad, x.detach().exp())


def test_writes_through_views_inside_the_block() -> None:
    def fn(x):
        y = x * 1.5
        y[:, :2].mul_(2.0)
        y.view(-1)[3:7].tanh_()
        return y.sin()

    for seed in range(3):
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(seed))
        ref, got = x.clone().requires_grad_(), x.clone().requires_grad_()
        fn(ref).sum().backward()
        tapesac_core.checkpoint(fn, got, use_reentrant=False).sum().backward()
        assert torch.equal(ref.grad, got.grad)


def _gradient_penalty(model: nn.Module, forward, x: torch.Tensor):
    """A loss through a first-order gradient taken with ``create_graph=True``, then its
    gradients: what gradient penalties and Hessian-vector products do."""
    out = forward(x)
    (g,) = torch.autograd.grad(out.pow(2).sum(), x, create_graph=True)
    loss = g.pow(2).sum() + out.sum()
    return loss.detach(), torch.autograd.grad(loss, [x, *model.parameters()], allow_unused=True)


@pytest.mark.parametrize("calls", [1, 3])
def test_double_backward_through_an_mlp_is_bitwise(calls: int) -> None:
    """Torch's ``test_checkpoint_valid`` (its non-reentrant half), bitwise, from recorded and
    steady-state calls."""
    model = _mlp()
    wrapped = tapesac_core.checkpoint_module(copy.deepcopy(model))
    for seed in range(calls):
        x = torch.randn(2, 100, generator=torch.Generator().manual_seed(seed), requires_grad=True)
        ref_loss, ref = _gradient_penalty(model, model, x)
        loss, got = _gradient_penalty(wrapped, wrapped, x)
        assert torch.equal(ref_loss, loss)
        assert all(torch.equal(a, b) for a, b in zip(ref, got))
        assert ref[0] is not None


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj, self.drop, self.scale = nn.Linear(8, 8), nn.Dropout(0.2), 1.0

    def forward(self, x):
        return self.drop(torch.tanh(self.proj(x)) * self.scale).sin()


def test_double_backward_with_dropout_and_a_diverged_call_is_bitwise() -> None:
    """Random draws replayed and a steady-state call that diverged (its scale changed): its
    backward runs the forward again, and double backward still matches."""
    torch.manual_seed(0)
    model = nn.Sequential(_Scaled(), _Scaled())
    wrapped = copy.deepcopy(model)
    tapesac_core.checkpoint_modules(wrapped, {_Scaled})
    with tapesac_core.trace() as blocks:
        for call in range(5):
            for layer in (*model, *wrapped):
                layer.scale = 1.0 + (call // 3) * 0.5
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(call), requires_grad=True)
            torch.manual_seed(call)
            ref_loss, ref = _gradient_penalty(model, model, x)
            torch.manual_seed(call)
            loss, got = _gradient_penalty(wrapped, wrapped, x)
            assert torch.equal(ref_loss, loss)
            assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert "diverged" in block_paths(blocks) and "steady" in block_paths(blocks)


def test_double_backward_through_a_qwen3_layer_is_bitwise() -> None:
    model, layer_class = hf_model("qwen3", dropout=0.0)
    model.config._attn_implementation = "eager"  # sdpa has no double backward on CPU
    wrapped = copy.deepcopy(model)
    tapesac_core.checkpoint_modules(wrapped, {layer_class})
    ids = token_ids(0, batch=2, seq=16, vocab=128)

    def forward_of(m):
        return lambda e: m(inputs_embeds=e).logits

    for _ in range(2):
        embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
        ref_loss, ref = _gradient_penalty(model, forward_of(model), embeds)
        loss, got = _gradient_penalty(wrapped, forward_of(wrapped), embeds)
        assert torch.equal(ref_loss, loss)
        same = [a is b is None or torch.equal(a, b) for a, b in zip(ref, got)]
        assert all(same), same
        assert sum(a is not None for a in ref) > 10


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj, self.drop = nn.Linear(16, 16), nn.Dropout(0.1)

    def forward(self, x, scale=1.0):
        return self.drop(torch.tanh(self.proj(x))) * scale + x


def test_torch_checkpoint_wrapper_takes_tapesac_as_its_function() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    plain = nn.Sequential(_Layer(), _Layer())
    wrapped = nn.Sequential(
        *(checkpoint_wrapper(copy.deepcopy(layer), checkpoint_fn=tapesac_core.checkpoint)
          for layer in plain)
    )  # fmt: skip
    with tapesac_core.trace() as blocks:
        for seed in range(3):
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(seed))
            ref = step(plain, lambda: plain(x).sum(), seed)
            loss, grads = step(wrapped, lambda: wrapped(x).sum(), seed)
            unwrapped = {k.replace("._checkpoint_wrapped_module", ""): g for k, g in grads.items()}
            assert_bitwise(ref, (loss, unwrapped))
    assert len(blocks) == 6


def test_hugging_face_checkpointing_takes_tapesac_as_its_function() -> None:
    """Transformers' ``_set_gradient_checkpointing(gradient_checkpointing_func=...)``: its
    decoder layers call the function with a ``functools.partial`` of the layer and torch's
    keywords; each call is a block of the layer."""
    model, _ = hf_model("qwen3", dropout=0.0)
    theirs = copy.deepcopy(model)
    theirs.train()
    theirs._set_gradient_checkpointing(
        enable=True,
        gradient_checkpointing_func=functools.partial(tapesac_core.checkpoint, use_reentrant=False),
    )
    ids = token_ids(0, batch=2, seq=16, vocab=128)
    with tapesac_core.trace() as blocks:
        for seed in range(3):
            ref = step(model, lambda: model(input_ids=ids, labels=ids).loss, seed)
            got = step(theirs, lambda: theirs(input_ids=ids, labels=ids).loss, seed)
            assert_bitwise(ref, got)
    assert len(blocks) == 6
    assert block_paths(blocks)[-2:] == ["steady", "steady"], block_paths(blocks)


class _LayerOfTransformers4(_Layer):
    """A decoder layer as transformers 4 checkpoints it: its own ``__call__`` hands
    ``partial(super().__call__, **kwargs)`` to its checkpoint function."""

    gradient_checkpointing = False

    def __call__(self, *args, **kwargs):
        if self.gradient_checkpointing and self.training:
            return self._gradient_checkpointing_func(
                functools.partial(super().__call__, **kwargs), *args
            )
        return super().__call__(*args, **kwargs)


def test_transformers_4_style_layers_take_tapesac_as_their_function() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(_LayerOfTransformers4(), _LayerOfTransformers4())
    theirs = copy.deepcopy(plain)
    for layer in theirs:
        layer.gradient_checkpointing = True
        layer._gradient_checkpointing_func = functools.partial(
            tapesac_core.checkpoint, use_reentrant=False
        )
    with tapesac_core.trace() as blocks:
        for seed in range(3):
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(seed))
            ref = step(plain, lambda: plain[1](plain[0](x), scale=0.5).sum(), seed)
            got = step(theirs, lambda: theirs[1](theirs[0](x), scale=0.5).sum(), seed)
            assert_bitwise(ref, got)
    assert block_paths(blocks)[-2:] == ["steady", "steady"], block_paths(blocks)


def test_a_function_made_per_call_keeps_nothing_it_captured() -> None:
    """A lambda whose first argument is a module is no method of it: the call stays a function
    block, and nothing it captured outlives its step in the module's cache."""
    layer, masks = nn.Linear(16, 16), []
    for _ in range(3):
        _masked_step(layer, masks)
    gc.collect()
    assert all(ref() is None for ref in masks)


def _masked_step(layer: nn.Module, masks: list) -> None:
    mask = torch.rand(4, 16)
    masks.append(weakref.ref(mask))
    h = torch.randn(4, 16, requires_grad=True)
    out = tapesac_core.checkpoint(lambda lyr, x: lyr(x) * mask, layer, h, use_reentrant=False)
    out.sum().backward()


def test_keywords_bound_in_a_partial_reach_the_function_under_torch_s_checkpoint() -> None:
    """A plan entry that runs a block under ``torch.utils.checkpoint``: the function's own
    keywords named as torch's (``early_stop``) are the function's."""

    def scaled(x, early_stop="no"):
        return x.sin() * (2.0 if early_stop == "yes" else 3.0)

    x = torch.randn(5, requires_grad=True)
    with tapesac_core.use_plan({"default": [tapesac_core.TORCH_CHECKPOINT]}):
        out = tapesac_core.checkpoint(functools.partial(scaled, early_stop="yes"), x)
    assert torch.equal(out, scaled(x, early_stop="yes"))


def test_a_region_that_is_not_a_name_is_an_error() -> None:
    with pytest.raises(TypeError, match="region must be a str"):
        tapesac_core.checkpoint(lambda x, region: x * region, torch.ones(2), region=torch.ones(2))
