"""``pipe.memory()``: each stage's memory in the last training step, predicted and measured.

A stage's memory is its state (parameters, their gradients, buffers) plus the tensors it
keeps for backward, at their peak over the step. The measured peak comes from the step
itself (``fxpipe.runtime.memory``: autograd's saved tensors and the runner's held values,
each storage once, as the schedule interleaves micro-batches); the predicted one from the
stage's memory profile (a fake run, ``fxpipe.compiler.memory_profile``) walked through the
schedule (``fxpipe.planner.memory_model``). Optimizer state is not part of either peak (the
pipeline does not know the optimizer); the planner (``checkpoint="auto"``) adds Adam's
two moments per parameter to what a device must hold.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fxpipe.devices import torch_device
from fxpipe.inspection import format as fmt
from fxpipe.planner.memory_model import activation_peaks, describe_choice
from fxpipe.schedules import stage_workers

if TYPE_CHECKING:
    from fxpipe.planner.estimates import StageChoices
    from fxpipe.runtime.memory import StepMemory


@dataclass(frozen=True)
class StageMemoryRow:
    """One stage's memory in the last step, in bytes.

    parameters / gradients / buffers: the stage's state after the step (gradients as
    held then); activations_peak: the most bytes kept for backward at once, measured;
    predicted_activations: the same, predicted; predicted_peak / measured_peak: state
    plus activations (predicted gradients: one per trainable parameter);
    allocator_peak: on CUDA, the caching allocator's peak on the stage's device during
    the step (every stage on that device together), else None; keeps: what the stage
    keeps for backward (its recompute and offload choice).
    """

    index: int
    device: str
    parameters: int
    gradients: int
    buffers: int
    activations_peak: int
    predicted_activations: float
    predicted_peak: float
    measured_peak: int
    allocator_peak: int | None = None
    keeps: str = ""

    @property
    def error(self) -> float:
        """predicted_peak / measured_peak - 1 (0 when nothing was measured)."""
        return self.predicted_peak / self.measured_peak - 1 if self.measured_peak else 0.0


@dataclass(frozen=True)
class DeviceMemoryRow:
    """The activations the stages on one logical device kept at once, at their peak over
    the step: measured and predicted (bytes)."""

    device: str
    stages: tuple[int, ...]
    activations_peak: int
    predicted_activations: float


@dataclass
class MemoryReport:
    """The last training step's memory on this process, one row per stage it runs (and
    ``devices``, per logical device, its stages' activations together). Iterate it,
    index it by position, or print it (a table, bytes in IEC units)."""

    stages: list[StageMemoryRow]
    microbatches: int
    schedule: str
    devices: list[DeviceMemoryRow] = field(default_factory=list)

    def __iter__(self) -> Iterator[StageMemoryRow]:
        return iter(self.stages)

    def __len__(self) -> int:
        return len(self.stages)

    def __getitem__(self, k: int) -> StageMemoryRow:
        return self.stages[k]

    def __str__(self) -> str:
        head = ("stage", "device", "parameters", "gradients", "buffers", "activations", "predicted", "peak", "predicted peak", "peak error")
        rows = [head]
        for r in self.stages:
            rows.append((
                str(r.index), r.device, fmt.nbytes(r.parameters), fmt.nbytes(r.gradients), fmt.nbytes(r.buffers),
                fmt.nbytes(r.activations_peak), fmt.nbytes(r.predicted_activations), fmt.nbytes(r.measured_peak),
                fmt.nbytes(r.predicted_peak), f"{r.error:+.1%}",
            ))
        widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
        lines = [f"memory of the last step ({self.microbatches} micro-batches, {self.schedule}), measured and predicted:"]
        lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
        lines += [f"stage {r.index} keeps {r.keeps}" for r in self.stages if r.keeps != describe_choice(False, False)]
        lines += [
            f"{d.device} (stages {', '.join(map(str, d.stages))}): activations {fmt.nbytes(d.activations_peak)} at once, "
            f"predicted {fmt.nbytes(d.predicted_activations)}"
            for d in self.devices if len(d.stages) > 1
        ]
        peaks = {r.device: r.allocator_peak for r in self.stages if r.allocator_peak is not None}
        lines += [f"CUDA allocator peak on {d}: {fmt.nbytes(p)}" for d, p in peaks.items()]
        lines.append(
            "activations: the most bytes kept for backward at once (saved tensors and held values, each storage "
            "once); peak: parameters + gradients + buffers + activations; optimizer state not included"
        )
        return "\n".join(lines)


@dataclass(frozen=True)
class StateBytes:
    """What a stage module holds between steps, each storage once: parameter bytes,
    buffer bytes, and the bytes of the parameters that get gradients."""

    params: int
    buffers: int
    trainable: int


def memory_report(
    part: Any, sizes: list[int], step: StepMemory, state: dict[int, StateBytes], schedule: str, inputs: list | None = None
) -> MemoryReport:
    """The report of a step of ``part`` (its Partitioned) cut into micro-batches of
    ``sizes`` whose stage modules held ``state`` (this process's stages, by index). Micro-batches
    of different shapes (a listed step) give ``inputs``, the flat inputs of the one with
    the most elements: every micro-batch is predicted as that one, an upper bound."""
    m = len(sizes)
    choices = part.choices(m, size=max(sizes), inputs=inputs)
    estimates = part.estimates(m, choices)
    rows = []
    for index, held in sorted(state.items()):
        stage = part.stages[index]
        params, buffers, trainable = held.params, held.buffers, held.trainable
        record = step.stages.get(index)
        measured = record.peak if record is not None else 0
        predicted = estimates[index].activation_peak
        rows.append(StageMemoryRow(
            index, stage.device, params, step.gradients.get(index, 0), buffers, measured, predicted,
            params + trainable + buffers + predicted, params + step.gradients.get(index, 0) + buffers + measured,
            step.allocator_peak.get(str(torch_device(stage.device))), describe_choice(stage.recompute, stage.offload),
        ))
    return MemoryReport(rows, m, schedule, _devices(part, m, choices, step, state))


def _devices(part: Any, m: int, choices: StageChoices, step: StepMemory, state: dict[int, StateBytes]) -> list[DeviceMemoryRow]:
    """Per logical device this process runs stages on: its activations at once, measured
    and (from the workers' order, those on one device added) predicted."""
    predicted: dict[str, float] = {}
    if choices.profile is not None:
        actions = part.actions(m)
        workers = stage_workers(actions)
        for w, peak in enumerate(activation_peaks(actions, choices.profile)[1]):
            device = part.stages[workers.index(w)].device
            predicted[device] = predicted.get(device, 0.0) + peak
    rows = []
    for device, total in step.devices.items():
        stages = tuple(s for s in sorted(state) if part.stages[s].device == device)
        rows.append(DeviceMemoryRow(device, stages, total.peak, predicted.get(device, 0.0)))
    return rows
