"""CPU models of FlashInfer's Blackwell FP4 kernels: test oracles, not backends. The CUTLASS
NVFP4 x NVFP4 fused MoE (:func:`simulate_cutlass_nvfp4_moe`) and the W4A16 dense GEMM
``mm_bf16_fp4(..., backend="cudnn")`` (:func:`simulate_mm_bf16_fp4`).

It consumes the exact prepared arguments (``nvfp4_weight_arguments`` + ``nvfp4_quant_scales``
of :mod:`fp4moe_ops.backends.flashinfer_cutlass`) in FlashInfer's semantics. We have no
Blackwell GPU, so this is how the Blackwell path's arguments are checked: tests run it against
the reference backend, and the accuracy study uses it for the activation-scale modes (including
the pre-seed bug). It reads the kernel's tensors as FlashInfer does: int64-packed E2M1, swizzled
int32 block scales, activations quantized with ``act_global`` (the reciprocal of ModelOpt's
``input_scale``), GEMM outputs rescaled by ``alpha[e]`` and stored in the activation dtype (the
kernel's BF16 outputs), fc1 rows ``[up; gate]``, ids outside ``[0, E)`` skipped.
"""

from __future__ import annotations

import torch

from .moe_math import expert_scale, gated_silu, routed_moe
from .nvfp4 import BLOCK_SIZE, e2m1_decode, quantize_activation_nvfp4, unpack_e2m1, unswizzle_block_scale


def _weight(packed_i64: torch.Tensor, sf_i32: torch.Tensor, e: int) -> torch.Tensor:
    """Expert e's ``e2m1 * block_scale`` (no global scale) from the kernel's tensors."""
    packed = packed_i64[e].view(torch.uint8)
    rows, k = packed.shape[0], packed.shape[1] * 2
    sf = unswizzle_block_scale(sf_i32[e].view(torch.uint8), rows, k // BLOCK_SIZE)
    sf = sf.view(torch.float8_e4m3fn).float().repeat_interleave(BLOCK_SIZE, -1)
    return e2m1_decode(unpack_e2m1(packed)) * sf


def simulate_cutlass_nvfp4_moe(hidden_states, topk_ids, topk_weights, fc1_weights, fc2_weights, quant_scales):
    """``cutlass_fused_moe`` NVFP4 semantics on CPU; returns ``[T, H]`` float32."""
    fc1_act_global, fc1_sf, fc1_alpha, fc2_act_global, fc2_sf, fc2_alpha = quant_scales
    dtype = hidden_states.dtype

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        a1 = quantize_activation_nvfp4(rows, expert_scale(fc1_act_global, e))
        h = ((a1 @ _weight(fc1_weights, fc1_sf, e).T) * fc1_alpha[e]).to(dtype).float()
        a2 = quantize_activation_nvfp4(gated_silu(h, dtype, up_first=True), expert_scale(fc2_act_global, e))
        return ((a2 @ _weight(fc2_weights, fc2_sf, e).T) * fc2_alpha[e]).to(dtype).float()

    return routed_moe(hidden_states, topk_ids, topk_weights, fc1_weights.shape[0], expert)


def simulate_mm_bf16_fp4(a, b, b_descale, alpha=None, *, backend, out_dtype=None):
    """``flashinfer.mm_bf16_fp4`` with ``backend="cudnn"`` on CPU, in float64: ``(a @ dequant(b).T) *
    alpha`` with ``dequant(b) = e2m1 * block scale`` (FlashInfer's docstring), enforcing the argument
    contract of that path: ``a [M, K]`` bfloat16, ``b [N, K/2]`` uint8 (low nibble = even k),
    ``b_descale`` the linear, non-swizzled ``[N, K/16]`` float8_e4m3fn scales (what
    ``prepare_bf16_fp4_weights(..., backend="cudnn")`` returns), ``alpha`` None or ``[1]`` float32."""
    if backend != "cudnn":
        raise ValueError(f"only the cuDNN path is modelled, got backend={backend!r}")
    if a.dtype != torch.bfloat16 or a.dim() != 2:
        raise TypeError(f"a must be [M, K] bfloat16, got {a.dtype} {list(a.shape)}")
    n, k = b.shape[0], b.shape[1] * 2
    if b.dtype != torch.uint8 or b.dim() != 2 or a.shape[1] != k:
        raise TypeError(f"b must be [N, K/2] uint8 with K = {a.shape[1]}, got {b.dtype} {list(b.shape)}")
    if b_descale.dtype != torch.float8_e4m3fn or tuple(b_descale.shape) != (n, k // BLOCK_SIZE):
        raise TypeError(f"b_descale must be the linear [N, K/16] float8_e4m3fn scales, got {b_descale.dtype} "
                        f"{list(b_descale.shape)}")
    if alpha is not None and (alpha.dtype != torch.float32 or tuple(alpha.shape) != (1,)):
        raise TypeError(f"alpha must be [1] float32, got {alpha.dtype} {list(alpha.shape)}")
    if out_dtype not in (None, torch.bfloat16, torch.float16):
        raise TypeError(f"out_dtype must be bf16 or fp16, got {out_dtype}")
    w = e2m1_decode(unpack_e2m1(b)).double() * b_descale.double().repeat_interleave(BLOCK_SIZE, -1)
    out = a.double() @ w.T
    return out if alpha is None else out * alpha.double()
