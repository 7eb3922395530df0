"""``Partitioned``: the result of the compiler passes, before anything is placed on a device."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.fx as fx

from fxpipe import format as fmt
from fxpipe.cost_model import Calibration
from fxpipe.estimates import StageEstimate, estimate_stages, predicted_timeline
from fxpipe.passes.partition import PartitionedGraph
from fxpipe.plan import Plan
from fxpipe.stage import Stage
from fxpipe.timeline import Timeline


@dataclass
class Partitioned:
    """A model cut into stages: inspectable (summary, explain, to_dot) without any hardware.

    The views (summary, explain, estimates, simulate, to_dot, draw) read the costs the
    compiler wrote on the graph; none of them runs a pass or writes ``node.meta``.

    stages: the Stage list (modules reference the model's own submodules: nothing copied);
    graph: the whole partitioned program with explicit send/recv nodes;
    frontend: "fx" or "export"; notes: what happened while compiling;
    deps: the stage graph, (producer, consumer) pairs; stage_workers: the worker each stage
    runs on under the plan's schedule (compile-time facts the runtimes read);
    key: the signature of the call the trace was made for (``key_of(args, kwargs)`` gives a
    call's in the same terms); anchors: where each stage after the first begins, to cut
    another signature's trace at the same places; calibration: the per-kind rates
    ``fxpipe.profile`` measured, if a profile was given; model_losses: the loss calls the
    last stage makes (a model computing its own loss), with the slice that computes their
    targets from the model's inputs (``fxpipe.loss_scale.ModelLosses``), or None;
    output_inputs: per output leaf, the model inputs (flat positions) it depends on;
    opaque: the callees the fx frontend runs whole (``fxpipe.passes.opaque.OpaqueCallee``:
    name, why, where fx stopped), listed by summary() and explain().
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
    deps: list[tuple[int, int]] = field(default_factory=list)
    stage_workers: list[int] = field(default_factory=list)
    key: Any = None
    key_of: Callable[..., Any] | None = None
    anchors: list[Any] = field(default_factory=list)
    calibration: Calibration | None = None
    model_losses: Any = None
    output_inputs: list[frozenset[int]] | None = None
    opaque: list[Any] = field(default_factory=list)

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

    def summary(self) -> str:
        """A table: per stage its device, nodes, parameters, and what it receives and sends."""
        head = (
            f"{self.model_name}: {self.num_stages} stage(s), schedule {self.plan.schedule}, "
            f"{self.plan.microbatches} micro-batch(es), traced with {self.frontend}"
        )
        rows = [("stage", "device", "nodes", "params", "param bytes", "FLOPs", "predicted", "memory", "recv", "send", "modules")]
        for s, est in zip(self.stages, self.estimates()):
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
                    s.module_range,
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [head] + ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.append("send/recv bytes are per full example batch; each micro-batch moves its share")
        lines.append(
            "FLOPs: forward, full example batch; predicted: forward+backward+send/recv of one micro-batch; "
            "memory: parameters, gradients, optimizer state and in-flight activations (see docs/cost-model.md)"
        )
        return "\n".join(lines + self._opaque_lines())

    def _opaque_lines(self) -> list[str]:
        """The callees run whole (fx could not trace into them), one line each with the reason."""
        if not self.opaque:
            return []
        head = f"run whole (opaque: torch.fx could not trace into them): {len(self.opaque)}"
        return [head] + [f"  {callee.describe()}" for callee in self.opaque]

    def explain(self) -> str:
        """Why each stage holds its nodes (tag, split point, cost model) and the edges it cuts."""
        lines = [f"{self.model_name} traced with {self.frontend}; split={self.plan.split!r}"]
        lines += [f"note: {n}" for n in self.notes]
        for s, est in zip(self.stages, self.estimates()):
            lines.append(f"stage {s.index} on {s.device}: {s.reason}; modules {s.module_range}")
            lines.append(
                f"    cost model, per micro-batch: forward {fmt.seconds(est.forward)}, backward "
                f"{fmt.seconds(est.backward)}, send/recv {fmt.seconds(est.comm)}; memory {fmt.nbytes(est.memory)} "
                f"(state {fmt.nbytes(est.state_bytes)} + {est.in_flight} micro-batch(es) of activations "
                f"x {fmt.nbytes(est.activation_bytes)})"
            )
            for e in s.inputs:
                lines.append(f"    recv {e.name} {e.description} from stage {e.src} ({fmt.nbytes(e.nbytes)})")
            for e in s.outputs:
                lines.append(f"    send {e.name} {e.description} to stage {e.dst} ({fmt.nbytes(e.nbytes)})")
        return "\n".join(lines + self._opaque_lines())

    def estimates(self, microbatches: int | None = None) -> list[StageEstimate]:
        """The cost model's prediction per stage (time per micro-batch, memory, FLOPs), from
        the node costs the compiler wrote. ``microbatches`` defaults to the plan's."""
        return estimate_stages(self.graph, self.partitioned.edges, self.devices, self.plan, microbatches, self.calibration)

    def simulate(self, microbatches: int | None = None) -> Timeline:
        """The predicted Timeline of one training step under the plan's schedule.

        Stage times come from the cost model (or ``fxpipe.profile`` measurements);
        ``microbatches`` overrides the plan's count. Returns a Timeline of kind "predicted"
        whose ``activation_bytes`` gives each stage's bytes per micro-batch.
        """
        return predicted_timeline(self.graph, self.partitioned.edges, self.devices, self.plan, microbatches, self.calibration)

    def to_dot(self, level: str = "auto") -> str:
        """The partition as Graphviz DOT: one cluster per stage, send/recv edges labelled."""
        from fxpipe.drawing.diagram import partition_dot

        return partition_dot(self, level=level)

    def draw(self, path: str | Path, level: str = "auto", renderer: str = "auto") -> Path:
        """Writes the partition drawing to ``path`` (.svg, .png, .pdf or .dot); returns it.

        level: "node" (every node), "stage" (a box per stage) or "auto" (stage view for
        big graphs). Uses Graphviz when installed, a matplotlib renderer otherwise; see
        ``fxpipe.drawing.render.draw`` for what it raises.
        """
        from fxpipe.drawing.render import draw

        return draw(self, path, level=level, renderer=renderer)
