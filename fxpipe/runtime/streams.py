"""Device plumbing for workers: one CUDA stream per worker, events on hand-offs.

On the CPU everything here is a no-op. On CUDA a worker runs its actions on its own
stream; a value handed to another worker carries an event recorded on the producer's
stream, and the consumer makes its stream (and the source device's current stream,
which cross-device copies use) wait on that event before reading it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree


class WorkerStream:
    """The stream a worker runs on (None on the CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def active(self) -> contextlib.AbstractContextManager:
        """The block runs on this worker's stream (nothing to do on the CPU)."""
        if self.stream is None:
            return _NOTHING
        return _on_stream(self.device, self.stream)

    def record(self) -> Any:
        """An event marking the work queued so far (None on the CPU)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def receive(self, value: Any, event: Any) -> Any:
        """Make ``value`` (produced elsewhere) safe to use on this worker's stream."""
        if event is None:
            return value
        if self.stream is not None:
            self.stream.wait_event(event)
        for leaf in pytree.tree_leaves(value):
            if isinstance(leaf, torch.Tensor) and leaf.is_cuda:
                torch.cuda.current_stream(leaf.device).wait_event(event)
                if self.stream is not None and leaf.device == self.device:
                    leaf.record_stream(self.stream)
        return value

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()


_NOTHING = contextlib.nullcontext()


@contextlib.contextmanager
def _on_stream(device: torch.device, stream: Any) -> Iterator[None]:
    with torch.cuda.device(device), torch.cuda.stream(stream):
        yield


def move(value: Any, device: torch.device, detach: bool) -> Any:
    """Tensors in ``value`` moved to ``device``; with ``detach``, as fresh autograd leaves
    that require grad exactly when the source did (the boundary of a stage's backward)."""

    def one(t: torch.Tensor) -> torch.Tensor:
        if not detach:
            return t.to(device, non_blocking=True)
        out = t.detach().to(device, non_blocking=True)
        return out.requires_grad_(t.requires_grad)

    if isinstance(value, torch.Tensor):  # the common case, without pytree's cost
        return one(value)
    return pytree.tree_map_only(torch.Tensor, one, value)


def leaves(value: Any) -> list[Any]:
    """The pytree leaves of a value (a tensor is its own single leaf, cheaply)."""
    return [value] if isinstance(value, torch.Tensor) else pytree.tree_leaves(value)


def wants_grad(module: torch.nn.Module, args: list) -> bool:
    """Whether a stage's outputs depend on something that wants a gradient."""
    if any(p.requires_grad for p in module.parameters()):
        return True
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in pytree.tree_leaves(args))


def carries_grad(value: Any) -> Any:
    """``value`` with its floating-point tensors marked as requiring grad (detached views):
    what a stage computed without autograd (checkpointing) hands to its consumers."""
    def mark(t: torch.Tensor) -> torch.Tensor:
        return t.detach().requires_grad_(True) if t.is_floating_point() or t.is_complex() else t

    return pytree.tree_map_only(torch.Tensor, mark, value)

