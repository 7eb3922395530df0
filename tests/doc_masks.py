"""Models fed a structured attention mask, for the listed micro-batch tests.

A document mask (packed sequences: each token attends to earlier tokens of its own
document) as a registered pytree dataclass of a tensor and a Python value, and as a
NamedTuple; ``DocLM`` reads it in every block, so it reaches every stage. With
``build_masks=True`` a leaf module (kept whole by torch.fx) builds the blocks'
``AttentionMask`` from it in the first stage, and that structured value crosses the stages
as one pytree. ``Opaque`` is a mask class that is no pytree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn

VOCAB = 32


@dataclass
class DocumentMask:
    """Per token, the document it belongs to ([B, T]); ``window``: attend at most this many
    tokens back (0: no limit), a Python value traced as a constant."""

    document: torch.Tensor
    window: int = 0


pytree.register_dataclass(DocumentMask)


class AttentionMask(NamedTuple):
    """Which keys each query may attend to ([B, T, T]) and the window it was built with."""

    allowed: torch.Tensor
    window: int


class Opaque:
    """A holder of tensors that is not a registered pytree."""

    def __init__(self, **values: object) -> None:
        self.__dict__.update(values)


def document_mask(lengths: list[list[int]], window: int = 0) -> DocumentMask:
    """The mask of a micro-batch of packed rows, row r holding documents of ``lengths[r]``
    tokens (every row the same total)."""
    rows = [torch.cat([torch.full((n,), d) for d, n in enumerate(row)]) for row in lengths]
    return DocumentMask(torch.stack(rows), window)


def allowed(document: torch.Tensor, window: int) -> torch.Tensor:
    """[B, T, T]: query t may attend key s when s <= t, both in one document (and within the window)."""
    pos = torch.arange(document.shape[1], device=document.device)
    keep = (document[:, :, None] == document[:, None, :]) & (pos[:, None] >= pos[None, :])
    if window:
        keep = keep & (pos[:, None] - pos[None, :] < window)
    return keep


class MaskBuilder(nn.Module):
    """Turns a DocumentMask into the blocks' AttentionMask (a leaf module under torch.fx)."""

    def forward(self, mask: DocumentMask) -> AttentionMask:
        return AttentionMask(allowed(mask.document, mask.window), mask.window)


class Block(nn.Module):
    """Single-head attention under the mask, and an MLP; ``built``: it is given the
    AttentionMask (otherwise the DocumentMask)."""

    def __init__(self, width: int, built: bool) -> None:
        super().__init__()
        self.built = built
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.mlp = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, mask: DocumentMask | AttentionMask) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        keep = mask.allowed if self.built else allowed(mask.document, mask.window)
        a = F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None], attn_mask=keep[:, None])[:, 0]
        x = x + self.out(a)
        return x + torch.tanh(self.mlp(x))


class DocLM(nn.Module):
    """Embedding, ``layers`` masked-attention blocks, an LM head."""

    def __init__(self, layers: int = 4, width: int = 16, build_masks: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, width)
        self.masks = MaskBuilder() if build_masks else None
        self.blocks = nn.ModuleList(Block(width, build_masks) for _ in range(layers))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, ids: torch.Tensor, mask: DocumentMask) -> torch.Tensor:
        x = self.emb(ids)
        blocks_mask = self.masks(mask) if self.masks is not None else mask
        for block in self.blocks:
            x = block(x, blocks_mask)
        return self.head(x)
