"""The export frontend: ``torch.export.export(strict=False)`` flattened into a plain graph.

``program.module()`` is an fx graph of aten ops whose parameters and buffers are
``get_attr`` nodes under their original names; this module copies it into a flat graph
whose placeholders are the call's tensor leaves. It traces at the example's sizes
(``dynamic_batch=False``: the key holds every size) or with dim 0 of batch-sized inputs
symbolic (``dynamic_batch=True``: one trace serves every micro-batch size, and export's
guards stay in the graph to check at run time what the model assumed of it). A batch of
one is traced at two rows: export would specialise a size-1 dim to the constant 1.

Writes ``node.meta[MODULE_PATH]`` (from export's ``nn_module_stack``); device_guard tags
arrive in ``node.meta["custom"]`` through ``torch.fx.traceback``; train/eval literals are
rewired by ``passes/mode.py``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from fxpipe.passes.meta import MODULE_PATH
from fxpipe.passes.mode import bind_mode
from fxpipe.passes.module_state import preserved_module_state
from fxpipe.passes.signature import CallSpec, flat_leaves
from fxpipe.passes.tags import tracing
from fxpipe.passes.trace_errors import first_line
from fxpipe.passes.traced import Traced, checked_binder, unflatten_with


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
            shapes.update({k: _shapes_of(v, spec) for k, v in value.items()})  # export names them one by one
        else:
            shapes[name] = _shapes_of(value, spec)
    return shapes


def _shapes_of(value: Any, spec: Callable[[Any], Any]) -> Any:
    """``spec`` of every leaf of ``value``, in the form torch.export reads: the same
    container for builtin ones (tuples, lists, dicts, NamedTuples), the list of its
    children's for a registered class (a dataclass mask), whose own type export does not
    take as a container of shapes."""
    node = pytree._get_node_type(value)
    if node not in pytree.SUPPORTED_NODES:
        return spec(value)
    children, context = pytree.SUPPORTED_NODES[node].flatten_fn(value)
    shapes = [_shapes_of(child, spec) for child in children]
    return pytree.SUPPORTED_NODES[node].unflatten_fn(shapes, context) if node in pytree.BUILTIN_TYPES else shapes


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


def trace_export(model: nn.Module, signature: inspect.Signature, bound: inspect.BoundArguments, dynamic_batch: bool) -> Traced:
    """Trace ``model`` for the bound call with torch.export; returns the flat Traced.

    Raises what torch.export raises (the caller words it as a TraceError).
    """
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
                notes.append(f"torch.export specialised the batch size ({first_line(err)})")
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
    return Traced(gm, unlifted, "export", checked_binder(spec, key), unflatten_with(out_spec), key, spec.key, notes)


def _clean_path(path: str) -> str:
    """export's module paths sometimes read ``L['self'].layer1[0]``: keep ``layer1.0``."""
    path = path.replace("L['self'].", "").replace("L['self']", "").replace("L__self__.", "")
    return path.replace("[", ".").replace("]", "").replace("'", "").strip(".")


