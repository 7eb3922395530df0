"""Small random HuggingFace models of every family fxpipe is held to, built from config
classes (no hub downloads), with their inputs at any batch size and sequence length.

Each :class:`Family` gives a model builder, ``inputs(batch, length, generator)`` (the
forward's keyword arguments), split points by module path (>= 2 stages) and three sequence
lengths to check. The builders take ``layers``, ``width`` and ``heads`` (defaults: the small
models the families use). Dropout is off in every config so eager and pipelines are
comparable value for value. Reused by the compiler's per-signature tests and by the torchrun
tests (tests/test_llm_torchrun.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

VOCAB = 64
WIDTH = 32
# token ids within the vocabulary, so configs do not warn about the defaults (50256, ...)
SPECIAL = dict(bos_token_id=0, eos_token_id=1, pad_token_id=2)


@dataclass(frozen=True)
class Family:
    """One model family: how to build it, feed it and split it."""

    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[int, int, torch.Generator], dict[str, torch.Tensor]]
    split: list[str]
    lengths: tuple[int, int, int] = (5, 8, 13)


def _ids(batch: int, length: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=g)


def token_inputs(batch: int, length: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    return {"input_ids": _ids(batch, length, g)}


def padded_inputs(batch: int, length: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Token ids with an attention mask that pads the last samples' tails."""
    mask = torch.ones(batch, length, dtype=torch.long)
    for row in range(batch):
        mask[row, length - row % 3 :] = 0
    return {"input_ids": _ids(batch, length, g), "attention_mask": mask}


