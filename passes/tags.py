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

from fxpipe.passes.meta import CUSTOM, TAG_KEY

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
def tagged(device: str) -> Iterator[None]:
    """Tag every node created inside with ``device`` (a canonical device name)."""
    with fx_traceback.annotate({TAG_KEY: device}):
        yield


def tag_of(node: fx.Node) -> str | None:
    """The device_guard tag of a node, or None."""
    custom = node.meta.get(CUSTOM) or {}
    return custom.get(TAG_KEY)


def has_tags(graph: fx.Graph) -> bool:
    """Whether any node of ``graph`` carries a device_guard tag."""
    return any(tag_of(n) is not None for n in graph.nodes)
