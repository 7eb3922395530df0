"""Partition pass: cut the staged graph, with explicit send/recv nodes on every cut edge.

Reads ``node.meta["stage"]`` (annotate pass) and ``node.meta["val"]`` (shape_prop).
Returns a new graph in which:
- every value used by a later stage goes through ``fxpipe_send(value, dst=…)`` in its
  producer's stage and ``fxpipe_recv(send, src=…)`` in the consumer's stage; an edge that
  jumps over stages (a ResNet/UNet skip) goes straight from producer to consumer;
- every ``get_attr`` (parameter, buffer, constant) is repeated in each stage that uses
  it, so weights are never sent as activations; a parameter used by two stages on
  different devices is a tied weight, handled by the placement step;
- ``node.meta["stage"]`` is set on every node, send/recv included, and send/recv nodes
  carry ``node.meta["edge"]``: the :class:`Edge` they implement.
The graph stays executable (send and recv return their input), so ``pipe.graph`` is the
whole partitioned program.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.fx as fx

from fxpipe.passes.meta import EDGE, MODULE_PATH, STAGE, VAL
from fxpipe.passes.shape_prop import describe, tensor_bytes


def fxpipe_send(value: Any, dst: int) -> Any:
    """Marks a value leaving its stage for stage ``dst`` (identity when run in one graph)."""
    return value


def fxpipe_recv(value: Any, src: int) -> Any:
    """Marks a value arriving from stage ``src`` (identity when run in one graph)."""
    return value


@dataclass
class Edge:
    """One value crossing from stage ``src`` to stage ``dst``.

    name: the producing node's name (also the consumer stage's placeholder name).
    value: the shape-propagated value (fake tensors), None if unknown.
    """

    name: str
    src: int
    dst: int
    value: Any = None

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.value)

    @property
    def description(self) -> str:
        return describe(self.value)


@dataclass
class PartitionedGraph:
    """The whole partitioned program and its edges, grouped by stage."""

    graph: fx.Graph
    num_stages: int
    edges: list[Edge]

    @property
    def edge_ends(self) -> list[tuple[int, int]]:
        """(producer stage, consumer stage) of every edge, by edge id."""
        return [(e.src, e.dst) for e in self.edges]

    @property
    def deps(self) -> list[tuple[int, int]]:
        """The stage graph: the distinct (producer, consumer) pairs, sorted."""
        return sorted(set(self.edge_ends))

    def recv_edges(self, stage: int) -> list[Edge]:
        return [e for e in self.edges if e.dst == stage]

    def send_edges(self, stage: int) -> list[Edge]:
        return [e for e in self.edges if e.src == stage]


def partition(graph: fx.Graph, num_stages: int) -> PartitionedGraph:
    """Copy ``graph`` inserting send/recv pairs on cut edges and one get_attr per using stage."""
    new = fx.Graph()
    mapped: dict[fx.Node, fx.Node] = {}
    received: dict[tuple[fx.Node, int], fx.Node] = {}
    attrs: dict[tuple[fx.Node, int], fx.Node] = {}
    edges: list[Edge] = []

    def value_in(arg: fx.Node, stage: int) -> fx.Node:
        if arg.op == "get_attr":
            key = (arg, stage)
            if key not in attrs:
                node = new.get_attr(arg.target)
                node.meta.update(arg.meta)
                node.meta[STAGE] = stage
                attrs[key] = node
            return attrs[key]
        src = arg.meta[STAGE]
        if src == stage:
            return mapped[arg]
        key = (arg, stage)
        if key not in received:
            edge = Edge(arg.name, src, stage, arg.meta.get(VAL))
            send = new.create_node("call_function", fxpipe_send, (mapped[arg],), {"dst": stage}, name=f"send_{arg.name}_to_{stage}")
            recv = new.create_node("call_function", fxpipe_recv, (send,), {"src": src}, name=f"{arg.name}_at_{stage}")
            for node, where in ((send, src), (recv, stage)):
                node.meta.update({STAGE: where, EDGE: edge, VAL: arg.meta.get(VAL)})
                node.meta[MODULE_PATH] = arg.meta.get(MODULE_PATH, "")
            edges.append(edge)
            received[key] = recv
        return received[key]

    for node in graph.nodes:
        if node.op == "get_attr":
            continue  # emitted next to each using stage
        stage = node.meta[STAGE]
        copy = new.node_copy(node, lambda arg, stage=stage: value_in(arg, stage))
        mapped[node] = copy
    new.lint()
    return PartitionedGraph(new, num_stages, edges)
