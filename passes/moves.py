"""Hand placement read as tags: ``x.to("cuda:1")`` / ``x.cuda(1)`` in ``forward``.

PyTorch's model-parallel tutorial places a model by hand: ``self.net2(x.to("cuda:1"))``.
While fxpipe traces, such a move of a traced tensor to a CUDA device is read as a
device tag (``passes/tags.py``), as if a ``device_guard`` opened there and lasted up to the
next move: the nodes created after it carry ``node.meta["custom"]["fxpipe_device"]``. The
move itself leaves no node in the graph (what is left of it is a dtype change, when it
asked for one): a stage's device decides where its values live, and the send/recv between
stages moves them, so a plan may map the tutorial's ``cuda:0``/``cuda:1`` on other devices
(two CPUs) and a machine without CUDA can plan it.

:func:`read_move` tells a move from any other ``.to`` call; :class:`MovesIgnored` runs the
user's own ``forward`` (on fake tensors, as the compiler asks it questions) with those moves
left out, as the trace leaves them out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["Move", "MovesIgnored", "read_move"]

# the arguments of Tensor.to that may stand next to a device and still leave nothing to do
_NOTHING_LEFT = {"non_blocking"}


@dataclass(frozen=True)
class Move:
    """A move read as a tag: the canonical CUDA device (``"cuda:N"``) and what the call asks
    besides (a dtype, ``copy=``), as ``Tensor.to`` arguments without the device."""

    device: str
    args: tuple = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    @property
    def leaves_nothing(self) -> bool:
        """Whether the call is a move only (``x.to("cuda:1", non_blocking=True)``)."""
        return not self.args and set(self.kwargs) <= _NOTHING_LEFT


def _cuda_name(device: Any) -> str | None:
    """``"cuda:N"`` for a CUDA device given as a string, ``torch.device`` or index; else None."""
    if isinstance(device, int) and not isinstance(device, bool):
        return f"cuda:{device}"
    if isinstance(device, str | torch.device):
        try:
            parsed = torch.device(device)
        except RuntimeError:
            return None
        if parsed.type == "cuda":
            return f"cuda:{parsed.index or 0}"
    return None


def read_move(method: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Move | None:
    """The move a call ``tensor.<method>(*args, **kwargs)`` makes, when ``method`` is ``to`` or
    ``cuda`` and the device is a constant CUDA device; None for any other call (a dtype only,
    ``"cpu"``, a device read from a traced tensor)."""
    kwargs = dict(kwargs)
    if method == "cuda":
        device = kwargs.pop("device", args[0] if args else None)
        name = "cuda:0" if device is None else _cuda_name(device)
        rest = {k: v for k, v in kwargs.items() if k != "non_blocking"}
        return Move(name, (), rest) if name is not None else None
    if method != "to":
        return None
    if "device" in kwargs:
        name = _cuda_name(kwargs.pop("device"))
        return Move(name, tuple(args), kwargs) if name is not None else None
    if args and not isinstance(args[0], torch.dtype):
        name = _cuda_name(args[0]) if not isinstance(args[0], int) else None
        return Move(name, tuple(args[1:]), kwargs) if name is not None else None
    return None


class MovesIgnored(TorchFunctionMode):
    """Runs ``forward`` with every CUDA move (:func:`read_move`) left out: the tensor itself,
    or its ``.to`` with the rest of the arguments (a dtype). For the compiler's questions to
    the eager model on fake tensors, which must see the program the trace recorded."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Mapping[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", None)
        if name in ("to", "cuda") and args and isinstance(args[0], torch.Tensor) and func in (torch.Tensor.to, torch.Tensor.cuda):
            move = read_move(name, args[1:], kwargs)
            if move is not None:
                return args[0] if move.leaves_nothing else args[0].to(*move.args, **move.kwargs)
        return func(*args, **kwargs)
