"""Annotate pass: every node gets the pipeline stage that will run it.

Reads ``node.meta["custom"]["fxpipe_device"]`` (device_guard tags) and
``node.meta["module_path"]`` and ``node.meta["opaque"]`` (written by the trace pass).
Writes ``node.meta["stage"]`` (int, 0-based, non-decreasing along every edge) and
``node.meta["stage_reason"]`` (why the node is there, for ``explain()``).

Rules
-----
tags         Each contiguous run of one tag, in program order, is a stage; a device may
             host several stages. Untagged nodes follow their inputs (the latest stage
             among them); nodes with no inputs follow their first user.
split points A list of module paths: a new stage begins at the first node created by
             each listed module (or one of its children), in program order.
cuts         A list of nodes: a new stage begins at each, in program order (the cuts
             ``split="auto"`` chose with the cost model).
anchors      Another trace of the model (another input signature) cut where :func:`anchors`
             found the stages of a first one (each stage's first compute node, named by
             module path, op and occurrence), so a ``split="auto"`` cut never moves.
In every mode placeholders are stage 0 and ``get_attr`` nodes (parameters, constants)
take the earliest stage that uses them; the partition pass gives every other using stage
its own reference, so parameters are never sent as activations.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch.fx as fx

from fxpipe.passes.meta import COMPUTE_OPS, MODULE_PATH, OPAQUE, REASON, STAGE
from fxpipe.passes.tags import has_tags, tag_of, tag_source

__all__ = ["COMPUTE_OPS", "REASON", "STAGE", "Anchor", "AnnotateError", "StageAssignment", "anchors", "annotate_by_anchors", "has_tags", "tag_of"]


class AnnotateError(ValueError):
    """The requested stages cannot be cut from this graph; the message says why and what to do."""


@dataclass
class StageAssignment:
    """What the annotate pass decided: the stage count and, for tags, each stage's device."""

    num_stages: int
    tag_devices: list[str] | None
    reasons: list[str]


def annotate_by_tags(graph: fx.Graph) -> StageAssignment:
    """Stages from device_guard tags. Raises AnnotateError when the graph has none."""
    devices: list[str] = []
    reasons: list[str] = []
    current = -1
    for node in graph.nodes:
        tag = tag_of(node)
        if node.op in COMPUTE_OPS and tag is not None:
            if not devices or devices[-1] != tag:
                devices.append(tag)
                reasons.append(tag_source(node, block=True))
                current += 1
            node.meta[STAGE] = current
            node.meta[REASON] = tag_source(node)
    if not devices:
        raise AnnotateError(
            "split='tags' but forward() has no fxpipe.device_guard blocks; wrap parts of "
            "forward in `with fxpipe.device_guard('cpu'):`, or use Plan(split=['module.path', ...]) "
            "or Plan(split='auto')"
        )
    _fill_untagged(graph)
    return StageAssignment(len(devices), devices, reasons)


def _nearest_modules(path: str, known_modules: set[str]) -> str:
    """The module paths nearest to ``path`` (by spelling, then by containment), else the
    model's top-level modules, as the fix of an unknown split point."""
    known = sorted(m for m in known_modules if m)
    near = difflib.get_close_matches(path, known, n=5, cutoff=0.6)
    near += [m for m in known if (path in m or m in path) and m not in near]
    if near:
        return f"nearest: {', '.join(sorted(near[:5]))}"
    top = [m for m in known if "." not in m]
    return f"the model's top-level modules are {', '.join(top[:10])}{', …' if len(top) > 10 else ''}"


def annotate_by_split_points(graph: fx.Graph, split_points: Sequence[str], known_modules: set[str]) -> StageAssignment:
    """A new stage begins at the first node of each module path in ``split_points``."""
    nodes = list(graph.nodes)
    starts: list[int] = []
    for i, path in enumerate(split_points):
        if path not in known_modules:
            raise AnnotateError(f"plan.split[{i}] = {path!r} is not a module of the model; {_nearest_modules(path, known_modules)}")
        first = next(
            (k for k, n in enumerate(nodes) if n.op in COMPUTE_OPS and _within(n.meta.get(MODULE_PATH, ""), path)),
            None,
        )
        if first is None:
            _check_not_inside_opaque(nodes, i, path)
            raise AnnotateError(f"plan.split[{i}] = {path!r} is never called in forward(); pick a module that runs")
        if starts and first <= starts[-1]:
            raise AnnotateError(
                f"plan.split[{i}] = {path!r} starts at or before plan.split[{i - 1}] = {split_points[i - 1]!r} "
                "in program order; list split points in the order forward() reaches them, one per stage"
            )
        starts.append(first)
    node_reasons = ["before the first split point"] + [f"split point {p!r}" for p in split_points]
    _assign_from_starts(nodes, starts, node_reasons)
    _fix_sources(graph)
    reasons = ["before the first split point"] + [f"from split point {p!r}" for p in split_points]
    _check_nonempty(graph, len(starts) + 1, "plan.split")
    return StageAssignment(len(starts) + 1, None, reasons)


