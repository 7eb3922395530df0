"""``Pipeline``: a compiled model whose stages sit on this machine's devices.

Stage modules are placed as copies (see :mod:`fxpipe.placement`); a
:class:`~fxpipe.runtime.local.LocalExecutor` runs them on the plan's schedule, one thread
per pipeline worker.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from fxpipe.devices import torch_device
from fxpipe.partitioned import Partitioned
from fxpipe.placement import place
from fxpipe.runtime.context import StepContext
from fxpipe.runtime.local import LocalExecutor
from fxpipe.runtime.pipeline import Batch, PipelineBase, make_runner
from fxpipe.schedules import describe_schedule


class Pipeline(PipelineBase):
    """A model split into stages on devices. See ``fxpipe.compile``.

    Attributes: stages (Stage list, modules on their devices), graph (the partitioned
    fx.Graph with send/recv nodes), plan, frontend.
    """

    def __init__(self, part: Partitioned, model: nn.Module, loss_fn: Any = None) -> None:
        self._placement = place([s.module for s in part.stages], [s.device for s in part.stages], model)
        self.stages = [dataclasses.replace(s, module=m) for s, m in zip(part.stages, self._placement.modules)]
        # from here on the partition describes the placed stages: nothing in the pipeline
        # refers to the user's modules, which can be freed
        self._setup(dataclasses.replace(part, stages=self.stages), loss_fn, model)
        self._params, self._state = self._placement.params, self._placement.state
        self._modules = self._placement.modules
        runners = [
            make_runner(s, s.module, torch_device(s.device), len(self.stages), self.plan.checkpoint) for s in self.stages
        ]
        edge_ends = [(e.src, e.dst) for e in part.partitioned.edges]
        self._executor = LocalExecutor(runners, edge_ends, self.plan.timeout)

    def _execute(self, batch: Batch, ctx: StepContext) -> None:
        self._placement.sync_replicas()
        actions = self._actions(len(batch.inputs), ctx.train)
        self._last_events = self._executor.run(actions, batch.inputs, ctx, record=True)
        if ctx.train:
            self._placement.reduce_replica_grads()

    def _output(self, batch: Batch, ctx: StepContext) -> Any:
        return self._merged(batch, [ctx.outputs[i] for i in range(len(batch.inputs))])

    def _step_loss(self, ctx: StepContext) -> torch.Tensor:
        last_device = self._executor.runners[-1].device
        return torch.stack([ctx.losses[i].to(last_device) for i in sorted(ctx.losses)]).sum()

    def _after_load(self) -> None:
        self._placement.sync_replicas()

    @property
    def num_workers(self) -> int:
        return self.part.num_workers

    def __repr__(self) -> str:
        return f"Pipeline({self.part.model_name}, stages={[s.device for s in self.stages]}, schedule={describe_schedule(self.plan.schedule)})"
