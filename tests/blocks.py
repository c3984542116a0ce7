"""Single checkpointed blocks used by several tests: real block shapes and an in-place/view stress block."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from support import step

import tapesac_core
from examples.models import DecoderLayer, ModelConfig, MoEDecoderLayer, rotary_cos_sin


class InplaceViews(torch.nn.Module):
    """In-place ops, writes through views, reads of a base after a write through its view,
    index_add_ into zeros, an empty buffer written by copy_, transposes and dropout."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.d = d
        self.up = torch.nn.Linear(d, 2 * d)
        self.down = torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = self.d
        h = self.up(x)
        h[:, :d].relu_()  # write through a view of h
        s = h.sum(-1, keepdim=True)  # read the base after that write
        b = h[:, d:].clone()
        b[:, :2].add_(b[:, 2:4])  # write through a slice, reading another slice
        idx = torch.arange(b.shape[0] - 1, -1, -1)
        c = torch.zeros_like(b)
        c.index_add_(0, idx, b * h[:, :d])  # index_add_ into zeros
        c.masked_fill_(c.abs() < 0.05, 0.0)
        y = self.down(c.t().contiguous().t())
        y = F.dropout(y, 0.2, training=True) * torch.sigmoid(s)
        buf = torch.empty_like(y)
        buf.copy_(y)  # an allocation written by a recorded op
        buf.add_(1.0)
        return buf + x


@dataclass
class Case:
    """A module, how to run one step on it, and the reference (no checkpointing) result."""

    module: torch.nn.Module
    region: str
    args: tuple
    ref: tuple

    def loss(self) -> torch.Tensor:
        out = self.module(*self.args)
        weights = torch.linspace(-1.0, 1.0, out.numel()).view_as(out)
        return (out * weights).sum()

    def step(self) -> tuple:
        return step(self.module, self.loss, seed=3)

    @functools.cached_property
    def must_only(self) -> tapesac_core.Tape:
        with tapesac_core.trace() as blocks:
            self.step()
        return blocks[0].tape

    @functools.cached_property
    def coords(self) -> list[tapesac_core.Coord]:
        """Every output of the block that a plan may name."""
        tape = self.must_only
        leaf_sids = {tape.values[v].sid for v in tape.leaves}
        return sorted(
            tape.coord(v.vid)
            for v in tape.values
            if v.node >= 0
            and v.sid not in leaf_sids
            and v.vid not in tape.mandatory
            and not tape.nodes[v.node].name.startswith("tapesac.")
        )


def _make(kind: str) -> Case:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if kind == "inplace":
        module: torch.nn.Module = InplaceViews()
        args: tuple[Any, ...] = (torch.randn(8, 16, generator=g, requires_grad=True),)
    else:
        config = ModelConfig(moe=kind == "moe", dropout=0.1)
        module = (MoEDecoderLayer if kind == "moe" else DecoderLayer)(config)
        x = torch.randn(2, 8, config.hidden_size, generator=g, requires_grad=True)
        cos, sin = rotary_cos_sin(8, config.head_dim, config.rope_theta, x)
        args = (x, cos, sin)
    case = Case(module, type(module).__name__, args, ())
    case.ref = case.step()
    tapesac_core.checkpoint_module(module)
    return case


@functools.cache
def case(kind: str) -> Case:
    """A checkpointed block of kind "dense", "moe" or "inplace", with its reference result."""
    return _make(kind)
