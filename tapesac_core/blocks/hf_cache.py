"""Hugging Face's key-value cache in training: left out of a checkpointed block's call, as
Hugging Face's own gradient checkpointing leaves it out.

Why. A Hugging Face model at its default ``use_cache=True`` makes a cache every forward, and
each layer appends its keys and values to it. A block's forward run again in backward (a call
that departed from its tape, ``tape/recompute.py``, or torch's checkpoint) would append them a
second time and attend over both; the check of that run (``tape/rerun_checks.py``) refuses it.
``GradientCheckpointingLayer`` turns the cache off in training for that reason
(``use_cache=False``, its cache argument None unless the layer only reads it, flagged by
``_can_checkpoint_with_cache``); TapeSAC, which takes the place of that checkpointing, does the
same, with one warning, for a cache that holds nothing yet: nothing a training step computes
reads it. A cache that already holds keys (a prefix the user passed, as prefix tuning does) is
kept: its layers read it. Calls without gradients (evaluation, generation) keep theirs.

The cache a training call returns therefore stays empty, as with Hugging Face's checkpointing. A
caller that passes it to its next training call (segment recurrence) would get no context from
it, silently: a cache given again to a layer that left it out is a ``TapeSACError``. (Recording
such calls, with no run in backward, would keep the cache, but would take steady state from
every model at its default ``use_cache=True``.)
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import torch

from ..errors import TapeSACError
from .block_settings import block_config


def without_hf_cache(
    module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]
) -> tuple[tuple, dict[str, Any]]:
    """``args`` and ``kwargs`` of a training call of ``module``, its Hugging Face cache left out
    where it holds nothing yet (a layer takes it by keyword or, as GPT-2's, by position)."""
    cache_utils = sys.modules.get("transformers.cache_utils")
    if cache_utils is None or not module.training:
        return args, kwargs  # no Hugging Face cache exists without transformers imported
    # A class attribute of ``GradientCheckpointingLayer`` since transformers 5; older layers
    # all write their cache.
    if getattr(type(module), "_can_checkpoint_with_cache", False):
        return args, kwargs
    cache = cache_utils.Cache

    def unfilled(x: Any) -> bool:
        return isinstance(x, cache) and x.get_seq_length() == 0

    changed: dict[str, Any] = {name: None for name, v in kwargs.items() if unfilled(v)}
    positions = [i for i, a in enumerate(args) if unfilled(a)]
    if not changed and not positions:
        return args, kwargs
    config = block_config(module)
    if config is not None:
        given = {id(c): c for c in (*(args[i] for i in positions), *map(kwargs.get, changed))}
        for emptied in given.values():
            if emptied in config.emptied_caches:
                raise TapeSACError(
                    f"block {config.path or type(module).__name__!r} was given a Hugging Face "
                    "key-value cache an earlier training call returned: checkpointed layers "
                    "leave the cache out in training (as Hugging Face's gradient checkpointing "
                    "does), so it holds nothing. Fix: do not pass caches between training "
                    "calls, or leave these layers out of checkpointing"
                )
            config.emptied_caches.add(emptied)
    if kwargs.get("use_cache") is True:
        changed["use_cache"] = False
    # A warning, not a log line: Python's default filter shows it once per run.
    warnings.warn(
        "TapeSAC: Hugging Face's key-value cache is off in checkpointed layers in training, as "
        "with Hugging Face's gradient checkpointing: a layer's forward run again in backward "
        "would append its keys and values a second time. The cache a training call returns "
        "stays empty. Set use_cache=False in the model's config to silence this",
        UserWarning,
        stacklevel=3,
    )
    args = tuple(None if i in positions else a for i, a in enumerate(args))
    return args, {**kwargs, **changed}
