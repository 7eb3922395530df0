"""Which buffers a stage's forward may write in place: what a recompute must not update twice.

Checkpointing runs a stage's forward twice per micro-batch (once without autograd, again
in backward); BatchNorm's running statistics would be updated both times. The runtime
snapshots exactly the buffers :func:`buffers_written` names before the recompute and
restores them after, so they are updated once per micro-batch, as in eager.

A buffer counts as written when:
- a call_module (or its ``scope.call`` rewrite) runs a module that updates it: a norm
  layer tracking running statistics, or any buffer of a class from outside torch, whose
  forward fxpipe cannot see;
- an op writes it or a view of it: an in-place method or function (``add_``,
  ``operator.iadd``, ``x[i] = v``), an aten schema argument marked ``(a!)``, an ``out=``
  or ``inplace=True`` argument, or the running statistics of ``batch_norm`` /
  ``instance_norm`` (torch, functional or aten) unless training is literally False.

Reads no ``node.meta`` keys; writes none.
"""

from __future__ import annotations

import functools
import inspect
import operator
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from fxpipe.passes import scope
from fxpipe.passes.ops import aliases_self, overloads_of, writes_self

_IN_PLACE_OPERATORS = {
    operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
    operator.ifloordiv, operator.imod, operator.ipow, operator.iand, operator.ior,
    operator.ixor, operator.ilshift, operator.irshift, operator.imatmul,
}
_IN_PLACE_METHODS = {f"__{op.__name__}__" for op in _IN_PLACE_OPERATORS}  # x[i] = v: __setitem__
_STATISTICS = ("running_mean", "running_var")
_TRAINING = ("training", "use_input_stats", "train")


def buffers_written(gm: fx.GraphModule) -> list[str]:
    """Qualified names of the buffers ``gm``'s forward may update in place, in graph order.

    Names are ``gm``'s own (a stage module keeps the model's qualified names). Returns []
    for a stage that writes none.
    """
    buffers = {name for name, _ in gm.named_buffers(remove_duplicate=False)}
    written: dict[str, None] = {}
    for node in gm.graph.nodes:
        for name in _written_names(node, gm):
            if name in buffers:
                written.setdefault(name)
    return list(written)


def _written_names(node: fx.Node, root: nn.Module) -> Iterator[str]:
    called = _called_module(node, root)
    if called is not None:
        path, module, _ = called
        yield from (f"{path}.{name}" for name in module_buffers_written(module))
    for value in written_args(node, root):
        base = _base(value)
        if base.op == "get_attr":
            yield str(base.target)


def _called_module(node: fx.Node, root: nn.Module) -> tuple[str, nn.Module, tuple] | None:
    """(qualified name, module, data arguments) of a call_module or its keyed rewrite."""
    if node.op == "call_module":
        return str(node.target), root.get_submodule(str(node.target)), node.args
    if node.op == "call_function" and node.target is scope.call and node.args[0].op == "get_attr":
        path = str(node.args[0].target)
        return path, root.get_submodule(path), node.args[3:]
    return None


def module_buffers_written(module: nn.Module) -> list[str]:
    """Names (relative to ``module``) of the buffers its forward may update.

    Norm layers tracking running statistics update those; a module class from outside
    torch may update any buffer it holds (its forward is not visible to fxpipe).
    """
    names = []
    for prefix, sub in module.named_modules():
        dot = f"{prefix}." if prefix else ""
        if isinstance(sub, nn.modules.batchnorm._NormBase) and sub.track_running_stats:
            names += [f"{dot}{b}" for b in (*_STATISTICS, "num_batches_tracked") if getattr(sub, b, None) is not None]
        elif not type(sub).__module__.startswith("torch."):
            names += [f"{dot}{b}" for b, _ in sub.named_buffers(recurse=False)]
    return names


def written_args(node: fx.Node, root: nn.Module) -> list[fx.Node]:
    """The argument nodes ``node`` writes into in place (not following views)."""
    called = _called_module(node, root)
    if called is not None:
        _, module, args = called
        return [args[0]] if getattr(module, "inplace", False) and args and isinstance(args[0], fx.Node) else []
    if node.op not in ("call_function", "call_method"):
        return []
    written: list[Any] = []
    ops = overloads_of(node)
    in_place = node.target in (_IN_PLACE_METHODS if node.op == "call_method" else _IN_PLACE_OPERATORS)
    if in_place or any(writes_self(op) for op in ops):
        written.append(node.args[0] if node.args else None)
    bound = _bind(node, ops)
    if bound.get("inplace") is True:
        written.append(next(iter(bound.values()), None))
    written.append(bound.get("out"))
    if any(name in bound for name in _STATISTICS) and not any(bound.get(flag) is False for flag in _TRAINING):
        written += [bound.get(name) for name in _STATISTICS]
    if len(ops) == 1:
        written += [bound.get(a.name) for a in ops[0]._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    nodes: list[fx.Node] = []
    fx.node.map_arg(written, nodes.append)
    return list(dict.fromkeys(nodes))


def _bind(node: fx.Node, ops: tuple[torch._ops.OpOverload, ...]) -> dict[str, Any]:
    """The node's arguments by parameter name (empty when they cannot be named)."""
    if len(ops) == 1 or (ops and len({tuple(a.name for a in op._schema.arguments) for op in ops}) == 1):
        names = [a.name for a in ops[0]._schema.arguments]
        if node.op == "call_method" or len(node.args) <= len(names):
            return {**dict(zip(names, node.args)), **node.kwargs}
    signature = _python_signature(node.target) if node.op == "call_function" and not ops else None
    if signature is not None:
        try:
            return dict(signature.bind_partial(*node.args, **node.kwargs).arguments)
        except TypeError:
            pass
    return dict(node.kwargs)


@functools.cache
def _python_signature(target: Any) -> inspect.Signature | None:
    """The signature of a Python function (``F.batch_norm``), None for builtins."""
    return inspect.signature(target) if isinstance(target, types.FunctionType) else None


def _base(value: fx.Node) -> fx.Node:
    """The node whose memory ``value`` may share: back through views and in-place results."""
    while value.args and isinstance(value.args[0], fx.Node) and _aliases(value):
        value = value.args[0]
    return value


def _aliases(node: fx.Node) -> bool:
    if node.op == "call_function" and node.target in (operator.getitem, *_IN_PLACE_OPERATORS):
        return True
    if node.op == "call_method" and node.target in _IN_PLACE_METHODS:
        return True
    return any(aliases_self(op) for op in overloads_of(node))
