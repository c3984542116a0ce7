"""Random ops in steady state: the generator state each random op of a call drew from.

A recorded call keeps, per random op, its generator's state before the op (``Node.rng``). A
steady-state call runs no recorder, but its checking mode (``op_checks.SteadyCheck``) sees each
random op as it is dispatched and reads its generator's state just before it runs, whatever set
that state (the ops before it, a ``manual_seed`` or an RNG-state tracker's ``set_rng_state``
inside the forward): backward replays each mask from the state it was drawn from, once. (A call
that diverged from its tape runs its forward again from the generator states at its start, as
``torch.utils.checkpoint`` does: under such a tracker its masks are not the forward's.) The
tape's random ops must draw from their device's default generator, by their arguments'
layouts (``draws_by_layout``); others (``multinomial``, ``poisson``, custom ops, a generator
passed in) keep their blocks recorded (``steady.tape_blocker``).
"""

from __future__ import annotations

from collections.abc import Mapping

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


def draws_by_layout(node: Node) -> bool:
    """Whether random ``node`` draws by its layouts alone, from its device's default generator
    (one whose state a steady-state call reads)."""
    op = node.op
    if type(op) is not OpOverload or op.namespace != "aten":
        return False
    if op_packet(op) not in LAYOUT_DRAWS:
        return False
    generator = node.rng[0]
    return default_generator(generator.device) is generator


class Draws:
    """The generator state each random op of one steady-state call drew from (by node index)."""

    def __init__(self, before: Mapping[int, Tensor]) -> None:
        self.before = dict(before)
        self.nbytes = sum(state.nbytes for state in self.before.values())
