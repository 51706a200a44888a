"""Triton fused-MoE backend: exact NVFP4 weights x 16-bit activations (W4A16), any CUDA GPU
Triton supports, written for Hopper (SM90) where FlashInfer's NVFP4 kernel does not run.

Pipeline of one call (no host syncs, CUDA-graph capturable):

1. ``route``: group the ``S = T*k`` (token, expert) slots by expert on the device and cut each
   expert's slots into blocks of ``BLOCK_M`` rows: ``block_expert [B]`` (-1 = unused block),
   ``block_row_start/end [B]`` into ``sorted_slot [S]``. ``B`` is a static upper bound.
2. ``_gemm1_swiglu_kernel``: per (block, N tile) program, gather the block's token rows,
   stream the expert's packed gate and up rows, dequantize in registers, two bf16 tensor-core
   dots with fp32 accumulators, apply the global scale and ``silu(gate) * up``; store
   ``[S, I]`` rows in the activation dtype (slot order). For decode-sized batches gate and up
   tiles go to separate programs (twice the programs) and ``_silu_mul_kernel`` finishes.
3. ``_gemm2_kernel``: same over ``w2``, times the routing weight, into ``[S, H]`` fp32.
4. ``_sum_topk_kernel``: ``out[t] = sum_j y[t*k + j]`` over valid slots, cast to the input dtype
   (deterministic: no atomics).

Only experts that some token picked are read, each weight byte once per (M block, N tile).
Where H and I are multiples of 256 (every real MoE shape), weight and scale tiles come through
TMA descriptors over ``[E*N, K/2]`` / ``[E*N, K/16]`` (bulk copies pipelined over
``num_stages``), and the K axis of both dots runs in MMA-fragment order (:func:`fragment_order`):
each thread's weight bytes are then one contiguous run per row, read with vector loads, instead
of single bytes (1.4-1.5x at decode on H200). The activations are permuted once per call (in
the routing launch) and GEMM1 writes its output already permuted for GEMM2. The backend stores
those shapes' packed weights in its own paired layout (:func:`paired_weight_layout`: rows r and
r+8 per 32-bit word, bits pre-permuted), which cuts the decode from 2.25 to 1.5 instructions per
element (a further 0.88-0.93x at decode); canonical weights still run, a little slower.
Routing for decode-sized batches is one single-program kernel (sort + histogram); prefill-sized
batches use a few torch ops.

Weight decode (exact): every dequantized weight is ``e2m1 * e4m3 * 2^-22`` in bf16 (at most 6
significant bits, >= 2^-32, so exact); the ``2^22`` is folded into the per-expert global scale
applied to the fp32 accumulator. On the GPU inline-PTX routines turn 8 packed codes into 8
bf16 with bit masks, rotates or one integer multiply, and one ``mul.bf16x2`` by the block scale
per pair (``_PAIRED_WORD_TO_BF16`` for the paired layout, ``_E2M1X8_TO_BF16`` for canonical
bytes), and E4M3 scale bytes into bf16 with a shift and two exact multiplies
(``_E4M3X4_TO_BF16``); the portable path (fp16 and Triton's CPU interpreter) builds the same
values from fp16 bit patterns: code ``c`` as ``(c & 7) << 9 | (c & 8) << 12`` is
``value * 2^-14`` and E4M3 byte ``b`` as ``(b & 0x7F) << 7`` is ``scale * 2^-8``.
"""

from __future__ import annotations

import os

import torch

from .base import Backend, canonical_layout, canonical_specs, check_canonical_tensors, check_specs, register_backend

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton
    triton = None

