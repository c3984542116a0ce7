"""What the recorder needs to know about an operator, read once from its schema and tags."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from .._compat import op_packet, op_schema, raw_call

# PyTorch has no tag for collectives: they are recognised by operator namespace.
COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "_c10d_functional_autograd", "c10d"})
# Ops that belong to FSDP's own machinery or to the profiler, never to the block's dataflow.
UNRECORDED_NAMESPACES = frozenset({"fsdp", "profiler"})
# PyTorch's own operator libraries: their ops that draw random numbers say so (tags, schemas).
# Any other op (a custom kernel) may draw from its device's generator unannounced.
ANNOUNCING_NAMESPACES = frozenset({"aten", "prims", *COLLECTIVE_NAMESPACES, *UNRECORDED_NAMESPACES})

# Ops that read only their tensor input's metadata. Replay rebuilds their output from the recorded
# shape, strides, dtype and device, so they add no data dependency (a dropout mask made with
# ``empty_like(x)`` must not drag the producer of ``x`` into every replay).
_FILL = {
    "empty_like": None,
    "new_empty": None,
    "new_empty_strided": None,
    "zeros_like": 0,
    "new_zeros": 0,
    "ones_like": 1,
    "new_ones": 1,
}
_FILL_FROM_ARG = {"full_like": 1, "new_full": 2}  # position of the fill value
# Random ops of the same kind: replayed on a stand-in input with the recorded metadata.
_RANDOM_LIKE = frozenset({"rand_like", "randn_like", "randint_like"})
# Uninitialised allocations: a recorded read before any recorded write means an invisible kernel
# filled the buffer, so it must be saved.
_ALLOCATIONS = frozenset(
    {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "empty_permuted"}
)
# Ops that return their input's content, storage and layout unchanged: the same value.
_IDENTITY = frozenset({"detach", "alias", "lift_fresh"})
# Ops whose output aliases their input although the schema says nothing about it.
_UNANNOTATED_VIEWS = frozenset({"_unsafe_view"})
# Ops that write arguments their schema does not mark as written: the legacy batch norm
# kernels update the running statistics in place (when training, where a flag says so).
_RUNNING_STATS = ((3, "running_mean"), (4, "running_var"))
_UNDECLARED_WRITES: dict[str, tuple[tuple[tuple[int, str], ...], tuple[int, str] | None]] = {
    "native_batch_norm": (_RUNNING_STATS, (5, "training")),
    "cudnn_batch_norm": (_RUNNING_STATS, (5, "training")),
    "miopen_batch_norm": (_RUNNING_STATS, (5, "training")),
    "batch_norm_update_stats": (((1, "running_mean"), (2, "running_var")), None),
}


@dataclass(frozen=True, slots=True)
class OpInfo:
    """Facts about one operator overload that recording and replay act on."""

    name: str
    qualname: str  # ``namespace::name``, as deterministic_ops names it
    unrecorded: bool
    collective: bool
    view: bool  # outputs are views of an input (the schema says so): they share its version
    aliasing: bool  # outputs share an input's storage, views or not (``_unsafe_view``)
    mutated: tuple[tuple[int, str], ...]  # (position, name) of arguments the op writes
    writes_if: tuple[int, str] | None  # (position, name) of a flag without which it does not
    random: bool  # may draw random numbers: see ``is_random_call``
    unannounced: bool  # random only because nothing says it is not (a custom op)
    dropout_arg: tuple[int, str, float] | None  # (position, name, default) of ``dropout_p``
    generator_arg: tuple[int, str] | None  # (position, name) of a ``Generator`` argument
    dynamic_shape: bool
    metadata_only: bool
    allocation: bool
    identity: bool
    holds_outputs: bool  # outputs may be mandatory (collectives, data-dependent shapes)
    retargets: bool  # ``set_``: points a tensor at other bytes, which replay cannot follow
    plain: bool  # none of the above: fresh outputs, nothing to capture or refuse
    simple_view: bool  # a view op, otherwise plain: its output shares its first input's storage
    call: Any  # what calling the op runs: OpOverload.__call__ only forwards to it, a Python frame


def _is_generator(t: Any) -> bool:
    """A schema argument type ``Generator`` or ``Generator?``."""
    inner = t.getElementType() if isinstance(t, torch.OptionalType) else t
    return str(inner) == "Generator"


@functools.cache
def op_info(op: Any) -> OpInfo:
    """Read an operator's schema and tags once."""
    name = str(op)
    namespace = getattr(op, "namespace", "")
    packet = op_packet(op) or (name.split(".")[1] if "." in name else name)
    schema = op_schema(op)
    tags = set(getattr(op, "tags", ()))
    mutated = tuple(
        (i, a.name)
        for i, a in enumerate(schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    )
    undeclared = _UNDECLARED_WRITES.get(packet) if namespace == "aten" else None
    if undeclared is not None:
        mutated = undeclared[0]
    view = not mutated and any(r.alias_info is not None for r in schema.returns)
    dropout_arg = next(
        (
            (i, a.name, float(a.default_value or 0.0))
            for i, a in enumerate(schema.arguments)
            if a.name == "dropout_p"
        ),
        None,
    )
    generator_arg = next(
        ((i, a.name) for i, a in enumerate(schema.arguments) if _is_generator(a.type)), None
    )
    announced = (
        torch.Tag.nondeterministic_seeded in tags
        or dropout_arg is not None
        or generator_arg is not None
    )
    unannounced = not announced and namespace not in ANNOUNCING_NAMESPACES
    random = announced or unannounced
    special = (
        namespace in UNRECORDED_NAMESPACES
        or namespace in COLLECTIVE_NAMESPACES
        or bool(mutated)
        or packet in _IDENTITY
        or random
        or torch.Tag.dynamic_output_shape in tags
        or packet in _ALLOCATIONS
        or packet in _FILL
        or packet in _FILL_FROM_ARG
        or packet in _RANDOM_LIKE
    )
    return OpInfo(
        name=name,
        qualname=f"{namespace}::{packet}",
        unrecorded=namespace in UNRECORDED_NAMESPACES,
        collective=namespace in COLLECTIVE_NAMESPACES,
        view=view,
        aliasing=view or packet in _UNANNOTATED_VIEWS,
        mutated=mutated,
        writes_if=undeclared[1] if undeclared is not None else None,
        random=random,
        unannounced=unannounced,
        dropout_arg=dropout_arg,
        generator_arg=generator_arg,
        dynamic_shape=torch.Tag.dynamic_output_shape in tags,
        metadata_only=packet in _FILL or packet in _FILL_FROM_ARG or packet in _RANDOM_LIKE,
        allocation=packet in _ALLOCATIONS,
        identity=packet in _IDENTITY and namespace == "aten",
        holds_outputs=namespace in COLLECTIVE_NAMESPACES or torch.Tag.dynamic_output_shape in tags,
        retargets=namespace == "aten" and packet == "set_",
        plain=not (special or view or packet in _UNANNOTATED_VIEWS),
        simple_view=view and not special,
        call=raw_call(op),
    )


def arg(args: tuple, kwargs: dict, position: int, name: str, default: Any = None) -> Any:
    """An argument by schema position or keyword."""
    if position < len(args):
        return args[position]
    return kwargs.get(name, default)


def is_random_call(info: OpInfo, args: tuple, kwargs: dict) -> bool:
    """Whether this call draws random numbers, so replay must restore the generator it drew from.

    The rule: an op is random if it carries the ``nondeterministic_seeded`` tag (ATen's random
    ops; ``register_kernel(..., random=True)`` adds it), or its schema takes a ``Generator``, or
    it takes a ``dropout_p`` argument. Many custom ops carry no tag although they draw random
    numbers (flash-attn's forward with attention dropout, Triton kernels with fused dropout), so
    the schema decides too, and an op outside PyTorch's own libraries counts as random unless
    declared deterministic (``checkpoint_modules(..., deterministic_ops=...)``): capturing a
    generator it does not use costs a state copy, replaying new random numbers costs wrong
    gradients. An op with a ``dropout_p`` draws only when ``dropout_p`` is not 0: attention ops
    are tagged random even at dropout 0.
    """
    if not info.random:
        return False
    if info.dropout_arg is not None:
        position, name, default = info.dropout_arg
        return float(arg(args, kwargs, position, name, default)) != 0.0
    return True


def has_dynamic_shape(op: Any, info: OpInfo, args: tuple, kwargs: dict) -> bool:
    """Whether the output shape depends on data values, so replay would need a host sync.

    ``index.Tensor`` is tagged because boolean masks are allowed, but integer indices have a shape
    known without reading them; ``repeat_interleave`` with ``output_size`` likewise.
    """
    if not info.dynamic_shape:
        return False
    if op is torch.ops.aten.index.Tensor:
        return any(
            t is not None and (t.dtype == torch.bool or t.dtype == torch.uint8) for t in args[1]
        )
    if op is torch.ops.aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None
    return True


def rebuild_output(
    op: Any, node_args: tuple, node_kwargs: dict, out_meta: Any, in_meta: Any
) -> torch.Tensor:
    """Replay a metadata-only op without its input's data: from recorded output metadata."""
    packet = op_packet(op) or str(op)
    if packet in _RANDOM_LIKE:
        # The random stream depends on the input's layout only: a stand-in with its metadata works.
        stand_in = torch.empty_strided(
            in_meta.shape, in_meta.stride, dtype=in_meta.dtype, device=in_meta.device
        )
        return op(stand_in, *node_args[1:], **node_kwargs)
    out = torch.empty_strided(
        out_meta.shape, out_meta.stride, dtype=out_meta.dtype, device=out_meta.device
    )
    if packet in _FILL_FROM_ARG:
        out.fill_(node_args[_FILL_FROM_ARG[packet]])
    elif (fill := _FILL[packet]) is not None:
        out.fill_(fill)
    return out
