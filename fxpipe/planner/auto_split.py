"""``split="auto"``: where to cut, chosen with the cost model; the annotate pass assigns stages.

The compute nodes, in program order (a topological order of the data flow), are split
into ``len(plan.devices) x plan.chunks`` contiguous stages by the exact min-max partitioner
of ``passes/split_solver.py`` over the device model's node times, send/recv times of the
bytes live across each cut, and every device's memory; a model of repeated layers (the
blocks the tracer stamped, ``node.meta["block"]``) is split between layers, each layer one
item; the cuts are then moved (by whole items) while the plan's simulated schedule gets
faster (``refine``). The result is cut *positions*: the
nodes where stages begin, with a reason per stage; ``passes/annotate.annotate_by_cuts``
turns them into ``node.meta["stage"]`` with the placement rule every split shares.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import networkx as nx
import torch
import torch.fx as fx

from fxpipe.inspection import format as fmt
from fxpipe.passes.annotate import AnnotateError
from fxpipe.passes.meta import BLOCK, COMPUTE_OPS, MEASURED, VAL
from fxpipe.passes.node_costs import cost_of
from fxpipe.passes.shape_prop import tensor_bytes
from fxpipe.passes.split_solver import (
    SplitInfeasible,
    SplitProblem,
    ordered_problem_inputs,
    refine,
    solve,
)
from fxpipe.plan import Plan, PlanError, PlanScheduleError
from fxpipe.planner.cost_model import (
    OPTIMIZER_STATES,
    Calibration,
    DeviceModel,
    stage_models,
    state_bytes,
)
from fxpipe.planner.estimates import StepClock, in_flight, measured_device
from fxpipe.schedules import Schedule, describe_schedule, stage_workers

# the exact min-max split gives way to the schedule-refined one only when the simulated
# step is at least this much shorter: smaller gains are far below the model's error
REFINE_MIN_GAIN = 0.01
# repeated blocks (layers) are the split's items when there are at least this many per stage
CLUSTERS_PER_STAGE = 4


@dataclass
class AutoSplit:
    """Cut positions: stage ``k + 1`` begins at node ``starts[k]`` (program order);
    ``reasons``: per stage, its predicted time and memory; ``how``: what chose the cuts."""

    starts: list[fx.Node]
    reasons: list[str]
    how: str


def auto_split(graph: fx.Graph, plan: Plan, calibration: Calibration | None = None) -> AutoSplit:
    """The cuts of ``graph`` (nodes carry ``cost``, and ``measured_time`` where profiled)
    for ``plan``: the exact min-max split, refined for the plan's schedule. ``calibration``
    (from ``fxpipe.profile``) rates the nodes the profile did not time.

    One stage per entry of ``plan.devices`` (times ``plan.chunks``), each on the device of
    the worker the plan's schedule runs it on. Writes nothing on the graph. Raises
    AnnotateError when there are fewer compute nodes than stages, PlanError when the
    schedule cannot run that many stages or no split fits the devices' memory (naming how
    much each stage would need on which device).
    """
    num_stages = len(plan.devices or []) * plan.chunks
    m = plan.microbatches
    try:
        actions = plan.actions(num_stages)
    except PlanScheduleError as err:
        raise PlanScheduleError(f"split='auto' makes {num_stages} stage(s) (one per plan.devices entry, times chunks): {err}") from err
    devices = plan.stage_devices(stage_workers(actions), how="split='auto'")
    models = stage_models(plan, devices, calibration)
    compute = [n for n in graph.nodes if n.op in COMPUTE_OPS]
    if len(compute) < num_stages:
        raise AnnotateError(
            f"split='auto': {num_stages} stages asked for but the graph has only {len(compute)} compute "
            "nodes; use fewer devices (plan.devices) or chunks"
        )
    order, cuts = ordered_problem_inputs(_dataflow(compute), compute)
    measured_on = measured_device(graph, plan, calibration)
    phases = torch.tensor([_node_phases(mdl, order, m, measured_on) for mdl in models], dtype=torch.float64)  # stages x nodes x (forward, input gradient, weight gradient)
    flight = in_flight(plan, actions, num_stages)
    problem_for = _problems(graph, order, phases, cuts, models, devices, m, flight)
    edges = _block_edges(order, num_stages)  # one item per stamped layer where there are enough
    _, item_phases, item_cuts = _by_items(problem_for(False), phases, cuts, edges)
    items = [order[e] for e in edges[:-1]]
    problem, split = _solve(
        plan,
        lambda recompute: _by_items(problem_for(recompute), phases, cuts, edges)[0],
        lambda err, problem, held: _infeasible_message(err, devices, problem, items, held, m),
        flight,
    )
    step_time = _simulated_step(actions, m, models, item_phases, item_cuts)
    minmax_step = step_time(split.boundaries)
    bounds = refine(problem, split.boundaries, step_time)
    refined_step = step_time(bounds)
    if refined_step > minmax_step * (1 - REFINE_MIN_GAIN):
        bounds, refined_step = split.boundaries, minmax_step
    reasons = _reasons(problem, bounds, devices)
    refined = bounds != split.boundaries
    if refined:
        reasons[0] += (
            f"; cuts moved from the min-max split (slowest stage {fmt.seconds(split.bottleneck)}, step "
            f"{fmt.seconds(minmax_step)}) to the predicted best {describe_schedule(plan.schedule)} step with {m} micro-batches ({fmt.seconds(refined_step)})"
        )
    how = "cost model: min-max split" + (f", refined for the {describe_schedule(plan.schedule)} schedule" if refined else "")
    return AutoSplit([order[edges[b]] for b in bounds[1:-1]], reasons, how)


def _node_phases(model: DeviceModel, order: list[fx.Node], m: int, measured_on: DeviceModel | None) -> list[Any]:
    """Each ordered node's (forward, I, W) seconds on ``model``: an estimate computed once
    per distinct cost (a 10,000-node stack has a handful), a measured node's on its own."""
    known: dict[Any, Any] = {}
    rows = []
    for node in order:
        cost, measured = cost_of(node), node.meta.get(MEASURED)
        if measured is not None:
            rows.append(model.node_phases(cost, 1 / m, measured, measured_on))
            continue
        row = known.get(cost)
        if row is None:
            row = known[cost] = model.node_phases(cost, 1 / m, None, measured_on)
        rows.append(row)
    return rows


