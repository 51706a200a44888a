"""fp4moe's Hugging Face Transformers integration: ``patch_deepseek(model)`` and friends."""

from .expert_parallel import shard_experts
from .modelopt import CheckpointError, load_modelopt_nvfp4, save_modelopt_nvfp4
from .patch import (
    calibrate_activation_scales,
    find_experts_modules,
    fp4moe_experts_forward,
    fuse_routers,
    patch_deepseek,
    patch_moe,
    set_backend,
)

__all__ = [
    "CheckpointError", "calibrate_activation_scales", "find_experts_modules", "fp4moe_experts_forward", "fuse_routers",
    "load_modelopt_nvfp4", "patch_deepseek", "patch_moe", "save_modelopt_nvfp4", "set_backend", "shard_experts",
]
