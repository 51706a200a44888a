"""The decode-sized expert GEMMs on ``mma.sync``, weights and scales through a TMA ring.

Why: at decode sizes (up to 4 rows per expert) the layer is a stream of FP4 weights, and the wgmma
kernels (kernels.py) issue ~3.5 instructions per weight element there (454 per K step of 128
elements and thread, sm90 SASS), of which the decode is ~1.65; the rest is wgmma's descriptors,
fences and waits. ``mma.sync m16n8k16`` takes both operands from registers: one instruction per
16-wide chunk (the down GEMM's loop: 287-323 instructions per step; the gate_up GEMM's: ~350). Plain global loads of
the weights saturated the L1/TEX pipe (an earlier decode kernel; benchmarks/NOTES.md), and
per-thread scale loads bound the first version of these kernels; here both
come through TMA into a shared-memory ring, and each thread reads its weight words with one
128-bit shared load per 32 elements.

Layout: a program computes ``[64 weight rows, BM tokens]`` of one row block with 4 warps that
split K: step ``s`` covers natural K ``[256 s, 256 s + 256)``, warp ``w`` its chunk ``4 s + w``
(64 elements). Each warp holds all 64 rows (4 m16 tiles), so its activation fragments serve four
MMAs, and the four partial sums are added through shared memory at the end. Thread ``t = lane %
4`` of a pair row decodes words ``4t .. 4t+3`` of a chunk (K ``16t .. 16t+15`` of the chunk, one
scale block per row), exactly its A registers of the chunk's four 16-wide MMAs. Its B registers
are then K ``16t .. 16t+15`` of its token in the order ``16t + 4j + 2e + s`` (MMA j, register half
e, s = 0 for the first register): the gate_up GEMM stores ``h`` with bits 0 and 1 of K swapped, so they are
one contiguous 32-byte run for the down GEMM, and reads ``x`` in natural order (two ``prmt`` per pair).

The TMA boxes read the op's own tensors (paired weights ``[E, N/2, K/4]`` int32 viewed by 64-wide K
chunk, scales ``[E, N, K/16]``; layout.py), no copies: a chunk's 64 bytes of a pair row, and a step's four scale words
of a row (chunks ``4 s .. 4 s + 3``, 16 contiguous bytes), so a warp's eight scale rows in shared
memory are 16 bytes apart (no bank conflicts). gpt-oss's E8M0 scales held once per 32 values
(``SCALE_BLOCK`` 32, :func:`.layout.values_per_scale`) are 8 bytes a row per step, held in row
pairs (:func:`.layout.pair_scale_rows`): a step's box is 32 pairs of 16 bytes, i.e. 64 rows of
four int16 (a warp's chunk two bytes, thread ``t`` using byte ``t // 2``), read as the words are.

The same GEMM serves one NVFP4 linear (``fp4moe::nvfp4_linear`` on paired weights,
:func:`linear_v3`): one expert, the tokens in natural order, K split into parts summed by the last
to finish.

Compute capability 9.x and the Triton releases of :data:`.launch.GLUON_TRITON` only (checked by the
caller); sizes: H and I multiples of 64 (gpt-oss's 2880: the last step partial, its chunks past K
read as zeros through TMA, the activations there masked), scale rows in whole 256-value steps
(:func:`.layout.scale_columns`; with a scale per 32 values, in row pairs).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from .compile_ahead import launch_or_compile
from .descriptors import view_descriptor
from .gluon_api import reinterpret, thread_barrier, tma_load
from .prefill_rs import _SPLIT_HALVES, _WORD_TO_BF16

# Two E4M3 scale bytes (byte t of $2 for row r, of $3 for row r + 8, picked by the selector $4 =
# t | t << 4 | (4 + t) << 8 | (4 + t) << 12: one selector nibble per output byte) -> bf16x2 ``(S_r, S_r)`` and ``(S_r8, S_r8)``,
# S = scale * 2^104 (as prefill_rs._E4M3_TO_BF16X2, both rows in one pass). The four threads of a
# quad load the same aligned word (the scales of their four blocks).
_E4M3X2_TO_BF16X2 = gl.constexpr("""
{
.reg .b32 t, c;
mov.b32 c, 0x77807780;
prmt.b32 t, $2, $3, $4;
and.b32 t, t, 0x007F007F; shl.b32 t, t, 4;
mul.rn.bf16x2 t, t, c; mul.rn.bf16x2 t, t, c;
prmt.b32 $0, t, 0, 0x1010;
prmt.b32 $1, t, 0, 0x3232;
}
""")
# The same for E8M0 scale bytes (MXFP4; as kernels._E8M0X4_TO_BF16): byte + 104 in bf16's exponent
# field is ``scale * 2^104`` (exact up to 2^23).
_E8M0X2_TO_BF16X2 = gl.constexpr("""
{
.reg .b32 t;
prmt.b32 t, $2, $3, $4;
and.b32 t, t, 0x00FF00FF; add.u32 t, t, 0x00680068; shl.b32 t, t, 7;
prmt.b32 $0, t, 0, 0x1010;
prmt.b32 $1, t, 0, 0x3232;
}
""")


@gluon.jit
def _words_ref(la: gl.constexpr):
    """A ``[4 warps, 32 pair rows, 4 (t), 4 (j)]`` int32 zero tensor whose layout gives each thread
    the words of its A fragments of a ``[4, 64, 64]`` step (row ``16m + 8rs + g``, column
    ``16j + 8s + 2t + e``; pair row ``8m + g``)."""
    ref = gl.zeros([4, 64, 64], gl.bfloat16, la)
    ref = gl.reshape(ref, [4, 4, 2, 8, 4, 2, 4, 2])  # w, m, rs, g, j, s, t, e
    ref = gl.permute(ref, [0, 1, 3, 6, 4, 2, 5, 7])  # w, m, g, t, j, rs, s, e
    ref = gl.reshape(ref, [4, 32, 4, 4, 8])
    return gl.max(ref.to(gl.int32), axis=4)


@gluon.jit
def _act_ref(lb: gl.constexpr, BM: gl.constexpr):
    """A ``[4, BM, 32]`` int32 zero tensor (warp, token, word ``8t + 2j + s`` of the step: positions
    ``16t + 4j + 2s + e``) whose layout is the B operand's: a thread's 8 words of a token are contiguous."""
    ref = gl.zeros([4, 64, BM], gl.bfloat16, lb)
    ref = gl.reshape(ref, [4, 4, 2, 4, 2, BM])  # w, j, s, t, e, n
    ref = gl.permute(ref, [0, 5, 3, 1, 2, 4])  # w, n, t, j, s, e
    ref = gl.reshape(ref, [4, BM, 32, 2])
    return gl.max(ref.to(gl.int32), axis=3)  # [4, BM, 32] int32 words


@gluon.jit
def _decode(words, sc_r, sc_r8):
    """``words [4, 32, 4, 4]`` and bf16x2 scales ``[4, 32, 4, 1]`` -> A ``[4, 64, 64]`` bf16."""
    o0, o1, o2, o3 = gl.inline_asm_elementwise(
        _WORD_TO_BF16, "=r,=r,=r,=r,r,r,r", [words, sc_r, sc_r8],
        dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1)
    v = gl.join(gl.join(o0, o1), gl.join(o2, o3))  # [w, p, t, j, rs, s]
    lo, hi = gl.inline_asm_elementwise(_SPLIT_HALVES, "=h,=h,r", [v], dtype=(gl.bfloat16, gl.bfloat16),
                                       is_pure=True, pack=1)
    a = gl.join(lo, hi)  # [w, p, t, j, rs, s, e]
    a = gl.reshape(a, [4, 4, 8, 4, 4, 2, 2, 2])  # w, m, g, t, j, rs, s, e
    a = gl.permute(a, [0, 1, 5, 2, 4, 6, 3, 7])  # w, m, rs, g, j, s, t, e
    return gl.reshape(a, [4, 64, 64])


# Two words of natural-order activations (k, k+1), (k+2, k+3) -> the B registers (k, k+2), (k+1, k+3)
_NATURAL_TO_B = gl.constexpr("prmt.b32 $0, $2, $3, 0x5410; prmt.b32 $1, $2, $3, 0x7632;")


@gluon.jit
def _step(acc, words, ra, rb, sel, x, WL: gl.constexpr, la: gl.constexpr, lb: gl.constexpr, BM: gl.constexpr,
          NATURAL_B: gl.constexpr = False, E8M0: gl.constexpr = False):
    """One K step: decode ``words`` ([4, 32, 16] int32) with the raw scale words ``ra``, ``rb``
    (E4M3, or with E8M0 MXFP4's power-of-two scales),
    the MMA with the activation words ``x`` ([4, BM, 32]; with NATURAL_B in natural K order,
    else with K's bits 0 and 1 swapped)."""
    if NATURAL_B:
        xa, xc = gl.split(gl.reshape(x, [4, BM, 16, 2]))
        x0, x1 = gl.inline_asm_elementwise(_NATURAL_TO_B, "=r,=r,r,r", [xa, xc], dtype=(gl.int32, gl.int32),
                                           is_pure=True, pack=1)
        x = gl.reshape(gl.join(x0, x1), [4, BM, 32])
    words = gl.convert_layout(gl.reshape(words, [4, 32, 4, 4]), WL, assert_trivial=True)
    sc_r, sc_r8 = gl.inline_asm_elementwise(_E8M0X2_TO_BF16X2 if E8M0 else _E4M3X2_TO_BF16X2, "=r,=r,r,r,r",
                                            [ra, rb, sel],
                                            dtype=(gl.int32, gl.int32), is_pure=True, pack=1)
    a = _decode(words, gl.expand_dims(sc_r, 3), gl.expand_dims(sc_r8, 3))
    a = gl.convert_layout(a, la, assert_trivial=True)
    xlo, xhi = gl.inline_asm_elementwise(_SPLIT_HALVES, "=h,=h,r", [x], dtype=(gl.bfloat16, gl.bfloat16),
                                         is_pure=True, pack=1)
    xb = gl.reshape(gl.join(xlo, xhi), [4, BM, 4, 4, 2, 2])  # w, n, t, j, s, e
    xb = gl.reshape(gl.permute(xb, [0, 3, 4, 2, 5, 1]), [4, 64, BM])  # column 16j + 8s + 2t + e
    xb = gl.convert_layout(xb, lb, assert_trivial=True)
    return mma_v2(a, xb, acc)


@gluon.jit
def _slot_scales(step, SL: gl.constexpr):
    """One step's scale words in the ring (``[64 rows, 4 warps]`` int32: word (r, w) holds row r's
    four blocks of warp w's chunk) -> the words of rows r and r + 8, ``[4, 32, 1]`` each in
    ``SL``'s slice (warp, pair row ``8m + g``; the four threads t of a quad read the same word).
    Row ``16m + 8rs + g`` of a warp's load is 16 bytes from the next g: no bank conflicts."""
    RL: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[8, 0], [16, 0], [32, 0]], lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[0, 1], [0, 2]], block_bases=[], shape=[64, 4])
    v = step.load(RL).to(gl.int32)  # [64 rows, 4 warps] (E8M0 per 32 values: int16, its upper bytes never picked)
    v = gl.permute(gl.reshape(v, [4, 2, 8, 4]), [3, 0, 2, 1])  # w, m, g, rs
    r_lo, r_hi = gl.split(gl.reshape(v, [4, 32, 2]))
    PL: gl.constexpr = gl.SliceLayout(2, SL)
    r_lo = gl.convert_layout(r_lo, PL, assert_trivial=True)
    r_hi = gl.convert_layout(r_hi, PL, assert_trivial=True)
    return gl.expand_dims(r_lo, 2), gl.expand_dims(r_hi, 2)


