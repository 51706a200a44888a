"""What a model's activations run, said where it differs from what its quantized tensors declare:
calibrated input scales held but unused (16-bit activations), or NVFP4 activations for the routed
experts only. Logged after loading, patching and :func:`hf_integration.set_backend`."""

from __future__ import annotations

from torch import nn
from transformers.utils import logging

from .experts import NVFP4Experts, NVFP4Linear
from .kinds import quantized_modules

logger = logging.get_logger("transformers.fp4moe")  # under Transformers: set_verbosity_* applies


def log_activation_modes(model: nn.Module) -> None:
    """Say where the model's activations are not what its quantized tensors declare (see the module
    docstring). Reads the modes the experts run (a backend may choose one: ``flashinfer_nvfp4``);
    only NVFP4Experts run NVFP4 activations, and only NVFP4 linears are left out of them."""
    experts = [m for m in model.modules() if isinstance(m, NVFP4Experts)]
    modes = {m.act_scale_mode for m in experts} - {None}
    held = [m for _, m in quantized_modules(model) if m.holds_input_scales()]
    linears = [m for m in model.modules() if isinstance(m, NVFP4Linear)]
    if not modes and held:
        fused = any(type(m).__name__ == "ExpertsWithShared" for m in experts)
        how = ("a model whose shared experts run inside the routed call cannot run them (load or patch with "
               "fuse_shared_experts=False for NVFP4 activations)" if fused else
               "fp4moe runs gpt-oss's NVFP4 layers with 16-bit activations only" if not experts else
               "act_scale_mode='per_expert' or 'global_max' (set_backend, or the loading config) runs the routed "
               "experts' activations in NVFP4")
        logger.warning("fp4moe: %d modules hold calibrated input scales (NVFP4 activations, W4A4), kept for "
                       "save_pretrained; activations stay 16-bit (W4A16); %s", len(held), how)
    elif modes and linears:
        logger.warning("fp4moe: act_scale_mode=%s quantizes the routed experts' activations only; the model's %d "
                       "NVFP4 linears outside them (attention, dense MLPs, shared experts) keep 16-bit activations",
                       "/".join(sorted(modes)), len(linears))


__all__ = ["log_activation_modes"]
