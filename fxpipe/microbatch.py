"""Micro-batches: cut the batch along dim 0, and put outputs back together.

A batch of N samples cut into m micro-batches gets sizes as even as possible
(10 into 4 → 3, 3, 2, 2). Tensors whose dim 0 equals N are cut; everything else
(non-tensor arguments, tensors of another leading size, 0-d tensors) is passed whole
to every micro-batch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree


class MicrobatchError(ValueError):
    """The batch cannot be cut as the plan asks."""


def batch_size(values: Any) -> int | None:
    """The leading size of the first tensor with at least one dimension, or None."""
    for leaf in pytree.tree_leaves(values):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return None


def split_sizes(n: int, m: int) -> list[int]:
    """Sizes of m micro-batches of an n-sample batch, as even as possible, larger first."""
    if m > n:
        raise MicrobatchError(
            f"plan.microbatches = {m} but the batch has only {n} samples; use at most {n} "
            "micro-batches (Plan(microbatches=...)) or a larger batch"
        )
    return [n // m + (1 if i < n % m else 0) for i in range(m)]


def split(values: Any, m: int) -> tuple[list[Any], list[int]]:
    """Cut every batch-sized tensor in ``values`` (any pytree) into m micro-batches.

    Returns (one pytree per micro-batch, their sizes). Raises MicrobatchError when there
    are fewer samples than micro-batches or no tensor to cut.
    """
    n = batch_size(values)
    if n is None:
        if m == 1:
            return [values], [1]
        raise MicrobatchError("no tensor input with a batch dimension to cut into micro-batches; use Plan(microbatches=1)")
    sizes = split_sizes(n, m)
    leaves, spec = pytree.tree_flatten(values)
    columns = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == n:
            columns.append(list(torch.split(leaf, sizes)))
        else:
            columns.append([leaf] * m)
    return [pytree.tree_unflatten([c[i] for c in columns], spec) for i in range(m)], sizes


def merge(outputs: list[Any]) -> Any:
    """Put micro-batch outputs back together: tensors are concatenated along dim 0.

    Leaves that are not tensors with a batch dimension are kept from the first micro-batch
    when all micro-batches agree, and returned as a list otherwise.
    """
    if len(outputs) == 1:
        return outputs[0]
    flat = [pytree.tree_flatten(o) for o in outputs]
    spec = flat[0][1]
    merged = []
    for column in zip(*(leaves for leaves, _ in flat)):
        first = column[0]
        if isinstance(first, torch.Tensor) and first.dim() > 0:
            merged.append(torch.cat([t.to(first.device) for t in column]))
        elif all(_same(first, other) for other in column[1:]):
            merged.append(first)
        else:
            merged.append(list(column))
    return pytree.tree_unflatten(merged, spec)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a.cpu(), b.cpu()))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - incomparable values are different
        return False


def loss_weights(sizes: list[int], loss_fn: Any, total: int | None = None, scale: float = 1.0) -> list[float]:
    """Weights that make the micro-batch losses sum to the whole batch's loss.

    A mean-reduced loss (torch's default) is weighted by its micro-batch's share of
    ``total`` samples (default ``sum(sizes)``; data parallelism passes the global batch),
    a ``reduction="sum"`` loss by 1; every weight is then multiplied by ``scale``.
    """
    total = sum(sizes) if total is None else total
    if getattr(loss_fn, "reduction", "mean") == "sum":
        return [scale] * len(sizes)
    return [scale * n / total for n in sizes]


def weighted_loss(loss_fn: Any, build_output: Any, targets: list[Any], weights: list[float]) -> Any:
    """``loss_of(i, stage_output)``: micro-batch i's loss times ``weights[i]``.

    ``build_output`` turns the last stage's output into what the model returns. Without a
    ``loss_fn`` the model's output (or its ``.loss``) must be a scalar loss; otherwise
    ``loss_of`` raises ValueError saying so.
    """

    def loss_of(i: int, out: Any) -> torch.Tensor:
        out = build_output(out)
        if loss_fn is not None:
            loss = loss_fn(out, targets[i])
        else:
            loss = getattr(out, "loss", out)
            if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
                raise ValueError("step() needs a loss: pass loss_fn to fxpipe.compile, or return a scalar loss from forward")
        return loss * weights[i]

    return loss_of
