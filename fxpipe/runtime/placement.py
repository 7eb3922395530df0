"""Placement: each stage's modules on its device, holding the model's own tensors.

The stage modules are copies of the model's modules (an instance of the same class, its
graph and generated code shared: a stage graph is not changed after the compiler), but the parameters and buffers they hold
are the model's own objects, moved in place (``param.data = param.data.to(device)``) to
the device of the earliest stage that uses them, as FSDP2 does. So an optimizer built on
``model.parameters()`` updates what the pipeline reads, and an in-place edit of the
model's weights is seen by the next step; the model's module structure is left as it was.

A tensor used by stages on different (logical) devices is held once per device: the
model's own one on the earliest stage's device is the *primary* (the one
``pipe.parameters()`` lists and the optimizer updates); the other devices hold copies
(*replicas*), refreshed from it before each run, their gradients added into the primary's
after backward. Stages on one device share one copy of anything they both use, so
autograd sums the uses' gradients exactly as eager does.
"""

from __future__ import annotations

import copy
import itertools
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from fxpipe.devices import torch_device

# a GraphModule's attributes that hold the code generated from its graph
_CODE = frozenset({"_code", "_lineno_map", "_prologue_start"})


@dataclass
class TiedGroup:
    """One original parameter (or buffer) held several times: on several devices, or
    (sharded) by several stages of one rank."""

    name: str
    primary: torch.Tensor
    replicas: list[torch.Tensor] = field(default_factory=list)

    def sync(self) -> None:
        """Copy the primary's values into every replica."""
        with torch.no_grad():
            for replica in self.replicas:
                replica.copy_(self.primary)  # blocking: workers' streams read it next

    def reduce_grads(self) -> None:
        """Add the replicas' gradients into the primary's and clear them."""
        for replica in self.replicas:
            if replica.grad is None:
                continue
            grad = replica.grad.to(self.primary.device)
            if self.primary.grad is None:
                self.primary.grad = grad.clone()
            else:
                self.primary.grad.add_(grad)
            replica.grad = None


@dataclass
class Placement:
    """Stage modules on their devices and where every original name lives."""

    modules: list[fx.GraphModule]
    params: dict[str, nn.Parameter]  # canonical name -> primary parameter
    state: dict[str, torch.Tensor]  # every state_dict key -> its tensor (primary copy)
    tied: list[TiedGroup]

    def sync_replicas(self) -> None:
        """Copy each primary's values into its replicas on other devices."""
        for group in self.tied:
            group.sync()

    def reduce_replica_grads(self) -> None:
        """Add replicas' gradients into the primary's and clear them."""
        for group in self.tied:
            group.reduce_grads()


def _named_tensors(module: nn.Module):
    """Every parameter and buffer under every name it has (tied tensors repeated)."""
    return itertools.chain(module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False))


def alias_groups(model: nn.Module) -> dict[str, list[str]]:
    """For every parameter/buffer name of ``model``, all names of that same tensor, first first."""
    by_id: dict[int, list[str]] = defaultdict(list)
    for name, tensor in _named_tensors(model):
        by_id[id(tensor)].append(name)
    return {name: names for names in by_id.values() for name in names}


def place(modules: list[fx.GraphModule], devices: list[str], model: nn.Module, own: bool = True) -> Placement:
    """Stage modules on their logical devices, holding the model's own tensors, and the
    model's names mapped onto them.

    Each parameter and buffer is moved in place to the device of the first stage that
    uses it and shared by every stage on that device; stages on other devices get a copy.
    With ``own=False`` every device gets copies and the model is left as it was.
    Logical CPU devices ("cpu:0", "cpu:1") are distinct here: each holds its own copy of a
    weight tied across them, as two GPUs would.
    """
    memos: dict[str, dict] = defaultdict(dict)
    claimed: set[int] = set()
    placed: list[fx.GraphModule] = []
    for module, device in zip(modules, devices):
        target = torch_device(device)
        for tensor in _distinct_tensors(module):
            if own and id(tensor) not in claimed:
                claimed.add(id(tensor))
                move_in_place(tensor, target)
                memos[device][id(tensor)] = tensor  # the copy holds the model's own object
        clone = copy_stage_module(module, memos[device])
        placed.append(clone.to(target))  # moves only the copies made for this device
    aliases = alias_groups(model)
    copies = held_tensors(placed, aliases)
    tied = [TiedGroup(name, ts[0], ts[1:]) for name, ts in copies.items() if len(ts) > 1]
    params, state = model_names(model, copies, aliases)
    return Placement(placed, params, state, tied)


