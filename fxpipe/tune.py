"""``fxpipe.tune``: the schedule and micro-batch count, chosen by prediction and confirmed
by measuring.

The tutorial's "split size" sweep, done without running most of it: the model is
partitioned once, the cost model predicts one step (``Partitioned.simulate``) for every
candidate schedule and micro-batch count, pairs whose predicted peak memory does not fit a
device are dropped, and the few best predicted pairs are run and timed for real. Fewer
micro-batches leave a bigger pipeline bubble; more pay the fixed per-op and per-action
costs more often on smaller kernels, so the curve is U-shaped and its bottom is the answer;
schedules differ in their bubble and in how many micro-batches they keep in memory. Under
``checkpoint="auto"`` (or ``offload="auto"``) each pair gets its own per-stage choice
(``fxpipe.planner.memory_plan``), so the sweep searches over recompute too.
"""

from __future__ import annotations

import textwrap
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from fxpipe.batching.microbatch import batch_size
from fxpipe.compiler.driver import partition
from fxpipe.factory import build_pipeline
from fxpipe.plan import Plan, PlanError, PlanScheduleError
from fxpipe.planner.cost_model import spec_for
from fxpipe.planner.memory_plan import with_memory_plan
from fxpipe.schedules import (
    SCHEDULES,
    ScheduleError,
    ScheduleSpec,
    describe_schedule,
    min_microbatches,
)


@dataclass
class TunePoint:
    """One (schedule, micro-batch count) of the sweep: predicted step seconds and peak bytes
    on the fullest device, whether that fits, the measured step seconds when it was run,
    and what each stage recomputes (chosen per point under ``checkpoint="auto"``)."""

    microbatches: int
    predicted_step: float
    predicted_memory: float
    fits: bool
    measured_step: float | None = None
    schedule: ScheduleSpec = "1f1b"
    recompute: tuple = ()
    error: str | None = None

    @property
    def name(self) -> str:
        """``1f1b x 8``: the candidate's schedule and micro-batch count."""
        return f"{describe_schedule(self.schedule)} x {self.microbatches}"


def _batch_size(example_inputs: tuple) -> int:
    size = batch_size(example_inputs)
    if size is None:
        raise PlanError("tune needs a tensor with a batch dimension among example_inputs")
    return size


def _mean_loss(output: Any, target: Any) -> torch.Tensor:
    leaves = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return sum(t.mean() for t in leaves)


def sweep(
    model: nn.Module,
    plan: Plan | Mapping[str, Any],
    example_inputs: tuple | Any,
    loss_fn: Any = None,
    target: Any = None,
    candidates: Sequence[int] | None = None,
    measure: int | Sequence[int] = 3,
    repeats: int = 3,
    example_kwargs: Mapping[str, Any] | None = None,
    profile: Any = None,
    schedules: Sequence[ScheduleSpec] | None = None,
) -> list[TunePoint]:
    """Predict every candidate (schedule, micro-batch count) and measure a few; one
    TunePoint each, in schedule then count order.

    candidates: counts to predict (default 1 up to the batch size, at most 64; a named
    schedule skips the counts below its ``min_microbatches``, as "dualpipev" below 2p - 1);
    schedules: schedules to predict (default the plan's and every built-in schedule that
    runs its stages on the same workers); measure: how many of the best predicted pairs
    that fit to compile and time, or the exact counts to time (under the plan's schedule);
    repeats: timed steps per measured pair (the fastest is kept, after one warm-up step),
    each on the split that was predicted. Schedules that split the backward into I and W
    (zero bubble) are predicted and run on a partition compiled for them (its stages defer
    weight gradients). The model is never changed: the measured pipelines run on copies of
    the stages (a default candidate whose own partition does not fit is left out).
    ``loss_fn(output, target)`` defaults to the mean of the outputs. Raises PlanError for
    counts above the batch size or a schedule that cannot run the plan's stages, and what
    ``fxpipe.partition`` raises.
    """
    plan = Plan.coerce(plan)
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    batch = _batch_size(example_inputs)
    counts = sorted(set(candidates or range(1, min(batch, 64) + 1)))
    if counts[0] < 1 or counts[-1] > batch:
        raise PlanError(f"tune candidates must lie in 1..{batch} (the example batch size), got {counts}")
    base = partition(model, plan, example_inputs, example_kwargs, profile)
    specs = list(schedules) if schedules is not None else _runnable_schedules(base, plan)
    # one partition per kind of backward: the plan's, and one compiled for the other kind
    parts = {_splits_backward(plan.schedule, base, plan): base}

    def partition_for(spec: ScheduleSpec) -> Any:
        split = _splits_backward(spec, base, plan)
        if split not in parts:
            try:
                parts[split] = partition(model, plan.replace(schedule=spec), example_inputs, example_kwargs, profile)
            except PlanError:
                if schedules is not None:
                    raise
                parts[split] = None  # a default candidate that cannot be planned (memory): left out
        return parts[split]

    limits = [spec_for(plan, d).memory for d in base.devices]
    points = []
    runs: dict[int, Any] = {}  # id of a point -> the Partitioned it predicted
    for spec in specs:
        part = partition_for(spec)
        if part is None:
            continue
        for m in counts:
            if isinstance(spec, str) and m < min_microbatches(spec, part.num_workers):
                continue  # a count the named schedule does not run (dualpipev's least is 2p - 1)
            point, runs_on = _predicted(part, spec, m, plan, limits, strict=schedules is not None)
            points.append(point)
            runs[id(point)] = runs_on
    if isinstance(measure, int):
        order = sorted((p for p in points if p.fits), key=lambda p: p.predicted_step)
        wanted = measure
    else:
        order = [p for p in points if p.schedule == plan.schedule and p.microbatches in set(measure)]
        wanted = len(order)
    loss_fn = loss_fn or _mean_loss
    done = 0
    for point in order:  # a candidate that fails is named and skipped: the next best is timed instead
        if done >= wanted:
            break
        try:
            # on copies of the model's tensors: timing changes nothing of the model
            pipe = build_pipeline(runs[id(point)], model, loss_fn, own=False)
            point.measured_step = _time_step(pipe, example_inputs, example_kwargs or {}, target, repeats)
            done += 1
        except Exception as err:  # noqa: BLE001 - any failure of one candidate: reported, the sweep goes on
            _skip(point, err, "failed when run")
    return points


