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

import contextlib
import dataclasses
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from fxpipe.batching.loss_scale import StepCounts
from fxpipe.batching.microbatch import signature
from fxpipe.distributed import comm, startup
from fxpipe.distributed import gathered_timeline as gathered
from fxpipe.distributed.executor import RankExecutor
from fxpipe.distributed.faults import RankFailedError, Watchdog
from fxpipe.distributed.fsdp import (
    ShardedStages,
    full,
    hand_to_model,
    load_into,
    local,
    reshard_choice,
    untie,
)
from fxpipe.distributed.grads import GradAverager, TiedGrads, average_buffers
from fxpipe.distributed.layout import init_process_group, make_layout, make_mesh, rank_device
from fxpipe.distributed.materialize import Weights, materialize
from fxpipe.distributed.specs import ValueSpec, derive_edge_specs, fake_extras
from fxpipe.inspection.timeline import Timeline
from fxpipe.plan import PlanScheduleError
from fxpipe.runtime.context import StepContext
from fxpipe.runtime.interpret import Step, after_last_backward
from fxpipe.runtime.pipeline_base import Batch, Compiler, PipelineBase, Program
from fxpipe.runtime.placement import TiedGroup, alias_groups, held_tensors, model_names, skeleton
from fxpipe.runtime.runner import make_runner
from fxpipe.runtime.streams import move
from fxpipe.schedules import describe_schedule

if TYPE_CHECKING:
    from fxpipe.compiler.partitioned import Partitioned


@dataclass
class RankProgram(Program):
    """A Program with what this rank derives per micro-batch signature: specs (edge shapes
    and dtypes, by signature key) and messages (this rank's comm plan, by the same key);
    skeletons: meta copies of every stage, for the fake runs that derive the specs."""

    specs: dict = field(default_factory=dict)
    messages: dict = field(default_factory=dict)
    skeletons: list = field(default_factory=list)

    def train(self, mode: bool) -> None:
        super().train(mode)
        for sk in self.skeletons:
            sk.train(mode)


