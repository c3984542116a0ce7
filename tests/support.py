"""Helpers shared by the tests: models and batches, a short controller schedule and an injected
memory meter, reference runs, bitwise comparison, op counting, a sample plan.

Tests import from here (or from the other helper modules: blocks.py, plan_graphs.py, launch.py,
fused_kernel.py, lightning_app.py), never from another test file."""

from __future__ import annotations

import copy
import os
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tapesac_core
from examples.models import DecoderLayer, DecoderLM, ModelConfig, MoEDecoderLayer
from tapesac_core.control.controller import Controller
from tapesac_core.measure.memory import MemoryReading
from tapesac_core.plan.plan import Plan, RegionPlan, Saved
from tapesac_core.units import GiB, MiB


class OpCounter(TorchDispatchMode):
    """Counts the ops that reach the dispatcher, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def step(
    model: torch.nn.Module, loss_fn: Callable[[], torch.Tensor], seed: int = 0
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward and backward from a fixed RNG state: the loss and every gradient."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = loss_fn()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def require_deterministic() -> None:
    """Deterministic algorithms are on: without them, CUDA's ``index_add_``, ``scatter_add_``
    and ``index_put_(accumulate=True)`` add in a varying order and bitwise checks fail."""
    assert torch.are_deterministic_algorithms_enabled(), (
        "bitwise tests need torch.use_deterministic_algorithms(True) (tests/conftest.py sets it)"
    )


def assert_bitwise(ref: tuple, got: tuple) -> None:
    """Loss and every gradient identical, bit for bit."""
    (ref_loss, ref_grads), (loss, grads) = ref, got
    assert torch.equal(ref_loss, loss), (ref_loss.item(), loss.item())
    assert ref_grads.keys() == grads.keys()
    different = [n for n in ref_grads if not torch.equal(ref_grads[n], grads[n])]
    assert not different, f"gradients differ: {different}"


def _available(tape: tapesac_core.Tape, kept: set[int] | frozenset[int]) -> set[int]:
    """S ∪ S0 ∪ L, from the tape's fields (not its ``always_available``)."""
    return (
        set(kept)
        | set(tape.mandatory)
        | {v.vid for v in tape.values if v.kind in ("input", "param", "buffer")}
    )


def brute_force_replay(
    tape: tapesac_core.Tape,
    kept: set[int] | frozenset[int] = frozenset(),
    demand: set[int] | frozenset[int] | None = None,
) -> list[int]:
    """Eq. 3 by fixed-point iteration over every node, independent of the library's closure:
    a node runs when one of its outputs is wanted and not available (kept, S0 or a leaf); a
    running node wants the inputs whose data it reads."""
    available = _available(tape, kept)
    wanted = {v for v in (tape.demand if demand is None else demand) if v not in available}
    run: set[int] = set()
    changed = True
    while changed:
        changed = False
        for node in tape.nodes:
            if node.index not in run and wanted & set(node.outs):
                run.add(node.index)
                wanted |= {d for d in node.deps if d not in available}
                changed = True
    return sorted(run)


def brute_force_block(
    tape: tapesac_core.Tape, kept: set[int] | frozenset[int] = frozenset()
) -> list[int]:
    """Eq. 4 as written: the nodes up to the last one with an output in P minus the available
    values, except those whose outputs are all available."""
    available = _available(tape, kept)
    missing = tape.demand - available
    last = max((n.index for n in tape.nodes if missing & set(n.outs)), default=-1)
    return [n.index for n in tape.nodes[: last + 1] if not set(n.outs) <= available]


def assert_replayed_as_predicted(blocks: list[tapesac_core.BlockTrace]) -> None:
    """Replay ran each node at most once: exactly the nodes Eq. 3 (by brute force) gives for what
    was kept and what backward read, never a node outside it for all of P, never more than block
    recomputation."""
    for b in blocks:
        tape = b.tape
        assert len(b.replayed) == len(set(b.replayed)), tape.name
        kept = b.saved | b.alive_taken
        assert sorted(b.replayed) == brute_force_replay(tape, kept, b.unpacked), tape.name
        full_demand = brute_force_replay(tape, b.saved)
        assert set(b.replayed) <= set(full_demand), tape.name
        assert set(full_demand) <= set(tape.block_nodes(b.saved)), tape.name


