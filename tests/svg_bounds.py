"""Where an SVG's drawn elements lie, from the file alone: used to check that a picture's
viewBox holds every element (nothing clipped on any side).

It reads the shapes Graphviz and matplotlib write (path, polygon, polyline, line, rect,
circle, ellipse, text, use) under nested ``transform`` attributes (matrix, translate,
scale, rotate). Text spans are estimated from the font size and typical glyph widths, glyph
``use`` elements by their origin; whatever sits under ``defs`` or ``clipPath`` is not drawn.
"""

from __future__ import annotations

import math
import re
import xml.etree.ElementTree as ET
from pathlib import Path

Matrix = tuple[float, float, float, float, float, float]  # a b c d e f, as SVG's matrix()
IDENTITY: Matrix = (1.0, 0.0, 0.0, 1.0, 0.0, 0.0)
NOT_DRAWN = {"defs", "clipPath", "title", "desc", "metadata", "style", "mask", "pattern", "symbol"}
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def _compose(m: Matrix, n: Matrix) -> Matrix:
    a, b, c, d, e, f = m
    a2, b2, c2, d2, e2, f2 = n
    return (a * a2 + c * b2, b * a2 + d * b2, a * c2 + c * d2, b * c2 + d * d2, a * e2 + c * f2 + e, b * e2 + d * f2 + f)


def parse_transform(text: str) -> Matrix:
    """The matrix of an SVG ``transform`` attribute."""
    matrix = IDENTITY
    for name, args in re.findall(r"(\w+)\s*\(([^)]*)\)", text or ""):
        v = [float(x) for x in _NUMBER.findall(args)]
        if name == "matrix":
            step = tuple(v)
        elif name == "translate":
            step = (1.0, 0.0, 0.0, 1.0, v[0], v[1] if len(v) > 1 else 0.0)
        elif name == "scale":
            step = (v[0], 0.0, 0.0, v[1] if len(v) > 1 else v[0], 0.0, 0.0)
        elif name == "rotate":
            r = math.radians(v[0])
            step = (math.cos(r), math.sin(r), -math.sin(r), math.cos(r), 0.0, 0.0)
            if len(v) == 3:
                step = _compose(_compose((1, 0, 0, 1, v[1], v[2]), step), (1, 0, 0, 1, -v[1], -v[2]))
        else:
            raise ValueError(f"unsupported SVG transform {name}()")
        matrix = _compose(matrix, step)
    return matrix


def _apply(m: Matrix, x: float, y: float) -> tuple[float, float]:
    a, b, c, d, e, f = m
    return a * x + c * y + e, b * x + d * y + f


def _path_points(d: str) -> list[tuple[float, float]]:
    """The points of a path written with absolute commands (M, L, C, Q, Z), as both writers do."""
    commands = set(re.findall(r"[A-Za-z]", re.sub(r"(?<=\d)[eE][-+]?\d", "", d)))
    if not commands <= set("MLCQZz"):
        raise ValueError(f"unsupported path commands {sorted(commands)} in {d[:60]!r}")
    numbers = [float(x) for x in _NUMBER.findall(d)]
    return list(zip(numbers[0::2], numbers[1::2]))


def _local_points(el: ET.Element, tag: str) -> list[tuple[float, float]]:
    num = lambda key, default=0.0: float(el.get(key, default))  # noqa: E731
    if tag == "path":
        return _path_points(el.get("d", ""))
    if tag in ("polygon", "polyline"):
        values = [float(x) for x in _NUMBER.findall(el.get("points", ""))]
        return list(zip(values[0::2], values[1::2]))
    if tag == "line":
        return [(num("x1"), num("y1")), (num("x2"), num("y2"))]
    if tag == "rect":
        x, y = num("x"), num("y")
        return [(x, y), (x + num("width"), y + num("height"))]
    if tag in ("circle", "ellipse"):
        rx = num("r") if tag == "circle" else num("rx")
        ry = num("r") if tag == "circle" else num("ry")
        return [(num("cx") - rx, num("cy") - ry), (num("cx") + rx, num("cy") + ry)]
    if tag == "use":
        return [(num("x"), num("y"))]
    return []


def _em(char: str) -> float:
    """About how wide ``char`` is in Helvetica / DejaVu Sans, in em."""
    if char in " ,.:;|!il[]()'`·ftjrI-/\u00a0":
        return 0.3
    if char.isupper() or char in "mwMW%@":
        return 0.75
    return 0.56


def _text_points(el: ET.Element, inherited_size: float) -> list[tuple[float, float]]:
    text = "".join(el.itertext()).strip()
    if not text:
        return []
    size = float(el.get("font-size", inherited_size))
    x, y = float(el.get("x", 0.0)), float(el.get("y", 0.0))
    width = size * sum(_em(c) for c in text)
    left = {"start": x, "middle": x - width / 2, "end": x - width}[el.get("text-anchor", "start")]
    return [(left, y - 0.8 * size), (left + width, y + 0.2 * size)]


def element_bounds(path: str | Path) -> tuple[tuple[float, float, float, float], list[tuple[str, float, float, float, float]]]:
    """Returns the SVG's viewBox (x, y, width, height) and, per drawn element, its tag and
    bounding box (left, top, right, bottom) in viewBox units."""
    root = ET.parse(path).getroot()
    view_box = tuple(float(v) for v in _NUMBER.findall(root.get("viewBox", "")))
    if len(view_box) != 4:
        raise ValueError(f"{path}: the <svg> element has no viewBox")
    boxes: list[tuple[str, float, float, float, float]] = []

    def walk(el: ET.Element, matrix: Matrix, font_size: float) -> None:
        tag = el.tag.rpartition("}")[2]
        if tag in NOT_DRAWN:
            return
        matrix = _compose(matrix, parse_transform(el.get("transform", "")))
        font_size = float(el.get("font-size", font_size))
        local = _text_points(el, font_size) if tag == "text" else _local_points(el, tag)
        if local:
            corners = [_apply(matrix, x, y) for x, y in local]
            if tag in ("text", "rect", "circle", "ellipse"):  # boxes: all four corners
                (x0, y0), (x1, y1) = local[0], local[-1]
                corners = [_apply(matrix, x, y) for x, y in ((x0, y0), (x1, y0), (x0, y1), (x1, y1))]
            xs, ys = [p[0] for p in corners], [p[1] for p in corners]
            boxes.append((tag, min(xs), min(ys), max(xs), max(ys)))
        if tag != "text":
            for child in el:
                walk(child, matrix, font_size)

    walk(root, IDENTITY, 14.0)
    return view_box, boxes  # type: ignore[return-value]


def outside_view_box(path: str | Path, tolerance: float = 0.5) -> list[str]:
    """Returns a line per element reaching outside the viewBox by more than ``tolerance``
    units (empty when the viewBox holds everything)."""
    (vx, vy, vw, vh), boxes = element_bounds(path)
    out = []
    for tag, left, top, right, bottom in boxes:
        if left < vx - tolerance or top < vy - tolerance or right > vx + vw + tolerance or bottom > vy + vh + tolerance:
            out.append(f"<{tag}> spans ({left:.1f}, {top:.1f})-({right:.1f}, {bottom:.1f}) outside viewBox {vx} {vy} {vw} {vh}")
    return out
