"""fxpipe: a torch.fx compiler for pipeline parallelism.

``fxpipe.compile(model, plan)`` traces the model, assigns every node a stage (from
``device_guard`` tags, split points or a cost model), cuts the graph with explicit
send/recv edges, emits one GraphModule per stage and runs them on a schedule: GPipe, 1F1B,
interleaved 1F1B, the zero-bubble ZB-H1 and ZB-V, the memory-controlled V-Half and V-Min,
or your own lists of ``fxpipe.Action`` (checked by ``fxpipe.check_schedule`` before anything
runs). ``pipe.memory()`` reports each stage's memory, measured against its prediction.
"""

from typing import Any

from fxpipe.batching.microbatch import LossFunctionError, MicrobatchError
from fxpipe.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from fxpipe.compiler.driver import CompileError, partition
from fxpipe.compiler.partitioned import Partitioned
from fxpipe.compiler.stage import Stage
from fxpipe.devices import DeviceError
from fxpipe.factory import compile
from fxpipe.guard import device_guard
from fxpipe.inspection.memory_report import MemoryReport
from fxpipe.passes.annotate import AnnotateError
from fxpipe.passes.traced import TraceError
from fxpipe.plan import DeviceSpec, Plan, PlanError
from fxpipe.planner.profile import Profile, profile
from fxpipe.runtime.inputs import InputError
from fxpipe.runtime.local import PipelineError
from fxpipe.runtime.local_pipeline import Pipeline
from fxpipe.schedules import Action, ScheduleError, check_schedule
from fxpipe.tune import tune

# fxpipe.distributed loads when one of its names is first asked for (or a compile runs)
_DISTRIBUTED = {"DistributedPipeline": "fxpipe.distributed.rank_pipeline", "RankFailedError": "fxpipe.distributed.faults"}


def __getattr__(name: str) -> Any:
    if name in _DISTRIBUTED:
        import importlib

        return getattr(importlib.import_module(_DISTRIBUTED[name]), name)
    raise AttributeError(f"module 'fxpipe' has no attribute {name!r}")


__all__ = [
    "Action",
    "AnnotateError",
    "CheckpointError",
    "CompileError",
    "DeviceError",
    "DeviceSpec",
    "DistributedPipeline",
    "InputError",
    "LossFunctionError",
    "MemoryReport",
    "MicrobatchError",
    "Partitioned",
    "Pipeline",
    "PipelineError",
    "Plan",
    "PlanError",
    "RankFailedError",
    "Profile",
    "ScheduleError",
    "Stage",
    "TraceError",
    "check_schedule",
    "compile",
    "device_guard",
    "load_checkpoint",
    "partition",
    "profile",
    "save_checkpoint",
    "tune",
]