# Both kernels' MMA: mma.sync m16n8k16 over [4 warps, 64 weight rows, BM tokens], and its operands
_MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1, 1], instr_shape=[1, 16, 8]))
_LA = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_MMA, k_width=2))
_LB = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=_MMA, k_width=2))


@gluon.jit
def _global_scale(g_ptr, e, E8M0: gl.constexpr):
    """Expert ``e``'s global scale times 2^22 (the decoded tiles' 2^-22): ``g[e]``, or 1 for MXFP4."""
    if E8M0:
        return 4194304.0
    return gl.load(g_ptr + e) * 4194304.0


@gluon.jit
def _block_expert(block_expert_ptr, b, SLOT_BLOCKS: gl.constexpr, E: gl.constexpr):
    """Row block ``b``'s expert, -1 for none (a one-token call's block: its slot's id, any integer
    type, checked against E)."""
    e = gl.load(block_expert_ptr + b)
    if SLOT_BLOCKS:
        e = gl.where((e >= 0) & (e < E), e, -1).to(gl.int32)
    return e


@gluon.jit
def _rows_in(b, rows, r0, r1, sorted_slot_ptr, SLOT_BLOCKS: gl.constexpr):
    """The slots of row block ``b`` (rows ``[r0, r1)`` of ``sorted_slot``; with SLOT_BLOCKS the
    block is slot ``b``) at ``rows`` (an arange over its BM rows), int64, and which are real."""
    if SLOT_BLOCKS:
        valid = rows == 0
        slots = (b + rows * 0).to(gl.int64)
    else:
        valid = r0 + rows < r1
        slots = gl.load(sorted_slot_ptr + r0 + rows, mask=valid, other=0).to(gl.int64)
    return slots, valid


