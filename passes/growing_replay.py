"""Example values of a graph while fx is still building it.

The fx frontend asks, mid-trace, what a traced value is for the example call (a size a
Python branch compares, what an opaque callee returns). :class:`GrowingReplay` answers
with a :class:`~fxpipe.passes.fake_replay.FakeReplay` run over the graph as it grows:
nodes are only ever added at the end (and a failed attempt's removed from the end), so
each node runs once, in order, when a value at or after it is first asked for, and
repeated layers reuse one template. A node that cannot run on fake tensors (data-dependent
output shapes, no fake kernel) is unknown, and so is everything computed from it; one that
ran for real on zeros instead (the replay's fallback) is data-dependent, and so is
everything computed from it.
Writes no ``node.meta`` keys.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch.fx as fx

from fxpipe.passes.fake_replay import FakeReplay
from fxpipe.passes.tags import TagError

UNKNOWN = object()  # the value of a node the replay could not run


class GrowingReplay:
    """A fake run of ``graph`` that keeps up with it as it grows.

    resolve: target -> module or tensor; inputs: a placeholder's example value;
    real_inputs: whether those values are the example's own (else only their shapes count).
    ``replay`` is the underlying FakeReplay (values, keys, templates, runs).
    """

    def __init__(self, graph: fx.Graph, resolve: Callable[[str], Any], inputs: Callable[[fx.Node], Any], real_inputs: bool = True) -> None:
        self.graph, self.resolve, self.inputs = graph, resolve, inputs
        self.replay = FakeReplay(real_inputs=real_inputs)
        self._done: set[fx.Node] = set()
        self._dependent: set[fx.Node] = set()
        self._last: fx.Node | None = None

    def value(self, node: fx.Node, around: Callable[[fx.Node], contextlib.AbstractContextManager] | None = None) -> Any:
        """``node``'s value (UNKNOWN if it could not run), after running every node made
        since the last call; ``around(n)`` gives a context to run node ``n`` in. Raises
        TagError from a node (a device_guard where none may be)."""
        for pending in self._pending():
            with around(pending) if around is not None else contextlib.nullcontext():
                self._run(pending)
        return self.replay.values.get(node, UNKNOWN)

    def data_dependent(self, node: fx.Node) -> bool:
        """Whether ``node``'s value depends on a node that ran for real on zeros (its sizes
        may be another call's: a branch on them cannot be taken once for all)."""
        return node in self._dependent

    def forget(self, gone: set[fx.Node]) -> None:
        """Drop what was recorded for nodes erased from the graph (a rolled-back attempt)."""
        for node in gone:
            for table in (self.replay.values, self.replay.keys, self.replay.templates):
                table.pop(node, None)
        self._done -= gone
        self._dependent -= gone
        if self._last in gone:
            self._last = next((n for n in reversed(self.graph.nodes) if n in self._done), None)

    def _pending(self) -> Iterator[fx.Node]:
        node = self._last.next if self._last is not None else next(iter(self.graph.nodes), None)
        pending = []
        while node is not None and node.op != "root":
            pending.append(node)
            node = node.next
        return iter(pending)

    def _run(self, node: fx.Node) -> None:
        self._done.add(node)
        self._last = node
        if any(self.replay.values.get(a, UNKNOWN) is UNKNOWN for a in node.all_input_nodes):
            return  # an input could not run: neither can this node
        try:
            self.replay.step(node, self.resolve, self.inputs(node) if node.op == "placeholder" else None)
            if node in self.replay.estimated or (not _reads_rank_or_type(node) and any(a in self._dependent for a in node.all_input_nodes)):
                self._dependent.add(node)
        except TagError:
            raise
        except Exception:  # noqa: BLE001 - unknown from here on (data-dependent, or no fake kernel)
            self.replay.values.pop(node, None)


_RANK_OR_TYPE = {"dim", "ndimension", "ndim", "dtype", "device", "layout", "is_floating_point", "is_complex", "is_cuda"}


def _reads_rank_or_type(node: fx.Node) -> bool:
    """Whether a node reads only what does not depend on tensor values, even of a tensor
    whose sizes do (``x.dim()``, ``x.dtype``)."""
    if node.op == "call_method":
        return node.target in _RANK_OR_TYPE
    return node.op == "call_function" and node.target is getattr and len(node.args) > 1 and node.args[1] in _RANK_OR_TYPE
