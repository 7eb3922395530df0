"""``fxpipe.device_guard``: PaddlePaddle-style device tags written in ``forward``.

Built on ``torch.fx.traceback.annotate``: while fxpipe traces a model (either frontend,
with ``preserve_node_meta`` on) every node created inside the block records
``node.meta["custom"]["fxpipe_device"]``. Blocks nest and the innermost wins. Outside
fxpipe's tracing the guard does nothing at all, so the model runs eagerly unchanged.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from torch.fx import traceback as fx_traceback

from fxpipe.devices import normalize_device

TAG_KEY = "fxpipe_device"

_state = threading.local()


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
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def device_guard(device: str) -> Iterator[None]:
    """Run the enclosed part of ``forward`` on ``device`` ("cpu", "cpu:N", "cuda:N", "gpu:N").

    A no-op in eager mode. While fxpipe traces, every node created inside is tagged with
    the canonical device name; the annotate pass turns each contiguous run of one tag
    into a pipeline stage. Raises DeviceError for an unknown device name.
    """
    name = normalize_device(device, where="device_guard")
    if not is_tracing():
        yield
        return
    with fx_traceback.annotate({TAG_KEY: name}):
        yield