@gluon.jit
def _block_rows(b, rows, sorted_slot_ptr, row_start_ptr, row_end_ptr, SLOT_BLOCKS: gl.constexpr):
    """:func:`_rows_in` with the block's bounds loaded (returned too, for the epilogue)."""
    if SLOT_BLOCKS:
        r0 = b * 0
        r1 = r0 + 1
    else:
        r0 = gl.load(row_start_ptr + b)
        r1 = gl.load(row_end_ptr + b)
    slots, valid = _rows_in(b, rows, r0, r1, sorted_slot_ptr, SLOT_BLOCKS)
    return slots, valid, r0, r1


@gluon.jit
def _scale_selector(SL: gl.constexpr, SCALE_BLOCK: gl.constexpr = 16):
    """``[4, 32, 4]`` int32 in ``SL``: each thread's ``prmt`` selector of its scale bytes (block t of
    rows r and r + 8, one selector nibble per output byte; a scale per 32 values: block t // 2)."""
    ti = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, SL)))
    if SCALE_BLOCK == 32:
        ti = ti >> 1
    sel = gl.expand_dims(gl.expand_dims(ti | (ti << 4) | ((ti + 4) << 8) | ((ti + 4) << 12), 0), 1)
    return sel + gl.zeros([4, 32, 4], gl.int32, SL)


@gluon.jit
def _act_load(a_words, a_off, a_mask, step, BM: gl.constexpr, K_EDGE: gl.constexpr):
    """Step ``step``'s activation words (``a_off``: step 0's, 128 words a step) where ``a_mask``; with
    ``K_EDGE`` (K, when its last step is partial) only the warps' chunks below K."""
    if K_EDGE > 0:
        BL: gl.constexpr = _act_ref(_LB, BM).type.layout
        bw = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, BL)))
        kw = gl.expand_dims(gl.expand_dims(bw * 64, 1), 2)  # [4, 1, 1]: warp w's chunk, K 64 w ..
        return gl.load(a_words + a_off + step * 128, mask=a_mask & (kw + step * 256 < K_EDGE), other=0)
    return gl.load(a_words + a_off + step * 128, mask=a_mask, other=0)


