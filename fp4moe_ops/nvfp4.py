"""The NVFP4 format: constants, E2M1 encode/decode, packing, block scales, swizzle (MXFP4, which
shares the E2M1 codes, is :mod:`fp4moe_ops.mxfp4`).

NVFP4 (as written by NVIDIA ModelOpt, e.g. ``nvidia/DeepSeek-R1-FP4``) stores a matrix
``W [N, K]`` whose rows are output features and whose columns run along the reduction dim K:

* ``packed``      ``[N, K/2]  uint8``          two E2M1 codes per byte, **low nibble = even k**.
* ``block_scale`` ``[N, K/16] float8_e4m3fn``  one scale per 16 consecutive elements along K.
* ``global_scale`` scalar ``float32``          one per tensor / expert, multiplying.

and ``W[n, k] = e2m1(packed)[n, k] * float(block_scale[n, k // 16]) * global_scale``.

ModelOpt's recipe: ``global_scale = amax(W) / (6 * 448)``, and each block scale is
``amax(block) / (6 * global_scale)`` in float32 (an all-zero block gets 1.0), clamped to E4M3's
``[2^-9, 448]`` and rounded to E4M3, so the largest element of a block maps near the top of the
E2M1 range (6) and the largest block scale near the top of E4M3 (448).

Every function here is vectorized torch (CPU or CUDA) and works on stacks of matrices:
any leading dims (e.g. experts ``[E, N, K]``) are carried through.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL = 2.0**-9
BLOCK_SIZE = 16  # NVFP4 elements per E4M3 block scale

# The 8 non-negative E2M1 magnitudes, indexed by the 3 low bits of a code (bit 3 is the sign).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# Round-to-nearest-even boundaries between consecutive magnitudes. At an exact midpoint the
# value goes to the code with an even index (mantissa bit 0): from index i to i+1 we step
# when x > boundary if i is even (tie stays at i), when x >= boundary if i is odd.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _check_float_tensor(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point() or t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"{name} must be float32/bfloat16/float16, got dtype {t.dtype}")


def check_quantize_input(caller: str, x: torch.Tensor, block: int) -> None:
    """``x`` for ``caller`` (a quantizer of ``block``-element blocks): a float ``[..., N, K]`` with K a
    multiple of ``block``, finite (one host sync: quantizing is a one-time step)."""
    _check_float_tensor("x", x)
    if x.dim() < 2 or x.shape[-1] % block:
        raise ValueError(f"{caller}: x must be [..., N, K] with K a multiple of {block}, got shape {tuple(x.shape)}")
    if not torch.isfinite(x).all():
        raise ValueError(f"{caller}: x {tuple(x.shape)} contains NaN or Inf")


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Round ``x`` to the nearest E2M1 value (ties to even, saturating at +-6).

    Returns uint8 codes in ``[0, 15]`` of the same shape: bits 0-2 index ``E2M1_VALUES``,
    bit 3 is the sign (set for negative inputs only). NaN input is rejected by callers.
    """
    magnitude = x.abs().float()
    index = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for i, boundary in enumerate(_E2M1_MIDPOINTS):
        step = magnitude > boundary if i % 2 == 0 else magnitude >= boundary
        index += step.to(torch.uint8)
    sign = (x < 0).to(torch.uint8) << 3
    return index | sign


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """Map uint8 E2M1 codes (0-15) to their float32 values."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    magnitude = table[(codes & 0x7).long()]
    return torch.where((codes & 0x8) != 0, -magnitude, magnitude)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes ``[..., K]`` into bytes ``[..., K/2]``: element 2j low nibble, 2j+1 high."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_e2m1 needs an even last dim, got shape {tuple(codes.shape)}")
    return (codes[..., 0::2] & 0xF) | ((codes[..., 1::2] & 0xF) << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Unpack bytes ``[..., K/2] uint8`` into codes ``[..., K] uint8``."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed E2M1 must be uint8, got {packed.dtype}")
    low, high = packed & 0xF, packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def global_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """ModelOpt's per-tensor scale ``amax / (6 * 448)``, float32.

    An all-zero tensor (amax 0) gets scale 1 (any positive value encodes zeros exactly), and
    the result never drops below float32's smallest normal, so nothing divides by zero.
    """
    scale = amax.float() / (E2M1_MAX * E4M3_MAX)
    scale = torch.where(amax > 0, scale, torch.ones_like(scale))
    return scale.clamp_min(torch.finfo(torch.float32).tiny)


@dataclass
class NVFP4Tensor:
    """An NVFP4-quantized stack of matrices ``[..., N, K]``.

    Attributes:
        packed: ``[..., N, K/2] uint8``, E2M1 pairs, low nibble first.
        block_scale: ``[..., N, K/16] float8_e4m3fn``, linear (unswizzled) layout.
        global_scale: ``[...] float32``, one per matrix (``[]`` for a single matrix).
    """

    packed: torch.Tensor
    block_scale: torch.Tensor
    global_scale: torch.Tensor

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_nvfp4(self.packed, self.block_scale, self.global_scale, dtype)


def quantize_nvfp4(x: torch.Tensor, global_scale: torch.Tensor | None = None) -> NVFP4Tensor:
    """Quantize ``x [..., N, K]`` to NVFP4 with ModelOpt's recipe.

    Args:
        x: float tensor; K must be a multiple of 16; no NaN/Inf.
        global_scale: ``[...]`` float32, one per matrix. Default: ``amax / (6*448)`` of each
            matrix. Values of ``x`` beyond ``6 * 448 * global_scale`` saturate (this is what
            happens to activations larger than their calibrated amax).
    """
    check_quantize_input("quantize_nvfp4", x, BLOCK_SIZE)
    if global_scale is None:
        global_scale = global_scale_from_amax(x.float().abs().amax(dim=(-2, -1)))
    else:
        _check_global_scale(global_scale, tuple(x.shape[:-2]))
    x = x.float()
    global_scale = global_scale.float().to(x.device).expand(x.shape[:-2])
    g = global_scale[..., None, None]

    blocks = x.unflatten(-1, (-1, BLOCK_SIZE))  # [..., N, K/16, 16]
    block_amax = blocks.abs().amax(dim=-1)  # [..., N, K/16]
    # ModelOpt's exact float32 steps (dividing by the product, not twice, decides E4M3 ties the
    # same way), so a model quantized here is byte-identical to ModelOpt's export of it
    block_scale = block_amax / (E2M1_MAX * g)
    block_scale = torch.where(block_scale == 0, 1.0, block_scale)
    block_scale = block_scale.clamp(min=E4M3_MIN_SUBNORMAL, max=E4M3_MAX).to(torch.float8_e4m3fn)
    step = block_scale.float() * g  # the dequantized size of one E2M1 unit (> 0: scales are clamped)
    codes = e2m1_encode((blocks / step[..., None]).flatten(-2))
    return NVFP4Tensor(pack_e2m1(codes), block_scale, global_scale.contiguous())


def _check_global_scale(g, matrices: tuple) -> None:
    """An explicit global scale of :func:`quantize_nvfp4`: a float tensor of ``[]`` or a shape that
    expands to one per matrix (``matrices``), finite and > 0."""
    if not isinstance(g, torch.Tensor) or not g.is_floating_point():
        what = f"a {g.dtype} tensor" if isinstance(g, torch.Tensor) else type(g).__name__
        raise TypeError(f"quantize_nvfp4: global_scale must be a float tensor, got {what}")
    shape = tuple(g.shape)
    if len(shape) > len(matrices) or any(n not in (1, m) for n, m in zip(reversed(shape), reversed(matrices))):
        raise ValueError(f"quantize_nvfp4: global_scale {list(shape)} must be [] or one per matrix {list(matrices)} "
                         "(x is [..., N, K]: one scale per [N, K] matrix)")
    if not (torch.isfinite(g).all() and (g > 0).all()):
        raise ValueError("quantize_nvfp4: global_scale must be finite and > 0")


def dequantize_nvfp4(
    packed: torch.Tensor,
    block_scale: torch.Tensor,
    global_scale: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of :func:`quantize_nvfp4`: ``[..., N, K/2]`` bytes -> ``[..., N, K]`` ``dtype``.

    Computed in float32 (float64 if ``dtype`` is float64), then cast.
    """
    if block_scale.dtype != torch.float8_e4m3fn:
        hint = " (raw E4M3 bytes? pass .view(torch.float8_e4m3fn))" if block_scale.dtype == torch.uint8 else ""
        raise TypeError(f"block_scale must be float8_e4m3fn, got {block_scale.dtype}{hint}")
    if block_scale.shape[:-1] != packed.shape[:-1] or block_scale.shape[-1] * BLOCK_SIZE != packed.shape[-1] * 2:
        raise ValueError(f"block_scale {list(block_scale.shape)} does not match packed {list(packed.shape)}: "
                         f"expected {list(packed.shape[:-1]) + [packed.shape[-1] * 2 // BLOCK_SIZE]}")
    if tuple(global_scale.shape) not in ((), tuple(packed.shape[:-2])):
        raise ValueError(f"global_scale {list(global_scale.shape)} must be [] or one per matrix "
                         f"{list(packed.shape[:-2])}")
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    # one table lookup per byte (both nibbles' values) and the scales broadcast over their
    # 16-weight blocks: no [..., N, K] code or repeated-scale temporaries
    values = _byte_values(packed.device, compute)[packed.int()]  # [..., N, K/2, 2]
    values = values.reshape(*packed.shape[:-1], -1, BLOCK_SIZE)  # [..., N, K/16, 16]
    out = values * block_scale.to(compute)[..., None] * global_scale.to(compute)[..., None, None, None]
    return out.flatten(-2).to(dtype)


