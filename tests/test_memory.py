"""Memory is measured, with torch's profiler (profile_memory=True) as the independent reference."""

import copy
import gc

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint

import tapesac_core
from examples.models import DecoderLayer, DecoderLM, ModelConfig, MoEDecoderLayer, rotary_cos_sin
from tapesac_core.measure.memory import LiveTensorMeter, MemoryReading, memory_meter, profile_memory

CPU_GENERATOR_STATE = 5056  # bytes of torch.default_generator.get_state()


class Stack(torch.nn.Module):
    def __init__(self, config: ModelConfig, layers: int = 4) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(DecoderLayer(config) for _ in range(layers))

    def forward(self, x, cos, sin):
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x


class TorchCheckpointed(torch.nn.Module):
    def __init__(self, stack: Stack) -> None:
        super().__init__()
        self.stack = stack

    def forward(self, x, cos, sin):
        for layer in self.stack.layers:
            x = torch_checkpoint.checkpoint(layer, x, cos, sin, use_reentrant=False)
        return x


def _setup(dropout: float):
    torch.manual_seed(0)
    config = ModelConfig(dropout=dropout)
    stack = Stack(config)
    x = torch.randn(2, 32, config.hidden_size, requires_grad=True)
    cos, sin = rotary_cos_sin(32, config.head_dim, config.rope_theta, x)
    tapesac = copy.deepcopy(stack)
    tapesac_core.checkpoint_modules(tapesac, {DecoderLayer})
    return {"none": stack, "tapesac": tapesac, "torch": TorchCheckpointed(copy.deepcopy(stack))}, (
        x,
        cos,
        sin,
    )


def _train_step(model, args):
    def run():
        torch.manual_seed(1)
        model(*args).square().sum().backward()

    return run


def _step_memory(model, args):
    """Profiled memory of one training step; the input's old gradient is dropped outside the window."""
    args[0].grad = None
    return profile_memory(_train_step(model, args))[1]


@pytest.mark.parametrize("plan", ["must_only", "save_matmuls"])
def test_forward_leaves_exactly_the_inputs_mandatory_and_saved_bytes_the_tape_reports(plan) -> None:
    models, args = _setup(dropout=0.1)
    _, plain = profile_memory(lambda: models["none"](*args))
    coords = {("aten.mm.default", k, 0) for k in range(7)} if plan == "save_matmuls" else set()
    with tapesac_core.use_plan({"DecoderLayer": coords}), tapesac_core.trace() as blocks:
        out, measured = profile_memory(lambda: models["tapesac"](*args))
    # Live after forward: each block's output (the next block's input), what it saved (S0 and
    # the plan) and the generator states its random ops replay from. Nothing else.
    predicted = sum(b.tape.bytes_of(b.saved | b.tape.outputs) + b.rng_bytes for b in blocks)
    assert measured.end == predicted
    # What the blocks report keeping, against the profiler: the planned forward leaves exactly
    # that many bytes more than a must-only forward (this model has an empty S0).
    with tapesac_core.trace() as must_only:
        _, must_measured = profile_memory(lambda: models["tapesac"](*args))
    assert sum(b.saved_bytes for b in must_only) == 0
    # Generator states: one per random op when a call records, one per block in steady state.
    states = sum(b.rng_bytes for b in blocks) - sum(b.rng_bytes for b in must_only)
    assert measured.end - must_measured.end == sum(b.saved_bytes for b in blocks) + states
    if plan == "save_matmuls":
        # The down projection is dead: saving its output would keep bytes nothing reads.
        assert all(len(b.tape.planned) == 7 and len(b.saved) == 6 for b in blocks)
    assert measured.end < plain.end / (2 if plan == "save_matmuls" else 10)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_step_peak_is_no_higher_than_torch_checkpoint(dropout) -> None:
    models, args = _setup(dropout)
    peaks = {name: _step_memory(model, args) for name, model in models.items()}
    # Second steps (gradients exist now): TapeSAC runs in steady state.
    again = {name: _step_memory(models[name], args) for name in ("tapesac", "torch")}
    with tapesac_core.trace() as blocks:
        models["tapesac"](*args)
    assert all(b.steady for b in blocks)
    # Generator states: TapeSAC keeps one per random op, torch.utils.checkpoint one per block (on
    # CUDA each is 16 bytes; on CPU the Mersenne-Twister state is 5 KB). A recorded block takes
    # each before its op, as does a steady-state one's checking mode (``draws.py``).
    random_ops = [sum(n.rng is not None for n in b.tape.nodes) for b in blocks]
    extra = (sum(random_ops) - len(blocks)) * CPU_GENERATOR_STATE if dropout else 0
    assert sum(b.draws_bytes for b in blocks) == (sum(random_ops) if dropout else 0) * (
        CPU_GENERATOR_STATE
    )
    assert peaks["tapesac"].peak - extra <= peaks["torch"].peak < peaks["none"].peak
    assert again["tapesac"].peak - extra <= again["torch"].peak
    # Blocks free everything they kept once their backward is done (no reference cycles).
    assert peaks["tapesac"].end == peaks["torch"].end == peaks["none"].end
    assert again["tapesac"].end == again["torch"].end


