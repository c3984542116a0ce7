"""Errors raised by TapeSAC. Messages name the block (module path), the op and the fix."""


class TapeSACError(RuntimeError):
    """A TapeSAC block cannot be recorded or replayed as written; the message says why and how to fix it."""


COPY_FIX = "write into a copy (.clone(), or an out-of-place op) instead"
LEAF_FIX = (
    "change parameters and buffers after backward (optimizer.step() after loss.backward()), "
    "or replace them instead of writing into them (module.weight = torch.nn.Parameter(new))"
)


def written_after_forward(
    block: str, what: str, version: int, now: int, fix: str = COPY_FIX
) -> TapeSACError:
    """The error for ``what``, a tensor block ``block``'s backward reads, written in place by
    code after the block: its version was ``version`` at the end of forward, ``now`` now."""
    return TapeSACError(
        f"block {block!r}: {what} was written in place after its forward (version {version}, now "
        f"{now}): backward would read the new values and give wrong gradients. Fix: {fix}"
    )


def moved_after_forward(block: str, what: str, fix: str) -> TapeSACError:
    """The error for ``what``, a tensor block ``block``'s backward reads, moved to other bytes
    or another layout (``.data =``: no version bump) by code after the block."""
    return TapeSACError(
        f"block {block!r}: {what} was moved to other bytes or another layout (`.data =`) after "
        f"its forward, which the tensor the block keeps for backward does not follow (wrong "
        f"gradients). Fix: {fix}"
    )
