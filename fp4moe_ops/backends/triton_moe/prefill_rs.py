"""Prefill GEMMs with the FP4 decode into wgmma's register operand (Gluon, Hopper; issue 17).

The weights are the MMA's left operand, decoded by the warps that issue the MMA straight into the
registers wgmma reads (as CUTLASS's mixed-input GEMMs do), while the previous step's wgmma runs;
the activations are the right operand, from shared memory. Nothing decoded goes through shared
memory, which the warp-specialized kernels (:mod:`.prefill_ws`) spend 2 x 32 KB of bandwidth per
K step on.

One program (8 warps, 2 warpgroups) computes ``[256 weight rows, BM = 128 tokens]`` of one
expert's row block over K in 64-wide steps:

- TMA copies of each step's activation tile ``[128 tokens, 64]`` bf16 and two paired-layout weight
  boxes ``[64 pair rows, 64 bytes]`` into a ring of ``STAGES`` slots;
- each thread decodes its own fragments: a paired word (rows r and r + 8, one 2-byte unit each)
  is exactly the four bf16x2 registers of one 16-wide K chunk of wgmma's A operand when K runs in
  :func:`.layout.fragment_order` (chunk 64), so the activations are stored that way (the gather
  copy for GEMM1, GEMM1's epilogue for ``h``);
- GEMM1's tile is 128 gate rows then the same up rows (rows r and r + 128 in one thread: SwiGLU
  without exchange); GEMM2's is 256 consecutive rows of ``w2``.

Decoded values carry a 2^-22 factor, folded into the global scale in the epilogue (as in
:mod:`.kernels`). bf16 activations only; written for Triton 3.6's Gluon (the GPU machine's).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from .kernels import _PAIRED_WORD_TO_BF16
from .layout import fragment_column, fragment_order

BLOCK_M = 128  # tokens per row block (wgmma N)
BK = gl.constexpr(64)  # K per step
PAIRS = gl.constexpr(64)  # pair rows per weight box (128 weight rows)

_WORD_TO_BF16 = gl.constexpr(_PAIRED_WORD_TO_BF16.value)
_fragment_column = gluon.jit(fragment_column)  # plain index arithmetic, shared with .layout
_SPLIT_HALVES = gl.constexpr("mov.b32 {$0, $1}, $2;")  # int32 -> its two bf16 halves (no instruction)

# E4M3 block-scale byte -> bf16x2 of scale * 2^104 in both halves (see prefill_ws._E4M3_TO_BF16X2)
_E4M3_TO_BF16X2 = gl.constexpr("""
{
.reg .b32 t, c;
mov.b32 c, 0x77807780;
and.b32 t, $1, 0x7F; shl.b32 t, t, 4; prmt.b32 t, t, 0, 0x1010;
mul.rn.bf16x2 t, t, c; mul.rn.bf16x2 $0, t, c;
}
""")


@gluon.jit
def _operand_layouts(mma: gl.constexpr):
    """The decode's layouts, derived from wgmma's A-operand layout for a ``[256, 64]`` tile:
    returns a ``[128 pair rows, 4, 4]`` int32 zero tensor (pair row, ``t``, ``j``: word ``4 t + j``)
    whose layout gives each thread the words of its own fragments (pair rows ``64 box + 8 warp +
    lane // 4``, ``t = lane % 4``, all ``j``)."""
    la: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    ref = gl.zeros([256, 64], gl.bfloat16, la)
    # row 128 box + 16 a + 8 rs + b, column 16 j + 8 s + 2 t + e
    ref = gl.reshape(ref, [2, 8, 2, 8, 4, 2, 4, 2])
    ref = gl.permute(ref, [0, 1, 3, 6, 4, 2, 5, 7])  # box, a, b, t, j, rs, s, e
    ref = gl.reshape(ref, [128, 4, 4, 8])
    # the last dimension lives in registers; drop it
    return gl.max(ref.to(gl.int32), axis=3)


@gluon.jit
def _decode(words, sc_r, sc_r8):
    """``words [128, 4, 4]`` int32 (pair row, t, j) and the bf16x2 scales of rows r and r + 8
    (``[128, 4, 1]``) -> the A operand ``[256, 64]`` bf16 (rows in tile order, K in fragment order)."""
    o0, o1, o2, o3 = gl.inline_asm_elementwise(
        _WORD_TO_BF16, "=r,=r,=r,=r,r,r,r", [words, sc_r, sc_r8],
        dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1)
    v = gl.join(gl.join(o0, o1), gl.join(o2, o3))  # [128, t, j, rs, s]
    lo, hi = gl.inline_asm_elementwise(_SPLIT_HALVES, "=h,=h,r", [v], dtype=(gl.bfloat16, gl.bfloat16),
                                       is_pure=True, pack=1)
    a = gl.join(lo, hi)  # [128, t, j, rs, s, e]
    a = gl.reshape(a, [2, 8, 8, 4, 4, 2, 2, 2])  # box, a, b, t, j, rs, s, e
    a = gl.permute(a, [0, 1, 5, 2, 4, 6, 3, 7])  # box, a, rs, b, j, s, t, e
    return gl.reshape(a, [256, 64])


@gluon.jit
def _scale_offsets(srow0, srow1, K, layout: gl.constexpr):
    """Byte offsets of step 0's block scales of rows r, ``[128, 4]`` (pair row, t): the words
    ``4 t .. 4 t + 3`` of a 64-wide step cover K ``16 t .. 16 t + 15`` (fragment order), block ``t``."""
    p = gl.arange(0, 128, layout=gl.SliceLayout(1, layout))
    t = gl.arange(0, 4, layout=gl.SliceLayout(0, layout))
    q = p % 64
    row = gl.where(p < 64, srow0, srow1) + (q // 8) * 16 + q % 8
    return row.to(gl.int64)[:, None] * (K // 16) + t[None, :]


@gluon.jit
def _scales_bf16x2(raw):
    return gl.inline_asm_elementwise(_E4M3_TO_BF16X2, "=r,r", [raw.to(gl.int32)], dtype=gl.int32, is_pure=True,
                                     pack=1)


@gluon.jit
def _issue(x_desc, w_desc, x_smem, w_smem, ready, row0, wbox, wpair, j, nk):
    """Step ``j``'s TMA copies into its ring slot: the activation tile and both weight boxes (one
    3-D box: boxes ``wbox``, ``wbox + 1`` of the weights viewed as ``[boxes, pair rows, bytes]``)."""
    S: gl.constexpr = x_smem.shape[0]
    if j < nk:
        s = j % S
        mbarrier.expect(ready.index(s), x_desc.block_type.nbytes + w_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(x_desc, [row0, j * BK], ready.index(s), x_smem.index(s))
        tma.async_copy_global_to_shared(w_desc, [wbox, wpair, j * BK], ready.index(s), w_smem.index(s))


@gluon.jit
def _rs_gemm_kernel(x_desc, w_desc, s_ptr, g_ptr, out_ptr, topk_w_ptr, sorted_slot_ptr,
                    block_expert_ptr, block_row_start_ptr, block_row_end_ptr,
                    N_OUT: gl.constexpr, K: gl.constexpr, EXPERT_PAIR_ROWS: gl.constexpr, SECOND_BOX: gl.constexpr,
                    GEMM1: gl.constexpr, BM: gl.constexpr, STAGES: gl.constexpr, DIAG: gl.constexpr = 0):
    """Program (weight tile ``t``, row block ``b``); tiles as in :mod:`.prefill_ws`. ``DIAG`` 1 (a
    diagnostic, wrong results): no decode, the A operand is a constant."""
    t = gl.program_id(0)
    b = gl.program_id(1)
    e = gl.load(block_expert_ptr + b)
    if e >= 0:
        row0 = gl.load(block_row_start_ptr + b)
        nrows = gl.load(block_row_end_ptr + b) - row0
        wrow0 = e * EXPERT_PAIR_ROWS + t * (PAIRS if GEMM1 else 2 * PAIRS)
        wrow1 = wrow0 + SECOND_BOX
        col0 = t * (128 if GEMM1 else 256)
        if GEMM1:  # w13 as [2E, I/2, H] bytes: gate half 2e, up half 2e + 1, pair rows 64 t ..
            wbox = 2 * e
            wpair = t * PAIRS
        else:  # w2 as [E H/128, 64, I] bytes: boxes of 64 pair rows
            wbox = wrow0 // PAIRS
            wpair = 0

        x_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        w_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=3)
        x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BK], x_layout)
        w_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, 2, PAIRS, BK], w_layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
        # a slot's two boxes as one [128 pair rows, 4, 4] tile of words
        w_words = w_smem._reinterpret(gl.int32, [STAGES, 2 * PAIRS, 4, 4], gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))

        nk = K // BK
        for j in gl.static_range(STAGES):
            _issue(x_desc, w_desc, x_smem, w_smem, ready, row0, wbox, wpair, j, nk)

        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, BM, 16])
        wl: gl.constexpr = _operand_layouts(mma).type.layout
        la: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        offs = _scale_offsets(2 * wrow0, 2 * wrow1, K, gl.SliceLayout(2, wl))
        below = 8 * (K // 16)  # rows r + 8
        ra = gl.load(s_ptr + offs)
        rb = gl.load(s_ptr + offs + below)
        na = gl.load(s_ptr + offs + 4 * gl.minimum(1, nk - 1))
        nb = gl.load(s_ptr + offs + below + 4 * gl.minimum(1, nk - 1))
        acc = gl.zeros([256, BM], gl.float32, mma)
        # Two A operands, for even and odd steps: wgmma reads its register operand while it runs,
        # and ptxas does not guard those registers (a single loop-carried operand, copied at the
        # back edge, left the decode of step k + 1 writing the registers wgmma k was reading: wrong
        # sums and NaN on H200). Each is rewritten only after the wait that retires its wgmma.
        a_odd = gl.zeros([256, BK], gl.bfloat16, la)
        scales = (ra, rb, na, nb)
        ring = (x_desc, w_desc, x_smem, w_smem, w_words, ready, row0, wbox, wpair, nk)
        for k in range(0, nk, 2):  # (K a multiple of 128)
            acc, a_even, scales = _step(k, acc, a_odd, scales, ring, s_ptr, offs, below, wl, la, DIAG)
            acc, a_odd, scales = _step(k + 1, acc, a_even, scales, ring, s_ptr, offs, below, wl, la, DIAG)
        acc, a_odd = warpgroup_mma_wait(0, deps=[acc, a_odd])
        _epilogue(acc, out_ptr, g_ptr, topk_w_ptr, sorted_slot_ptr, e, row0, nrows, col0, N_OUT, GEMM1, BM)


@gluon.jit
def _step(k, acc, a_prev, scales, ring, s_ptr, offs, below, wl: gl.constexpr, la: gl.constexpr, DIAG: gl.constexpr):
    """K step ``k``: decode its A operand, issue its wgmma, retire step k - 1's (``a_prev``, held
    in registers till here), refill that step's slot. ``scales``: raw bytes of steps k, k + 1
    (rows r, rows r + 8), returned for k + 1, k + 2."""
    x_desc, w_desc, x_smem, w_smem, w_words, ready, row0, wbox, wpair, nk = ring
    STAGES: gl.constexpr = x_smem.shape[0]
    ra, rb, na, nb = scales
    s = k % STAGES
    ahead = 4 * gl.minimum(k + 2, nk - 1)
    ca = gl.load(s_ptr + offs + ahead)
    cb = gl.load(s_ptr + offs + below + ahead)
    mbarrier.wait(ready.index(s), (k // STAGES) & 1)
    if DIAG == 1:
        a = gl.full([256, BK], 1.0, gl.bfloat16, la)
    else:
        words = w_words.index(s).load(wl)
        a = _decode(words, gl.expand_dims(_scales_bf16x2(ra), 2), gl.expand_dims(_scales_bf16x2(rb), 2))
        a = gl.convert_layout(a, la, assert_trivial=True)
    acc = warpgroup_mma(a, x_smem.index(s).permute((1, 0)), acc, is_async=True)
    acc, a_prev = warpgroup_mma_wait(1, deps=[acc, a_prev])
    if k > 0:  # step k - 1's wgmma is done in both warpgroups: its slot can be refilled
        gl.thread_barrier()
        _issue(x_desc, w_desc, x_smem, w_smem, ready, row0, wbox, wpair, k - 1 + STAGES, nk)
    return acc, a, (na, nb, ca, cb)


@gluon.jit
def _epilogue(acc, out_ptr, g_ptr, topk_w_ptr, sorted_slot_ptr, e, row0, nrows, col0, N_OUT: gl.constexpr,
              GEMM1: gl.constexpr, BM: gl.constexpr):
    """GEMM1: SwiGLU into ``h`` (sorted rows, K of GEMM2 in fragment order); GEMM2: times the
    routing weight into ``y`` (by slot). ``acc [256 weight rows, BM tokens]``."""
    mma: gl.constexpr = acc.type.layout
    g = gl.load(g_ptr + e) * 4194304.0  # the decoded tiles' 2^-22
    m = gl.arange(0, 256, layout=gl.SliceLayout(1, mma))
    n = gl.arange(0, BM, layout=gl.SliceLayout(0, mma))
    if GEMM1:  # rows 0..127 gate rows i, 128..255 the same up rows: both in one thread
        rows = gl.zeros([256, BM], gl.int32, mma) + m[:, None]
        toks = gl.zeros([256, BM], gl.int32, mma) + n[None, :]
        gate, up = gl.split(gl.permute(gl.reshape(acc * g, [2, 128, BM]), [1, 2, 0]))
        c, _ = gl.split(gl.permute(gl.reshape(rows, [2, 128, BM]), [1, 2, 0]))
        tok, _ = gl.split(gl.permute(gl.reshape(toks, [2, 128, BM]), [1, 2, 0]))
        h = gate / (1.0 + gl.exp(-gate)) * up
        offs = (row0 + tok).to(gl.int64) * N_OUT + _fragment_column(col0 + c, 64)
        gl.store(out_ptr + offs, h.to(gl.bfloat16), mask=tok < nrows)
    else:
        valid = n < nrows
        slot = gl.load(sorted_slot_ptr + row0 + n, mask=valid, other=0)
        route = gl.load(topk_w_ptr + slot, mask=valid, other=0.0)
        y = acc * g * route[None, :]
        offs = slot.to(gl.int64)[None, :] * N_OUT + col0 + m[:, None]
        gl.store(out_ptr + offs, y, mask=valid[None, :])


def _descriptor(t: torch.Tensor, block: list[int], swizzle: int):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    layout = gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=t.element_size() * 8, rank=t.dim())
    return TensorDescriptor.from_tensor(t, block, layout)


def gather_fragment_order(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``x[rows]`` with each 64-wide piece of K in fragment order (GEMM1's activations)."""
    return fragment_order(x, 64).index_select(0, rows)


def rs_prefill_gemms(x_sorted, w13, s13, g13, w2, s2, g2, topk_weights, sorted_slot, block_expert, row_start,
                     row_end, stages: int = 6, diag: int = 0):
    """Both GEMMs: ``x_sorted [S, H]`` bf16 (activations in expert-sorted row order, K in fragment
    order, :func:`gather_fragment_order`) -> ``y [S, H]`` float32 by slot (the top-k sum is the
    caller's). Weights and row blocks as for :func:`.prefill_ws.ws_prefill_gemms`."""
    num_slots, hidden = x_sorted.shape
    inter = s13.shape[1] // 2
    num_experts = w13.shape[0]
    h = torch.empty(num_slots, inter, dtype=torch.bfloat16, device=x_sorted.device)
    y = torch.empty(num_slots, hidden, dtype=torch.float32, device=x_sorted.device)
    blocks = block_expert.numel()
    common = dict(BM=BLOCK_M, STAGES=stages, DIAG=diag, num_warps=8)
    w13_bytes = w13.view(torch.uint8).reshape(2 * num_experts, inter // 2, hidden)
    _rs_gemm_kernel[(inter // 128, blocks)](
        _descriptor(x_sorted, [BLOCK_M, BK.value], 128), _descriptor(w13_bytes, [2, PAIRS.value, BK.value], 0),
        s13.view(torch.uint8), g13, h, topk_weights, sorted_slot, block_expert, row_start, row_end,
        N_OUT=inter, K=hidden, EXPERT_PAIR_ROWS=inter, SECOND_BOX=inter // 2, GEMM1=True, **common)
    w2_bytes = w2.view(torch.uint8).reshape(num_experts * hidden // 128, PAIRS.value, inter)
    _rs_gemm_kernel[(hidden // 256, blocks)](
        _descriptor(h, [BLOCK_M, BK.value], 128), _descriptor(w2_bytes, [2, PAIRS.value, BK.value], 0),
        s2.view(torch.uint8), g2, y, topk_weights, sorted_slot, block_expert, row_start, row_end,
        N_OUT=hidden, K=inter, EXPERT_PAIR_ROWS=hidden // 2, SECOND_BOX=PAIRS.value, GEMM1=False, **common)
    return y
