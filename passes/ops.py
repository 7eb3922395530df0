"""Which aten operators an fx node may call, whichever frontend traced it.

fx graphs hold torch-level calls (``torch.rand``, ``x.uniform_()``) and export graphs hold
aten overloads (``aten.rand.default``). Both are looked up here as the aten overloads
they resolve to, so one schema-based rule (does it draw random numbers? which argument
does it write? does its result alias its input?) serves both frontends.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.fx as fx

aten = torch.ops.aten


@functools.cache
def aten_overloads(name: str) -> tuple[torch._ops.OpOverload, ...]:
    """Every overload of ``aten.<name>``, or () when there is no such operator."""
    packet = getattr(aten, name, None) if name.isidentifier() else None
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return ()
    return tuple(getattr(packet, o) for o in packet.overloads())


def torch_builtin_name(target: Any) -> str | None:
    """The name of a torch builtin (``torch.rand``, ``Tensor.uniform_``), else None."""
    name = getattr(target, "__name__", None)
    if not isinstance(name, str):
        return None
    homes = (torch, torch.Tensor, torch._C._nn, torch._C._VariableFunctions)
    return name if any(getattr(home, name, None) is target for home in homes) else None


def overloads_of(node: fx.Node) -> tuple[torch._ops.OpOverload, ...]:
    """The aten (or custom) overloads a call_function / call_method node may resolve to."""
    target = node.target
    if node.op == "call_method":
        return aten_overloads(target)
    if node.op != "call_function":
        return ()
    if isinstance(target, torch._ops.OpOverload):
        return (target,)
    if isinstance(target, torch._ops.OpOverloadPacket):
        return tuple(getattr(target, o) for o in target.overloads())
    name = torch_builtin_name(target)
    return aten_overloads(name) if name is not None else ()


def writes_self(op: torch._ops.OpOverload) -> bool:
    """Whether ``op`` writes its first argument in place (``Tensor(a!) self``)."""
    args = op._schema.arguments
    return bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write


def aliases_self(op: torch._ops.OpOverload) -> bool:
    """Whether ``op``'s result may share memory with its first argument (a view, or an
    in-place op returning ``self``)."""
    args, returns = op._schema.arguments, op._schema.returns
    if not args or not returns or args[0].alias_info is None or returns[0].alias_info is None:
        return False
    return bool(set(args[0].alias_info.before_set) & set(returns[0].alias_info.before_set))


@functools.cache
def generator_overload(op: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """``op`` itself if it takes ``generator=``, else its overload that does and otherwise
    takes the same arguments (``aten.rand.default`` -> ``aten.rand.generator``), else None."""
    names = [a.name for a in op._schema.arguments]
    if "generator" in names:
        return op
    packet = op.overloadpacket
    for overload in packet.overloads():
        candidate = getattr(packet, overload)
        other = [a.name for a in candidate._schema.arguments]
        if "generator" in other and [n for n in other if n != "generator"] == names and len(candidate._schema.returns) == len(op._schema.returns):
            if not any(a.is_out for a in candidate._schema.arguments):
                return candidate
    return None


@functools.cache
def draws_random(op: Any) -> bool:
    """Whether an operator draws random numbers (tagged so by torch, or takes a generator)."""
    if not isinstance(op, torch._ops.OpOverload):
        return False
    return torch.Tag.nondeterministic_seeded in op.tags or any(a.name == "generator" for a in op._schema.arguments)
