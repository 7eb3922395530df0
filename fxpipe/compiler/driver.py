"""``fxpipe.partition``: the compiler passes in order, the only driver of the passes.

``partition`` traces a model and cuts it into stages (a :class:`Partitioned`, nothing
placed); ``partition_like`` cuts another input signature's trace at the same places.
``fxpipe.factory`` builds pipelines from the result; this module imports no pipeline.
"""

from __future__ import annotations

import copy
import functools
import inspect
import itertools
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from fxpipe.batching import microbatch
from fxpipe.batching.loss_scale import model_losses, rule_of
from fxpipe.compiler.collector import collector_paused
from fxpipe.compiler.partitioned import Partitioned
from fxpipe.compiler.progress import Progress
from fxpipe.compiler.stage import Stage
from fxpipe.passes import annotate as annotate_pass
from fxpipe.passes.buffers import buffers_written
from fxpipe.passes.codegen import build_stage_module, mutated_inputs, stage_graph
from fxpipe.passes.fake_replay import FakeReplay, replay
from fxpipe.passes.generalise import check_generalises
from fxpipe.passes.input_slice import input_slice, output_inputs
from fxpipe.passes.loss_terms import added_terms
from fxpipe.passes.meta import COMPUTE_OPS, MODULE_PATH, STAGE
from fxpipe.passes.node_costs import annotate_costs
from fxpipe.passes.partition import partition as partition_pass
from fxpipe.passes.rng import make_randomness_explicit, number_random_ops
from fxpipe.passes.shape_prop import propagate_shapes, real_runs, record_values
from fxpipe.passes.targets import lookup, resolver
from fxpipe.passes.trace import quiet_attempt, trace
from fxpipe.passes.uncompiled import eager_code, without_compile_wrappers
from fxpipe.passes.weight_grad import defer_weight_gradients
from fxpipe.plan import Plan, PlanError
from fxpipe.planner.auto_split import auto_split
from fxpipe.planner.cost_model import Calibration
from fxpipe.planner.memory_plan import memory_choices, plan_memory
from fxpipe.planner.profile import Profile
from fxpipe.schedules import stage_workers


class CompileError(ValueError):
    """A plan the compiler cannot honour for this model; the message names the culprit."""


def _annotate(graph, plan: Plan, model: nn.Module, profile: Profile | None) -> tuple[annotate_pass.StageAssignment, str]:
    if isinstance(plan.split, list):
        known = {name for name, _ in model.named_modules()}
        return annotate_pass.annotate_by_split_points(graph, plan.split, known), f"plan.split={plan.split}"
    if plan.split == "auto":
        if plan.devices is None:
            raise PlanError("split='auto' needs plan.devices: the devices to spread the model over")
        cuts = auto_split(graph, plan, profile.calibration if profile is not None else None)
        return annotate_pass.annotate_by_cuts(graph, cuts.starts, cuts.reasons, cuts.how), "split='auto' (cost model)"
    if annotate_pass.has_tags(graph):
        return annotate_pass.annotate_by_tags(graph), "the device_guard tags"
    if plan.devices is not None and len(plan.devices) * plan.chunks > 1:
        raise PlanError(
            f"split='tags' but {type(model).__name__}.forward has no fxpipe.device_guard blocks, so it "
            f"cannot fill the {len(plan.devices)} devices in plan.devices; tag forward with "
            "fxpipe.device_guard, or use Plan(split=['module.path', ...]) or Plan(split='auto')"
        )
    return annotate_pass.single_stage(graph), "no tags (one stage)"


def partition(
    model: nn.Module,
    plan: Plan | Mapping[str, Any] | None = None,
    example_inputs: tuple | Any = (),
    example_kwargs: Mapping[str, Any] | None = None,
    profile: Profile | None = None,
) -> Partitioned:
    """Run the compiler passes (trace, shape propagation, annotate, partition, codegen).

    Nothing is moved or copied: a plan naming ``cuda:0`` can be made and inspected on a
    machine without a GPU. ``profile`` (from ``fxpipe.profile``) replaces the cost model's
    estimated node times by measured ones. Returns a :class:`Partitioned`. Raises TraceError when the
    model cannot be traced, PlanError/AnnotateError/ScheduleError when the plan cannot be
    honoured (the message names the field, node or module at fault). A compile longer
    than 2 s reports its progress on one line of stderr (``fxpipe.compiler.progress``); Python's
    garbage collector is paused while it runs (``fxpipe.compiler.collector``). A model or
    submodules compiled by the user (``torch.compile``, ``Module.compile``) are traced as
    their original code, under their own names (``fxpipe.passes.uncompiled``); no compiled
    code runs on fake tensors.
    """
    if isinstance(model, nn.Module):
        model, _ = without_compile_wrappers(model)
    with collector_paused(), eager_code(), Progress(type(model).__name__) as progress:
        return _partition(model, plan, example_inputs, example_kwargs, profile, progress)


