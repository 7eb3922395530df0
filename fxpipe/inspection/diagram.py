"""The partition as a diagram: one cluster per stage, cut edges labelled; DOT text for it.

Two views of a :class:`~fxpipe.compiler.partitioned.Partitioned`:

``"node"``   every fx node (parameters aside) inside its stage's cluster, labelled with
             its name, what it calls, its module path and its output shape; each cut edge
             runs from a ``send`` to a ``recv`` node and carries the tensor's shape and
             bytes. A cluster's title names the modules its stage runs.
``"stage"``  one box per stage (device, the modules it runs as ranges of numbered blocks,
             ``transformer.h.0 – transformer.h.5``, nodes, parameters, and the cost
             model's forward FLOPs, time per micro-batch and memory) and one arrow per
             pair of communicating stages (how many tensors, bytes per batch and per
             micro-batch, the largest values by the module producing them), so a model of
             a hundred layers draws as one box per stage.

``"auto"`` picks the stage view above ``NODE_VIEW_LIMIT`` nodes. A view is first built
as a :class:`Diagram` (plain data), which ``Diagram.to_dot`` turns into Graphviz text and
``fxpipe.inspection.render`` renders, with Graphviz or its own matplotlib fallback.
"""

from __future__ import annotations

import html
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch.fx as fx

from fxpipe.inspection import format as fmt
from fxpipe.inspection.contents import crossing_values
from fxpipe.passes.meta import EDGE, MODULE_PATH, STAGE, VAL
from fxpipe.passes.partition import fxpipe_recv, fxpipe_send
from fxpipe.passes.shape_prop import describe

if TYPE_CHECKING:
    from fxpipe.compiler.partitioned import Partitioned
    from fxpipe.compiler.stage import Stage

LEVELS = ("auto", "node", "stage")
NODE_VIEW_LIMIT = 400
CONTENTS_WIDTH = 48  # characters per line of a stage box's module list
NAMED_VALUES = 2  # the values a stage-view arrow names; the rest are counted

# Pastel cluster fills and the stronger border of each, indexed by stage.
_FILLS = ["#dbeafe", "#dcfce7", "#fef3c7", "#fce7f3", "#e0e7ff", "#ccfbf1", "#fee2e2", "#f3e8ff"]
_BORDERS = ["#3b82f6", "#22c55e", "#f59e0b", "#ec4899", "#6366f1", "#14b8a6", "#ef4444", "#a855f7"]
CUT_COLOUR = "#dc2626"
LINK_COLOUR = "#6b7280"


@dataclass
class Cluster:
    """A stage's frame: its index, title and colours."""

    index: int
    title: str
    fill: str
    border: str


@dataclass
class Box:
    """One drawn node: ``lines[0]`` is its title; ``cluster`` the stage framing it, if any.

    shape: "box" (a computation or a stage), "port" (a send or recv), "io" (the model's
    inputs and outputs).
    """

    id: str
    lines: list[str]
    fill: str = "#ffffff"
    border: str = "#4b5563"
    cluster: int | None = None
    shape: str = "box"


@dataclass
class Link:
    """An arrow between two boxes; ``cut`` marks a value crossing stages; ``label`` may
    hold several lines."""

    src: str
    dst: str
    label: str = ""
    cut: bool = False


@dataclass
class Diagram:
    """What a partition drawing shows, independent of the renderer.

    rankdir: "TB" (the node view flows down) or "LR" (the stage view flows right).
    """

    title: str
    level: str
    rankdir: str
    clusters: list[Cluster] = field(default_factory=list)
    boxes: list[Box] = field(default_factory=list)
    links: list[Link] = field(default_factory=list)

    def to_dot(self) -> str:
        """Returns Graphviz DOT source: one ``cluster_<stage>`` subgraph per stage, HTML
        labels with the first line in bold, cut edges red and labelled."""
        shapes = {"box": "box", "port": "cds", "io": "oval"}
        out = [
            "digraph partition {",
            f"  rankdir={self.rankdir}; newrank=true; compound=true;",
            f"  label={_html([self.title])}; labelloc=t; fontname=Helvetica; fontsize=16;",
            '  node [shape=box, style="rounded,filled", fontname=Helvetica, fontsize=10, penwidth=1];',
            f'  edge [fontname=Helvetica, fontsize=9, color="{LINK_COLOUR}", arrowsize=0.6];',
        ]

        def box_line(box: Box, indent: str) -> str:
            return (
                f"{indent}{_dot_id(box.id)} [label={_html(box.lines)}, shape={shapes[box.shape]}, "
                f'fillcolor="{box.fill}", color="{box.border}"];'
            )

        by_cluster: dict[int | None, list[Box]] = defaultdict(list)
        for box in self.boxes:
            by_cluster[box.cluster].append(box)
        for cluster in self.clusters:
            out.append(f"  subgraph cluster_{cluster.index} {{")
            out.append(
                f"    label={_html([cluster.title])}; labeljust=l; fontsize=13; "
                f'style="filled,rounded"; fillcolor="{cluster.fill}"; color="{cluster.border}";'
            )
            out += [box_line(box, "    ") for box in by_cluster[cluster.index]]
            out.append("  }")
        out += [box_line(box, "  ") for box in by_cluster[None]]
        for link in self.links:
            attrs = []
            if link.label:
                # In a top-down drawing the label sits right of its arrow: keep it clear.
                indent = "\u00a0\u00a0" if self.rankdir == "TB" else ""
                label = _html([indent + line for line in link.label.split("\n")], bold_title=False)
                attrs.append(f"label={label}")
            if link.cut:
                attrs.append(f'color="{CUT_COLOUR}", fontcolor="{CUT_COLOUR}", penwidth=2')
            suffix = f" [{', '.join(attrs)}]" if attrs else ""
            out.append(f"  {_dot_id(link.src)} -> {_dot_id(link.dst)}{suffix};")
        out.append("}")
        return "\n".join(out) + "\n"


