"""Stage estimates and the predicted timeline: what the cost model says of a partition.

Reads the costs the compiler wrote on the partitioned graph (``node.meta["cost"]``, and
``node.meta["measured_time"]`` where ``fxpipe.profile`` timed a node) and the device model
(``fxpipe.planner.cost_model``); writes nothing. Per stage: forward, input-gradient (I) and
weight-gradient (W) seconds per micro-batch, the seconds a recompute (or an offload's
unhidden transfers) adds to the backward, send/recv seconds, and memory: state plus the
activation peak, from the stages' memory profile (``fxpipe.compiler.memory_profile``) walked
through the schedule (``fxpipe.planner.memory_model``) when given one, else one micro-batch's
output bytes times the micro-batches the schedule holds in flight there (the node model
``split="auto"`` cuts with). The predicted timeline plays the plan's schedule with these
times on ``fxpipe.planner.schedule_sim``'s ideal clock. The schedule comes from the caller
(``Partitioned.actions``, or the plan's for ``split="auto"``): this module resolves none.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch.fx as fx

from fxpipe.inspection.timeline import Timeline
from fxpipe.passes.meta import EDGE, MEASURED, STAGE
from fxpipe.passes.node_costs import cost_of
from fxpipe.passes.partition import Edge
from fxpipe.plan import Plan, is_recompute
from fxpipe.planner.cost_model import (
    Calibration,
    DeviceModel,
    stage_models,
    state_bytes,
    transfer_seconds,
)
from fxpipe.planner.memory_model import MicrobatchMemory, activation_peaks
from fxpipe.planner.schedule_sim import simulate
from fxpipe.schedules import Action, Schedule, StageGraph, execution_order

# node kinds whose outputs selective recompute keeps (the rest it runs again)
COSTLY_KINDS = ("matmul", "conv")


@dataclass(frozen=True)
class StageChoices:
    """What each stage keeps for backward: ``recompute`` (False, True or "selective") and
    ``offload`` per stage; ``profile``: what one micro-batch then keeps on each stage
    (``fxpipe.compiler.memory_profile``), or None when not profiled."""

    recompute: Sequence[bool | str]
    offload: Sequence[bool]
    profile: Sequence[MicrobatchMemory] | None = None

    @classmethod
    def of(cls, plan: Plan, num_stages: int) -> StageChoices:
        """The choices ``plan`` states outright ("auto" counts as keeping everything)."""
        checkpoint = plan.checkpoint
        if isinstance(checkpoint, list) and len(checkpoint) == num_stages:
            return cls(list(checkpoint), [False] * num_stages)
        fixed = checkpoint if is_recompute(checkpoint) else False
        return cls([fixed] * num_stages, [False] * num_stages)

    def recompute_seconds(self, stage: int, forward: float, cheap: float, model: DeviceModel, compute: float) -> float:
        """Seconds stage ``stage``'s backward adds: its forward again (True), its cheap ops
        again ("selective"), or the offloaded tensors' transfers that its compute
        (``compute`` seconds) does not hide."""
        mode = self.recompute[stage]
        if mode is True:
            return forward
        if mode == "selective":
            return cheap
        if self.offload[stage] and self.profile is not None:
            moved = self.profile[stage].backward - self.profile[stage].forward
            return max(0.0, 2 * moved / model.spec.bandwidth - compute)
        return 0.0


@dataclass
class StageEstimate:
    """What the cost model predicts for one stage, per micro-batch unless noted.

    flops: forward FLOPs of the full example batch; forward / input_grad / weight_grad:
    compute seconds of the forward and of the backward's two parts (I: gradients of the
    stage's inputs, W: of its weights); recompute: seconds the backward spends running
    forward ops again (``checkpoint`` True or "selective"), or waiting for offloaded
    tensors; comm: seconds sending and receiving (both directions); state_bytes:
    parameters, gradients, optimizer state and buffers; activation_bytes: what one
    micro-batch's outputs take (the node model); in_flight: micro-batches held at once
    under the schedule; activation_peak: the most bytes kept for backward at once over
    the step (from a fake run of the stage when profiled, else in_flight x
    activation_bytes).
    """

    index: int
    device: str
    flops: float
    forward: float
    input_grad: float
    weight_grad: float
    comm: float
    state_bytes: float
    activation_bytes: float
    in_flight: int
    recompute: float = 0.0
    activation_peak: float = 0.0

    @property
    def backward(self) -> float:
        """Backward seconds: I plus W, plus any recompute."""
        return self.input_grad + self.weight_grad + self.recompute

    @property
    def time(self) -> float:
        return self.forward + self.backward + self.comm

    @property
    def memory(self) -> float:
        """Bytes on the device: state (with optimizer state) and the activation peak."""
        return self.state_bytes + self.activation_peak


def in_flight(plan: Plan, actions: Schedule, num_stages: int, deps: Sequence[tuple[int, int]] | None = None) -> list[int]:
    """Per stage, the most micro-batches whose activations ``actions`` (the plan's schedule
    on the stage graph ``deps``, the chain by default) hold at once; one each where the plan
    recomputes every stage's forward."""
    if plan.checkpoint is True:
        return [1] * num_stages
    peaks = simulate(actions, num_stages, 1.0, 2.0, deps=deps).peak_in_flight()
    return [max(peaks.get(s, 1), 1) for s in range(num_stages)]


