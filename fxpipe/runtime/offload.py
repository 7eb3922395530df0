"""Offloading: a CUDA stage's saved activations wait in host memory between its forward
and its backward.

``Plan(offload=True)`` (or ``"auto"`` choosing it for a stage) hands each tensor autograd
saves on a CUDA stage to :class:`Offload` (through the stage's saved-tensor hooks,
:mod:`~fxpipe.runtime.memory`): a copy into pinned host memory is queued on a side stream
after the work that made the tensor, and the GPU memory is released once that copy has
run (``record_stream`` keeps the caching allocator from reusing it earlier). Before the
micro-batch's backward the runner calls :meth:`Offload.prefetch`, which queues the copies
back on the side stream, so they overlap whatever runs before that backward; the backward
waits for each tensor's copy only when autograd unpacks it. Host memory is the
heterogeneous device that pays: hundreds of gigabytes against a GPU's tens.

Correct by construction: every copy is ordered by CUDA events (after the producer, before
the consumer), and the values autograd gets back are the values it saved. Tensors below
``MIN_BYTES`` stay on the GPU (the copies' fixed costs outweigh them). On a CPU stage
nothing moves; the compiler never sets ``offload`` there. The memory profile
(``fxpipe.compiler.memory_profile``) uses the same class with ``copy=False``: nothing moves, but
the accounting sees the tensors leave at the forward and return at the prefetch.
"""

from __future__ import annotations

import torch

MIN_BYTES = 1 << 16  # smaller saved tensors stay where they are


class Offloaded:
    """One saved tensor sent to host memory: the host copy, the event marking the copy
    done, and once prefetched, the device copy and its event."""

    __slots__ = ("tensor", "host", "sent", "back", "arrived")

    def __init__(self, tensor: torch.Tensor | None, host: torch.Tensor | None, sent: torch.cuda.Event | None) -> None:
        self.tensor = tensor  # the tensor itself when nothing is copied (profile)
        self.host = host
        self.sent = sent
        self.back: torch.Tensor | None = None
        self.arrived: torch.cuda.Event | None = None


class Offload:
    """A stage's offloading on ``device``; ``copy=False`` only pretends (for the memory
    profile on fake tensors)."""

    def __init__(self, device: torch.device, copy: bool = True) -> None:
        self.device = device
        self.copy = copy and device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.copy else None

    def takes(self, t: torch.Tensor) -> bool:
        """Whether saved tensor ``t`` goes to host memory."""
        return (not self.copy or t.device == self.device) and t.numel() * t.element_size() >= MIN_BYTES

    def pack(self, t: torch.Tensor) -> Offloaded:
        """Queue ``t``'s copy to pinned host memory after the work that made it."""
        if not self.copy:
            return Offloaded(t, None, None)
        made = torch.cuda.current_stream(self.device).record_event()
        host = torch.empty(t.shape, dtype=t.dtype, layout=t.layout, pin_memory=True)
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(made)
            host.copy_(t, non_blocking=True)
            t.record_stream(self.stream)  # t's memory is reused only after the copy
            sent = self.stream.record_event()
        return Offloaded(None, host, sent)

    def prefetch(self, item: Offloaded) -> None:
        """Queue ``item``'s copy back to the device (once)."""
        if not self.copy or item.back is not None:
            return
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(item.sent)
            item.back = torch.empty(item.host.shape, dtype=item.host.dtype, device=self.device)
            item.back.copy_(item.host, non_blocking=True)
            item.arrived = self.stream.record_event()

    def unpack(self, item: Offloaded) -> torch.Tensor:
        """The saved tensor again, on the device, once its copy back has arrived."""
        if not self.copy:
            return item.tensor
        self.prefetch(item)
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(item.arrived)
        item.back.record_stream(stream)
        return item.back
