"""Partition drawings as files: Graphviz when its ``dot`` program is installed, otherwise a
pure-Python renderer (a layered layout drawn with matplotlib), so ``draw`` always works.

``make install`` installs Graphviz where apt-get can; the fallback draws the same
:class:`~fxpipe.inspection.diagram.Diagram` (stage clusters, labelled cut edges) with straight and curved
arrows instead of Graphviz's spline routing. matplotlib loads only when a picture is asked for.
"""

from __future__ import annotations

import shutil
import subprocess
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fxpipe.inspection.diagram import CUT_COLOUR, LINK_COLOUR, Box, Diagram, Link, partition_diagram

if TYPE_CHECKING:
    from fxpipe.compiler.partitioned import Partitioned

RENDERERS = ("auto", "graphviz", "matplotlib")
SOURCE_SUFFIXES = (".dot", ".gv")
# What each renderer writes, by file extension.
GRAPHVIZ_FORMATS = ("svg", "png", "pdf", "jpg", "jpeg")
MATPLOTLIB_FORMATS = ("svg", "png", "pdf", "jpg", "jpeg")
RASTER_FORMATS = ("png", "jpg", "jpeg")
DPI = 96  # pixels per inch of raster pictures
MAX_PIXELS = 30000  # the longest side of a PNG; Agg refuses beyond 2**16


class DrawError(RuntimeError):
    """A drawing could not be written: unknown format, or the renderer asked for is missing."""


def graphviz_available() -> bool:
    """Returns whether Graphviz's ``dot`` program is on PATH."""
    return shutil.which("dot") is not None


def draw(part: Partitioned, path: str | Path, level: str = "auto", renderer: str = "auto") -> Path:
    """Draws the partition of ``part`` and writes it to ``path``; returns the path.

    The format follows the extension: ``.svg``, ``.png``, ``.pdf`` (a picture) or ``.dot`` /
    ``.gv`` (the DOT source). ``level`` is "node", "stage" or "auto" (see ``fxpipe.inspection.diagram``).
    ``renderer`` "auto" uses Graphviz when ``dot`` is installed and matplotlib otherwise.

    Raises:
        ValueError: for an unknown level or renderer.
        DrawError: for an extension neither renderer writes, renderer="graphviz" without
            Graphviz installed, or Graphviz failing.
    """
    if renderer not in RENDERERS:
        raise ValueError(f"renderer must be one of {', '.join(map(repr, RENDERERS))}, got {renderer!r}")
    diagram = partition_diagram(part, level)
    return draw_diagram(diagram, path, renderer)


def draw_diagram(diagram: Diagram, path: str | Path, renderer: str = "auto") -> Path:
    """Writes ``diagram`` to ``path`` as ``draw`` does; returns the path."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in SOURCE_SUFFIXES:
        path.write_text(diagram.to_dot())
        return path
    fmt = suffix.lstrip(".")
    if fmt not in GRAPHVIZ_FORMATS + MATPLOTLIB_FORMATS:
        raise DrawError(f"cannot draw to {path.name!r}: use a .svg, .png, .pdf or .dot file name")
    if renderer == "graphviz" and not graphviz_available():
        raise DrawError(
            "renderer='graphviz' but Graphviz's dot program is not installed: "
            "`apt-get install graphviz` (make install does this), or use renderer='matplotlib'"
        )
    if renderer == "graphviz" or (renderer == "auto" and graphviz_available()):
        _render_graphviz(diagram.to_dot(), path, fmt)
    else:
        _render_matplotlib(diagram, path)
    return path


def _render_graphviz(source: str, path: Path, fmt: str) -> None:
    # The resolution is a raster setting: Graphviz 2.43 scales an SVG's drawing by it but
    # not its viewBox, which clips the picture, so vector formats keep their points.
    resolution = [f"-Gdpi={DPI}"] if fmt in RASTER_FORMATS else []
    command = ["dot", f"-T{fmt}", *resolution, "-o", str(path)]
    done = subprocess.run(command, input=source, text=True, capture_output=True, check=False)
    if done.returncode != 0:
        raise DrawError(f"Graphviz failed drawing {path.name}: {done.stderr.strip()}")


# ------------------------------------------------------------ matplotlib fallback
FONT = 9.0  # points; the layout is in points too, so text and boxes scale together
LINE = FONT * 1.3
PAD = 6.0
NODE_GAP = 18.0
RANK_GAP = 34.0
CLUSTER_PAD = 12.0
CLUSTER_TITLE = 22.0
CLUSTER_FONT = FONT * 1.2
LABEL_FONT = FONT * 0.9
LABEL_GAP = 6.0  # points between an arrow and its label
PORT_HEAD = 1.5  # a send/recv arrow's height over its body's (matplotlib's rarrow)
TITLE = 30.0


@dataclass
class Placed:
    """A box's centre and size in points (y grows downwards)."""

    x: float
    y: float
    width: float
    height: float


