"""Node costs: what every node costs, counted on fake tensors (nothing is computed for real).

Reads the replay of shape propagation (``passes/fake_replay``: each node's value, key and
output template). Writes ``node.meta["cost"]``: a :class:`NodeCost` on every compute and
``get_attr`` node, at the batch size of the example inputs.

- Counted once per distinct node: nodes whose replay keys are equal (the same computation
  on inputs of the same shapes, dtypes and ``requires_grad``) and whose inputs play the same
  roles (activation or weight) cost the same, so a 48-layer LM is counted one layer's worth.
- FLOPs: a distinct node is replayed alone on fresh fake tensors, its ops counted with
  the formulas of ``torch.utils.flop_counter``: its forward, then its backward in two
  parts: I (gradients of its activation inputs only: what the previous stage waits for)
  and W (gradients of its weights: parameters, and values computed from parameters alone,
  such as export's ``t(weight)``); the backward is I + W. Matmuls, convolutions and
  attention are counted by PyTorch's formulas; ops it has none for (elementwise, norms,
  pooling) get one FLOP per output element, views and pass-throughs none.
- Bytes: activation bytes read and written (views move none); weight bytes read per call
  (parameters, buffers, weight-derived values: the same for any batch).
- State: parameter bytes (trainable: they also carry gradients and optimizer state) and
  buffer bytes of the module a node calls, or of the tensor a ``get_attr`` fetches.
- Activation bytes: outputs in new memory (views and in-place results count 0).
- Ops: the ATen ops the forward, I and W dispatch (each pays a fixed cost), and the
  node's kind ("conv", "matmul", "norm", "elementwise", "view"), which a calibration from
  ``fxpipe.profile`` rates separately.
A node whose replay fails (an op without a fake kernel) keeps the fallback estimate;
measured times from ``fxpipe.profile`` can replace estimates.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from fxpipe.passes.fake_replay import FakeReplay, OutputTemplate, quiet_meta_failures
from fxpipe.passes.meta import COMPUTE_OPS, COST
from fxpipe.passes.shape_prop import tensor_bytes

KINDS = ("conv", "matmul", "norm", "elementwise", "view")
_MATMUL_OPS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "mv", "addmv", "dot", "einsum", "_int_mm"}
_ATTENTION_PREFIXES = ("_scaled_dot_product", "_flash_attention", "_efficient_attention")


@dataclass(frozen=True)
class NodeCost:
    """What one node costs at the example batch size.

    fwd_flops / bwd_flops: FLOPs of its forward and of its whole backward (0 when nothing
    upstream needs a gradient); bwd_input_flops / bwd_weight_flops: the backward's gradients
    of the node's activation inputs (I) and of its weights (W), which add up to bwd_flops;
    act_bytes_moved: activation bytes read plus written by the forward; weight_bytes:
    weight bytes read per call (any batch); param_bytes: trainable parameters held (each
    also has a gradient and optimizer state); buffer_bytes: buffers and frozen tensors held;
    activation_bytes: new memory the output takes (what a backward may need kept);
    kind: one of ``KINDS``; fwd_ops / bwd_ops /
    bwd_input_ops / bwd_weight_ops: ATen ops dispatched (each pays a fixed cost: a leaf
    module such as ``nn.TransformerEncoderLayer`` is one node but ~100 ops).
    """

    fwd_flops: float = 0.0
    bwd_flops: float = 0.0
    bwd_input_flops: float = 0.0
    bwd_weight_flops: float = 0.0
    act_bytes_moved: float = 0.0
    weight_bytes: float = 0.0
    param_bytes: int = 0
    buffer_bytes: int = 0
    activation_bytes: int = 0
    kind: str = "elementwise"
    fwd_ops: int = 1
    bwd_ops: int = 1
    bwd_input_ops: int = 0
    bwd_weight_ops: int = 0

    @property
    def convolution(self) -> bool:
        """A convolution (CPU libraries re-layout its weights on every call)."""
        return self.kind == "conv"

    @property
    def weight_share(self) -> float:
        """The share of the backward that is weight-gradient work (W), by FLOPs where they
        were counted, else by ops; the rest is input-gradient work (I)."""
        counted = self.bwd_input_flops + self.bwd_weight_flops
        if counted:
            return self.bwd_weight_flops / counted
        ops = self.bwd_input_ops + self.bwd_weight_ops
        return self.bwd_weight_ops / ops if ops else 0.0


class _Counter(TorchDispatchMode):
    """Counts the ATen ops dispatched while active, their FLOPs (``flop_counter``'s
    formulas; FlopCounterMode itself also tracks modules, which costs ~2x here) and names."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.flops = 0.0
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace != "prim":  # prim.device and friends: metadata queries, no kernel
            packet = func._overloadpacket
            self.ops += 1
            self.names.add(packet.__name__)
            if packet in flop_registry:
                self.flops += flop_registry[packet](*args, **kwargs, out_val=out)
        return out


