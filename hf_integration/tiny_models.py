"""Tiny random Transformers models (no download) for tests, the demo and CI."""

from __future__ import annotations

import torch


def tiny_deepseek_v3(dtype=torch.bfloat16, seed: int | None = None, **overrides):
    """A 2-layer DeepSeek-V3 (one dense layer, one MoE layer with 8 experts, top-2)."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    cfg = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
               num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
               n_group=2, topk_group=1, n_shared_experts=1, num_attention_heads=4, num_key_value_heads=4,
               q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
               max_position_embeddings=256, routed_scaling_factor=2.5, pad_token_id=0)
    cfg.update(overrides)
    if seed is not None:
        torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(DeepseekV3Config(**cfg), dtype=dtype)
    _randomize_experts(model)
    return model.eval()


def tiny_qwen3_moe(dtype=torch.bfloat16):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    _randomize_experts(model)
    return model.eval()


def tiny_mixtral(dtype=torch.bfloat16):
    from transformers import AutoModelForCausalLM, MixtralConfig

    cfg = MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                        num_local_experts=4, num_experts_per_tok=2, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    _randomize_experts(model)
    return model.eval()


@torch.no_grad()
def _randomize_experts(model) -> None:
    """Give experts well-scaled random weights (the default init leaves some at zero), and
    routers and the LM head well-separated scores: with the default std 0.02 all router scores
    and logits are near ties, so any rounding difference (compiled vs eager) flips top-k and
    greedy choices and comparisons become coin tosses."""
    # Peaky output distribution: greedy decoding then has clear winners instead of near-ties.
    lm_head = model.get_output_embeddings()
    lm_head.weight.normal_(0, 8 * lm_head.weight.shape[-1] ** -0.5)
    for m in model.modules():
        experts = getattr(m, "experts", None)
        if isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor) and experts.gate_up_proj.dim() == 3:
            experts.gate_up_proj.normal_(0, experts.gate_up_proj.shape[-1] ** -0.5)
            experts.down_proj.normal_(0, experts.down_proj.shape[-1] ** -0.5)
            gate = getattr(m, "gate", None)
            if gate is not None and getattr(gate, "weight", None) is not None:
                gate.weight.normal_(0, 4 * gate.weight.shape[-1] ** -0.5)
