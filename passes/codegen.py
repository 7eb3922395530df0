"""Codegen pass: one ``fx.GraphModule`` per stage, holding only that stage's submodules.

Reads ``node.meta["stage"]`` and ``node.meta["edge"]`` from the partitioned graph.
Each stage's forward takes, in order: the model's inputs (stage 0 only), then one
argument per received edge, named after the producing node; it returns a tuple with one
value per sent edge, or, for the last stage, exactly what the model's forward returns
(its output structure). The stage module's attributes keep their original qualified
names (``layer3.0.conv1``), so its parameter names are the model's own.

The modules built here *reference* the model's submodules (nothing is copied or moved):
this is what ``fxpipe.partition`` shows. Placement (``fxpipe.compile``) copies them per
device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.fx as fx
from torch import nn

from fxpipe.passes.meta import EDGE, STAGE
from fxpipe.passes.partition import PartitionedGraph, fxpipe_recv, fxpipe_send


def stage_graph(partitioned: PartitionedGraph, stage: int) -> fx.Graph:
    """The graph of one stage: recv nodes become placeholders, send nodes outputs."""
    graph = fx.Graph()
    mapped: dict[fx.Node, fx.Node] = {}
    source = partitioned.graph
    last = stage == partitioned.num_stages - 1
    if stage == 0:
        for node in source.nodes:
            if node.op == "placeholder":
                mapped[node] = graph.node_copy(node)
    recvs = {e.name: None for e in partitioned.recv_edges(stage)}
    for node in source.nodes:
        if node.op == "call_function" and node.target is fxpipe_recv and node.meta[STAGE] == stage:
            placeholder = graph.placeholder(node.meta[EDGE].name)
            placeholder.meta.update(node.meta)
            recvs[node.meta[EDGE].name] = placeholder
            mapped[node] = placeholder
    sends: dict[str, fx.Node] = {}
    for node in source.nodes:
        if node.meta.get(STAGE) != stage or node.op == "placeholder" or node in mapped:
            continue
        if node.op == "call_function" and node.target is fxpipe_send:
            sends[node.meta[EDGE].name] = mapped[node.args[0]]
            continue
        if node.op == "output":
            if last:
                graph.output(fx.map_arg(node.args[0], lambda a: mapped[a]))
            continue
        mapped[node] = graph.node_copy(node, lambda a: mapped[a])
    if not last:
        outputs = tuple(sends[e.name] for e in partitioned.send_edges(stage))
        graph.output(outputs)
    graph.lint()
    return graph


def build_stage_module(graph: fx.Graph, resolve: Callable[[str], Any], extra: dict[str, Any], name: str) -> fx.GraphModule:
    """A GraphModule whose attributes are exactly the targets the graph uses (plus ``extra``).

    ``resolve(target)`` returns the model's module or tensor for a qualified name.
    """
    targets = {n.target: resolve(n.target) for n in graph.nodes if n.op in ("get_attr", "call_module")}
    gm = fx.GraphModule(targets, graph, class_name=name)
    for path in sorted(extra, key=lambda p: p.count(".")):
        _assign(gm, path, extra[path])
    return gm


def _assign(root: nn.Module, path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    module = root
    for part in parents:
        if not hasattr(module, part):
            module.add_module(part, nn.Module())
        module = getattr(module, part)
    if isinstance(value, nn.Parameter):
        module.register_parameter(leaf, value)
    elif isinstance(value, nn.Module):
        module.add_module(leaf, value)
    else:
        module.register_buffer(leaf, value)


def mutated_inputs(graph: fx.Graph, resolve: Callable[[str], Any]) -> frozenset[int]:
    """Positions of placeholders that some node of ``graph`` writes into in place."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    return frozenset(k for k, p in enumerate(placeholders) if any(_writes_first_arg(u, p, resolve) for u in p.users))


def _writes_first_arg(node: fx.Node, arg: fx.Node, resolve: Callable[[str], Any]) -> bool:
    if not node.args or node.args[0] is not arg:
        return False
    if node.op == "call_module":
        return bool(getattr(resolve(node.target), "inplace", False))
    if node.kwargs.get("inplace"):
        return True
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.startswith("_")
    if node.op == "call_function":
        name = getattr(node.target, "__name__", str(node.target))
        schema = getattr(node.target, "_schema", None)
        if schema is not None:
            return any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments[:1])
        return name.startswith("i") and name in {"iadd", "isub", "imul", "itruediv", "iand", "ior"} or (name.endswith("_") and not name.startswith("_"))
    return False
