"""The fx frontend: ``torch.fx`` symbolic tracing through :class:`PipeTracer`.

PipeTracer keeps module calls (``call_module`` nodes), honours ``leaf_modules`` and
``concrete_args``, and reads buffers as ``get_attr`` nodes. None and other non-tensor
arguments are traced as constants (fx ``concrete_args``: ``if mask is None`` takes the
call's branch); containers of tensors become one placeholder per tensor leaf; tensor
defaults are inputs bound at call time. The graph reads sizes at run time, so the key
holds dtypes and ranks only.

Writes ``node.meta[MODULE_PATH]``: the qualified name of the innermost module whose
forward created the node ("" for the root); device_guard tags arrive in
``node.meta["custom"]`` through ``torch.fx.traceback``.
"""

from __future__ import annotations

import inspect
import operator
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from fxpipe.passes.meta import MODULE_PATH
from fxpipe.passes.module_state import preserved_module_state
from fxpipe.passes.signature import CallSpec, flat_leaves, is_constant
from fxpipe.passes.tags import tracing
from fxpipe.passes.trace_errors import none_error, user_line
from fxpipe.passes.traced import Traced, checked_binder, unflatten_with


class _Proxy(fx.Proxy):
    """An fx Proxy that records item assignment (``self.history[i] = x`` on a buffer, now
    that buffers are proxies) as ``operator.setitem``, which writes in place at run time."""

    def __setitem__(self, key: Any, value: Any) -> None:
        self.tracer.create_proxy("call_function", operator.setitem, (self, key, value), {})


class PipeTracer(fx.Tracer):
    """fx tracer that keeps nn.Module calls and treats ``leaf_modules`` as opaque.

    Buffers are proxied like parameters (``get_attr`` nodes), so values computed from
    them are computed at run time from the stage's buffer, never frozen as constants.
    leaf_modules: module classes, or qualified module names, never traced into.
    """

    proxy_buffer_attributes = True

    def __init__(self, leaf_modules: Sequence[Any] = ()) -> None:
        super().__init__()
        self.leaf_classes = tuple(m for m in leaf_modules if isinstance(m, type))
        self.leaf_names = {m for m in leaf_modules if isinstance(m, str)}
        self.path_stack: list[str] = [""]
        self.placeholders: list[fx.Node] = []
        self._tensor_names: dict[int, str] | None = None

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _Proxy(node, self)

    def trace(self, root: Any, concrete_args: dict[str, Any] | None = None) -> fx.Graph:
        self.placeholders = []
        self._tensor_names = None
        return super().trace(root, concrete_args)

    def call_module(self, m: nn.Module, forward: Callable, args: tuple, kwargs: dict) -> Any:
        self.path_stack.append(self.path_of_module(m))
        try:
            return super().call_module(m, forward, args, kwargs)
        finally:
            self.path_stack.pop()

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        node = super().create_node(*args, **kwargs)
        node.meta[MODULE_PATH] = node.target if node.op == "call_module" else self.path_stack[-1]
        if node.op == "placeholder":
            self.placeholders.append(node)
        return node

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.leaf_names or isinstance(m, self.leaf_classes):
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Any]) -> Any:
        # fx searches named_parameters()/named_buffers() on every access (quadratic in the
        # model's size); one id -> name map per trace gives the same first name
        if not isinstance(attr_val, torch.Tensor):
            return attr_val
        if self._tensor_names is None:
            self._tensor_names = {}
            for name, tensor in [*self.root.named_parameters(), *self.root.named_buffers()]:
                self._tensor_names.setdefault(id(tensor), name)
        name = self._tensor_names.get(id(attr_val))
        if name is None:
            return attr_val
        if name not in parameter_proxy_cache:
            parameter_proxy_cache[name] = self.create_proxy("get_attr", name, (), {})
        return parameter_proxy_cache[name]


@dataclass
class _FxInputs:
    """How the fx tracer sees a call: concrete_args, and per placeholder what it is."""

    concrete: dict[str, Any]
    # per placeholder fx creates, in order: (argument, leaf index or None) of an input,
    # or None for a placeholder fx makes for a constant (removed after tracing)
    layout: list[tuple[str, int | None] | None]
    none_arguments: list[str]


def _fx_inputs(signature: inspect.Signature, bound: inspect.BoundArguments, user_concrete: Mapping[str, Any]) -> _FxInputs:
    """Constants (None, scalars, strings) become fx concrete_args; containers of tensors and
    constants are concrete too, with a placeholder per tensor leaf; tensors and other
    objects stay proxies."""
    concrete: dict[str, Any] = {}
    layout: list[tuple[str, int | None] | None] = []
    none_arguments = []
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    # fx makes the named arguments' placeholders first (keyword-only ones included), then
    # *args, then **kwargs
    ordered = sorted(signature.parameters.items(), key=lambda item: item[1].kind in variadic)
    for name, param in ordered:
        value = bound.arguments.get(name)
        if name not in bound.arguments or param.kind in variadic:
            layout.append((name, None))
            continue
        if name in user_concrete:
            # the user's own concrete_args, as torch.fx takes them (fx.PH leaves stay inputs)
            concrete[name] = user_concrete[name]
            leaves = flat_leaves(user_concrete[name])[0]
            layout += [(name, k) if isinstance(x, type(fx.PH)) else None for k, x in enumerate(leaves)]
            continue
        if value is None:
            none_arguments.append(name)
        leaves, spec = flat_leaves(value)
        if isinstance(value, torch.Tensor) or not all(isinstance(x, torch.Tensor) or is_constant(x) for x in leaves):
            layout.append((name, None))
            continue
        concrete[name] = pytree.tree_unflatten([fx.PH if isinstance(x, torch.Tensor) else x for x in leaves], spec)
        layout += [(name, k) if isinstance(x, torch.Tensor) else None for k, x in enumerate(leaves)]
    return _FxInputs(concrete, layout, none_arguments)


