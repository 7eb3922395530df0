"""``Partitioned``: the result of the compiler passes, before anything is placed on a device."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from fxpipe.batching.microbatch import microbatch_inputs
from fxpipe.compiler import memory_profile
from fxpipe.compiler.stage import Stage
from fxpipe.inspection import format as fmt
from fxpipe.inspection.contents import crossing_values, stage_contents
from fxpipe.inspection.diagram import partition_dot
from fxpipe.inspection.render import draw as draw_partition
from fxpipe.inspection.timeline import Timeline
from fxpipe.passes.partition import Edge, PartitionedGraph
from fxpipe.plan import Plan, PlanScheduleError
from fxpipe.planner.cost_model import Calibration, stage_models
from fxpipe.planner.estimates import (
    StageChoices,
    StageEstimate,
    estimate_stages,
    predicted_timeline,
)
from fxpipe.planner.memory_model import MicrobatchMemory, describe_choice
from fxpipe.schedules import Schedule, ScheduleSpec, describe_schedule, forward_only, stage_workers


@dataclass
class Partitioned:
    """A model cut into stages: inspectable (summary, explain, to_dot) without any hardware.

    The views (summary, explain, estimates, simulate, to_dot, draw) read the costs the
    compiler wrote on the graph; none of them runs a pass or writes ``node.meta``.

    stages: the Stage list (modules reference the model's own submodules: nothing copied);
    graph: the whole partitioned program with explicit send/recv nodes;
    frontend: "fx" or "export"; notes: what happened while compiling;
    stage_workers: the worker each stage runs on under the plan's schedule (a compile-time
    fact the runtimes read; :meth:`actions` keeps every micro-batch count's schedule to it);
    key: the signature of the call the trace was made for (``key_of(args, kwargs)`` gives a
    call's in the same terms); anchors: where each stage after the first begins, to cut
    another signature's trace at the same places; calibration: the per-kind rates
    ``fxpipe.profile`` measured, if a profile was given; model_losses: the loss calls the
    last stage makes (a model computing its own loss), with the slice that computes their
    targets from the model's inputs (``fxpipe.batching.loss_scale.ModelLosses``), or None;
    output_inputs: per output leaf, the model inputs (flat positions) it depends on;
    opaque: the callees the fx frontend runs whole (``fxpipe.passes.opaque.OpaqueCallee``:
    name, why, where fx stopped), listed by summary() and explain(); real_runs: the nodes
    that could not run on fake tensors and ran for real at compile time
    (``fxpipe.passes.shape_prop.RealRun``: node, module, target, why), listed there too;
    loss_terms: the names of the terms a model's own loss adds beside its reduced loss
    calls, computed from its inputs (a router's ``aux_loss``): computed per micro-batch;
    batch_lengths: where the trace iterated over the batch (``Traced.batch_lengths``): the
    stages hold the batch size, and a pipeline runs each micro-batch size on a trace of
    its own.
    """

    plan: Plan
    model_name: str
    stages: list[Stage]
    partitioned: PartitionedGraph
    frontend: str
    bind_inputs: Callable[[tuple, dict], list]
    build_output: Callable[[Any], Any]
    example_inputs: tuple = ()
    example_kwargs: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    stage_workers: list[int] = field(default_factory=list)
    key: Any = None
    key_of: Callable[..., Any] | None = None
    anchors: list[Any] = field(default_factory=list)
    calibration: Calibration | None = None
    model_losses: Any = None
    output_inputs: list[frozenset[int]] | None = None
    opaque: list[Any] = field(default_factory=list)
    real_runs: list[Any] = field(default_factory=list)
    loss_terms: list[str] = field(default_factory=list)
    batch_lengths: list[str] = field(default_factory=list)
    # (micro-batch size, memory profile) by (recompute, offload) per stage: shared by copies made with replace()
    profiles: dict = field(default_factory=dict, repr=False)
    _schedules: dict[tuple[int, bool], Schedule] = field(default_factory=dict, init=False, repr=False, compare=False)

    @cached_property
    def edge_ends(self) -> list[tuple[int, int]]:
        """(producer stage, consumer stage) of every edge, by edge id (``Stage.recv_ids`` /
        ``send_ids`` index them)."""
        return self.partitioned.edge_ends

    @cached_property
    def deps(self) -> list[tuple[int, int]]:
        """The stage graph: the distinct (producer, consumer) pairs of the edges, sorted."""
        return self.partitioned.deps

    def actions(self, microbatches: int | None = None, train: bool = True) -> Schedule:
        """Every worker's action list for ``microbatches`` (default the plan's): the plan's
        schedule, resolved and proven to run on this stage graph once per count, with each
        stage on the worker it was placed on; forwards only unless ``train``. The one
        source of the schedule for the runtimes, the estimates and the timeline.

        Raises PlanScheduleError (a ScheduleError) when the schedule cannot serve that count
        or would put a stage on another worker than ``stage_workers``.
        """
        m = microbatches or self.plan.microbatches
        if (m, train) not in self._schedules:
            actions = self.plan.actions(self.num_stages, m, self.deps)
            if stage_workers(actions) != self.stage_workers:
                raise PlanScheduleError(
                    f"plan.schedule={describe_schedule(self.plan.schedule)}: the schedule for {m} micro-batches puts "
                    f"the stages on workers {stage_workers(actions)}, but they were placed for workers "
                    f"{self.stage_workers}; a schedule must place stages the same way for every micro-batch count"
                )
            self._schedules[(m, train)] = actions if train else forward_only(actions)
        return self._schedules[(m, train)]

    def under(self, schedule: ScheduleSpec, microbatches: int) -> Partitioned:
        """The same stages under another schedule and micro-batch count (the plan's other
        fields kept); raises PlanError (PlanScheduleError) for a schedule the plan rejects.
        Call :meth:`actions` to know whether it runs them where they were placed."""
        return dataclasses.replace(self, plan=self.plan.replace(schedule=schedule, microbatches=microbatches))

    @property
    def num_workers(self) -> int:
        return max(self.stage_workers, default=0) + 1

    @property
    def graph(self) -> fx.Graph:
        return self.partitioned.graph

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def devices(self) -> list[str]:
        return [s.device for s in self.stages]

    def stage_contents(self) -> list[list[str]]:
        """Per stage, the modules it runs as the model names them, with numbered blocks as
        ranges and a block the cut falls inside named by part (see ``fxpipe.inspection.contents``):
        ``["transformer.h.6 (from attn) – transformer.h.11", "lm_head"]``."""
        return stage_contents([s.module_paths for s in self.stages])

    def summary_rows(self) -> list[tuple[str, ...]]:
        """The summary table: a header row, then per stage its device, nodes, parameters,
        FLOPs, predicted time and memory, what it receives and sends, and its modules."""
        rows = [("stage", "device", "nodes", "params", "param bytes", "FLOPs", "predicted", "memory", "recv", "send", "modules")]
        for s, est, modules in zip(self.stages, self.estimates(), self.stage_contents()):
            rows.append(
                (
                    str(s.index),
                    s.device,
                    str(s.num_nodes),
                    fmt.count(s.num_parameters),
                    fmt.nbytes(s.parameter_bytes),
                    fmt.count(est.flops),
                    fmt.seconds(est.time),
                    fmt.nbytes(est.memory),
                    f"{len(s.inputs)} ({fmt.nbytes(s.recv_bytes)})",
                    f"{len(s.outputs)} ({fmt.nbytes(s.send_bytes)})",
                    ", ".join(modules),
                )
            )
        return rows

    def crossing_rows(self) -> list[tuple[str, ...]]:
        """The values crossing stages: a header row, then per edge its stages, the module
        that produces it, its shape and dtype, and its bytes per full example batch."""
        origins = crossing_values(self.graph)
        rows = [("from", "to", "value", "shape", "bytes", "fx node")]
        for e in self.partitioned.edges:
            rows.append((str(e.src), str(e.dst), origins.get(e.name, e.name), e.description, fmt.nbytes(e.nbytes), e.name))
        return rows

    def summary(self) -> str:
        """A table per stage (device, nodes, parameters, FLOPs, predicted time and memory,
        recv/send, modules), then every value crossing stages by the module producing it."""
        head = (
            f"{self.model_name}: {self.num_stages} stage(s), schedule {self.plan.schedule}, "
            f"{self.plan.microbatches} micro-batch(es), traced with {self.frontend}"
        )
        lines = [head, *_aligned(self.summary_rows())]
        crossing = self.crossing_rows()
        if len(crossing) > 1:
            lines.append("values crossing stages:")
            lines += ["  " + line for line in _aligned(crossing)]
        lines.append("send/recv bytes are per full example batch; each micro-batch moves its share")
        lines.append(
            "FLOPs: forward, full example batch; predicted: forward+backward+send/recv of one micro-batch; "
            "memory: parameters, gradients, optimizer state and the activation peak (see docs/cost-model.md)"
        )
        return "\n".join(lines + self._opaque_lines())

    def _opaque_lines(self) -> list[str]:
        """The callees run whole (fx could not trace into them), one line each with the reason;
        then the nodes that ran for real at compile time, grouped by what they call and why."""
        lines = []
        if self.opaque:
            lines.append(f"run whole (opaque: torch.fx could not trace into them): {len(self.opaque)}")
            lines += [f"  {callee.describe()}" for callee in self.opaque]
        if self.real_runs:
            groups: dict[tuple[str, str], list[Any]] = {}
            for run in self.real_runs:
                groups.setdefault((run.target, run.why), []).append(run)
            lines.append(f"ran for real at compile time (not on fake tensors): {len(self.real_runs)} node(s)")
            for (target, why), runs in groups.items():
                modules = list(dict.fromkeys(r.module or "(root)" for r in runs))
                where = ", ".join(modules[:3]) + (f", … ({len(modules)} modules)" if len(modules) > 3 else "")
                lines.append(f"  {len(runs)} x {target} in {where}: {why}")
        return lines

    def explain(self) -> str:
        """Why each stage holds its nodes (tag, split point, cost model), the modules it
        runs, and each value it receives and sends, named by the module producing it."""
        lines = [f"{self.model_name} traced with {self.frontend}; split={self.plan.split!r}"]
        lines += [f"note: {n}" for n in self.notes]
        origins = crossing_values(self.graph)

        def value(e: Edge) -> str:
            return f"{origins.get(e.name, e.name)} {e.description} ({fmt.nbytes(e.nbytes)}; fx node {e.name})"

        for s, est, modules in zip(self.stages, self.estimates(), self.stage_contents()):
            lines.append(f"stage {s.index} on {s.device}: {s.reason}")
            lines.append(f"    runs {', '.join(modules)}")
            lines.append(
                f"    cost model, per micro-batch: forward {fmt.seconds(est.forward)}, backward "
                f"{fmt.seconds(est.backward)}, send/recv {fmt.seconds(est.comm)}; memory {fmt.nbytes(est.memory)} "
                f"(state {fmt.nbytes(est.state_bytes)} + activations {fmt.nbytes(est.activation_peak)} at their peak, "
                f"{est.in_flight} micro-batch(es) in flight; keeps {describe_choice(s.recompute, s.offload)})"
            )
            lines += [f"    recv from stage {e.src}: {value(e)}" for e in s.inputs]
            lines += [f"    send to stage {e.dst}: {value(e)}" for e in s.outputs]
        return "\n".join(lines + self._opaque_lines())

    def estimates(self, microbatches: int | None = None, choices: StageChoices | None = None) -> list[StageEstimate]:
        """The cost model's prediction per stage (time per micro-batch, memory, FLOPs), from
        the node costs the compiler wrote and the stages' memory profile. ``microbatches``
        defaults to the plan's; ``choices`` to the stages' own recompute and offload."""
        m = microbatches or self.plan.microbatches
        choices = choices or self.choices(m)
        return estimate_stages(self.graph, self.partitioned.edges, self.devices, self.plan, self.actions(m), m, self.calibration, choices)

    def device_memory(self) -> list[float]:
        """Bytes usable on each stage's device: its ``DeviceSpec.memory`` (the plan's
        ``device_specs``, else the cost model's default for the device)."""
        return [model.spec.memory for model in stage_models(self.plan, self.devices, self.calibration)]

    def simulate(self, microbatches: int | None = None, choices: StageChoices | None = None) -> Timeline:
        """The predicted Timeline of one training step under the plan's schedule.

        Stage times come from the cost model (or ``fxpipe.profile`` measurements), with
        each stage's recompute in its backward; ``microbatches`` overrides the plan's count.
        Returns a Timeline of kind "predicted" whose ``activation_bytes`` gives each
        stage's bytes per micro-batch.
        """
        m = microbatches or self.plan.microbatches
        choices = choices or self.choices(m)
        return predicted_timeline(self.estimates(m, choices), self.actions(m), self.partitioned.edges, self.devices, self.plan, m, self.calibration)

    def choices(
        self, microbatches: int | None = None, recompute: Sequence[bool | str] | None = None, offload: Sequence[bool] | None = None,
        size: int | None = None, inputs: list | None = None,
    ) -> StageChoices:
        """What each stage keeps for backward (its own recompute and offload unless given)
        with the memory profile of that choice (see :meth:`memory_profile`)."""
        recompute = list(recompute if recompute is not None else (s.recompute for s in self.stages))
        offload = list(offload if offload is not None else (s.offload for s in self.stages))
        return StageChoices(recompute, offload, self.memory_profile(microbatches, recompute, offload, size, inputs))

    def memory_profile(
        self, microbatches: int | None = None, recompute: Sequence[bool | str] | None = None, offload: Sequence[bool] | None = None,
        size: int | None = None, inputs: list | None = None,
    ) -> list[MicrobatchMemory] | None:
        """Per stage, what one micro-batch keeps for backward (``fxpipe.compiler.memory_profile``),
        by default under the stages' own recompute and offload: run on fake tensors at the
        plan's micro-batch once per choice, then scaled to a micro-batch of ``size``
        samples (default: the first piece of the example batch cut into
        ``microbatches``). Given ``inputs`` (one micro-batch's flat model inputs), run on
        fake tensors of their shapes instead, unscaled (once per choice and shapes). None,
        said once in ``notes``, when a stage cannot run on fake tensors."""
        recompute = tuple(recompute if recompute is not None else (s.recompute for s in self.stages))
        offload = tuple(offload if offload is not None else (s.offload for s in self.stages))
        shapes = None if inputs is None else tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in pytree.tree_leaves(inputs))
        key = (recompute, offload) if shapes is None else (recompute, offload, shapes)
        if key not in self.profiles:
            try:
                if inputs is None:
                    at = microbatch_inputs(self, self.plan.microbatches)[1]
                    self.profiles[key] = (at, memory_profile.profile(self, self.plan.microbatches, recompute, offload))
                else:
                    self.profiles[key] = (None, memory_profile.profile(self, self.plan.microbatches, recompute, offload, inputs))
            except RuntimeError as err:
                self.profiles[key] = (0, None)
                self.notes.append(f"memory predicted from output sizes: {err}")
        at, measured = self.profiles[key]
        if measured is None:
            return None
        if at is None:
            return measured
        if size is None:
            size = microbatch_inputs(self, microbatches or self.plan.microbatches)[1]
        return measured if size == at else [kept.scaled(size / at) for kept in measured]

    def to_dot(self, level: str = "auto") -> str:
        """The partition as Graphviz DOT: one cluster per stage, send/recv edges labelled."""
        return partition_dot(self, level=level)

    def draw(self, path: str | Path, level: str = "auto", renderer: str = "auto") -> Path:
        """Writes the partition drawing to ``path`` (.svg, .png, .pdf or .dot); returns it.

        level: "node" (every node), "stage" (a box per stage) or "auto" (stage view for
        big graphs). Uses Graphviz when installed, a matplotlib renderer otherwise; see
        ``fxpipe.inspection.render.draw`` for what it raises.
        """
        return draw_partition(self, path, level=level, renderer=renderer)


def _aligned(rows: list[tuple[str, ...]]) -> list[str]:
    """The rows as lines of left-aligned columns two spaces apart."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
