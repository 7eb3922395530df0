"""The fx frontend: ``torch.fx`` symbolic tracing through :class:`PipeTracer`.

The graph's placeholders are the call's tensor leaves (:func:`root_call`): None and other
non-tensor arguments are constants (``if mask is None`` takes the call's branch),
containers of tensors give one placeholder per tensor leaf, tensor defaults are inputs
bound at call time, an object fx keeps whole (neither tensor nor constant) is one input.
The user's ``concrete_args`` are taken as torch.fx takes them (``fx.PH`` leaves stay
inputs). Whatever fx cannot trace runs as an opaque call (``passes/fx_tracer.py``).

The key holds dtypes and ranks (the graph reads sizes at run time), and every size but
the batch when the trace followed a Python branch on sizes (the branch holds for those
sizes; ``check_assumed`` nodes re-check it per micro-batch).

Writes ``node.meta[MODULE_PATH]``: the qualified name of the innermost module whose
forward created the node ("" for the root); ``node.meta["opaque"]`` on opaque calls;
device_guard tags arrive in ``node.meta["custom"]`` through ``torch.fx.traceback``.
"""

from __future__ import annotations

import inspect
import itertools
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch.fx._lazy_graph_module import _LazyGraphModule, _use_lazy_graph_module

from fxpipe.passes.fx_tracer import PipeTracer, RootCall
from fxpipe.passes.meta import MODULE_PATH
from fxpipe.passes.module_state import preserved_module_state
from fxpipe.passes.signature import CallSpec, flat_leaves, is_constant
from fxpipe.passes.tags import tracing
from fxpipe.passes.trace_errors import none_error, user_line
from fxpipe.passes.traced import Traced, checked_binder, unflatten_with


def trace_fx(
    model: nn.Module,
    signature: inspect.Signature,
    bound: inspect.BoundArguments,
    leaf_modules: Sequence[Any],
    user_concrete: Mapping[str, Any],
    dynamic_batch: bool = True,
    auto_leaf: bool = True,
    stamp_blocks: bool = True,
) -> Traced:
    """Trace ``model`` for the bound call with torch.fx; returns the flat Traced, whose
    ``opaque`` lists what runs whole (``auto_leaf=False``: nothing, fx fails instead); a
    repeated block is traced once and stamped for the others (``stamp_blocks``).
    A trace that followed a branch on sizes holds them in its key: every size but the batch
    (``dynamic_batch=True``) or every size.

    Raises what fx raises where nothing can run whole in its place (the root forward's own
    body), or TraceError naming the argument and line when a None argument reaches an
    operator.
    """
    call, picks = root_call(bound, user_concrete, dynamic_batch, on_meta=_on_meta(model))
    tracer = PipeTracer(leaf_modules, auto_leaf, stamp_blocks)
    with preserved_module_state(model), tracing():
        graph = tracer.trace_call(model, call)
        # built before the model's attributes are restored: constants the tracer stored on
        # the root (``_tensor_constant0``) are copied into the GraphModule; its Python code is
        # generated when first run (the compiler runs the stages' code, not this one's)
        with _use_lazy_graph_module(True):
            gm = _LazyGraphModule(tracer.root, graph, type(model).__name__)
    nones = [name for name, value in bound.arguments.items() if value is None and name not in user_concrete]
    _check_none_operands(model, gm, call, nones, tracer)
    baked = _sizes_but_the_batch(bound) if tracer.assumptions and dynamic_batch else {}
    spec = CallSpec(signature, type(model).__name__, tuple(picks), sizes=bool(tracer.assumptions), baked=baked)
    key = spec.key_of_bound(bound)
    build_output = _identity if tracer.out_spec.is_leaf() else unflatten_with(tracer.out_spec)
    traced = Traced(gm, gm, "fx", checked_binder(spec, key), build_output, key, spec.key, opaque=list(tracer.opaque))
    traced.replay = tracer.example_replay()
    traced.batch_lengths = list(tracer.batch_lengths)
    return traced


def _identity(value: Any) -> Any:
    return value


class _Missing:
    """An argument the example leaves out: an input all the same (binding a call asks for it)."""


_MISSING = _Missing()


