"""``fxpipe.profile``: measured forward and backward seconds per node, for the cost model.

The model is traced as ``fxpipe.compile`` traces it (same node names) and a copy of it,
on the device, is trained on the plan's micro-batch (the first piece of the example batch:
CPU kernels do not scale linearly with the batch, and weight-bound layers hardly at all).
Every node is timed in context, inside warm whole-model training steps, not replayed
alone (alone, fresh allocations page-fault, weights are cold and first calls set kernels
up: on CPU, ResNet-50's first convolution timed several times its in-model time that way):

- forward: the traced graph is run node by node and each compute node's call is timed
  (on CUDA with a synchronize before each clock read);
- backward: after a node runs, the autograd Nodes it created are found by walking from
  the ``grad_fn`` of its outputs (and of its inputs, which an in-place op rewrites)
  through ``next_functions``, stopping at Nodes already claimed by earlier nodes; a
  parameter's ``AccumulateGrad`` goes to the first node that reaches it (the layer using
  the parameter). A pre-hook on each of these Nodes stamps the clock when the autograd
  engine starts it. Backward then runs from the graph's outputs (gradients of ones), and
  a node's backward is the sum of the gaps from each of its Nodes' stamps to the next
  stamp (the last to the end of backward): the engine runs CPU Nodes one at a time on the
  calling thread, so a gap is that Node's work plus the engine's hand-off to the next
  Node (on CUDA each stamp synchronizes the device first). Nodes that create no autograd
  Node (shape reads, integer ops) get 0.

One warm-up step is run and discarded, then ``repeats`` timed steps; each node's forward
and backward are the medians over them. Gradients accumulate into the copy's ``.grad``
between steps, as over a pipeline's micro-batches. The CPU thread count is the caller's.

The timed nodes also calibrate the cost model (``Profile.calibration``): per kind of node
(conv, matmul, norm, elementwise, view), how much slower or faster than its roofline
estimate the device ran it. Passing the result as ``fxpipe.partition(..., profile=p)`` (or
``compile``) makes ``split="auto"``, the summary and ``simulate()`` use the measured times
for the nodes it timed and the calibrated estimates for any other node (a profile of a
smaller model of the same layers calibrates a bigger one). The user's model is not touched (a copy runs, so BatchNorm statistics and
gradients stay as they were), nor are the example inputs (each step runs on clones).
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from fxpipe.batching.microbatch import split
from fxpipe.devices import check_available, normalize_device, torch_device
from fxpipe.passes.meta import COMPUTE_OPS, MEASURED
from fxpipe.passes.node_costs import annotate_costs, cost_of
from fxpipe.passes.shape_prop import propagate_shapes
from fxpipe.passes.targets import lookup, resolver
from fxpipe.passes.trace import trace
from fxpipe.plan import Plan
from fxpipe.planner.cost_model import Calibration, DeviceModel, MeasuredTime, calibrate


@dataclass
class Profile:
    """Measured seconds per node name on ``device`` (at the plan's micro-batch), and the
    per-kind calibration of the cost model they give."""

    device: str
    times: dict[str, MeasuredTime] = field(default_factory=dict)
    calibration: Calibration | None = None

    @property
    def forward(self) -> float:
        """Sum of the nodes' forward seconds."""
        return sum(t.forward for t in self.times.values())

    @property
    def backward(self) -> float:
        """Sum of the nodes' backward seconds."""
        return sum(t.backward for t in self.times.values())

    def apply(self, graph: fx.Graph) -> int:
        """Write ``node.meta["measured_time"]`` on the nodes of ``graph`` this profile timed
        (matched by name: the same model traced with the same plan settings); returns how
        many. Nodes it did not time are estimated with its calibration."""
        hits = 0
        for node in graph.nodes:
            if node.name in self.times:
                node.meta[MEASURED] = self.times[node.name]
                hits += 1
        return hits


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
    names match what ``fxpipe.compile`` will trace, and ``microbatches``: the nodes are
    timed on the first micro-batch of ``example_inputs``. Runs one warm-up training step
    and ``repeats`` timed ones (see the module doc). Returns a :class:`Profile`. Raises
    DeviceError when ``device`` is absent here, TraceError when the model cannot be traced,
    ValueError when ``repeats`` < 1.
    """
    if repeats < 1:
        raise ValueError(f"profile(repeats={repeats}): time at least one step (repeats >= 1)")
    plan = Plan.coerce(plan)
    device = normalize_device(device, "profile(device=...)")
    check_available(device, "profile(device=...)")
    where = torch_device(device)
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    kwargs = dict(example_kwargs or {})
    traced = trace(
        model, example_inputs, kwargs, plan.frontend, plan.leaf_modules, plan.concrete_args
    )
    graph = traced.graph_module.graph
    resolve_model = resolver(model, traced.root)
    # the node costs on fake tensors, for the calibration: nothing runs, nothing changes
    fake_run = propagate_shapes(traced.graph_module, traced.bind_inputs(example_inputs, kwargs), resolve_model)
    annotate_costs(graph, resolve_model, fake_run)
    replica = copy.deepcopy(model).to(where)
    root = copy.deepcopy(traced.root).to(where)

    def resolve(target: str) -> Any:
        return lookup([replica, root], target)

    def to_device(v: Any) -> Any:
        # detached: backward must not reach the user's tensors (nor their .grad)
        return (
            v.detach().to(where).requires_grad_(v.requires_grad)
            if isinstance(v, torch.Tensor)
            else v
        )

    inputs = [pytree.tree_map(to_device, v) for v in traced.bind_inputs(example_inputs, kwargs)]
    pieces, sizes = split(inputs, plan.microbatches)
    inputs, fraction = pieces[0], sizes[0] / sum(sizes)
    names = [n.name for n in graph.nodes if n.op in COMPUTE_OPS]
    forwards: dict[str, list[float]] = {name: [] for name in names}
    backwards: dict[str, list[float]] = {name: [] for name in names}
    last_users = _last_uses(graph)
    with torch.enable_grad():
        for step in range(repeats + 1):
            fwd, bwd = _training_step(graph, last_users, inputs, resolve, where)
            if step:  # the first step warms up: allocations, weights in cache, kernel setup
                for name in names:
                    forwards[name].append(fwd[name])
                    backwards[name].append(bwd[name])
    times = {
        name: MeasuredTime(
            statistics.median(forwards[name]), statistics.median(backwards[name]), device, fraction
        )
        for name in names
    }
    samples = [(cost_of(n), times[n.name]) for n in graph.nodes if n.name in times]
    return Profile(device, times, calibrate(DeviceModel.of(plan, device), samples))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _call(node: fx.Node, args: tuple, kwargs: dict, resolve) -> Any:
    if node.op == "call_module":
        return resolve(node.target)(*args, **kwargs)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    return node.target(*args, **kwargs)


def _clone(v: Any) -> Any:
    """A fresh leaf per step, so in-place ops and input gradients stay within the step."""
    return v.detach().clone().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) else v


def _claim(values: Any, name: str, owner: dict[Any, str]) -> None:
    """Give ``name`` the autograd Nodes behind ``values`` that no earlier node has claimed."""
    stack = [
        t.grad_fn
        for t in pytree.tree_leaves(values)
        if isinstance(t, torch.Tensor) and t.grad_fn is not None
    ]
    while stack:
        fn = stack.pop()
        if fn is None or fn in owner:
            continue
        owner[fn] = name
        stack.extend(nxt for nxt, _ in fn.next_functions)


def _stamper(stamps: list[tuple[float, str]], name: str, where: torch.device):
    if where.type == "cuda":

        def stamp(grad_outputs: Any) -> None:
            torch.cuda.synchronize(where)
            stamps.append((time.perf_counter(), name))

    else:

        def stamp(grad_outputs: Any) -> None:
            stamps.append((time.perf_counter(), name))

    return stamp


def _last_uses(graph: fx.Graph) -> dict[fx.Node, list[fx.Node]]:
    """Per node, the values it is the last user of (freed after it runs, as eager does)."""
    last_users: dict[fx.Node, list[fx.Node]] = {}
    seen: set[fx.Node] = set()
    for node in reversed(graph.nodes):
        for used in node.all_input_nodes:
            if used not in seen:
                seen.add(used)
                last_users.setdefault(node, []).append(used)
    return last_users


def _training_step(
    graph: fx.Graph, last_users: dict[fx.Node, list[fx.Node]], inputs: list, resolve, where: torch.device
) -> tuple[dict[str, float], dict[str, float]]:
    """One forward and backward of the graph: (forward, backward) seconds per compute node."""
    forward: dict[str, float] = {}
    owner: dict[Any, str] = {}  # autograd Node -> name of the fx node that created it
    env: dict[fx.Node, Any] = {}
    placeholders = iter(pytree.tree_map(_clone, inputs))
    out: Any = None
    for node in graph.nodes:
        if node.op == "placeholder":
            env[node] = next(placeholders, None)
        elif node.op == "get_attr":
            env[node] = resolve(node.target)
        elif node.op in COMPUTE_OPS:
            args = fx.map_arg(node.args, env.__getitem__)
            kwargs = fx.map_arg(node.kwargs, env.__getitem__)
            _sync(where)
            start = time.perf_counter()
            value = _call(node, args, kwargs, resolve)
            _sync(where)
            forward[node.name] = time.perf_counter() - start
            # inputs too: an in-place op gives its input a new grad_fn
            _claim((value, args, kwargs), node.name, owner)
            env[node] = value
            del args, kwargs, value
        elif node.op == "output":
            out = fx.map_arg(node.args[0], env.__getitem__)
        for used in last_users.get(node, ()):
            del env[used]
    env.clear()
    backward = dict.fromkeys(forward, 0.0)
    roots = [
        t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn is not None
    ]
    del out
    if not roots:
        return forward, backward
    stamps: list[tuple[float, str]] = []
    handles = [fn.register_prehook(_stamper(stamps, name, where)) for fn, name in owner.items()]
    try:
        torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
        _sync(where)
        end = time.perf_counter()
    finally:
        for handle in handles:
            handle.remove()
        owner.clear()
        del roots
    stamps.sort()  # already in order on CPU; on CUDA the engine's device thread adds its own
    for (at, name), (nxt, _) in zip(stamps, stamps[1:] + [(end, "")]):
        backward[name] += nxt - at
    return forward, backward
