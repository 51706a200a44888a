"""Pure-PyTorch reference backend: runs anywhere (CPU included).

It computes what a fused kernel computes, expert by expert over the tokens routed to it
(:func:`fp4moe_ops.moe_math.routed_moe`): dequantized NVFP4 weights in float32, float32
accumulation, the gated-SiLU intermediate rounded to the activation dtype (as kernels store it).
With activation scales it also rounds each expert's GEMM inputs through NVFP4 with that expert's
scale (what FlashInfer does after permuting tokens to experts, in its formulation:
:func:`~fp4moe_ops.nvfp4.quantize_activation_nvfp4`); without them it is W4A16.

:func:`reference_moe` with ``cutlass_rounding=True`` also rounds each GEMM's output to the
activation dtype, where FlashInfer's CUTLASS kernel writes BF16: the kernel-faithful comparison
for ``flashinfer_nvfp4``. Slow and host-syncing (one sync per call): for correctness, CPU
use and tiny models, not for CUDA graphs.

:func:`reference_gpt_oss_moe` is gpt-oss's experts (``fp4moe::gpt_oss_moe``) the same way: each
routed expert's weights decoded to float32 (MXFP4: gpt-oss's blocks and E8M0 scales; NVFP4: E2M1
codes, E4M3 block scales and the global scale), float32 GEMMs with their biases, the clamped SwiGLU
(:func:`~fp4moe_ops.moe_math.clamped_swiglu`) rounded to the activation dtype.
"""

from __future__ import annotations

import torch

from ..moe_math import clamped_swiglu, expert_scale, gated_silu, routed_moe
from ..mxfp4 import dequantize_gpt_oss, e8m0_decode
from ..nvfp4 import BLOCK_SIZE, dequantize_nvfp4, e2m1_decode, quantize_activation_nvfp4, unpack_e2m1
from .base import Backend, register_backend


def _fake_quantize(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """Round an activation through NVFP4 with calibrated ``input_scale``; float32."""
    return quantize_activation_nvfp4(x, 1.0 / input_scale) * input_scale


def _dequantize(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """One expert's matrix in float32 from the op's canonical tensors: NVFP4 (E4M3 block scales as
    uint8 bytes or float8, times the global scale) or MXFP4 (E8M0 bytes as int8, one per 16 values:
    ``2^(byte - 127)``, the global scale unused, as in the Triton kernels)."""
    if block_scale.dtype != torch.int8:
        return dequantize_nvfp4(packed, block_scale.view(torch.float8_e4m3fn), global_scale)
    values = e2m1_decode(unpack_e2m1(packed)).unflatten(-1, (-1, BLOCK_SIZE))
    return (values * e8m0_decode(block_scale.view(torch.uint8))[..., None]).flatten(-2)


def reference_moe(hidden_states, topk_ids, topk_weights, expert_tensors, gate_up_input_scale=None,
                  down_input_scale=None, *, cutlass_rounding: bool = False, observe=None) -> torch.Tensor:
    """The MoE layer on canonical tensors ``[gate_up, gate_up_scale (E4M3 as uint8 bytes or float8,
    or MXFP4's E8M0 as int8), gate_up_global_scale, down, down_scale, down_global_scale]``; ``[T, H]``
    in ``hidden_states.dtype``.

    ``cutlass_rounding``: round the gate_up and the down GEMM's outputs to the activation dtype, as
    FlashInfer's CUTLASS kernel does (its BF16 stores), instead of keeping them in float32.
    ``observe(e, gate_up_input, down_input)``: called with each expert's inputs (calibration).
    """
    gate_up, gate_up_scale, gate_up_global_scale, down, down_scale, down_global_scale = expert_tensors
    dtype = hidden_states.dtype

    def rounded(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype).float() if cutlass_rounding else t

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        gate_up_in, down_in = expert_scale(gate_up_input_scale, e), expert_scale(down_input_scale, e)
        x = rows.float() if gate_up_in is None else _fake_quantize(rows, gate_up_in)
        act = gated_silu(rounded(x @ _dequantize(gate_up[e], gate_up_scale[e], gate_up_global_scale[e]).T), dtype)
        if observe is not None:
            observe(e, rows, act)
        down_x = act.float() if down_in is None else _fake_quantize(act, down_in)
        return rounded(down_x @ _dequantize(down[e], down_scale[e], down_global_scale[e]).T)

    return routed_moe(hidden_states, topk_ids, topk_weights, gate_up.shape[0], expert).to(dtype)


def reference_gpt_oss_moe(hidden_states, topk_ids, topk_weights, expert_tensors, swiglu_alpha: float,
                          limit: float) -> torch.Tensor:
    """gpt-oss's MoE experts on its MXFP4 checkpoint tensors ``[gate_up_blocks, gate_up_scales,
    gate_up_bias, down_blocks, down_scales, down_bias]`` or on NVFP4 ones ``[gate_up, gate_up_scale,
    gate_up_global_scale, gate_up_bias, down, down_scale, down_global_scale, down_bias]`` (rows
    interleaving gate and up: see ``fp4moe::gpt_oss_moe``); ``[T, H]`` in ``hidden_states.dtype``."""
    if len(expert_tensors) == 8:
        (gate_up_packed, gate_up_scale, gate_up_global_scale, gate_up_bias,
         down_packed, down_scale, down_global_scale, down_bias) = expert_tensors
        gate_up_scale, down_scale = gate_up_scale.view(torch.float8_e4m3fn), down_scale.view(torch.float8_e4m3fn)
        gate_up = lambda e: dequantize_nvfp4(gate_up_packed[e], gate_up_scale[e], gate_up_global_scale[e])  # noqa: E731
        down = lambda e: dequantize_nvfp4(down_packed[e], down_scale[e], down_global_scale[e])  # noqa: E731
    else:
        gate_up_blocks, gate_up_scales, gate_up_bias, down_blocks, down_scales, down_bias = expert_tensors
        gate_up = lambda e: dequantize_gpt_oss(gate_up_blocks[e], gate_up_scales[e])  # noqa: E731
        down = lambda e: dequantize_gpt_oss(down_blocks[e], down_scales[e])  # noqa: E731
    dtype = hidden_states.dtype

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        h = rows.float() @ gate_up(e).T + gate_up_bias[e].float()
        act = clamped_swiglu(h, swiglu_alpha, limit).to(dtype)  # the intermediate a kernel stores
        return act.float() @ down(e).T + down_bias[e].float()

    return routed_moe(hidden_states, topk_ids, topk_weights, gate_up_bias.shape[0], expert).to(dtype)


class ReferenceBackend(Backend):
    """Pure PyTorch, any device; float32 math on dequantized weights (slow)."""

    name = "reference"
    reads_e8m0_scales = True
    activation_scales = "optional"

    def unavailable_reason(self, device: torch.device) -> str | None:
        return None

    def run(self, hidden_states, topk_ids, topk_weights, expert_tensors, gate_up_input_scale, down_input_scale,
            routed_experts=0):
        return reference_moe(hidden_states, topk_ids, topk_weights, expert_tensors, gate_up_input_scale,
                             down_input_scale)

    def gpt_oss_refusal(self, device: torch.device) -> str | None:
        return None

    def run_gpt_oss(self, hidden_states, topk_ids, topk_weights, expert_tensors, swiglu_alpha, limit):
        return reference_gpt_oss_moe(hidden_states, topk_ids, topk_weights, expert_tensors, swiglu_alpha, limit)


register_backend(ReferenceBackend())