def tiny_lm(**overrides: Any) -> DecoderLM:
    """The example decoder (``ModelConfig(**overrides)``), its weights drawn from seed 0."""
    torch.manual_seed(0)
    return DecoderLM(ModelConfig(**overrides))


BLOCK_CLASSES = {DecoderLayer, MoEDecoderLayer}

# The small decoder of the controller tests: 3 layers of width 32 (2 heads of 16).
SMALL = dict(
    hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64, num_layers=3
)

# A short controller schedule: one warm-up, one profiling and one must-only control step, then
# planned steps with no further control steps. Vary it with ``SHORT_SCHEDULE | {...}``.
SHORT_SCHEDULE = dict(warmup_steps=1, profile_steps=1, control_steps=1, control_every=0)


# A wider decoder of 4 layers, whose blocks' times and peaks stand well above a host's noise.
WIDE = dict(
    hidden_size=256,
    num_heads=8,
    num_kv_heads=4,
    head_dim=32,
    intermediate_size=768,
    moe_intermediate_size=256,
    num_layers=4,
)


def checkpointed_lm(blocks: Any = (DecoderLayer,), **overrides: Any) -> DecoderLM:
    """``tiny_lm(**overrides)`` with TapeSAC on its ``blocks`` classes."""
    model = tiny_lm(**overrides)
    tapesac_core.checkpoint_modules(model, set(blocks))
    return model


def reference_and_copy(**overrides: Any) -> tuple[DecoderLM, DecoderLM]:
    """``tiny_lm(**overrides)``, and a copy of it (the same weights) with TapeSAC on its blocks."""
    reference = tiny_lm(**overrides)
    model = copy.deepcopy(reference)
    tapesac_core.checkpoint_modules(model, BLOCK_CLASSES)
    return reference, model


def token_ids(seed: int, batch: int = 2, seq: int = 32, vocab: int = 256) -> torch.Tensor:
    """A ``batch`` x ``seq`` batch of random token ids, the same for the same ``seed``."""
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


class FakeMeter:
    """A memory meter the test controls: the must-only peak grows linearly with tokens;
    ``extra`` adds to what a step reads."""

    def __init__(self, base: int = 64 * MiB, per_token: int = 4096) -> None:
        self.base, self.per_token, self.tokens, self.extra = base, per_token, 0, 0
        self.readings = 0

    def __call__(self) -> FakeMeter:
        return self

    def __enter__(self) -> FakeMeter:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def reading(self) -> MemoryReading:
        self.readings += 1
        peak = self.base + self.per_token * self.tokens + self.extra
        return MemoryReading(
            peak=peak, current=self.base, reserved=peak, total=64 * GiB, free=32 * GiB
        )


def setup_controller(
    limit: Any, meter: Any = None, **settings: Any
) -> tuple[DecoderLM, Any, Controller]:
    """The ``SMALL`` decoder checkpointed, its meter (a ``FakeMeter`` unless given) and a
    controller on the short schedule (``settings`` change it)."""
    model = checkpointed_lm(**SMALL)
    meter = meter or FakeMeter()
    controller = Controller(model, limit, meter=meter, **(SHORT_SCHEDULE | settings))
    return model, meter, controller


def run_step(model: DecoderLM, meter: Any, controller: Controller, seq: int, batch: int = 2):
    """One controller step on a ``batch`` x ``seq`` batch (seeded by ``seq``); its report."""
    ids = token_ids(seq, batch, seq)
    meter.tokens = ids.numel()
    with controller.step(tokens=ids.numel()) as report:
        model.loss(ids).backward()
    model.zero_grad(set_to_none=True)
    return report


