"""Turn an opaque kernel's autograd.Function into one dispatcher op that the tape can record and replay."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from .._compat import op_exists, parse_schema, tree_leaves

CtxAttributes = Callable[..., dict[str, Any]]


def register_kernel(
    qualname: str,
    function: type[torch.autograd.Function],
    *,
    schema: str,
    fake: Callable[..., Any],
    outputs: int = 1,
    ctx_attributes: CtxAttributes | None = None,
    random: bool = False,
) -> Callable[..., Any]:
    """Register ``function`` as the custom op ``qualname``; return a drop-in for ``function.apply``.

    Kernels launched from an autograd.Function (Triton, CUDA extensions) are invisible to the
    dispatcher. The op runs the Function's forward as ONE dispatcher call and uses its backward,
    so the tape records it as one node, can replay it, and sees every tensor backward needs.

    The user provides:

    - ``qualname``: ``"namespace::name"``, e.g. ``"mylib::fused_rmsnorm"``. Op names are global to
      the process; registering a name twice raises.
    - ``function``: the autograd.Function, with ``forward(ctx, *args)`` or ``forward(*args)`` plus
      ``setup_context``. It must be out-of-place and return a tensor or a tuple of tensors.
    - ``schema``: the torch.library schema without the name, e.g.
      ``"(Tensor x, Tensor w, float eps) -> (Tensor, Tensor)"``. Its arguments are forward's
      arguments in order (no keyword-only ``*``). Its returns are the Function's ``outputs``
      outputs, then one ``Tensor`` per ctx-only tensor: every tensor forward keeps on ctx that
      is neither an input nor an output, first those passed to ``ctx.save_for_backward`` in
      order, then tensor attributes (``ctx.rstd = rstd``) in order of first assignment.
    - ``fake(*args)``: returns all the schema's returns as empty tensors with the right
      shapes, dtypes and devices (e.g. ``x.new_empty(...)``); used under fake tensors.
    - ``outputs``: how many of the returns are the Function's own outputs.
    - ``ctx_attributes(*args)``: returns every non-tensor attribute forward sets on ctx
      (e.g. ``{"eps": eps}``). Backward reads these values, also under fake tensors where
      forward does not run. Each real call checks forward set no other non-tensor attribute
      and that the values agree.
    - ``random``: True if forward draws random numbers (a fused dropout, noise). The op then
      carries the ``nondeterministic_seeded`` tag, and the tape captures the generator state at
      each call and restores it when replay runs the op again, so replay draws the same numbers.
      Without it the op is still taken as random, as every op outside PyTorch's own libraries
      is unless ``checkpoint_modules(..., deterministic_ops=...)`` declares it deterministic
      (see ``ops.is_random_call``): its device's generator is captured at each call.

    The returned callable takes forward's arguments and returns the Function's outputs (a bare
    tensor when ``outputs == 1``), with the same values and gradients as ``function.apply``.
    The op itself is ``torch.ops.<namespace>.<name>.default`` and also returns the ctx-only tensors.

    The ctx layout (which saved tensor is which input, output or ctx-only tensor, plus
    ``mark_non_differentiable`` and ``set_materialize_grads``) is learned from the first call
    on real tensors and kept with the op; a later call with a different layout raises. So
    run the op once eagerly before tracing it with fake tensors (torch.compile, opcheck).
    Forward sees ``ctx.needs_input_grad`` as True for every tensor argument.
    """
    parsed = _parse_schema(qualname, schema, outputs)
    _check_forward_arity(qualname, function, parsed)
    _check_unregistered(qualname)
    kernel = _Kernel(qualname, function, parsed, fake, outputs, ctx_attributes)
    # custom_op keeps its Library in torch's own registry, so the registration lives as long as the process.
    tags = (torch.Tag.nondeterministic_seeded,) if random else ()
    op = torch.library.custom_op(
        qualname, kernel.forward, mutates_args=(), schema=schema, tags=tags
    )
    op.register_fake(kernel.fake)
    op.register_autograd(kernel.backward, setup_context=kernel.setup_context)

    def apply(*args: Any, **kwargs: Any) -> Any:
        returns = _as_tuple(op(*args, **kwargs))
        return returns[0] if outputs == 1 else returns[:outputs]

    return apply


@dataclass(frozen=True)
class _CtxLayout:
    """Where each tensor forward kept on ctx lives, as an index into (*op inputs, *op returns)."""

    saved: tuple[int | None, ...]
    tensor_attributes: tuple[tuple[str, int], ...]
    non_differentiable: tuple[int, ...]
    materialize_grads: bool


class _RecordingCtx:
    """Stands in for ctx while forward runs inside the op, recording what it keeps for backward."""

    # Forward's own attributes land in __dict__, apart from the recording state.
    __slots__ = (
        "__dict__",
        "_materialize_grads",
        "_non_differentiable",
        "_saved",
        "needs_input_grad",
    )

    def __init__(self, needs_input_grad: tuple[bool, ...]) -> None:
        self._saved: tuple[Tensor | None, ...] = ()
        self._non_differentiable: tuple[Tensor, ...] = ()
        self._materialize_grads = True
        self.needs_input_grad = needs_input_grad

    def save_for_backward(self, *tensors: Tensor | None) -> None:
        """Record the tensors backward will read from ``ctx.saved_tensors``."""
        self._saved = tensors

    def mark_non_differentiable(self, *tensors: Tensor) -> None:
        """Record outputs that get no gradient."""
        self._non_differentiable += tensors

    def set_materialize_grads(self, value: bool) -> None:
        """Record whether backward receives zeros or None for outputs without a gradient."""
        self._materialize_grads = value

    def mark_dirty(self, *tensors: Tensor) -> None:
        """Reject in-place forwards: the op must not modify its inputs."""
        raise TypeError(
            "register_kernel needs an out-of-place Function, but forward called ctx.mark_dirty: "
            "return a new tensor instead of modifying an input."
        )


class _Kernel:
    """The op's implementation, fake and autograd formula for one registered Function."""

    def __init__(
        self,
        qualname: str,
        function: type[torch.autograd.Function],
        schema: torch.FunctionSchema,
        fake: Callable[..., Any],
        outputs: int,
        ctx_attributes: CtxAttributes | None,
    ) -> None:
        self.qualname = qualname
        self.function = function
        self.schema = schema
        self.user_fake = fake
        self.outputs = outputs
        self.ctx_attributes = ctx_attributes
        self.layout: _CtxLayout | None = None

    def forward(self, *args: Any) -> Tensor | tuple[Tensor, ...]:
        """Run the Function's forward on real tensors; return its outputs, then its ctx-only tensors."""
        args = _with_defaults(self.schema, args)
        ctx = _RecordingCtx(tuple(isinstance(a, Tensor) for a in args))
        outs = _as_tuple(_run_forward(self.function, ctx, args))
        if len(outs) != self.outputs:
            raise ValueError(
                f"{self.qualname}: forward returned {len(outs)} tensors but outputs={self.outputs}."
            )
        layout, ctx_tensors = _learn_layout(args, outs, ctx)
        self._check_ctx_tensors(layout, ctx_tensors, [*args, *outs])
        self._remember(layout)
        self._check_attributes(vars(ctx), args)
        return _from_tuple((*outs, *ctx_tensors))

    def fake(self, *args: Any) -> Tensor | tuple[Tensor, ...]:
        """Call the user's fake and check it returns every schema return."""
        returns = _as_tuple(self.user_fake(*_with_defaults(self.schema, args)))
        if len(returns) != len(self.schema.returns):
            raise ValueError(
                f"{self.qualname}: fake returned {len(returns)} tensors but the schema declares "
                f"{len(self.schema.returns)}: the Function's {self.outputs} outputs, "
                "then its ctx-only tensors."
            )
        return _from_tuple(returns)

    def setup_context(self, ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        """Save what the Function's backward reads, in the layout learned from the first real call."""
        layout = self._known_layout()
        returns = _as_tuple(output)
        sources = (*inputs, *returns)
        ctx.save_for_backward(
            *(None if i is None else sources[i] for i in layout.saved),
            *(sources[i] for _, i in layout.tensor_attributes),
        )
        ctx.mark_non_differentiable(
            *(returns[j] for j in layout.non_differentiable), *returns[self.outputs :]
        )
        # Autograd would otherwise allocate zero gradients as large as the hidden ctx-only returns;
        # backward materializes the Function's own outputs itself when the Function asks for it.
        ctx.set_materialize_grads(False)
        ctx.tapesac_attributes = self._attributes(inputs)
        ctx.tapesac_output_meta = [(o.shape, o.dtype, o.device) for o in returns[: self.outputs]]

    def backward(self, ctx: Any, *grads: Tensor | None) -> Any:
        """Call the Function's backward with a ctx that looks like the one its forward filled."""
        layout = self._known_layout()
        saved = ctx.saved_tensors
        n_saved = len(layout.saved)
        tensor_attributes = {
            name: t for (name, _), t in zip(layout.tensor_attributes, saved[n_saved:], strict=True)
        }
        function_ctx = SimpleNamespace(
            **{**ctx.tapesac_attributes, **tensor_attributes},
            saved_tensors=saved[:n_saved],
            needs_input_grad=ctx.needs_input_grad,
        )
        own_grads = grads[: self.outputs]
        if layout.materialize_grads:
            own_grads = tuple(
                torch.zeros(shape, dtype=dtype, device=device) if g is None else g
                for g, (shape, dtype, device) in zip(
                    own_grads, ctx.tapesac_output_meta, strict=True
                )
            )
        return self.function.backward(function_ctx, *own_grads)

    def _known_layout(self) -> _CtxLayout:
        if self.layout is None:
            raise RuntimeError(
                f"{self.qualname} has not run on real tensors yet, so TapeSAC does not know what its "
                "forward keeps on ctx (register_kernel learns it from the first real call). "
                "Call it once eagerly before tracing it with fake tensors (torch.compile, opcheck)."
            )
        return self.layout

    def _remember(self, layout: _CtxLayout) -> None:
        if self.layout is None:
            self.layout = layout
        elif layout != self.layout:
            raise RuntimeError(
                f"{self.qualname}: forward kept different tensors on ctx than on its first call "
                f"(first: {self._describe(self.layout)}; now: {self._describe(layout)}). "
                "One op needs one ctx layout: register one op per variant of the Function."
            )

    def _check_ctx_tensors(
        self, layout: _CtxLayout, ctx_tensors: list[Tensor], known: list[Any]
    ) -> None:
        expected = len(self.schema.returns) - self.outputs
        if len(ctx_tensors) != expected:
            raise ValueError(
                f"{self.qualname}: forward keeps {len(ctx_tensors)} tensors only on ctx but the schema "
                f"has room for {expected} ({len(self.schema.returns)} returns, outputs={self.outputs}). "
                f"Forward kept: {self._describe(layout)}. Declare one Tensor return per ctx tensor "
                "after the outputs, in that order, and return them from fake."
            )
        for k, t in enumerate(ctx_tensors):
            for i, other in enumerate([*known, *ctx_tensors[:k]]):
                if isinstance(other, Tensor) and _shares_memory(t, other):
                    raise ValueError(
                        f"{self.qualname}: forward keeps a view of {self._slot_name(i)} on ctx as "
                        f"ctx tensor {k}, and an op cannot return a view of its inputs or outputs. "
                        "Keep the tensor itself on ctx (save x, not x.view(...)) "
                        "and take the view in backward."
                    )

    def _check_attributes(self, recorded: dict[str, Any], args: tuple[Any, ...]) -> None:
        provided = self._attributes(args)
        for name, value in recorded.items():
            if isinstance(value, Tensor):
                continue
            if any(isinstance(leaf, Tensor) for leaf in tree_leaves(value)):
                raise TypeError(
                    f"{self.qualname}: forward sets ctx.{name} to a container of tensors, which "
                    "TapeSAC cannot see. Give each tensor its own attribute or pass it to save_for_backward."
                )
            if name not in provided:
                raise ValueError(
                    f"{self.qualname}: forward sets ctx.{name} = {value!r}, which ctx_attributes does not "
                    f"provide. Backward may read it, also under fake tensors: return it from "
                    f"ctx_attributes, e.g. ctx_attributes=lambda *args: {{{name!r}: ...}}."
                )
            if provided[name] != value:
                raise ValueError(
                    f"{self.qualname}: forward sets ctx.{name} = {value!r} but ctx_attributes returns "
                    f"{provided[name]!r}; they must agree."
                )

    def _attributes(self, args: tuple[Any, ...]) -> dict[str, Any]:
        return {} if self.ctx_attributes is None else self.ctx_attributes(*args)

    def _describe(self, layout: _CtxLayout) -> str:
        saved = ", ".join(self._slot_name(i) for i in layout.saved)
        attributes = ", ".join(
            f"ctx.{name}={self._slot_name(i)}" for name, i in layout.tensor_attributes
        )
        return (
            f"saved ({saved}), tensor attributes ({attributes}), non-differentiable outputs "
            f"{list(layout.non_differentiable)}, materialize_grads={layout.materialize_grads}"
        )

    def _slot_name(self, index: int | None) -> str:
        n_inputs = len(self.schema.arguments)
        if index is None:
            return "None"
        if index < n_inputs:
            return f"input {self.schema.arguments[index].name}"
        if index < n_inputs + self.outputs:
            return f"output {index - n_inputs}"
        return f"ctx tensor {index - n_inputs - self.outputs}"


def _learn_layout(
    args: tuple[Any, ...], outs: tuple[Tensor, ...], ctx: _RecordingCtx
) -> tuple[_CtxLayout, list[Tensor]]:
    """Index what forward kept on ctx; tensors that are neither inputs nor outputs become ctx tensors."""
    sources: list[Any] = [*args, *outs]
    n_known = len(sources)

    def slot(t: Tensor) -> int:
        # Identity, not equality: a saved input must be found as that input, even if values repeat.
        for i, source in enumerate(sources):
            if source is t:
                return i
        sources.append(t)
        return len(sources) - 1

    layout = _CtxLayout(
        saved=tuple(None if t is None else slot(t) for t in ctx._saved),
        tensor_attributes=tuple(
            (name, slot(v)) for name, v in vars(ctx).items() if isinstance(v, Tensor)
        ),
        non_differentiable=tuple(slot(t) - len(args) for t in ctx._non_differentiable),
        materialize_grads=ctx._materialize_grads,
    )
    return layout, sources[n_known:]


def _run_forward(
    function: type[torch.autograd.Function], ctx: _RecordingCtx, args: tuple[Any, ...]
) -> Any:
    """Run forward the way Function.apply would, for either ctx style."""
    if not _has_setup_context(function):
        return function.forward(ctx, *args)
    result = function.forward(*args)
    function.setup_context(ctx, args, result)
    return result


def _has_setup_context(function: type[torch.autograd.Function]) -> bool:
    return function.setup_context is not torch.autograd.Function.setup_context


def _with_defaults(schema: torch.FunctionSchema, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Work around the dispatcher dropping trailing default-valued arguments before a Python kernel."""
    return (*args, *(a.default_value for a in schema.arguments[len(args) :]))


def _shares_memory(a: Tensor, b: Tensor) -> bool:
    # Empty and meta storages all report address 0 without sharing anything.
    address = a.untyped_storage().data_ptr()
    return address != 0 and address == b.untyped_storage().data_ptr()


def _as_tuple(result: Tensor | tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    return result if isinstance(result, tuple) else (result,)


def _from_tuple(returns: tuple[Tensor, ...]) -> Tensor | tuple[Tensor, ...]:
    return returns[0] if len(returns) == 1 else returns


def _parse_schema(qualname: str, schema: str, outputs: int) -> torch.FunctionSchema:
    """Parse and check the schema before anything is registered, so a fixed retry can reuse the name."""
    namespace, _, name = qualname.partition("::")
    if not (namespace.isidentifier() and name.isidentifier()):
        raise ValueError(f"qualname must look like 'mylib::fused_rmsnorm', got {qualname!r}.")
    try:
        parsed = parse_schema(name + schema)
    except RuntimeError as error:
        raise ValueError(
            f"{qualname}: cannot parse schema {schema!r}; write it without the name, like "
            f"'(Tensor x, Tensor w, float eps) -> (Tensor, Tensor)'. Parser said: {error}"
        ) from error
    if any(a.kwarg_only for a in parsed.arguments):
        raise ValueError(
            f"{qualname}: forward takes positional arguments; remove the '*' from the schema."
        )
    if not all(isinstance(r.type, torch.TensorType) for r in parsed.returns):
        raise ValueError(f"{qualname}: every schema return must be a plain Tensor, got {schema!r}.")
    if not 1 <= outputs <= len(parsed.returns):
        raise ValueError(
            f"{qualname}: outputs={outputs} but the schema has {len(parsed.returns)} returns; "
            "list the Function's outputs first, then its ctx-only tensors."
        )
    return parsed


def _check_forward_arity(
    qualname: str, function: type[torch.autograd.Function], schema: torch.FunctionSchema
) -> None:
    parameters = list(inspect.signature(function.forward).parameters.values())
    if not _has_setup_context(function):
        parameters = parameters[1:]  # ctx
    if any(p.kind is p.VAR_POSITIONAL for p in parameters):
        return
    if len(parameters) != len(schema.arguments):
        raise ValueError(
            f"{qualname}: the schema lists {len(schema.arguments)} arguments but "
            f"{function.__name__}.forward takes {len(parameters)} "
            f"({', '.join(p.name for p in parameters)}); list forward's arguments in order."
        )


def _check_unregistered(qualname: str) -> None:
    """Refuse a taken name: torch.library.custom_op would silently replace an op it made earlier."""
    if not op_exists(qualname):
        return
    raise RuntimeError(
        f"{qualname} is already registered in this process. Op names are global: pick another name, "
        "or reuse the callable the first register_kernel call returned."
    )
