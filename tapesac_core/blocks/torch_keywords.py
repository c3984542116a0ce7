"""The keyword arguments of ``torch.utils.checkpoint.checkpoint``, as ``tapesac_core.checkpoint``
takes them: code written for torch's checkpoint (Hugging Face's ``_gradient_checkpointing_func``,
torch's ``checkpoint_wrapper(module, checkpoint_fn=...)``) passes them, and none of them is ever
passed on to the checkpointed function.

What each means here:

* ``use_reentrant``: ``False`` or ``None`` run TapeSAC (its checkpoint is non-reentrant; torch's
  ``None`` means reentrant with a warning). ``True`` is refused: torch's reentrant checkpoint
  runs no plan and no tape.
* ``preserve_rng_state``: either. TapeSAC's replay always draws what the forward drew; ``False``
  lets torch skip restoring the generator, it does not ask for other numbers.
* ``determinism_check``: ``"default"`` or ``"none"``, as torch. TapeSAC's checks of a replay
  are its own and always on.
* ``debug``: either. TapeSAC's errors name the block and the op without it.
* ``early_stop``: either. A replay runs only the producers of what backward reads, earlier
  than torch's early stop; it never runs the whole forward again.
* ``context_fn``: only torch's default. A selective-checkpointing policy cannot combine with
  TapeSAC's plan, which chooses what to save.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.utils.checkpoint import noop_context_fn

from ..errors import TapeSACError

DETERMINISM_CHECKS = ("default", "none")


@dataclass(frozen=True, kw_only=True)
class TorchKeywords:
    """The keywords of ``torch.utils.checkpoint.checkpoint`` one call was given."""

    use_reentrant: bool | None = None
    context_fn: Callable[[], Any] = noop_context_fn
    determinism_check: str = "default"
    debug: bool = False
    early_stop: bool = True
    preserve_rng_state: bool = True

    def check(self, name: str) -> None:
        """Refuse those TapeSAC cannot honour for block ``name``, naming the fix."""
        if self.use_reentrant:
            raise TapeSACError(
                f"block {name!r}: use_reentrant=True asks for torch's reentrant checkpoint, which "
                "TapeSAC does not run (it records and replays, as the non-reentrant one). Fix: pass "
                "use_reentrant=False (Hugging Face: gradient_checkpointing_kwargs="
                "{'use_reentrant': False}), or call torch.utils.checkpoint.checkpoint for this block"
            )
        if self.context_fn is not noop_context_fn:
            raise TapeSACError(
                f"block {name!r}: context_fn (a selective-checkpointing policy) cannot combine with "
                "TapeSAC's plan, which chooses what each block saves under memory_limit. Fix: drop "
                "context_fn, or call torch.utils.checkpoint.checkpoint for this block"
            )
        if self.determinism_check not in DETERMINISM_CHECKS:
            raise TapeSACError(
                f"block {name!r}: determinism_check={self.determinism_check!r}; torch's checkpoint takes "
                f"one of {DETERMINISM_CHECKS}"
            )
        for keyword, value in (
            ("use_reentrant", self.use_reentrant),
            ("preserve_rng_state", self.preserve_rng_state),
            ("debug", self.debug),
            ("early_stop", self.early_stop),
        ):
            if not isinstance(value, bool) and not (keyword == "use_reentrant" and value is None):
                raise TapeSACError(f"block {name!r}: {keyword} must be a bool, not {value!r}")
