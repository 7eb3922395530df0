"""Repeated blocks traced once: a 48-layer model's layers are one trace, stamped 47 times.

The fx tracer (``passes/fx_tracer.py``) asks :class:`Blocks` at every module call it would
trace into. A call's key is the module's class, its parameters' and buffers' names, shapes
and dtypes, its children's keys and its attributes (configuration by value, objects by
identity), and the call's input signature: the structure of its arguments, each traced
value's shape, dtype and ``requires_grad`` on the example (and which arguments are the same
value), constants by value. The first call of a key is traced and its nodes kept as a
:class:`Template`; a later call of the key gets a copy of those nodes (:func:`stamp`) with
its own arguments in place of the first's and every target under the first module's path
(``transformer.h.0.attn.c_attn.weight``) rebound under its own (``transformer.h.7...``).

Integer attributes are kept out of the key (``layer_idx`` differs in every layer) but
not out of the rule: while a block is traced in full its modules' integer attributes are
watched (:func:`watching`), and those its trace used (compared, computed with, passed to an
op) must be equal for a later call to be stamped from it; a block whose trace made a tensor
constant must match in all of them. A module (or one inside it) with hooks, or a trace that
reads a value from outside the call other than a parameter (an attribute holding a traced
value), a device_guard tag inside, or an output that is neither traced nor a constant, is
never stamped: it is traced every time.

Writes the stamped nodes' ``node.meta`` as copies of the template's, with
``module_path`` (and an opaque module's callee) rebound to the new path, and
``node.meta["block"]`` on the nodes of every block stamped and of its template: the
partitioner clusters them (``split="auto"`` cuts between layers).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch.fx.node import map_aggregate
from torch.nn.modules import module as module_hooks

from fxpipe.passes.meta import BLOCK, CUSTOM, MODULE_PATH, OPAQUE
from fxpipe.passes.opaque import OpaqueCallee
from fxpipe.passes.signature import is_constant

_MAX_PLAIN_LENGTH = 64  # longer containers in attributes are keyed by identity


@dataclass
class Template:
    """The nodes one traced call of a block made, and how they connect to the call.

    path: the module's qualified name; nodes: in graph order; inputs: each argument node the
    call was given -> its position among the call's pytree leaves; out_spec / outputs: the
    call's result, each leaf a node of the template, an input, or a constant.
    """

    path: str
    nodes: list[fx.Node]
    inputs: dict[fx.Node, int]
    out_spec: pytree.TreeSpec
    outputs: list[Any]


class Blocks:
    """The templates of one trace, by key (see the module doc)."""

    def __init__(self) -> None:
        # per key: (the integer attributes a template's trace used, with their values; template)
        self._entries: dict[Hashable, list[tuple[dict[str, int], Template]]] = {}
        self._signatures: dict[int, tuple[nn.Module, Hashable, dict[str, int]]] = {}
        self._rebound: dict[tuple[int, str], OpaqueCallee] = {}
        self.stamped = 0  # how many calls were stamped instead of traced

    def key(self, module: nn.Module, leaves: list[Any], spec: pytree.TreeSpec, value_of: Callable[[fx.Node], Any]) -> tuple[Hashable, dict[str, int]] | None:
        """(key, integer attributes) of a call of ``module`` whose arguments' pytree leaves are
        ``leaves``; ``value_of(node)`` is a traced value's example value. None when the call
        cannot be stamped (hooks, an argument whose example value is unknown)."""
        if _hooked(module):
            return None
        signature, ints = self._signature(module)
        described = []
        seen: dict[fx.Node, int] = {}
        for leaf in leaves:
            if isinstance(leaf, fx.Proxy):
                if leaf.node in seen:
                    described.append(("same", seen[leaf.node]))
                    continue
                seen[leaf.node] = len(described)
                value = value_of(leaf.node)
                if isinstance(value, torch.Tensor):
                    described.append(("tensor", tuple(value.shape), value.dtype, value.device, value.requires_grad))
                elif is_constant(value):
                    described.append(("value", type(value), value))
                else:
                    return None
            else:
                described.append(_plain(leaf))
        return (type(module), signature, spec, tuple(described)), ints

    def template_for(self, key: Hashable, ints: dict[str, int]) -> Template | None:
        """The template a call of ``key`` can be stamped from, or None (trace it)."""
        for used, template in self._entries.get(key, ()):
            if all(ints.get(name) == value for name, value in used.items()):
                return template
        return None

    def record(self, key: Hashable, ints: dict[str, int], used: set[str], template: Template | None) -> None:
        """A call of ``key`` was traced in full: its template (None when it cannot be one),
        and the integer attributes its trace ``used``."""
        if template is not None:
            used = set(ints) if _makes_constants(template) else used
            self._entries.setdefault(key, []).append(({name: ints[name] for name in used if name in ints}, template))

    def forget(self, gone: set[fx.Node]) -> None:
        """Drop templates made of nodes a rolled-back attempt erased."""
        for variants in self._entries.values():
            variants[:] = [(used, t) for used, t in variants if not (t.nodes and t.nodes[0] in gone)]

    def rebound_callee(self, callee: OpaqueCallee, old: str, new: str) -> OpaqueCallee:
        """An opaque callee of a stamped node, under the stamped path: a module's record is
        copied with its name and path rebound; a function's learns the rebound modules."""
        if callee.kind == "function":
            callee.modules |= {rebase(m, old, new) for m in list(callee.modules) if _under(m, old)}
            return callee
        key = (id(callee), new)
        if key not in self._rebound:
            modules = {rebase(m, old, new) for m in callee.modules}
            self._rebound[key] = OpaqueCallee(rebase(callee.name, old, new), callee.kind, callee.reason, callee.line, modules)
        return self._rebound[key]

    def _signature(self, module: nn.Module) -> tuple[Hashable, dict[str, int]]:
        """The module's key without its integer attributes, and those by path (``attn.
        layer_idx``); computed once per module, a child's reused by its parent."""
        entry = self._signatures.get(id(module))
        if entry is None:
            state, ints = [], {}
            for name, value in vars(module).items():
                if name in ("_parameters", "_buffers", "_modules"):
                    continue
                if isinstance(value, int) and not isinstance(value, bool):
                    ints[name] = value.value if isinstance(value, _Watched) else value
                else:
                    state.append((name, _plain(value)))
            tensors = tuple((name, None if t is None else (tuple(t.shape), t.dtype, t.requires_grad)) for name, t in [*module._parameters.items(), *module._buffers.items()])
            children = []
            for name, child in module._modules.items():
                if child is None:
                    children.append((name, None))
                    continue
                signature, child_ints = self._signature(child)
                children.append((name, signature))
                ints.update({f"{name}.{path}": value for path, value in child_ints.items()})
            entry = (module, (type(module), tuple(state), tensors, tuple(children)), ints)
            self._signatures[id(module)] = entry
        return entry[1], entry[2]


