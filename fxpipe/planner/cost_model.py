"""The device model: a node's seconds and a stage's bytes from its counted costs.

A node's time on a device is a roofline plus a fixed cost per op::

    forward  = fwd_ops x op_overhead + max(fwd_flops x f / flops, (act_bytes_moved x f + passes_f x weight_bytes) / memory_bandwidth)
    backward = bwd_ops x op_overhead + max(bwd_flops x f / flops, (2 x act_bytes_moved x f + passes_b x weight_bytes) / memory_bandwidth)

with ``f = 1 / microbatches`` (FLOPs and activation bytes are counted at the example batch)
and weight passes per forward and backward (1 and 3; CPU convolutions 4 and 12). The
backward splits into input-gradient (I) and weight-gradient (W) time by the node's
``weight_share``. The fixed cost is why small micro-batches run slower per sample: the
per-op and per-action costs do not shrink with the batch, which gives the micro-batch sweep
its U shape. A node measured by ``fxpipe.profile`` uses its measured time instead (scaled
by the FLOP/s ratio when the stage runs on another device).

Memory of a stage: trainable parameters x (1 + 1 gradient + ``OPTIMIZER_STATES``) plus
buffers, and one micro-batch's activations times the micro-batches the schedule keeps in
flight there (``fxpipe.planner.estimates``).

Defaults (``default_spec``) are deterministic, so every rank of a distributed run makes
the same plan: "cpu" is ``CPU_FLOPS_PER_CORE`` x the cores (at most 16), 80% of physical
memory, 10 GB/s between logical CPU devices; "cuda:N" reads total memory and the SM
count from the device when there is one, else assumes a 20 TFLOP/s, 16 GB GPU on PCIe 4.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from fxpipe.passes.node_costs import NodeCost
from fxpipe.plan import DeviceSpec, Plan

CPU_FLOPS_PER_CORE = 40e9
CPU_ACTION_LATENCY = 100e-6  # thread hand-off and autograd call per action, measured on the local executor
OPTIMIZER_STATES = 2  # Adam's two moments; SGD with momentum holds 1
# FLOPs per byte of memory traffic at which a device turns from memory- to compute-bound.
_BALANCE = {"cpu": 8.0, "cuda": 30.0}
# Passes over a layer's weights per forward and per backward: reading them, and in
# backward also writing the weight gradient that autograd then accumulates (1 and 3).
# CPU convolutions cost more: oneDNN re-lays-out the weights on every call; measured on
# ResNet-50's layer3/layer4 (1 thread, micro-batches 4 and 16): forward ~0.4 ns and
# backward ~1.2-1.7 ns per weight byte whatever the batch, i.e. 4 and 12 passes.
_DENSE_WEIGHT_PASSES = (1.0, 3.0)
_CONV_WEIGHT_PASSES = {"cpu": (4.0, 12.0), "cuda": (1.0, 3.0)}
# Seconds of fixed cost per ATen op a node dispatches (passes/node_costs.py counts them): Python
# and dispatch on CPU, a kernel launch on GPU. CPU measured on nn.TransformerEncoderLayer
# (256 wide, one thread): one sample per call costs 0.92 ms more forward+backward than a
# sixteenth of a 16-sample call, over 118 ops, ~8 µs each.
_OP_OVERHEAD = {"cpu": 8e-6, "cuda": 10e-6}


class NodeTimes(NamedTuple):
    """A node's seconds: forward, and its backward as input gradients (I) plus weight
    gradients (W)."""

    forward: float
    input_grad: float
    weight_grad: float

    @property
    def backward(self) -> float:
        return self.input_grad + self.weight_grad


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
class Calibration:
    """How a device runs each kind of node (``NodeCost.kind``: conv, matmul, norm,
    elementwise, view) against the roofline estimate, measured by ``fxpipe.profile``.

    forward / backward: per kind, measured seconds over estimated seconds, both above the
    fixed per-op cost (1.0: as estimated; kinds the profile did not see get the ratio of
    all its nodes together). Applies to every device of ``device``'s type (``cpu:N`` share
    the host CPU); ``nodes``: how many timed nodes it was fitted on.
    """

    device: str
    forward: Mapping[str, float]
    backward: Mapping[str, float]
    nodes: int = 0

    def factors(self, kind: str) -> tuple[float, float]:
        """(forward, backward) factor for a node of ``kind``."""
        return self.forward.get(kind, self.forward.get("all", 1.0)), self.backward.get(kind, self.backward.get("all", 1.0))

    def applies_to(self, device: str) -> bool:
        return _kind(device) == _kind(self.device)


@dataclass(frozen=True)
class DeviceModel:
    """A device as the cost model sees it: its spec plus memory bandwidth and op overhead,
    and the per-kind calibration measured on it, if any."""

    device: str
    spec: DeviceSpec
    memory_bandwidth: float
    op_overhead: float
    conv_weight_passes: tuple[float, float] = (1.0, 3.0)
    calibration: Calibration | None = None

    @classmethod
    def of(cls, plan: Plan, device: str, calibration: Calibration | None = None) -> DeviceModel:
        """The model of ``device`` under ``plan``; ``calibration`` is kept when it was measured
        on a device of the same type."""
        spec = spec_for(plan, device)
        kind = _kind(device)
        if calibration is not None and not calibration.applies_to(device):
            calibration = None
        return cls(device, spec, spec.flops / _BALANCE[kind], _OP_OVERHEAD[kind], _CONV_WEIGHT_PASSES[kind], calibration)

    def node_times(self, cost: NodeCost, fraction: float, measured: MeasuredTime | None = None, measured_on: DeviceModel | None = None) -> tuple[float, float]:
        """(forward, backward) seconds of a node on a micro-batch ``fraction`` of the example batch."""
        times = self.node_phases(cost, fraction, measured, measured_on)
        return times.forward, times.backward

    def node_phases(self, cost: NodeCost, fraction: float, measured: MeasuredTime | None = None, measured_on: DeviceModel | None = None) -> NodeTimes:
        """Forward, input-gradient and weight-gradient seconds of a node on a micro-batch
        ``fraction`` of the example batch, its backward split by the counted weight share.

        ``measured`` (taken on ``measured_on``) replaces the estimate: above the fixed
        per-op cost it is scaled by how the estimate changes from where it was measured
        (micro-batch, device) to here, so a weight-bound layer does not shrink with the
        micro-batch as a compute-bound one does.
        """
        fixed_fwd, fixed_bwd = max(cost.fwd_ops, 1), max(cost.bwd_ops, 1)  # ops paying the fixed cost
        fwd, bwd = self.variable_seconds(cost, fraction)
        if measured is not None and measured_on is not None:
            at_fwd, at_bwd = measured_on.variable_seconds(cost, measured.batch_fraction)
            fwd = _rescaled(measured.forward - measured_on.op_overhead * fixed_fwd, fwd, at_fwd)
            bwd = _rescaled(measured.backward - measured_on.op_overhead * fixed_bwd, bwd, at_bwd) if measured.backward else 0.0
        fwd += self.op_overhead * fixed_fwd
        if bwd or cost.bwd_flops or cost.bwd_ops:
            bwd += self.op_overhead * fixed_bwd
        weight = bwd * cost.weight_share
        return NodeTimes(fwd, bwd - weight, weight)

    def variable_seconds(self, cost: NodeCost, fraction: float) -> tuple[float, float]:
        """(forward, backward) roofline seconds of a node above its fixed per-op cost, on a
        micro-batch ``fraction`` of the example batch, calibrated when the model is."""
        weights_fwd, weights_bwd = self.conv_weight_passes if cost.convolution else _DENSE_WEIGHT_PASSES
        moved = cost.act_bytes_moved * fraction
        fwd = max(cost.fwd_flops * fraction / self.spec.flops, (moved + weights_fwd * cost.weight_bytes) / self.memory_bandwidth)
        bwd = 0.0
        if cost.bwd_flops or cost.bwd_ops:
            bwd = max(cost.bwd_flops * fraction / self.spec.flops, (2 * moved + weights_bwd * cost.weight_bytes) / self.memory_bandwidth)
        if self.calibration is not None:
            scale_fwd, scale_bwd = self.calibration.factors(cost.kind)
            fwd, bwd = fwd * scale_fwd, bwd * scale_bwd
        return fwd, bwd

    def seconds_per_byte(self, other: DeviceModel) -> float:
        """Seconds per byte sent between this device and ``other`` (0 on the same device)."""
        if other.device == self.device:
            return 0.0
        return 1.0 / min(self.spec.bandwidth, other.spec.bandwidth)


def state_bytes(cost: NodeCost) -> float:
    """Persistent bytes: parameters with their gradients and optimizer state, plus buffers."""
    return cost.param_bytes * (2 + OPTIMIZER_STATES) + cost.buffer_bytes


def calibrate(model: DeviceModel, samples: Iterable[tuple[NodeCost, MeasuredTime]]) -> Calibration:
    """The per-kind Calibration of ``model``'s device from timed nodes (``samples``: each
    node's cost and its measured time): per kind, the sum of the measured seconds over the
    sum of the estimated ones, both above the fixed per-op cost and at the micro-batch the
    nodes were timed on. Returns factors of 1.0 when nothing was timed."""
    model = replace(model, calibration=None)
    sums: dict[tuple[str, str], list[float]] = {}
    count = 0
    for cost, measured in samples:
        count += 1
        est_fwd, est_bwd = model.variable_seconds(cost, measured.batch_fraction)
        got_fwd = max(measured.forward - model.op_overhead * max(cost.fwd_ops, 1), 0.0)
        got_bwd = max(measured.backward - model.op_overhead * max(cost.bwd_ops, 1), 0.0) if measured.backward else 0.0
        for kind in (cost.kind, "all"):
            for phase, got, est in (("forward", got_fwd, est_fwd), ("backward", got_bwd, est_bwd)):
                if est > 0:
                    total = sums.setdefault((phase, kind), [0.0, 0.0])
                    total[0] += got
                    total[1] += est
    factors: dict[str, dict[str, float]] = {"forward": {}, "backward": {}}
    for (phase, kind), (got, est) in sums.items():
        factors[phase][kind] = got / est
    return Calibration(model.device, factors["forward"], factors["backward"], count)


def _rescaled(measured: float, here: float, there: float) -> float:
    """A measured variable time moved from where it was taken (estimate ``there``) to here."""
    return max(measured, 0.0) * (here / there) if there > 0 else max(measured, 0.0)


def transfer_seconds(models: list[DeviceModel], src: int, dst: int, nbytes: float) -> float:
    """Seconds to move ``nbytes`` from stage ``src``'s device to stage ``dst``'s."""
    return nbytes * models[src].seconds_per_byte(models[dst]) + max(models[src].spec.latency, models[dst].spec.latency)


def stage_models(plan: Plan, devices: list[str], calibration: Calibration | None = None) -> list[DeviceModel]:
    """One DeviceModel per stage device (calibrated where ``calibration`` applies)."""
    return [DeviceModel.of(plan, d, calibration) for d in devices]
