"""What the eager model returns, asked on fake tensors: which outputs follow the batch,
and one call's output shapes.

The pipelines merge micro-batches' outputs by what they are (``fxpipe.batching.microbatch.merge``):
an output whose dim 0 follows the input batch is concatenated, any other is merged as
``Plan.output_merge`` says. This module answers the question once per input structure,
with the compiler's fake eager run (``fxpipe.passes.generalise.eager_on_fake``). A step of
listed micro-batches counts its loss's tokens before anything runs, on each micro-batch's
output as meta tensors (:func:`output_like`). The pipelines get both handed in by
``fxpipe.factory``, so no runtime imports a pass.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from fxpipe.batching.microbatch import batch_size, leaves_with_paths, path_of
from fxpipe.passes.generalise import eager_on_fake


def batched_outputs(model: nn.Module, args: tuple = (), kwargs: Mapping[str, Any] | None = None) -> dict[str, bool]:
    """Which tensor outputs of ``model(*args, **kwargs)`` are batched: dim 0 follows the batch.

    Runs ``forward`` twice on fake tensors (``FakeTensorMode``; the parameters and buffers
    are fake copies put in through ``torch.func.functional_call``), with every batch-sized
    input at the example's batch size N and at 2N: nothing is computed, and the model, its
    buffers and the random generators are left as they were. An output is batched when its
    dim 0 is k × the batch for one k ≥ 1 at both sizes (k > 1: rows of batch × sequence
    flattened). Returns {path: batched} for every tensor output (paths as ``fxpipe.batching.microbatch``
    names them). When ``forward`` cannot run on fake tensors, warns and returns {}: then
    every tensor output merged over several micro-batches needs its ``output_merge`` entry.
    """
    kwargs = dict(kwargs or {})
    n = batch_size((args, kwargs))
    try:
        first = _fake_outputs(model, args, kwargs, n, n)
        second = _fake_outputs(model, args, kwargs, n, 2 * n) if n is not None else first
    except Exception as err:  # noqa: BLE001 - any failure: fall back to explicit output_merge
        text = str(err).strip().splitlines()
        warnings.warn(
            f"fxpipe: {type(model).__name__}.forward did not run on fake tensors ({type(err).__name__}: "
            f"{text[0] if text else ''}), so which outputs are batched is unknown; merging several "
            "micro-batches' outputs will ask for Plan(output_merge={path: 'cat' | 'stack' | 'sum' | 'mean'})",
            stacklevel=2,
        )
        return {}
    batched = {}
    for path, rows in first.items():
        again = second.get(path)
        batched[path] = (
            n is not None and rows is not None and again is not None
            and rows > 0 and rows % n == 0 and again == 2 * rows
        )
    return batched


def _fake_outputs(model: nn.Module, args: tuple, kwargs: dict, n: int | None, size: int | None) -> dict[str, int | None]:
    """dim 0 (None for 0-d) of every tensor output when the batch-sized inputs have ``size`` rows."""
    def shape_of(t: torch.Tensor) -> tuple[int, ...]:
        return (size, *t.shape[1:]) if t.dim() > 0 and t.shape[0] == n else tuple(t.shape)

    with torch.no_grad():
        out = eager_on_fake(model, tuple(args), kwargs, getattr(model, "fxpipe_devices", None), shape_of)
    return {
        path_of(key_path): (int(leaf.shape[0]) if leaf.dim() > 0 else None)
        for key_path, leaf in leaves_with_paths(out)
        if isinstance(leaf, torch.Tensor)
    }


def output_like(model: nn.Module, args: tuple = (), kwargs: Mapping[str, Any] | None = None) -> Any:
    """What ``model(*args, **kwargs)`` returns, its tensors on the meta device (shapes and
    dtypes, no values), from one run of ``forward`` on fake tensors that computes nothing
    and leaves the model and the random generators as they were. Raises what ``forward``
    raises on fake tensors."""
    with torch.no_grad():
        out = eager_on_fake(model, tuple(args), dict(kwargs or {}), getattr(model, "fxpipe_devices", None))
    return pytree.tree_map_only(torch.Tensor, lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"), out)


def check_call(model: nn.Module, args: tuple = (), kwargs: Mapping[str, Any] | None = None) -> None:
    """Raise what ``model(*args, **kwargs)`` would raise for these inputs' shapes and dtypes,
    found on fake tensors (nothing computed; the dtype rules of real kernels kept:
    ``fxpipe.passes.generalise.KernelDtypes``): a call the program was not traced for is
    told apart from one it serves before any stage runs."""
    log = logging.getLogger("torch._subclasses.fake_tensor")  # logs every meta kernel that refuses, at ERROR
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        with torch.no_grad():
            eager_on_fake(model, tuple(args), dict(kwargs or {}), getattr(model, "fxpipe_devices", None), kernel_dtypes=True)
    finally:
        log.setLevel(level)
