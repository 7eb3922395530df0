"""Tracing never changes the model: every submodule's attributes restored after a trace.

Some models (timm's levit, efficientformer) cache values in attributes while they run,
which leaves proxies behind after a symbolic trace; :func:`preserved_module_state`
snapshots and restores them. Writes no ``node.meta`` keys.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn


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
