"""Device tags in ``forward``: the tracing switch that ``fxpipe.device_guard`` consults.

While fxpipe traces a model (either frontend) the current thread is marked as tracing and
``torch.fx.traceback.preserve_node_meta`` is on, so every node created inside a
``device_guard`` block records ``node.meta["custom"]["fxpipe_device"]``. Outside tracing
the guard does nothing. The annotate pass reads the tags back with :func:`tag_of`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch.fx as fx
from torch.fx import traceback as fx_traceback

from fxpipe.passes.meta import CUSTOM, TAG_KEY, TAG_SOURCE

_state = threading.local()


class TagError(ValueError):
    """A ``device_guard`` in the model's own ``forward`` is wrong (an unknown device).

    Every frontend would stop at the same line, so the trace pass re-raises it unchanged
    instead of trying the next frontend and wrapping it in a TraceError.
    """


@contextlib.contextmanager
def tracing() -> Iterator[None]:
    """Mark the current thread as tracing for fxpipe (guards record tags inside)."""
    depth = getattr(_state, "depth", 0)
    _state.depth = depth + 1
    try:
        with fx_traceback.preserve_node_meta():
            yield
    finally:
        _state.depth = depth


def is_tracing() -> bool:
    """Whether fxpipe is tracing on this thread."""
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def opaque_scope(callee: str) -> Iterator[None]:
    """Mark the code run inside as an opaque callee's (described by ``callee``): the trace
    runs it whole, so a ``device_guard`` there cannot be honoured (``tagged`` raises)."""
    previous = getattr(_state, "opaque", None)
    _state.opaque = callee
    try:
        yield
    finally:
        _state.opaque = previous


@contextlib.contextmanager
def tagged(device: str, where: str = "a device_guard") -> Iterator[None]:
    """Tag every node created inside with ``device`` (a canonical device name).

    Raises TagError naming ``where`` (the guard's source line) and the callee when the
    block is inside an opaque callee (see :func:`opaque_scope`)."""
    callee = getattr(_state, "opaque", None)
    if callee is not None:
        raise TagError(
            f"{where} is inside {callee}, which fxpipe runs as one opaque call (fx cannot trace into it): "
            "its nodes cannot go to another device; move the device_guard out of it, or make the callee traceable"
        )
    with fx_traceback.annotate({TAG_KEY: device}):
        yield


def tag_of(node: fx.Node) -> str | None:
    """The device_guard tag of a node, or None."""
    custom = node.meta.get(CUSTOM) or {}
    return custom.get(TAG_KEY)


def tag_source(node: fx.Node, block: bool = False) -> str:
    """What tagged a node, for ``explain()``: ``device_guard('cuda:1')`` (with ``block``:
    ``device_guard('cuda:1') block``), or the move in forward that set it (``passes/moves.py``)."""
    custom = node.meta.get(CUSTOM) or {}
    if custom.get(TAG_SOURCE):
        return custom[TAG_SOURCE]
    return f"device_guard({custom.get(TAG_KEY)!r})" + (" block" if block else "")


def has_tags(graph: fx.Graph) -> bool:
    """Whether any node of ``graph`` carries a device_guard tag."""
    return any(tag_of(n) is not None for n in graph.nodes)
