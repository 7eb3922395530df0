"""Facts about traced values the fx tracer asks for (``passes/fx_tracer.py``).

Which user code is running, whether a value is real data, a condition on the call's inputs
alone computed for real, whether an object kept in an opaque call reaches a traced value,
and whether an opaque call's fake run draws random numbers. Writes no ``node.meta`` keys.
"""

from __future__ import annotations

import functools
import sys
import traceback
import types
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

from fxpipe.passes.ops import draws_random
from fxpipe.passes.scope import draws_nothing
from fxpipe.passes.signature import is_constant
from fxpipe.passes.trace_errors import is_internal


def user_code() -> types.CodeType | None:
    """The code of the innermost frame of the user's code on the stack."""
    frame = sys._getframe(1)
    while frame is not None and is_internal(frame.f_code.co_filename):
        frame = frame.f_back
    return frame.f_code if frame is not None else None


def names_tensor(classes: Any) -> bool:
    return classes is torch.Tensor or (type(classes) is tuple and torch.Tensor in classes)


def real(value: Any) -> bool:
    """Whether every tensor in ``value`` holds real data (not fake, not on the meta device)."""
    return all(not (isinstance(t, FakeTensor) or t.is_meta) for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor))


def input_only_value(node: fx.Node, given: dict[fx.Node, Any]) -> Any:
    """``node``'s value computed for real from the call's own inputs when it depends on
    them alone (no parameter, buffer or module: a check of the inputs), else None."""
    needed, stack = {node}, [node]
    while stack:
        for arg in stack.pop().all_input_nodes:
            if arg not in needed:
                needed.add(arg)
                stack.append(arg)
    if any(n.op in ("get_attr", "call_module") or (n.op == "placeholder" and n not in given) for n in needed):
        return None
    values: dict[fx.Node, Any] = {}
    with torch.no_grad():
        for n in node.graph.nodes:
            if n not in needed:
                continue
            if n.op == "placeholder":
                values[n] = given[n]
                continue
            args, kwargs = fx.map_arg((n.args, n.kwargs), values.__getitem__)
            values[n] = getattr(args[0], n.target)(*args[1:], **kwargs) if n.op == "call_method" else n.target(*args, **kwargs)
    return values[node]


def holds_proxy(value: Any, depth: int = 3) -> bool:
    """Whether an object kept in an opaque call reaches a traced value (through a closure, a
    partial's arguments or its attributes): at run time it would hand that proxy over."""
    if isinstance(value, fx.Proxy):
        return True
    if depth == 0 or is_constant(value) or isinstance(value, nn.Module | torch.Tensor | type):
        return False
    if isinstance(value, types.FunctionType):
        inner = [c.cell_contents for c in value.__closure__ or () if c.cell_contents is not value] if cells_full(value) else []
    elif isinstance(value, functools.partial):
        inner = [value.func, *value.args, *value.keywords.values()]
    elif isinstance(value, list | tuple | set | dict):
        inner = list(value.values()) if isinstance(value, dict) else list(value)
    else:
        inner = list(getattr(value, "__dict__", {}).values())
    return any(holds_proxy(v, depth - 1) for v in inner)


def cells_full(fn: types.FunctionType) -> bool:
    try:
        for cell in fn.__closure__ or ():
            cell.cell_contents  # noqa: B018 - raises ValueError for an empty cell
    except ValueError:
        return False
    return True


def caller_line() -> str:
    """``file:line: `code``` of the innermost frame of the user's code on the stack."""
    frame = sys._getframe(2)
    while frame is not None and is_internal(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return ""
    summary = traceback.extract_stack(frame, limit=1)[0]
    return f"{summary.filename}:{summary.lineno}: `{(summary.line or '').strip()}`"


class DrawRecorder(TorchDispatchMode):
    """Whether any random op runs inside (dropout with p=0 and attention without dropout
    do not count)."""

    def __init__(self) -> None:
        super().__init__()
        self.drew = False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not self.drew and draws_random(func) and not draws_nothing(func, args, kwargs):
            self.drew = True
        return func(*args, **kwargs)