def capture(graph: fx.Graph, after: fx.Node | None, path: str, leaves: list[Any], out: Any) -> Template | None:
    """The template of the call of module ``path`` whose nodes follow ``after`` in ``graph``
    (its arguments' pytree leaves ``leaves``, its result ``out``), or None when it cannot be
    stamped elsewhere (see the module doc)."""
    nodes = []
    node = after.next if after is not None else next(iter(graph.nodes), None)
    while node is not None and node.op != "root":
        nodes.append(node)
        node = node.next
    inside = set(nodes)
    inputs: dict[fx.Node, int] = {}
    for k, leaf in enumerate(leaves):
        if isinstance(leaf, fx.Proxy):
            inputs.setdefault(leaf.node, k)
    for node in nodes:
        if (node.meta.get(CUSTOM) or {}) or any(a not in inside and a not in inputs and a.op != "get_attr" for a in node.all_input_nodes):
            return None
    out_leaves, out_spec = pytree.tree_flatten(out)
    outputs = []
    for leaf in out_leaves:
        if isinstance(leaf, fx.Proxy):
            if leaf.node not in inside and leaf.node not in inputs:
                return None
            outputs.append(leaf.node)
        elif is_constant(leaf):
            outputs.append(leaf)
        else:
            return None
    return Template(path, nodes, inputs, out_spec, outputs)


def stamp(
    template: Template,
    path: str,
    leaves: list[Any],
    graph: fx.Graph,
    attribute: Callable[[str, dict], fx.Node],
    rebound: Callable[[OpaqueCallee], OpaqueCallee],
) -> tuple[dict[fx.Node, fx.Node], Any]:
    """Copy ``template``'s nodes to the end of ``graph`` for the call of module ``path`` with
    argument leaves ``leaves``, named as a trace would name them. ``attribute(target,
    meta)`` gives the ``get_attr`` node of a target (one per target in a trace; a new one
    gets ``meta``); ``rebound`` an opaque callee under ``path``. Marks the template's nodes
    and the copies with ``node.meta["block"]`` (their block's path: the outermost repeated
    block wins). Returns the node map and the call's result, with nodes in place of the
    template's."""
    old = template.path
    for node in template.nodes:
        node.meta[BLOCK] = old
    env: dict[fx.Node, fx.Node] = {node: leaves[k].node for node, k in template.inputs.items()}

    def mapped(node: fx.Node) -> fx.Node:
        if node not in env:  # a get_attr made outside the call (a tied or earlier-read parameter)
            env[node] = attribute(rebase(node.target, old, path), {})
        return env[node]

    for node in template.nodes:
        meta = dict(node.meta)
        for key in (MODULE_PATH, BLOCK):
            if key in meta:
                meta[key] = rebase(meta[key], old, path)
        if OPAQUE in meta:
            meta[OPAQUE] = rebound(meta[OPAQUE])
        if node.op == "get_attr":
            env[node] = attribute(rebase(node.target, old, path), meta)
            continue
        target = rebase(node.target, old, path) if node.op == "call_module" else node.target
        new = graph.create_node(node.op, target, fx.map_arg(node.args, mapped), fx.map_arg(node.kwargs, mapped), type_expr=node.type)
        new.meta = meta
        env[node] = new
    outputs = [env[leaf] if isinstance(leaf, fx.Node) else leaf for leaf in template.outputs]
    return env, (template.out_spec, outputs)


