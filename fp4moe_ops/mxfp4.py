"""The MXFP4 format (OCP Microscaling, MX v1.0): E8M0 scales, encode/decode, gpt-oss's checkpoint layout.

MXFP4 stores a matrix ``W [N, K]`` (rows: output features, K: the reduction dim) as

* FP4 E2M1 codes, two per byte, **low nibble = even k** (the codes and packing NVFP4 uses too:
  :func:`fp4moe_ops.nvfp4.e2m1_decode`, :func:`~fp4moe_ops.nvfp4.pack_e2m1`);
* one E8M0 scale per 32 consecutive elements along K: an unsigned byte ``s`` standing for
  ``2^(s - 127)`` (``s`` in 0..254, so 2^-127 .. 2^127), with ``0xFF`` NaN; there is no zero, no
  sign and no global scale.

``W[n, k] = e2m1(code[n, k]) * 2^(scale[n, k // 32] - 127)``; a NaN scale makes its 32 values NaN.

gpt-oss checkpoints (OpenAI's release, read by Transformers, vLLM and SGLang) hold each layer's
experts as ``<proj>_blocks [E, N, K/32, 16] uint8`` (one 32-value block's 16 bytes per row of the
last dim, so ``blocks.flatten(-2)`` is the ``[E, N, K/2]`` packed matrix) and ``<proj>_scales
[E, N, K/32] uint8``, for ``gate_up_proj`` (``N = 2I``, ``K = H``) and ``down_proj`` (``N = H``,
``K = I``). The rows of ``gate_up_proj`` interleave gate and up: row ``2j`` is gate's ``j``, row
``2j + 1`` up's (and so do the entries of ``gate_up_proj_bias [E, 2I]``). Transformers' BF16
``GptOssExperts.gate_up_proj [E, H, 2I]`` is the transpose of the decoded ``[E, 2I, H]``.

Every function is vectorized torch and carries any leading dims (experts) through.
"""

from __future__ import annotations

import torch

from .nvfp4 import E2M1_MAX, NVFP4Tensor, _byte_values, check_quantize_input, e2m1_encode, pack_e2m1

MX_BLOCK_SIZE = 32  # MXFP4 elements per E8M0 scale
E8M0_BIAS = 127
E8M0_NAN = 0xFF
BLOCK_BYTES = MX_BLOCK_SIZE // 2  # bytes of one block in gpt-oss's ``*_blocks`` tensors


