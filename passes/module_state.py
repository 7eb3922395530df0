"""Tracing never changes the model: every submodule's attributes restored after a trace.

Some models (timm's levit, efficientformer) cache values in attributes while they run,
which leaves proxies behind after a symbolic trace; :func:`preserved_module_state`
snapshots and restores them. :class:`WriteJournal` undoes the writes of one failed trace
attempt. Writes no ``node.meta`` keys.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from fxpipe.passes.trace_errors import is_internal
from fxpipe.passes.traced_values import holds_proxy


@contextlib.contextmanager
def preserved_module_state(model: nn.Module) -> Iterator[None]:
    """Restore every submodule's attributes after the block (and drop leaked proxies).

    Containers held in attributes (dicts, lists, sets: caches) are copied one level deep,
    so a cache filled during tracing is emptied back to what it held before.
    """
    saved = []
    for module in model.modules():
        state = {}
        for key, value in module.__dict__.items():
            if isinstance(value, dict | list | set):
                value = type(value)(value) if not isinstance(value, dict) else dict(value)
            state[key] = value
        originals = {k: v for k, v in module.__dict__.items() if isinstance(v, dict | list | set)}
        saved.append((module, state, originals))
    try:
        yield
    finally:
        for module, state, originals in saved:
            module.__dict__.clear()
            for key, value in state.items():
                original = originals.get(key)
                if original is not None:
                    # refill the user's own container object so outside references stay valid
                    original.clear()
                    if isinstance(original, dict):
                        original.update(value)
                    elif isinstance(original, list):
                        original.extend(value)
                    else:
                        original.update(value)
                    value = original
                module.__dict__[key] = value


_ABSENT = object()
_STORES = ("_parameters", "_buffers", "_modules")


class WriteJournal:
    """Module attributes written while it is open (``nn.Module.__setattr__``), undoable.

    A trace attempt that fails is rolled back: the attributes it set to traced values (a
    cache, such as torchvision's ``AnchorGenerator.cell_anchors``) are set back too, so the
    next attempt does not read values of erased nodes. Writes of other values stay: they
    may record effects the journal cannot undo (transformers' ``_output_capturing_hooks_installed``
    marks hooks registered on submodules; set back, the next attempt registers them twice
    and records every hidden state twice). ``recording()`` says whether a write is journaled
    (the tracer's thread while it traces). Writes into containers an attribute holds are
    not seen.
    """

    def __init__(self, recording: Callable[[], bool]) -> None:
        self.recording = recording
        self._entries: list[tuple[nn.Module, str, str | None, Any]] = []
        self._original = nn.Module.__setattr__

    def __enter__(self) -> WriteJournal:
        journal, original = self, self._original

        def journaled(module: nn.Module, name: str, value: Any) -> None:
            # the model's own writes; fx's (the constants it stores on the root) it keeps track of
            if journal.recording() and holds_proxy(value) and not is_internal(sys._getframe(1).f_code.co_filename):
                journal._entries.append((module, name, *_current(module, name)))
            original(module, name, value)

        nn.Module.__setattr__ = journaled
        return self

    def __exit__(self, *exc: Any) -> None:
        nn.Module.__setattr__ = self._original

    def mark(self) -> int:
        return len(self._entries)

    def undo(self, mark: int) -> None:
        """Set back every attribute written since ``mark``, newest first."""
        while len(self._entries) > mark:
            module, name, store, value = self._entries.pop()
            for where in _STORES:
                getattr(module, where).pop(name, None)
            module.__dict__.pop(name, None)
            if value is not _ABSENT:
                (getattr(module, store) if store else module.__dict__)[name] = value


def _current(module: nn.Module, name: str) -> tuple[str | None, Any]:
    """Where an attribute lives (a store of parameters, buffers, modules, or the instance
    dict: None) and its value, or (None, absent)."""
    for where in _STORES:
        store = module.__dict__.get(where, {})
        if name in store:
            return where, store[name]
    return None, module.__dict__.get(name, _ABSENT)