def _check_not_inside_opaque(nodes: list[fx.Node], index: int, path: str) -> None:
    """Raise AnnotateError when split point ``path`` runs inside a call the trace runs whole
    (``node.meta["opaque"]``): no stage can begin inside it."""
    for node in nodes:
        callee = node.meta.get(OPAQUE)
        if callee is not None and callee.contains(path):
            raise AnnotateError(
                f"plan.split[{index}] = {path!r} runs inside {callee.name}, which fxpipe runs as one opaque call "
                f"because torch.fx could not trace into it ({callee.reason}{f' at {callee.line}' if callee.line else ''}); "
                f"split at {node.meta.get(MODULE_PATH) or 'a module'} or outside it, or make it traceable "
                "(or trace with Plan(frontend='export'))"
            )


def annotate_by_cuts(graph: fx.Graph, starts: Sequence[fx.Node], reasons: Sequence[str], how: str) -> StageAssignment:
    """Stage ``k + 1`` begins at node ``starts[k]``, in program order: cuts chosen by a
    cost model (``split="auto"``). ``reasons``: one per stage, for ``explain()``; ``how``:
    what chose the cuts, for each node's reason. Raises AnnotateError when the starts are
    not in program order or leave a stage without computation."""
    nodes = list(graph.nodes)
    position = {node: k for k, node in enumerate(nodes)}
    indices = [position[node] for node in starts]
    if any(b <= a for a, b in zip(indices, indices[1:])) or (indices and indices[0] == 0):
        raise AnnotateError(f"{how}: stage starts {[n.name for n in starts]} are not in program order after the first node")
    _assign_from_starts(nodes, indices, [f"{how}, stage {k}" for k in range(len(starts) + 1)])
    _fix_sources(graph)
    _check_nonempty(graph, len(starts) + 1, how)
    return StageAssignment(len(starts) + 1, None, list(reasons))



def single_stage(graph: fx.Graph) -> StageAssignment:
    for node in graph.nodes:
        node.meta[STAGE] = 0
        node.meta[REASON] = "single stage"
    return StageAssignment(1, None, ["single stage"])


def _assign_from_starts(nodes: list[fx.Node], starts: list[int], node_reasons: list[str]) -> None:
    """Stage ``k`` runs the nodes from position ``starts[k - 1]`` up to ``starts[k]``."""
    stage = 0
    for k, node in enumerate(nodes):
        while stage < len(starts) and k >= starts[stage]:
            stage += 1
        node.meta[STAGE] = stage
        node.meta[REASON] = node_reasons[stage]


def _within(module_path: str, prefix: str) -> bool:
    return module_path == prefix or module_path.startswith(prefix + ".")


def _fill_untagged(graph: fx.Graph) -> None:
    for node in graph.nodes:
        if STAGE in node.meta and node.op in COMPUTE_OPS:
            continue
        inputs = [a for a in node.all_input_nodes if a.op != "get_attr" and a.meta.get(STAGE) is not None]
        if node.op == "placeholder":
            node.meta[STAGE], node.meta[REASON] = 0, "model input"
        elif node.op == "output":
            node.meta[STAGE] = max((a.meta[STAGE] for a in inputs), default=0)
            node.meta[REASON] = "model output"
        elif inputs:
            node.meta[STAGE] = max(a.meta[STAGE] for a in inputs)
            node.meta[REASON] = "untagged: follows its inputs"
        else:
            node.meta[STAGE] = None
    _fix_sources(graph)


def _fix_sources(graph: fx.Graph) -> None:
    """Placeholders to stage 0; attributes and input-free nodes to their earliest user."""
    for node in reversed(graph.nodes):
        if node.op == "placeholder":
            node.meta[STAGE], node.meta[REASON] = 0, "model input"
        elif node.op == "get_attr" or (node.op != "output" and not node.all_input_nodes) or node.meta.get(STAGE) is None:
            users = [u.meta[STAGE] for u in node.users if u.meta.get(STAGE) is not None]
            if users:
                node.meta[STAGE] = min(users)
                node.meta[REASON] = "parameter/constant: with its first user" if node.op == "get_attr" else "no inputs: with its first user"
            elif node.meta.get(STAGE) is None:
                node.meta[STAGE], node.meta[REASON] = 0, "unused"
    # the output node gathers whatever the model returns in the last stage
    last = max(n.meta[STAGE] for n in graph.nodes)
    for node in graph.nodes:
        if node.op == "output":
            node.meta[STAGE] = last


def _check_nonempty(graph: fx.Graph, num_stages: int, field: str) -> None:
    counts = [0] * num_stages
    for node in graph.nodes:
        if node.op in COMPUTE_OPS:
            counts[node.meta[STAGE]] += 1
    empty = [i for i, c in enumerate(counts) if c == 0]
    if empty:
        raise AnnotateError(f"{field} leaves stage(s) {empty} without any computation; remove or move split points")


