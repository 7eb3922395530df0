"""``StageRunner``: one stage's forward and backward for one micro-batch.

Both executors wrap the same runner: the local one hands the values it returns to other
threads through mailboxes, the distributed one sends them to other ranks. The runner owns
everything about running a stage once:

- the stage boundary: received values become fresh autograd leaves (``detach``), so each
  stage's backward is its own autograd call; the model's own inputs (stage 0) are used as
  given (the pipeline made each micro-batch piece that needs a gradient a leaf already);
  in a training step a stage hands on detached values and keeps its outputs only as
  handles into its autograd graph, their memory released (the consumers hold the values);
- inputs the stage writes into in place are copied first (a leaf cannot be mutated);
- the caller's grad mode and autocast state (worker threads do not inherit them);
- the loss of the last stage;
- checkpointing: the forward runs without autograd and is recomputed in backward on
  copies of the buffers it updates (BatchNorm running statistics), so they change once
  per micro-batch as in eager; ``checkpoint="selective"`` keeps the costly ops' outputs
  and recomputes only the rest (:mod:`~fxpipe.runtime.recompute`); ``offload`` sends
  the saved activations of a CUDA stage to host memory until the backward
  (:mod:`~fxpipe.runtime.offload`);
- what it keeps for backward, measured in a training step (:mod:`~fxpipe.runtime.memory`):
  autograd's saved tensors, the inputs and outputs it holds, what a deferred W holds;
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
from torch import nn

from fxpipe.runtime import finite
from fxpipe.runtime.compiled import CompiledStage, compile_options
from fxpipe.runtime.context import StepContext
from fxpipe.runtime.memory import StageMemory, storages
from fxpipe.runtime.offload import Offload
from fxpipe.runtime.recompute import SelectiveRecompute
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
    edge id; checkpoint: False (keep the activations), True (recompute the forward in
    backward) or "selective" (keep the costly ops' outputs, recompute the rest); offload:
    where saved activations wait for the backward in host memory (CUDA stages);
    compiled: the module under ``torch.compile`` (``Plan(compile=...)``), called instead
    of it; split_backward: the schedule runs the backward as "I" and "W" (the weight
    gradients wait in a store: the graph's own "weight_grads" argument when it defers them
    op by op, the compiled stage's when it splits its compiled backward graph).
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
    checkpoint: bool | str = False
    extra_inputs: tuple[str, ...] = ()
    check_finite: bool = False
    edge_names: dict[int, str] = field(default_factory=dict)
    offload: Offload | None = None
    compiled: CompiledStage | None = None
    split_backward: bool = False
    # per output leaf, whether its memory may go once sent (learnt in a measured step)
    _releasable: list[bool] | None = field(default=None, init=False, repr=False)

    def forward(self, i: int, model_inputs: Sequence[Any], received: Sequence[Any], ctx: StepContext) -> list[Any]:
        """Run micro-batch ``i``; return the values for the send edges (``[]`` for the last
        stage, whose output and loss go into ``ctx``)."""
        recompute = ctx.train and bool(self.checkpoint)
        args = [move(v, self.device, detach=False) for v in model_inputs]
        args += [move(v, self.device, detach=ctx.train) for v in received]
        store: list | None = [] if self.split_backward else None
        args += self._extras(i, ctx, store)
        selective = SelectiveRecompute() if recompute and self.checkpoint == "selective" else None
        memory = self.memory_of(ctx)
        out = self._forward(i, args, ctx, recompute, selective, memory)
        if self.is_last:
            ctx.outputs[i] = _detached(out) if ctx.train else out
        if self.check_finite:
            self._check_forward(i, out, ctx)
        handed = list(out) if not self.is_last else []
        if ctx.train:
            # a recomputed stage makes its outputs again in backward: only its inputs wait
            kept = None if self.is_last or recompute else out
            if kept is not None and memory is not None:
                self._releasable = _releasable(kept, memory.saved_storages(i))
            if kept is not None and self._releasable is not None:
                handed = [move(v, self.device, detach=True) for v in out]
                _release_data(kept, self._releasable)
            ctx.saved[(self.index, i)] = (args, kept, store, selective)
            if memory is not None:
                memory.hold(i, (args, kept, selective.kept if selective is not None else ()))
            if selective is not None:
                selective.kept = []
        if recompute and handed and wants_grad(self.module, args):
            # computed without autograd: consumers must still ask for the gradients the
            # recomputation in backward will need
            return [carries_grad(v) for v in out]
        return handed

    def _forward(self, i: int, args: list[Any], ctx: StepContext, recompute: bool, selective: SelectiveRecompute | None, memory: StageMemory | None) -> Any:
        """The stage's forward (and the last stage's loss) under the call's grad mode and
        autocast: recorded for backward, without autograd (recomputed later), or keeping
        only the costly ops' outputs (``selective``)."""
        if selective is not None:
            how = selective.forward()
        elif memory is not None and not recompute:
            how = memory.saving(i, self.offload)
        else:
            how = contextlib.nullcontext()
        with torch.set_grad_enabled(ctx.grad_enabled and not recompute), ctx.autocast.applied(), how:
            out = self._call(args, ctx, i)
            if self.is_last and ctx.train and ctx.loss_of is not None and not recompute:
                ctx.losses[i] = ctx.loss_of(i, out)
        return out

    def backward(self, i: int, output_grads: Sequence[Grads], ctx: StepContext) -> list[Grads]:
        """"B": backpropagate micro-batch ``i`` through the stage, given the gradients of its
        outputs (one list per send edge); return the gradients of its received inputs."""
        input_grads, store = self._backprop(i, output_grads, ctx, defer=False)
        for work in store or ():
            work()
        return input_grads

    def backward_input(self, i: int, output_grads: Sequence[Grads], ctx: StepContext) -> list[Grads]:
        """"I": like ``backward``, but the weight gradients of the ops that can defer them
        wait for ``backward_weight``; only what those need is kept until then."""
        input_grads, store = self._backprop(i, output_grads, ctx, defer=True)
        ctx.deferred[(self.index, i)] = store or []
        memory = self.memory_of(ctx)
        if memory is not None:
            memory.hold(("W", i), [work.holds for work in store or ()])
        return input_grads

    def backward_weight(self, i: int, ctx: StepContext) -> None:
        """"W": the weight gradients ``backward_input`` deferred for micro-batch ``i``."""
        for work in ctx.deferred.pop((self.index, i)):
            work()
        memory = self.memory_of(ctx)
        if memory is not None:
            memory.release(("W", i))

    def _backprop(self, i: int, output_grads: Sequence[Grads], ctx: StepContext, defer: bool) -> tuple[list[Grads], list | None]:
        args, out, store, selective = ctx.saved.pop((self.index, i))
        memory = self.memory_of(ctx)
        if memory is not None:
            memory.fetch(i)
        if self.checkpoint:
            # random ops draw from the same (seed, key) as in the forward: the same masks
            saving = memory.saving() if memory is not None else contextlib.nullcontext()
            replay = selective.replay() if selective is not None else contextlib.nullcontext()
            with torch.enable_grad(), ctx.autocast.applied(), saving:
                with self._buffers_restored(), replay:
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
            # a compiled split backward leaves its W in the store under "I" ("B": runs it)
            deferring = self.compiled.deferring(store if defer else None) if self.compiled is not None else contextlib.nullcontext()
            with deferring:
                torch.autograd.backward(tensors, grads if any(g is not None for g in grads) else None)
        if self.is_last and i in ctx.losses:
            ctx.losses[i] = ctx.losses[i].detach()
        received = args[self.num_model_inputs : len(args) - len(self.extra_inputs)]
        input_grads = [[t.grad if isinstance(t, torch.Tensor) else None for t in leaves(v)] for v in received]
        if self.check_finite:
            for edge, grads in zip(self.recv, input_grads):
                finite.check(grads, f"the gradient stage {self.index} sends back on {self._edge(edge)}", edge)
        if memory is not None:
            memory.release(i)
        return input_grads, store

    def _check_forward(self, i: int, out: Any, ctx: StepContext) -> None:
        if not self.is_last:
            for edge, value in zip(self.send, out):
                finite.check(value, f"the activation stage {self.index} sends on {self._edge(edge)}", edge)
            return
        finite.check(out, f"the model's output (stage {self.index})")
        if i in ctx.losses:
            finite.check(ctx.losses[i], f"the loss of micro-batch {i}")

    def memory_of(self, ctx: StepContext) -> StageMemory | None:
        """This stage's record of what it keeps for backward in a measured training step
        (in every training step when it offloads: offloading runs through its hooks)."""
        if not ctx.train or ctx.memory is None or not (ctx.memory.measured or self.offload is not None):
            return None
        return ctx.memory.stage(self.index, self.module, self.name or str(self.device))

    def _edge(self, edge: int) -> str:
        return self.edge_names.get(edge, f"edge {edge}")

    def _extras(self, i: int, ctx: StepContext, store: list | None) -> list[Any]:
        return [ctx.rng_seed(i) if role == "rng_seed" else store for role in self.extra_inputs]

    def _call(self, args: list[Any], ctx: StepContext, i: int) -> Any:
        if self.mutated_inputs:
            args = [a.clone() if k in self.mutated_inputs and isinstance(a, torch.Tensor) else a for k, a in enumerate(args)]
        call = self.compiled if self.compiled is not None else self.module
        if self.is_last:
            with ctx.loss_scaling(i):
                return call(*args)
        return call(*args)

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


