"""Keyed randomness: the functions a stage graph calls after the rng pass.

Every random draw of a stage is a function of three integers: the seed the runtime hands
to the stage for one (step, micro-batch), the node's key (its position among the random
nodes of the whole, unpartitioned graph) and the draw's index within that node (0 for an
op that draws once; 0, 1, 2, ... for the random ops inside an opaque module). The draw
uses a ``torch.Generator`` seeded with ``mix(mix(seed, key), draw)``, so a mask depends on
nothing else: not on the thread, the schedule, the split or how often the stage ran
before. Checkpoint recompute, which runs the stage again with the same seed, replays the
same masks.

No global state is touched: each thread keeps one generator per device and re-seeds it
for every draw (``manual_seed``), so threads never share a generator and the caller's
global generator is left alone.

What the rewritten graph calls:
- :func:`generator` for an op that takes a ``generator=`` argument (``torch.rand``,
  ``bernoulli``, ``Tensor.uniform_``, aten's ``rand.generator`` overloads, ...);
- :func:`dropout` and its siblings, :func:`aten_dropout`, :func:`native_dropout` and
  :func:`attention` in place of the dropout family and ``scaled_dot_product_attention``,
  which take no generator; each computes what the torch op computes, with the same
  kernels (on CPU, bitwise what torch's dropout gives from the same generator state);
- :func:`call` for a module whose randomness is out of sight (``nn.MultiheadAttention``,
  ``nn.TransformerEncoderLayer``, a user leaf module) and :func:`scoped` for such a
  function: they run it under a :class:`KeyedScope`, which routes every random aten op
  inside to the node's generator.
"""

from __future__ import annotations

import functools
import math
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: splitmix64's increment