def rebase(target: str, old: str, new: str) -> str:
    """``target`` with the module path ``old`` it starts with replaced by ``new``."""
    if target == old or target.startswith(old + "."):
        return new + target[len(old):]
    return target


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + ".")


def _hooked(module: nn.Module) -> bool:
    """Whether a hook would run on a call of ``module`` or a module inside (skipped by a stamp)."""
    if module_hooks._global_forward_hooks or module_hooks._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())


def _plain(value: Any) -> Hashable:
    """A value by value where that is cheap and meaningful, else by identity."""
    if is_constant(value):
        return (type(value), value)
    if isinstance(value, list | tuple | set | frozenset) and len(value) <= _MAX_PLAIN_LENGTH:
        items = sorted(value, key=repr) if isinstance(value, set | frozenset) else value
        return (type(value), tuple(_plain(v) for v in items))
    if isinstance(value, dict) and len(value) <= _MAX_PLAIN_LENGTH:
        return (dict, tuple((k, _plain(v)) for k, v in value.items()))
    return ("id", id(value))


def _makes_constants(template: Template) -> bool:
    """Whether the traced call stored a tensor constant on the root (``_tensor_constant0``),
    which an integer attribute might have shaped without the trace seeing the integer."""
    return any(node.op == "get_attr" and str(node.target).startswith("_tensor_constant") for node in template.nodes)


class _Watched(int):
    """An integer attribute of a module while a block is traced: it records, in each
    watcher's set, under the watcher's name for it, that the trace used it."""

    def __new__(cls, value: int, watchers: list[tuple[str, set[str]]]) -> _Watched:
        plain = value.value if isinstance(value, _Watched) else value  # unwrapped without using it
        obj = super().__new__(cls, plain)
        obj.value, obj.watchers = plain, watchers
        return obj

    def used(self) -> None:
        for name, seen in self.watchers:
            seen.add(name)

    def __reduce__(self) -> tuple:
        return (int, (self.value,))


def _watched_method(name: str) -> Callable:
    plain = getattr(int, name)

    def method(self: _Watched, *args: Any) -> Any:
        self.used()
        return plain(self.value, *args)

    return method


for _name in (
    "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__hash__", "__bool__", "__index__", "__int__", "__float__",
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__floordiv__", "__rfloordiv__", "__truediv__",
    "__rtruediv__", "__mod__", "__rmod__", "__pow__", "__rpow__", "__neg__", "__pos__", "__abs__", "__and__", "__rand__",
    "__or__", "__ror__", "__xor__", "__rxor__", "__lshift__", "__rshift__", "__invert__", "__format__", "__str__", "__repr__",
    "__divmod__", "__rdivmod__", "__round__", "__trunc__", "__floor__", "__ceil__",
):
    setattr(_Watched, _name, _watched_method(_name))


@contextlib.contextmanager
def watching(module: nn.Module) -> Iterator[set[str]]:
    """While the block runs inside, yields the set of the paths (``attn.num_heads``) of the
    integer attributes of ``module`` and the modules inside it that the code used."""
    used: set[str] = set()
    saved = []
    for prefix, sub in module.named_modules():
        for name, value in list(vars(sub).items()):
            if isinstance(value, int) and not isinstance(value, bool):
                path = f"{prefix}.{name}" if prefix else name
                outer = value.watchers if isinstance(value, _Watched) else []
                saved.append((sub, name, value))
                sub.__dict__[name] = _Watched(value, [*outer, (path, used)])
    try:
        yield used
    finally:
        for sub, name, value in reversed(saved):
            sub.__dict__[name] = value


def unwatched(value: Any) -> Any:
    """``value``, a watched integer recorded as used and made plain (what a graph keeps)."""
    if isinstance(value, _Watched):
        value.used()
        return value.value
    return value


def plain_ints(template: Template) -> None:
    """Record as used, and replace by plain ints, the watched integers a template's nodes
    hold as arguments (``view(-1, self.num_heads)``) or return."""
    for node in template.nodes:
        node.args = map_aggregate(node.args, unwatched)
        node.kwargs = map_aggregate(node.kwargs, unwatched)
    template.outputs = [unwatched(v) for v in template.outputs]
