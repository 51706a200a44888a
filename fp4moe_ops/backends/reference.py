"""Pure-PyTorch reference backend: runs anywhere (CPU included), no host syncs.

It computes what a fused kernel computes, one expert at a time over all tokens (dense, so no
data-dependent shapes): dequantized NVFP4 weights in float32, float32 accumulation, the
gated-SiLU intermediate rounded to the activation dtype (as kernels store it). With activation
scales it also rounds each expert's GEMM inputs through NVFP4 with that expert's scale (what
FlashInfer does after permuting tokens to experts, in its formulation:
:func:`~fp4moe_ops.nvfp4.quantize_activation_nvfp4`); without them it is W4A16.
Slow (E dense expert passes): meant for correctness, CPU use and tiny models.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..nvfp4 import dequantize_nvfp4, quantize_activation_nvfp4
from .base import Backend, register_backend


def _expert_scale(scale: torch.Tensor | None, e: int) -> torch.Tensor | None:
    if scale is None:
        return None
    return scale.reshape(-1)[e] if scale.numel() > 1 else scale.reshape(())


def _fake_quantize(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """Round an activation through NVFP4 with calibrated ``input_scale``; float32."""
    return quantize_activation_nvfp4(x, 1.0 / input_scale) * input_scale


class ReferenceBackend(Backend):
    """Pure PyTorch, any device; float32 math on dequantized weights (slow)."""

    name = "reference"
    activation_scales = "optional"

    def unavailable_reason(self, device: torch.device) -> str | None:
        return None

    def run(self, hidden_states, topk_ids, topk_weights, expert_tensors, fc1_act_scale, fc2_act_scale,
            routed_experts=0):
        w13, s13, g13, w2, s2, g2 = expert_tensors
        s13, s2 = s13.view(torch.float8_e4m3fn), s2.view(torch.float8_e4m3fn)
        num_experts, intermediate = w13.shape[0], w13.shape[1] // 2
        out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
        x = hidden_states.float()
        for e in range(num_experts):
            # Routing weight of expert e for each token; 0 where e is not chosen (ids outside
            # [0, E), e.g. expert-parallel sentinels, never match any e).
            route = (topk_weights.float() * (topk_ids == e)).sum(dim=-1)  # [T]
            a1 = x
            fc1_scale = _expert_scale(fc1_act_scale, e)
            if fc1_scale is not None:
                a1 = _fake_quantize(hidden_states, fc1_scale)
            gate_up = a1 @ dequantize_nvfp4(w13[e], s13[e], g13[e]).T  # [T, 2I] fp32
            act = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
            a2 = act.to(hidden_states.dtype)
            fc2_scale = _expert_scale(fc2_act_scale, e)
            a2 = _fake_quantize(a2, fc2_scale) if fc2_scale is not None else a2.float()
            out += route[:, None] * (a2 @ dequantize_nvfp4(w2[e], s2[e], g2[e]).T)
        return out.to(hidden_states.dtype)


register_backend(ReferenceBackend())