def e8m0_decode(scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 E8M0 scales -> ``2^(s - 127)`` in ``dtype`` (NaN for ``0xFF``).

    Every value 2^-127 .. 2^127 is exact in float32 (2^-127 as a subnormal) and bfloat16."""
    if scale.dtype != torch.uint8:
        raise TypeError(f"E8M0 scales must be uint8, got {scale.dtype}")
    power = torch.exp2(scale.double() - E8M0_BIAS)  # exact in float64, then one exact cast
    return torch.where(scale == E8M0_NAN, float("nan"), power).to(dtype)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[..., N, K/2]`` MXFP4 bytes and ``[..., N, K/32]`` E8M0 scales -> ``[..., N, K]`` ``dtype``.

    Computed in float32 (float64 if ``dtype`` is float64): every product is exact there unless it
    overflows (a scale near 2^127 times a value > 2 is inf in float32)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed MXFP4 must be uint8, got {packed.dtype}")
    if scale.shape[:-1] != packed.shape[:-1] or scale.shape[-1] * MX_BLOCK_SIZE != packed.shape[-1] * 2:
        raise ValueError(f"MXFP4 scale {list(scale.shape)} does not match packed {list(packed.shape)}: expected "
                         f"{list(packed.shape[:-1]) + [packed.shape[-1] * 2 // MX_BLOCK_SIZE]}")
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    values = _byte_values(packed.device, compute)[packed.int()]  # [..., N, K/2, 2]: both nibbles of each byte
    values = values.reshape(*packed.shape[:-1], -1, MX_BLOCK_SIZE)  # [..., N, K/32, 32]
    return (values * e8m0_decode(scale, compute)[..., None]).flatten(-2).to(dtype)


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [..., N, K]`` (K % 32 == 0) to MXFP4 with a rounded-up shared exponent.

    Returns ``(packed [..., N, K/2] uint8, scale [..., N, K/32] uint8 E8M0)``. The exponent is
    ``ceil(log2(amax / 6))``, so no element saturates (the OCP recipe's ``floor(log2(amax)) - 2``
    can clip a block's largest values to 6).
    """
    check_quantize_input("quantize_mxfp4", x, MX_BLOCK_SIZE)
    blocks = x.float().unflatten(-1, (-1, MX_BLOCK_SIZE))
    amax = blocks.abs().amax(dim=-1)
    exponent = torch.ceil(torch.log2(amax.clamp_min(2.0**-126) / E2M1_MAX)).clamp(-127, 127)
    codes = e2m1_encode((blocks / torch.exp2(exponent)[..., None]).flatten(-2))
    return pack_e2m1(codes), (exponent + E8M0_BIAS).to(torch.uint8)


# --- NVFP4 -> MXFP4 (FlashInfer's SM90 W4A16 kernel wants MXFP4) ------------------------
#
# Re-quantizing is lossy: two NVFP4 blocks with different E4M3 scales (and the per-expert global
# scale) must share one power of two.


def nvfp4_to_mxfp4(w: NVFP4Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Re-quantize NVFP4 matrices to MXFP4 (lossy; see :func:`mxfp4_requant_error`)."""
    return quantize_mxfp4(w.dequantize(torch.float32))


def mxfp4_requant_error(w: NVFP4Tensor) -> float:
    """Relative Frobenius error ``||W_mx - W_nv|| / ||W_nv||`` of the NVFP4 -> MXFP4 step."""
    exact = w.dequantize(torch.float64)
    approx = dequantize_mxfp4(*nvfp4_to_mxfp4(w)).double()
    return ((approx - exact).norm() / exact.norm().clamp_min(1e-300)).item()


# --- gpt-oss's checkpoint layout ----------------------------------------------------------


def gpt_oss_shapes(rows: int, cols: int, experts: int) -> tuple[tuple, tuple]:
    """``(blocks shape, scales shape)`` of ``experts`` matrices ``[rows, cols]`` (cols % 32 == 0)."""
    return (experts, rows, cols // MX_BLOCK_SIZE, BLOCK_BYTES), (experts, rows, cols // MX_BLOCK_SIZE)


def check_gpt_oss_blocks(name: str, blocks: torch.Tensor, scales: torch.Tensor, rows: int, cols: int,
                          experts: int) -> None:
    """Raise ValueError naming ``name`` unless ``<name>_blocks`` / ``<name>_scales`` are uint8 of
    :func:`gpt_oss_shapes`. Metadata only (works on fake tensors)."""
    for suffix, t, shape in zip(("_blocks", "_scales"), (blocks, scales), gpt_oss_shapes(rows, cols, experts)):
        if t.dtype != torch.uint8 or tuple(t.shape) != shape:
            raise ValueError(f"{name}{suffix}: expected uint8 {list(shape)} (experts {experts}, matrices "
                             f"[{rows}, {cols}] in 32-value MXFP4 blocks), got {t.dtype} {list(t.shape)}")


BIAS_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # gpt-oss's biases, as a model may hold them
# one layer's experts, as gpt-oss's checkpoint names them (and fp4moe::gpt_oss_moe takes them)
MXFP4_EXPERT_TENSORS = ("gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias",
                        "down_proj_blocks", "down_proj_scales", "down_proj_bias")


def check_mxfp4_experts(expert_tensors: list[torch.Tensor], hidden_size: int) -> tuple[int, int]:
    """Shapes and dtypes of gpt-oss's six expert tensors (:data:`MXFP4_EXPERT_TENSORS`) for hidden
    size ``hidden_size``; ``(E, I)``, read off ``gate_up_proj_scales [E, 2I, H/32]``. ValueError
    naming the tensor otherwise. Metadata only (fake tensors too)."""
    if len(expert_tensors) != len(MXFP4_EXPERT_TENSORS):
        raise ValueError(f"expected {len(MXFP4_EXPERT_TENSORS)} expert tensors {list(MXFP4_EXPERT_TENSORS)}, "
                         f"got {len(expert_tensors)}")
    gate_up_blocks, gate_up_scales, gate_up_bias, down_blocks, down_scales, down_bias = expert_tensors
    if gate_up_scales.dim() != 3 or gate_up_scales.shape[1] % 2:
        raise ValueError(f"gate_up_proj_scales: expected [E, 2I, H/32], got {list(gate_up_scales.shape)}")
    experts, inter = gate_up_scales.shape[0], gate_up_scales.shape[1] // 2
    for name, size in (("hidden size", hidden_size), ("intermediate size", inter)):
        if size % MX_BLOCK_SIZE:
            raise ValueError(f"gpt-oss MXFP4 experts need a {name} that is a multiple of {MX_BLOCK_SIZE}, got {size}")
    check_gpt_oss_blocks("gate_up_proj", gate_up_blocks, gate_up_scales, 2 * inter, hidden_size, experts)
    check_gpt_oss_blocks("down_proj", down_blocks, down_scales, hidden_size, inter, experts)
    check_gpt_oss_biases(("gate_up_proj_bias", gate_up_bias), ("down_proj_bias", down_bias), experts, inter, hidden_size)
    return experts, inter


def check_gpt_oss_biases(gate_up_bias: tuple[str, torch.Tensor], down_bias: tuple[str, torch.Tensor], experts: int,
                         inter: int, hidden_size: int) -> None:
    """Raise ValueError naming the bias unless ``(name, gate_up_bias)`` is ``[E, 2I]`` and ``(name, down_bias)``
    ``[E, H]``, both of :data:`BIAS_DTYPES`. Metadata only."""
    for (name, bias), shape in ((gate_up_bias, (experts, 2 * inter)), (down_bias, (experts, hidden_size))):
        if bias.dtype not in BIAS_DTYPES or tuple(bias.shape) != shape:
            raise ValueError(f"{name}: expected bfloat16/float16/float32 {list(shape)}, got {bias.dtype} "
                             f"{list(bias.shape)}")


def dequantize_gpt_oss(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """gpt-oss ``blocks [..., N, K/32, 16]`` and ``scales [..., N, K/32]`` -> ``[..., N, K]`` ``dtype``
    (rows are output features: ``y = x @ W.T``)."""
    if blocks.shape[-1] != BLOCK_BYTES:
        raise ValueError(f"gpt-oss MXFP4 blocks must end in {BLOCK_BYTES} bytes, got {list(blocks.shape)}")
    return dequantize_mxfp4(blocks.flatten(-2), scales, dtype)


def to_gpt_oss_blocks(packed: torch.Tensor) -> torch.Tensor:
    """Packed MXFP4 ``[..., N, K/2]`` -> gpt-oss ``blocks [..., N, K/32, 16]`` (the same bytes)."""
    return packed.unflatten(-1, (-1, BLOCK_BYTES))


def interleave_gate_up(gate: torch.Tensor, up: torch.Tensor, dim: int = -2) -> torch.Tensor:
    """gpt-oss's fused gate/up order along ``dim``: gate's ``j`` at ``2j``, up's at ``2j + 1``."""
    dim = dim % gate.dim()
    return torch.stack((gate, up), dim=dim + 1).flatten(dim, dim + 1)


__all__ = [
    "BLOCK_BYTES", "E8M0_BIAS", "E8M0_NAN", "MXFP4_EXPERT_TENSORS", "MX_BLOCK_SIZE", "BIAS_DTYPES", "check_gpt_oss_biases", "check_gpt_oss_blocks", "check_mxfp4_experts",
    "dequantize_gpt_oss", "dequantize_mxfp4", "e8m0_decode", "gpt_oss_shapes", "interleave_gate_up", "mxfp4_requant_error",
    "nvfp4_to_mxfp4", "quantize_mxfp4", "to_gpt_oss_blocks",
]
