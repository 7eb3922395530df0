"""What ``torch.fx`` cannot record, refused while the fx tracer traces.

Changing or reading grad mode or autocast inside ``forward`` (``with torch.no_grad():``,
``torch.autocast(...)``, ``torch.is_autocast_enabled()``) takes effect while tracing and
leaves nothing in the graph: :func:`untraceable_contexts` makes it an error there
(:class:`UntraceableContext`), so the fx tracer runs the enclosing function or module whole
instead, and it behaves as in eager. Writes no ``node.meta`` keys.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx

from fxpipe.passes.trace_errors import is_internal


class UntraceableContext(RuntimeError):
    """forward changes or reads grad mode or autocast, which fx cannot record."""


@contextlib.contextmanager
def untraceable_contexts(tracing: Callable[[], bool], length_of: Callable[[fx.Proxy], int | None]) -> Iterator[None]:
    """While ``tracing()`` (the tracer's thread, tracing), entering ``torch.no_grad``/``enable_grad``/``inference_mode``/
    ``torch.autocast`` or reading grad mode or autocast raises UntraceableContext, so the
    enclosing function or module runs whole (and behaves as in eager); ``len()`` of a proxy
    (fx's ``Attribute`` proxies too) is ``length_of(proxy)`` where that is not None (the
    tracer's own proxies, answered from the example)."""

    def refuse(what: str, original: Callable, internal_ok: bool) -> Callable:
        def guarded(*args: Any, **kwargs: Any) -> Any:
            if tracing() and not (internal_ok and is_internal(sys._getframe(1).f_code.co_filename)):
                raise UntraceableContext(f"{what} inside forward: fx cannot record a change of grad mode or autocast")
            return original(*args, **kwargs)

        return guarded

    patches = [
        (fx.Proxy, "__len__", "len", False),  # every proxy, fx's Attribute ones too: len() from the example
        (torch.amp.autocast_mode.autocast, "__enter__", "with torch.autocast(...)", False),
        (torch.autograd.grad_mode.no_grad, "__enter__", "with torch.no_grad()", False),
        (torch.autograd.grad_mode.enable_grad, "__enter__", "with torch.enable_grad()", False),
        (torch.autograd.grad_mode.inference_mode, "__enter__", "with torch.inference_mode()", False),
        (torch.autograd.grad_mode.set_grad_enabled, "__init__", "torch.set_grad_enabled(...)", False),
        (torch, "is_autocast_enabled", "torch.is_autocast_enabled()", True),
        (torch, "is_grad_enabled", "torch.is_grad_enabled()", True),
    ]

    def length(proxy: fx.Proxy) -> int:
        answer = length_of(proxy) if tracing() else None
        return original_len(proxy) if answer is None else answer

    original_len = fx.Proxy.__len__
    # torch caches these tables on first use: built while the patches stand, they would hold
    # the patched functions (and through them this tracer and the user's model) for good
    torch.overrides.get_ignored_functions()
    torch.overrides.get_overridable_functions()
    saved = [(owner, name, getattr(owner, name)) for owner, name, _, _ in patches]
    try:
        for owner, name, what, internal_ok in patches:
            setattr(owner, name, length if what == "len" else refuse(what, getattr(owner, name), internal_ok))
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
