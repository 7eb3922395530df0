"""Opaque callees: what the fx frontend runs whole because fx cannot trace into it.

When fx cannot trace a module's forward or a function (a Python branch on a tensor's
values, a context manager fx cannot record such as ``torch.autocast``, a helper that
inspects its arguments), the fx frontend (``passes/fx_tracer.py``) calls it as one graph
node instead and traces on around it:

- a module becomes a ``call_module`` node (as a leaf module would);
- a function becomes a ``call_function`` node whose target is an :class:`OpaqueCall`: the
  function with the call's non-graph arguments (a config object, flags) kept in it; the
  graph passes the tensors and the modules (as ``get_attr`` nodes, so each stage holds its
  own copy).

The trace learns what the callee returns by running it on fake tensors. The traced code
after it sees that structure with the constants it held (``None``, flags, sizes) and a
graph value for each tensor; an :class:`OutputGuard` node after the call checks at run
time that the callee returns the same structure and constants, and hands the tensors on.

Writes ``node.meta["opaque"]``: the :class:`OpaqueCallee` on each opaque call node (what
it is, why it is opaque, where fx stopped, the modules it runs). Reads nothing.
"""

from __future__ import annotations

import types
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from fxpipe.passes.signature import is_constant


class OpaqueOutputError(RuntimeError):
    """An opaque callee returned another structure or constant than when it was traced."""


@dataclass(eq=False)
class OpaqueCallee:
    """Something the trace calls whole.

    name: the module path and class (``transformer.h.0.attn (GPT2Attention)``) or the
    function's qualified name; kind: "module" or "function"; reason: why fx could not trace
    into it (the exception's first line); line: ``file:line: `code``` of the user's source
    line where fx stopped ("" when unknown); modules: the module paths it runs (a split
    point inside cannot be honoured).
    """

    name: str
    kind: str
    reason: str
    line: str = ""
    modules: set[str] = field(default_factory=set)

    def describe(self) -> str:
        """One line: the callee, why it is opaque and where."""
        where = f" at {self.line}" if self.line else ""
        return f"{self.name} ({self.kind}): {self.reason}{where}"

    def contains(self, path: str) -> bool:
        """Whether module ``path`` runs inside this callee (the callee itself excluded)."""
        return any(path.startswith(m + ".") or (self.kind == "function" and path == m) for m in self.modules)


class OpaqueCall:
    """A function called whole: ``fn`` with the graph's values put back into the call.

    ``spec`` is the pytree structure of the call's ``(args, kwargs)``; ``baked`` its leaves
    with None where the graph passes the value (positions ``slots``). Equal calls (same
    function, structure and baked values) compare equal, so a fake replay runs one of them.
    """

    def __init__(self, fn: types.FunctionType, spec: pytree.TreeSpec, baked: tuple, slots: tuple[int, ...], callee: OpaqueCallee) -> None:
        self.fn, self.spec, self.baked, self.slots, self.callee = fn, spec, baked, slots, callee
        # fx's code generation names a call_function target by these
        self.__name__ = "opaque_" + "".join(c if c.isalnum() else "_" for c in fn.__qualname__)
        self.__qualname__ = self.__name__
        self.__module__ = __name__
        self._key = (fn, spec, slots, tuple(_by_value(v) for v in baked))

    def __call__(self, *values: Any) -> Any:
        leaves = list(self.baked)
        for slot, value in zip(self.slots, values):
            leaves[slot] = value
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return self.fn(*args, **kwargs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OpaqueCall) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        return f"OpaqueCall({self.fn.__module__}.{self.fn.__qualname__})"


