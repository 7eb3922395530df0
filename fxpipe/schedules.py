"""Pipeline schedules as data: one list of actions per worker, and the proof that it runs.

A schedule is a ``list[list[Action]]``: list ``w`` is what worker ``w`` executes, in
order. The generators below build GPipe, 1F1B, interleaved 1F1B, the zero-bubble
schedules ZB-H1 and ZB-V, the memory-controlled V-Half and V-Min, and DeepSeek's DualPipeV;
a user may write their own (``resolve_schedule`` accepts a name,
lists of actions or a function returning them). ``check_schedule`` proves that a list is
complete and cannot deadlock. The simulator and both executors interpret the same lists;
``StageGraph`` and ``execution_order`` are the one dependency rule they all share, and the
schedule itself says which worker runs which stage (``stage_workers``). V-Half and V-Min
trade step time for activation memory (``v_half``, ``v_min``).

Plain Python over stage and micro-batch indices: nothing here imports torch.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "v-half", "v-min", "dualpipev")
# the schedules that run two stages per worker in a V (chunks=2)
V_SCHEDULES = ("zb-v", "v-half", "v-min", "dualpipev")
OPS = ("F", "B", "I", "W")


class ScheduleError(ValueError):
    """A schedule that cannot be built, is incomplete, or would deadlock."""


@dataclass(frozen=True)
class Action:
    """One step of one worker: an op of one stage on one micro-batch.

    ``op`` is "F" (forward), "B" (backward: input and weight gradients at once), "I" (the
    gradients of the stage's inputs only, which the stages before it wait for) or "W" (the
    weight gradients an "I" left, run later on the same worker). A stage's backward of a
    micro-batch runs either as one "B" or as an "I" and, after it, a "W".
    """

    op: str
    stage: int
    microbatch: int

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ScheduleError(f"Action op must be one of {OPS}, got {self.op!r}")
        # the exact-int test first: generators and checkers make many thousands of actions
        if type(self.stage) is int and type(self.microbatch) is int and self.stage >= 0 and self.microbatch >= 0:
            return
        for name in ("stage", "microbatch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ScheduleError(f"Action {name} must be an int >= 0, got {value!r}")

    def __str__(self) -> str:
        return f"{self.op}{self.stage}:{self.microbatch}"


Schedule = list[list[Action]]
# What Plan.schedule holds: a name, a schedule as data, or a function of (stages, micro-batches).
ScheduleSpec = str | Sequence[Sequence[Action]] | Callable[[int, int], Sequence[Sequence[Action]]]


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


def zb_h1(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): 1F1B with each
    backward split into "I" and "W", the W's moved into what would be bubbles.

    Worker ``w`` runs stage ``w`` in 1F1B's order, "I" in place of "B":
    ``min(p - w - 1, m)`` warm-up forwards, then one forward and one "I" in turn, then the
    remaining "I"s. The "W" of each micro-batch follows the "I" of the micro-batch ``w``
    later (the rest close the list), so the deferred W's fill the cool-down, where 1F1B
    waits for gradients. With unit-time F, I and W, 3 stages and 5 micro-batches::

        tick      0  1  2  3  4  5  6  7  8  9  10 11 12 13 14 15 16
        worker 0  F0 F1 F2 .  .  I0 W0 F3 I1 W1 F4 I2 W2 I3 W3 I4 W4
        worker 1  .  F0 F1 .  I0 F2 I1 W0 F3 I2 W1 F4 I3 W2 I4 W3 W4
        worker 2  .  .  F0 I0 F1 I1 F2 I2 W0 F3 I3 W1 F4 I4 W2 W3 W4

    For ``m >= p`` the step lasts ``3m + p - 1`` ticks, the least possible (the last worker
    cannot start before tick ``p - 1``): each worker idles ``p - 1`` ticks, a third of
    1F1B's ``3(p - 1)`` with the same costs (B = I + W), and the bubble is
    ``(p - 1) / (3m + p - 1)`` against 1F1B's ``3(p - 1) / (3m + 3(p - 1))``.

    Memory: a micro-batch's activations are held from its F until its W (after the "I"
    only what the W needs is kept; it is counted whole). Worker ``w`` holds at most
    ``min(p, m)`` micro-batches: 1F1B's peak, which 1F1B reaches on worker 0. Holding every
    worker to its own 1F1B count ``min(p - w, m)`` would leave no room to defer a W on the
    last worker and keep two thirds of 1F1B's bubble.

    Returns:
        One action list per stage.
    Raises:
        ScheduleError: if either count is below 1.
    """
    _check_positive(num_stages=num_stages, num_microbatches=num_microbatches)
    p, m = num_stages, num_microbatches
    schedule = []
    for w in range(p):
        order = _one_f_one_b_order(
            [Action("F", w, i) for i in range(m)],
            [Action("I", w, i) for i in range(m)],
            warmup=p - w - 1,
        )
        delayed = []
        for action in order:
            delayed.append(action)
            if action.op == "I" and action.microbatch >= w:
                delayed.append(Action("W", w, action.microbatch - w))
        schedule.append(delayed + [Action("W", w, i) for i in range(max(m - w, 0), m)])
    return schedule


