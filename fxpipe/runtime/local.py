"""The local executor: one thread per pipeline worker, interpreting the schedule's action lists.

Each worker walks its own list with the shared action loop
(:func:`~fxpipe.runtime.interpret.interpret`) over a mailbox transport: ``F(s, i)`` takes
micro-batch i's values from the stages feeding s out of the mailbox, runs the stage and
posts its outputs; ``B(s, i)`` takes the gradients of those outputs, backpropagates through
the stage and posts the gradients of its inputs. Stages overlap for real: PyTorch releases
the GIL inside ops, and on CUDA each worker has its own stream with an event on every
hand-off. Worker threads live as long as the executor (starting threads per step costs).

Faults end in bounded time: the calling thread watches the workers. A worker whose action
raises stops the step at once (the others stop before their next action) with a
:class:`PipelineError` naming the stage, action and micro-batch; an action that runs, or a
wait that lasts, longer than the plan's ``timeout`` ends the step with a PipelineError
naming the stage that is stuck (the end of the chain of waits), and that stage's thread is
abandoned (Python cannot stop it) and replaced for the next step.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fxpipe.inspection.timeline import Event
from fxpipe.runtime.interpret import ACT, Step, inbound, interpret, outbound
from fxpipe.runtime.runner import StageRunner
from fxpipe.runtime.streams import WorkerStream
from fxpipe.schedules import Action

_POLL = 0.5  # seconds between the calling thread's looks at stuck workers


class PipelineError(RuntimeError):
    """A stage failed or hung while running; ``stage``, ``action`` and ``microbatch`` name it."""

    def __init__(self, message: str, stage: int | None = None, action: Action | None = None) -> None:
        super().__init__(message)
        self.stage = stage
        self.action = action
        self.microbatch = action.microbatch if action is not None else None


class _Aborted(Exception):
    """Another worker failed: stop quietly, the first failure is reported."""


@dataclass
class _State:
    """What one worker is doing, for the watchdog: an action running or a value awaited."""

    action: Action | None = None
    waiting_for: tuple | None = None
    since: float = 0.0
    done: bool = False


class _Mailbox:
    """Values and gradients in flight, keyed by (kind, edge, micro-batch)."""

    def __init__(self) -> None:
        self.items: dict[tuple, tuple[Any, Any]] = {}
        self.cond = threading.Condition()
        self.failed: BaseException | None = None

    def put(self, key: tuple, value: Any, event: Any) -> None:
        with self.cond:
            self.items[key] = (value, event)
            self.cond.notify_all()

    def take(self, key: tuple, state: _State) -> tuple[Any, Any]:
        with self.cond:
            if key not in self.items:
                state.waiting_for, state.since = key, time.monotonic()
                while key not in self.items:
                    if self.failed is not None:
                        raise _Aborted
                    self.cond.wait()
                state.waiting_for = None
            return self.items.pop(key)

    def fail(self, err: BaseException) -> None:
        with self.cond:
            if self.failed is None:
                self.failed = err
            self.cond.notify_all()


class _Thread:
    """A long-lived worker thread running the jobs it is handed, one at a time, until retired."""

    def __init__(self, name: str) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.retired = False
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.retired:
            self.jobs.get()()

    def retire(self) -> None:
        """End the thread once its current job returns (a stuck job keeps it until then)."""
        self.retired = True
        self.jobs.put(_nothing)  # wakes an idle thread to see it


def _nothing() -> None:
    pass


def _retire_all(threads: dict[int, _Thread], timeout: float = 0.0) -> None:
    for thread in threads.values():
        thread.retire()
    for thread in threads.values():
        if timeout > 0 and thread.thread is not threading.current_thread():
            thread.thread.join(timeout)
    threads.clear()


class _MailboxTransport:
    """One worker's transport: values and gradients through the shared mailbox, on the
    worker's CUDA stream (created for its first stage's device), with the state the
    watchdog reads."""

    rank = None

    def __init__(self, worker: int, box: _Mailbox, state: _State) -> None:
        self.worker = worker
        self.box = box
        self.state = state
        self.stream: WorkerStream | None = None

    def start(self, k: int, action: Action, runner: StageRunner) -> contextlib.AbstractContextManager:
        if self.box.failed is not None:
            raise _Aborted
        if self.stream is None:
            self.stream = WorkerStream(runner.device)
        self.state.action, self.state.since = action, time.monotonic()
        return self.stream.active()

    def receive(self, k: int, action: Action, runner: StageRunner) -> list[Any]:
        kind, edges = inbound(action, runner.recv, runner.send)
        values = [self.stream.receive(*self.box.take((kind, e, action.microbatch), self.state)) for e in edges]
        self.state.since = time.monotonic()
        return values

    def send(self, k: int, action: Action, runner: StageRunner, results: list[Any]) -> None:
        kind, edges = outbound(action, runner.recv, runner.send)
        if not results:
            return
        event = self.stream.record()
        for edge, value in zip(edges, results):
            self.box.put((kind, edge, action.microbatch), value, event)

    def settle(self, k: int, action: Action, runner: StageRunner) -> None:
        self.stream.synchronize()

    def failed(self, action: Action, runner: StageRunner, err: Exception) -> BaseException:
        if isinstance(err, _Aborted):
            return err
        return PipelineError(
            f"stage {action.stage} on {self.label(runner)} failed in {action} (micro-batch {action.microbatch}): "
            f"{type(err).__name__}: {err}",
            action.stage,
            action,
        )

    def finish(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    def label(self, runner: StageRunner) -> str:
        return runner.name or str(runner.device)



class LocalExecutor:
    """Runs action lists over stage runners in one process, on worker threads it keeps.

    timeout: seconds any one action or wait may last before the step fails.
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._threads: dict[int, _Thread] = {}
        # the threads end with the executor (they hold no reference to it)
        weakref.finalize(self, _retire_all, self._threads)

    def close(self, timeout: float = 5.0) -> None:
        """Retire and join the worker threads (a later run starts new ones)."""
        _retire_all(self._threads, timeout)

    def run(self, actions: Sequence[Sequence[Action]], step: Step) -> list[Event]:
        """Run one step: ``actions`` one list per worker, over ``step.runners`` (every stage
        of the call's input signature). The last stage's outputs and losses land in
        ``step.ctx``; returns the recorded events. Raises PipelineError naming the stage."""
        box = _Mailbox()
        states = [_State() for _ in actions]
        events: list[list[Event]] = [[] for _ in actions]
        finished = threading.Semaphore(0)

        def work(w: int, plan: Sequence[Action]) -> None:
            try:
                events[w] = interpret(plan, step, _MailboxTransport(w, box, states[w]))
            except _Aborted:
                pass
            except PipelineError as err:
                box.fail(err)
            except BaseException as err:  # noqa: BLE001 - reported by the calling thread
                failure = PipelineError(f"worker {w} failed after its actions: {type(err).__name__}: {err}")
                failure.__cause__ = err
                box.fail(failure)
            finally:
                states[w].done = True
                finished.release()

        for w, plan in enumerate(actions):
            self._thread(w).jobs.put(lambda w=w, plan=plan: work(w, plan))
        workers = {a.stage: w for w, plan in enumerate(actions) for a in plan}
        self._watch(box, states, finished, workers, step)
        if box.failed is not None:
            raise box.failed
        return sorted((e for worker in events for e in worker), key=lambda e: (e.start, e.worker))

    def _thread(self, w: int) -> _Thread:
        if w not in self._threads:
            self._threads[w] = _Thread(f"fxpipe-worker-{w}")
        return self._threads[w]

    def _watch(
        self,
        box: _Mailbox,
        states: list[_State],
        finished: threading.Semaphore,
        workers: dict[int, int],
        step: Step,
    ) -> None:
        """Wait for every worker; on a stuck one, fail the step and stop waiting for it."""
        remaining = len(states)
        abandoned: set[int] = set()
        while remaining > len(abandoned):
            if finished.acquire(timeout=min(_POLL, self.timeout)):
                remaining -= 1
                continue
            if box.failed is not None:
                continue
            stuck = self._stuck(states, workers, step)
            if stuck is not None:
                worker, error = stuck
                box.fail(error)
                if not states[worker].done:
                    abandoned.add(worker)
                    self._threads.pop(worker).retire()  # a fresh thread serves the next step
        # leave the abandoned threads to finish (or not) on their own

    def _stuck(self, states: list[_State], workers: dict[int, int], step: Step) -> tuple[int, PipelineError] | None:
        """The worker at the end of a chain of waits longer than the timeout, with the error
        naming it; None while every wait and action is within the timeout. ``workers``
        maps each stage to the worker that runs it."""
        now = time.monotonic()
        for w, state in enumerate(states):
            if state.done or state.action is None or now - state.since <= self.timeout:
                continue
            chain = []
            culprit = w
            seen = {w}
            while states[culprit].waiting_for is not None and not states[culprit].done:
                kind, edge, i = states[culprit].waiting_for
                src, dst = step.edge_ends[edge]
                producer = src if kind == ACT else dst
                what = "activation" if kind == ACT else "gradient"
                chain.append(f"stage {states[culprit].action.stage} waits {now - states[culprit].since:.1f} s for the {what} of micro-batch {i} from stage {producer}")
                nxt = workers.get(producer)
                if nxt is None or nxt in seen:
                    break
                seen.add(nxt)
                culprit = nxt
            action = states[culprit].action
            runner = step.runner(action)
            where = runner.name or str(runner.device)
            head = (
                f"stage {action.stage} on {where} has been running {action} (micro-batch {action.microbatch}) "
                f"for {now - states[culprit].since:.1f} s"
                if states[culprit].waiting_for is None
                else f"stage {action.stage} on {where} is stuck at {action} (micro-batch {action.microbatch})"
            )
            detail = f" ({'; '.join(chain)})" if chain else ""
            return culprit, PipelineError(
                f"{head}, longer than Plan.timeout = {self.timeout:g} s{detail}: the stage hangs or is too slow; "
                "raise Plan(timeout=...) if it is only slow",
                action.stage,
                action,
            )
        return None