def measured_device(graph: fx.Graph, plan: Plan, calibration: Calibration | None = None) -> DeviceModel | None:
    """The device ``fxpipe.profile`` timed the graph's nodes on, if it did."""
    for node in graph.nodes:
        if MEASURED in node.meta:
            return DeviceModel.of(plan, node.meta[MEASURED].device, calibration)
    return None


def estimate_stages(
    graph: fx.Graph,
    edges: Sequence[Edge],
    devices: list[str],
    plan: Plan,
    actions: Schedule,
    m: int,
    calibration: Calibration | None = None,
    choices: StageChoices | None = None,
) -> list[StageEstimate]:
    """Per stage of a partitioned graph (nodes carry ``stage`` and ``cost``), its estimate
    for ``m`` micro-batches run as ``actions`` (the plan's schedule); ``calibration`` (from
    ``fxpipe.profile``) rates the nodes it did not time; ``choices`` says what each stage
    keeps for backward and, with a memory profile, gives the activation peaks (without
    one, in-flight micro-batches x the node model's bytes)."""
    models = stage_models(plan, devices, calibration)
    measured_on = measured_device(graph, plan, calibration)
    flight = in_flight(plan, actions, len(devices), _deps(edges))
    est = [StageEstimate(k, d, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, flight[k]) for k, d in enumerate(devices)]
    cheap = [0.0] * len(devices)  # forward seconds of the ops selective recompute runs again
    for node in graph.nodes:
        if EDGE in node.meta or node.meta.get(STAGE) is None or node.op in ("placeholder", "output"):
            continue
        e = est[node.meta[STAGE]]
        cost = cost_of(node)
        e.state_bytes += state_bytes(cost)
        if node.op == "get_attr":
            continue
        times = models[e.index].node_phases(cost, 1 / m, node.meta.get(MEASURED), measured_on)
        e.flops += cost.fwd_flops
        e.forward += times.forward
        e.input_grad += times.input_grad
        e.weight_grad += times.weight_grad
        e.activation_bytes += cost.activation_bytes / m
        if cost.kind not in COSTLY_KINDS:
            cheap[e.index] += times.forward
    for edge in edges:
        seconds = transfer_seconds(models, edge.src, edge.dst, edge.nbytes / m)
        est[edge.src].comm += 2 * seconds
        est[edge.dst].comm += 2 * seconds
    choices = choices or StageChoices.of(plan, len(devices))
    peaks = None
    if choices.profile is not None:
        peaks = activation_peaks(actions, choices.profile)[0]
    for e in est:
        e.recompute = choices.recompute_seconds(e.index, e.forward, cheap[e.index], models[e.index], e.forward + e.input_grad + e.weight_grad)
        e.activation_peak = peaks[e.index] if peaks is not None else e.in_flight * e.activation_bytes
    return est


def play(
    actions: Sequence[Sequence[Action]],
    models: list[DeviceModel],
    forward: Sequence[float],
    input_grad: Sequence[float],
    weight_grad: Sequence[float],
    edge_bytes: dict[tuple[int, int], float],
) -> Timeline:
    """Simulate ``actions``: stage ``s``'s forward, input-gradient (I) and weight-gradient (W)
    seconds (a whole backward, B, is I + W), each action plus its device's latency, and
    ``edge_bytes[(src, dst)]`` per micro-batch sent between stages."""
    def seconds(phases: Sequence[Sequence[float]]):
        return lambda s, _: sum(p[s] for p in phases) + models[s].spec.latency

    return simulate(
        actions,
        len(models),
        seconds([forward]),
        seconds([input_grad, weight_grad]),
        lambda a, b, _: transfer_seconds(models, a, b, edge_bytes.get((a, b), edge_bytes.get((b, a), 0.0))),
        deps=sorted(edge_bytes),
        input_time=seconds([input_grad]),
        weight_time=seconds([weight_grad]),
    )


