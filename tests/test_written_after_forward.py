"""A tensor a block keeps for backward that code after the block writes in place: backward
would read the new values. An output the plan kept is replayed from its producers instead, as
where the plan does not keep it; an input, or a parameter or buffer, is an error at the block's
first unpack that reads it, recorded and steady-state calls alike (autograd raises so for the
tensors it saves itself). Before, the gradients were wrong, silently."""

import copy

import pytest
import torch

import tapesac_core
from tapesac_core.errors import TapeSACError

MM = ("aten.mm.default", 0, 0)


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16, 16))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x @ self.w
        return h, h.exp() * 2  # autograd saves exp's result, not h


def _grads(block: Block, x: torch.Tensor, write: bool) -> list[torch.Tensor]:
    block.w.grad = x.grad = None
    h, e = block(x)
    if write:
        h.add_(1)  # legal for autograd: it saved no tensor on h's storage
    (h.sin() + e).sum().backward()
    return [block.w.grad.clone(), x.grad.clone()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("plan", [{"r": {MM}}, {}], ids=["keeps_h", "must_only"])
def test_an_output_written_in_place_after_the_forward_is_replayed_where_the_block_keeps_it(
    plan,
) -> None:
    torch.manual_seed(0)
    reference = Block()
    block = tapesac_core.checkpoint_module(copy.deepcopy(reference), "r")
    x = torch.randn(8, 16, requires_grad=True)
    for call in range(3):  # recorded, then steady-state calls
        with tapesac_core.use_plan(plan), tapesac_core.trace() as traces:
            # Legal without checkpointing (autograd saved no tensor on h's storage): the block
            # drops the written h it kept and replays it, as where the plan does not keep it.
            assert _same(_grads(reference, x, write=True), _grads(block, x, write=True))
            assert _same(_grads(reference, x, write=False), _grads(block, x, write=False))
        # A block keeping a value autograd does not save records every call; else the calls
        # after the first run in steady state.
        assert [t.steady for t in traces] == ([False, False] if plan else [call > 0, True])
        if plan:
            assert 0 in traces[0].replayed and 0 not in traces[1].replayed  # h, once written


def test_an_input_written_in_place_after_the_forward_is_an_error() -> None:
    torch.manual_seed(0)
    block = tapesac_core.checkpoint_module(Block(), "r")
    x = torch.randn(8, 16)
    with tapesac_core.trace() as traces:
        for call in range(2):  # recorded, then in steady state
            h, e = block(x)
            x.mul_(2)  # the block keeps its input: autograd saved x for the matrix product too
            with pytest.raises(TapeSACError, match="written in place after its forward"):
                (h.sin() + e).sum().backward()
    assert [t.steady for t in traces] == [False, True]


def test_an_input_given_as_a_view_written_through_its_base_is_an_error_every_backward() -> None:
    torch.manual_seed(0)
    block = tapesac_core.checkpoint_module(Block(), "r")
    for call in range(2):
        buffer = torch.randn(128)
        h, e = block(buffer.view(8, 16))  # the view dies with the call; its counter lives on
        loss = (h.sin() + e).sum()
        loss.backward(retain_graph=True)  # before the write: as without checkpointing
        buffer.mul_(2)
        with pytest.raises(TapeSACError, match="written in place after its forward"):
            loss.backward()  # a second backward reads the block's storages again


class Two(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(16, 16))
        self.w2 = torch.nn.Parameter(torch.randn(16, 16))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x @ self.w1, (z @ self.w2).exp()


def test_a_backward_that_reads_no_written_storage_and_empty_storages_are_no_error() -> None:
    torch.manual_seed(0)
    reference = Two()
    block = tapesac_core.checkpoint_module(copy.deepcopy(reference), "r")

    def grad(m: Two) -> torch.Tensor:
        m.w2.grad = None
        g = torch.Generator().manual_seed(1)
        x, z, empty = (
            torch.randn(8, 16, generator=g),
            torch.randn(8, 16, generator=g),
            torch.zeros(0, 16),
        )
        a, b = m(x, z + empty.sum())
        x.mul_(2)  # only w1's gradient reads x, and this backward asks for w2's alone
        empty.zero_()  # writes nothing: every empty storage has address 0
        (a.sum() + b.sum()).backward(inputs=[m.w2])
        return m.w2.grad.clone()

    for _ in range(2):  # recorded, then in steady state
        assert torch.equal(grad(reference), grad(block))


class Toggled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16, 16))
        self.extra = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.w
        return (h * 1.0 if self.extra else h).sin()


