"""The per-rank executor: one rank walks its own action list of the shared schedule.

It wraps the same :class:`~fxpipe.runtime.stage.StageRunner` as the local executor and
adds only communication: ``F(s, i)`` gets micro-batch i's values (the model's inputs for
stage 0; received buffers or same-rank values for the rest), runs the stage and sends its
outputs; ``B(s, i)`` gets the gradients of those outputs, runs the stage's backward and
sends the gradients of its inputs back. Messages are planned by
:mod:`fxpipe.distributed.comm` from the edges' specs, so nothing about shapes is asked at
run time. Every wait goes through the :class:`~fxpipe.distributed.faults.Watchdog`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from fxpipe.distributed import comm
from fxpipe.distributed.faults import RankFailedError, Watchdog
from fxpipe.distributed.specs import ValueSpec
from fxpipe.runtime import inject
from fxpipe.runtime.context import StepContext
from fxpipe.runtime.stage import Grads, StageRunner
from fxpipe.schedules import Action
from fxpipe.timeline import Event


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
        self,
        actions: Sequence[Action],
        plan: comm.ActionMessages,
        inputs: Sequence[list],
        spec: Callable[[int, int], ValueSpec],
        ctx: StepContext,
        runners: dict[int, StageRunner],
        edge_ends: Sequence[tuple[int, int]],
        on_stage_done: Callable[[int], None] | None = None,
    ) -> list[Event]:
        """Run one step of this rank's ``actions``; return the recorded events.

        plan: this rank's messages for ``actions`` (see comm); inputs: per micro-batch, the
        model's flat inputs (used by stage 0); spec(edge, i): the edge's ValueSpec for
        micro-batch i; runners: this rank's stages (of the call's input signature) by
        index; edge_ends: (src, dst) stage per edge id; on_stage_done(s): called after a
        stage's last backward (data-parallel reduction starts there). The last stage's
        outputs and losses land in ``ctx``. Raises RankFailedError naming the failing rank
        and stage.
        """
        num_edges = len(edge_ends)
        events: list[Event] = []
        local: dict[tuple, Any] = {}  # values and gradients between stages of this rank
        received: dict[tuple, list[torch.Tensor]] = {}
        pending_recvs: dict[int, list[tuple[Any, int]]] = {}
        pending_sends: list[tuple[Any, int]] = []
        last_backward = {a.stage: k for k, a in enumerate(actions) if a.op != "F"}  # B, or the later of I and W
        cuda = self.device.type == "cuda"
        origin = time.perf_counter()
        faults = inject.armed()

        def peer_stages(recvs: Sequence[comm.Message], sends: Sequence[comm.Message] = ()) -> dict[int, int]:
            """For each peer rank of the messages, its stage at the other end of the edge:
            what a receive waits for (the producer of an activation, the consumer sending a
            gradient back), where a send goes (the consumer of an activation, the producer
            of a gradient's value)."""
            ends = [(m, 0 if m.kind == comm.ACT else 1) for m in recvs] + [(m, 1 if m.kind == comm.ACT else 0) for m in sends]
            return {m.peer: edge_ends[m.edge][end] for m, end in ends}

        def buffers(msg: comm.Message) -> list[torch.Tensor]:
            leaves = spec(msg.edge, msg.microbatch).leaves
            return [torch.empty(leaves[k].shape, dtype=leaves[k].dtype, device=self.device) for k in msg.leaves]

        def post(k: int, sends: list) -> None:
            """Post the receives of action k (if any) together with ``sends``."""
            recvs = []
            for msg in plan.recvs[k] if k < len(actions) else []:
                received[msg.key] = buffers(msg)
                recvs.append((msg, received[msg.key]))
            try:
                send_works, recv_works = comm.post(sends, recvs, num_edges)
            except RuntimeError as err:  # gloo refuses to post to a peer that is gone
                peers = sorted({msg.peer for msg, _ in sends + recvs})
                raise self.watchdog.lost(err, peers, peer_stages([m for m, _ in recvs], [m for m, _ in sends])) from err
            pending_sends.extend(send_works)
            pending_recvs.setdefault(k, []).extend(recv_works)

        def activation(edge: int, i: int) -> Any:
            if (comm.ACT, edge, i) in local:
                return local.pop((comm.ACT, edge, i))
            return spec(edge, i).build(received.pop((comm.ACT, edge, i), []))

        def gradients(edge: int, i: int) -> Grads:
            """The gradients of an edge value's leaves (None where none flows)."""
            if (comm.GRAD, edge, i) in local:
                return local.pop((comm.GRAD, edge, i))
            value_spec = spec(edge, i)
            full: Grads = [None] * len(value_spec.leaves)
            for pos, g in zip(value_spec.grads, received.pop((comm.GRAD, edge, i), [])):
                full[pos] = g
            return full

        def forward(k: int, action: Action) -> list:
            runner, i = runners[action.stage], action.microbatch
            values = [activation(edge, i) for edge in runner.recv]
            outs = runner.forward(i, inputs[i] if runner.index == 0 else (), values, ctx)
            remote = {msg.edge: msg for msg in plan.sends[k]}
            sends = []
            for edge, value in zip(runner.send, outs):
                if edge in remote:
                    msg = remote[edge]
                    tensors = _tensor_leaves(value)
                    _check_shapes(tensors, spec(edge, i), msg, self.rank, runner.index)
                    sends.append((msg, [t.detach().contiguous() for t in tensors]))
                if self.rank_of_stage(edge_ends[edge][1]) == self.rank:
                    local[(comm.ACT, edge, i)] = value
            return sends

        def backward(k: int, action: Action) -> list:
            runner, i = runners[action.stage], action.microbatch
            if action.op == "W":
                runner.backward_weight(i, ctx)
                return []
            run = runner.backward if action.op == "B" else runner.backward_input
            input_grads = run(i, [gradients(edge, i) for edge in runner.send], ctx)
            remote = {msg.edge: msg for msg in plan.sends[k]}
            sends = []
            for edge, grads in zip(runner.recv, input_grads):
                if edge in remote:
                    value_spec = spec(edge, i)
                    sends.append((remote[edge], [_grad_or_zeros(grads[pos], value_spec.leaves[pos], self.device) for pos in value_spec.grads]))
                else:
                    local[(comm.GRAD, edge, i)] = grads
            return sends

        if not self.fused and actions:
            post(0, [])
        previous_sends: list = []  # fused: sends wait to go out with the next receives
        for k, action in enumerate(actions):
            if self.fused:
                post(k, previous_sends)
            elif k + 1 < len(actions):
                post(k + 1, [])  # prefetch: the next action's inputs arrive while this one computes
            waited = time.perf_counter()
            self.watchdog.wait(
                pending_recvs.pop(k, []), lambda a=action: f"the inputs of {a}", stage=action.stage,
                peer_stages=peer_stages(plan.recvs[k]),
            )
            self.watchdog.running(str(action), action.stage)
            start = time.perf_counter()
            if start - waited > 1e-4:  # the inputs had not all arrived: the timeline shows the wait
                events.append(Event(self.worker, action.stage, action.microbatch, "recv", waited - origin, start - origin, str(self.device)))
            try:
                if faults is not None:
                    faults.fire(action, runners[action.stage].module, self.rank)
                sends = forward(k, action) if action.op == "F" else backward(k, action)
            except RankFailedError:
                raise
            except Exception as err:
                raise self._failed(action, err) from err
            if self.fused:
                previous_sends = sends
            else:
                post(len(actions), sends)
            if cuda:  # the action's kernels (and the NCCL receives they wait on) finish under the watchdog
                self.watchdog.wait([(_EventWork(self.device), self.rank)], lambda a=action: f"{a}'s kernels and the messages they wait on", stage=action.stage)
            events.append(
                Event(self.worker, action.stage, action.microbatch, action.op, start - origin, time.perf_counter() - origin, str(self.device))
            )
            if on_stage_done is not None and last_backward.get(action.stage) == k:
                on_stage_done(action.stage)
        if previous_sends:
            post(len(actions), previous_sends)
        self.watchdog.wait(pending_sends, lambda: "the step's last messages to be received")
        self.watchdog.running("the script's own code, between pipeline calls")
        return events

    def _failed(self, action: Action, err: BaseException) -> RankFailedError:
        return self.watchdog.report(
            f"rank {self.rank} (stage {action.stage}) failed in {action} (micro-batch {action.microbatch}): "
            f"{type(err).__name__}: {err}",
            self.rank,
            action.stage,
        )


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
