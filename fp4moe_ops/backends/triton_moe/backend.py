"""The Triton backend as the op sees it: availability, its packed layout, checks, the call."""

from __future__ import annotations

import torch

from ..base import CANONICAL, Backend, canonical_specs, check_canonical_tensors, check_specs, register_backend, \
    register_packed_layout
from .launch import triton, triton_fused_moe
from .layout import canonical_from_paired, fits_tma, paired_weight_layout

PAIRED = "paired"


class TritonBackend(Backend):
    """fp4moe's Triton kernel: exact NVFP4 weights x bf16/fp16 activations (Hopper and newer)."""

    name = "triton"
    activation_scales = "forbidden"

    def unavailable_reason(self, device: torch.device) -> str | None:
        if triton is None:
            return "triton is not installed"
        if device.type != "cuda":
            return "needs a CUDA GPU"
        if torch.cuda.get_device_capability(device) < (8, 0):
            return "needs compute capability 8.0+ (bf16 tensor cores)"
        return None

    def packed_layout(self, hidden_size: int, intermediate_size: int) -> str:
        """The paired layout where tiles come through TMA (H and I multiples of 256)."""
        return PAIRED if fits_tma(hidden_size, intermediate_size) else CANONICAL

    def check_expert_tensors(self, expert_tensors, hidden_size):
        """The canonical layout, or (H and I multiples of 256) packed weights in the paired layout,
        ``w13 [E, I, H/4]`` and ``w2 [E, H/2, I/4]`` int32."""
        if len(expert_tensors) != 6 or expert_tensors[0].dtype != torch.int32:
            return check_canonical_tensors(expert_tensors, hidden_size)
        specs = canonical_specs(expert_tensors, hidden_size)
        e, inter = specs["w13_global"][1][0], specs["w2"][1][2] * 2
        if not fits_tma(hidden_size, inter):
            raise ValueError(f"the paired weight layout needs H and I multiples of 256, got H={hidden_size}, I={inter}")
        specs["w13"] = (expert_tensors[0], (e, inter, hidden_size // 4), torch.int32)
        specs["w2"] = (expert_tensors[3], (e, hidden_size // 2, inter // 4), torch.int32)
        check_specs({f"{n} (paired)" if n in ("w13", "w2") else n: v for n, v in specs.items()}, hidden_size)
        return e

    def run(self, hidden_states, topk_ids, topk_weights, expert_tensors, fc1_act_scale, fc2_act_scale,
            routed_experts=0):
        # Triton launches on the current device: make it the experts' (device_map spreads layers)
        with torch.cuda.device(hidden_states.device):
            return triton_fused_moe(hidden_states, topk_ids, topk_weights, expert_tensors,
                                    routed_experts=routed_experts)


register_packed_layout(PAIRED, paired_weight_layout, canonical_from_paired)
register_backend(TritonBackend())
