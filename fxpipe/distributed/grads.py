"""Gradient reductions across ranks, once per step.

- **Data parallelism.** Each replica's loss is weighted so that averaging its gradients
  over replicas gives the full-batch gradient. As soon as a stage finishes its last
  backward of the step, its gradients are flattened into buckets and all-reduced
  asynchronously along the mesh's ``"dp"`` dimension, overlapping the rest of the
  schedule; :meth:`GradAverager.finish` waits and writes the averages back.
- **Buffers.** Floating-point buffers (BatchNorm running statistics) are averaged over
  the replicas after every training step, so replicas never drift apart in eval mode.
- **Weights tied across ranks** (an embedding and an LM head on different stages): every
  holder keeps a copy; after the step the copies' new gradients are summed within the
  replica, so each copy gets what eager sums, and identical updates keep them equal.
  Sharded (``plan.fsdp``), every holder's copy is split alike over the replicas, so the
  holders sum their shards.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from fxpipe.distributed.faults import Watchdog
from fxpipe.distributed.fsdp import local

BUCKET_BYTES = 25 * 2**20


def _buckets(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    buckets: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if not buckets or size + nbytes > BUCKET_BYTES or p.dtype != buckets[-1][0].dtype:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return buckets


def _grads(params: list[nn.Parameter]) -> list[torch.Tensor]:
    return [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]


class GradAverager:
    """Averages gradients over ``group`` (the replicas), stage by stage, once per step.

    stage_params: this rank's trainable parameters per stage (shared ones listed once).
    """

    def __init__(self, stage_params: dict[int, list[nn.Parameter]], group: dist.ProcessGroup, size: int, watchdog: Watchdog) -> None:
        self.buckets = {s: _buckets(params) for s, params in stage_params.items()}
        self.group = group
        self.size = size
        self.watchdog = watchdog
        self.pending: list[tuple[dist.Work, torch.Tensor, list[nn.Parameter]]] = []

    def reduce(self, stage: int) -> None:
        """Launch the all-reduce of ``stage``'s gradients (after its last backward)."""
        for bucket in self.buckets.get(stage, []):
            flat = _flatten_dense_tensors(_grads(bucket))
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            self.pending.append((work, flat, bucket))

    def finish(self) -> None:
        """Wait for every launched reduction and write the averages into ``.grad``."""
        pending, self.pending = self.pending, []
        self.watchdog.wait([(work, None) for work, _, _ in pending], lambda: "the data-parallel gradient all-reduce", peers=dist.get_process_group_ranks(self.group))
        for _, flat, bucket in pending:
            flat.div_(self.size)
            for p, g in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)


def average_buffers(buffers: list[torch.Tensor], group: dist.ProcessGroup, size: int, watchdog: Watchdog) -> None:
    """Average floating-point buffers (BatchNorm running statistics) over the replicas, so
    every replica evaluates alike, as one model trained on the whole batch would."""
    if not buffers:
        return
    flat = _flatten_dense_tensors(buffers)
    work = dist.all_reduce(flat, group=group, async_op=True)
    watchdog.wait([(work, None)], lambda: "the buffer all-reduce", peers=dist.get_process_group_ranks(group))
    flat.div_(size)
    for buffer, value in zip(buffers, _unflatten_dense_tensors(flat, buffers)):
        buffer.copy_(value)


class TiedGrads:
    """Sums the gradients of weights held by several ranks of a replica.

    groups: (this rank's copies of one tied weight, process group of its holders).
    """

    def __init__(self, groups: list[tuple[list[nn.Parameter], dist.ProcessGroup]], watchdog: Watchdog) -> None:
        self.groups = groups
        self.watchdog = watchdog
        self.stash: dict[int, torch.Tensor | None] = {}

    def before_step(self) -> None:
        """Set aside gradients accumulated by earlier steps (they are already summed)."""
        for params, _ in self.groups:
            for p in params:
                self.stash[id(p)] = p.grad
                p.grad = None

    def after_step(self) -> None:
        """Sum this step's gradients over the holders and add back what was set aside."""
        works, peers = [], set()
        for params, group in self.groups:
            peers.update(dist.get_process_group_ranks(group))
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                works.append((dist.all_reduce(local(p.grad), group=group, async_op=True), None))  # a shard each, alike
        self.watchdog.wait(works, lambda: "the tied-weight gradient all-reduce", peers=sorted(peers))
        for params, _ in self.groups:
            for p in params:
                stashed = self.stash.pop(id(p), None)
                if stashed is not None:
                    p.grad.add_(stashed)
