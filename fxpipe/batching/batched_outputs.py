"""What the eager model returns, asked on fake tensors: which outputs follow the batch,
and one call's output shapes.

The pipelines merge micro-batches' outputs by what they are (``fxpipe.batching.microbatch.merge``):
an output whose dim 0 follows the input batch is concatenated, any other is merged as
``Plan.output_merge`` says. This module answers the question once per input structure,
from the traced program's own data flow: its graph replayed on fake tensors at two batch
sizes (``fxpipe.passes.fake_replay``, where a node that cannot run on fake tensors, a
router's ``nonzero``, runs for real), else with the compiler's fake eager run
(``fxpipe.passes.generalise.eager_on_fake``). A step of
listed micro-batches counts its loss's tokens before anything runs, on each micro-batch's
output as meta tensors (:func:`output_like`). The pipelines get both handed in by
``fxpipe.factory``, so no runtime imports a pass.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from fxpipe.batching.microbatch import batch_size, leaves_with_paths, path_of
from fxpipe.passes.fake_replay import FakeReplay
from fxpipe.passes.generalise import eager_on_fake
from fxpipe.passes.targets import resolver


def batched_outputs(model: nn.Module, args: tuple = (), kwargs: Mapping[str, Any] | None = None, part: Any = None) -> dict[str, bool]:
    """Which tensor outputs of ``model(*args, **kwargs)`` are batched: dim 0 follows the batch.

    part: the call's ``Partitioned`` program, when there is one: its graph is replayed on
    fake tensors at the batch N and at 2N (:func:`graph_batched_outputs`), which never
    stops at a value a node reads (a node that cannot run on fake tensors runs for real).
    Without it, or when that replay fails, ``forward`` runs twice on fake tensors (``FakeTensorMode``; the parameters and buffers
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
    if part is not None and n is not None:
        try:
            return graph_batched_outputs(part, args, kwargs)
        except Exception:  # noqa: BLE001 - the program's graph did not replay: ask the eager model
            pass
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


def graph_batched_outputs(part: Any, args: tuple, kwargs: Mapping[str, Any]) -> dict[str, bool]:
    """Which tensor outputs of the traced program ``part`` (a ``Partitioned``) follow the
    batch of the call ``(args, kwargs)``: its whole partitioned graph replayed on fake tensors
    with the batch-sized inputs at N and at 2N rows. An output is batched when its dim 0 is
    k x the batch for one k >= 1 at both sizes. The trace's checks of the sizes it branched
    on are skipped (a trace that iterated over the batch holds the size of a micro-batch,
    yet its outputs follow the batch). Raises what the replay raises."""
    flat = part.bind_inputs(tuple(args), dict(kwargs))
    n = batch_size((args, kwargs))
    tensors = [t for t in flat if isinstance(t, torch.Tensor) and t.dim() > 0]
    modules = [stage.module for stage in part.stages]
    resolve = resolver(*modules)
    rows = []
    for size in (n, 2 * n):
        fake_run = FakeReplay(_device_for_skeletons(modules), real_inputs=size == n, assumptions=False)
        inputs = [_resized(x, n, size) if any(x is t for t in tensors) else x for x in flat]
        with torch.no_grad():
            out = part.build_output(fake_run.run(part.graph, inputs, resolve))
        rows.append({
            path_of(key_path): (int(leaf.shape[0]) if leaf.dim() > 0 else None)
            for key_path, leaf in leaves_with_paths(out)
            if isinstance(leaf, torch.Tensor)
        })
    first, second = rows
    return {
        path: rows_n is not None and rows_n > 0 and rows_n % n == 0 and second.get(path) == 2 * rows_n
        for path, rows_n in first.items()
    }


def _device_for_skeletons(modules: list[nn.Module]) -> torch.device | None:
    """None when every stage holds real tensors; else (a rank holding only its own stages,
    the others on the meta device) the device of the real ones, or the CPU: a graph that
    reads ``x.device`` would otherwise see ``meta``."""
    tensors = [t for m in modules for t in itertools.chain(m.parameters(), m.buffers())]
    if not any(t.is_meta for t in tensors):
        return None
    return next((t.device for t in tensors if not t.is_meta), torch.device("cpu"))


def _resized(t: torch.Tensor, n: int, size: int) -> torch.Tensor:
    """``t`` with ``size`` rows where it has the batch's ``n`` (on the meta device: only its
    shape is read), else ``t``."""
    if size == n or t.shape[0] != n:
        return t
    return torch.empty((size, *t.shape[1:]), dtype=t.dtype, device="meta")


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
    with torch.no_grad():  # eager_on_fake holds back torch's log of refusing meta kernels
        eager_on_fake(model, tuple(args), dict(kwargs or {}), getattr(model, "fxpipe_devices", None), kernel_dtypes=True)
