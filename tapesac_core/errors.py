"""Errors raised by TapeSAC. Messages name the block (module path), the op and the fix."""


class TapeSACError(RuntimeError):
    """A TapeSAC block cannot be recorded or replayed as written; the message says why and how to fix it."""