def partition_diagram(part: Partitioned, level: str = "auto") -> Diagram:
    """Returns the :class:`Diagram` of ``part`` at ``level`` ("node", "stage" or "auto").

    Raises:
        ValueError: for any other level.
    """
    if level not in LEVELS:
        raise ValueError(f"level must be one of {', '.join(map(repr, LEVELS))}, got {level!r}")
    if level == "auto":
        level = "stage" if _num_nodes(part.graph) > NODE_VIEW_LIMIT else "node"
    return _stage_diagram(part) if level == "stage" else _node_diagram(part)


def partition_dot(part: Partitioned, level: str = "auto") -> str:
    """Returns Graphviz DOT source for ``part`` at ``level`` ("node", "stage" or "auto").

    Raises:
        ValueError: for an unknown level.
    """
    return partition_diagram(part, level).to_dot()


# ------------------------------------------------------------------ node view
def _node_diagram(part: Partitioned) -> Diagram:

    diagram = Diagram(
        f"{part.model_name}: {part.num_stages} stage(s), node view", "node", "TB",
        clusters=[
            _cluster(s, f"stage {s.index} · {s.device} · {fmt.count(s.num_parameters)} params · {', '.join(modules)}")
            for s, modules in zip(part.stages, part.stage_contents())
        ],
    )
    modules = {s.index: s.module for s in part.stages}
    for node in part.graph.nodes:
        if node.op == "get_attr":
            continue
        stage = node.meta.get(STAGE, 0)
        if _is_port(node):
            edge = node.meta[EDGE]
            lines = [f"send → stage {edge.dst}" if node.target is fxpipe_send else f"recv ← stage {edge.src}", edge.name]
            diagram.boxes.append(Box(node.name, lines, _fill(stage), _border(stage), stage, "port"))
            continue
        shape = "io" if node.op in ("placeholder", "output") else "box"
        diagram.boxes.append(Box(node.name, _node_lines(node, modules.get(stage)), cluster=stage, shape=shape))
    for node in part.graph.nodes:
        for arg in node.all_input_nodes:
            if arg.op == "get_attr":
                continue
            if _is_port(node) and node.target is fxpipe_recv:
                edge = node.meta[EDGE]
                diagram.links.append(Link(arg.name, node.name, f"{edge.description} · {fmt.nbytes(edge.nbytes)}", cut=True))
            else:
                diagram.links.append(Link(arg.name, node.name))
    return diagram


def _node_lines(node: fx.Node, module: fx.GraphModule | None) -> list[str]:
    """Title (node name), what it calls and where (module path), and its output shape."""
    path = node.meta.get(MODULE_PATH, "")
    if node.op == "placeholder":
        what = "input"
    elif node.op == "output":
        what = "output"
    elif node.op == "call_module":
        what = _module_class(module, node.target) if module is not None else "module"
    elif node.op == "call_method":
        what = f".{node.target}()"
    else:
        what = getattr(node.target, "__name__", str(node.target))
    if path and path != node.name:
        what += f" · {path}"
    lines = [node.name, what]
    if VAL in node.meta:
        lines.append(describe(node.meta[VAL]))
    return lines


def _module_class(module: fx.GraphModule, target: str) -> str:
    try:
        return type(module.get_submodule(target)).__name__
    except AttributeError:
        return "module"