def check_monotone(graph: fx.Graph) -> None:
    """Raise AnnotateError if some node runs in an earlier stage than one of its inputs."""
    for node in graph.nodes:
        for arg in node.all_input_nodes:
            if arg.op != "get_attr" and arg.meta[STAGE] > node.meta[STAGE]:
                raise AnnotateError(
                    f"node {node.name!r} (stage {node.meta[STAGE]}, module {node.meta.get(MODULE_PATH)!r}) "
                    f"uses {arg.name!r} from the later stage {arg.meta[STAGE]}: stages must follow program order; "
                    "tag the node's block with the later device or move the split point"
                )


@dataclass(frozen=True)
class Anchor:
    """Where a stage begins, in terms that hold in any trace of the same model: the module
    whose forward made the stage's first compute node (``module_path``), that node's
    operation (``op``) and how many nodes of that operation the module made before it
    (``occurrence``). Node names and positions change between traces; these do not."""

    module_path: str
    op: str
    occurrence: int

    def __str__(self) -> str:
        return f"{self.op} #{self.occurrence} in module '{self.module_path or '(root)'}'"


def _op_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, str):
        name = "" if node.op == "call_module" else target  # a module's path is its anchor's path
    else:
        name = getattr(target, "__qualname__", None) if not hasattr(target, "_schema") else None
        name = name or str(target)
    return f"{node.op}:{name}"


def _anchored(graph: fx.Graph) -> Iterator[tuple[fx.Node, Anchor]]:
    """Every compute node with its Anchor, in program order."""
    seen: dict[tuple[str, str], int] = {}
    for node in graph.nodes:
        if node.op in COMPUTE_OPS:
            path, op = node.meta.get(MODULE_PATH, ""), _op_name(node)
            count = seen.get((path, op), 0)
            seen[(path, op)] = count + 1
            yield node, Anchor(path, op, count)


def anchors(graph: fx.Graph) -> list[Anchor]:
    """Where each stage after the first begins in an annotated graph (``node.meta["stage"]``),
    as Anchors: the first compute node of stage k, in program order, for k = 1, 2, ...

    Re-applied by :func:`annotate_by_anchors` to another trace of the model (another input
    signature), they give the same stage boundaries, so a cut found once (``split="auto"``)
    never moves. Raises AnnotateError when a stage has no compute node.
    """
    first: dict[int, Anchor] = {}
    for node, anchor in _anchored(graph):
        first.setdefault(node.meta[STAGE], anchor)
    num_stages = max(first, default=0) + 1
    missing = [k for k in range(num_stages) if k not in first]
    if missing:
        raise AnnotateError(f"stage(s) {missing} have no compute node: no anchor to find them again")
    return [first[k] for k in range(1, num_stages)]


def annotate_by_anchors(graph: fx.Graph, stage_anchors: Sequence[Anchor], reasons: Sequence[str] | None = None) -> StageAssignment:
    """Stages of another trace cut where :func:`anchors` found them: stage k begins at the
    node matching ``stage_anchors[k - 1]`` and runs to the next one, in program order.

    Placeholders are stage 0, ``get_attr`` nodes and nodes without inputs go with their
    first user, the output with the last stage (the rule every split shares). ``reasons`` (one per stage) default to naming the anchor. Returns the
    StageAssignment. Raises AnnotateError naming the anchor this graph lacks, or the two
    anchors it finds out of order.
    """
    starts: dict[Anchor, fx.Node] = {}
    wanted = set(stage_anchors)
    for node, anchor in _anchored(graph):
        if anchor in wanted and anchor not in starts:
            starts[anchor] = node
    lacking = [a for a in stage_anchors if a not in starts]
    if lacking:
        raise AnnotateError(
            f"this trace has no {lacking[0]}, where stage {list(stage_anchors).index(lacking[0]) + 1} began in the "
            "first trace: the model runs other code for this input signature; use split points at module "
            "boundaries (Plan(split=['module.path', ...])), which every signature reaches"
        )
    position = {node: k for k, node in enumerate(graph.nodes)}
    order = [position[starts[a]] for a in stage_anchors]
    for k in range(1, len(order)):
        if order[k] <= order[k - 1]:
            raise AnnotateError(f"stage {k + 1} begins at {stage_anchors[k]}, before stage {k}'s {stage_anchors[k - 1]} in this trace")
    num_stages = len(stage_anchors) + 1
    reasons = list(reasons) if reasons is not None else ["before the first anchor"] + [f"begins at {a}" for a in stage_anchors]
    _assign_from_starts(list(graph.nodes), order, reasons)
    _fix_sources(graph)
    _check_nonempty(graph, num_stages, "the anchors")
    return StageAssignment(num_stages, None, reasons)
