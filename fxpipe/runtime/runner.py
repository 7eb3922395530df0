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
- checkpointing: the forward runs without autograd and is recomputed in backward on
  copies of the buffers it updates (BatchNorm running statistics), so they change once
  per micro-batch as in eager;
- ``Plan(check_finite=True)``: every floating value it hands on, and every loss, is
  checked for NaN and Inf (:mod:`~fxpipe.runtime.finite`);
- the stage's extra arguments, named by role at compile time: ``rng_seed`` (what the
  stage's random ops draw from: the step's seed and the micro-batch's global index, the
  same in a recompute) and ``weight_grads`` (the list a stage whose backward is split
  into I and W keeps its deferred weight-gradient work in).

``backward`` is "B": input and weight gradients at once. ``backward_input`` ("I") and
``backward_weight`` ("W") split it for zero-bubble schedules.

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

from fxpipe.runtime import finite
from fxpipe.runtime.context import StepContext
from fxpipe.runtime.streams import carries_grad, leaves, move, wants_grad

Grads = list[torch.Tensor | None]


@dataclass
class StageRunner:
    """One stage, placed on its device, with the compile-time facts needed to run it.

    recv / send: edge ids of the stage's inputs after the model's own (in argument order)
    and of its output tuple; mutated_inputs: argument positions it writes in place;
    buffers_written: (owning module, name) of the buffers its forward updates in place;
    name: the logical device ("cpu:1") shown in timelines; extra_inputs: the roles of the
    stage's trailing arguments ("rng_seed", "weight_grads"), in order; check_finite: raise
    NonFiniteError on the first NaN/Inf handed on; edge_names: how messages name each
    edge id.
    """

    index: int
    module: torch.nn.Module
    device: torch.device
    num_model_inputs: int
    recv: list[int]
    send: list[int]
    is_last: bool
    mutated_inputs: frozenset[int] = frozenset()
    buffers_written: Sequence[tuple[torch.nn.Module, str]] = field(default_factory=list)
    name: str = ""
    checkpoint: bool = False
    extra_inputs: tuple[str, ...] = ()
    check_finite: bool = False
    edge_names: dict[int, str] = field(default_factory=dict)

    def forward(self, i: int, model_inputs: Sequence[Any], received: Sequence[Any], ctx: StepContext) -> list[Any]:
        """Run micro-batch ``i``; return the values for the send edges (``[]`` for the last
        stage, whose output and loss go into ``ctx``)."""
        recompute = ctx.train and self.checkpoint
        args = [move(v, self.device, detach=False) for v in model_inputs]
        args += [move(v, self.device, detach=ctx.train) for v in received]
        store: list | None = [] if "weight_grads" in self.extra_inputs else None
        args += self._extras(i, ctx, store)
        with torch.set_grad_enabled(ctx.grad_enabled and not recompute), ctx.autocast.applied():
            out = self._call(args, ctx, i)
            if self.is_last and ctx.train and ctx.loss_of is not None and not recompute:
                ctx.losses[i] = ctx.loss_of(i, out)
        if self.is_last:
            ctx.outputs[i] = _detached(out) if ctx.train else out
        if self.check_finite:
            self._check_forward(i, out, ctx)
        if ctx.train:
            ctx.saved[(self.index, i)] = (args, None if self.is_last and not recompute else out, store)
        if self.is_last:
            return []
        if recompute and wants_grad(self.module, args):
            # computed without autograd: consumers must still ask for the gradients the
            # recomputation in backward will need
            return [carries_grad(v) for v in out]
        return list(out)

    def backward(self, i: int, output_grads: Sequence[Grads], ctx: StepContext) -> list[Grads]:
        """"B": backpropagate micro-batch ``i`` through the stage, given the gradients of its
        outputs (one list per send edge); return the gradients of its received inputs."""
        input_grads, store = self._backprop(i, output_grads, ctx)
        for work in store or ():
            work()
        return input_grads

    def backward_input(self, i: int, output_grads: Sequence[Grads], ctx: StepContext) -> list[Grads]:
        """"I": like ``backward``, but the weight gradients of the ops that can defer them
        wait for ``backward_weight``; only what those need is kept until then."""
        input_grads, store = self._backprop(i, output_grads, ctx)
        ctx.deferred[(self.index, i)] = store or []
        return input_grads

    def backward_weight(self, i: int, ctx: StepContext) -> None:
        """"W": the weight gradients ``backward_input`` deferred for micro-batch ``i``."""
        for work in ctx.deferred.pop((self.index, i)):
            work()

    def _backprop(self, i: int, output_grads: Sequence[Grads], ctx: StepContext) -> tuple[list[Grads], list | None]:
        args, out, store = ctx.saved.pop((self.index, i))
        if self.checkpoint:
            # random ops draw from the same (seed, key) as in the forward: the same masks
            with torch.enable_grad(), ctx.autocast.applied(), self._buffers_restored():
                out = self._call(args, ctx, i)
                if self.is_last and ctx.loss_of is not None:
                    ctx.losses[i] = ctx.loss_of(i, out)
            if self.check_finite and i in ctx.losses:
                finite.check(ctx.losses[i], f"the loss of micro-batch {i}")
        tensors: list[torch.Tensor] = []
        grads: list[torch.Tensor | None] = []
        if self.is_last:
            loss = ctx.losses.get(i)
            if loss is not None and loss.requires_grad:
                tensors.append(loss)
                grads.append(None)
        else:
            for value, edge_grads in zip(out, output_grads):
                for t, g in zip(leaves(value), edge_grads):
                    if isinstance(t, torch.Tensor) and t.requires_grad and g is not None:
                        tensors.append(t)
                        grads.append(g if g.device == t.device else g.to(t.device, non_blocking=True))
        if tensors:
            torch.autograd.backward(tensors, grads if any(g is not None for g in grads) else None)
        if self.is_last and i in ctx.losses:
            ctx.losses[i] = ctx.losses[i].detach()
        received = args[self.num_model_inputs : len(args) - len(self.extra_inputs)]
        input_grads = [[t.grad if isinstance(t, torch.Tensor) else None for t in leaves(v)] for v in received]
        if self.check_finite:
            for edge, grads in zip(self.recv, input_grads):
                finite.check(grads, f"the gradient stage {self.index} sends back on {self._edge(edge)}", edge)
        return input_grads, store

    def _check_forward(self, i: int, out: Any, ctx: StepContext) -> None:
        if not self.is_last:
            for edge, value in zip(self.send, out):
                finite.check(value, f"the activation stage {self.index} sends on {self._edge(edge)}", edge)
            return
        finite.check(out, f"the model's output (stage {self.index})")
        if i in ctx.losses:
            finite.check(ctx.losses[i], f"the loss of micro-batch {i}")

    def _edge(self, edge: int) -> str:
        return self.edge_names.get(edge, f"edge {edge}")

    def _extras(self, i: int, ctx: StepContext, store: list | None) -> list[Any]:
        return [ctx.rng_seed(i) if role == "rng_seed" else store for role in self.extra_inputs]

    def _call(self, args: list[Any], ctx: StepContext, i: int) -> Any:
        if self.mutated_inputs:
            args = [a.clone() if k in self.mutated_inputs and isinstance(a, torch.Tensor) else a for k, a in enumerate(args)]
        if self.is_last:
            with ctx.loss_scaling(i):
                return self.module(*args)
        return self.module(*args)

    @contextlib.contextmanager
    def _buffers_restored(self) -> Iterator[None]:
        """The recomputation updates copies of the buffers (the forward already updated
        them); the originals are put back untouched, so no autograd version moves."""
        originals = [owner._buffers[name] for owner, name in self.buffers_written]
        for (owner, name), buffer in zip(self.buffers_written, originals):
            owner._buffers[name] = buffer.clone()
        try:
            yield
        finally:
            for (owner, name), buffer in zip(self.buffers_written, originals):
                owner._buffers[name] = buffer


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    return pytree.tree_map_only(torch.Tensor, lambda t: t.detach(), value)
