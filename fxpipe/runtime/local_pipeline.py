"""``Pipeline``: a compiled model whose stages sit on this machine's devices.

Stage modules are placed as copies holding the model's own parameters and buffers (see
:mod:`fxpipe.runtime.placement`); a
:class:`~fxpipe.runtime.local.LocalExecutor` runs them on the plan's schedule, one thread
per pipeline worker. A call with another input signature (another sequence length under
torch.export, another None pattern) is traced and cut again once, at the same stage
boundaries, its stages sharing the placed parameters (the retrace is the compiler's,
handed in by ``fxpipe.factory``: this module imports neither the compiler nor a pass).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fxpipe.devices import torch_device
from fxpipe.runtime.context import StepContext
from fxpipe.runtime.interpret import Step
from fxpipe.runtime.local import LocalExecutor
from fxpipe.runtime.pipeline_base import Batch, Compiler, PipelineBase, Program
from fxpipe.runtime.placement import place, skeleton
from fxpipe.runtime.runner import make_runner
from fxpipe.schedules import describe_schedule

if TYPE_CHECKING:
    from fxpipe.compiler.partitioned import Partitioned


class Pipeline(PipelineBase):
    """A model split into stages on devices. See ``fxpipe.compile``.

    Attributes: stages (Stage list, modules on their devices), graph (the partitioned
    fx.Graph with send/recv nodes), plan, frontend. ``own``: the stages hold the model's
    own tensors (moved in place); otherwise copies of them (the model is left unchanged).
    """

    def __init__(self, part: Partitioned, model: nn.Module, compiler: Compiler, loss_fn: Any = None, own: bool = True) -> None:
        # the fake runs put their tensors where the model's were when it was traced
        traced_as = skeleton(model)
        self._placement = place([s.module for s in part.stages], [s.device for s in part.stages], model, own)
        self.stages = [dataclasses.replace(s, module=m) for s, m in zip(part.stages, self._placement.modules)]
        # from here on the partition describes the placed stages: the pipeline refers to
        # the model's tensors, not to its modules
        self._setup(dataclasses.replace(part, stages=self.stages), loss_fn, traced_as, compiler, model)
        self._params, self._state = self._placement.params, self._placement.state
        self._modules = self._placement.modules
        self._executor = LocalExecutor(self.plan.timeout)
        self._first_program(self._program_of(self.part))

    def _runners(self, stages: list) -> dict[int, Any]:
        return {s.index: make_runner(s, s.module, torch_device(s.device), len(stages), self.plan) for s in stages}

    def _compile_program(self, args: tuple, kwargs: dict) -> Program:
        return self._program_of(self._compiler.retrace(self.part, self._model, args, kwargs, self._roots_for))

    def _program_of(self, part: Partitioned) -> Program:
        return Program(part, self._runners(part.stages))

    def _roots_for(self, stage: int) -> list[nn.Module]:
        """Where stage ``stage`` of a later signature finds its targets: the placed copies on its device."""
        device = self.stages[stage].device
        return [s.module for s in self.stages if s.device == device]

    def _execute(self, batch: Batch, ctx: StepContext) -> None:
        program = batch.program
        self._placement.sync_replicas()
        actions = program.part.actions(len(batch.inputs), ctx.train)
        step = Step(ctx, batch.inputs, program.runners, program.part.edge_ends, self.action_hooks, microbatch_runners=batch.microbatch_runners())
        self._last_events = self._executor.run(actions, step)
        if ctx.train:
            self._placement.reduce_replica_grads()

    def _output(self, batch: Batch, ctx: StepContext) -> Any:
        return self._merged(batch, [ctx.outputs[i] for i in range(len(batch.inputs))])

    def _step_loss(self, ctx: StepContext) -> torch.Tensor:
        last_device = torch_device(self.stages[-1].device)
        return torch.stack([ctx.losses[i].to(last_device) for i in sorted(ctx.losses)]).sum()

    def _after_load(self) -> None:
        self._placement.sync_replicas()

    def close(self) -> None:
        """Join the worker threads. The pipeline can still run: a later call starts new ones."""
        self._executor.close()

    @property
    def num_workers(self) -> int:
        return self.part.num_workers

    def __repr__(self) -> str:
        return f"Pipeline({self.part.model_name}, stages={[s.device for s in self.stages]}, schedule={describe_schedule(self.plan.schedule)})"
