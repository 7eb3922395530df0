"""Terms a model adds to its own loss beside its reduced loss calls.

A model that computes its own loss (``labels=``) may add terms to the reduced loss calls
(``cross_entropy``) that fxpipe normalises over the whole step: MoE routers add a load
balancing term (``loss += coef * aux_loss``) computed from the statistics of the batch the
forward sees. Under micro-batching each micro-batch computes it over its own samples, and
a product of batch means is not the mean of per-micro-batch products: such a term cannot
equal its full-batch value. :func:`added_terms` finds the terms summed into a loss, so the
compiler can name them.

The loss is read as a sum: ``+``/``-`` (``operator``, ``torch.add``/``sub``, their in-place
and method forms) are followed into both operands, a product or quotient with a constant
and casts/moves (``.to``, ``.float()``) into their tensor operand; every other node is a
term. Reads nothing from ``node.meta`` but the module path; writes nothing.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import fx

from fxpipe.passes.meta import MODULE_PATH

_ADD = {operator.add, operator.iadd, operator.sub, operator.isub, torch.add, torch.sub}
_ADD_METHODS = {"add", "add_", "sub", "sub_", "__add__", "__radd__", "__iadd__", "__sub__"}
_SCALE = {operator.mul, operator.imul, operator.truediv, operator.itruediv, torch.mul, torch.div}
_SCALE_METHODS = {"mul", "mul_", "div", "div_", "__mul__", "__rmul__", "__truediv__"}
_CASTS = {"to", "type_as", "float", "double", "half", "bfloat16", "contiguous", "clone", "cpu", "cuda"}


@dataclass(frozen=True)
class LossTerm:
    """A term summed into a loss: its node, a name (the output it is also returned as,
    else the module and node that compute it) and whether it depends on a model input."""

    node: fx.Node
    name: str
    from_inputs: bool


def added_terms(loss: fx.Node, is_loss_call: Callable[[fx.Node], bool], outputs: Mapping[fx.Node, str]) -> list[LossTerm]:
    """The terms summed into ``loss`` other than the calls ``is_loss_call`` accepts and
    constants, in the order they are found. ``outputs`` names graph values the model also
    returns (an ``aux_loss`` field): a term that is one of them carries that name."""
    inputs = _reaching_inputs(loss)
    terms: list[LossTerm] = []
    stack: list[fx.Node] = [loss]
    seen: set[fx.Node] = set()
    while stack:
        node = stack.pop()
        if node in seen or is_loss_call(node):
            continue
        seen.add(node)
        if node is not loss and node in outputs:
            terms.append(LossTerm(node, outputs[node], inputs(node)))
            continue
        operands = _summed_operands(node)
        if operands is None:
            where = node.meta.get(MODULE_PATH) or "the model's forward"
            terms.append(LossTerm(node, f"{node.name} (computed in {where})", inputs(node)))
        else:
            stack.extend(reversed(operands))
    return terms


def _summed_operands(node: fx.Node) -> list[fx.Node] | None:
    """The nodes ``node`` sums, scales by a constant or casts; None when it is a term."""
    if node.op not in ("call_function", "call_method"):
        return None
    method = node.target if node.op == "call_method" else None
    tensors = [a for a in node.args[:2] if isinstance(a, fx.Node)]
    if node.target in _ADD or method in _ADD_METHODS:
        return tensors
    if (node.target in _SCALE or method in _SCALE_METHODS) and len(tensors) == 1:
        return tensors
    if method in _CASTS and tensors:
        return tensors[:1]
    return None


def _reaching_inputs(loss: fx.Node) -> Callable[[fx.Node], bool]:
    """``depends(node)``: whether ``node`` depends on a placeholder of ``loss``'s graph."""
    memo: dict[fx.Node, bool] = {}
    for node in loss.graph.nodes:
        memo[node] = node.op == "placeholder" or any(memo.get(a, False) for a in node.all_input_nodes)
        if node is loss:
            break
    return lambda node: memo.get(node, False)


__all__ = ["LossTerm", "added_terms"]
