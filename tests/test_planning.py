"""Planning on measured costs: an injected delay changes the plan; data-dependent blocks fall back."""

import time

import torch
from test_controller import FakeMeter

import tapesac_core
from examples.models import ModelConfig, MoEDecoderLayer, rotary_cos_sin
from tapesac_core.controller import PLANNED, Controller
from tapesac_core.kernels import register_kernel
from tapesac_core.units import GiB

SLOW = "tapesac_test_delay.slow_sin.default"


class SlowSin(torch.autograd.Function):
    """sin(x), after sleeping ``delay`` seconds: a kernel whose cost the dispatcher cannot guess."""

    delay = 0.0

    @staticmethod
    def forward(ctx, x):
        time.sleep(SlowSin.delay)
        ctx.save_for_backward(x)
        return x.sin()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * x.cos()


slow_sin = register_kernel("tapesac_test_delay::slow_sin", SlowSin, schema="(Tensor x) -> Tensor",
                           fake=lambda x: torch.empty_like(x))


class Costly(torch.nn.Module):
    """An expensive matmul, then the opaque kernel, then cheap ops."""

    def __init__(self, d: int = 512) -> None:
        super().__init__()
        self.a = torch.nn.Linear(d, d)

    def forward(self, x):
        return slow_sin(self.a(x)).tanh() * 2.0


def _plan_with_delay(delay: float):
    SlowSin.delay = delay
    torch.manual_seed(0)
    model = torch.nn.Sequential(Costly())
    tapesac_core.checkpoint_modules(model, {Costly})
    meter = FakeMeter(base=GiB, per_token=0)
    one_storage = 256 * 512 * 4
    controller = Controller(model, GiB + int(1.5 * one_storage), meter=meter, margin=0.0,
                            warmup_steps=1, profile_steps=2, control_steps=1, control_every=0)
    x = torch.randn(256, 512)
    for _ in range(5):
        with controller.step(tokens=256) as report:
            model(x).sum().backward()
    assert report.mode == PLANNED
    profile = controller.profiles["Costly"]
    (slow,) = [n.index for n in profile.tape.nodes if n.name == SLOW]
    (coords,) = report.plan.regions["Costly"].blocks
    return profile.node_time[slow], coords


def test_a_measured_delay_shows_in_the_profile_and_changes_the_plan() -> None:
    quick_time, quick = _plan_with_delay(0.0)
    slow_time, slow = _plan_with_delay(0.05)
    assert quick_time < 0.01 <= 0.05 <= slow_time
    # Without the delay the matmul is the expensive op: its output is saved. With it, the same
    # bytes are worth more after the kernel: saving tanh's output makes the kernel and tanh dead.
    assert quick == {("aten.addmm.default", 0, 0)}
    assert slow == {("aten.tanh.default", 0, 0)}


def test_blocks_with_data_dependent_op_sequences_save_only_their_mandatory_set() -> None:
    torch.manual_seed(0)
    config = ModelConfig(moe=True, skip_empty_experts=True, num_experts=8, top_k=1,
                         hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16,
                         intermediate_size=64, moe_intermediate_size=32)
    layers = torch.nn.ModuleList(MoEDecoderLayer(config) for _ in range(4))
    tapesac_core.checkpoint_modules(layers, {MoEDecoderLayer})
    controller = Controller(layers, GiB, meter=FakeMeter(base=0, per_token=0), warmup_steps=1,
                            profile_steps=1, control_steps=1, control_every=0)
    g = torch.Generator().manual_seed(0)
    dropped = 0
    for step in range(8):
        x = torch.randn(1, 6, 32, generator=g, requires_grad=True)
        cos, sin = rotary_cos_sin(6, 16, config.rope_theta, x)
        with controller.step(tokens=6) as report:
            h = x
            for layer in layers:
                h = layer(h, cos, sin)
            h.sum().backward()
        dropped += sum(b.plan_dropped for b in report.block_traces)
    region = report.plan.regions["MoEDecoderLayer"]
    profile = controller.profiles["MoEDecoderLayer"]
    assert 0 < profile.blocks < 4
    assert "another op sequence (data-dependent control flow)" in region.note
    assert [bool(b) for b in region.blocks] == list(profile.shares_reference)
    assert "data-dependent control flow" in report.plan.explain()
    # At run time a block whose routing changed its op sequence drops the plan for that step.
    assert dropped > 0