class StepClock:
    """``play(actions, models, ...).step_time`` for many stage times on one schedule (the
    refinement of ``split="auto"`` asks hundreds): the execution order, which depends on the
    schedule and the stages' dependencies ``deps`` only, is worked out once; each
    :meth:`step_time` adds up the seconds in that order, with ``play``'s arithmetic (the
    same float operations in the same order, so the same result)."""

    def __init__(self, actions: Sequence[Sequence[Action]], models: list[DeviceModel], deps: Sequence[tuple[int, int]]) -> None:
        self.models = models
        self.num_workers = len(actions)
        self._steps: list[tuple[int, str, int, list[tuple[int, int, int]]]] = []  # worker, op, stage, needs (index, worker, stage)
        where: dict[Action, tuple[int, int]] = {}
        for worker, action, needs in execution_order(actions, StageGraph(len(models), deps)):
            self._steps.append((worker, action.op, action.stage, [(*where[n], n.stage) for n in needs]))
            where[action] = (len(where), worker)

    def step_time(self, forward: Sequence[float], input_grad: Sequence[float], weight_grad: Sequence[float], edge_bytes: dict[tuple[int, int], float]) -> float:
        """What ``play(actions, models, forward, input_grad, weight_grad, edge_bytes).step_time`` returns."""
        models = self.models
        latency = [mdl.spec.latency for mdl in models]
        seconds = {
            "F": [0 + f + lat for f, lat in zip(forward, latency)],
            "B": [0 + i + w + lat for i, w, lat in zip(input_grad, weight_grad, latency)],
            "I": [0 + i + lat for i, lat in zip(input_grad, latency)],
            "W": [0 + w + lat for w, lat in zip(weight_grad, latency)],
        }
        comm: dict[tuple[int, int], float] = {}
        free_at = [0.0] * self.num_workers
        ends: list[float] = []
        first = last = None
        for worker, op, stage, needs in self._steps:
            start = free_at[worker]
            for index, need_worker, need_stage in needs:
                need_end = ends[index]
                if need_worker != worker:
                    pair = (need_stage, stage)
                    if pair not in comm:
                        comm[pair] = _non_negative(transfer_seconds(models, *pair, edge_bytes.get(pair, edge_bytes.get(pair[::-1], 0.0))), "comm_time")
                    need_end += comm[pair]
                start = max(start, need_end)
            end = start + _non_negative(seconds[op][stage], f"{op} time") + 0.0
            ends.append(end)
            free_at[worker] = end
            first = start if first is None else min(first, start)
            last = end if last is None else max(last, end)
        return 0.0 if first is None else last - first


def _non_negative(value: float, what: str) -> float:
    if value < 0:
        raise ValueError(f"{what} is negative ({value} s)")
    return value


def predicted_timeline(
    est: Sequence[StageEstimate],
    actions: Schedule,
    edges: Sequence[Edge],
    devices: list[str],
    plan: Plan,
    m: int,
    calibration: Calibration | None = None,
) -> Timeline:
    """The predicted Timeline of one training step of a partitioned graph: ``actions`` (the
    plan's schedule for ``m`` micro-batches) played with the stages' estimates ``est`` (a
    stage's recompute runs in its backward, before its input gradients)."""
    sizes: dict[tuple[int, int], float] = {}
    for edge in edges:
        sizes[(edge.src, edge.dst)] = sizes.get((edge.src, edge.dst), 0.0) + edge.nbytes / m
    models = stage_models(plan, devices, calibration)
    timeline = play(actions, models, [e.forward for e in est], [e.input_grad + e.recompute for e in est], [e.weight_grad for e in est], sizes)
    timeline.activation_bytes = {e.index: int(e.activation_bytes) for e in est}
    return timeline


def _deps(edges: Sequence[Edge]) -> list[tuple[int, int]]:
    return sorted({(e.src, e.dst) for e in edges})
