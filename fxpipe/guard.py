"""``fxpipe.device_guard``: PaddlePaddle-style device tags written in ``forward``.

Built on ``torch.fx.traceback.annotate`` (see ``fxpipe.passes.tags``): while fxpipe
traces a model every node created inside the block records
``node.meta["custom"]["fxpipe_device"]``. Blocks nest and the innermost wins. Outside
fxpipe's tracing the guard does nothing at all, so the model runs eagerly unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from fxpipe.devices import normalize_device
from fxpipe.passes.tags import is_tracing, tagged


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
    with tagged(name):
        yield
