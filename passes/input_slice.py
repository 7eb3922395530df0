"""The part of a graph that computes some of its values from the model's inputs alone.

A model that computes its own loss (``labels=``) derives the loss's target from an input
(HF causal LMs pad and shift ``labels``): that derivation needs no parameter and no
activation, so it can run before the pipeline does, on every micro-batch, for the price of
a few indexing ops. :func:`input_slice` cuts it out as a GraphModule that takes the
graph's placeholders and returns the values asked for. :func:`output_inputs` says which
inputs each output depends on: one that depends on no input cut into micro-batches is the
same for every micro-batch and is returned once.

Reads nothing from ``node.meta``; writes nothing. The graph is not changed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx

_FREE_ATTRIBUTES = ("device",)  # ``x.to(logits.device)``: where the value lives, not what it is


def input_slice(gm: fx.GraphModule, values: Sequence[Any]) -> fx.GraphModule | None:
    """A GraphModule ``f(*placeholders) -> tuple(values)``, or None when a value depends on a
    parameter, a buffer, a submodule call or an impure op.

    ``values`` are nodes of ``gm.graph`` or constants. ``getattr(x, "device")`` reads are
    replaced by the CPU device: the slice computes what the values are, wherever they live.
    """
    needed: dict[fx.Node, None] = {}
    stack = [v for v in values if isinstance(v, fx.Node)]
    while stack:
        node = stack.pop()
        if node in needed:
            continue
        if node.op in ("get_attr", "call_module") or (node.op != "placeholder" and node.is_impure()):
            return None
        needed[node] = None
        if not _free_attribute(node):
            stack.extend(node.all_input_nodes)
    graph = fx.Graph()
    copied: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            copied[node] = graph.node_copy(node)
        elif node in needed:
            copied[node] = graph.call_function(torch.device, ("cpu",)) if _free_attribute(node) else graph.node_copy(node, copied.__getitem__)
    graph.output(tuple(copied[v] if isinstance(v, fx.Node) else v for v in values))
    graph.eliminate_dead_code()
    return fx.GraphModule(torch.nn.Module(), graph, "InputSlice")


def output_inputs(gm: fx.GraphModule) -> list[frozenset[int]]:
    """For every leaf of the graph's output (in pytree order), the positions of the
    placeholders it depends on (empty: a constant, or parameters alone)."""
    placeholders = {n: k for k, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    reach: dict[fx.Node, frozenset[int]] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            reach[node] = frozenset({placeholders[node]})
        else:
            reach[node] = frozenset().union(*(reach[i] for i in node.all_input_nodes))
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    leaves = pytree.tree_leaves(output.args[0])
    return [reach[leaf] if isinstance(leaf, fx.Node) else frozenset() for leaf in leaves]


def _free_attribute(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is getattr and len(node.args) == 2 and node.args[1] in _FREE_ATTRIBUTES


__all__ = ["input_slice", "output_inputs"]
