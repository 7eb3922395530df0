"""Keyed scopes: the random ops inside a callee fxpipe cannot see into.

A call_module of ``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer`` or a user leaf
module, or a Python function fx kept whole (``fx.wrap``), draws random numbers somewhere
inside. The rng pass rewrites such a call into :func:`call` (modules) or
:func:`scoped` (functions), which run it under a :class:`KeyedScope`: a dispatch mode,
entered around that call only (a mode on every op of a stage would cost too much), that
hands the n-th random aten op inside the generator for draw n of the node's key.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fxpipe.passes.keyed import (
    alpha_dropout,
    check_seed,
    dropout,
    dropout1d,
    dropout2d,
    dropout3d,
    feature_alpha_dropout,
    generator,
    native_dropout,
)
from fxpipe.passes.ops import draws_random, generator_overload

aten = torch.ops.aten

# the torch.nn.functional dropouts each dropout module calls, and whether it passes inplace
MODULE_DROPOUTS: dict[type, tuple[Callable[..., torch.Tensor], bool]] = {
    nn.Dropout: (dropout, True),
    nn.Dropout1d: (dropout1d, True),
    nn.Dropout2d: (dropout2d, True),
    nn.Dropout3d: (dropout3d, True),
    nn.AlphaDropout: (alpha_dropout, False),
    nn.FeatureAlphaDropout: (feature_alpha_dropout, False),
}


class KeyedScope(TorchDispatchMode):
    """Routes every random aten op run inside to a generator keyed by (seed, key, n-th draw).

    A dispatch mode sees the aten ops that a module's Python and C++ code reach, so random
    ops are caught wherever they are written. Ops that take a generator get one;
    ``native_dropout`` (the fused dropout torch uses on accelerators) is replaced by
    :func:`native_dropout`; any other random op draws from torch's global generator and
    is reported once, naming ``label``, because its result cannot be reproduced.
    """

    def __init__(self, seed: int, key: int, label: str) -> None:
        super().__init__()
        self.seed, self.key, self.label = seed, key, label
        self.draws = 0

    def _next(self, where: Any) -> torch.Generator | None:
        gen = generator(self.seed, self.key, where, self.draws)
        self.draws += 1
        return gen

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not draws_random(func) or kwargs.get("generator") is not None or draws_nothing(func, args, kwargs):
            return func(*args, **kwargs)
        if func is aten.native_dropout.default:
            return native_dropout(*args, **kwargs, generator=self._next(args[0]))
        keyed = generator_overload(func)
        if keyed is None:
            _warn_unkeyed(func, self.label)
            return func(*args, **kwargs)
        return keyed(*args, **kwargs, generator=self._next(_where(args, kwargs)))


def draws_nothing(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether a random op is called with a probability of 0 (a dropout's ``p``, an attention
    kernel's ``dropout_p``), so it draws nothing (it is tagged random for when it does)."""
    for position, argument in enumerate(func._schema.arguments):
        if argument.name in ("p", "dropout_p"):
            value = args[position] if position < len(args) else kwargs.get(argument.name, argument.default_value)
            return value == 0
    return False


def _where(args: tuple, kwargs: dict) -> Any:
    """What decides an op's device: its first tensor argument, else its ``device=``."""
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg
    return kwargs.get("device")


@functools.cache
def _warn_unkeyed(op: Any, label: str) -> None:
    warnings.warn(
        f"fxpipe: {op} inside {label} draws from torch's global generator (it takes no generator "
        "argument), so its result is not reproducible and checkpoint recompute draws it anew; "
        "trace with Plan(frontend='export') to let fxpipe see the op, or avoid it in training",
        stacklevel=2,
    )


def call(module: nn.Module, seed: int, key: int, /, *args: Any, **kwargs: Any) -> Any:
    """``module(*args, **kwargs)`` with every random draw inside keyed by (seed, key, n).

    A plain dropout module (exactly ``nn.Dropout``, ``nn.Dropout2d``, ...) is run directly
    with its keyed functional; the masks are the ones the scope would give it. A module
    built from torch's own classes only draws in training, so in eval it runs as is.
    Raises TypeError when ``seed`` is not an int.
    """
    check_seed(seed)
    direct = MODULE_DROPOUTS.get(type(module))
    if direct is not None and len(args) == 1 and not kwargs:
        fn, passes_inplace = direct
        gen = generator(seed, key, args[0])
        return fn(args[0], module.p, module.training, module.inplace if passes_inplace else False, generator=gen)
    if not module.training and all(type(m).__module__.startswith("torch.") for m in module.modules()):
        return module(*args, **kwargs)
    with KeyedScope(seed, key, type(module).__name__):
        return module(*args, **kwargs)


@functools.cache
def scoped(fn: Callable) -> Callable:
    """``fn`` run under a :class:`KeyedScope`: ``scoped(fn)(seed, key, *args, **kwargs)``.

    One wrapper per function (cached), named after it, so the stage's code reads
    ``keyed_gumbel_softmax(fxpipe_rng_seed, 4, x, tau=0.5)``.
    """
    label = getattr(fn, "__name__", None) or str(fn)

    def keyed_call(seed: int, key: int, /, *args: Any, **kwargs: Any) -> Any:
        with KeyedScope(check_seed(seed), key, label):
            return fn(*args, **kwargs)

    keyed_call.__name__ = keyed_call.__qualname__ = "keyed_" + "".join(c if c.isalnum() else "_" for c in label)
    return keyed_call
