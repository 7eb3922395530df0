"""Selective recompute: a stage keeps the outputs of its costly ops and recomputes the rest.

``Plan(checkpoint="selective")`` (or ``"auto"`` choosing it for a stage) sits between
keeping every activation and recomputing the whole forward in backward: the outputs of
matrix products, convolutions and attention (most of a layer's time, a minority of what
it saves) are kept; everything cheap (norms, activations, elementwise ops, views) is
recomputed from the stage's inputs in backward. Built on PyTorch's selective activation
checkpointing modes (``torch.utils.checkpoint.create_selective_checkpoint_contexts``):
during the forward a caching dispatch mode keeps the costly ops' outputs; in backward the
forward runs again under the matching replay mode, which hands those outputs back instead
of computing them, so autograd records every op (with the costly ones' inputs saved)
while only the cheap ones compute.

The forward records an autograd graph that saves nothing (its pack hook drops every
tensor), so the ops dispatched are the same as in the recomputation, which the replay
mode requires; the stage hands on detached outputs, and the graph goes with them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

# what the selective policy keeps: matrix products, convolutions, attention kernels
_COSTLY = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "matmul", "_int_mm", "convolution", "_convolution",
    "mkldnn_convolution", "cudnn_convolution", "miopen_convolution", "convolution_overrideable",
})
_ATTENTION = ("_scaled_dot_product", "_flash_attention", "_efficient_attention")


def costly(op: Any) -> bool:
    """Whether selective recompute keeps the output of ATen ``op`` (a matrix product,
    convolution or attention kernel) rather than recomputing it."""
    name = op._overloadpacket.__name__ if hasattr(op, "_overloadpacket") else str(op)
    return name in _COSTLY or name.startswith(_ATTENTION)


def _drop(_: torch.Tensor) -> None:
    return None


def _never(_: Any) -> torch.Tensor:
    raise RuntimeError("fxpipe: a selectively recomputed stage's forward graph was backpropagated; its backward recomputes")


class SelectiveRecompute:
    """One micro-batch of one stage: its forward keeps the costly ops' outputs, its
    backward replays them. ``kept`` lists them (detached) for memory accounting."""

    def __init__(self) -> None:
        self.kept: list[torch.Tensor] = []
        self._caching, self._replay = create_selective_checkpoint_contexts(self._policy)
        # fxpipe's own hooks below are not the user's: no warning about them
        self._caching.respect_saved_tensors_hooks = False

    def _policy(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if costly(op):
            self.kept += [t.detach() for t in pytree.tree_leaves(ctx.op_output) if isinstance(t, torch.Tensor)]
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """The block runs the stage's forward: costly outputs kept, nothing saved."""
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_drop, _never), self._caching:
            yield

    def replay(self) -> contextlib.AbstractContextManager:
        """The block recomputes the forward, the kept outputs handed back in order."""
        return self._replay