def _partition(model, plan, example_inputs, example_kwargs, profile, progress: Progress) -> Partitioned:
    progress.phase("trace")
    plan = Plan.coerce(plan)
    if not isinstance(model, nn.Module):
        raise TypeError(f"fxpipe expects an nn.Module, got {type(model).__name__}")
    if example_inputs is None and not example_kwargs:
        raise CompileError(
            f"example_inputs=None: pass example_inputs=(x, ...), the arguments of {type(model).__name__}.forward "
            "shaped like a training batch (a single tensor may be passed as is; keyword arguments go in example_kwargs=)"
        )
    if not isinstance(example_inputs, tuple):
        example_inputs = () if example_inputs is None else (example_inputs,)
    kwargs = dict(example_kwargs or {})
    traced = trace(model, example_inputs, kwargs, plan.frontend, plan.leaf_modules, plan.concrete_args)
    gm = traced.graph_module
    # the user's model first: its names and tied tensors; export's constants live on the root
    resolve = resolver(model, traced.root)
    try:
        example = traced.bind_inputs(example_inputs, kwargs)
    except TypeError as err:
        raise CompileError(
            f"example_inputs do not fit {type(model).__name__}.forward ({err}); pass "
            "example_inputs=(x, ...) (and example_kwargs=) shaped like a training batch: fxpipe "
            "propagates their shapes on fake tensors to size every stage and edge"
        ) from None
    progress.phase("shapes and costs")
    if traced.replay is not None:  # the fx frontend replayed the example while tracing
        fake_run = traced.replay
        record_values(fake_run)
    else:
        fake_run = propagate_shapes(gm, _on_model_device(model, example), resolve, progress=progress.nodes)
    _check_kernel_dtypes(model, example_inputs, kwargs, fake_run)
    annotate_costs(gm.graph, resolve, fake_run)
    _check_cut_fits(gm, resolve, plan, model, example_inputs, kwargs, example)
    if profile is not None:
        profile.apply(gm.graph)
    progress.phase("split")
    assignment, how = _annotate(gm.graph, plan, model, profile)
    used = {n.target for n in gm.graph.nodes if n.op in ("get_attr", "call_module")}
    progress.phase("partition")
    part = _cut(
        traced, plan, assignment, how, type(model).__name__, lambda s: resolve, _unused_state(model, used),
        example_inputs, kwargs, calibration=profile.calibration if profile is not None else None,
    )
    if plan.checkpoint == "auto" or plan.offload == "auto":
        progress.phase("memory plan")
        plan_memory(part)
    return part


def _check_cut_fits(gm, resolve: Callable[[str], Any], plan: Plan, model: nn.Module, args: tuple, kwargs: dict, example: list) -> None:
    """Micro-batches cut every tensor along dim 0 where the first tensor's dim 0 is. When that
    first tensor sits in a list (a detection model's list of images: one tensor per sample),
    dim 0 may not be the batch: the graph is replayed on the first micro-batch on fake
    tensors, and a cut it cannot run is a PlanError saying what to do instead."""
    if plan.microbatches == 1 or not _batch_in_a_list(model, args, kwargs):
        return
    try:
        first = microbatch.split(example, plan.microbatches)[0][0]
        with quiet_attempt():
            replay(gm, _on_model_device(model, first), resolve)
    except Exception as err:  # noqa: BLE001 - any failure: the cut does not fit the model
        text = str(err).strip().splitlines()
        raise PlanError(
            f"plan.microbatches = {plan.microbatches} cuts every input tensor along dim 0, but "
            f"{type(model).__name__} takes its batch as a list of tensors (one per sample), whose dim 0 is not the "
            f"batch: the model fails on such a micro-batch ({type(err).__name__}: {text[0] if text else ''}). "
            "A list is not cut into micro-batches: use Plan(microbatches=1) and one step() per micro-batch "
            "(a sub-list of the samples; gradients accumulate as eager's over the same sub-lists)"
        ) from None


