"""Sharded data parallelism, ``Plan(fsdp=True)``: each stage's parameters, gradients and
optimizer state split over its data-parallel replicas with FSDP2 (``fully_shard``).

Every stage this rank runs is one FSDP unit over the mesh's ``"dp"`` dimension (the ranks
that hold the same stage in the other replicas). The action loop drives the units through
an :class:`~fxpipe.runtime.interpret.ActionHook`, as torch.distributed.pipelining's
UNSHARD, RESHARD and REDUCE_GRAD actions drive its stages:

- **gather**: before a stage's F, B or I its parameters are all-gathered (``unshard``)
  unless they still are; a W needs none (its weight gradients come from the activations
  and output gradients the I saved);
- **free**: after each of its actions a stage that reshards frees the gathered
  parameters; one that keeps them holds them until its reduction (:func:`reshard_choice`);
- **reduce**: gradients accumulate unsharded over the step's micro-batches and are
  reduce-scattered once, after the stage's last backward action (its last B, or the later
  of its last I and W). FSDP's post-backward is run by hand there (the path
  torch.distributed.pipelining's ``perform_reduce_grad`` takes): a deferred W runs
  outside autograd, so no autograd hook could tell when the gradients are complete.

FSDP's own module hooks stay on but never free or reduce: each unit is built with
``reshard_after_forward=False``, and gradient sync and reshard-after-backward are off
between reductions.

A weight that two stages of this rank share (an embedding tied to the LM head under
zb-v) cannot be in two FSDP units: :func:`untie` gives the later stage its own copy, and
:class:`ShardedStages` keeps the copies one weight as the local pipeline keeps copies on
several devices (``fxpipe.runtime.placement.TiedGroup``): before every call each copy takes the
first's values; after a step its gradient is added into the first's, which the optimizer
updates (the first is the one ``pipe.parameters()`` lists).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from fxpipe.plan import PlanError
from fxpipe.runtime.interpret import Step
from fxpipe.runtime.placement import TiedGroup, copy_module
from fxpipe.runtime.runner import StageRunner
from fxpipe.schedules import Action

if TYPE_CHECKING:
    from fxpipe.compiler.partitioned import Partitioned


def keep_gathered(param_bytes: Mapping[int, float], resident: float, memory: float) -> dict[int, bool]:
    """Which of a rank's stages keep their gathered parameters from their first action of
    a step to their gradient reduction: the rule ``Plan(reshard_after_forward=None)`` applies.

    param_bytes: each of the rank's stages' unsharded parameter bytes, in stage order;
    resident: the rank's bytes the choice does not change; memory: the device's usable bytes.

    A kept stage holds its gathered parameters all step; a resharding one only during its
    own actions, one stage at a time, so the rank's peak is ``resident + Σ kept + max(the
    others)``. Stages are kept in order while the peak stays within ``memory`` or does not
    grow: a stage alone on its rank is always kept (its own actions need it gathered, so
    resharding would only repeat the all-gathers).
    """
    kept: list[int] = []

    def peak(keep: list[int]) -> float:
        others = [b for s, b in param_bytes.items() if s not in keep]
        return resident + sum(param_bytes[s] for s in keep) + max(others, default=0.0)

    for stage in param_bytes:
        if peak([*kept, stage]) <= max(memory, peak(kept)):
            kept.append(stage)
    return {s: s in kept for s in param_bytes}


def reshard_choice(part: Partitioned, stages: Sequence[int], replicas: int) -> dict[int, bool]:
    """For each of ``stages`` (this rank's), whether it frees its gathered parameters after
    every action: ``plan.reshard_after_forward`` when given, else :func:`keep_gathered` on
    the cost model's estimates. A stage's resident bytes are its estimated memory (state
    and activations in flight, for the plan's batch) over ``replicas``, plus its unsharded
    gradients (accumulated in full until the reduction).

    Raises PlanError when ``plan.reshard_after_forward`` lists a number of values other
    than the number of stages.
    """
    choice = part.plan.reshard_after_forward
    if isinstance(choice, bool):
        return dict.fromkeys(stages, choice)
    if choice is not None:
        if len(choice) != part.num_stages:
            raise PlanError(
                f"plan.reshard_after_forward lists {len(choice)} value(s) but the plan has {part.num_stages} stages; "
                "give one bool per stage, or one bool for all"
            )
        return {s: choice[s] for s in stages}
    estimates = part.estimates()
    param_bytes = {s: float(part.stages[s].parameter_bytes) for s in stages}
    resident = sum(estimates[s].memory / replicas + param_bytes[s] for s in stages)
    kept = keep_gathered(param_bytes, resident, part.device_memory()[stages[0]])
    return {s: not kept[s] for s in stages}


def untie(modules: dict[int, nn.Module]) -> dict[int, nn.Module]:
    """The stage modules, with no parameter shared between two of them: a stage holding a
    parameter an earlier stage holds becomes a copy whose shared parameters are its own
    (its other parameters, its buffers and its code stay the same objects)."""
    seen: set[int] = set()
    untied = {}
    for stage, module in modules.items():
        params = list(module.parameters())
        if any(id(p) in seen for p in params):
            memo: dict[int, Any] = {id(p): p for p in params if id(p) not in seen}
            memo.update((id(b), b) for b in module.buffers())
            module = copy_module(module, memo)
        seen.update(id(p) for p in module.parameters())
        untied[stage] = module
    return untied


class ShardedStages:
    """This rank's stages, each an FSDP unit over its replicas (``mesh``), and the hook that
    gathers, frees and reduces them as the action loop runs.

    modules: stage index -> module (parameters untied, see :func:`untie`); reshard: stage
    index -> whether it frees its gathered parameters after every action;
    collective(what, stage): the context every all-gather and reduce-scatter runs in (the
    watchdog's: it names a replica that is gone); tied: the weights two of the stages hold
    (primary and copies, as model names give them).
    """

    def __init__(
        self,
        modules: dict[int, nn.Module],
        mesh: DeviceMesh,
        reshard: dict[int, bool],
        collective: Callable[[str, int], contextlib.AbstractContextManager],
    ) -> None:
        # FSDP warns of stage outputs that are views, which an in-place op could detach from
        # its backward hook; no stage output is changed in place (consumers get them detached)
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        self.units: dict[int, FSDPModule] = {s: self.make_unit(module, mesh) for s, module in modules.items()}
        self.reshard = reshard
        self.collective = collective
        self.tied: list[TiedGroup] = []

    @staticmethod
    def make_unit(module: nn.Module, mesh: DeviceMesh) -> FSDPModule:
        """``module`` made one FSDP unit sharded over ``mesh``, initialised at once (a later
        input signature's stages may run before the unit's own forward)."""
        fully_shard(module, mesh=mesh, reshard_after_forward=False)
        unit = cast(FSDPModule, module)
        _state(unit)._lazy_init()
        return unit

    def begin_call(self) -> None:
        """Before any call: gradients stay unsharded, accumulating, until the reduction;
        copies of a weight shared by two stages take the primary's values."""
        for unit in self.units.values():
            unit.set_requires_gradient_sync(False)
            unit.set_reshard_after_backward(False)
            unit.set_is_last_backward(False)
        for group in self.tied:
            group.sync()

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Every stage's parameters all-gathered for the block, freed after it."""
        for unit in self.units.values():
            unit.unshard()
        try:
            yield
        finally:
            self.end_call()

    def before(self, action: Action, runner: StageRunner, step: Step) -> None:
        if action.op != "W":
            with self.collective(f"the all-gather of stage {action.stage}'s parameters", action.stage):
                self.units[action.stage].unshard()

    def after(self, action: Action, runner: StageRunner, step: Step) -> None:
        if self.reshard[action.stage]:
            self.units[action.stage].reshard()

    def reduce(self, stage: int) -> None:
        """Reduce-scatter ``stage``'s accumulated gradients over its replicas (averaging them)
        into its sharded parameters' ``.grad``, and free its gathered parameters."""
        unit = self.units[stage]
        unit.set_requires_gradient_sync(True)
        unit.set_reshard_after_backward(True)
        unit.set_is_last_backward(True)
        state = _state(unit)
        with self.collective(f"the reduce-scatter of stage {stage}'s gradients", stage):
            for group in state._fsdp_param_groups:
                group.post_backward()
            state._root_post_backward_final_callback()  # waits for the reduction, ends FSDP's backward
        unit.set_requires_gradient_sync(False)
        unit.set_reshard_after_backward(False)
        unit.set_is_last_backward(False)

    def end_call(self) -> None:
        """After any call: every stage holds only its shard again (what the optimizer
        updates and a checkpoint saves)."""
        for unit in self.units.values():
            unit.reshard()

    def end_step(self) -> None:
        """After a training step's reductions: each copy's gradient into its primary's."""
        for group in self.tied:
            group.reduce_grads()


def hand_to_model(model: nn.Module, params: Mapping[str, nn.Parameter], aliases: Mapping[str, list[str]]) -> None:
    """Make the sharded parameters the pipeline trains the model's own: each of ``params``
    (model name -> this rank's sharded parameter) is set on the model's module under every
    name of it (``aliases``), as FSDP2's ``fully_shard`` sets the shards on the modules it
    shards. An optimizer built on ``model.parameters()`` after compiling then updates what
    the pipeline reads; the parameters of other ranks' stages stay as they were."""
    for name, param in params.items():
        for alias in aliases.get(name, [name]):
            owner, _, leaf = alias.rpartition(".")
            setattr(model.get_submodule(owner), leaf, param)


def _state(unit: FSDPModule) -> Any:
    """FSDP's state of a unit, for the two steps FSDP2 has no public call for: initialising
    before the unit's first forward, and reducing by hand."""
    return unit._get_fsdp_state()


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: a sharded tensor's shard, any other tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole of ``tensor``: a sharded tensor gathered from its replicas (a collective:
    every rank holding a shard must ask), any other tensor itself."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def load_into(target: torch.Tensor, value: torch.Tensor) -> None:
    """Copy the whole tensor ``value`` into ``target``: a sharded target takes its own
    shard of it (no communication)."""
    if isinstance(target, DTensor):
        shard = distribute_tensor(value.to(target.device), target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(shard.to_local())
    else:
        target.copy_(value.to(target.device))
