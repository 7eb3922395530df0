"""Gantt charts of timelines (matplotlib, loaded only when a chart is drawn)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fxpipe.inspection import format as fmt
from fxpipe.schedules import OPS as WORK_OPS  # a worker's own work: the actions' ops

if TYPE_CHECKING:
    from fxpipe.inspection.timeline import Event, Timeline


def plot_timelines(timelines: Sequence[Timeline], path: str | Path, title: str | None = None) -> None:
    """Draws the timelines one above the other on a shared time axis; see ``Timeline.plot``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    span = max(t.step_time for t in timelines) or 1.0
    scale, unit = fmt.time_unit(span)
    per_row = max(
        (sum(e.worker == w for e in t.events) for t in timelines for w in range(t.num_workers)),
        default=0,
    )
    # Wide enough for a readable box per action, up to a size a screen still shows.
    width = min(30.0, max(12.0, 0.3 * per_row))
    rows = sum(t.num_workers for t in timelines)
    entries = legend_entries(timelines)
    # As many legend rows as the labels need at this width, under the time axis.
    needed = sum(_LEGEND_ENTRY_INCHES + _LEGEND_CHAR_INCHES * len(e["label"]) for e in entries)
    legend_rows = math.ceil(needed / (0.95 * width))
    height = 1.2 + 0.45 * rows + 0.6 * len(timelines) + 0.3 * legend_rows
    fig, axes = plt.subplots(len(timelines), 1, sharex=True, squeeze=False, figsize=(width, height))
    points_per_second = width * 72 * 0.8 / span
    for ax, timeline in zip(axes[:, 0], timelines):  # each panel numbered as densely as its own boxes allow
        labels = _labels([e for e in timeline.events if e.op in WORK_OPS], points_per_second)
        _draw(timeline, ax, scale, labels, points_per_second)
    axes[-1, 0].set_xlabel(f"time ({unit})")
    axes[-1, 0].set_xlim(0, span * scale * 1.01)
    fig.legend(
        handles=[Patch(**entry) for entry in entries],
        loc="lower center",
        ncol=math.ceil(len(entries) / legend_rows),
        frameon=False,
    )
    if title:
        fig.suptitle(title, x=0.01, ha="left")
    fig.tight_layout(rect=(0, (0.1 + 0.3 * legend_rows) / height, 1, 0.97))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def legend_entries(timelines: Sequence[Timeline]) -> list[dict[str, Any]]:
    """The legend's patches as ``matplotlib.patches.Patch`` keyword arguments: each op the
    timelines hold in its colour, the idle hatch, the later-chunk shades when a worker holds
    several stages, and sends/receives when there are any."""
    ops = [op for op in WORK_OPS if any(e.op == op for t in timelines for e in t.events)]
    multi_chunk = any(
        len({(e.worker, e.stage) for e in t.events}) > len({e.worker for e in t.events}) for t in timelines
    )
    entries: list[dict[str, Any]] = [{"color": _COLOURS[op][0], "label": _OP_LABELS[op]} for op in ops]
    entries.append(
        {"facecolor": _IDLE_COLOUR, "edgecolor": _IDLE_EDGE, "hatch": "////", "linewidth": 0, "label": "idle (bubble)"}
    )
    if multi_chunk:
        entries += [{"color": _COLOURS[op][1], "label": f"{_OP_LABELS[op]}, later chunk"} for op in ops]
    if any(e.op not in WORK_OPS for t in timelines for e in t.events):
        entries.append({"color": _COMM_COLOUR, "label": "send / recv"})
    return entries


