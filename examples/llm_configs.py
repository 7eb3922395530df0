"""Small causal language models from transformers' configs (random weights, no download),
as model factories for the ``fxpipe`` command:

    fxpipe inspect examples/llm_configs.py:gpt2 --input 8x128:int64 --stages 4 --html
    fxpipe inspect examples/llm_configs.py:llama --model-arg layers=16 --input 8x128:int64 --stages 4
    fxpipe train examples/llm_configs.py:gpt2 --input 8x64:int64 --stages 2 --loss lm

Each factory takes the depth, width, heads and vocabulary; dropout is off and the KV cache
unused, as for training. docs/inspection.md walks through what fxpipe shows of them.
"""

from __future__ import annotations

import transformers
from torch import nn

SPECIAL = dict(bos_token_id=0, eos_token_id=1, pad_token_id=2)  # ids within any vocabulary given


def gpt2(layers: int = 12, width: int = 128, heads: int = 4, vocab: int = 1024, positions: int = 512) -> nn.Module:
    """A GPT-2 (``GPT2LMHeadModel``: learned positions, tied input and output embeddings)."""
    config = transformers.GPT2Config(
        n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocab, n_positions=positions,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, **SPECIAL,
    )
    return transformers.GPT2LMHeadModel(config)


def llama(layers: int = 12, width: int = 128, heads: int = 4, vocab: int = 1024, positions: int = 512) -> nn.Module:
    """A Llama (``LlamaForCausalLM``: rotary positions, RMSNorm, gated MLP, grouped-query
    attention with half as many key/value heads)."""
    config = transformers.LlamaConfig(
        num_hidden_layers=layers, hidden_size=width, intermediate_size=int(width * 8 / 3), num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2), vocab_size=vocab, max_position_embeddings=positions,
        attention_dropout=0.0, use_cache=False, **SPECIAL,
    )
    return transformers.LlamaForCausalLM(config)
