"""``DistributedPipeline``: the compiled model when each stage has its own process.

What ``fxpipe.compile`` returns under ``torchrun`` (or any world of more than one rank).
Every rank compiled the same plan; this one keeps only its own stages (rank r is worker
``r % workers`` of replica ``r // workers``, running stages ``w, w + workers, …``) and
the meta skeletons of the others (for shapes; no memory). ``step`` runs this rank's
action list of the shared schedule and returns the full-batch loss on every rank;
``pipe(x)`` returns the model's output on the ranks holding the last stage, None
elsewhere.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fxpipe import microbatch
from fxpipe.distributed import comm
from fxpipe.distributed.faults import RankFailedError, Watchdog, check_same_plan
from fxpipe.distributed.grads import GradAverager, TiedGrads, average_buffers
from fxpipe.distributed.layout import init_process_group, make_layout, make_mesh, rank_device
from fxpipe.distributed.materialize import Weights, materialize
from fxpipe.distributed.runtime import RankExecutor, RankStage
from fxpipe.distributed.specs import ValueSpec, derive_edge_specs, signature, skeleton
from fxpipe.partitioned import Partitioned
from fxpipe.placement import alias_groups, held_tensors, model_names
from fxpipe.plan import PlanError
from fxpipe.schedules import forward_only, make_schedule
from fxpipe.streams import move
from fxpipe.views import PipelineViews

_instances = itertools.count()


class DistributedPipeline(PipelineViews):
    """This rank's share of a pipeline. See ``fxpipe.compile`` and docs/distributed.md.

    Attributes: rank, world_size, layout (worker/replica of this rank), device,
    local_stages (indices of the stages this rank runs), stages (every Stage; other
    ranks' modules are meta skeletons), is_last (this rank holds the last stage).
    """

    def __init__(
        self,
        part: Partitioned,
        model: nn.Module,
        loss_fn: Any = None,
        weights: Weights = None,
        mutated_inputs: Sequence[frozenset[int]] | None = None,
    ) -> None:
        self.part = part
        self.plan = plan = part.plan
        self.loss_fn = loss_fn
        self.frontend = part.frontend
        num_stages = part.num_stages
        layout = make_layout(plan, num_stages)
        self.device = rank_device(part.stages[layout.my_stages[0]].device)
        init_process_group(self.device, plan.timeout)
        self.layout = layout = make_layout(plan, num_stages)
        self.rank, self.world_size = layout.rank, layout.world
        self.local_stages = layout.my_stages
        self.is_last = num_stages - 1 in self.local_stages

        store = dist.distributed_c10d._get_default_store()
        prefix = f"fxpipe/{next(_instances)}/"
        check_same_plan(store, prefix, layout.rank, layout.world, self._fingerprint_parts(), self._plan_summary(), plan.timeout)
        self.watchdog = Watchdog(store, prefix, layout.rank, layout.describe, lambda r: layout.stages_of(r % layout.workers)[0], plan.timeout)
        mesh = make_mesh(layout, self.device)
        self.mesh = mesh

        edges = part.partitioned.edges
        edge_ids = {id(e): k for k, e in enumerate(edges)}
        self._edge_ends = [(e.src, e.dst) for e in edges]
        self._recv = [[edge_ids[id(e)] for e in s.inputs] for s in part.stages]
        self._send = [[edge_ids[id(e)] for e in s.outputs] for s in part.stages]
        self._skeletons = [skeleton(s.module) for s in part.stages]

        aliases = alias_groups(model)
        modules = materialize({s: part.stages[s].module for s in self.local_stages}, self.device, weights, aliases)
        mutated = list(mutated_inputs) if mutated_inputs is not None else [frozenset()] * num_stages
        self._rank_stages = {
            s: RankStage(s, modules[s], self._recv[s], self._send[s], len(part.stages[s].model_inputs), s == num_stages - 1, mutated[s])
            for s in self.local_stages
        }
        self.stages = [
            dataclasses.replace(st, module=modules[st.index] if st.index in modules else self._skeletons[st.index])
            for st in part.stages
        ]
        self._params, self._state = self._names(model, aliases)
        self.executor = RankExecutor(
            self._rank_stages, self.device, layout.rank, layout.rank_of_stage, self._edge_ends, self.watchdog, fused=self.device.type == "cuda", checkpoint=plan.checkpoint, worker=layout.worker,
        )
        self._tied = TiedGrads(self._tied_groups(model, aliases), layout.rank, self.watchdog)
        self._averager = None
        self._dp_group = None
        self._float_buffers = [b for st in self.local_stages for b in modules[st].buffers() if b.is_floating_point()]
        if layout.replicas > 1:
            dp_group = self._dp_group = mesh.get_group("dp")
            self._broadcast_from_first_replica(dp_group)
            self._averager = GradAverager(
                {s: self._trainable(modules[s]) for s in self.local_stages}, dp_group, layout.replicas,
                layout.rank, self.watchdog,
            )
        self._barrier()
        self._schedules: dict[tuple[int, bool], list] = {}
        self._specs: dict[tuple, dict[int, ValueSpec]] = {}
        self._messages: dict[tuple, comm.ActionMessages] = {}
        self._last_events: list = []
        self.training = model.training

    # -------------------------------------------------------------- set-up
    def _fingerprint_parts(self) -> dict[str, str]:
        plan = self.plan
        fields = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)}
        parts = {"plan": repr(sorted(fields.items(), key=lambda kv: kv[0])), "layout": f"world {self.layout.world} workers {self.layout.workers} replicas {self.layout.replicas}"}
        for s in self.part.stages:
            tensors = [(n, tuple(t.shape), str(t.dtype)) for n, t in list(s.module.named_parameters()) + list(s.module.named_buffers())]
            edges = [(e.name, e.src, e.dst, e.description) for e in s.inputs + s.outputs]
            parts[f"stage {s.index}"] = f"{s.module.code}\n{tensors}\n{edges}"
        return parts

    def _plan_summary(self) -> str:
        p = self.plan
        return (
            f"{self.part.num_stages} stages, split={p.split!r}, schedule={p.schedule!r}, microbatches={p.microbatches}, "
            f"chunks={p.chunks}, data_parallel={p.data_parallel}, world={self.layout.world}"
        )

    def _names(self, model: nn.Module, aliases: dict[str, list[str]]) -> tuple[dict, dict]:
        held = held_tensors([self._rank_stages[s].module for s in self.local_stages], aliases)
        return model_names(model, held, aliases)

    @staticmethod
    def _trainable(module: nn.Module) -> list[nn.Parameter]:
        return [p for p in module.parameters() if p.requires_grad]

    def _tied_groups(self, model: nn.Module, aliases: dict[str, list[str]]) -> list:
        """Process groups for weights used by stages on different workers (created on every rank)."""
        holders: dict[str, set[int]] = {}
        for st in self.part.stages:
            for name, _ in st.module.named_parameters(remove_duplicate=False):
                holders.setdefault(aliases.get(name, [name])[0], set()).add(self.layout.worker_of(st.index))
        groups = []
        for name in sorted(holders):
            workers = sorted(holders[name])
            if len(workers) < 2:
                continue
            for replica in range(self.layout.replicas):
                ranks = [replica * self.layout.workers + w for w in workers]
                group = dist.new_group(ranks)
                if self.layout.rank in ranks and name in self._params:
                    groups.append(([self._params[name]], group))
                    dist.broadcast(self._params[name].data, src=ranks[0], group=group)
        return groups

    def _broadcast_from_first_replica(self, group: dist.ProcessGroup) -> None:
        src = dist.get_global_rank(group, 0)
        with torch.no_grad():
            for s in self.local_stages:
                module = self._rank_stages[s].module
                for t in list(module.parameters()) + list(module.buffers()):
                    dist.broadcast(t.data, src=src, group=group)

    def _barrier(self) -> None:
        """Every rank reached the end of set-up (also creates NCCL communicators eagerly)."""
        flag = torch.ones(1, device=self.device)
        work = dist.all_reduce(flag, async_op=True)
        self.watchdog.wait([(work, 0)], lambda: "the other ranks to finish setting up")

    # ------------------------------------------------------------- running
    def _actions(self, m: int, train: bool) -> list:
        """Every worker's action list for ``m`` micro-batches (forwards only for inference)."""
        if (m, train) not in self._schedules:
            actions = make_schedule(self.plan.schedule, self.part.num_stages, m, self.plan.chunks)
            self._schedules[(m, train)] = actions if train else forward_only(actions)
        return self._schedules[(m, train)]

    def _split(self, args: tuple, kwargs: dict, target: Any) -> tuple[list, list, list[int], int]:
        """This replica's micro-batches: (inputs, targets, sizes, global batch size)."""
        values = (self.part.bind_inputs(args, kwargs), target)
        total = microbatch.batch_size(values) or 1
        if self.layout.replicas > 1:
            shards, _ = microbatch.split(values, self.layout.replicas)
            values = shards[self.layout.replica]
        pieces, sizes = microbatch.split(values, self.plan.microbatches)
        return [p[0] for p in pieces], [p[1] for p in pieces], sizes, total

    def _edge_specs(self, inputs: list[list], train: bool) -> tuple[list[dict[int, ValueSpec]], tuple]:
        modes = tuple(m.training for m in self._skeletons)
        keys = []
        for flat in inputs:
            key = (signature(flat), train, modes)
            if key not in self._specs:
                self._specs[key] = derive_edge_specs(self._skeletons, self._recv, self._send, flat, train)
            keys.append(key)
        return [self._specs[k] for k in keys], tuple(keys)

    def _run(self, inputs: list[list], train: bool, loss_of: Any = None) -> Any:
        specs, key = self._edge_specs(inputs, train)
        actions = self._actions(len(inputs), train)
        spec = lambda e, i: specs[i][e]  # noqa: E731
        if key not in self._messages:  # key holds ``train`` already
            self._messages[key] = self._plan_messages(actions, spec)
        on_done = self._averager.start if (train and self._averager is not None) else None
        return self.executor.run(actions[self.layout.worker], self._messages[key], inputs, spec, train, loss_of, on_done)

    def _plan_messages(self, actions: list, spec: Any) -> comm.ActionMessages:
        """This rank's messages; on NCCL, every rank's, put in an order proven not to hang."""
        first = self.layout.replica * self.layout.workers
        ranks = range(first, first + self.layout.workers) if self.executor.fused else [self.layout.rank]
        plans = {
            r: comm.messages_for(actions[r - first], self._recv, self._send, self._edge_ends, self.layout.rank_of_stage, r, spec)
            for r in ranks
        }
        if not self.executor.fused:
            return plans[self.layout.rank]
        try:
            return comm.nccl_plans(plans)[self.layout.rank]
        except comm.CommPlanError as err:
            raise PlanError(f"plan.schedule={self.plan.schedule!r} cannot run on NCCL: {err}") from err

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Forward over micro-batches. Returns the model's output on the ranks holding the
        last stage (this replica's shard of the batch under data parallelism), None elsewhere."""
        inputs, _, _, _ = self._split(args, kwargs, None)
        result = self._run(inputs, train=False)
        self._last_events = result.events
        if not self.is_last:
            return None
        return self.part.build_output(microbatch.merge([result.outputs[i] for i in range(len(inputs))]))

    forward = __call__

    def step(self, *args: Any, target: Any = None, loss_fn: Any = None, **kwargs: Any) -> torch.Tensor:
        """One training step on the schedule; returns the full-batch loss on every rank.

        Every rank passes the same whole batch (and target); with ``data_parallel`` each
        replica takes its own shard. Each local parameter's ``.grad`` accumulates what
        eager ``loss_fn(model(x), t).backward()`` gives it (averaged over replicas, once
        per step). Raises RankFailedError naming the rank and stage that failed.
        """
        loss_fn = loss_fn or self.loss_fn
        inputs, targets, sizes, total = self._split(args, kwargs, target)
        weights = microbatch.loss_weights(sizes, loss_fn, total=total, scale=self.layout.replicas)
        loss_of = None
        if self.is_last:  # the target goes where the last stage's output is
            targets = [move(tg, self.device, detach=True) for tg in targets]
            loss_of = microbatch.weighted_loss(loss_fn, self.part.build_output, targets, weights)
        self._tied.before_step()
        result = self._run(inputs, train=True, loss_of=loss_of)
        if self._averager is not None:
            self._averager.finish()
            with torch.no_grad():
                average_buffers(self._float_buffers, self._dp_group, self.layout.replicas, self.layout.rank, self.watchdog)
        self._tied.after_step()
        self._last_events = result.events
        loss = torch.zeros((), device=self.device)
        if self.is_last:
            loss = torch.stack([result.losses[i] for i in sorted(result.losses)]).sum().to(self.device) / self.layout.replicas
        work = dist.all_reduce(loss, async_op=True)
        self.watchdog.wait([(work, self.layout.rank_of_stage(self.part.num_stages - 1))], lambda: "the loss")
        return loss

    # ------------------------------------------------------ module-like API
    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under the model's names; a tied weight once, first name."""
        yield from self._params.items()

    def state_dict(self) -> OrderedDict[str, torch.Tensor]:
        """The model's state_dict keys held by this rank (tied weights under every name)."""
        return OrderedDict((k, v.detach()) for k, v in self._state.items())

    def load_state_dict(self, state: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Load this rank's keys from a full or partial state dict (others' keys are ignored).

        Raises KeyError, with ``strict``, when a key this rank holds is missing.
        """
        missing = [k for k in self._state if k not in state]
        if strict and missing:
            raise KeyError(f"load_state_dict: rank {self.rank} holds keys the state dict lacks: {missing[:5]}")
        with torch.no_grad():
            for key, tensor in self._state.items():
                if key in state:
                    tensor.copy_(state[key].to(tensor.device))

    def zero_grad(self, set_to_none: bool = True) -> None:
        for s in self.local_stages:
            self._rank_stages[s].module.zero_grad(set_to_none=set_to_none)

    def train(self, mode: bool = True) -> DistributedPipeline:
        self.training = mode
        for s in self.local_stages:
            self._rank_stages[s].module.train(mode)
        for sk in self._skeletons:
            sk.train(mode)
        return self

    @property
    def num_workers(self) -> int:
        return self.layout.workers

    def __repr__(self) -> str:
        return (
            f"DistributedPipeline(rank {self.rank}/{self.world_size}, stages {self.local_stages} on {self.device}, "
            f"schedule={self.plan.schedule!r}, replicas={self.layout.replicas})"
        )


__all__ = ["DistributedPipeline", "RankFailedError"]
