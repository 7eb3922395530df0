"""Stage estimates and the predicted timeline: what the cost model says of a partition.

Reads the costs the compiler wrote on the partitioned graph (``node.meta["cost"]``, and
``node.meta["measured_time"]`` where ``fxpipe.profile`` timed a node) and the device model
(``fxpipe.cost_model``); writes nothing. Per stage: forward, input-gradient (I) and
weight-gradient (W) seconds per micro-batch, send/recv seconds, and memory: state plus one
micro-batch's activations times the micro-batches the schedule holds in flight there (read
from the schedule itself, simulated with unit costs). The predicted timeline plays the
plan's schedule with these times on ``fxpipe.schedule_sim``'s ideal clock. The schedule
comes from the caller (``Partitioned.actions``, or the plan's for ``split="auto"``): this
module resolves none.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch.fx as fx

from fxpipe.cost_model import Calibration, DeviceModel, stage_models, state_bytes, transfer_seconds
from fxpipe.passes.meta import EDGE, MEASURED, STAGE
from fxpipe.passes.node_costs import cost_of
from fxpipe.passes.partition import Edge
from fxpipe.plan import Plan
from fxpipe.schedule_sim import simulate
from fxpipe.schedules import Action, Schedule
from fxpipe.timeline import Timeline


@dataclass
class StageEstimate:
    """What the cost model predicts for one stage, per micro-batch unless noted.

    flops: forward FLOPs of the full example batch; forward / input_grad / weight_grad:
    compute seconds of the forward and of the backward's two parts (I: gradients of the
    stage's inputs, W: of its weights); comm: seconds sending and receiving (both
    directions); state_bytes: parameters, gradients, optimizer state and buffers;
    activation_bytes: what one micro-batch keeps for backward; in_flight: micro-batches
    held at once under the schedule.
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

    @property
    def backward(self) -> float:
        """Backward seconds: I plus W."""
        return self.input_grad + self.weight_grad

    @property
    def time(self) -> float:
        return self.forward + self.backward + self.comm

    @property
    def memory(self) -> float:
        return self.state_bytes + self.in_flight * self.activation_bytes


def in_flight(plan: Plan, actions: Schedule, num_stages: int, deps: Sequence[tuple[int, int]] | None = None) -> list[int]:
    """Per stage, the most micro-batches whose activations ``actions`` (the plan's schedule
    on the stage graph ``deps``, the chain by default) hold at once; one each under
    ``plan.checkpoint``."""
    if plan.checkpoint:
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
    flight: Sequence[int],
    m: int,
    calibration: Calibration | None = None,
) -> list[StageEstimate]:
    """Per stage of a partitioned graph (nodes carry ``stage`` and ``cost``), its estimate
    for ``m`` micro-batches, with ``flight[s]`` micro-batches in flight on stage s
    (:func:`in_flight`); ``calibration`` (from ``fxpipe.profile``) rates the nodes it did
    not time."""
    models = stage_models(plan, devices, calibration)
    measured_on = measured_device(graph, plan, calibration)
    est = [StageEstimate(k, d, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, flight[k]) for k, d in enumerate(devices)]
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
    for edge in edges:
        seconds = transfer_seconds(models, edge.src, edge.dst, edge.nbytes / m)
        est[edge.src].comm += 2 * seconds
        est[edge.dst].comm += 2 * seconds
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
    plan's schedule for ``m`` micro-batches) played with the stages' estimates ``est``."""
    sizes: dict[tuple[int, int], float] = {}
    for edge in edges:
        sizes[(edge.src, edge.dst)] = sizes.get((edge.src, edge.dst), 0.0) + edge.nbytes / m
    models = stage_models(plan, devices, calibration)
    timeline = play(actions, models, [e.forward for e in est], [e.input_grad for e in est], [e.weight_grad for e in est], sizes)
    timeline.activation_bytes = {e.index: int(e.activation_bytes) for e in est}
    return timeline
