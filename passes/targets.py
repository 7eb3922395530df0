"""Node targets to objects: the module or tensor a ``call_module`` / ``get_attr`` node names.

A target is a dotted path (``layer3.0.conv1``, ``_tensor_constant0``). The compiler looks
targets up on several roots in turn: the user's model first (its names, its tied tensors),
then the traced root (export's constants and higher-order-op submodules), then, once the
graph is cut, the stage modules.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any


def lookup(roots: Sequence[Any], target: str) -> Any:
    """The attribute at dotted path ``target`` of the first of ``roots`` that has it.

    Raises AttributeError when none has it.
    """
    for root in roots:
        try:
            return functools.reduce(getattr, target.split("."), root)
        except AttributeError:
            continue
    raise AttributeError(f"none of {len(roots)} root module(s) holds {target!r}")


def resolver(*roots: Any) -> Callable[[str], Any]:
    """``resolve(target)``: :func:`lookup` over ``roots``, the form every pass takes."""
    return functools.partial(lookup, roots)