@dataclass(frozen=True)
class _Counts:
    """(FLOPs, ops) of one distinct node's forward and its backward's I and W parts."""

    fwd: tuple[float, int]
    input_grad: tuple[float, int]
    weight_grad: tuple[float, int]
    op_names: frozenset[str]


def weight_side(graph: fx.Graph) -> set[fx.Node]:
    """The nodes whose values come from parameters and constants alone, never from the
    model's inputs (``get_attr`` nodes and what is computed from them only)."""
    side: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "get_attr":
            side.add(node)
        elif node.op in COMPUTE_OPS and node.all_input_nodes and all(a in side for a in node.all_input_nodes):
            side.add(node)
    return side


def annotate_costs(graph: fx.Graph, resolve: Callable[[str], Any], fake_run: FakeReplay) -> None:
    """Write ``node.meta["cost"]`` on every compute and ``get_attr`` node of ``graph``.

    ``resolve(target)`` fetches the module or tensor a ``call_module`` / ``get_attr`` node
    names; ``fake_run`` is the replay of ``graph`` (``propagate_shapes`` returns it). Nodes
    the replay did not run get the fallback estimate. Returns None.
    """
    side = weight_side(graph)
    memo: dict[Hashable, NodeCost] = {}
    for node in graph.nodes:
        if node.op == "get_attr":
            trainable, frozen = _state_of(node, resolve)
            node.meta[COST] = NodeCost(param_bytes=trainable, buffer_bytes=frozen, fwd_ops=0, bwd_ops=0)
            continue
        if node.op not in COMPUTE_OPS:
            continue
        key = None
        if node in fake_run.keys:
            key = (fake_run.keys[node], tuple(a in side for a in node.all_input_nodes), node in side)
        cost = memo.get(key) if key is not None else None
        if cost is None:
            cost = _cost(node, resolve, fake_run, side)
            if key is not None:
                memo[key] = cost
        node.meta[COST] = cost


def cost_of(node: fx.Node) -> NodeCost:
    """The node's ``NodeCost`` (an empty one for nodes the pass does not cost)."""
    return node.meta.get(COST) or NodeCost()


def _cost(node: fx.Node, resolve: Callable[[str], Any], fake_run: FakeReplay, side: set[fx.Node]) -> NodeCost:
    """Count one distinct node (see the module doc)."""
    template = fake_run.templates.get(node) or OutputTemplate(None, ())
    outputs = template.tensors
    out_elems = float(sum(_numel(t.shape) for t in outputs))
    needs_grad = any(t.requires_grad for t in outputs)
    view = template.only_aliases
    in_side = node in side
    act_in = sum(tensor_bytes(fake_run.values.get(a)) for a in node.all_input_nodes if a not in side)
    weight_in = sum(tensor_bytes(fake_run.values.get(a)) for a in node.all_input_nodes if a in side)
    trainable, frozen = _state_of(node, resolve)
    moved = 0.0 if view else float(act_in + template.nbytes)
    weight_bytes = float(weight_in + trainable + frozen)
    if in_side:  # a weight computed from weights: all its traffic is weight traffic
        weight_bytes += moved
        moved = 0.0
    try:
        counts = _count(node, resolve, fake_run, side)
    except Exception:  # noqa: BLE001 - any op without a fake kernel falls back to the estimate
        counts = None
    if counts is None:
        fwd, fwd_ops, i_flops, i_ops, w_flops, w_ops = 0.0, 1, 0.0, 0, 0.0, 0
        kind = "view" if view else ("conv" if _names_convolution(node, resolve) else "elementwise")
    else:
        (fwd, fwd_ops), (i_flops, i_ops), (w_flops, w_ops) = counts.fwd, counts.input_grad, counts.weight_grad
        kind = _kind(counts.op_names, view)
    bwd, bwd_ops = i_flops + w_flops, i_ops + w_ops
    # ops flop_counter does not count still touch every output element once
    fwd = fwd or (0.0 if view else out_elems)
    if not bwd and needs_grad and not view:
        bwd = out_elems
        ops = i_ops + w_ops
        w_flops = bwd * w_ops / ops if ops else 0.0
        i_flops = bwd - w_flops
    return NodeCost(
        fwd_flops=fwd,
        bwd_flops=bwd,
        bwd_input_flops=i_flops,
        bwd_weight_flops=w_flops,
        act_bytes_moved=moved,
        weight_bytes=weight_bytes,
        param_bytes=trainable,
        buffer_bytes=frozen,
        activation_bytes=0 if in_side else template.new_bytes,
        kind=kind,
        fwd_ops=max(fwd_ops, 1),
        bwd_ops=max(bwd_ops, 1) if needs_grad else 0,
        bwd_input_ops=i_ops,
        bwd_weight_ops=w_ops,
    )


