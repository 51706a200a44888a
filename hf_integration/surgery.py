"""Module surgery: finding the modules of a Transformers model that fp4moe replaces, and swapping
them in place (an accelerate hook that device_map dispatch put on the old module moves over)."""

from __future__ import annotations

import torch
from torch import nn

from fp4moe_ops.nvfp4 import BLOCK_SIZE as NVFP4_BLOCK

from .experts import NVFP4Experts

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


def nvfp4_experts_problem(m: nn.Module) -> str | None:
    """Why ``m`` (Transformers' experts) cannot be quantized into fp4moe's NVFP4 experts, from its
    form and shapes alone (:func:`experts_form_problem`, and NVFP4's blocks of 16 along both
    reductions), or None."""
    problem = experts_form_problem(m)
    _, two_i, h = m.gate_up_proj.shape
    if problem is None and (h % NVFP4_BLOCK or (two_i // 2) % NVFP4_BLOCK):
        problem = f"hidden {h} and intermediate {two_i // 2} must be multiples of {NVFP4_BLOCK}"
    return problem


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


__all__ = ["children_where", "find_experts_modules", "nvfp4_experts_problem", "is_dense_gated_mlp", "is_silu", "is_transformers_experts",
           "nvfp4_experts", "replace_module"]
