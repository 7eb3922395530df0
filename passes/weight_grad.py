"""Weight-gradient deferral: a stage's backward split into I (inputs) and W (weights).

Zero-bubble schedules run a stage's backward in two actions: "I" computes the gradients
the previous stage waits for, "W" the weight gradients, later, in what would have been a
bubble. This pass rewrites every op of a stage graph whose weight is a trainable parameter
and whose weight gradient has a closed form into a call of a deferring autograd Function:

- ``linear`` (``nn.Linear``, ``F.linear``, ``aten.linear``), ``addmm`` / ``mm`` / ``matmul``
  with a parameter as the right operand (GPT-2's ``Conv1D``), convolutions (``nn.Conv1d/2d/3d``,
  ``F.conv*d``, ``aten.conv*d`` / ``aten.convolution`` with numeric padding) and
  non-sparse embeddings (``nn.Embedding``, ``F.embedding``, ``aten.embedding``).

In backward such a Function computes the input gradient at once and, given a store (a
list), appends a closure that computes and accumulates the weight and bias gradients from
exactly the two tensors it needs (the op's input and the gradient of its output); the
autograd graph itself is freed after I, so what is held until W is what W needs. Given
``None`` instead of a store, it computes everything at once (a plain "B"). Ops of other
kinds (normalisation weights, custom modules) keep computing their weight gradients in I.

The stage's forward gains one last argument, the store (placeholder
``fxpipe_weight_grads``). Under autocast the Function casts as autocast would (the op's
inputs to the autocast dtype), so values and gradients match eager autocast.

Reads the stage GraphModule (to resolve ``call_module`` / ``get_attr`` targets); writes no
``node.meta`` key.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

WEIGHT_GRADS = "fxpipe_weight_grads"

aten = torch.ops.aten
_GRAD_LOCK = threading.Lock()  # two stages on one device may share a weight (tied) and run in two threads


def accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Add ``grad`` into ``param.grad`` as autograd's AccumulateGrad does (thread-safe)."""
    grad = grad.to(param.dtype)
    with _GRAD_LOCK:
        if param.grad is None:
            param.grad = grad
        else:
            param.grad.add_(grad)


def _autocast_dtype(device: torch.device) -> torch.dtype | None:
    kind = device.type if device.type in ("cpu", "cuda") else None
    if kind is not None and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return None


def _cast(dtype: torch.dtype | None, *tensors: torch.Tensor | None) -> tuple:
    if dtype is None:
        return tensors
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in tensors)


class Deferred:
    """A weight-gradient computation left for "W": call it to run it. ``holds``: the
    tensors it keeps until then (what memory accounting counts between I and W)."""

    __slots__ = ("work", "holds")

    def __init__(self, work: Callable[[], None], holds: tuple[torch.Tensor, ...]) -> None:
        self.work = work
        self.holds = holds

    def __call__(self) -> None:
        self.work()


def _defer(ctx: Any, work: Callable[[], None], *holds: torch.Tensor) -> None:
    """Run ``work`` now (no store: a plain "B") or append it to the store for "W", with the
    tensors it holds.

    The Function lets go of the store, and ``work`` must only hold detached tensors: a
    tensor with its ``grad_fn`` would close a cycle (store -> work -> tensor -> autograd
    graph -> this Function's ctx -> store) that keeps every activation of the micro-batch
    alive until Python's garbage collector finds it, which made the forwards after a
    split backward 1.5x slower."""
    store, ctx.store = ctx.store, None
    if store is None:
        work()
    else:
        store.append(Deferred(work, holds))


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class _Linear(torch.autograd.Function):
    """y = x @ weight.T + bias, weight gradient deferred."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, store: list | None) -> torch.Tensor:
        x, w, b = _cast(_autocast_dtype(x.device), x, weight, bias)
        with torch.autocast(x.device.type, enabled=False):
            y = F.linear(x, w, b)
        ctx.save_for_backward(x, w)
        ctx.params = (weight, bias)
        ctx.store = store
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, w = ctx.saved_tensors
        weight, bias = ctx.params
        gx = grad @ w if ctx.needs_input_grad[0] else None
        x, grad = x.detach(), grad.detach()

        def weights() -> None:
            if weight.requires_grad:
                accumulate(weight, _rows(grad).t() @ _rows(x))
            if bias is not None and bias.requires_grad:
                accumulate(bias, _rows(grad).sum(0))

        _defer(ctx, weights, x, grad)
        return gx, None, None, None


class _MatmulRight(torch.autograd.Function):
    """y = bias + x @ weight (addmm / mm / matmul with the parameter on the right)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, store: list | None) -> torch.Tensor:
        x, w, b = _cast(_autocast_dtype(x.device), x, weight, bias)
        with torch.autocast(x.device.type, enabled=False):
            y = x @ w if b is None else torch.addmm(b, _rows(x), w).view(*x.shape[:-1], w.shape[-1])
        ctx.save_for_backward(x, w)
        ctx.params = (weight, bias)
        ctx.store = store
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, w = ctx.saved_tensors
        weight, bias = ctx.params
        gx = grad @ w.t() if ctx.needs_input_grad[0] else None
        x, grad = x.detach(), grad.detach()

        def weights() -> None:
            if weight.requires_grad:
                accumulate(weight, _rows(x).t() @ _rows(grad))
            if bias is not None and bias.requires_grad:
                g = _rows(grad).sum(0) if bias.dim() == 1 else grad
                accumulate(bias, g)

        _defer(ctx, weights, x, grad)
        return gx, None, None, None


