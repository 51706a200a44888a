"""Architectures that Transformers runs under another name: Kimi-K2 (``model_type: "kimi_k2"``,
remote code upstream) is DeepSeek-V3's architecture. Registered here (only where Transformers has no
``kimi_k2`` of its own) so that plain ``from_pretrained`` of a Kimi-K2 checkpoint runs Transformers'
DeepSeek-V3 code, with DeepSeek-V3's checkpoint conversion (per-expert tensors to fused experts)."""

from __future__ import annotations

from transformers import AutoConfig, AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

KIMI_K2 = "kimi_k2"


class KimiK2Config(DeepseekV3Config):
    """Kimi-K2's config: DeepSeek-V3's fields under ``model_type: "kimi_k2"``."""

    model_type = KIMI_K2


class KimiK2ForCausalLM(DeepseekV3ForCausalLM):
    """Kimi-K2 as DeepSeek-V3 (the same modules, weights and routing)."""

    config_class = KimiK2Config


def register() -> None:
    """Map ``kimi_k2`` to DeepSeek-V3 in Transformers' auto classes (idempotent; a no-op where
    Transformers knows ``kimi_k2`` itself)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if KIMI_K2 in CONFIG_MAPPING:
        return
    AutoConfig.register(KIMI_K2, KimiK2Config)
    AutoModelForCausalLM.register(KimiK2Config, KimiK2ForCausalLM)
    register_checkpoint_conversion_mapping(KIMI_K2, get_checkpoint_conversion_mapping("deepseek_v3"), overwrite=True)


__all__ = ["KimiK2Config", "KimiK2ForCausalLM", "register"]