def trace_fx(
    model: nn.Module,
    signature: inspect.Signature,
    bound: inspect.BoundArguments,
    leaf_modules: Sequence[Any],
    user_concrete: Mapping[str, Any],
) -> Traced:
    """Trace ``model`` for the bound call with torch.fx; returns the flat Traced.

    Raises what fx raises (the caller words it as a TraceError), or TraceError naming the
    argument and line when a None argument reaches an operator.
    """
    inputs = _fx_inputs(signature, bound, user_concrete)
    tracer = PipeTracer(leaf_modules)
    with preserved_module_state(model), tracing(), warnings.catch_warnings():
        # fx cannot assert enum or device constants; the trace key guards them instead
        warnings.filterwarnings("ignore", message="Was not able to add assertion")
        graph = tracer.trace(model, concrete_args=inputs.concrete or None)
        out_spec = _flat_codegen(graph)
        picks = _keep_inputs_only(graph, tracer.placeholders, inputs.layout)
        # built before the model's attributes are restored: constants the tracer stored on
        # the root (``_tensor_constant0``) are copied into the GraphModule
        gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
    _check_none_operands(model, gm, inputs, tracer)
    spec = CallSpec(signature, type(model).__name__, tuple(picks), sizes=False)
    key = spec.key_of_bound(bound)
    build_output = unflatten_with(out_spec) if out_spec is not None else _identity
    return Traced(gm, gm, "fx", checked_binder(spec, key), build_output, key, spec.key)


def _identity(value: Any) -> Any:
    return value


def _flat_codegen(graph: fx.Graph) -> pytree.TreeSpec | None:
    """fx flattens inputs and outputs when concrete_args hold containers; keep the graph's
    placeholders flat (stages are called with flat values) and return the output's spec."""
    info = getattr(graph._codegen, "pytree_info", None)
    if info is None:
        return None
    graph._codegen = fx.graph.CodeGen()
    return info.out_spec


def _keep_inputs_only(graph: fx.Graph, placeholders: list[fx.Node], layout: list[tuple[str, int | None] | None]) -> list[tuple[str, int | None]]:
    """Drop the placeholders fx made for constants (with fx's assertions on them) and every
    placeholder's default (each call binds every input, tensor defaults included: a default
    embedded in the graph would be a constant). Returns the remaining placeholders' picks."""
    if len(placeholders) != len(layout):
        raise RuntimeError(f"fx made {len(placeholders)} placeholders for {len(layout)} expected inputs")
    picks = []
    for node, pick in zip(placeholders, layout):
        if pick is not None and not str(node.target).lstrip("*").startswith(pick[0]):
            raise RuntimeError(f"fx's placeholder {node.target!r} is not the expected input {pick[0]!r}")
        defaults = [a for a in node.args if isinstance(a, fx.Node)]
        if pick is None:
            _erase_with_users(graph, node)
        else:
            node.args = ()
            picks.append(pick)
        for default in defaults:
            if not default.users:
                graph.erase_node(default)
    return picks


def _erase_with_users(graph: fx.Graph, node: fx.Node) -> None:
    doomed, stack = {node}, [node]
    while stack:
        for user in stack.pop().users:
            if user not in doomed:
                doomed.add(user)
                stack.append(user)
    for victim in reversed([n for n in graph.nodes if n in doomed]):
        graph.erase_node(victim)


# Python operators that raise for a None operand (as eager does at that line), by symbol
_NONE_REJECTING = {
    operator.add: "+", operator.sub: "-", operator.mul: "*", operator.truediv: "/", operator.floordiv: "//",
    operator.mod: "%", operator.pow: "**", operator.matmul: "@", operator.neg: "unary -", operator.pos: "unary +",
    operator.lt: "<", operator.le: "<=", operator.gt: ">", operator.ge: ">=", operator.and_: "&", operator.or_: "|",
    operator.xor: "^", operator.getitem: "[]", operator.iadd: "+=", operator.imul: "*=",
}


def _check_none_operands(model: nn.Module, gm: fx.GraphModule, inputs: _FxInputs, tracer: PipeTracer) -> None:
    """A None argument that reaches an arithmetic operator fails in eager too: say which
    argument and which line, instead of a TypeError from deep inside compile."""
    if not inputs.none_arguments:
        return
    culprit = next(
        (n for n in gm.graph.nodes if n.op == "call_function" and n.target in _NONE_REJECTING and any(a is None for a in n.args)),
        None,
    )
    if culprit is None:
        return
    line = _source_line_of(model, inputs, culprit, tracer.leaf_classes + tuple(tracer.leaf_names))
    where = f"module '{culprit.meta.get(MODULE_PATH) or type(model).__name__}'"
    raise none_error(type(model).__name__, inputs.none_arguments, _NONE_REJECTING[culprit.target], line, where)


def _source_line_of(model: nn.Module, inputs: _FxInputs, node: fx.Node, leaf_modules: Sequence[Any]) -> tuple[str, str] | None:
    """(file:line, code) of the user's line that made ``node``: trace again recording stack
    traces (too slow to record on every trace) and find the node by name."""
    tracer = PipeTracer(leaf_modules)
    tracer.record_stack_traces = True
    with preserved_module_state(model), tracing(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = tracer.trace(model, concrete_args=inputs.concrete or None)
    again = next((n for n in graph.nodes if n.name == node.name), None)
    return None if again is None else user_line(again.stack_trace or "")