def _batch_in_a_list(model: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether the call's first argument holding a tensor is a list."""
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs)
    except TypeError:
        return False
    for value in bound.arguments.values():
        if any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(value)):
            return isinstance(value, list)
    return False


def _check_kernel_dtypes(model: nn.Module, example_inputs: tuple, kwargs: dict, fake_run: FakeReplay) -> None:
    """Raise CompileError when real kernels would refuse the example's dtypes against the
    model's (a float16 batch for float32 convolutions): fake tensors let them pass, so the
    replay of the trace on the example keeps those kernels' dtype rules
    (``fxpipe.passes.kernel_dtypes``) and says which op they refuse."""
    if fake_run.refused is None:
        return
    given = ", ".join(f"{microbatch.describe_tensor(t)}" for t in pytree.tree_leaves((example_inputs, kwargs)) if isinstance(t, torch.Tensor))
    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()})
    raise CompileError(
        f"example_inputs ({given}) meet {type(model).__name__}'s {'/'.join(dtypes)} parameters where real kernels refuse "
        f"mixed dtypes ({fake_run.refused}): pass inputs of the dtype the model computes in, or convert the model (model.to(dtype))"
    )


def partition_like(
    first: Partitioned,
    model: nn.Module,
    args: tuple,
    kwargs: Mapping[str, Any],
    roots_for: Callable[[int], list[nn.Module]],
) -> Partitioned:
    """The partition of another call signature of ``first``'s model: traced again for
    ``model(*args, **kwargs)``, cut at the same stage boundaries, on the same devices.

    ``model`` is a skeleton of the model (``fxpipe.runtime.placement.skeleton``: code and
    structure, no memory); it is traced on fake tensors placed where the real ones are.
    ``roots_for(s)`` lists the modules stage ``s``'s targets are looked up in, by
    qualified name (the placed stage modules of its device, so every signature's stages
    share the same parameters). Raises
    TraceError/TraceMismatch when the call cannot be traced faithfully, AnnotateError when
    the new trace lacks a stage boundary of the first, PlanError when it would need
    another number of stages or another placement. The garbage collector is paused while
    it runs, as in ``partition``.
    """
    with collector_paused(), eager_code():
        return _partition_like(first, model, args, kwargs, roots_for)


def _partition_like(first: Partitioned, model: nn.Module, args: tuple, kwargs: Mapping[str, Any], roots_for: Callable[[int], list[nn.Module]]) -> Partitioned:
    """``partition_like``'s work (see there)."""
    plan = first.plan
    traced, mode = _retrace(model, first.frontend, plan, args, kwargs, dynamic_batch=not first.batch_lengths)
    traced.batch_lengths = traced.batch_lengths or list(first.batch_lengths)  # traced at its batch: no replay at one to tell
    check_generalises(model, traced, args, kwargs, mode=mode)  # writes node.meta["val"]
    graph = traced.graph_module.graph
    if plan.split == "auto":
        assignment = annotate_pass.annotate_by_anchors(graph, first.anchors, [s.reason for s in first.stages])
        how = "split='auto' (the first signature's cut)"
    else:
        assignment, how = _annotate(graph, plan, model, None)
    if assignment.num_stages != first.num_stages:
        raise PlanError(
            f"the trace for {traced.key} has {assignment.num_stages} stage(s) by {how}, the first signature "
            f"{first.num_stages}: stage boundaries must not move between signatures"
        )
    own = functools.partial(_shared_or_traced, traced)
    part = _cut(
        traced, plan, assignment, how, first.model_name, lambda s: functools.partial(own, functools.partial(lookup, roots_for(s))), {}, args, dict(kwargs),
        devices=first.devices, calibration=first.calibration,
        choices=([st.recompute for st in first.stages], [st.offload for st in first.stages]),
    )
    if part.stage_workers != first.stage_workers:
        raise PlanError(f"the trace for {traced.key} places stages on workers {part.stage_workers}, the first signature on {first.stage_workers}")
    return part


