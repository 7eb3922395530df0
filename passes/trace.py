"""Trace pass: a model becomes one flat ``torch.fx`` graph, by either frontend.

Frontends
---------
``fx``      ``torch.fx`` symbolic tracing through :class:`PipeTracer`, which keeps module
            calls (``call_module`` nodes), honours ``leaf_modules`` and ``concrete_args``.
``export``  ``torch.export.export(strict=False)``; its ``.module()`` is an fx graph of aten
            ops whose parameters are ``get_attr`` nodes under their original names.
``auto``    fx first, export when fx fails (the result says which one ran).

Writes, per node: ``node.meta["custom"]["fxpipe_device"]`` (device_guard tags, recorded by
``torch.fx.traceback``) and ``node.meta[MODULE_PATH]``: the qualified name of the
innermost module whose forward created the node ("" for the root).

Tracing never changes the model: module attributes are snapshotted before and restored
after each trace, because some models (timm's levit, efficientformer) cache values in
attributes while they run, which leaves proxies behind after a symbolic trace.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch.fx import _pytree as fx_pytree

from fxpipe.passes.meta import MODULE_PATH
from fxpipe.passes.mode import bind_mode
from fxpipe.passes.tags import TagError, tracing


class TraceError(RuntimeError):
    """Neither frontend could trace the model; the message says where each one stopped."""


@dataclass
class Traced:
    """A traced model: a flat fx graph plus how to feed it and rebuild its output.

    graph_module: GraphModule whose placeholders are the flattened inputs.
    root: where attributes not found on the user's model live (export's constants and
        higher-order-op submodules).
    frontend: "fx" or "export".
    bind_inputs: (args, kwargs) -> one value per placeholder, in order.
    build_output: the graph's output value -> what the model's forward returns.
    notes: what happened while tracing (fallbacks), for ``explain()``.
    """

    graph_module: fx.GraphModule
    root: nn.Module
    frontend: str
    bind_inputs: Callable[[tuple, dict], list]
    build_output: Callable[[Any], Any]
    notes: list[str] = field(default_factory=list)


class PipeTracer(fx.Tracer):
    """fx tracer that keeps nn.Module calls and treats ``leaf_modules`` as opaque.

    leaf_modules: module classes, or qualified module names, never traced into.
    """

    def __init__(self, leaf_modules: Sequence[Any] = ()) -> None:
        super().__init__()
        self.leaf_classes = tuple(m for m in leaf_modules if isinstance(m, type))
        self.leaf_names = {m for m in leaf_modules if isinstance(m, str)}

        self.path_stack: list[str] = [""]

    def call_module(self, m: nn.Module, forward: Callable, args: tuple, kwargs: dict) -> Any:
        self.path_stack.append(self.path_of_module(m))
        try:
            return super().call_module(m, forward, args, kwargs)
        finally:
            self.path_stack.pop()

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        node = super().create_node(*args, **kwargs)
        node.meta[MODULE_PATH] = node.target if node.op == "call_module" else self.path_stack[-1]
        return node

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.leaf_names or isinstance(m, self.leaf_classes):
            return True
        return super().is_leaf_module(m, module_qualified_name)


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


def trace(
    model: nn.Module,
    example_inputs: tuple = (),
    example_kwargs: Mapping[str, Any] | None = None,
    frontend: str = "auto",
    leaf_modules: Sequence[Any] = (),
    concrete_args: Mapping[str, Any] | None = None,
) -> Traced:
    """Trace ``model`` into a flat fx graph with the chosen frontend.

    Returns a :class:`Traced`. Raises TraceError naming, for each frontend tried, the
    module and source line where it stopped, with the usual fixes (a leaf module,
    concrete args, or the other frontend).
    """
    kwargs = dict(example_kwargs or {})
    failures: list[tuple[str, BaseException]] = []
    if frontend in ("auto", "fx"):
        try:
            return _trace_fx(model, leaf_modules, concrete_args)
        except TagError:
            raise
        except Exception as err:  # noqa: BLE001 - any failure means: try the next frontend
            if frontend == "fx":
                raise TraceError(_failure_message(model, [("torch.fx", err)], fx_only=True)) from err
            failures.append(("torch.fx", err))
    try:
        traced = _trace_export(model, tuple(example_inputs), kwargs)
    except TagError:
        raise
    except Exception as err:  # noqa: BLE001
        failures.append(("torch.export", err))
        raise TraceError(_failure_message(model, failures)) from err
    if failures:
        where = _where(model, failures[0][1])
        note = (
            f"torch.fx could not trace {type(model).__name__} ({where}: "
            f"{_first_line(failures[0][1])}); traced with torch.export instead"
        )
        traced.notes.append(note)
        warnings.warn(f"fxpipe: {note}", stacklevel=3)
    return traced


def _trace_fx(model: nn.Module, leaf_modules: Sequence[Any], concrete_args: Mapping[str, Any] | None) -> Traced:
    tracer = PipeTracer(leaf_modules)
    with preserved_module_state(model), tracing():
        graph = tracer.trace(model, concrete_args=dict(concrete_args) if concrete_args else None)
        # built before the model's attributes are restored: constants the tracer stored on
        # the root (``_tensor_constant0``) are copied into the GraphModule
        gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
    signature = inspect.signature(model.forward)
    # names and defaults only: the pipeline must not keep the traced graph (and through it
    # the model's modules) alive
    placeholders = [(n.target.lstrip("*"), n.args[0] if n.args else None) for n in graph.nodes if n.op == "placeholder"]
    model_name = type(model).__name__

    def bind_inputs(args: tuple, kwargs: dict) -> list:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as err:
            raise TypeError(f"inputs do not match {model_name}.forward{signature}: {err}") from None
        bound.apply_defaults()
        return [bound.arguments.get(name, default) for name, default in placeholders]

    return Traced(gm, gm, "fx", bind_inputs, lambda out: out)


def _dynamic_batch_shapes(model: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any] | None:
    """Mark dim 0 of every batch-sized tensor input dynamic, so micro-batches of any size run."""
    leaves = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor) and x.dim() > 0]
    if not leaves:
        return None
    batch = leaves[0].shape[0]
    bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments

    def spec(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch:
            return {0: torch.export.Dim.DYNAMIC}
        return None

    return {name: pytree.tree_map(spec, value) for name, value in bound.items()}


def _trace_export(model: nn.Module, args: tuple, kwargs: dict) -> Traced:
    notes: list[str] = []
    with preserved_module_state(model), tracing():
        try:
            program = torch.export.export(
                model, args, kwargs, strict=False, dynamic_shapes=_dynamic_batch_shapes(model, args, kwargs)
            )
        except Exception as err:  # noqa: BLE001 - retry with the example's static shapes
            notes.append(f"torch.export specialised the batch size ({_first_line(err)})")
            program = torch.export.export(model, args, kwargs, strict=False)
    unlifted = program.module()
    in_spec, out_spec = unlifted._in_spec, unlifted._out_spec
    graph = fx.Graph()
    value_map: dict[fx.Node, fx.Node] = {}
    output = graph.graph_copy(unlifted.graph, value_map)
    graph.output(output)
    for node in list(graph.nodes):
        stack = node.meta.get("nn_module_stack")
        paths = [_clean_path(path) for path, _ in (stack or {}).values()]
        paths = [p for p in paths if not p.startswith("_empty_nn_module_stack")]
        node.meta[MODULE_PATH] = paths[-1] if paths else ""
        # export's input-guard check: shapes are checked by fxpipe itself per micro-batch
        if node.op == "call_module" and str(node.target).startswith("_guards_fn"):
            graph.erase_node(node)
    bind_mode(graph, unlifted)
    graph.lint()
    gm = fx.GraphModule(unlifted, graph, type(model).__name__)
    signature = inspect.signature(model.forward)

    def bind_inputs(call_args: tuple, call_kwargs: dict) -> list:
        bound = signature.bind(*call_args, **call_kwargs)
        bound.apply_defaults()
        # export recorded how many inputs were positional and the keyword names, in order
        num_positional = in_spec.child(0).num_children
        keyword_names = in_spec.child(1).context if in_spec.num_children > 1 else []
        names = list(bound.arguments)
        positional = tuple(bound.arguments[n] for n in names[:num_positional])
        keyword = {k: bound.arguments[k] for k in keyword_names}
        return list(fx_pytree.tree_flatten_spec((positional, keyword), in_spec))

    def build_output(flat: Any) -> Any:
        return pytree.tree_unflatten(list(flat), out_spec)

    return Traced(gm, unlifted, "export", bind_inputs, build_output, notes)


def _clean_path(path: str) -> str:
    """export's module paths sometimes read ``L['self'].layer1[0]``: keep ``layer1.0``."""
    path = path.replace("L['self'].", "").replace("L['self']", "").replace("L__self__.", "")
    return path.replace("[", ".").replace("]", "").replace("'", "").strip(".")


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


