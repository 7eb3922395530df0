"""What a frontend hands back: :class:`Traced`, and :class:`TraceError` when it cannot.

Both frontends (``passes/trace_fx.py``, ``passes/trace_export.py``) return a
:class:`Traced`: a flat graph, how a call feeds it (``bind_inputs``, checked against the
trace's :class:`~fxpipe.passes.signature.TraceKey` by :func:`checked_binder`) and how its
output becomes what the model returns. Writes no ``node.meta`` keys.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from fxpipe.passes.signature import CallSpec, SignatureError, TraceKey


class TraceError(RuntimeError):
    """Neither frontend could trace the model; the message says where each one stopped.

    ``failures`` holds (frontend, exception) for each attempt: their tracebacks, kept out
    of the printed error (pages of torch internals), are there for debugging.
    """

    def __init__(self, message: str, failures: Sequence[tuple[str, BaseException]] = ()) -> None:
        super().__init__(message)
        self.failures = list(failures)


@dataclass
class Traced:
    """A traced model: a flat fx graph plus how to feed it and rebuild its output.

    graph_module: GraphModule whose placeholders are the call's tensor inputs.
    root: where attributes not found on the user's model live (export's constants and
        higher-order-op submodules).
    frontend: "fx" or "export".
    bind_inputs: (args, kwargs) -> one value per placeholder, in order; raises
        SignatureError when the call does not fit the trace (see ``key``).
    build_output: the graph's output value -> what the model's forward returns.
    key: the TraceKey of the call the trace was made for.
    key_of: (args, kwargs) -> that call's TraceKey in this trace's terms; equal to ``key``
        exactly when this trace serves the call.
    notes: which frontend ran and why, for ``explain()``.
    opaque: the callees the fx frontend runs whole (``passes/opaque.py``), in trace order.
    replay: the fake replay of the whole graph on the example call, when the frontend made
        one (fx): shape propagation's values, so they need not be computed twice.
    batch_lengths: the source lines where the fx frontend iterated over a tensor's batch
        dimension (``list(image_features)``): the graph holds the batch size (a check per
        micro-batch), so each micro-batch size needs a trace of its own.
    """

    graph_module: fx.GraphModule
    root: nn.Module
    frontend: str
    bind_inputs: Callable[[tuple, dict], list]
    build_output: Callable[[Any], Any]
    key: TraceKey
    key_of: Callable[..., TraceKey]
    notes: list[str] = field(default_factory=list)
    opaque: list[Any] = field(default_factory=list)
    replay: Any = None
    batch_lengths: list[str] = field(default_factory=list)


def checked_binder(spec: CallSpec, key: TraceKey) -> Callable[[tuple, dict], list]:
    """``bind_inputs`` for a trace: one value per placeholder, after checking that the call
    is the traced signature up to its batch size (None pattern, constants, dtypes, ranks,
    structure and the sizes the trace baked, but dim 0 of batch-sized tensors: a whole
    batch is bound here and then cut into micro-batches, whose sizes the caller matches)."""
    expected = key.batch_free()

    def bind_inputs(args: tuple, kwargs: dict) -> list:
        bound = spec.bound(args, kwargs)
        got = spec.key_of_bound(bound).batch_free()
        if got != expected:
            raise SignatureError(
                f"this call to {spec.owner}.forward is not the traced signature ({'; '.join(expected.differences(got))}); "
                "the graph was specialised for the traced one: trace this call's signature too"
            )
        return spec.values(bound)

    return bind_inputs


def unflatten_with(spec: pytree.TreeSpec) -> Callable[[Any], Any]:
    """The graph returns its output's leaves; this rebuilds what forward returns."""
    return lambda flat: pytree.tree_unflatten(list(flat), spec)