def _shared_or_traced(traced: Any, placed: Callable[[str], Any], target: str) -> Any:
    """A later signature's target: parameters, buffers and the modules holding them are the
    placed ones (shared by every signature); what holds no tensor (export's guard
    function, higher-order-op subgraphs, a training flag, a Dropout) is this trace's own."""
    try:
        value = placed(target)
    except AttributeError:
        value = None
    if isinstance(value, torch.Tensor) or (isinstance(value, nn.Module) and _holds_state(value)):
        return value
    own = lookup([traced.graph_module, traced.root], target)
    if isinstance(own, torch.Tensor) or (isinstance(own, nn.Module) and _holds_state(own)):
        raise CompileError(
            f"the trace of {traced.key} uses {target!r}, a tensor the first signature's stages do not hold "
            "(a constant the model's forward creates): fxpipe cannot share it across signatures; register it "
            "as a buffer of the model, or compile a pipeline per signature"
        )
    return own


def _holds_state(module: nn.Module) -> bool:
    return any(True for _ in itertools.chain(module.parameters(), module.buffers()))


def _plain_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Tensors the model's modules hold as plain attributes, neither parameters nor buffers
    (torchvision's anchor generator keeps its anchors in a list): a retrace's fake copy of
    the model shares them, since a real tensor cannot be copied inside the fake mode."""
    found = []
    for module in model.modules():
        for name, value in vars(module).items():
            if name not in ("_parameters", "_buffers", "_modules"):
                found += [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
    return found


def _retrace(model: nn.Module, frontend: str, plan: Plan, args: tuple, kwargs: Mapping[str, Any], dynamic_batch: bool = True) -> tuple[Any, FakeTensorMode]:
    """Trace a skeleton for a call: its tensors made fake where the real ones live, and under
    export the call's too (export then records the right devices; nothing is computed;
    fx reads the call's own values where a condition asks for them). ``dynamic_batch``:
    False traces at the call's own batch size (a model that iterates over the batch, even
    a batch of one). Returns the trace, whose GraphModule holds those fakes, and their
    FakeTensorMode."""
    devices = getattr(model, "fxpipe_devices", {})
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    memo: dict[int, Any] = {}
    with mode:
        for name, t in itertools.chain(model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)):
            if id(t) not in memo:
                fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=devices.get(name, t.device))
                memo[id(t)] = nn.Parameter(fake, t.requires_grad) if isinstance(t, nn.Parameter) else fake
        memo.update((id(t), t) for t in _plain_tensors(model) if id(t) not in memo)  # shared, not copied
        fake_model = copy.deepcopy(model, memo)
        call = (tuple(args), dict(kwargs))
        if frontend != "fx":  # fx traces on the call's own values: they answer conditions on the inputs alone (nothing computed)
            call = pytree.tree_map_only(torch.Tensor, lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device), call)
    return trace(fake_model, *call, frontend, plan.leaf_modules, plan.concrete_args, dynamic_batch=dynamic_batch), mode


def _cut(
    traced: Any,
    plan: Plan,
    assignment: annotate_pass.StageAssignment,
    how: str,
    model_name: str,
    resolve_for: Callable[[int], Callable[[str], Any]],
    unused_state: dict[str, Any],
    example_inputs: tuple,
    example_kwargs: dict,
    devices: list[str] | None = None,
    calibration: Calibration | None = None,
    choices: tuple[list, list] | None = None,
) -> Partitioned:
    """Partition an annotated trace, run the per-stage passes, and describe the result.
    ``choices``: each stage's (recompute, offload), as an earlier signature resolved them."""
    gm = traced.graph_module
    annotate_pass.check_monotone(gm.graph)
    stage_anchors = annotate_pass.anchors(gm.graph) if plan.split == "auto" and assignment.num_stages > 1 else []
    number_random_ops(gm.graph, gm)  # keys from the whole graph: a node's masks do not depend on the split
    cut = partition_pass(gm.graph, assignment.num_stages)
    actions = plan.actions(assignment.num_stages, deps=cut.deps)
    workers = stage_workers(actions)
    devices = devices or plan.stage_devices(workers, assignment.tag_devices, how)
    recompute, offload = memory_choices(plan, assignment.num_stages, devices, choices)
    num_model_inputs = sum(1 for n in gm.graph.nodes if n.op == "placeholder")
    edge_index = {id(e): k for k, e in enumerate(cut.edges)}
    split_backward = any(a.op in ("I", "W") for todo in actions for a in todo)
    stages = []
    for s in range(assignment.num_stages):
        graph = stage_graph(cut, s)
        module = build_stage_module(graph, resolve_for(s), unused_state if s == 0 else {}, f"Stage{s}")
        paths = [n.meta.get(MODULE_PATH, "") for n in graph.nodes if n.op in COMPUTE_OPS]
        inputs = [n.name for n in graph.nodes if n.op == "placeholder"][: num_model_inputs if s == 0 else 0]
        recv, send = cut.recv_edges(s), cut.send_edges(s)
        mutated = mutated_inputs(graph, module.get_submodule)  # before the rewrites below hide call_modules
        written = tuple(buffers_written(module))
        roles = []
        if make_randomness_explicit(module):
            roles.append("rng_seed")
        # a stage compiled with Inductor splits its compiled backward graph instead (a
        # selectively recomputed one runs eager: docs/compiled.md)
        per_op = not plan.compiles_backward or recompute[s] == "selective"
        if split_backward and per_op and defer_weight_gradients(module):
            roles.append("weight_grads")
        stages.append(
            Stage(
                s, devices[s], module, recv, send, assignment.reasons[s], inputs, paths,
                recv_ids=[edge_index[id(e)] for e in recv],
                send_ids=[edge_index[id(e)] for e in send],
                mutated_inputs=mutated,
                extra_inputs=tuple(roles),
                buffers_written=written,
                recompute=recompute[s],
                offload=offload[s],
                split_backward=split_backward,
            )
        )
    last = [n for n in gm.graph.nodes if n.meta.get(STAGE) == assignment.num_stages - 1]
    losses = model_losses(last, functools.partial(input_slice, gm))
    return Partitioned(
        plan, model_name, stages, cut, traced.frontend, traced.bind_inputs, traced.build_output,
        example_inputs, example_kwargs, list(traced.notes), workers,
        key=traced.key, key_of=traced.key_of, anchors=stage_anchors, calibration=calibration,
        model_losses=losses, output_inputs=output_inputs(gm),
        opaque=list(traced.opaque), real_runs=real_runs(gm.graph),
        loss_terms=own_loss_terms(gm, traced.build_output) if losses is not None else [],
        batch_lengths=list(traced.batch_lengths),
    )


