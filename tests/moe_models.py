"""Small random MoE and hybrid models of transformers 5.x, built from config classes with
the library's defaults (``use_cache`` left on, the experts' default implementation, which
calls ``torch._grouped_mm``): 4 layers, width 64, a few experts, a vocabulary of 96.
Reused by tests/test_moe_families.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

VOCAB = 96
# token ids within the vocabulary, so configs do not warn about their defaults
SPECIAL = dict(bos_token_id=0, eos_token_id=1, pad_token_id=2)
COMMON = dict(
    num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=VOCAB, max_position_embeddings=64, **SPECIAL,
)


@dataclass(frozen=True)
class MoeFamily:
    """One family: its config and model classes and the config's family-specific fields."""

    name: str
    config: str
    model: str
    extra: dict = field(default_factory=dict)
    split: str = "model.layers.2"

    def build(self, **overrides) -> nn.Module:
        """The model in float32, seeded, from its config with ``overrides``."""
        config = getattr(transformers, self.config)(**{**COMMON, **self.extra, **overrides})
        torch.manual_seed(0)
        return getattr(transformers, self.model)(config)


FAMILIES = {
    f.name: f
    for f in (
        MoeFamily("mixtral", "MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
        MoeFamily(
            "qwen3-moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
            dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16),
        ),
        MoeFamily(
            "qwen2-moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
            dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64),
        ),
        MoeFamily("olmoe", "OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2)),
    )
}


def token_batch(batch: int = 8, length: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def max_relative_grad_error(pipe, model: nn.Module) -> float:
    """The largest |pipeline grad - eager grad| / max |eager grad| over every parameter."""
    eager = dict(model.named_parameters())
    return max(
        float((p.grad - eager[k].grad).abs().max() / eager[k].grad.abs().max().clamp_min(1e-30))
        for k, p in pipe.named_parameters()
    )


def logits_loss() -> Callable:
    def loss_fn(out, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten())

    return loss_fn


HYBRID = MoeFamily(
    "jamba", "JambaConfig", "JambaForCausalLM",
    dict(num_experts=4, num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1, attn_layer_period=2,
         attn_layer_offset=1, mamba_d_state=8, mamba_expand=2, mamba_dt_rank=8),
)
FAMILIES[HYBRID.name] = HYBRID
DEEPSEEK = MoeFamily(
    "deepseek-v3", "DeepseekV3Config", "DeepseekV3ForCausalLM",
    dict(n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=32, first_k_dense_replace=1,
         kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_shared_experts=1, num_key_value_heads=4),
)
FAMILIES[DEEPSEEK.name] = DEEPSEEK