def zb_v(num_workers: int, num_microbatches: int) -> Schedule:
    """ZB-V (Qi et al., section 6): two stages per worker in a V, each backward split into
    "I" and "W".

    The model is cut into ``2p`` stages and worker ``w`` runs stage ``w`` on the way down and
    stage ``2p - 1 - w`` on the way back: worker 0 holds the first and the last stage, and
    the turn of the V (stages ``p - 1`` and ``p``) stays on worker ``p - 1``. The order is
    list scheduling on a unit clock: at every tick each worker runs the first of these
    whose prerequisites are done:

    1. the forward of its later stage, else of its earlier one, while the worker holds
       fewer than ``2p`` stage activations (a stage's micro-batch counts one until its W);
    2. the "I" of its earlier stage, else of its later one;
    3. its oldest deferred "W".

    With unit-time F, I and W, 2 workers (4 stages) and 4 micro-batches (``F2`` is a
    forward of micro-batch 2 of the worker's earlier stage, ``f2`` of its later stage)::

        tick      0  1  2  3  4  5  6  7  8  9  10 11 12 13 14 15 16 17 18 19 20 21 22 23 24
        worker 0  F0 F1 F2 f0 i0 w0 f1 I0 i1 W0 F3 I1 w1 f2 i2 W1 w2 I2 W2 f3 i3 w3 .  I3 W3
        worker 1  .  F0 f0 F1 f1 i0 I0 w0 F2 i1 I1 W0 f2 w1 F3 i2 I2 W1 f3 w2 W2 i3 I3 w3 W3

    For ``m >= 2p`` the step lasts ``6m + p - 1`` ticks, the least possible (worker
    ``p - 1`` starts at tick ``p - 1`` with ``6m`` ticks of work; the tests check every
    ``p <= 16``, ``m <= 64``): each worker idles ``p - 1`` ticks, a sixth of what 1F1B
    idles on the same workers (a worker's two stages as one 1F1B stage, F = 2 and B = 4
    ticks), a bubble of ``(p - 1) / (6m + p - 1)``. Any ``m >= 1`` is accepted.

    Memory: each worker holds at most ``2p`` stage activations (its two stages together,
    held from F until W): when its two stages are the halves of one 1F1B stage, ``p``
    micro-batches' worth, 1F1B's peak (its worker 0's).

    Returns:
        One action list per worker, already proven complete and deadlock-free by
        ``check_schedule``.
    Raises:
        ScheduleError: if a count is below 1.
    """
    _check_positive(num_workers=num_workers, num_microbatches=num_microbatches)
    p, m = num_workers, num_microbatches
    stages = 2 * p
    graph = StageGraph(stages)
    split = {(s, i) for s in range(stages) for i in range(m)}
    finished: set[Action] = set()
    next_forward = [0] * stages
    next_input = [0] * stages
    deferred: list[deque[Action]] = [deque() for _ in range(p)]
    held = [0] * p
    schedule: Schedule = [[] for _ in range(p)]

    def ready(op: str, stage: int, counter: list[int]) -> Action | None:
        if counter[stage] == m:
            return None
        action = Action(op, stage, counter[stage])
        return action if all(need in finished for need in graph.prerequisites(action, split)) else None

    def pick(w: int) -> Action | None:
        earlier, later = w, stages - 1 - w
        if held[w] < stages:
            forward = ready("F", later, next_forward) or ready("F", earlier, next_forward)
            if forward:
                return forward
        backward = ready("I", earlier, next_input) or ready("I", later, next_input)
        return backward or (deferred[w][0] if deferred[w] else None)

    remaining = 3 * stages * m
    while remaining:
        # every worker picks from the same state: actions picked at one tick end at the next
        picked = [(w, action) for w in range(p) if (action := pick(w)) is not None]
        if not picked:  # a guard against looping forever; the tests show it never happens
            raise ScheduleError(f"zb-v found no runnable action with {p} workers and {m} micro-batches")
        for w, action in picked:
            schedule[w].append(action)
            finished.add(action)
            if action.op == "F":
                next_forward[action.stage] += 1
                held[w] += 1
            elif action.op == "I":
                next_input[action.stage] += 1
                deferred[w].append(Action("W", action.stage, action.microbatch))
            else:
                deferred[w].popleft()
                held[w] -= 1
        remaining -= len(picked)
    check_schedule(schedule, stages, m)
    return schedule


