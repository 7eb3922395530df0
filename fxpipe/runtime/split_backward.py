"""Zero bubble with compiled stages: a compiled backward graph split into I and W.

Under ``Plan(compile=...)`` with Inductor, AOTAutograd hands each stage graph's backward
to Inductor as one aten graph, whose outputs are the gradients of the forward's inputs in
order: the stage's parameters and its received activations. When the schedule splits the
backward (zero bubble: "I" then, later, "W"), :func:`compile_backward` partitions that
graph by dependency before compiling it:

- I: every node the gradients of the non-parameter inputs need; its outputs are those
  gradients and the intermediates W reads (the gradients of a linear's output, say);
- W: the rest: the parameters' gradients, from the backward's inputs it reads (saved
  activations, tangents) and I's intermediates.

Both are compiled by Inductor (``compile_fx_inner``, the compiler Inductor uses for the
whole backward, with its FX graph cache). :class:`SplitBackward` stands where the compiled
backward would: it runs I and returns the input gradients (``None`` for the parameters),
and hands W, with only the tensors it reads, to the stage's store as a
:class:`WeightWork`; without a store (a plain "B") it runs W at once and returns the
parameters' gradients to autograd.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.fx as fx

_GRAD_LOCK = threading.Lock()  # two stages may share a weight (tied) and run W in two threads


class Deferring(Protocol):
    """What a split backward reads at run time: the list its W goes to (None: run W in the
    backward), the module its parameters are looked up in, and the compile counters."""

    store: list | None
    module: torch.nn.Module
    graphs: int
    seconds: float


@dataclass
class BackwardParts:
    """A backward graph split in two. ``inputs``: I's (the backward's own); I returns the
    input gradients (the non-weight positions, in order), then ``carried`` intermediates;
    W reads ``from_inputs`` (positions in the backward's inputs) then the carried values,
    and returns the weights' gradients in order."""

    input_grads: fx.GraphModule
    weight_grads: fx.GraphModule
    from_inputs: list[int]
    carried: int


def _ancestors(roots: Sequence[Any]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    todo = [r for r in roots if isinstance(r, fx.Node)]
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(node.all_input_nodes)
    return seen


def partition(backward: fx.GraphModule, weights: Sequence[bool]) -> BackwardParts:
    """Split ``backward`` (outputs: one gradient per forward input) into I and W;
    ``weights[k]``: output ``k`` is a parameter's gradient, for W."""
    graph = backward.graph
    grads = list(next(n for n in graph.nodes if n.op == "output").args[0])
    needed_by_i = _ancestors([g for g, w in zip(grads, weights) if not w])
    computed = {n for n in _ancestors([g for g, w in zip(grads, weights) if w]) - needed_by_i if n.op != "placeholder"}
    weight_outputs = {g for g, w in zip(grads, weights) if w and isinstance(g, fx.Node)}
    read = [n for n in graph.nodes if n.op != "output" and n not in computed and (n in weight_outputs or any(u in computed for u in n.users))]
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    carried = [n for n in read if n.op != "placeholder"]

    first, env = fx.Graph(), {}
    for node in graph.nodes:
        if node.op == "placeholder" or node in needed_by_i and node.op != "output":
            env[node] = first.node_copy(node, env.__getitem__)
    input_grads = [env.get(g, g) for g, w in zip(grads, weights) if not w]
    # the carried values keep the layout the graph recorded, which W was compiled for
    _output(first, input_grads + [env[n] for n in carried], visible=range(len(input_grads), len(input_grads) + len(carried)))

    second, env = fx.Graph(), {}
    for node in [n for n in read if n.op == "placeholder"] + carried:
        env[node] = second.placeholder(node.name)
        env[node].meta = dict(node.meta)
    for node in graph.nodes:
        if node in computed:
            env[node] = second.node_copy(node, env.__getitem__)
    _output(second, [env.get(g, g) for g, w in zip(grads, weights) if w])
    from_inputs = [placeholders.index(n) for n in read if n.op == "placeholder"]
    return BackwardParts(fx.GraphModule(backward, first), fx.GraphModule(backward, second), from_inputs, len(carried))


def _output(graph: fx.Graph, values: list[Any], visible: range = range(0)) -> None:
    """The graph's output; ``visible``: the outputs Inductor must return with the strides
    the graph recorded (none, as Inductor's backward compiler marks its graph)."""
    node = graph.output(tuple(values))
    node.meta["user_visible_output_idxs"] = list(visible)
    graph.lint()


def compile_backward(backward: fx.GraphModule, example_inputs: Sequence[Any], options: dict[str, Any], stage: Deferring, names: Sequence[str | None]) -> Callable:
    """Inductor's backward compilation of ``backward`` (``options``: the keyword arguments
    Inductor passes ``compile_fx_inner``), split into I and W when it returns one gradient
    per forward input; ``names[k]``: the parameter forward input ``k`` is, or None."""
    # as torch.compile does: Inductor loads when it is used
    from torch._inductor.compile_fx import compile_fx_inner

    start = time.perf_counter()
    outputs = next(n for n in backward.graph.nodes if n.op == "output").args[0]
    weights = [name is not None for name in names]
    if len(outputs) != len(names) or not any(weights):
        compiled = compile_fx_inner(backward, example_inputs, **options)
        stage.graphs += 1
    else:
        parts = partition(backward, weights)
        first = compile_fx_inner(parts.input_grads, example_inputs, **options)
        weight_inputs = [n.meta["val"] for n in parts.weight_grads.graph.nodes if n.op == "placeholder"]
        second = compile_fx_inner(parts.weight_grads, weight_inputs, **dict(options, static_input_idxs=[]))
        compiled = SplitBackward(stage, first, second, parts, [n for n in names if n is not None], weights)
        stage.graphs += 2
    stage.seconds += time.perf_counter() - start
    return compiled


class SplitBackward:
    """The compiled backward of a stage graph as I, then W now or deferred (see the
    module docstring). Called by AOTAutograd with the backward's inputs in a list it may
    empty (``_boxed_call``)."""

    def __init__(self, stage: Deferring, first: Callable, second: Callable, parts: BackwardParts, names: list[str], weights: list[bool]) -> None:
        self.stage, self.first, self.second = stage, first, second
        self.from_inputs, self.carried = parts.from_inputs, parts.carried
        self.names, self.weights = names, weights
        self._boxed_call = True  # an instance attribute: Dynamo's wrappers copy __dict__

    def __call__(self, args: list) -> list:
        held = [args[k] for k in self.from_inputs]
        out = list(self.first(list(args)))
        args.clear()
        count = len(out) - self.carried
        held += out[count:]
        found = iter(out[:count])
        grads = [None if w else next(found) for w in self.weights]
        store = self.stage.store
        if store is None:
            weight_grads = iter(self.second(held))
            return [next(weight_grads) if w else g for g, w in zip(grads, self.weights)]
        store.append(WeightWork(self, tuple(held)))
        return grads

    def weight_gradients(self, held: Sequence[Any]) -> None:
        """Run W on ``held`` and add each gradient into its parameter's ``.grad``."""
        module = self.stage.module
        with torch.no_grad():  # as in a backward: W reads parameters, records nothing
            grads = self.second(list(held))
        for name, grad in zip(self.names, grads):
            if grad is not None:
                accumulate(module.get_parameter(name), grad)


class WeightWork:
    """A deferred W: call it to run it. ``holds``: the tensors it keeps until then (what
    memory accounting counts between I and W)."""

    __slots__ = ("backward", "holds")

    def __init__(self, backward: SplitBackward, holds: tuple[Any, ...]) -> None:
        self.backward = backward
        self.holds = holds

    def __call__(self) -> None:
        holds, self.holds = self.holds, ()
        self.backward.weight_gradients(holds)


def accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Add ``grad`` into ``param.grad`` as autograd's AccumulateGrad does (thread-safe)."""
    grad = grad.to(param.dtype)
    with _GRAD_LOCK:
        if param.grad is None:
            param.grad = grad
        else:
            param.grad.add_(grad)
