"""Measured memory of a training step: what each stage keeps for its backward, and when.

A stage keeps, from a micro-batch's forward until its backward, the tensors autograd saved
(seen with ``torch.autograd.graph.saved_tensors_hooks`` around the stage's forward and,
under ``checkpoint``, around the recomputation in backward) and the values the runner holds
itself (the received inputs and the outputs whose gradients will come back; under
``checkpoint`` only the inputs). After an "I", only what the deferred weight gradients need
stays until the "W". :class:`StageMemory` counts those bytes as they come and go and
keeps the peak: each storage once (a view and its base, two micro-batches sharing the
batch's storage, count the bytes they cover once), parameters and buffers not at all
(they are the stage's state, counted apart).

A saved tensor is counted from its pack hook until autograd lets go of it: the hook hands
autograd a small holder instead of the tensor, and the holder's finalizer uncounts it, so
the count follows autograd's own lifetimes (saved values are freed as the backward passes
them). Tensors an :class:`~fxpipe.runtime.offload.Offload` takes to host memory count
only from the prefetch before their backward. :class:`StepMemory` gathers one call's stages, and after the step their gradient
bytes and, on CUDA, the allocator's peak per device.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from fxpipe.inspection.memory_report import StateBytes
from fxpipe.runtime.offload import Offload

# (device, storage identity): a storage, which views and detached copies share
StorageKey = tuple[str, int]


def _extent(t: torch.Tensor) -> tuple[StorageKey, int, int] | None:
    """The storage ``t`` lives in and the byte range of it that ``t`` can reach; None for
    a tensor that holds no memory (empty, on the meta device, or without a storage). Fake
    tensors count as the real ones would: storages are told apart by their identity."""
    if t.numel() == 0 or t.device.type == "meta" or t.is_sparse or t.is_nested:
        return None
    try:
        storage = t.untyped_storage()
        address = storage._cdata
    except (RuntimeError, NotImplementedError, AttributeError):
        return None
    itemsize = t.element_size()
    start = t.storage_offset() * itemsize
    span = (1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))) * itemsize
    return (str(t.device), address), start, min(start + span, storage.nbytes())


def storages(tensors: Iterable[torch.Tensor]) -> set[StorageKey]:
    """The storages of ``tensors`` (those holding memory)."""
    return {extent[0] for t in tensors if (extent := _extent(t)) is not None}


class _Saved:
    """What autograd keeps in place of a saved tensor: the tensor (or its offloaded copy)
    and its count, uncounted when autograd drops it."""

    __slots__ = ("payload", "owner", "entry", "counted", "offload", "__weakref__")

    def __init__(self, payload: Any, owner: StageMemory, entry: tuple[StorageKey, int, int] | None, offload: Offload | None = None) -> None:
        self.payload = payload
        self.owner = owner
        self.entry = entry
        self.counted = offload is None and entry is not None
        self.offload = offload

    def __del__(self) -> None:
        if self.counted:
            self.owner._remove(self.entry)


def _unpack(saved: Any) -> Any:
    if not isinstance(saved, _Saved):
        return saved
    return saved.offload.unpack(saved.payload) if saved.offload is not None else saved.payload


class Total:
    """Bytes summed over several stages (those on one device): ``live`` and ``peak``."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._lock = threading.Lock()

    def add(self, change: int) -> None:
        with self._lock:
            self.live += change
            self.peak = max(self.peak, self.live)


