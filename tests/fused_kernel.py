"""The registered kernel the kernel tests share: a fused RMSNorm with a gate, written as an
autograd.Function and registered with ``register_kernel`` (once per process: importing this
module registers it)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from tapesac_core.tape.kernels import register_kernel

NAMESPACE = "tapesac_test_kernels"


class FusedRMSNormGate(torch.autograd.Function):
    """RMSNorm returning the normed tensor and its gated product; sigmoid(g) and rstd live only on ctx."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, g: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        y = x * rstd * w
        gate = torch.sigmoid(g)
        ctx.save_for_backward(x, w, gate, y)
        ctx.rstd = rstd
        ctx.eps = eps
        return y, y * gate

    @staticmethod
    def backward(ctx: Any, grad_y: Tensor, grad_z: Tensor) -> tuple[Tensor | None, ...]:
        x, w, gate, y = ctx.saved_tensors
        normed = x * ctx.rstd
        grad_y = grad_y + grad_z * gate
        grad_normed = grad_y * w
        grad_x = ctx.rstd * (grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True))
        grad_w = (grad_y * normed).flatten(0, -2).sum(0) if ctx.needs_input_grad[1] else None
        grad_g = grad_z * y * gate * (1 - gate)
        return grad_x, grad_w, grad_g, None


def fused_fake(x: Tensor, w: Tensor, g: Tensor, eps: float) -> tuple[Tensor, ...]:
    return (
        torch.empty_like(x),
        torch.empty_like(x),
        torch.empty_like(g),
        x.new_empty(*x.shape[:-1], 1),
    )


fused = register_kernel(
    f"{NAMESPACE}::fused_rmsnorm_gate",
    FusedRMSNormGate,
    schema="(Tensor x, Tensor w, Tensor g, float eps) -> (Tensor, Tensor, Tensor, Tensor)",
    fake=fused_fake,
    outputs=2,
    ctx_attributes=lambda x, w, g, eps: {"eps": eps},
)
