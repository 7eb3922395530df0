"""What one micro-batch keeps on each stage, found by running the stages on fake tensors.

The prediction half of ``pipe.memory()`` and of ``Plan(checkpoint="auto")``: each stage's
own runner (``fxpipe.runtime.runner.StageRunner``, the one both executors run) does one
micro-batch's forward and backward on fake tensors (``FakeTensorMode``: shapes, dtypes and
storages, no data), with the same accounting as a real step
(``fxpipe.runtime.memory.StageMemory``: autograd's saved tensors, the values the runner
holds, what a deferred "W" keeps, each storage once). So it sees what autograd really saves
(a GELU keeps its input, a matrix product its operands, a view nothing of its own) under
each recompute choice, which per-node output sizes do not. Stages run in pipeline order,
each on the fake outputs of those feeding it, on copies of the stage modules whose
parameters and buffers are fakes: nothing real is read, written or allocated.

What a stage keeps depends on the micro-batch's size; a profile is taken at the plan's
micro-batch (the first, largest piece of the example batch) and scaled for other sizes.
The loss of a ``loss_fn`` given to ``compile`` is not part of the profile (a model's own
loss, inside its graph, is).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from fxpipe.batching import microbatch
from fxpipe.devices import torch_device
from fxpipe.passes.fake_replay import quiet_meta_failures
from fxpipe.passes.uncompiled import eager_code
from fxpipe.planner.memory_model import MicrobatchMemory
from fxpipe.runtime.context import StepContext
from fxpipe.runtime.memory import StageMemory, StepMemory
from fxpipe.runtime.offload import Offload
from fxpipe.runtime.placement import copy_stage_module
from fxpipe.runtime.runner import StageRunner, make_runner

Recompute = bool | str  # False, True or "selective"


def profile(
    part: Any, microbatches: int, recompute: Sequence[Recompute], offload: Sequence[bool], inputs: list | None = None
) -> list[MicrobatchMemory]:
    """Per stage of ``part`` (a Partitioned), what one micro-batch keeps when the example
    batch is cut into ``microbatches`` (or given its flat ``inputs``) and stage ``s``
    recomputes as ``recompute[s]`` and offloads its saved tensors when ``offload[s]``.

    Raises RuntimeError naming the stage when a stage cannot run on fake tensors.
    """
    if inputs is None:
        inputs, _ = microbatch.microbatch_inputs(part, microbatches)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with eager_code(), quiet_meta_failures(), mode:
        runners = [_fake_runner(part, s, mode, recompute[s], offload[s]) for s in range(part.num_stages)]
        ctx = StepContext(train=True, grad_enabled=True, loss_of=_scalar_loss, memory=StepMemory())
        outputs = _forwards(runners, _fake(inputs, mode), ctx, part)
        return [_backward(runner, outputs.get(runner.index, []), ctx) for runner in runners]


def _failed(stage: int, err: Exception) -> RuntimeError:
    return RuntimeError(
        f"stage {stage} cannot run on fake tensors, so what it keeps for backward cannot be "
        f"predicted: {type(err).__name__}: {err}"
    )


def _fake_runner(part: Any, s: int, mode: FakeTensorMode, recompute: Recompute, offload: bool) -> StageRunner:
    """Stage ``s``'s runner on a copy of its module whose tensors are fakes (offloading
    only in the accounting)."""
    stage = part.stages[s]
    module = stage.module
    planned = torch_device(stage.device)
    known = getattr(module, "fxpipe_devices", {})
    memo: dict[int, Any] = {}
    for name, t in itertools.chain(module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False)):
        if id(t) in memo:
            continue
        device = known.get(name, t.device)
        device = planned if device.type == "meta" else device
        fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
        memo[id(t)] = nn.Parameter(fake, t.requires_grad) if isinstance(t, nn.Parameter) else fake
    copied = copy_stage_module(module, memo, share_graph=False)  # the stage's generated code reused; the graph does not keep this copy
    device = next((t.device for t in memo.values()), planned)
    # fake tensors run the stage graph itself, never compiled code
    plan = part.plan.replace(compile=False)
    runner = make_runner(dataclasses.replace(stage, recompute=recompute, offload=False), copied, device, part.num_stages, plan)
    runner.check_finite = False
    runner.offload = Offload(device, copy=False) if offload else None
    return runner


def _fake(value: Any, mode: FakeTensorMode) -> Any:
    return pytree.tree_map_only(torch.Tensor, lambda t: mode.from_tensor(t) if not isinstance(t, torch._subclasses.FakeTensor) else t, value)


def _scalar_loss(_: int, out: Any) -> torch.Tensor:
    """The last stage's loss stand-in: the sum of its floating outputs' means."""
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return sum(t.mean() for t in leaves)


def _forwards(runners: list[StageRunner], inputs: list, ctx: StepContext, part: Any) -> dict[int, list]:
    """Every stage's forward of micro-batch 0, in pipeline order; returns each stage's
    outputs (one value per send edge)."""
    values: dict[int, Any] = {}
    outputs: dict[int, list] = {}
    for runner in runners:
        received = [values[e] for e in runner.recv]
        try:
            out = runner.forward(0, inputs if runner.index == 0 else (), received, ctx)
        except Exception as err:
            raise _failed(runner.index, err) from err
        outputs[runner.index] = out
        values.update(zip(runner.send, out))
    return outputs


def _backward(runner: StageRunner, out: list, ctx: StepContext) -> MicrobatchMemory:
    """The stage's backward of micro-batch 0 with zero gradients for its outputs; what it
    kept after the forward, at most during the backward, and until its "W"."""
    memory: StageMemory = runner.memory_of(ctx)
    forward = memory.live
    memory.peak = memory.live
    grads = [[torch.zeros_like(t) if isinstance(t, torch.Tensor) and t.requires_grad else None for t in pytree.tree_leaves(v)] for v in out]
    try:
        if runner.split_backward:
            runner.backward_input(0, grads, ctx)
            weight, backward = memory.live, memory.peak
            runner.backward_weight(0, ctx)
        else:
            runner.backward(0, grads, ctx)
            weight, backward = 0, memory.peak
    except Exception as err:
        raise _failed(runner.index, err) from err
    return MicrobatchMemory(float(forward), float(max(backward, forward)), float(weight))
