"""Byte units for limits and messages."""

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def format_bytes(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1 (``1.50 GiB``)."""
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
