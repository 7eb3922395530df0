"""``Plan(checkpoint="auto")`` and ``Plan(offload="auto")``: what each stage keeps for
backward, chosen so that every device fits and the step is the fastest predicted.

Each stage may keep every activation (False), recompute its forward in backward (True),
keep only its costly ops' outputs and recompute the rest ("selective"), or, on a CUDA
stage, keep every activation in host memory until its backward (offload). What one
micro-batch then keeps on the stage comes from its memory profile (a fake run of the
stage, ``fxpipe.compiler.memory_profile``), how many it keeps at once from the schedule
(``fxpipe.planner.memory_model``), and what it costs from the cost model (the forward again, the
cheap ops again, or the transfers the stage's compute does not hide).

A device needs the state of its stages (parameters, gradients, optimizer state, buffers)
plus the most activation bytes its workers hold at once; it fits when that is within
its ``DeviceSpec.memory``. The search starts from keeping everything and, while a device
does not fit, changes the one stage on such a device whose change saves the most bytes
per second added to the simulated step. A plan that still cannot fit raises PlanError
saying which device is short, by how much, and what would fit.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fxpipe.batching.microbatch import batch_size, microbatch_inputs
from fxpipe.inspection import format as fmt
from fxpipe.plan import Plan, PlanError
from fxpipe.planner.cost_model import spec_for
from fxpipe.planner.estimates import StageChoices
from fxpipe.planner.memory_model import MicrobatchMemory, activation_peaks, describe_choice
from fxpipe.schedules import stage_workers

# a stage's choice: (recompute, offload), cheapest first
Choice = tuple[bool | str, bool]
KEEP: Choice = (False, False)
RECOMPUTE_OPTIONS: tuple[Choice, ...] = (KEEP, ("selective", False), (True, False))
OFFLOAD: Choice = (False, True)


def memory_choices(plan: Plan, num_stages: int, devices: Sequence[str], choices: tuple[list, list] | None = None) -> tuple[list, list]:
    """Each stage's (recompute, offload) as the plan states it ("auto" starts from keeping
    everything; :func:`plan_memory` resolves it), or an earlier signature's ``choices``.

    Raises PlanError when ``plan.checkpoint`` lists another number of entries than there
    are stages. Warns, once, when ``plan.offload=True`` meets a stage that is not on CUDA.
    """
    if choices is not None:
        return list(choices[0]), list(choices[1])
    checkpoint = plan.checkpoint
    if isinstance(checkpoint, list):
        if len(checkpoint) != num_stages:
            raise PlanError(
                f"plan.checkpoint lists {len(checkpoint)} entries but the model is cut into {num_stages} stages; "
                f"give one of False / True / 'selective' per stage, or checkpoint='auto'"
            )
        recompute = list(checkpoint)
    else:
        recompute = [False if checkpoint == "auto" else checkpoint] * num_stages
    on_cuda = [d.startswith("cuda") for d in devices]
    if plan.offload is True and not all(on_cuda):
        cpu = [f"stage {s} ({d})" for s, d in enumerate(devices) if not d.startswith("cuda")]
        warnings.warn(
            f"plan.offload=True does nothing on {', '.join(cpu)}: a CPU stage's activations are in host memory "
            "already; only CUDA stages offload",
            stacklevel=4,
        )
    return recompute, [plan.offload is True and cuda for cuda in on_cuda]


@dataclass
class _Candidate:
    """One assignment of choices: per-stage choices, the memory each device needs, the
    simulated step."""

    picks: list[Choice]
    needed: dict[str, float]
    step: float


class _Search:
    """The memory profiles of every option, and the evaluation of an assignment."""

    def __init__(self, part: Any) -> None:
        self.part = part
        self.plan = part.plan
        self.m = self.plan.microbatches
        self.devices = part.devices
        self.options = self._options()
        used = {choice for options in self.options for choice in options}
        n = part.num_stages
        self.profiles = {c: part.memory_profile(self.m, [c[0]] * n, [c[1]] * n) for c in used}
        if any(p is None for p in self.profiles.values()):
            raise PlanError("plan.checkpoint/offload='auto' needs the stages' memory profile, and a stage cannot run on fake tensors: " + part.notes[-1])
        self.limits = {d: spec_for(self.plan, d).memory for d in set(self.devices)}
        self.state = [e.state_bytes for e in part.estimates(self.m, StageChoices([False] * n, [False] * n))]
        self.actions = part.actions(self.m)

    def _options(self) -> list[tuple[Choice, ...]]:
        plan, stages = self.plan, self.part.stages
        out = []
        for stage in stages:
            recompute = RECOMPUTE_OPTIONS if plan.checkpoint == "auto" else ((stage.recompute, False),)
            if plan.offload == "auto" and stage.device.startswith("cuda"):
                recompute = recompute + (OFFLOAD,)
            elif stage.offload:
                recompute = tuple((r, True) if r is False else (r, False) for r, _ in recompute)
            out.append(recompute)
        return out

    def choices(self, picks: Sequence[Choice]) -> StageChoices:
        profile = [self.profiles[c][s] for s, c in enumerate(picks)]
        return StageChoices([c[0] for c in picks], [c[1] for c in picks], profile)

    def evaluate(self, picks: list[Choice]) -> _Candidate:
        choices = self.choices(picks)
        return _Candidate(picks, self.needed(choices.profile), self.part.simulate(self.m, choices).step_time)

    def needed(self, profile: Sequence[MicrobatchMemory]) -> dict[str, float]:
        return _needs(self.devices, self.state, self.actions, profile)

    def over(self, candidate: _Candidate) -> dict[str, float]:
        """The devices that do not fit, with the bytes they are short."""
        return {d: n - self.limits[d] for d, n in candidate.needed.items() if n > self.limits[d]}


def device_needs(part: Any, choices: StageChoices, microbatches: int | None = None) -> dict[str, float]:
    """Bytes each device of ``part`` (a Partitioned) must hold under ``choices`` (with a
    memory profile): its stages' state (parameters, gradients, Adam's moments, buffers)
    and the most activations its workers hold at once."""
    m = microbatches or part.plan.microbatches
    state = [e.state_bytes for e in part.estimates(m, choices)]
    return _needs(part.devices, state, part.actions(m), choices.profile)


def _needs(devices: Sequence[str], state: Sequence[float], actions: Any, profile: Sequence[MicrobatchMemory]) -> dict[str, float]:
    """Per device, its stages' ``state`` plus its workers' activation peaks."""
    workers = stage_workers(actions)
    needed = dict.fromkeys(devices, 0.0)
    for s, device in enumerate(devices):
        needed[device] += state[s]
    for w, peak in enumerate(activation_peaks(actions, profile)[1]):
        needed[devices[workers.index(w)]] += peak
    return needed


def choose(part: Any) -> tuple[list[Choice], float]:
    """For a Partitioned whose plan says ``checkpoint="auto"`` or ``offload="auto"``, each
    stage's (recompute, offload): the fastest predicted choice with which every device
    fits, and that predicted step. Raises PlanError (see the module doc)."""
    search = _Search(part)
    best = search.evaluate([options[0] for options in search.options])
    while search.over(best):
        step = _best_change(search, best)
        if step is None:
            raise PlanError(_cannot_fit(search, best))
        best = step
    return best.picks, best.step


def plan_memory(part: Any) -> None:
    """Resolve ``checkpoint="auto"`` / ``offload="auto"`` on a Partitioned in place: each
    stage's ``recompute`` and ``offload`` set by :func:`choose`, and said in its
    ``reason`` and in the notes."""
    picks, step = choose(part)
    for stage, (recompute, offload) in zip(part.stages, picks):
        stage.recompute, stage.offload = recompute, offload
        stage.reason += f"; keeps {describe_choice(recompute, offload)} (memory plan)"
    part.notes.append(
        "memory plan: " + ", ".join(f"stage {s} {describe_choice(*c)}" for s, c in enumerate(picks))
        + f"; predicted step {fmt.seconds(step)}; every device fits"
    )


def with_memory_plan(part: Any) -> Any:
    """A copy of ``part`` (its stages copied) resolved as :func:`plan_memory` does, for
    another schedule or micro-batch count of the same partition."""
    picks, _ = choose(part)
    stages = [dataclasses.replace(st, recompute=r, offload=o) for st, (r, o) in zip(part.stages, picks)]
    return dataclasses.replace(part, stages=stages)


def _best_change(search: _Search, current: _Candidate) -> _Candidate | None:
    """The one-stage change (on a device that does not fit) saving the most bytes there
    per second it adds to the step; None when no change saves anything."""
    over = search.over(current)
    best, best_score = None, 0.0
    for s, device in enumerate(search.devices):
        if device not in over:
            continue
        for choice in search.options[s]:
            if choice == current.picks[s]:
                continue
            picks = list(current.picks)
            picks[s] = choice
            candidate = search.evaluate(picks)
            saved = current.needed[device] - candidate.needed[device]
            if saved <= 0:
                continue
            score = saved / max(candidate.step - current.step, 1e-9)
            if score > best_score:
                best, best_score = candidate, score
    return best


def _cannot_fit(search: _Search, best: _Candidate) -> str:
    """Which devices are short with the most memory-saving choices, by how much, and what
    would fit."""
    lines = ["plan cannot fit the devices' memory, even with every stage saving what it can:"]
    for device, short in sorted(search.over(best).items()):
        state = sum(st for st, d in zip(search.state, search.devices) if d == device)
        lines.append(
            f"  {device} needs {fmt.nbytes(best.needed[device])} (state {fmt.nbytes(state)} with "
            f"gradients and optimizer state, activations {fmt.nbytes(best.needed[device] - state)}), has "
            f"{fmt.nbytes(search.limits[device])}: short by {fmt.nbytes(short)}"
        )
        if state > search.limits[device]:
            lines.append(f"    its stages' state alone exceeds it: cut the model over more devices, or give {device} more memory")
    lines.append("what would fit: " + "; ".join(_fixes(search, best)))
    return "\n".join(lines)


def _fixes(search: _Search, best: _Candidate) -> list[str]:
    """What would make the plan fit: device memory, more micro-batches (checked on the
    scaled profile), a schedule holding fewer micro-batches."""
    over = search.over(best)
    fixes = ["DeviceSpec(memory=...) of at least " + ", ".join(f"{fmt.nbytes(best.needed[d])} on {d}" for d in sorted(over))]
    part = search.part
    batch = batch_size(part.bind_inputs(part.example_inputs, part.example_kwargs)) or 1
    at = microbatch_inputs(part, search.m)[1]
    for m in (search.m * 2, search.m * 4, search.m * 8):
        if m > batch:
            break
        size = microbatch_inputs(part, m)[1]
        profile = [kept.scaled(size / at) for kept in search.choices(best.picks).profile]
        if all(n <= search.limits[d] for d, n in search.needed(profile).items()):
            fixes.append(f"microbatches={m} (smaller micro-batches hold fewer activations)")
            break
    fixes.append("a schedule holding fewer micro-batches ('v-half' or 'v-min', chunks=2)")
    return fixes
