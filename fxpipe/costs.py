"""From node costs to seconds and bytes: device models, stage estimates and ``split="auto"``.

A node's time on a device is a roofline plus a fixed cost per op::

    forward  = ops x op_overhead + max(fwd_flops / flops, (activation bytes moved + state bytes) / memory_bandwidth)
    backward = ops x op_overhead + max(bwd_flops / flops, 2 x the same bytes / memory_bandwidth)

with FLOPs and activation bytes scaled to the micro-batch (``1 / microbatches`` of the
example batch). The fixed cost is why small micro-batches run slower per sample: the
per-op and per-action costs do not shrink with the batch, which gives the micro-batch
sweep its U shape. A node measured by ``fxpipe.profile`` uses its measured time instead
(scaled by the FLOP/s ratio when the stage runs on another device).

Memory of a stage: trainable parameters x (1 + 1 gradient + ``OPTIMIZER_STATES``),
buffers, and one micro-batch's activations times the micro-batches the schedule keeps in
flight there (read from the schedule itself, simulated with unit costs).

Defaults (``default_spec``) are deterministic, so every rank of a distributed run makes
the same plan: "cpu" is ``CPU_FLOPS_PER_CORE`` x the cores (at most 16), 80% of physical
memory, 10 GB/s between logical CPU devices; "cuda:N" reads total memory and the SM
count from the device when there is one, else assumes a 20 TFLOP/s, 16 GB GPU on PCIe 4.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from fxpipe import format as fmt
from fxpipe.passes.annotate import AnnotateError, StageAssignment
from fxpipe.passes.autosplit import (
    SplitInfeasible,
    SplitProblem,
    ordered_problem_inputs,
    refine,
    solve,
)
from fxpipe.passes.cost import NodeCost, cost_of
from fxpipe.passes.meta import COMPUTE_OPS, COST, EDGE, MEASURED, REASON, STAGE, VAL
from fxpipe.passes.shape_prop import tensor_bytes
from fxpipe.plan import DeviceSpec, Plan, PlanError
from fxpipe.schedule_sim import simulate
from fxpipe.schedules import make_schedule

CPU_FLOPS_PER_CORE = 40e9
CPU_ACTION_LATENCY = 100e-6  # thread hand-off and autograd call per action, measured on the local executor
OPTIMIZER_STATES = 2  # Adam's two moments; SGD with momentum holds 1
# split="auto" leaves the exact min-max split for the schedule-refined one only when the
# simulated step is at least this much shorter: smaller gains are far below the model's error
REFINE_MIN_GAIN = 0.01
# FLOPs per byte of memory traffic at which a device turns from memory- to compute-bound.
_BALANCE = {"cpu": 8.0, "cuda": 30.0}
# Passes over a layer's weights per forward and per backward: reading them, and in
# backward also writing the weight gradient that autograd then accumulates (1 and 3).
# CPU convolutions cost more: oneDNN re-lays-out the weights on every call; measured on
# ResNet-50's layer3/layer4 (1 thread, micro-batches 4 and 16): forward ~0.4 ns and
# backward ~1.2-1.7 ns per weight byte whatever the batch, i.e. 4 and 12 passes.
_DENSE_WEIGHT_PASSES = (1.0, 3.0)
_CONV_WEIGHT_PASSES = {"cpu": (4.0, 12.0), "cuda": (1.0, 3.0)}
# Seconds of fixed cost per ATen op a node dispatches (passes/cost.py counts them): Python
# and dispatch on CPU, a kernel launch on GPU. CPU measured on nn.TransformerEncoderLayer
# (256 wide, one thread): one sample per call costs 0.92 ms more forward+backward than a
# sixteenth of a 16-sample call, over 118 ops, ~8 µs each.
_OP_OVERHEAD = {"cpu": 8e-6, "cuda": 10e-6}


@dataclass(frozen=True)
class MeasuredTime:
    """A node's measured forward and backward seconds on ``device``, at ``batch_fraction``
    of the example batch (the plan's micro-batch when profiled by ``fxpipe.profile``)."""

    forward: float
    backward: float
    device: str
    batch_fraction: float = 1.0


def _kind(device: str) -> str:
    return "cpu" if device.startswith("cpu") else "cuda"


@functools.cache
def default_spec(device: str) -> DeviceSpec:
    """The DeviceSpec assumed for ``device`` when the plan gives none (see the module doc)."""
    if _kind(device) == "cpu":
        cores = min(os.cpu_count() or 1, 16)
        try:
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 0.8
        except (ValueError, OSError, AttributeError):
            memory = 16e9
        return DeviceSpec(flops=CPU_FLOPS_PER_CORE * cores, memory=float(memory), bandwidth=10e9, latency=CPU_ACTION_LATENCY)
    index = int(device.split(":")[1]) if ":" in device else 0
    if torch.cuda.is_available() and index < torch.cuda.device_count():
        props = torch.cuda.get_device_properties(index)
        # 128 FP32 lanes x 2 (FMA) x ~1.5 GHz per SM is within 2x of every recent NVIDIA part
        return DeviceSpec(flops=props.multi_processor_count * 128 * 2 * 1.5e9, memory=props.total_memory * 0.9, bandwidth=25e9)
    return DeviceSpec(flops=20e12, memory=16e9, bandwidth=25e9)


def spec_for(plan: Plan, device: str) -> DeviceSpec:
    """The plan's DeviceSpec for ``device`` ("cpu" covers every "cpu:N"), else the default."""
    specs = plan.device_specs
    if device in specs:
        return specs[device]
    if _kind(device) == "cpu" and "cpu" in specs:
        return specs["cpu"]
    return default_spec(device)


@dataclass(frozen=True)
class DeviceModel:
    """A device as the cost model sees it: its spec plus memory bandwidth and op overhead."""

    device: str
    spec: DeviceSpec
    memory_bandwidth: float
    op_overhead: float
    conv_weight_passes: tuple[float, float] = (1.0, 3.0)

    @classmethod
    def of(cls, plan: Plan, device: str) -> DeviceModel:
        spec = spec_for(plan, device)
        kind = _kind(device)
        return cls(device, spec, spec.flops / _BALANCE[kind], _OP_OVERHEAD[kind], _CONV_WEIGHT_PASSES[kind])

    def node_times(self, cost: NodeCost, fraction: float, measured: MeasuredTime | None = None, measured_on: DeviceModel | None = None) -> tuple[float, float]:
        """(forward, backward) seconds of a node on a micro-batch ``fraction`` of the example batch."""
        fixed_fwd, fixed_bwd = max(cost.fwd_ops, 1), max(cost.bwd_ops, 1)  # ops paying the fixed cost
        if measured is not None and measured_on is not None:
            # times scale with the batch only away from the size they were measured at
            ratio = measured_on.spec.flops / self.spec.flops * fraction / measured.batch_fraction
            fwd = self.op_overhead * fixed_fwd + max(measured.forward - measured_on.op_overhead * fixed_fwd, 0.0) * ratio
            bwd = 0.0
            if measured.backward:
                bwd = self.op_overhead * fixed_bwd + max(measured.backward - measured_on.op_overhead * fixed_bwd, 0.0) * ratio
            return fwd, bwd
        weights_fwd, weights_bwd = self.conv_weight_passes if cost.convolution else _DENSE_WEIGHT_PASSES
        moved = cost.act_bytes_moved * fraction + cost.buffer_bytes
        fwd = self.op_overhead * fixed_fwd + max(cost.fwd_flops * fraction / self.spec.flops, (moved + weights_fwd * cost.param_bytes) / self.memory_bandwidth)
        bwd = 0.0
        if cost.bwd_flops:
            bwd = self.op_overhead * fixed_bwd + max(
                cost.bwd_flops * fraction / self.spec.flops, (2 * moved + weights_bwd * cost.param_bytes) / self.memory_bandwidth
            )
        return fwd, bwd

    def seconds_per_byte(self, other: DeviceModel) -> float:
        """Seconds per byte sent between this device and ``other`` (0 on the same device)."""
        if other.device == self.device:
            return 0.0
        return 1.0 / min(self.spec.bandwidth, other.spec.bandwidth)


def state_bytes(cost: NodeCost) -> float:
    """Persistent bytes: parameters with their gradients and optimizer state, plus buffers."""
    return cost.param_bytes * (2 + OPTIMIZER_STATES) + cost.buffer_bytes


def in_flight(plan: Plan, num_stages: int, microbatches: int | None = None) -> list[int]:
    """Per stage, the most micro-batches whose activations the schedule holds at once."""
    m = microbatches or plan.microbatches
    if plan.checkpoint:
        return [1] * num_stages
    actions = make_schedule(plan.schedule, num_stages, m, plan.chunks)
    peaks = simulate(actions, num_stages, 1.0, 2.0).peak_in_flight()
    return [max(peaks.get(s, 1), 1) for s in range(num_stages)]


def _stage_devices(plan: Plan, num_stages: int) -> list[str]:
    devices = list(plan.devices or [])
    return [devices[s % len(devices)] for s in range(num_stages)]


def _measured_device(graph: fx.Graph, plan: Plan) -> DeviceModel | None:
    for node in graph.nodes:
        if MEASURED in node.meta:
            return DeviceModel.of(plan, node.meta[MEASURED].device)
    return None


# ----------------------------------------------------------------- split="auto"
def auto_split(graph: fx.Graph, plan: Plan) -> StageAssignment:
    """Assign ``node.meta["stage"]`` by the exact min-max partitioner of ``passes.autosplit``,
    its cuts then moved while the plan's simulated schedule gets faster (``refine``).

    Needs ``node.meta["cost"]`` (``passes.cost``). One stage per entry of
    ``plan.devices`` (times ``plan.chunks``). Returns the StageAssignment whose reasons
    give each stage's predicted time and memory. Raises AnnotateError when there are
    fewer compute nodes than stages, PlanError when no split fits the devices' memory (naming how
    much each stage would need on which device).
    """
    num_stages = len(plan.devices or []) * plan.chunks
    devices = _stage_devices(plan, num_stages)
    models = [DeviceModel.of(plan, d) for d in devices]
    m = plan.microbatches
    compute = [n for n in graph.nodes if n.op in COMPUTE_OPS]
    if len(compute) < num_stages:
        raise AnnotateError(
            f"split='auto': {num_stages} stages asked for but the graph has only {len(compute)} compute "
            "nodes; use fewer devices (plan.devices) or chunks"
        )
    order, cuts = ordered_problem_inputs(_dataflow(compute), compute)
    measured_on = _measured_device(graph, plan)
    fwd_bwd = torch.tensor(
        [[mdl.node_times(cost_of(n), 1 / m, n.meta.get(MEASURED), measured_on) for n in order] for mdl in models],
        dtype=torch.float64,
    )  # stages x nodes x (forward, backward)
    times = fwd_bwd.sum(2)
    state = [0.0] * len(order)
    position = {n: k for k, n in enumerate(order)}
    for node in graph.nodes:
        if node.op == "get_attr" and node.users:
            first = min((position[u] for u in node.users if u in position), default=0)
            state[first] += state_bytes(cost_of(node))
        elif node in position:
            state[position[node]] += state_bytes(cost_of(node))
    flight = in_flight(plan, num_stages)
    per_device = {d: devices.count(d) for d in devices}
    problem = SplitProblem(
        item_time=times,
        cut_bytes=cuts,
        recv_per_byte=[0.0] + [2 / m * models[k].seconds_per_byte(models[k - 1]) for k in range(1, num_stages)],
        send_per_byte=[2 / m * models[k].seconds_per_byte(models[k + 1]) for k in range(num_stages - 1)] + [0.0],
        fixed_time=[2 * mdl.spec.latency * (1 + (k > 0) + (k < num_stages - 1)) for k, mdl in enumerate(models)],
        state_bytes=state,
        activation_bytes=[cost_of(n).activation_bytes / m for n in order],
        in_flight=flight,
        memory=[models[k].spec.memory / per_device[devices[k]] for k in range(num_stages)],
    )
    try:
        split = solve(problem)
    except SplitInfeasible as err:
        raise PlanError(_infeasible_message(err, devices, problem, order, flight, m)) from err
    step_time = _simulated_step(plan, models, fwd_bwd, cuts, num_stages)
    minmax_step = step_time(split.boundaries)
    bounds = refine(problem, split.boundaries, step_time)
    refined_step = step_time(bounds)
    if refined_step > minmax_step * (1 - REFINE_MIN_GAIN):
        bounds, refined_step = split.boundaries, minmax_step
    stage_times = [problem.stage_time(k, bounds[k], bounds[k + 1]) for k in range(num_stages)]
    reasons = []
    for k, t in enumerate(stage_times):
        reasons.append(
            f"cost model: {fmt.seconds(t)} per micro-batch (forward+backward+send/recv) on {devices[k]}, "
            f"memory {fmt.nbytes(problem.stage_memory(k, bounds[k], bounds[k + 1]))} of {fmt.nbytes(problem.memory[k])}"
            + ("; the slowest stage" if t == max(stage_times) else "")
        )
    if bounds != split.boundaries:
        reasons[0] += (
            f"; cuts moved from the min-max split (slowest stage {fmt.seconds(split.bottleneck)}, step "
            f"{fmt.seconds(minmax_step)}) to the predicted best {plan.schedule} step with {m} micro-batches ({fmt.seconds(refined_step)})"
        )
    how = "min-max split" + (f", refined for the {plan.schedule} schedule" if bounds != split.boundaries else "")
    for k in range(num_stages):
        for node in order[bounds[k] : bounds[k + 1]]:
            node.meta[STAGE] = k
            node.meta[REASON] = f"cost model: stage {k} of the {how}"
    _place_sources(graph, num_stages)
    return StageAssignment(num_stages, None, reasons)


def _simulated_step(plan: Plan, models: list[DeviceModel], fwd_bwd: torch.Tensor, cuts: list[float], num_stages: int):
    """``step_time(boundaries)``: the schedule's simulated step for a split of the ordered
    nodes (per-node (forward, backward) seconds ``fwd_bwd``, bytes ``cuts`` across each cut)."""
    m = plan.microbatches
    actions = make_schedule(plan.schedule, num_stages, m, plan.chunks)
    zero = torch.zeros(num_stages, 1, 2, dtype=torch.float64)
    prefix = torch.cat([zero, fwd_bwd.cumsum(1)], 1).tolist()  # stages x (nodes + 1) x 2

    def step_time(bounds: list[int]) -> float:
        spans = [(prefix[k][bounds[k]], prefix[k][bounds[k + 1]]) for k in range(num_stages)]
        edge_bytes = {(k, k + 1): cuts[bounds[k + 1]] / m for k in range(num_stages - 1)}
        fwd = [end[0] - start[0] for start, end in spans]
        bwd = [end[1] - start[1] for start, end in spans]
        return _play(actions, models, fwd, bwd, edge_bytes).step_time

    return step_time


def _play(actions, models: list[DeviceModel], forward: list[float], backward: list[float], edge_bytes: dict[tuple[int, int], float]):
    """Simulate ``actions``: stage ``s``'s forward/backward seconds plus its device's
    per-action latency, and ``edge_bytes[(src, dst)]`` per micro-batch sent between stages."""
    return simulate(
        actions,
        len(models),
        lambda s, _: forward[s] + models[s].spec.latency,
        lambda s, _: backward[s] + models[s].spec.latency,
        lambda a, b, _: transfer_seconds(models, a, b, edge_bytes.get((a, b), edge_bytes.get((b, a), 0.0))),
        deps=sorted(edge_bytes),
    )


def _dataflow(compute: list[fx.Node]):
    import networkx as nx

    flow = nx.DiGraph()
    flow.add_nodes_from(compute)
    members = set(compute)
    for node in compute:
        size = tensor_bytes(node.meta.get(VAL))
        for user in node.users:
            if user in members:
                flow.add_edge(node, user, bytes=size)
    return flow


def _place_sources(graph: fx.Graph, num_stages: int) -> None:
    """Inputs in stage 0, attributes with their first user, the output in the last stage."""
    for node in reversed(graph.nodes):
        if node.op == "placeholder":
            node.meta[STAGE], node.meta[REASON] = 0, "model input"
        elif node.op == "get_attr":
            users = [u.meta[STAGE] for u in node.users if u.meta.get(STAGE) is not None]
            node.meta[STAGE] = min(users, default=0)
            node.meta[REASON] = "parameter/constant: with its first user"
        elif node.op == "output":
            node.meta[STAGE], node.meta[REASON] = num_stages - 1, "model output"


def _infeasible_message(err: SplitInfeasible, devices, problem: SplitProblem, order, flight, m) -> str:
    lines = [
        "split='auto': no split of the model fits the devices' memory (parameters + gradients + "
        f"{OPTIMIZER_STATES} optimizer states + activations of the micro-batches in flight). "
        "The split needing the least memory would need:"
    ]
    b = err.boundaries
    for k, dev in enumerate(devices):
        i, j = b[k], b[k + 1]
        state = float(problem._S[j] - problem._S[i])
        acts = err.needed[k] - state
        over = "  <-- too small" if err.needed[k] > err.limits[k] else ""
        lines.append(
            f"  stage {k} on {dev} ({order[i].name} … {order[j - 1].name}): {fmt.nbytes(err.needed[k])} "
            f"(state {fmt.nbytes(state)}, activations {fmt.nbytes(acts)} for {flight[k]} micro-batch(es) in flight), "
            f"has {fmt.nbytes(err.limits[k])}{over}"
        )
    lines.append(
        "give the devices more memory in plan.device_specs, add devices, use checkpoint=True, "
        f"or more micro-batches (now {m}) to shrink activations"
    )
    return "\n".join(lines)


# ------------------------------------------------------------- stage estimates
@dataclass
class StageEstimate:
    """What the cost model predicts for one stage, per micro-batch unless noted.

    flops: forward FLOPs of the full example batch; forward / backward: compute seconds;
    comm: seconds sending and receiving (both directions); state_bytes: parameters,
    gradients, optimizer state and buffers; activation_bytes: what one micro-batch keeps
    for backward; in_flight: micro-batches held at once under the schedule.
    """

    index: int
    device: str
    flops: float
    forward: float
    backward: float
    comm: float
    state_bytes: float
    activation_bytes: float
    in_flight: int

    @property
    def time(self) -> float:
        return self.forward + self.backward + self.comm

    @property
    def memory(self) -> float:
        return self.state_bytes + self.in_flight * self.activation_bytes


def ensure_costs(graph: fx.Graph, resolve) -> None:
    """Run the cost pass on ``graph`` unless every compute node already has a cost."""
    from fxpipe.passes.cost import annotate_costs

    if any(COST not in n.meta for n in graph.nodes if n.op in COMPUTE_OPS and EDGE not in n.meta):
        annotate_costs(graph, resolve)


def estimate_stages(graph: fx.Graph, edges, devices: list[str], plan: Plan, microbatches: int | None = None) -> list[StageEstimate]:
    """Per stage of a partitioned graph (nodes carry ``stage`` and ``cost``), its estimate."""
    m = microbatches or plan.microbatches
    models = [DeviceModel.of(plan, d) for d in devices]
    measured_on = _measured_device(graph, plan)
    flight = in_flight(plan, len(devices), m)
    est = [StageEstimate(k, d, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, flight[k]) for k, d in enumerate(devices)]
    for node in graph.nodes:
        if EDGE in node.meta or node.meta.get(STAGE) is None or node.op in ("placeholder", "output"):
            continue
        e = est[node.meta[STAGE]]
        cost = cost_of(node)
        e.state_bytes += state_bytes(cost)
        if node.op == "get_attr":
            continue
        fwd, bwd = models[e.index].node_times(cost, 1 / m, node.meta.get(MEASURED), measured_on)
        e.flops += cost.fwd_flops
        e.forward += fwd
        e.backward += bwd
        e.activation_bytes += cost.activation_bytes / m
    for edge in edges:
        seconds = transfer_seconds(models, edge.src, edge.dst, edge.nbytes / m)
        est[edge.src].comm += 2 * seconds
        est[edge.dst].comm += 2 * seconds
    return est


def transfer_seconds(models: list[DeviceModel], src: int, dst: int, nbytes: float) -> float:
    """Seconds to move ``nbytes`` from stage ``src``'s device to stage ``dst``'s."""
    return nbytes * models[src].seconds_per_byte(models[dst]) + max(models[src].spec.latency, models[dst].spec.latency)


def predicted_timeline(graph: fx.Graph, edges, devices: list[str], plan: Plan, microbatches: int | None = None):
    """The predicted Timeline of one training step of a partitioned graph under ``plan``."""
    m = microbatches or plan.microbatches
    est = estimate_stages(graph, edges, devices, plan, m)
    models = [DeviceModel.of(plan, d) for d in devices]
    sizes: dict[tuple[int, int], float] = {}
    for edge in edges:
        sizes[(edge.src, edge.dst)] = sizes.get((edge.src, edge.dst), 0.0) + edge.nbytes / m
    actions = make_schedule(plan.schedule, len(devices), m, plan.chunks)
    timeline = _play(actions, models, [e.forward for e in est], [e.backward for e in est], sizes)
    timeline.activation_bytes = {e.index: int(e.activation_bytes) for e in est}
    return timeline


def lookup(roots: list[Any], target: str) -> Any:
    """The attribute at dotted path ``target`` of the first of ``roots`` that has it.

    Raises AttributeError when none has it.
    """
    for root in roots:
        try:
            return functools.reduce(getattr, target.split("."), root)
        except AttributeError:
            continue
    raise AttributeError(f"none of the stage modules holds {target!r}")
