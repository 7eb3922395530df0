"""``fxpipe.profile``: measured forward and backward seconds per node, for the cost model.

The model is traced as ``fxpipe.compile`` traces it (same node names), copied onto the
device, and every compute node is replayed alone on its real inputs, cut to the plan's
micro-batch (CPU kernels do not scale linearly with the batch, and weight-bound layers
hardly at all): forward, then the backward of its outputs with the weight gradients
accumulated as in training, each the fastest of ``repeats`` runs. Passing the result as
``fxpipe.partition(..., profile=p)`` (or ``compile``) makes ``split="auto"``, the summary
and ``simulate()`` use these times instead of the FLOP estimates. The user's model is not
touched (a copy runs, so BatchNorm statistics stay as they were).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from fxpipe.costs import MEASURED, MeasuredTime, lookup
from fxpipe.devices import check_available, normalize_device, torch_device
from fxpipe.microbatch import split
from fxpipe.plan import Plan
from passes.annotate import COMPUTE_OPS
from passes.trace import trace


@dataclass
class Profile:
    """Measured seconds per node name at the example batch on ``device``."""

    device: str
    times: dict[str, MeasuredTime] = field(default_factory=dict)

    @property
    def forward(self) -> float:
        """Sum of the nodes' forward seconds."""
        return sum(t.forward for t in self.times.values())

    @property
    def backward(self) -> float:
        """Sum of the nodes' backward seconds."""
        return sum(t.backward for t in self.times.values())

    def apply(self, graph: fx.Graph) -> None:
        """Write ``node.meta["measured_time"]`` on the nodes of ``graph`` this profile timed.

        Raises ValueError when no node name matches (the profile is of another model or
        was traced with other plan settings).
        """
        hits = 0
        for node in graph.nodes:
            if node.name in self.times:
                node.meta[MEASURED] = self.times[node.name]
                hits += 1
        if self.times and not hits:
            raise ValueError("the profile matches no node of this graph: profile the same model with the same plan")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fastest(run, repeats: int, device: torch.device) -> tuple[float, Any]:
    best, result = float("inf"), None
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        result = run()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best, result


def profile(
    model: nn.Module,
    example_inputs: tuple | Any,
    device: str = "cpu",
    plan: Plan | Mapping[str, Any] | None = None,
    example_kwargs: Mapping[str, Any] | None = None,
    repeats: int = 3,
) -> Profile:
    """Measure every compute node's forward and backward seconds on ``device``.

    ``plan`` supplies the tracing fields (frontend, leaf_modules, concrete_args) so node
    names match what ``fxpipe.compile`` will trace. Returns a :class:`Profile`. Raises
    DeviceError when ``device`` is absent here, TraceError when the model cannot be traced.
    """
    plan = Plan.coerce(plan)
    device = normalize_device(device, "profile(device=...)")
    check_available(device, "profile(device=...)")
    where = torch_device(device)
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    kwargs = dict(example_kwargs or {})
    traced = trace(model, example_inputs, kwargs, plan.frontend, plan.leaf_modules, plan.concrete_args)
    replica = copy.deepcopy(model).to(where)
    root = copy.deepcopy(traced.root).to(where)

    def resolve(target: str) -> Any:
        return lookup([replica, root], target)

    def to_device(v: Any) -> Any:
        return v.to(where) if isinstance(v, torch.Tensor) else v

    inputs = [pytree.tree_map(to_device, v) for v in traced.bind_inputs(example_inputs, kwargs)]
    pieces, sizes = split(inputs, plan.microbatches)
    inputs, fraction = pieces[0], sizes[0] / sum(sizes)
    result = Profile(device)
    env: dict[fx.Node, Any] = {}
    placeholders = iter(inputs)
    for node in traced.graph_module.graph.nodes:
        if node.op == "placeholder":
            env[node] = next(placeholders, None)
        elif node.op == "get_attr":
            env[node] = resolve(node.target)
        elif node.op in COMPUTE_OPS:
            env[node], result.times[node.name] = _time_node(node, env, resolve, repeats, where, device, fraction)
    return result


def _time_node(node: fx.Node, env: dict, resolve, repeats: int, where: torch.device, device: str, fraction: float) -> tuple[Any, MeasuredTime]:
    def fresh_args() -> tuple[tuple, dict, list[torch.Tensor]]:
        leaves: list[torch.Tensor] = []

        def fresh(v: Any) -> Any:
            if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter):
                leaf = v.detach().requires_grad_(v.requires_grad)
                if leaf.requires_grad:
                    leaves.append(leaf)
                    return leaf.clone()
                return leaf
            return v

        def arg(a: fx.Node) -> Any:
            return env[a] if a.op == "get_attr" else pytree.tree_map(fresh, env[a])

        return fx.map_arg(node.args, arg), fx.map_arg(node.kwargs, arg), leaves

    def call(args: tuple, kwargs: dict) -> Any:
        if node.op == "call_module":
            return resolve(node.target)(*args, **kwargs)
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        return node.target(*args, **kwargs)

    with torch.enable_grad():
        prepared = [fresh_args() for _ in range(repeats)]
        runs = iter(prepared)

        def forward() -> Any:
            a, k, _ = next(runs)
            return call(a, k)

        fwd, out = _fastest(forward, repeats, where)
        module = resolve(node.target) if node.op == "call_module" else None
        params = [p for p in module.parameters() if p.requires_grad] if isinstance(module, nn.Module) else []
        bwd = 0.0
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        if outs and (params or node.all_input_nodes):
            graphs = []
            for _ in range(repeats):
                a, k, leaves = fresh_args()
                o = [t for t in pytree.tree_leaves(call(a, k)) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
                graphs.append((o, leaves + params))
            pending = iter(graphs)

            def backward() -> None:
                o, wrt = next(pending)
                if wrt:  # into .grad, as a training step accumulates weight gradients
                    torch.autograd.backward(o, [torch.ones_like(t) for t in o], inputs=wrt)

            bwd, _ = _fastest(backward, repeats, where)
    value = pytree.tree_map(lambda t: t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, out)
    return value, MeasuredTime(fwd, bwd, device, fraction)