def _block_edges(order: list[fx.Node], num_stages: int) -> list[int]:
    """Where the split's items begin (and ``len(order)`` last): a model of repeated blocks
    (``node.meta["block"]``: the layers the tracer stamped) has one item per block, where
    there are at least ``CLUSTERS_PER_STAGE`` per stage, so cuts fall between layers; any
    other model (or node) is one item per node."""
    starts = [k for k, node in enumerate(order) if k == 0 or node.meta.get(BLOCK) is None or node.meta.get(BLOCK) != order[k - 1].meta.get(BLOCK)]
    if len(starts) < CLUSTERS_PER_STAGE * num_stages:
        starts = list(range(len(order)))
    return [*starts, len(order)]


def _by_items(problem: SplitProblem, phases: torch.Tensor, cuts: list[float], edges: list[int]) -> tuple[SplitProblem, torch.Tensor, list[float]]:
    """The problem, the per-item phase seconds and the cut bytes over the items ``edges``
    delimit (unchanged when every node is an item)."""
    if len(edges) == problem.num_items + 1:
        return problem, phases, cuts
    index = torch.tensor(edges)
    summed = torch.cat([torch.zeros_like(phases[:, :1]), phases.cumsum(1)], 1)
    return problem.clustered(edges[:-1]), summed[:, index[1:]] - summed[:, index[:-1]], [cuts[e] for e in edges]


def _problems(
    graph: fx.Graph, order: list[fx.Node], phases: torch.Tensor, cuts: list[float], models: list[DeviceModel], devices: list[str], m: int, flight: list[int]
) -> Callable[[bool], SplitProblem]:
    """``problem_for(recompute)``: the split problem when every stage keeps its activations,
    or recomputes (each then holds one micro-batch's at a time, and runs its forward twice)."""
    num_stages = len(models)

    def problem_for(recompute: bool) -> SplitProblem:
        return SplitProblem(
            item_time=phases.sum(2) + (phases[:, :, 0] if recompute else 0.0),
            cut_bytes=cuts,
            recv_per_byte=[0.0] + [2 / m * models[k].seconds_per_byte(models[k - 1]) for k in range(1, num_stages)],
            send_per_byte=[2 / m * models[k].seconds_per_byte(models[k + 1]) for k in range(num_stages - 1)] + [0.0],
            fixed_time=[2 * mdl.spec.latency * (1 + (k > 0) + (k < num_stages - 1)) for k, mdl in enumerate(models)],
            state_bytes=_state_per_item(graph, order),
            activation_bytes=[cost_of(n).activation_bytes / m for n in order],
            in_flight=[1] * num_stages if recompute else flight,
            memory=[models[k].spec.memory / devices.count(devices[k]) for k in range(num_stages)],
        )

    return problem_for


