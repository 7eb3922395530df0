"""Trace pass: a model becomes one flat ``torch.fx`` graph, by either frontend.

Frontends
---------
``fx``      ``torch.fx`` symbolic tracing through :class:`PipeTracer`, which keeps module
            calls (``call_module`` nodes), honours ``leaf_modules`` and ``concrete_args``,
            and reads buffers as ``get_attr`` nodes.
``export``  ``torch.export.export(strict=False)``; its ``.module()`` is an fx graph of aten
            ops whose parameters and buffers are ``get_attr`` nodes under their original names.
``auto``    fx first, export when fx fails; HuggingFace models (which fx cannot trace, and
            for which transformers no longer ships an fx tracer) go to export directly.
            The result's ``notes`` say which frontend ran and why.

What a trace specialises on is explicit (``passes/signature.py``): None and other
non-tensor arguments are traced as constants (so ``if mask is None`` takes the call's
branch), tensor defaults are bound at call time as inputs, and the export frontend traces
at the example's sizes (``dynamic_batch=False``: the key holds every size) or with dim 0
of batch-sized inputs symbolic (``dynamic_batch=True``: one trace serves every micro-batch
size, and export's guards stay in the graph to check at run time what the model assumed of
it). ``Traced.key`` is the call's :class:`TraceKey`; ``Traced.key_of`` gives another
call's key in the same terms, so a caller traces again exactly when a call's key is new.
``bind_inputs`` raises SignatureError for a call whose None pattern, constants, dtypes,
structure or baked sizes differ from the trace's (the batch size aside).

Writes, per node: ``node.meta["custom"]["fxpipe_device"]`` (device_guard tags, recorded by
``torch.fx.traceback``) and ``node.meta[MODULE_PATH]``: the qualified name of the
innermost module whose forward created the node ("" for the root).

Tracing never changes the model: module attributes are snapshotted before and restored
after each trace, because some models (timm's levit, efficientformer) cache values in
attributes while they run, which leaves proxies behind after a symbolic trace. A frontend
tries the model quietly (:func:`quiet_attempt`): a failed attempt prints nothing, and the
TraceError is a few lines naming the model's source line.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import linecache
import logging
import operator
import os
import re
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from fxpipe.passes.meta import MODULE_PATH
from fxpipe.passes.mode import bind_mode
from fxpipe.passes.signature import (
    CallSpec,
    SignatureError,
    TraceKey,
    flat_leaves,
    is_constant,
)
from fxpipe.passes.tags import TagError, tracing


class TraceError(RuntimeError):
    """Neither frontend could trace the model; the message says where each one stopped.

    ``failures`` holds (frontend, exception) for each attempt: their tracebacks, kept out
    of the printed error (pages of torch internals), are there for debugging.
    """

    def __init__(self, message: str, failures: Sequence[tuple[str, BaseException]] = ()) -> None:
        super().__init__(message)
        self.failures = list(failures)


@dataclass
class Traced:
    """A traced model: a flat fx graph plus how to feed it and rebuild its output.

    graph_module: GraphModule whose placeholders are the call's tensor inputs.
    root: where attributes not found on the user's model live (export's constants and
        higher-order-op submodules).
    frontend: "fx" or "export".
    bind_inputs: (args, kwargs) -> one value per placeholder, in order; raises
        SignatureError when the call does not fit the trace (see ``key``).
    build_output: the graph's output value -> what the model's forward returns.
    key: the TraceKey of the call the trace was made for.
    key_of: (args, kwargs) -> that call's TraceKey in this trace's terms; equal to ``key``
        exactly when this trace serves the call.
    notes: which frontend ran and why, for ``explain()``.
    """

    graph_module: fx.GraphModule
    root: nn.Module
    frontend: str
    bind_inputs: Callable[[tuple, dict], list]
    build_output: Callable[[Any], Any]
    key: TraceKey
    key_of: Callable[..., TraceKey]
    notes: list[str] = field(default_factory=list)


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


@contextlib.contextmanager
def preserved_module_state(model: nn.Module) -> Iterator[None]:
    """Restore every submodule's attributes after the block (and drop leaked proxies).

    Containers held in attributes (dicts, lists, sets: caches) are copied one level deep,
    so a cache filled during tracing is emptied back to what it held before.
    """
    saved = []
    for module in model.modules():
        state = {}
        for key, value in module.__dict__.items():
            if isinstance(value, dict | list | set):
                value = type(value)(value) if not isinstance(value, dict) else dict(value)
            state[key] = value
        originals = {k: v for k, v in module.__dict__.items() if isinstance(v, dict | list | set)}
        saved.append((module, state, originals))
    try:
        yield
    finally:
        for module, state, originals in saved:
            module.__dict__.clear()
            for key, value in state.items():
                original = originals.get(key)
                if original is not None:
                    # refill the user's own container object so outside references stay valid
                    original.clear()
                    if isinstance(original, dict):
                        original.update(value)
                    elif isinstance(original, list):
                        original.extend(value)
                    else:
                        original.update(value)
                    value = original
                module.__dict__[key] = value


@contextlib.contextmanager
def quiet_attempt() -> Iterator[None]:
    """A frontend tries the model without noise: torch's loggers are silenced and stderr is
    held back (torch.export prints the partial graph of a failed attempt there), then
    replayed if the attempt succeeds and dropped if it fails. ``TORCH_LOGS`` turns this off."""
    if os.environ.get("TORCH_LOGS"):
        yield
        return
    logger = logging.getLogger("torch")
    level = logger.level
    held = io.StringIO()
    logger.setLevel(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(held):
            yield
    finally:
        logger.setLevel(level)
    sys.stderr.write(held.getvalue())


def is_transformers_model(model: nn.Module) -> bool:
    """Whether ``model`` is a HuggingFace ``PreTrainedModel`` (without importing transformers)."""
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers") for c in type(model).__mro__)


def trace(
    model: nn.Module,
    example_inputs: tuple = (),
    example_kwargs: Mapping[str, Any] | None = None,
    frontend: str = "auto",
    leaf_modules: Sequence[Any] = (),
    concrete_args: Mapping[str, Any] | None = None,
    *,
    dynamic_batch: bool = True,
) -> Traced:
    """Trace ``model`` for the call ``model(*example_inputs, **example_kwargs)``.

    dynamic_batch (export only): True marks dim 0 of batch-sized tensor inputs symbolic so
    one trace serves every micro-batch size (export may still bake it, e.g. for a batch of
    1: ``key`` then holds it); False traces at the example's sizes, which ``key`` then
    holds: trace once per micro-batch signature.

    Returns a :class:`Traced`. Raises SignatureError when the example does not fit
    ``model.forward``, TraceError naming, for each frontend tried, the module and source
    line where it stopped, with the usual fixes (a leaf module, concrete args, or the
    other frontend), or naming the argument when a None argument reaches an operator.
    """
    owner = type(model).__name__
    signature = inspect.signature(model.forward)
    try:
        bound = signature.bind_partial(*example_inputs, **dict(example_kwargs or {}))
    except TypeError as err:
        raise SignatureError(f"example inputs do not match {owner}.forward{signature}: {err}") from None
    # an argument the example leaves out stays an input (fx needs no value for it); the
    # compiler's bind_inputs then asks for a complete example
    bound.apply_defaults()
    notes: list[str] = []
    if frontend == "auto" and is_transformers_model(model):
        frontend = "export"
        notes.append(f"{owner} is a HuggingFace model: traced with torch.export (torch.fx cannot trace transformers models)")
    failures: list[tuple[str, BaseException]] = []
    with quiet_attempt():
        if frontend in ("auto", "fx"):
            try:
                traced = _trace_fx(model, signature, bound, leaf_modules, concrete_args or {})
            except (TraceError, TagError):
                raise  # a wrong device_guard or a None operand: every frontend stops there
            except Exception as err:  # noqa: BLE001 - any failure means: try the next frontend
                failures.append(("torch.fx", err))
                if frontend == "fx":
                    raise TraceError(_failure_message(model, failures, bound, fx_only=True), failures) from None
            else:
                return traced
        try:
            traced = _trace_export(model, signature, bound, dynamic_batch)
        except TagError:
            raise
        except Exception as err:  # noqa: BLE001
            failures.append(("torch.export", err))
            raise TraceError(_failure_message(model, failures, bound), failures) from None
    if failures:
        note = (
            f"torch.fx could not trace {owner} ({_where(model, failures[0][1])}: "
            f"{_first_line(failures[0][1])}); traced with torch.export instead"
        )
        notes.append(note)
        warnings.warn(f"fxpipe: {note}", stacklevel=2)
    traced.notes[:0] = notes
    return traced


def _checked_binder(spec: CallSpec, key: TraceKey) -> Callable[[tuple, dict], list]:
    """``bind_inputs`` for a trace: one value per placeholder, after checking that the call
    is the traced signature up to its batch size (None pattern, constants, dtypes, ranks,
    structure and the sizes the trace baked, but dim 0 of batch-sized tensors: a whole
    batch is bound here and then cut into micro-batches, whose sizes the caller matches)."""
    expected = key.batch_free()

    def bind_inputs(args: tuple, kwargs: dict) -> list:
        bound = spec.bound(args, kwargs)
        got = spec.key_of_bound(bound).batch_free()
        if got != expected:
            raise SignatureError(
                f"this call to {spec.owner}.forward is not the traced signature ({'; '.join(expected.differences(got))}); "
                "the graph was specialised for the traced one: trace this call's signature too"
            )
        return spec.values(bound)

    return bind_inputs


# ----------------------------------------------------------------------------- fx
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


def _trace_fx(
    model: nn.Module,
    signature: inspect.Signature,
    bound: inspect.BoundArguments,
    leaf_modules: Sequence[Any],
    user_concrete: Mapping[str, Any],
) -> Traced:
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
    build_output = _unflatten_with(out_spec) if out_spec is not None else _identity
    return Traced(gm, gm, "fx", _checked_binder(spec, key), build_output, key, spec.key)


def _identity(value: Any) -> Any:
    return value


def _unflatten_with(spec: pytree.TreeSpec) -> Callable[[Any], Any]:
    """The graph returns its output's leaves; this rebuilds what forward returns."""
    return lambda flat: pytree.tree_unflatten(list(flat), spec)


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
    raise _none_error(type(model).__name__, inputs.none_arguments, _NONE_REJECTING[culprit.target], line, where)


