"""Graphviz DOT text for a partition: one cluster per stage, cut edges labelled.

Two views: ``"node"`` (every fx node, module path on each) and ``"stage"`` (a box per
stage with its module range, parameters and edges with tensor counts and bytes). ``"auto"``
picks the stage view above 400 nodes so ResNet-152-sized graphs stay readable.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

from passes.annotate import STAGE
from passes.partition import EDGE, fxpipe_recv, fxpipe_send

if TYPE_CHECKING:
    from fxpipe.partitioned import Partitioned

_COLORS = ["#dbeafe", "#dcfce7", "#fef3c7", "#fce7f3", "#e0e7ff", "#ccfbf1", "#fee2e2", "#f3e8ff"]


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def partition_dot(part: Partitioned, level: str = "auto") -> str:
    """DOT source for ``part``; level is "node", "stage" or "auto"."""
    if level not in ("auto", "node", "stage"):
        raise ValueError(f"level must be 'auto', 'node' or 'stage', got {level!r}")
    if level == "auto":
        level = "stage" if sum(1 for _ in part.graph.nodes) > 400 else "node"
    return _stage_dot(part) if level == "stage" else _node_dot(part)


def _node_dot(part: Partitioned) -> str:
    from fxpipe.partitioned import _fmt_bytes

    lines = ["digraph partition {", "  rankdir=TB;", '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];']
    by_stage: dict[int, list] = defaultdict(list)
    for node in part.graph.nodes:
        if node.op == "get_attr":
            continue
        by_stage[node.meta.get(STAGE, 0)].append(node)
    for stage in part.stages:
        color = _COLORS[stage.index % len(_COLORS)]
        lines.append(f"  subgraph cluster_{stage.index} {{")
        lines.append(f"    label={_quote(f'stage {stage.index} · {stage.device}')}; style=filled; color={_quote(color)};")
        for node in by_stage[stage.index]:
            if node.op == "call_function" and node.target in (fxpipe_send, fxpipe_recv):
                kind = "send" if node.target is fxpipe_send else "recv"
                label = f"{kind} {node.meta[EDGE].name}"
                lines.append(f"    {node.name} [label={_quote(label)}, shape=cds, fillcolor=\"#ffffff\"];")
                continue
            path = node.meta.get("module_path", "")
            label = node.name + (f"\\n{path}" if path and path != node.name else "")
            lines.append(f"    {node.name} [label={_quote(label)}, fillcolor=\"#ffffff\"];")
        lines.append("  }")
    for node in part.graph.nodes:
        for arg in node.all_input_nodes:
            if arg.op == "get_attr":
                continue
            attrs = ""
            if node.op == "call_function" and node.target is fxpipe_recv:
                edge = node.meta[EDGE]
                attrs = f" [label={_quote(f'{edge.description} · {_fmt_bytes(edge.nbytes)}')}, color=red, penwidth=2]"
            lines.append(f"  {arg.name} -> {node.name}{attrs};")
    lines.append("}")
    return "\n".join(lines)


def _stage_dot(part: Partitioned) -> str:
    from fxpipe.partitioned import _fmt_bytes, _fmt_count

    lines = ["digraph partition {", "  rankdir=LR;", '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=11];']
    for stage in part.stages:
        color = _COLORS[stage.index % len(_COLORS)]
        label = (
            f"stage {stage.index} · {stage.device}\\n{stage.module_range}\\n"
            f"{stage.num_nodes} nodes · {_fmt_count(stage.num_parameters)} params ({_fmt_bytes(stage.parameter_bytes)})"
        )
        lines.append(f"  stage{stage.index} [label={_quote(label)}, fillcolor={_quote(color)}];")
    pairs: dict[tuple[int, int], list] = defaultdict(list)
    for edge in part.partitioned.edges:
        pairs[(edge.src, edge.dst)].append(edge)
    for (src, dst), edges in sorted(pairs.items()):
        label = f"{len(edges)} value(s) · {_fmt_bytes(sum(e.nbytes for e in edges))}"
        lines.append(f"  stage{src} -> stage{dst} [label={_quote(label)}];")
    lines.append("}")
    return "\n".join(lines)