def _distinct_tensors(module: nn.Module) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for _, tensor in _named_tensors(module):
        seen.setdefault(id(tensor), tensor)
    return list(seen.values())


def move_in_place(tensor: torch.Tensor, device: torch.device) -> None:
    """Move ``tensor`` (a parameter or buffer) and its gradient to ``device``, keeping the
    object: whoever holds it (the user's model, an optimizer) sees the move."""
    if tensor.device == device:
        return
    with torch.no_grad():
        grad = tensor.grad
        if grad is not None:
            tensor.grad = None
        tensor.data = tensor.data.to(device)
        if grad is not None:
            tensor.grad = grad.to(device)


def copy_stage_module(module: fx.GraphModule, memo: dict[int, Any], share_graph: bool = True) -> fx.GraphModule:
    """A copy of ``module``: its state (submodules, parameters, buffers, attributes) deep-copied
    through ``memo``; its generated code shared (an instance of the same generated class: the
    same program, so no code is generated again, which ``copy.deepcopy`` of a GraphModule
    does) and its graph too (a stage graph is not changed once the compiler has made it, so
    no node is copied), the copy its ``owning_module`` from now on. ``share_graph=False``
    copies the graph node for node instead and leaves ``module`` its owner: for a short-lived
    copy that the graph must not keep alive. Returns the copy; ``module`` is unchanged."""
    clone = object.__new__(type(module))
    memo[id(module)] = clone
    for name, value in vars(module).items():
        if name == "_graph":
            value = value if share_graph else copy.deepcopy(value)  # a copy's nodes' meta shallow-copied; no tensor in it
            value.owning_module = clone
        elif name not in _CODE:
            value = copy.deepcopy(value, memo)
        clone.__dict__[name] = value
    return clone


def copy_module(module: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """``copy.deepcopy(module, memo)``, through :func:`copy_stage_module` for a generated
    stage module (its code shared, not generated again)."""
    return copy_stage_module(module, memo) if isinstance(module, fx.GraphModule) else copy.deepcopy(module, memo)


def held_tensors(modules: list[nn.Module], aliases: dict[str, list[str]]) -> dict[str, list[torch.Tensor]]:
    """Every distinct tensor the modules hold, under the model's first name for it, in order."""
    copies: dict[str, list[torch.Tensor]] = defaultdict(list)
    for module in modules:
        for name, tensor in _named_tensors(module):
            canonical = aliases.get(name, [name])[0]
            if not any(t is tensor for t in copies[canonical]):  # one entry per distinct copy
                copies[canonical].append(tensor)
    return copies


def model_names(model: nn.Module, held: dict[str, list[torch.Tensor]], aliases: dict[str, list[str]]) -> tuple[dict, dict]:
    """(parameters under ``model.named_parameters()`` names, tensors under every state_dict key),
    each the first copy in ``held``; names whose tensor is not held are left out."""
    params = {name: held[name][0] for name, _ in model.named_parameters() if name in held}
    state = {}
    for key in model.state_dict(keep_vars=True):
        canonical = aliases.get(key, [key])[0]
        if canonical in held:
            state[key] = held[canonical][0]
    return params, state


def skeleton(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers live on the meta device: its
    code and structure without the memory (for fake runs and re-tracing).

    The copy's ``fxpipe_devices`` maps each parameter and buffer name to the device the
    original tensor is on, so a fake run can put its fake tensors where the real ones are
    (a forward that creates a tensor on the default device then meets them there)."""
    memo: dict[int, Any] = {}
    for tensor in list(module.parameters()) + list(module.buffers()):
        meta = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
    copy_ = copy_module(module, memo)
    known = getattr(module, "fxpipe_devices", {})  # a skeleton of a skeleton keeps the real devices
    devices = {name: known.get(name, t.device) for name, t in _named_tensors(module)}
    object.__setattr__(copy_, "fxpipe_devices", devices)
    return copy_
