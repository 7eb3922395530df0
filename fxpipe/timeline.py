"""``Timeline``: what each worker did during one step, predicted or measured.

The simulator builds predicted timelines and the executors record measured ones; both
are lists of ``Event``. A timeline answers the questions asked of a pipeline step (how
long, how idle, how many activations held) and draws itself as a Gantt chart or a Chrome
trace. matplotlib loads only inside ``plot``.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

KINDS = ("predicted", "measured")
COMPUTE_OPS = ("F", "B")
EVENT_OPS = ("F", "B", "send", "recv")


@dataclass(frozen=True)
class Event:
    """One interval of one worker's time: a forward, a backward, a send or a recv.

    ``start`` and ``end`` are in seconds on a clock shared by all workers of the timeline.
    """

    worker: int
    stage: int
    microbatch: int
    op: str
    start: float
    end: float
    device: str = ""

    def __post_init__(self) -> None:
        if self.op not in EVENT_OPS:
            raise ValueError(f"Event op must be one of {EVENT_OPS}, got {self.op!r}")
        if self.end < self.start:
            raise ValueError(f"Event {self.op} ends ({self.end}) before it starts ({self.start})")

    @property
    def duration(self) -> float:
        """Seconds from start to end."""
        return self.end - self.start


class Timeline:
    """The events of one pipeline step on ``num_workers`` workers.

    ``kind`` says where the events come from: "predicted" (the simulator) or "measured"
    (an executor). ``activation_bytes`` optionally maps a stage to the bytes of
    activations one micro-batch holds there between its forward and its backward; the
    summary then reports peak activation memory.
    """

    def __init__(
        self,
        events: Iterable[Event],
        num_workers: int,
        kind: str = "predicted",
        activation_bytes: Mapping[int, int] | None = None,
    ) -> None:
        """Keeps the events sorted by start time.

        Raises:
            ValueError: for an unknown ``kind`` or an event on a worker outside
                ``0..num_workers - 1``.
        """
        if kind not in KINDS:
            raise ValueError(f"Timeline kind must be one of {KINDS}, got {kind!r}")
        self._events = tuple(sorted(events, key=lambda e: (e.start, e.worker, e.end)))
        for event in self._events:
            if not 0 <= event.worker < num_workers:
                raise ValueError(f"{event} is on a worker outside 0..{num_workers - 1}")
        self.num_workers = num_workers
        self.kind = kind
        self.activation_bytes = dict(activation_bytes or {})

    @property
    def events(self) -> tuple[Event, ...]:
        """All events, ordered by start time."""
        return self._events

    @property
    def step_time(self) -> float:
        """Seconds from the first event's start to the last event's end (0 when empty)."""
        if not self._events:
            return 0.0
        return max(e.end for e in self._events) - min(e.start for e in self._events)

    def busy_time(self, worker: int) -> float:
        """Returns the seconds ``worker`` spends in forwards and backwards."""
        return sum(e.duration for e in self._events if e.worker == worker and e.op in COMPUTE_OPS)

    @property
    def bubble_fraction(self) -> float:
        """The idle share of the workers' time: ``1 - busy / (num_workers * step_time)``,
        where busy counts forwards and backwards only (0 for an empty timeline)."""
        step = self.step_time
        if step == 0:
            return 0.0
        busy = sum(self.busy_time(w) for w in range(self.num_workers))
        return 1.0 - busy / (self.num_workers * step)

    def peak_in_flight(self) -> dict[int, int]:
        """Returns, per stage, the most micro-batches whose forward had finished and whose
        backward had not: how many micro-batches' activations the stage held at once.

        A forward-only timeline holds every micro-batch it ran, since no backward frees it.
        """
        changes: dict[int, list[tuple[float, int]]] = defaultdict(list)
        for e in self._events:
            if e.op in COMPUTE_OPS:
                # At equal times the backward's release sorts before the forward's hold.
                changes[e.stage].append((e.end, 1 if e.op == "F" else -1))
        peaks = {}
        for stage, steps in sorted(changes.items()):
            held = peak = 0
            for _, step in sorted(steps):
                held += step
                peak = max(peak, held)
            peaks[stage] = peak
        return peaks

    def to_dict(self) -> dict[str, Any]:
        """Returns the timeline as JSON-ready data: the figures of ``summary`` and every event."""
        return {
            "kind": self.kind,
            "num_workers": self.num_workers,
            "step_time": self.step_time,
            "bubble_fraction": self.bubble_fraction,
            "busy_time": [self.busy_time(w) for w in range(self.num_workers)],
            "peak_in_flight": self.peak_in_flight(),
            "activation_bytes": self.activation_bytes,
            "events": [asdict(e) for e in self._events],
        }

    def summary(self) -> str:
        """Returns a few lines of text: step time, bubble, and each worker's busy time."""
        step = self.step_time
        lines = [
            f"{self.kind} timeline: {self.num_workers} workers, {len(self._events)} events",
            f"step time {_format_seconds(step)}, bubble {self.bubble_fraction:.1%}",
        ]
        devices = {e.worker: e.device for e in self._events if e.device}
        for w in range(self.num_workers):
            busy = self.busy_time(w)
            share = busy / step if step else 0.0
            on = f" ({devices[w]})" if w in devices else ""
            lines.append(
                f"  worker {w}{on}: busy {_format_seconds(busy)} ({share:.1%} of the step)"
            )
        for stage, held in self.peak_in_flight().items():
            line = f"  stage {stage}: up to {held} micro-batches in flight"
            if stage in self.activation_bytes:
                line += f", {_format_bytes(held * self.activation_bytes[stage])} of activations"
            lines.append(line)
        return "\n".join(lines)

    def to_chrome_trace(self, path: str | Path) -> None:
        """Writes the events as Chrome trace JSON (opens in Perfetto and chrome://tracing).

        One complete ("X") event per timeline event; pid is the worker, tid 0 holds
        forwards and backwards and tid 1 sends and receives; times are microseconds from
        the step's start.
        """
        origin = min((e.start for e in self._events), default=0.0)
        trace = [
            {
                "name": f"{e.op} s{e.stage} mb{e.microbatch}",
                "cat": e.op,
                "ph": "X",
                "ts": (e.start - origin) * 1e6,
                "dur": e.duration * 1e6,
                "pid": e.worker,
                "tid": 0 if e.op in COMPUTE_OPS else 1,
                "args": {"stage": e.stage, "microbatch": e.microbatch, "device": e.device},
            }
            for e in self._events
        ]
        Path(path).write_text(json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}))

    def plot(
        self, path: str | Path, other: Timeline | None = None, title: str | None = None
    ) -> None:
        """Draws a Gantt chart, one row per worker, and writes it to ``path`` (PNG, SVG or
        any format matplotlib knows by the extension).

        Forwards and backwards get distinct colours (a darker shade for each further chunk
        a worker holds), each box shows its micro-batch, sends and receives are thin grey
        bars, and idle time stays white. With ``other``, the two timelines are drawn one
        above the other on a shared time axis (for predicted against measured).

        Raises:
            ImportError: if matplotlib is not installed (``pip install fxpipe[plot]``).
        """
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch

        timelines = [self] if other is None else [self, other]
        span = max(t.step_time for t in timelines) or 1.0
        scale, unit = _time_unit(span)
        compute = [e for t in timelines for e in t.events if e.op in COMPUTE_OPS]
        per_row = max(
            (sum(e.worker == w for e in t.events) for t in timelines for w in range(t.num_workers)),
            default=0,
        )
        # Wide enough for a readable box per action, up to a size a screen still shows.
        width = min(30.0, max(12.0, 0.3 * per_row))
        rows = sum(t.num_workers for t in timelines)
        fig, axes = plt.subplots(
            len(timelines),
            1,
            sharex=True,
            squeeze=False,
            figsize=(width, 1.2 + 0.45 * rows + 0.6 * len(timelines)),
        )
        label_size = _label_size(compute, points_per_second=width * 72 * 0.8 / span)
        multi_chunk = False
        for ax, timeline in zip(axes[:, 0], timelines):
            multi_chunk |= timeline._draw(ax, scale, label_size)
        axes[-1, 0].set_xlabel(f"time ({unit})")
        axes[-1, 0].set_xlim(0, span * scale * 1.01)
        legend = [
            Patch(color=_COLOURS["F"][0], label="forward"),
            Patch(color=_COLOURS["B"][0], label="backward"),
            Patch(facecolor=_IDLE_COLOUR, edgecolor=_IDLE_EDGE, hatch="////", linewidth=0, label="idle (bubble)"),
        ]
        if multi_chunk:
            legend += [
                Patch(color=_COLOURS["F"][1], label="forward, later chunk"),
                Patch(color=_COLOURS["B"][1], label="backward, later chunk"),
            ]
        if any(e.op not in COMPUTE_OPS for t in timelines for e in t.events):
            legend.append(Patch(color=_COMM_COLOUR, label="send / recv"))
        fig.legend(handles=legend, loc="upper right", ncol=len(legend), frameon=False)
        if title:
            fig.suptitle(title, x=0.01, ha="left")
        fig.tight_layout(rect=(0, 0, 1, 0.97))
        fig.savefig(path, dpi=120)
        plt.close(fig)

    def _title(self) -> str:
        return (
            f"{self.kind}: step {_format_seconds(self.step_time)}, "
            f"bubble {self.bubble_fraction:.1%}"
        )

    def _draw(self, ax: Any, scale: float, label_size: float | None) -> bool:
        """Draws the rows of this timeline on ``ax``; returns whether a worker holds
        several stages (so the legend explains the chunk shades)."""
        origin = min((e.start for e in self._events), default=0.0)
        stages_of: dict[int, list[int]] = defaultdict(list)
        for e in self._events:
            if e.stage not in stages_of[e.worker]:
                stages_of[e.worker].append(e.stage)
        # A stage's chunk: its rank among the stages its worker holds.
        chunk_of = {
            (w, s): k for w, stages in stages_of.items() for k, s in enumerate(sorted(stages))
        }
        devices = {e.worker: e.device for e in self._events if e.device}
        # A hatched band under each row: whatever forwards and backwards leave uncovered
        # is the worker's idle time, the pipeline bubble.
        for worker in range(self.num_workers):
            ax.barh(
                worker, self.step_time * scale, left=0, height=0.6, color=_IDLE_COLOUR,
                hatch="////", edgecolor=_IDLE_EDGE, linewidth=0, zorder=0,
            )
        for e in self._events:
            left, width = (e.start - origin) * scale, e.duration * scale
            if e.op not in COMPUTE_OPS:
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
            if label_size:
                ax.text(
                    left + width / 2,
                    e.worker,
                    str(e.microbatch),
                    ha="center",
                    va="center",
                    fontsize=label_size,
                    color="white",
                )
        ax.set_yticks(range(self.num_workers))
        ax.set_yticklabels(
            [_row_label(w, devices.get(w), stages_of[w]) for w in range(self.num_workers)]
        )
        ax.set_ylim(self.num_workers - 0.5, -0.5)
        ax.grid(axis="x", color="#dddddd", linewidth=0.6)
        ax.set_axisbelow(True)
        ax.set_title(self._title(), fontsize=10, loc="left")
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
        return any(len(stages) > 1 for stages in stages_of.values())