def _solve(plan: Plan, problem_for: Callable[[bool], SplitProblem], message: Callable[..., str], flight: list[int]) -> tuple[SplitProblem, Any]:
    """The min-max split with every stage keeping its activations; under
    ``checkpoint="auto"``, when none fits, the split for recomputing stages (the memory
    plan then keeps the activations of every stage that fits with them). Raises PlanError
    with ``message(err, problem, in_flight)`` when nothing fits."""
    problem = problem_for(False)
    try:
        return problem, solve(problem)
    except SplitInfeasible as err:
        if plan.checkpoint != "auto":
            raise PlanError(message(err, problem, flight)) from err
    problem = problem_for(True)
    try:
        return problem, solve(problem)
    except SplitInfeasible as err:
        raise PlanError(message(err, problem, [1] * len(flight))) from err


def _reasons(problem: SplitProblem, bounds: list[int], devices: list[str]) -> list[str]:
    """Per stage of a split, its predicted time and memory, the slowest one marked."""
    times = [problem.stage_time(k, bounds[k], bounds[k + 1]) for k in range(len(devices))]
    return [
        f"cost model: {fmt.seconds(t)} per micro-batch (forward+backward+send/recv) on {devices[k]}, "
        f"memory {fmt.nbytes(problem.stage_memory(k, bounds[k], bounds[k + 1]))} of {fmt.nbytes(problem.memory[k])}"
        + ("; the slowest stage" if t == max(times) else "")
        for k, t in enumerate(times)
    ]


def _state_per_item(graph: fx.Graph, order: list[fx.Node]) -> list[float]:
    """Persistent bytes per ordered node: its own, plus those of the attributes it is the
    first to use (where the annotate pass places them)."""
    state = [0.0] * len(order)
    position = {n: k for k, n in enumerate(order)}
    for node in graph.nodes:
        if node.op == "get_attr" and node.users:
            first = min((position[u] for u in node.users if u in position), default=0)
            state[first] += state_bytes(cost_of(node))
        elif node in position:
            state[position[node]] += state_bytes(cost_of(node))
    return state


def _simulated_step(actions: Schedule, m: int, models: list[DeviceModel], phases: torch.Tensor, cuts: list[float]) -> Callable[[list[int]], float]:
    """``step_time(boundaries)``: the schedule's simulated step for a split of the ordered
    nodes (per-node forward, I and W seconds ``phases``, bytes ``cuts`` across each cut)."""
    num_stages = len(models)
    zero = torch.zeros(num_stages, 1, 3, dtype=torch.float64)
    summed = torch.cat([zero, phases.cumsum(1)], 1)  # stages x (nodes + 1) x 3
    read: dict[tuple[int, int], list[float]] = {}  # the sums the refinement asks for, as floats

    def prefix(k: int, b: int) -> list[float]:
        if (k, b) not in read:
            read[(k, b)] = summed[k, b].tolist()
        return read[(k, b)]

    clock = StepClock(actions, models, [(k, k + 1) for k in range(num_stages - 1)])

    def step_time(bounds: list[int]) -> float:
        spans = [(prefix(k, bounds[k]), prefix(k, bounds[k + 1])) for k in range(num_stages)]
        edge_bytes = {(k, k + 1): cuts[bounds[k + 1]] / m for k in range(num_stages - 1)}
        per_phase = [[end[p] - start[p] for start, end in spans] for p in range(3)]
        return clock.step_time(*per_phase, edge_bytes)

    return step_time


def _dataflow(compute: list[fx.Node]) -> nx.DiGraph:
    flow = nx.DiGraph()
    flow.add_nodes_from(compute)
    members = set(compute)
    for node in compute:
        size = tensor_bytes(node.meta.get(VAL))
        for user in node.users:
            if user in members:
                flow.add_edge(node, user, bytes=size)
    return flow


def _infeasible_message(err: SplitInfeasible, devices: list[str], problem: SplitProblem, order: list[fx.Node], flight: list[int], m: int) -> str:
    lines = [
        "split='auto': no split of the model fits the devices' memory (parameters + gradients + "
        f"{OPTIMIZER_STATES} optimizer states + activations of the micro-batches in flight). "
        "The split needing the least memory would need:"
    ]
    b = err.boundaries
    for k, dev in enumerate(devices):
        i, j = b[k], b[k + 1]
        state = problem.stage_state(i, j)
        acts = err.needed[k] - state
        over = "  <-- too small" if err.needed[k] > err.limits[k] else ""
        lines.append(
            f"  stage {k} on {dev} ({order[i].name} … {order[j - 1].name}): {fmt.nbytes(err.needed[k])} "
            f"(state {fmt.nbytes(state)}, activations {fmt.nbytes(acts)} for {flight[k]} micro-batch(es) in flight), "
            f"has {fmt.nbytes(err.limits[k])}{over}"
        )
    lines.append(
        "give the devices more memory in plan.device_specs, add devices, use checkpoint=True or 'auto', "
        f"or more micro-batches (now {m}) to shrink activations"
    )
    return "\n".join(lines)
