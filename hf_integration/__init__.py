"""fp4moe's Hugging Face Transformers integration: ``patch_deepseek(model)`` and friends."""

from .patch import (
    calibrate_activation_scales,
    find_experts_modules,
    fp4moe_experts_forward,
    patch_deepseek,
    patch_moe,
    set_backend,
)

__all__ = [
    "calibrate_activation_scales", "find_experts_modules", "fp4moe_experts_forward",
    "patch_deepseek", "patch_moe", "set_backend",
]
