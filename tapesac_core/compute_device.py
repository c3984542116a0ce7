"""The device a model's blocks compute on, which the controller meters and synchronises."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._compat import fsdp_compute_device


def compute_device(roots: Sequence[torch.nn.Module]) -> torch.device:
    """The device the blocks compute on: FSDP2's compute device where a root or submodule is
    sharded (with CPU offload the parameters live on the CPU), else the first parameter's
    device, else the CPU."""
    for root in roots:
        for module in root.modules():
            device = fsdp_compute_device(module)
            if device is not None:
                return device
    params = [p for root in roots for p in root.parameters()]
    return params[0].device if params else torch.device("cpu")