class DistributedPipeline(PipelineBase):
    """This rank's share of a pipeline. See ``fxpipe.compile`` and docs/distributed.md.

    Attributes: rank, world_size, layout (worker/replica of this rank), device,
    local_stages (indices of the stages this rank runs), stages (every Stage; other
    ranks' modules are meta skeletons), is_last (this rank holds the last stage).
    """

    def __init__(
        self,
        part: Partitioned,
        model: nn.Module,
        compiler: Compiler,
        loss_fn: Any = None,
        weights: Weights = None,
        watchdog: Watchdog | None = None,
    ) -> None:
        plan = part.plan
        self.watchdog = watchdog if watchdog is not None else startup.join(plan.timeout)
        self._calls = 0  # calls run, numbering the timelines left in the store
        with startup.failures_recorded(self.watchdog):
            self.layout = layout = make_layout(plan, part.stage_workers)
            self.watchdog.assign(layout.describe, lambda r: layout.stages_of(r % layout.workers)[0])
            self.device = rank_device(part.stages[layout.my_stages[0]].device)
            self.watchdog.running("loading its stages' weights")
            aliases = alias_groups(model)
            traced_as = skeleton(model)  # the fake runs put their tensors where the model's were when traced
            modules = materialize({s: part.stages[s].module for s in layout.my_stages}, self.device, weights, aliases, own=not plan.fsdp)
            startup.check_same_plan(self.watchdog, startup.plan_parts(part, layout), startup.plan_summary(part, layout))
        # every rank compiled the same plan and holds its stages: connect them
        try:
            self._connect(part, model, traced_as, compiler, loss_fn, modules, aliases)
        except RankFailedError:
            raise
        except Exception as err:  # a peer that died during set-up breaks the collectives
            raise self.watchdog.lost(err, [r for r in range(layout.world) if r != layout.rank]) from err

    def _connect(
        self,
        part: Partitioned,
        model: nn.Module,
        traced_as: nn.Module,
        compiler: Compiler,
        loss_fn: Any,
        modules: dict[int, nn.Module],
        aliases: dict[str, list[str]],
    ) -> None:
        """Set-up across ranks: the process group, the mesh, tied weights, replicas' weights."""
        plan, layout = part.plan, self.layout
        num_stages = part.num_stages
        self.watchdog.running("connecting to the other ranks")
        init_process_group(self.device, plan.timeout, self.watchdog.store, layout.rank, layout.world)
        self.rank, self.world_size = layout.rank, layout.world
        self.replicas, self.replica = layout.replicas, layout.replica
        self.local_stages = layout.my_stages
        self.is_last = num_stages - 1 in self.local_stages
        self.mesh = make_mesh(layout, self.device)
        if plan.fsdp:
            modules = untie(modules)  # one FSDP unit per stage: no parameter in two

        self._skeletons = [skeleton(s.module) for s in part.stages]

        runners = {s: make_runner(part.stages[s], modules[s], self.device, num_stages, plan) for s in self.local_stages}
        self.stages = [
            dataclasses.replace(st, module=modules[st.index] if st.index in modules else self._skeletons[st.index])
            for st in part.stages
        ]
        self._setup(dataclasses.replace(part, stages=self.stages), loss_fn, traced_as, compiler, model)
        self._modules = [modules[s] for s in self.local_stages]
        self._params, self._state = model_names(model, held_tensors(self._modules, aliases), aliases)
        self._partial_state = True
        self.executor = RankExecutor(self.device, layout.rank, layout.rank_of_stage, self.watchdog, fused=self.device.type == "cuda", worker=layout.worker)
        self._first_program(RankProgram(self.part, runners, skeletons=self._skeletons))
        tied = self._tied_groups(aliases)
        self._averager: GradAverager | None = None
        self._sharded: ShardedStages | None = None
        self._dp_group = self.mesh.get_group("dp")
        if layout.replicas > 1:
            self._broadcast_from_first_replica(self._dp_group)
        if plan.fsdp:
            self._shard(part, model, aliases)
        elif layout.replicas > 1:
            self._averager = GradAverager({s: self._trainable(modules[s]) for s in self.local_stages}, self._dp_group, layout.replicas, self.watchdog)
        self._tied = TiedGrads([([self._params[name]], group) for name, group in tied], self.watchdog)
        self._float_buffers = [b for m in self._modules for b in m.buffers() if b.is_floating_point()]
        self._barrier()

    def _shard(self, part: Partitioned, model: nn.Module, aliases: dict[str, list[str]]) -> None:
        """Each of this rank's stages made an FSDP unit over its replicas (``plan.fsdp``):
        the model's names then lead to the sharded parameters, which the model itself then
        holds (:func:`~fxpipe.distributed.fsdp.hand_to_model`)."""
        reshard = self._agreed(reshard_choice(part, self.local_stages, self.layout.replicas))
        peers = [r for r in dist.get_process_group_ranks(self._dp_group) if r != self.rank]
        collective = lambda what, stage: self.watchdog.collective(what, peers, stage)  # noqa: E731
        self._sharded = ShardedStages(dict(zip(self.local_stages, self._modules)), self.mesh["dp"], reshard, collective)
        held = held_tensors(self._modules, aliases)
        self._params, self._state = model_names(model, held, aliases)
        self._sharded.tied = [TiedGroup(name, ts[0], ts[1:]) for name, ts in held.items() if len(ts) > 1]
        hand_to_model(model, self._params, aliases)

    def _agreed(self, reshard: dict[int, bool]) -> dict[int, bool]:
        """``reshard`` as every replica of this rank's stages has it (a stage frees its
        parameters if any replica's estimate says so: hosts may differ in memory), so that
        their all-gathers pair up."""
        flags = torch.tensor([reshard[s] for s in self.local_stages], dtype=torch.int32, device=self.device)
        work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._dp_group, async_op=True)
        self.watchdog.wait([(work, None)], lambda: "the replicas' choice of freeing parameters", peers=dist.get_process_group_ranks(self._dp_group))
        return {s: bool(f) for s, f in zip(self.local_stages, flags.tolist())}

    # -------------------------------------------------------------- set-up
    @staticmethod
    def _trainable(module: nn.Module) -> list[nn.Parameter]:
        return [p for p in module.parameters() if p.requires_grad]

    def _tied_groups(self, aliases: dict[str, list[str]]) -> list[tuple[str, dist.ProcessGroup]]:
        """(name, process group of its holders) for the weights this rank holds that stages
        on other workers use too; their copies start equal (every rank creates the groups)."""
        holders: dict[str, set[int]] = {}
        for st in self.part.stages:
            for name, _ in st.module.named_parameters(remove_duplicate=False):
                holders.setdefault(aliases.get(name, [name])[0], set()).add(self.layout.worker_of(st.index))
        groups = []
        self._norm_skip: set[str] = set()  # tied weights another worker counts in the global norm
        for name in sorted(holders):
            workers = sorted(holders[name])
            if len(workers) < 2:
                continue
            if self.layout.worker != workers[0]:
                self._norm_skip.add(name)
            for replica in range(self.layout.replicas):
                ranks = [replica * self.layout.workers + w for w in workers]
                group = dist.new_group(ranks)
                if self.layout.rank in ranks and name in self._params:
                    groups.append((name, group))
                    dist.broadcast(self._params[name].data, src=ranks[0], group=group)
        return groups

    def _broadcast_from_first_replica(self, group: dist.ProcessGroup) -> None:
        src = dist.get_global_rank(group, 0)
        with torch.no_grad():
            for module in self._modules:
                for t in list(module.parameters()) + list(module.buffers()):
                    dist.broadcast(t.data, src=src, group=group)

    def _barrier(self) -> None:
        """Every rank reached the end of set-up (also creates NCCL communicators eagerly)."""
        flag = torch.ones(1, device=self.device)
        work = dist.all_reduce(flag, async_op=True)
        self.watchdog.wait([(work, None)], lambda: "the other ranks to finish setting up", peers=range(self.world_size))

    # ------------------------------------------------------------- running
    def _compile_program(self, args: tuple, kwargs: dict) -> Program:
        """Another input signature's stages: this rank's share the materialized parameters;
        the others are meta skeletons, for shapes. Every rank traces the same call alike."""
        local = [self._programs_first().runners[s].module for s in self.local_stages]

        def roots_for(stage: int) -> list[nn.Module]:
            return local if stage in self.local_stages else [self._model]

        with startup.failures_recorded(self.watchdog):  # the other ranks, already waiting, name this one
            self.watchdog.running("compiling a new input signature")
            # sharded, the new stages take the gathered parameters, the ones every action runs with
            with self._sharded.gathered() if self._sharded is not None else contextlib.nullcontext():
                part = self._compiler.retrace(self.part, self._model, args, kwargs, roots_for)
        runners = {s: make_runner(part.stages[s], part.stages[s].module, self.device, part.num_stages, self.plan) for s in self.local_stages}
        skeletons = [skeleton(st.module) for st in part.stages]
        return RankProgram(part, runners, skeletons=skeletons)

    def _programs_first(self) -> RankProgram:
        return next(iter(self._programs.values()))

    def _edge_specs(self, batch: Batch, ctx: StepContext) -> tuple[list[dict[int, ValueSpec]], tuple]:
        """Each micro-batch's edge specs, derived once per input signature (shapes and
        dtypes of the inputs, train or not, the stages' modes and the caller's autocast)
        on its own program's skeletons, and the step's key: every micro-batch's."""
        keys = []
        for program, flat in zip(batch.programs, batch.inputs):
            modes = tuple(m.training for m in program.skeletons)
            key = (signature(flat), ctx.train, modes, ctx.autocast)
            if key not in program.specs:
                stages = program.part.stages
                program.specs[key] = derive_edge_specs(
                    program.skeletons, [st.recv_ids for st in stages], [st.send_ids for st in stages], flat, ctx.train,
                    ctx.autocast, [fake_extras(st) for st in stages], replay=self._compiler.fake_replay(),
                )
            keys.append(key)
        return [p.specs[k] for p, k in zip(batch.programs, keys)], tuple(keys)

    def _execute(self, batch: Batch, ctx: StepContext) -> None:
        program = batch.program
        actions = program.part.actions(len(batch.inputs), ctx.train)
        with startup.failures_recorded(self.watchdog):  # a value that cannot travel: the other ranks name this one
            self.watchdog.running("deriving the step's edge shapes")
            specs, key = self._edge_specs(batch, ctx)
            spec = lambda e, i: specs[i][e]  # noqa: E731
            if key not in program.messages:  # key holds ``train`` already
                if len(program.messages) >= _MESSAGE_PLANS:  # listed steps of ever new lengths: keep the latest
                    program.messages.pop(next(iter(program.messages)))
                program.messages[key] = self._plan_messages(program, actions, spec)
        mine = actions[self.layout.worker]
        hooks = list(self.action_hooks)
        if self._sharded is not None:  # gathers and frees the shards around each action
            self._sharded.begin_call()
            hooks.append(self._sharded)
        reducer = self._sharded or self._averager
        if ctx.train and reducer is not None:  # a stage's gradients are reduced as soon as they are complete
            hooks.append(after_last_backward(mine, reducer.reduce))
        if ctx.train:
            self._tied.before_step()
        runners = batch.microbatch_runners()
        # the events' time zero and the wall-clock time that lines the ranks up, read together
        # (a gap between them, a few ms on a loaded machine, would shift this rank's events)
        origin, self._step_started = time.perf_counter(), time.time()
        step = Step(ctx, batch.inputs, program.runners, program.part.edge_ends, hooks, microbatch_runners=runners, origin=origin)
        self._last_events = self.executor.run(mine, program.messages[key], spec, step)
        if self._sharded is not None:
            self._sharded.end_call()
        self._calls += 1
        gathered.publish(self.watchdog, self._calls, self._last_events, self._step_started, str(self.device))
        if ctx.train:
            self._after_step()

    def _after_step(self) -> None:
        """What a training step ends with: the replicas' gradient reductions finished, their
        buffers averaged, tied weights' gradients summed over their holders."""
        if self._sharded is not None:
            self._sharded.end_step()
        if self._averager is not None:
            self._averager.finish()
        if self.layout.replicas > 1:
            with torch.no_grad():
                average_buffers(self._float_buffers, self._dp_group, self.layout.replicas, self.watchdog)
        self._tied.after_step()

    def _plan_messages(self, program: RankProgram, actions: list, spec: Any) -> comm.ActionMessages:
        """This rank's messages; on NCCL, every rank's, put in an order proven not to hang."""
        first = self.layout.replica * self.layout.workers
        ranks = range(first, first + self.layout.workers) if self.executor.fused else [self.layout.rank]
        stages = program.part.stages
        recv, send = [st.recv_ids for st in stages], [st.send_ids for st in stages]
        plans = {
            r: comm.messages_for(actions[r - first], recv, send, program.part.edge_ends, self.layout.rank_of_stage, r, spec)
            for r in ranks
        }
        if not self.executor.fused:
            return plans[self.layout.rank]
        try:
            return comm.nccl_plans(plans)[self.layout.rank]
        except comm.CommPlanError as err:
            raise PlanScheduleError(f"plan.schedule={describe_schedule(self.plan.schedule)} cannot run on NCCL: {err}") from err

    def _holds_last(self) -> bool:
        return self.is_last

    def _loss_function(self, loss_fn: Any, batch: Batch, counts: Any) -> Any:
        if not self.is_last:
            return None
        batch.targets = [move(t, self.device, detach=True) for t in batch.targets]  # the target goes where the last stage's output is
        return super()._loss_function(loss_fn, batch, counts)

    def _over_replicas(self, total: int, counts: StepCounts | None) -> tuple[int, StepCounts | None]:
        """A listed step's samples and counts over every replica, from this one's: the ranks
        holding the last stage (one per replica, one data-parallel group) gather each
        replica's (samples, counted or not, calls), then add the counts when every replica
        counted the same calls (otherwise every replica weights per sample: None)."""
        if self.replicas == 1:
            return total, counts
        group = self._dp_group
        mine = torch.tensor([total, counts is not None, len(counts.counts) if counts else 0], dtype=torch.float64, device=self.device)
        everyone = [torch.empty_like(mine) for _ in range(self.replicas)]
        work = dist.all_gather(everyone, mine, group=group, async_op=True)
        self.watchdog.wait([(work, None)], lambda: "every replica's micro-batch counts", peers=range(self.world_size))
        total = int(sum(float(g[0]) for g in everyone))
        calls = {int(g[2]) for g in everyone}
        if counts is None or not all(bool(g[1]) for g in everyone) or len(calls) != 1:
            return total, None
        added = torch.tensor(counts.counts, dtype=torch.float64, device=self.device)
        work = dist.all_reduce(added, group=group, async_op=True)
        self.watchdog.wait([(work, None)], lambda: "every replica's micro-batch counts", peers=range(self.world_size))
        return total, StepCounts(counts.reductions, added.tolist(), total)

    def _output(self, batch: Batch, ctx: StepContext) -> Any:
        """The model's output on the ranks holding the last stage (this replica's shard of
        the batch under data parallelism), None elsewhere."""
        if not self.is_last:
            return None
        return self._merged(batch, [ctx.outputs[i] for i in range(len(batch.inputs))])

    def _step_loss(self, ctx: StepContext) -> torch.Tensor:
        """The full-batch loss on every rank, in the loss's own dtype: the ranks holding the
        last stage contribute (loss, dtype code) in float64, exact for every float dtype."""
        packet = torch.zeros(2, dtype=torch.float64, device=self.device)
        if self.is_last:
            loss = torch.stack([ctx.losses[i] for i in sorted(ctx.losses)]).sum() / self.layout.replicas
            packet[0] = loss.detach().to(torch.float64)
            packet[1] = _LOSS_DTYPES.index(loss.dtype) + 1
        work = dist.all_reduce(packet, async_op=True)
        self.watchdog.wait([(work, None)], lambda: "the loss", peers=range(self.world_size))
        dtype = _LOSS_DTYPES[round(float(packet[1]) / self.layout.replicas) - 1]
        return packet[0].to(dtype)

    def _counted_parameters(self) -> list[nn.Parameter]:
        """This rank's parameters in the global norm: replica 0's (replicas hold equal
        gradients after the step) or, sharded, every replica's (each holds its own shard);
        a tied weight on its first holder only."""
        if self.layout.replica != 0 and self._sharded is None:
            return []
        return [p for name, p in self._params.items() if name not in self._norm_skip]

    def _counted_grads(self) -> list[torch.Tensor]:
        return [local(g) for g in super()._counted_grads()]

    def state_dict(self) -> OrderedDict[str, torch.Tensor]:
        """This rank's keys of the model's state dict (tied weights under every name),
        detached and whole: under ``plan.fsdp`` each sharded tensor is gathered from the
        stage's replicas, a collective every rank must call. For a sharded checkpoint use
        :meth:`sharded_state_dict` with ``torch.distributed.checkpoint``."""
        return OrderedDict((k, full(v.detach())) for k, v in self._state.items())

    def _load_value(self, tensor: torch.Tensor, value: torch.Tensor) -> None:
        load_into(tensor, value)

    def _global_norm(self, local: torch.Tensor, norm_type: float) -> torch.Tensor:
        local = local.to(self.device)
        if norm_type == float("inf"):
            work = dist.all_reduce(local, op=dist.ReduceOp.MAX, async_op=True)
        else:
            local = local**norm_type
            work = dist.all_reduce(local, async_op=True)
        self.watchdog.wait([(work, None)], lambda: "the gradient norm of every rank", peers=range(self.world_size))
        return local if norm_type == float("inf") else local ** (1.0 / norm_type)

    def close(self) -> None:
        """Stop fxpipe's threads on this rank (heartbeat, communication waits) and join
        them. Call it after the last step, before ``destroy_process_group()``; it also
        runs at interpreter exit. The process group stays: it is the script's."""
        self.watchdog.close()

    @property
    def num_workers(self) -> int:
        return self.layout.workers

    def timeline(self, gather: bool = True) -> Timeline:
        """Measured Timeline of the last call or step, of the whole pipeline: every rank of
        this replica's events on one clock, so ``bubble_fraction`` is the pipeline's and
        ``to_chrome_trace`` names each rank. Any rank may ask, alone or with the others:
        the ranks' events are read from the job's store, where each rank leaves them after
        every call (waiting up to ``Plan.timeout`` for a rank still finishing that call).
        ``gather=False`` returns this rank's events alone, reading nothing.

        Raises:
            RuntimeError: before the first step or call.
            RankFailedError: when another rank of the pipeline does not finish the call.
        """
        if not self._last_events:
            raise RuntimeError("no step has run yet: call pipe.step(...) or pipe(...) first")
        first = self.layout.replica * self.layout.workers
        ranks = [first + w for w in range(self.layout.workers)]
        events = self._last_events
        if gather:
            events = gathered.collect(self.watchdog, ranks, self._calls, self.plan.timeout)
        return Timeline(events, num_workers=self.num_workers, kind="measured", ranks=ranks, deps=self.part.deps)

    def __repr__(self) -> str:
        return (
            f"DistributedPipeline(rank {self.rank}/{self.world_size}, stages {self.local_stages} on {self.device}, "
            f"schedule={describe_schedule(self.plan.schedule)}, replicas={self.layout.replicas})"
        )


_LOSS_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_MESSAGE_PLANS = 64  # message plans kept per program: one per combination of micro-batch signatures


__all__ = ["DistributedPipeline", "RankFailedError"]
