"""``fxpipe.compile`` and ``build_pipeline``: a partition made into a pipeline that runs.

The one module that picks the local :class:`~fxpipe.runtime.local_pipeline.Pipeline` or, when this
process is one of several (torchrun), the ``DistributedPipeline``, and the one that hands
the pipelines what they ask of the compiler while they run (:data:`COMPILER`: the retrace
of a new input signature and the questions asked on fake tensors), so that no pipeline
imports the compiler or a pass and the compiler imports no pipeline.

``fxpipe.distributed`` loads with the first ``compile`` (which asks whether this process is
one of several), and its runtime only for a distributed one: ``import fxpipe`` loads none
of it.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from torch import nn

from fxpipe.batching.batched_outputs import batched_outputs, check_call, output_like
from fxpipe.compiler.collector import collector_paused
from fxpipe.compiler.driver import CompileError, on_meta, partition, partition_like
from fxpipe.compiler.partitioned import Partitioned
from fxpipe.devices import check_available
from fxpipe.passes.fake_replay import FakeReplay
from fxpipe.passes.uncompiled import without_compile_wrappers
from fxpipe.plan import Plan, PlanError
from fxpipe.planner.profile import Profile
from fxpipe.runtime.local_pipeline import Pipeline
from fxpipe.runtime.pipeline_base import Compiler

COMPILER = Compiler(
    retrace=partition_like,
    batched_outputs=batched_outputs,
    fake_replay=lambda: FakeReplay(device="cpu"),
    output_like=output_like,
    check_call=check_call,
)


def compile(  # noqa: A001 - the public name is fxpipe.compile
    model: nn.Module,
    plan: Plan | Mapping[str, Any] | None = None,
    example_inputs: tuple | Any = (),
    example_kwargs: Mapping[str, Any] | None = None,
    loss_fn: Any = None,
    profile: Profile | None = None,
    weights: Any = None,
) -> Any:
    """Partition ``model`` per ``plan``, place each stage on its device, return a Pipeline.

    ``pipe(x)`` equals ``model(x)``; ``pipe.step(x, target=t)`` runs one forward+backward
    on the plan's schedule, returning the loss and accumulating every parameter's
    ``.grad`` as eager ``loss_fn(model(x), t).backward()`` does. The user's model is not
    modified. Raises what ``fxpipe.partition`` raises, and DeviceError when a stage's device
    is not present on this machine.

    Under torchrun (``WORLD_SIZE`` > 1, or an initialised process group of several ranks)
    it returns a ``fxpipe.distributed.DistributedPipeline`` holding only this rank's
    stages; a model built on the meta device is then filled per rank from ``weights``
    (a state dict, a checkpoint path, an init function, or None for the modules' own
    ``reset_parameters``). See docs/distributed.md. In one process ``weights`` cannot
    apply: it raises MaterializeError (load the weights into the model first). Python's
    garbage collector is paused while it compiles (``fxpipe.compiler.collector``).
    """
    # fxpipe.distributed loads on the first compile, not with ``import fxpipe``
    from fxpipe.distributed.layout import requested
    from fxpipe.distributed.materialize import check_weights_apply

    distributed = requested()
    check_weights_apply(weights, distributed)
    plan = Plan.coerce(plan)
    check_loss_fn(loss_fn)
    model = _traced_through(model, plan)
    with collector_paused():  # over the whole compile: one collection after it, not one per phase
        if distributed:
            return _compile_distributed(model, plan, example_inputs, example_kwargs, loss_fn, profile, weights)
        if plan.fsdp:
            raise PlanError(
                "plan.fsdp=True shards each stage over its data-parallel replicas, which run as separate processes: "
                "launch under torchrun (or fxpipe.distributed.launch) with plan.data_parallel > 1, or leave fsdp out"
            )
        if plan.data_parallel > 1:
            raise PlanError(
                f"plan.data_parallel={plan.data_parallel} replicates the pipeline over separate processes, but this one runs "
                "alone (world size 1): launch under torchrun (or fxpipe.distributed.launch) with one process per stage and "
                "replica, or leave data_parallel out"
            )
        part = partition(model, plan, example_inputs, example_kwargs, profile)
        if on_meta(model):
            raise CompileError(
                f"{type(model).__name__} is on the meta device; one process cannot fill it stage by stage. "
                "Launch one process per stage (torchrun, or fxpipe.distributed.launch) with weights=..., "
                "or build the model for real"
            )
        return build_pipeline(part, model, loss_fn)


def _compile_distributed(
    model: nn.Module, plan: Plan, example_inputs: Any, example_kwargs: Any, loss_fn: Any, profile: Any, weights: Any
) -> Any:
    """This rank's DistributedPipeline; the store is joined first, so that a rank failing
    to compile is named on every other rank."""
    from fxpipe.distributed import startup
    from fxpipe.distributed.rank_pipeline import DistributedPipeline

    watchdog = startup.join(plan.timeout)
    with startup.failures_recorded(watchdog):
        watchdog.running("compiling")
        part = partition(model, plan, example_inputs, example_kwargs, profile)
    return DistributedPipeline(part, model, COMPILER, loss_fn, weights=weights, watchdog=watchdog)


def _traced_through(model: Any, plan: Plan) -> Any:
    """The model fxpipe compiles: the user's, its ``torch.compile`` wrappers seen through
    (``fxpipe.passes.uncompiled``). The user's compiled code is not what the stages run:
    without ``Plan(compile=...)`` they run eager, which a warning says once."""
    if not isinstance(model, nn.Module):
        return model
    view, compiled = without_compile_wrappers(model)
    if compiled and not plan.compile:
        names = ", ".join(path or f"the model ({type(model).__name__})" for path in compiled)
        warnings.warn(
            f"fxpipe traced through torch.compile on {names}: its stages are built from the original code and run "
            "eager; pass Plan(compile=True) to run every stage compiled (see docs/compiled.md)",
            UserWarning,
            stacklevel=3,
        )
    return view


def check_loss_fn(loss_fn: Any) -> None:
    """Raise CompileError unless ``loss_fn`` is None or callable as ``loss_fn(output, target)``."""
    if loss_fn is not None and not callable(loss_fn):
        raise CompileError(
            f"loss_fn = {loss_fn!r} ({type(loss_fn).__name__}) is not callable: pass a function of (output, target) "
            "returning a scalar tensor, e.g. loss_fn=nn.CrossEntropyLoss(), or leave it out (the model returns its loss)"
        )


def build_pipeline(part: Partitioned, model: nn.Module, loss_fn: Any = None, own: bool = True) -> Pipeline:
    """A local Pipeline running ``part`` (partitioned from ``model``) on this machine's
    devices. ``own``: the stages hold the model's own parameters and buffers, moved in place
    to their devices (what ``compile`` does); otherwise copies, and ``model`` is not changed
    (what ``tune`` times). Raises DeviceError when a stage's device is not present. Python's
    garbage collector is paused while the stages are copied (``fxpipe.compiler.collector``)."""
    check_loss_fn(loss_fn)
    for stage in part.stages:
        check_available(stage.device, f"plan.devices[{stage.index}]")
    with collector_paused(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return Pipeline(part, model, COMPILER, loss_fn, own=own)


__all__ = ["COMPILER", "build_pipeline", "check_loss_fn", "compile"]