def _predicted(part: Any, spec: ScheduleSpec, m: int, plan: Plan, limits: list[float], strict: bool) -> tuple[TunePoint, Any]:
    """The TunePoint of ``part`` under ``spec`` with ``m`` micro-batches, and the Partitioned
    it predicted (None when it could not be predicted: the point then carries its error
    and a warning names it). Raises PlanScheduleError when the caller named the schedule
    (``strict``) and it cannot run the partition."""
    point = TunePoint(m, float("nan"), float("nan"), False, schedule=spec)
    try:
        # the split that was partitioned, under another schedule and count (split="auto"
        # would otherwise re-split for each, and the measurement would not be of the prediction)
        at = _under(part, spec, m)
        planned = _memory_planned(at)
        at = planned or at
        estimates = at.estimates()
        point.predicted_memory = max(e.memory for e in estimates)
        point.predicted_step = at.simulate().step_time
        point.recompute = tuple(st.recompute for st in at.stages)
        point.fits = all(e.memory <= limit for e, limit in zip(estimates, limits)) and (planned is not None or not _plans_memory(plan))
    except Exception as err:  # noqa: BLE001 - one candidate that cannot be predicted: reported, skipped
        if strict and isinstance(err, PlanScheduleError):
            raise
        point.fits = False
        _skip(point, err, "could not be predicted")
        return point, None
    return point, at


def _skip(point: TunePoint, err: BaseException, what: str) -> None:
    """Record why ``point`` has no measurement (``point.error``) and say so in a warning."""
    point.error = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"
    warnings.warn(f"fxpipe.tune: candidate {point.name} {what} ({point.error}); skipped, the sweep goes on", stacklevel=3)


def _plans_memory(plan: Plan) -> bool:
    return plan.checkpoint == "auto" or plan.offload == "auto"


def _memory_planned(part: Any) -> Any:
    """``part`` with each stage's recompute and offload chosen for its schedule and count
    when the plan says "auto" (``fxpipe.planner.memory_plan``); None when nothing fits or the plan
    states them."""
    if not _plans_memory(part.plan):
        return None
    try:
        return with_memory_plan(part)
    except PlanError:
        return None


def _runnable_schedules(part: Any, plan: Plan) -> list[ScheduleSpec]:
    """The plan's schedule, then every other built-in schedule that runs ``part``'s stages
    on the workers they were placed for."""
    runnable: list[ScheduleSpec] = [plan.schedule]
    for name in SCHEDULES:
        if name == plan.schedule:
            continue
        try:
            part.under(name, min_microbatches(name, part.num_workers)).actions()
        except ScheduleError:
            continue
        runnable.append(name)
    return runnable


def _splits_backward(spec: ScheduleSpec, part: Any, plan: Plan) -> bool:
    """Whether ``spec`` runs input- and weight-gradient actions (I, W) apart (wherever it
    places the stages: a partition is compiled for it)."""
    try:
        actions = plan.replace(schedule=spec).actions(part.num_stages, deps=part.deps)
    except ScheduleError:
        return False
    return any(a.op in ("I", "W") for todo in actions for a in todo)


