"""The per-rank executor: one rank walks its own action list of the shared schedule.

``F(s, i)`` takes micro-batch i's inputs (the model's, for stage 0; received buffers or
same-rank values for the rest), runs the stage and sends its outputs; ``B(s, i)`` takes
the gradients of those outputs, runs autograd through the stage alone (inputs are
detached leaves) and sends the gradients of its inputs back. Messages are planned by
:mod:`fxpipe.distributed.comm` from the edges' specs, so nothing about shapes is asked
at run time. Every wait goes through the :class:`~fxpipe.distributed.faults.Watchdog`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from fxpipe.distributed import comm
from fxpipe.distributed.faults import RankFailedError, Watchdog
from fxpipe.distributed.specs import ValueSpec
from fxpipe.schedules import Action
from fxpipe.streams import carries_grad, move, restored_rng, rng_state, wants_grad
from fxpipe.timeline import Event


@dataclass
class RankStage:
    """A stage this rank runs: its module on the rank's device and its edges (edge ids:
    ``recv`` in argument order after the model's inputs, ``send`` in output order).
    ``mutated_inputs``: argument positions the stage writes into in place."""

    index: int
    module: torch.nn.Module
    recv: list[int]
    send: list[int]
    num_model_inputs: int
    is_last: bool
    mutated_inputs: frozenset[int] = frozenset()


@dataclass
class RankResult:
    outputs: dict[int, Any] = field(default_factory=dict)  # micro-batch -> last stage's output
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)


class RankExecutor:
    """Runs this rank's action list for one step.

    stages: this rank's stages by index; device: where they run; rank_of_stage: which
    rank holds any stage (this replica); edge_ends: (src, dst) stage per edge id;
    fused: post ops NCCL's way (see comm); watchdog: waits with a deadline;
    worker: this rank's pipeline position (for the recorded timeline).
    """

    def __init__(
        self,
        stages: dict[int, RankStage],
        device: torch.device,
        rank: int,
        rank_of_stage: Callable[[int], int],
        edge_ends: Sequence[tuple[int, int]],
        watchdog: Watchdog,
        fused: bool,
        checkpoint: bool = False,
        worker: int = 0,
    ) -> None:
        self.worker = worker
        self.stages = stages
        self.device = device
        self.rank = rank
        self.rank_of_stage = rank_of_stage
        self.edge_ends = list(edge_ends)
        self.watchdog = watchdog
        self.fused = fused
        self.checkpoint = checkpoint

    def run(
        self,
        actions: Sequence[Action],
        plan: comm.ActionMessages,
        inputs: Sequence[list],
        spec: Callable[[int, int], ValueSpec],
        train: bool,
        loss_of: Callable[[int, Any], torch.Tensor] | None = None,
        on_stage_done: Callable[[int], None] | None = None,
    ) -> RankResult:
        """Run one step of this rank's ``actions``.

        plan: this rank's messages for ``actions`` (see comm); inputs: per micro-batch, the
        model's flat inputs (used by stage 0); spec(edge, i): the edge's ValueSpec for
        micro-batch i; loss_of(i, out): micro-batch i's weighted loss on the last stage;
        on_stage_done(s): called after a stage's last backward (data-parallel reduction
        starts there). Raises RankFailedError naming the failing rank and stage.
        """
        num_edges = len(self.edge_ends)
        result = RankResult()
        local: dict[tuple, Any] = {}  # values between stages of this rank
        received: dict[tuple, list[torch.Tensor]] = {}
        pending_recvs: dict[int, list[tuple[Any, int]]] = {}
        pending_sends: list[tuple[Any, int]] = []
        saved: dict[tuple[int, int], tuple] = {}
        last_backward = {a.stage: k for k, a in enumerate(actions) if a.op == "B"}
        grad_enabled = torch.is_grad_enabled()
        cuda = self.device.type == "cuda"
        origin = time.perf_counter()

        def buffers(msg: comm.Message) -> list[torch.Tensor]:
            value_spec = spec(msg.edge, msg.microbatch)
            return [torch.empty(value_spec.leaves[k].shape, dtype=value_spec.leaves[k].dtype, device=self.device) for k in msg.leaves]

        def post(k: int, sends: list) -> None:
            """Post the receives of action k (if any) together with ``sends``."""
            recvs = []
            for msg in plan.recvs[k] if k < len(actions) else []:
                received[msg.key] = buffers(msg)
                recvs.append((msg, received[msg.key]))
            send_works, recv_works = comm.post(sends, recvs, num_edges)
            pending_sends.extend(send_works)
            pending_recvs.setdefault(k, []).extend(recv_works)

        def value_in(kind: str, edge: int, i: int) -> Any:
            """An activation (built from its spec) or a gradient list, from this rank or received."""
            if (kind, edge, i) in local:
                return local.pop((kind, edge, i))
            tensors = received.pop((kind, edge, i), [])
            return spec(edge, i).build(tensors) if kind == comm.ACT else tensors

        def forward(k: int, action: Action) -> list:
            stage, i = self.stages[action.stage], action.microbatch
            args = [move(v, self.device, detach=True) for v in inputs[i]] if stage.index == 0 else []
            for edge in stage.recv:
                args.append(move(value_in(comm.ACT, edge, i), self.device, detach=True))
            rng = rng_state(self.device) if train and self.checkpoint else None
            with torch.set_grad_enabled(grad_enabled and not (train and self.checkpoint)):
                out = _call(stage, args)
            if stage.is_last:
                result.outputs[i] = pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, out) if train else out
                if train and loss_of is not None and not self.checkpoint:
                    result.losses[i] = loss_of(i, out)
            if train:
                saved[(stage.index, i)] = (args, None if (stage.is_last and not self.checkpoint) else out, rng)
            sends = []
            checkpointed = train and self.checkpoint and not stage.is_last and wants_grad(stage.module, args)
            for j, edge in enumerate(stage.send):
                if self.rank_of_stage(self.edge_ends[edge][1]) == self.rank:
                    # recomputed in backward: consumers on this rank must still ask for a gradient
                    local[(comm.ACT, edge, i)] = carries_grad(out[j]) if checkpointed else out[j]
            for msg in plan.sends[k]:
                tensors = _tensor_leaves(out[stage.send.index(msg.edge)])
                _check_shapes(tensors, spec(msg.edge, i), msg, self.rank, stage.index)
                sends.append((msg, [t.detach().contiguous() for t in tensors]))
            return sends

        def backward(k: int, action: Action) -> list:
            stage, i = self.stages[action.stage], action.microbatch
            args, out, rng = saved.pop((stage.index, i))
            if self.checkpoint:
                with restored_rng(self.device, rng), torch.enable_grad():  # the forward's random numbers
                    out = _call(stage, args)
                    if stage.is_last and loss_of is not None:
                        result.losses[i] = loss_of(i, out)
            tensors, grads = [], []
            if stage.is_last:
                loss = result.losses.get(i)
                if loss is not None and loss.requires_grad:
                    tensors.append(loss)
                    grads.append(None)
            else:
                for j, edge in enumerate(stage.send):
                    grad_leaves = value_in(comm.GRAD, edge, i)
                    outs = pytree.tree_leaves(out[j])
                    for pos, g in zip(spec(edge, i).grads, grad_leaves):
                        t = outs[pos]
                        if isinstance(t, torch.Tensor) and t.requires_grad and g is not None:
                            tensors.append(t)
                            grads.append(g)
            if tensors:
                torch.autograd.backward(tensors, grads if any(g is not None for g in grads) else None)
            if stage.is_last and i in result.losses:
                result.losses[i] = result.losses[i].detach()
            sends = []
            received_args = args[stage.num_model_inputs :] if stage.index == 0 else args
            remote = {msg.edge: msg for msg in plan.sends[k]}
            for edge, value in zip(stage.recv, received_args):
                value_spec = spec(edge, i)
                leaves = pytree.tree_leaves(value)
                grads_out = [_grad_or_zeros(leaves[pos], value_spec.leaves[pos]) for pos in value_spec.grads]
                if edge in remote:
                    sends.append((remote[edge], grads_out))
                else:
                    local[(comm.GRAD, edge, i)] = grads_out
            return sends

        if not self.fused and actions:
            post(0, [])
        previous_sends: list = []  # fused: sends wait to go out with the next receives
        for k, action in enumerate(actions):
            if self.fused:
                post(k, previous_sends)
            elif k + 1 < len(actions):
                post(k + 1, [])  # prefetch: the next action's inputs arrive while this one computes
            self.watchdog.wait(pending_recvs.pop(k, []), lambda a=action: f"the inputs of {a}")
            start = time.perf_counter()
            try:
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
                self.watchdog.wait([(_EventWork(self.device), self.rank)], lambda a=action: f"{a}'s kernels and the messages they wait on")
            result.events.append(
                Event(self.worker, action.stage, action.microbatch, action.op, start - origin, time.perf_counter() - origin, str(self.device))
            )
            if on_stage_done is not None and last_backward.get(action.stage) == k:
                on_stage_done(action.stage)
        if previous_sends:
            post(len(actions), previous_sends)
        self.watchdog.wait(pending_sends, lambda: "the step's last messages to be received")
        return result

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


def _call(stage: RankStage, args: list) -> Any:
    # an argument the stage writes into gets a copy: a leaf that requires grad cannot be mutated
    return stage.module(*[a.clone() if k in stage.mutated_inputs and isinstance(a, torch.Tensor) else a for k, a in enumerate(args)])


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


def _grad_or_zeros(leaf: Any, leaf_spec: Any) -> torch.Tensor:
    if isinstance(leaf, torch.Tensor) and leaf.grad is not None:
        return leaf.grad
    return torch.zeros(leaf_spec.shape, dtype=leaf_spec.dtype, device=leaf.device if isinstance(leaf, torch.Tensor) else "cpu")
