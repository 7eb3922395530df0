"""The dtype rules real kernels keep and fake ones do not (:class:`KernelDtypes`).

A fake tensor lets a float64 batch meet float32 weights in a matrix product; the real
kernel refuses it. Every fake replay (``passes/fake_replay.py``) runs its distinct
computations under a recording :class:`KernelDtypes`, so the compiler names such a call
from the trace's own replay; ``eager_on_fake`` (``passes/generalise.py``) raises from it.
Writes no ``node.meta`` keys.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._ops import HigherOrderOperator
from torch.utils._python_dispatch import TorchDispatchMode

_SAME_DTYPE_OPS = {
    torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm, torch.ops.aten.addbmm,
    torch.ops.aten.mv, torch.ops.aten.addmv, torch.ops.aten.dot, torch.ops.aten.vdot,
}
_NORM_OPS = {  # (input, ..., weight at this position)
    torch.ops.aten.native_layer_norm: 2, torch.ops.aten.native_batch_norm: 1, torch.ops.aten._native_batch_norm_legit: 1,
    torch.ops.aten._native_batch_norm_legit_no_training: 1, torch.ops.aten.native_group_norm: 1,
}
_REDUCED = (torch.float16, torch.bfloat16)


class KernelDtypeError(RuntimeError):
    """A kernel would refuse its operands' dtypes (found on fake tensors by :class:`KernelDtypes`)."""


class KernelDtypes(TorchDispatchMode):
    """Under a FakeTensorMode, the dtype rules real kernels keep and fake ones do not: a
    matrix product's operands share one dtype ("mat1 and mat2 must have the same dtype"),
    a norm's input is floating and its weight of the input's dtype (float32 weights under
    a float16/bfloat16 input are fine), a convolution's input and weight share one dtype.
    Raises KernelDtypeError where the kernel would raise, so that a fake run fails where the
    real one will; with ``record=True`` it raises nothing and keeps the first refusal in
    ``refused`` (a fake replay notes it and runs on)."""

    def __init__(self, record: bool = False) -> None:
        super().__init__()
        self.record = record
        self.refused: KernelDtypeError | None = None

    supports_higher_order_operators = True  # cond, while_loop, ...: passed on, their branches unchecked

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if isinstance(func, HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        refusal = refused(func.overloadpacket, args)
        if refusal is not None:
            if not self.record:
                raise KernelDtypeError(refusal)
            self.refused = self.refused or KernelDtypeError(refusal)
        return func(*args, **(kwargs or {}))


def refused(packet: Any, args: tuple) -> str | None:
    """Why a real kernel would refuse ``packet`` on ``args``' dtypes, or None."""
    if packet in _SAME_DTYPE_OPS:
        dtypes = {a.dtype for a in args if isinstance(a, torch.Tensor)}
        if len(dtypes) > 1:
            return f"{packet.__name__}: operands of different dtypes ({', '.join(sorted(str(d) for d in dtypes))}); a matrix product needs one"
    elif packet in _NORM_OPS:
        x, position = args[0], _NORM_OPS[packet]
        weight = args[position] if len(args) > position else None
        if not x.is_floating_point():
            return f"{packet.__name__}: input of dtype {x.dtype}; a norm needs a floating input"
        if isinstance(weight, torch.Tensor) and weight.dtype != x.dtype and not (x.dtype in _REDUCED and weight.dtype == torch.float32):
            return f"{packet.__name__}: input of dtype {x.dtype}, weight of dtype {weight.dtype}; mixed dtypes fail"
    elif packet is torch.ops.aten.convolution and args[1].dtype != args[0].dtype:
        return f"convolution: input of dtype {args[0].dtype}, weight of dtype {args[1].dtype}; mixed dtypes fail"
    return None
