"""The model's plain Python attributes, held to their compile-time values.

A trace bakes what forward reads of the model's Python attributes (``x * self.scale``,
``if self.use_bias:``) into the graph, and the stages run copies of the model's modules,
whose attributes (``Dropout.p``, ``LayerNorm.eps``) were copied at compile time. The
tensors are the model's own (:mod:`fxpipe.runtime.placement`), so a change to the model's
weights is seen; a change to such an attribute would not be. :class:`AttributeGuard`
snapshots every public attribute of every submodule that holds a plain value (numbers,
strings, booleans, None, dtypes, devices, and lists or tuples of them) and, before each
call, names the first one that changed, so the pipeline never runs on a stale value.
``training`` is left out: ``pipe.train()`` / ``pipe.eval()`` set the stages' mode.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any

import torch
from torch import nn

_PLAIN = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)
_MISSING = object()


class AttributeChangedError(RuntimeError):
    """An attribute of the model changed after compile; the message names it."""


def _plain(value: Any) -> bool:
    if isinstance(value, _PLAIN):
        return True
    return isinstance(value, (tuple, list)) and all(_plain(v) for v in value)


def _same(old: Any, new: Any) -> bool:
    if old is new:
        return True
    try:
        return type(old) is type(new) and bool(old == new)
    except Exception:  # noqa: BLE001 - values that do not compare are not known to be the same
        return False


class AttributeGuard:
    """The plain attributes of ``model``'s submodules, as they are now. The modules are
    held weakly: the pipeline does not keep the user's model alive, and a module nobody
    holds any more cannot change."""

    def __init__(self, model: nn.Module) -> None:
        self._watched: list[tuple[str, weakref.ref, str, Any]] = []  # (module path, module, name, value)
        for path, module in model.named_modules():
            for name, value in vars(module).items():
                if not name.startswith("_") and name != "training" and _plain(value):
                    self._watched.append((path, weakref.ref(module), name, copy.copy(value)))

    def check(self) -> None:
        """Raise AttributeChangedError naming the first watched attribute whose value changed."""
        for path, ref, name, old in self._watched:
            module = ref()
            if module is None:
                continue
            new = vars(module).get(name, _MISSING)
            if not _same(old, new):
                where = f"{path}.{name}" if path else name
                now = "deleted" if new is _MISSING else f"now {new!r}"
                raise AttributeChangedError(
                    f"the model's attribute {where!r} changed after compile (it was {old!r}, {now}): the pipeline's "
                    "stages were traced and copied with the old value and would go on using it. Compile the model "
                    "again after changing it (fxpipe.compile), set it back, or pass the value to forward as an argument"
                )