class _Convolution(torch.autograd.Function):
    """N-d convolution (numeric stride/padding/dilation, groups), weight gradient deferred."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, store: list | None, stride: Any, padding: Any, dilation: Any, transposed: bool, output_padding: Any, groups: int) -> torch.Tensor:
        x, w, b = _cast(_autocast_dtype(x.device), x, weight, bias)
        n = w.dim() - 2
        stride, padding, dilation, output_padding = (_expand(v, n) for v in (stride, padding, dilation, output_padding))
        with torch.autocast(x.device.type, enabled=False):
            y = aten.convolution(x, w, b, stride, padding, dilation, transposed, output_padding, groups)
        ctx.save_for_backward(x, w)
        ctx.params = (weight, bias)
        ctx.store = store
        ctx.conv = (stride, padding, dilation, transposed, output_padding, groups)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, w = ctx.saved_tensors
        weight, bias = ctx.params
        grad = grad.contiguous()
        gx = None
        if ctx.needs_input_grad[0]:
            gx = aten.convolution_backward(grad, x, w, None, *ctx.conv, [True, False, False])[0]
        # the weight gradient needs the weight's shape and dtype, not its values (as in
        # torch.nn.grad.conv2d_weight): W holds no weight, which may be freed by then
        x, w, grad = x.detach(), w.new_empty(1).expand(w.shape), grad.detach()

        def weights() -> None:
            want_b = bias is not None and bias.requires_grad
            _, gw, gb = aten.convolution_backward(grad, x, w, [w.shape[0]] if want_b else None, *ctx.conv, [False, weight.requires_grad, want_b])
            if weight.requires_grad:
                accumulate(weight, gw)
            if want_b:
                accumulate(bias, gb)

        _defer(ctx, weights, x, grad)
        return (gx,) + (None,) * 9


class _Embedding(torch.autograd.Function):
    """Dense embedding lookup: all of its backward is weight gradient (deferred)."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, indices: torch.Tensor, store: list | None, padding_idx: int, scale_grad_by_freq: bool) -> torch.Tensor:
        ctx.save_for_backward(indices)
        ctx.weight = weight
        ctx.store = store
        ctx.options = (padding_idx, scale_grad_by_freq)
        return aten.embedding(weight, indices, padding_idx, scale_grad_by_freq)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (indices,) = ctx.saved_tensors
        weight = ctx.weight
        padding_idx, scale = ctx.options
        grad = grad.detach()

        def weights() -> None:
            accumulate(weight, aten.embedding_dense_backward(grad, indices, weight.shape[0], padding_idx, scale))

        _defer(ctx, weights, indices, grad)
        return None, None, None, None, None


def _expand(value: Any, n: int) -> list[int]:
    if isinstance(value, int):
        return [value] * n
    value = list(value)
    return value * n if len(value) == 1 else value


# ---------------------------------------------------------------- graph entry points
def deferred_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, store: list | None) -> torch.Tensor:
    """``F.linear`` whose weight gradient goes to ``store`` (at once when it is None)."""
    return _Linear.apply(x, weight, bias, store)


def deferred_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, store: list | None) -> torch.Tensor:
    """``bias + x @ weight`` (``addmm``/``mm``/``matmul``), weight gradient to ``store``."""
    return _MatmulRight.apply(x, weight, bias, store)


def deferred_convolution(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, store: list | None, stride: Any = 1, padding: Any = 0, dilation: Any = 1, transposed: bool = False, output_padding: Any = 0, groups: int = 1) -> torch.Tensor:
    """A convolution whose weight and bias gradients go to ``store``."""
    return _Convolution.apply(x, weight, bias, store, stride, padding, dilation, transposed, output_padding, groups)


def deferred_embedding(weight: torch.Tensor, indices: torch.Tensor, store: list | None, padding_idx: int = -1, scale_grad_by_freq: bool = False) -> torch.Tensor:
    """An embedding lookup whose weight gradient goes to ``store``."""
    return _Embedding.apply(weight, indices, store, padding_idx, scale_grad_by_freq)


# ---------------------------------------------------------------- the rewrite
def _trainable(gm: fx.GraphModule, node: Any) -> bool:
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return False
    try:
        value = gm.get_parameter(node.target)
    except AttributeError:
        return False
    return value.requires_grad


