"""Triton fused-MoE backend (a package: ``kernels`` the GPU code, ``prefill_rs`` the Gluon kernels
for large prefills on Hopper, ``decode_v3`` the Gluon kernels for up to 6 rows per expert on
Hopper, ``layout`` the data layouts, ``launch`` routing and launches,
``compile_ahead`` launch sequences that only compile (every kernel variant of a layer at its first
call), ``backend`` the op's view): exact NVFP4 weights x 16-bit activations (W4A16), any CUDA GPU
Triton supports, written for Hopper (SM90) where FlashInfer's NVFP4 kernel does not run. The same
decode loops serve ``fp4moe::nvfp4_linear``'s ``"triton"`` backend (one weight, K split into parts:
``launch.triton_nvfp4_linear``; ``decode_v3``'s on weights in the paired layout).

Pipeline of one call (no host syncs, CUDA-graph capturable):

1. ``route``: group the ``S = T*k`` (token, expert) slots by expert on the device and cut each
   expert's slots into blocks of ``BLOCK_M`` rows: ``block_expert [B]`` (-1 = unused block),
   ``block_row_start/end [B]`` into ``sorted_slot [S]``. ``B`` is a static upper bound. A
   one-token call skips this launch: its ``k`` slots are the blocks, read from the ids by the GEMMs.
2. ``_gate_up_swiglu_kernel``: per (block, N tile) program, gather the block's token rows,
   stream the expert's packed gate and up rows (where TMA fits, half a tile of each in one K
   loop), dequantize in registers, bf16 tensor-core dots with fp32 accumulators, apply the
   global scale and ``silu(gate) * up``; store ``[S, I]`` rows in the activation dtype (slot order).
3. ``_down_kernel``: same over ``down``, times the routing weight, into ``[S, H]`` fp32.
4. ``_sum_topk_kernel``: ``out[t] = sum_j y[t*k + j]`` over valid slots, cast to the input dtype
   (deterministic: no atomics).

From 64 rows per expert on Hopper (bf16 activations, paired weights, Triton 3.6), steps 2-3 are
instead ``prefill_rs``'s kernels over 128-row blocks of activations gathered in expert order (the
FP4 decode straight into wgmma's register operand, overlapping the previous step's wgmma), an
expert's last block of at most 64 rows in 64-token tiles of a launch of its own. Up to 6 rows
per expert (DeepSeek-V3: 1-192 tokens), on the same condition, steps 2-3 are ``decode_v3``'s:
``mma.sync`` with the weights and scales through a TMA ring, 8-row blocks (0.76-1.02x the time of
the kernels above on the H200; ``x`` read in natural order, so the routing launch makes no
permuted copy).

Only experts that some token picked are read, each weight byte once per (M block, N tile).
Where H and I are multiples of 256 (every real MoE shape), weight and scale tiles come through
TMA descriptors over ``[E*N, K/2]`` / ``[E*N, K/16]`` (bulk copies pipelined over
``num_stages``), and the K axis of both dots runs in MMA-fragment order (:func:`fragment_order`):
each thread's weight bytes are then one contiguous run per row, read with vector loads, instead
of single bytes (1.4-1.5x at decode on H200). The activations are permuted once per call (in
the routing launch; a one-token call's gate_up GEMM reads them permuted instead) and the gate_up GEMM writes its
output already permuted for the down GEMM. The backend stores
those shapes' packed weights in its own paired layout (:func:`paired_weight_layout`: rows r and
r+8 per 32-bit word, bits pre-permuted), which cuts the decode from 2.25 to 1.5 instructions per
element (a further 0.88-0.93x at decode); canonical weights still run, a little slower.
gpt-oss's experts (H = I = 2880, multiples of 64) run the same TMA kernels with a partial last K
step (TMA reads zeros past K; :func:`.layout.fits_tma_edges`, ``kernel_config(edges=True)``).
Routing for decode-sized batches is one kernel (a counting sort, 64 slots per program); prefill-sized
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

from .backend import PAIRED, TritonBackend
from .launch import FAST_ROUTE_MAX_SLOTS, interpreting, kernel_config, route, triton, triton_fused_moe, triton_gpt_oss_moe
from .layout import canonical_from_paired, fits_tma, fragment_order, gpt_oss_checkpoint_tensors, gpt_oss_kernel_tensors, \
    paired_weight_layout

__all__ = [
    "FAST_ROUTE_MAX_SLOTS", "PAIRED", "TritonBackend", "canonical_from_paired", "fits_tma", "fragment_order",
    "gpt_oss_checkpoint_tensors", "gpt_oss_kernel_tensors", "interpreting", "kernel_config", "paired_weight_layout",
    "route", "triton", "triton_fused_moe", "triton_gpt_oss_moe",
]
