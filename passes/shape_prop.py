"""Shape propagation on fake tensors: no real compute, the model's state untouched.

Writes ``node.meta["val"]`` on every node: the node's value with every tensor replaced by
a FakeTensor (shape, strides, dtype, device, requires_grad), or a Python value as it was;
``node.meta["real_run"]`` on a node that could not run on fake tensors and ran for real
(see :mod:`fxpipe.passes.fake_replay`): why.
Modules run with their training flags as they are, on fake copies of their parameters and
buffers, so BatchNorm running statistics are never updated. The values come from one
:mod:`fxpipe.passes.fake_replay` run, which the cost pass then reads too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode

from fxpipe.passes.fake_replay import FakeReplay, replay
from fxpipe.passes.meta import MODULE_PATH, REAL_RUN, VAL


def propagate_shapes(
    gm: fx.GraphModule,
    inputs: list,
    resolve: Callable[[str], Any] | None = None,
    mode: FakeTensorMode | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> FakeReplay:
    """Record ``node.meta["val"]`` for every node of ``gm`` given one value per placeholder.

    ``resolve(target)`` fetches a module or tensor by qualified name (defaults to ``gm``'s
    attributes); ``mode``: the FakeTensorMode to run in, when ``resolve`` hands out fake
    tensors of that mode (a model traced on fake tensors); ``progress(done, total)`` hears
    how far it got. Tensors in ``inputs`` are faked, so nothing is computed for real and no
    parameter or buffer changes. Returns the replay (values, keys, templates) for the cost
    pass. Raises what a node raises on fake tensors (a note names the node).
    """
    fake_run = replay(gm, inputs, resolve, progress=progress, mode=mode)
    record_values(fake_run)
    return fake_run


def record_values(fake_run: FakeReplay) -> None:
    """Write ``node.meta["val"]`` from a replay that already ran (the fx frontend's, made
    while tracing on the same example)."""
    for node, value in fake_run.values.items():
        node.meta[VAL] = value
    for node, why in fake_run.real_run_reasons().items():
        node.meta[REAL_RUN] = why


def real_runs(graph: fx.Graph) -> list[RealRun]:
    """The nodes of ``graph`` that ran for real in shape propagation, in graph order."""
    return [
        RealRun(n.name, n.meta.get(MODULE_PATH, ""), _target_name(n), n.meta[REAL_RUN])
        for n in graph.nodes if REAL_RUN in n.meta
    ]


@dataclass(frozen=True)
class RealRun:
    """A node that ran for real at compile time: its name, module, what it calls and why."""

    node: str
    module: str
    target: str
    why: str


def _target_name(node: fx.Node) -> str:
    if node.op == "call_module":
        return str(node.target)
    return getattr(node.target, "__name__", None) or str(node.target)


def tensor_bytes(value: Any) -> int:
    """Bytes of every tensor inside ``value`` (a tensor, a pytree of them, or neither)."""
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor))


def describe(value: Any) -> str:
    """A short text for a value: ``f32[8, 64]`` for a tensor, the structure otherwise."""
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).replace("torch.", "")
        short = {"float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16", "int64": "i64", "int32": "i32", "bool": "bool"}
        return f"{short.get(dtype, dtype)}[{', '.join(str(int(d)) for d in value.shape)}]"
    if isinstance(value, list | tuple):
        inner = ", ".join(describe(v) for v in value[:4]) + (", …" if len(value) > 4 else "")
        return f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {describe(v)}" for k, v in list(value.items())[:4]) + "}"
    return type(value).__name__ if value is not None else "None"
