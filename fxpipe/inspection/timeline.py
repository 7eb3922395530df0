"""``Timeline``: what each worker did during one step, predicted or measured.

The simulator builds predicted timelines and the executors record measured ones; both
are lists of ``Event``. A timeline answers the questions asked of a pipeline step (how
long, how idle, how many activations held) and draws itself as a Gantt chart or a Chrome
trace. matplotlib loads only inside ``plot``.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fxpipe.inspection import format as fmt
from fxpipe.inspection.gantt import plot_timelines
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
    summary then reports peak activation memory. ``ranks`` gives each worker's process
    rank when the events were gathered under torchrun (rows and trace processes are then
    named by rank). ``deps`` lists the (producer, consumer) stage pairs that exchange
    values, default each stage with the next: the Chrome trace draws their messages.
    """

    def __init__(
        self,
        events: Iterable[Event],
        num_workers: int,
        kind: str = "predicted",
        activation_bytes: Mapping[int, int] | None = None,
        ranks: Sequence[int] | None = None,
        deps: Iterable[tuple[int, int]] | None = None,
    ) -> None:
        """Keeps the events sorted by start time.

        Raises:
            ValueError: for an unknown ``kind``, an event on a worker outside
                ``0..num_workers - 1``, or ``ranks`` not naming one rank per worker.
        """
        if kind not in KINDS:
            raise ValueError(f"Timeline kind must be one of {KINDS}, got {kind!r}")
        self._events = tuple(sorted(events, key=lambda e: (e.start, e.worker, e.end)))
        for event in self._events:
            if not 0 <= event.worker < num_workers:
                raise ValueError(f"{event} is on a worker outside 0..{num_workers - 1}")
        if ranks is not None and len(ranks) != num_workers:
            raise ValueError(f"Timeline ranks must name one rank per worker ({num_workers}), got {list(ranks)}")
        self.num_workers = num_workers
        self.kind = kind
        self.activation_bytes = dict(activation_bytes or {})
        self.ranks = list(ranks) if ranks is not None else None
        stages = sorted({e.stage for e in self._events})
        self.deps = sorted(set(deps)) if deps is not None else [(s - 1, s) for s in stages if s - 1 in stages]

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
            "ranks": self.ranks,
            "deps": self.deps,
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
            lines.append(f"  {self.worker_name(w)}{on}: busy {fmt.seconds(busy)} ({parts})")
        for stage, held in self.peak_in_flight().items():
            line = f"  stage {stage}: up to {held} micro-batches in flight"
            if stage in self.activation_bytes:
                line += f", {fmt.nbytes(held * self.activation_bytes[stage])} of activations"
            lines.append(line)
        return "\n".join(lines)

    def worker_name(self, worker: int) -> str:
        """``rank 3`` when the timeline was gathered under torchrun, else ``worker 3``."""
        return f"rank {self.ranks[worker]}" if self.ranks is not None else f"worker {worker}"

    def stages_of(self, worker: int) -> list[int]:
        """The stages ``worker`` ran during the step, in order."""
        return sorted({e.stage for e in self._events if e.worker == worker})

    def process_name(self, worker: int) -> str:
        """What the worker is, in one line: ``rank 1: stage 1, cpu`` (``stages 1, 3`` when it
        holds several)."""
        stages = self.stages_of(worker)
        name = self.worker_name(worker)
        if stages:
            name += f": stage{'s' if len(stages) > 1 else ''} {', '.join(map(str, stages))}"
        device = next((e.device for e in self._events if e.worker == worker and e.device), "")
        return f"{name}, {device}" if device else name

    def messages(self) -> list[tuple[str, Event, Event]]:
        """The values that crossed workers, as (kind, sending action, receiving action):
        each forward's activation to the consumer stage's forward, each backward's (or
        input-gradient's) gradient back to the producer stage's, for every pair in ``deps``
        whose stages ran on different workers."""
        action = {(e.op, e.stage, e.microbatch): e for e in self._events if e.op in WORK_OPS}

        def gradient(stage: int, microbatch: int) -> Event | None:
            return action.get(("B", stage, microbatch)) or action.get(("I", stage, microbatch))

        found = []
        for src, dst in self.deps:
            for produced in (e for e in self._events if e.op == "F" and e.stage == src):
                consumed = action.get(("F", dst, produced.microbatch))
                if consumed is None or consumed.worker == produced.worker:
                    continue
                found.append(("activation", produced, consumed))
                back, front = gradient(dst, produced.microbatch), gradient(src, produced.microbatch)
                if back is not None and front is not None:
                    found.append(("gradient", back, front))
        return found

    def to_chrome_trace(self, path: str | Path) -> None:
        """Writes the events as Chrome trace JSON (opens in Perfetto and chrome://tracing).

        One process per worker, named for what it is (``rank 1: stage 1, cpu``); in it,
        thread 0 holds the actions (F, B, I, W) and thread 1 the sends and receives, one
        complete ("X") event each; an arrow (a flow event) runs from each action that sends
        a value to another worker to the action that receives it. Times are microseconds
        from the step's start.
        """
        origin = min((e.start for e in self._events), default=0.0)
        micros = lambda t: (t - origin) * 1e6  # noqa: E731
        trace: list[dict[str, Any]] = []
        for w in range(self.num_workers):
            trace += [
                {"name": "process_name", "ph": "M", "pid": w, "args": {"name": self.process_name(w)}},
                {"name": "process_sort_index", "ph": "M", "pid": w, "args": {"sort_index": w}},
                {"name": "thread_name", "ph": "M", "pid": w, "tid": 0, "args": {"name": "actions"}},
                {"name": "thread_name", "ph": "M", "pid": w, "tid": 1, "args": {"name": "send / recv"}},
            ]
        trace += [
            {
                "name": f"{e.op} s{e.stage} mb{e.microbatch}",
                "cat": e.op,
                "ph": "X",
                "ts": micros(e.start),
                "dur": e.duration * 1e6,
                "pid": e.worker,
                "tid": 0 if e.op in WORK_OPS else 1,
                "args": {"stage": e.stage, "microbatch": e.microbatch, "device": e.device},
            }
            for e in self._events
        ]
        for k, (kind, sender, receiver) in enumerate(self.messages()):
            name = f"{kind} s{sender.stage}→s{receiver.stage} mb{sender.microbatch}"
            # a flow's ends bind to the slices enclosing them: put each just inside its action
            start = micros(sender.end) - _inside(sender)
            end = micros(receiver.start) + _inside(receiver)
            trace.append({"name": name, "cat": kind, "ph": "s", "id": k, "pid": sender.worker, "tid": 0, "ts": start})
            trace.append({"name": name, "cat": kind, "ph": "f", "bp": "e", "id": k, "pid": receiver.worker, "tid": 0, "ts": end})
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
        plot_timelines([self] if other is None else [self, other], path, title)

    def title(self) -> str:
        """One line: the kind, step time and bubble (the chart title)."""
        return (
            f"{self.kind}: step {fmt.seconds(self.step_time)}, "
            f"bubble {self.bubble_fraction:.1%}"
        )


def _inside(event: Event) -> float:
    """Microseconds from an action's edge to a point certainly inside it."""
    return min(0.5, event.duration * 1e6 / 2)