def _numeric(*values: Any) -> bool:
    return all(isinstance(v, int) or (isinstance(v, list | tuple) and all(isinstance(e, int) for e in v)) for v in values)


def _module_call(gm: fx.GraphModule, graph: fx.Graph, node: fx.Node, store: fx.Node) -> fx.Node | None:
    module = gm.get_submodule(node.target)
    if type(module) not in (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding) or node.kwargs or len(node.args) != 1:
        return None
    if not module.weight.requires_grad:
        return None
    with graph.inserting_before(node):
        weight = graph.get_attr(f"{node.target}.weight")
        bias = graph.get_attr(f"{node.target}.bias") if getattr(module, "bias", None) is not None else None
        x = node.args[0]
        if isinstance(module, nn.Linear):
            return graph.call_function(deferred_linear, (x, weight, bias, store))
        if isinstance(module, nn.Embedding):
            if module.sparse or module.max_norm is not None:
                return None
            padding = module.padding_idx if module.padding_idx is not None else -1
            return graph.call_function(deferred_embedding, (weight, x, store, padding, module.scale_grad_by_freq))
        if module.padding_mode != "zeros" or isinstance(module.padding, str):
            return None
        return graph.call_function(
            deferred_convolution,
            (x, weight, bias, store, list(module.stride), list(module.padding), list(module.dilation), False, [0] * len(module.stride), module.groups),
        )


def _function_call(gm: fx.GraphModule, graph: fx.Graph, node: fx.Node, store: fx.Node) -> fx.Node | None:
    target, args, kwargs = node.target, list(node.args), dict(node.kwargs)
    if kwargs and target not in (F.linear, torch._C._nn.linear):
        return None
    with graph.inserting_before(node):
        if target in (F.linear, torch._C._nn.linear, aten.linear.default):
            x, weight = args[0], args[1] if len(args) > 1 else kwargs.get("weight")
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if _trainable(gm, weight) and (bias is None or _trainable(gm, bias)):
                return graph.call_function(deferred_linear, (x, weight, bias, store))
        elif target in (torch.addmm, aten.addmm.default) and len(args) == 3 and _trainable(gm, args[2]) and _trainable(gm, args[0]):
            return graph.call_function(deferred_matmul, (args[1], args[2], args[0], store))
        elif target in (torch.mm, torch.matmul, operator.matmul, aten.mm.default, aten.matmul.default) and len(args) == 2 and _trainable(gm, args[1]):
            weight_value = gm.get_parameter(args[1].target)
            if weight_value.dim() == 2:
                return graph.call_function(deferred_matmul, (args[0], args[1], None, store))
        elif target in _CONVS and _trainable(gm, args[1]) and (len(args) < 3 or args[2] is None or _trainable(gm, args[2])):
            n = _CONVS[target]
            rest = args[3:] + [None] * (4 - len(args[3:]))
            stride, padding, dilation, groups = (d if r is None else r for r, d in zip(rest, (1, 0, 1, 1)))
            if _numeric(stride, padding, dilation, groups):
                bias = args[2] if len(args) > 2 else None
                return graph.call_function(deferred_convolution, (args[0], args[1], bias, store, stride, padding, dilation, False, [0] * n, groups))
        elif target in (F.embedding, aten.embedding.default) and _trainable(gm, args[0] if target is aten.embedding.default else args[1]):
            if target is aten.embedding.default:
                weight, indices = args[0], args[1]
                padding, scale = (args[2] if len(args) > 2 else -1), (args[3] if len(args) > 3 else False)
                if len(args) > 4 and args[4]:
                    return None  # sparse
            else:
                return None  # F.embedding's max_norm/sparse keywords: keep the plain op
            return graph.call_function(deferred_embedding, (weight, indices, store, padding, scale))
    return None


_CONVS = {aten.conv1d.default: 1, aten.conv2d.default: 2, aten.conv3d.default: 3, F.conv1d: 1, F.conv2d: 2, F.conv3d: 3}


def defer_weight_gradients(gm: fx.GraphModule) -> int:
    """Rewrite ``gm`` (a stage) so its weight gradients can be deferred; returns how many
    ops now defer. Adds the last placeholder ``fxpipe_weight_grads`` when any op does."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    anchor = placeholders[-1] if placeholders else next(iter(graph.nodes))
    with graph.inserting_after(anchor):
        store = graph.placeholder(WEIGHT_GRADS)
    rewritten = 0
    for node in list(graph.nodes):
        if node.op == "call_module":
            new = _module_call(gm, graph, node, store)
        elif node.op == "call_function":
            new = _function_call(gm, graph, node, store)
        else:
            continue
        if new is None:
            continue
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        rewritten += 1
    if not rewritten:
        graph.erase_node(store)
        return 0
    graph.lint()
    gm.recompile()
    return rewritten
