"""``Plan``: the user's intent in one dataclass. Passes read the fields they need."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fxpipe.batching.microbatch import MERGE_MODES
from fxpipe.devices import default_devices, normalize_device
from fxpipe.schedules import (
    SCHEDULES,
    Schedule,
    ScheduleError,
    ScheduleSpec,
    as_schedule,
    check_chunks,
    describe_schedule,
    microbatch_count,
    resolve_schedule,
)

DEFAULT_MICROBATCHES = 4
FRONTENDS = ("auto", "fx", "export")
# what a stage may keep for backward: everything, its inputs only (recompute), or the
# outputs of its costly ops ("selective")
RECOMPUTE = (False, True, "selective")
# the torch.compile keyword arguments Plan(compile={...}) passes on for each stage
COMPILE_OPTIONS = ("mode", "dynamic", "options", "backend", "fullgraph")


def is_recompute(value: object) -> bool:
    """Whether ``value`` is one stage's recompute choice: False, True or "selective"."""
    return isinstance(value, bool) or value == "selective"


class PlanError(ValueError):
    """A plan the compiler cannot honour; the message names the field and the fix."""


class PlanScheduleError(PlanError, ScheduleError):
    """The plan's schedule cannot run (as named, with these chunks, for these stages or this
    micro-batch count): a PlanError naming the plan field, and the ScheduleError
    ``fxpipe.check_schedule`` documents, so that catching either catches it."""


@dataclass(frozen=True)
class DeviceSpec:
    """What the cost model assumes of a device, in SI units.

    flops: sustained FLOP/s; memory: bytes usable for parameters, gradients, optimizer
    state and activations; bandwidth: bytes/s to and from the other devices;
    latency: fixed seconds every send/recv and every action pays.
    """

    flops: float
    memory: float
    bandwidth: float
    latency: float = 20e-6


