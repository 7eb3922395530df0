"""Predicts the timeline of a schedule from per-action costs, without running anything.

Each worker runs its action list in order; an action starts when its worker is free and
every prerequisite (``execution_order``, the rule ``check_schedule`` proves against) has
finished and, when it ran on another worker, has been communicated. Plain Python.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from fxpipe.inspection.timeline import Event, Timeline
from fxpipe.schedules import Action, StageGraph, execution_order

StageCost = float | Callable[[int, int], float]
EdgeCost = float | Callable[[int, int, int], float]


def _as_callable(cost: float | Callable[..., float]) -> Callable[..., float]:
    if callable(cost):
        return cost
    constant = float(cost)
    return lambda *_: constant


def _half(cost: StageCost) -> Callable[[int, int], float]:
    whole = _as_callable(cost)
    return lambda stage, microbatch: whole(stage, microbatch) / 2


def simulate(
    actions: Sequence[Sequence[Action]],
    num_stages: int,
    forward_time: StageCost,
    backward_time: StageCost,
    comm_time: EdgeCost = 0.0,
    deps: Iterable[tuple[int, int]] | None = None,
    microbatch_overhead: float = 0.0,
    kind: str = "predicted",
    input_time: StageCost | None = None,
    weight_time: StageCost | None = None,
) -> Timeline:
    """Plays a schedule on an ideal clock and returns its timeline.

    Args:
        actions: one action list per worker, as ``make_schedule`` returns.
        num_stages: number of stages the actions refer to.
        forward_time, backward_time: seconds per "F" and per "B" action, a constant or a
            function of (stage, microbatch).
        comm_time: seconds between a producer finishing and a consumer on another worker
            being able to start, a constant or a function of (src_stage, dst_stage,
            microbatch). It applies to forward edges (activations, producer to consumer)
            and backward edges (gradients, from the consumer's "B" or "I" to the
            producer); stages on the same worker pay nothing, and "W" sends nothing.
        deps: (producer_stage, consumer_stage) pairs; default the chain (s - 1, s).
        microbatch_overhead: fixed seconds added to every action (launch, bookkeeping).
        kind: the ``Timeline`` kind to stamp on the result.
        input_time, weight_time: seconds per "I" and per "W" action, as ``forward_time``.
            Each defaults to half of ``backward_time``: a linear layer's backward is two
            matrix products of one size, one for the input gradient, one for the weight's.

    Returns:
        A ``Timeline`` with one event per action, of the action's op, starting at time 0.
    Raises:
        ScheduleError: if the schedule deadlocks or waits for an action no worker runs.
        ValueError: if a cost is negative.
    """
    durations = {
        "F": _as_callable(forward_time),
        "B": _as_callable(backward_time),
        "I": _as_callable(input_time) if input_time is not None else _half(backward_time),
        "W": _as_callable(weight_time) if weight_time is not None else _half(backward_time),
    }
    comm = _as_callable(comm_time)
    free_at = [0.0] * len(actions)
    finished: dict[Action, tuple[int, float]] = {}
    events = []
    deps = list(deps) if deps is not None else None
    for worker, action, needs in execution_order(actions, StageGraph(num_stages, deps)):
        start = free_at[worker]
        for need in needs:
            need_worker, need_end = finished[need]
            if need_worker != worker:
                need_end += _non_negative(
                    comm(need.stage, action.stage, action.microbatch), "comm_time", action
                )
            start = max(start, need_end)
        duration = durations[action.op](action.stage, action.microbatch)
        end = start + _non_negative(duration, f"{action.op} time", action) + microbatch_overhead
        finished[action] = (worker, end)
        free_at[worker] = end
        events.append(Event(worker, action.stage, action.microbatch, action.op, start, end))
    return Timeline(events, num_workers=len(actions), kind=kind, deps=deps)


def _non_negative(seconds: float, what: str, action: Action) -> float:
    if seconds < 0:
        raise ValueError(f"{what} for {action} is negative ({seconds} s)")
    return seconds
