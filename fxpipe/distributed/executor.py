"""The per-rank executor: one rank walks its own action list of the shared schedule.

It runs the shared action loop (:func:`~fxpipe.runtime.interpret.interpret`) over the same
:class:`~fxpipe.runtime.runner.StageRunner` as the local executor; what it adds is the
transport: ``F(s, i)`` gets micro-batch i's values (received buffers, or same-rank values),
and its outputs are sent; ``B(s, i)`` gets the gradients of those outputs, and the
gradients of its inputs are sent back. Messages are planned by
:mod:`fxpipe.distributed.comm` from the edges' specs, so nothing about shapes is asked at
run time (a value whose shape differs from its spec is an error before it is sent). Every
wait goes through the :class:`~fxpipe.distributed.faults.Watchdog`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from fxpipe.distributed import comm
from fxpipe.distributed.faults import RankFailedError, Watchdog
from fxpipe.distributed.specs import ValueSpec
from fxpipe.inspection.timeline import Event
from fxpipe.runtime.interpret import ACT, GRAD, Step, inbound, interpret, outbound
from fxpipe.runtime.runner import Grads, StageRunner
from fxpipe.schedules import Action


class RankExecutor:
    """Runs this rank's action list for one step.

    device: where this rank's stages run; rank_of_stage: which rank holds any stage (this
    replica); fused: post ops NCCL's way (see comm); watchdog: waits with a deadline;
    worker: this rank's pipeline position (for the recorded timeline).
    """

    def __init__(
        self,
        device: torch.device,
        rank: int,
        rank_of_stage: Callable[[int], int],
        watchdog: Watchdog,
        fused: bool,
        worker: int = 0,
    ) -> None:
        self.device = device
        self.rank = rank
        self.rank_of_stage = rank_of_stage
        self.watchdog = watchdog
        self.fused = fused
        self.worker = worker

    def run(
        self, actions: Sequence[Action], plan: comm.ActionMessages, spec: Callable[[int, int], ValueSpec], step: Step
    ) -> list[Event]:
        """Run one step of this rank's ``actions`` over ``step.runners`` (this rank's stages
        of the call's input signature); return the recorded events.

        plan: this rank's messages for ``actions`` (see comm); spec(edge, i): the edge's
        ValueSpec for micro-batch i. The last stage's outputs and losses land in
        ``step.ctx``. Raises RankFailedError naming the failing rank and stage.
        """
        return interpret(actions, step, _RankTransport(self, len(actions), plan, spec, step.edge_ends))


class _RankTransport:
    """One step of one rank: values from and to other ranks as point-to-point messages,
    between this rank's own stages through a dict; every wait under the watchdog.

    gloo prefetches: the receives of action k+1 are posted before action k runs and sends
    go out as soon as their action ends. NCCL (``fused``): the sends of action k go out
    with the receives of action k+1, as one group (see comm).
    """

    def __init__(
        self,
        executor: RankExecutor,
        num_actions: int,
        plan: comm.ActionMessages,
        spec: Callable[[int, int], ValueSpec],
        edge_ends: Sequence[tuple[int, int]],
    ) -> None:
        self.executor = executor
        self.worker, self.rank = executor.worker, executor.rank
        self.num_actions = num_actions
        self.plan = plan
        self.spec = spec
        self.edge_ends = edge_ends
        self.local: dict[tuple, Any] = {}  # values and gradients between stages of this rank
        self.received: dict[tuple, list[torch.Tensor]] = {}
        self.pending_recvs: dict[int, list[tuple[Any, int]]] = {}
        self.pending_sends: list[tuple[Any, int]] = []
        self.held_sends: list = []  # fused: sends wait to go out with the next receives

    # ------------------------------------------------------------ the loop's calls
    def start(self, k: int, action: Action, runner: StageRunner) -> contextlib.AbstractContextManager:
        if self.executor.fused:
            self._post(k, self.held_sends)
        else:
            if k == 0:
                self._post(0, [])
            if k + 1 < self.num_actions:
                self._post(k + 1, [])  # prefetch: the next action's inputs arrive while this one computes
        return contextlib.nullcontext()

    def receive(self, k: int, action: Action, runner: StageRunner) -> list[Any]:
        self.executor.watchdog.wait(
            self.pending_recvs.pop(k, []), lambda: f"the inputs of {action}", stage=action.stage,
            peer_stages=self._peer_stages(self.plan.recvs[k]),
        )
        self.executor.watchdog.running(str(action), action.stage)
        kind, edges = inbound(action, runner.recv, runner.send)
        take = self._activation if kind == ACT else self._gradients
        return [take(edge, action.microbatch) for edge in edges]

    def send(self, k: int, action: Action, runner: StageRunner, results: list[Any]) -> None:
        kind, edges = outbound(action, runner.recv, runner.send)
        remote = {msg.edge: msg for msg in self.plan.sends[k]}
        sends = []
        for edge, value in zip(edges, results):
            if edge in remote:
                sends.append((remote[edge], self._tensors(kind, value, remote[edge], runner.index)))
            if kind == GRAD and edge not in remote:
                self.local[(GRAD, edge, action.microbatch)] = value
            elif kind == ACT and self.executor.rank_of_stage(self.edge_ends[edge][1]) == self.rank:
                self.local[(ACT, edge, action.microbatch)] = value
        if self.executor.fused:
            self.held_sends = sends
        else:
            self._post(self.num_actions, sends)

    def settle(self, k: int, action: Action, runner: StageRunner) -> None:
        if self.executor.device.type == "cuda":  # the kernels (and the NCCL receives they wait on) finish under the watchdog
            self.executor.watchdog.wait([(_EventWork(self.executor.device), self.rank)], lambda: f"{action}'s kernels and the messages they wait on", stage=action.stage)

    def failed(self, action: Action, runner: StageRunner, err: Exception) -> BaseException:
        if isinstance(err, RankFailedError):
            return err
        return self.executor.watchdog.report(
            f"rank {self.rank} (stage {action.stage}) failed in {action} (micro-batch {action.microbatch}): "
            f"{type(err).__name__}: {err}",
            self.rank,
            action.stage,
        )

    def finish(self) -> None:
        if self.held_sends:
            self._post(self.num_actions, self.held_sends)
        self.executor.watchdog.wait(self.pending_sends, lambda: "the step's last messages to be received")
        self.executor.watchdog.running("the script's own code, between pipeline calls")

    def label(self, runner: StageRunner) -> str:
        return str(self.executor.device)

    # ------------------------------------------------------------ messages
    def _peer_stages(self, recvs: Sequence[comm.Message], sends: Sequence[comm.Message] = ()) -> dict[int, int]:
        """For each peer rank of the messages, its stage at the other end of the edge:
        what a receive waits for (the producer of an activation, the consumer sending a
        gradient back), where a send goes (the consumer of an activation, the producer
        of a gradient's value)."""
        ends = [(m, 0 if m.kind == ACT else 1) for m in recvs] + [(m, 1 if m.kind == ACT else 0) for m in sends]
        return {m.peer: self.edge_ends[m.edge][end] for m, end in ends}

    def _post(self, k: int, sends: list) -> None:
        """Post the receives of action k (if any) together with ``sends``."""
        recvs = []
        for msg in self.plan.recvs[k] if k < self.num_actions else []:
            leaves = self.spec(msg.edge, msg.microbatch).leaves
            self.received[msg.key] = [torch.empty(leaves[j].shape, dtype=leaves[j].dtype, device=self.executor.device) for j in msg.leaves]
            recvs.append((msg, self.received[msg.key]))
        try:
            send_works, recv_works = comm.post(sends, recvs, len(self.edge_ends))
        except RuntimeError as err:  # gloo refuses to post to a peer that is gone
            peers = sorted({msg.peer for msg, _ in sends + recvs})
            raise self.executor.watchdog.lost(err, peers, self._peer_stages([m for m, _ in recvs], [m for m, _ in sends])) from err
        self.pending_sends.extend(send_works)
        self.pending_recvs.setdefault(k, []).extend(recv_works)

    def _activation(self, edge: int, i: int) -> Any:
        if (ACT, edge, i) in self.local:
            return self.local.pop((ACT, edge, i))
        return self.spec(edge, i).build(self.received.pop((ACT, edge, i), []))

    def _gradients(self, edge: int, i: int) -> Grads:
        """The gradients of an edge value's leaves (None where none flows)."""
        if (GRAD, edge, i) in self.local:
            return self.local.pop((GRAD, edge, i))
        value_spec = self.spec(edge, i)
        full: Grads = [None] * len(value_spec.leaves)
        for pos, g in zip(value_spec.grads, self.received.pop((GRAD, edge, i), [])):
            full[pos] = g
        return full

    def _tensors(self, kind: str, value: Any, msg: comm.Message, stage: int) -> list[torch.Tensor]:
        """What travels of an activation (its tensors, after a shape check) or of an input's
        gradients (zeros where a leaf got none)."""
        value_spec = self.spec(msg.edge, msg.microbatch)
        if kind == GRAD:
            return [_grad_or_zeros(value[pos], value_spec.leaves[pos], self.executor.device) for pos in value_spec.grads]
        tensors = _tensor_leaves(value)
        _check_shapes(tensors, value_spec, msg, self.rank, stage)
        return [t.detach().contiguous() for t in tensors]


class _EventWork:
    """The work queued so far on a CUDA stream, shaped like a c10d Work for the watchdog."""

    def __init__(self, device: torch.device) -> None:
        self.event = torch.cuda.Event()
        self.event.record(torch.cuda.current_stream(device))

    def is_completed(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        self.event.synchronize()


def _tensor_leaves(value: Any) -> list[torch.Tensor]:
    return [leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]


def _check_shapes(tensors: list[torch.Tensor], value_spec: ValueSpec, msg: comm.Message, rank: int, stage: int) -> None:
    expected = [value_spec.leaves[k] for k in msg.leaves]
    got = [(tuple(t.shape), t.dtype) for t in tensors]
    want = [(leaf.shape, leaf.dtype) for leaf in expected]
    if got != want:
        raise RuntimeError(
            f"stage {stage} produced {got} on edge {msg.edge} for micro-batch {msg.microbatch}, but its "
            f"fake run predicted {want}: the stage's output shapes depend on the data, which a "
            "pipeline across processes cannot send without knowing them in advance"
        )


def _grad_or_zeros(grad: torch.Tensor | None, leaf_spec: Any, device: torch.device) -> torch.Tensor:
    if grad is not None:
        return grad
    return torch.zeros(leaf_spec.shape, dtype=leaf_spec.dtype, device=device)