def _draw(timeline: Timeline, ax: Any, scale: float, labels: tuple[float, int], points_per_second: float) -> None:
    """Draws the rows of this timeline on ``ax``."""
    origin = min((e.start for e in timeline.events), default=0.0)
    stages_of: dict[int, list[int]] = defaultdict(list)
    for e in timeline.events:
        if e.stage not in stages_of[e.worker]:
            stages_of[e.worker].append(e.stage)
    # A stage's chunk: its rank among the stages its worker holds.
    chunk_of = {
        (w, s): k for w, stages in stages_of.items() for k, s in enumerate(sorted(stages))
    }
    devices = {e.worker: e.device for e in timeline.events if e.device}
    # A hatched band under each row: whatever the actions leave uncovered
    # is the worker's idle time, the pipeline bubble.
    for worker in range(timeline.num_workers):
        ax.barh(
            worker, timeline.step_time * scale, left=0, height=0.6, color=_IDLE_COLOUR,
            hatch="////", edgecolor=_IDLE_EDGE, linewidth=0, zorder=0,
        )
    for e in timeline.events:
        left, width = (e.start - origin) * scale, e.duration * scale
        if e.op not in WORK_OPS:
            ax.barh(e.worker + 0.38, width, left=left, height=0.1, color=_COMM_COLOUR)
            continue
        shades = _COLOURS[e.op]
        ax.barh(
            e.worker,
            width,
            left=left,
            height=0.6,
            color=shades[chunk_of[e.worker, e.stage] % len(shades)],
            edgecolor="white",
            linewidth=0.8,
        )
        _label(ax, e, left + width / 2, e.duration * points_per_second, labels)
    ax.set_yticks(range(timeline.num_workers))
    ax.set_yticklabels(
        [_row_label(timeline.worker_name(w), devices.get(w), stages_of[w]) for w in range(timeline.num_workers)]
    )
    ax.set_ylim(timeline.num_workers - 0.5, -0.5)
    ax.grid(axis="x", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)
    ax.set_title(timeline.title(), fontsize=10, loc="left")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


# Forward blues, backward oranges, input-gradient (I) reds and weight-gradient (W) greens,
# one shade per chunk a worker holds.
_COLOURS = {
    "F": ("#3a78b5", "#1f4e79", "#6fa3d6", "#0f2d4a"),
    "B": ("#e07b28", "#a3520f", "#f0a868", "#6b3306"),
    "I": ("#c8414b", "#8c1c25", "#e27b82", "#5a0f15"),
    "W": ("#3d9a5b", "#1f6b3a", "#79c493", "#0f4023"),
}
_OP_LABELS = {"F": "forward", "B": "backward", "I": "input gradients (I)", "W": "weight gradients (W)"}
_COMM_COLOUR = "#9a9a9a"
# A legend entry's width in inches at matplotlib's default sizes: handle and spacing, and
# per character of its label.
_LEGEND_ENTRY_INCHES = 0.7
_LEGEND_CHAR_INCHES = 0.08
_IDLE_COLOUR = "#f4f4f5"
_IDLE_EDGE = "#d4d4d8"


def _label_width(microbatch: int, size: float) -> float:
    """Points a micro-batch number takes at ``size``, with a margin."""
    return size * (0.6 * len(str(microbatch)) + 0.3)


def _labels(compute: list[Event], points_per_second: float) -> tuple[float, int]:
    """(font size, stride) of the micro-batch numbers: the largest size up to 9 points that
    fits the narrowest box, not below 5; when even 5 points do not fit, every k-th
    micro-batch is numbered (k of 2, 5, 10, 20, … so that k narrowest boxes hold a
    number), never none."""
    if not compute:
        return 9.0, 1
    narrowest = min(e.duration for e in compute) * points_per_second
    widest_number = max(compute, key=lambda e: len(str(e.microbatch))).microbatch
    size = max(5.0, min(9.0, narrowest / _label_width(widest_number, 1.0)))
    stride = 1
    steps = (2, 5)
    k = 0
    while stride * max(narrowest, 1e-9) < _label_width(widest_number, size) * 1.2:
        stride = steps[k % 2] * 10 ** (k // 2)
        k += 1
    return size, stride


def _label(ax: Any, e: Event, centre: float, box_points: float, labels: tuple[float, int]) -> None:
    """Number the box of ``e``: inside it when the number fits, else (every stride-th
    micro-batch) just outside, forwards above the row and backwards below it."""
    size, stride = labels
    inside = box_points >= _label_width(e.microbatch, size)
    if not inside and e.microbatch % stride:
        return
    if inside:
        ax.text(centre, e.worker, str(e.microbatch), ha="center", va="center", fontsize=size, color="white")
    else:
        above = e.op == "F"
        ax.text(
            centre, e.worker + (-0.31 if above else 0.31), str(e.microbatch), ha="center",
            va="bottom" if above else "top", fontsize=size, color="#333333",
        )


def _row_label(name: str, device: str | None, stages: list[int]) -> str:
    label = name
    if device:
        label += f" ({device})"
    if len(stages) > 1:
        label += "\nstages " + ", ".join(map(str, sorted(stages)))
    return label
