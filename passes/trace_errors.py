"""Error forensics for the trace pass: where in the user's code a frontend stopped.

A failed trace ends in one short :class:`~fxpipe.passes.traced.TraceError` naming, per
frontend, the innermost module of the model and the user's source line (never pages of
torch internals); the same helpers name the line a node came from (``user_line``) and the
argument when a None argument reaches an operator (``none_error``). Writes no
``node.meta`` keys.
"""

from __future__ import annotations

import inspect
import linecache
import os
import re
import traceback
from collections.abc import Sequence

import torch
from torch import nn

from fxpipe.passes.traced import TraceError

_PASSES = os.path.dirname(os.path.abspath(__file__))
_TORCH = os.path.dirname(torch.__file__)


def user_line(stack_trace: str) -> tuple[str, str] | None:
    """(``file:line``, code) of the innermost frame outside torch and fxpipe's passes in a
    node's recorded ``stack_trace``, or None."""
    lines = stack_trace.strip().splitlines()
    for k in range(len(lines) - 1, -1, -1):
        frame = re.match(r'\s*File "(.+)", line (\d+)', lines[k])
        if frame and not is_internal(frame.group(1)):
            code = lines[k + 1].strip() if k + 1 < len(lines) else ""
            return f"{frame.group(1)}:{frame.group(2)}", code
    return None


def is_internal(filename: str) -> bool:
    """Whether a source file is torch's or fxpipe's passes' (not the user's code)."""
    return filename.startswith((_TORCH + os.sep, _PASSES + os.sep, "<fxpipe")) or "site-packages/torch/" in filename


def first_line(err: BaseException) -> str:
    """``ExceptionType: first line of its message``."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


def user_frame(err: BaseException) -> tuple[str, str] | None:
    """(``file:line``, code) of the innermost frame outside torch and fxpipe in a traceback."""
    found = None
    for frame, lineno in traceback.walk_tb(err.__traceback__):
        if not is_internal(frame.f_code.co_filename):
            found = (frame.f_code.co_filename, lineno)
    if found is None:
        return None
    return f"{found[0]}:{found[1]}", linecache.getline(found[0], found[1]).strip()


def where(model: nn.Module, err: BaseException) -> str:
    """The innermost module of ``model`` and the innermost user source line in the traceback."""
    paths = {id(m): name or type(model).__name__ for name, m in model.named_modules()}
    module_path = None
    for frame, _ in traceback.walk_tb(err.__traceback__):
        code = frame.f_code
        owner = frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None
        if owner is not None and id(owner) in paths:
            module_path = paths[id(owner)]
    line = user_frame(err)
    parts = []
    if module_path:
        parts.append(f"module '{module_path}'")
    if line:
        parts.append(f"at {line[0]}")
    return ", ".join(parts) or "inside torch"


def none_error(owner: str, nones: Sequence[str], op: str, line: tuple[str, str] | None, location: str) -> TraceError:
    """The error for a None argument reaching an operator; names the arguments on the line."""
    names = [a for a in nones if line is None or re.search(rf"\b{a}\b", line[1])] or list(nones)
    at = f"{line[0]}: `{line[1]}`" if line else location
    return TraceError(
        f"{owner}: argument {' or '.join(repr(a) for a in names)} is None in this call and reaches {op} at {at}; "
        "pass a tensor for it, or guard the use with `if ... is not None:` (eager fails here too)"
    )


def failure_message(
    model: nn.Module, failures: list[tuple[str, BaseException]], bound: inspect.BoundArguments, fx_only: bool = False
) -> str:
    """The TraceError's text: per frontend tried, where it stopped, then the usual fixes."""
    nones = [name for name, value in bound.arguments.items() if value is None]
    last = failures[-1][1]
    if nones and "NoneType" in str(last):
        # the model fails on the None argument itself: eager would fail there too
        operation = re.search(r"operand type\(s\) for (\S+):", str(last))
        return str(none_error(type(model).__name__, nones, operation.group(1) if operation else "an operation", user_frame(last), where(model, last)))
    lines = [f"fxpipe could not trace {type(model).__name__}:"]
    for name, err in failures:
        lines.append(f"  {name} stopped in {where(model, err)}: {first_line(err)}")
    if any("Cache" in first_line(err) for _, err in failures):
        lines.append(
            "A generation cache (a DynamicCache) reached the trace: leave use_cache out of the call (fxpipe then traces "
            "with use_cache=False) or pass use_cache=False; a pipeline returns no cache for incremental decoding."
        )
    lines.append(
        "Fixes: mark the module that fails as a leaf (Plan(leaf_modules=[ModuleClass or 'path.to.module'])),"
        " fix data-dependent Python control flow with Plan(concrete_args={...}),"
        + (" or let torch.export try (Plan(frontend='auto' or 'export'))." if fx_only else " or rewrite the branch with torch.where / torch.cond.")
    )
    return "\n".join(lines)
