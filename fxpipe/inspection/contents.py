"""What each stage holds, in the model's own names: module ranges and crossing values.

A stage's contents name the modules it runs as the model names them, as few as possible:

- a module whose every node runs in the stage is named whole (``lm_head``), its children
  not at all;
- a run of numbered siblings becomes a range (``transformer.h.0 – transformer.h.5``);
- a numbered block the cut falls inside (a decoder layer, a ResNet bottleneck) says which
  part each stage holds: ``transformer.h.6 (up to ln_1)`` in one stage,
  ``transformer.h.6 (from attn) – transformer.h.11`` in the next; a part inside a leaf
  module reads ``part of mlp.act``.

So no module is named whole by two stages, and the ranges of consecutive stages meet
without overlapping. Values crossing stages are named by the module that produces them
(``transformer.h.5 · add``), with the fx node name kept for the partitioned graph.
Plain functions over module paths and graph nodes: no pass runs, nothing is written.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch.fx as fx

from fxpipe.passes.meta import EDGE, MODULE_PATH
from fxpipe.passes.partition import fxpipe_send

RANGE = " – "


@dataclass(frozen=True)
class Piece:
    """One named module of a stage's contents; ``part`` says which part of a block the
    stage holds ("" when whole), ``cut_before`` / ``cut_after`` whether the block's
    beginning / end lies in another stage."""

    path: str
    part: str = ""
    cut_before: bool = False
    cut_after: bool = False

    @property
    def label(self) -> str:
        return f"{self.path} ({self.part})" if self.part else self.path


class ModuleTree:
    """The model's modules as the stages' nodes name them: children in order of first
    appearance, and the stages running nodes under each module."""

    def __init__(self, paths_per_stage: Sequence[Sequence[str]]) -> None:
        self.children: dict[str, list[str]] = defaultdict(list)
        self.owners: dict[str, set[int]] = defaultdict(set)
        for stage, paths in enumerate(paths_per_stage):
            for path in paths:
                if not path:
                    continue
                parts = path.split(".")
                for depth in range(1, len(parts) + 1):
                    module, parent = ".".join(parts[:depth]), ".".join(parts[: depth - 1])
                    if module not in self.owners:
                        self.children[parent].append(module)
                    self.owners[module].add(stage)

    def pieces(self, stage: int) -> list[Piece]:
        """The modules ``stage`` runs, whole or in part, in the model's order."""
        found: list[Piece] = []

        def visit(module: str) -> None:
            owners = self.owners[module]
            if stage not in owners:
                return
            if owners == {stage}:
                found.append(Piece(module))
            elif _is_block(module) or not self.children[module]:
                found.append(self._part(module, stage))
            else:
                for child in self.children[module]:
                    visit(child)

        for top in self.children[""]:
            visit(top)
        return found

    def _part(self, module: str, stage: int) -> Piece:
        """``module`` split between stages: the part ``stage`` holds."""
        owners = self.owners[module]
        before, after = stage > min(owners), stage < max(owners)
        if not self.children[module]:
            return Piece(module, "part", before, after)
        first, last = self._edge_child(module, stage, 0), self._edge_child(module, stage, -1)
        if before and after:
            part = f"from {first} to {last}"
        else:
            part = f"from {first}" if before else f"up to {last}"
        return Piece(module, part, before, after)

    def _edge_child(self, module: str, stage: int, end: int) -> str:
        """The first (``end`` 0) or last (-1) descendant of ``module`` that ``stage`` runs
        whole, relative to ``module``; ``part of X`` when the cut falls inside a leaf X."""
        node = module
        while True:
            held = [c for c in self.children[node] if stage in self.owners[c]]
            if not held:
                relative = node[len(module) + 1 :]
                return f"part of {relative}" if relative else "its own operations"
            node = held[end]
            if self.owners[node] == {stage}:
                return node[len(module) + 1 :]


def _is_block(module: str) -> bool:
    """A numbered child of a container (``transformer.h.6``, ``layer2.0``): a repeated block."""
    return module.rpartition(".")[2].isdigit()


def _follows(a: Piece, b: Piece) -> bool:
    """Whether ``b`` continues a range ending at ``a``: numbered siblings one apart, with no
    cut between them."""
    parent_a, _, index_a = a.path.rpartition(".")
    parent_b, _, index_b = b.path.rpartition(".")
    return (
        index_a.isdigit() and index_b.isdigit() and parent_a == parent_b
        and int(index_b) == int(index_a) + 1 and not a.cut_after and not b.cut_before
    )


def outline(pieces: Sequence[Piece]) -> list[str]:
    """Joins runs of numbered siblings into ranges: ``["transformer.h.0 – transformer.h.5", "lm_head"]``."""
    runs: list[list[Piece]] = []
    for piece in pieces:
        if runs and _follows(runs[-1][-1], piece):
            runs[-1].append(piece)
        else:
            runs.append([piece])
    return [run[0].label if len(run) == 1 else run[0].label + RANGE + run[-1].label for run in runs]


def stage_contents(paths_per_stage: Sequence[Sequence[str]]) -> list[list[str]]:
    """Returns, per stage, what it runs as module names and ranges (see the module's
    docstring). A stage that runs no module's children, only containers' own forward code,
    names those containers (``transformer (its own operations)``); ``(root)`` the model's."""
    tree = ModuleTree(paths_per_stage)
    contents = []
    for stage, paths in enumerate(paths_per_stage):
        own = [f"{p} (its own operations)" for p in dict.fromkeys(paths) if p]
        contents.append(outline(tree.pieces(stage)) or own or ["(root)"])
    return contents


# ------------------------------------------------------------ crossing values
def value_origin(node: fx.Node) -> str:
    """What produced ``node``'s value, in the model's terms: ``input input_ids``,
    ``layer2.3.relu`` (a module's output), ``transformer.h.5 · add`` (an operation inside
    a module's forward), ``(root) · add`` (one in the model's own forward)."""
    if node.op == "placeholder":
        return f"input {node.name}"
    path = node.meta.get(MODULE_PATH, "")
    if node.op == "call_module":
        return path or str(node.target)
    return f"{path or '(root)'} · {operation_name(node)}"


def operation_name(node: fx.Node) -> str:
    """A node's operation without namespace or overload: ``tanh`` for ``aten.tanh.default``,
    ``add`` for ``operator.add``, ``view`` for the method ``.view``."""
    target = node.target
    if isinstance(target, str):
        return target
    packet = getattr(target, "overloadpacket", None)
    name = getattr(packet or target, "__name__", str(target))
    return name.rpartition(".")[2]


def crossing_values(graph: fx.Graph) -> dict[str, str]:
    """Maps each value crossing stages (by its edge name, the producing node's name) to
    :func:`value_origin` of its producer, read off the partitioned graph's send nodes."""
    return {
        node.meta[EDGE].name: value_origin(node.args[0])
        for node in graph.nodes
        if node.op == "call_function" and node.target is fxpipe_send
    }


__all__ = ["ModuleTree", "Piece", "crossing_values", "operation_name", "outline", "stage_contents", "value_origin"]