@dataclass
class Plan:
    """How to cut and run a model. A dict with the same keys is accepted wherever a Plan is.

    devices: device of each stage in pipeline order ("cpu", "cpu:N", "cuda:N", "gpu:N");
        with ``chunks`` > 1 it may instead list one device per pipeline worker (a stage
        then runs on the device of the worker the schedule puts it on: see
        :meth:`stage_devices`). Omitted: taken from device_guard tags, or one logical
        device per worker.
    split: "tags" (device_guard blocks), "auto" (cost model) or a list of module paths;
        a new stage begins at the first node of each listed module.
    schedule: a name, "gpipe" | "1f1b" | "interleaved-1f1b" | "zb-h1", or one of the V
        schedules "zb-v" | "v-half" | "v-min" | "dualpipev" (with chunks=2; "dualpipev" runs
        at least ``2p - 1`` micro-batches on ``p`` workers), or your own schedule: one list of ``fxpipe.Action`` per worker, or a
        function ``(num_stages, num_microbatches)`` returning such lists. Your own is
        checked (complete, deadlock-free) before anything runs; its lists place the stages
        (worker ``w`` runs the stages in list ``w``). See docs/schedules.md.
    microbatches: the batch (dim 0) is cut into this many micro-batches; default 4, or,
        when ``schedule`` is given as lists of actions, the count those lists run.
    chunks: stages per device: any for "interleaved-1f1b", 2 for the V schedules.
    checkpoint: what each stage keeps for backward: False (every activation), True
        (only its inputs; the forward runs again in backward), "selective" (the outputs of
        matrix products, convolutions and attention; the cheap ops run again), "auto"
        (per stage, the fastest predicted choice that fits every device's
        ``DeviceSpec.memory``; a plan that cannot fit is a PlanError saying by how much
        and what would fit), or a list of False / True / "selective", one per stage.
    offload: on CUDA stages, move the tensors saved for backward to pinned host memory
        after the forward and back before the backward, on a side stream: True, False,
        or "auto" (the stages where the cost model finds it cheaper than recompute for
        fitting ``DeviceSpec.memory``). CPU stages never offload (True says so, once).
    device_specs: DeviceSpec per device name for the cost model.
    data_parallel: pipeline replicas (distributed runs only).
    fsdp: shard each stage's parameters, gradients and optimizer state over its
        ``data_parallel`` replicas (``torch.distributed.fsdp.fully_shard``) instead of
        copying them (distributed runs only; see docs/distributed.md).
    reshard_after_forward: with ``fsdp``, whether a stage frees its gathered parameters
        after each action (True) or keeps them until its gradients are reduced (False):
        one bool for every stage, one per stage, or None to let the memory estimates
        choose per stage.
    timeout: seconds any one action or wait may last before the step fails with an error
        naming the stage (and, distributed, the rank) at fault: in the local executor a
        stage that runs or waits longer raises PipelineError, under torchrun a rank waiting
        longer for a peer raises RankFailedError; start-up (ranks compiling, joining) is
        bounded by it too.
    check_finite: check every floating value a stage hands on (activations, gradients sent
        back, the model's output) and every loss for NaN/Inf, and fail at the first one
        with an error naming the stage, action, micro-batch and edge. Off by default, so a
        run that diverges behaves as eager does (a NaN loss comes back, nothing raises);
        each check costs a pass over the tensor and a host synchronisation.
    frontend: "auto" (torch.fx for every model, what it cannot trace run whole as opaque
        calls; torch.export when fx fails outright), "fx" or "export".
    leaf_modules: module classes or qualified names the fx tracer keeps as single calls.
    concrete_args: forward arguments fixed while tracing with fx (torch.fx semantics).
    output_merge: how to merge each tensor output whose dim 0 is not the batch (a 0-d
        auxiliary loss, per-layer statistics) over the micro-batches, by its path in the
        model's return value ("1", "aux", "0.aux"): "cat", "stack", "sum", or "mean"
        (weighted by micro-batch size, so a mean-reduced loss equals its full-batch value).
    compile: run each stage's forward and backward as code compiled from fxpipe's own
        stage graph (``torch.compile`` of the stage module: Dynamo, AOTAutograd, Inductor):
        False (eager stages), True, or a dict of ``torch.compile`` keyword options
        (``mode``, ``dynamic``, ``options``, ``backend``, ``fullgraph``). See docs/compiled.md.
    """

    devices: Sequence[str] | None = None
    split: str | Sequence[str] = "tags"
    schedule: ScheduleSpec = "1f1b"
    microbatches: int | None = None
    chunks: int = 1
    checkpoint: bool | str | Sequence[bool | str] = False
    device_specs: Mapping[str, DeviceSpec] = field(default_factory=dict)
    data_parallel: int = 1
    fsdp: bool = False
    reshard_after_forward: bool | Sequence[bool] | None = None
    timeout: float = 300.0
    check_finite: bool = False
    frontend: str = "auto"
    leaf_modules: Sequence[Any] = ()
    concrete_args: Mapping[str, Any] | None = None
    output_merge: Mapping[str, str] = field(default_factory=dict)
    offload: bool | str = False
    compile: bool | Mapping[str, Any] = False

    def __post_init__(self) -> None:
        self._check_containers()
        if self.devices is not None:
            if isinstance(self.devices, str):
                raise PlanError(f"plan.devices must be a list of device names, got the string {self.devices!r}; write [{self.devices!r}]")
            self.devices = [normalize_device(d, f"plan.devices[{i}]") for i, d in enumerate(self.devices)]
            if not self.devices:
                raise PlanError("plan.devices is empty; give one device per stage, e.g. ['cpu:0', 'cpu:1']")
        if isinstance(self.split, str):
            if self.split not in ("tags", "auto"):
                raise PlanError(f"plan.split = {self.split!r}: use 'tags', 'auto' or a list of module paths such as ['layer3']")
        else:
            self.split = list(self.split)
            if not all(isinstance(s, str) and s for s in self.split):
                raise PlanError(f"plan.split must list module paths as strings, got {self.split!r}")
        self._check_schedule()
        for name in ("microbatches", "chunks", "data_parallel"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanError(f"plan.{name} = {value!r}: must be a positive integer")
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, int | float) or not self.timeout > 0:
            raise PlanError(f"plan.timeout = {self.timeout!r}: must be a positive number of seconds")
        if not isinstance(self.check_finite, bool):
            raise PlanError(f"plan.check_finite = {self.check_finite!r}: must be True or False")
        self._check_sharding()
        if isinstance(self.schedule, str):
            try:
                check_chunks(self.schedule, self.chunks)
            except ScheduleError as err:
                raise PlanScheduleError(f"plan.schedule = {self.schedule!r} with plan.chunks = {self.chunks}: {err}") from None
        self._check_memory_fields()
        self._check_compile()
        if self.frontend not in FRONTENDS:
            raise PlanError(f"plan.frontend = {self.frontend!r}: choose one of {', '.join(FRONTENDS)}")
        self.device_specs = {normalize_device(k, f"plan.device_specs[{k!r}]"): v for k, v in dict(self.device_specs).items()}
        for key, spec in self.device_specs.items():
            if not isinstance(spec, DeviceSpec):
                raise PlanError(f"plan.device_specs[{key!r}] must be an fxpipe.DeviceSpec, got {type(spec).__name__}")
        self.output_merge = dict(self.output_merge)
        for path, mode in self.output_merge.items():
            if not isinstance(path, str) or mode not in MERGE_MODES:
                raise PlanError(
                    f"plan.output_merge[{path!r}] = {mode!r}: map output paths (strings such as '1' or 'aux') "
                    f"to one of {', '.join(MERGE_MODES)}"
                )

    def _check_containers(self) -> None:
        """The fields that hold lists or dicts hold one (``Plan(devices=5)`` is named here,
        not met later as "'int' object is not iterable")."""
        lists = {
            "devices": (self.devices, "a list of device names, one per stage, e.g. ['cpu:0', 'cpu:1']"),
            "split": (self.split, "'tags', 'auto' or a list of module paths such as ['layer3']"),
            "leaf_modules": (self.leaf_modules, "a list of module classes or qualified names, e.g. [nn.MultiheadAttention]"),
        }
        for name, (value, want) in lists.items():
            if value is None or (name == "split" and isinstance(value, str)):
                continue
            unordered_ok = name == "leaf_modules" and isinstance(value, set | frozenset)
            if isinstance(value, str | bytes | Mapping) or not (isinstance(value, Sequence) or unordered_ok):
                raise PlanError(f"plan.{name} = {value!r} ({type(value).__name__}): give {want}")
        dicts = {
            "device_specs": "a dict of device name -> fxpipe.DeviceSpec, e.g. {'cuda:0': DeviceSpec(...)}",
            "output_merge": "a dict of output path -> 'cat' | 'stack' | 'sum' | 'mean', e.g. {'1': 'mean'}",
            "concrete_args": "a dict of forward argument name -> value, or None",
        }
        for name, want in dicts.items():
            value = getattr(self, name)
            if not (isinstance(value, Mapping) or (value is None and name == "concrete_args")):
                raise PlanError(f"plan.{name} = {value!r} ({type(value).__name__}): give {want}")

    def _check_memory_fields(self) -> None:
        """``checkpoint`` and ``offload`` (a per-stage list's length is checked at compile
        time, when the stages are known)."""
        if isinstance(self.checkpoint, list | tuple):
            self.checkpoint = list(self.checkpoint)
            bad = [c for c in self.checkpoint if not is_recompute(c)]
            if bad or not self.checkpoint:
                raise PlanError(
                    f"plan.checkpoint = {self.checkpoint!r}: a list gives each stage False, True or "
                    "'selective' (one entry per stage); 'auto' applies to the whole plan"
                )
        elif not (is_recompute(self.checkpoint) or self.checkpoint == "auto"):
            raise PlanError(
                f"plan.checkpoint = {self.checkpoint!r}: use False, True, 'selective', 'auto', or a list "
                "of False / True / 'selective' with one entry per stage"
            )
        if not (isinstance(self.offload, bool) or self.offload == "auto"):
            raise PlanError(f"plan.offload = {self.offload!r}: use False, True or 'auto'")

    @property
    def compiles_backward(self) -> bool:
        """Whether compiled stages hold their backward graph (Inductor, the default backend):
        a zero-bubble schedule then splits that graph into I and W, where eager stages (and
        other backends) defer the weight gradients op by op."""
        if self.compile is True:
            return True
        return isinstance(self.compile, Mapping) and self.compile.get("backend", "inductor") == "inductor"

    def _check_compile(self) -> None:
        """``compile``: a bool, or a dict of ``torch.compile`` keyword options (copied)."""
        if isinstance(self.compile, bool):
            return
        if not isinstance(self.compile, Mapping):
            raise PlanError(
                f"plan.compile = {self.compile!r} ({type(self.compile).__name__}): use False, True, or a dict of "
                f"torch.compile options such as {{'mode': 'max-autotune-no-cudagraphs'}} (keys: {', '.join(COMPILE_OPTIONS)})"
            )
        unknown = sorted(k for k in self.compile if k not in COMPILE_OPTIONS)
        if unknown:
            raise PlanError(f"plan.compile has unknown option(s) {unknown}: torch.compile options fxpipe passes on are {', '.join(COMPILE_OPTIONS)}")
        if "options" in self.compile and "mode" in self.compile and self.compile["mode"] is not None and self.compile["options"] is not None:
            raise PlanError("plan.compile gives both 'mode' and 'options', which torch.compile refuses together: put the mode's settings in 'options'")
        self.compile = dict(self.compile)

    def _check_sharding(self) -> None:
        if not isinstance(self.fsdp, bool):
            raise PlanError(f"plan.fsdp = {self.fsdp!r}: must be True or False")
        reshard = self.reshard_after_forward
        if reshard is None:
            return
        if not self.fsdp:
            raise PlanError(f"plan.reshard_after_forward = {reshard!r} applies to sharded stages only: set plan.fsdp=True, or leave it out")
        if not isinstance(reshard, bool):
            if isinstance(reshard, str) or not isinstance(reshard, Sequence) or not all(isinstance(r, bool) for r in reshard):
                raise PlanError(f"plan.reshard_after_forward = {reshard!r}: give True, False, one bool per stage, or None (chosen per stage)")
            self.reshard_after_forward = list(reshard)

    def _check_schedule(self) -> None:
        """Types only (whether a schedule runs needs the stage count: ``resolve_schedule``).
        A schedule given as lists of actions is copied and fixes ``microbatches``."""
        if isinstance(self.schedule, str):
            if self.schedule not in SCHEDULES:
                raise PlanScheduleError(
                    f"plan.schedule = {self.schedule!r}: choose one of {', '.join(SCHEDULES)}, or write your "
                    "own: a list of fxpipe.Action lists (one per device) or a function "
                    "(num_stages, num_microbatches) -> such lists"
                )
        elif not callable(self.schedule):
            try:
                self.schedule = as_schedule(self.schedule, "plan.schedule")
            except ScheduleError as err:
                raise PlanScheduleError(str(err)) from None
            runs = microbatch_count(self.schedule)
            if self.microbatches is None:
                self.microbatches = runs
            elif self.microbatches != runs:
                raise PlanScheduleError(
                    f"plan.microbatches = {self.microbatches!r}, but plan.schedule runs {runs} micro-batches; "
                    "leave microbatches out (the lists fix it), or give a function "
                    "(num_stages, num_microbatches) -> schedule to serve any count"
                )
        if self.microbatches is None:
            self.microbatches = DEFAULT_MICROBATCHES

    @classmethod
    def coerce(cls, plan: Plan | Mapping[str, Any] | None) -> Plan:
        """A Plan from a Plan, a dict with Plan's keys, or None (all defaults)."""
        if plan is None:
            return cls()
        if isinstance(plan, Plan):
            return plan
        if isinstance(plan, Mapping):
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(plan) - known)
            if unknown:
                raise PlanError(f"unknown plan field(s) {unknown}; Plan has {sorted(known)}")
            return cls(**plan)
        raise PlanError(f"expected an fxpipe.Plan or a dict, got {type(plan).__name__}")

    def replace(self, **changes: Any) -> Plan:
        """A copy of this plan with some fields changed."""
        return dataclasses.replace(self, **changes)

    def actions(self, num_stages: int, microbatches: int | None = None, deps: Sequence[tuple[int, int]] | None = None) -> Schedule:
        """The plan's schedule for ``num_stages`` stages and ``microbatches`` (default the
        plan's), proven to run on the stage graph ``deps`` ((producer, consumer) pairs; the
        chain by default): the one place a plan's schedule is resolved
        (``resolve_schedule``). A partition asks ``Partitioned.actions``, which also keeps
        every count's stages where they were placed. Raises PlanScheduleError naming
        plan.schedule and why it cannot run."""
        try:
            return resolve_schedule(self.schedule, num_stages, microbatches or self.microbatches, self.chunks, deps)
        except ScheduleError as err:
            raise PlanScheduleError(f"plan.schedule={describe_schedule(self.schedule)}: {err}") from err

    def stage_devices(self, workers: Sequence[int], tag_devices: Sequence[str] | None = None, how: str = "the split") -> list[str]:
        """The device of every stage, given the worker the schedule runs it on (``workers[s]``,
        ``stage_workers``): ``devices`` lists one per stage, or one per worker (stage s runs
        on ``devices[workers[s]]``); without ``devices``, the device_guard tags' devices
        (``tag_devices``), else one default device per worker. ``how``: what made the stages,
        for the message. Raises PlanError when ``devices`` lists neither as many devices as
        stages nor as many as workers."""
        num_stages, num_workers = len(workers), max(workers) + 1
        if self.devices is None:
            if tag_devices:
                return list(tag_devices)
            per_worker = default_devices(num_workers)
            return [per_worker[w] for w in workers]
        if len(self.devices) == num_stages:
            return list(self.devices)
        if len(self.devices) == num_workers:
            return [self.devices[w] for w in workers]
        raise PlanError(
            f"plan.devices lists {len(self.devices)} device(s) but {how} gives {num_stages} stage(s) on "
            f"{num_workers} worker(s) of the schedule {describe_schedule(self.schedule)}; list one device per "
            f"stage or one per worker, e.g. devices={default_devices(num_workers)}"
        )