def sample_plan() -> Plan:
    """A solved plan as data: one region of two blocks, the second saving one matmul output."""
    saved = (
        Saved(
            coord=("aten.mm.default", 0, 0),
            module="self_attn.q_proj",
            bytes=3 * MiB,
            time_removed=0.0021,
        ),
    )
    region = RegionPlan(
        sequence="abc-90",
        tokens=4096,
        saved=saved,
        blocks=(frozenset(), frozenset({("aten.mm.default", 0, 0)})),
        block_bytes=(0, 3 * MiB),
    )
    return Plan(
        model=("DecoderLayer",),
        regions={"DecoderLayer": region},
        capacity=20 * GiB,
        base=12 * GiB,
        saved_bytes=3 * MiB,
        predicted_speedup=1.08,
        predicted_speedup_vs_full=1.21,
    )


class VirtualClock(TorchDispatchMode):
    """A deterministic clock for timing tests: every op that reaches the dispatcher advances
    ``now`` by a cost that depends only on the op's name and is linear in ``tokens`` (set by the
    test each step). Install with ``monkeypatch.setattr(time, "perf_counter", clock.read)`` and
    run the steps inside ``with clock:``: node timers, replay wall times and step times then all
    read the same model time, whatever else loads the host."""

    def __init__(
        self, costs: dict[str, float], default: float = 1e-4, reference_tokens: int = 1
    ) -> None:
        super().__init__()
        self.costs, self.default, self.reference_tokens = costs, default, reference_tokens
        self.now, self.tokens, self.slowdown = 0.0, reference_tokens, 1.0

    def read(self) -> float:
        return self.now

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        name = func.__name__.split(".")[0]
        self.now += (
            self.costs.get(name, self.default) * self.slowdown * self.tokens / self.reference_tokens
        )
        return func(*args, **(kwargs or {}))


@contextmanager
def process_group_of_one() -> Iterator[None]:
    """A gloo process group of this process alone (DTensors, device meshes), destroyed after."""
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as store:
        dist.init_process_group(
            "gloo", init_method=f"file://{os.path.join(store, 'store')}", rank=0, world_size=1
        )
        try:
            yield
        finally:
            dist.destroy_process_group()


def block_paths(blocks: list[tapesac_core.BlockTrace]) -> list[str]:
    """The path each block took: "steady", "diverged" (from its tape: recomputed), or why it
    was recorded."""
    return [
        "steady" if b.steady else "diverged" if b.diverged else str(b.recorded_because)
        for b in blocks
    ]


def hf_model(family: str, dropout: float) -> tuple[torch.nn.Module, type]:
    """A tiny Hugging Face causal LM of ``family`` (qwen3, llama or gpt2) with ``dropout``, and
    its decoder layer class."""
    import transformers as tf

    common = dict(vocab_size=128, num_hidden_layers=2, num_attention_heads=4)
    torch.manual_seed(0)
    if family == "gpt2":
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        config = tf.GPT2Config(
            vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64,
            resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
        )  # fmt: skip
        return tf.GPT2LMHeadModel(config), GPT2Block
    if family == "llama":
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        config = tf.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_key_value_heads=2,
            attention_dropout=dropout, **common,
        )  # fmt: skip
        return tf.LlamaForCausalLM(config), LlamaDecoderLayer
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    config = tf.Qwen3Config(
        hidden_size=64, intermediate_size=128, num_key_value_heads=2, head_dim=16,
        attention_dropout=dropout, **common,
    )  # fmt: skip
    return tf.Qwen3ForCausalLM(config), Qwen3DecoderLayer


def every_other_saved(tape: tapesac_core.Tape) -> set[tuple]:
    """Every other coordinate of the values a recorded call packs beyond S0: a plan that keeps
    values a steady-state call can hold."""
    coords = sorted(
        tape.coord(v)
        for v in tape.demand
        if tape.values[v].kind == "op" and v not in tape.mandatory
    )
    return set(coords[::2])


class ScaledBySaved(torch.autograd.Function):
    """A custom Function that saves its second argument, a tensor no call reads: ``h`` in
    forward, the gradient times that tensor in backward."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(scale)
        return h * 1.0

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        (scale,) = ctx.saved_tensors
        return g * scale, None