def _none_error(owner: str, nones: Sequence[str], op: str, line: tuple[str, str] | None, where: str) -> TraceError:
    """The error for a None argument reaching an operator; names the arguments on the line."""
    names = [a for a in nones if line is None or re.search(rf"\b{a}\b", line[1])] or list(nones)
    at = f"{line[0]}: `{line[1]}`" if line else where
    return TraceError(
        f"{owner}: argument {' or '.join(repr(a) for a in names)} is None in this call and reaches {op} at {at}; "
        "pass a tensor for it, or guard the use with `if ... is not None:` (eager fails here too)"
    )


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


def user_line(stack_trace: str) -> tuple[str, str] | None:
    """(``file:line``, code) of the innermost frame outside torch and fxpipe's passes in a
    node's recorded ``stack_trace``, or None."""
    lines = stack_trace.strip().splitlines()
    for k in range(len(lines) - 1, -1, -1):
        frame = re.match(r'\s*File "(.+)", line (\d+)', lines[k])
        if frame and not _is_internal(frame.group(1)):
            code = lines[k + 1].strip() if k + 1 < len(lines) else ""
            return f"{frame.group(1)}:{frame.group(2)}", code
    return None


def _is_internal(filename: str) -> bool:
    return filename.startswith(os.path.dirname(torch.__file__)) or "site-packages/torch" in filename or filename == __file__


