"""Prefill GEMMs in Gluon for Hopper: the FP4 weights decoded straight into the register
operand of wgmma.

The weights are the MMA's left operand (M = weight rows), decoded by the warps that issue the MMA
into the registers wgmma reads, while the previous K step's wgmma runs (the structure of
CUTLASS's mixed-input GEMMs); the activations are the right operand (N = a row block's tokens,
``BLOCK_M``), from shared memory. Nothing decoded goes through shared memory (an earlier kernel
decoded into shared memory in producer warps: 0.94x the single-role kernels' time at 8192 tokens
against this one's ~0.8x; benchmarks/NOTES.md).

One program computes ``[256 weight rows, BLOCK_M tokens]`` of one expert's row block, over K in
64-wide steps, as two warpgroups that run as separate Gluon partitions (the barriers Gluon puts
around each TMA copy then hold one warpgroup, not both). Ring slots hold two K steps (one TMA
copy and one wait per two steps):

- each warpgroup has 128 of the weight rows (the gate_up GEMM: 64 gate rows and the same 64 up rows, so
  SwiGLU needs no exchange; the down GEMM: 128 consecutive rows of ``down``) and its own ring of weight
  boxes ``[2 steps, 2 boxes, 32 pair rows, 64 bytes]`` (:func:`.layout.paired_weight_layout`: a
  pair row holds weight rows r and r + 8), filled by TMA;
- the activation tiles ``[2 steps, BLOCK_M tokens, 64]`` bf16 are shared: warpgroup 0 refills a ring
  slot once both warpgroups retired its steps (an mbarrier with two arrivals);
- each thread decodes its own fragments: a paired word (rows r and r + 8, one 2-byte unit each)
  is exactly four bf16x2 registers of one 16-wide K chunk of wgmma's A operand when K runs in
  :func:`.layout.fragment_order` (chunk 64), so the activations are stored that way (the gather
  copy for the gate_up GEMM, the gate_up GEMM's epilogue for ``h``).

Row blocks are 128 tokens; an expert's last block, when it holds few rows, can run in a launch
of its own with narrower tiles (``tails`` of :func:`prefill_gemms`): the MMA work of its padding
shrinks, the decode per block stays. Narrow blocks throughout (8-64 tokens) run too, but lose to
the single-role kernels at decode and middle sizes: the decode is the same work per block, done
by 8 warps per SM (benchmarks/NOTES.md).

Block scales come with plain loads, each thread its own byte per row and step: E4M3 (uint8) or
E8M0 (int8) one per 16 values, or gpt-oss's E8M0 held once per 32 values in row pairs
(:func:`.layout.pair_scale_rows`), given as int16 (the dtype says so at compile time, worker
partitions included), where threads t and t + 1 of a quad read the same byte.

Decoded values carry a 2^-22 factor, folded into the global scale in the epilogue (as in
:mod:`.kernels`). bf16 activations only; written for Triton 3.6's Gluon (the GPU machine's;
Triton 3.9 renamed the TMA copy, so the CPU CI does not compile these kernels).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from .compile_ahead import launch_or_compile
from .descriptors import view_descriptor
from .gluon_api import reinterpret, tma_load
from .kernels import _PAIRED_WORD_TO_BF16
from .layout import fragment_column, values_per_scale

# Gluon 3.6 passes constexpr arguments to a worker partition as run-time values: what must stay
# a compile-time constant there (layouts) is a module constant, or read from a shape (the row
# block's tokens, wgmma's N, are ``x_smem.shape[1]``)
BK = gl.constexpr(64)  # K per step
PAIRS = gl.constexpr(64)  # pair rows of a warpgroup's 128 weight rows (its two boxes: 32 each)

_WORD_TO_BF16 = gl.constexpr(_PAIRED_WORD_TO_BF16.value)
_fragment_column = gluon.jit(fragment_column)  # plain index arithmetic, shared with .layout
_SPLIT_HALVES = gl.constexpr("mov.b32 {$0, $1}, $2;")  # int32 -> its two bf16 halves (no instruction)

# An E4M3 block-scale byte (zero-extended) -> bf16x2 of ``scale * 2^104`` in both halves: the 7
# exponent/mantissa bits moved into bf16's fields read as scale * 2^-120 (subnormals included;
# the sign is dropped, scales are >= 0), times 2^112 twice (exact).
_E4M3_TO_BF16X2 = gl.constexpr("""
{
.reg .b32 t, c;
mov.b32 c, 0x77807780;
and.b32 t, $1, 0x7F; shl.b32 t, t, 4; prmt.b32 t, t, 0, 0x1010;
mul.rn.bf16x2 t, t, c; mul.rn.bf16x2 $0, t, c;
}
""")
# An E8M0 block-scale byte (MXFP4, loaded as int8 and sign-extended) -> the same: byte + 104 in
# bf16's exponent field is ``scale * 2^104`` (exact up to 2^23).
_E8M0_TO_BF16X2 = gl.constexpr("""
{
.reg .b32 t;
and.b32 t, $1, 0xFF; add.u32 t, t, 104; shl.b32 t, t, 7; prmt.b32 $0, t, 0, 0x1010;
}
""")


@gluon.jit
def _operand_layouts(mma: gl.constexpr):
    """The decode's layouts, derived from wgmma's A-operand layout for a warpgroup's ``[128, 64]``
    tile: returns a ``[64 pair rows, 4, 4]`` int32 zero tensor (pair row, ``t``, ``j``: word ``4 t +
    j``) whose layout gives each thread the words of its own fragments (pair rows ``32 box + 8 warp
    + lane // 4``, ``t = lane % 4``, all ``j``)."""
    la: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    ref = gl.zeros([128, 64], gl.bfloat16, la)
    # row 64 box + 16 a + 8 rs + b, column 16 j + 8 s + 2 t + e
    ref = gl.reshape(ref, [2, 4, 2, 8, 4, 2, 4, 2])
    ref = gl.permute(ref, [0, 1, 3, 6, 4, 2, 5, 7])  # box, a, b, t, j, rs, s, e
    ref = gl.reshape(ref, [64, 4, 4, 8])
    # the last dimension lives in registers; drop it
    return gl.max(ref.to(gl.int32), axis=3)


@gluon.jit
def _decode(words, sc_r, sc_r8):
    """``words [64, 4, 4]`` int32 (pair row, t, j) and the bf16x2 scales of rows r and r + 8
    (``[64, 4, 1]``) -> the A operand ``[128, 64]`` bf16 (rows in tile order, K in fragment order)."""
    o0, o1, o2, o3 = gl.inline_asm_elementwise(
        _WORD_TO_BF16, "=r,=r,=r,=r,r,r,r", [words, sc_r, sc_r8],
        dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1)
    v = gl.join(gl.join(o0, o1), gl.join(o2, o3))  # [64, t, j, rs, s]
    lo, hi = gl.inline_asm_elementwise(_SPLIT_HALVES, "=h,=h,r", [v], dtype=(gl.bfloat16, gl.bfloat16),
                                       is_pure=True, pack=1)
    a = gl.join(lo, hi)  # [64, t, j, rs, s, e]
    a = gl.reshape(a, [2, 4, 8, 4, 4, 2, 2, 2])  # box, a, b, t, j, rs, s, e
    a = gl.permute(a, [0, 1, 5, 2, 4, 6, 3, 7])  # box, a, rs, b, j, s, t, e
    return gl.reshape(a, [128, 64])


@gluon.jit
def _scale_offsets(s_ptr, srow0, srow1, lrow0, lrow1, n_rows, S_ROW, layout: gl.constexpr):
    """Byte offsets of step 0's block scales of rows r, ``[64, 4]`` (pair row, t): box 0's pair
    rows start at weight row ``srow0`` (row ``lrow0`` of the expert's ``n_rows``), box 1's at
    ``srow1`` (``lrow1``); ``S_ROW`` bytes a scale row; the words ``4 t .. 4 t + 3`` of a 64-wide
    step cover K ``16 t .. 16 t + 15`` (fragment order), block ``t`` (a scale per 32 values, int16
    ``s_ptr``: block ``t // 2`` of row r's 8 bytes in its pair's 16 of the 256-wide step, whose
    rows hold ``2 S_ROW`` bytes; see :func:`_load_scales`). A tile past N (gpt-oss's
    2880 rows in 128- and 256-row tiles) reads its expert's last 16 rows' scales instead: its sums
    are not stored, and the loads stay inside the tensor without a mask in the K loop."""
    p = gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
    t = gl.arange(0, 4, layout=gl.SliceLayout(0, layout))
    q = p % 32
    lbox = gl.where(p < 32, lrow0, lrow1)
    group = gl.minimum(lbox + (q // 8) * 16, n_rows - 16)  # (rows r and r + 8 of one 16-row group)
    row = gl.where(p < 32, srow0, srow1) + group - lbox + q % 8
    if s_ptr.dtype.element_ty == gl.int16:
        offs = (row // 2).to(gl.int64)[:, None] * (2 * S_ROW) + ((row % 2) * 8)[:, None] + (t // 2)[None, :]
    else:
        offs = row.to(gl.int64)[:, None] * S_ROW + t[None, :]
    return offs


@gluon.jit
def _load_scales(s_ptr, offs, step):
    """Raw scale bytes of K step ``step`` at byte offsets ``offs`` (:func:`_scale_offsets`): 4 bytes
    a step, or from an int16 ``s_ptr`` (a scale per 32 values, rows in pairs) 2 bytes a step within
    each 256-wide step's 16 bytes of a pair, read as int8 (E8M0)."""
    if s_ptr.dtype.element_ty == gl.int16:
        raw = gl.load(s_ptr.to(gl.pointer_type(gl.int8), bitcast=True) + offs + (step // 4) * 16 + (step % 4) * 2)
    else:
        raw = gl.load(s_ptr + offs + 4 * step)
    return raw


@gluon.jit
def _scales_bf16x2(raw):
    """Raw scale bytes -> bf16x2 words: E4M3 (uint8) or, loaded through an int8 pointer, E8M0 (MXFP4):
    the scales' dtype tells the formats apart at compile time, worker partitions included."""
    if raw.dtype == gl.int8:
        return gl.inline_asm_elementwise(_E8M0_TO_BF16X2, "=r,r", [raw.to(gl.int32)], dtype=gl.int32, is_pure=True,
                                         pack=1)
    return gl.inline_asm_elementwise(_E4M3_TO_BF16X2, "=r,r", [raw.to(gl.int32)], dtype=gl.int32, is_pure=True,
                                     pack=1)


@gluon.jit
def _issue_x(x_desc, x_smem, x_ready, row0, i, n2):
    """Pair step ``i``'s activation tiles (K steps 2i, 2i + 1: one 3-D box of the activations viewed
    as ``[K/64, S, 64]``) into the shared ring."""
    S: gl.constexpr = x_smem.shape[0] // 2
    BLOCK_M: gl.constexpr = x_smem.shape[1]
    if i < n2:
        s = i % S
        # the ring's two tiles of a slot as one [2, BLOCK_M, 64] box (the same bytes and swizzle)
        pairs = reinterpret(x_smem, gl.bfloat16, [S, 2, BLOCK_M, BK],
                                    gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3))
        mbarrier.expect(x_ready.index(s), x_desc.block_type.nbytes)
        tma_load(x_desc, [2 * i, row0, 0], x_ready.index(s), pairs.index(s))


@gluon.jit
def _issue_w(w_desc, w_smem, w_ready, base, wbox, wpair, i, n2):
    """Pair step ``i``'s weight boxes (one 4-D box of the weights viewed as ``[K/64, boxes, pair
    rows, 64 bytes]``: K steps 2i, 2i + 1 of boxes ``wbox``, ``wbox + 1``, 32 pair rows from
    ``wpair``) into a warpgroup's ring (slots ``base ..``). Each step's 64-byte rows land
    contiguous: a warp's reads of one step are free of bank conflicts (with 128-byte rows holding
    both steps, two pair rows of a quarter-warp hit the same banks)."""
    S: gl.constexpr = w_smem.shape[0] // 2
    if i < n2:
        s = base + i % S
        mbarrier.expect(w_ready.index(s), w_desc.block_type.nbytes)
        tma_load(w_desc, [2 * i, wbox, wpair, 0], w_ready.index(s), w_smem.index(s))


@gluon.jit
def _warpgroup(x_desc, w_desc, x_smem, w_all, x_ready, x_empty, w_ready_all, s_ptr, g_ptr, out_ptr, topk_w_ptr,
               sorted_slot_ptr, e, row0, nrows, t, WG, N_OUT, K, S_ROW,
               EXPERT_PAIR_ROWS, GATE_UP, DIAG, gate_up_bias_ptr, swiglu_alpha, limit, GPT_OSS):
    """One warpgroup's half of the program: 128 weight rows (the gate_up GEMM: 64 gate rows and the same up
    rows; the down GEMM: 128 consecutive rows) x BLOCK_M tokens. Its weight ring is its own; the activation
    ring is shared: warpgroup 0 refills it once both have retired a slot (``x_empty``). A ring slot
    holds two K steps (one TMA copy and one wait per two steps: Gluon puts a barrier of the
    partition around each copy)."""
    S: gl.constexpr = x_smem.shape[0] // 2
    BLOCK_M: gl.constexpr = x_smem.shape[1]
    # this warpgroup's rows, as pair rows of the weights: box 0, box 1
    if GATE_UP:
        p0 = e * EXPERT_PAIR_ROWS + t * PAIRS + WG * (PAIRS // 2)
        col0 = t * 128 + WG * 64
        wbox = 2 * e  # gate_up as [2E, I/2, H] bytes: gate half 2e, up half 2e + 1
        wpair = t * PAIRS + WG * (PAIRS // 2)
    else:
        p0 = e * EXPERT_PAIR_ROWS + t * 2 * PAIRS + WG * PAIRS
        col0 = t * 256 + WG * 128
        wbox = p0 // (PAIRS // 2)  # down as [E H/64, 32, I] bytes: boxes of 32 pair rows
        wpair = 0
    p1 = p0 + (EXPERT_PAIR_ROWS // 2 if GATE_UP else PAIRS // 2)  # the gate_up GEMM: the up rows, I / 2 pair rows further
    nk = (K + BK - 1) // BK  # K a multiple of 64
    n2 = (nk + 1) // 2  # pair steps; with nk odd the last one's second step lies past K: TMA reads
    # zeros for its weights and activations, and its scales are step nk - 1's (_step clamps)
    for i in gl.static_range(S):
        _issue_w(w_desc, w_all, w_ready_all, WG * S, wbox, wpair, i, n2)
    if WG == 0:
        for i in gl.static_range(S):
            _issue_x(x_desc, x_smem, x_ready, row0, i, n2)

    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16])
    ref = _operand_layouts(mma)
    wl: gl.constexpr = ref.type.layout
    wl2: gl.constexpr = gl.reshape(ref, [PAIRS, 16]).type.layout  # the same as [pair row, word]
    la: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    # a slot's [2 steps, 2 boxes, 32 pair rows, 64 bytes] as [2 steps, 64 pair rows, 16 words]
    w_words = reinterpret(w_all, gl.int32, [4 * S, PAIRS, 16], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    if GATE_UP:  # box 0 gate rows col0 .., box 1 the same up rows
        offs = _scale_offsets(s_ptr, 2 * p0, 2 * p1, col0, col0, N_OUT, S_ROW, gl.SliceLayout(2, wl))
    else:  # 128 consecutive rows
        offs = _scale_offsets(s_ptr, 2 * p0, 2 * p1, col0, col0 + 64, N_OUT, S_ROW, gl.SliceLayout(2, wl))
    below = 8 * S_ROW  # rows r + 8
    ra = _load_scales(s_ptr, offs, 0)
    rb = _load_scales(s_ptr, offs + below, 0)
    na = _load_scales(s_ptr, offs, gl.minimum(1, nk - 1))
    nb = _load_scales(s_ptr, offs + below, gl.minimum(1, nk - 1))
    acc = gl.zeros([128, BLOCK_M], gl.float32, mma)
    # Two A operands, for even and odd steps: wgmma reads its register operand while it runs,
    # and ptxas does not guard those registers (a single loop-carried operand, copied at the
    # back edge, left the decode of step k + 1 writing the registers wgmma k was reading: wrong
    # sums and NaN on H200). Each is rewritten only after the wait that retires its wgmma.
    a_odd = gl.zeros([128, BK], gl.bfloat16, la)
    scales = (ra, rb, na, nb)
    for i in range(n2):
        s = i % S
        ws = WG * S + s  # this warpgroup's weight slot
        mbarrier.wait(w_ready_all.index(ws), (i // S) & 1)
        mbarrier.wait(x_ready.index(s), (i // S) & 1)
        acc, a_even, scales = _step(2 * i, acc, a_odd, scales, w_words.index(2 * ws), x_smem.index(2 * s),
                                    s_ptr, offs, below, nk, wl, wl2, la, DIAG)
        if i > 0:  # pair step i - 1 retired in this warpgroup (its odd step by the wait just done)
            mbarrier.arrive(x_empty.index((i - 1) % S))
            _issue_w(w_desc, w_all, w_ready_all, WG * S, wbox, wpair, i - 1 + S, n2)
        if WG == 0:
            if i > 1:  # the activation slot of pair step i - 2, once both warpgroups retired it
                mbarrier.wait(x_empty.index((i - 2) % S), ((i - 2) // S) & 1)
                _issue_x(x_desc, x_smem, x_ready, row0, i - 2 + S, n2)
        acc, a_odd, scales = _step(2 * i + 1, acc, a_even, scales, w_words.index(2 * ws + 1), x_smem.index(2 * s + 1),
                                   s_ptr, offs, below, nk, wl, wl2, la, DIAG)
    acc, a_odd = warpgroup_mma_wait(0, deps=[acc, a_odd])
    if DIAG >= 2:
        acc += gl.sum(gl.sum(a_odd.to(gl.float32), axis=1), axis=0)
    _epilogue(acc, out_ptr, s_ptr, g_ptr, topk_w_ptr, sorted_slot_ptr, e, row0, nrows, col0, N_OUT, GATE_UP,
              gate_up_bias_ptr, swiglu_alpha, limit, GPT_OSS)


@gluon.jit
def _step(k, acc, a_prev, scales, words_smem, x_tile, s_ptr, offs, below, nk, wl: gl.constexpr, wl2: gl.constexpr,
          la: gl.constexpr, DIAG):
    """K step ``k``: decode its A operand from ``words_smem`` (``[64, 16]``), issue its wgmma with
    ``x_tile``, retire step k - 1's (``a_prev``, held in registers till here). ``scales``: raw
    bytes of steps k, k + 1 (rows r, rows r + 8), returned for k + 1, k + 2."""
    ra, rb, na, nb = scales
    ahead = gl.minimum(k + 2, nk - 1)
    ca = _load_scales(s_ptr, offs, ahead)
    cb = _load_scales(s_ptr, offs + below, ahead)
    if DIAG == 1:
        a = gl.full([128, BK], 1.0, gl.bfloat16, la)
    else:
        words = gl.convert_layout(gl.reshape(words_smem.load(wl2), [PAIRS, 4, 4]), wl, assert_trivial=True)
        a = _decode(words, gl.expand_dims(_scales_bf16x2(ra), 2), gl.expand_dims(_scales_bf16x2(rb), 2))
        a = gl.convert_layout(a, la, assert_trivial=True)
    if DIAG >= 2:  # each decoded tile XOR-ed into the next (so none is dead code), summed at the end
        a = (a.to(gl.int16, bitcast=True) ^ a_prev.to(gl.int16, bitcast=True)).to(gl.bfloat16, bitcast=True)
    if DIAG == 3:  # the MMA on a constant operand: both sides' work, neither waiting for the other
        acc = warpgroup_mma(gl.full([128, BK], 1.0, gl.bfloat16, la), x_tile.permute((1, 0)), acc, is_async=True)
    elif DIAG != 2:
        acc = warpgroup_mma(a, x_tile.permute((1, 0)), acc, is_async=True)
    acc, a_prev = warpgroup_mma_wait(1, deps=[acc, a_prev])
    return acc, a, (na, nb, ca, cb)


@gluon.jit
def _prefill_gemm_kernel(x_desc, w_desc, s_ptr, g_ptr, out_ptr, topk_w_ptr, sorted_slot_ptr,
                         block_expert_ptr, block_row_start_ptr, block_row_end_ptr,
                         N_OUT: gl.constexpr, K: gl.constexpr, S_ROW: gl.constexpr, EXPERT_PAIR_ROWS: gl.constexpr,
                         GATE_UP: gl.constexpr,
                         BLOCK_M: gl.constexpr, STAGES: gl.constexpr, REGS: gl.constexpr, DIAG: gl.constexpr = 0,
                         gate_up_bias_ptr=None, swiglu_alpha=1.0, limit=1.0, GPT_OSS: gl.constexpr = False):
    """Program (weight tile ``t``, row block ``b`` of up to ``BLOCK_M`` tokens). The gate_up GEMM: tile ``t``
    is gate rows ``128 t ..`` and the same up rows; the down GEMM: weight rows ``256 t ..``.
    ``EXPERT_PAIR_ROWS``: pair rows per expert; ``S_ROW``: bytes per scale row. N_OUT and K multiples
    of 64: rows past N_OUT in the last tile are computed and not stored. ``DIAG`` (diagnostics, wrong results): 1 no decode
    (A a constant), 2 no MMA (the decode and the copies only), 3 both, the MMA on a constant A.
    GPT_OSS (the gate_up GEMM): gpt-oss's clamped SwiGLU with the biases ``gate_up_bias [E, 2 N_OUT]`` float32; int8
    scales ``s_ptr``: MXFP4's E8M0 (and no global scale); int16: E8M0 held once per 32 values, rows in
    pairs (two bytes a 64-wide step; ``S_ROW`` a row's bytes, see :func:`_load_scales`)."""
    t = gl.program_id(0)
    b = gl.program_id(1)
    e = gl.load(block_expert_ptr + b)
    if e >= 0:
        row0 = gl.load(block_row_start_ptr + b)
        nrows = gl.load(block_row_end_ptr + b) - row0
        x_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        w_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=4)
        x_smem = gl.allocate_shared_memory(gl.bfloat16, [2 * STAGES, BLOCK_M, BK], x_layout)  # one K step per tile
        # warpgroup 0's slots, then 1's: [2 steps, 2 boxes, 32 pair rows, 64 bytes] each
        w_smem = gl.allocate_shared_memory(gl.uint8, [2 * STAGES, 2, 2, PAIRS // 2, BK], w_layout)
        x_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        x_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        w_ready = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(x_ready.index(i), count=1)
            mbarrier.init(x_empty.index(i), count=2)
            mbarrier.init(w_ready.index(i), count=1)
            mbarrier.init(w_ready.index(STAGES + i), count=1)
        gl.warp_specialize([
            (_warpgroup, (x_desc, w_desc, x_smem, w_smem, x_ready, x_empty, w_ready, s_ptr, g_ptr, out_ptr, topk_w_ptr,
                          sorted_slot_ptr, e, row0, nrows, t, 0, N_OUT, K, S_ROW, EXPERT_PAIR_ROWS, GATE_UP, DIAG,
                          gate_up_bias_ptr, swiglu_alpha, limit, GPT_OSS)),
            (_warpgroup, (x_desc, w_desc, x_smem, w_smem, x_ready, x_empty, w_ready, s_ptr, g_ptr, out_ptr, topk_w_ptr,
                          sorted_slot_ptr, e, row0, nrows, t, 1, N_OUT, K, S_ROW, EXPERT_PAIR_ROWS, GATE_UP, DIAG,
                          gate_up_bias_ptr, swiglu_alpha, limit, GPT_OSS)),
        ], [4], [REGS])


@gluon.jit
def _epilogue(acc, out_ptr, s_ptr, g_ptr, topk_w_ptr, sorted_slot_ptr, e, row0, nrows, col0, N_OUT, GATE_UP,
              gate_up_bias_ptr, swiglu_alpha, limit, GPT_OSS):
    """``acc [128 weight rows, BLOCK_M tokens]`` times the global scale (none for MXFP4's E8M0 scales,
    int8 or int16): the gate_up GEMM's SwiGLU (GPT_OSS: gpt-oss's, see :func:`_store_swiglu`) into ``h`` (sorted rows, K
    of the down GEMM in fragment order), the down GEMM's times the routing weight into ``y`` (by slot)."""
    if s_ptr.dtype.element_ty == gl.int8 or s_ptr.dtype.element_ty == gl.int16:
        g = 4194304.0  # the decoded tiles' 2^-22
    else:
        g = gl.load(g_ptr + e) * 4194304.0
    if GATE_UP:  # (a run-time branch in the worker partition: see BK)
        _store_swiglu(acc * g, out_ptr, row0, nrows, col0, N_OUT, e, gate_up_bias_ptr, swiglu_alpha, limit,
                      GPT_OSS)
    else:
        _store_routed(acc * g, out_ptr, topk_w_ptr, sorted_slot_ptr, row0, nrows, col0, N_OUT)


@gluon.jit
def _store_swiglu(acc, h_ptr, row0, nrows, col0, N_OUT, e, gate_up_bias_ptr, swiglu_alpha, limit, GPT_OSS):
    """Rows 0..63 gate rows i, 64..127 the same up rows: both in one thread. With GPT_OSS (a
    run-time value in the worker partition) gpt-oss's clamped SwiGLU of the projections plus
    ``gate_up_bias[e]`` (``[2 N_OUT]``: gate's, then up's)."""
    mma: gl.constexpr = acc.type.layout
    BLOCK_M: gl.constexpr = acc.type.shape[1]
    m = gl.arange(0, 128, layout=gl.SliceLayout(1, mma))
    n = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma))
    rows = gl.zeros([128, BLOCK_M], gl.int32, mma) + m[:, None]
    toks = gl.zeros([128, BLOCK_M], gl.int32, mma) + n[None, :]
    gate, up = gl.split(gl.permute(gl.reshape(acc, [2, 64, BLOCK_M]), [1, 2, 0]))
    c, _ = gl.split(gl.permute(gl.reshape(rows, [2, 64, BLOCK_M]), [1, 2, 0]))
    tok, _ = gl.split(gl.permute(gl.reshape(toks, [2, 64, BLOCK_M]), [1, 2, 0]))
    inside = col0 + c < N_OUT  # (the last tile of gpt-oss's 2880 rows: half past N_OUT)
    if GPT_OSS:
        gate_up_bias_e = gate_up_bias_ptr + e.to(gl.int64) * (2 * N_OUT) + col0 + c
        gate = gl.minimum(gate + gl.load(gate_up_bias_e, mask=inside, other=0.0), limit)
        up = gl.minimum(gl.maximum(up + gl.load(gate_up_bias_e + N_OUT, mask=inside, other=0.0), -limit), limit)
        h = gate / (1.0 + gl.exp(-swiglu_alpha * gate)) * (up + 1.0)
    else:
        h = gate / (1.0 + gl.exp(-gate)) * up
    offs = (row0 + tok).to(gl.int64) * N_OUT + _fragment_column(col0 + c, 64)
    gl.store(h_ptr + offs, h.to(gl.bfloat16), mask=(tok < nrows) & inside)


@gluon.jit
def _store_routed(acc, y_ptr, topk_w_ptr, sorted_slot_ptr, row0, nrows, col0, N_OUT):
    mma: gl.constexpr = acc.type.layout
    BLOCK_M: gl.constexpr = acc.type.shape[1]
    m = gl.arange(0, 128, layout=gl.SliceLayout(1, mma))
    n = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma))
    valid = n < nrows
    slot = gl.load(sorted_slot_ptr + row0 + n, mask=valid, other=0)
    route = gl.load(topk_w_ptr + slot, mask=valid, other=0.0)
    offs = slot.to(gl.int64)[None, :] * N_OUT + col0 + m[:, None]
    gl.store(y_ptr + offs, acc * route[None, :], mask=valid[None, :] & (col0 + m < N_OUT)[:, None])


def _scale_bytes(s: torch.Tensor, scale_block: int = 16) -> torch.Tensor:
    """Block scales as the kernels read them: E4M3 as uint8, MXFP4's E8M0 kept int8 (see _scales_bf16x2),
    or held once per 32 values in row pairs (``scale_block`` 32) as int16 (see :func:`_load_scales`)."""
    if scale_block == 32:
        return s.view(torch.int16)
    return s if s.dtype == torch.int8 else s.view(torch.uint8)


def _by_k_step(a: torch.Tensor) -> torch.Tensor:
    """``a [S, K]`` viewed as ``[K/64, S, 64]`` (no copy): one TMA box covers two K steps of a row block."""
    return a.view(a.shape[0], a.shape[1] // BK.value, BK.value).permute(1, 0, 2)


def _weight_boxes(w_bytes: torch.Tensor) -> torch.Tensor:
    """Paired weights as bytes ``[boxes, pair rows, K]`` (gate_up: ``[2E, I/2, H]``, down: ``[E H/64, 32, I]``)
    viewed as ``[K/64, boxes, pair rows, 64]`` (no copy): one TMA box ``[2, 2, 32, 64]`` holds two K
    steps of 32 pair rows of two boxes, each step's rows contiguous."""
    boxes, pairs, k = w_bytes.shape
    return w_bytes.view(boxes, pairs, k // BK.value, BK.value).permute(2, 0, 1, 3)


def gate_up_boxes(gate_up: torch.Tensor) -> torch.Tensor:
    """Paired gate_up ``[E, I, H/4]`` int32 as :func:`_weight_boxes` of its bytes ``[2E, I/2, H]``."""
    num_experts, inter, quarter_h = gate_up.shape
    return _weight_boxes(gate_up.view(torch.uint8).reshape(2 * num_experts, inter // 2, 4 * quarter_h))


def down_boxes(down: torch.Tensor) -> torch.Tensor:
    """Paired down ``[E, H/2, I/4]`` int32 as :func:`_weight_boxes` of its bytes ``[E H/64, 32, I]``."""
    num_experts, half_h, quarter_i = down.shape
    return _weight_boxes(down.view(torch.uint8).reshape(num_experts * half_h // 32, PAIRS.value // 2, 4 * quarter_i))


BLOCK_MS = (8, 16, 32, 64, 128)  # tokens per row block (wgmma N; a power of two for the epilogue's aranges)
SHARED_BYTES = 227 * 1024  # Hopper's shared memory per program


def ring_bytes(block_m: int, stages: int) -> int:
    """Shared memory of the rings: per slot two K steps of both warpgroups' weights (2 x 8 KB) and
    of the activations (2 x ``block_m`` x 64 bf16)."""
    return stages * (2 * 2 * PAIRS.value * 64 + 2 * block_m * BK.value * 2)


def ring_fits(block_m: int, stages: int) -> bool:
    """Whether rings of ``stages`` slots at ``block_m`` rows fit in shared memory (1 KB left for
    the barriers)."""
    return ring_bytes(block_m, stages) + 1024 <= SHARED_BYTES


def check_config(hidden: int, inter: int, block_m: int, stages: int, tails=()):
    """Raise ValueError unless :func:`prefill_gemms` can run these shapes and options."""
    sizes = (block_m, *tails)
    if any(m not in BLOCK_MS for m in sizes) or any(a <= b for a, b in zip(sizes, sizes[1:])):
        raise ValueError(f"prefill_gemms: block_m must be one of {BLOCK_MS} and the tails smaller, decreasing; "
                         f"got {block_m}, {tuple(tails)}")
    # 2 slots would wait on their own refills (a slot is refilled two pair steps after its use)
    if stages < 3 or not ring_fits(block_m, stages):
        raise ValueError(f"prefill_gemms: stages must be at least 3 and the rings fit in shared memory "
                         f"({ring_bytes(block_m, stages)} bytes at block_m={block_m}), got {stages}")
    if hidden % 64 or inter % 64:  # K chunks of 64 (a partial last pair step reads zeros past K), tiles
        # past N computed and not stored, h's 64-wide fragment-order chunks
        raise ValueError(f"prefill_gemms: H and I must be multiples of 64, got H={hidden}, I={inter}")


def split_blocks(block_expert, row_start, row_end, num_experts: int, block_m: int, tails=()):
    """The launches of :func:`prefill_gemms`: ``[(rows per block, block_expert, row_start, row_end)]``,
    one per size in ``(block_m, *tails)``, a block in the launch of the smallest size that holds
    its rows, -1 in the others (split on the device, no host sync). The block lists as
    :func:`.launch.route` makes them with ``block_m``."""
    if not tails:
        return [(block_m, block_expert, row_start, row_end)]
    rows = row_end - row_start
    sizes = (block_m, *tails)
    launches = []
    for m, below in zip(sizes, (*sizes[1:], 0)):
        # (the routing kernel leaves the rows of unused blocks unwritten)
        mine = (rows <= m) & (rows > below) & (block_expert >= 0)
        experts = torch.where(mine, block_expert, -1)
        if m == block_m:
            launches.append((m, experts, row_start, row_end))
            continue
        # a tail level holds at most one block per expert (its last): those first, and a grid of E
        # programs instead of one per block (each skipped program still costs a launch slot)
        order = torch.argsort(~mine, stable=True)[:min(num_experts, rows.numel())]
        launches.append((m, experts[order], row_start[order], row_end[order]))
    return launches


def prefill_gemms(x_sorted, gate_up, gate_up_scale, gate_up_global_scale, down, down_scale, down_global_scale,
                  topk_weights, sorted_slot, block_expert, row_start, row_end, block_m: int = 128, stages: int = 4, regs: int = 248, diag: int = 0, tails=(),
                  gpt_oss=None, launches=None):
    """Both GEMMs: ``x_sorted [S, H]`` bf16 (activations in expert-sorted row order, each 64-wide
    piece of K in :func:`.layout.fragment_order`) -> ``y [S, H]`` float32 by slot (the top-k sum
    is the caller's). Weights in the paired layout (int32 ``gate_up [E, I, H/4]``, ``down [E, H/2, I/4]``),
    scales as bytes, the row blocks as :func:`.launch.route` makes them with ``block_m`` rows
    (one of :data:`BLOCK_MS`). ``stages``: ring slots of two K steps each, at least 3, as many as
    fit in shared memory (:func:`ring_bytes`: 4 x 48 KB at 128 rows); ``regs``: the worker
    partition's registers; ``diag`` (a diagnostic, wrong results): 1 skips the decode, 2 the
    MMA, 3 runs both unlinked (the MMA on a constant operand). ``tails``: smaller sizes of
    :data:`BLOCK_MS`, decreasing: a block of at most ``tails[j]`` rows (an expert's last, or all
    its rows) runs in a launch of its own with ``tails[j]``-token tiles, the MMA work of its
    padding cut (each launch skips the others' blocks). ``launches``: that split as
    :func:`split_blocks` returns it, made elsewhere (the routing kernel makes a one-tail split
    itself); None: :func:`split_blocks` makes it. H and I multiples of 64 (a partial last K step,
    tiles past N not stored); scale rows of any length (``[E, N, *]``; whole 256-value steps with a
    scale per 32 values). MXFP4 (gpt-oss): int8 E8M0 scales, one per 32 values in row pairs
    (:func:`.layout.values_per_scale`, :func:`.layout.pair_scale_rows`;
    ``gate_up_global_scale``, ``down_global_scale`` unused) and ``gpt_oss`` (:class:`.layout.GptOssTerms`)
    for the gate_up GEMM's activation."""
    scale_block = values_per_scale(gate_up_scale, gpt_oss is not None)
    num_slots, hidden = x_sorted.shape
    inter = gate_up_scale.shape[1] // 2
    num_experts = gate_up.shape[0]
    check_config(hidden, inter, block_m, stages, tails)
    h = torch.empty(num_slots, inter, dtype=torch.bfloat16, device=x_sorted.device)
    y = torch.empty(num_slots, hidden, dtype=torch.float32, device=x_sorted.device)
    if launches is None:
        launches = split_blocks(block_expert, row_start, row_end, num_experts, block_m, tails)
    w_box = [2, 2, PAIRS.value // 2, BK.value]
    gate_up_desc = view_descriptor(gate_up_boxes, gate_up, w_box)
    down_desc = view_descriptor(down_boxes, down, w_box)
    # the gate_up GEMM's activation: gpt-oss's, or SiLU (a float32 tensor stands in for gate_up_bias: a worker partition
    # compiles both branches, and the down GEMM's the gate_up GEMM's epilogue too)
    act = gpt_oss.gate_up_args() if gpt_oss is not None else \
        dict(gate_up_bias_ptr=gate_up_global_scale, swiglu_alpha=1.0, limit=1.0, GPT_OSS=False)
    gate_up_scale_bytes, down_scale_bytes = _scale_bytes(gate_up_scale, scale_block), _scale_bytes(down_scale, scale_block)
    calls = []  # (grid, arguments, constexprs): the gate_up GEMM at each level, then the down GEMM
    for bm, experts, starts, ends in launches:
        calls.append(((-(-inter // 128), experts.numel()),
                      (view_descriptor(_by_k_step, x_sorted, [2, bm, BK.value], swizzle=128), gate_up_desc,
                       gate_up_scale_bytes, gate_up_global_scale, h, topk_weights, sorted_slot, experts,
                       starts, ends),
                      dict(N_OUT=inter, K=hidden, S_ROW=gate_up_scale.shape[-1], EXPERT_PAIR_ROWS=inter, GATE_UP=True,
                           BLOCK_M=bm, **act)))
    for bm, experts, starts, ends in launches:
        calls.append(((-(-hidden // 256), experts.numel()),
                      (view_descriptor(_by_k_step, h, [2, bm, BK.value], swizzle=128), down_desc, down_scale_bytes,
                       down_global_scale, y, topk_weights, sorted_slot, experts, starts, ends),
                      dict(N_OUT=hidden, K=inter, S_ROW=down_scale.shape[-1], EXPERT_PAIR_ROWS=hidden // 2,
                           GATE_UP=False, BLOCK_M=bm, **act)))
    common = dict(STAGES=stages, REGS=regs, DIAG=diag, num_warps=4)
    for grid, args, consts in calls:
        launch_or_compile(_prefill_gemm_kernel, grid, *args, **consts, **common)
    return y
