"""Cost pass: what every node costs, counted on fake tensors (nothing is computed for real).

Reads ``node.meta["val"]`` (shape_prop). Writes ``node.meta["cost"]``: a :class:`NodeCost`
for every ``call_module`` / ``call_function`` / ``call_method`` node, at the batch size of
the example inputs.

- FLOPs: each node is replayed alone, forward and backward, on fresh fake tensors under
  ``torch.utils.flop_counter.FlopCounterMode``. Matmuls, convolutions and attention are
  counted by PyTorch's own formulas; ops it does not count (elementwise, normalisation,
  pooling) get one FLOP per output element, so nothing costs zero.
- Bytes moved: the activations a node reads and writes plus its parameters and buffers
  (what bounds memory-bound ops such as BatchNorm and ReLU).
- State: parameter bytes (trainable, so they also carry gradients and optimizer state) and
  buffer bytes of the module a node calls, or of the tensor a ``get_attr`` fetches.
- Activation bytes: the node's output, counted once per storage so views and in-place
  ops do not double count.
- Ops: the ATen ops the forward and the backward dispatch in that replay, for the fixed
  cost each op pays (dispatch on CPU, a kernel launch on GPU).
A node whose replay fails (an op without a fake kernel) keeps the fallback estimate and
``NodeCost.exact = False``; measured times from ``fxpipe.profile`` can replace estimates.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from fxpipe.passes.meta import COMPUTE_OPS, COST, VAL
from fxpipe.passes.shape_prop import tensor_bytes


@dataclass(frozen=True)
class NodeCost:
    """What one node costs at the example batch size.

    fwd_flops / bwd_flops: FLOPs of its forward and of its backward (0 when nothing
    upstream needs a gradient); act_bytes_moved: activation bytes read plus written by
    the forward; param_bytes: trainable parameters (each also has a gradient and
    optimizer state); buffer_bytes: buffers and frozen tensors; activation_bytes: the
    output a backward may need kept; exact: False when FLOPs are the fallback estimate;
    convolution: the node is a convolution (CPU libraries re-layout its weights per call);
    fwd_ops / bwd_ops: ATen ops its forward and backward dispatch (each pays a fixed
    cost: a leaf module such as ``nn.TransformerEncoderLayer`` is one node but ~60 ops).
    """

    fwd_flops: float = 0.0
    bwd_flops: float = 0.0
    act_bytes_moved: float = 0.0
    param_bytes: int = 0
    buffer_bytes: int = 0
    activation_bytes: int = 0
    exact: bool = True
    convolution: bool = False
    fwd_ops: int = 1
    bwd_ops: int = 1


def _fresh(value: Any, leaves: list[torch.Tensor]) -> Any:
    """A new fake tensor (under the active fake mode) shaped like ``value``.

    One that needs a gradient is a clone of a leaf recorded in ``leaves``, so in-place
    ops (``ReLU(inplace=True)``) replay as they do inside a graph.
    """
    if not isinstance(value, torch.Tensor):
        return value
    fake = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)
    if value.requires_grad and (value.is_floating_point() or value.is_complex()):
        leaves.append(fake.requires_grad_(True))
        return fake.clone()
    return fake


class _OpCounter(TorchDispatchMode):
    """Counts the ATen ops dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace != "prim":  # prim.device and friends: metadata queries, no kernel
            self.count += 1
        return func(*args, **(kwargs or {}))


def _count_node(node: fx.Node, resolve: Callable[[str], Any], mode: FakeTensorMode) -> tuple[float, float, int, int]:
    """(forward FLOPs, backward FLOPs, forward ops, backward ops) of ``node`` replayed
    alone on fake tensors."""
    def fake_arg(arg: fx.Node) -> Any:
        if arg.op == "get_attr":
            real = resolve(arg.target)
            if isinstance(real, torch.Tensor):
                fake = mode.from_tensor(real, static_shapes=True)
                return fake.detach().requires_grad_(real.requires_grad) if isinstance(real, torch.nn.Parameter) else fake
            return real
        return pytree.tree_map(lambda v: _fresh(v, wrt), arg.meta.get(VAL))

    wrt: list[torch.Tensor] = []
    with mode:
        args = fx.map_arg(node.args, fake_arg)
        kwargs = fx.map_arg(node.kwargs, fake_arg)
        params: list[torch.Tensor] = []
        if node.op == "call_module":
            module = resolve(node.target)
            fakes = {}
            for name, t in list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False)):
                fake = mode.from_tensor(t, static_shapes=True)
                if isinstance(t, torch.nn.Parameter):
                    fake = fake.detach().requires_grad_(t.requires_grad)
                    params.append(fake)
                fakes[name] = fake
            run = lambda: torch.func.functional_call(module, fakes, args, kwargs, tie_weights=True, strict=False)  # noqa: E731
        elif node.op == "call_method":
            run = lambda: getattr(args[0], node.target)(*args[1:], **kwargs)  # noqa: E731
        else:
            run = lambda: node.target(*args, **kwargs)  # noqa: E731
        with torch.enable_grad():
            forward, forward_ops = FlopCounterMode(display=False), _OpCounter()
            with forward, forward_ops:
                out = run()
            wrt += [p for p in params if p.requires_grad]
            outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None]
            backward, backward_ops = FlopCounterMode(display=False), _OpCounter()
            if wrt and outs:
                grads = [torch.empty_like(t) for t in outs]
                with backward, backward_ops:
                    torch.autograd.grad(outs, wrt, grads, allow_unused=True)
    return float(forward.get_total_flops()), float(backward.get_total_flops()), forward_ops.count, backward_ops.count


