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
of single bytes (1.4-1.5x at decode on H200). The weights stay in the canonical layout; the
activations are permuted once per call and GEMM1 writes its output already permuted for GEMM2.
Routing for decode-sized batches is one single-program kernel (sort + histogram); prefill-sized
batches use a few torch ops.

Weight decode (exact): every dequantized weight is ``e2m1 * e4m3 * 2^-22`` in bf16 (at most 6
significant bits, >= 2^-32, so exact); the ``2^22`` is folded into the per-expert global scale
applied to the fp32 accumulator. On the GPU an inline-PTX routine turns 8 packed codes into 8
bf16 with bit masks, one integer multiply per pair and one ``mul.bf16x2`` by the block scale
(``_E2M1X8_TO_BF16``); the portable path (fp16 and Triton's CPU interpreter) builds the same
values from fp16 bit patterns: code ``c`` as ``(c & 7) << 9 | (c & 8) << 12`` is
``value * 2^-14`` and E4M3 byte ``b`` as ``(b & 0x7F) << 7`` is ``scale * 2^-8``.
"""

from __future__ import annotations

import os

import torch

from .base import Backend, register_backend

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
                                    FAST_DECODE: tl.constexpr):
        """:func:`_decode_tile` with the K axis in MMA-fragment order (see :func:`fragment_order`):
        ``[BN, BK]`` whose column ``16j + 8s + 2t + e`` is the weight at ``k = (BK/4)t + 4j + 2e + s``.

        Why: a tensor-core operand gives each thread of a quad ``t`` the k pairs ``2t, 2t+1`` and
        ``2t+8, 2t+9`` of every 16-wide step. In natural order those come from bytes all over the
        row (one byte load each, then byte shuffles); in this order a thread's bytes are one
        contiguous ``BK/8``-byte run per row (vector loads) and span only 4 scale blocks. The
        activations are fed in the same order, so the dot product is unchanged.
        """
        p = packed.reshape(BN, 4, BK // 16, 2)  # byte (BK/8)t + 2j + e -> [row, t, j, e]
        scale = _e4m3_f32(sbytes).reshape(BN, 4, BK // 64, 1, 1)  # block of byte b is b // 8
        scale = tl.broadcast_to(scale, (BN, 4, BK // 64, 4, 2)).reshape(BN, 4, BK // 16, 2)
        if FAST_DECODE and OUT_DTYPE == tl.bfloat16:
            lo, hi = tl.inline_asm_elementwise(
                _E2M1X8_TO_BF16, "=r,=r,=r,=r,r,r,r", [p, (scale * 2.0**112).to(tl.bfloat16)],
                dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        else:
            lo = _finish(_e2m1_f32(p & 0xF) * scale, OUT_DTYPE)
            hi = _finish(_e2m1_f32(p >> 4) * scale, OUT_DTYPE)
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
                       FRAGMENT_ORDER: tl.constexpr = False):
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
                packed = w_desc.load([desc_row, k0 // 2])
                sbytes = s_desc.load([desc_row, k0 // 16])
            elif PREFETCH:
                more = (k0 + BK) < K  # the last iteration loads nothing
                packed_next = tl.load(w_ptrs + (k0 + BK) // 2, mask=(kb[None, :] * 0 + more) != 0, other=0)
                sbytes_next = tl.load(s_ptrs + (k0 + BK) // 16, mask=(ks[None, :] * 0 + more) != 0, other=0)
            else:
                packed = tl.load(w_ptrs + k0 // 2)
                sbytes = tl.load(s_ptrs + k0 // 16)
            if FRAGMENT_ORDER:
                w = _decode_tile_fragment_order(packed, sbytes, BN, BK, dtype, FAST_DECODE)
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
        SPLIT_GATE_UP: tl.constexpr = False,
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
                                     FRAGMENT_ORDER)
                tl.store(out_ptr + slots[None, :] * (2 * I) + cols[:, None], acc * g, mask=row_mask[None, :])
                return
            cols = tl.program_id(1) * BN + tl.arange(0, BN)
            row0 = e * (2 * I) + tl.program_id(1) * BN  # descriptor row of this tile in [E * 2I, H/2]
            acc_gate = _expert_matmul(zero, w_e, s_e, cols, x_ptr, tokens, row_mask, H, BN, BK, PREFETCH, FAST_DECODE,
                                      INTERPRET, w_desc, s_desc, row0, TMA, FRAGMENT_ORDER)
            acc_up = _expert_matmul(zero, w_e, s_e, cols + I, x_ptr, tokens, row_mask, H, BN, BK, PREFETCH, FAST_DECODE,
                                    INTERPRET, w_desc, s_desc, row0 + I, TMA, FRAGMENT_ORDER)
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
        TMA: tl.constexpr, FRAGMENT_ORDER: tl.constexpr = False,
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
                                 e * H + tl.program_id(1) * BN, TMA, FRAGMENT_ORDER)
            g = tl.load(g_ptr + e)
            if a_ptr.dtype.element_ty == tl.bfloat16:
                g = g * 4194304.0
            route = tl.load(topk_weights_ptr + slots, mask=row_mask, other=0.0)
            y = acc * g * route[None, :]
            tl.store(out_ptr + slots[None, :] * H + cols[:, None], y, mask=row_mask[None, :])

    @triton.jit
    def _route_kernel(ids_ptr, sorted_slot_ptr, block_expert_ptr, block_row_start_ptr, block_row_end_ptr,
                      S, E, NUM_BLOCKS,
                      BM: tl.constexpr, S_PAD: tl.constexpr, E_PAD: tl.constexpr, B_PAD: tl.constexpr):
        """:func:`route` in one program (decode-sized S): one launch instead of ~12 torch ops."""
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


def route(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Group slots by expert and cut them into ``block_m``-row blocks, on the device.

    Returns ``(sorted_slot [S] int32, block_expert [B] int32 (-1 unused), block_row_start [B],
    block_row_end [B])`` with ``B = min(S, E) + S // block_m`` (a bound on the blocks needed:
    each expert hit adds at most one partial block). Invalid ids are dropped.
    """
    flat = topk_ids.reshape(-1)
    num_slots = flat.numel()
    num_blocks = min(num_slots, num_experts) + num_slots // block_m
    if num_slots <= FAST_ROUTE_MAX_SLOTS and triton is not None and (flat.is_cuda or interpreting()):
        out = torch.empty(num_slots + 3 * num_blocks, dtype=torch.int32, device=flat.device)
        sorted_slot, block_expert, row_start, row_end = out.split([num_slots] + [num_blocks] * 3)
        _route_kernel[(1,)](
            flat, sorted_slot, block_expert, row_start, row_end, num_slots, num_experts, num_blocks,
            BM=block_m, S_PAD=triton.next_power_of_2(num_slots), E_PAD=triton.next_power_of_2(num_experts + 1),
            B_PAD=triton.next_power_of_2(num_blocks), num_warps=4,
        )
        return sorted_slot, block_expert, row_start, row_end
    return _route_torch(flat, num_experts, block_m, num_blocks)


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
    # TMA boxes need BK >= 256 (a box row of scales >= 16 bytes, every row 16-byte aligned),
    # i.e. H and I multiples of 256, as in every DeepSeek/Qwen/Mixtral shape.
    fits_tma = hidden % 256 == 0 and inter % 256 == 0
    if decode:
        bm, bn1, bk1, bn2, bk2, warps, stages, prefetch = 16, 64, 256, 64, 256, 4, 3, False
    elif fits_tma:  # prefill, tensor-core bound: 1.8x / 1.37x over the plain-load tiles at 2048 / 8192 tokens
        bm, bn1, bk1, bn2, bk2, warps, stages, prefetch = 64, 128, 256, 128, 256, 8, 3, False
    else:
        bm, bn1, bk1, bn2, bk2, warps, stages, prefetch = 128, 128, 128, 128, 128, 8, 2, True
    cfg = dict(
        BM=bm, BN1=_pow2_divisor(inter, bn1), BK1=_pow2_divisor(hidden, bk1),
        BN2=_pow2_divisor(hidden, bn2), BK2=_pow2_divisor(inter, bk2),
        num_warps=warps, num_stages=stages, PREFETCH=prefetch,
    )
    # Weights through TMA (bulk copies pipelined over num_stages, 1.2x at decode on H200), and K
    # in MMA-fragment order: vector loads of each thread's weight bytes instead of byte loads and
    # shuffles (933 -> 562 instructions per K step of the decode GEMM2 loop, sm90 SASS; 1.4-1.5x).
    cfg["TMA"] = cfg["FRAGMENT_ORDER"] = fits_tma
    # Gate and up tiles in separate programs: 2x the programs for GEMM1, which at decode has too
    # few to fill 132 SMs (1.07-1.09x at 1 and 8 tokens, within 4% elsewhere in the bucket).
    # Costs an fp32 scratch of S x 2I (at most 16 rows x E: 67 MB for DeepSeek-V3 at 512 tokens).
    cfg["SPLIT_GATE_UP"] = decode
    return cfg


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
    """Run the Triton kernels; ``expert_tensors`` in the reference (canonical) layout. The tiles
    come from :func:`kernel_config` (``routed_experts``: see ``fp4moe::fused_moe``) unless
    ``config`` is given."""
    w13, s13, g13, w2, s2, g2 = expert_tensors
    num_tokens, hidden = hidden_states.shape
    top_k = topk_ids.shape[1]
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    num_slots = num_tokens * top_k
    cfg = config or kernel_config(num_slots, num_experts, hidden, inter, routed_experts)
    sorted_slot, block_expert, row_start, row_end = route(topk_ids, num_experts, cfg["BM"])
    x = hidden_states.contiguous()
    fragment = cfg.get("FRAGMENT_ORDER", False)
    launch = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], PREFETCH=cfg.get("PREFETCH", True),
                  FAST_DECODE=cfg.get("FAST_DECODE", not interpreting()), INTERPRET=interpreting(),
                  FRAGMENT_ORDER=fragment)

    inter_act = torch.empty(num_slots, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(num_slots, hidden, dtype=torch.float32, device=x.device)
    tma = cfg.get("TMA", False)
    split = cfg.get("SPLIT_GATE_UP", False)
    desc1 = _descriptors(w13, s13, cfg["BN1"], cfg["BK1"]) if tma else (w13, s13)
    desc2 = _descriptors(w2, s2, cfg["BN2"], cfg["BK2"]) if tma else (w2, s2)
    grid1 = (block_expert.numel(), (2 if split else 1) * inter // cfg["BN1"])
    pre_act = torch.empty(num_slots, 2 * inter, dtype=torch.float32, device=x.device) if split else inter_act
    _gemm1_swiglu_kernel[grid1](
        fragment_order(x, cfg["BK1"]) if fragment else x, w13, s13, g13, pre_act, sorted_slot, block_expert,
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
    ``[bn, bk/2]`` / ``[bn, bk/16]`` boxes (bk >= 256: a box row must be >= 16 bytes)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    w2d, s2d = w.reshape(-1, w.shape[-1]), s.reshape(-1, s.shape[-1])
    return TensorDescriptor.from_tensor(w2d, [bn, bk // 2]), TensorDescriptor.from_tensor(s2d, [bn, bk // 16])


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

    def unavailable_reason(self, device: torch.device) -> str | None:
        if triton is None:
            return "triton is not installed"
        if device.type != "cuda":
            return "needs a CUDA GPU"
        if torch.cuda.get_device_capability(device) < (8, 0):
            return "needs compute capability 8.0+ (bf16 tensor cores)"
        return None

    def run(self, hidden_states, topk_ids, topk_weights, expert_tensors, fc1_act_scale, fc2_act_scale,
            routed_experts=0):
        # Triton launches on the current device: make it the experts' (device_map spreads layers)
        with torch.cuda.device(hidden_states.device):
            return triton_fused_moe(hidden_states, topk_ids, topk_weights, expert_tensors,
                                    routed_experts=routed_experts)


register_backend(TritonBackend())