def _releasable(values: Any, saved: set) -> list[bool]:
    """Which leaves of a stage's outputs it may keep without their memory (see
    :func:`_release_data`): tensors in its autograd graph, not views, not saved by autograd
    itself (``saved``: the storages it saved)."""
    return [
        isinstance(t, torch.Tensor) and t.grad_fn is not None and t._base is None and t.numel() > 1 and not storages([t]) & saved
        for t in pytree.tree_leaves(values)
    ]


def _release_data(values: Any, releasable: list[bool]) -> None:
    """Let go of the memory of the outputs a stage keeps for its backward, which needs
    only their place in the autograd graph (``grad_fn``) and their shapes: their consumers
    hold the values (Megatron-LM frees sent outputs the same way). Each releasable leaf
    (decided once, in a measured step: the same code keeps the same tensors) keeps its
    shape on one element's memory."""
    leaves = pytree.tree_leaves(values)
    if len(leaves) != len(releasable):
        return
    for t, ok in zip(leaves, releasable):
        if ok and isinstance(t, torch.Tensor) and t.grad_fn is not None:
            t.data = torch.empty((), dtype=t.dtype, device=t.device).expand(t.shape)


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    return pytree.tree_map_only(torch.Tensor, lambda t: t.detach(), value)


def make_runner(stage: Any, module: nn.Module, device: torch.device, num_stages: int, plan: Any) -> StageRunner:
    """The runner of a compiled ``fxpipe.Stage`` whose module was placed on ``device``,
    run as the stage (recompute) and ``plan`` (finiteness checks, compiled stages) say."""
    options = compile_options(plan.compile)
    edges = zip(list(stage.recv_ids) + list(stage.send_ids), list(stage.inputs) + list(stage.outputs))
    return StageRunner(
        index=stage.index,
        module=module,
        device=device,
        num_model_inputs=len(stage.model_inputs),
        recv=list(stage.recv_ids),
        send=list(stage.send_ids),
        is_last=stage.index == num_stages - 1,
        mutated_inputs=stage.mutated_inputs,
        buffers_written=[_owner(module, name) for name in stage.buffers_written],
        name=stage.device,
        checkpoint=stage.recompute,
        extra_inputs=tuple(stage.extra_inputs),
        check_finite=plan.check_finite,
        edge_names={k: f"edge {k} ({e.name!r}, stage {e.src} -> stage {e.dst})" for k, e in edges},
        offload=Offload(device) if stage.offload else None,
        # torch.compile refuses the recomputation selective checkpointing replays (it
        # finds the cached tensors mutated): such a stage runs eager, as summary() says
        compiled=CompiledStage(stage.index, module, options, split=stage.split_backward and plan.compiles_backward) if options is not None and stage.recompute != "selective" else None,
        split_backward=stage.split_backward,
    )


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    """(the submodule holding buffer ``name``, its attribute name)."""
    path, _, attr = name.rpartition(".")
    return module.get_submodule(path), attr
