"""A FlexAttention-style mask per packed micro-batch, and a model reading it in every block.

``PackedMask`` is shaped like ``torch.nn.attention.flex_attention.BlockMask``: tensor
children ``pos`` ([B, T], each token's position inside its document), ``same_doc``
([B, T, T]) and ``bias`` ([T, T], one for every row), and Python values ``seq_len`` and
``causal`` in the pytree *context* (as BlockMask keeps its sequence lengths), so two masks
of other lengths have other tree specs. Without a bias the mask has two children. ``PackedLM``'s attention reads all five: the
context values are Python constants of its trace.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch import nn

VOCAB = 32


@dataclass
class PackedMask:
    pos: torch.Tensor  # [B, T] position of each token inside its document
    same_doc: torch.Tensor  # [B, T, T] query and key in one document
    bias: torch.Tensor | None  # [T, T] a distance penalty shared by every row (None: no child)
    seq_len: int
    causal: bool = True


_CHILDREN = ("pos", "same_doc", "bias")


def _flatten(mask: PackedMask) -> tuple[list[torch.Tensor], tuple[int, bool, bool]]:
    children = [getattr(mask, k) for k in _CHILDREN if getattr(mask, k) is not None]
    return children, (mask.seq_len, mask.causal, mask.bias is not None)


def _flatten_with_keys(mask: PackedMask) -> tuple[list, tuple[int, bool, bool]]:
    children, context = _flatten(mask)
    return [(pytree.GetAttrKey(k), c) for k, c in zip(_CHILDREN, children)], context


def _unflatten(children: list, context: tuple[int, bool, bool]) -> PackedMask:
    seq_len, causal, has_bias = context
    return PackedMask(children[0], children[1], children[2] if has_bias else None, seq_len, causal)


pytree.register_pytree_node(PackedMask, _flatten, _unflatten, flatten_with_keys_fn=_flatten_with_keys)


def packed_mask(lengths: list[list[int]], causal: bool = True, bias: bool = True, dtype: torch.dtype = torch.float64) -> PackedMask:
    """The mask of rows packed with documents of ``lengths[r]`` tokens (every row one total)."""
    seq_len = sum(lengths[0])
    docs = torch.stack([torch.cat([torch.full((n,), d) for d, n in enumerate(row)]) for row in lengths])
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    t = torch.arange(seq_len)
    distance = -0.125 * (t[:, None] - t[None, :]).abs().to(dtype)
    return PackedMask(pos, docs[:, :, None] == docs[:, None, :], distance if bias else None, seq_len, causal)


class PackedAttention(nn.Module):
    """Multi-head attention over a PackedMask: the heads are cut with the mask's seq_len."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.mlp = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, mask: PackedMask) -> torch.Tensor:
        rows, width = x.shape[0], x.shape[-1]
        q, k, v = self.qkv(x).view(rows, mask.seq_len, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        keep = mask.same_doc
        if mask.causal:
            keep = keep & (mask.pos[:, :, None] >= mask.pos[:, None, :])
        scores = q @ k.transpose(-1, -2) / (width // self.heads) ** 0.5
        if mask.bias is not None:
            scores = scores + mask.bias
        scores = scores.masked_fill(~keep[:, None], float("-inf"))
        a = (scores.softmax(-1) @ v).transpose(1, 2).reshape(rows, mask.seq_len, width)
        x = x + self.out(a)
        return x + torch.tanh(self.mlp(x))


class PackedLM(nn.Module):
    """Embedding, ``layers`` PackedAttention blocks, an LM head."""

    def __init__(self, layers: int = 4, width: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(PackedAttention(width, heads) for _ in range(layers))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, ids: torch.Tensor, mask: PackedMask) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(x)