class OutputGuard:
    """What the trace assumed of an opaque callee's output; called on it at run time.

    Returns the leaves the graph uses (``passed``: tensors and other objects) as a tuple,
    after checking the output's structure and its constant leaves (``constants``: position
    -> value). Raises OpaqueOutputError naming the callee and both structures otherwise.
    """

    def __init__(self, spec: pytree.TreeSpec, constants: dict[int, Any], passed: tuple[int, ...], callee: OpaqueCallee) -> None:
        self.spec, self.constants, self.passed, self.callee = spec, constants, passed, callee
        self.__name__ = "outputs_of_" + "".join(c if c.isalnum() else "_" for c in callee.name.split(" ")[0])
        self.__qualname__ = self.__name__
        self.__module__ = __name__
        self._key = (spec, passed, tuple(sorted((k, _by_value(v)) for k, v in constants.items())))

    def __call__(self, value: Any) -> tuple:
        leaves, spec = pytree.tree_flatten(value)
        if spec != self.spec or any(not _same_constant(leaves[k], v) for k, v in self.constants.items()):
            raise OpaqueOutputError(
                f"{self.callee.name} returned {_render(leaves, spec)} but the trace assumed {_render_expected(self)} "
                f"(it runs whole because {self.callee.reason}): its output depends on something the trace did not "
                "see (tensor values, or fake tensors taking another branch); trace with Plan(frontend='export'), "
                "or give the call inputs that keep its output's structure"
            )
        return tuple(leaves[k] for k in self.passed)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OutputGuard) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)


class TensorGuard:
    """What the trace assumed of an opaque callee that returned one tensor: that it returns
    a tensor at run time too (HF's ``eager_mask`` returns None for a micro-batch without
    padding). Returns it; raises OpaqueOutputError naming the callee otherwise."""

    def __init__(self, callee: OpaqueCallee) -> None:
        self.callee = callee
        self.__name__ = "tensor_of_" + "".join(c if c.isalnum() else "_" for c in callee.name.split(" ")[0])
        self.__qualname__ = self.__name__
        self.__module__ = __name__

    def __call__(self, value: Any) -> torch.Tensor:
        if not isinstance(value, torch.Tensor):
            raise OpaqueOutputError(
                f"{self.callee.name} returned {_render(*pytree.tree_flatten(value))} but the trace assumed a "
                f"tensor (it runs whole because {self.callee.reason}): its output depends on the values of this call "
                "(a mask builder returns None when no token is padded); give every micro-batch inputs that keep its "
                "output's structure (pad each micro-batch alike), or use an implementation that always returns a "
                "tensor (HF: attn_implementation='sdpa')"
            )
        return value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TensorGuard)

    def __hash__(self) -> int:
        return hash(TensorGuard)


def output_guard(value: Any, callee: OpaqueCallee, estimated: bool = False) -> OutputGuard | TensorGuard:
    """The guard for an opaque callee whose value (on fake tensors) is ``value``: a
    :class:`TensorGuard` when it is one tensor, else an :class:`OutputGuard`.
    ``estimated``: the value came from a run on zeros (the call depends on tensor values):
    only its structure and None leaves are assumed; numbers and flags are graph values."""
    if isinstance(value, torch.Tensor):
        return TensorGuard(callee)
    leaves, spec = pytree.tree_flatten(value)
    constants = {k: leaf for k, leaf in enumerate(leaves) if (leaf is None if estimated else is_constant(leaf))}
    passed = tuple(k for k in range(len(leaves)) if k not in constants)
    return OutputGuard(spec, constants, passed, callee)


def _same_constant(got: Any, expected: Any) -> bool:
    if type(got) is not type(expected):
        return False
    try:
        return bool(got == expected)
    except Exception:  # noqa: BLE001 - a constant without equality is not known to differ
        return True


def _by_value(value: Any) -> Hashable:
    if is_constant(value):
        return (type(value), value)
    return ("id", id(value))


def _render(leaves: list[Any], spec: pytree.TreeSpec) -> str:
    shown = [f"<{type(x).__name__}>" if isinstance(x, torch.Tensor) or not is_constant(x) else repr(x) for x in leaves]
    if spec.is_leaf():
        return shown[0]
    return str(pytree.tree_unflatten(shown, spec)).replace("'", "")


def _render_expected(guard: OutputGuard) -> str:
    leaves = [guard.constants.get(k, torch.empty(0)) for k in range(guard.spec.num_leaves)]
    return _render(leaves, guard.spec)


__all__ = ["OpaqueCall", "OpaqueCallee", "OpaqueOutputError", "OutputGuard", "TensorGuard", "output_guard"]