def own_loss_terms(gm: Any, build_output: Callable[[Any], Any]) -> list[str]:
    """The names of the terms a model's own loss (the output's ``loss``, or a scalar output)
    adds beside its reduced loss calls, computed from the model's inputs: each is computed
    per micro-batch (``fxpipe.passes.loss_terms``). [] when the loss is not found."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    try:
        structured = build_output(output.args[0])
    except Exception:  # noqa: BLE001 - an output that cannot hold graph nodes: nothing to name
        return []
    loss = getattr(structured, "loss", structured)
    if not isinstance(loss, torch.fx.Node):
        return []
    names = {leaf: microbatch.path_of(path) for path, leaf in microbatch.leaves_with_paths(structured) if isinstance(leaf, torch.fx.Node)}
    terms = added_terms(loss, lambda n: n.op == "call_function" and rule_of(n.target) is not None, names)
    return [t.name for t in terms if t.from_inputs]


def on_meta(model: nn.Module) -> bool:
    """Whether the model has tensors on the meta device (built for shapes, not values)."""
    return any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))


def _on_model_device(model: nn.Module, inputs: list) -> list:
    """Inputs as meta tensors when the model is on the meta device, so shapes propagate."""
    if not on_meta(model):
        return inputs
    return pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), inputs)


def _unused_state(model: nn.Module, used: set[str]) -> dict[str, Any]:
    """Parameters and buffers no node touches: they live in stage 0 so nothing is dropped."""

    def touched(name: str) -> bool:
        parts = name.split(".")
        return any(".".join(parts[:k]) in used for k in range(1, len(parts) + 1))

    return {
        name: tensor
        for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers())
        if not touched(name)
    }


__all__ = ["CompileError", "on_meta", "partition", "partition_like"]