def dualpipe_v(num_workers: int, num_microbatches: int) -> Schedule:
    """DualPipeV (DeepSeek-AI's "cut-in-half" DualPipe, as in torch.distributed.pipelining's
    ``ScheduleDualPipeV``): ZB-V's placement, with the steady state run as forward/backward
    pairs.

    The model is cut into ``2p`` stages in a V: worker ``w`` runs stage ``w`` on the way
    down and stage ``2p - 1 - w`` on the way back (its "earlier" and "later" stage). With
    ``q = p - 1 - w`` (how far the worker is from the turn of the V), worker ``w`` runs, in
    order:

    1. ``2q`` forwards of its earlier stage;
    2. ``w + 1`` times: a forward of the earlier stage, then one of the later stage;
    3. ``q`` times: an "I" of the later stage, the oldest deferred "W", a forward of the
       later stage (zero-bubble warm-up);
    4. ``m - 2p + w + 1`` times, the steady state: the pair (forward of the earlier stage,
       whole backward "B" of the later stage), then the pair (forward of the later stage,
       "B" of the earlier stage). DeepSeek runs each pair's two halves overlapped (the
       communication of one hides behind the computation of the other); here a pair is
       two adjacent actions of one list;
    5. ``q`` times: a "B" of the later stage, then the pair (forward of the later stage,
       "B" of the earlier stage);
    6. ``w + 1`` times: a backward of the later stage, then one of the earlier stage; the
       first ``w + 1`` of these as whole "B"s, the last ``w + 1`` as "I"s whose "W" is
       deferred;
    7. ``q`` times: the oldest deferred "W", then an "I" of the earlier stage;
    8. the ``w + 1`` deferred "W"s left.

    With unit-time F, I and W, a "B" two ticks (``~~`` its second), 2 workers (4 stages)
    and 4 micro-batches (upper case: the worker's earlier stage, lower case: its later
    one)::

        tick      0  1  2  3  4  5  6  7  8  9  10 11 12 13 14 15 16 17 18 19 20 21 22 23 24
        worker 0  F0 F1 F2 f0 i0 w0 f1 F3 b1 ~~ f2 B0 ~~ b2 ~~ f3 .  B1 ~~ b3 ~~ I2 W2 I3 W3
        worker 1  .  F0 f0 F1 f1 F2 b0 ~~ f2 B0 ~~ F3 b1 ~~ f3 B1 ~~ b2 ~~ B2 ~~ i3 I3 w3 W3

    The steady state runs whole backwards: one action where ZB-V runs an "I" and a "W".
    Run one action at a time with unit costs, the step lasts ``6m + p - 1``
    ticks, ZB-V's and the least possible (the tests check every ``p <= 16``,
    ``2p <= m <= 64``); the warm-up's and the tail's "W"s fill what would be bubbles.

    Memory: each worker holds at most ``2p + 1`` stage activations (each from its F until
    its B or W), one more than ZB-V's ``2p``: in each pair the forward runs before the
    backward that frees a micro-batch.

    Returns:
        One action list per worker, already proven complete and deadlock-free by
        ``check_schedule``.
    Raises:
        ScheduleError: if a count is below 1, or ``num_microbatches`` is below ``2p - 1``
            (phase 4 runs ``m - 2p + 1`` times on worker 0; torch's ``ScheduleDualPipeV``
            and DeepSeek's ``DualPipeV`` ask for ``m >= 2p``).
    """
    _check_positive(num_workers=num_workers, num_microbatches=num_microbatches)
    p, m = num_workers, num_microbatches
    if m < min_microbatches("dualpipev", p):
        raise ScheduleError(
            f"dualpipev needs at least 2p - 1 = {2 * p - 1} micro-batches on {p} workers (worker 0 "
            f"runs {2 * p - 1} forwards of stage 0 before its first backward), got {m}; use "
            f"microbatches >= {2 * p - 1}, or 'zb-v' (chunks=2), which takes any count"
        )
    schedule = [_dualpipe_v_worker(p, m, w) for w in range(p)]
    check_schedule(schedule, 2 * p, m)
    return schedule


class _VWorkerList:
    """One worker's action list as it is written: each stage's next micro-batch per op, and
    the "W"s its "I"s deferred, oldest first."""

    def __init__(self, earlier: int, later: int) -> None:
        self.earlier, self.later = earlier, later
        self.actions: list[Action] = []
        self._next: dict[tuple[str, int], int] = defaultdict(int)
        self._deferred: deque[Action] = deque()

    def forward(self, stage: int) -> None:
        self._append("F", stage)

    def backward(self, stage: int, split: bool = False) -> None:
        """A whole "B", or an "I" whose "W" waits for ``weight``."""
        action = self._append("I" if split else "B", stage)
        if split:
            self._deferred.append(Action("W", stage, action.microbatch))

    def weight(self) -> None:
        """The oldest deferred "W", if any."""
        if self._deferred:
            self.actions.append(self._deferred.popleft())

    def _append(self, op: str, stage: int) -> Action:
        key = ("F" if op == "F" else "B", stage)
        action = Action(op, stage, self._next[key])
        self._next[key] += 1
        self.actions.append(action)
        return action


