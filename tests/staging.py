"""Per-signature staging at the trace/partition level: the passes in the order the compiler
runs them, once per new TraceKey, with stage boundaries that never move.

``SignatureStages(model, split, devices)`` traces a call on first sight of its key
(``Traced.key_of``; static shapes under torch.export), checks the trace against the eager
model on fake tensors (``check_generalises``), cuts it where the first trace was cut (split
points re-annotated; ``split="auto"`` re-applied through anchors) and builds one stage
GraphModule per stage. ``run(args, kwargs)`` feeds the stages in order by hand, in one
autograd graph, so ``loss.backward()`` reaches the model's own parameters (the stage
modules reference them, as ``fxpipe.partition``'s do).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from conftest import assert_grads_match
from torch import nn

import fxpipe
from fxpipe.passes import annotate
from fxpipe.passes.codegen import build_stage_module, stage_graph
from fxpipe.passes.generalise import check_generalises
from fxpipe.passes.meta import COMPUTE_OPS, MODULE_PATH, STAGE
from fxpipe.passes.node_costs import annotate_costs
from fxpipe.passes.partition import PartitionedGraph, partition
from fxpipe.passes.shape_prop import propagate_shapes
from fxpipe.passes.signature import TraceKey
from fxpipe.passes.targets import resolver
from fxpipe.passes.trace import trace
from fxpipe.passes.traced import Traced
from fxpipe.planner.auto_split import auto_split


@dataclass
class Staged:
    """One signature's trace cut into stage modules."""

    traced: Traced
    cut: PartitionedGraph
    modules: list[fx.GraphModule]

    def stage_modules(self) -> list[set[str]]:
        """Per stage, the module paths its compute nodes come from (what 'same boundaries' means)."""
        paths: list[set[str]] = [set() for _ in self.modules]
        for node in self.cut.graph.nodes:
            if node.op in COMPUTE_OPS and node.meta.get(MODULE_PATH) and not node.meta.get("edge"):
                paths[node.meta[STAGE]].add(node.meta[MODULE_PATH])
        return paths


class SignatureStages:
    """Stages per input signature of ``model``, cut by ``split`` (module paths or "auto")."""

    def __init__(self, model: nn.Module, split: list[str] | str, devices: list[str] | None = None, frontend: str = "auto") -> None:
        self.model = model
        self.split = split
        self.plan = fxpipe.Plan(devices=devices or ["cpu:0", "cpu:1"], split=split, microbatches=1)
        self.frontend = frontend
        self.cache: dict[TraceKey, Staged] = {}
        self.anchors: list[annotate.Anchor] | None = None
        self.traces = 0

    def stages_for(self, args: tuple = (), kwargs: dict | None = None) -> Staged:
        kwargs = dict(kwargs or {})
        if self.cache:
            key = next(iter(self.cache.values())).traced.key_of(args, kwargs)
            if key in self.cache:
                return self.cache[key]
        traced = trace(self.model, args, kwargs, frontend=self.frontend, dynamic_batch=False)
        self.frontend = traced.frontend  # every signature by the same frontend: the same nodes
        self.traces += 1
        resolve = resolver(self.model, traced.root)
        check_generalises(self.model, traced, args, kwargs, resolve)
        graph = traced.graph_module.graph
        if isinstance(self.split, list):
            known = {name for name, _ in self.model.named_modules()}
            assignment = annotate.annotate_by_split_points(graph, self.split, known)
        elif self.anchors is None:
            annotate_costs(graph, resolve, propagate_shapes(traced.graph_module, traced.bind_inputs(args, kwargs), resolve))
            cuts = auto_split(graph, self.plan)
            assignment = annotate.annotate_by_cuts(graph, cuts.starts, cuts.reasons, cuts.how)
            self.anchors = annotate.anchors(graph)
        else:
            assignment = annotate.annotate_by_anchors(graph, self.anchors)
        annotate.check_monotone(graph)
        cut = partition(graph, assignment.num_stages)
        modules = [build_stage_module(stage_graph(cut, s), resolve, {}, f"Stage{s}") for s in range(assignment.num_stages)]
        staged = Staged(traced, cut, modules)
        self.cache[traced.key] = staged
        return staged

    def run(self, args: tuple = (), kwargs: dict | None = None) -> Any:
        """The model's output, computed stage by stage (autograd reaches the model's parameters)."""
        kwargs = dict(kwargs or {})
        staged = self.stages_for(args, kwargs)
        values: dict[str, Any] = {}
        out: Any = None
        for s, module in enumerate(staged.modules):
            inputs = staged.traced.bind_inputs(args, kwargs) if s == 0 else []
            out = module(*inputs, *[values[e.name] for e in staged.cut.recv_edges(s)])
            if s < len(staged.modules) - 1:
                values.update({e.name: v for e, v in zip(staged.cut.send_edges(s), out)})
        return staged.traced.build_output(out)


def logits_of(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out[0] if isinstance(out, tuple | list) else out


def probe_loss(out: Any, probe: torch.Tensor) -> torch.Tensor:
    """A scalar that depends on every logit (so every gradient is checked)."""
    return (logits_of(out) * probe).sum()


def check_against_eager(
    stages: SignatureStages, ref: nn.Module, args: tuple = (), kwargs: dict | None = None, rtol: float = 1e-7, atol: float = 1e-9
) -> torch.Tensor:
    """Run one call through the stages and through ``ref`` (an eager copy of the model);
    assert the outputs, a loss over every output value, and every gradient agree.

    Returns the stages' output logits."""
    kwargs = dict(kwargs or {})
    stages.model.zero_grad()
    ref.zero_grad()
    out = stages.run(args, kwargs)
    expected = ref(*args, **kwargs)
    torch.testing.assert_close(logits_of(out), logits_of(expected), rtol=rtol, atol=atol)
    probe = torch.randn(logits_of(out).shape, dtype=logits_of(out).dtype, generator=torch.Generator().manual_seed(0))
    loss = probe_loss(out, probe)
    loss.backward()
    probe_loss(expected, probe).backward()
    assert_grads_match(stages.model, ref, rtol=max(rtol, 1e-6), atol=max(atol, 1e-8))
    return logits_of(out).detach()
