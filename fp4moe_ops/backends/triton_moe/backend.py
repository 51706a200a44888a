"""The Triton backend as the op sees it: availability, its packed layout, checks, the call."""

from __future__ import annotations

import torch

from ..base import CANONICAL, Backend, canonical_specs, check_canonical_tensors, check_specs, register_backend, \
    register_packed_layout
from .launch import triton, triton_fused_moe, triton_gpt_oss_moe
from .layout import KERNEL_MULTIPLE, canonical_from_paired, fits_tma, paired_weight_layout, scale_columns

PAIRED = "paired"


class TritonBackend(Backend):
    """fp4moe's Triton kernel: exact NVFP4 weights x bf16/fp16 activations (Hopper and newer)."""

    name = "triton"
    activation_scales = "forbidden"
    reads_e8m0_scales = True

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
        ``gate_up [E, I, H/4]`` and ``down [E, H/2, I/4]`` int32."""
        if len(expert_tensors) != 6 or expert_tensors[0].dtype != torch.int32:
            return check_canonical_tensors(expert_tensors, hidden_size)
        specs = canonical_specs(expert_tensors, hidden_size)
        e, inter = specs["gate_up_global_scale"][1][0], specs["down"][1][2] * 2
        if not fits_tma(hidden_size, inter):
            raise ValueError(f"the paired weight layout needs H and I multiples of 256, got H={hidden_size}, I={inter}")
        specs["gate_up"] = (expert_tensors[0], (e, inter, hidden_size // 4), torch.int32)
        specs["down"] = (expert_tensors[3], (e, hidden_size // 2, inter // 4), torch.int32)
        check_specs({f"{n} (paired)" if n in ("gate_up", "down") else n: v for n, v in specs.items()}, hidden_size)
        return e

    def run(self, hidden_states, topk_ids, topk_weights, expert_tensors, gate_up_input_scale, down_input_scale,
            routed_experts=0):
        # Triton launches on the current device: make it the experts' (device_map spreads layers)
        with torch.cuda.device(hidden_states.device):
            return triton_fused_moe(hidden_states, topk_ids, topk_weights, expert_tensors,
                                    routed_experts=routed_experts)


    def gpt_oss_refusal(self, device: torch.device) -> str | None:
        reason = self.unavailable_reason(device)
        if reason is None and torch.cuda.get_device_capability(device) < (9, 0):
            reason = "gpt-oss's experts run on its TMA kernels: compute capability 9.0+"
        return reason

    def check_gpt_oss_tensors(self, expert_tensors, hidden_size):
        """The experts in this backend's layout (:func:`.layout.gpt_oss_kernel_tensors`): MXFP4 ``[gate_up
        [E, Ip, Hp/4] int32, gate_up_scale [E, 2Ip, Hs] int8, gate_up_bias [E, 2Ip] float32, down [E, Hp/2,
        Ip/4] int32, down_scale [E, Hp, Is] int8, down_bias [E, Hp] float32]``, or NVFP4 the same with
        uint8 scales and the global scales ``gate_up_global_scale``, ``down_global_scale [E]`` float32 after
        them; Hp and Ip multiples of 64, ``hidden_size <= Hp`` and Hs, Is their
        :func:`.layout.scale_columns` (MXFP4: one E8M0 byte per 32 values, NVFP4: one E4M3 byte per 16).
        Metadata only."""
        nvfp4 = len(expert_tensors) == 8
        names = (("gate_up", "gate_up_scale", "gate_up_global_scale", "gate_up_bias",
                  "down", "down_scale", "down_global_scale", "down_bias") if nvfp4 else
                 ("gate_up", "gate_up_scale", "gate_up_bias", "down", "down_scale", "down_bias"))
        if len(expert_tensors) not in (6, 8) or expert_tensors[0].dtype != torch.int32:
            raise ValueError("the triton backend runs gpt-oss's experts in its own layout (6 tensors for MXFP4, 8 for "
                             "NVFP4, gate_up int32 first: fp4moe_ops.backends.triton_moe.layout.gpt_oss_kernel_tensors; "
                             "the gpt-oss experts modules' set_backend('triton') converts their tensors), got "
                             f"{[f'{t.dtype} {list(t.shape)}' for t in expert_tensors]}")
        gate_up, gate_up_scale = expert_tensors[0], expert_tensors[1]
        if gate_up.dim() != 3 or gate_up_scale.dim() != 3:
            raise ValueError(f"gate_up, gate_up_scale: expected [E, Ip, Hp/4] and [E, 2Ip, Hs], got "
                             f"{list(gate_up.shape)} and {list(gate_up_scale.shape)}")
        e, ip, hp = gate_up_scale.shape[0], gate_up_scale.shape[1] // 2, gate_up.shape[2] * 4
        if ip % KERNEL_MULTIPLE or hp % KERNEL_MULTIPLE or hidden_size > hp:
            raise ValueError(f"gpt-oss kernel tensors: Ip={ip} and Hp={hp} must be multiples of {KERNEL_MULTIPLE} "
                             f"with hidden size {hidden_size} <= Hp")
        scale, per = (torch.uint8, 16) if nvfp4 else (torch.int8, 32)  # E4M3 or E8M0 bytes, values per byte
        specs = {"gate_up": (torch.int32, (e, ip, hp // 4)),
                 "gate_up_scale": (scale, (e, 2 * ip, scale_columns(hp, per))),
                 "gate_up_global_scale": (torch.float32, (e,)), "gate_up_bias": (torch.float32, (e, 2 * ip)),
                 "down": (torch.int32, (e, hp // 2, ip // 4)), "down_scale": (scale, (e, hp, scale_columns(ip, per))),
                 "down_global_scale": (torch.float32, (e,)), "down_bias": (torch.float32, (e, hp))}
        for name, t in zip(names, expert_tensors):
            dtype, shape = specs[name]
            if t.dtype != dtype or tuple(t.shape) != shape:
                raise ValueError(f"gpt-oss kernel tensor {name}: expected {dtype} {list(shape)}, got {t.dtype} "
                                 f"{list(t.shape)}")
        return e

    def run_gpt_oss(self, hidden_states, topk_ids, topk_weights, expert_tensors, swiglu_alpha, limit):
        with torch.cuda.device(hidden_states.device):
            return triton_gpt_oss_moe(hidden_states, topk_ids, topk_weights, expert_tensors, swiglu_alpha, limit)


register_packed_layout(PAIRED, paired_weight_layout, canonical_from_paired)
register_backend(TritonBackend())