def root_call(
    bound: inspect.BoundArguments, user_concrete: Mapping[str, Any], dynamic_batch: bool = True, on_meta: bool = False
) -> tuple[RootCall, list[tuple[str, int | None]]]:
    """The root's inputs for a bound call, and per input which argument (and pytree leaf of
    it, or None for the whole value) it takes. Branches on sizes follow the example's, or
    under ``dynamic_batch`` a batch of two where the example's is one; ``on_meta``: the
    model's tensors are on the meta device, and the example is replayed there too."""
    names: list[str] = []
    examples: list[Any] = []
    picks: list[tuple[str, int | None]] = []
    # per argument: its leaves with holes for the inputs, its structure, (leaf, input) pairs
    layout: dict[str, tuple[list[Any], pytree.TreeSpec, list[tuple[int, int]]]] = {}
    arguments = {name: bound.arguments.get(name, _MISSING) for name in bound.signature.parameters}
    for name, value in arguments.items():
        template = user_concrete.get(name, value)
        leaves, spec = flat_leaves(template)
        holes = [k for k, x in enumerate(leaves) if isinstance(x, torch.Tensor | type(fx.PH))]
        kept = value is _MISSING or (name not in user_concrete and not all(isinstance(x, torch.Tensor) or is_constant(x) for x in leaves))
        if kept:
            leaves, spec, holes = [value], pytree.tree_structure(None), [0]  # an object: one input, as fx keeps it
        # one input for the whole argument: a tensor or such an object, never a 1-tuple of a tensor
        whole = name not in user_concrete and (kept or (len(leaves) == 1 and spec.is_leaf()))
        actual = flat_leaves(value)[0] if not whole else [value]
        pairs = []
        for k in holes:
            pairs.append((k, len(names)))
            picks.append((name, None if whole else k))
            names.append(name if whole else f"{name}_{k}")
            examples.append(actual[k])
        layout[name] = (leaves, spec, pairs)

    def rebuild(values: Sequence[Any]) -> tuple[tuple, dict]:
        arguments = {}
        for name, (leaves, spec, pairs) in layout.items():
            filled = list(leaves)
            for k, position in pairs:
                filled[k] = values[position]
            arguments[name] = pytree.tree_unflatten(filled, spec)
        call = inspect.BoundArguments(bound.signature, arguments)
        return call.args, call.kwargs

    if on_meta:  # as the compiler propagates shapes for such a model
        examples = [x.to("meta") if isinstance(x, torch.Tensor) else x for x in examples]
    if not dynamic_batch:
        return RootCall(names, examples, None, rebuild), picks
    replayed = _with_batch(examples, 2, only_from=1)
    return RootCall(names, replayed, _with_batch(examples, 1), rebuild, replayed_as_given=replayed is examples, given=examples), picks


def _on_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))


def _with_batch(examples: list[Any], size: int, only_from: int | None = None) -> list[Any]:
    """The examples with dim 0 of batch-sized tensors (the first tensor's dim 0) set to
    ``size`` (empty tensors: only their sizes are read), or unchanged when ``only_from`` is
    given and the batch is not that. A branch on sizes is followed as a batch of two takes
    it, so it holds for the micro-batches of a larger call (export's size-1 specialisation,
    avoided the same way); a batch of one tells which branches only it would take."""
    tensors = [x for x in examples if isinstance(x, torch.Tensor) and x.dim() > 0]
    batch = tensors[0].shape[0] if tensors else None
    if batch is None or (only_from is not None and batch != only_from):
        return examples
    return [x.new_empty((size, *x.shape[1:])) if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch else x for x in examples]


def _sizes_but_the_batch(bound: inspect.BoundArguments) -> dict[tuple[str, int], tuple[bool, ...]]:
    """Per tensor leaf of the call, every dimension baked but dim 0 of batch-sized ones."""
    leaves = [x for x in pytree.tree_leaves(dict(bound.arguments)) if isinstance(x, torch.Tensor) and x.dim() > 0]
    batch = leaves[0].shape[0] if leaves else None
    baked = {}
    for name, value in bound.arguments.items():
        for k, leaf in enumerate(flat_leaves(value)[0]):
            if isinstance(leaf, torch.Tensor):
                baked[(name, k)] = tuple(not (d == 0 and size == batch) for d, size in enumerate(leaf.shape))
    return baked


_NONE_REJECTING = {
    operator.add: "+", operator.sub: "-", operator.mul: "*", operator.truediv: "/", operator.floordiv: "//",
    operator.mod: "%", operator.pow: "**", operator.matmul: "@", operator.neg: "unary -", operator.pos: "unary +",
    operator.lt: "<", operator.le: "<=", operator.gt: ">", operator.ge: ">=", operator.and_: "&", operator.or_: "|",
    operator.xor: "^", operator.getitem: "[]", operator.iadd: "+=", operator.imul: "*=",
}


def _check_none_operands(model: nn.Module, gm: fx.GraphModule, call: RootCall, nones: list[str], tracer: PipeTracer) -> None:
    """A None argument that reaches an arithmetic operator fails in eager too: say which
    argument and which line, instead of a TypeError from deep inside compile."""
    if not nones:
        return
    culprit = next((n for n in gm.graph.nodes if n.op == "call_function" and n.target in _NONE_REJECTING and _none_operand(n)), None)
    if culprit is None:
        return
    line = _source_line_of(model, call, culprit, tracer.leaf_classes + tuple(tracer.leaf_names))
    where = f"module '{culprit.meta.get(MODULE_PATH) or type(model).__name__}'"
    raise none_error(type(model).__name__, nones, _NONE_REJECTING[culprit.target], line, where)


def _none_operand(node: fx.Node) -> bool:
    """Whether an operator node gets None where eager raises (``x[None]`` indexes fine)."""
    operands = node.args[:1] if node.target is operator.getitem else node.args
    return any(a is None for a in operands)


def _source_line_of(model: nn.Module, call: RootCall, node: fx.Node, leaf_modules: Sequence[Any]) -> tuple[str, str] | None:
    """(file:line, code) of the user's line that made ``node``: trace again recording stack
    traces (too slow to record on every trace) and find the node by name."""
    tracer = PipeTracer(leaf_modules)
    tracer.record_stack_traces = True
    with preserved_module_state(model), tracing():
        graph = tracer.trace_call(model, call)
    again = next((n for n in graph.nodes if n.name == node.name), None)
    return None if again is None else user_line(again.stack_trace or "")