def _count(node: fx.Node, resolve: Callable[[str], Any], fake_run: FakeReplay, side: set[fx.Node]) -> _Counts:
    """Replay ``node`` alone on fresh fake tensors: FLOPs and ops of its forward, I and W."""
    acts: list[torch.Tensor] = []
    weights: list[torch.Tensor] = []
    fresh: dict[fx.Node, Any] = {}

    def leaf(t: torch.Tensor, role: list[torch.Tensor], clone: bool) -> torch.Tensor:
        if not t.requires_grad:
            return fake_run.fake_like(t)
        base = fake_run.fake_like(t, requires_grad=True)
        role.append(base)
        # a non-leaf, as inside the graph, so in-place ops (ReLU(inplace=True)) replay
        return base.clone() if clone else base

    def value_of(arg: fx.Node) -> Any:
        if arg not in fresh:
            role, clone = (weights, False) if arg in side else (acts, True)
            fresh[arg] = pytree.tree_map_only(torch.Tensor, lambda t: leaf(t, role, clone), fake_run.values[arg])
        return fresh[arg]

    with fake_run.mode, torch.enable_grad():
        args = fx.map_arg(node.args, value_of)
        kwargs = fx.map_arg(node.kwargs, value_of)
        state = None
        if node.op == "call_module":
            state = {}
            module = resolve(node.target)
            for name, t in list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False)):
                state[name] = fake_run.fake(t)
                if isinstance(t, torch.nn.Parameter) and t.requires_grad and not any(w is state[name] for w in weights):
                    weights.append(state[name])
        with quiet_meta_failures(), _Counter() as forward:
            out = fake_run.execute(node, args, kwargs, resolve, state)
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None]
        grads = [torch.empty_like(t) for t in outs]
        input_grad = _backward(outs, grads, acts, retain=bool(weights))
        weight_grad = _backward(outs, grads, weights, retain=False)
    return _Counts((forward.flops, forward.ops), input_grad, weight_grad, frozenset(forward.names))


def _backward(outs: list[torch.Tensor], grads: list[torch.Tensor], wrt: list[torch.Tensor], retain: bool) -> tuple[float, int]:
    """(FLOPs, ops) of the gradients of ``outs`` with respect to ``wrt``."""
    if not outs or not wrt:
        return 0.0, 0
    with _Counter() as counter:
        torch.autograd.grad(outs, wrt, grads, retain_graph=retain, allow_unused=True)
    return counter.flops, counter.ops


def _kind(op_names: frozenset[str], view: bool) -> str:
    if view:
        return "view"
    if any("conv" in name for name in op_names):
        return "conv"
    if op_names & _MATMUL_OPS or any(name.startswith(_ATTENTION_PREFIXES) for name in op_names):
        return "matmul"
    if any("norm" in name for name in op_names):
        return "norm"
    return "elementwise"


def _names_convolution(node: fx.Node, resolve: Callable[[str], Any]) -> bool:
    if node.op == "call_module":
        return isinstance(resolve(node.target), torch.nn.modules.conv._ConvNd)
    return node.op == "call_function" and "conv" in getattr(node.target, "__name__", str(node.target))


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


def _numel(shape: tuple[int, ...]) -> int:
    numel = 1
    for d in shape:
        numel *= d
    return numel
