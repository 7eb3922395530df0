"""``StageRunner``: one stage's forward and backward for one micro-batch.

Both executors wrap the same runner: the local one hands the values it returns to other
threads through mailboxes, the distributed one sends them to other ranks. The runner owns
everything about running a stage once:

- the stage boundary: received values become fresh autograd leaves (``detach``), so each
  stage's backward is its own autograd call; the model's own inputs (stage 0) are used as
  given (the pipeline made each micro-batch piece that needs a gradient a leaf already);
- inputs the stage writes into in place are copied first (a leaf cannot be mutated);
- the caller's grad mode and autocast state (worker threads do not inherit them);
- the loss of the last stage;
- checkpointing: the forward runs without autograd and is recomputed in backward, with
  the buffers it updates (BatchNorm running statistics) restored after the recompute, so
  they change once per micro-batch as in eager.

Gradients travel as one list per edge, aligned with the edge value's pytree leaves
(``None`` where a leaf carries no gradient).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from fxpipe.runtime.context import StepContext
from fxpipe.runtime.streams import carries_grad, move, restored_rng, rng_state, wants_grad

Grads = list[torch.Tensor | None]


@dataclass
class StageRunner:
    """One stage, placed on its device, with the compile-time facts needed to run it.

    recv / send: edge ids of the stage's inputs after the model's own (in argument order)
    and of its output tuple; mutated_inputs: argument positions it writes in place;
    buffers_written: buffers its forward updates in place (restored after a recompute);
    name: the logical device ("cpu:1") shown in timelines.
    """

    index: int
    module: torch.nn.Module
    device: torch.device
    num_model_inputs: int
    recv: list[int]
    send: list[int]
    is_last: bool
    mutated_inputs: frozenset[int] = frozenset()
    buffers_written: Sequence[torch.Tensor] = field(default_factory=list)
    name: str = ""
    checkpoint: bool = False

    def forward(self, i: int, model_inputs: Sequence[Any], received: Sequence[Any], ctx: StepContext) -> list[Any]:
        """Run micro-batch ``i``; return the values for the send edges (``[]`` for the last
        stage, whose output and loss go into ``ctx``)."""
        recompute = ctx.train and self.checkpoint
        args = [move(v, self.device, detach=False) for v in model_inputs]
        args += [move(v, self.device, detach=ctx.train) for v in received]
        rng = rng_state(self.device) if recompute else None
        with torch.set_grad_enabled(ctx.grad_enabled and not recompute), ctx.autocast.applied():
            out = self._call(args)
            if self.is_last and ctx.train and ctx.loss_of is not None and not recompute:
                ctx.losses[i] = ctx.loss_of(i, out)
        if self.is_last:
            ctx.outputs[i] = _detached(out) if ctx.train else out
        if ctx.train:
            ctx.saved[(self.index, i)] = (args, None if self.is_last and not recompute else out, rng)
        if self.is_last:
            return []
        if recompute and wants_grad(self.module, args):
            # computed without autograd: consumers must still ask for the gradients the
            # recomputation in backward will need
            return [carries_grad(v) for v in out]
        return list(out)

    def backward(self, i: int, output_grads: Sequence[Grads], ctx: StepContext) -> list[Grads]:
        """Backpropagate micro-batch ``i`` through the stage, given the gradients of its
        outputs (one list per send edge); return the gradients of its received inputs."""
        args, out, rng = ctx.saved.pop((self.index, i))
        if self.checkpoint:
            with restored_rng(self.device, rng), torch.enable_grad(), ctx.autocast.applied(), self._buffers_restored():
                out = self._call(args)
                if self.is_last and ctx.loss_of is not None:
                    ctx.losses[i] = ctx.loss_of(i, out)
        tensors: list[torch.Tensor] = []
        grads: list[torch.Tensor | None] = []
        if self.is_last:
            loss = ctx.losses.get(i)
            if loss is not None and loss.requires_grad:
                tensors.append(loss)
                grads.append(None)
        else:
            for value, edge_grads in zip(out, output_grads):
                for t, g in zip(pytree.tree_leaves(value), edge_grads):
                    if isinstance(t, torch.Tensor) and t.requires_grad and g is not None:
                        tensors.append(t)
                        grads.append(g if g.device == t.device else g.to(t.device, non_blocking=True))
        if tensors:
            torch.autograd.backward(tensors, grads if any(g is not None for g in grads) else None)
        if self.is_last and i in ctx.losses:
            ctx.losses[i] = ctx.losses[i].detach()
        return [
            [t.grad if isinstance(t, torch.Tensor) else None for t in pytree.tree_leaves(value)]
            for value in args[self.num_model_inputs :]
        ]

    def _call(self, args: list[Any]) -> Any:
        if self.mutated_inputs:
            args = [a.clone() if k in self.mutated_inputs and isinstance(a, torch.Tensor) else a for k, a in enumerate(args)]
        return self.module(*args)

    @contextlib.contextmanager
    def _buffers_restored(self) -> Iterator[None]:
        """The recomputation's buffer updates are undone: the forward already made them."""
        saved = [b.clone() for b in self.buffers_written]
        try:
            yield
        finally:
            with torch.no_grad():
                for buffer, value in zip(self.buffers_written, saved):
                    buffer.copy_(value)


def _detached(value: Any) -> Any:
    return pytree.tree_map_only(torch.Tensor, lambda t: t.detach(), value)
