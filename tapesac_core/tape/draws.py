"""Random ops in steady state: the generator states a call's random ops drew from, without a
dispatch mode to capture them as they ran.

A recorded call keeps, per random op, its generator's state before the op (``Node.rng``). A
steady-state call sees no op, so it keeps only each default generator's state at its start
(``generator_states``). The ops drew in the tape's order, and how far an op's draws advance its
generator depends on its arguments' layouts only (``draws_by_layout``): a bernoulli draws once per
element on one CPU, one seed on another (MKL), a Philox offset per element on CUDA, whatever the
values. So the state before the k-th random op is its generator's start state advanced by the
random ops before it that drew from the same generator: replay runs each of those again, on
zero-filled stand-ins of the recorded layouts where backward does not replay it anyway
(``Draws.before``), and takes the state after each op it runs for real. Backward reads masks
last to first, so the stand-ins would draw most masks twice: instead the forward's pack hook
reads a generator's state at the first pack after each random op that another op on that
generator follows (``state_packs``), before that next op runs, and no op is run for its draws. Random ops whose draws
depend on values (``multinomial``, ``poisson``, custom ops) or on a generator passed in keep their
blocks recorded (``steady.tape_blocker``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from .._compat import OpOverload, op_packet
from ..tensors import default_generator
from .tape import Node

# ATen's random ops whose draws from their generator depend on their arguments' layouts (shapes,
# strides, dtypes, devices) and scalars, not on tensor values.
LAYOUT_DRAWS = frozenset(
    {
        "bernoulli",
        "bernoulli_",
        "native_dropout",
        "_fused_dropout",
        "rand",
        "rand_like",
        "randn",
        "randn_like",
        "randint",
        "randint_like",
        "randperm",
        "uniform_",
        "normal",
        "normal_",
        "exponential_",
        "geometric_",
        "log_normal_",
        "cauchy_",
        "random_",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    }
)

State = tuple[torch.Generator, Tensor]


def draws_by_layout(node: Node) -> bool:
    """Whether random ``node`` draws by its layouts alone, from its device's default generator
    (one whose state a steady-state call keeps)."""
    op = node.op
    if type(op) is not OpOverload or op.namespace != "aten":
        return False
    if op_packet(op) not in LAYOUT_DRAWS:
        return False
    generator = node.rng[0]
    return default_generator(generator.device) is generator


def state_packs(random: Sequence[Node], draw_packs: Mapping[int, int]) -> dict[int, int]:
    """Pack index -> position in ``random`` of the op whose generator's state a steady-state
    call reads at that pack: the state after the op, for the next random op on its generator.
    ``draw_packs``: per random node's index, the first pack after it and before the next
    random op on its generator (``Recorder.draw_packs``)."""
    followed = _followed(random)
    return {
        draw_packs[n.index]: p
        for p, n in enumerate(random)
        if p in followed and n.index in draw_packs
    }


def _followed(random: Sequence[Node]) -> set[int]:
    """The positions in ``random`` of the ops that a later op on the same generator follows."""
    last: dict[int, int] = {}
    followed: set[int] = set()
    for p, n in enumerate(random):
        key = id(n.rng[0])
        if key in last:
            followed.add(last[key])
        last[key] = p
    return followed


class Draws:
    """The generator states of one steady-state call's random ops, derived from the states at
    its start, and from the states its forward read after some of them (``after``: position in
    ``random`` -> state), as replay asks for them."""

    def __init__(
        self, random: Sequence[Node], start: Sequence[State], after: Mapping[int, Tensor]
    ) -> None:
        self.order = random
        self._position = {n.index: p for p, n in enumerate(self.order)}
        start_of = {id(g): state for g, state in start}
        last: dict[int, int] = {}
        # Per random op: its generator, and the random op before it on that generator (or None).
        self._previous: list[int | None] = []
        self._start: list[Tensor | None] = []
        self._followed = _followed(self.order)  # random ops with a later one on their generator
        for p, n in enumerate(self.order):
            key = id(n.rng[0])
            self._previous.append(last.get(key))
            self._start.append(start_of[key] if key not in last else None)
            last[key] = p
        self._after: dict[int, Tensor] = dict(after)
        states = [*start_of.values(), *after.values()]
        self.nbytes = sum(state.nbytes for state in states)

    def run(self, node: Node, call: Callable[[], Any], stand_in: Callable[[Node], Any]) -> Any:
        """``call()`` (``node``, run for real) from the state its op drew from in forward;
        ``stand_in(n)`` runs an earlier random op ``n`` on stand-ins when its draws are needed."""
        return self._drawn(self._position[node.index], call, stand_in)

    def _drawn(self, p: int, call: Callable[[], Any], stand_in: Callable[[Node], Any]) -> Any:
        """``call()`` with random op ``p``'s generator at the state ``p`` drew from, put back
        after; the state after it kept when a later op on that generator draws from there."""
        generator = self.order[p].rng[0]
        current = generator.get_state()
        generator.set_state(self._before(p, stand_in))
        try:
            out = call()
            if p in self._followed and p not in self._after:
                self._after[p] = generator.get_state()
        finally:
            generator.set_state(current)
        return out

    def _before(self, p: int, stand_in: Callable[[Node], Any]) -> Tensor:
        start = self._start[p]
        if start is not None:
            return start
        previous = self._previous[p]
        assert previous is not None  # not the first on its generator: it has a previous op
        if previous not in self._after:  # its draws are not replayed yet: on stand-ins
            self._drawn(previous, lambda: stand_in(self.order[previous]), stand_in)
        return self._after[previous]
