"""Which rank runs what: pipeline workers × data-parallel replicas on a device mesh.

The world is a ``(data_parallel, workers)`` mesh: rank ``r`` is worker ``r % workers``
of replica ``r // workers``. Worker ``w`` runs the stages the schedule puts on it (one
stage for GPipe and 1F1B; ``w, w + workers, …`` interleaved; ``w`` and ``2·workers−1−w``
for ZB-V; anything for a custom schedule). Activations and gradients move along the mesh's
``"pp"`` dimension with point-to-point ops; gradients are averaged along ``"dp"``.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fxpipe.devices import torch_device
from fxpipe.plan import Plan, PlanError


def requested() -> bool:
    """True when this process is one of several: torch.distributed is initialised with
    more than one rank, or ``WORLD_SIZE`` (set by torchrun and fxpipe's launcher) is > 1."""
    if not dist.is_available():
        return False
    if dist.is_initialized():
        return dist.get_world_size() > 1
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


@dataclass(frozen=True)
class Layout:
    """rank/world of this process, ``workers`` per pipeline, ``replicas`` pipelines."""

    rank: int
    world: int
    workers: int
    replicas: int
    stage_workers: tuple[int, ...]  # the worker of every stage, from the schedule

    @property
    def num_stages(self) -> int:
        return len(self.stage_workers)

    @property
    def worker(self) -> int:
        return self.rank % self.workers

    @property
    def replica(self) -> int:
        return self.rank // self.workers

    def worker_of(self, stage: int) -> int:
        return self.stage_workers[stage]

    def rank_of_stage(self, stage: int) -> int:
        """The rank running ``stage`` in this process's replica."""
        return self.replica * self.workers + self.worker_of(stage)

    def stages_of(self, worker: int) -> list[int]:
        return [s for s, w in enumerate(self.stage_workers) if w == worker]

    @property
    def my_stages(self) -> list[int]:
        return self.stages_of(self.worker)

    def describe(self, rank: int, stage: int | None = None) -> str:
        """``rank``'s stage (``stage`` when given, else all of its stages) and replica."""
        stages = [stage] if stage is not None else self.stages_of(rank % self.workers)
        where = f"stage {stages[0]}" if len(stages) == 1 else f"stages {', '.join(map(str, stages))}"
        return where + (f" of replica {rank // self.workers}" if self.replicas > 1 else "")


def make_layout(plan: Plan, stage_workers: list[int]) -> Layout:
    """The layout for this process, given the worker of every stage (the schedule's
    placement). Raises PlanError when the world size does not fit."""
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    workers = max(stage_workers) + 1
    if workers * plan.data_parallel != world:
        raise PlanError(
            f"the plan needs {workers} pipeline worker(s) × data_parallel={plan.data_parallel} = "
            f"{workers * plan.data_parallel} processes, but the world has {world}; launch "
            f"{workers * plan.data_parallel} processes (torchrun --nproc-per-node "
            f"{workers * plan.data_parallel}) or change plan.split / plan.chunks / plan.data_parallel"
        )
    return Layout(rank, world, workers, plan.data_parallel, tuple(stage_workers))


def rank_device(stage_device: str) -> torch.device:
    """The torch device this rank computes on, from its stage's device in the plan.

    CPU stages run on the host. A CUDA stage runs on ``cuda:LOCAL_RANK`` when torchrun
    (or the launcher) set ``LOCAL_RANK``: one GPU per process, so replicas on one node do
    not collide; otherwise on the plan's own index.
    """
    device = torch_device(stage_device)
    if device.type != "cuda":
        return device
    local = os.environ.get("LOCAL_RANK")
    count = torch.cuda.device_count()
    index = int(local) % count if local is not None and count else device.index or 0
    return torch.device("cuda", index)


def init_process_group(device: torch.device, timeout: float, store: dist.Store, rank: int, world: int) -> None:
    """Initialise the default process group unless the script did: nccl for CUDA, gloo for
    CPU, on ``store`` (the job's store fxpipe joined, under the key prefix torch's env://
    rendezvous uses). Every rank must be alive and calling it: it connects every pair.

    The backend's own timeout is a backstop behind fxpipe's watchdog, at twice ``timeout``
    plus a minute: it counts from when an op is posted (receives go out one action ahead),
    so at ``timeout`` itself it would cut short waits that the watchdog allows and fail
    before the watchdog names the culprit.

    Raises PlanError when the script's group cannot move this device's tensors.
    """
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend, store=dist.PrefixStore("default_pg", store), rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=2 * timeout + 60),
        )
        return
    backend = str(dist.get_backend())
    if device.type == "cuda" and "nccl" not in backend:
        raise PlanError(f"stages on {device} need the nccl backend, but the process group uses {backend!r}")
    if device.type == "cpu" and "gloo" not in backend:
        raise PlanError(f"stages on the CPU need the gloo backend, but the process group uses {backend!r}")


def make_mesh(layout: Layout, device: torch.device):
    """The ``(dp, pp)`` DeviceMesh over the world (a collective: every rank calls it)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (layout.replicas, layout.workers), mesh_dim_names=("dp", "pp"))