def test_an_input_written_in_place_is_an_error_for_a_call_that_diverged_from_its_tape() -> None:
    torch.manual_seed(0)
    block = tapesac_core.checkpoint_module(Toggled(), "r")
    for call in range(3):
        block.extra = call == 2  # another op: the call departs from its tape, backward reruns it
        x = torch.randn(8, 16)
        with tapesac_core.trace() as traces:
            y = block(x)
            x.mul_(2)
            with pytest.raises(TapeSACError, match="written in place after its forward"):
                y.sum().backward()
        assert bool(traces[0].diverged) == (call == 2)


class Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 32)
        self.b = torch.nn.Linear(32, 16)
        self.register_buffer("scale", torch.full((32,), 0.5))
        self.extra = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x) * self.scale
        return self.b(torch.nn.functional.gelu(h * 1.0 if self.extra else h))


WRITES = {
    # Autograd saved no tensor on it (its consumers' inputs are saved): legal without
    # checkpointing, but a must-only backward recomputes from it.
    "a.bias": lambda m: m.a.bias.add_(1),
    # Autograd saved it: an error without checkpointing too.
    "a.weight": lambda m: m.a.weight.mul_(2),
    "scale": lambda m: m.scale.add_(1),
}


@pytest.mark.parametrize("leaf", list(WRITES))
def test_a_parameter_or_buffer_written_in_place_before_backward_is_an_error(leaf: str) -> None:
    torch.manual_seed(0)
    block = tapesac_core.checkpoint_module(Scaled(), "r")
    x = torch.randn(8, 16, requires_grad=True)
    with tapesac_core.trace() as traces:
        for call in range(3):  # recorded, then in steady state; the last one diverged
            block.extra = call == 2
            y = block(x)
            with torch.no_grad():
                WRITES[leaf](block)  # an optimizer step before backward, say
            with pytest.raises(
                TapeSACError, match=f"'{leaf}'.* was written in place after its forward"
            ):
                y.square().sum().backward()
    assert [t.steady for t in traces] == [False, True, False]
    assert [bool(t.diverged) for t in traces] == [False, False, True]


def test_a_parameter_replaced_or_written_after_backward_is_no_error() -> None:
    torch.manual_seed(0)
    reference = Scaled()
    block = tapesac_core.checkpoint_module(copy.deepcopy(reference), "r")
    x = torch.randn(8, 16, requires_grad=True)

    def grads(m: Scaled) -> list[torch.Tensor]:
        x.grad = None
        m.zero_grad()
        y = m(x)
        m.scale = m.scale + 1  # replaced, not written: backward uses the forward's
        y.square().sum().backward()
        with torch.no_grad():
            m.a.bias.add_(1)  # after backward, as an optimizer steps
        return [x.grad.clone(), *(p.grad.clone() for p in m.parameters())]

    with tapesac_core.trace():
        for call in range(3):
            reference.extra = block.extra = call == 2
            assert _same(grads(reference), grads(block))


def test_a_parameter_the_forward_did_not_read_written_before_backward_is_no_error() -> None:
    """An expert no token was routed to, say: on a call that diverged from its tape too, whose
    backward runs the forward again (it checks only the parameters the forward read)."""
    torch.manual_seed(0)
    reference = Scaled()
    reference.unused = torch.nn.Linear(4, 4)
    block = tapesac_core.checkpoint_module(copy.deepcopy(reference), "r")
    x = torch.randn(8, 16, requires_grad=True)

    def grads(m: Scaled) -> list[torch.Tensor]:
        x.grad = None
        m.zero_grad()
        y = m(x)
        with torch.no_grad():
            m.unused.weight.add_(1)
        y.square().sum().backward()
        return [x.grad.clone(), *(p.grad.clone() for p in m.parameters() if p.grad is not None)]

    with tapesac_core.trace() as traces:
        for call in range(3):
            reference.extra = block.extra = call == 2
            assert _same(grads(reference), grads(block))
    assert [bool(t.diverged) for t in traces] == [False, False, True]


