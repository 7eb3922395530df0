"""fxpipe on torch.distributed: one process per pipeline worker, replicas for data parallelism.

``fxpipe.compile`` returns a :class:`DistributedPipeline` when the process is one of a
torchrun world (``WORLD_SIZE`` > 1). ``launch(fn, nprocs)`` starts such a world locally.
The runtime interprets the same action lists as the local executor, without importing
it or any compiler pass. See docs/distributed.md.

The launcher loads with the package (``launch`` is also its module's name); the other
names load with the module that defines them, on first use, so importing one module of the
package (``fxpipe.distributed.layout``) does not load the runtime.
"""

from __future__ import annotations

import importlib
from typing import Any

from fxpipe.distributed.launch import LaunchError, launch

_WHERE = {
    "DistributedPipeline": "rank_pipeline",
    "MaterializeError": "materialize",
    "PlanMismatchError": "faults",
    "RankFailedError": "faults",
    "SignatureError": "specs",
    "requested": "layout",
}

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


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"fxpipe.distributed.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'fxpipe.distributed' has no attribute {name!r}")