# ------------------------------------------------------------------------- export
def _dynamic_batch_shapes(bound: inspect.BoundArguments) -> dict[str, Any] | None:
    """Dim 0 of every batch-sized tensor input symbolic, so micro-batches of any size run."""
    leaves = [x for x in pytree.tree_leaves(dict(bound.arguments)) if isinstance(x, torch.Tensor) and x.dim() > 0]
    if not leaves:
        return None
    batch = leaves[0].shape[0]

    def spec(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch:
            return {0: torch.export.Dim.DYNAMIC}
        return None

    shapes = {}
    for name, value in bound.arguments.items():
        if bound.signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            shapes.update({k: pytree.tree_map(spec, v) for k, v in value.items()})  # export names them one by one
        else:
            shapes[name] = pytree.tree_map(spec, value)
    return shapes


def _batch_of_one_doubled(bound: inspect.BoundArguments) -> inspect.BoundArguments:
    """The arguments with every batch-sized tensor repeated to 2 rows when the batch is 1:
    export specialises a size-1 dim to the constant 1, which would break every other batch
    size (and micro-batch size) the trace is meant to run."""
    leaves = [x for x in pytree.tree_leaves(dict(bound.arguments)) if isinstance(x, torch.Tensor) and x.dim() > 0]
    if not leaves or leaves[0].shape[0] != 1:
        return bound
    doubled = pytree.tree_map_only(
        torch.Tensor, lambda x: torch.cat([x, x]) if x.dim() > 0 and x.shape[0] == 1 else x, dict(bound.arguments)
    )
    return inspect.BoundArguments(bound.signature, doubled)


def _trace_export(model: nn.Module, signature: inspect.Signature, bound: inspect.BoundArguments, dynamic_batch: bool) -> Traced:
    notes: list[str] = []
    if dynamic_batch:
        bound = _batch_of_one_doubled(bound)
    # every argument is passed, defaults included: a tensor default is an input, never a
    # constant baked into the graph (a call that overrides it must be seen)
    args, kwargs = bound.args, bound.kwargs
    program = None
    with preserved_module_state(model), tracing():
        shapes = _dynamic_batch_shapes(bound) if dynamic_batch else None
        if shapes is not None:
            try:
                program = torch.export.export(model, args, kwargs, strict=False, dynamic_shapes=shapes)
            except Exception as err:  # noqa: BLE001 - retry with the example's static shapes
                notes.append(f"torch.export specialised the batch size ({_first_line(err)})")
        if program is None:
            program = torch.export.export(model, args, kwargs, strict=False)
    unlifted = program.module()
    out_spec = unlifted._out_spec
    graph = fx.Graph()
    output = graph.graph_copy(unlifted.graph, {})
    graph.output(output)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    leaves = [(name, k) for name, value in bound.arguments.items() for k in range(len(flat_leaves(value)[0]))]
    if len(placeholders) != len(leaves):
        raise RuntimeError(f"torch.export made {len(placeholders)} placeholders for {len(leaves)} input leaves")
    # sizes the graph keeps symbolic; every other size is baked in and part of the key
    baked = {
        pick: tuple(isinstance(s, int) for s in node.meta["val"].shape)
        for node, pick in zip(placeholders, leaves)
        if isinstance(node.meta.get("val"), torch.Tensor)
    }
    symbolic = not all(all(dims) for dims in baked.values())
    # the call's constants (None, flags, ints): the key guards them, the graph needs no input
    constants = {
        node: flat_leaves(bound.arguments[name])[0][k]
        for node, (name, k) in zip(placeholders, leaves)
        if not isinstance(node.meta.get("val"), torch.Tensor)
    }
    for node in list(graph.nodes):
        stack = node.meta.get("nn_module_stack")
        paths = [_clean_path(path) for path, _ in (stack or {}).values()]
        paths = [p for p in paths if not p.startswith("_empty_nn_module_stack")]
        node.meta[MODULE_PATH] = paths[-1] if paths else ""
        if node.op == "call_module" and str(node.target).startswith("_guards_fn"):
            if symbolic:
                # one trace runs every batch size: export's guards check, per micro-batch,
                # whatever it assumed of the sizes it kept symbolic (a branch on them)
                node.args = tuple(constants.get(a, a) for a in node.args)
            else:
                graph.erase_node(node)  # static: the key holds every size and constant it checks
    picks = []
    for node, pick in zip(placeholders, leaves):
        if node in constants and not node.users:
            graph.erase_node(node)
        else:
            picks.append(pick)
    bind_mode(graph, unlifted)
    graph.lint()
    gm = fx.GraphModule(unlifted, graph, type(model).__name__)
    spec = CallSpec(signature, type(model).__name__, tuple(picks), sizes=True, baked=baked if symbolic else {})
    key = spec.key_of_bound(bound)
    return Traced(gm, unlifted, "export", _checked_binder(spec, key), _unflatten_with(out_spec), key, spec.key, notes)


def _clean_path(path: str) -> str:
    """export's module paths sometimes read ``L['self'].layer1[0]``: keep ``layer1.0``."""
    path = path.replace("L['self'].", "").replace("L['self']", "").replace("L__self__.", "")
    return path.replace("[", ".").replace("]", "").replace("'", "").strip(".")


# ------------------------------------------------------------------------- errors
def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


def _user_frame(err: BaseException) -> tuple[str, str] | None:
    """(``file:line``, code) of the innermost frame outside torch and fxpipe in a traceback."""
    found = None
    for frame, lineno in traceback.walk_tb(err.__traceback__):
        if not _is_internal(frame.f_code.co_filename):
            found = (frame.f_code.co_filename, lineno)
    if found is None:
        return None
    return f"{found[0]}:{found[1]}", linecache.getline(found[0], found[1]).strip()


def _where(model: nn.Module, err: BaseException) -> str:
    """The innermost module of ``model`` and the innermost user source line in the traceback."""
    paths = {id(m): name or type(model).__name__ for name, m in model.named_modules()}
    module_path = None
    for frame, _ in traceback.walk_tb(err.__traceback__):
        code = frame.f_code
        owner = frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None
        if owner is not None and id(owner) in paths:
            module_path = paths[id(owner)]
    line = _user_frame(err)
    parts = []
    if module_path:
        parts.append(f"module '{module_path}'")
    if line:
        parts.append(f"at {line[0]}")
    return ", ".join(parts) or "inside torch"


def _failure_message(
    model: nn.Module, failures: list[tuple[str, BaseException]], bound: inspect.BoundArguments, fx_only: bool = False
) -> str:
    nones = [name for name, value in bound.arguments.items() if value is None]
    last = failures[-1][1]
    if nones and "NoneType" in str(last):
        # the model fails on the None argument itself: eager would fail there too
        operation = re.search(r"operand type\(s\) for (\S+):", str(last))
        return str(_none_error(type(model).__name__, nones, operation.group(1) if operation else "an operation", _user_frame(last), _where(model, last)))
    lines = [f"fxpipe could not trace {type(model).__name__}:"]
    for name, err in failures:
        lines.append(f"  {name} stopped in {_where(model, err)}: {_first_line(err)}")
    lines.append(
        "Fixes: mark the module that fails as a leaf (Plan(leaf_modules=[ModuleClass or 'path.to.module'])),"
        " fix data-dependent Python control flow with Plan(concrete_args={...}),"
        + (" or let torch.export try (Plan(frontend='auto' or 'export'))." if fx_only else " or rewrite the branch with torch.where / torch.cond.")
    )
    return "\n".join(lines)
