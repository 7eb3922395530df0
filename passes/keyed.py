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
- for a callee whose randomness is out of sight, ``passes/scope.py``.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import torch
import torch.nn.functional as F

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
    finalised again. Returns an int in [0, 2**64). For one ``seed`` distinct values (mod
    2**64) give distinct results; across seeds results collide as rarely as random ones.
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


def check_seed(seed: Any) -> int:
    """``seed`` itself; raises TypeError when it is not an int (the stage was called
    without its ``fxpipe_rng_seed`` argument)."""
    if not isinstance(seed, int):
        raise TypeError(
            f"fxpipe_rng_seed must be an int, got {type(seed).__name__}: this stage draws random "
            "numbers, so its last argument is the seed of the (step, micro-batch) it runs"
        )
    return seed


def generator(seed: int, key: int, where: Any = None, draw: int = 0) -> torch.Generator | None:
    """This thread's generator for ``where``'s device, seeded for draw ``draw`` of node ``key``.

    ``where``: a tensor (its device), a device, or None (the default device). The
    generator is re-seeded by the next call on this thread and device, so use it at once.
    Returns None on the meta device. Raises TypeError when ``seed`` is not an int.
    """
    return _seeded(draw_seed(check_seed(seed), key, draw), _device_of(where))


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
