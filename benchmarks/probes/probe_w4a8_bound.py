"""What an FP8-activation ("W4A8") prefill on Hopper could reach, before one is built: the FP8
GEMM alone on the product's shapes, what turning NVFP4 weights into E4M3 costs per call, and a first
fused Triton kernel that does that decode in registers under FP8 wgmma.

    python benchmarks/probes/probe_w4a8_bound.py [--quick] [--out DIR]     # GPU (Hopper)

Hopper has no FP4 MMA; the bf16 route (decode E2M1 to bf16 under bf16 wgmma, benchmarks/NOTES.md,
"Prefill" and "NVFP4 linears") is bounded by cuBLAS BF16. FP8 wgmma runs at twice the BF16 rate, so
W4A8 (activations quantized to E4M3 per token, the weights' E2M1 codes and E4M3 block scales turned
into E4M3 values with one float32 scale per output row, float32 accumulation) moves that bound up
by at most 2x, if the decode can hide under an MMA that is twice as fast. The script measures:

1. **Floors** (CUDA-graph replay of several rotating weight and input copies, >= 150 MB of NVFP4
   bytes per graph so weights come from HBM as in a model; each copy called once per replay, the
   median of the replays timed with CUDA events, after an eager run and 3 warm-up replays:
   bench_moe's capture_graph and replay_times_ms): BF16 (``torch.mm``, ``torch._grouped_mm``) and
   FP8 E4M3 with row-wise float32 scales (``torch._scaled_mm``, ``torch._scaled_grouped_mm`` where
   this torch has it; ``use_fast_accum`` off and on), on bench_linear.py's DeepSeek-V3
   o_proj, q_b_proj and dense gate_up and Qwen3-30B's q_proj at 128-8192 tokens, and on the experts
   of DeepSeek-V3 (E=256, H=7168, I=2048) and Qwen3-30B-A3B (E=128, H=2048, I=768), top-8, balanced
   (T*8/E rows per expert), as a grouped gate_up GEMM ``[rows, H] @ [H, 2I]`` and down GEMM
   ``[rows, I] @ [I, H]`` at 2048-8192 tokens (one copy of the experts' weights, 0.4-15 GB, far
   beyond L2; two input sets).
2. **The decode's cost**: ``_decode_kernel`` turns NVFP4 bytes into E4M3 bytes and a row scale
   (what a "decode to FP8, then an FP8 GEMM" path pays each call), timed on the same weights, next to
   the FP8 GEMM; with the activations' quantization (``_act_quant_kernel``) and the whole
   decode -> ``_scaled_mm`` path on the dense shapes.
3. **A fused W4A8 GEMM** for the dense linear (``_w4a8_gemm_kernel``): activations quantized by
   ``_act_quant_kernel`` (no host sync), each weight tile decoded in registers exactly as the decode
   kernel does, ``tl.dot`` on ``tl.float8e4nv`` operands (FP8 wgmma on SM90), the row scales applied
   in the epilogue, bf16 out. Every config of ``CONFIGS`` is timed; the table gives the one
   ``pick_config`` would choose and the best, with float32 promotion every K step (``fp32``: each
   step's wgmma chain summed from zero, then added to a float32 accumulator) and with wgmma's own
   FP8 accumulation throughout (``fast``).
4. **Exactness on the device**: on one mid-size case the decode's and quantizer's bytes against the
   float64 oracle of this file (byte-exact expected), every fused config's and ``_scaled_mm``'s largest
   error against the W4A8 oracle in units of the float32-accumulation tolerance, and the W4A8
   result's distance from the exact W4A16 result (what the format change costs).

**How the block scale is folded.** NVFP4 is ``W = e2m1 * s_b * g`` (``s_b`` the E4M3 scale of the 16
weights' block, ``g`` float32). The decode writes ``W ~ w8 * r`` with ``w8`` E4M3 and one float32
``r`` per output row. An E2M1 value has a 1- or 2-bit significand (1, 1.5) and an E4M3 scale a 4-bit
one (1.000-1.111b), so their product has up to 6 significant bits (1.5 * 1.875 = 10.1101b; of the
882 nonzero products of an E2M1 magnitude and a normal or subnormal E4M3 scale, 93 have 5 and 132
have 6); E4M3 keeps 4. So ``w8`` needs one rounding, and the fold is chosen so that it is the only
one: ``r = g * 2^-k`` with ``k`` the largest integer for which the row's largest product fits E4M3,
``6 * max_b(s_b) * 2^k <= 448`` (``_row_fold``). Scaling by ``2^k`` is exact, the product ``e2m1 *
s_b * 2^k`` is exact in float32, and ``w8 = RNE_E4M3(e2m1 * s_b * 2^k)`` rounds it once, to nearest,
ties to even (ties go up and down equally often, so a row's roundings do not drift one way; the
hardware's ``cvt.rn`` does the same), never saturating (the row's largest product lands in (224,
448]). A non-power-of-two row scale (``448 / (6 max s_b)``, the largest product exactly 448) would
buy no precision (E4M3's relative step is the same in every normal binade) and would add a float32
rounding before the E4M3 one. What rounding to 4 bits costs: each weight moves by at most 1/16 of
its size (half a step at 4 bits); a block whose scale is about 2^10 or more below its row's largest
loses bits in E4M3's subnormals (its smallest codes first), and products of at most 2^-10 after the
shift become zero; the device check prints the total.

**Activations.** Per token ``a = max |x|``, ``inv = fl32(448 / a)``, ``s_x = fl32(a / 448)``,
``x8 = RNE_E4M3(fl32(x * inv))`` (``a`` floored at 2^-100 so an all-zero row gives zeros). The output
is ``y = bf16(fl32(fl32(acc * s_x) * r))``, ``acc`` the float32 sum of the exact products
``x8 * w8``. ``oracle_w4a8_64`` is that math in float64 from the format definitions, with the
float32 steps of the scales emulated; ``oracle_w4a16_64`` the exact NVFP4 weight times bf16 x.

**Rounding to E4M3 in the kernels.** ``EXACT=False`` (the timed path) uses the hardware's
``cvt.rn.satfinite`` (``.to(tl.float8e4nv, fp_downcast_rounding="rtne")``); ``EXACT=True`` rounds in
integer arithmetic first (``_rne_e4m3``), so the conversion after it is exact. The second exists
because Triton's CPU interpreter (3.6 and 3.9) does not round float32 -> float8e4nv to nearest even
(ties go away from zero, a carry out of the mantissa is lost: 1.9375 becomes 1.0, subnormals
truncate) and truncates float32 -> bf16, so in the interpreter the wrappers default to
``EXACT=True`` (its bf16 store rounded in integer arithmetic too); the device check compares both
paths' bytes against the oracle.
The interpreter does run ``tl.dot`` on float8e4nv operands (it widens them to float16 exactly and
multiplies in float32), so the fused kernel itself is tested on the CPU (tests/test_w4a8_probe.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

E4M3_MAX = 448.0
NVFP4_BLOCK = 16
ACT_FLOOR = 2.0**-100  # a row's amax floor: an all-zero row quantizes to zeros, not NaN

# bench_linear.SHAPES' entries named in the study: (name, N = out features, K = in features)
LINEAR_SHAPES = [("o_proj", 7168, 16384), ("q_b_proj", 24576, 1536), ("dense gate_up", 36864, 7168),
                 ("qwen3-30b q_proj", 4096, 2048)]
LINEAR_TOKENS = (128, 512, 2048, 8192)
# (name, E, H, I, top-k)
MOE_SHAPES = [("DeepSeek-V3", 256, 7168, 2048, 8), ("Qwen3-30B-A3B", 128, 2048, 768, 8)]
MOE_TOKENS = (2048, 4096, 8192)
# Where the kernels run in Triton's CPU interpreter, whose float32 -> float8e4nv cast does not round to
# nearest even (module docstring), the wrappers round in integer arithmetic unless told otherwise
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# --------------------------------------------------------------------------------------------------
# Triton kernels


@triton.jit
def _rne_e4m3(v):
    """float32 ``v`` (|v| <= 448 up to a few ulps) rounded to E4M3 to nearest, ties to even,
    saturating at 448; returned as a float32 that holds an E4M3 value exactly."""
    bits = v.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    sign = bits ^ mag
    # normal E4M3 (>= 2^-6): float32's mantissa cut to 3 bits, to nearest even (a carry into the
    # exponent is the right answer)
    normal = (mag + 0x7FFFF + ((mag >> 20) & 1)) & 0x7FF00000
    # subnormal E4M3 (< 2^-6): multiples of 2^-9; adding 2^23 rounds x * 2^9 to an integer, ties even
    scaled = mag.to(tl.float32, bitcast=True) * 512.0
    sub = ((scaled + 8388608.0) - 8388608.0) * 0.001953125
    out = tl.where(mag >= 0x3C800000, normal, sub.to(tl.int32, bitcast=True))
    out = tl.minimum(out, 0x43E00000)  # 448
    return (out | sign).to(tl.float32, bitcast=True)


@triton.jit
def _to_e4m3(v, EXACT: tl.constexpr):
    if EXACT:
        return _rne_e4m3(v).to(tl.float8e4nv)
    return v.to(tl.float8e4nv, fp_downcast_rounding="rtne")


@triton.jit
def _to_bf16(v, EXACT: tl.constexpr):
    if EXACT:  # float32 rounded to bf16's 8 significant bits, to nearest even, in integer arithmetic
        bits = v.to(tl.int32, bitcast=True)
        v = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    return v.to(tl.bfloat16)


@triton.jit
def _row_fold(smax):
    """A row's largest block scale (float32, > 0) -> ``(2^(k+14), 2^-k)``, ``k`` the largest integer
    with ``6 * smax * 2^k <= 448``. With ``smax = 1.m * 2^p``: ``1.m * 2^(p+k) <= 74.67`` holds up to
    ``p+k = 6`` if ``1.m <= 1.125`` (E4M3 significands are 1.000-1.111b), else up to 5. (The 2^14
    undoes the E2M1 decode's float16 bias, ``_e2m1_f32``.)"""
    bits = smax.to(tl.int32, bitcast=True)
    p = ((bits >> 23) & 255) - 127
    k = tl.where(((bits >> 20) & 7) <= 1, 6, 5) - p
    shift = ((k + 14 + 127) << 23).to(tl.float32, bitcast=True)
    inverse = ((127 - k) << 23).to(tl.float32, bitcast=True)
    return shift, inverse


@triton.jit
def _e2m1_f32(code):
    """E2M1 codes (uint8, 0-15) -> float32 values times 2^-14: the 3 magnitude bits placed at float16's
    exponent/mantissa boundary are the value (codes 0-1 as float16 subnormals, which the hardware
    never flushes), the sign at float16's sign; widening to float32 is exact."""
    c = code.to(tl.int16)
    half = ((c & 7) << 9) | ((c & 8) << 12)
    return half.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _decode_tile(packed, scale, BN: tl.constexpr, BK: tl.constexpr, EXACT: tl.constexpr):
    """``packed [BN, BK/2]`` uint8 (low nibble first), ``scale [BN, BK/16]`` float32 = block scale
    * 2^(k+14) of the row -> ``[BN, BK]`` E4M3, each weight rounded once (module docstring)."""
    per_byte = tl.reshape(tl.broadcast_to(scale[:, :, None], (BN, BK // 16, 8)), (BN, BK // 2))
    low = _to_e4m3(_e2m1_f32(packed & 15) * per_byte, EXACT)
    high = _to_e4m3(_e2m1_f32(packed >> 4) * per_byte, EXACT)
    return tl.reshape(tl.join(low, high), (BN, BK))


@triton.jit
def _row_scale_kernel(scale_ptr, global_ptr, shift_ptr, row_scale_ptr, N, K, ROWS_PER_GLOBAL,
                      BN: tl.constexpr, BS: tl.constexpr):
    """Per weight row: the decode's multiplier 2^(k+14) and the row scale g * 2^-k (a weight's
    load-time constants for the fused GEMM)."""
    rows = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)
    ok = rows < N
    smax = tl.zeros([BN], dtype=tl.float32)
    for s0 in range(0, K // 16, BS):
        cols = s0 + tl.arange(0, BS)
        s = tl.load(scale_ptr + rows[:, None] * (K // 16) + cols[None, :],
                    mask=ok[:, None] & (cols[None, :] < K // 16), other=0.0).to(tl.float32)
        smax = tl.maximum(smax, tl.max(s, axis=1))
    shift, inverse = _row_fold(tl.maximum(smax, 0.001953125))  # (an all-zero row: any fold is exact)
    g = tl.load(global_ptr + rows // ROWS_PER_GLOBAL, mask=ok, other=1.0)
    tl.store(shift_ptr + rows, shift, mask=ok)
    tl.store(row_scale_ptr + rows, g * inverse, mask=ok)


@triton.jit
def _decode_kernel(packed_ptr, scale_ptr, global_ptr, out_ptr, row_scale_ptr, N, K, ROWS_PER_GLOBAL,
                   BN: tl.constexpr, BK: tl.constexpr, EXACT: tl.constexpr):
    """NVFP4 ``[N, K/2]`` bytes + ``[N, K/16]`` E4M3 scales + float32 global scales (one per
    ``ROWS_PER_GLOBAL`` rows: an expert's) -> E4M3 ``[N, K]`` and float32 row scales ``[N]``. One
    program per ``BN`` rows: the rows' largest scale, then the decode, K in steps of ``BK``."""
    rows = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)  # (stacked experts: > 2^31 weights)
    ok = rows < N
    smax = tl.zeros([BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        cols = k0 // 16 + tl.arange(0, BK // 16)
        s = tl.load(scale_ptr + rows[:, None] * (K // 16) + cols[None, :], mask=ok[:, None], other=0.0)
        smax = tl.maximum(smax, tl.max(s.to(tl.float32), axis=1))
    shift, inverse = _row_fold(tl.maximum(smax, 0.001953125))
    g = tl.load(global_ptr + rows // ROWS_PER_GLOBAL, mask=ok, other=1.0)
    tl.store(row_scale_ptr + rows, g * inverse, mask=ok)
    for k0 in range(0, K, BK):
        bytes_ = tl.load(packed_ptr + rows[:, None] * (K // 2) + (k0 // 2 + tl.arange(0, BK // 2))[None, :],
                         mask=ok[:, None], other=0)
        s = tl.load(scale_ptr + rows[:, None] * (K // 16) + (k0 // 16 + tl.arange(0, BK // 16))[None, :],
                    mask=ok[:, None], other=0.0)
        w = _decode_tile(bytes_, s.to(tl.float32) * shift[:, None], BN, BK, EXACT)
        tl.store(out_ptr + rows[:, None] * K + (k0 + tl.arange(0, BK))[None, :], w, mask=ok[:, None])


@triton.jit
def _act_quant_kernel(x_ptr, out_ptr, scale_ptr, K, stride_x, BK: tl.constexpr, EXACT: tl.constexpr):
    """One token per program: ``a = max|x|``, ``x8 = RNE_E4M3(x * fl32(448/a))``, ``s_x = fl32(a/448)``."""
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BK], dtype=tl.float32)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    a = tl.maximum(tl.max(amax, axis=0), 7.888609052210118e-31)  # ACT_FLOOR, 2^-100
    top = tl.full([], 448.0, tl.float32)
    inv = tl.math.div_rn(top, a)  # (correctly rounded divisions, as the oracle's float32 ones)
    tl.store(scale_ptr + row, tl.math.div_rn(a, top))
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * K + cols, _to_e4m3(x * inv, EXACT), mask=cols < K)


@triton.jit
def _w4a8_gemm_kernel(x_ptr, x_scale_ptr, packed_ptr, scale_ptr, shift_ptr, row_scale_ptr, y_ptr, M, N, K,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
                      WEIGHT_A: tl.constexpr, FP32_ACC: tl.constexpr, EXACT: tl.constexpr):
    """``y [M, N] = x8 [M, K] @ decode(W) [N, K]^T * s_x * r`` in bf16; K a multiple of BK.
    ``WEIGHT_A``: the decoded weight tile is the MMA's A operand (``[BN, BK] @ [BK, BM]``, the
    accumulator transposed; wgmma may then take it from registers), else the B operand.
    ``FP32_ACC``: wgmma's FP8 partial sums promoted to float32 every BK."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    # groups of GROUP token tiles walk the weight tiles together, so a weight tile's bytes come from
    # HBM once for GROUP token tiles (the others find them in L2)
    per_group = GROUP * tiles_n
    first_m = (pid // per_group) * GROUP
    group = tl.minimum(tiles_m - first_m, GROUP)
    pid_m = first_m + (pid % per_group) % group
    pid_n = (pid % per_group) // group
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    rows_m = (offs_m % M).to(tl.int64)  # (tails read valid rows; their results are not stored)
    rows_n = (offs_n % N).to(tl.int64)
    shift = tl.load(shift_ptr + rows_n)
    x_ptrs = x_ptr + rows_m[:, None] * K + tl.arange(0, BK)[None, :]
    w_ptrs = packed_ptr + rows_n[:, None] * (K // 2) + tl.arange(0, BK // 2)[None, :]
    s_ptrs = scale_ptr + rows_n[:, None] * (K // 16) + tl.arange(0, BK // 16)[None, :]
    if WEIGHT_A:
        acc = tl.zeros([BN, BM], dtype=tl.float32)
    else:
        acc = tl.zeros([BM, BN], dtype=tl.float32)
    for _ in range(0, K // BK):
        x8 = tl.load(x_ptrs)
        w8 = _decode_tile(tl.load(w_ptrs), tl.load(s_ptrs).to(tl.float32) * shift[:, None], BN, BK, EXACT)
        # FP32_ACC: each K step's products summed by wgmma from zero, then added in float32 (wgmma's
        # FP8 accumulator keeps fewer bits than float32). Written out because Triton's
        # max_num_imprecise_acc left the register-A configs unpromoted (no float32 adds in 3.9's PTX)
        if WEIGHT_A:
            if FP32_ACC:
                acc += tl.dot(w8, tl.trans(x8))
            else:
                acc = tl.dot(w8, tl.trans(x8), acc)
        else:
            if FP32_ACC:
                acc += tl.dot(x8, tl.trans(w8))
            else:
                acc = tl.dot(x8, tl.trans(w8), acc)
        x_ptrs += BK
        w_ptrs += BK // 2
        s_ptrs += BK // 16
    x_scale = tl.load(x_scale_ptr + rows_m)
    row_scale = tl.load(row_scale_ptr + rows_n)
    if WEIGHT_A:
        y = _to_bf16((acc * x_scale[None, :]) * row_scale[:, None], EXACT)
        tl.store(y_ptr + offs_m[None, :].to(tl.int64) * N + offs_n[:, None], y,
                 mask=(offs_m[None, :] < M) & (offs_n[:, None] < N))
    else:
        y = _to_bf16((acc * x_scale[:, None]) * row_scale[None, :], EXACT)
        tl.store(y_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :], y,
                 mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


# --------------------------------------------------------------------------------------------------
# Host wrappers


@dataclass(frozen=True)
class Config:
    """A fused-GEMM launch: token rows BM, weight rows BN, K step BK, the weight as the MMA's A
    operand or not, float32 promotion every K step or wgmma's own FP8 accumulation."""
    BM: int
    BN: int
    BK: int
    weight_a: bool
    fp32_acc: bool = True
    num_warps: int = 8
    num_stages: int = 3

    @property
    def name(self) -> str:
        return (f"{'W' if self.weight_a else 'X'}a {self.BM}x{self.BN}x{self.BK} w{self.num_warps} "
                f"s{self.num_stages} {'fp32' if self.fp32_acc else 'fast'}")


# The timed configs: the weight as the MMA's B operand (the activation tile wgmma's A, from shared
# memory) or as its A (the decoded tile straight from registers, tokens on wgmma's N); 128-256 tokens
# per tile, since a weight tile's decode is paid once per token tile. With float32 promotion the
# partial and total accumulators both live in registers, so 256-token tiles take 64 weight rows
# (256 x 128 spills with 8 warps and with 16; ptxas for sm_90, Triton 3.9).
CONFIGS = ([Config(bm, bn, 128, wa) for bm, bn in ((128, 128), (256, 64)) for wa in (False, True)]
           + [Config(bm, bn, bk, wa, fp32_acc=False) for wa in (False, True)
              for bm, bn, bk in ((128, 128, 128), (256, 128, 128), (128, 256, 64))])
QUICK_CONFIGS = [c for c in CONFIGS if c.fp32_acc or (c.BM, c.BN) == (128, 128)]


def pick_config(tokens: int, n: int, k: int, fp32_acc: bool = True) -> Config:
    """The table's rule: 256-token tiles once they are full and still give every SM a tile (a weight
    tile decoded once per 256 tokens instead of 128), else 128; the weight as the B operand."""
    if fp32_acc:
        wide = tokens >= 2048 and (tokens // 256) * (n // 64) >= 132
        return Config(256, 64, 128, False) if wide else Config(128, 128, 128, False)
    wide = tokens >= 2048 and (tokens // 256) * (n // 128) >= 132
    return Config(256 if wide else 128, 128, 128, False, fp32_acc=False)


def weight_row_scales(packed, block_scale, global_scale, rows_per_global: int | None = None):
    """A weight's load-time constants for the fused GEMM: ``(shift [N] = 2^(k+14), row scale [N])``."""
    n, k = packed.shape[0], 2 * packed.shape[1]
    shift = torch.empty(n, device=packed.device, dtype=torch.float32)
    row_scale = torch.empty_like(shift)
    g = global_scale.reshape(-1).float()
    _row_scale_kernel[(triton.cdiv(n, 32),)](block_scale, g, shift, row_scale, n, k, rows_per_global or n,
                                             BN=32, BS=64)
    return shift, row_scale


def decode_to_e4m3(packed, block_scale, global_scale, rows_per_global: int | None = None, exact: bool | None = None,
                   out=None, row_scale=None):
    """NVFP4 ``[N, K/2]`` -> ``(E4M3 [N, K], float32 row scale [N])``; ``global_scale`` one value, or
    one per ``rows_per_global`` rows (stacked experts)."""
    n, k = packed.shape[0], 2 * packed.shape[1]
    if k % 32:
        raise ValueError(f"K={k} must be a multiple of 32")
    exact = INTERPRETED if exact is None else exact
    out = torch.empty(n, k, device=packed.device, dtype=torch.float8_e4m3fn) if out is None else out
    row_scale = torch.empty(n, device=packed.device, dtype=torch.float32) if row_scale is None else row_scale
    bk = 256 if k % 256 == 0 else 128 if k % 128 == 0 else 64 if k % 64 == 0 else 32
    bn = 16 if n >= 16 * 264 else 8  # >= 2 programs per SM on every shape here
    _decode_kernel[(triton.cdiv(n, bn),)](packed, block_scale, global_scale.reshape(-1).float(), out, row_scale,
                                          n, k, rows_per_global or n, BN=bn, BK=bk, EXACT=exact, num_warps=4)
    return out, row_scale


def quantize_activations(x, exact: bool | None = None, out=None, scale=None):
    """bf16 ``[T, K]`` -> ``(E4M3 [T, K], float32 per-token scale [T])``."""
    t, k = x.shape
    exact = INTERPRETED if exact is None else exact
    out = torch.empty(t, k, device=x.device, dtype=torch.float8_e4m3fn) if out is None else out
    scale = torch.empty(t, device=x.device, dtype=torch.float32) if scale is None else scale
    _act_quant_kernel[(t,)](x, out, scale, k, x.stride(0), BK=min(1024, triton.next_power_of_2(k)), EXACT=exact,
                            num_warps=4)
    return out, scale


def w4a8_gemm(x8, x_scale, packed, block_scale, shift, row_scale, cfg: Config, exact: bool | None = None, out=None):
    """The fused GEMM on quantized activations: ``[T, K]`` E4M3 -> ``[T, N]`` bf16."""
    t, k = x8.shape
    n = packed.shape[0]
    if k % cfg.BK:
        raise ValueError(f"K={k} must be a multiple of BK={cfg.BK}")
    exact = INTERPRETED if exact is None else exact
    out = torch.empty(t, n, device=x8.device, dtype=torch.bfloat16) if out is None else out
    grid = (triton.cdiv(t, cfg.BM) * triton.cdiv(n, cfg.BN),)
    _w4a8_gemm_kernel[grid](x8, x_scale, packed, block_scale, shift, row_scale, out, t, n, k, BM=cfg.BM, BN=cfg.BN,
                            BK=cfg.BK, GROUP=8, WEIGHT_A=cfg.weight_a, FP32_ACC=cfg.fp32_acc, EXACT=exact,
                            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def w4a8_linear(x, packed, block_scale, shift, row_scale, cfg: Config, exact: bool | None = None):
    """``x [T, K]`` bf16 times the NVFP4 weight ``[N, K/2]``: activations quantized, then the fused GEMM."""
    x8, x_scale = quantize_activations(x, exact)
    return w4a8_gemm(x8, x_scale, packed, block_scale, shift, row_scale, cfg, exact)


# --------------------------------------------------------------------------------------------------
# The float64 oracle, from the format definitions (not fp4moe_ops' helpers)

_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_64(packed: torch.Tensor) -> torch.Tensor:
    """``[..., K/2]`` uint8, low nibble first -> ``[..., K]`` float64: codes 0-7 the magnitudes
    0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 the sign."""
    p = packed.to(torch.int64)
    codes = torch.stack((p & 15, p >> 4), dim=-1).flatten(-2)
    magnitude = torch.tensor(_E2M1, dtype=torch.float64, device=packed.device)[codes & 7]
    return torch.where(codes >= 8, -magnitude, magnitude)


def e4m3_64(t: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn (or its bytes) -> float64 from the bits: S EEEE MMM, bias 7, subnormals
    ``M/8 * 2^-6``, S.1111.111 NaN."""
    b = t.view(torch.uint8).to(torch.int64)
    e, m = (b >> 3) & 15, (b & 7).double()
    magnitude = torch.where(e == 0, m / 8 * 2.0**-6, (1 + m / 8) * torch.pow(2.0, (e - 7).double()))
    magnitude = torch.where((b & 127) == 127, float("nan"), magnitude)
    return torch.where(b >= 128, -magnitude, magnitude)


def round_e4m3_64(v: torch.Tensor) -> torch.Tensor:
    """float64 rounded to the nearest E4M3 value, ties to even, saturating at 448 (sign kept, -0
    included)."""
    v = v.double()
    mantissa, exponent = torch.frexp(v.abs())  # |v| = mantissa * 2^exponent, mantissa in [0.5, 1)
    ulp = torch.pow(2.0, (torch.clamp(exponent - 1, min=-6) - 3).double())  # subnormals: 2^-9
    rounded = torch.clamp(torch.round(v.abs() / ulp) * ulp, max=E4M3_MAX)  # torch.round: half to even
    return torch.copysign(rounded, v)


def e4m3_bytes(values64: torch.Tensor) -> torch.Tensor:
    """float64 values that are E4M3 values -> their bytes (the cast is exact on them)."""
    return values64.to(torch.float8_e4m3fn).view(torch.uint8)


def oracle_row_fold64(block_scale: torch.Tensor, global_scale, rows_per_global: int | None = None):
    """``(k [N] int64, row scale r = g * 2^-k [N] float64)``: ``k`` the largest integer with
    ``6 * max_b s_b * 2^k <= 448``, found by exact float64 comparisons."""
    smax = e4m3_64(block_scale).amax(dim=-1).clamp(min=2.0**-9)
    k = torch.floor(torch.log2(E4M3_MAX / 6 / smax)).to(torch.int64)
    fits = lambda k: 6 * smax * torch.pow(2.0, k.double()) <= E4M3_MAX  # noqa: E731
    k = torch.where(fits(k + 1), k + 1, k)
    k = torch.where(fits(k), k, k - 1)
    assert bool(fits(k).all()) and not bool(fits(k + 1).any())
    n = block_scale.shape[0]
    g = torch.as_tensor(global_scale, dtype=torch.float64, device=block_scale.device).reshape(-1)
    g = g.repeat_interleave(rows_per_global or n)[:n] if g.numel() > 1 else g.expand(n)
    return k, g * torch.pow(2.0, -k.double())


def oracle_decode64(packed, block_scale, global_scale, rows_per_global: int | None = None):
    """The decode's result in float64: ``(w8 [N, K] E4M3 values, r [N])``, ``w8 = RNE_E4M3(e2m1 * s_b * 2^k)``."""
    k, r = oracle_row_fold64(block_scale, global_scale, rows_per_global)
    folded = e4m3_64(block_scale) * torch.pow(2.0, k.double())[:, None]
    products = e2m1_64(packed) * folded.repeat_interleave(NVFP4_BLOCK, dim=-1)
    return round_e4m3_64(products), r


def oracle_act_quant64(x: torch.Tensor):
    """The activations' quantization: ``(x8 [T, K] E4M3 values, s_x [T])`` in float64, the kernel's
    float32 steps done in float32 (each correctly rounded, as the kernel's)."""
    x32 = x.float()
    a = x32.abs().amax(dim=-1).clamp(min=ACT_FLOOR)
    inv = torch.full_like(a, E4M3_MAX) / a
    scale = a / torch.full_like(a, E4M3_MAX)
    return round_e4m3_64((x32 * inv[:, None]).double()), scale.double()


def oracle_w4a8_64(x, packed, block_scale, global_scale):
    """The W4A8 result before the kernel's float32 epilogue: ``(y [T, N], bound [T, N])`` float64,
    ``y = (x8 @ w8^T) * s_x * r`` and ``bound = (|x8| @ |w8|^T) * s_x * r`` (sum of |products|)."""
    x8, x_scale = oracle_act_quant64(x)
    w8, r = oracle_decode64(packed, block_scale, global_scale)
    outer = x_scale[:, None] * r[None, :]
    return (x8 @ w8.T) * outer, (x8.abs() @ w8.abs().T) * outer


def oracle_w4a16_64(x, packed, block_scale, global_scale):
    """The exact NVFP4 weight times bf16 ``x`` in float64: ``[T, N]``."""
    w = e2m1_64(packed) * e4m3_64(block_scale).repeat_interleave(NVFP4_BLOCK, dim=-1) * float(global_scale)
    return x.double() @ w.T


def fp32_tolerance(y64: torch.Tensor, bound64: torch.Tensor, k: int) -> torch.Tensor:
    """How far the kernel's bf16 output may be from ``y64``: a float32 sum of K exact products (4-bit
    by 4-bit significands: exact in float32) in any order is within ``(K-1) u S`` of the exact sum
    (``u = 2^-24``, ``S`` the sum of |products|); the two epilogue multiplications add ``2u`` of it; the
    bf16 store then moves the value by at most half a bf16 ulp, ``2^-8`` of it (8 significant bits).
    So ``|out - y| <= (K+1) u S (1 + 2^-8) + 2^-8 |y|``: a bound, not an estimate, so a kernel that
    accumulates in less than float32 (wgmma's own FP8 accumulation) shows as a ratio above 1."""
    acc = (k + 1) * 2.0**-24 * bound64
    return acc * (1 + 2.0**-8) + 2.0**-8 * y64.abs()


# --------------------------------------------------------------------------------------------------
# GPU measurements

DEVICE = "cuda"
COPY_BYTES = 150e6  # NVFP4 bytes a graph cycles through (3x the H200's 50 MB L2), as bench_linear.py


def _random_nvfp4(n: int, k: int, seed: int):
    """Random NVFP4 bytes (every code), block scales over 2^-4..2^5, a global scale: timing data."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), device=DEVICE, dtype=torch.uint8, generator=gen)
    scale = torch.pow(2.0, torch.rand(n, k // 16, device=DEVICE, generator=gen) * 9 - 4).to(torch.float8_e4m3fn)
    return packed, scale, torch.tensor([1.7e-3], device=DEVICE)


def _ms(flops: float, ms: float) -> str:
    return f"{ms:.4f} ({flops / ms / 1e9:.0f})"


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200] if text else ''}"


class Timer:
    """Median per-call time of CUDA-graph replays (bench_moe's capture and replay: each input set
    called once per replay, the graph run eagerly first, so kernels compile outside the capture);
    a variant that fails is recorded and timed as NaN, so one unsupported op does not end the run."""

    def __init__(self):
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
        from bench_moe import capture_graph, replay_times_ms

        self._capture, self._replay = capture_graph, replay_times_ms
        self.errors: list[str] = []

    def __call__(self, fn, inputs, what: str, replays: int = 20) -> float:
        try:
            g = self._capture(fn, inputs)
            ms = statistics.median(self._replay(g, len(inputs), replays))
            del g
            return ms
        except Exception as e:  # noqa: BLE001 - one failed variant must not stop the run
            self.errors.append(f"{what}: {_first_line(e)}")
            _synchronize()
            return float("nan")


def _synchronize() -> None:
    """After a failure: wait for the device, without raising again if the failure was the device's."""
    try:
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001
        pass


def scaled_mm(a8, a_scale, b8, b_scale, fast: bool):
    """``torch._scaled_mm`` with row-wise scales: ``a8 [M, K]`` row-major, ``b8 [N, K]`` passed as its
    column-major transpose, float32 scales ``[M, 1]`` and ``[1, N]``, bf16 out."""
    return torch._scaled_mm(a8, b8.t(), scale_a=a_scale.view(-1, 1), scale_b=b_scale.view(1, -1),
                            out_dtype=torch.bfloat16, use_fast_accum=fast)


def device_check(lines: list, configs, t: int = 256, n: int = 2048, k: int = 4096) -> None:
    """Bytes and errors against the oracle on one mid-size case (ModelOpt's recipe on Gaussian
    weights, Gaussian bf16 activations), on the device."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from fp4moe_ops import nvfp4  # (test data only; the oracle decodes from the format definitions)

    torch.manual_seed(1)
    original = torch.randn(n, k, device=DEVICE) / k**0.5
    q = nvfp4.quantize_nvfp4(original)
    packed, scale, g = q.packed, q.block_scale, q.global_scale.reshape(1).float()
    x = torch.randn(t, k, device=DEVICE, dtype=torch.bfloat16)
    w8_64, r64 = oracle_decode64(packed, scale, g)
    x8_64, sx64 = oracle_act_quant64(x)
    y64, bound = oracle_w4a8_64(x, packed, scale, g)
    tol = fp32_tolerance(y64, bound, k)
    w64 = e2m1_64(packed) * e4m3_64(scale).repeat_interleave(NVFP4_BLOCK, dim=-1) * float(g)
    exact16 = x.double() @ w64.T
    lines.append(f"\n### Against the float64 oracle on the device (T={t}, N={n}, K={k})\n")
    for exact in (False, True):
        w8, r = decode_to_e4m3(packed, scale, g, exact=exact)
        x8, sx = quantize_activations(x, exact=exact)
        lines.append(f"- {'integer rounding (EXACT=True)' if exact else 'hardware cvt (EXACT=False, timed)'}: "
                     f"decoded E4M3 bytes differing from the oracle's: "
                     f"{(w8.view(torch.uint8) != e4m3_bytes(w8_64)).sum().item()} of {n * k}, row scales "
                     f"{(r.double() != r64).sum().item()} of {n}; activation bytes "
                     f"{(x8.view(torch.uint8) != e4m3_bytes(x8_64)).sum().item()} of {t * k}, token scales "
                     f"{(sx.double() != sx64).sum().item()} of {t}")
    shift, r = weight_row_scales(packed, scale, g)
    lines.append(f"- load-time row scales (`_row_scale_kernel`) differing from the oracle's: "
                 f"{(r.double() != r64).sum().item()} of {n}")
    w8, _ = decode_to_e4m3(packed, scale, g)
    x8, sx = quantize_activations(x)

    distance = lambda y: ((y.double() - exact16).norm() / exact16.norm()).item()  # noqa: E731

    def report(what, out):
        err = (out.double() - y64).abs()
        lines.append(f"- {what}: max |err| {err.max().item():.3e}, max |err| / tolerance "
                     f"{(err / tol).max().item():.3f}, relative distance from W4A16 {distance(out):.4f}")

    for cfg in configs:
        try:
            report(f"fused {cfg.name}", w4a8_gemm(x8, sx, packed, scale, shift, r, cfg))
        except Exception as e:  # noqa: BLE001
            lines.append(f"- fused {cfg.name}: {_first_line(e)}")
    for fast in (False, True):
        try:
            report(f"torch._scaled_mm on the decoded weight, use_fast_accum={fast}", scaled_mm(x8, sx, w8, r, fast))
        except Exception as e:  # noqa: BLE001
            lines.append(f"- torch._scaled_mm (use_fast_accum={fast}): {_first_line(e)}")
    lines.append(f"- the W4A8 oracle's relative distance from W4A16: {distance(y64):.4f} (the weights' E4M3 "
                 f"rounding alone: {distance(x.double() @ (w8_64 * r64[:, None]).T):.4f}, the activations' alone: "
                 f"{distance((x8_64 * sx64[:, None]) @ w64.T):.4f}); for scale, W4A16's own distance from the "
                 f"unquantized weight: {distance(x.double() @ original.double().T):.4f}, and bf16 torch.mm on the "
                 f"NVFP4 weight's bf16 copy from W4A16: {distance(x @ w64.to(torch.bfloat16).T):.4f}")
    lines.append("- tolerance: the float32-accumulation bound of `fp32_tolerance` (a ratio above 1 is a sum kept "
                 "in less than float32)")


def linear_tables(lines: list, timer: Timer, shapes, tokens, configs) -> None:
    """The dense tables: floors and the decode's cost, then the fused GEMM's configs."""
    floors = ["| layer | N | K | T | BF16 torch.mm | FP8 _scaled_mm | FP8 fast accum | act quant | decode "
              "| decode / FP8 | act quant + decode + FP8 | BF16 / that |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    fused = ["| layer | T | BF16 | FP8 | table's config | its time | best fp32-acc config | its time | best fast-acc "
             "config | its time | act quant + best fp32-acc | BF16 / that | FP8 / best fused |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, n, k in shapes:
        copies = max(2, min(64, int(COPY_BYTES // (n * k * 0.5625)) + 1))
        weights = []
        for c in range(copies):
            packed, scale, g = _random_nvfp4(n, k, seed=c)
            w8, r = decode_to_e4m3(packed, scale, g)
            shift, _ = weight_row_scales(packed, scale, g)
            bf16 = (w8.to(torch.bfloat16) * r[:, None].to(torch.bfloat16)).contiguous()
            weights.append((packed, scale, g, w8, r, shift, bf16))
        for t in tokens:
            flops = 2.0 * t * n * k
            xs = [torch.randn(t, k, device=DEVICE, dtype=torch.bfloat16) for _ in range(copies)]
            qs = [quantize_activations(x) for x in xs]
            out = torch.empty(t, n, device=DEVICE, dtype=torch.bfloat16)
            where = f"{name} T={t}"
            reps = 10 if flops >= 1e12 else 20  # (the largest calls take milliseconds: fewer replays)
            bf = timer(lambda x, w: torch.mm(x, w.t(), out=out), [(x, w[6]) for x, w in zip(xs, weights)],
                       f"{where} torch.mm", reps)
            fp8_inputs = [(q[0], q[1], w[3], w[4]) for q, w in zip(qs, weights)]
            fp8 = [timer(lambda a, sa, w, r, f=fast: scaled_mm(a, sa, w, r, f), fp8_inputs,
                         f"{where} _scaled_mm fast={fast}", reps) for fast in (False, True)]
            # the decode writes over a weight's own E4M3 copy (the same bytes), so no extra buffer
            dec = timer(lambda p, s, g, w8, r: decode_to_e4m3(p, s, g, out=w8, row_scale=r),
                        [w[:5] for w in weights], f"{name} decode", reps)
            aq = timer(lambda x: quantize_activations(x), [(x,) for x in xs], f"{where} act quant", reps)

            def path(x, p, s, g, w8, r):
                a8, sa = quantize_activations(x)
                decode_to_e4m3(p, s, g, out=w8, row_scale=r)
                return scaled_mm(a8, sa, w8, r, False)

            whole = timer(path, [(x, *w[:5]) for x, w in zip(xs, weights)], f"{where} decode path", reps)
            floors.append(f"| {name} | {n} | {k} | {t} | {_ms(flops, bf)} | {_ms(flops, fp8[0])} "
                          f"| {_ms(flops, fp8[1])} "
                          f"| {aq:.4f} | {dec:.4f} | {dec / fp8[0]:.2f} | {whole:.4f} | {bf / whole:.2f}x |")
            gemm_inputs = [(q[0], q[1], w[0], w[1], w[5], w[4]) for q, w in zip(qs, weights)]
            times = {cfg: timer(lambda a, sa, p, s, sh, r, c=cfg: w4a8_gemm(a, sa, p, s, sh, r, c, out=out),
                                gemm_inputs, f"{where} {cfg.name}", reps) for cfg in configs}
            chosen = pick_config(t, n, k)
            if chosen not in times:
                times[chosen] = timer(lambda a, sa, p, s, sh, r: w4a8_gemm(a, sa, p, s, sh, r, chosen, out=out),
                                      gemm_inputs, f"{where} {chosen.name}", reps)

            def best(fp32_acc: bool):
                ran = [(ms, c) for c, ms in times.items() if c.fp32_acc == fp32_acc and ms == ms]
                return min(ran, key=lambda r: r[0]) if ran else (float("nan"), None)

            (ms32, c32), (msfa, cfa) = best(True), best(False)
            fastest = min((m for m in (ms32, msfa) if m == m), default=float("nan"))
            fused.append(f"| {name} | {t} | {bf:.4f} | {fp8[0]:.4f} | {chosen.name} | {_ms(flops, times[chosen])} | "
                         f"{c32.name if c32 else '-'} | {_ms(flops, ms32)} | {cfa.name if cfa else '-'} | "
                         f"{_ms(flops, msfa)} | {aq + ms32:.4f} | {bf / (aq + ms32):.2f}x | {fp8[0] / fastest:.2f}x |")
            print(floors[-1], fused[-1], sep="\n", flush=True)
            xs = qs = out = None  # (freed before the next token count's)
        weights = None
        torch.cuda.empty_cache()
    lines += ["\n### Dense linears: the floors and the decode's cost (ms per call, TFLOP/s in brackets)\n",
              "`decode`: NVFP4 -> E4M3 + row scales, the whole weight each call; `act quant`: bf16 -> E4M3 + "
              "token scales; the last columns: the three as one call, against BF16.\n", *floors,
              "\n### Dense linears: the fused W4A8 GEMM (ms, TFLOP/s in brackets)\n",
              "Config names: `Xa` the activations are wgmma's A operand (the weight B, through shared memory), "
              "`Wa` the decoded weight is A (from registers); BMxBNxBK = token rows x weight rows x K step; "
              "`fp32` float32 promotion every K step, `fast` wgmma's FP8 accumulation throughout. The fused "
              "times exclude the activations' quantization; 'act quant + best' adds it.\n", *fused]


def moe_tables(lines: list, timer: Timer, shapes, tokens) -> None:
    """The experts as grouped GEMMs: BF16, FP8, and the decode of all experts' weights."""
    have_grouped, have_scaled = hasattr(torch, "_grouped_mm"), hasattr(torch, "_scaled_grouped_mm")
    table = ["| model | GEMM | T | rows / expert | BF16 _grouped_mm | FP8 _scaled_grouped_mm | FP8 fast accum "
             "| decode (all experts) | decode / FP8 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for model, e, h, i, top_k in shapes:
        for gemm, n, k in (("gate_up", 2 * i, h), ("down", h, i)):
            packed, scale, _ = _random_nvfp4(e * n, k, seed=7)
            g = torch.rand(e, device=DEVICE) * 1e-3 + 1e-3
            w8, r = decode_to_e4m3(packed, scale, g, rows_per_global=n)
            dec = timer(lambda p, s, gg: decode_to_e4m3(p, s, gg, rows_per_global=n, out=w8, row_scale=r),
                        [(packed, scale, g)], f"{model} {gemm} decode", replays=10)
            w8_b = w8.view(e, n, k).transpose(1, 2)  # [E, K, N], column-major per expert
            r_b = r.view(e, n)
            bf16 = torch.randn(e, k, n, device=DEVICE, dtype=torch.bfloat16) if have_grouped else None
            for t in tokens:
                rows = t * top_k // e
                flops = 2.0 * rows * e * n * k
                offs = torch.arange(1, e + 1, device=DEVICE, dtype=torch.int32) * rows
                xs = [torch.randn(rows * e, k, device=DEVICE, dtype=torch.bfloat16) for _ in range(2)]
                qs = [quantize_activations(x) for x in xs]
                where = f"{model} {gemm} T={t}"
                bf = (timer(lambda x: torch._grouped_mm(x, bf16, offs=offs), [(x,) for x in xs],
                            f"{where} _grouped_mm", replays=10) if have_grouped else float("nan"))

                def grouped_fp8(a, sa, fast):
                    return torch._scaled_grouped_mm(a, w8_b, sa, r_b, offs=offs, out_dtype=torch.bfloat16,
                                                    use_fast_accum=fast)

                fp8 = [timer(lambda a, sa, f=fast: grouped_fp8(a, sa, f), qs, f"{where} _scaled_grouped_mm fast={fast}",
                             replays=10) if have_scaled else float("nan") for fast in (False, True)]
                table.append(f"| {model} | {gemm} | {t} | {rows} | {_ms(flops, bf)} | {_ms(flops, fp8[0])} | "
                             f"{_ms(flops, fp8[1])} | {dec:.4f} | {dec / fp8[0]:.2f} |")
                print(table[-1], flush=True)
                xs = qs = None
            packed = scale = w8 = r = w8_b = r_b = bf16 = None
            torch.cuda.empty_cache()
    lines += ["\n### MoE experts as grouped GEMMs, balanced routing (ms per call, TFLOP/s in brackets)\n",
              "`decode`: all E experts' weights of the GEMM to E4M3 (what a decode-then-FP8 path pays per call).\n",
              *table]
    for what, have in (("torch._grouped_mm", have_grouped), ("torch._scaled_grouped_mm", have_scaled)):
        if not have:
            lines.append(f"\n{what} is absent from this torch: its columns are empty.")


def compile_sm90(configs) -> list[str]:
    """Every kernel variant the GPU run launches, compiled for sm_90 on a machine without a GPU
    (tools/compile_ahead_cpu.py's stand-in driver; nothing launches): the MMA instruction each fused
    config lowers to, whether its A operand comes from registers, and ptxas's registers and spill
    bytes (``cuobjdump -res-usage`` on the cubin, where Triton ships cuobjdump)."""
    import re
    import subprocess
    import tempfile

    import triton.backends.nvidia as nvidia_backend
    from triton.runtime import driver

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    from compile_ahead_cpu import _Sm90WithoutGpu

    driver.set_active(_Sm90WithoutGpu())
    cuobjdump = Path(nvidia_backend.__file__).parent / "bin" / "cuobjdump"
    t, n, k = 256, 256, 1024  # (multiples of 16, as every shape here: the same specializations)
    x = torch.empty(t, k, dtype=torch.bfloat16)
    x8, sx = torch.empty(t, k, dtype=torch.float8_e4m3fn), torch.empty(t)
    packed, scale = torch.empty(n, k // 2, dtype=torch.uint8), torch.empty(n, k // 16, dtype=torch.float8_e4m3fn)
    w8, g, shift, r = torch.empty(n, k, dtype=torch.float8_e4m3fn), torch.empty(1), torch.empty(n), torch.empty(n)
    y = torch.empty(t, n, dtype=torch.bfloat16)
    variants = [(f"_act_quant_kernel EXACT={e}", lambda e=e: _act_quant_kernel.warmup(
                    x, x8, sx, k, k, BK=1024, EXACT=e, num_warps=4, grid=(1,))) for e in (False, True)]
    variants += [(f"_decode_kernel BK={bk} EXACT={e}", lambda e=e, bk=bk: _decode_kernel.warmup(
                    packed, scale, g, w8, r, n, k, n, BN=16, BK=bk, EXACT=e, num_warps=4, grid=(1,)))
                 for e in (False, True) for bk in (256,)]
    variants += [("_row_scale_kernel", lambda: _row_scale_kernel.warmup(scale, g, shift, r, n, k, n, BN=32, BS=64,
                                                                        grid=(1,)))]
    variants += [(f"_w4a8_gemm_kernel {c.name}", lambda c=c: _w4a8_gemm_kernel.warmup(
                    x8, sx, packed, scale, shift, r, y, t, n, k, BM=c.BM, BN=c.BN, BK=c.BK, GROUP=8,
                    WEIGHT_A=c.weight_a, FP32_ACC=c.fp32_acc, EXACT=False, num_warps=c.num_warps,
                    num_stages=c.num_stages, grid=(1,))) for c in configs]
    rows = [f"## sm_90 compile, Triton {triton.__version__} (no GPU: nothing launched)\n",
            "| kernel | MMA | A operand | registers | spill bytes |", "|---|---|---|---|---|"]
    for name, build in variants:
        try:
            compiled = build()
        except Exception as e:  # noqa: BLE001 - every variant reported
            rows.append(f"| {name} | FAILED {_first_line(e)} | | | |")
            continue
        ptx = compiled.asm["ptx"]
        mma = sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.\S+", ptx)))
        first = re.search(r"wgmma\.mma_async\S*\s+\{[^}]*\},\s*(\S)", ptx)
        operand = "" if first is None else "registers" if first.group(1) == "{" else "shared memory"
        regs = spills = "n/a"
        if cuobjdump.exists():
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(compiled.asm["cubin"])
                f.flush()
                usage = subprocess.run([str(cuobjdump), "-res-usage", f.name], capture_output=True, text=True).stdout
            regs = ",".join(re.findall(r"REG:(\d+)", usage)) or "n/a"
            spills = ",".join(re.findall(r"STACK:(\d+)", usage)) or "n/a"
        mma_text = " ".join(m.rstrip(";") for m in mma) or "-"
        rows.append(f"| {name} | {mma_text} | {operand or '-'} | {regs} | {spills} |")
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer shapes, token counts and configs (~2 min)")
    ap.add_argument("--out", default=None, help="folder for w4a8_bound.md")
    ap.add_argument("--skip", default="", help="parts to leave out, comma-separated: check, linear, moe")
    ap.add_argument("--compile-only", action="store_true",
                    help="no GPU needed: compile every kernel variant for sm_90 and print what it lowers to")
    args = ap.parse_args()
    if args.compile_only:
        print("\n".join(compile_sm90(CONFIGS)))
        return
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (the CPU check is tests/test_w4a8_probe.py)")
    skip = set(args.skip.split(","))
    configs = QUICK_CONFIGS if args.quick else CONFIGS
    linear_shapes = LINEAR_SHAPES
    if args.quick:
        linear_shapes = [s for s in LINEAR_SHAPES if s[0] in ("o_proj", "qwen3-30b q_proj")]
    lines = [f"## W4A8 bound: {torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}"
             f"{' (--quick)' if args.quick else ''}"]
    timer = Timer()
    parts = (("check", lambda: device_check(lines, configs)),
             ("linear", lambda: linear_tables(lines, timer, linear_shapes, (512, 8192) if args.quick else LINEAR_TOKENS,
                                              configs)),
             ("moe", lambda: moe_tables(lines, timer, MOE_SHAPES, (4096,) if args.quick else MOE_TOKENS)))
    for part, run in parts:
        if part in skip:
            continue
        start = len(lines)
        try:
            run()
        except Exception as e:  # noqa: BLE001 - report what ran
            lines.append(f"\n**{part} failed**: {_first_line(e)}")
            _synchronize()
        if part == "check":
            print("\n".join(lines[start:]), flush=True)
    if timer.errors:
        lines += ["\n### Variants that failed\n", *(f"- {e}" for e in timer.errors)]
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "w4a8_bound.md").write_text(text)


if __name__ == "__main__":
    main()
