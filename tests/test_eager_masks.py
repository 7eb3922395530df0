"""Additive masks built from a traced dtype are traced, not run whole (issue 34).

HF's ``eager_mask`` converts a boolean mask with ``torch.finfo(dtype).min`` of the hidden
states' dtype, and returns None when nothing is padded. ``torch.finfo`` of a traced dtype
is a graph node read at run time (its value follows the dtype a stage computes in, autocast
included), so the mask builder traces through and takes HF's static path: a mask for every
micro-batch, zeros where eager has None. ModernBERT with ``attn_implementation="eager"``
then trains with micro-batches that have no padding, its loss and gradients equal eager's.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxpipe

PLAN = dict(devices=["cpu", "cpu"], microbatches=4, schedule="1f1b")


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (1.0 - mask.to(dtype)) * torch.finfo(dtype).min


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = self.a(x)
        return self.b((scores + additive(mask, scores.dtype)).softmax(-1))


def test_finfo_of_a_traced_dtype_is_read_at_run_time_under_autocast() -> None:
    torch.manual_seed(0)
    model = Masked()
    x, mask = torch.randn(8, 4), torch.ones(8, 4)
    mask[4:, 3] = 0
    pipe = fxpipe.compile(model, fxpipe.Plan(split=["b"], **PLAN), example_inputs=(x, mask))
    assert pipe.part.opaque == []
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the mask's minimum is bfloat16's, as in eager
        out, expected = pipe(x, mask), model(x, mask)
    assert out.dtype == expected.dtype == torch.bfloat16
    assert torch.equal(out, expected)


def test_modernbert_with_eager_attention_trains_with_unpadded_microbatches_like_eager() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.ModernBertConfig(
        num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=96,
        max_position_embeddings=64, pad_token_id=2, bos_token_id=0, eos_token_id=1, cls_token_id=0, sep_token_id=1,
        global_attn_every_n_layers=2, local_attention=8, attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = transformers.ModernBertForMaskedLM(config).double()
    ref = copy.deepcopy(model)
    ids = torch.randint(3, 96, (8, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    for row in range(2, 8):  # micro-batch 0 (rows 0 and 1) has no padding
        mask[row, 11 - row % 3 :] = 0
    target = torch.randint(3, 96, (8, 12), generator=torch.Generator().manual_seed(1)).masked_fill(mask == 0, -100)

    def loss_fn(out, t: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.logits.flatten(0, 1), t.flatten(), ignore_index=-100)

    pipe = fxpipe.compile(model, fxpipe.Plan(split=["model.layers.2"], **PLAN), example_kwargs={"input_ids": ids, "attention_mask": mask}, loss_fn=loss_fn)
    assert pipe.part.opaque == []
    loss = pipe.step(input_ids=ids, attention_mask=mask, target=target)
    eager = loss_fn(ref(input_ids=ids, attention_mask=mask), target)
    eager.backward()
    assert torch.allclose(loss, eager, rtol=1e-12, atol=0)
    eager_grads = dict(ref.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, eager_grads[name].grad, rtol=1e-9, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
    pipe.eval()
    ref.eval()
    with torch.no_grad():
        for picked in (slice(0, 8), slice(0, 1), slice(3, 4)):  # a batch of one without padding, one with
            out = pipe(input_ids=ids[picked], attention_mask=mask[picked]).logits
            assert torch.allclose(out, ref(input_ids=ids[picked], attention_mask=mask[picked]).logits, rtol=0, atol=1e-12)
