"""Module surgery: finding the modules of a Transformers model that fp4moe replaces, and swapping
them in place (an accelerate hook that device_map dispatch put on the old module moves over); what
the swapped-in modules' activations run, logged."""

from __future__ import annotations

import torch
from torch import nn

from transformers.utils import logging

from .gpt_oss import NVFP4GptOssExperts
from .experts import NVFP4Experts, NVFP4Linear

logger = logging.get_logger("transformers.fp4moe")  # under Transformers: set_verbosity_* applies

SILU_NAMES = ("SiLUActivation", "SiLU")


def children_where(model: nn.Module, predicate) -> list[tuple[nn.Module, str, nn.Module]]:
    """``(parent, attribute, module)`` of every submodule for which ``predicate(module)`` holds:
    what :func:`replace_module` needs to swap it."""
    return [(parent, attr, m) for parent in model.modules() for attr, m in parent.named_children() if predicate(m)]


def replace_module(parent: nn.Module, attr: str, new: nn.Module) -> None:
    """``parent.attr = new``, keeping an accelerate hook (device_map dispatch) the old one had."""
    old = getattr(parent, attr)
    setattr(parent, attr, new)
    if hasattr(old, "_hf_hook"):
        from accelerate.hooks import add_hook_to_module

        add_hook_to_module(new, old._hf_hook)


def is_transformers_experts(m: nn.Module) -> bool:
    """A Transformers fused-experts module (``@use_experts_implementation``) with its weights."""
    return hasattr(m, "is_concatenated") and hasattr(m, "has_gate") and \
        isinstance(getattr(m, "gate_up_proj", None), torch.Tensor)


def experts_form_problem(m: nn.Module) -> str | None:
    """Why fp4moe's NVFP4 experts (a SiLU-gated MLP per expert over concatenated ``[gate; up]``
    rows, no biases) cannot stand for Transformers' experts module ``m``, or None. gpt-oss's experts
    (transposed, interleaved, biased, clamped SwiGLU) are one such: they run as
    :class:`~hf_integration.gpt_oss.MXFP4GptOssExperts`."""
    if not m.has_gate or not m.is_concatenated or m.is_transposed or m.has_bias:
        return "only gated, concatenated [gate; up], untransposed, bias-free experts are supported"
    act = getattr(m, "act_fn", None)
    if act is not None and not is_silu(act):
        return f"activation {type(act).__name__} is not SiLU"
    return None


def find_experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every routed-experts module: Transformers' BF16 ones and fp4moe's NVFP4 ones."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, NVFP4Experts) or is_transformers_experts(m)]


def nvfp4_experts(model: nn.Module) -> list[tuple[str, NVFP4Experts]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, NVFP4Experts)]


def is_silu(act: nn.Module | None) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ in SILU_NAMES


def is_dense_gated_mlp(m: nn.Module) -> bool:
    """A bias-free SiLU gated MLP with ``gate_proj`` / ``up_proj`` / ``down_proj`` linears."""
    lin = [getattr(m, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    return all(isinstance(x, nn.Linear) and x.bias is None for x in lin) and is_silu(getattr(m, "act_fn", None))


def log_activation_modes(model: nn.Module) -> None:
    """Say where the model's activations are not what its NVFP4 tensors declare: calibrated input
    scales held but unused (16-bit activations), or NVFP4 activations for the routed experts only.
    Reads the modes the experts run (a backend may choose one: ``flashinfer_nvfp4``)."""
    experts = [m for m in model.modules() if isinstance(m, NVFP4Experts)]
    modes = {m.act_scale_mode for m in experts} - {None}
    held = [m for m in model.modules()
            if (isinstance(m, NVFP4Experts) and getattr(m, "fc1_input_scale", None) is not None)
            or (isinstance(m, NVFP4Linear) and m.scheme.input_scale in m._buffers)
            or (isinstance(m, NVFP4GptOssExperts) and "gate_up_proj_input_scale" in m._buffers)]
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


__all__ = ["children_where", "find_experts_modules", "is_dense_gated_mlp", "is_silu", "is_transformers_experts",
           "log_activation_modes", "nvfp4_experts", "replace_module"]
