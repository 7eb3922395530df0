"""``Partitioned``: the result of the compiler passes, before anything is placed on a device."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.fx as fx

from fxpipe.plan import Plan
from fxpipe.stage import Stage
from passes.partition import PartitionedGraph


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def _fmt_count(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(int(n))


@dataclass
class Partitioned:
    """A model cut into stages: inspectable (summary, explain, to_dot) without any hardware.

    stages: the Stage list (modules reference the model's own submodules: nothing copied);
    graph: the whole partitioned program with explicit send/recv nodes;
    frontend: "fx" or "export"; notes: what happened while compiling.
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
        rows = [("stage", "device", "nodes", "params", "param bytes", "recv", "send", "modules")]
        for s in self.stages:
            rows.append(
                (
                    str(s.index),
                    s.device,
                    str(s.num_nodes),
                    _fmt_count(s.num_parameters),
                    _fmt_bytes(s.parameter_bytes),
                    f"{len(s.inputs)} ({_fmt_bytes(s.recv_bytes)})",
                    f"{len(s.outputs)} ({_fmt_bytes(s.send_bytes)})",
                    s.module_range,
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [head] + ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.append("send/recv bytes are per full example batch; each micro-batch moves its share")
        return "\n".join(lines)

    def explain(self) -> str:
        """Why each stage holds its nodes (tag, split point, cost model) and the edges it cuts."""
        lines = [f"{self.model_name} traced with {self.frontend}; split={self.plan.split!r}"]
        lines += [f"note: {n}" for n in self.notes]
        for s in self.stages:
            lines.append(f"stage {s.index} on {s.device}: {s.reason}; modules {s.module_range}")
            for e in s.inputs:
                lines.append(f"    recv {e.name} {e.description} from stage {e.src} ({_fmt_bytes(e.nbytes)})")
            for e in s.outputs:
                lines.append(f"    send {e.name} {e.description} to stage {e.dst} ({_fmt_bytes(e.nbytes)})")
        return "\n".join(lines)

    def to_dot(self, level: str = "auto") -> str:
        """The partition as Graphviz DOT: one cluster per stage, send/recv edges labelled."""
        from fxpipe.dot import partition_dot

        return partition_dot(self, level=level)

    def draw(self, path: str | Path, level: str = "auto", renderer: str = "auto") -> Path:
        """Writes the partition drawing to ``path`` (.svg, .png, .pdf or .dot); returns it.

        level: "node" (every node), "stage" (a box per stage) or "auto" (stage view for
        big graphs). Uses Graphviz when installed, a matplotlib renderer otherwise; see
        ``fxpipe.draw.draw`` for what it raises.
        """
        from fxpipe.draw import draw

        return draw(self, path, level=level, renderer=renderer)