def _where(model: nn.Module, err: BaseException) -> str:
    """The innermost module of ``model`` and the innermost user source line in the traceback."""
    paths = {id(m): name or type(model).__name__ for name, m in model.named_modules()}
    torch_dir = os.path.dirname(torch.__file__)
    module_path, line = None, None
    for frame, lineno in traceback.walk_tb(err.__traceback__):
        code = frame.f_code
        owner = frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None
        if owner is not None and id(owner) in paths:
            module_path = paths[id(owner)]
        filename = frame.f_code.co_filename
        if not filename.startswith(torch_dir) and "site-packages/torch" not in filename and __file__ != filename:
            line = f"{filename}:{lineno}"
    parts = []
    if module_path:
        parts.append(f"module '{module_path}'")
    if line:
        parts.append(f"at {line}")
    return ", ".join(parts) or "inside torch"


def _failure_message(model: nn.Module, failures: list[tuple[str, BaseException]], fx_only: bool = False) -> str:
    lines = [f"fxpipe could not trace {type(model).__name__}:"]
    for name, err in failures:
        lines.append(f"  {name} stopped in {_where(model, err)}: {_first_line(err)}")
    lines.append(
        "Fixes: mark the module that fails as a leaf (Plan(leaf_modules=[ModuleClass or 'path.to.module'])),"
        " fix data-dependent Python control flow with Plan(concrete_args={...}),"
        + (" or let torch.export try (Plan(frontend='auto' or 'export'))." if fx_only else " or rewrite the branch with torch.where / torch.cond.")
    )
    return "\n".join(lines)
