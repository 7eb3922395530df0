"""Small random vision-language models of transformers 5.x, built from config classes with
the library's defaults (``use_cache`` left on; the text model's default attention): a
2-layer vision tower of 16x16 images in 8x8 patches (4 image tokens per image), a 4-layer
text model of width 64, a vocabulary of 96 and one image token id past it. Reused by
tests/test_vlm_families.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

VOCAB = 96
IMAGE_TOKEN = VOCAB
PATCHES = 4  # (16 / 8) ** 2 image tokens per image
TEXT = dict(
    num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=VOCAB + 4, max_position_embeddings=64, bos_token_id=0, eos_token_id=1, pad_token_id=2,
)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=16, patch_size=8)


@dataclass(frozen=True)
class VlmFamily:
    """One family: its config and model classes, its text and vision configs."""

    name: str
    config: str
    model: str
    text: str
    vision: str
    extra: dict
    text_extra: dict
    split: str = "model.language_model.layers.2"

    def build(self, dtype: torch.dtype = torch.float32) -> nn.Module:
        """The model in ``dtype``, seeded, from its config with transformers' defaults."""
        text = getattr(transformers, self.text)(**TEXT, **self.text_extra)
        vision = getattr(transformers, self.vision)(**VISION)
        config = getattr(transformers, self.config)(vision_config=vision.to_dict(), text_config=text.to_dict(), **self.extra)
        torch.manual_seed(0)
        return getattr(transformers, self.model)(config).to(dtype)


FAMILIES = {
    f.name: f
    for f in (
        VlmFamily(
            "paligemma", "PaliGemmaConfig", "PaliGemmaForConditionalGeneration", "GemmaConfig", "SiglipVisionConfig",
            dict(image_token_index=IMAGE_TOKEN, projection_dim=64), dict(head_dim=16),
        ),
        VlmFamily(
            "llava", "LlavaConfig", "LlavaForConditionalGeneration", "LlamaConfig", "CLIPVisionConfig",
            dict(image_token_index=IMAGE_TOKEN, vision_feature_layer=-1), {},
        ),
    )
}


def image_batch(batch: int = 8, length: int = 12, dtype: torch.dtype = torch.float32, seed: int = 0) -> dict[str, torch.Tensor]:
    """Token ids with one image's tokens in every row (at rows' own offsets), pixels, and an
    attention mask whose rows pad 0 to 3 tokens at their tails."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=generator)
    mask = torch.ones_like(ids)
    for row in range(batch):
        start = row % 3
        ids[row, start : start + PATCHES] = IMAGE_TOKEN
        mask[row, length - row % 4 :] = 0
    pixels = torch.randn(batch, 3, 16, 16, generator=generator).to(dtype)
    return {"input_ids": ids, "pixel_values": pixels, "attention_mask": mask}


def rows(call: dict[str, torch.Tensor], picked: slice) -> dict[str, torch.Tensor]:
    return {k: v[picked] for k, v in call.items()}


def max_grad_error(pipe, model: nn.Module, floor: float = 1e-3) -> float:
    """The largest |pipeline grad - eager grad| over every parameter, relative to the larger
    of that parameter's largest eager gradient and ``floor`` times the model's largest: a
    gradient that is zero up to rounding in eager (an attention's key bias) is not
    compared with itself."""
    eager = dict(model.named_parameters())
    largest = max(float(p.grad.abs().max()) for p in model.parameters() if p.grad is not None)
    errors = []
    for name, p in pipe.named_parameters():
        assert (p.grad is None) == (eager[name].grad is None), name
        if p.grad is not None:
            scale = max(float(eager[name].grad.abs().max()), floor * largest)
            errors.append(float((p.grad - eager[name].grad).abs().max()) / scale)
    return max(errors)
