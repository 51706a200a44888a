"""The float64 oracle of the tests and the self-test: independent MoE math that decodes NVFP4 and
MXFP4 bytes from the format definitions (its own codebook and bit twiddling, not
:mod:`fp4moe_ops.nvfp4` / :mod:`fp4moe_ops.mxfp4`) and loops over experts and their tokens. Slow by
design; nothing in the library computes with it."""

import torch
import torch.nn.functional as F

CODEBOOK = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def dequant64(packed: torch.Tensor, scale_e4m3: torch.Tensor, global_scale) -> torch.Tensor:
    """[N, K/2] uint8 + [N, K/16] float8_e4m3fn (+ scalar fp32) -> [N, K] float64."""
    vals = e2m1_64(packed)
    s = scale_e4m3.double().repeat_interleave(16, dim=-1)
    return vals * s * float(global_scale)


def e2m1_64(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] uint8 -> [..., K] float64 E2M1 values, low nibble first."""
    p = packed.long()
    codes = torch.stack([p & 15, p >> 4], dim=-1).flatten(-2)
    return CODEBOOK[codes & 7] * torch.where(codes >= 8, -1.0, 1.0).double()


def dequant_mx64(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """gpt-oss MXFP4 ``[N, K/32, 16]`` uint8 blocks + ``[N, K/32]`` E8M0 bytes -> ``[N, K]`` float64
    (``2^(s - 127)``, NaN for 0xFF)."""
    s = torch.where(scales == 255, float("nan"), torch.pow(2.0, scales.double() - 127))
    return (e2m1_64(blocks) * s[..., None]).flatten(-2)


def gpt_oss_moe64(x, ids, weights, tensors, swiglu_alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's experts in float64, token by token: ``tensors`` are MXFP4 ``[gate_up_blocks,
    gate_up_scales, gate_up_bias, down_blocks, down_scales, down_bias]`` or NVFP4 ``[gate_up, gate_up_scale
    (E4M3 bytes), gate_up_global_scale, gate_up_bias, down, down_scale, down_global_scale, down_bias]``;
    gate/up interleaved (gate even);
    ``(clamp(up, -limit, limit) + 1) * g * sigmoid(swiglu_alpha g)``, ``g = min(gate, limit)``. The
    intermediate is rounded to x's dtype, as kernels store it."""
    if len(tensors) == 8:
        gate_up, gate_up_scale, gate_up_global_scale, gate_up_bias, down, down_scale, down_global_scale, down_bias = tensors
        gate_up_scale, down_scale = gate_up_scale.view(torch.float8_e4m3fn), down_scale.view(torch.float8_e4m3fn)
        matrices = lambda e: (dequant64(gate_up[e], gate_up_scale[e], gate_up_global_scale[e]),  # noqa: E731
                              dequant64(down[e], down_scale[e], down_global_scale[e]))
    else:
        gate_up_blocks, gate_up_scales, gate_up_bias, down_blocks, down_scales, down_bias = tensors
        matrices = lambda e: (dequant_mx64(gate_up_blocks[e], gate_up_scales[e]),  # noqa: E731
                              dequant_mx64(down_blocks[e], down_scales[e]))
    out = torch.zeros(x.shape, dtype=torch.float64)
    for e in sorted(set(ids[(ids >= 0) & (ids < gate_up_bias.shape[0])].tolist())):
        gate_up_e, down_e = matrices(e)
        for t, j in (ids == e).nonzero().tolist():
            h = x[t].double() @ gate_up_e.T + gate_up_bias[e].double()
            gate, up = h[0::2].clamp(max=limit), h[1::2].clamp(-limit, limit)
            act = ((up + 1) * gate * torch.sigmoid(swiglu_alpha * gate)).to(x.dtype).double()
            out[t] += float(weights[t, j]) * (act @ down_e.T + down_bias[e].double())
    return out


def linear64(x, packed, scale_e4m3, global_scale, bias=None) -> torch.Tensor:
    """``x [..., K]`` times the NVFP4 linear ``[N, K/2]`` bytes (+ bias), in float64: ``[..., N]``."""
    y = x.double() @ dequant64(packed, scale_e4m3, global_scale).T
    return y if bias is None else y + bias.double()


def moe64(x, ids, weights, gate_up, gate_up_scale, gate_up_global_scale, down, down_scale, down_global_scale,
          gate_up_input_scale=None, down_input_scale=None, quant=None):
    """out[t] = sum_j weights[t,j] * down(silu(gate x) * up x), float64, gate rows first.

    ``quant(v, s)`` (if scales are given) rounds a GEMM input through NVFP4 with scale s; the
    intermediate is rounded to x's dtype first, as kernels store it.
    """
    t_count, h = x.shape
    num_experts, two_i = gate_up.shape[0], gate_up.shape[1]
    i = two_i // 2
    out = torch.zeros(t_count, h, dtype=torch.float64)
    # expert by expert, each decoded once (not once per token), one expert's matrices in memory at a time
    for e in sorted(set(ids[(ids >= 0) & (ids < num_experts)].tolist())):
        gate_up_e = dequant64(gate_up[e], gate_up_scale[e], gate_up_global_scale[e])
        down_e = dequant64(down[e], down_scale[e], down_global_scale[e])
        for t, j in (ids == e).nonzero().tolist():
            a = x[t:t + 1]
            if gate_up_input_scale is not None:
                a = quant(a, gate_up_input_scale.reshape(-1)[e if gate_up_input_scale.numel() > 1 else 0])
            hgu = a.double() @ gate_up_e.T
            act = (F.silu(hgu[:, :i]) * hgu[:, i:]).to(x.dtype)
            if down_input_scale is not None:
                act = quant(act, down_input_scale.reshape(-1)[e if down_input_scale.numel() > 1 else 0])
            out[t] += float(weights[t, j]) * (act.double() @ down_e.T)[0]
    return out