def seq2seq_inputs(batch: int, length: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Encoder ids of ``length`` tokens and decoder ids of about half as many."""
    return {"input_ids": _ids(batch, length, g), "decoder_input_ids": _ids(batch, max(2, length // 2), g)}


def gpt2(layers: int = 3, dropout: float = 0.0, width: int = WIDTH, heads: int = 2) -> nn.Module:
    config = transformers.GPT2Config(
        n_layer=layers, n_embd=width, n_head=heads, vocab_size=VOCAB, n_positions=64,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, use_cache=False, **SPECIAL,
    )
    return transformers.GPT2LMHeadModel(config)


def gpt_neo() -> nn.Module:
    config = transformers.GPTNeoConfig(
        num_layers=2, attention_types=[[["global", "local"], 1]], hidden_size=WIDTH, num_heads=2,
        vocab_size=VOCAB, max_position_embeddings=64, window_size=4, resid_dropout=0.0,
        embed_dropout=0.0, attention_dropout=0.0, use_cache=False, **SPECIAL,
    )
    return transformers.GPTNeoForCausalLM(config)


def opt(layers: int = 2, width: int = WIDTH, heads: int = 2) -> nn.Module:
    config = transformers.OPTConfig(
        num_hidden_layers=layers, hidden_size=width, ffn_dim=2 * width, num_attention_heads=heads, word_embed_proj_dim=width,
        vocab_size=VOCAB, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0, use_cache=False, **SPECIAL,
    )
    return transformers.OPTForCausalLM(config)


def _llama_like(config_class: type, model_class: type, layers: int = 2, width: int = WIDTH, heads: int = 2, **extra) -> nn.Module:
    config = config_class(
        num_hidden_layers=layers, hidden_size=width, intermediate_size=2 * width, num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        vocab_size=VOCAB, max_position_embeddings=64, use_cache=False, **SPECIAL, **extra,
    )
    return model_class(config)


def llama(layers: int = 2, width: int = WIDTH, heads: int = 2) -> nn.Module:
    return _llama_like(transformers.LlamaConfig, transformers.LlamaForCausalLM, layers, width, heads)


def mistral(layers: int = 2, width: int = WIDTH, heads: int = 2) -> nn.Module:
    return _llama_like(transformers.MistralConfig, transformers.MistralForCausalLM, layers, width, heads, sliding_window=6)


def qwen2(layers: int = 2, width: int = WIDTH, heads: int = 2) -> nn.Module:
    return _llama_like(transformers.Qwen2Config, transformers.Qwen2ForCausalLM, layers, width, heads)


def bert(layers: int = 2, width: int = WIDTH, heads: int = 2) -> nn.Module:
    config = transformers.BertConfig(
        num_hidden_layers=layers, hidden_size=width, intermediate_size=2 * width, num_attention_heads=heads, vocab_size=VOCAB,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=2,
    )
    return transformers.BertForMaskedLM(config)


def t5(layers: int = 2, width: int = WIDTH, heads: int = 2) -> nn.Module:
    """``layers`` encoder blocks and as many decoder blocks."""
    config = transformers.T5Config(
        num_layers=layers, num_decoder_layers=layers, d_model=width, d_kv=width // heads, d_ff=2 * width, num_heads=heads, vocab_size=VOCAB,
        dropout_rate=0.0, use_cache=False, decoder_start_token_id=0, **SPECIAL,
    )
    return transformers.T5ForConditionalGeneration(config)


def bart() -> nn.Module:
    config = transformers.BartConfig(
        encoder_layers=2, decoder_layers=2, d_model=WIDTH, encoder_ffn_dim=64, decoder_ffn_dim=64,
        encoder_attention_heads=2, decoder_attention_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, use_cache=False, decoder_start_token_id=0, **SPECIAL,
    )
    return transformers.BartForConditionalGeneration(config)


def vit() -> nn.Module:
    config = transformers.ViTConfig(
        image_size=32, patch_size=8, num_channels=3, num_hidden_layers=2, hidden_size=WIDTH, intermediate_size=64,
        num_attention_heads=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=5,
    )
    return transformers.ViTForImageClassification(config)


def image_inputs(batch: int, length: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Images of ``length`` x ``length`` pixels: (length / 8)^2 patches, positions interpolated."""
    return {"pixel_values": torch.randn(batch, 3, length, length, generator=g), "interpolate_pos_encoding": True}


MEL_BINS = 8
SOURCE_POSITIONS = 8  # Whisper's encoder takes exactly 2 x this many frames


def whisper() -> nn.Module:
    config = transformers.WhisperConfig(
        num_mel_bins=MEL_BINS, encoder_layers=2, decoder_layers=2, d_model=WIDTH, encoder_ffn_dim=64,
        decoder_ffn_dim=64, encoder_attention_heads=2, decoder_attention_heads=2, vocab_size=VOCAB,
        max_source_positions=SOURCE_POSITIONS, max_target_positions=64, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, use_cache=False, decoder_start_token_id=0, **SPECIAL,
    )
    return transformers.WhisperForConditionalGeneration(config)


def speech_inputs(batch: int, length: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Mel features of the fixed frame count Whisper expects, and ``length`` decoder tokens."""
    return {
        "input_features": torch.randn(batch, MEL_BINS, 2 * SOURCE_POSITIONS, generator=g),
        "decoder_input_ids": _ids(batch, length, g),
    }


FAMILIES = {
    f.name: f
    for f in (
        Family("gpt2", gpt2, token_inputs, ["transformer.h.1", "transformer.h.2"]),
        Family("gpt-neo", gpt_neo, token_inputs, ["transformer.h.1"]),
        Family("opt", opt, token_inputs, ["model.decoder.layers.1"]),
        Family("llama", llama, token_inputs, ["model.layers.1"]),
        Family("mistral", mistral, token_inputs, ["model.layers.1"]),
        Family("qwen2", qwen2, token_inputs, ["model.layers.1"]),
        Family("bert", bert, padded_inputs, ["bert.encoder.layer.1"]),
        Family("t5", t5, seq2seq_inputs, ["encoder.block.1", "decoder.block.0"]),
        Family("bart", bart, seq2seq_inputs, ["model.encoder.layers.1", "model.decoder.layers.0"]),
        Family("vit", vit, image_inputs, ["vit.layers.1"], lengths=(16, 24, 32)),
        Family("whisper", whisper, speech_inputs, ["model.encoder.layers.1", "model.decoder.layers.0"]),
    )
}