class StageMemory:
    """One stage's activation bytes over one step: ``live`` now, ``peak`` the most so far.

    ``state``: storages of the stage's parameters and buffers, never counted here;
    ``device``: the total of the stages on the same device, which every change also
    moves. Thread-safe: autograd may free saved tensors on its own threads (CUDA).
    """

    def __init__(self, state: set[StorageKey], device: Total | None = None) -> None:
        self.state = state
        self.device = device
        self.live = 0
        self.peak = 0
        self._lock = threading.Lock()
        self._ranges: dict[StorageKey, dict[tuple[int, int], int]] = {}
        self._bytes: dict[StorageKey, int] = {}
        self._held: dict[Any, list[tuple[StorageKey, int, int]]] = {}
        self._away: dict[Any, list[weakref.ref]] = {}  # offloaded, per key: not on the device
        self._packed: dict[Any, set[StorageKey]] = {}  # storages autograd saved, per key

    @contextlib.contextmanager
    def saving(self, key: Any = None, offload: Offload | None = None) -> Iterator[None]:
        """Count every tensor autograd saves inside the block until autograd lets it go;
        with ``offload``, the tensors it takes go to host memory and count only from
        ``fetch(key)`` on."""
        @torch._dynamo.disable
        def pack(t: torch.Tensor) -> Any:
            # autograd calls this from the eager code between a compiled stage's graphs too,
            # where Dynamo would otherwise compile it anew for every key (and hit its limit)
            return self._pack(t, key, offload)

        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            yield

    def fetch(self, key: Any) -> None:
        """Bring back what ``saving(key, offload)`` sent to host memory (its backward is
        next): the copies are queued, and counted from now on."""
        for ref in reversed(self._away.pop(key, ())):  # the backward needs the last saved first
            saved = ref()
            if saved is not None and not saved.counted:
                saved.offload.prefetch(saved.payload)
                saved.counted = True
                self._add(saved.entry)

    def hold(self, key: Any, values: Any) -> None:
        """Count the tensors in ``values`` (any pytree) until ``release(key)``."""
        entries = [e for t in _tensors(values) if (e := self._entry(t)) is not None]
        for entry in entries:
            self._add(entry)
        self._held.setdefault(key, []).extend(entries)

    def release(self, key: Any) -> None:
        """Stop counting what ``hold(key, ...)`` counted (nothing when it held nothing)."""
        self._packed.pop(key, None)
        for entry in self._held.pop(key, ()):
            self._remove(entry)

    def saved_storages(self, key: Any) -> set[StorageKey]:
        """The storages of what autograd saved inside ``saving(key)`` so far."""
        return self._packed.get(key, set())

    def _pack(self, t: torch.Tensor, key: Any, offload: Offload | None) -> Any:
        # what autograd keeps must not hold a grad_fn: an op's saved output would otherwise
        # reference its own graph through the hook (a cycle the collector cannot see, which
        # a step that never runs its backward, a failed one, would leak)
        t = t.detach() if t.grad_fn is not None else t
        entry = self._entry(t)
        if entry is None:
            return t
        self._packed.setdefault(key, set()).add(entry[0])
        if offload is not None and offload.takes(t):
            saved = _Saved(offload.pack(t), self, entry, offload)
            self._away.setdefault(key, []).append(weakref.ref(saved))
            return saved
        self._add(entry)
        return _Saved(t, self, entry)

    def _entry(self, t: torch.Tensor) -> tuple[StorageKey, int, int] | None:
        extent = _extent(t)
        if extent is None or extent[0] in self.state or extent[1] >= extent[2]:
            return None
        return extent

    def _add(self, entry: tuple[StorageKey, int, int]) -> None:
        key, start, end = entry
        with self._lock:
            ranges = self._ranges.setdefault(key, {})
            ranges[(start, end)] = ranges.get((start, end), 0) + 1
            self._recount(key, ranges)

    def _remove(self, entry: tuple[StorageKey, int, int]) -> None:
        key, start, end = entry
        with self._lock:
            ranges = self._ranges[key]
            if ranges[(start, end)] == 1:
                del ranges[(start, end)]
            else:
                ranges[(start, end)] -= 1
            self._recount(key, ranges)
            if not ranges:
                del self._ranges[key]

    def _recount(self, key: StorageKey, ranges: dict[tuple[int, int], int]) -> None:
        """Bring ``live`` up to date with the bytes of ``key`` its ranges now cover."""
        covered, reach = 0, 0
        for start, end in sorted(ranges):
            if end > reach:
                covered += end - max(start, reach)
                reach = end
        change = covered - self._bytes.get(key, 0)
        self.live += change
        if self.device is not None and change:
            self.device.add(change)
        if covered:
            self._bytes[key] = covered
        else:
            self._bytes.pop(key, None)
        self.peak = max(self.peak, self.live)


def _tensors(values: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(values) if isinstance(t, torch.Tensor)]


@dataclass
class StepMemory:
    """One training step's measured memory on this process.

    stages: per stage index, its :class:`StageMemory`; devices: per logical device, the
    :class:`Total` of its stages; gradients: per stage, the bytes of its parameters'
    gradients after the step; allocator_peak: per CUDA device, the caching allocator's
    peak during the step (``torch.cuda.max_memory_allocated``); measured: False for a
    step that is not measured, whose offloading stages still count (offload runs through
    the same hooks) and the rest do not.
    """

    measured: bool = True
    stages: dict[int, StageMemory] = field(default_factory=dict)
    devices: dict[str, Total] = field(default_factory=dict)
    gradients: dict[int, int] = field(default_factory=dict)
    allocator_peak: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def stage(self, index: int, module: torch.nn.Module, device: str = "") -> StageMemory:
        """The record of stage ``index`` on logical ``device`` (made on its first use)."""
        with self._lock:
            if index not in self.stages:
                total = self.devices.setdefault(device, Total())
                self.stages[index] = StageMemory(storages(_state(module)), total)
            return self.stages[index]

    @classmethod
    def start(cls, devices: Iterable[torch.device], measured: bool = True) -> StepMemory:
        """A record for a step about to run on ``devices`` (when ``measured``, the CUDA
        allocators' peaks are reset, so they measure this step)."""
        if measured:
            for device in {d for d in devices if d.type == "cuda"}:
                torch.cuda.reset_peak_memory_stats(device)
        return cls(measured)

    def finish(self, modules: dict[int, torch.nn.Module], devices: Iterable[torch.device]) -> StepMemory:
        """Record what the step left: each stage's gradient bytes, the allocators' peaks."""
        for index, module in modules.items():
            grads = [p.grad for p in module.parameters() if p.grad is not None]
            self.gradients[index] = sum(stored_bytes(grads).values())
        for device in {d for d in devices if d.type == "cuda"}:
            self.allocator_peak[str(device)] = torch.cuda.max_memory_allocated(device)
        return self


def _state(module: torch.nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


def stored_bytes(tensors: Iterable[torch.Tensor]) -> dict[StorageKey, int]:
    """The bytes of each storage among ``tensors``' (each storage once, whole)."""
    out: dict[StorageKey, int] = {}
    for t in tensors:
        extent = _extent(t)
        if extent is not None:
            out[extent[0]] = t.untyped_storage().nbytes()
    return out


def held_state(module: torch.nn.Module) -> StateBytes:
    """What ``module`` (a stage) holds between steps, each storage once, for ``pipe.memory()``."""
    params = stored_bytes(module.parameters())
    buffers = {k: v for k, v in stored_bytes(module.buffers()).items() if k not in params}
    trainable = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    return StateBytes(sum(params.values()), sum(buffers.values()), trainable)