@dataclass
class Layout:
    """Where the fallback renderer puts everything: boxes, cluster frames, the canvas."""

    boxes: dict[str, Placed]
    clusters: dict[int, tuple[float, float, float, float]]  # left, top, right, bottom
    routes: list[list[tuple[float, float]]]  # one polyline per diagram link
    labels: list[tuple[float, float] | None]  # where each link's label is anchored, if it has one
    width: float
    height: float


def layout(diagram: Diagram) -> Layout:
    """Returns a layered layout of ``diagram``: ranks by longest path (a stage's cluster
    starts below the previous one's), boxes in a rank ordered by their inputs' positions."""
    sizes = {b.id: _box_size(b) for b in diagram.boxes}
    rank = _ranks(diagram)
    preds: dict[str, list[str]] = defaultdict(list)
    for link in diagram.links:
        preds[link.dst].append(link.src)
    by_rank: dict[int, list[Box]] = defaultdict(list)
    for box in diagram.boxes:
        by_rank[rank[box.id]].append(box)
    across = diagram.rankdir == "TB"  # in TB ranks are rows, boxes of a rank side by side

    def extent(box_id: str, along: bool) -> float:
        width, height = sizes[box_id]
        return (height if along else width) if across else (width if along else height)

    cluster_of = {b.id: b.cluster for b in diagram.boxes}
    cross: dict[str, float] = {}
    rank_at: dict[int, float] = {}
    position = TITLE
    previous_clusters: set[int | None] = set()
    for r in sorted(by_rank):
        boxes = by_rank[r]
        clusters = {cluster_of[b.id] for b in boxes}
        starts_cluster = bool(clusters - previous_clusters - {None})
        ids = {b.id for b in boxes}
        labels = [link.label for link in diagram.links if link.label and link.dst in ids]
        # A label sits beside its arrow in TB and across the gap between columns in LR.
        lines = [line for label in labels for line in label.split("\n")]
        label_room = (
            (FONT * 1.4 * max(label.count("\n") + 1 for label in labels) if across else max(map(len, lines)) * FONT * 0.9 * 0.6)
            if labels else 0.0
        )
        if r != min(by_rank):
            ends_cluster = bool(previous_clusters - clusters - {None})
            position += RANK_GAP + label_room + (CLUSTER_PAD if ends_cluster else 0.0)
        position += CLUSTER_TITLE + CLUSTER_PAD if starts_cluster and across else 0.0
        thickness = max(extent(b.id, True) for b in boxes)
        rank_at[r] = position + thickness / 2
        position += thickness
        previous_clusters = clusters
        _place_rank(boxes, preds, cross, lambda box_id: extent(box_id, False))
    low = min(cross[b] - extent(b, False) / 2 for b in cross) - CLUSTER_PAD - PAD
    placed = {}
    for box in diagram.boxes:
        width, height = sizes[box.id]
        along, side = rank_at[rank[box.id]], cross[box.id] - low + CLUSTER_PAD
        x, y = (side, along) if across else (along + CLUSTER_PAD, side + TITLE)
        placed[box.id] = Placed(x, y, width, height)
    routes = [_route(link, placed, rank, across) for link in diagram.links]
    frames = {}
    for cluster in diagram.clusters:
        members = [placed[b.id] for b in diagram.boxes if b.cluster == cluster.index]
        if not members:
            continue
        inside = [
            point for link, route in zip(diagram.links, routes)
            if cluster_of[link.src] == cluster_of[link.dst] == cluster.index for point in route[1:-1]
        ]
        left = min(p.x - p.width / 2 for p in members) - CLUSTER_PAD
        title_right = left + len(cluster.title) * CLUSTER_FONT * 0.62 + 2 * PAD  # the frame holds its title
        frames[cluster.index] = (
            left,
            min(p.y - p.height / 2 for p in members) - CLUSTER_PAD - CLUSTER_TITLE,
            max([p.x + p.width / 2 for p in members] + [x for x, _ in inside] + [title_right - CLUSTER_PAD]) + CLUSTER_PAD,
            max([p.y + p.height / 2 for p in members] + [y for _, y in inside]) + CLUSTER_PAD,
        )
    labels = [_label_anchor(route, across) if link.label else None for link, route in zip(diagram.links, routes)]
    corners = [(p.x + p.width / 2, p.y + p.height / 2) for p in placed.values()]
    corners += [_label_corner(link.label, at, across) for link, at in zip(diagram.links, labels) if at is not None]
    corners += [(f[2], f[3]) for f in frames.values()] + [point for route in routes for point in route]
    right = max(x for x, _ in corners) + CLUSTER_PAD
    bottom = max(y for _, y in corners) + CLUSTER_PAD
    title_width = len(diagram.title) * FONT * 1.5 * 0.62 + 2 * CLUSTER_PAD
    return Layout(placed, frames, routes, labels, max(right, title_width), bottom)


