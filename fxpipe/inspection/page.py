"""One self-contained HTML page that explains a partition: what ``fxpipe inspect --html`` writes.

The page holds the partition drawing (inline SVG), the summary table and the values
crossing stages (HTML tables), the predicted timeline (a PNG inside the page, with its
figures) and the explain text. It loads nothing from anywhere: no scripts, no fonts, no
links to files beside it, so it can be mailed or attached to an issue as it is.
"""

from __future__ import annotations

import base64
import html
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from fxpipe.inspection.render import draw

if TYPE_CHECKING:
    from fxpipe.compiler.partitioned import Partitioned
    from fxpipe.inspection.timeline import Timeline

STYLE = """
body { font-family: Helvetica, Arial, sans-serif; margin: 24px; color: #111827; max-width: 1600px; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 17px; margin-top: 28px; }
p.lead { color: #4b5563; margin-top: 0; }
table { border-collapse: collapse; font-size: 13px; margin: 8px 0; }
th, td { border-bottom: 1px solid #e5e7eb; padding: 4px 10px; text-align: left; vertical-align: top; }
th { background: #f3f4f6; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
pre { background: #f9fafb; border: 1px solid #e5e7eb; padding: 10px; font-size: 12px; overflow-x: auto; }
.figure svg, .figure img { max-width: 100%; height: auto; }
.figure { overflow-x: auto; }
"""
# the summary's columns that hold figures, right-aligned
NUMERIC = {"nodes", "params", "param bytes", "FLOPs", "predicted", "memory", "bytes"}


def inspection_page(part: Partitioned, timeline: Timeline, level: str = "stage", renderer: str = "auto") -> str:
    """Returns the page's HTML for ``part`` and its predicted ``timeline``; the drawing at
    ``level`` (default the stage view: the page is an overview) by ``renderer`` (see
    ``fxpipe.inspection.render.draw``, whose errors it raises)."""
    with tempfile.TemporaryDirectory() as folder:
        drawing = draw(part, Path(folder) / "partition.svg", level=level, renderer=renderer).read_text()
        chart = Path(folder) / "timeline.png"
        timeline.plot(chart, title="predicted timeline of one step")
        chart_data = base64.b64encode(chart.read_bytes()).decode("ascii")
    title = f"{part.model_name}: {part.num_stages} stage(s)"
    lead = (
        f"schedule {part.plan.schedule}, {part.plan.microbatches} micro-batch(es), devices "
        f"{', '.join(part.devices)}, split {part.plan.split!r}, traced with {part.frontend}"
    )
    body = [
        f"<h1>{html.escape(title)}</h1>",
        f'<p class="lead">{html.escape(lead)}</p>',
        "<h2>Partition</h2>",
        f'<div class="figure" id="drawing">{_inline_svg(drawing)}</div>',
        "<h2>Stages</h2>",
        _table(part.summary_rows(), "summary"),
        "<h2>Values crossing stages</h2>",
        _table(part.crossing_rows(), "crossing") if len(part.crossing_rows()) > 1 else "<p>none: one stage</p>",
        "<h2>Predicted timeline</h2>",
        f'<div class="figure" id="timeline"><img alt="predicted timeline" src="data:image/png;base64,{chart_data}"></div>',
        f"<pre>{html.escape(timeline.summary())}</pre>",
        "<h2>Why each stage holds what it holds</h2>",
        f'<pre id="explain">{html.escape(part.explain())}</pre>',
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{html.escape(title)}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n"
        + "\n".join(body)
        + "\n</body>\n</html>\n"
    )


def write_page(part: Partitioned, timeline: Timeline, path: str | Path, level: str = "stage", renderer: str = "auto") -> Path:
    """Writes :func:`inspection_page` to ``path``; returns the path."""
    path = Path(path)
    path.write_text(inspection_page(part, timeline, level, renderer), encoding="utf-8")
    return path


def _inline_svg(document: str) -> str:
    """An SVG file's ``<svg>`` element, without the XML declaration, doctype and comments
    that may not appear inside HTML."""
    start = document.index("<svg")
    return re.sub(r"<!--.*?-->", "", document[start:], flags=re.S)


def _table(rows: Sequence[tuple[str, ...]], name: str) -> str:
    """The rows as an HTML table: the first is the header."""
    header, *body = rows
    numeric = [column in NUMERIC for column in header]
    lines = [f'<table id="{name}">', "<tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in header) + "</tr>"]
    for row in body:
        cells = "".join(
            f'<td class="num">{html.escape(c)}</td>' if right else f"<td>{html.escape(c)}</td>"
            for c, right in zip(row, numeric)
        )
        lines.append(f"<tr>{cells}</tr>")
    lines.append("</table>")
    return "\n".join(lines)


__all__ = ["inspection_page", "write_page"]
