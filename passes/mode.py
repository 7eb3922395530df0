"""Mode pass: train/eval-dependent aten ops follow the stage's ``.training`` flag.

``torch.export`` records the model's mode at trace time as literal arguments
(``aten.batch_norm(..., training=True, ...)``, ``aten.dropout(x, p, train=True)``) and
an unconditional ``num_batches_tracked.add_(1)``, and models that pick an attention dropout
``p if self.training else 0.0`` leave a literal ``dropout_p`` in
``aten.scaled_dot_product_attention``. This pass replaces each literal with
the output of a ``fxpipe_training`` call: a tiny module that returns its own ``training``
attribute, so ``pipe.train()`` / ``pipe.eval()`` switch BatchNorm and Dropout exactly as
``model.train()`` / ``model.eval()`` do in eager mode. One call is inserted right before
each op, so every stage reads its own flag.

Other Python branches on ``self.training`` inside ``forward`` stay as traced.

Writes no ``node.meta`` keys; adds the ``fxpipe_training`` submodule to the root.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch import nn

from fxpipe.passes.meta import CUSTOM, MODULE_PATH

FLAG = "fxpipe_training"

aten = torch.ops.aten
# op -> position of its train/eval argument
_MODE_ARG = {
    aten.batch_norm.default: 5,
    aten.dropout.default: 2,
    aten.feature_dropout.default: 2,
    aten.alpha_dropout.default: 2,
    aten.feature_alpha_dropout.default: 2,
}


class TrainingFlag(nn.Module):
    """Returns whether it is in training mode (it follows ``.train()`` / ``.eval()``)."""

    def forward(self) -> bool:
        return self.training


def bind_mode(graph: fx.Graph, root: nn.Module) -> int:
    """Rewire literal train/eval arguments of ``graph`` to a ``fxpipe_training`` call.

    Registers the flag module on ``root``. Returns how many ops now follow the mode.
    """
    rewired = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        position = _MODE_ARG.get(node.target)
        if position is not None and len(node.args) > position and isinstance(node.args[position], bool):
            node.args = (*node.args[:position], _flag_before(graph, node), *node.args[position + 1 :])
            rewired += 1
        elif node.target is aten.scaled_dot_product_attention.default:
            rewired += _attention_dropout(graph, node)
        elif _counts_batches(node):
            # num_batches_tracked += 1 only while training, as nn.BatchNorm does
            node.args = (node.args[0], _flag_before(graph, node))
            rewired += 1
    if rewired and not hasattr(root, FLAG):
        root.add_module(FLAG, TrainingFlag())
    return rewired


def _flag_before(graph: fx.Graph, node: fx.Node) -> fx.Node:
    with graph.inserting_before(node):
        flag = graph.call_module(FLAG)
    flag.meta.update({k: v for k, v in node.meta.items() if k in (CUSTOM, "nn_module_stack", MODULE_PATH)})
    return flag


def _attention_dropout(graph: fx.Graph, node: fx.Node) -> int:
    """``dropout_p`` becomes ``p * training`` (0 in eval mode)."""
    position = 4
    if len(node.args) > position:
        p = node.args[position]
    else:
        p = node.kwargs.get("dropout_p", 0.0)
    if not isinstance(p, float) or p == 0.0:
        return 0
    flag = _flag_before(graph, node)
    with graph.inserting_before(node):
        scaled = graph.call_function(operator.mul, (p, flag))
    if len(node.args) > position:
        node.args = (*node.args[:position], scaled, *node.args[position + 1 :])
    else:
        node.kwargs = {**node.kwargs, "dropout_p": scaled}
    return 1


def _counts_batches(node: fx.Node) -> bool:
    if node.target is not aten.add_.Tensor or len(node.args) != 2 or node.args[1] != 1:
        return False
    target = node.args[0]
    return isinstance(target, fx.Node) and target.op == "get_attr" and str(target.target).endswith("num_batches_tracked")