def test_the_meter_agrees_with_the_profiler() -> None:
    models, args = _setup(dropout=0.0)
    run = _train_step(models["tapesac"], args)
    run()  # gradients exist from now on, as in training
    with LiveTensorMeter() as meter:
        before = meter.reading().current
        _, profiled = profile_memory(run)
        reading = meter.reading()
    assert reading.peak - before == profiled.peak
    assert reading.current - before == profiled.end == 0
    assert reading.total >= reading.free > 0


class FakeAllocator:
    """torch.accelerator's memory functions for one device, with numbers the test sets."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.stats = {
            "max_memory_allocated": 700,
            "memory_allocated": 300,
            "max_memory_reserved": 900,
            "memory_reserved": 800,
        }
        self.retries = 2

    def install(self, monkeypatch) -> None:
        for name, value in self.stats.items():
            monkeypatch.setattr(torch.accelerator, name, lambda device, v=value: v)
        monkeypatch.setattr(torch.accelerator, "get_memory_info", lambda device: (1000, 10_000))
        monkeypatch.setattr(
            torch.accelerator, "memory_stats", lambda device: {"num_alloc_retries": self.retries}
        )
        for name in ("synchronize", "reset_peak_memory_stats"):
            monkeypatch.setattr(
                torch.accelerator, name, lambda device, n=name: self.calls.append(f"{n}({device})")
            )


def test_a_device_meter_reads_the_allocator_of_its_device(monkeypatch) -> None:
    allocator = FakeAllocator()
    allocator.install(monkeypatch)
    meter = memory_meter(torch.device("cuda", 1))
    with meter:
        assert allocator.calls == ["synchronize(cuda:1)", "reset_peak_memory_stats(cuda:1)"]
        reading = meter.reading()
    assert allocator.calls[-1] == "synchronize(cuda:1)"
    # Peak and current are allocated bytes; outside = total − free − reserved now (Eq. 9).
    # Reserved grew by 100 over the 800 reserved at entry; no allocation retried in between.
    assert reading == MemoryReading(
        peak=700,
        current=300,
        reserved=900,
        total=10_000,
        free=1000,
        outside=10_000 - 1000 - 800,
        reserved_growth=100,
        alloc_retries=0,
    )
    assert isinstance(memory_meter("cpu"), LiveTensorMeter)


class _Interrupted(Exception):
    pass


def _forward_only(model, tokens, plan) -> None:
    """A forward with grad whose backward never runs (evaluation with grad on, a skipped step,
    an error inside a block)."""
    with tapesac_core.use_plan(plan):
        try:
            model.loss(tokens)
        except _Interrupted:
            pass


def _raise(*args) -> None:
    raise _Interrupted


@pytest.mark.parametrize(
    "moe,interrupted",
    [(False, False), (True, False), (False, True)],
    ids=["dense", "moe", "error_inside_a_block"],
)
def test_forward_without_backward_frees_every_block_after_gc(moe, interrupted) -> None:
    torch.manual_seed(0)
    model = DecoderLM(ModelConfig(moe=moe, num_layers=2))
    tapesac_core.checkpoint_modules(model, {DecoderLayer, MoEDecoderLayer})
    tokens = torch.randint(0, 256, (2, 16))
    # A plan that saves matmul outputs: blocks hold values produced inside them (with a graph).
    region = "MoEDecoderLayer" if moe else "DecoderLayer"
    plan = {region: {("aten.mm.default", k, 0) for k in range(7)}}
    with tapesac_core.trace() as blocks:
        _forward_only(model, tokens, plan)
    assert all(len(b.saved) > len(b.tape.mandatory) for b in blocks)
    if interrupted:  # the last block raises after its attention saved its matmuls
        model.layers[-1].mlp.register_forward_hook(_raise)
    with LiveTensorMeter() as meter:
        before = meter.reading().current
        for _ in range(3):
            _forward_only(model, tokens, plan)
        gc.collect()
        assert meter.reading().current == before
