"""Signatures: the part of a call that a trace is valid for, and how a call feeds a trace.

A trace specialises on some facts about the call it was made from. fxpipe makes those
facts explicit as a :class:`TraceKey`, so a trace is reused exactly for the calls it fits
and made again for any other:

- which arguments are None or absent (after the forward's defaults are applied: an
  absent argument and one passed as its default are the same call);
- every other non-tensor value (bools, ints, floats, strings, dtypes, devices): traced as
  constants, so ``if mask is None`` and ``if use_cache`` take the branch the call takes;
- the structure of containers (tuples, lists, dicts) holding tensors;
- each tensor's dtype and rank, and the sizes the trace bakes in: none under torch.fx
  (its graphs read sizes at run time), every size under torch.export with static shapes,
  every size except the batch dimensions it kept symbolic under a dynamic-batch export.

Tensor default arguments (``scale=torch.tensor(2.0)``) are inputs like any tensor: the
default is bound at call time, never embedded in the graph.

:class:`CallSpec` is what a trace records about its inputs: ``bind`` turns a call into one
value per graph placeholder, ``key`` gives the call's TraceKey in the trace's terms.
Writes no ``node.meta`` keys.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

# values traced as constants: a trace made for one of them is valid for that value only
CONSTANT_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout, torch.memory_format, enum.Enum)

_SHORT_DTYPES = {
    torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "bool",
}


class SignatureError(TypeError):
    """A call does not fit a trace (another None pattern, constant, dtype or structure)."""


@dataclass(frozen=True)
class TensorSig:
    """A tensor as a trace sees it: dtype and, per dimension, the size it bakes in (None: any)."""

    dtype: torch.dtype
    shape: tuple[int | None, ...]

    def __str__(self) -> str:
        dtype = _SHORT_DTYPES.get(self.dtype, str(self.dtype).replace("torch.", ""))
        return f"{dtype}[{', '.join('*' if s is None else str(s) for s in self.shape)}]"

    def batch_free(self, batch: int | None) -> TensorSig:
        """The same without dim 0 when it is the batch (the dimension micro-batching cuts)."""
        if self.shape and self.shape[0] == batch:
            return TensorSig(self.dtype, (None, *self.shape[1:]))
        return self


@dataclass(frozen=True)
class Constant:
    """A non-tensor value traced as a constant; ``kind`` keeps ``True`` apart from ``1``."""

    kind: str
    value: Any

    def __str__(self) -> str:
        return repr(self.value)


@dataclass(frozen=True)
class Opaque:
    """An object fx keeps as a proxy (the graph is generic in it): keyed by its type only."""

    kind: str

    def __str__(self) -> str:
        return f"<{self.kind}>"


@dataclass(frozen=True)
class TraceKey:
    """The hashable part of a call a trace is valid for: per forward argument, in order, its
    pytree structure and one descriptor (TensorSig, Constant or Opaque) per leaf."""

    arguments: tuple[tuple[str, pytree.TreeSpec, tuple[Any, ...]], ...]

    def __str__(self) -> str:
        parts = []
        for name, spec, leaves in self.arguments:
            parts.append(f"{name}: {_render_argument(spec, leaves)}")
        return ", ".join(parts)

    def brief(self) -> str:
        """Like ``str``, without the arguments that are None and empty containers: what a
        summary shows of a signature (``input_ids: i64[*, 16]``)."""
        parts = []
        for name, spec, leaves in self.arguments:
            if not leaves or all(isinstance(d, Constant) and d.value is None for d in leaves):
                continue
            parts.append(f"{name}: {_render_argument(spec, leaves)}")
        return ", ".join(parts) or "(no arguments)"

    def batch_free(self) -> TraceKey:
        """The key without the batch size: dim 0 of every tensor whose dim 0 is the first
        tensor's (the batch, which micro-batching cuts; a symbolic one counts too). What a
        whole batch and each of its micro-batches agree on."""
        tensors = [d for _, _, leaves in self.arguments for d in leaves if isinstance(d, TensorSig) and d.shape]
        batch = tensors[0].shape[0] if tensors else None
        return TraceKey(
            tuple((n, s, tuple(d.batch_free(batch) if isinstance(d, TensorSig) else d for d in leaves)) for n, s, leaves in self.arguments)
        )

    def differences(self, other: TraceKey) -> list[str]:
        """``"name: mine -> other's"`` for every argument that differs."""
        theirs = {name: (spec, leaves) for name, spec, leaves in other.arguments}
        lines = []
        for name, spec, leaves in self.arguments:
            if theirs.get(name) != (spec, leaves):
                other_spec, other_leaves = theirs.get(name, (pytree.tree_flatten(None)[1], (Constant("absent", None),)))
                lines.append(f"{name}: {_render_argument(spec, leaves)} -> {_render_argument(other_spec, other_leaves)}")
        return lines


def _render(value: Any) -> str:
    if isinstance(value, tuple | list):
        inner = ", ".join(_render(v) for v in value)
        return f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_render(v)}" for k, v in value.items()) + "}"
    return str(value)


def _render_argument(spec: pytree.TreeSpec, leaves: tuple[Any, ...]) -> str:
    """One argument of a key: builtin containers as Python writes them, a registered class
    by its type, its children and the Python values it keeps in its context
    (``PackedMask(i64[*, *], bool[*, *, *]; context (9, True))``), never by rebuilding it
    from descriptors."""
    if not _has_registered_class(spec):
        return _render(pytree.tree_unflatten(list(leaves), spec))
    rendered = iter(_render_tree(spec, iter(leaves)))
    return next(rendered)


def _has_registered_class(spec: pytree.TreeSpec) -> bool:
    if spec.is_leaf():
        return False
    return spec.type not in pytree.BUILTIN_TYPES or any(_has_registered_class(c) for c in spec.children())


def _render_tree(spec: pytree.TreeSpec, leaves: Iterator[Any]) -> list[str]:
    if spec.is_leaf():
        return [str(next(leaves))]
    children = [text for child in spec.children() for text in _render_tree(child, leaves)]
    if spec.type in pytree.BUILTIN_TYPES:
        return [_render(pytree.tree_unflatten([_Text(c) for c in children], spec))]
    context = spec.context
    names = context[0] if dataclasses.is_dataclass(spec.type) and isinstance(context, list) and len(context) == 2 else None
    if isinstance(names, list) and len(names) == len(children):
        return [f"{spec.type.__name__}({', '.join(f'{n}={c}' for n, c in zip(names, children))})"]
    return [f"{spec.type.__name__}({', '.join(children)}; context {context!r})"]


class _Text(str):
    """A rendered piece placed back into a builtin container, printed as is."""

    __slots__ = ()


def is_constant(value: Any) -> bool:
    """Whether a value is traced as a constant (None, bool, number, string, dtype, device, enum)."""
    return isinstance(value, CONSTANT_TYPES)


def describe_leaf(value: Any, sizes: tuple[bool, ...] | bool) -> Any:
    """A leaf's descriptor. ``sizes``: per dimension whether the trace bakes it (or one bool
    for every dimension)."""
    if isinstance(value, torch.Tensor):
        baked = sizes if isinstance(sizes, tuple) else (sizes,) * value.dim()
        return TensorSig(value.dtype, tuple(int(s) if b else None for s, b in zip(value.shape, baked)))
    if is_constant(value):
        return Constant(type(value).__qualname__, value)
    return Opaque(f"{type(value).__module__}.{type(value).__qualname__}")


def bind_call(signature: inspect.Signature, owner: str, args: tuple, kwargs: Mapping[str, Any]) -> inspect.BoundArguments:
    """The call bound to ``signature`` with every default applied.

    Raises SignatureError (a TypeError) when the arguments do not fit the forward.
    """
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as err:
        raise SignatureError(f"inputs do not match {owner}.forward{signature}: {err}") from None
    bound.apply_defaults()
    return bound


def flat_leaves(value: Any) -> tuple[list[Any], pytree.TreeSpec]:
    """The pytree leaves and structure of one argument (a tensor or constant is one leaf)."""
    return pytree.tree_flatten(value)


def trace_key(model: torch.nn.Module, args: tuple = (), kwargs: Mapping[str, Any] | None = None, frontend: str = "fx") -> TraceKey:
    """The TraceKey of ``model(*args, **kwargs)`` for a trace by ``frontend``.

    "fx": dtypes and ranks, no sizes (fx graphs read sizes at run time); "export": every
    size (torch.export with static shapes). Two calls with equal keys are served by one
    trace. Raises SignatureError when the arguments do not fit ``model.forward``.
    """
    if frontend not in ("fx", "export"):
        raise ValueError(f"trace_key: frontend must be 'fx' or 'export', got {frontend!r}")
    signature = inspect.signature(model.forward)
    bound = bind_call(signature, type(model).__name__, tuple(args), dict(kwargs or {}))
    spec = CallSpec(signature, type(model).__name__, picks=(), sizes=frontend == "export")
    return spec.key_of_bound(bound)


@dataclass(frozen=True)
class CallSpec:
    """How one trace reads a call.

    picks: per graph placeholder, the forward argument it takes and which pytree leaf of it
        (None: the whole value, as fx keeps it).
    sizes: whether the trace bakes tensor sizes (export) or not (fx).
    baked: per (argument, leaf) the dimensions a dynamic-batch export kept symbolic are
        False; leaves not listed follow ``sizes``.
    """

    signature: inspect.Signature
    owner: str
    picks: tuple[tuple[str, int | None], ...]
    sizes: bool
    baked: Mapping[tuple[str, int], tuple[bool, ...]] = field(default_factory=dict)

    def bound(self, args: tuple, kwargs: Mapping[str, Any]) -> inspect.BoundArguments:
        return bind_call(self.signature, self.owner, tuple(args), dict(kwargs))

    def key_of_bound(self, bound: inspect.BoundArguments) -> TraceKey:
        arguments = []
        for name, value in bound.arguments.items():
            leaves, spec = flat_leaves(value)
            descs = tuple(describe_leaf(leaf, self.baked.get((name, k), self.sizes)) for k, leaf in enumerate(leaves))
            arguments.append((name, spec, descs))
        return TraceKey(tuple(arguments))

    def key(self, args: tuple = (), kwargs: Mapping[str, Any] | None = None) -> TraceKey:
        """The call's TraceKey in this trace's terms (sizes it bakes, none it does not).

        Raises SignatureError when the arguments do not fit the forward."""
        return self.key_of_bound(self.bound(args, kwargs or {}))

    def values(self, bound: inspect.BoundArguments) -> list[Any]:
        """One value per placeholder, picked from a bound call."""
        leaves: dict[str, list[Any]] = {}
        out = []
        for name, leaf in self.picks:
            value = bound.arguments[name]
            if leaf is None:
                out.append(value)
                continue
            if name not in leaves:
                leaves[name] = flat_leaves(value)[0]
            out.append(leaves[name][leaf])
        return out