def _finalize(z: int) -> int:
    """splitmix64's output function: a bijection of 64-bit integers that avalanches."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def mix(seed: int, value: int) -> int:
    """A 64-bit seed for ``value`` within the stream ``seed`` (both any Python ints).

    splitmix64 style: the finalised seed advanced by ``value + 1`` golden-ratio steps,
    finalised again. Returns an int in [0, 2**64); distinct pairs give unrelated seeds.
    """
    state = (_finalize(seed & _MASK64) + ((value & _MASK64) + 1) * _GOLDEN) & _MASK64
    return _finalize(state)


def draw_seed(seed: int, key: int, draw: int = 0) -> int:
    """The generator seed of draw ``draw`` of random node ``key`` under the stage seed ``seed``."""
    return mix(mix(seed, key), draw)


_local = threading.local()


def _device_of(where: Any) -> torch.device:
    if isinstance(where, torch.Tensor):
        return where.device
    if isinstance(where, torch.device | str):
        device = torch.device(where)
        if device.index is None and device.type not in ("cpu", "meta"):
            device = torch.device(device.type, torch.get_device_module(device.type).current_device())
        return device
    return torch.get_default_device()


def _seeded(seed: int, device: torch.device) -> torch.Generator | None:
    if device.type == "meta":
        return None  # nothing is drawn on meta tensors
    generators = _local.__dict__.setdefault("generators", {})
    gen = generators.get(device)
    if gen is None:
        gen = generators[device] = torch.Generator(device)
    return gen.manual_seed(seed)


def generator(seed: int, key: int, where: Any = None, draw: int = 0) -> torch.Generator | None:
    """This thread's generator for ``where``'s device, seeded for draw ``draw`` of node ``key``.

    ``where``: a tensor (its device), a device, or None (the default device). The
    generator is re-seeded by the next call on this thread and device, so use it at once.
    Returns None on the meta device. Raises TypeError when ``seed`` is not an int (the
    stage was called without its ``fxpipe_rng_seed`` argument).
    """
    if not isinstance(seed, int):
        raise TypeError(
            f"fxpipe_rng_seed must be an int, got {type(seed).__name__}: this stage draws random "
            "numbers, so its last argument is the seed of the (step, micro-batch) it runs"
        )
    return _seeded(draw_seed(seed, key, draw), _device_of(where))


# ------------------------------------------------------------------ the dropout family
def aten_dropout(
    input: torch.Tensor,
    p: float,
    train: bool,
    *,
    generator: torch.Generator | None,
    feature: bool = False,
    alpha: bool = False,
    inplace: bool = False,
) -> torch.Tensor:
    """aten's ``dropout``, ``feature_dropout``, ``alpha_dropout``, ``feature_alpha_dropout``
    (``inplace``: their ``_`` forms), drawing the noise from ``generator``.

    The same steps as torch's CPU kernel: Bernoulli(1 - p) noise in an uninitialised tensor
    (one value per (sample, channel) for ``feature``), scaled in place, one multiply. In
    eval (``train`` false) or for p == 0 the input is returned as is. Raises ValueError for
    p outside [0, 1].
    """
    if p < 0.0 or p > 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if p == 0.0 or not train or input.numel() == 0:
        return input
    if p == 1.0:
        zero = torch.zeros((), dtype=input.dtype, device=input.device)
        return input.mul_(zero) if inplace else input.mul(zero)
    if feature:
        noise = input.new_empty((input.shape[0], input.shape[1], *([1] * (input.dim() - 2))))
    else:
        noise = torch.empty_like(input)
    noise.bernoulli_(1.0 - p, generator=generator)
    if not alpha:
        noise.div_(1.0 - p)
        return input.mul_(noise) if inplace else input * noise
    # SELU-preserving dropout: dropped units go to the negative saturation value, then an
    # affine map restores mean and variance (a and b as in torch's kernel)
    saturation = 1.7580993408473766
    a = 1.0 / math.sqrt((saturation * saturation * p + 1) * (1 - p))
    b = noise.add(-1).mul_(saturation * a).add_(saturation * a * p)
    noise.mul_(a)
    return input.mul_(noise).add_(b) if inplace else (input * noise).add_(b)


def _functional(
    input: torch.Tensor, p: float, training: bool, inplace: bool, generator: torch.Generator | None,
    feature: bool = False, alpha: bool = False, batched_dim: int | None = None,
) -> torch.Tensor:
    """A ``torch.nn.functional`` dropout: an input without its batch dimension (fewer dims
    than ``batched_dim``) is treated as one sample, as dropout1d and dropout3d do."""
    unbatched = batched_dim is not None and input.dim() != batched_dim
    if unbatched:
        input = input.unsqueeze_(0) if inplace else input.unsqueeze(0)
    out = aten_dropout(input, p, training, generator=generator, feature=feature, alpha=alpha, inplace=inplace)
    if unbatched:
        out = out.squeeze_(0) if inplace else out.squeeze(0)
    return out


def dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False, *, generator: torch.Generator | None) -> torch.Tensor:
    """``F.dropout`` drawing from ``generator``."""
    return _functional(input, p, training, inplace, generator)


def dropout1d(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False, *, generator: torch.Generator | None) -> torch.Tensor:
    """``F.dropout1d`` drawing from ``generator``."""
    return _functional(input, p, training, inplace, generator, feature=True, batched_dim=3)


def dropout2d(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False, *, generator: torch.Generator | None) -> torch.Tensor:
    """``F.dropout2d`` drawing from ``generator`` (a 3-d input is read as (N, C, L), as torch does)."""
    return _functional(input, p, training, inplace, generator, feature=True)


def dropout3d(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False, *, generator: torch.Generator | None) -> torch.Tensor:
    """``F.dropout3d`` drawing from ``generator``."""
    return _functional(input, p, training, inplace, generator, feature=True, batched_dim=5)


def alpha_dropout(input: torch.Tensor, p: float = 0.5, training: bool = False, inplace: bool = False, *, generator: torch.Generator | None) -> torch.Tensor:
    """``F.alpha_dropout`` drawing from ``generator``."""
    return _functional(input, p, training, inplace, generator, alpha=True)


def feature_alpha_dropout(input: torch.Tensor, p: float = 0.5, training: bool = False, inplace: bool = False, *, generator: torch.Generator | None) -> torch.Tensor:
    """``F.feature_alpha_dropout`` drawing from ``generator``."""
    return _functional(input, p, training, inplace, generator, feature=True, alpha=True)


def native_dropout(input: torch.Tensor, p: float, train: bool | None, *, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """aten's ``native_dropout`` drawing from ``generator``: (output, boolean keep mask)."""
    if train is False or input.numel() == 0:
        return input.clone(), torch.ones_like(input, dtype=torch.bool)
    keep = 1.0 - p
    mask = torch.empty_like(input).bernoulli_(keep, generator=generator)
    out = input * mask
    out.mul_(0.0 if keep == 0 else 1.0 / keep)
    return out, mask.bool()


# the torch.nn.functional dropouts each dropout module calls, and whether it passes inplace
MODULE_DROPOUTS: dict[type, tuple[Callable[..., torch.Tensor], bool]] = {
    nn.Dropout: (dropout, True),
    nn.Dropout1d: (dropout1d, True),
    nn.Dropout2d: (dropout2d, True),
    nn.Dropout3d: (dropout3d, True),
    nn.AlphaDropout: (alpha_dropout, False),
    nn.FeatureAlphaDropout: (feature_alpha_dropout, False),
}


