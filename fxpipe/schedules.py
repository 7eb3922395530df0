"""Pipeline schedules as data: one list of actions per worker, and the proof that it runs.

A schedule is a ``list[list[Action]]``: list ``w`` is what worker ``w`` executes, in
order. The generators below build GPipe, 1F1B and interleaved 1F1B; ``check_schedule``
proves that a list is complete and cannot deadlock. The simulator and both executors
interpret the same lists, and ``StageGraph`` is the one dependency rule they all share.

Plain Python over stage and micro-batch indices: nothing here imports torch.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
OPS = ("F", "B")


class ScheduleError(ValueError):
    """A schedule that cannot be built, is incomplete, or would deadlock."""


@dataclass(frozen=True)
class Action:
    """One step of one worker: the forward ("F") or backward ("B") of a stage on a micro-batch."""

    op: str
    stage: int
    microbatch: int

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ScheduleError(f"Action op must be one of {OPS}, got {self.op!r}")

    def __str__(self) -> str:
        return f"{self.op}{self.stage}:{self.microbatch}"


Schedule = list[list[Action]]


def _check_positive(**counts: int) -> None:
    for name, value in counts.items():
        if value < 1:
            raise ScheduleError(f"{name} must be at least 1, got {value}")


def _one_f_one_b_order(
    forwards: list[Action], backwards: list[Action], warmup: int
) -> list[Action]:
    """``warmup`` forwards, then one forward and one backward in turn, then the rest of the
    backwards. Holding at most ``warmup + 1`` forwards' activations is what bounds memory."""
    warmup = min(warmup, len(forwards))
    order = forwards[:warmup]
    for forward, backward in zip(forwards[warmup:], backwards):
        order += [forward, backward]
    order += backwards[len(forwards) - warmup :]
    return order


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe: every forward, then every backward, each in micro-batch order.

    Worker ``s`` runs stage ``s``. With unit-time forwards and backwards, 3 stages and
    4 micro-batches (``F2`` is the forward of micro-batch 2, ``.`` is idle)::

        tick      0   1   2   3   4   5   6   7   8   9  10  11
        worker 0  F0  F1  F2  F3  .   .   .   .   B0  B1  B2  B3
        worker 1  .   F0  F1  F2  F3  .   .   B0  B1  B2  B3  .
        worker 2  .   .   F0  F1  F2  F3  B0  B1  B2  B3  .   .

    Every stage holds the activations of all ``num_microbatches`` micro-batches at once.

    Returns:
        One action list per stage.
    Raises:
        ScheduleError: if either count is below 1.
    """
    _check_positive(num_stages=num_stages, num_microbatches=num_microbatches)
    return [
        [Action("F", s, m) for m in range(num_microbatches)]
        + [Action("B", s, m) for m in range(num_microbatches)]
        for s in range(num_stages)
    ]


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """Non-interleaved 1F1B (PipeDream-flush, Megatron-LM).

    Worker ``s`` runs stage ``s``: ``min(num_stages - s - 1, num_microbatches)`` warm-up
    forwards, then one forward and one backward in turn, then the remaining backwards.
    With unit-time forwards and backwards, 3 stages and 4 micro-batches::

        tick      0   1   2   3   4   5   6   7   8   9  10  11
        worker 0  F0  F1  F2  .   .   B0  F3  B1  .   B2  .   B3
        worker 1  .   F0  F1  .   B0  F2  B1  F3  B2  .   B3  .
        worker 2  .   .   F0  B0  F1  B1  F2  B2  F3  B3  .   .

    The step takes as long as GPipe's, but stage ``s`` never holds more than
    ``min(num_stages - s, num_microbatches)`` micro-batches' activations.

    Returns:
        One action list per stage.
    Raises:
        ScheduleError: if either count is below 1.
    """
    _check_positive(num_stages=num_stages, num_microbatches=num_microbatches)
    return [
        _one_f_one_b_order(
            [Action("F", s, m) for m in range(num_microbatches)],
            [Action("B", s, m) for m in range(num_microbatches)],
            warmup=num_stages - s - 1,
        )
        for s in range(num_stages)
    ]


def _interleaved_order(
    num_workers: int, num_microbatches: int, chunks: int
) -> list[tuple[int, int]]:
    """The (chunk, micro-batch) order in which every worker runs its forwards: micro-batches
    in groups of ``num_workers``, each group through every chunk before the next group."""
    order = []
    for first in range(0, num_microbatches, num_workers):
        group = range(first, min(first + num_workers, num_microbatches))
        order += [(chunk, m) for chunk in range(chunks) for m in group]
    return order


def interleaved_1f1b(num_workers: int, num_microbatches: int, chunks: int) -> Schedule:
    """Interleaved 1F1B (Megatron-LM's virtual pipeline stages).

    The model is cut into ``num_workers * chunks`` stages and stage ``s`` lives on worker
    ``s % num_workers``, so worker ``w`` holds stages ``w, w + p, w + 2p, ...``. Forwards
    run micro-batches in groups of ``num_workers``, each group through every chunk before
    the next group starts; backwards run the same order with the chunks reversed. Worker
    ``w`` does ``(num_workers - w - 1) + (chunks - 1) * num_workers`` warm-up forwards
    and then alternates as 1F1B does. With unit-time actions, 2 workers, 2 chunks and
    4 micro-batches (``F2:1`` is the forward of stage 2 on micro-batch 1)::

        tick  0    1    2    3    4    5    6    7    8    9    10   11   12   13   14   15   16   17
        w0    F0:0 F0:1 F2:0 F2:1 .    B2:0 F0:2 B2:1 F0:3 B0:0 F2:2 B0:1 F2:3 B2:2 .    B2:3 B0:2 B0:3
        w1    .    F1:0 F1:1 F3:0 B3:0 F3:1 B3:1 F1:2 B1:0 F1:3 B1:1 F3:2 B3:2 F3:3 B3:3 B1:2 B1:3 .

    When ``num_microbatches`` is a multiple of ``num_workers`` the step lasts
    ``2 * chunks * m + 2 * (p - 1)`` ticks: the bubble is ``chunks`` times smaller than
    1F1B's. Any other count is accepted too (the last group is smaller and a few more
    ticks idle); Megatron-LM's larger warm-up, ``2 * (p - w - 1) + (chunks - 1) * p``,
    deadlocks on some of those counts, which this one does not. With ``chunks=1`` the
    result equals ``one_f_one_b(num_workers, num_microbatches)``.

    Returns:
        One action list per worker, already proven complete and deadlock-free by
        ``check_schedule``.
    Raises:
        ScheduleError: if a count is below 1.
    """
    _check_positive(num_workers=num_workers, num_microbatches=num_microbatches, chunks=chunks)
    p = num_workers
    order = _interleaved_order(p, num_microbatches, chunks)
    schedule = []
    for w in range(p):
        forwards = [Action("F", c * p + w, m) for c, m in order]
        backwards = [Action("B", (chunks - 1 - c) * p + w, m) for c, m in order]
        schedule.append(_one_f_one_b_order(forwards, backwards, (p - w - 1) + (chunks - 1) * p))
    # The warm-up rule for counts that are not multiples of p is verified, not derived:
    # every schedule handed out has passed the checker.
    check_schedule(schedule, p * chunks, num_microbatches)
    return schedule


class StageGraph:
    """Which stages feed which: the dependency rule every interpreter of a schedule obeys.

    ``F(s, m)`` needs ``F(p, m)`` for every producer ``p`` of ``s``; ``B(s, m)`` needs
    ``F(s, m)`` and ``B(c, m)`` for every consumer ``c`` of ``s`` (a stage without
    consumers, like the last, needs only its own forward).
    """

    def __init__(self, num_stages: int, deps: Iterable[tuple[int, int]] | None = None) -> None:
        """``deps``: (producer_stage, consumer_stage) pairs; default the chain (s - 1, s).

        Raises:
            ScheduleError: if ``num_stages`` is below 1 or a pair names a stage out of range
                or a stage feeding itself.
        """
        _check_positive(num_stages=num_stages)
        if deps is None:
            deps = [(s - 1, s) for s in range(1, num_stages)]
        self.num_stages = num_stages
        self.producers: list[list[int]] = [[] for _ in range(num_stages)]
        self.consumers: list[list[int]] = [[] for _ in range(num_stages)]
        for producer, consumer in sorted(set(deps)):
            if not (0 <= producer < num_stages and 0 <= consumer < num_stages):
                raise ScheduleError(
                    f"dependency ({producer}, {consumer}) names a stage outside 0..{num_stages - 1}"
                )
            if producer == consumer:
                raise ScheduleError(
                    f"dependency ({producer}, {consumer}): a stage cannot feed itself"
                )
            self.producers[consumer].append(producer)
            self.consumers[producer].append(consumer)

    def prerequisites(self, action: Action) -> list[Action]:
        """Returns the actions that must finish before ``action`` may start.

        Raises:
            ScheduleError: if ``action`` names a stage outside the graph.
        """
        if not 0 <= action.stage < self.num_stages:
            raise ScheduleError(f"{action} names a stage outside 0..{self.num_stages - 1}")
        m = action.microbatch
        if action.op == "F":
            return [Action("F", p, m) for p in self.producers[action.stage]]
        return [Action("F", action.stage, m)] + [
            Action("B", c, m) for c in self.consumers[action.stage]
        ]


def execution_order(
    actions: Sequence[Sequence[Action]], graph: StageGraph
) -> Iterator[tuple[int, Action]]:
    """Runs every worker's list in order, each action once its prerequisites are done.

    Yields:
        (worker, action) pairs in an order that respects both each worker's list and every
        prerequisite, so a consumer can compute start times as it goes.
    Raises:
        ScheduleError: when no worker can move, listing each stuck worker's next action and
            the action it waits for.
    """
    position = [0] * len(actions)
    done: set[Action] = set()
    waiting: dict[Action, list[int]] = defaultdict(list)
    runnable = deque(range(len(actions)))
    while runnable:
        worker = runnable.popleft()
        todo = actions[worker]
        while position[worker] < len(todo):
            action = todo[position[worker]]
            missing = next((d for d in graph.prerequisites(action) if d not in done), None)
            if missing is not None:
                waiting[missing].append(worker)
                break
            done.add(action)
            position[worker] += 1
            yield worker, action
            runnable.extend(waiting.pop(action, ()))
    stuck = [w for w, todo in enumerate(actions) if position[w] < len(todo)]
    if stuck:
        raise ScheduleError(_deadlock_report(actions, graph, position, done, stuck))


def _deadlock_report(
    actions: Sequence[Sequence[Action]],
    graph: StageGraph,
    position: list[int],
    done: set[Action],
    stuck: list[int],
) -> str:
    where = {a: (w, i) for w, todo in enumerate(actions) for i, a in enumerate(todo)}
    lines = []
    for w in stuck:
        action = actions[w][position[w]]
        for need in graph.prerequisites(action):
            if need in done:
                continue
            if need not in where:
                reason = "which no worker runs"
            elif where[need][0] == w:
                reason = f"which comes later in the same list, at position {where[need][1]}"
            elif where[need][1] == position[where[need][0]]:
                reason = f"the next action of worker {where[need][0]}, itself waiting"
            else:
                owner, index = where[need]
                reason = (
                    f"at position {index} of worker {owner}, "
                    f"queued behind {actions[owner][position[owner]]}"
                )
            lines.append(
                f"  worker {w}, position {position[w]}: {action} waits for {need}, {reason}"
            )
    return "schedule deadlocks; no worker can move:\n" + "\n".join(lines)


def check_schedule(
    actions: Sequence[Sequence[Action]],
    num_stages: int,
    num_microbatches: int,
    deps: Iterable[tuple[int, int]] | None = None,
    forward_only: bool = False,
) -> None:
    """Proves that a schedule is complete and cannot deadlock.

    Complete: every ``F(s, m)`` and, unless ``forward_only``, every ``B(s, m)`` for
    ``s < num_stages`` and ``m < num_microbatches`` appears exactly once, and all the
    actions of one stage are on one worker. Deadlock-free: running each worker's list in
    order, an action only once its ``StageGraph`` prerequisites are done, finishes every
    list. ``deps`` are (producer_stage, consumer_stage) pairs, by default the chain.

    Returns:
        None; a schedule that returns is safe to execute.
    Raises:
        ScheduleError: naming the missing, duplicated, out-of-range or misplaced actions,
            or, on deadlock, each stuck worker's next action and what it waits for.
    """
    graph = StageGraph(num_stages, deps)
    _check_positive(num_microbatches=num_microbatches)
    ops = ("F",) if forward_only else OPS
    expected = {
        Action(op, s, m) for op in ops for s in range(num_stages) for m in range(num_microbatches)
    }
    problems = []
    seen: set[Action] = set()
    worker_of_stage: dict[int, int] = {}
    for worker, todo in enumerate(actions):
        for action in todo:
            if action not in expected:
                problems.append(
                    f"worker {worker} runs {action}, which is not part of a "
                    f"{'forward-only ' if forward_only else ''}schedule of "
                    f"{num_stages} stages and {num_microbatches} micro-batches"
                )
            elif action in seen:
                problems.append(f"worker {worker} runs {action} a second time")
            seen.add(action)
            owner = worker_of_stage.setdefault(action.stage, worker)
            if owner != worker:
                problems.append(
                    f"worker {worker} runs {action}, but stage {action.stage} "
                    f"already runs on worker {owner}"
                )
    missing = sorted(expected - seen, key=lambda a: (a.op, a.stage, a.microbatch))
    if missing:
        shown = ", ".join(map(str, missing[:10]))
        more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        problems.append(f"no worker runs {shown}{more}")
    if problems:
        raise ScheduleError("invalid schedule:\n" + "\n".join(f"  {p}" for p in problems))
    for _ in execution_order(actions, graph):
        pass


def _check_chunks(num_stages: int, chunks: int) -> None:
    _check_positive(num_stages=num_stages, chunks=chunks)
    if num_stages % chunks:
        raise ScheduleError(
            f"{num_stages} stages cannot be spread evenly over workers holding {chunks} "
            f"chunks each; use a number of stages divisible by chunks={chunks}"
        )


def worker_of(stage: int, num_stages: int, chunks: int = 1) -> int:
    """Returns the worker that runs ``stage``: ``stage % (num_stages // chunks)``.

    Raises:
        ScheduleError: if ``num_stages`` is not a positive multiple of ``chunks`` or
            ``stage`` is out of range.
    """
    _check_chunks(num_stages, chunks)
    if not 0 <= stage < num_stages:
        raise ScheduleError(f"stage {stage} is outside 0..{num_stages - 1}")
    return stage % (num_stages // chunks)


def make_schedule(name: str, num_stages: int, num_microbatches: int, chunks: int = 1) -> Schedule:
    """Builds the schedule called ``name`` (one of ``SCHEDULES``).

    ``num_stages`` counts all stages; under "interleaved-1f1b" they are spread over
    ``num_stages // chunks`` workers, otherwise each stage has its own worker.

    Returns:
        One action list per worker.
    Raises:
        ScheduleError: for an unknown name, ``chunks != 1`` with "gpipe" or "1f1b",
            ``num_stages`` not divisible by ``chunks``, or a count below 1.
    """
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    if name == "interleaved-1f1b":
        _check_chunks(num_stages, chunks)
        return interleaved_1f1b(num_stages // chunks, num_microbatches, chunks)
    if chunks != 1:
        raise ScheduleError(
            f"schedule {name!r} runs one stage per worker, got chunks={chunks}; "
            f"use chunks=1, or schedule 'interleaved-1f1b' for several stages per worker"
        )
    return (
        gpipe(num_stages, num_microbatches)
        if name == "gpipe"
        else one_f_one_b(num_stages, num_microbatches)
    )


def forward_only(actions: Sequence[Sequence[Action]]) -> Schedule:
    """Returns the schedule without its backwards: what inference runs, in the same order."""
    return [[a for a in todo if a.op == "F"] for todo in actions]