@gluon.jit
def _scale_copy(s_desc, row0, slot, SPS: gl.constexpr, bar, dst, SCALE_BLOCK: gl.constexpr):
    """The TMA copy of ring slot ``slot``'s scales of rows ``row0 ..``: its SPS steps' words (a scale
    per 32 values: their row pairs, :func:`pair_scale_view`)."""
    if SCALE_BLOCK == 32:
        tma_load(s_desc, [SPS * slot, row0 // 2, 0], bar, dst)
    else:
        tma_load(s_desc, [0, slot, row0, 0], bar, dst)


@gluon.jit
def _ring_gemm(w_desc, s_desc, a_words, a_off, a_mask, pair0, row0, slot0, NSLOTS: gl.constexpr, BM: gl.constexpr,
               STAGES: gl.constexpr, SPS: gl.constexpr, NATURAL_B: gl.constexpr = False, E8M0: gl.constexpr = False,
               K_EDGE: gl.constexpr = 0, SCALE_BLOCK: gl.constexpr = 16):
    """``[4 warps, 64 weight rows, BM tokens]`` float32 partial sums over ring slots ``slot0 ..
    slot0 + NSLOTS`` (SPS 256-wide steps each; each warp its chunk of a step) of one 64-row weight
    tile: weights and scales through the TMA ring (:func:`weight_view` / :func:`scale_view`
    descriptors at pair row ``pair0``, row ``row0``), activation words ``a_words + a_off`` (``[4,
    BM, 32]`` in :func:`_act_ref`'s layout; 128 words a step) where ``a_mask``. ``K_EDGE``: K when
    the last step is partial (gpt-oss's 2880): TMA fills the weights past K with zeros (the scales
    are held in whole TMA rows, zeros past K) and the activations there are not read, so zeros meet zeros.
    SCALE_BLOCK 32: ``s_desc`` over :func:`pair_scale_view` (box ``[SPS, 32, 8]``: the slot's steps
    of 32 row pairs), read as ``[64 rows, 4]`` int16 a step."""
    NSTEPS: gl.constexpr = NSLOTS * SPS
    mma: gl.constexpr = _MMA
    la: gl.constexpr = _LA
    lb: gl.constexpr = _LB
    wref = _words_ref(la)
    WL: gl.constexpr = wref.type.layout
    WL16: gl.constexpr = gl.reshape(wref, [4, 32, 16]).type.layout
    SL: gl.constexpr = gl.SliceLayout(3, WL)

    # the ring: per slot SPS steps x [4 warps' chunks, 32 pair rows, 64 bytes] and their
    # scale words [64 rows, 4 warps]
    w_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, 4 * SPS, 32, 64], w_desc.layout)
    if SCALE_BLOCK == 32:
        s_smem = gl.allocate_shared_memory(gl.int16, [STAGES, SPS, 32, 8], s_desc.layout)
    else:
        s_smem = gl.allocate_shared_memory(gl.int32, [STAGES, SPS, 1, 64, 4], s_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for q in gl.static_range(STAGES):
        mbarrier.init(ready.index(q), count=1)
    SLOT_BYTES: gl.constexpr = w_desc.block_type.nbytes + s_desc.block_type.nbytes
    for q in gl.static_range(STAGES):
        if q < NSLOTS:
            mbarrier.expect(ready.index(q), SLOT_BYTES)
            _scale_copy(s_desc, row0, slot0 + q, SPS, ready.index(q), s_smem.index(q), SCALE_BLOCK)
            tma_load(w_desc, [4 * SPS * (slot0 + q), pair0, 0], ready.index(q), w_smem.index(q))
    words_smem = reinterpret(w_smem, gl.int32, [STAGES * SPS, 4, 32, 16], gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
    if SCALE_BLOCK == 32:  # a step's 32 pairs of 16 bytes as 64 rows of 8
        s_steps = reinterpret(s_smem, gl.int16, [STAGES * SPS, 64, 4], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    else:
        s_steps = reinterpret(s_smem, gl.int32, [STAGES * SPS, 64, 4], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))

    sel = _scale_selector(SL, SCALE_BLOCK)
    a_cur = _act_load(a_words, a_off, a_mask, 0, BM, K_EDGE)
    acc = gl.zeros([4, 64, BM], gl.float32, mma)
    for i in range(NSLOTS):
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        words0 = words_smem.index(SPS * s).load(WL16)
        ra, rb = _slot_scales(s_steps.index(SPS * s), SL)
        if SPS == 2:
            words1 = words_smem.index(SPS * s + 1).load(WL16)
            na, nb = _slot_scales(s_steps.index(SPS * s + 1), SL)
        thread_barrier()  # every warp has its words and scales of slot s: refill it
        if i + STAGES < NSLOTS:
            mbarrier.expect(ready.index(s), SLOT_BYTES)
            _scale_copy(s_desc, row0, slot0 + i + STAGES, SPS, ready.index(s), s_smem.index(s), SCALE_BLOCK)
            tma_load(w_desc, [4 * SPS * (slot0 + i + STAGES), pair0, 0], ready.index(s), w_smem.index(s))
        # the next step's activations, issued after the copy (its proxy fence waits for the
        # thread's outstanding memory operations)
        a_nxt = _act_load(a_words, a_off, a_mask, gl.minimum(SPS * i + 1, NSTEPS - 1), BM, K_EDGE)
        acc = _step(acc, words0, ra, rb, sel, a_cur, WL, la, lb, BM, NATURAL_B=NATURAL_B, E8M0=E8M0)
        if SPS == 2:
            a_cur = _act_load(a_words, a_off, a_mask, gl.minimum(SPS * i + 2, NSTEPS - 1), BM, K_EDGE)
            acc = _step(acc, words1, na, nb, sel, a_nxt, WL, la, lb, BM, NATURAL_B=NATURAL_B, E8M0=E8M0)
        else:
            a_cur = a_nxt
    return acc


@gluon.jit
def _warp_sum(acc, BM: gl.constexpr):
    """The four warps' partial sums ``[4, 64, BM]`` added through shared memory -> ``[64, BM]``:
    each warp stores its partial sums, each thread then adds the four partials of its outputs (a
    generic reduction over the warp axis also shuffled within warps, with bank conflicts: 202 us
    instead of 152 on the down GEMM)."""
    red = gl.allocate_shared_memory(gl.float32, [4, 64, BM], gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
    red.store(acc)
    thread_barrier()
    RL: gl.constexpr = gl.BlockedLayout([4, 1, 4], [1, 32 // (BM // 4), BM // 4], [1, 4, 1], [2, 1, 0])
    return gl.sum(red.load(RL), axis=0)


@gluon.jit
def _act_offsets(rows, row_words, BM: gl.constexpr):
    """Activation word offsets ``[4, BM, 32]`` in :func:`_act_ref`'s layout of step 0: ``rows``
    (``[BM]`` int64 in its slice) times ``row_words`` plus warp w's chunk (32 words) and the word."""
    BL: gl.constexpr = _act_ref(_LB, BM).type.layout
    bw = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, BL)))
    bq = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, BL)))
    return (gl.expand_dims(gl.expand_dims(rows * row_words, 0), 2) + gl.expand_dims(gl.expand_dims(bw * 32, 1), 2)
            + gl.expand_dims(gl.expand_dims(bq, 0), 1))


@gluon.jit
def _act_mask(valid, BM: gl.constexpr):
    """``valid [BM]`` (rows that are real) broadcast to the ``[4, BM, 32]`` activation words."""
    BL: gl.constexpr = _act_ref(_LB, BM).type.layout
    bq = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, BL)))
    return gl.expand_dims(gl.expand_dims(valid, 0), 2) & gl.expand_dims(gl.expand_dims(bq >= 0, 0), 1)


@gluon.jit
def _act_rows(BM: gl.constexpr):
    """``arange(BM)`` in the activation words' token slice."""
    BL: gl.constexpr = _act_ref(_LB, BM).type.layout
    return gl.arange(0, BM, layout=gl.SliceLayout(0, gl.SliceLayout(2, BL)))