def _label_anchor(route: list[tuple[float, float]], across: bool) -> tuple[float, float]:
    """Where a link's label goes: beside the middle of its first segment, or of its detour
    for a link routed around boxes (so the label stays clear of them). Top-down drawings
    anchor the label's left end right of the arrow; left-right ones its centre above it."""
    (x0, y0), (x1, y1) = route[1:3] if len(route) > 2 else route[:2]
    return ((x0 + x1) / 2 + LABEL_GAP, (y0 + y1) / 2) if across else ((x0 + x1) / 2, (y0 + y1) / 2 - LABEL_GAP)


def _label_corner(label: str, at: tuple[float, float], across: bool) -> tuple[float, float]:
    """The lower right corner of a label anchored at ``at``."""
    lines = label.split("\n")
    width = max(map(len, lines)) * LABEL_FONT * 0.6 + 2 * PAD
    height = len(lines) * LABEL_FONT * 1.3 / 2
    return (at[0] + width, at[1] + height) if across else (at[0] + width / 2, at[1] + height)


def _route(link: Link, placed: dict[str, Placed], rank: dict[str, int], across: bool) -> list[tuple[float, float]]:
    """A straight arrow between neighbouring ranks; a link that jumps over ranks (a skip
    connection) detours beside the boxes of the ranks between, so it crosses none."""
    src, dst = placed[link.src], placed[link.dst]
    if across:
        start, end = (src.x, src.y + src.height / 2), (dst.x, dst.y - dst.height / 2)
    else:
        start, end = (src.x + src.width / 2, src.y), (dst.x - dst.width / 2, dst.y)
    between = [placed[b] for b, r in rank.items() if rank[link.src] < r < rank[link.dst]]
    if not between:
        return [start, end]
    if across:
        side = max(p.x + p.width / 2 for p in between) + NODE_GAP / 2
        return [start, (side, start[1] + RANK_GAP / 2), (side, end[1] - RANK_GAP / 2), end]
    side = max(p.y + p.height / 2 for p in between) + NODE_GAP
    return [start, (start[0] + RANK_GAP / 2, side), (end[0] - RANK_GAP / 2, side), end]


def _ranks(diagram: Diagram) -> dict[str, int]:
    """Longest-path ranks, with every box of stage s ranked below all of stage s - 1."""
    import networkx as nx

    graph = nx.DiGraph()
    order = {b.id: k for k, b in enumerate(diagram.boxes)}
    graph.add_nodes_from(order)
    graph.add_edges_from((link.src, link.dst) for link in diagram.links)
    cluster_of = {b.id: b.cluster for b in diagram.boxes}

    def key(box_id: str) -> tuple[int, int]:
        cluster = cluster_of[box_id]
        if cluster is None:
            cluster = -1 if graph.in_degree(box_id) == 0 else 1 << 30
        return cluster, order[box_id]

    rank: dict[str, int] = {}
    floor, current, deepest = 0, None, -1
    for box_id in nx.lexicographical_topological_sort(graph, key=key):
        cluster = cluster_of[box_id]
        if cluster is not None and cluster != current:
            floor, current = deepest + 1, cluster
        rank[box_id] = max([rank[p] + 1 for p in graph.predecessors(box_id)] + [floor])
        deepest = max(deepest, rank[box_id])
    return rank


def _place_rank(boxes: list[Box], preds: dict[str, list[str]], cross: dict[str, float], extent) -> None:
    """Puts each box of one rank near the mean of its inputs, then pushes overlapping
    boxes apart keeping the rank's centre."""
    wanted = {}
    for k, box in enumerate(boxes):
        known = [cross[p] for p in preds[box.id] if p in cross]
        wanted[box.id] = sum(known) / len(known) if known else k * 100.0
    ordered = sorted(boxes, key=lambda b: wanted[b.id])
    at = []
    edge = float("-inf")
    for box in ordered:
        half = extent(box.id) / 2
        centre = max(wanted[box.id], edge + half + NODE_GAP)
        at.append(centre)
        edge = centre + half
    shift = sum(wanted[b.id] for b in ordered) / len(ordered) - sum(at) / len(at)
    for box, centre in zip(ordered, at):
        cross[box.id] = centre + shift


