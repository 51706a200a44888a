"""The Triton backend's GPU code: Triton jit kernels and the inline-PTX decode routines.

Launched by :mod:`.launch`; the weight layouts they read are defined in :mod:`.layout`. Imported
only where Triton is installed.
"""

import triton
import triton.language as tl

from .layout import fragment_column, fragment_source



@triton.jit
def _e2m1_f32(codes):
    """E2M1 codes (0..15, any int dtype) -> float32 value * 2^-14, exact."""
    c = codes.to(tl.int16)
    return (((c & 7) << 9) | ((c & 8) << 12)).to(tl.float16, bitcast=True).to(tl.float32)

@triton.jit
def _e4m3_f32(sbytes):
    """Block-scale bytes -> float32 scale * 2^-8, exact: E4M3 (non-negative) given as uint8, or
    E8M0 (MXFP4's ``2^(s - 127)``, byte 0 included) given as int8 (a signed view of the same bytes:
    the dtype is how every kernel tells the two formats apart at compile time)."""
    if sbytes.dtype == tl.int8:
        s = sbytes.to(tl.int32) & 0xFF
        return tl.where(s == 0, 0x00400000, s << 23).to(tl.float32, bitcast=True) * 0.00390625
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
# A diagnostic (config key DIAG 1, wrong results): the paired decode's registers set to 1.0 instead,
# its inputs unused, so the weight tiles still arrive (the TMA copies and their waits stay) but
# nothing decodes them; what the decode costs is then the difference (benchmarks/probes/probe_stream.py).
_NO_DECODE = tl.constexpr("mov.b32 $0, 0x3F803F80; mov.b32 $1, 0x3F803F80; mov.b32 $2, 0x3F803F80; "
                          "mov.b32 $3, 0x3F803F80;")

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

# PTX for 4 E8M0 scale bytes (MXFP4) -> 4 bf16 ``scale * 2^104``, 1.5 instructions per scale:
# bf16 has E8M0's 8 exponent bits, so byte ``s`` plus 104 moved into the exponent field is
# ``2^(s - 23)``; exact for s <= 150 (scales up to 2^23, checked where the tensors are made).
_E8M0X4_TO_BF16 = tl.constexpr("""
{
.reg .b32 t, z;
mov.b32 z, 0;
prmt.b32 t, $2, z, 0x4140; add.u32 t, t, 0x00680068; shl.b32 $0, t, 7;
prmt.b32 t, $2, z, 0x4342; add.u32 t, t, 0x00680068; shl.b32 $1, t, 7;
}
""")

