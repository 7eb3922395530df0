"""``PipeTracer``: the fx tracer of the fx frontend, which traces on where fx would stop.

On top of ``torch.fx.Tracer`` it keeps module calls as ``call_module`` nodes (standard
torch layers and the user's ``leaf_modules``), reads buffers as ``get_attr`` nodes, records
``node.meta[MODULE_PATH]``, and:

- **takes the call as the compiler binds it**: the root's placeholders are the call's
  tensor leaves (:class:`RootCall`), whatever ``forward``'s signature or decorators;
- **knows the example's sizes**: every node is replayed on fake tensors as it is made
  (``passes/fake_replay.py``; repeated layers cost one), so a Python branch on a traced
  size (``if q_length > 1``), ``len()`` and iteration follow the example's values, each
  recorded as a ``check_assumed`` node (``passes/assumed.py``) that re-checks it at run time;
- **makes opaque what it cannot trace** (``auto_leaf``): when tracing a module's forward
  fails (a branch on tensor values, a context manager fx cannot record, anything else),
  the partial trace is rolled back and the innermost Python function below the failure is
  made opaque (``passes/intercept.py``), then the forward is traced again; when no
  function is left, the module itself is called whole. An opaque call's result is known
  from its fake run (``passes/opaque.py``): its structure and constants, with graph values
  for its tensors behind an output guard. Randomness and autocast inside run as in eager
  (the rng pass keys opaque callees with a scope; the stage runs them in the caller's
  autocast); a ``device_guard`` inside one is a TagError naming it.

- **reads hand placement**: ``x.to("cuda:1")`` / ``x.cuda(1)`` of a traced tensor is a device
  tag from there to the next move and leaves no node (``passes/moves.py``); the computation
  before the first move is tagged with the moved value's device.

Changing grad mode or autocast inside ``forward`` (``with torch.no_grad():``,
``torch.autocast``, reading ``torch.is_autocast_enabled()``) is something fx cannot
record: the enclosing function or module runs whole instead, so it behaves as in eager.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import threading
import traceback
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch.fx import _symbolic_trace as fx_internals
from torch.nn.modules.module import register_module_forward_pre_hook

from fxpipe.passes.assumed import check_assumed
from fxpipe.passes.blocks import Blocks, Template, capture, plain_ints, stamp, unwatched, watching
from fxpipe.passes.fake_replay import FakeReplay
from fxpipe.passes.fx_untraceable import untraceable_contexts
from fxpipe.passes.growing_replay import UNKNOWN, GrowingReplay
from fxpipe.passes.intercept import Interceptor, function_of, interceptable
from fxpipe.passes.meta import (
    COMPUTE_OPS,
    CUSTOM,
    MODULE_PATH,
    OPAQUE,
    OPAQUE_DRAWS,
    TAG_KEY,
    TAG_SOURCE,
)
from fxpipe.passes.module_state import WriteJournal
from fxpipe.passes.moves import read_move
from fxpipe.passes.opaque import OpaqueCall, OpaqueCallee, TensorGuard, output_guard
from fxpipe.passes.signature import is_constant
from fxpipe.passes.tags import TagError, opaque_scope, tag_of
from fxpipe.passes.targets import resolver
from fxpipe.passes.trace_errors import first_line, is_internal, user_frame
from fxpipe.passes.traced_values import (
    DrawRecorder,
    caller_line,
    holds_proxy,
    input_only_value,
    names_tensor,
    real,
    user_code,
)

# torch factories whose sizes may be traced values (``torch.ones(x.shape[0], n)``): torch's
# argument parser does not hand an fx Proxy in a size to __torch_function__, so fx records
# a call with any traced argument as one node instead (fx's autowrap)
_FACTORIES = (torch.ones, torch.zeros, torch.empty, torch.full, torch.rand, torch.randn, torch.randint, torch.arange, torch.eye)
# the same for a traced dtype: ``torch.finfo(x.dtype).min`` (HF's eager mask) is a node read at
# run time, so the value follows the dtype a stage computes in (autocast included)
_DTYPE_INFO = (torch.finfo, torch.iinfo)
_AUTOWRAPPED = _FACTORIES + _DTYPE_INFO
_ABSENT = object()
# at most this many functions made opaque in one trace (each costs a partial retrace)
MAX_OPAQUE_FUNCTIONS = 64


class RootCall:
    """How the root's placeholders feed ``forward``: the call's arguments with each graph
    input (a tensor leaf, or an argument fx keeps whole) in its place.

    names: one placeholder name per input; examples: the example's value of each;
    batch_of_one: the same with the batch cut to one sample, or None (branches that only a
    batch of one takes the other way are then not checked at run time);
    rebuild: placeholder values -> (args, kwargs) for ``forward``; replayed_as_given: False
    when ``examples`` are not the call's own sizes (a batch of one replayed as two); given:
    the call's own values (default ``examples``).
    """

    def __init__(
        self,
        names: Sequence[str],
        examples: Sequence[Any],
        batch_of_one: Sequence[Any] | None,
        rebuild: Callable[[Sequence[Any]], tuple[tuple, dict]],
        replayed_as_given: bool = True,
        given: Sequence[Any] | None = None,
    ) -> None:
        self.names, self.examples, self.rebuild = list(names), list(examples), rebuild
        self.given = list(examples if given is None else given)
        self.batch_of_one = None if batch_of_one is None else list(batch_of_one)
        self.replayed_as_given = replayed_as_given


class _Proxy(fx.Proxy):
    """An fx Proxy that records item assignment (``self.history[i] = x`` on a buffer, now
    that buffers are proxies) as ``operator.setitem``, which writes in place at run time."""

    def __setitem__(self, key: Any, value: Any) -> None:
        self.tracer.create_proxy("call_function", operator.setitem, (self, key, value), {})


class PipeTracer(fx.Tracer):
    """fx tracer for one call of a model (see the module doc).

    leaf_modules: module classes, or qualified module names, called whole (their results
    stay plain proxies, as fx's leaves); auto_leaf: make opaque what fx cannot trace
    (False: fail there, as plain fx does); stamp_blocks: trace each distinct block once
    (``passes/blocks.py``; False: trace every call). After :meth:`trace_call`: ``opaque`` lists the
    opaque callees in the order they were made, ``assumptions`` counts the branches taken
    on sizes, ``batch_lengths`` the source lines that iterated over the batch (the trace
    holds the batch size), ``out_spec`` is the structure of what ``forward`` returned.
    """

    proxy_buffer_attributes = True

    def __init__(self, leaf_modules: Sequence[Any] = (), auto_leaf: bool = True, stamp_blocks: bool = True) -> None:
        super().__init__(autowrap_functions=_AUTOWRAPPED)
        self._autowrap_search.append(torch)  # torch.ones(batch, length): one node, sizes read at run time
        self.leaf_classes = tuple(m for m in leaf_modules if isinstance(m, type))
        self.leaf_names = {m for m in leaf_modules if isinstance(m, str)}
        self.auto_leaf = auto_leaf
        self.stamp_blocks = stamp_blocks
        self.path_stack: list[str] = [""]
        self.opaque: list[OpaqueCallee] = []
        self.assumptions = 0
        self.batch_lengths: list[str] = []
        self.out_spec: pytree.TreeSpec | None = None
        self._root_call: RootCall | None = None
        self._tensor_names: dict[int, str] | None = None
        self._param_cache: dict[str, fx.Proxy] | None = None
        self._opaque_modules: dict[int, OpaqueCallee] = {}
        self._opaque_functions: dict[types.FunctionType, OpaqueCallee] = {}
        self._calls: Interceptor | None = None
        self._inputs: dict[fx.Node, Any] = {}  # placeholder -> the example's value
        self._given: dict[fx.Node, Any] = {}  # placeholder -> the call's own value, where real
        self._input_branches: set[types.CodeType] = set()  # code whose branches may follow input values
        self._scopes: dict[int, tuple[dict, Any]] = {}  # module globals given _isinstance -> what they had
        self._expanded: set[int] = set()  # forwards' module globals whose called functions' modules got it too
        self._example: GrowingReplay | None = None
        self._shadow: GrowingReplay | None = None  # the same at a batch of one
        self._draws: dict[Any, bool] = {}
        self.blocks = Blocks()
        self._writes = WriteJournal(self.tracing_here)
        self._thread = threading.get_ident()
        self._replaying = 0
        self._moved_to: str | None = None  # the device of the last move read (passes/moves.py)
        self._move_source = ""  # that move, as explain() names it
        self.moves_read = 0
        self._children: dict[int, tuple[nn.Module, dict[int, str]]] = {}  # id(parent) -> (parent, id(child) -> name)

    # ------------------------------------------------------------------ entry
    def trace_call(self, model: nn.Module, call: RootCall) -> fx.Graph:
        """Trace ``model.forward`` for ``call``; returns the graph, whose output is what forward
        returned, flattened to a list of leaves unless it is one value (``out_spec`` rebuilds
        it). Raises what fx raises
        where no opaque call can stand in (a failure in the root's own forward body)."""
        self._root_call = call
        self._answer_isinstance(type(model).forward)
        try:
            with Interceptor(self._call_opaque_function) as self._calls, untraceable_contexts(self.tracing_here, self._own_length), self._writes:
                graph = self.trace(model)
                output = next(reversed(graph.nodes))
                with self._fake_run():
                    self._example.value(output)  # the rest of the replay: shape propagation's values
        finally:
            for scope, previous in self._scopes.values():
                if previous is _ABSENT:
                    scope.pop("isinstance", None)
                else:
                    scope["isinstance"] = previous
        for node in graph.nodes:
            if node.target in _AUTOWRAPPED:
                # fx marks autowrapped calls for re-tracing by name, which a torch.* name breaks
                node.meta.pop("is_wrapped", None)
        # the callees the final graph calls (a failed attempt's are gone with its nodes)
        self.opaque = list({id(c): c for n in graph.nodes if (c := n.meta.get(OPAQUE)) is not None}.values())
        return graph

    def example_replay(self) -> FakeReplay | None:
        """After :meth:`trace_call`: the replay of the whole graph on the example (every
        node's value, key and template, as shape propagation makes them), or None when a node
        could not run or the example was replayed at another batch size (a batch of one)."""
        replay = self._example.replay
        replay.release_real_values()
        if self._root_call.replayed_as_given and all(n in replay.values for n in self.graph.nodes):
            return replay
        return None

    def create_args_for_root(self, root_fn: Callable, is_module: bool, concrete_args: Any = None) -> tuple[Callable, list]:
        call = self._root_call
        placeholders = [self.create_proxy("placeholder", name, (), {}) for name in call.names]
        self._inputs = {p.node: example for p, example in zip(placeholders, call.examples)}
        self._given = {p.node: value for p, value in zip(placeholders, call.given) if real(value)}
        resolve = resolver(self.root)
        self._example = GrowingReplay(self.graph, resolve, self._inputs.__getitem__, real_inputs=call.replayed_as_given)
        if call.batch_of_one is not None:
            shadow = {p.node: example for p, example in zip(placeholders, call.batch_of_one)}
            self._shadow = GrowingReplay(self.graph, resolve, shadow.__getitem__, real_inputs=False)

        def root_call(root: nn.Module, *values: Any) -> Any:
            args, kwargs = call.rebuild(values)
            out = self._traced(lambda: root.forward(*args, **kwargs), root)
            leaves, self.out_spec = pytree.tree_flatten(out)
            return leaves[0] if self.out_spec.is_leaf() else leaves

        return root_call, [self.root, *placeholders]

    # ------------------------------------------------------------------ fx hooks
    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _Proxy(node, self)

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        node = super().create_node(*args, **kwargs)
        node.meta[MODULE_PATH] = node.target if node.op == "call_module" else self.path_stack[-1]
        if self._moved_to is not None and node.op in COMPUTE_OPS and tag_of(node) is None:
            _tag(node, self._moved_to, self._move_source)  # a device_guard inside wins, as the innermost guard does
        return node

    def path_of_module(self, mod: nn.Module) -> str:
        """The module's path as the call reaches it: the calling module's path and the
        child's name there. A module shared by two parents (``0.module`` and ``2.module``)
        gets the path of the parent calling it, so each call belongs to its caller's
        stage; else fx's (its first name)."""
        parent_path = self.path_stack[-1] if self.path_stack else ""
        try:
            parent = self.root.get_submodule(parent_path) if parent_path else self.root
        except AttributeError:
            parent = None
        if parent is mod and parent_path:  # asked again from inside its own call (fx's call_module)
            return parent_path
        name = self._child_name(parent, mod) if parent is not None else None
        if name is not None:
            return f"{parent_path}.{name}" if parent_path else name
        return super().path_of_module(mod)

    def _child_name(self, parent: nn.Module, mod: nn.Module) -> str | None:
        """``mod``'s first name among ``parent``'s children, or None: looked up in a table per
        parent (built on first use, rebuilt when a forward changed the children), so a
        sequence of 10,000 children is not scanned once per call."""
        table = self._children.get(id(parent))
        name = table[1].get(id(mod)) if table is not None and table[0] is parent else None
        if name is not None and parent._modules.get(name) is mod:
            return name
        names: dict[int, str] = {}
        for child_name, child in parent._modules.items():
            names.setdefault(id(child), child_name)
        self._children[id(parent)] = (parent, names)
        return names.get(id(mod))

    def create_proxy(self, kind: str, target: Any, args: tuple, kwargs: dict, *rest: Any, **options: Any) -> fx.Proxy:
        """fx's, except that a move of a traced tensor to a CUDA device (``x.to("cuda:1")``,
        ``x.cuda(1)``) leaves no node (see ``passes/moves.py``): one to another device than the
        value's is read as a device tag from here on; what else it asks (a dtype) stays a
        ``.to`` without the device."""
        if kind == "call_method" and target in ("to", "cuda") and args and isinstance(args[0], fx.Proxy) and args[0].tracer is self:
            move = read_move(target, args[1:], kwargs)
            if move is not None:
                where = self._device_of(args[0].node)
                if where != move.device:  # ``.to(x.device)`` of a value already there moves nothing
                    self._read_move(where, move.device, caller_line())
                if move.leaves_nothing:
                    return args[0]
                return super().create_proxy(kind, "to", (args[0], *move.args), dict(move.kwargs), *rest, **options)
        return super().create_proxy(kind, target, args, kwargs, *rest, **options)

    def _device_of(self, node: fx.Node) -> str | None:
        """The canonical device of a traced tensor's example value, or None (not a tensor, meta)."""
        value = self._value(node)
        if not isinstance(value, torch.Tensor) or value.device.type not in ("cpu", "cuda"):
            return None
        return "cpu" if value.device.type == "cpu" else f"cuda:{value.device.index or 0}"

    def _read_move(self, before: str | None, device: str, line: str) -> None:
        """Nodes from now on run on ``device`` (the move at ``line`` of forward). At the first
        move, the computation before it (untagged) runs where the moved value is (``before``:
        where the user placed the modules that made it), so the move is a stage boundary."""
        if self.moves_read == 0 and before is not None:
            for node in self.graph.nodes:
                if node.op in COMPUTE_OPS and tag_of(node) is None:
                    _tag(node, before, f"before the first move in forward, where the moved value is ({before!r})")
        self._moved_to, self._move_source = device, f"moved to {device!r} in forward ({line})"
        self.moves_read += 1

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.leaf_names or isinstance(m, self.leaf_classes):
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward: Callable, args: tuple, kwargs: dict) -> Any:
        path = self.path_of_module(m)
        self.path_stack.append(path)
        try:
            if id(m) in self._opaque_modules:
                return self._call_opaque_module(path, args, kwargs, self._opaque_modules[id(m)])
            if not self.auto_leaf or self.is_leaf_module(m, path):
                return super().call_module(m, forward, args, kwargs)
            return self._call_block(m, path, forward, args, kwargs)
        finally:
            self.path_stack.pop()

    def _call_block(self, m: nn.Module, path: str, forward: Callable, args: tuple, kwargs: dict) -> Any:
        """A module traced into: stamped from an equal call traced before (``passes/blocks.py``),
        else traced (what fx cannot trace made opaque), else run whole."""
        self._answer_isinstance(type(m).forward)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        keyed = None
        if self.stamp_blocks:
            with self._fake_run():
                keyed = self.blocks.key(m, leaves, spec, self._example.value)
        template = self.blocks.template_for(*keyed) if keyed is not None else None
        if template is not None:
            return self._stamp(template, path, leaves)
        mark = self._mark()
        try:
            with watching(m) as used:
                out = self._traced(lambda: fx.Tracer.call_module(self, m, forward, args, kwargs), m)
        except TagError:
            raise
        except Exception as err:  # noqa: BLE001 - whatever stops fx: the module runs whole
            callee = _callee(f"{path} ({type(m).__name__})", "module", err, {path})
            self._opaque_modules[id(m)] = callee
            return self._call_opaque_module(path, args, kwargs, callee)
        # a move read inside changes the device of what follows the call: never stamped
        made = capture(self.graph, mark[0], path, leaves, out) if self.moves_read == mark[3][2] else None
        if made is not None:
            plain_ints(made)
        if keyed is not None:
            self.blocks.record(*keyed, used, made)
        return out

    def _stamp(self, template: Template, path: str, leaves: list[Any]) -> Any:
        rebound = functools.partial(self.blocks.rebound_callee, old=template.path, new=path)
        env, (spec, outputs) = stamp(template, path, leaves, self.graph, self._attribute, rebound)
        for node in template.nodes:  # the copies run where the last move sent them, not the template
            copy = env[node]
            if copy.op in COMPUTE_OPS and TAG_KEY in (copy.meta.get(CUSTOM) or {}):
                copy.meta[CUSTOM] = {k: v for k, v in copy.meta[CUSTOM].items() if k not in (TAG_KEY, TAG_SOURCE)}
            if copy.op in COMPUTE_OPS and self._moved_to is not None:
                _tag(copy, self._moved_to, self._move_source)
        self.blocks.stamped += 1
        return pytree.tree_unflatten([self.proxy(o) if isinstance(o, fx.Node) else o for o in outputs], spec)

    def _answer_isinstance(self, forward: Callable) -> None:
        """Let ``isinstance(x, torch.Tensor)`` in the code of a module's forward (and of the
        decorators around it), and in the library modules of the functions it names, answer
        from the example for this trace's proxies: models check their inputs' types (HF's
        mask builders, in ``transformers.masking_utils``, return a 4-D mask handed to them
        as it is only if it is a tensor). Only the model's modules and those its code calls
        are given it (as fx's autowrap patches their globals): torch's own checks, and its
        C++ ones, must see a proxy."""
        fn = forward
        while fn is not None:
            scope = getattr(fn, "__globals__", None)
            if scope is not None and id(scope) not in self._expanded:
                self._expanded.add(id(scope))
                self._patch_isinstance(scope)
                for called in list(scope.values()):
                    while isinstance(called, types.FunctionType) and not is_internal(called.__code__.co_filename):
                        self._patch_isinstance(called.__globals__)
                        called = getattr(called, "__wrapped__", None)
            fn = getattr(fn, "__wrapped__", None)

    def _patch_isinstance(self, scope: dict) -> None:
        if id(scope) not in self._scopes:
            self._scopes[id(scope)] = (scope, scope.get("isinstance", _ABSENT))
            scope["isinstance"] = self._isinstance

    def _isinstance(self, obj: Any, classes: Any) -> bool:
        if type(obj) is _Proxy and names_tensor(classes) and self.tracing_here():
            return self.is_tensor(obj) or isinstance(obj, classes)
        return isinstance(obj, classes)

    def _attribute(self, target: str, meta: dict) -> fx.Node:
        """The ``get_attr`` node of ``target`` (one per target in the trace); a new one gets
        ``meta`` (a stamped template node's)."""
        if self._param_cache is None:
            self._param_cache = {}
        if target not in self._param_cache:
            self._param_cache[target] = self.create_proxy("get_attr", target, (), {})
            self._param_cache[target].node.meta.update(meta)
        return self._param_cache[target].node

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Any]) -> Any:
        # fx searches named_parameters()/named_buffers() on every access (quadratic in the
        # model's size); one id -> name map per trace gives the same first name
        self._param_cache = parameter_proxy_cache
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

    def to_bool(self, obj: fx.Proxy) -> bool:
        """A branch on a traced value: taken as the example's sizes take it, or, in the
        root's forward where nothing can run whole instead, for a condition on the values of
        the call's inputs alone (``if (boxes[:, 2:] <= boxes[:, :2]).any():``, a check of its
        targets), as the example's values take it; either way checked at run time. A branch
        on other tensor values cannot be traced (fx's TraceError)."""
        given = None
        if user_code() in self._input_branches:
            with self._fake_run():  # the inputs' own values, computed for real
                given = input_only_value(obj.node, self._given)
        value = self._size_value(obj) if given is None else given
        self._assume(obj, bool(value), "the condition")
        return bool(value)

    def iter(self, obj: fx.Proxy) -> Iterator:
        """Iterating over a traced tuple or list (its structure is the example's), or over a
        tensor's dim 0 (its size followed and checked at run time)."""
        return iter([obj[k] for k in range(self.length(obj))])

    def is_tensor(self, obj: fx.Proxy) -> bool:
        """Whether the example's value of one of this trace's proxies is a tensor."""
        return obj.tracer is self and isinstance(self._value(obj.node), torch.Tensor)

    def length(self, obj: fx.Proxy) -> int:
        """``len()`` of a traced tuple or list (a structure; kept even when the values inside
        depend on data), or of a tensor (its dim 0 followed and checked at run time)."""
        value = self._value(obj.node)
        if isinstance(value, tuple | list):
            return len(value)
        value = self._known(obj)
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            if self._follows_batch(obj, value):
                self.batch_lengths.append(caller_line() or "forward")
            self._assume(obj.size(0), int(value.shape[0]), "a length")
            return int(value.shape[0])
        raise fx.proxy.TraceError(f"len() of a traced {type(value).__name__}")

    def _follows_batch(self, obj: fx.Proxy, value: torch.Tensor) -> bool:
        """Whether a traced tensor's dim 0 is the batch: it has one row when the example is
        replayed at a batch of one (``list(image_features)`` over a batch of images)."""
        if self._shadow is None:
            return False
        with self._fake_run():
            alone = self._shadow.value(obj.node)
        return isinstance(alone, torch.Tensor) and alone.dim() > 0 and alone.shape[0] != value.shape[0]

    # ------------------------------------------------------------------ retrying
    def _traced(self, run: Callable[[], Any], module: nn.Module) -> Any:
        """``run()`` traced; when it fails, the innermost function below ``module``'s
        forward that fx could not trace is made opaque and ``run()`` traced again. Raises
        the failure when no function is left to make opaque (nothing of it stays in the graph)."""
        while True:
            mark = self._mark()
            try:
                return run()
            except TagError:
                raise
            except Exception as err:
                self._rollback(mark)
                if not self.auto_leaf or len(self._opaque_functions) >= MAX_OPAQUE_FUNCTIONS:
                    raise
                fn = self._failing_function(err, module)
                if fn is not None:
                    self._opaque_functions[fn] = _callee(f"{fn.__module__}.{fn.__qualname__}", "function", err, set())
                    self._calls.intercept(fn)
                elif not (module is self.root and self._may_branch_on_inputs(err)):
                    raise

    def _may_branch_on_inputs(self, err: BaseException) -> bool:
        """For a branch in the root's own forward, where nothing can run whole instead: let a
        condition on the call's inputs alone follow the example's values (a check of the
        inputs, such as a detection model's of its target boxes), checked at run time.
        Returns whether the line was not allowed before (then trace again)."""
        frames = [frame for frame, _ in traceback.walk_tb(err.__traceback__) if not is_internal(frame.f_code.co_filename)]
        if not frames or not isinstance(err, fx.proxy.TraceError) or frames[-1].f_code in self._input_branches:
            return False
        self._input_branches.add(frames[-1].f_code)
        return True

    def _failing_function(self, err: BaseException, module: nn.Module) -> types.FunctionType | None:
        """The innermost function in the user's code (or a library's) between ``module``'s
        forward and where ``err`` was raised that can be made opaque, or None."""
        frames = [frame for frame, _ in traceback.walk_tb(err.__traceback__)]
        start = next((k for k, f in enumerate(frames) if f.f_code.co_name == "forward" and f.f_locals.get("self") is module), None)
        if start is None:
            start = next((k for k, f in enumerate(frames) if not is_internal(f.f_code.co_filename)), len(frames))
        for frame in reversed(frames[start + 1 :]):
            if is_internal(frame.f_code.co_filename):
                continue
            fn = function_of(frame)
            if fn is not None and interceptable(fn) and not self._calls.intercepted(fn):
                return fn
        return None

    def _mark(self) -> tuple[fx.Node | None, int, int, tuple[str | None, str, int]]:
        nodes = self.graph.nodes
        last = next(iter(reversed(nodes)), None) if len(nodes) else None
        return last, len(self.module_stack), self._writes.mark(), (self._moved_to, self._move_source, self.moves_read)

    def _rollback(self, mark: tuple[fx.Node | None, int, int, tuple[str | None, str, int]]) -> None:
        """Erase what a failed attempt added to the graph, fx's bookkeeping of it, and set
        back the module attributes it wrote and the moves it read."""
        last, depth, writes, (self._moved_to, self._move_source, self.moves_read) = mark
        self._writes.undo(writes)
        doomed = []
        for node in reversed(self.graph.nodes):
            if node is last:
                break
            doomed.append(node)
        for node in doomed:  # newest first: users before what they use
            self.graph.erase_node(node)
        gone = set(doomed)
        for replay in (self._example, self._shadow):
            if replay is not None:
                replay.forget(gone)
        self.blocks.forget(gone)
        if self._param_cache is not None:
            for name in [k for k, p in self._param_cache.items() if p.node in gone]:
                del self._param_cache[name]
        while len(self.module_stack) > depth:
            self.module_stack.popitem(last=True)

    # ------------------------------------------------------------------ opaque calls
    def _call_opaque_module(self, path: str, args: tuple, kwargs: dict, callee: OpaqueCallee) -> Any:
        proxy = self.create_proxy("call_module", path, args, kwargs)
        proxy.node.meta[OPAQUE] = callee
        return self._concretise(proxy, callee)

    def _call_opaque_function(self, fn: types.FunctionType, args: tuple, kwargs: dict) -> Any:
        """The handler of calls to functions made opaque: one ``OpaqueCall`` node."""
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if not any(isinstance(x, fx.Proxy) for x in leaves):
            return self._calls.originals[fn](*args, **kwargs)  # nothing traced flows in
        callee = self._opaque_functions[fn]
        baked, slots, values = [], [], []
        for k, leaf in enumerate(leaves):
            graph_value = self._as_graph_value(leaf)
            if graph_value is None:
                baked.append(unwatched(leaf))
                continue
            baked.append(None)
            slots.append(k)
            values.append(graph_value)
        call = OpaqueCall(fn, spec, tuple(baked), tuple(slots), callee)
        proxy = self.create_proxy("call_function", call, tuple(values), {})
        proxy.node.meta[OPAQUE] = callee
        return self._concretise(proxy, callee)

    def _as_graph_value(self, leaf: Any) -> Any:
        """What the graph passes for one argument leaf of an opaque function: a proxy as is,
        a submodule as a ``get_attr`` node (each stage gets its copy), a tensor as fx makes
        it (a constant or attribute); None for a leaf kept in the call (constants, objects)."""
        if isinstance(leaf, fx.Proxy | torch.Tensor):
            return leaf
        if isinstance(leaf, nn.Module):
            path = self.submodule_paths.get(leaf) if self.submodule_paths else None
            return None if not path else self.create_proxy("get_attr", path, (), {})
        if holds_proxy(leaf):
            raise fx.proxy.TraceError(f"a {type(leaf).__name__} holding traced values cannot be kept in an opaque call")
        return None

    def _concretise(self, proxy: fx.Proxy, callee: OpaqueCallee) -> Any:
        """An opaque call's value as the traced code sees it: its structure and constants from
        a fake run, a graph value per tensor (through an OutputGuard node). A call that
        cannot run on fake tensors stays a plain proxy."""
        value = self._value(proxy.node, callee)
        if value is UNKNOWN:  # data-dependent: its structure stays unknown
            return proxy
        value = pytree.tree_map(unwatched, value)
        guard = output_guard(value, callee, estimated=self._example.data_dependent(proxy.node))
        out = self.create_proxy("call_function", guard, (proxy,), {})
        if isinstance(guard, TensorGuard):
            return out
        leaves, spec = pytree.tree_flatten(value)
        for j, k in enumerate(guard.passed):
            leaves[k] = out[j]
        return pytree.tree_unflatten(leaves, spec)

    # ------------------------------------------------------------------ example values
    def _known(self, obj: fx.Proxy) -> Any:
        """The example's value of a proxy (fake tensors) for a decision the trace takes once:
        fx's TraceError when unknown, or when its sizes depend on tensor values."""
        value = self._value(obj.node)
        if value is UNKNOWN or self._example.data_dependent(obj.node):
            raise fx.proxy.TraceError("symbolically traced variables cannot be used as inputs to control flow")
        return value

    def _size_value(self, obj: fx.Proxy) -> Any:
        value = self._known(obj)
        if isinstance(value, torch.Tensor) or not is_constant(value):
            # a branch on tensor values (or an object): data-dependent, as fx says
            raise fx.proxy.TraceError("symbolically traced variables cannot be used as inputs to control flow")
        return value

    def _assume(self, proxy: fx.Proxy, value: Any, what: str) -> None:
        """Follow the example's ``value`` of ``proxy`` and check it at run time, except an
        (in)equality of sizes that only a batch of one decides the other way: like
        torch.export, a batch dimension is taken to be larger than 1 there (a micro-batch of
        one computes the generic branch: a broadcast to the batch, as HF's masks do)."""
        self.assumptions += 1
        if self._shadow is not None and proxy.node.target in (operator.eq, operator.ne):
            with self._fake_run():
                alone = self._shadow.value(proxy.node)
            if alone is not UNKNOWN and alone != value:
                return  # a size compared for (in)equality that only a batch of one changes
        line = caller_line()
        where = f"{what} at {line}" if line else what
        self.create_proxy("call_function", check_assumed, (proxy, value, where), {})

    def _value(self, node: fx.Node, callee: OpaqueCallee | None = None) -> Any:
        """``node``'s value on the example's fake tensors (UNKNOWN if it cannot run).
        ``callee``: the node is an opaque call, run in its scope (see :meth:`_opaque_run`)."""
        around = None if callee is None else (lambda n: self._opaque_run(callee, n) if n is node else contextlib.nullcontext())
        with self._fake_run():
            return self._example.value(node, around)

    @contextlib.contextmanager
    def _opaque_run(self, callee: OpaqueCallee, node: fx.Node) -> Iterator[None]:
        """An opaque call's fake run: a device_guard inside is an error naming the callee,
        the modules it runs are recorded, and whether it draws random numbers is written to
        ``node.meta["opaque_draws"]`` (for the rng pass; one answer per distinct call)."""
        replay = self._example.replay
        runs = replay.runs
        with opaque_scope(callee.describe()), self._modules_run_by(callee), DrawRecorder() as recorder:
            yield
        key = replay.keys.get(node)
        if replay.runs > runs:
            self._draws[key] = recorder.drew
        node.meta[OPAQUE_DRAWS] = self._draws.get(key, True)

    @contextlib.contextmanager
    def _modules_run_by(self, callee: OpaqueCallee) -> Iterator[None]:
        """Record in ``callee.modules`` the submodules an opaque function runs."""
        paths = self.submodule_paths or {}

        def seen(module: nn.Module, args: Any) -> None:
            if paths.get(module):
                callee.modules.add(paths[module])

        handle = register_module_forward_pre_hook(seen) if callee.kind == "function" else None
        try:
            yield
        finally:
            if handle is not None:
                handle.remove()

    @contextlib.contextmanager
    def _fake_run(self) -> Iterator[None]:
        """Running the model's code for real (on fake tensors), not tracing it: fx's patches
        of nn.Module lifted, opaque functions run as they are."""
        self._replaying += 1
        was_tracing = fx_internals.is_fx_tracing()
        try:
            with self._calls.suspended(), fx_internals._maybe_revert_all_patches():
                fx_internals._set_is_fx_tracing(False)
                yield
        finally:
            fx_internals._set_is_fx_tracing(was_tracing)
            self._replaying -= 1

    def _own_length(self, proxy: fx.Proxy) -> int | None:
        return self.length(proxy) if proxy.tracer is self else None

    def tracing_here(self) -> bool:
        """Whether the current thread is tracing (not replaying) for this tracer."""
        return threading.get_ident() == self._thread and not self._replaying


def _tag(node: fx.Node, device: str, source: str) -> None:
    node.meta[CUSTOM] = {**(node.meta.get(CUSTOM) or {}), TAG_KEY: device, TAG_SOURCE: source}


def _callee(name: str, kind: str, err: BaseException, modules: set[str]) -> OpaqueCallee:
    line = user_frame(err)
    return OpaqueCallee(name, kind, first_line(err), f"{line[0]}: `{line[1]}`" if line else "", modules)
