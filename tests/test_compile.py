"""torch.compile on a model with TapeSAC blocks: the blocks are excluded from tracing (they run
eagerly, recorded and replayed), the code around them compiles, without recompiling per block."""

import copy
import warnings

import pytest
import torch
import torch._dynamo
from support import assert_bitwise, step
from torch._dynamo.testing import CompileCounterWithBackend

import tapesac_core
from tapesac_core.blocks import wrapping


class Mlp(torch.nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.up = torch.nn.Linear(d, 2 * d)
        self.down = torch.nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Net(torch.nn.Module):
    """Non-block ops before, between and after three blocks: four graphs for Dynamo.

    The blocks are called one by one: Dynamo skips (runs eagerly) a whole frame that breaks its
    graph inside a loop, with or without TapeSAC."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(d, d)
        self.blocks = torch.nn.ModuleList(Mlp(d) for _ in range(3))
        self.out = torch.nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks[0](torch.tanh(self.inp(x)))
        h = self.blocks[1](h * 2.0)
        h = self.blocks[2](h.sin())
        return self.out(h.cos()).square().mean()


def _compiled_run(
    model: torch.nn.Module, x: torch.Tensor
) -> tuple[CompileCounterWithBackend, tuple]:
    """Compile ``model`` with inductor (graphs counted); loss and gradients of its second step."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter)
    step(model, lambda: compiled(x))
    return counter, step(model, lambda: compiled(x))


@pytest.mark.slow
def test_compile_excludes_blocks_compiles_the_rest_and_matches_uncompiled_blocks_bitwise() -> None:
    torch.manual_seed(0)
    plain = Net()
    x = torch.randn(4, 16)
    reference = copy.deepcopy(plain)
    for block in reference.blocks:  # the same blocks left uncompiled, without TapeSAC
        block.forward = torch.compiler.disable(block.forward)
    ref_counter, ref = _compiled_run(reference, x)

    model = copy.deepcopy(plain)
    tapesac_core.checkpoint_modules(model, {Mlp})
    with (
        warnings.catch_warnings(record=True) as told,
        torch._dynamo.config.patch(recompile_limit=2, fail_on_recompile_limit_hit=True),
        tapesac_core.trace() as blocks,
    ):
        warnings.simplefilter("default")  # as outside pytest: a warning once per place
        counter, got = _compiled_run(model, x)
    try:
        entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(
            wrapping._checkpointed_forward.__code__
        )
    finally:
        torch._dynamo.reset()
    assert_bitwise(ref, got)
    # Before, between and after the blocks: four graphs, the same as the reference's.
    assert (counter.frame_count, counter.op_count) == (
        ref_counter.frame_count,
        ref_counter.op_count,
    )
    assert counter.frame_count == 4 and counter.op_count > 0
    # One cache entry serves every block (it guards nothing on them): no recompilation per block
    # (with three blocks and a limit of two, a per-block guard would have hit the limit, which
    # this test makes an error).
    assert len(entries) <= 1
    # The blocks ran recorded and replayed, all six (two steps), and the log said so once.
    assert len(blocks) == 6 and all(b.replayed for b in blocks)
    assert [str(w.message).count("leaves checkpointed blocks uncompiled") for w in told] == [1]


def test_a_compiled_function_block_runs_eagerly_and_exactly() -> None:
    def gelu_block(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(x.sin()) * x

    # A fixed input: inductor's exp (outside the block) can differ from eager's by an ulp on some
    # inputs, which would then show in the gradient whatever the block does.
    torch.manual_seed(0)
    x = torch.randn(8, requires_grad=True)
    ref = torch.autograd.grad(gelu_block(x).sum(), x)
    torch._dynamo.reset()
    try:
        with tapesac_core.trace() as blocks:
            out = torch.compile(
                lambda t: tapesac_core.checkpoint(gelu_block, t.exp()).sum(), backend="inductor"
            )(x)
            got = torch.autograd.grad(out, x)
    finally:
        torch._dynamo.reset()
    x_exp = x.exp()  # the reference through exp, as the compiled function computes it
    assert len(blocks) == 1 and blocks[0].replayed
    assert blocks[0].tape.name.endswith("gelu_block")
    ref = torch.autograd.grad(gelu_block(x_exp).sum(), x)
    assert torch.equal(ref[0], got[0])