# ------------------------------------------------------------------ attention
def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` whose attention dropout draws from ``generator``.

    With ``dropout_p`` == 0 (always so in eval, where the mode pass makes it 0) this is
    torch's fused SDPA, unchanged. Otherwise the math formulation torch's own math backend
    uses (q and k each scaled by sqrt(scale), masked -inf, softmax that gives 0 for fully
    masked rows, dropout on the weights, weights @ v). Raises ValueError when both
    ``attn_mask`` and ``is_causal`` are given, as torch does.
    """
    if dropout_p == 0.0:
        return F.scaled_dot_product_attention(query, key, value, attn_mask, 0.0, is_causal, scale=scale, enable_gqa=enable_gqa)
    if is_causal and attn_mask is not None:
        raise ValueError("scaled_dot_product_attention: an explicit attn_mask should not be set when is_causal=True")
    factor = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
    root = math.sqrt(abs(factor))
    if enable_gqa:
        groups = query.size(-3) // key.size(-3)
        key, value = key.repeat_interleave(groups, -3), value.repeat_interleave(groups, -3)
    scores = (query * (root if factor >= 0 else -root)) @ (key * root).transpose(-2, -1)
    if is_causal:
        attn_mask = torch.ones(query.size(-2), key.size(-2), dtype=torch.bool, device=query.device).tril()
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(attn_mask.logical_not(), float("-inf"))
        else:
            scores = scores + attn_mask
    weights = aten._safe_softmax.default(scores, -1)
    weights = aten_dropout(weights, dropout_p, True, generator=generator)
    return weights @ value


# ------------------------------------------------------------------ opaque callees
@functools.cache
def generator_overload(op: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """``op`` itself if it takes ``generator=``, else its overload that does and otherwise
    takes the same arguments (``aten.rand.default`` -> ``aten.rand.generator``), else None."""
    names = [a.name for a in op._schema.arguments]
    if "generator" in names:
        return op
    packet = op.overloadpacket
    for overload in packet.overloads():
        candidate = getattr(packet, overload)
        other = [a.name for a in candidate._schema.arguments]
        if "generator" in other and [n for n in other if n != "generator"] == names and len(candidate._schema.returns) == len(op._schema.returns):
            if not any(a.is_out for a in candidate._schema.arguments):
                return candidate
    return None


def draws_random(op: torch._ops.OpOverload) -> bool:
    """Whether an operator draws random numbers (tagged so by torch, or takes a generator)."""
    return torch.Tag.nondeterministic_seeded in op.tags or any(a.name == "generator" for a in op._schema.arguments)


class KeyedScope(TorchDispatchMode):
    """Routes every random aten op run inside to a generator keyed by (seed, key, n-th draw).

    A dispatch mode sees the aten ops that a module's Python and C++ code reach, so random
    ops are caught wherever they are written. Ops that take a generator get one;
    ``native_dropout`` (the fused dropout torch uses on accelerators) is replaced by
    :func:`native_dropout`; any other random op draws from torch's global generator and
    is reported once, naming ``label``, because its result cannot be reproduced.
    """

    def __init__(self, seed: int, key: int, label: str) -> None:
        super().__init__()
        self.seed, self.key, self.label = seed, key, label
        self.draws = 0

    def _next(self, where: Any) -> torch.Generator | None:
        gen = generator(self.seed, self.key, where, self.draws)
        self.draws += 1
        return gen

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not isinstance(func, torch._ops.OpOverload) or not draws_random(func) or kwargs.get("generator") is not None:
            return func(*args, **kwargs)
        if func is aten.native_dropout.default:
            return native_dropout(*args, **kwargs, generator=self._next(args[0]))
        keyed = generator_overload(func)
        if keyed is None:
            _warn_unkeyed(func, self.label)
            return func(*args, **kwargs)
        return keyed(*args, **kwargs, generator=self._next(_where(args, kwargs)))


def _where(args: tuple, kwargs: dict) -> Any:
    """What decides an op's device: its first tensor argument, else its ``device=``."""
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg
    return kwargs.get("device")


@functools.cache
def _warn_unkeyed(op: Any, label: str) -> None:
    warnings.warn(
        f"fxpipe: {op} inside {label} draws from torch's global generator (it takes no generator "
        "argument), so its result is not reproducible and checkpoint recompute draws it anew; "
        "trace with Plan(frontend='export') to let fxpipe see the op, or avoid it in training",
        stacklevel=2,
    )


def call(module: nn.Module, seed: int, key: int, /, *args: Any, **kwargs: Any) -> Any:
    """``module(*args, **kwargs)`` with every random draw inside keyed by (seed, key, n).

    A plain dropout module (exactly ``nn.Dropout``, ``nn.Dropout2d``, ...) is run directly
    with its keyed functional; the masks are the ones the scope would give it.
    """
    direct = MODULE_DROPOUTS.get(type(module))
    if direct is not None:
        fn, passes_inplace = direct
        (x,) = args
        gen = generator(seed, key, x)
        return fn(x, module.p, module.training, module.inplace if passes_inplace else False, generator=gen)
    if not isinstance(seed, int):
        generator(seed, key)  # raises the TypeError that names the missing seed
    with KeyedScope(seed, key, type(module).__name__):
        return module(*args, **kwargs)


@functools.cache
def scoped(fn: Callable) -> Callable:
    """``fn`` run under a :class:`KeyedScope`: ``scoped(fn)(seed, key, *args, **kwargs)``.

    One wrapper per function (cached), named after it, so the stage's code reads
    ``keyed_gumbel_softmax(fxpipe_rng_seed, 4, x, tau=0.5)``.
    """
    label = getattr(fn, "__name__", None) or str(fn)

    def keyed_call(seed: int, key: int, /, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(seed, int):
            generator(seed, key)  # raises the TypeError that names the missing seed
        with KeyedScope(seed, key, label):
            return fn(*args, **kwargs)

    keyed_call.__name__ = keyed_call.__qualname__ = "keyed_" + "".join(c if c.isalnum() else "_" for c in label)
    return keyed_call
