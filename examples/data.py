"""Byte-level training text taken from the Python standard library's own source files.

Every Python install ships these files, so examples and tests need no download. Tokens are bytes
(ids 0..255), matching ``ModelConfig.vocab_size == 256``.
"""

import functools
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch

# Third-party packages may be installed inside the stdlib folder; they vary between machines.
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@functools.cache
def stdlib_sources() -> tuple[Path, ...]:
    """Sorted paths of the standard library's ``.py`` files, third-party packages excluded."""
    paths = []
    for folder, subfolders, files in os.walk(sysconfig.get_paths()["stdlib"]):
        subfolders[:] = [name for name in subfolders if name not in _SKIPPED_DIRS]
        paths += [Path(folder, name) for name in files if name.endswith(".py")]
    return tuple(sorted(paths))


def documents() -> Iterator[bytes]:
    """Each standard library source file's bytes, once, in sorted path order."""
    for path in stdlib_sources():
        yield path.read_bytes()


def _shuffled_documents(generator: torch.Generator) -> Iterator[bytes]:
    """Documents in a fresh seeded order every epoch, endlessly."""
    paths = stdlib_sources()
    while True:
        for index in torch.randperm(len(paths), generator=generator).tolist():
            yield paths[index].read_bytes()


def batches(batch_size: int, max_len: int, seed: int, min_len: int = 16) -> Iterator[torch.Tensor]:
    """Endless ``input_ids`` batches, LongTensor ``[batch_size, T]`` with T drawn from [min_len, max_len].

    Documents are packed back to back into one byte stream, so there is no padding; T changes from
    batch to batch so token counts (and activation sizes) vary. The same seed gives the same batches.
    """
    if not 2 <= min_len <= max_len:
        raise ValueError(f"need 2 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    generator = torch.Generator().manual_seed(seed)
    docs = _shuffled_documents(generator)
    stream = bytearray()
    while True:
        length = int(torch.randint(min_len, max_len + 1, (), generator=generator))
        needed = batch_size * length
        while len(stream) < needed:
            stream += next(docs)
        chunk, stream = stream[:needed], stream[needed:]
        yield torch.frombuffer(chunk, dtype=torch.uint8).long().view(batch_size, length)
