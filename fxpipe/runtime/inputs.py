"""A call's inputs against those the program was traced for, before any stage runs.

A trace serves every call of its signature (``fxpipe.passes.signature``): under torch.fx the
sizes are read at run time, so another sequence length runs the same stages, and another
dtype is traced again. Neither says whether the model itself can take the call: eight
features where a ``Linear`` has nine, or a float64 batch for float32 weights, would fail
inside stage 0 with a bare torch error ("mat1 and mat2 shapes cannot be multiplied").

:class:`InputCheck` keeps the batch-free description (per forward argument, each tensor's
dtype and its sizes after dim 0) of the compile-time example and of every call found to
fit. A call described alike costs one binding per step; another description is asked of
the model once, on fake tensors with the dtype rules of real kernels (the compiler's
``check_call``, handed in), and either joins the known ones or raises :class:`InputError`
naming the argument, what was traced and what was given.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import torch.utils._pytree as pytree
from torch import nn

_SHORT = {torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16", torch.int64: "i64", torch.int32: "i32", torch.bool: "bool"}


class InputError(TypeError):
    """A call's input has a dtype or a non-batch shape the model, as traced, cannot take;
    the message names the forward argument, the traced and the given description."""


def _tensor_text(dtype: torch.dtype, sizes: tuple[int, ...]) -> str:
    return f"{_SHORT.get(dtype, str(dtype).replace('torch.', ''))}[{', '.join(['*', *map(str, sizes)])}]"


class InputCheck:
    """The descriptions of calls known to fit the program, and the check of a new one.

    model: a skeleton of the model (code and structure, ``fxpipe.runtime.placement.skeleton``);
    example: the compile-time call (args, kwargs); check_call(model, args, kwargs): raises
    what the eager model raises on fake tensors of the call's shapes and dtypes.
    """

    def __init__(self, model: nn.Module, example: tuple[tuple, dict], check_call: Callable[[nn.Module, tuple, dict], None]) -> None:
        self._model = model
        self._signature = inspect.signature(model.forward)
        self._check_call = check_call
        self._example_call = example
        self._example = self.describe(*example)
        self._known = {self._example}
        self._checkable: bool | None = None  # whether the model runs on fake tensors at all

    def describe(self, args: tuple, kwargs: dict) -> tuple | None:
        """Per forward argument: its name, structure and, per tensor leaf, (dtype, sizes
        after dim 0); None when the call does not bind to forward (the signature check says
        why)."""
        try:
            bound = self._signature.bind(*args, **kwargs)
        except TypeError:
            return None
        bound.apply_defaults()
        described = []
        for name, value in bound.arguments.items():
            leaves, spec = pytree.tree_flatten(value)
            described.append((name, str(spec), tuple((t.dtype, tuple(t.shape[1:])) if isinstance(t, torch.Tensor) else None for t in leaves)))
        return tuple(described)

    def __call__(self, args: tuple, kwargs: dict) -> None:
        """Raise InputError when the model cannot take this call's dtypes and non-batch
        shapes (found on fake tensors, once per new description)."""
        described = self.describe(args, kwargs)
        if described is None or described in self._known:
            return
        if self._checkable is None:
            self._checkable = self._runs(*self._example_call)
        if not self._checkable:  # not even the example runs on fake tensors: nothing to tell
            return
        try:
            self._check_call(self._model, args, kwargs)
        except Exception as err:  # noqa: BLE001 - what the forward raises is the reason
            raise InputError(self._message(described, err)) from err
        self._known.add(described)

    def _runs(self, args: tuple, kwargs: dict) -> bool:
        try:
            self._check_call(self._model, args, kwargs)
        except Exception:  # noqa: BLE001 - a model fake tensors cannot run (data-dependent shapes)
            return False
        return True

    def _message(self, described: tuple, err: BaseException) -> str:
        """One line: each tensor argument that differs from the example (traced and given),
        the model's own failure on fake tensors, and the fix."""
        traced = {name: (spec, leaves) for name, spec, leaves in self._example or ()}
        differences, fixes = [], []
        for name, spec, leaves in described:
            mine_spec, mine_leaves = traced.get(name, (spec, leaves))
            if mine_spec != spec:
                continue
            for k, (mine, given) in enumerate(zip(mine_leaves, leaves)):
                if mine is None or given is None or mine == given:
                    continue
                label = repr(name) if len(leaves) == 1 else f"{name!r} (tensor {k})"
                differences.append(f"argument {label} is {_tensor_text(*given)} where it was traced as {_tensor_text(*mine)}")
                if mine[0] != given[0]:
                    fixes.append(f"pass {name}.to({mine[0]})")
                if mine[1] != given[1]:
                    fixes.append(f"give {name} the traced sizes after the batch dimension {list(mine[1])}")
        cause = (str(err).strip().splitlines() or [""])[0]
        what = "; ".join(differences) or "arguments differ from the traced example"
        fix = " or ".join(dict.fromkeys(fixes)) or "pass inputs like the example"
        return (
            f"{type(self._model).__name__}.forward's {what}, and the model cannot take it ({type(err).__name__}: {cause}): "
            f"{fix}, or compile with example_inputs of this kind"
        )