def _dualpipe_v_worker(p: int, m: int, w: int) -> list[Action]:
    """Worker ``w``'s list under ``dualpipe_v``: its eight phases in order."""
    todo = _VWorkerList(w, 2 * p - 1 - w)
    down, up, q = todo.earlier, todo.later, p - 1 - w
    for _ in range(2 * q):
        todo.forward(down)
    for _ in range(w + 1):
        todo.forward(down)
        todo.forward(up)
    for _ in range(q):
        todo.backward(up, split=True)
        todo.weight()
        todo.forward(up)
    for _ in range(m - 2 * p + w + 1):
        todo.forward(down)
        todo.backward(up)
        todo.forward(up)
        todo.backward(down)
    for _ in range(q):
        todo.backward(up)
        todo.forward(up)
        todo.backward(down)
    # the later stage's backward, then the earlier's: the second half as I's, whose W's
    # fill the drain
    for k in range(2 * (w + 1)):
        todo.backward(up if k % 2 == 0 else down, split=k > w)
    for _ in range(q):
        todo.weight()
        todo.backward(down, split=True)
    for _ in range(w + 1):
        todo.weight()
    return todo.actions


def v_half(num_workers: int, num_microbatches: int) -> Schedule:
    """V-Half (Qi et al., "Pipeline Parallelism with Controllable Memory", NeurIPS 2024): ZB-V's
    placement and I/W split, holding at most half of 1F1B's activations.

    Worker ``w`` runs stages ``w`` and ``2p - 1 - w`` (a V, ``chunks=2``), and holds at most
    ``max(p, 2)`` stage activations (a stage's micro-batch counts one from its F until its
    W): with the two stages the halves of one 1F1B stage, ``p / 2`` micro-batches' worth,
    half of 1F1B's peak of ``p``. The order is a modulo schedule (see ``_v_modulo``).
    With unit-time F, I and W, 3 workers (6 stages) and 3 micro-batches (upper case: the
    worker's earlier stage, lower case: its later one)::

        tick      0  1  2  3  4  5  6  7  8  9  10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29
        worker 0  F0 .  .  .  .  f0 i0 w0 F1 .  .  .  .  f1 i1 w1 F2 I0 W0 .  .  f2 i2 w2 I1 W1 .  .  I2 W2
        worker 1  .  F0 .  .  f0 .  .  i0 w0 F1 .  .  f1 I0 W0 i1 w1 F2 .  .  f2 I1 W1 i2 w2 .  .  I2 W2 .
        worker 2  .  .  F0 f0 .  .  .  .  i0 w0 F1 f1 I0 W0 .  .  i1 w1 F2 f2 I1 W1 .  .  i2 w2 I2 W2 .  .

    For ``p = 4`` and ``m = 8`` the step lasts 67 half-stage ticks, 1F1B's 66 (F = 2 and
    B = 4 ticks per whole stage), with 4 stage activations held against 1F1B's 8.

    Returns:
        One action list per worker, already proven complete and deadlock-free by
        ``check_schedule``.
    Raises:
        ScheduleError: if a count is below 1.
    """
    _check_positive(num_workers=num_workers, num_microbatches=num_microbatches)
    return _v_modulo(num_workers, num_microbatches, max(num_workers, 2))


