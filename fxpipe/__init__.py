"""fxpipe: a torch.fx compiler for pipeline parallelism.

``fxpipe.compile(model, plan)`` traces the model, assigns every node a stage (from
``device_guard`` tags, split points or a cost model), cuts the graph with explicit
send/recv edges, emits one GraphModule per stage and runs them on a schedule: GPipe, 1F1B,
interleaved 1F1B, the zero-bubble ZB-H1 and ZB-V, or your own lists of ``fxpipe.Action``
(checked by ``fxpipe.check_schedule`` before anything runs).
"""

from fxpipe.compiler import CompileError, compile, partition
from fxpipe.devices import DeviceError
from fxpipe.distributed import DistributedPipeline, RankFailedError
from fxpipe.guard import device_guard
from fxpipe.microbatch import MicrobatchError
from fxpipe.partitioned import Partitioned
from fxpipe.passes.annotate import AnnotateError
from fxpipe.passes.traced import TraceError
from fxpipe.pipeline import Pipeline
from fxpipe.plan import DeviceSpec, Plan, PlanError
from fxpipe.profile import Profile, profile
from fxpipe.runtime.local import PipelineError
from fxpipe.schedules import Action, ScheduleError, check_schedule
from fxpipe.stage import Stage
from fxpipe.tune import tune

__all__ = [
    "Action",
    "AnnotateError",
    "CompileError",
    "DeviceError",
    "DeviceSpec",
    "DistributedPipeline",
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
    "partition",
    "profile",
    "tune",
]
