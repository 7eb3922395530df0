"""``fxpipe.device_guard``: PaddlePaddle-style device tags written in ``forward``.

Built on ``torch.fx.traceback.annotate`` (see ``fxpipe.passes.tags``): while fxpipe
traces a model every node created inside the block records
``node.meta["custom"]["fxpipe_device"]``. Blocks nest and the innermost wins. Outside
fxpipe's tracing the guard does nothing at all, so the model runs eagerly unchanged.
"""

from __future__ import annotations

import contextlib
import sys
from contextlib import AbstractContextManager

from fxpipe.devices import DeviceError, normalize_device
from fxpipe.passes.tags import TagError, is_tracing, tagged


class DeviceGuardError(DeviceError, TagError):
    """An unknown device in a ``device_guard`` block; the message names the line of forward."""


def device_guard(device: str) -> AbstractContextManager[None]:
    """Run the enclosed part of ``forward`` on ``device`` ("cpu", "cpu:N", "cuda:N", "gpu:N").

    A no-op in eager mode. While fxpipe traces, every node created inside is tagged with
    the canonical device name; the annotate pass turns each contiguous run of one tag
    into a pipeline stage. Raises DeviceError (a DeviceGuardError) for an unknown device
    name, naming the file and line of ``forward`` that opened the block, eagerly and while
    compiling alike (tracing stops there instead of trying another frontend).
    """
    caller = sys._getframe(1)
    where = f"fxpipe.device_guard({device!r}) at {caller.f_code.co_filename}:{caller.f_lineno} in {caller.f_code.co_name}()"
    try:
        name = normalize_device(device, where)
    except DeviceError as err:
        # raised here, not inside normalize_device: the traceback ends at the user's line
        raise DeviceGuardError(str(err)) from None
    return tagged(name, where) if is_tracing() else contextlib.nullcontext()
