"""The local executor: one thread per pipeline worker, interpreting the schedule's action lists.

Each worker walks its own list in order. ``F(s, i)`` waits for micro-batch i's values
from the stages feeding stage s, runs the stage module and posts its outputs for the
consumers; ``B(s, i)`` waits for the gradients of those outputs, runs autograd through
the stage and posts the gradients of its inputs back to the producers. Values cross
workers through a mailbox; between stages they are detached, so each stage's backward
is its own autograd call and stages overlap for real (PyTorch releases the GIL inside
ops; on CUDA each worker has its own stream).

The executor knows stages only as modules, devices and edge lists: it imports no pass.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from fxpipe.schedules import Action
from fxpipe.streams import WorkerStream, carries_grad, move, restored_rng, rng_state, wants_grad
from fxpipe.timeline import Event


class PipelineError(RuntimeError):
    """A stage failed while running; the message names the stage, the action and the cause."""


@dataclass
class RuntimeStage:
    """What the executor needs of a stage.

    recv: the edge id of each forward argument after the model inputs;
    send: the edge id of each element of the stage's output tuple.
    """

    index: int
    module: torch.nn.Module
    device: torch.device
    num_model_inputs: int
    recv: list[int]
    send: list[int]
    is_last: bool
    mutated_inputs: frozenset[int] = frozenset()
    name: str = ""  # the logical device ("cpu:1") shown in timelines

    def __call__(self, args: list) -> Any:
        # a stage that writes into its input in place gets a copy (a leaf can't be mutated)
        args = [a.clone() if k in self.mutated_inputs and isinstance(a, torch.Tensor) else a for k, a in enumerate(args)]
        return self.module(*args)


@dataclass
class StepResult:
    outputs: list[Any]
    losses: list[torch.Tensor | None]
    events: list[Event] = field(default_factory=list)


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

    def take(self, key: tuple) -> tuple[Any, Any]:
        with self.cond:
            while key not in self.items:
                if self.failed is not None:
                    raise _Aborted
                self.cond.wait(timeout=1.0)
            return self.items.pop(key)

    def fail(self, err: BaseException) -> None:
        with self.cond:
            if self.failed is None:
                self.failed = err
            self.cond.notify_all()


class _Aborted(Exception):
    """Another worker failed: stop quietly, the first failure is reported."""


class LocalExecutor:
    """Runs action lists over stages in one process (threads; CUDA streams where present)."""

    def __init__(self, stages: Sequence[RuntimeStage], checkpoint: bool = False) -> None:
        self.stages = list(stages)
        self.checkpoint = checkpoint

    def run(
        self,
        actions: Sequence[Sequence[Action]],
        inputs: Sequence[list],
        train: bool,
        loss_of: Callable[[int, Any], torch.Tensor] | None = None,
        record: bool = False,
    ) -> StepResult:
        """Run one step.

        actions: one list per worker. inputs: per micro-batch, the model's flat inputs.
        train: detach between stages and run the B actions; otherwise values keep their
        autograd history across stages (so a caller may backpropagate through the output).
        loss_of(i, output): micro-batch i's (already weighted) loss from the last stage's
        output. Returns the last stage's outputs and losses per micro-batch.
        Raises PipelineError naming the failing stage and action.
        """
        m = len(inputs)
        box = _Mailbox()
        saved: dict[tuple[int, int], tuple] = {}
        outputs: list[Any] = [None] * m
        losses: list[torch.Tensor | None] = [None] * m
        events: list[Event] = []
        grad_enabled = torch.is_grad_enabled() or train
        origin = time.perf_counter()

        def forward(stream: WorkerStream, stage: RuntimeStage, i: int) -> float:
            args = [move(v, stage.device, detach=train) for v in inputs[i]] if stage.index == 0 else []
            for edge in stage.recv:
                value, event = box.take(("act", edge, i))
                args.append(move(stream.receive(value, event), stage.device, detach=train))
            began = time.perf_counter()
            rng = rng_state(stage.device) if train and self.checkpoint else None
            with torch.set_grad_enabled(grad_enabled and not (train and self.checkpoint)):
                out = stage(args)
            if stage.is_last:
                outputs[i] = _detached(out) if train else out
                if train and loss_of is not None:
                    if self.checkpoint:
                        out = None  # recomputed in backward
                    else:
                        losses[i] = loss_of(i, out)
            if train:
                saved[(stage.index, i)] = (args, out, rng)
            if not stage.is_last:
                sent = out
                if train and self.checkpoint and wants_grad(stage.module, args):
                    # computed without autograd: tell consumers which values will carry a
                    # gradient once the stage recomputes them in backward
                    sent = [carries_grad(v) for v in out]
                event = stream.record()
                for edge, value in zip(stage.send, sent):
                    box.put(("act", edge, i), value, event)
            return began

        def backward(stream: WorkerStream, stage: RuntimeStage, i: int) -> float:
            args, out, rng = saved.pop((stage.index, i))
            received_grads = [box.take(("grad", edge, i)) for edge in stage.send] if not stage.is_last else []
            began = time.perf_counter()
            if self.checkpoint:
                with restored_rng(stage.device, rng), torch.enable_grad():
                    out = stage(args)
                    if stage.is_last and loss_of is not None:
                        losses[i] = loss_of(i, out)
            tensors, grads = [], []
            if stage.is_last:
                loss = losses[i]
                if loss is not None and loss.requires_grad:
                    tensors.append(loss)
                    grads.append(None)
            else:
                for k, (grad, event) in enumerate(received_grads):
                    grad = stream.receive(grad, event)
                    for t, g in zip(pytree.tree_leaves(out[k]), pytree.tree_leaves(grad)):
                        if isinstance(t, torch.Tensor) and t.requires_grad and isinstance(g, torch.Tensor):
                            tensors.append(t)
                            grads.append(g.to(t.device, non_blocking=True))
            if tensors:
                torch.autograd.backward(tensors, grads if any(g is not None for g in grads) else None)
            event = stream.record()
            received = args[stage.num_model_inputs :] if stage.index == 0 else args
            for edge, value in zip(stage.recv, received):
                grad = pytree.tree_map(lambda t: t.grad if isinstance(t, torch.Tensor) else None, value)
                box.put(("grad", edge, i), grad, event)
            if stage.is_last and losses[i] is not None:
                losses[i] = losses[i].detach()
            return began

        def work(w: int, plan: Sequence[Action]) -> None:
            stream = None
            try:
                for action in plan:
                    stage = self.stages[action.stage]
                    if stream is None:
                        stream = WorkerStream(stage.device)
                    waited = time.perf_counter()
                    with stream.active():
                        if action.op == "F":
                            start = forward(stream, stage, action.microbatch)
                        else:
                            start = backward(stream, stage, action.microbatch)
                    if record:
                        stream.synchronize()
                        device = stage.name or str(stage.device)
                        if start - waited > 1e-4:  # time spent waiting for a value or gradient
                            events.append(Event(w, action.stage, action.microbatch, "recv", waited - origin, start - origin, device))
                        events.append(Event(w, action.stage, action.microbatch, action.op, start - origin, time.perf_counter() - origin, device))
                if stream is not None:
                    stream.synchronize()
            except _Aborted:
                return
            except BaseException as err:  # noqa: BLE001 - reported by the caller thread
                failure = PipelineError(
                    f"stage {action.stage} on {self.stages[action.stage].device} failed in {action} "
                    f"(micro-batch {action.microbatch}): {type(err).__name__}: {err}"
                )
                failure.__cause__ = err
                box.fail(failure)

        threads = [threading.Thread(target=work, args=(w, plan), name=f"fxpipe-worker-{w}", daemon=True) for w, plan in enumerate(actions)]
        if len(threads) == 1:
            work(0, actions[0])
        else:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        if box.failed is not None:
            raise box.failed
        return StepResult(outputs, losses, sorted(events, key=lambda e: (e.start, e.worker)))


def _detached(value: Any) -> Any:
    return pytree.tree_map_only(torch.Tensor, lambda t: t.detach(), value)