# Forward blues and backward oranges, one shade per chunk a worker holds.
_COLOURS = {
    "F": ("#3a78b5", "#1f4e79", "#6fa3d6", "#0f2d4a"),
    "B": ("#e07b28", "#a3520f", "#f0a868", "#6b3306"),
}
_COMM_COLOUR = "#9a9a9a"
_IDLE_COLOUR = "#f4f4f5"
_IDLE_EDGE = "#d4d4d8"


def _label_size(compute: list[Event], points_per_second: float) -> float | None:
    """One font size for every micro-batch label, the largest that fits the narrowest box;
    None when that would be unreadably small."""
    if not compute:
        return None
    narrowest = min(e.duration for e in compute) * points_per_second
    digits = max(len(str(e.microbatch)) for e in compute)
    size = min(9.0, narrowest / (0.6 * digits + 0.3))
    return size if size >= 5 else None


def _row_label(worker: int, device: str | None, stages: list[int]) -> str:
    label = f"worker {worker}"
    if device:
        label += f" ({device})"
    if len(stages) > 1:
        label += "\nstages " + ", ".join(map(str, sorted(stages)))
    return label


def _time_unit(seconds: float) -> tuple[float, str]:
    if seconds >= 1:
        return 1.0, "s"
    if seconds >= 1e-3:
        return 1e3, "ms"
    return 1e6, "µs"


def _format_seconds(seconds: float) -> str:
    scale, unit = _time_unit(seconds) if seconds else (1.0, "s")
    return f"{seconds * scale:.4g} {unit}"


def _format_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if abs(count) < 1024:
            return f"{count:.4g} {unit}"
        count /= 1024
    return f"{count:.4g} GiB"
