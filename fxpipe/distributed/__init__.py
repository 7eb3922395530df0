"""fxpipe on torch.distributed: one process per pipeline worker, replicas for data parallelism.

``fxpipe.compile`` returns a :class:`DistributedPipeline` when the process is one of a
torchrun world (``WORLD_SIZE`` > 1). ``launch(fn, nprocs)`` starts such a world locally.
The runtime interprets the same action lists as the local executor, without importing
it or any compiler pass. See docs/distributed.md.
"""

from fxpipe.distributed.faults import PlanMismatchError, RankFailedError
from fxpipe.distributed.launch import LaunchError, launch
from fxpipe.distributed.layout import requested
from fxpipe.distributed.materialize import MaterializeError
from fxpipe.distributed.pipeline import DistributedPipeline
from fxpipe.distributed.specs import SignatureError

__all__ = [
    "DistributedPipeline",
    "LaunchError",
    "MaterializeError",
    "PlanMismatchError",
    "RankFailedError",
    "SignatureError",
    "launch",
    "requested",
]