@triton.jit
def _scales_bf16(sbytes, FAST_SCALES: tl.constexpr):
    """Block-scale bytes (E4M3 as uint8, E8M0 as int8) -> bf16 ``scale * 2^104`` (exact): the PTX
    above, or (FAST_SCALES off, for comparison) through fp32 as in :func:`_e4m3_f32`."""
    if FAST_SCALES and sbytes.dtype == tl.int8:
        return tl.inline_asm_elementwise(_E8M0X4_TO_BF16, "=r,=r,r", [sbytes], dtype=tl.bfloat16,
                                         is_pure=True, pack=4)
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
                 FAST_DECODE: tl.constexpr, SCALE_BLOCK: tl.constexpr = 16):
    """``packed [BN, BK/2]`` uint8 + ``sbytes [BN, BK/SCALE_BLOCK]`` (a scale per SCALE_BLOCK values)
    -> ``[BN, BK]`` OUT_DTYPE (bf16: times 2^-22, exact). PTX fast path for bf16 on the GPU;
    portable path otherwise."""
    if FAST_DECODE and OUT_DTYPE == tl.bfloat16:
        scale = (_e4m3_f32(sbytes) * 2.0**112).to(tl.bfloat16)  # scale * 2^104, exact
        scale = tl.broadcast_to(scale[:, :, None], (BN, BK // SCALE_BLOCK, SCALE_BLOCK // 2))
        lo, hi = tl.inline_asm_elementwise(
            _E2M1X8_TO_BF16, "=r,=r,=r,=r,r,r,r", [packed.reshape(BN, BK // SCALE_BLOCK, SCALE_BLOCK // 2), scale],
            dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        return tl.join(lo.reshape(BN, BK // 2), hi.reshape(BN, BK // 2)).reshape(BN, BK)
    values = _e2m1_f32(tl.join(packed & 0xF, packed >> 4).reshape(BN, BK))
    values = (values.reshape(BN, BK // SCALE_BLOCK, SCALE_BLOCK) * _e4m3_f32(sbytes)[:, :, None]).reshape(BN, BK)
    return _finish(values, OUT_DTYPE)

@triton.jit
def _decode_tile_fragment_order(packed, sbytes, BN: tl.constexpr, BK: tl.constexpr, OUT_DTYPE: tl.constexpr,
                                FAST_DECODE: tl.constexpr, PAIRED: tl.constexpr = False,
                                FAST_SCALES: tl.constexpr = True, DIAG: tl.constexpr = 0,
                                NATURAL_K: tl.constexpr = False, SCALE_BLOCK: tl.constexpr = 16):
    """:func:`_decode_tile` with the K axis in MMA-fragment order (see :func:`fragment_order`):
    ``[BN, BK]`` whose column ``16j + 8s + 2t + e`` is the weight at ``k = (BK/4)t + 4j + 2e + s``.

    Why: a tensor-core operand gives each thread of a quad ``t`` the k pairs ``2t, 2t+1`` and
    ``2t+8, 2t+9`` of every 16-wide step. In natural order those come from bytes all over the
    row (one byte load each, then byte shuffles); in this order a thread's bytes are one
    contiguous ``BK/8``-byte run per row (vector loads) and span only 4 scale blocks. The
    activations are fed in the same order, so the dot product is unchanged.

    With PAIRED, ``packed`` is a ``[BN/2, BK]`` tile of :func:`paired_weight_layout` words.
    NATURAL_K: the tile in natural K order instead (for a decode to memory). ``sbytes [BN,
    BK/SCALE_BLOCK]``: a scale per SCALE_BLOCK values (16: E4M3, or E8M0 written per 16; 32: gpt-oss's
    E8M0 held once per block).
    """
    # byte (t, j, e) holds k = (BK/4)t + 4j + 2e + s: scale (BK/(4 SCALE_BLOCK))t + j // (SCALE_BLOCK/4)
    SB: tl.constexpr = BK // (4 * SCALE_BLOCK)  # scales per row of each t's run
    if FAST_DECODE and OUT_DTYPE == tl.bfloat16:
        scale = _scales_bf16(sbytes, FAST_SCALES).reshape(BN, 4, SB, 1, 1)
        scale = tl.broadcast_to(scale, (BN, 4, SB, SCALE_BLOCK // 4, 2)).reshape(BN, 4, BK // 16, 2)
        if PAIRED:
            p = _pairs_to_rows(packed.reshape(BN // 2, BK // 4, 2, 2), BN, BK)
            lo, hi = tl.inline_asm_elementwise(_NO_DECODE if DIAG == 1 else _PAIRED_WORD_TO_BF16,
                                               "=r,=r,=r,=r,r,r,r", [p, scale], dtype=(tl.bfloat16, tl.bfloat16),
                                               is_pure=True, pack=4)
        else:
            p = packed.reshape(BN, 4, BK // 16, 2)  # byte (BK/8)t + 2j + e -> [row, t, j, e]
            lo, hi = tl.inline_asm_elementwise(_E2M1X8_TO_BF16, "=r,=r,=r,=r,r,r,r", [p, scale],
                                               dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        scale = _e4m3_f32(sbytes).reshape(BN, 4, SB, 1, 1)
        scale = tl.broadcast_to(scale, (BN, 4, SB, SCALE_BLOCK // 4, 2)).reshape(BN, 4, BK // 16, 2)
        if PAIRED:
            lo_codes, hi_codes = _paired_codes(packed, BN, BK)
        else:
            p = packed.reshape(BN, 4, BK // 16, 2)
            lo_codes, hi_codes = p & 0xF, p >> 4
        lo = _finish(_e2m1_f32(lo_codes) * scale, OUT_DTYPE)
        hi = _finish(_e2m1_f32(hi_codes) * scale, OUT_DTYPE)
    w = tl.join(lo, hi)  # [row, t, j, e, s]: the low nibble is s = 0
    if NATURAL_K:  # k = (BK/4)t + 4j + 2e + s
        return w.reshape(BN, BK)
    return tl.permute(w, (0, 2, 4, 1, 3)).reshape(BN, BK)  # column 16j + 8s + 2t + e

# The fragment-order permutation is written once, in .layout (plain index arithmetic); the
# kernels compile the same functions.
_fragment_position = triton.jit(fragment_column)
_fragment_source = triton.jit(fragment_source)


@triton.jit
def _await_previous_kernel(PDL: tl.constexpr):
    """With programmatic dependent launch (``launch_pdl``), this program may start while the
    previous kernel on the stream still runs: wait for it to finish (its writes visible), then let
    the next kernel's programs start taking free SM slots. A no-op without PDL."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _block_expert(b, block_expert_ptr, E: tl.constexpr, SLOT_BLOCKS: tl.constexpr):
    """Row block ``b``'s expert, -1 for a block to skip. As :func:`.launch.route` made the blocks, or
    with SLOT_BLOCKS (one-token calls, no routing launch) block ``b`` is slot ``b`` alone and
    ``block_expert_ptr`` the flat ids, checked here against ``[0, E)`` as loaded (64-bit ids
    included), so an id past the weights is never read."""
    e = tl.load(block_expert_ptr + b)
    if SLOT_BLOCKS:
        e = tl.where((e >= 0) & (e < E), e, -1).to(tl.int32)
    return e

@triton.jit
def _block_rows(b, sorted_slot_ptr, block_row_start_ptr, block_row_end_ptr, BM: tl.constexpr,
                SLOT_BLOCKS: tl.constexpr = False):
    """A used block's slots ``[BM]`` int64 and row mask (SLOT_BLOCKS: slot ``b`` alone). Not for a
    skipped block: the routing kernel leaves their rows unwritten."""
    if SLOT_BLOCKS:
        return (b + tl.arange(0, BM) * 0).to(tl.int64), tl.arange(0, BM) == 0
    r0 = tl.load(block_row_start_ptr + b)
    r1 = tl.load(block_row_end_ptr + b)
    rows = r0 + tl.arange(0, BM)
    row_mask = rows < r1
    slots = tl.load(sorted_slot_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    return slots, row_mask

@triton.jit
def _fragment_order_tile(a, BM: tl.constexpr, BK: tl.constexpr):
    """``a [BM, BK]`` in natural K order -> ``[BK, BM]`` with K in :func:`fragment_order`: natural
    index ``(BK/4) t + 4 j + 2 e + s`` goes to column ``16 j + 8 s + 2 t + e``."""
    a = tl.reshape(a, (BM, 4, BK // 16, 2, 2))  # (m, t, j, e, s)
    return tl.reshape(tl.permute(a, (2, 4, 1, 3, 0)), (BK, BM))  # (j, s, t, e) x m


@triton.jit
def _expert_matmul(acc, w_ptr, s_ptr, rows, a_ptr, a_rows, row_mask, K,
                   BN: tl.constexpr, BK: tl.constexpr, PREFETCH: tl.constexpr, FAST_DECODE: tl.constexpr, INTERPRET: tl.constexpr,
                   w_desc=None, s_desc=None, desc_row=0, TMA: tl.constexpr = False,
                   FRAGMENT_ORDER: tl.constexpr = False, PAIRED: tl.constexpr = False,
                   FAST_SCALES: tl.constexpr = True, k_lo=0, k_hi=0, A_NATURAL: tl.constexpr = False,
                   a_desc=None, a_row0=0, A_TMA: tl.constexpr = False, BM: tl.constexpr = 16,
                   GATE_UP: tl.constexpr = False, desc_expert=0, DIAG: tl.constexpr = 0, K_TAIL: tl.constexpr = 0,
                   SCALE_BLOCK: tl.constexpr = 16):
    """``acc [BN, BM] += W[rows, k_lo:k_hi] @ A[a_rows, k_lo:k_hi]^T`` (``k_hi = 0``: K) with W NVFP4
    ``[*, K/2]`` bytes (with FRAGMENT_ORDER, A's K axis is in :func:`fragment_order` per BK chunk,
    or with A_NATURAL too, A is in natural order and read permuted: for small A, no copy to make;
    with A_TMA as well, A's ``[BM, BK]`` tiles from ``a_row0`` come through TMA in natural order,
    pipelined like the weights, and are permuted in registers).

    The weight tile is the MMA's M side ("swap AB"): decode's few tokens sit on the narrow
    N side. A constant ``k_hi`` (0) with a constexpr K gives the loop a static trip count: then
    ptxas keeps up to 8 wgmma in flight (``WARPGROUP.DEPBAR.LE gsb0, 0x7`` in the sm90 SASS). With a
    run-time bound the loop's zero-trip path sets the accumulators outside a wgmma and ptxas waits
    after every wgmma (its note C7515), but needs fewer registers (80 instead of 124 in the decode
    the down GEMM: more CTAs per SM). Which wins depends on the bucket (``PIPELINED_GATE_UP`` / ``PIPELINED_DOWN`` in kernel_config).

    With PREFETCH the next tile's bytes are loaded before this tile is decoded, so the memory
    latency overlaps the decode and the dot.

    GATE_UP (the gate_up GEMM's merged tiles): ``w_desc`` / ``s_desc`` are 4-D descriptors over one expert's
    ``[2, I, *]`` (gate, up) and the tile is rows ``desc_row .. desc_row + BN/2`` of both, for expert
    ``desc_expert``: here ``desc_row`` is a row within I, where the 2-D TMA path takes a row of
    ``[E*N, *]``.

    K_TAIL (``K % BK`` > 0, gpt-oss's 2880; TMA only): the last ``K_TAIL`` columns are one more,
    partial step after the loop. TMA fills the weights past K with zeros (and the scales are held in
    whole steps, zeros past K); A's last partial chunk is held in natural order (no full chunk to
    permute within), read with the fragment order's addresses and masked past K: zero weights times
    zero activations, so the sum is the unpadded one, exactly.

    SCALE_BLOCK 32 (gpt-oss's E8M0 held once per 32 values, rows in pairs: TMA with BK 256 only):
    the scale boxes hold row pairs (:func:`_scale_row`, :func:`_step_scales`) and the decode takes
    a scale per 32 values.
    """
    if SCALE_BLOCK != 16:
        tl.static_assert(TMA and BK == 256, "a scale per 32 values comes through TMA, K steps of 256")
    dtype = a_ptr.dtype.element_ty
    kb = tl.arange(0, BK // 2)
    ks = tl.arange(0, BK // 16)
    kk = tl.arange(0, BK)
    w_ptrs = w_ptr + rows[:, None] * (K // 2) + kb[None, :]
    s_ptrs = s_ptr + rows[:, None] * (K // 16) + ks[None, :]
    if FRAGMENT_ORDER and A_NATURAL:
        a_ptrs = a_ptr + a_rows[None, :] * K + _fragment_source(kk, BK)[:, None]
    else:
        a_ptrs = a_ptr + a_rows[None, :] * K + kk[:, None]
    k_end = K if k_hi == 0 else k_hi
    if not TMA:  # unmasked: without TMA the caller's range must not be empty (only the linear, always
        # through TMA, has empty K parts)
        packed = tl.load(w_ptrs + k_lo // 2)
        sbytes = tl.load(s_ptrs + k_lo // 16)
    if K_TAIL > 0:
        k_main = k_end - K_TAIL
    else:
        k_main = k_end
    for k0 in range(k_lo, k_main, BK):
        if A_TMA:
            a = _fragment_order_tile(a_desc.load([a_row0, k0]), BM, BK)
        else:
            a = tl.load(a_ptrs + k0, mask=row_mask[None, :], other=0.0)
        if GATE_UP or TMA:  # bulk tensor copies, which Triton pipelines over num_stages
            packed, sbytes = _tma_step(w_desc, s_desc, s_ptrs, desc_expert, desc_row, k0, GATE_UP, PAIRED, BN, BK,
                                       SCALE_BLOCK)
        elif PREFETCH:
            more = (k0 + BK) < k_end  # the last iteration loads nothing
            packed_next = tl.load(w_ptrs + (k0 + BK) // 2, mask=(kb[None, :] * 0 + more) != 0, other=0)
            sbytes_next = tl.load(s_ptrs + (k0 + BK) // 16, mask=(ks[None, :] * 0 + more) != 0, other=0)
        else:
            packed = tl.load(w_ptrs + k0 // 2)
            sbytes = tl.load(s_ptrs + k0 // 16)
        if FRAGMENT_ORDER:
            w = _decode_tile_fragment_order(packed, sbytes, BN, BK, dtype, FAST_DECODE, PAIRED, FAST_SCALES, DIAG,
                                            SCALE_BLOCK=SCALE_BLOCK)
        else:
            w = _decode_tile(packed, sbytes, BN, BK, dtype, FAST_DECODE, SCALE_BLOCK)
        if INTERPRET:  # Triton's CPU interpreter mis-multiplies bf16 dots
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(w, a, acc)
        if PREFETCH and not TMA:
            packed, sbytes = packed_next, sbytes_next
    if K_TAIL > 0:
        acc = _expert_matmul_tail(acc, a_ptr, a_rows, row_mask, K, k_main, BN, BK, FAST_DECODE, INTERPRET,
                                  w_desc, s_desc, desc_row, FRAGMENT_ORDER, PAIRED, FAST_SCALES, GATE_UP, desc_expert,
                                  DIAG, K_TAIL, SCALE_BLOCK)
    return acc


@triton.jit
def _scale_row(row, SCALE_BLOCK: tl.constexpr):
    """The scale box's first row for weight row ``row``: the row itself, or with a scale per 32
    values its row pair (:func:`.layout.pair_scale_rows`; the descriptor views ``[N/2, 2 Hs]``, a
    256-wide step's 16-byte unit rows 2p and 2p + 1's 8 bytes), at column ``k0 / 16`` either way."""
    return row // (SCALE_BLOCK // 16)

@triton.jit
def _step_scales(box, BN: tl.constexpr, BK: tl.constexpr, SCALE_BLOCK: tl.constexpr):
    """A K step's scale box (``[BN, BK/16]``, or with a scale per 32 values ``[BN/2, 16]`` row
    pairs; any leading unit dimensions) -> ``[BN, BK/SCALE_BLOCK]``, rows in order."""
    return box.reshape(BN, BK // SCALE_BLOCK)

@triton.jit
def _tma_step(w_desc, s_desc, s_ptrs, desc_expert, desc_row, k0, GATE_UP: tl.constexpr, PAIRED: tl.constexpr,
              BN: tl.constexpr, BK: tl.constexpr, SCALE_BLOCK: tl.constexpr):
    """One K step's packed weights and scale bytes through TMA, from ``k0``: with GATE_UP ``[gate rows;
    up rows]`` of expert ``desc_expert`` from 4-D descriptors over ``[E, 2, I, *]``, else rows of the
    2-D ``[E*N, *]`` views (paired: ``[BN/2, BK]`` bytes of row-pair words). A scale box row under 16
    bytes is not allowed, so with ``BK`` < 256 the scales come by plain loads from ``s_ptrs``."""
    if GATE_UP:
        if PAIRED:
            packed = w_desc.load([desc_expert, 0, desc_row // 2, k0]).reshape(BN // 2, BK)
        else:
            packed = w_desc.load([desc_expert, 0, desc_row, k0 // 2]).reshape(BN, BK // 2)
        sbytes = _step_scales(s_desc.load([desc_expert, 0, _scale_row(desc_row, SCALE_BLOCK), k0 // 16]), BN, BK,
                              SCALE_BLOCK)
    else:
        if PAIRED:
            packed = w_desc.load([desc_row // 2, k0])
        else:
            packed = w_desc.load([desc_row, k0 // 2])
        if BK >= 256:
            sbytes = _step_scales(s_desc.load([_scale_row(desc_row, SCALE_BLOCK), k0 // 16]), BN, BK, SCALE_BLOCK)
        else:
            sbytes = tl.load(s_ptrs + k0 // 16)
    return packed, sbytes

@triton.jit
def _expert_matmul_tail(acc, a_ptr, a_rows, row_mask, K, k0, BN: tl.constexpr, BK: tl.constexpr,
                        FAST_DECODE: tl.constexpr, INTERPRET: tl.constexpr, w_desc, s_desc, desc_row,
                        FRAGMENT_ORDER: tl.constexpr, PAIRED: tl.constexpr, FAST_SCALES: tl.constexpr,
                        GATE_UP: tl.constexpr, desc_expert, DIAG: tl.constexpr, K_TAIL: tl.constexpr,
                        SCALE_BLOCK: tl.constexpr = 16):
    """:func:`_expert_matmul`'s last, partial K step (``K_TAIL`` columns from ``k0``), TMA tiles only."""
    dtype = a_ptr.dtype.element_ty
    kk = tl.arange(0, BK)
    if FRAGMENT_ORDER:
        src = _fragment_source(kk, BK)
    else:
        src = kk
    a = tl.load(a_ptr + a_rows[None, :] * K + k0 + src[:, None], mask=row_mask[None, :] & (src[:, None] < K_TAIL),
                other=0.0)
    tl.static_assert(GATE_UP or BK >= 256, "a partial K step needs the scales through TMA")
    packed, sbytes = _tma_step(w_desc, s_desc, s_desc, desc_expert, desc_row, k0, GATE_UP, PAIRED, BN, BK, SCALE_BLOCK)
    if FRAGMENT_ORDER:
        w = _decode_tile_fragment_order(packed, sbytes, BN, BK, dtype, FAST_DECODE, PAIRED, FAST_SCALES, DIAG,
                                        SCALE_BLOCK=SCALE_BLOCK)
    else:
        w = _decode_tile(packed, sbytes, BN, BK, dtype, FAST_DECODE, SCALE_BLOCK)
    if INTERPRET:
        a, w = a.to(tl.float32), w.to(tl.float32)
    return tl.dot(w, a, acc)

@triton.jit
def _global_scale(g_ptr, s_ptr, e):
    """Expert ``e``'s global scale: ``g[e]`` for NVFP4, 1 for MXFP4 (E8M0 scales, int8: no global
    scale, ``g_ptr`` unused)."""
    if s_ptr.dtype.element_ty == tl.int8:
        return 1.0
    return tl.load(g_ptr + e)

@triton.jit
def _gpt_oss_glu(gate, up, swiglu_alpha, limit):
    """gpt-oss's clamped SwiGLU of the biased projections (float32), as
    :func:`fp4moe_ops.moe_math.clamped_swiglu` defines it."""
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    return gate * tl.sigmoid(gate * swiglu_alpha) * (up + 1.0)

@triton.jit
def _gate_up_swiglu_kernel(
    x_ptr, w_ptr, s_ptr, g_ptr, out_ptr,
    sorted_slot_ptr, block_expert_ptr, block_row_start_ptr, block_row_end_ptr,
    H: tl.constexpr, I: tl.constexpr, TOPK, w_desc, s_desc, K_RUNTIME,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREFETCH: tl.constexpr, FAST_DECODE: tl.constexpr, INTERPRET: tl.constexpr,
    TMA: tl.constexpr, FRAGMENT_ORDER: tl.constexpr = False, OUT_CHUNK: tl.constexpr = 256,
    PAIRED: tl.constexpr = False, FAST_SCALES: tl.constexpr = True,
    MERGED_GATE_UP: tl.constexpr = False, PIPELINED_MMA: tl.constexpr = True, PDL: tl.constexpr = False,
    DIAG: tl.constexpr = 0, SLOT_BLOCKS: tl.constexpr = False, E: tl.constexpr = 0,
    gate_up_bias_ptr=None, swiglu_alpha=1.0, limit=1.0, GPT_OSS: tl.constexpr = False, SCALE_BLOCK: tl.constexpr = 16,
):
    """Per (M block, N tile): ``silu(x W_gate^T) * (x W_up^T)`` into ``out [S, I]`` (GPT_OSS:
    gpt-oss's clamped SwiGLU with the biases ``gate_up_bias [E, 2I]`` float32, :func:`_gpt_oss_glu`;
    SCALE_BLOCK 32: gpt-oss's E8M0 scales held once per 32 values, see :func:`_expert_matmul`). With
    MERGED_GATE_UP (TMA tiles) a program's BN rows are BN/2 gate rows and the same up rows, in one K
    loop with one accumulator; else BN gate rows and BN up rows in two K loops. SLOT_BLOCKS: see
    :func:`_block_expert`; ``x`` is then in natural order (read permuted, with FRAGMENT_ORDER)."""
    _await_previous_kernel(PDL)
    b = tl.program_id(0)
    e = _block_expert(b, block_expert_ptr, E, SLOT_BLOCKS)
    if e >= 0:
        slots, row_mask = _block_rows(b, sorted_slot_ptr, block_row_start_ptr, block_row_end_ptr, BM, SLOT_BLOCKS)
        tokens = slots // TOPK
        k_stop = 0 if PIPELINED_MMA else K_RUNTIME  # a static K loop (wgmma pipelined) or not: see _expert_matmul
        e64 = e.to(tl.int64)
        w_e = w_ptr + e64 * (2 * I) * (H // 2)
        s_e = s_ptr + e64 * (2 * I) * (H // 16)
        zero = tl.zeros((BN, BM), dtype=tl.float32)
        g = _global_scale(g_ptr, s_ptr, e)
        if x_ptr.dtype.element_ty == tl.bfloat16:
            g = g * 4194304.0  # the tiles' 2^-22
        if MERGED_GATE_UP:  # BN/2 gate rows and the same up rows in one K loop, one accumulator
            i0 = tl.program_id(1) * (BN // 2)  # the tile's first row within I (of gate and of up)
            # (the weights come through the 4-D descriptors: w_e, s_e and the rows are unused there)
            acc = _expert_matmul(zero, w_e, s_e, tl.arange(0, BN), x_ptr, tokens, row_mask, H, BN, BK, PREFETCH,
                                 FAST_DECODE, INTERPRET, w_desc, s_desc, i0, TMA, FRAGMENT_ORDER, PAIRED,
                                 FAST_SCALES, k_hi=k_stop, A_NATURAL=SLOT_BLOCKS, GATE_UP=True, desc_expert=e,
                                 DIAG=DIAG, K_TAIL=H % BK, SCALE_BLOCK=SCALE_BLOCK)
            gate, up = tl.split(tl.permute((acc * g).reshape(2, BN // 2, BM), (1, 2, 0)))  # rows [gate; up]
            cols = i0 + tl.arange(0, BN // 2)
        else:
            cols = tl.program_id(1) * BN + tl.arange(0, BN)
            row0 = e * (2 * I) + tl.program_id(1) * BN  # descriptor row of this tile in [E * 2I, H/2]
            acc_gate = _expert_matmul(zero, w_e, s_e, cols, x_ptr, tokens, row_mask, H, BN, BK, PREFETCH,
                                      FAST_DECODE, INTERPRET, w_desc, s_desc, row0, TMA, FRAGMENT_ORDER, PAIRED,
                                      FAST_SCALES, k_hi=k_stop, A_NATURAL=SLOT_BLOCKS, DIAG=DIAG, K_TAIL=H % BK,
                                      SCALE_BLOCK=SCALE_BLOCK)
            acc_up = _expert_matmul(zero, w_e, s_e, cols + I, x_ptr, tokens, row_mask, H, BN, BK, PREFETCH,
                                    FAST_DECODE, INTERPRET, w_desc, s_desc, row0 + I, TMA, FRAGMENT_ORDER, PAIRED,
                                    FAST_SCALES, k_hi=k_stop, A_NATURAL=SLOT_BLOCKS, DIAG=DIAG, K_TAIL=H % BK,
                                    SCALE_BLOCK=SCALE_BLOCK)
            gate = acc_gate * g
            up = acc_up * g
        if GPT_OSS:
            gate_up_bias_e = gate_up_bias_ptr + e64 * (2 * I)
            h = _gpt_oss_glu(gate + tl.load(gate_up_bias_e + cols)[:, None], up + tl.load(gate_up_bias_e + I + cols)[:, None],
                             swiglu_alpha, limit)
        else:
            h = gate * tl.sigmoid(gate) * up
        if FRAGMENT_ORDER and I % OUT_CHUNK == 0:  # the down GEMM reads its K axis (our columns) in fragment order
            cols = _fragment_position(cols, OUT_CHUNK)
        elif FRAGMENT_ORDER:  # a partial last chunk stays in natural order (see _expert_matmul's K_TAIL)
            cols = tl.where(cols < I - I % OUT_CHUNK, _fragment_position(cols, OUT_CHUNK), cols)
        tl.store(out_ptr + slots[None, :] * I + cols[:, None], h.to(out_ptr.dtype.element_ty),
                 mask=row_mask[None, :])

@triton.jit
def _down_kernel(
    a_ptr, w_ptr, s_ptr, g_ptr, topk_weights_ptr, out_ptr,
    sorted_slot_ptr, block_expert_ptr, block_row_start_ptr, block_row_end_ptr,
    H: tl.constexpr, I: tl.constexpr, w_desc, s_desc, K_RUNTIME,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREFETCH: tl.constexpr, FAST_DECODE: tl.constexpr, INTERPRET: tl.constexpr,
    TMA: tl.constexpr, FRAGMENT_ORDER: tl.constexpr = False, PAIRED: tl.constexpr = False,
    FAST_SCALES: tl.constexpr = True, PIPELINED_MMA: tl.constexpr = True, PDL: tl.constexpr = False,
    DIAG: tl.constexpr = 0, SLOT_BLOCKS: tl.constexpr = False, E: tl.constexpr = 0, SCALE_BLOCK: tl.constexpr = 16,
):
    _await_previous_kernel(PDL)
    b = tl.program_id(0)
    e = _block_expert(b, block_expert_ptr, E, SLOT_BLOCKS)
    if e >= 0:
        slots, row_mask = _block_rows(b, sorted_slot_ptr, block_row_start_ptr, block_row_end_ptr, BM, SLOT_BLOCKS)
        k_stop = 0 if PIPELINED_MMA else K_RUNTIME  # a static K loop (wgmma pipelined) or not: see _expert_matmul
        e64 = e.to(tl.int64)
        w_e = w_ptr + e64 * H * (I // 2)
        s_e = s_ptr + e64 * H * (I // 16)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        acc = _expert_matmul(tl.zeros((BN, BM), dtype=tl.float32), w_e, s_e, cols, a_ptr, slots, row_mask, I,
                             BN, BK, PREFETCH, FAST_DECODE, INTERPRET, w_desc, s_desc,
                             e * H + tl.program_id(1) * BN, TMA, FRAGMENT_ORDER, PAIRED, FAST_SCALES, k_hi=k_stop,
                             DIAG=DIAG, K_TAIL=I % BK, SCALE_BLOCK=SCALE_BLOCK)
        g = _global_scale(g_ptr, s_ptr, e)
        if a_ptr.dtype.element_ty == tl.bfloat16:
            g = g * 4194304.0
        route = tl.load(topk_weights_ptr + slots, mask=row_mask, other=0.0)
        y = acc * g * route[None, :]
        tl.store(out_ptr + slots[None, :] * H + cols[:, None], y, mask=row_mask[None, :])

@triton.jit(do_not_specialize=["S", "NUM_BLOCKS", "X_NUMEL", "H", "CHUNK_SLOTS"])
def _route_kernel(ids_ptr, sorted_slot_ptr, block_expert_ptr, block_row_start_ptr, block_row_end_ptr,
                  S, E, NUM_BLOCKS, x_ptr, x_fragment_ptr, X_NUMEL, H, chunk_counts_ptr, CHUNK_SLOTS,
                  tail_expert_ptr, tail_row_start_ptr, tail_row_end_ptr,
                  BM: tl.constexpr, E_PAD: tl.constexpr, R_CHUNK: tl.constexpr, COUNT_BLOCK: tl.constexpr,
                  CHUNK: tl.constexpr, X_BLOCK: tl.constexpr, PDL: tl.constexpr = False,
                  CHUNKS: tl.constexpr = 0, TAIL: tl.constexpr = 0, X_NATURAL_TAIL: tl.constexpr = False):
    """:func:`route` in the first programs: one launch instead of ~12 torch ops. Decode-sized S
    (``CHUNKS == 0``): ``ceil(S / R_CHUNK)`` programs, each counting every slot itself. Prefill
    (``CHUNKS`` > 0): ``CHUNKS`` programs of ``CHUNK_SLOTS`` slots each, reading the per-chunk
    counts :func:`_route_count_kernel` wrote (``chunk_counts [CHUNKS, E_PAD]``). The other
    programs (if any) copy ``x [T, H]`` into :func:`fragment_order` with ``CHUNK``-wide chunks,
    which saves the permute's own launch (X_NATURAL_TAIL: ``H % CHUNK`` > 0, the partial last chunk
    copied in natural order, as :func:`.layout.fragment_order` leaves it). ``TAIL`` > 0: an expert's
    last block of at most ``TAIL`` rows goes to the tail table (indexed by expert, -1 where none)
    instead of the block table (see :func:`_route_program`).

    No size is a constexpr and S, NUM_BLOCKS, X_NUMEL, H and CHUNK_SLOTS are not specialized: one
    compiled variant serves every token count of a path (a tl.sort over a power-of-two padded S
    compiled a variant per power of two, up to 15 s each on the CPU machine, paid on the first
    call of every new size class)."""
    _await_previous_kernel(PDL)
    if CHUNKS > 0:
        route_programs = CHUNKS
    else:
        route_programs = tl.cdiv(S, R_CHUNK)
    p = tl.program_id(0)
    if p >= route_programs:
        idx = (p - route_programs) * X_BLOCK + tl.arange(0, X_BLOCK)
        mask = idx < X_NUMEL
        c = idx % H
        natural = _fragment_source(c, CHUNK)
        if X_NATURAL_TAIL:
            natural = tl.where(c < H - H % CHUNK, natural, c)
        tl.store(x_fragment_ptr + idx, tl.load(x_ptr + idx - c + natural, mask=mask), mask=mask)
    else:
        _route_program(p, ids_ptr, sorted_slot_ptr, block_expert_ptr, block_row_start_ptr, block_row_end_ptr,
                       S, E, NUM_BLOCKS, chunk_counts_ptr, CHUNK_SLOTS, tail_expert_ptr, tail_row_start_ptr,
                       tail_row_end_ptr, BM, E_PAD, R_CHUNK, COUNT_BLOCK, CHUNKS, TAIL)

@triton.jit(do_not_specialize=["S", "CHUNK_SLOTS"])
def _route_count_kernel(ids_ptr, chunk_counts_ptr, S, E, CHUNK_SLOTS, E_PAD: tl.constexpr,
                        COUNT_BLOCK: tl.constexpr):
    """Prefill routing's first launch: program ``c`` writes the slots per bin of slots ``c
    CHUNK_SLOTS .. (c + 1) CHUNK_SLOTS`` to ``chunk_counts [c, :]`` (each slot read once, where a
    program counting all slots itself would read S slots per program)."""
    c0 = tl.program_id(0) * CHUNK_SLOTS
    end = tl.minimum(c0 + CHUNK_SLOTS, S)
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    for start in range(c0, end, COUNT_BLOCK):
        _, key = _expert_keys(ids_ptr, start, end, E, COUNT_BLOCK)
        counts += tl.histogram(key, E_PAD)
    tl.store(chunk_counts_ptr + tl.program_id(0) * E_PAD + tl.arange(0, E_PAD), counts)

@triton.jit
def _expert_keys(ids_ptr, start, end, E, BLOCK: tl.constexpr):
    """Expert ids of slots ``start .. start + BLOCK``: invalid ids -> bin E, slots at or past
    ``end`` -> bin E + 1 (counted nowhere that matters)."""
    offs = start + tl.arange(0, BLOCK)
    key = tl.load(ids_ptr + offs, mask=offs < end, other=-1)
    key = tl.where((key >= 0) & (key < E), key, E).to(tl.int32)  # checked before narrowing int64 ids
    return offs, tl.where(offs < end, key, E + 1)

@triton.jit
def _count(ids_ptr, end, E, E_PAD: tl.constexpr, COUNT_BLOCK: tl.constexpr):
    """Slots per bin among slots ``0 .. end``."""
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    for c0 in range(0, end, COUNT_BLOCK):
        _, key = _expert_keys(ids_ptr, c0, end, E, COUNT_BLOCK)
        counts += tl.histogram(key, E_PAD)
    return counts

@triton.jit
def _chunk_counts(chunk_counts_ptr, p, CHUNKS: tl.constexpr, E_PAD: tl.constexpr):
    """From :func:`_route_count_kernel`'s table: slots per bin in all chunks, and in chunks before ``p``."""
    bins = tl.arange(0, E_PAD)
    total = tl.zeros((E_PAD,), dtype=tl.int32)
    before = tl.zeros((E_PAD,), dtype=tl.int32)
    for r0 in tl.static_range(0, CHUNKS, 16):  # 16 chunks' rows at a time: a [CHUNKS, E_PAD] tile is too many registers
        rows = r0 + tl.arange(0, 16)
        table = tl.load(chunk_counts_ptr + rows[:, None] * E_PAD + bins[None, :], mask=rows[:, None] < CHUNKS, other=0)
        total += tl.sum(table, axis=0)
        before += tl.sum(tl.where(rows[:, None] < p, table, 0), axis=0)
    return total, before

@triton.jit
def _route_program(p, ids_ptr, sorted_slot_ptr, block_expert_ptr, block_row_start_ptr, block_row_end_ptr,
                   S, E, NUM_BLOCKS, chunk_counts_ptr, CHUNK_SLOTS, tail_expert_ptr, tail_row_start_ptr,
                   tail_row_end_ptr, BM: tl.constexpr, E_PAD: tl.constexpr, R_CHUNK: tl.constexpr,
                   COUNT_BLOCK: tl.constexpr, CHUNKS: tl.constexpr, TAIL: tl.constexpr):
    """A stable counting sort of the slots by expert; program ``p`` places the slots of its chunk
    (``R_CHUNK`` slots, or ``CHUNK_SLOTS`` with ``CHUNKS`` in ``R_CHUNK`` steps): a slot's row is its
    expert's first row + the expert's slots before this step + its rank among the step's slots of
    that expert. Decode-sized S: every program counts all slots and those before its chunk itself
    (S <= 4096 ids, a few COUNT_BLOCK steps), so the programs need nothing from each other; with
    ``CHUNKS``, the counts come from the per-chunk table. Bin E collects invalid ids: those slots
    land after every valid one. Program 0 also writes the block table, and with ``TAIL`` the tail
    table: expert ``e``'s last block goes there (the block table's entry -1) when it holds at most
    ``TAIL`` rows."""
    bins = tl.arange(0, E_PAD)
    if CHUNKS > 0:
        counts, before = _chunk_counts(chunk_counts_ptr, p, CHUNKS, E_PAD)
        c0 = p * CHUNK_SLOTS
        c_end = tl.minimum(c0 + CHUNK_SLOTS, S)
        steps_end = c_end
    else:
        counts = _count(ids_ptr, S, E, E_PAD, COUNT_BLOCK)
        c0 = p * R_CHUNK
        before = _count(ids_ptr, c0, E, E_PAD, COUNT_BLOCK)
        c_end = S
        steps_end = c0 + 1  # one step
    row_start = tl.cumsum(counts, 0) - counts
    base = row_start + before
    lane = tl.arange(0, R_CHUNK)
    for step in range(c0, steps_end, R_CHUNK):
        offs, key = _expert_keys(ids_ptr, step, c_end, E, R_CHUNK)
        earlier = (key[:, None] == key[None, :]) & (lane[None, :] < lane[:, None])
        rank = tl.sum(earlier.to(tl.int32), axis=1)  # earlier slots of this step with the same key
        row = tl.gather(base, key, 0) + rank
        tl.store(sorted_slot_ptr + row, offs, mask=offs < c_end)
        base += tl.histogram(key, E_PAD)

    if p == 0:
        counts = tl.where(bins < E, counts, 0)
        blocks = (counts + BM - 1) // BM
        block_start = tl.cumsum(blocks, 0) - blocks
        for b0 in range(0, NUM_BLOCKS, E_PAD):
            b = b0 + bins
            tl.store(block_expert_ptr + b, tl.full((E_PAD,), -1, tl.int32), mask=b < NUM_BLOCKS)
        tl.debug_barrier()  # the -1 fill lands before the real entries below
        last_rows = counts - (blocks - 1) * BM  # rows of each expert's last block
        to_tail = (blocks > 0) & (last_rows <= TAIL)
        for j in range(0, tl.max(blocks, 0)):
            used = (j < blocks) & ~(to_tail & (j == blocks - 1))
            r0 = row_start + j * BM
            tl.store(block_expert_ptr + block_start + j, bins, mask=used)
            tl.store(block_row_start_ptr + block_start + j, r0, mask=used)
            tl.store(block_row_end_ptr + block_start + j, tl.minimum(r0 + BM, row_start + counts), mask=used)
        if TAIL > 0:
            r0 = row_start + (blocks - 1) * BM
            mine = bins < E
            tl.store(tail_expert_ptr + bins, tl.where(to_tail, bins, -1), mask=mine)
            tl.store(tail_row_start_ptr + bins, r0, mask=mine)
            tl.store(tail_row_end_ptr + bins, row_start + counts, mask=mine)

@triton.jit
def _sum_topk_kernel(y_ptr, ids_ptr, out_ptr, H, E, TOPK: tl.constexpr, BH: tl.constexpr, PDL: tl.constexpr = False,
                     down_bias_ptr=None, topk_w_ptr=None, HAS_BIAS: tl.constexpr = False):
    """``out[t] = sum_j y[t k + j]`` over the token's valid slots; HAS_BIAS (gpt-oss's down-projection
    bias ``down_bias [E, H]`` float32): ``+ w[t, j] * down_bias[e_j]`` each."""
    _await_previous_kernel(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    col_mask = cols < H
    acc = tl.zeros((BH,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        e = tl.load(ids_ptr + t * TOPK + j) + tl.zeros((BH,), dtype=tl.int32)
        valid = col_mask & (e >= 0) & (e < E)  # unused slots were never written
        acc += tl.load(y_ptr + (t * TOPK + j) * H + cols, mask=valid, other=0.0)
        if HAS_BIAS:
            w = tl.load(topk_w_ptr + t * TOPK + j)
            acc += w * tl.load(down_bias_ptr + e.to(tl.int64) * H + cols, mask=valid, other=0.0)
    tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=col_mask)


# --- NVFP4 linear layers (fp4moe::nvfp4_linear) ------------------------------------------------

@triton.jit(do_not_specialize=["T", "K_PART"])
def _linear_kernel(x_ptr, w_ptr, s_ptr, g_ptr, bias_ptr, out_ptr, parts_ptr, count_ptr, T, N, K, K_PART, w_desc,
                   s_desc, x_desc, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FAST_DECODE: tl.constexpr,
                   INTERPRET: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, SERIAL: tl.constexpr,
                   X_TMA: tl.constexpr, PAIRED: tl.constexpr = False):
    """Per (N tile, M block, K part) program: ``W[cols, part] @ x[rows, part]^T`` (the weight tile on
    the MMA's M side, as in the experts' decode) times the global scale, + bias, stored in x's
    dtype into ``out [T, N]``. Split K (several parts, to fill the GPU when N / BN is small): each
    part stores float32 partial sums into ``parts [PARTS, T, N]`` (a part past K stores zeros);
    SERIAL: the last part of a tile to arrive (``count [tiles]`` int32, zero between calls: that
    program sets it back) sums all parts in part order and stores ``out``, in this launch; else
    :func:`_linear_parts_kernel` does, in a second one. The same float32 additions in the same order
    either way. ``x [T, K]`` is in natural order (read in fragment order, or with X_TMA through
    TMA and permuted in registers); weights and scales come through TMA, the weights as stored
    (``[N, K/2]`` bytes) or PAIRED (``[N/2, K/4]`` words of :func:`.layout.paired_weight_layout`)."""
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    rows = tl.program_id(1) * BM + tl.arange(0, BM)
    row_mask = rows < T
    part = tl.program_id(2)
    k_lo = part * K_PART
    acc = _expert_matmul(tl.zeros((BN, BM), dtype=tl.float32), w_ptr, s_ptr, cols, x_ptr, rows.to(tl.int64),
                         row_mask, K, BN, BK, False, FAST_DECODE, INTERPRET, w_desc, s_desc, tl.program_id(0) * BN,
                         True, True, PAIRED, True, k_lo, tl.minimum(k_lo + K_PART, K), True,
                         x_desc, tl.program_id(1) * BM, X_TMA, BM)
    g = tl.load(g_ptr)
    if x_ptr.dtype.element_ty == tl.bfloat16:
        g = g * 4194304.0  # the decoded tiles' 2^-22
    y = acc * g
    offs = rows[None, :].to(tl.int64) * N + cols[:, None]
    if not SPLIT:
        _linear_store(y, bias_ptr, out_ptr, cols, offs, row_mask, HAS_BIAS)
    else:
        tl.store(parts_ptr + part.to(tl.int64) * T * N + offs, y, mask=row_mask[None, :])
        if SERIAL:
            tl.debug_barrier()  # all of this program's partial sums are stored before it counts itself
            tile = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
            arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == tl.num_programs(2) - 1:
                total = tl.zeros((BN, BM), dtype=tl.float32)
                for p in range(0, tl.num_programs(2)):
                    total += tl.load(parts_ptr + (p * T).to(tl.int64) * N + offs, mask=row_mask[None, :], other=0.0,
                                     cache_modifier=".cg")  # from L2, where the other programs' stores are
                _linear_store(total, bias_ptr, out_ptr, cols, offs, row_mask, HAS_BIAS)
                tl.atomic_xchg(count_ptr + tile, 0)  # ready for the next call (and a graph's next replay)

@triton.jit
def _linear_store(y, bias_ptr, out_ptr, cols, offs, row_mask, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols).to(tl.float32)[:, None]
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=row_mask[None, :])

@triton.jit(do_not_specialize=["NUMEL", "PARTS"])
def _linear_parts_kernel(parts_ptr, bias_ptr, out_ptr, NUMEL, N, PARTS, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """``out = sum of the PARTS float32 partial sums (+ bias)``, in out's dtype; a fixed order, no atomics."""
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < NUMEL
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for p in range(PARTS):
        acc += tl.load(parts_ptr + p * NUMEL + idx, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + idx % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + idx, acc.to(out_ptr.dtype.element_ty), mask=mask)

@triton.jit
def _dequant_kernel(w_ptr, s_ptr, g_ptr, out_ptr, K, w_desc, BN: tl.constexpr, BK: tl.constexpr,
                    FAST_DECODE: tl.constexpr, PAIRED: tl.constexpr = False):
    """``out [N, K]`` (16-bit) = e2m1 * block scale * global scale, the product in float32 rounded
    once: bitwise what :func:`fp4moe_ops.nvfp4.dequantize_nvfp4` gives (the exact decoded tile times
    ``2^22 g`` is the same float32 product). For prefill, where cuBLAS then does the GEMM. The
    weights as stored, or PAIRED (``w_desc``: a TMA descriptor over their bytes ``[N/2, K]``)."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    k0 = tl.program_id(1) * BK
    ks = tl.arange(0, BK // 16)
    sbytes = tl.load(s_ptr + rows[:, None].to(tl.int64) * (K // 16) + k0 // 16 + ks[None, :])
    dtype = out_ptr.dtype.element_ty
    if PAIRED:  # (the portable decode: the PTX one assumes the register order a dot operand gets)
        packed = w_desc.load([tl.program_id(0) * (BN // 2), k0])
        w = _decode_tile_fragment_order(packed, sbytes, BN, BK, dtype, False, True, NATURAL_K=True)
    else:
        kb = tl.arange(0, BK // 2)
        packed = tl.load(w_ptr + rows[:, None].to(tl.int64) * (K // 2) + k0 // 2 + kb[None, :])
        w = _decode_tile(packed, sbytes, BN, BK, dtype, FAST_DECODE)
    w = w.to(tl.float32)
    g = tl.load(g_ptr)
    if dtype == tl.bfloat16:
        g = g * 4194304.0
    kk = k0 + tl.arange(0, BK)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * K + kk[None, :], (w * g).to(dtype))
