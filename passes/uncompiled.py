"""The user's ``torch.compile`` wrappers, seen through: what fxpipe traces and runs on fake
tensors is always the original Python code.

A user may hand fxpipe a model compiled three ways: ``torch.compile(model)`` (an
``OptimizedModule`` whose ``_orig_mod`` is the model), ``torch.compile(block)`` registered
as a child (the torchtitan way: every parameter name then gains ``_orig_mod.``), or
``block.compile()`` (``nn.Module.compile``: the block itself, its ``_compiled_call_impl``
set). Tracing such a wrapper records ``_orig_mod.`` paths, and running one on fake
tensors runs Inductor's generated kernels on tensors without memory: the process dies
with SIGSEGV.

- :func:`without_compile_wrappers` returns a view of the model with every wrapper
  replaced by the module it wraps: shallow copies along the way share the user's
  parameters, buffers and untouched submodules, so names are the user's own minus
  ``_orig_mod.`` and the user's model is not changed (its compiled modules stay compiled).
- :func:`eager_code` is the stance every fake-tensor run of fxpipe holds: any function or
  module Dynamo would run compiled (a ``torch.compile``-decorated helper the model calls,
  a wrapper not reachable as a submodule) runs its original Python instead, so no
  generated kernel ever sees a fake tensor.

Reads and writes no ``node.meta`` key.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Iterator

import torch
from torch import nn
from torch._dynamo.eval_frame import OptimizedModule


def without_compile_wrappers(model: nn.Module) -> tuple[nn.Module, list[str]]:
    """``model`` with its ``torch.compile`` wrappers seen through, and the paths of the
    compiled modules found, sorted (``""`` for the model itself). The model is returned
    as is when nothing in it is compiled."""
    found: list[str] = []
    view = _view(model, "", found, {})
    return view, sorted(found)


def _view(module: nn.Module, path: str, found: list[str], seen: dict[int, nn.Module]) -> nn.Module:
    if id(module) in seen:  # a module registered twice stays one module
        return seen[id(module)]
    original = module
    while isinstance(module, OptimizedModule):
        module = module._orig_mod
        if path not in found:
            found.append(path)
    children = {
        name: None if child is None else _view(child, f"{path}.{name}" if path else name, found, seen)
        for name, child in module._modules.items()
    }
    in_place = module.__dict__.get("_compiled_call_impl") is not None
    compiled_forward = _compiled_class_forward(module)
    if (in_place or compiled_forward) and path not in found:
        found.append(path)
    if not in_place and not compiled_forward and all(children[n] is c for n, c in module._modules.items()):
        seen[id(original)] = module
        return module
    plain = copy.copy(module)  # shares the parameter and buffer dicts: the same tensors
    plain.__dict__["_modules"] = children
    if in_place:
        plain.__dict__["_compiled_call_impl"] = None
    if compiled_forward:
        del plain.__dict__["forward"]  # the class's forward, which the instance's wrapped
    seen[id(original)] = plain
    return plain


def _compiled_class_forward(module: nn.Module) -> bool:
    """Whether ``module.forward = torch.compile(module.forward)`` was done: an instance
    attribute wrapping the class's own forward."""
    original = getattr(module.__dict__.get("forward"), "_torchdynamo_orig_callable", None)
    if original is None:
        return False
    method = inspect.unwrap(original)  # Dynamo keeps its own function around the bound method
    return getattr(method, "__self__", None) is module and getattr(method, "__func__", None) is getattr(type(module), "forward", None)


@contextlib.contextmanager
def eager_code() -> Iterator[None]:
    """Within it, whatever Dynamo would run compiled runs as its original Python (Dynamo's
    ``force_eager`` stance): the guard of every fake-tensor run."""
    with torch.compiler.set_stance("force_eager"):
        yield
