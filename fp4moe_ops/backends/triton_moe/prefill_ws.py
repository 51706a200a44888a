"""Warp-specialized prefill GEMMs (Gluon, Hopper): the experts' two GEMMs for prefill-sized batches,
with the FP4 decode in its own warps so that it overlaps the tensor cores' work (issue 17; the
single-role Triton kernels in :mod:`.kernels` keep the tensor pipe busy 39-46% of the time at 8192
tokens).

One program computes a ``[BM = 128 tokens, 256 weight rows]`` tile of one expert's row block, over
K in 64-wide steps, with shared-memory rings between two partitions:

- **consumer** (the default partition, 8 warps = 2 warpgroups): issues the TMA copies of each
  step's activation tile ``[128, 64]`` bf16 (rows of the expert-sorted activations) and its two
  paired-layout weight boxes ``[64 pair rows, 64]`` bytes (:func:`.layout.paired_weight_layout`:
  a pair row holds weight rows ``r`` and ``r + 8``), runs ``wgmma(activations [128, 64],
  weights^T [64, 256])`` from shared memory with one in flight, then the epilogue: GEMM1's
  SwiGLU into ``h [S, I]`` bf16 in sorted-row order (the tile is 128 gate rows then the same up
  rows, both in one thread of the accumulator), GEMM2's product times the routing weight into
  ``y [S, H]`` float32 by slot.
- **producer** (4 warps): each step's boxes -> a ``[256, 64]`` bf16 tile (128-byte swizzle, for
  wgmma), weight rows and K in natural order, times their E4M3 block scales (loaded from global
  memory two steps ahead).

Decoded values carry a 2^-22 factor (exact in bf16, as in :mod:`.kernels`), folded into the global
scale in the epilogue. bf16 activations only. Imported only where Triton (with Gluon) is installed;
written for Triton 3.6's Gluon (the GPU machine's). Measurements and what bounds it: NOTES.md.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_wait

BLOCK_M = 128  # tokens per row block (the consumer's two warpgroups, 64 each)
BK = gl.constexpr(64)  # K per step: one 128-byte swizzled row of bf16 operands
PAIRS = gl.constexpr(64)  # pair rows per weight box (128 weight rows); a tile is two boxes

# A paired word (rows r and r + 8, K 4u .. 4u + 3; bits permuted, see .layout) -> four bf16x2
# registers in natural K order: (row r: k0 k1), (row r: k2 k3), (row r+8: k0 k1), (row r+8: k2 k3).
# The masks / rotates / multiply leave bits 8..6 and 15 of each half (value * 2^-126, as in
# kernels._PAIRED_WORD_TO_BF16, whose register order is (k0, k2), (k1, k3)); one mul.bf16x2 per
# register by the row's block scale * 2^104; prmt puts the halves in K order.
_PAIRED_WORD_TO_BF16_NATURAL = gl.constexpr("""
{
.reg .b32 a, b, c, d, t;
and.b32 a, $4, 0x81C081C0;
shf.l.wrap.b32 t, $4, $4, 10; and.b32 b, t, 0x81C081C0;
shf.l.wrap.b32 t, $4, $4, 13; and.b32 c, t, 0x81C081C0;
and.b32 t, $4, 0x001B001B; mul.lo.u32 t, t, 0x4108; and.b32 d, t, 0x81C081C0;
mul.rn.bf16x2 a, a, $5; mul.rn.bf16x2 c, c, $5;
mul.rn.bf16x2 b, b, $6; mul.rn.bf16x2 d, d, $6;
prmt.b32 $0, a, c, 0x5410; prmt.b32 $1, a, c, 0x7632;
prmt.b32 $2, b, d, 0x5410; prmt.b32 $3, b, d, 0x7632;
}
""")

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


# The producer's register layout of one weight box's words of a step, ``[pair, scale block,
# word]``: each thread 4 consecutive words of one pair row (a 16-byte load; one scale block).
# Within each group of 8 lanes (one shared-memory phase of a 16-byte access) the 4 blocks of two
# adjacent pair rows: the loads read 128 contiguous bytes and the stores of the decoded rows (r
# and r + 1, an odd distance) land in different 16-byte columns of the 128-byte swizzle, so
# neither conflicts. (With both boxes in one phase the decoded rows 2i, 2i + 1 of an interleaved
# tile stored without conflicts but the loads conflicted 2-way; with both boxes in one thread the
# stores did: 290 M of 581 M store wavefronts at 8192 tokens, Nsight Compute.)
_WORDS: gl.constexpr = gl.BlockedLayout([1, 1, 4], [8, 4, 1], [4, 1, 1], [2, 1, 0])
_WORDS_2D: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])  # the same as [pair, word]
_SCALES: gl.constexpr = gl.SliceLayout(2, _WORDS)
_TILE_I32: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)


@gluon.jit
def _scale_offsets(srow, K):
    """Byte offsets of the block scales of step 0 for rows r (the first of each pair row) of a box
    whose first weight row is ``srow``, ``[PAIRS, 4]`` (pair, block); rows r + 8 are ``8 K/16``
    further."""
    p = gl.arange(0, 64, layout=gl.SliceLayout(1, _SCALES))
    j = gl.arange(0, 4, layout=gl.SliceLayout(0, _SCALES))
    r = (p // 8) * 16 + p % 8
    return (srow + r).to(gl.int64)[:, None] * (K // 16) + j[None, :]


@gluon.jit
def _scales_bf16x2(raw):
    return gl.inline_asm_elementwise(_E4M3_TO_BF16X2, "=r,r", [raw.to(gl.int32)], dtype=gl.int32, is_pure=True,
                                     pack=1)


@gluon.jit
def _decode_box(box, top, bottom):
    """A step's weight box (int32 ``[PAIRS, 16]`` in shared memory) and its raw scale bytes (rows
    r, rows r + 8; ``[PAIRS, 4]``) -> int32 ``[128, 32]``: bf16 pairs, the box's weight rows and K
    in natural order."""
    words = gl.convert_layout(gl.reshape(box.load(_WORDS_2D), [64, 4, 4]), _WORDS, assert_trivial=True)
    o0, o1, o2, o3 = gl.inline_asm_elementwise(
        _PAIRED_WORD_TO_BF16_NATURAL, "=r,=r,=r,=r,r,r,r",
        [words, gl.expand_dims(_scales_bf16x2(top), 2), gl.expand_dims(_scales_bf16x2(bottom), 2)],
        dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1)
    upper = gl.reshape(gl.join(o0, o1), [8, 8, 32])  # rows r = 16 (pair // 8) + pair % 8: (pair // 8, pair % 8, k pair)
    lower = gl.reshape(gl.join(o2, o3), [8, 8, 32])  # rows r + 8
    return gl.reshape(gl.permute(gl.join(upper, lower), [0, 3, 1, 2]), [128, 32])


@gluon.jit
def _producer(w_smem, d_smem, bars, s_ptr, srow0, srow1, K, DIAG):
    """Each step's two weight boxes -> one ``[256, 64]`` bf16 tile: the first box's 128 rows, then
    the second's (GEMM1: gate rows i, then the same up rows; GEMM2: 256 consecutive rows). The
    consumer issues the TMA copies: Gluon puts a barrier of the whole partition around each TMA
    copy and expect, which in this partition held every warp to the slowest several times per
    step."""
    x_ready, w_ready, d_ready, d_empty = bars
    WS: gl.constexpr = w_smem.shape[0] // 2
    DS: gl.constexpr = d_smem.shape[0]
    nk = K // BK
    # the boxes as words, [slot * 2 + box, pair, word] (TMA writes them plain: no swizzle)
    w_words = w_smem._reinterpret(gl.int32, [2 * WS, 64, 16], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    # block scales come from global memory two steps ahead, kept as raw bytes until used (their
    # latency then hides behind two steps' decoding)
    offs0 = _scale_offsets(srow0, K)
    offs1 = _scale_offsets(srow1, K)
    below = 8 * (K // 16)  # rows r + 8
    a0, a1, a2, a3 = _load_scale_bytes(s_ptr, offs0, offs1, below, 0)
    b0, b1, b2, b3 = _load_scale_bytes(s_ptr, offs0, offs1, below, gl.minimum(1, nk - 1))
    for k in range(nk):
        ahead = gl.minimum(k + 2, nk - 1)
        if DIAG == 3:  # (a diagnostic: step 0's scales every step, so they stay in L1)
            ahead = 0
        c0, c1, c2, c3 = _load_scale_bytes(s_ptr, offs0, offs1, below, ahead)
        ws = k % WS
        mbarrier.wait(w_ready.index(ws), (k // WS) & 1)
        ds = k % DS
        tile = d_smem.index(ds)._reinterpret(gl.int32, [256, 32], _TILE_I32)
        if DIAG != 1:  # (DIAG 1, a diagnostic: no decode, the tile is left as it was)
            first = _decode_box(w_words.index(2 * ws), a0, a1)
            second = _decode_box(w_words.index(2 * ws + 1), a2, a3)
            mbarrier.wait(d_empty.index(ds), ((k // DS) & 1) ^ 1)
            tile.slice(0, 128).store(first)
            tile.slice(128, 128).store(second)
        else:
            mbarrier.wait(d_empty.index(ds), ((k // DS) & 1) ^ 1)
        # the stores before the consumer's wgmma, and the box reads before the TMA copy the
        # consumer issues into this slot once it has seen this step's tile
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(d_ready.index(ds))
        a0, a1, a2, a3, b0, b1, b2, b3 = b0, b1, b2, b3, c0, c1, c2, c3


@gluon.jit
def _load_scale_bytes(s_ptr, offs0, offs1, below, k):
    """Raw scale bytes of step ``k``: (box 0 rows r, rows r + 8, box 1 rows r, rows r + 8)."""
    return (gl.load(s_ptr + offs0 + 4 * k), gl.load(s_ptr + offs0 + below + 4 * k),
            gl.load(s_ptr + offs1 + 4 * k), gl.load(s_ptr + offs1 + below + 4 * k))


@gluon.jit
def _load_x(x_desc, x_smem, x_ready, row0, j, nk):
    XS: gl.constexpr = x_smem.shape[0]
    if j < nk:
        xs = j % XS
        mbarrier.expect(x_ready.index(xs), x_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(x_desc, [row0, j * BK], x_ready.index(xs), x_smem.index(xs))


@gluon.jit
def _load_w(w_desc, w_smem, w_ready, wrow0, wrow1, j, nk):
    WS: gl.constexpr = w_smem.shape[0] // 2
    if j < nk:
        ws = j % WS
        mbarrier.expect(w_ready.index(ws), 2 * w_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(w_desc, [wrow0, j * BK], w_ready.index(ws), w_smem.index(2 * ws))
        tma.async_copy_global_to_shared(w_desc, [wrow1, j * BK], w_ready.index(ws), w_smem.index(2 * ws + 1))


@gluon.jit
def _consumer(x_desc, w_desc, x_smem, w_smem, d_smem, bars, out_ptr, g_ptr, topk_w_ptr, sorted_slot_ptr, e, row0,
              nrows, col0, wrow0, wrow1, N_OUT: gl.constexpr, K: gl.constexpr, GEMM1: gl.constexpr,
              BM: gl.constexpr, DIAG: gl.constexpr):
    """The TMA copies, wgmma over the rings, then the epilogue. Activation tiles: a slot is
    refilled (``XS`` steps ahead) once this partition's wgmma that read it is done. Weight boxes:
    step ``k + WS - 1`` goes into the slot of step ``k - 1``, which the producer has read (it
    decoded step k - 1 before this step's wgmma could start); that leaves the producer, at most
    ``DS`` steps ahead of this partition, ``WS - 1 - DS`` steps of copy latency."""
    x_ready, w_ready, d_ready, d_empty = bars
    XS: gl.constexpr = x_smem.shape[0]
    WS: gl.constexpr = w_smem.shape[0] // 2
    DS: gl.constexpr = d_smem.shape[0]
    nk = K // BK
    for j in gl.static_range(XS):
        _load_x(x_desc, x_smem, x_ready, row0, j, nk)
    for j in gl.static_range(WS):
        _load_w(w_desc, w_smem, w_ready, wrow0, wrow1, j, nk)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[BM // 16, 1],
                                                  instr_shape=[16, 256, 16])
    acc = gl.zeros([BM, 256], gl.float32, mma)
    for k in range(nk):
        xs = k % XS
        ds = k % DS
        mbarrier.wait(x_ready.index(xs), (k // XS) & 1)
        mbarrier.wait(d_ready.index(ds), (k // DS) & 1)
        if DIAG != 2:  # (DIAG 2, a diagnostic: no wgmma)
            acc = warpgroup_mma(x_smem.index(xs), d_smem.index(ds).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(1, deps=[acc])
        if k > 0:  # the previous step's wgmma is done (in both warpgroups, after the barrier)
            gl.thread_barrier()
            mbarrier.arrive(d_empty.index((k - 1) % DS))
            _load_x(x_desc, x_smem, x_ready, row0, k - 1 + XS, nk)
            _load_w(w_desc, w_smem, w_ready, wrow0, wrow1, k - 1 + WS, nk)
    acc = warpgroup_mma_wait(0, deps=[acc])

    _epilogue(acc, out_ptr, g_ptr, topk_w_ptr, sorted_slot_ptr, e, row0, nrows, col0, N_OUT, GEMM1, BM)


@gluon.jit
def _epilogue(acc, out_ptr, g_ptr, topk_w_ptr, sorted_slot_ptr, e, row0, nrows, col0, N_OUT: gl.constexpr,
              GEMM1: gl.constexpr, BM: gl.constexpr):
    """GEMM1: SwiGLU into ``h`` (sorted rows); GEMM2: times the routing weight into ``y`` (by slot)."""
    mma: gl.constexpr = acc.type.layout
    g = gl.load(g_ptr + e) * 4194304.0  # the decoded tiles' 2^-22
    m = gl.arange(0, BM, layout=gl.SliceLayout(1, mma))
    n = gl.arange(0, 256, layout=gl.SliceLayout(0, mma))
    rows = gl.zeros([BM, 256], gl.int32, mma) + m[:, None]
    cols = gl.zeros([BM, 256], gl.int32, mma) + n[None, :]
    if GEMM1:  # columns 0..127 gate rows i, 128..255 the same up rows: both in one thread
        gate, up = gl.split(gl.permute(gl.reshape(acc * g, [BM, 2, 128]), [0, 2, 1]))
        r, _ = gl.split(gl.permute(gl.reshape(rows, [BM, 2, 128]), [0, 2, 1]))
        c, _ = gl.split(gl.permute(gl.reshape(cols, [BM, 2, 128]), [0, 2, 1]))
        h = gate / (1.0 + gl.exp(-gate)) * up
        mask = r < nrows
        offs = (row0 + r).to(gl.int64) * N_OUT + col0 + c
        gl.store(out_ptr + offs, h.to(gl.bfloat16), mask=mask)
    else:
        mask = rows < nrows
        slot = gl.load(sorted_slot_ptr + row0 + m, mask=m < nrows, other=0)
        route = gl.load(topk_w_ptr + slot, mask=m < nrows, other=0.0)
        y = acc * g * route[:, None]
        offs = slot.to(gl.int64)[:, None] * N_OUT + col0 + cols
        gl.store(out_ptr + offs, y, mask=mask)


@gluon.jit
def _ws_gemm_kernel(x_desc, w_desc, s_ptr, g_ptr, out_ptr, topk_w_ptr, sorted_slot_ptr,
                    block_expert_ptr, block_row_start_ptr, block_row_end_ptr,
                    N_OUT: gl.constexpr, K: gl.constexpr, EXPERT_PAIR_ROWS: gl.constexpr, SECOND_BOX: gl.constexpr,
                    GEMM1: gl.constexpr, BM: gl.constexpr, XS: gl.constexpr, WS: gl.constexpr, DS: gl.constexpr,
                    DECODER_REGS: gl.constexpr, DIAG: gl.constexpr = 0):
    """Program (weight tile, row block). GEMM1: tile ``t`` is gate rows ``128 t ..`` and the same up
    rows (``SECOND_BOX`` = I / 2 pair rows further); GEMM2: weight rows ``256 t ..`` (second box 64
    pair rows further). ``EXPERT_PAIR_ROWS``: pair rows per expert in the weight descriptor."""
    t = gl.program_id(0)
    b = gl.program_id(1)
    e = gl.load(block_expert_ptr + b)
    if e >= 0:
        row0 = gl.load(block_row_start_ptr + b)
        nrows = gl.load(block_row_end_ptr + b) - row0
        wrow0 = e * EXPERT_PAIR_ROWS + t * (PAIRS if GEMM1 else 2 * PAIRS)
        wrow1 = wrow0 + SECOND_BOX
        # scale rows (weight rows) of the two boxes; GEMM1's output columns start at 128 t, GEMM2's at 256 t
        srow0 = 2 * wrow0
        srow1 = 2 * wrow1
        col0 = t * (128 if GEMM1 else 256)

        x_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        w_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)
        x_smem = gl.allocate_shared_memory(gl.bfloat16, [XS, BM, BK], x_layout)
        w_smem = gl.allocate_shared_memory(gl.uint8, [2 * WS, PAIRS, BK], w_layout)
        d_smem = gl.allocate_shared_memory(gl.bfloat16, [DS, 256, BK], x_layout)
        x_ready = gl.allocate_shared_memory(gl.int64, [XS, 1], mbarrier.MBarrierLayout())
        w_ready = gl.allocate_shared_memory(gl.int64, [WS, 1], mbarrier.MBarrierLayout())
        d_ready = gl.allocate_shared_memory(gl.int64, [DS, 1], mbarrier.MBarrierLayout())
        d_empty = gl.allocate_shared_memory(gl.int64, [DS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(XS):
            mbarrier.init(x_ready.index(i), count=1)
        for i in gl.static_range(WS):
            mbarrier.init(w_ready.index(i), count=1)
        for i in gl.static_range(DS):
            mbarrier.init(d_ready.index(i), count=1)
            mbarrier.init(d_empty.index(i), count=1)
        bars = (x_ready, w_ready, d_ready, d_empty)
        gl.warp_specialize([
            (_consumer, (x_desc, w_desc, x_smem, w_smem, d_smem, bars, out_ptr, g_ptr, topk_w_ptr, sorted_slot_ptr, e,
                         row0, nrows, col0, wrow0, wrow1, N_OUT, K, GEMM1, BM, DIAG)),
            (_producer, (w_smem, d_smem, bars, s_ptr, srow0, srow1, K, DIAG)),
        ], [4], [DECODER_REGS])


def _descriptor(t: torch.Tensor, block: list[int], swizzle: int):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    layout = gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=t.element_size() * 8, rank=2)
    return TensorDescriptor.from_tensor(t, block, layout)


def ws_prefill_gemms(x_sorted, w13, s13, g13, w2, s2, g2, topk_weights, sorted_slot, block_expert, row_start,
                     row_end, bm: int = BLOCK_M, stages=(4, 6, 2), maxnreg: int = 168, decoder_regs: int = 128,
                     diag: int = 0):
    """Both GEMMs: ``x_sorted [S, H]`` bf16 (activations in expert-sorted row order) ->
    ``y [S, H]`` float32 by slot (the top-k sum is the caller's). Weights in the paired layout
    (int32 ``w13 [E, I, H/4]``, ``w2 [E, H/2, I/4]``), scales as bytes; the row blocks as
    :func:`.launch.route` makes them with ``block_m = bm``. ``stages``: slots of the activation,
    weight-box and decoded-tile rings (4 + 6 + 2: 176 KB of shared memory). ``diag`` (diagnostics,
    wrong results): 1 skips the decode, 2 the wgmma, to time each side alone; 3 reads step 0's
    block scales at every step (the cost of the scales' L2 traffic)."""
    num_slots, hidden = x_sorted.shape
    inter = s13.shape[1] // 2
    num_experts = w13.shape[0]
    xs, ws, ds = stages
    h = torch.empty(num_slots, inter, dtype=torch.bfloat16, device=x_sorted.device)
    y = torch.empty(num_slots, hidden, dtype=torch.float32, device=x_sorted.device)
    blocks = block_expert.numel()
    common = dict(BM=bm, XS=xs, WS=ws, DS=ds, DECODER_REGS=decoder_regs, DIAG=diag, num_warps=bm // 16,
                  maxnreg=maxnreg)
    w13_bytes = w13.view(torch.uint8).reshape(num_experts * inter, hidden)
    _ws_gemm_kernel[(inter // 128, blocks)](
        _descriptor(x_sorted, [bm, BK.value], 128), _descriptor(w13_bytes, [PAIRS.value, BK.value], 0), s13.view(torch.uint8), g13, h,
        topk_weights, sorted_slot, block_expert, row_start, row_end,
        N_OUT=inter, K=hidden, EXPERT_PAIR_ROWS=inter, SECOND_BOX=inter // 2, GEMM1=True, **common)
    w2_bytes = w2.view(torch.uint8).reshape(num_experts * hidden // 2, inter)
    _ws_gemm_kernel[(hidden // 256, blocks)](
        _descriptor(h, [bm, BK.value], 128), _descriptor(w2_bytes, [PAIRS.value, BK.value], 0), s2.view(torch.uint8), g2, y,
        topk_weights, sorted_slot, block_expert, row_start, row_end,
        N_OUT=hidden, K=inter, EXPERT_PAIR_ROWS=hidden // 2, SECOND_BOX=PAIRS.value, GEMM1=False, **common)
    return y
