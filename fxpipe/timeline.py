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

from fxpipe import format as fmt
from fxpipe.schedules import OPS

KINDS = ("predicted", "measured")
# a worker's own work: forward, backward, and the backward split into input and weight parts
WORK_OPS = OPS
EVENT_OPS = (*WORK_OPS, "send", "recv")


@dataclass(frozen=True)
class Event:
    """One interval of one worker's time: an action ("F", "B", "I" or "W"), a send or a recv.

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
        """Returns the seconds ``worker`` spends in its actions (F, B, I and W)."""
        return sum(e.duration for e in self._events if e.worker == worker and e.op in WORK_OPS)

    @property
    def bubble_fraction(self) -> float:
        """The idle share of the workers' time: ``1 - busy / (num_workers * step_time)``,
        where busy counts actions (F, B, I, W), not sends and receives (0 for an empty
        timeline)."""
        step = self.step_time
        if step == 0:
            return 0.0
        busy = sum(self.busy_time(w) for w in range(self.num_workers))
        return 1.0 - busy / (self.num_workers * step)

    def peak_in_flight(self, per: str = "stage") -> dict[int, int]:
        """Returns, per stage (or per worker with ``per="worker"``, its stages together), the
        most micro-batches held at once: a forward's activations count from its end until
        the end of its backward "B" or, when the backward is split, of its "W". Between
        "I" and "W" only what the W needs is really kept; it is counted whole.

        A forward-only timeline holds every micro-batch it ran, since no backward frees it.

        Raises:
            ValueError: if ``per`` is neither "stage" nor "worker".
        """
        if per not in ("stage", "worker"):
            raise ValueError(f"peak_in_flight per must be 'stage' or 'worker', got {per!r}")
        changes: dict[int, list[tuple[float, int]]] = defaultdict(list)
        for e in self._events:
            key = e.stage if per == "stage" else e.worker
            if e.op == "F":
                changes[key].append((e.end, 1))
            elif e.op in ("B", "W"):
                # At equal times the release sorts before the forward's hold.
                changes[key].append((e.end, -1))
        peaks = {}
        for key, steps in sorted(changes.items()):
            held = peak = 0
            for _, step in sorted(steps):
                held += step
                peak = max(peak, held)
            peaks[key] = peak
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
            "peak_in_flight_per_worker": self.peak_in_flight("worker"),
            "activation_bytes": self.activation_bytes,
            "events": [asdict(e) for e in self._events],
        }

    def summary(self) -> str:
        """Returns a few lines of text: step time, bubble, and each worker's busy time."""
        step = self.step_time
        lines = [
            f"{self.kind} timeline: {self.num_workers} workers, {len(self._events)} events",
            f"step time {fmt.seconds(step)}, bubble {self.bubble_fraction:.1%}",
        ]
        devices = {e.worker: e.device for e in self._events if e.device}
        split = any(e.op in ("I", "W") for e in self._events)
        for w in range(self.num_workers):
            busy = self.busy_time(w)
            share = busy / step if step else 0.0
            on = f" ({devices[w]})" if w in devices else ""
            parts = f"{share:.1%} of the step"
            if split:  # how much of the work is the W's that fill the bubbles
                per_op = {op: sum(e.duration for e in self._events if e.worker == w and e.op == op) for op in WORK_OPS}
                parts = ", ".join(f"{op} {fmt.seconds(t)}" for op, t in per_op.items() if t) + "; " + parts
            lines.append(f"  worker {w}{on}: busy {fmt.seconds(busy)} ({parts})")
        for stage, held in self.peak_in_flight().items():
            line = f"  stage {stage}: up to {held} micro-batches in flight"
            if stage in self.activation_bytes:
                line += f", {fmt.nbytes(held * self.activation_bytes[stage])} of activations"
            lines.append(line)
        return "\n".join(lines)

    def to_chrome_trace(self, path: str | Path) -> None:
        """Writes the events as Chrome trace JSON (opens in Perfetto and chrome://tracing).

        One complete ("X") event per timeline event; pid is the worker, tid 0 holds its
        actions (F, B, I, W) and tid 1 sends and receives; times are microseconds from the
        step's start.
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
                "tid": 0 if e.op in WORK_OPS else 1,
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

        Forwards, backwards and the split backward's "I" and "W" get distinct colours (a
        darker shade for each further chunk a worker holds), each box shows its micro-batch, sends and receives are thin grey
        bars, and idle time stays white. With ``other``, the two timelines are drawn one
        above the other on a shared time axis (for predicted against measured).

        Raises:
            ImportError: if matplotlib is not installed (``pip install fxpipe[plot]``).
        """
        from fxpipe.drawing.gantt import plot_timelines

        plot_timelines([self] if other is None else [self, other], path, title)

    def title(self) -> str:
        """One line: the kind, step time and bubble (the chart title)."""
        return (
            f"{self.kind}: step {fmt.seconds(self.step_time)}, "
            f"bubble {self.bubble_fraction:.1%}"
        )