@gluon.jit
def _down_v3_kernel(h_ptr, w_desc, s_desc, g_ptr, topk_w_ptr, y_ptr, sorted_slot_ptr, block_expert_ptr,
                     row_start_ptr, row_end_ptr, H: gl.constexpr, I: gl.constexpr, BM: gl.constexpr,
                     SLOT_BLOCKS: gl.constexpr, E: gl.constexpr, STAGES: gl.constexpr, SPS: gl.constexpr,
                     E8M0: gl.constexpr = False, SCALE_BLOCK: gl.constexpr = 16):
    """Program (row block ``b``, weight tile ``n``): ``y[slot, 64 n ..] = route * g * down[e] @ h[slot]``
    (E8M0: MXFP4 scales, no global scale; SCALE_BLOCK 32: one per 32 values, ``s_desc`` over
    :func:`pair_scale_view` with box ``[SPS, 32, 8]``).
    ``w_desc``, ``s_desc``: TMA descriptors of :func:`weight_view` (box ``[4 SPS, 32, 64]``: SPS
    steps of down per ring slot) and :func:`scale_view` (box ``[SPS, 1, 64, 4]``: their scale words);
    ``h [S, I]`` bf16 with K's bits 0, 1 swapped; ``y [S, H]`` float32. I a multiple of 64, the last
    step partial where it is not one of 256 SPS."""
    b = gl.program_id(0)
    n = gl.program_id(1)
    e = _block_expert(block_expert_ptr, b, SLOT_BLOCKS, E)
    if e >= 0:
        # the block's slots and their activation words of step 0
        slots_b, valid_b, r0, r1 = _block_rows(b, _act_rows(BM), sorted_slot_ptr, row_start_ptr, row_end_ptr,
                                               SLOT_BLOCKS)
        h_words = h_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
        acc = _ring_gemm(w_desc, s_desc, h_words, _act_offsets(slots_b, I // 2, BM), _act_mask(valid_b, BM),
                         e * (H // 2) + n * 32, e * H + n * 64, 0, (I + 256 * SPS - 1) // (256 * SPS), BM, STAGES, SPS,
                         E8M0=E8M0, K_EDGE=I if I % (256 * SPS) else 0, SCALE_BLOCK=SCALE_BLOCK)
        y = _warp_sum(acc, BM)
        YL: gl.constexpr = y.type.layout
        g = _global_scale(g_ptr, e, E8M0)
        mo = gl.arange(0, BM, layout=gl.SliceLayout(0, YL))
        rr = gl.arange(0, 64, layout=gl.SliceLayout(1, YL))
        slots, valid = _rows_in(b, mo, r0, r1, sorted_slot_ptr, SLOT_BLOCKS)
        route = gl.load(topk_w_ptr + slots, mask=valid, other=0.0)
        y = y * g * gl.expand_dims(route, 0)
        y_off = gl.expand_dims(slots * H, 0) + gl.expand_dims(n * 64 + rr, 1)
        gl.store(y_ptr + y_off, y, mask=gl.expand_dims(valid, 0) & gl.expand_dims(rr >= 0, 1))


def weight_view(down: torch.Tensor, sps: int) -> torch.Tensor:
    """down's paired words ``[E, H/2, I/4]`` int32 as bytes ``[E H/2 pair rows, I]``, viewed ``[I/64
    (K chunk), E H/2, 64]``: entry ``[c, p]`` is pair row ``p``'s K chunk ``c`` (64 elements of both
    its rows). A ring slot's box ``[4 SPS, 32, 64]`` holds chunks ``4 SPS q ..`` (step ``SPS q + j``,
    warp ``w``: chunk ``4 (SPS q + j) + w``); a K edge is a dimension edge, past which TMA reads zeros.
    ``sps`` is the box's business only (kept for the callers)."""
    num_experts, half_h, quarter_i = down.shape
    inter = 4 * quarter_i
    return down.view(torch.uint8).reshape(num_experts * half_h, inter // 64, 64).permute(1, 0, 2)


def pair_scale_view(scale: torch.Tensor) -> torch.Tensor:
    """Block scales held one per 32 values in row pairs (gpt-oss's E8M0, ``[E, N, Is]`` bytes,
    :func:`.layout.pair_scale_rows`) as int16 ``[Is/8 (step), E N/2 (pair), 8]``: entry ``[s, p, 4 r +
    w]`` is row ``2p + r``'s two bytes of K chunk ``4 s + w`` (step s, warp w)."""
    num_experts, rows, blocks = scale.shape
    return scale.view(torch.int16).reshape(num_experts * rows // 2, blocks // 8, 8).permute(1, 0, 2)


def scale_view(down_scale: torch.Tensor, sps: int) -> torch.Tensor:
    """down's block scales ``[E, H, Is]`` (Is: whole 256-value steps, :func:`.layout.scale_columns`) as
    int32 words ``[E H, Is/4]`` (word ``c``: the four blocks of K chunk ``c``), viewed ``[SPS, Is/(4 SPS)
    (slot), E H, 4 (warp)]``: entry ``[j, q, r, w]`` is row ``r``'s word of chunk ``4 (SPS q + j) + w``."""
    num_experts, hidden, blocks = down_scale.shape
    words = down_scale.view(torch.uint8).view(torch.int32)
    return words.reshape(num_experts * hidden, blocks // (16 * sps), sps, 4).permute(2, 1, 0, 3)


def down_v3(h, down, down_scale, down_global_scale, topk_weights, y, sorted_slot, block_expert, row_start, row_end,
            hidden, inter, bm, slot_blocks, num_experts, stages=2, sps=2, scale_block=16):
    """``y = route * down @ h`` per slot (:func:`_down_v3_kernel`) over the routed row blocks (one
    per slot with ``slot_blocks``, ``bm`` 8). ``scale_block``: values per scale byte (32: gpt-oss's
    E8M0 held once per block, :func:`.layout.values_per_scale`)."""
    step_bytes = 256 // scale_block
    if inter % 64 or hidden % 64 or down_scale.shape[-1] % (step_bytes * sps):
        raise ValueError(f"decode_v3: I and H must be multiples of 64 and the scale rows of {sps} steps, got {inter}, "
                         f"{hidden}, {down_scale.shape[-1]}")
    scales = view_descriptor(pair_scale_view, down_scale, [sps, 32, 8]) if scale_block == 32 else \
        view_descriptor(scale_view, down_scale, [sps, 1, 64, 4], sps)
    launch_or_compile(_down_v3_kernel, (block_expert.numel(), hidden // 64), h,
                      view_descriptor(weight_view, down, [4 * sps, 32, 64], sps), scales, down_global_scale, topk_weights,
                      y, sorted_slot, block_expert, row_start, row_end,
                      H=hidden, I=inter, BM=bm, SLOT_BLOCKS=slot_blocks, E=num_experts, STAGES=stages, SPS=sps,
                      E8M0=down_scale.dtype == torch.int8, SCALE_BLOCK=scale_block, num_warps=4)


@gluon.jit
def _gate_up_v3_kernel(x_ptr, w_desc, s_desc, g_ptr, h_ptr, sorted_slot_ptr, block_expert_ptr, row_start_ptr,
                     row_end_ptr, H: gl.constexpr, I: gl.constexpr, TOPK: gl.constexpr, BM: gl.constexpr,
                     SLOT_BLOCKS: gl.constexpr, E: gl.constexpr, STAGES: gl.constexpr, E8M0: gl.constexpr = False,
                     gate_up_bias_ptr=None, swiglu_alpha=1.0, limit=1.0, GPT_OSS: gl.constexpr = False,
                     SCALE_BLOCK: gl.constexpr = 16):
    """Program (row block ``b``, tile ``n``): ``h[slot, i] = silu(gate_i . x) * (up_i . x)`` (GPT_OSS:
    gpt-oss's clamped SwiGLU with the biases ``gate_up_bias [E, 2I]``; E8M0: MXFP4 scales) for
    ``i = 32 n ..`` (rows 0-31 of the tile gate rows, 32-63 the same up rows), stored with K's
    bits 0, 1 swapped for :func:`_down_v3_kernel`. ``w_desc``, ``s_desc``:
    TMA descriptors of :func:`gate_up_views` (boxes ``[4, 2, 16, 64]`` and ``[1, 2, 1, 32, 4]``:
    one step per ring slot); ``x [T, H]`` bf16 in natural order (token = slot // TOPK). H a multiple
    of 64: a partial last step reads zeros from TMA past H, and x's words there not at all.
    SCALE_BLOCK 32 (gpt-oss's E8M0 held once per 32 values, rows in pairs): ``s_desc`` over
    :func:`gate_up_views`' int16 pairs, box ``[1, 1, 2, 16, 8]``: read as the words are."""
    b = gl.program_id(0)
    n = gl.program_id(1)
    e = _block_expert(block_expert_ptr, b, SLOT_BLOCKS, E)
    if e >= 0:
        NSTEPS: gl.constexpr = (H + 255) // 256
        K_EDGE: gl.constexpr = H if H % 256 else 0
        mma: gl.constexpr = _MMA
        la: gl.constexpr = _LA
        lb: gl.constexpr = _LB
        wref = _words_ref(la)
        WL: gl.constexpr = wref.type.layout
        WL16: gl.constexpr = gl.reshape(wref, [4, 32, 16]).type.layout
        SL: gl.constexpr = gl.SliceLayout(3, WL)
        BL: gl.constexpr = _act_ref(lb, BM).type.layout

        # the ring: per slot [4 warps' chunks, gate/up, 16 pair rows, 64 bytes] (pair row 16 half
        # + p) and the scale words [gate/up, 32 rows, 4 warps]
        w_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, 4, 2, 16, 64], w_desc.layout)
        if SCALE_BLOCK == 32:
            s_smem = gl.allocate_shared_memory(gl.int16, [STAGES, 1, 1, 2, 16, 8], s_desc.layout)
        else:
            s_smem = gl.allocate_shared_memory(gl.int32, [STAGES, 1, 2, 1, 32, 4], s_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for q in gl.static_range(STAGES):
            mbarrier.init(ready.index(q), count=1)
        SLOT_BYTES: gl.constexpr = w_desc.block_type.nbytes + s_desc.block_type.nbytes
        for q in gl.static_range(STAGES):
            if q < NSTEPS:
                mbarrier.expect(ready.index(q), SLOT_BYTES)
                _gate_up_scale_copy(s_desc, e, n, q, ready.index(q), s_smem.index(q), SCALE_BLOCK)
                tma_load(w_desc, [4 * q, 2 * e, n * 16, 0], ready.index(q), w_smem.index(q))
        words_smem = reinterpret(w_smem, gl.int32, [STAGES, 4, 32, 16], gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
        if SCALE_BLOCK == 32:  # gate's 16 pairs of 16 bytes, then up's, as 64 rows of 8
            s_steps = reinterpret(s_smem, gl.int16, [STAGES, 64, 4], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        else:
            s_steps = reinterpret(s_smem, gl.int32, [STAGES, 64, 4], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))

        sel = _scale_selector(SL, SCALE_BLOCK)

        bw = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, BL)))
        bn = gl.arange(0, BM, layout=gl.SliceLayout(0, gl.SliceLayout(2, BL)))
        bq = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, BL)))
        slots_b, valid_b, r0, r1 = _block_rows(b, bn, sorted_slot_ptr, row_start_ptr, row_end_ptr, SLOT_BLOCKS)
        if SLOT_BLOCKS:  # (the division in 32 bits, as the program id)
            tok_b = (b // TOPK + bn * 0).to(gl.int64)
        else:
            tok_b = slots_b // TOPK
        x_off = (gl.expand_dims(gl.expand_dims(tok_b * (H // 2), 0), 2) + gl.expand_dims(gl.expand_dims(bw * 32, 1), 2)
                 + gl.expand_dims(gl.expand_dims(bq, 0), 1))
        x_words = x_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
        x_mask = gl.expand_dims(gl.expand_dims(valid_b, 0), 2) & gl.expand_dims(gl.expand_dims(bq >= 0, 0), 1)

        x_cur = _act_load(x_words, x_off, x_mask, 0, BM, K_EDGE)
        acc = gl.zeros([4, 64, BM], gl.float32, mma)
        for i in range(NSTEPS):
            s = i % STAGES
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            words = words_smem.index(s).load(WL16)
            ra, rb = _slot_scales(s_steps.index(s), SL)
            thread_barrier()  # every warp has its words and scales of slot s: refill it
            if i + STAGES < NSTEPS:
                mbarrier.expect(ready.index(s), SLOT_BYTES)
                _gate_up_scale_copy(s_desc, e, n, i + STAGES, ready.index(s), s_smem.index(s), SCALE_BLOCK)
                tma_load(w_desc, [4 * (i + STAGES), 2 * e, n * 16, 0], ready.index(s), w_smem.index(s))
            x_nxt = _act_load(x_words, x_off, x_mask, gl.minimum(i + 1, NSTEPS - 1), BM, K_EDGE)
            acc = _step(acc, words, ra, rb, sel, x_cur, WL, la, lb, BM, NATURAL_B=True, E8M0=E8M0)
            x_cur = x_nxt

        # the warps' partial sums through shared memory; rows r (gate) and 32 + r (up) in one thread
        red = gl.allocate_shared_memory(gl.float32, [4, 64, BM], gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
        red.store(acc)
        thread_barrier()
        red4 = reinterpret(red, gl.float32, [4, 2, 32, BM], gl.SwizzledSharedLayout(1, 1, 1, [3, 2, 1, 0]))
        RL: gl.constexpr = gl.BlockedLayout([4, 2, 1, BM // 4], [1, 1, 8, 4], [1, 1, 4, 1], [3, 2, 1, 0])
        y = gl.sum(red4.load(RL), axis=0)  # [2, 32, BM]
        g = _global_scale(g_ptr, e, E8M0)
        gate, up = gl.split(gl.permute(y * g, [1, 2, 0]))
        HL: gl.constexpr = gate.type.layout
        mo = gl.arange(0, BM, layout=gl.SliceLayout(0, HL))
        rr = gl.arange(0, 32, layout=gl.SliceLayout(1, HL))
        if GPT_OSS:
            gate_up_bias_e = gate_up_bias_ptr + e.to(gl.int64) * (2 * I) + n * 32 + rr
            gate = gl.minimum(gate + gl.expand_dims(gl.load(gate_up_bias_e), 1), limit)
            up = gl.minimum(gl.maximum(up + gl.expand_dims(gl.load(gate_up_bias_e + I), 1), -limit), limit)
            hv = gate / (1.0 + gl.exp(-swiglu_alpha * gate)) * (up + 1.0)
        else:
            hv = gate / (1.0 + gl.exp(-gate)) * up
        slots, valid = _rows_in(b, mo, r0, r1, sorted_slot_ptr, SLOT_BLOCKS)
        col = n * 32 + rr
        col = (col & ~3) | ((col & 1) << 1) | ((col >> 1) & 1)  # K's bits 0, 1 swapped for the down GEMM
        h_off = gl.expand_dims(slots * I, 0) + gl.expand_dims(col, 1)
        gl.store(h_ptr + h_off, hv.to(gl.bfloat16), mask=gl.expand_dims(valid, 0) & gl.expand_dims(rr >= 0, 1))


@gluon.jit
def _gate_up_scale_copy(s_desc, e, n, step, bar, dst, SCALE_BLOCK: gl.constexpr):
    """The TMA copy of K step ``step``'s scales of tile ``n`` (gate rows ``32 n ..``, the same up
    rows) of expert ``e``: the step's words (a scale per 32 values: their row pairs)."""
    if SCALE_BLOCK == 32:
        tma_load(s_desc, [step, e, 0, n * 16, 0], bar, dst)
    else:
        tma_load(s_desc, [step, 0, e, n * 32, 0], bar, dst)


def gate_up_views(gate_up: torch.Tensor, gate_up_scale: torch.Tensor,
                  scale_block: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up's paired words ``[E, I, H/4]`` int32 as bytes ``[2E (expert, gate/up), I/2 pair rows,
    H]`` viewed ``[H/64 (K chunk), 2E, I/2, 64]`` (entry ``[c, 2e + u, p]``: chunk ``c`` of pair row
    ``p`` of expert e's gate (u 0) or up (u 1) rows; step ``s``'s box holds chunks ``4s + w``, zeros
    past H), and its scales ``[E, 2I, Hs]`` (whole steps, :func:`.layout.scale_columns`) as int32
    words viewed ``[Hs/16 (step), 2 (gate/up), E, I, 4 (warp)]`` (entry ``[s, u, e, i, w]``: row
    ``u I + i``'s word of chunk ``4s + w``). ``scale_block`` 32 (a scale per 32 values, rows in pairs:
    :func:`.layout.pair_scale_rows`): the scales as int16 ``[Hs/8 (step), E, 2 (gate/up), I/2 (pair), 8]``
    instead (entry ``[s, e, u, p, 4 r + w]``: row ``u I + 2p + r``'s two bytes of chunk ``4 s + w``)."""
    return gate_up_weight_view(gate_up), gate_up_scale_view(gate_up_scale, scale_block)


def gate_up_weight_view(gate_up: torch.Tensor) -> torch.Tensor:
    """:func:`gate_up_views`' first view."""
    num_experts, inter, quarter_h = gate_up.shape
    hidden = 4 * quarter_h
    return gate_up.view(torch.uint8).reshape(2 * num_experts, inter // 2, hidden // 64, 64).permute(2, 0, 1, 3)


def gate_up_scale_view(gate_up_scale: torch.Tensor, scale_block: int = 16) -> torch.Tensor:
    """:func:`gate_up_views`' second view."""
    num_experts, two_i = gate_up_scale.shape[:2]
    inter = two_i // 2
    if scale_block == 32:
        pairs = gate_up_scale.view(torch.int16).reshape(num_experts, 2, inter // 2, gate_up_scale.shape[-1] // 8, 8)
        return pairs.permute(3, 0, 1, 2, 4)
    steps = gate_up_scale.shape[-1] // 16
    words = gate_up_scale.view(torch.uint8).view(torch.int32).reshape(num_experts, 2, inter, steps, 4)
    return words.permute(3, 1, 0, 2, 4)


def gate_up_v3(x, gate_up, gate_up_scale, gate_up_global_scale, h, sorted_slot, block_expert, row_start, row_end, hidden,
               inter, top_k, bm, slot_blocks, num_experts, stages=2, gpt_oss=None, scale_block=16):
    """``h = silu(gate . x) * (up . x)`` per slot (:func:`_gate_up_v3_kernel`), ``h``'s K bits 0, 1 swapped.
    ``gpt_oss``: :class:`.layout.GptOssTerms` for gpt-oss's activation; int8 ``gate_up_scale``: E8M0 scales (MXFP4),
    ``scale_block`` 32 where held once per 32 values (:func:`.layout.values_per_scale`)."""
    if hidden % 64 or inter % 32 or gate_up_scale.shape[-1] % (256 // scale_block):
        raise ValueError(f"decode_v3: H must be a multiple of 64, I of 32 and the scale rows whole steps, got {hidden}, "
                         f"{inter}, {gate_up_scale.shape[-1]}")
    scale_box = [1, 1, 2, 16, 8] if scale_block == 32 else [1, 2, 1, 32, 4]
    launch_or_compile(_gate_up_v3_kernel, (block_expert.numel(), inter // 32), x,
                      view_descriptor(gate_up_weight_view, gate_up, [4, 2, 16, 64]),
                      view_descriptor(gate_up_scale_view, gate_up_scale, scale_box, scale_block),
                      gate_up_global_scale, h,
                      sorted_slot, block_expert, row_start, row_end, H=hidden, I=inter, TOPK=top_k, BM=bm,
                      SLOT_BLOCKS=slot_blocks, E=num_experts, STAGES=stages, E8M0=gate_up_scale.dtype == torch.int8,
                      SCALE_BLOCK=scale_block, **({} if gpt_oss is None else gpt_oss.gate_up_args()), num_warps=4)


@gluon.jit(do_not_specialize=["T"])
def _linear_v3_kernel(x_ptr, w_desc, s_desc, g_ptr, bias_ptr, out_ptr, parts_ptr, count_ptr, T, N, K,
                      BM: gl.constexpr, PART_SLOTS: gl.constexpr, STAGES: gl.constexpr, SPS: gl.constexpr,
                      HAS_BIAS: gl.constexpr, SPLIT: gl.constexpr, SERIAL: gl.constexpr):
    """One NVFP4 linear (``fp4moe::nvfp4_linear``), program (weight tile ``n``, token block ``m``,
    K part ``p``): ``out[m BM .., 64 n ..] = g * x @ W^T (+ bias)`` over ring slots ``[p PART_SLOTS,
    (p + 1) PART_SLOTS)`` of SPS 256-wide steps each. The weight tile is the MMA's M side, as in
    :func:`_down_v3_kernel` with one expert; ``x [T, K]`` bf16 in natural order. SPLIT: each part
    stores float32 partial sums into ``parts [PARTS, T, N]``, and with SERIAL the last part of a
    tile to arrive (``count [tiles]`` int32, zero between calls; that program sets it back) adds
    them in part order and stores ``out``; without, the caller's second kernel does."""
    n = gl.program_id(0)
    mb = gl.program_id(1)
    part = gl.program_id(2)
    tok_b = mb * BM + _act_rows(BM)
    x_words = x_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
    acc = _ring_gemm(w_desc, s_desc, x_words, _act_offsets(tok_b.to(gl.int64), K // 2, BM) + part * (PART_SLOTS * SPS * 128),
                     _act_mask(tok_b < T, BM), n * 32, n * 64, part * PART_SLOTS, PART_SLOTS, BM, STAGES, SPS,
                     NATURAL_B=True)
    y = _warp_sum(acc, BM) * (gl.load(g_ptr) * 4194304.0)  # the decoded tiles' 2^-22
    YL: gl.constexpr = y.type.layout
    tok = mb * BM + gl.arange(0, BM, layout=gl.SliceLayout(0, YL))
    cols = n * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, YL))
    offs = gl.expand_dims(tok.to(gl.int64) * N, 0) + gl.expand_dims(cols, 1)
    mask = gl.expand_dims(tok < T, 0) & gl.expand_dims(cols >= 0, 1)
    if not SPLIT:
        _linear_v3_store(y, bias_ptr, out_ptr, cols, offs, mask, HAS_BIAS)
    else:
        gl.store(parts_ptr + part.to(gl.int64) * T * N + offs, y, mask=mask)
        if SERIAL:
            thread_barrier()  # all of this program's partial sums are stored before it counts itself
            tile = mb * gl.num_programs(0) + n
            arrived = gl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == gl.num_programs(2) - 1:
                total = gl.zeros([64, BM], gl.float32, YL)
                for p in range(0, gl.num_programs(2)):
                    total += gl.load(parts_ptr + (p * T).to(gl.int64) * N + offs, mask=mask, other=0.0,
                                     cache_modifier=".cg")  # from L2, where the other programs' stores are
                _linear_v3_store(total, bias_ptr, out_ptr, cols, offs, mask, HAS_BIAS)
                gl.atomic_xchg(count_ptr + tile, 0)  # ready for the next call (and a graph's next replay)


@gluon.jit
def _linear_v3_store(y, bias_ptr, out_ptr, cols, offs, mask, HAS_BIAS: gl.constexpr):
    if HAS_BIAS:
        y += gl.expand_dims(gl.load(bias_ptr + cols).to(gl.float32), 1)
    gl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _linear_weight_view(words: torch.Tensor, sps: int) -> torch.Tensor:
    """A linear's paired words ``[N/2, K/4]`` as :func:`weight_view` of one expert."""
    return weight_view(words[None], sps)


def _linear_scale_view(weight_scale: torch.Tensor, sps: int) -> torch.Tensor:
    """A linear's block scales ``[N, Ks]`` as :func:`scale_view` of one expert."""
    return scale_view(weight_scale[None], sps)


def linear_v3(x2, words, weight_scale, global_scale, bias, out, partials, counters, bm: int, parts: int,
              stages: int = 2):
    """``out [T, N] = x2 [T, K] @ W^T (+ bias)`` (:func:`_linear_v3_kernel`) for paired weights
    ``words [N/2, K/4]`` int32 (:func:`.layout.paired_weight_layout`), block scales ``[N, K/16]``
    E4M3, ``global_scale []`` float32 that multiplies; bf16 ``x2``. ``parts`` splits K's ring
    slots (it must divide them): ``partials [parts, T, N]`` float32 receives the parts' sums,
    added by the last part of each tile where ``counters`` (a zeroed int32 table of at least
    ``N/64 * ceil(T/bm)`` entries) is given; else the caller adds them."""
    n, k = 2 * words.shape[0], 4 * words.shape[1]
    sps = 2 if k % 512 == 0 else 1
    slots = k // (256 * sps)
    if k % 256 or n % 64 or slots % parts:
        raise ValueError(f"linear_v3: N must be a multiple of 64, K of 256 and the parts ({parts}) must divide "
                         f"K's {slots} slots; got N={n}, K={k}")
    tokens = x2.shape[0]
    grid = (n // 64, -(-tokens // bm), parts)
    launch_or_compile(_linear_v3_kernel, grid, x2, view_descriptor(_linear_weight_view, words, [4 * sps, 32, 64], sps),
                      view_descriptor(_linear_scale_view, weight_scale, [sps, 1, 64, 4], sps), global_scale,
                      out if bias is None else bias, out, partials, out if counters is None else counters, tokens,
                      n, k, BM=bm, PART_SLOTS=slots // parts, STAGES=stages, SPS=sps, HAS_BIAS=bias is not None,
                      SPLIT=parts > 1, SERIAL=counters is not None, num_warps=4)
