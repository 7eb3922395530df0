"""Python decisions the fx frontend took on sizes, checked again every time the graph runs.

fx cannot see Python control flow: ``if q_length > 1:`` on a traced size takes one branch
for good. The fx frontend evaluates such a condition on the example's fake tensors, follows
that branch and records a :func:`check_assumed` node, so a call (or micro-batch) whose
sizes would take the other branch fails loudly, naming the user's line, instead of
computing something else. Writes no ``node.meta`` keys.
"""

from __future__ import annotations

from typing import Any

from fxpipe.passes.traced import TraceError


class AssumptionError(TraceError):
    """A size the trace branched on takes another value in this call: a TraceError (the
    trace does not serve the call), so ``except fxpipe.TraceError`` catches it."""


def check_assumed(value: Any, expected: Any, where: str) -> None:
    """Raise AssumptionError unless ``value == expected`` (the traced branch holds)."""
    if value != expected:
        raise AssumptionError(
            f"the trace followed the branch of {where} for {expected!r}, but this call gives {value!r}: "
            "a Python branch on sizes was taken once while tracing; call with sizes that take the same "
            "branch (a micro-batch of other size, a sequence of length 1), or compile for this signature"
        )
