"""The action loop both executors share: one worker walks its action list.

For each action of its list, in order, the loop:

1. ``transport.start``: lets the transport get ready (post the next receives; stop when
   another worker failed) and enters the context the action runs in (a CUDA stream);
2. ``transport.receive``: waits for the action's inputs (:func:`inbound`);
3. calls every hook's ``before``, strikes an armed fault (:mod:`~fxpipe.runtime.inject`),
   and runs the action on its stage's runner: :func:`dispatch`, the one place that maps
   F, B, I and W to a :class:`StageRunner` call;
4. ``transport.send``: hands the results on (:func:`outbound`);
5. ``transport.settle``: waits for the action's device work, so the recorded end time is
   true; records the timeline events (a ``recv`` event when the inputs were late, then the
   action) and calls every hook's ``after``.

Any error raised on the way goes through ``transport.failed``, which names the stage and
the action; after the last action, ``transport.finish`` waits for what is still in flight.

The executors differ only in their transport: the local one
(:mod:`~fxpipe.runtime.local`) hands values to other threads through a mailbox, with a
watchdog thread; the distributed one (``fxpipe.distributed.executor``) posts
point-to-point messages planned from the edges' specs, in NCCL's fused groups on GPUs,
and checks shapes before sending.

Extension points: an :class:`ActionHook` sees every action before and after it runs, with
the :class:`Step` (the call's :class:`~fxpipe.runtime.context.StepContext`, the model's
inputs per micro-batch, which may differ in shape from one micro-batch to the next, and the
runners); see :func:`after_last_backward`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from fxpipe.inspection.timeline import Event
from fxpipe.runtime import inject
from fxpipe.runtime.context import StepContext
from fxpipe.runtime.runner import StageRunner
from fxpipe.schedules import Action

ACT, GRAD = "act", "grad"  # what crosses an edge: a forward's value, or its gradient coming back
_LATE = 1e-4  # seconds of waiting for inputs worth a "recv" event on the timeline


class ActionHook(Protocol):
    """Called around every action a worker runs (on the worker's thread): ``before`` once
    its inputs arrived, just before it runs; ``after`` once its device work finished and
    its results were handed on. An exception fails the action, as the stage's own would."""

    def before(self, action: Action, runner: StageRunner, step: Step) -> None: ...

    def after(self, action: Action, runner: StageRunner, step: Step) -> None: ...


@dataclass
class Step:
    """One call of the pipeline as every worker's loop sees it.

    ctx: what the call asks of every stage (train or not, grad mode, autocast, the loss,
    the seed), where the last stage leaves outputs and losses; inputs: per micro-batch,
    the model's flat inputs (stage 0 reads them; micro-batches may differ in shape);
    runners: the stages this process runs, by index; edge_ends: (producer stage, consumer
    stage) per edge id; hooks: called around every action; faults: the armed test faults
    (read once, by the calling thread); origin: time zero of the recorded events;
    microbatch_runners: per micro-batch, the runners of its own program, when the
    micro-batches of a call were traced for different input signatures (another sequence
    length under torch.export): the same stages on the same parameters and edges, each
    compiled for its shapes (see :meth:`runner`).
    """

    ctx: StepContext
    inputs: Sequence[list]
    runners: Mapping[int, StageRunner]
    edge_ends: Sequence[tuple[int, int]]
    hooks: Sequence[ActionHook] = ()
    faults: inject.Faults | None = field(default_factory=inject.armed)
    origin: float = field(default_factory=time.perf_counter)
    microbatch_runners: Sequence[Mapping[int, StageRunner]] | None = None

    def runner(self, action: Action) -> StageRunner:
        """The runner of ``action``'s stage for its micro-batch."""
        if self.microbatch_runners is not None:
            return self.microbatch_runners[action.microbatch][action.stage]
        return self.runners[action.stage]


class Transport(Protocol):
    """How one worker's values reach its stages and leave them: what differs between the
    local and the distributed executor. ``k`` is the action's position in the worker's list.

    worker: the pipeline worker (the timeline's row); rank: this process's rank, for fault
    injection (None in the local executor).
    """

    worker: int
    rank: int | None

    def start(self, k: int, action: Action, runner: StageRunner) -> contextlib.AbstractContextManager:
        """Get ready for action k; return the context it runs in. May raise to stop."""
        ...

    def receive(self, k: int, action: Action, runner: StageRunner) -> list[Any]:
        """Wait for action k's inputs: one value or gradient list per :func:`inbound` edge."""
        ...

    def send(self, k: int, action: Action, runner: StageRunner, results: list[Any]) -> None:
        """Hand on what action k returned: one value or gradient list per :func:`outbound` edge."""
        ...

    def settle(self, k: int, action: Action, runner: StageRunner) -> None:
        """Wait until action k's device work has finished."""
        ...

    def failed(self, action: Action, runner: StageRunner, err: Exception) -> BaseException:
        """The error to raise for ``err`` raised in ``action`` (``err`` itself to let it pass)."""
        ...

    def finish(self) -> None:
        """After the worker's last action: what is still in flight completes."""
        ...

    def label(self, runner: StageRunner) -> str:
        """The device name the timeline shows for the runner's actions."""
        ...


def inbound(action: Action, recv: list[int], send: list[int]) -> tuple[str, list[int]]:
    """What ``action`` of a stage with receive edges ``recv`` and send edges ``send`` waits
    for: (ACT, ``recv``) for F, (GRAD, ``send``) for B and I, nothing for W (its work was
    left on this worker by the I). An ACT comes from an edge's producer, a GRAD from its
    consumer."""
    if action.op == "F":
        return ACT, recv
    if action.op == "W":
        return GRAD, []
    return GRAD, send


def outbound(action: Action, recv: list[int], send: list[int]) -> tuple[str, list[int]]:
    """What ``action`` hands on: (ACT, ``send``) for F, (GRAD, ``recv``) for B and I,
    nothing for W. An ACT goes to an edge's consumer, a GRAD to its producer."""
    if action.op == "F":
        return ACT, send
    if action.op == "W":
        return GRAD, []
    return GRAD, recv


def dispatch(action: Action, runner: StageRunner, step: Step, received: list[Any]) -> list[Any]:
    """Run ``action`` on its stage's runner, given what :func:`inbound` named; return what
    :func:`outbound` names: F the values for the send edges (``[]`` from the last stage,
    which leaves its output and loss in the context), B and I the gradients of the
    received inputs, W nothing."""
    i, ctx = action.microbatch, step.ctx
    if action.op == "F":
        return runner.forward(i, step.inputs[i] if runner.index == 0 else (), received, ctx)
    if action.op == "B":
        return runner.backward(i, received, ctx)
    if action.op == "I":
        return runner.backward_input(i, received, ctx)
    runner.backward_weight(i, ctx)
    return []


def interpret(actions: Sequence[Action], step: Step, transport: Transport) -> list[Event]:
    """Run one worker's ``actions`` for ``step`` through ``transport``; return the events
    recorded (in order). Raises what ``transport.failed`` makes of the first error."""
    events: list[Event] = []
    for k, action in enumerate(actions):
        runner = step.runner(action)
        try:
            events += _run_action(k, action, runner, step, transport)
        except Exception as err:
            failure = transport.failed(action, runner, err)
            if failure is err:
                raise
            raise failure from err
    transport.finish()
    return events


def _run_action(k: int, action: Action, runner: StageRunner, step: Step, transport: Transport) -> list[Event]:
    """Action ``k`` from its inputs to its results handed on; its events."""
    with transport.start(k, action, runner):
        waited = time.perf_counter()
        received = transport.receive(k, action, runner)
        began = time.perf_counter()
        for hook in step.hooks:
            hook.before(action, runner, step)
        if step.faults is not None:
            step.faults.fire(action, runner.module, transport.rank)
        transport.send(k, action, runner, dispatch(action, runner, step, received))
    transport.settle(k, action, runner)
    events = _events(action, transport.worker, transport.label(runner), step.origin, waited, began)
    for hook in step.hooks:
        hook.after(action, runner, step)
    return events


def _events(action: Action, worker: int, device: str, origin: float, waited: float, began: float) -> list[Event]:
    """A ``recv`` event when the inputs came late, and the action's own, ending now."""
    ended = time.perf_counter()
    events = []
    if began - waited > _LATE:
        events.append(Event(worker, action.stage, action.microbatch, "recv", waited - origin, began - origin, device))
    events.append(Event(worker, action.stage, action.microbatch, action.op, began - origin, ended - origin, device))
    return events


@dataclass
class _AfterLastBackward:
    last: dict[int, Action]
    then: Callable[[int], None]

    def before(self, action: Action, runner: StageRunner, step: Step) -> None:
        pass

    def after(self, action: Action, runner: StageRunner, step: Step) -> None:
        if self.last.get(action.stage) == action:
            self.then(action.stage)


def after_last_backward(actions: Sequence[Action], then: Callable[[int], None]) -> ActionHook:
    """A hook calling ``then(stage)`` once a stage's last backward action in ``actions``
    (its last B, or the later of its last I and W) has run: its gradients are complete."""
    return _AfterLastBackward({a.stage: a for a in actions if a.op != "F"}, then)
