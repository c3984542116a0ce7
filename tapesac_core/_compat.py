"""Every torch-private name TapeSAC uses, in one place: what each is for.

Checked on the torch versions in ``CHECKED_ON``: the whole suite passed on each, and
``pyproject.toml`` bounds torch below the next minor release until it has run there too
(``tests/test_compat.py`` keeps the bound, this list and the modules in step). A name torch
renames or drops breaks here, and only here. Hot paths take the C functions themselves (no
wrapper call per op).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map_only

CHECKED_ON = ("2.11", "2.13")

__all__ = [
    "CHECKED_ON",
    "OpOverload",
    "any_autocast_enabled",
    "TorchDispatchMode",
    "disable_current_modes",
    "DispatchModeWithoutDynamoGuard",
    "cuda_sleep",
    "current_autograd_node",
    "dispatch_disabled",
    "fsdp_compute_device",
    "graph_task_id",
    "op_exists",
    "op_packet",
    "op_schema",
    "parse_schema",
    "raw_call",
    "saved_tensors_hooks_on_top",
    "storage_use_count",
    "tree_flatten",
    "tree_leaves",
    "torch_function_disabled",
    "torch_function_modes",
    "tree_map_only",
]

# A guard that turns every dispatch mode off in C++: ``_disable_current_modes`` pops and pushes
# each mode in Python (16 µs a call) for bookkeeping ops no mode may see.
dispatch_disabled = torch._C._DisableTorchDispatch
# The id of the autograd graph task running now (-1 outside backward): which backward a block's
# unpack belongs to, and whether a forward runs inside a backward (reentrant checkpointing).
graph_task_id: Callable[[], int] = torch._C._current_graph_task_id
# The autograd node running now: which block's backward the sample step's timeline is in.
current_autograd_node: Callable[[], Any] = torch._C._current_autograd_node
parse_schema: Callable[[str], torch.FunctionSchema] = torch._C.parse_schema
# Whether autocast is on for any device (one C call): a call checked at the torch-function level
# must run without it, since autocast's casts happen below that level (``call_checks.py``).
any_autocast_enabled: Callable[[], bool] = torch._C._is_any_autocast_enabled
# A guard that turns torch-function handling off (modes too) in C++: bookkeeping that a block's
# hooks run while its calls are logged or checked is not the forward's (``submodule_hooks.py``).
torch_function_disabled = torch._C.DisableTorchFunction
# How many torch-function modes are on the stack (a mode's handler does not count itself): a
# user's mode below TapeSAC's would rewrite calls after they are checked (``call_checks.py``).
torch_function_modes: Callable[[], int] = torch._C._len_torch_function_stack
# Every dispatch mode off, in Python: where a C++ guard is not enough (a mode's own state).
disable_current_modes = _disable_current_modes


def storage_use_count(storage: torch.UntypedStorage) -> int:
    """How many tensors and Python storage objects reference ``storage``: torch has no public
    count, and offloading a storage something outside a block holds would free nothing
    (``offload.py``)."""
    return torch._C._storage_Use_Count(storage._cdata)


def saved_tensors_hooks_on_top() -> Any:
    """The innermost ``saved_tensors_hooks`` pushed now, if any (torch's checkpoint inside or
    around a block pushes its own)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(True)


def op_exists(qualname: str) -> bool:
    """Whether an operator of that name is registered (any overload)."""
    try:
        torch._C._dispatch_find_schema_or_throw(qualname, "")
    except RuntimeError:
        return False
    return True


def op_schema(op: OpOverload) -> torch.FunctionSchema:
    """An aten op's schema: its arguments' names, types and which it writes."""
    return op._schema


def op_packet(op: Any) -> str | None:
    """An op's packet name, without namespace and overload (``aten.add.Tensor``: ``add``);
    None for a callable that is no torch operator."""
    return getattr(op, "_opname", None)


def cuda_sleep(cycles: int) -> None:
    """Queue a kernel that spins ``cycles`` GPU clock cycles: the one kernel torch has that
    takes a duration (the op timers' tests and calibration)."""
    torch.cuda._sleep(cycles)


def raw_call(op: Any) -> Callable[..., Any]:
    """What calling ``op`` calls: an ``OpOverload``'s C++ callable (``__call__`` only forwards
    to it, a frame per op at replay), anything else itself."""
    return op._op if type(op) is OpOverload else op


def fsdp_compute_device(module: torch.nn.Module) -> torch.device | None:
    """The device FSDP2 computes on for a module it shards, else None: with
    ``CPUOffloadPolicy`` the sharded parameters live on the CPU and only FSDP's private state
    names the accelerator each forward moves them to."""
    get_state = getattr(module, "_get_fsdp_state", None)
    if get_state is None:
        return None
    device = getattr(get_state(), "_device", None)
    return torch.device(device) if device is not None else None


class DispatchModeWithoutDynamoGuard(TorchDispatchMode):
    """A dispatch mode whose ``__torch_dispatch__`` runs without Dynamo's disable wrapper,
    which costs microseconds per op: for modes that only ever run eagerly (recording)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False
