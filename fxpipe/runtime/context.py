"""What one call of a pipeline asks of every stage, captured from the caller once.

Worker threads (and other ranks) do not inherit the caller's thread-local state, so
``pipe(x)`` / ``pipe.step(x)`` capture it here and every stage re-enters it: the grad
mode and the autocast state (device type, dtype, enabled, cache), which is also part of
the input signature that edge shapes and dtypes are derived for.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from fxpipe.runtime.memory import StepMemory

AUTOCAST_DEVICES = ("cpu", "cuda")
_NOTHING = contextlib.nullcontext()
_GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: consecutive micro-batches' seeds far apart


@dataclass(frozen=True)
class AutocastState:
    """The caller's autocast settings: per device type, (enabled, dtype); and the cache flag."""

    settings: tuple[tuple[str, bool, torch.dtype], ...] = ()
    cache: bool = True

    @classmethod
    def current(cls) -> AutocastState:
        """The autocast state of the calling thread."""
        settings = tuple(
            (device, True, torch.get_autocast_dtype(device))
            for device in AUTOCAST_DEVICES
            if torch.is_autocast_enabled(device)
        )
        return cls(settings, torch.is_autocast_cache_enabled())

    @property
    def enabled(self) -> bool:
        return bool(self.settings)

    def applied(self) -> contextlib.AbstractContextManager:
        """A context running its block under this autocast state (on any thread)."""
        if not self.settings:
            return _NOTHING
        return self._entered()

    @contextlib.contextmanager
    def _entered(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for device, enabled, dtype in self.settings:
                stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled, cache_enabled=self.cache))
            yield

    def __str__(self) -> str:
        if not self.settings:
            return "no autocast"
        return ", ".join(f"autocast({d}, {str(t).replace('torch.', '')})" for d, _, t in self.settings)


@dataclass
class StepContext:
    """One call of the pipeline, as every stage sees it.

    train: a training step (backward actions run; values are detached between stages);
    otherwise a forward that keeps autograd history across stages when ``grad_enabled``.
    grad_enabled: whether forwards record autograd graphs (always, in a training step).
    autocast: the caller's autocast state, re-entered by every stage.
    loss_of(i, output): micro-batch i's weighted loss from the last stage's output.
    microbatch_base: the global index of this process's first micro-batch (data-parallel
    replicas number theirs after the earlier replicas').
    outputs / losses: filled by the last stage, per micro-batch.
    saved: what each (stage, micro-batch) keeps between its forward and its backward, and
    deferred: the weight-gradient work an "I" leaves for its "W"; both belong to the call,
    so a stage that outlives a failed call cannot touch the next one.
    step_seed: drawn once per call from the caller's global generator when the pipeline
    has random ops; every random op draws from (step_seed, global micro-batch index, op).
    last_stage_scaling(i): the context of micro-batch i's last-stage forward when the model
    computes its own loss (see :meth:`loss_scaling`).
    memory: what a training step's stages keep for backward, measured as they run.
    """

    train: bool
    grad_enabled: bool
    autocast: AutocastState = field(default_factory=AutocastState)
    loss_of: Callable[[int, Any], torch.Tensor] | None = None
    microbatch_base: int = 0
    outputs: dict[int, Any] = field(default_factory=dict)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    saved: dict[tuple[int, int], tuple[list, Any, list | None, Any]] = field(default_factory=dict)
    deferred: dict[tuple[int, int], list] = field(default_factory=dict)
    step_seed: int = 0
    last_stage_scaling: Callable[[int], contextlib.AbstractContextManager] | None = None
    memory: StepMemory | None = None

    def loss_scaling(self, i: int) -> contextlib.AbstractContextManager:
        """The context the last stage computes micro-batch ``i`` in: a model's own loss
        calls scaled to the step's counts (``fxpipe.batching.loss_scale``), or nothing."""
        if self.last_stage_scaling is None or not self.train:
            return _NOTHING
        return self.last_stage_scaling(i)

    def rng_seed(self, i: int) -> int:
        """The seed micro-batch ``i``'s random ops draw from: the step's seed moved along by
        the micro-batch's global index (the same on every rank and in a recompute)."""
        return (self.step_seed + (self.microbatch_base + i) * _GOLDEN) % 2**64

    @classmethod
    def capture(
        cls, train: bool, loss_of: Callable[[int, Any], torch.Tensor] | None = None, microbatch_base: int = 0, random: bool = False
    ) -> StepContext:
        """The context of a call made now on this thread: a training step always records
        autograd graphs (``step()`` under ``torch.no_grad()`` still computes gradients);
        with ``random`` (the pipeline has random ops) one seed is drawn from the caller's
        global generator, so it advances the same way whatever the schedule."""
        return cls(
            train=train,
            grad_enabled=train or torch.is_grad_enabled(),
            autocast=AutocastState.current(),
            loss_of=loss_of,
            microbatch_base=microbatch_base,
            step_seed=int(torch.empty((), dtype=torch.int64).random_()) if random else 0,
        )
