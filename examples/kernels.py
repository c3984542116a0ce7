"""An opaque kernel of the kind TapeSAC must replay bitwise: an ``autograd.Function`` that draws
its own dropout mask inside forward, as a Triton kernel with fused dropout does."""

from __future__ import annotations

import torch


class FusedDropout(torch.autograd.Function):
    """``x * mask``, the mask drawn inside forward."""

    @staticmethod
    def forward(ctx, x, dropout_p):
        mask = (torch.rand_like(x) >= dropout_p).to(x.dtype) / (1 - dropout_p)
        ctx.save_for_backward(mask)
        return x * mask

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        return grad * mask, None