def _box_size(box: Box) -> tuple[float, float]:
    longest = max(len(line) * (1.08 if k == 0 else 1.0) for k, line in enumerate(box.lines))
    width = longest * FONT * 0.6 + 2 * PAD
    height = len(box.lines) * LINE + 2 * PAD
    if box.shape == "io":
        width += 2 * PAD
    if box.shape == "port":  # the arrow's head is half as tall again as its body, and sticks out by a third
        height *= PORT_HEAD
        width += height / 3
    return width, height


def _render_matplotlib(diagram: Diagram, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    placed = layout(diagram)
    fig = plt.figure(figsize=(placed.width / 72, placed.height / 72))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, placed.width)
    ax.set_ylim(placed.height, 0)
    ax.axis("off")
    ax.text(CLUSTER_PAD, TITLE / 2, diagram.title, fontsize=FONT * 1.5, weight="bold", va="center")
    for cluster in diagram.clusters:
        if cluster.index not in placed.clusters:
            continue
        left, top, right, bottom = placed.clusters[cluster.index]
        ax.add_patch(
            FancyBboxPatch(
                (left, top), right - left, bottom - top, boxstyle="round,pad=0,rounding_size=8",
                facecolor=cluster.fill, edgecolor=cluster.border, linewidth=1.0, zorder=0,
            )
        )
        ax.text(left + PAD, top + CLUSTER_TITLE / 2 + 2, cluster.title, fontsize=CLUSTER_FONT, weight="bold", va="center", zorder=1)
    styles = {"box": "round,pad=0,rounding_size=5", "port": "rarrow,pad=0", "io": "round,pad=0,rounding_size={r}"}
    for box in diagram.boxes:
        p = placed.boxes[box.id]
        style = styles[box.shape].format(r=p.height / 2)
        width, height, centre = p.width, p.height, p.x
        if box.shape == "port":  # the body, so that its head ends at the placed size
            width, height, centre = p.width - p.height / 3, p.height / PORT_HEAD, p.x - p.height / 6
        ax.add_patch(
            FancyBboxPatch(
                (centre - width / 2, p.y - height / 2), width, height, boxstyle=style,
                facecolor=box.fill, edgecolor=box.border, linewidth=0.9, zorder=3,
            )
        )
        top = p.y - (len(box.lines) - 1) * LINE / 2
        for k, line in enumerate(box.lines):
            ax.text(
                centre, top + k * LINE, line, fontsize=FONT,
                weight="bold" if k == 0 else "normal", ha="center", va="center", zorder=4,
            )
    for link, route, label_at in zip(diagram.links, placed.routes, placed.labels):
        colour = CUT_COLOUR if link.cut else LINK_COLOUR
        width = 1.8 if link.cut else 0.8
        if len(route) > 2:
            ax.plot(*zip(*route[:-1]), color=colour, linewidth=width, zorder=2, solid_joinstyle="round")
        ax.add_patch(
            FancyArrowPatch(
                route[-2], route[-1], arrowstyle="-|>", mutation_scale=9, color=colour,
                linewidth=width, shrinkA=0, zorder=2,
            )
        )
        if label_at is not None:
            ax.text(
                *label_at, link.label, fontsize=LABEL_FONT, color=colour, ha="left" if diagram.rankdir == "TB" else "center",
                va="center", zorder=5, bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.85, "pad": 1.5},
            )
    fig.savefig(path, dpi=_dpi(placed))
    plt.close(fig)


def _dpi(placed: Layout) -> float:
    """DPI of the fallback's picture: ``DPI``, less when the longest side would pass ``MAX_PIXELS``."""
    return min(DPI, MAX_PIXELS / (max(placed.width, placed.height) / 72))


def fallback_size(diagram: Diagram) -> tuple[int, int]:
    """Returns the (width, height) in pixels of the PNG the matplotlib renderer writes."""
    placed = layout(diagram)
    dpi = _dpi(placed)
    return round(placed.width / 72 * dpi), round(placed.height / 72 * dpi)


__all__ = ["DrawError", "draw", "draw_diagram", "fallback_size", "graphviz_available", "layout"]
