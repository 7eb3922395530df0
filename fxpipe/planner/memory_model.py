"""The activation memory a schedule needs, from what one micro-batch keeps on each stage.

Plain Python over action lists (no torch). A stage keeps, per micro-batch, some bytes from
its forward until its backward begins (:class:`MicrobatchMemory`: ``forward``), holds at
most ``backward`` while that backward runs (a recomputation's saved tensors come and go
then), and, when the backward is split into "I" and "W", ``weight`` bytes from the "I"
until the "W". A worker runs its list in order, so what each stage holds at any moment
follows from the order alone, whatever the timing: :func:`activation_peaks` walks every
worker's list and returns the most each stage, and each worker (its stages together),
ever holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fxpipe.schedules import Action


@dataclass(frozen=True)
class MicrobatchMemory:
    """What one micro-batch keeps on one stage, in bytes.

    forward: held from the end of its forward until its backward (B, or I) starts;
    backward: the most held while that backward runs (at least ``forward``);
    weight: held from the end of its "I" until its "W" (what the deferred weight
    gradients need).
    """

    forward: float
    backward: float
    weight: float = 0.0

    def scaled(self, factor: float) -> MicrobatchMemory:
        """The same stage at ``factor`` times the micro-batch size (activations follow the
        batch)."""
        return MicrobatchMemory(self.forward * factor, self.backward * factor, self.weight * factor)


def activation_peaks(actions: Sequence[Sequence[Action]], per_stage: Sequence[MicrobatchMemory]) -> tuple[list[float], list[float]]:
    """Returns (per stage, per worker) the most activation bytes held at once while each
    worker runs its list in order, one micro-batch of stage ``s`` keeping ``per_stage[s]``.

    Raises:
        IndexError: if an action names a stage without an entry in ``per_stage``.
    """
    stage_peak = [0.0] * len(per_stage)
    worker_peak = [0.0] * len(actions)
    stage_live = [0.0] * len(per_stage)
    for w, todo in enumerate(actions):
        live = 0.0
        for action in todo:
            kept = per_stage[action.stage]
            s = action.stage
            if action.op == "F":
                change, transient = kept.forward, 0.0
            elif action.op == "W":
                change, transient = -kept.weight, 0.0
            else:  # B or I: the backward's own high-water mark, then what stays
                transient = kept.backward - kept.forward
                change = -kept.forward + (kept.weight if action.op == "I" else 0.0)
            stage_peak[s] = max(stage_peak[s], stage_live[s] + max(transient, change, 0.0))
            worker_peak[w] = max(worker_peak[w], live + max(transient, change, 0.0))
            stage_live[s] += change
            live += change
    return stage_peak, worker_peak


def describe_choice(recompute: bool | str, offload: bool) -> str:
    """What a stage keeps for backward, in words, for its recompute and offload choice."""
    if offload:
        return "its activations in host memory (offload)"
    return {False: "every activation", True: "only its inputs (recompute)", "selective": "its costly ops' outputs (selective recompute)"}[recompute]
