"""The device a model's blocks compute on, which the controller meters and synchronises."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _fsdp_compute_device(module: torch.nn.Module) -> torch.device | None:
    """The device FSDP2 computes on for a module it shards, else None.

    With ``CPUOffloadPolicy`` FSDP2 keeps the sharded parameters on the CPU and moves them to
    the accelerator for each forward; only its private state names that accelerator.
    """
    get_state = getattr(module, "_get_fsdp_state", None)
    if get_state is None:
        return None
    device = getattr(get_state(), "_device", None)
    return torch.device(device) if device is not None else None


def compute_device(roots: Sequence[torch.nn.Module]) -> torch.device:
    """The device the blocks compute on: FSDP2's compute device where a root or submodule is
    sharded (with CPU offload the parameters live on the CPU), else the first parameter's
    device, else the CPU."""
    for root in roots:
        for module in root.modules():
            device = _fsdp_compute_device(module)
            if device is not None:
                return device
    params = [p for root in roots for p in root.parameters()]
    return params[0].device if params else torch.device("cpu")