# ----------------------------------------------------------------- stage view
def _stage_diagram(part: Partitioned) -> Diagram:

    # Two stages read best side by side; more stack downwards, so a page's width holds
    # the boxes and the labels of the arrows between them.
    rankdir = "LR" if part.num_stages <= 2 else "TB"
    diagram = Diagram(f"{part.model_name}: {part.num_stages} stage(s), stage view", "stage", rankdir)
    inputs = [n for n in part.graph.nodes if n.op == "placeholder"]
    if inputs:
        lines = ["input"] + [f"{n.name}: {describe(n.meta[VAL])}" if VAL in n.meta else n.name for n in inputs]
        diagram.boxes.append(Box("input", lines, shape="io"))
    for stage, estimate, modules in zip(part.stages, part.estimates(), part.stage_contents()):
        lines = [f"stage {stage.index} · {stage.device}"]
        lines += _wrap(modules, CONTENTS_WIDTH)
        lines.append(f"{stage.num_nodes} node{'s' if stage.num_nodes != 1 else ''} · {fmt.count(stage.num_parameters)} params ({fmt.nbytes(stage.parameter_bytes)})")
        lines.append(f"{fmt.flops(estimate.flops)} forward per batch")
        lines.append(f"predicted {fmt.seconds(estimate.time)} per micro-batch · memory {fmt.nbytes(estimate.memory)}")
        diagram.boxes.append(Box(f"stage{stage.index}", lines, _fill(stage.index), _border(stage.index)))
    if inputs:
        diagram.links.append(Link("input", "stage0"))
    diagram.links += _traffic_links(part)
    output = next((n for n in part.graph.nodes if n.op == "output"), None)
    if output is not None:
        value = fx.map_arg(output.args[0], lambda n: n.meta.get(VAL))
        diagram.boxes.append(Box("output", ["output", describe(value)], shape="io"))
        diagram.links.append(Link(f"stage{part.num_stages - 1}", "output"))
    return diagram


def _traffic_links(part: Partitioned) -> list[Link]:
    """One red arrow per pair of communicating stages: how many tensors and bytes (per
    batch and per micro-batch), then the largest values by the module producing them."""
    microbatches = part.plan.microbatches
    origins = crossing_values(part.graph)
    pairs: dict[tuple[int, int], list] = defaultdict(list)
    for edge in part.partitioned.edges:
        pairs[(edge.src, edge.dst)].append(edge)
    links = []
    for (src, dst), edges in sorted(pairs.items()):
        nbytes = sum(e.nbytes for e in edges)
        lines = [f"{len(edges)} tensor{'s' if len(edges) != 1 else ''} · {fmt.nbytes(nbytes)}"]
        if microbatches > 1:
            lines.append(f"{fmt.nbytes(nbytes / microbatches)} per micro-batch")
        largest = sorted(edges, key=lambda e: -e.nbytes)
        lines += [f"{origins.get(e.name, e.name)} {e.description}" for e in largest[:NAMED_VALUES]]
        if len(edges) > NAMED_VALUES:
            lines.append(f"and {len(edges) - NAMED_VALUES} more")
        links.append(Link(f"stage{src}", f"stage{dst}", "\n".join(lines), cut=True))
    return links


# ------------------------------------------------------------------- helpers
def _num_nodes(graph: fx.Graph) -> int:
    return sum(1 for n in graph.nodes if n.op != "get_attr")


def _is_port(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in (fxpipe_send, fxpipe_recv)


def _fill(stage: int) -> str:
    return _FILLS[stage % len(_FILLS)]


def _border(stage: int) -> str:
    return _BORDERS[stage % len(_BORDERS)]


def _cluster(stage: Stage, title: str) -> Cluster:
    return Cluster(stage.index, title, _fill(stage.index), _border(stage.index))


def _wrap(items: list[str], width: int) -> list[str]:
    """Joins ``items`` with commas into lines of at most about ``width`` characters."""
    lines: list[str] = []
    for item in items:
        if lines and len(lines[-1]) + len(item) + 2 <= width:
            lines[-1] += ", " + item
        else:
            lines.append(item)
    return lines


def _html(lines: list[str], bold_title: bool = True) -> str:
    """A Graphviz HTML label, one line per row, the first in bold unless told otherwise."""
    escaped = [html.escape(line, quote=False) for line in lines]
    if bold_title and escaped and escaped[0]:
        escaped[0] = f"<B>{escaped[0]}</B>"
    return "<" + "<BR/>".join(escaped) + ">"


def _dot_id(name: str) -> str:
    return name if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) else '"' + name.replace('"', '\\"') + '"'


__all__ = ["Box", "Cluster", "Diagram", "Link", "partition_diagram", "partition_dot"]
