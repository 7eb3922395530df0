"""Shape propagation on fake tensors: no real compute, the model's state untouched.

Writes ``node.meta["val"]``: the node's value with every tensor replaced by a
FakeTensor (shape, dtype, device, requires_grad), or a Python value as it was.
Runs in train mode semantics of the modules as they are, but on fake copies of
parameters and buffers, so BatchNorm running statistics are never updated.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

from fxpipe.passes.meta import VAL


class _FakeInterpreter(fx.Interpreter):
    """Runs the graph with fake parameters, recording every node's value."""

    def __init__(self, gm: fx.GraphModule, mode: FakeTensorMode, resolve: Any) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.mode = mode
        self.resolve = resolve
        self._fake_attrs: dict[int, Any] = {}

    def _fake(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            key = id(value)
            if key not in self._fake_attrs:
                fake = self.mode.from_tensor(value, static_shapes=True)
                if isinstance(value, torch.nn.Parameter):
                    fake = fake.detach().requires_grad_(value.requires_grad)
                self._fake_attrs[key] = fake
            return self._fake_attrs[key]
        return value

    def get_attr(self, target: str, args: tuple, kwargs: dict) -> Any:
        return self._fake(self.resolve(target))

    def call_module(self, target: str, args: tuple, kwargs: dict) -> Any:
        module = self.resolve(target)
        params = dict(module.named_parameters(remove_duplicate=False))
        buffers = dict(module.named_buffers(remove_duplicate=False))
        fakes = {**{k: self._fake(v) for k, v in params.items()}, **{k: self._fake(v) for k, v in buffers.items()}}
        try:
            # parameters/buffers replaced by fakes for this call only
            return torch.func.functional_call(module, fakes, args, kwargs, tie_weights=True, strict=False)
        except Exception:  # noqa: BLE001 - e.g. a leaf module with data-dependent control flow
            return self._run_for_real(module, args, kwargs)

    def _run_for_real(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        """Run a copy of one module on zero tensors of the right shapes; fake the result."""
        with unset_fake_temporarily():
            real = pytree.tree_map_only(torch.Tensor, _zeros_like_fake, (args, kwargs))
            with torch.no_grad():
                out = copy.deepcopy(module)(*real[0], **real[1])
        return pytree.tree_map_only(torch.Tensor, lambda t: self.mode.from_tensor(t, static_shapes=True), out)

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        n.meta[VAL] = result
        return result


def propagate_shapes(gm: fx.GraphModule, inputs: list, resolve: Any = None, mode: FakeTensorMode | None = None) -> None:
    """Record ``node.meta["val"]`` for every node of ``gm`` given one value per placeholder.

    ``resolve(target)`` fetches a module or tensor by qualified name (defaults to
    ``gm.get_submodule``/``getattr`` chains on ``gm``). Tensors in ``inputs`` are faked,
    so nothing is computed for real and no parameter or buffer changes. ``mode``: the
    FakeTensorMode to run in, when ``resolve`` hands out fake tensors of that mode (a
    model traced on fake tensors).
    """
    if resolve is None:
        resolve = functools.partial(_attribute, gm)
    with mode or FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_inputs = pytree.tree_map_only(torch.Tensor, lambda t: mode.from_tensor(t, static_shapes=True), inputs)
        interpreter = _FakeInterpreter(gm, mode, resolve)
        interpreter.run(*fake_inputs)


def _zeros_like_fake(t: torch.Tensor) -> torch.Tensor:
    return torch.zeros(tuple(int(d) for d in t.shape), dtype=t.dtype, device="cpu" if t.device.type == "meta" else t.device)


def _attribute(root: torch.nn.Module, target: str) -> Any:
    return functools.reduce(getattr, target.split("."), root)


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