DECODE_SHIFT = 2.0**22  # 2^14 (E2M1 in fp16 bits) * 2^8 (E4M3 in fp16 bits)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:

    @triton.jit
    def _e2m1_f32(codes):
        """E2M1 codes (0..15, any int dtype) -> float32 value * 2^-14, exact."""
        c = codes.to(tl.int16)
        return (((c & 7) << 9) | ((c & 8) << 12)).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _e4m3_f32(sbytes):
        """E4M3 bytes (non-negative scales) -> float32 value * 2^-8, exact."""
        return ((sbytes & 0x7F).to(tl.int16) << 7).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _finish(values, OUT_DTYPE: tl.constexpr):
        # values carry a 2^-22 factor: exact in bf16 (folded into the global scale later);
        # fp16 lacks the range, so undo it there (exact too).
        if OUT_DTYPE == tl.float16:
            values = values * 4194304.0
        return values.to(OUT_DTYPE)

    # PTX for 4 packed bytes (8 E2M1 codes) -> 8 bf16, times a bf16x2 block scale, 2.25
    # instructions per element: spread bytes 0,1 (then 2,3) into the two 16-bit halves, keep one
    # nibble per half, multiply by 2^6 + 2^12 to copy it to bits 9..6 and 15..12 (the copies do
    # not overlap), and keep bits 8..6 (exponent/mantissa) and 15 (sign): that bf16 bit pattern is
    # value * 2^-126, subnormal 0.5 included. Then one mul.bf16x2 by the block scale
    # pre-multiplied by 2^104 (exact): the result is value * scale * 2^-22. Strictly elementwise
    # (Triton packs a thread's elements 4 at a time in register order, which need not be 4
    # adjacent bytes of one row): $0..$3 are lo(b0,b1), lo(b2,b3), hi(b0,b1), hi(b2,b3) and the
    # scales of elements 0,1 are in $5, of elements 2,3 in $6.
    _E2M1X8_TO_BF16 = tl.constexpr("""
    {
    .reg .b32 t0, t1, m, z;
    mov.b32 z, 0;
    prmt.b32 t0, $4, z, 0x4140;
    prmt.b32 t1, $4, z, 0x4342;
    and.b32 m, t0, 0x000F000F; mul.lo.u32 m, m, 0x1040; and.b32 $0, m, 0x81C081C0;
    and.b32 m, t1, 0x000F000F; mul.lo.u32 m, m, 0x1040; and.b32 $1, m, 0x81C081C0;
    and.b32 m, t0, 0x00F000F0; mul.lo.u32 m, m, 0x104;  and.b32 $2, m, 0x81C081C0;
    and.b32 m, t1, 0x00F000F0; mul.lo.u32 m, m, 0x104;  and.b32 $3, m, 0x81C081C0;
    mul.rn.bf16x2 $0, $0, $5;
    mul.rn.bf16x2 $1, $1, $6;
    mul.rn.bf16x2 $2, $2, $5;
    mul.rn.bf16x2 $3, $3, $6;
    }
    """)

    # PTX for one word of the paired layout (:func:`paired_weight_layout`: rows r and r+8, 4 codes
    # each, bits pre-permuted) -> 8 bf16, 1.5 instructions per element: one register is a mask,
    # two are a rotate and a mask, one is mask / multiply / mask (the multiply adds three shifted
    # copies of 4 bits that cannot carry into each other); each leaves bits 8..6 and 15 of both
    # halves as above. $0 = lo(row r), $1 = lo(row r+8), $2 = hi(row r), $3 = hi(row r+8); the
    # scales of row r are in $5, of row r+8 in $6. Not elementwise: it relies on Triton packing
    # the word's 4 bytes in order (checked by the GPU tests against the reference).
    _PAIRED_WORD_TO_BF16 = tl.constexpr("""
    {
    .reg .b32 t;
    and.b32 $0, $4, 0x81C081C0;
    shf.l.wrap.b32 t, $4, $4, 10; and.b32 $1, t, 0x81C081C0;
    shf.l.wrap.b32 t, $4, $4, 13; and.b32 $2, t, 0x81C081C0;
    and.b32 t, $4, 0x001B001B; mul.lo.u32 t, t, 0x4108; and.b32 $3, t, 0x81C081C0;
    mul.rn.bf16x2 $0, $0, $5;
    mul.rn.bf16x2 $1, $1, $6;
    mul.rn.bf16x2 $2, $2, $5;
    mul.rn.bf16x2 $3, $3, $6;
    }
    """)

    # PTX for 4 E4M3 block-scale bytes -> 4 bf16 ``scale * 2^104``, 2.5 instructions per scale:
    # spread two bytes into the 16-bit halves, drop the sign bit (scales are >= 0; this keeps a
    # -0 byte at 0), shift left by 4 (an E4M3 bit pattern moved into bf16's exponent and mantissa
    # fields reads as ``scale * 2^-120``, subnormals included), and two exact multiplies by 2^112.
    _E4M3X4_TO_BF16 = tl.constexpr("""
    {
    .reg .b32 t, z, c;
    mov.b32 z, 0;
    mov.b32 c, 0x77807780;
    prmt.b32 t, $2, z, 0x4140; and.b32 t, t, 0x007F007F; shl.b32 t, t, 4;
    mul.rn.bf16x2 t, t, c; mul.rn.bf16x2 $0, t, c;
    prmt.b32 t, $2, z, 0x4342; and.b32 t, t, 0x007F007F; shl.b32 t, t, 4;
    mul.rn.bf16x2 t, t, c; mul.rn.bf16x2 $1, t, c;
    }
    """)

    @triton.jit
    def _scales_bf16(sbytes, FAST_SCALES: tl.constexpr):
        """E4M3 scale bytes -> bf16 ``scale * 2^104`` (exact): the PTX above, or (FAST_SCALES
        off, for comparison) through fp16 and fp32 as in :func:`_e4m3_f32`."""
        if FAST_SCALES:
            return tl.inline_asm_elementwise(_E4M3X4_TO_BF16, "=r,=r,r", [sbytes], dtype=tl.bfloat16,
                                             is_pure=True, pack=4)
        return (_e4m3_f32(sbytes) * 2.0**112).to(tl.bfloat16)

    @triton.jit
    def _pairs_to_rows(x, BN: tl.constexpr, BK: tl.constexpr):
        """``[BN/2, BK/4, 2, 2]`` (row pair, 2-byte unit, row of the pair, last dim) ->
        ``[BN, 4, BK/16, 2]`` (row, t, j, last dim) with unit ``(BK/16)t + j``; pair ``p`` holds
        rows ``16(p // 8) + p % 8`` and that + 8."""
        x = x.reshape(BN // 16, 8, 4, BK // 16, 2, 2)
        return tl.permute(x, (0, 4, 1, 2, 3, 5)).reshape(BN, 4, BK // 16, 2)

    @triton.jit
    def _pattern_codes(x):
        """bf16x2 bit patterns as the PTX leaves them (bits 8..6 and 15 per half) -> the two E2M1
        codes (low half, high half)."""
        return ((x >> 6) & 7) | ((x >> 12) & 8), ((x >> 22) & 7) | ((x >> 28) & 8)

    @triton.jit
    def _paired_codes(words, BN: tl.constexpr, BK: tl.constexpr):
        """Portable decode of a paired-layout tile ``[BN/2, BK]`` bytes -> E2M1 codes ``(low
        nibbles, high nibbles)``, each ``[BN, 4, BK/16, 2]`` like the canonical bytes' nibbles:
        the PTX's bit moves in plain integer ops, then the codes read back from the patterns."""
        e0, e1 = tl.split(words.reshape(BN // 2, BK // 4, 2, 2))  # [pair, unit, row of the pair]
        b0, b2 = tl.split(e0)
        b1, b3 = tl.split(e1)
        w = b0.to(tl.uint32) | (b1.to(tl.uint32) << 8) | (b2.to(tl.uint32) << 16) | (b3.to(tl.uint32) << 24)
        r0l, r0h = _pattern_codes(w & 0x81C081C0)
        r1l, r1h = _pattern_codes(((w << 10) | (w >> 22)) & 0x81C081C0)
        r2l, r2h = _pattern_codes(((w << 13) | (w >> 19)) & 0x81C081C0)
        r3l, r3h = _pattern_codes(((w & 0x001B001B) * 0x4108) & 0x81C081C0)
        lo = tl.join(tl.join(r0l, r1l), tl.join(r0h, r1h))  # [pair, unit, row of the pair, e]
        hi = tl.join(tl.join(r2l, r3l), tl.join(r2h, r3h))
        return _pairs_to_rows(lo, BN, BK), _pairs_to_rows(hi, BN, BK)

    @triton.jit
    def _decode_tile(packed, sbytes, BN: tl.constexpr, BK: tl.constexpr, OUT_DTYPE: tl.constexpr,
                     FAST_DECODE: tl.constexpr):
        """``packed [BN, BK/2]`` uint8 + ``sbytes [BN, BK/16]`` E4M3 -> ``[BN, BK]`` OUT_DTYPE
        (bf16: times 2^-22, exact). PTX fast path for bf16 on the GPU; portable path otherwise."""
        if FAST_DECODE and OUT_DTYPE == tl.bfloat16:
            scale = (_e4m3_f32(sbytes) * 2.0**112).to(tl.bfloat16)  # scale * 2^104, exact
            scale = tl.broadcast_to(scale[:, :, None], (BN, BK // 16, 8))
            lo, hi = tl.inline_asm_elementwise(
                _E2M1X8_TO_BF16, "=r,=r,=r,=r,r,r,r", [packed.reshape(BN, BK // 16, 8), scale],
                dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
            return tl.join(lo.reshape(BN, BK // 2), hi.reshape(BN, BK // 2)).reshape(BN, BK)
        values = _e2m1_f32(tl.join(packed & 0xF, packed >> 4).reshape(BN, BK))
        values = (values.reshape(BN, BK // 16, 16) * _e4m3_f32(sbytes)[:, :, None]).reshape(BN, BK)
        return _finish(values, OUT_DTYPE)

    @triton.jit
    def _decode_tile_fragment_order(packed, sbytes, BN: tl.constexpr, BK: tl.constexpr, OUT_DTYPE: tl.constexpr,
                                    FAST_DECODE: tl.constexpr, PAIRED: tl.constexpr = False,
                                    FAST_SCALES: tl.constexpr = True):
        """:func:`_decode_tile` with the K axis in MMA-fragment order (see :func:`fragment_order`):
        ``[BN, BK]`` whose column ``16j + 8s + 2t + e`` is the weight at ``k = (BK/4)t + 4j + 2e + s``.

        Why: a tensor-core operand gives each thread of a quad ``t`` the k pairs ``2t, 2t+1`` and
        ``2t+8, 2t+9`` of every 16-wide step. In natural order those come from bytes all over the
        row (one byte load each, then byte shuffles); in this order a thread's bytes are one
        contiguous ``BK/8``-byte run per row (vector loads) and span only 4 scale blocks. The
        activations are fed in the same order, so the dot product is unchanged.

        With PAIRED, ``packed`` is a ``[BN/2, BK]`` tile of :func:`paired_weight_layout` words.
        """
        if FAST_DECODE and OUT_DTYPE == tl.bfloat16:
            scale = _scales_bf16(sbytes, FAST_SCALES).reshape(BN, 4, BK // 64, 1, 1)  # block of byte b is b // 8
            scale = tl.broadcast_to(scale, (BN, 4, BK // 64, 4, 2)).reshape(BN, 4, BK // 16, 2)
            if PAIRED:
                p = _pairs_to_rows(packed.reshape(BN // 2, BK // 4, 2, 2), BN, BK)
                lo, hi = tl.inline_asm_elementwise(_PAIRED_WORD_TO_BF16, "=r,=r,=r,=r,r,r,r", [p, scale],
                                                   dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
            else:
                p = packed.reshape(BN, 4, BK // 16, 2)  # byte (BK/8)t + 2j + e -> [row, t, j, e]
                lo, hi = tl.inline_asm_elementwise(_E2M1X8_TO_BF16, "=r,=r,=r,=r,r,r,r", [p, scale],
                                                   dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        else:
            scale = _e4m3_f32(sbytes).reshape(BN, 4, BK // 64, 1, 1)
            scale = tl.broadcast_to(scale, (BN, 4, BK // 64, 4, 2)).reshape(BN, 4, BK // 16, 2)
            if PAIRED:
                lo_codes, hi_codes = _paired_codes(packed, BN, BK)
            else:
                p = packed.reshape(BN, 4, BK // 16, 2)
                lo_codes, hi_codes = p & 0xF, p >> 4
            lo = _finish(_e2m1_f32(lo_codes) * scale, OUT_DTYPE)
            hi = _finish(_e2m1_f32(hi_codes) * scale, OUT_DTYPE)
        w = tl.join(lo, hi)  # [row, t, j, e, s]: the low nibble is s = 0
        return tl.permute(w, (0, 2, 4, 1, 3)).reshape(BN, BK)  # column 16j + 8s + 2t + e

    @triton.jit
    def _fragment_position(k, CHUNK: tl.constexpr):
        """Column of natural index ``k`` in :func:`fragment_order` with ``CHUNK``-wide chunks."""
        kp = k % CHUNK
        t, j, e, s = kp // (CHUNK // 4), (kp % (CHUNK // 4)) // 4, (kp // 2) % 2, kp % 2
        return k - kp + 16 * j + 8 * s + 2 * t + e

    @triton.jit
    def _block_rows(b, sorted_slot_ptr, block_row_start_ptr, block_row_end_ptr, BM: tl.constexpr):
        r0 = tl.load(block_row_start_ptr + b)
        r1 = tl.load(block_row_end_ptr + b)
        rows = r0 + tl.arange(0, BM)
        row_mask = rows < r1
        slots = tl.load(sorted_slot_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        return slots, row_mask

    @triton.jit
    def _expert_matmul(acc, w_ptr, s_ptr, rows, a_ptr, a_rows, row_mask, K,
                       BN: tl.constexpr, BK: tl.constexpr, PREFETCH: tl.constexpr, FAST_DECODE: tl.constexpr, INTERPRET: tl.constexpr,
                       w_desc=None, s_desc=None, desc_row=0, TMA: tl.constexpr = False,
                       FRAGMENT_ORDER: tl.constexpr = False, PAIRED: tl.constexpr = False,
                       FAST_SCALES: tl.constexpr = True):
        """``acc [BN, BM] += W[rows, :K] @ A[a_rows, :K]^T`` with W NVFP4 ``[*, K/2]`` bytes
        (with FRAGMENT_ORDER, A's K axis is in :func:`fragment_order` per BK chunk).

        The weight tile is the MMA's M side ("swap AB"): decode's few tokens sit on the narrow
        N side. With PREFETCH the next tile's bytes are loaded before this tile is decoded, so
        the memory latency overlaps the decode and the dot.
        """
        dtype = a_ptr.dtype.element_ty
        kb = tl.arange(0, BK // 2)
        ks = tl.arange(0, BK // 16)
        kk = tl.arange(0, BK)
        w_ptrs = w_ptr + rows[:, None] * (K // 2) + kb[None, :]
        s_ptrs = s_ptr + rows[:, None] * (K // 16) + ks[None, :]
        a_ptrs = a_ptr + a_rows[None, :] * K + kk[:, None]
        if not TMA:
            packed = tl.load(w_ptrs)
            sbytes = tl.load(s_ptrs)
        for k0 in range(0, K, BK):
            a = tl.load(a_ptrs + k0, mask=row_mask[None, :], other=0.0)
            if TMA:  # bulk tensor copies, which Triton pipelines over num_stages
                if PAIRED:  # [BN/2, BK] bytes of row-pair words
                    packed = w_desc.load([desc_row // 2, k0])
                else:
                    packed = w_desc.load([desc_row, k0 // 2])
                if BK >= 256:
                    sbytes = s_desc.load([desc_row, k0 // 16])
                else:  # a scale box row under 16 bytes is not allowed: plain loads (BK/16 bytes per row)
                    sbytes = tl.load(s_ptrs + k0 // 16)
            elif PREFETCH:
                more = (k0 + BK) < K  # the last iteration loads nothing
                packed_next = tl.load(w_ptrs + (k0 + BK) // 2, mask=(kb[None, :] * 0 + more) != 0, other=0)
                sbytes_next = tl.load(s_ptrs + (k0 + BK) // 16, mask=(ks[None, :] * 0 + more) != 0, other=0)
            else:
                packed = tl.load(w_ptrs + k0 // 2)
                sbytes = tl.load(s_ptrs + k0 // 16)
            if FRAGMENT_ORDER:
                w = _decode_tile_fragment_order(packed, sbytes, BN, BK, dtype, FAST_DECODE, PAIRED, FAST_SCALES)
            else:
                w = _decode_tile(packed, sbytes, BN, BK, dtype, FAST_DECODE)
            if INTERPRET:  # Triton's CPU interpreter mis-multiplies bf16 dots
                a, w = a.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(w, a, acc)
            if PREFETCH and not TMA:
                packed, sbytes = packed_next, sbytes_next
        return acc

    @triton.jit
    def _gemm1_swiglu_kernel(
        x_ptr, w_ptr, s_ptr, g_ptr, out_ptr,
        sorted_slot_ptr, block_expert_ptr, block_row_start_ptr, block_row_end_ptr,
        H, I, TOPK, w_desc, s_desc,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREFETCH: tl.constexpr, FAST_DECODE: tl.constexpr, INTERPRET: tl.constexpr,
        TMA: tl.constexpr, FRAGMENT_ORDER: tl.constexpr = False, OUT_CHUNK: tl.constexpr = 256,
        SPLIT_GATE_UP: tl.constexpr = False, PAIRED: tl.constexpr = False, FAST_SCALES: tl.constexpr = True,
    ):
        """Per (M block, N tile): ``silu(x W_gate^T) * (x W_up^T)`` into ``out [S, I]``. With
        SPLIT_GATE_UP a program computes only the gate or the up tile and stores it, scaled, in
        fp32 ``out [S, 2I]`` (twice the programs, for batches too small to fill the GPU);
        :func:`_silu_mul_kernel` finishes."""
        b = tl.program_id(0)
        e = tl.load(block_expert_ptr + b)
        if e >= 0:
            slots, row_mask = _block_rows(b, sorted_slot_ptr, block_row_start_ptr, block_row_end_ptr, BM)
            tokens = slots // TOPK
            e64 = e.to(tl.int64)
            w_e = w_ptr + e64 * (2 * I) * (H // 2)
            s_e = s_ptr + e64 * (2 * I) * (H // 16)
            zero = tl.zeros((BN, BM), dtype=tl.float32)
            g = tl.load(g_ptr + e)
            if x_ptr.dtype.element_ty == tl.bfloat16:
                g = g * 4194304.0  # the tiles' 2^-22
            if SPLIT_GATE_UP:
                cols = tl.program_id(1) * BN + tl.arange(0, BN)  # rows of [gate; up], 0..2I
                acc = _expert_matmul(zero, w_e, s_e, cols, x_ptr, tokens, row_mask, H, BN, BK, PREFETCH, FAST_DECODE,
                                     INTERPRET, w_desc, s_desc, e * (2 * I) + tl.program_id(1) * BN, TMA,
                                     FRAGMENT_ORDER, PAIRED, FAST_SCALES)
                tl.store(out_ptr + slots[None, :] * (2 * I) + cols[:, None], acc * g, mask=row_mask[None, :])
                return
            cols = tl.program_id(1) * BN + tl.arange(0, BN)
            row0 = e * (2 * I) + tl.program_id(1) * BN  # descriptor row of this tile in [E * 2I, H/2]
            acc_gate = _expert_matmul(zero, w_e, s_e, cols, x_ptr, tokens, row_mask, H, BN, BK, PREFETCH, FAST_DECODE,
                                      INTERPRET, w_desc, s_desc, row0, TMA, FRAGMENT_ORDER, PAIRED, FAST_SCALES)
            acc_up = _expert_matmul(zero, w_e, s_e, cols + I, x_ptr, tokens, row_mask, H, BN, BK, PREFETCH, FAST_DECODE,
                                    INTERPRET, w_desc, s_desc, row0 + I, TMA, FRAGMENT_ORDER, PAIRED, FAST_SCALES)
            gate = acc_gate * g
            up = acc_up * g
            h = gate * tl.sigmoid(gate) * up  # [BN, BM]
            if FRAGMENT_ORDER:  # GEMM2 reads its K axis (our columns) in fragment order
                cols = _fragment_position(cols, OUT_CHUNK)
            tl.store(out_ptr + slots[None, :] * I + cols[:, None], h.to(out_ptr.dtype.element_ty),
                     mask=row_mask[None, :])

    @triton.jit
    def _silu_mul_kernel(pre_ptr, ids_ptr, out_ptr, I, E, FRAGMENT_ORDER: tl.constexpr, OUT_CHUNK: tl.constexpr,
                         BLOCK: tl.constexpr):
        """``out[s, c] = silu(pre[s, c]) * pre[s, I + c]`` (``pre [S, 2I]`` fp32, ``out [S, I]``),
        columns in fragment order if asked; slots with an invalid expert id (never written by
        GEMM1, never read by GEMM2) are skipped."""
        s = tl.program_id(0).to(tl.int64)
        e = tl.load(ids_ptr + s)
        if (e < 0) | (e >= E):
            return
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        gate = tl.load(pre_ptr + s * (2 * I) + cols)
        up = tl.load(pre_ptr + s * (2 * I) + I + cols)
        if FRAGMENT_ORDER:
            cols = _fragment_position(cols, OUT_CHUNK)
        tl.store(out_ptr + s * I + cols, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty))

    @triton.jit
    def _gemm2_kernel(
        a_ptr, w_ptr, s_ptr, g_ptr, topk_weights_ptr, out_ptr,
        sorted_slot_ptr, block_expert_ptr, block_row_start_ptr, block_row_end_ptr,
        H, I, w_desc, s_desc,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREFETCH: tl.constexpr, FAST_DECODE: tl.constexpr, INTERPRET: tl.constexpr,
        TMA: tl.constexpr, FRAGMENT_ORDER: tl.constexpr = False, PAIRED: tl.constexpr = False,
        FAST_SCALES: tl.constexpr = True,
    ):
        b = tl.program_id(0)
        e = tl.load(block_expert_ptr + b)
        if e >= 0:
            slots, row_mask = _block_rows(b, sorted_slot_ptr, block_row_start_ptr, block_row_end_ptr, BM)
            e64 = e.to(tl.int64)
            w_e = w_ptr + e64 * H * (I // 2)
            s_e = s_ptr + e64 * H * (I // 16)
            cols = tl.program_id(1) * BN + tl.arange(0, BN)
            acc = _expert_matmul(tl.zeros((BN, BM), dtype=tl.float32), w_e, s_e, cols, a_ptr, slots, row_mask, I,
                                 BN, BK, PREFETCH, FAST_DECODE, INTERPRET, w_desc, s_desc,
                                 e * H + tl.program_id(1) * BN, TMA, FRAGMENT_ORDER, PAIRED, FAST_SCALES)
            g = tl.load(g_ptr + e)
            if a_ptr.dtype.element_ty == tl.bfloat16:
                g = g * 4194304.0
            route = tl.load(topk_weights_ptr + slots, mask=row_mask, other=0.0)
            y = acc * g * route[None, :]
            tl.store(out_ptr + slots[None, :] * H + cols[:, None], y, mask=row_mask[None, :])

    @triton.jit
    def _route_kernel(ids_ptr, sorted_slot_ptr, block_expert_ptr, block_row_start_ptr, block_row_end_ptr,
                      S, E, NUM_BLOCKS, x_ptr, x_fragment_ptr, X_NUMEL, H,
                      BM: tl.constexpr, S_PAD: tl.constexpr, E_PAD: tl.constexpr, B_PAD: tl.constexpr,
                      CHUNK: tl.constexpr, X_BLOCK: tl.constexpr, ROUTE: tl.constexpr = True):
        """:func:`route` in program 0 (decode-sized S): one launch instead of ~12 torch ops. The
        other programs (if any) copy ``x [T, H]`` into :func:`fragment_order` with ``CHUNK``-wide
        chunks, which saves the permute's own launch. ROUTE=False: only the copy (prefill, where
        torch ops route)."""
        if tl.program_id(0) > 0:
            idx = (tl.program_id(0) - 1) * X_BLOCK + tl.arange(0, X_BLOCK)
            mask = idx < X_NUMEL
            c = idx % H
            cp = c % CHUNK  # column 16j + 8s + 2t + e holds natural (CHUNK/4)t + 4j + 2e + s
            natural = c - cp + (CHUNK // 4) * ((cp // 2) % 4) + 4 * (cp // 16) + 2 * (cp % 2) + (cp // 8) % 2
            tl.store(x_fragment_ptr + idx, tl.load(x_ptr + idx - c + natural, mask=mask), mask=mask)
        elif ROUTE:
            _route_program(ids_ptr, sorted_slot_ptr, block_expert_ptr, block_row_start_ptr, block_row_end_ptr,
                           S, E, NUM_BLOCKS, BM, S_PAD, E_PAD, B_PAD)

    @triton.jit
    def _route_program(ids_ptr, sorted_slot_ptr, block_expert_ptr, block_row_start_ptr, block_row_end_ptr,
                       S, E, NUM_BLOCKS,
                       BM: tl.constexpr, S_PAD: tl.constexpr, E_PAD: tl.constexpr, B_PAD: tl.constexpr):
        offs = tl.arange(0, S_PAD)
        key = tl.load(ids_ptr + offs, mask=offs < S, other=-1).to(tl.int32)
        key = tl.where((key >= 0) & (key < E), key, E)  # invalid ids and padding sort last
        # sort (expert, slot) pairs: slot order is kept within an expert
        order = tl.sort(key * S_PAD + offs)
        tl.store(sorted_slot_ptr + offs, order % S_PAD, mask=offs < S)

        bins = tl.arange(0, E_PAD)
        counts = tl.where(bins < E, tl.histogram(key, E_PAD), 0)
        row_start = tl.cumsum(counts, 0) - counts
        blocks = (counts + BM - 1) // BM
        block_start = tl.cumsum(blocks, 0) - blocks
        b = tl.arange(0, B_PAD)
        tl.store(block_expert_ptr + b, tl.full((B_PAD,), -1, tl.int32), mask=b < NUM_BLOCKS)
        tl.debug_barrier()  # the -1 fill lands before the real entries below
        for j in range(0, tl.max(blocks, 0)):
            used = j < blocks
            r0 = row_start + j * BM
            tl.store(block_expert_ptr + block_start + j, bins, mask=used)
            tl.store(block_row_start_ptr + block_start + j, r0, mask=used)
            tl.store(block_row_end_ptr + block_start + j, tl.minimum(r0 + BM, row_start + counts), mask=used)

    @triton.jit
    def _sum_topk_kernel(y_ptr, ids_ptr, out_ptr, H, E, TOPK: tl.constexpr, BH: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BH + tl.arange(0, BH)
        col_mask = cols < H
        acc = tl.zeros((BH,), dtype=tl.float32)
        for j in tl.static_range(TOPK):
            e = tl.load(ids_ptr + t * TOPK + j) + tl.zeros((BH,), dtype=tl.int32)
            valid = col_mask & (e >= 0) & (e < E)  # unused slots were never written
            acc += tl.load(y_ptr + (t * TOPK + j) * H + cols, mask=valid, other=0.0)
        tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=col_mask)


FAST_ROUTE_MAX_SLOTS = 4096  # one-program routing up to here; torch ops beyond (prefill)


def route(topk_ids: torch.Tensor, num_experts: int, block_m: int, activations: torch.Tensor | None = None,
          fragment_chunk: int = 0):
    """Group slots by expert and cut them into ``block_m``-row blocks, on the device.

    Returns ``(sorted_slot [S] int32, block_expert [B] int32 (-1 unused), block_row_start [B],
    block_row_end [B])`` with ``B = min(S, E) + S // block_m`` (a bound on the blocks needed:
    each expert hit adds at most one partial block). Invalid ids are dropped. With
    ``activations [T, H]`` and ``fragment_chunk``, also returns them in :func:`fragment_order`
    (in the same launch on the one-program path).
    """
    flat = topk_ids.reshape(-1)
    num_slots = flat.numel()
    num_blocks = min(num_slots, num_experts) + num_slots // block_m
    on_triton = triton is not None and (flat.is_cuda or interpreting())
    fast = num_slots <= FAST_ROUTE_MAX_SLOTS and on_triton
    copy = activations is not None and on_triton  # the permute runs in _route_kernel's programs 1..
    if fast:
        out = torch.empty(num_slots + 3 * num_blocks, dtype=torch.int32, device=flat.device)
        routed = tuple(out.split([num_slots] + [num_blocks] * 3))
    else:
        routed = _route_torch(flat, num_experts, block_m, num_blocks)
    if fast or copy:
        x = activations.contiguous() if copy else routed[0]  # (unused without the copy)
        x_fragment = torch.empty_like(x) if copy else x
        x_block = 1024
        _route_kernel[(1 + (triton.cdiv(x.numel(), x_block) if copy else 0),)](
            flat, *routed, num_slots, num_experts, num_blocks, x, x_fragment, x.numel() if copy else 0, x.shape[-1],
            BM=block_m, S_PAD=triton.next_power_of_2(num_slots) if fast else 1,
            E_PAD=triton.next_power_of_2(num_experts + 1) if fast else 1,
            B_PAD=triton.next_power_of_2(num_blocks) if fast else 1, CHUNK=max(fragment_chunk, 16),
            X_BLOCK=x_block, ROUTE=fast, num_warps=4,
        )
    if activations is None:
        return routed
    if not copy:
        x_fragment = fragment_order(activations.contiguous(), fragment_chunk)
    return (*routed, x_fragment)


def _route_torch(flat: torch.Tensor, num_experts: int, block_m: int, num_blocks: int):
    valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, num_experts).to(torch.int32)
    _, sorted_slot = torch.sort(key, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, key.long(), torch.ones_like(key))
    counts = counts[:num_experts]
    expert_row_start = torch.cumsum(counts, 0, dtype=torch.int32) - counts
    blocks = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0, dtype=torch.int32)
    block = torch.arange(num_blocks, dtype=torch.int32, device=flat.device)
    block_expert = torch.searchsorted(block_end, block, right=True).to(torch.int32)
    used = block_expert < num_experts
    e = block_expert.clamp(max=num_experts - 1)
    row_start = expert_row_start[e] + (block - (block_end[e] - blocks[e])) * block_m
    row_end = torch.minimum(row_start + block_m, expert_row_start[e] + counts[e])
    block_expert = torch.where(used, block_expert, -1)
    return sorted_slot.to(torch.int32), block_expert, row_start, row_end


def _pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two <= cap that divides n (n is a multiple of 16)."""
    d = 16
    while d * 2 <= cap and n % (d * 2) == 0:
        d *= 2
    return d


def kernel_config(num_slots: int, num_experts: int, hidden: int, inter: int, routed_experts: int = 0) -> dict:
    """Tile sizes by shape bucket, chosen from H200 sweeps (benchmarks/sweep_triton.py,
    numbers in benchmarks/NOTES.md). Static: nothing is tuned at call time or in graph capture.

    The bucket is the expected rows per expert: slots over the experts the router chooses among
    (``routed_experts``, e.g. 256 on an expert-parallel rank holding 32; 0: ``num_experts``).
    Counting only local experts would put an EP=8 rank's decode batches of 64+ tokens, ~2 real
    rows per expert, in the prefill bucket."""
    rows_per_expert = num_slots / max(1, min(routed_experts or num_experts, num_slots))
    decode = rows_per_expert <= 16  # memory-bound, one M block per expert
    tma = fits_tma(hidden, inter)
    if decode:
        bm, bn1, bk1, bn2, bk2, warps, stages, prefetch = 16, 64, 256, 64, 256, 4, 3, False
    elif tma:  # prefill, tensor-core bound: 1.8x / 1.37x over the plain-load tiles at 2048 / 8192 tokens;
        # 256-row weight tiles (half the programs; GEMM2's K loop is short, I / 256 steps; GEMM1
        # decodes each weight tile for 2x the MMA work per instruction): 1.08-1.10x more
        bm, bn1, bk1, bn2, bk2, warps, stages, prefetch = 64, 256, 256, 256, 256, 8, 3, False
    else:
        bm, bn1, bk1, bn2, bk2, warps, stages, prefetch = 128, 128, 128, 128, 128, 8, 2, True
    cfg = dict(
        BM=bm, BN1=_pow2_divisor(inter, bn1), BK1=_pow2_divisor(hidden, bk1),
        BN2=_pow2_divisor(hidden, bn2), BK2=_pow2_divisor(inter, bk2),
        num_warps=warps, num_stages=stages, PREFETCH=prefetch,
    )
    # Weights through TMA (bulk copies pipelined over num_stages, 1.2x at decode on H200), and K
    # in MMA-fragment order: vector loads of each thread's weight bytes instead of byte loads and
    # shuffles (933 -> 562 instructions per K step of the decode GEMM2 loop, sm90 SASS; 1.4-1.5x);
    # with the paired weight layout of TritonBackend.prepare, 462 (0.88-0.93x the time at decode).
    cfg["TMA"] = cfg["FRAGMENT_ORDER"] = tma
    # Gate and up tiles in separate programs: 2x the programs for GEMM1, which at decode has too
    # few to fill 132 SMs (1.07-1.09x at 1 and 8 tokens, within 4% elsewhere in the bucket).
    # Costs an fp32 scratch of S x 2I (at most 16 rows x E: 67 MB for DeepSeek-V3 at 512 tokens).
    cfg["SPLIT_GATE_UP"] = decode
    return cfg


# --- the backend's weight layout (prepared once) ---------------------------------------------
#
# Where tiles come through TMA, the packed weights are stored as "row-pair words" so that the GPU
# decode needs 1.5 instead of 2.25 instructions per element. The MMA gives each thread rows r and
# r+8 of every 16-row group and, in fragment order, one 2-byte unit (4 codes) of each row per
# 16-wide K step; a word holds exactly those 4 bytes, bits permuted so that each of its four bf16x2
# registers comes out of a mask (_PAIRED_WORD_TO_BF16).

_BF16_CODE_BITS = (6, 7, 8, 15)  # where an E2M1 code's bits m, e0, e1, s go in a bf16 half
# The word's registers in PTX output order: (row of the pair, code in the low half, code in the
# high half), codes 0..3 of a row's 2-byte unit (code q is nibble q, low nibble first).
_WORD_REGISTERS = ((0, 0, 2), (1, 0, 2), (0, 1, 3), (1, 1, 3))
_PRODUCT_SOURCE = {6: 3, 7: 4, 8: 0, 15: 1}  # register 3: ((w & 0x001B001B) * 0x4108), per half


def _register_source_bit(register: int, target: int) -> int:
    """The stored word's bit that the PTX moves to bit ``target`` (0..31) of output ``register``:
    registers 0-2 rotate the word left by 0, 10, 13; register 3 multiplies (see above)."""
    if register == 3:
        return 16 * (target // 16) + _PRODUCT_SOURCE[target % 16]
    return (target - (0, 10, 13)[register]) % 32


def _plain_to_stored_bits() -> list[int]:
    """``dest[b]``: where bit ``b`` of a plain word (bytes: row r's unit, row r+8's unit; bit
    ``16*row + 4*code + i``) goes in the stored word. A permutation of 0..31."""
    dest = [0] * 32
    for register, (row, *codes) in enumerate(_WORD_REGISTERS):
        for half, code in enumerate(codes):
            for i, target in enumerate(_BF16_CODE_BITS):
                dest[16 * row + 4 * code + i] = _register_source_bit(register, 16 * half + target)
    assert sorted(dest) == list(range(32))
    return dest


def _permute_word_bits(words: torch.Tensor, dest: list[int]) -> torch.Tensor:
    """``words [..., 4]`` uint8 (little-endian 32-bit words) -> int32 ``[...]`` with bit ``b``
    moved to ``dest[b]``, by one 256-entry table per byte."""
    v = torch.arange(256, device=words.device)
    out = torch.zeros(words.shape[:-1], dtype=torch.int64, device=words.device)
    for byte in range(4):
        table = sum(((v >> j) & 1) << dest[8 * byte + j] for j in range(8))
        out |= table[words[..., byte].long()]
    return (out - ((out >> 31) << 32)).to(torch.int32)  # two's complement view of the 32 bits


def paired_weight_layout(packed: torch.Tensor) -> torch.Tensor:
    """Canonical NVFP4 weights ``[E, N, K/2]`` uint8 -> the Triton backend's ``[E, N/2, K/4]``
    int32: row ``p`` of an expert holds rows ``16(p//8) + p%8`` and that + 8, word ``u`` their
    2-byte units ``u`` (row r's first), bits permuted for the GPU decode. N multiple of 16."""
    e, n, k_half = packed.shape
    if n % 16 or k_half % 2:
        raise ValueError(f"paired layout needs N % 16 == 0 and K % 4 == 0, got {list(packed.shape)}")
    dest = _plain_to_stored_bits()
    out = torch.empty(e, n // 2, k_half // 2, dtype=torch.int32, device=packed.device)
    for x in range(e):  # one expert at a time: the int64 temporaries stay small
        units = packed[x].reshape(n // 16, 2, 8, k_half // 2, 2).permute(0, 2, 3, 1, 4)
        out[x] = _permute_word_bits(units.reshape(n // 2, k_half // 2, 4), dest)
    return out


def canonical_from_paired(words: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`paired_weight_layout`: ``[E, N/2, K/4]`` int32 -> ``[E, N, K/2]`` uint8."""
    e, half_n, quarter_k = words.shape
    dest = _plain_to_stored_bits()
    inverse = [dest.index(b) for b in range(32)]
    plain = _permute_word_bits(words.contiguous().view(torch.uint8).reshape(e, half_n, quarter_k, 4), inverse)
    units = plain.view(torch.uint8).reshape(e, half_n // 8, 8, quarter_k, 2, 2).permute(0, 1, 4, 2, 3, 5)
    return units.reshape(e, 2 * half_n, 2 * quarter_k).contiguous()


def fits_tma(hidden: int, inter: int) -> bool:
    """TMA boxes need BK >= 256 (a box row of scales >= 16 bytes, every row 16-byte aligned),
    i.e. H and I multiples of 256, as in every DeepSeek/Qwen/Mixtral shape."""
    return hidden % 256 == 0 and inter % 256 == 0


def fragment_order(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """``x [..., K]`` with each ``chunk``-wide piece of K reordered so that column
    ``16j + 8s + 2t + e`` holds natural index ``(chunk/4)t + 4j + 2e + s`` (t < 4, j < chunk/16,
    e, s < 2): the order in which :func:`_decode_tile_fragment_order` lays out weight columns."""
    *lead, k = x.shape
    pieces = x.reshape(*lead, k // chunk, 4, chunk // 16, 2, 2)  # [..., c, t, j, e, s]
    n = len(lead)
    return pieces.permute(*range(n + 1), n + 2, n + 4, n + 1, n + 3).reshape(*lead, k)


def triton_fused_moe(hidden_states, topk_ids, topk_weights, expert_tensors, config: dict | None = None,
                     routed_experts: int = 0):
    """Run the Triton kernels. ``expert_tensors``: :meth:`TritonBackend.prepare`'s (packed
    weights in :func:`paired_weight_layout`, int32) or the canonical layout (uint8; any config).
    The tiles come from :func:`kernel_config` (``routed_experts``: see ``fp4moe::fused_moe``)
    unless ``config`` is given."""
    w13, s13, g13, w2, s2, g2 = expert_tensors
    num_tokens, hidden = hidden_states.shape
    top_k = topk_ids.shape[1]
    num_experts, inter = s13.shape[0], s13.shape[1] // 2
    num_slots = num_tokens * top_k
    cfg = config or kernel_config(num_slots, num_experts, hidden, inter, routed_experts)
    paired = w13.dtype == torch.int32
    if paired and not (cfg.get("TMA") and cfg.get("FRAGMENT_ORDER")):
        raise ValueError("paired-layout weights need a TMA + FRAGMENT_ORDER config; pass canonical "
                         "uint8 weights for other configs")
    if cfg.get("FRAGMENT_ORDER") and (cfg["BN1"] % 64 or cfg["BN2"] % 64):
        # the GPU decode maps a 64-row weight tile onto the warpgroup's MMA fragments; narrower
        # tiles compile but give wrong sums on H200 (benchmarks/results/sweep_narrow_*.log)
        raise ValueError(f"fragment-order configs need BN1 and BN2 multiples of 64, got {cfg['BN1']} and {cfg['BN2']}")
    x = hidden_states.contiguous()
    fragment = cfg.get("FRAGMENT_ORDER", False)
    if fragment:  # GEMM1 reads x with K in fragment order
        sorted_slot, block_expert, row_start, row_end, x_gemm1 = route(topk_ids, num_experts, cfg["BM"], x, cfg["BK1"])
    else:
        sorted_slot, block_expert, row_start, row_end = route(topk_ids, num_experts, cfg["BM"])
        x_gemm1 = x
    launch = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], PREFETCH=cfg.get("PREFETCH", True),
                  FAST_DECODE=cfg.get("FAST_DECODE", not interpreting()), INTERPRET=interpreting(),
                  FRAGMENT_ORDER=fragment, PAIRED=paired, FAST_SCALES=cfg.get("FAST_SCALES", True))

    inter_act = torch.empty(num_slots, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(num_slots, hidden, dtype=torch.float32, device=x.device)
    tma = cfg.get("TMA", False)
    split = cfg.get("SPLIT_GATE_UP", False)
    desc1 = _descriptors(w13, s13, cfg["BN1"], cfg["BK1"]) if tma else (w13, s13)
    desc2 = _descriptors(w2, s2, cfg["BN2"], cfg["BK2"]) if tma else (w2, s2)
    grid1 = (block_expert.numel(), (2 if split else 1) * inter // cfg["BN1"])
    pre_act = torch.empty(num_slots, 2 * inter, dtype=torch.float32, device=x.device) if split else inter_act
    _gemm1_swiglu_kernel[grid1](
        x_gemm1, w13, s13, g13, pre_act, sorted_slot, block_expert,
        row_start, row_end, hidden, inter, top_k, *desc1, BM=cfg["BM"], BN=cfg["BN1"], BK=cfg["BK1"], TMA=tma,
        OUT_CHUNK=cfg["BK2"], SPLIT_GATE_UP=split, **launch,
    )
    if split:
        block = _pow2_divisor(inter, 1024)
        _silu_mul_kernel[(num_slots, inter // block)](pre_act, topk_ids.contiguous(), inter_act, inter, num_experts,
                                                       FRAGMENT_ORDER=fragment, OUT_CHUNK=cfg["BK2"], BLOCK=block)
    grid2 = (block_expert.numel(), hidden // cfg["BN2"])
    _gemm2_kernel[grid2](
        inter_act, w2, s2, g2, topk_weights.contiguous(), y, sorted_slot, block_expert, row_start, row_end,
        hidden, inter, *desc2, BM=cfg["BM"], BN=cfg["BN2"], BK=cfg["BK2"], TMA=tma, **launch,
    )
    return _sum_topk(y, topk_ids, x, num_experts)


def _descriptors(w: torch.Tensor, s: torch.Tensor, bn: int, bk: int):
    """TMA descriptors over ``w [E, N, K/2]`` and ``s [E, N, K/16]`` as 2-D ``[E*N, *]`` with
    ``[bn, bk/2]`` / ``[bn, bk/16]`` boxes; paired ``w [E, N/2, K/4]`` int32 as bytes
    ``[E*N/2, K]`` with ``[bn/2, bk]`` boxes. A box row must be >= 16 bytes: with ``bk < 256``
    the kernel loads scales with plain loads and gets ``s`` itself."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if w.dtype == torch.int32:
        w_box = TensorDescriptor.from_tensor(w.view(torch.uint8).reshape(-1, 4 * w.shape[-1]), [bn // 2, bk])
    else:
        w_box = TensorDescriptor.from_tensor(w.reshape(-1, w.shape[-1]), [bn, bk // 2])
    if bk < 256:
        return w_box, s
    return w_box, TensorDescriptor.from_tensor(s.reshape(-1, s.shape[-1]), [bn, bk // 16])


def _sum_topk(y: torch.Tensor, topk_ids: torch.Tensor, x: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``out [T, H]`` (x's dtype) = sum over each token's valid slots (ids in ``[0, num_experts)``)
    of ``y [T*k, H]`` fp32."""
    num_tokens, hidden = x.shape
    out = torch.empty_like(x)
    bh = min(1024, triton.next_power_of_2(hidden))
    _sum_topk_kernel[(num_tokens, triton.cdiv(hidden, bh))](
        y, topk_ids.contiguous(), out, hidden, num_experts, TOPK=topk_ids.shape[1], BH=bh,
    )
    return out


class TritonBackend(Backend):
    """fp4moe's Triton kernel: exact NVFP4 weights x bf16/fp16 activations (Hopper and newer)."""

    name = "triton"
    activation_scales = "forbidden"
    owns_packed_layout = True

    def unavailable_reason(self, device: torch.device) -> str | None:
        if triton is None:
            return "triton is not installed"
        if device.type != "cuda":
            return "needs a CUDA GPU"
        if torch.cuda.get_device_capability(device) < (8, 0):
            return "needs compute capability 8.0+ (bf16 tensor cores)"
        return None

    def prepare(self, weights) -> list[torch.Tensor]:
        """Canonical tensors, with the packed weights in :func:`paired_weight_layout` where the
        tiles come through TMA (H and I multiples of 256)."""
        tensors = canonical_layout(weights.tensors())
        tensors[0], tensors[3] = self.relayout_packed(tensors[0], tensors[3])
        return tensors

    def relayout_packed(self, w13, w2):
        """Both in :func:`paired_weight_layout` if H and I are multiples of 256, else as they are."""
        if w13.dtype == torch.uint8 and fits_tma(w2.shape[1], 2 * w2.shape[2]):
            return paired_weight_layout(w13), paired_weight_layout(w2)
        return w13, w2

    def canonical_packed(self, w13, w2):
        if w13.dtype == torch.int32:
            return canonical_from_paired(w13), canonical_from_paired(w2)
        return w13, w2

    def check_expert_tensors(self, expert_tensors, hidden_size):
        """The canonical layout, or (H and I multiples of 256) :meth:`prepare`'s paired packed
        weights ``w13 [E, I, H/4]`` and ``w2 [E, H/2, I/4]`` int32."""
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


register_backend(TritonBackend())
