"""``Pipeline``: a compiled model whose stages sit on their devices, run on a schedule."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from fxpipe import microbatch
from fxpipe.devices import torch_device
from fxpipe.executor import LocalExecutor, RuntimeStage
from fxpipe.partitioned import Partitioned
from fxpipe.passes.codegen import mutated_inputs
from fxpipe.placement import place
from fxpipe.schedules import forward_only, make_schedule
from fxpipe.stage import Stage
from fxpipe.views import PipelineViews


class Pipeline(PipelineViews):
    """A model split into stages on devices. See ``fxpipe.compile``.

    Attributes: stages (Stage list, modules on their devices), graph (the partitioned
    fx.Graph with send/recv nodes), plan, frontend.
    """

    def __init__(self, part: Partitioned, model: nn.Module, loss_fn: Any = None) -> None:
        self.part = part
        self.plan = part.plan
        self.loss_fn = loss_fn
        self.frontend = part.frontend
        devices = [torch_device(s.device) for s in part.stages]
        self._placement = place([s.module for s in part.stages], [s.device for s in part.stages], model)
        self.stages = [
            Stage(s.index, s.device, module, s.inputs, s.outputs, s.reason, s.model_inputs, s.module_paths)
            for s, module in zip(part.stages, self._placement.modules)
        ]
        # from here on the partition describes the placed stages: nothing in the pipeline
        # refers to the user's modules, which can be freed
        self.part = dataclasses.replace(part, stages=self.stages)
        self._executor = LocalExecutor(self._runtime_stages(devices), checkpoint=self.plan.checkpoint)
        self._schedules: dict[int, list] = {}
        self._last_events: list = []
        self.training = model.training

    # ------------------------------------------------------------------ running
    def _runtime_stages(self, devices: list[torch.device]) -> list[RuntimeStage]:
        edge_ids = {id(e): k for k, e in enumerate(self.part.partitioned.edges)}
        last = len(self.stages) - 1
        runtime = []
        for stage, device in zip(self.stages, devices):
            runtime.append(
                RuntimeStage(
                    index=stage.index,
                    module=stage.module,
                    device=device,
                    num_model_inputs=len(stage.model_inputs),
                    recv=[edge_ids[id(e)] for e in stage.inputs],
                    send=[edge_ids[id(e)] for e in stage.outputs],
                    is_last=stage.index == last,
                    name=stage.device,
                    mutated_inputs=mutated_inputs(stage.module.graph, lambda t, m=stage.module: m.get_submodule(t)),
                )
            )
        return runtime

    def _actions(self, m: int) -> list:
        if m not in self._schedules:
            self._schedules[m] = make_schedule(self.plan.schedule, len(self.stages), m, self.plan.chunks)
        return self._schedules[m]

    def _split(self, args: tuple, kwargs: dict, target: Any) -> tuple[list, list, list[int]]:
        flat = self.part.bind_inputs(args, kwargs)
        pieces, sizes = microbatch.split((flat, target), self.plan.microbatches)
        return [p[0] for p in pieces], [p[1] for p in pieces], sizes

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Forward through all stages over micro-batches; equals ``model(*args, **kwargs)``.

        Stages keep autograd history, so ``pipe(x).sum().backward()`` works too (not
        pipelined; use ``step`` for a scheduled backward).
        """
        inputs, _, _ = self._split(args, kwargs, None)
        self._placement.sync_replicas()
        actions = forward_only(self._actions(len(inputs)))
        result = self._executor.run(actions, inputs, train=False, record=True)
        self._last_events = result.events
        return self.part.build_output(microbatch.merge(result.outputs))

    forward = __call__

    def step(self, *args: Any, target: Any = None, loss_fn: Any = None, **kwargs: Any) -> torch.Tensor:
        """One training step's forward and backward on the schedule; returns the loss.

        Every parameter's ``.grad`` accumulates exactly what eager
        ``loss_fn(model(*args), target).backward()`` gives (micro-batch losses are weighted
        by their share of the batch, so uneven micro-batches still sum to the full-batch
        loss). Without a loss function the model's output must be a scalar loss.
        Raises MicrobatchError for more micro-batches than samples, PipelineError naming
        the stage when a stage fails.
        """
        loss_fn = loss_fn or self.loss_fn
        inputs, targets, sizes = self._split(args, kwargs, target)
        loss_of = microbatch.weighted_loss(loss_fn, self.part.build_output, targets, microbatch.loss_weights(sizes, loss_fn))
        self._placement.sync_replicas()
        result = self._executor.run(self._actions(len(inputs)), inputs, train=True, loss_of=loss_of, record=True)
        self._placement.reduce_replica_grads()
        self._last_events = result.events
        last_device = self._executor.stages[-1].device
        return torch.stack([loss.to(last_device) for loss in result.losses]).sum()

    # ------------------------------------------------------------ module-like API
    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Parameters under the model's names; a tied weight once, under its first name."""
        yield from self._placement.params.items()

    def state_dict(self) -> OrderedDict[str, torch.Tensor]:
        """The model's state_dict keys (tied weights under every name), values detached."""
        return OrderedDict((k, v.detach()) for k, v in self._placement.state.items())

    def load_state_dict(self, state: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Load a state dict saved from the model or from a pipeline of it."""
        missing = [k for k in self._placement.state if k not in state]
        unexpected = [k for k in state if k not in self._placement.state]
        if strict and (missing or unexpected):
            raise KeyError(f"load_state_dict: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}")
        with torch.no_grad():
            for key, tensor in self._placement.state.items():
                if key in state:
                    tensor.copy_(state[key].to(tensor.device))
        self._placement.sync_replicas()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for module in self._placement.modules:
            module.zero_grad(set_to_none=set_to_none)

    def train(self, mode: bool = True) -> Pipeline:
        """Set train/eval mode on every stage, as ``model.train(mode)`` does eagerly."""
        self.training = mode
        for module in self._placement.modules:
            module.train(mode)
        return self

    @property
    def num_workers(self) -> int:
        return len(self.stages) // self.plan.chunks

    def __repr__(self) -> str:
        return f"Pipeline({self.part.model_name}, stages={[s.device for s in self.stages]}, schedule={self.plan.schedule!r})"