def _under(part: Any, spec: ScheduleSpec, microbatches: int) -> Any:
    """``part`` under another schedule and count; raises PlanScheduleError when they cannot
    run its stages where it placed them."""
    try:
        at = part.under(spec, microbatches)
        at.actions()
    except ScheduleError as err:
        raise PlanScheduleError(f"tune: schedule {describe_schedule(spec)} cannot run this partition with {microbatches} micro-batch(es): {err}") from err
    return at


def _time_step(pipe: Any, args: tuple, kwargs: Mapping[str, Any], target: Any, repeats: int) -> float:
    best = float("inf")
    for k in range(repeats + 1):
        start = time.perf_counter()
        pipe.step(*args, target=target, **kwargs)
        if k:
            best = min(best, time.perf_counter() - start)
        pipe.zero_grad()
    return best


def tune(
    model: nn.Module,
    plan: Plan | Mapping[str, Any],
    example_inputs: tuple | Any,
    loss_fn: Any = None,
    target: Any = None,
    plot: str | Path | None = None,
    **options: Any,
) -> Plan:
    """The plan with the best schedule and micro-batch count: lowest measured step time
    among the measured pairs (lowest predicted when ``measure=0``).

    ``options`` go to :func:`sweep` (candidates, schedules, measure, repeats,
    example_kwargs, profile). ``plot``: write predicted (lines, one per schedule) and
    measured (points) step time against the micro-batch count to this image file. Raises
    PlanError when nothing fits the devices' memory, and what :func:`sweep` raises.
    """
    plan = Plan.coerce(plan)
    points = sweep(model, plan, example_inputs, loss_fn, target, **options)
    if plot is not None:
        plot_sweep(points, plot)
    measured = [p for p in points if p.measured_step is not None]
    failed = [p for p in points if p.error is not None]
    if measured:
        best = min(measured, key=lambda p: p.measured_step)
    else:
        fitting = [p for p in points if p.fits and p.error is None]
        if not fitting:
            why = f"; every candidate tried failed: {'; '.join(f'{p.name}: {p.error}' for p in failed[:3])}" if failed else ""
            raise PlanError(f"no schedule and micro-batch count fit the devices' memory and ran{why}; see Partitioned.explain() for where memory goes")
        best = min(fitting, key=lambda p: p.predicted_step)
    return plan.replace(schedule=best.schedule, microbatches=best.microbatches)


def plot_sweep(points: Sequence[TunePoint], path: str | Path, title: str | None = None) -> Path:
    """Draw predicted and measured step time against the micro-batch count, one line per
    schedule; returns the path.

    Raises ImportError without matplotlib (``pip install fxpipe[plot]``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    schedules = list(dict.fromkeys(describe_schedule(p.schedule) for p in points))
    for name in schedules:
        own = [p for p in points if describe_schedule(p.schedule) == name]
        label = f"predicted, {name}" if len(schedules) > 1 else "predicted"
        line = ax.plot([p.microbatches for p in own], [p.predicted_step * 1e3 for p in own], "-", label=label)[0]
        measured = [p for p in own if p.measured_step is not None]
        if measured:
            ax.plot([p.microbatches for p in measured], [p.measured_step * 1e3 for p in measured], "o", color=line.get_color(), label=label.replace("predicted", "measured"))
    unfit = [p for p in points if not p.fits and p.error is None]
    failed = [p for p in points if p.error is not None]
    if failed:  # named where they stand (at their prediction, or at the curve's floor when unpredicted)
        floor = min((p.predicted_step for p in points if p.predicted_step == p.predicted_step), default=1e-3)
        ys = [(p.predicted_step if p.predicted_step == p.predicted_step else floor) * 1e3 for p in failed]
        ax.plot([p.microbatches for p in failed], ys, "X", color="black", markersize=9, label="failed (skipped)")
        for p, y in zip(failed, ys):
            cause = p.error.split("): ")[-1]  # a stage's failure: the error it raised, not where
            text = textwrap.shorten(f"{p.name}: {cause}", 90, placeholder=" …")
            ax.annotate("\n".join(textwrap.wrap(text, 34)), (p.microbatches, y), textcoords="offset points",
                        xytext=(-10, -10), ha="right", va="top", fontsize=7,
                        bbox={"boxstyle": "round", "facecolor": "white", "alpha": 0.8, "linewidth": 0})
    if unfit:
        ax.plot([p.microbatches for p in unfit], [p.predicted_step * 1e3 for p in unfit], "x", color="red", label="exceeds memory")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batches")
    ax.set_ylabel("step time (ms)")
    ax.set_title(title or "step time against micro-batch count")
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


# ``fxpipe.tune`` is the function above (it shadows this module's name in ``fxpipe``), so
# the sweep it runs is reachable from it too: ``fxpipe.tune.sweep(...)``
tune.sweep = sweep  # type: ignore[attr-defined]