def _state_of(node: fx.Node, resolve: Callable[[str], Any]) -> tuple[int, int]:
    """(trainable parameter bytes, buffer and frozen bytes) held by the node's target."""
    tensors: list[torch.Tensor] = []
    if node.op == "call_module":
        module = resolve(node.target)
        tensors = list(module.parameters()) + list(module.buffers())
    elif node.op == "get_attr":
        value = resolve(node.target)
        tensors = [value] if isinstance(value, torch.Tensor) else []
    trainable = tensor_bytes([t for t in tensors if isinstance(t, torch.nn.Parameter) and t.requires_grad])
    return trainable, tensor_bytes(tensors) - trainable


def _storage_key(t: torch.Tensor) -> Any:
    try:
        return id(t.untyped_storage())
    except (NotImplementedError, RuntimeError):
        return id(t)


def annotate_costs(graph: fx.Graph, resolve: Callable[[str], Any]) -> None:
    """Write ``node.meta["cost"]`` on every compute and ``get_attr`` node of ``graph``.

    ``resolve(target)`` fetches the module or tensor a ``call_module`` / ``get_attr`` node
    names. Nodes without ``meta["val"]`` (shape propagation did not run) are costed by
    what can be known without shapes. Returns None.
    """
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    seen_storages: set[Any] = set()
    for node in graph.nodes:
        if node.op == "get_attr":
            trainable, frozen = _state_of(node, resolve)
            node.meta[COST] = NodeCost(param_bytes=trainable, buffer_bytes=frozen)
            continue
        if node.op == "placeholder":
            for t in pytree.tree_leaves(node.meta.get(VAL)):
                if isinstance(t, torch.Tensor):
                    seen_storages.add(_storage_key(t))
            continue
        if node.op not in COMPUTE_OPS:
            continue
        out = node.meta.get(VAL)
        out_tensors = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        in_bytes = sum(tensor_bytes(a.meta.get(VAL)) for a in node.all_input_nodes if a.op != "get_attr")
        fresh = []
        for t in out_tensors:
            key = _storage_key(t)
            if key not in seen_storages:
                seen_storages.add(key)
                fresh.append(t)
        out_elems = sum(t.numel() for t in out_tensors)
        try:
            fwd, bwd, fwd_ops, bwd_ops = _count_node(node, resolve, mode)
            exact = True
        except Exception:  # noqa: BLE001 - any op without a fake kernel falls back to the estimate
            fwd, bwd, fwd_ops, bwd_ops, exact = 0.0, 0.0, 1, 1, False
        needs_grad = any(t.requires_grad for t in out_tensors)
        # ops flop_counter does not count still touch every output element once
        fwd = fwd or float(out_elems)
        bwd = bwd or (float(out_elems) if needs_grad else 0.0)
        trainable, frozen = _state_of(node, resolve)
        node.meta[COST] = NodeCost(
            fwd_flops=fwd,
            bwd_flops=bwd,
            act_bytes_moved=float(in_bytes + tensor_bytes(out)),
            param_bytes=trainable,
            buffer_bytes=frozen,
            activation_bytes=tensor_bytes(fresh),
            exact=exact,
            convolution=_is_convolution(node, resolve),
            fwd_ops=max(fwd_ops, 1),
            bwd_ops=max(bwd_ops, 1) if needs_grad else 0,
        )


def _is_convolution(node: fx.Node, resolve: Any) -> bool:
    if node.op == "call_module":
        return isinstance(resolve(node.target), torch.nn.modules.conv._ConvNd)
    return node.op == "call_function" and "conv" in getattr(node.target, "__name__", str(node.target))


def cost_of(node: fx.Node) -> NodeCost:
    """The node's ``NodeCost`` (an empty one for nodes the pass does not cost)."""
    return node.meta.get(COST) or NodeCost()