class Outside(torch.nn.Module):
    """Reads a tensor that is neither its input nor its parameter or buffer (a plain attribute,
    or another module's parameter through a closure): the block keeps it as it is."""

    def __init__(self, other: torch.Tensor) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16, 16))
        self.other = other

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.other.dim() == 1:  # a shift: without checkpointing autograd saves the sum
            return (x @ self.w + self.other).sin()
        return (x @ self.w @ self.other).sin()  # autograd saves it (it raises too)


@pytest.mark.parametrize("shape", [(16,), (16, 16)], ids=["added", "multiplied"])
def test_a_tensor_read_from_outside_written_in_place_before_backward_is_an_error(shape) -> None:
    torch.manual_seed(0)
    block = tapesac_core.checkpoint_module(Outside(torch.randn(shape)), "r")
    x = torch.randn(8, 16, requires_grad=True)
    with tapesac_core.trace() as traces:
        for _ in range(2):
            y = block(x)
            block.other.add_(1)
            with pytest.raises(TapeSACError, match="read from outside the block"):
                y.sum().backward()
    # Kept where no pack is, the shift makes every call record; the matrix is packed.
    assert [t.steady for t in traces] == [False, len(shape) == 2]


class Selected(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16, 16))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x @ self.w
        y = torch.masked_select(h, h > 0)  # a data-dependent shape: held (S0), not replayed
        return y, (y * 2).sin()


def test_an_output_with_a_data_dependent_shape_written_after_the_forward_is_replayed() -> None:
    torch.manual_seed(0)
    reference = Selected()
    block = tapesac_core.checkpoint_module(copy.deepcopy(reference), "r")
    x = torch.randn(8, 16, requires_grad=True)

    def grads(m: Selected) -> list[torch.Tensor]:
        x.grad = m.w.grad = None
        y, z = m(x)
        y.add_(1)  # legal without checkpointing: autograd saved no tensor on y's storage
        (y.sum() + z.sum()).backward()
        return [x.grad.clone(), m.w.grad.clone()]

    for plan in ({}, {"r": {("aten.mul.Tensor", 0, 0)}}):
        with tapesac_core.use_plan(plan), tapesac_core.trace():
            for _ in range(2):
                assert _same(grads(reference), grads(block))


def test_a_parameter_whose_storage_is_freed_before_backward_is_an_error() -> None:
    """FSDP2 frees a parameter's unsharded storage after the forward and gathers it again before
    its module's backward; a backward reading it in between would read freed memory."""
    torch.manual_seed(0)
    block = tapesac_core.checkpoint_module(Scaled(), "r")
    x = torch.randn(8, 16, requires_grad=True)
    weight = block.b.weight
    y = block(x)
    weight.untyped_storage().resize_(0)  # as FSDP2's reshard after forward, no version bump
    with pytest.raises(TapeSACError, match="'b.weight', which its forward read, has no storage"):
        y.square().sum().backward()


class Aliased(torch.nn.Module):
    """Reads its buffer through another tensor object, with a version counter of its own
    (``.data``) or the buffer's (``.detach()``)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8))
        self.register_buffer("bias", torch.randn(8))
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias.data if self.how == "data" else self.bias.detach()
        return (x @ self.w + bias).sin()


@pytest.mark.parametrize("how", ["data", "detach"])
def test_a_buffer_read_through_an_alias_and_written_before_backward_is_an_error(how) -> None:
    """Through ``.data`` the block took the buffer for an outside tensor and kept its alias,
    whose counter the write does not bump: wrong gradients, silently."""
    torch.manual_seed(0)
    block = tapesac_core.checkpoint_module(copy.deepcopy(Aliased(how)), "r")  # version 1
    x = torch.randn(4, 8, requires_grad=True)
    with tapesac_core.trace():
        for _ in range(3):
            y = block(x)
            with torch.no_grad():
                block.bias.add_(1)
            with pytest.raises(TapeSACError, match="'bias'.* was written in place after its"):
                y.square().sum().backward()