def v_min(num_workers: int, num_microbatches: int) -> Schedule:
    """V-Min (Qi et al., NeurIPS 2024): like ``v_half``, holding at most a third of 1F1B's
    activations and paying for it in step time.

    Worker ``w`` holds at most ``max(ceil(2p / 3), 2)`` stage activations (a third of
    1F1B's ``2p`` half stages, rounded up). With unit-time F, I and W, 3 workers and 3
    micro-batches::

        tick      0  1  2  3  4  5  6  7  8  9  10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31 32 33
        worker 0  F0 .  .  .  .  f0 i0 w0 F1 .  .  .  I0 W0 .  f1 i1 w1 F2 .  .  .  I1 W1 .  f2 i2 w2 .  .  .  .  I2 W2
        worker 1  .  F0 .  .  f0 .  .  i0 w0 F1 .  I0 W0 .  f1 .  .  i1 w1 F2 .  I1 W1 .  f2 .  .  i2 w2 .  .  I2 W2 .
        worker 2  .  .  F0 f0 .  .  .  .  i0 w0 I0 W0 F1 f1 .  .  .  .  i1 w1 I1 W1 F2 f2 .  .  .  .  i2 w2 I2 W2 .  .

    For ``p = 4`` and ``m = 8`` the step lasts 88 half-stage ticks against 1F1B's 66, with
    3 stage activations held against 1F1B's 8.

    Returns:
        One action list per worker, already proven complete and deadlock-free by
        ``check_schedule``.
    Raises:
        ScheduleError: if a count is below 1.
    """
    _check_positive(num_workers=num_workers, num_microbatches=num_microbatches)
    return _v_modulo(num_workers, num_microbatches, max(-(-2 * num_workers // 3), 2))


def _v_modulo(p: int, m: int, limit: int) -> Schedule:
    """A V schedule of ``2p`` stages holding at most ``limit`` stage activations per worker:
    the modulo schedule of the least period that keeps to it.

    One micro-batch's actions are placed on a unit clock in the order of its data flow
    (the forwards down and up the V, then the I's back, each W after its I), each at the
    first tick after its prerequisite whose residue modulo the period ``T`` is still free
    on its worker; micro-batch ``j`` repeats that pattern ``T * j`` ticks later. Every
    worker then runs its actions in tick order. Each activation lives from its F to its W,
    so the longer ``T``, the fewer micro-batches overlap: ``T`` grows from 6 (a worker's
    six actions per micro-batch) until the worker holding the most stays within ``limit``.
    """
    period = 6
    while True:
        schedule = _v_pattern(p, m, period)
        if max(_most_held(todo) for todo in schedule) <= limit:
            check_schedule(schedule, 2 * p, m)
            return schedule
        period += 1


def _v_pattern(p: int, m: int, period: int) -> Schedule:
    """The modulo schedule of ``_v_modulo`` for one period: one action list per worker."""
    stages = 2 * p
    worker = [min(s, stages - 1 - s) for s in range(stages)]
    taken: list[set[int]] = [set() for _ in range(p)]
    tick: dict[Action, int] = {}

    def place(action: Action, earliest: int) -> int:
        w = worker[action.stage]
        t = earliest
        while t % period in taken[w]:
            t += 1
        taken[w].add(t % period)
        tick[action] = t
        return t

    t = -1
    for s in range(stages):
        t = place(Action("F", s, 0), t + 1)
    for s in reversed(range(stages)):
        t = place(Action("I", s, 0), t + 1)
        place(Action("W", s, 0), t + 1)
    timed: list[list[tuple[int, Action]]] = [[] for _ in range(p)]
    for action, start in tick.items():
        for j in range(m):
            timed[worker[action.stage]].append((start + period * j, Action(action.op, action.stage, j)))
    return [[action for _, action in sorted(todo, key=lambda item: item[0])] for todo in timed]


def _most_held(todo: Sequence[Action]) -> int:
    """The most stage activations a worker running ``todo`` holds: each from its F to its W
    (or B)."""
    held = most = 0
    for action in todo:
        held += 1 if action.op == "F" else -1 if action.op in ("B", "W") else 0
        most = max(most, held)
    return most


class StageGraph:
    """Which stages feed which: the dependency rule every interpreter of a schedule obeys.

    ``F(s, m)`` needs ``F(q, m)`` for every producer ``q`` of ``s``. ``B(s, m)`` and
    ``I(s, m)`` need ``F(s, m)`` and, from every consumer ``c`` of ``s``, the gradient for
    ``m``: ``I(c, m)`` when the schedule splits that backward, ``B(c, m)`` otherwise (a
    stage without consumers, like the last, needs only its own forward). ``W(s, m)`` needs
    ``I(s, m)``.
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

    def prerequisites(
        self, action: Action, split: Collection[tuple[int, int]] = ()
    ) -> list[Action]:
        """Returns the actions that must finish before ``action`` may start.

        ``split``: the (stage, micro-batch) pairs whose backward the schedule runs as "I"
        and "W" rather than "B" (``execution_order`` reads them off the schedule).

        Raises:
            ScheduleError: if ``action`` names a stage outside the graph.
        """
        if not action.stage < self.num_stages:
            raise ScheduleError(f"{action} names a stage outside 0..{self.num_stages - 1}")
        s, m = action.stage, action.microbatch
        if action.op == "F":
            return [Action("F", p, m) for p in self.producers[s]]
        if action.op == "W":
            return [Action("I", s, m)]
        return [Action("F", s, m)] + [
            Action("I" if (c, m) in split else "B", c, m) for c in self.consumers[s]
        ]


def _split_backwards(actions: Sequence[Sequence[Action]]) -> set[tuple[int, int]]:
    """The (stage, micro-batch) pairs whose backward runs as "I" and "W"."""
    return {(a.stage, a.microbatch) for todo in actions for a in todo if a.op == "I"}


def execution_order(
    actions: Sequence[Sequence[Action]], graph: StageGraph
) -> Iterator[tuple[int, Action, list[Action]]]:
    """Runs every worker's list in order, each action once its prerequisites are done.

    Yields:
        (worker, action, prerequisites) in an order that respects both each worker's list
        and every prerequisite, so a consumer can compute start times as it goes.
    Raises:
        ScheduleError: when no worker can move, listing each stuck worker's next action and
            the action it waits for.
    """
    split = _split_backwards(actions)
    position = [0] * len(actions)
    done: set[Action] = set()
    waiting: dict[Action, list[int]] = defaultdict(list)
    runnable = deque(range(len(actions)))
    while runnable:
        worker = runnable.popleft()
        todo = actions[worker]
        while position[worker] < len(todo):
            action = todo[position[worker]]
            needs = graph.prerequisites(action, split)
            missing = next((d for d in needs if d not in done), None)
            if missing is not None:
                waiting[missing].append(worker)
                break
            done.add(action)
            position[worker] += 1
            yield worker, action, needs
            runnable.extend(waiting.pop(action, ()))
    stuck = [w for w, todo in enumerate(actions) if position[w] < len(todo)]
    if stuck:
        raise ScheduleError(_deadlock_report(actions, graph, split, position, done, stuck))


def _deadlock_report(
    actions: Sequence[Sequence[Action]],
    graph: StageGraph,
    split: set[tuple[int, int]],
    position: list[int],
    done: set[Action],
    stuck: list[int],
) -> str:
    where = {a: (w, i) for w, todo in enumerate(actions) for i, a in enumerate(todo)}
    lines = []
    for w in stuck:
        action = actions[w][position[w]]
        for need in graph.prerequisites(action, split):
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

    Complete: for every stage ``s < num_stages`` and micro-batch ``m < num_microbatches``,
    ``F(s, m)`` appears exactly once and, unless ``forward_only``, so does either ``B(s, m)``
    or the pair ``I(s, m)``, ``W(s, m)`` with the "I" first; all the actions of one stage
    are on one worker and every worker has some. Deadlock-free: running each worker's list
    in order, an action only once its ``StageGraph`` prerequisites are done, finishes every
    list. ``deps`` are (producer_stage, consumer_stage) pairs, by default the chain.

    Returns:
        None; a schedule that returns is safe to execute.
    Raises:
        ScheduleError: naming the missing, duplicated, out-of-range or misplaced actions,
            or, on deadlock, each stuck worker's next action and what it waits for.
    """
    graph = StageGraph(num_stages, deps)
    _check_positive(num_microbatches=num_microbatches)
    problems = _completeness_problems(actions, num_stages, num_microbatches, forward_only)
    if problems:
        raise ScheduleError("invalid schedule:\n" + "\n".join(f"  {p}" for p in problems))
    for _ in execution_order(actions, graph):
        pass


def _completeness_problems(
    actions: Sequence[Sequence[Action]], num_stages: int, num_microbatches: int, forward_only: bool
) -> list[str]:
    """What keeps ``actions`` from being a complete schedule, one line each (none: complete)."""
    problems = []
    where: dict[Action, tuple[int, int]] = {}
    worker_of_stage: dict[int, int] = {}
    for worker, todo in enumerate(actions):
        if not todo:
            problems.append(f"worker {worker} runs nothing; give it a stage or drop its list")
        for index, action in enumerate(todo):
            if (
                action.stage >= num_stages
                or action.microbatch >= num_microbatches
                or (forward_only and action.op != "F")
            ):
                problems.append(
                    f"worker {worker} runs {action}, which is not part of a "
                    f"{'forward-only ' if forward_only else ''}schedule of "
                    f"{num_stages} stages and {num_microbatches} micro-batches"
                )
                continue
            if action in where:
                problems.append(f"worker {worker} runs {action} a second time")
                continue
            where[action] = (worker, index)
            owner = worker_of_stage.setdefault(action.stage, worker)
            if owner != worker:
                problems.append(
                    f"worker {worker} runs {action}, but stage {action.stage} "
                    f"already runs on worker {owner}"
                )
    missing = []
    for s in range(num_stages):
        for m in range(num_microbatches):
            forward, full, inputs, weights = (Action(op, s, m) for op in ("F", "B", "I", "W"))
            if forward not in where:
                missing.append(forward)
            if forward_only:
                continue
            if full in where and (inputs in where or weights in where):
                other = inputs if inputs in where else weights
                problems.append(f"{full} and {other} both run: a backward runs as B, or as I then W")
            elif inputs in where and weights not in where:
                problems.append(f"{inputs} runs but no worker runs {weights}, the weight gradients it leaves")
            elif weights in where and inputs not in where:
                problems.append(f"{weights} runs but no worker runs {inputs}, which it finishes")
            elif inputs in where and where[weights][0] == where[inputs][0] and where[weights] < where[inputs]:
                problems.append(f"worker {where[weights][0]} runs {weights} before {inputs}; W must follow its I")
            elif full not in where and inputs not in where:
                missing.append(full)
    if missing:
        shown = ", ".join(map(str, missing[:10]))
        more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        hint = " (a backward runs as B, or as I then W)" if any(a.op == "B" for a in missing) else ""
        problems.append(f"no worker runs {shown}{more}{hint}")
    return problems


def stage_workers(actions: Sequence[Sequence[Action]]) -> list[int]:
    """Returns the worker of every stage, read off the schedule: entry ``s`` is the index of
    the list that runs stage ``s`` (1F1B: ``s``; interleaved 1F1B: ``s % p``; ZB-V: stages
    ``w`` and ``2p - 1 - w`` on worker ``w``; a custom schedule: wherever it puts them).

    Raises:
        ScheduleError: if a stage runs on two workers, or no worker runs a stage below the
            highest one named.
    """
    owner: dict[int, int] = {}
    for worker, todo in enumerate(actions):
        for action in todo:
            if owner.setdefault(action.stage, worker) != worker:
                raise ScheduleError(
                    f"stage {action.stage} runs on workers {owner[action.stage]} and {worker} "
                    f"({action}); all the actions of a stage belong on one worker"
                )
    missing = [s for s in range(max(owner, default=-1) + 1) if s not in owner]
    if missing:
        raise ScheduleError(f"no worker runs stage(s) {', '.join(map(str, missing))}")
    return [owner[s] for s in range(len(owner))]


def _check_divisible(num_stages: int, chunks: int) -> None:
    _check_positive(num_stages=num_stages, chunks=chunks)
    if num_stages % chunks:
        raise ScheduleError(
            f"{num_stages} stages cannot be spread evenly over workers holding {chunks} "
            f"chunks each; use a number of stages divisible by chunks={chunks}"
        )


_ONE_STAGE_PER_WORKER = {"gpipe": gpipe, "1f1b": one_f_one_b, "zb-h1": zb_h1}
_V_SHAPED = {"zb-v": zb_v, "v-half": v_half, "v-min": v_min, "dualpipev": dualpipe_v}


def min_microbatches(name: str, num_workers: int) -> int:
    """Returns the fewest micro-batches the built-in schedule ``name`` runs on
    ``num_workers`` workers: ``2p - 1`` for "dualpipev" (``dualpipe_v``), 1 for the others."""
    return max(2 * num_workers - 1, 1) if name == "dualpipev" else 1


def check_chunks(name: str, chunks: int) -> None:
    """The one rule for how many stages a worker holds under the schedule called ``name``:
    one for "gpipe", "1f1b" and "zb-h1", two for "zb-v", "v-half", "v-min" and "dualpipev" (in a V),
    any number for "interleaved-1f1b".

    Raises:
        ScheduleError: naming the schedule, the ``chunks`` it got and what to set instead.
    """
    if name in _ONE_STAGE_PER_WORKER and chunks != 1:
        raise ScheduleError(
            f"schedule {name!r} runs one stage per worker, got chunks={chunks}; use "
            "chunks=1, or schedule 'interleaved-1f1b' (any chunks) or 'zb-v', 'v-half', "
            "'v-min' or 'dualpipev' (chunks=2) for several stages per worker"
        )
    if name in V_SCHEDULES and chunks != 2:
        raise ScheduleError(
            f"schedule {name!r} runs two stages per worker, got chunks={chunks}; set chunks=2 "
            "(two stages per device, in a V) and use an even number of stages"
        )


def make_schedule(name: str, num_stages: int, num_microbatches: int, chunks: int = 1) -> Schedule:
    """Builds the schedule called ``name`` (one of ``SCHEDULES``).

    ``num_stages`` counts all stages. "gpipe", "1f1b" and "zb-h1" give each stage its own
    worker (``chunks=1``); "interleaved-1f1b" spreads them over ``num_stages // chunks``
    workers; "zb-v", "v-half", "v-min" and "dualpipev" need ``chunks=2`` (two stages per
    worker, in a V); "dualpipev" needs ``min_microbatches`` micro-batches.

    Returns:
        One action list per worker.
    Raises:
        ScheduleError: for an unknown name, a ``chunks`` the schedule does not take,
            ``num_stages`` not divisible by ``chunks``, or a count below 1 (below
            ``min_microbatches`` for "dualpipev").
    """
    if not isinstance(name, str):
        raise ScheduleError(
            f"make_schedule builds the schedules named in SCHEDULES, got {describe_schedule(name)}; "
            "resolve_schedule takes lists of actions and functions too"
        )
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    check_chunks(name, chunks)
    if name in _ONE_STAGE_PER_WORKER:
        return _ONE_STAGE_PER_WORKER[name](num_stages, num_microbatches)
    _check_divisible(num_stages, chunks)
    if name in _V_SHAPED:
        return _V_SHAPED[name](num_stages // 2, num_microbatches)
    return interleaved_1f1b(num_stages // chunks, num_microbatches, chunks)


def resolve_schedule(
    spec: ScheduleSpec,
    num_stages: int,
    num_microbatches: int,
    chunks: int = 1,
    deps: Iterable[tuple[int, int]] | None = None,
) -> Schedule:
    """Builds the schedule ``spec`` describes and proves that it runs.

    ``spec`` is what ``Plan.schedule`` holds: a name (built by ``make_schedule`` with
    ``chunks``), a schedule as data (one list of ``Action`` per worker; it fixes the
    micro-batch count) or a function ``(num_stages, num_microbatches) -> schedule``. Data and
    functions place the stages themselves (``stage_workers``); ``chunks`` is ignored for
    them. ``deps`` are the stage graph's (producer, consumer) pairs, by default the chain.

    Returns:
        A new ``Schedule`` that ``check_schedule`` accepted: safe to run.
    Raises:
        ScheduleError: for what ``make_schedule`` rejects; a function that raises or returns
            something other than lists of ``Action``; data for another micro-batch count; a
            schedule that is incomplete (naming the missing actions) or deadlocks (naming
            each blocked action and what it waits for).
    """
    if isinstance(spec, str):
        actions = make_schedule(spec, num_stages, num_microbatches, chunks)
    elif callable(spec):
        call = f"{describe_schedule(spec)}({num_stages}, {num_microbatches})"
        try:
            made = spec(num_stages, num_microbatches)
        except ScheduleError:
            raise
        except Exception as err:
            raise ScheduleError(f"{call} raised {type(err).__name__}: {err}") from err
        actions = as_schedule(made, f"what {call} returned")
    else:
        actions = as_schedule(spec)
        runs = microbatch_count(actions)
        if runs != num_microbatches:
            raise ScheduleError(
                f"the schedule given as data runs {runs} micro-batches, but this step has "
                f"{num_microbatches}; a schedule as data fixes the count: set "
                f"Plan(microbatches={runs}) and batches that split into {runs}, or give a "
                "function (num_stages, num_microbatches) -> schedule to serve any count"
            )
    check_schedule(actions, num_stages, num_microbatches, deps)
    return actions


def as_schedule(value: object, what: str = "the schedule") -> Schedule:
    """Returns ``value``, a sequence of per-worker sequences of ``Action``, as a new Schedule.

    Checks types only (``check_schedule`` proves the rest). ``what`` names ``value`` in errors.

    Raises:
        ScheduleError: naming the first entry that is not a list of actions or not an
            ``Action``, and how to write it.
    """
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise ScheduleError(
            f"{what} must be a list holding one list of fxpipe.Action per worker, "
            f"got {type(value).__name__}"
        )
    if not value:
        raise ScheduleError(f"{what} is empty; give one list of fxpipe.Action per worker")
    schedule = []
    for w, todo in enumerate(value):
        if isinstance(todo, str | bytes | Action) or not isinstance(todo, Sequence):
            raise ScheduleError(
                f"{what}[{w}] is {todo!r}, not a list: give worker {w}'s actions as a list of "
                "fxpipe.Action"
            )
        for k, action in enumerate(todo):
            if not isinstance(action, Action):
                hint = f"fxpipe.Action{tuple(action)!r}" if isinstance(action, tuple) else "fxpipe.Action(op, stage, microbatch)"
                raise ScheduleError(
                    f"{what}[{w}][{k}] is {action!r}, not an fxpipe.Action; write {hint}"
                )
        schedule.append(list(todo))
    return schedule


def microbatch_count(actions: Sequence[Sequence[Action]]) -> int:
    """Returns how many micro-batches a schedule runs: one more than the highest index."""
    return 1 + max((a.microbatch for todo in actions for a in todo), default=-1)


def describe_schedule(spec: ScheduleSpec) -> str:
    """Returns a short name for ``spec`` for messages and summaries: the schedule's name, the
    function's qualified name, or "custom schedule (N workers)" for data."""
    if isinstance(spec, str):
        return spec
    if callable(spec):
        return getattr(spec, "__qualname__", type(spec).__name__)
    return f"custom schedule ({len(spec)} worker{'' if len(spec) == 1 else 's'})"


def forward_only(actions: Sequence[Sequence[Action]]) -> Schedule:
    """Returns the schedule without its backwards: what inference runs, in the same order."""
    return [[a for a in todo if a.op == "F"] for todo in actions]