_BYTE_VALUES: dict = {}


def _byte_values(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``[256, 2]``: the E2M1 values of each byte's low and high nibble (cached per device)."""
    key = (str(device), dtype)
    if key in _BYTE_VALUES and not torch.compiler.is_compiling():
        return _BYTE_VALUES[key]
    codes = torch.arange(256, dtype=torch.uint8, device=device)
    values = e2m1_decode(torch.stack((codes & 0xF, codes >> 4), dim=-1)).to(dtype)
    if not torch.compiler.is_compiling():  # a traced tensor in the cache would break every later call
        _BYTE_VALUES[key] = values
    return values


# --- FlashInfer / CUTLASS 128x4 block-scale swizzle -------------------------------------
#
# CUTLASS's block-scaled GEMMs read scales in tiles of 128 rows x 4 scale columns (512 bytes).
# Tiles are stored row-tile major; inside a tile, row r and column c sit at byte
# (r % 32) * 16 + (r // 32) * 4 + c. Rows are padded to 128 and columns to 4 with zeros.


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def swizzle_block_scale(scale: torch.Tensor) -> torch.Tensor:
    """Swizzle ``[..., M, S]`` scales into CUTLASS's 128x4 layout.

    Returns ``[..., M_pad, S_pad]`` (``M_pad = ceil128(M)``, ``S_pad = ceil4(S)``) whose
    memory, read flat per matrix, is the swizzled buffer FlashInfer expects
    (``nvfp4_block_scale_interleave``).
    """
    *lead, m, s = scale.shape
    mp, sp = _round_up(m, 128), _round_up(s, 4)
    padded = scale.new_zeros((*lead, mp, sp))
    padded[..., :m, :s] = scale
    # [.., row_tile, r_hi(4), r_lo(32), col_tile, c(4)] -> [.., row_tile, col_tile, r_lo, r_hi, c]
    tiles = padded.reshape(*lead, mp // 128, 4, 32, sp // 4, 4)
    n = len(lead)
    tiles = tiles.permute(*range(n), n, n + 3, n + 2, n + 1, n + 4)
    return tiles.reshape(*lead, mp, sp)


def unswizzle_block_scale(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Exact inverse of :func:`swizzle_block_scale`, cropping back to ``[..., rows, cols]``.

    ``swizzled`` may be the ``[..., M_pad, S_pad]`` tensor or its flat per-matrix buffer.
    """
    mp, sp = _round_up(rows, 128), _round_up(cols, 4)
    if swizzled.shape[-2:] == (mp, sp):
        lead = swizzled.shape[:-2]
    elif swizzled.dim() >= 1 and swizzled.shape[-1] == mp * sp:
        lead = swizzled.shape[:-1]
    else:
        raise ValueError(f"unswizzle_block_scale: {list(swizzled.shape)} holds no [{rows}, {cols}] scales: expected "
                         f"[..., {mp}, {sp}] or a flat [..., {mp * sp}] buffer (rows padded to 128, columns to 4)")
    tiles = swizzled.reshape(*lead, mp // 128, sp // 4, 32, 4, 4)
    n = len(lead)
    # inverse of the permutation in swizzle_block_scale
    tiles = tiles.permute(*range(n), n, n + 3, n + 2, n + 1, n + 4)
    return tiles.reshape(*lead, mp, sp)[..., :rows, :cols]


def quantize_activation_nvfp4(x: torch.Tensor, act_global: torch.Tensor) -> torch.Tensor:
    """NVFP4 activation quantization as CUTLASS/FlashInfer do it; returns float32 ``q * sf``.

    ``act_global`` is the reciprocal of ModelOpt's calibrated ``input_scale`` (``6*448/amax``):
    ``sf = e4m3(act_global * amax16 / 6)`` and ``q = e2m1(x * act_global / sf)``, so the
    dequantized activation is ``q * sf / act_global``. Values beyond the calibrated range
    saturate. This formulation (multiply by the reciprocal) decides E2M1 ties differently
    from ``x / (sf * input_scale)``, and bf16 inputs hit ties often, so every NVFP4-activation
    path here uses this one function. No input checks (no host sync).
    """
    blocks = x.float().unflatten(-1, (-1, BLOCK_SIZE))
    sf = (act_global * blocks.abs().amax(dim=-1) / E2M1_MAX).clamp(max=E4M3_MAX)
    sf = sf.to(torch.float8_e4m3fn).float()[..., None]
    scaled = torch.where(sf > 0, blocks * act_global / torch.where(sf > 0, sf, 1.0), 0.0)
    return (e2m1_decode(e2m1_encode(scaled)) * sf).flatten(-2)
