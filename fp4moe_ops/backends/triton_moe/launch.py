"""Launching the Triton backend's kernels: routing (slots grouped by expert into row blocks),
the tile table by shape bucket, the launch sequence of one call, and every kernel variant of a
layer compiled at its first call; the same for one NVFP4 linear layer (``fp4moe::nvfp4_linear``'s
``"triton"`` backend)."""

from __future__ import annotations

import logging
import os
import warnings
from functools import partial

import torch

from ...env import env_switch
from ...relaunch import cdiv, next_power_of_2
from .compile_ahead import async_compile_active, compile_all, compiling_ahead, launch_or_compile, planned_slots
from .layout import GptOssTerms, fits_tma, fits_tma_edges, fragment_order, values_per_scale

try:
    import triton

    from .kernels import _dequant_kernel, _gate_up_swiglu_kernel, _down_kernel, _linear_kernel, _linear_parts_kernel, \
        _route_count_kernel, _route_kernel, _sum_topk_kernel
except ImportError:  # pragma: no cover - CPU installs without triton
    triton = None


_log = logging.getLogger("fp4moe")


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


# Up to here the routing kernel's programs each count every slot themselves (one launch); beyond
# (prefill), a first launch counts the slots of ROUTE_CHUNKS chunks and the placing launch reads
# those counts: two launches, where torch ops took ~15 and the tail split ~10 more
FAST_ROUTE_MAX_SLOTS = 4096
ROUTE_CHUNKS = 64
# From this many rows per expert on, the Gluon prefill kernels (prefill_rs.py) on Hopper, with an
# expert's last block in 64-token tiles when it holds 64 rows or fewer (GLUON_PREFILL_TAILS): faster
# than the single-role kernels from 64 rows, not at 32; a second, 32-row tail level gained nothing
# measurable and costs two more kernels to compile (measurements: benchmarks/NOTES.md, "Where launch.py's settings come from")
GLUON_PREFILL_MIN_ROWS = 64
GLUON_PREFILL_TAILS = (64,)
# Up to this many rows per expert, decode_v3's kernels in 8-row blocks (kernel_config)
V3_MAX_ROWS = 6
# The Triton releases (major.minor) the Gluon kernels (decode_v3.py, prefill_rs.py) compile on
# (checked in CI for sm_90 on the CPU, gluon_api.py resolving Gluon's renames) and were tested with
# on the H200: those torch 2.11-2.15 pin. Gluon is experimental and changes between releases, so
# another release runs the single-role kernels with a warning, unless FP4MOE_GLUON=1 (try them
# anyway) or FP4MOE_GLUON=0 (never: the single-role kernels everywhere).
GLUON_TRITON = ("3.6", "3.7", "3.8", "3.9")
ROUTE_CHUNK = 64  # slots each routing program places
# A layer's (an NVFP4 linear's) first call compiles every kernel variant its shape can launch, together
# (compile_layer_once, compile_linear_once); FP4MOE_COMPILE_AHEAD=0: each bucket's kernels compile
# when a call first reaches it. None: the variable decides, read at the first launch (not at import,
# so a value it does not understand is refused, naming it, whichever way the kernels are reached).
COMPILE_AHEAD: bool | None = None


def _compile_ahead() -> bool:
    global COMPILE_AHEAD
    if COMPILE_AHEAD is None:
        COMPILE_AHEAD = env_switch("FP4MOE_COMPILE_AHEAD", True)
    return COMPILE_AHEAD


def _round4(n: int) -> int:
    return (n + 3) // 4 * 4


def route(topk_ids: torch.Tensor, num_experts: int, block_m: int, activations: torch.Tensor | None = None,
          fragment_chunk: int = 0, pdl: bool = False, tail: int = 0):
    """Group slots by expert and cut them into ``block_m``-row blocks, on the device.

    Returns ``(sorted_slot [S] int32, block_expert [B] int32 (-1 unused), block_row_start [B],
    block_row_end [B])`` with ``B = min(S, E) + S // block_m`` (a bound on the blocks needed:
    each expert hit adds at most one partial block). Invalid ids are dropped. ``tail`` > 0 (the
    routing kernel only: CUDA or the interpreter): an expert's last block of at most ``tail`` rows
    is left out of the block table (-1) and put in a tail table, returned next: ``(tail_expert
    [E] (-1: none), tail_row_start [E], tail_row_end [E])``, indexed by expert. With
    ``activations [T, H]`` and ``fragment_chunk``, also returns them in :func:`fragment_order`
    (in the same launch as the routing kernel), last. ``pdl``: launch the routing kernel with
    programmatic dependent launch (see :func:`kernel_config`).
    """
    flat = topk_ids.reshape(-1)
    num_slots = flat.numel()
    num_blocks = min(num_slots, num_experts) + num_slots // block_m
    on_triton = triton is not None and (flat.is_cuda or interpreting())
    if tail and not on_triton:
        raise ValueError("route(tail=...) needs the routing kernel (a CUDA tensor, or TRITON_INTERPRET=1)")
    decide_slots = planned_slots(num_slots)  # (compile_ahead: the representative count)
    chunked = decide_slots > FAST_ROUTE_MAX_SLOTS
    if not on_triton:
        routed = _route_torch(flat, num_experts, block_m, num_blocks)
        if activations is None:
            return routed
        return (*routed, fragment_order(activations.contiguous(), fragment_chunk))
    e_pad = next_power_of_2(num_experts + 2)  # + bins for invalid ids, padding
    # one allocation, each part starting on a 16-byte boundary: the kernels reading these pointers
    # are specialized on alignment, which must not change with the token count
    sizes = [num_slots] + [num_blocks] * 3 + [num_experts] * (3 if tail else 0)
    # (zeros while compiling ahead: nothing writes them, and torch ops may index with them)
    alloc = torch.zeros if compiling_ahead() else torch.empty
    pieces = [size for n in sizes for size in (n, _round4(n) - n)]  # each part, then its padding
    out = alloc(sum(pieces), dtype=torch.int32, device=flat.device)
    routed = out.split_with_sizes(pieces)[::2]  # (one op for all the views: host time)
    count_block = _count_block(decide_slots)
    copy = activations is not None  # the permute runs in _route_kernel's last programs
    if chunked:
        chunk_slots = cdiv(cdiv(num_slots, ROUTE_CHUNKS), ROUTE_CHUNK) * ROUTE_CHUNK
        chunk_counts = alloc(ROUTE_CHUNKS * e_pad, dtype=torch.int32, device=flat.device)
        launch_or_compile(_route_count_kernel, (ROUTE_CHUNKS,), flat, chunk_counts, num_slots, num_experts,
                          chunk_slots, E_PAD=e_pad, COUNT_BLOCK=count_block, num_warps=4)
        route_programs = ROUTE_CHUNKS
    else:
        chunk_slots, chunk_counts = ROUTE_CHUNK, routed[0]  # (unused)
        route_programs = cdiv(num_slots, ROUTE_CHUNK)
    x = activations.contiguous() if copy else routed[0]  # (unused without the copy)
    x_fragment = torch.empty_like(x) if copy else x
    x_block = 1024
    grid = route_programs + (cdiv(x.numel(), x_block) if copy else 0)
    if grid:
        launch_or_compile(
            _route_kernel, (grid,), flat, *routed[:4], num_slots, num_experts, num_blocks, x, x_fragment,
            x.numel() if copy else 0, x.shape[-1] if copy else 1, chunk_counts, chunk_slots,
            *(routed[4:] if tail else routed[:1] * 3), BM=block_m, E_PAD=e_pad, R_CHUNK=ROUTE_CHUNK,
            COUNT_BLOCK=count_block, CHUNK=max(fragment_chunk, 16), X_BLOCK=x_block,
            CHUNKS=ROUTE_CHUNKS if chunked else 0, TAIL=tail, num_warps=4, **_pdl_args(pdl),
            **({"X_NATURAL_TAIL": True} if copy and x.shape[-1] % max(fragment_chunk, 16) else {}),
        )
    elif tail:  # no slots, no launch: no expert has a tail block
        routed[4].fill_(-1)
    return (*routed, x_fragment) if activations is not None else routed


def _pdl_args(pdl: bool) -> dict:
    """Launch arguments for programmatic dependent launch: the kernel waits for the previous one
    itself (``PDL``), so the launch may start it early (``launch_pdl``). Never in the interpreter."""
    pdl = pdl and not interpreting()
    return dict(PDL=pdl, launch_pdl=pdl) if pdl else {}


def _count_block(num_slots: int) -> int:
    """Slots each histogram step of the routing kernel reads: 64 for decode batches (at most 8
    tokens of top-8; a 1024-wide step there cost ~2 us of the 1-token layer), 1024 beyond. Two
    compiled variants in all."""
    return 64 if num_slots <= 64 else 1024


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


def kernel_config(num_slots: int, num_experts: int, hidden: int, inter: int, routed_experts: int = 0,
                  edges: bool = False) -> dict:
    """Tile sizes by shape bucket, chosen from H200 sweeps (benchmarks/probes/sweep_triton.py; the
    measurements behind each choice: benchmarks/NOTES.md, "Where launch.py's settings come from"). Static: nothing is tuned at call time or in graph capture.

    The bucket is the expected rows per expert: slots over the experts the router chooses among
    (``routed_experts``, e.g. 256 on an expert-parallel rank holding 32, or 288 for DeepSeek-V3's
    256 top-8 experts with the shared expert as a 257th on every token; 0: ``num_experts``).
    Counting only local experts would put an EP=8 rank's decode batches of 64+ tokens, ~2 real
    rows per expert, in the prefill bucket.

    ``edges``: the weights are gpt-oss's kernel layout (:func:`.layout.gpt_oss_kernel_tensors`), H
    and I multiples of 64 (2880 for gpt-oss) whose K edges the kernels mask (:func:`.layout.fits_tma_edges`):
    the same buckets and kernels as H and I multiples of 256, K tiles of 256 with a partial last one,
    weight tiles that divide N."""
    rows_per_expert = num_slots / max(1, min(routed_experts or num_experts, num_slots))
    tma = fits_tma(hidden, inter) or (edges and fits_tma_edges(hidden, inter))
    # memory-bound, one M block per expert; past 8 rows on average (random routing) a 16-row
    # block leaves many experts with a second block that re-reads their weights
    middle = tma and 8 < rows_per_expert <= 16
    decode = rows_per_expert <= 16 and not middle
    regs = 0  # no cap on registers per thread
    if middle:  # 32-row tiles beat the decode tiles here; 8 warps capped at 128 registers (2 programs
        # per SM) edge out 4 warps
        bm, bn_gate_up, bk_gate_up, bn_down, bk_down, warps, stages, prefetch, regs = 32, 128, 256, 128, 256, 8, 3, False, 128
    elif decode:
        bm, bn_gate_up, bk_gate_up, bn_down, bk_down, warps, stages, prefetch = 16, 64, 256, 64, 256, 4, 3, False
    elif tma:  # prefill, tensor-core bound: TMA tiles beat the plain-load ones; 256-row weight tiles
        # (half the programs; the down GEMM's K loop is short, I / 256 steps; the gate_up GEMM decodes each weight tile
        # for 2x the MMA work per instruction) a little more
        bm, bn_gate_up, bk_gate_up, bn_down, bk_down, warps, stages, prefetch = 64, 256, 256, 256, 256, 8, 3, False
    else:
        bm, bn_gate_up, bk_gate_up, bn_down, bk_down, warps, stages, prefetch = 128, 128, 128, 128, 128, 8, 2, True
    cfg = dict(
        BM=bm, BN_GATE_UP=_pow2_divisor(inter, bn_gate_up), BK_GATE_UP=_pow2_divisor(hidden, bk_gate_up),
        BN_DOWN=_pow2_divisor(hidden, bn_down), BK_DOWN=_pow2_divisor(inter, bk_down),
        num_warps=warps, num_stages=stages, PREFETCH=prefetch, maxnreg=regs,
    )
    if tma and not fits_tma(hidden, inter):
        # K tiles stay 256 wide (16-byte TMA rows of scales, the merged gate/up boxes), the last one
        # partial (kernels._expert_matmul's tail); the merged gate_up tile's halves divide I
        cfg |= dict(BK_GATE_UP=bk_gate_up, BK_DOWN=bk_down, BN_GATE_UP=2 * _pow2_divisor(inter, bn_gate_up // 2))
    # Weights through TMA (bulk copies pipelined over num_stages), and K in MMA-fragment order:
    # vector loads of each thread's weight bytes instead of byte loads and shuffles, fewer
    # instructions per K step, fewer still with the paired weight layout (layout.py, held by
    # PreparedExperts)
    cfg["TMA"] = cfg["FRAGMENT_ORDER"] = tma
    # the gate_up GEMM's tiles hold BN_GATE_UP/2 gate rows and the same up rows, in one K loop with one accumulator
    # (4-D TMA boxes): two K loops kept a first accumulator alive through the second, and ptxas
    # serialized every wgmma there (the merged prefill tile still uses 255 registers and spills a
    # little, but its wgmmas overlap); faster or level at every token count
    cfg["MERGED_GATE_UP"] = tma
    # A static K loop (wgmma pipelined; see _expert_matmul) where measured faster: one token of top-8
    # (8 slots: the rule counts slots, so a top-2 model pipelines up to 4 tokens, not measured) and
    # the middle and prefill buckets; in the rest of the decode bucket a run-time loop is faster
    cfg["PIPELINED_GATE_UP"] = cfg["PIPELINED_DOWN"] = tma and not (decode and num_slots > 8)
    # Programmatic dependent launch (sm90+; opt-in, config key PDL) for the launches of a call
    # (routing, the gate_up GEMM, the down GEMM, top-k sum; no routing at one token): each kernel's programs start while
    # the previous one drains its last wave, and wait for it (griddepcontrol) before reading anything
    # it wrote. Off: a few % at 1-2 tokens, but a slower first pass over new shapes
    cfg["PDL"] = False
    # Prefill with many rows per expert: the Gluon kernels (prefill_rs.py; paired weights, bf16
    # activations and compute capability 9.x only, checked at the call)
    cfg["GLUON_PREFILL"] = tma and rows_per_expert >= GLUON_PREFILL_MIN_ROWS
    # Up to V3_MAX_ROWS rows per expert: both GEMMs on mma.sync with weights and scales through a
    # TMA ring (decode_v3.py; Hopper, bf16 and Gluon only, checked at the call), in 8-row blocks:
    # faster than the wgmma kernels up to 6 rows per expert, slower at 8. Rings of 2 slots: the down GEMM's
    # of 2 steps (256 K each) where I allows, of one at one token, the gate_up GEMM's of one step
    cfg["DECODE_V3"] = tma and rows_per_expert <= V3_MAX_ROWS
    if cfg["DECODE_V3"]:
        cfg |= dict(V3_STAGES=2, V3_SPS=2 if inter % 512 == 0 else 1, V3_SPS_ONE_TOKEN=1, V3_STAGES_GATE_UP=2, V3_BM=8)
    return cfg


def triton_fused_moe(hidden_states, topk_ids, topk_weights, expert_tensors, config: dict | None = None,
                     routed_experts: int = 0, gpt_oss=None):
    """Run the Triton kernels. ``expert_tensors``: the op's tensors (packed weights in
    :func:`paired_weight_layout`, int32, as :class:`~fp4moe_ops.PreparedExperts` holds them) or the canonical layout (uint8; any config).
    The tiles come from :func:`kernel_config` (``routed_experts``: see ``fp4moe::fused_moe``)
    unless ``config`` is given. ``gpt_oss``: :class:`.layout.GptOssTerms` for gpt-oss's experts
    (:func:`triton_gpt_oss_moe`; MXFP4's block scales are E8M0 as int8, one per 32 values, and its
    global scales unused: :func:`.layout.values_per_scale`)."""
    gate_up, gate_up_scale, gate_up_global_scale, down, down_scale, down_global_scale = expert_tensors
    num_tokens, hidden = hidden_states.shape
    top_k = topk_ids.shape[1]
    num_experts, inter = gate_up_scale.shape[0], gate_up_scale.shape[1] // 2
    num_slots = num_tokens * top_k
    if config is None and _compile_ahead():
        compile_layer_once(hidden_states, topk_ids, topk_weights, expert_tensors, routed_experts, gpt_oss)
    cfg = config or kernel_config(num_slots, num_experts, hidden, inter, routed_experts, edges=gpt_oss is not None)
    paired = gate_up.dtype == torch.int32
    if config is None:
        _announce_once(("moe", hidden_states.device, hidden_states.dtype, paired), hidden_states,
                       "the MoE layer" if paired else "the MoE layer (canonical weight layout)", paired)
    if paired and not (cfg.get("TMA") and cfg.get("FRAGMENT_ORDER")):
        raise ValueError("paired-layout weights need a TMA + FRAGMENT_ORDER config; pass canonical "
                         "uint8 weights for other configs")
    if cfg.get("FRAGMENT_ORDER") and (cfg["BN_GATE_UP"] % 64 or cfg["BN_DOWN"] % 64):
        # the GPU decode maps a 64-row weight tile onto the warpgroup's MMA fragments; narrower
        # tiles compile but give wrong sums on the GPU (benchmarks/NOTES.md, "Where launch.py's settings come from")
        raise ValueError(f"fragment-order configs need BN_GATE_UP and BN_DOWN multiples of 64, got {cfg['BN_GATE_UP']} and {cfg['BN_DOWN']}")
    if cfg.get("FRAGMENT_ORDER") and cfg["BM"] % 16:
        # 8-token row blocks give wrong sums on the GPU: at N = 8 Triton compiles the dot to
        # mma.sync through a shared-memory layout conversion, not wgmma, and the paired decode's
        # packing assumption likely fails there (the CPU interpreter's sums are right; NOTES.md).
        # kernel_config never makes them
        raise ValueError(f"fragment-order configs need BM a multiple of 16, got {cfg['BM']}")
    if (hidden % cfg["BK_GATE_UP"] or inter % cfg["BK_DOWN"]) and not (cfg.get("TMA") and cfg["BK_GATE_UP"] >= 256
                                                                       and cfg["BK_DOWN"] >= 256):
        # a partial last K step reads its weights and scales through TMA (zeros past K)
        raise ValueError(f"H={hidden}, I={inter} not multiples of the K tiles ({cfg['BK_GATE_UP']}, {cfg['BK_DOWN']}) "
                         "need a TMA config with K tiles of at least 256")
    scale_block = values_per_scale(gate_up_scale, gpt_oss is not None)
    if scale_block == 32 and not (cfg.get("TMA") and cfg["BK_GATE_UP"] == cfg["BK_DOWN"] == 256):
        # a 256-wide step's scales are 8 bytes a row there, in 16-byte units of row pairs (layout.pair_scale_rows)
        raise ValueError("gpt-oss's MXFP4 experts (a scale per 32 values) need a TMA config with K tiles of 256")
    x = hidden_states.contiguous()
    if cfg.get("GLUON_PREFILL") and paired and _gluon_runs(x):
        return _gluon_prefill_moe(x, topk_ids, topk_weights, expert_tensors, gpt_oss=gpt_oss)
    if cfg.get("DECODE_V3") and paired and _gluon_runs(x):
        return _decode_v3_moe(x, topk_ids, topk_weights, expert_tensors, cfg, gpt_oss)
    pdl = cfg.get("PDL", False)
    fragment = cfg.get("FRAGMENT_ORDER", False)
    # One token: a row block per slot, read from the ids by the GEMMs themselves (its experts are
    # distinct as a router picks them; were two the same, each block would read the weights), so
    # no routing launch and no copy of x (the gate_up GEMM reads it permuted; benchmarks/NOTES.md)
    blocks = _one_token_blocks(cfg, topk_ids)
    slot_blocks = blocks is not None
    if slot_blocks:
        sorted_slot, block_expert, row_start, row_end = blocks
        x_gate_up = x
    elif fragment:  # the gate_up GEMM reads x with K in fragment order
        sorted_slot, block_expert, row_start, row_end, x_gate_up = route(topk_ids, num_experts, cfg["BM"], x, cfg["BK_GATE_UP"],
                                                                       pdl=pdl)
    else:
        sorted_slot, block_expert, row_start, row_end = route(topk_ids, num_experts, cfg["BM"], pdl=pdl)
        x_gate_up = x
    common = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], PREFETCH=cfg.get("PREFETCH", True),
                  **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}),
                  FAST_DECODE=cfg.get("FAST_DECODE", not interpreting()), INTERPRET=interpreting(),
                  FRAGMENT_ORDER=fragment, PAIRED=paired, FAST_SCALES=cfg.get("FAST_SCALES", True), **_pdl_args(pdl),
                  **({"DIAG": cfg["DIAG"]} if cfg.get("DIAG") else {}),  # (a diagnostic: see kernels._NO_DECODE)
                  **({"SLOT_BLOCKS": True, "E": num_experts} if slot_blocks else {}), SCALE_BLOCK=scale_block)

    inter_act = torch.empty(num_slots, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(num_slots, hidden, dtype=torch.float32, device=x.device)
    tma = cfg.get("TMA", False)
    merged = cfg.get("MERGED_GATE_UP", False)
    if merged and not (tma and cfg["BK_GATE_UP"] >= 256):
        raise ValueError("MERGED_GATE_UP needs TMA and BK_GATE_UP >= 256 (16-byte scale box rows)")
    if merged:
        gate_up_desc = _gate_up_descriptors(gate_up, gate_up_scale, cfg["BN_GATE_UP"], cfg["BK_GATE_UP"], scale_block)
    else:
        gate_up_desc = _descriptors(gate_up, gate_up_scale, cfg["BN_GATE_UP"], cfg["BK_GATE_UP"], scale_block) if tma \
            else (gate_up, gate_up_scale)
    down_desc = _descriptors(down, down_scale, cfg["BN_DOWN"], cfg["BK_DOWN"], scale_block) if tma else (down, down_scale)
    # programs per M block: BN_GATE_UP/2 gate and BN_GATE_UP/2 up rows each (merged), or BN_GATE_UP of both
    gate_up_grid = (block_expert.numel(), (2 if merged else 1) * inter // cfg["BN_GATE_UP"])
    # hidden and inter go in twice: as the constexprs H and I, and as K_RUNTIME, the K loop's bound
    # when PIPELINED_MMA is off (a run-time bound, see _expert_matmul)
    launch_or_compile(
        _gate_up_swiglu_kernel, gate_up_grid, x_gate_up, gate_up, gate_up_scale, gate_up_global_scale, inter_act, sorted_slot,
        block_expert, row_start, row_end, hidden, inter, top_k, *gate_up_desc, hidden, BM=cfg["BM"], BN=cfg["BN_GATE_UP"], BK=cfg["BK_GATE_UP"], TMA=tma,
        OUT_CHUNK=cfg["BK_DOWN"], MERGED_GATE_UP=merged, PIPELINED_MMA=cfg.get("PIPELINED_GATE_UP", True), **common,
        **({} if gpt_oss is None else gpt_oss.gate_up_args()),
    )
    down_grid = (block_expert.numel(), hidden // cfg["BN_DOWN"])
    launch_or_compile(
        _down_kernel, down_grid, inter_act, down, down_scale, down_global_scale, topk_weights.contiguous(), y, sorted_slot,
        block_expert, row_start, row_end, hidden, inter, *down_desc, inter, BM=cfg["BM"], BN=cfg["BN_DOWN"], BK=cfg["BK_DOWN"], TMA=tma,
        PIPELINED_MMA=cfg.get("PIPELINED_DOWN", True), **common,
    )
    return _sum_topk(y, topk_ids, x, num_experts, pdl, _down_bias(gpt_oss, topk_weights))


def _down_bias(gpt_oss, topk_weights):
    """``(down_bias, topk_weights)`` for the top-k sum (gpt-oss's down-projection bias), or None."""
    return None if gpt_oss is None else (gpt_oss.down_bias, topk_weights.contiguous())


def triton_gpt_oss_moe(hidden_states, topk_ids, topk_weights, kernel_tensors, swiglu_alpha: float, limit: float,
                       config: dict | None = None):
    """gpt-oss's experts on the Triton kernels: ``kernel_tensors`` as
    :func:`.layout.gpt_oss_kernel_tensors` makes them (six for MXFP4, whose E8M0 scales are held
    once per 32 values, as the checkpoint stores them; eight for NVFP4). H and I as held: the kernels mask the K edges of
    gpt-oss's 2880 (:func:`.layout.fits_tma_edges`). Only a layout padded past ``hidden_states``'
    width (H not a multiple of 64, or the padded layout benchmarks compare) pads the activations and
    cuts the output back, two copies per call."""
    if len(kernel_tensors) == 8:
        (gate_up, gate_up_scale, gate_up_global_scale, gate_up_bias,
         down, down_scale, down_global_scale, down_bias) = kernel_tensors
    else:
        gate_up, gate_up_scale, gate_up_bias, down, down_scale, down_bias = kernel_tensors
        # (E8M0 scales need no global scale: the kernels ignore it, so the bias stands in for it)
        gate_up_global_scale = down_global_scale = gate_up_bias
    hidden = hidden_states.shape[1]
    held = down.shape[1] * 2  # down [E, Hp/2, Ip/4] (paired words)
    x = hidden_states if held == hidden else torch.nn.functional.pad(hidden_states, (0, held - hidden))
    out = triton_fused_moe(x, topk_ids, topk_weights,
                           [gate_up, gate_up_scale, gate_up_global_scale, down, down_scale, down_global_scale], config,
                           gpt_oss=GptOssTerms(gate_up_bias, down_bias, swiglu_alpha, limit))
    return out if held == hidden else out[:, :hidden].contiguous()


def variant_slots(num_experts: int, hidden: int, inter: int, top_k: int, routed_experts: int = 0,
                  edges: bool = False) -> list[int]:
    """One slot count per distinct set of kernels a layer can launch: the smallest slot count (a
    multiple of ``top_k``) of each combination of :func:`kernel_config` and routing path. Every
    rule is a threshold on the slot count (rows per expert never fall as slots grow), and past the
    Gluon threshold and the routing kernel's limit nothing changes."""
    routed = routed_experts or num_experts
    last = max(GLUON_PREFILL_MIN_ROWS * routed, FAST_ROUTE_MAX_SLOTS + 1)
    seen = {}
    for slots in range(top_k, last + top_k, top_k):
        cfg = kernel_config(slots, num_experts, hidden, inter, routed_experts, edges)
        key = (tuple(sorted(cfg.items())), slots == top_k, slots <= FAST_ROUTE_MAX_SLOTS, _count_block(slots))
        seen.setdefault(key, slots)
    return sorted(seen.values())


def layer_plans(hidden_states, topk_ids, topk_weights, expert_tensors, routed_experts: int = 0, gpt_oss=None):
    """:func:`.compile_ahead.compile_all`'s plans for a layer (a call's arguments): per
    :func:`variant_slots` entry, the call's launch sequence with that slot count's tile config, on
    a one-token copy. One token is enough: the kernels are specialized on dtypes, alignment, the
    layer's sizes and the tile config, never on the token count (the routing kernel's counts are
    ``do_not_specialize``; its path, and whether the GEMMs read a one-token call's ids themselves,
    follow :func:`.compile_ahead.planned_slots`). A copy, not a view: a call of several tokens makes
    a strided input contiguous in a fresh (aligned) buffer. A one-token call hands its own ``x``
    and ids to the GEMMs: were they views not 16-byte aligned, that call would compile a variant of
    its own (correct, only not ahead).
    Largest slot count first: the Gluon prefill kernels take longest to compile, so they start first."""
    num_experts, inter = expert_tensors[1].shape[0], expert_tensors[1].shape[1] // 2
    hidden, top_k = hidden_states.shape[1], topk_ids.shape[1]
    one = [t[:1].clone(memory_format=torch.contiguous_format) for t in (hidden_states, topk_ids, topk_weights)]
    edges = gpt_oss is not None
    return [(slots, partial(triton_fused_moe, *one, expert_tensors, routed_experts=routed_experts,
                            config=kernel_config(slots, num_experts, hidden, inter, routed_experts, edges),
                            gpt_oss=gpt_oss))
            for slots in reversed(variant_slots(num_experts, hidden, inter, top_k, routed_experts, edges))]


_COMPILED_SHAPES = set()  # layer and linear shapes compiled ahead in this process


def _compile_once(key, x: torch.Tensor, make_plans, what: str) -> None:
    """At the first call of ``key`` in this process, compile ``make_plans()`` together
    (:func:`.compile_ahead.compile_all`). Not under the interpreter, nor for CPU or empty inputs;
    put off to a later call while a CUDA graph is captured or Triton's async compile mode is active.
    On failure a warning, and the launches compile as calls reach them."""
    if key in _COMPILED_SHAPES or interpreting() or not x.is_cuda or compiling_ahead() or x.numel() == 0:
        return  # (the set first: every later call of the layer or linear stops there)
    if torch.cuda.is_current_stream_capturing() or async_compile_active():
        return
    _COMPILED_SHAPES.add(key)
    try:
        errors = compile_all(make_plans())
    except Exception as exc:
        errors = [exc]
    if errors:  # a head start only
        warnings.warn(f"fp4moe: compiling the {what}'s Triton kernels ahead failed ({errors[0]!r}, {len(errors)} "
                      "plan(s)); they compile one by one as calls reach them")


def compile_layer_once(hidden_states, topk_ids, topk_weights, expert_tensors, routed_experts: int = 0,
                       gpt_oss=None):
    """At the first call of a layer shape in this process, compile every kernel variant it can
    launch (:func:`layer_plans`), together (see :func:`_compile_once`)."""
    gate_up, gate_up_scale = expert_tensors[0], expert_tensors[1]
    key = ("moe", hidden_states.device, hidden_states.dtype, topk_ids.dtype, topk_weights.dtype, gate_up.dtype,
           gate_up_scale.dtype, tuple(gate_up_scale.shape), hidden_states.shape[1], topk_ids.shape[1], routed_experts,
           gpt_oss is None)
    _compile_once(key, hidden_states, lambda: layer_plans(hidden_states, topk_ids, topk_weights, expert_tensors,
                                                          routed_experts, gpt_oss), "layer")


def gluon_triton_supported(version: str) -> bool:
    """Whether the Gluon kernels are tested on this Triton release (:data:`GLUON_TRITON`)."""
    return ".".join(version.split(".")[:2]) in GLUON_TRITON


_GLUON_STATUS = {}  # (device, dtype) -> why the Gluon kernels do not run there, or None


def gluon_unavailable(x: torch.Tensor) -> str | None:
    """Why the Gluon kernels (prefill_rs.py, decode_v3.py) cannot run on activations like ``x``, or
    None. They need Hopper (compute capability 9.x: wgmma, TMA), bf16 activations and a Triton
    whose Gluon they compile on (:func:`gluon_triton_supported`); not in the interpreter."""
    if interpreting() or not x.is_cuda:
        return "Triton's CPU interpreter" if interpreting() else f"activations on {x.device}"
    key = (x.device, x.dtype)
    if key not in _GLUON_STATUS:
        _GLUON_STATUS[key] = _gluon_check(x)
    return _GLUON_STATUS[key]


def _gluon_check(x: torch.Tensor) -> str | None:
    choice = env_switch("FP4MOE_GLUON")
    if choice is False:
        return f"FP4MOE_GLUON={os.environ['FP4MOE_GLUON']}"
    major, minor = torch.cuda.get_device_capability(x.device)
    if major != 9:
        return f"compute capability {major}.{minor} (the Gluon kernels are Hopper's, 9.x)"
    if x.dtype != torch.bfloat16:
        return f"{x.dtype} activations (the Gluon kernels take bfloat16)"
    if not gluon_triton_supported(triton.__version__) and choice is not True:
        return (f"Triton {triton.__version__} (the Gluon kernels are tested on Triton {', '.join(GLUON_TRITON)}; "
                "FP4MOE_GLUON=1 tries them)")
    try:
        from .decode_v3 import gate_up_v3  # noqa: F401
        from .prefill_rs import prefill_gemms  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means no Gluon here, said why
        return f"the Gluon kernels do not import on Triton {triton.__version__} ({type(exc).__name__}: {exc})"
    return None


def _gluon_runs(x: torch.Tensor) -> bool:
    return gluon_unavailable(x) is None


def kernel_family(x: torch.Tensor, num_slots: int, num_experts: int, hidden: int, inter: int,
                  routed_experts: int = 0, paired: bool = True, edges: bool = False) -> str:
    """The kernels a call of ``num_slots`` (token, expert) slots runs: ``"gluon-decode"`` (mma.sync,
    decode_v3.py), ``"gluon-prefill"`` (wgmma with the weights decoded in registers, prefill_rs.py),
    ``"triton-wgmma"`` (the single-role Triton kernels through TMA, kernels.py) or ``"triton"`` (the
    same with plain loads), as :func:`triton_fused_moe` picks them (``edges``: for gpt-oss's
    experts, see :func:`kernel_config`)."""
    cfg = kernel_config(num_slots, num_experts, hidden, inter, routed_experts, edges)
    gluon = paired and _gluon_runs(x)
    if cfg.get("GLUON_PREFILL") and gluon:
        return "gluon-prefill"
    if cfg.get("DECODE_V3") and gluon:
        return "gluon-decode"
    return "triton-wgmma" if cfg.get("TMA") else "triton"


_ANNOUNCED = set()


def _announce_once(key, x: torch.Tensor, what: str, fallback_warns: bool) -> None:
    """Say once per process and ``key`` which kernels ``what`` runs: at info level, and, where a
    Hopper GPU falls back from the Gluon kernels for a reason the user can change (``fallback_warns``:
    the Triton release, the activations' dtype, an import failure), as a warning naming it."""
    if key in _ANNOUNCED or interpreting() or not x.is_cuda:
        return
    _ANNOUNCED.add(key)
    why = gluon_unavailable(x)
    version = triton.__version__
    if why is None:
        _log.info("fp4moe: %s runs Triton %s's kernels with Gluon (decode and prefill)", what, version)
        return
    _log.info("fp4moe: %s runs Triton %s's single-role kernels, without Gluon: %s", what, version, why)
    hopper = torch.cuda.get_device_capability(x.device)[0] == 9
    if hopper and fallback_warns and why != "FP4MOE_GLUON=0":
        warnings.warn(f"fp4moe: {what} runs the slower single-role Triton kernels on this Hopper GPU, not the "
                      f"Gluon kernels: {why}", stacklevel=4)


def _one_token_blocks(cfg: dict, topk_ids: torch.Tensor):
    """A one-token call's row blocks: one per slot, whose expert the GEMMs read from the ids
    themselves (see :func:`triton_fused_moe`), as :func:`route`'s four tensors (only
    ``block_expert`` is read); None for other calls or with ``SLOT_BLOCKS`` off."""
    if not (cfg.get("SLOT_BLOCKS", True) and planned_slots(topk_ids.numel()) == topk_ids.shape[1]):
        return None
    block_expert = topk_ids.reshape(-1).contiguous()
    return block_expert, block_expert, block_expert, block_expert


def _gluon_prefill_moe(x, topk_ids, topk_weights, expert_tensors, block_m: int = 128, tails=GLUON_PREFILL_TAILS,
                       gpt_oss=None, **options):
    """Route into ``block_m``-row blocks, gather the activations in expert order (K in fragment
    order), both GEMMs (:func:`.prefill_rs.prefill_gemms`: ``tails``, the narrower tiles of an
    expert's last block, and ``options``, its tuning and diagnostic arguments), top-k sum."""
    from .prefill_rs import BK, prefill_gemms

    gate_up, gate_up_scale, gate_up_global_scale, down, down_scale, down_global_scale = expert_tensors
    num_experts = gate_up_scale.shape[0]
    # one tail level: the routing kernel splits it off itself (else split_blocks' torch ops; also
    # where the kernel does not run: CPU tensors compiled for sm_90 by tools/compile_ahead_cpu.py)
    tail = tails[0] if len(tails) == 1 and (x.is_cuda or interpreting()) else 0
    sorted_slot, *tables, x_fragment = route(topk_ids, num_experts, block_m, x, BK.value, tail=tail)
    launches = [(block_m, *tables[:3]), (tail, *tables[3:])] if tail else None
    # (int32 all the way: index_select takes int32 indices, one op fewer on the host's path)
    x_sorted = x_fragment.index_select(0, torch.div(sorted_slot, topk_ids.shape[1], rounding_mode="floor"))
    y = prefill_gemms(x_sorted, gate_up, gate_up_scale, gate_up_global_scale, down, down_scale, down_global_scale,
                      topk_weights.contiguous(), sorted_slot, *tables[:3], block_m=block_m, tails=tails, gpt_oss=gpt_oss, launches=launches, **options)
    return _sum_topk(y, topk_ids, x, num_experts, bias=_down_bias(gpt_oss, topk_weights))


def _decode_v3_moe(x, topk_ids, topk_weights, expert_tensors, cfg: dict, gpt_oss=None):
    """Up to :data:`V3_MAX_ROWS` rows per expert: route (one token: a row block per slot, read from
    the ids by the GEMMs, as in :func:`triton_fused_moe`), :func:`.decode_v3.gate_up_v3` (``h`` with
    K's bits 0, 1 swapped), :func:`.decode_v3.down_v3`, top-k sum."""
    from .decode_v3 import gate_up_v3, down_v3

    gate_up, gate_up_scale, gate_up_global_scale, down, down_scale, down_global_scale = expert_tensors
    num_experts, inter = gate_up_scale.shape[0], gate_up_scale.shape[1] // 2
    (num_tokens, hidden), top_k = x.shape, topk_ids.shape[1]
    num_slots = num_tokens * top_k
    blocks = _one_token_blocks(cfg, topk_ids)
    slot_blocks = blocks is not None
    bm = 8 if slot_blocks else cfg.get("V3_BM", cfg["BM"])
    sorted_slot, block_expert, row_start, row_end = blocks if slot_blocks else route(topk_ids, num_experts, bm)
    h = torch.empty(num_slots, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(num_slots, hidden, dtype=torch.float32, device=x.device)
    scale_block = values_per_scale(gate_up_scale, gpt_oss is not None)
    gate_up_v3(x, gate_up, gate_up_scale, gate_up_global_scale, h, sorted_slot, block_expert, row_start, row_end, hidden,
               inter, top_k, bm, slot_blocks, num_experts, cfg["V3_STAGES_GATE_UP"], gpt_oss, scale_block)
    down_v3(h, down, down_scale, down_global_scale, topk_weights.contiguous(), y, sorted_slot, block_expert, row_start,
            row_end, hidden, inter, bm, slot_blocks, num_experts, cfg["V3_STAGES"], cfg["V3_SPS_ONE_TOKEN" if slot_blocks else "V3_SPS"],
            scale_block)
    return _sum_topk(y, topk_ids, x, num_experts, bias=_down_bias(gpt_oss, topk_weights))


def _descriptors(w: torch.Tensor, s: torch.Tensor, bn: int, bk: int, scale_block: int = 16):
    """TMA descriptors over ``w [E, N, K/2]`` and ``s [E, N, K/16]`` as 2-D ``[E*N, *]`` with
    ``[bn, bk/2]`` / ``[bn, bk/16]`` boxes (``scale_block`` 32: ``s [E, N, K/32]`` in row pairs,
    :func:`.layout.pair_scale_rows`, as ``[E*N/2, K/16]`` with ``[bn/2, 16]`` boxes); paired ``w
    [E, N/2, K/4]`` int32 as bytes ``[E*N/2, K]`` with ``[bn/2, bk]`` boxes. A box row must be >= 16
    bytes: with ``bk < 256`` the kernel loads scales with plain loads and gets ``s`` itself."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    w_box = _weight_descriptor(w, bn, bk)
    if bk < 256:
        return w_box, s
    pair = scale_block // 16  # rows a scale box row holds
    return w_box, TensorDescriptor.from_tensor(s.reshape(-1, pair * s.shape[-1]), [bn // pair, bk // 16])


def _weight_descriptor(w: torch.Tensor, bn: int, bk: int):
    """:func:`_descriptors`' TMA descriptor over the packed weights alone."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if w.dtype == torch.int32:
        return TensorDescriptor.from_tensor(w.view(torch.uint8).reshape(-1, 4 * w.shape[-1]), [bn // 2, bk])
    return TensorDescriptor.from_tensor(w.reshape(-1, w.shape[-1]), [bn, bk // 2])


def _gate_up_descriptors(gate_up: torch.Tensor, gate_up_scale: torch.Tensor, bn: int, bk: int, scale_block: int = 16):
    """4-D TMA descriptors over ``gate_up`` as ``[E, 2, I, H/2]`` (paired: bytes ``[E, 2, I/2, H]``, gate
    pairs then up pairs) and ``gate_up_scale`` as ``[E, 2, I, H/16]`` (``scale_block`` 32, rows in pairs:
    ``[E, 2, I/2, H/16]``): one box holds ``bn/2`` gate rows and the same up rows."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    e, inter = gate_up.shape[0], gate_up_scale.shape[1] // 2
    pair = scale_block // 16
    s = TensorDescriptor.from_tensor(gate_up_scale.reshape(e, 2, inter // pair, pair * gate_up_scale.shape[-1]),
                                     [1, 2, bn // 2 // pair, bk // 16])
    if gate_up.dtype == torch.int32:  # paired: row-pair words, as bytes
        w = gate_up.view(torch.uint8).reshape(e, 2, inter // 2, 4 * gate_up.shape[-1])
        return TensorDescriptor.from_tensor(w, [1, 2, bn // 4, bk]), s
    return TensorDescriptor.from_tensor(gate_up.reshape(e, 2, inter, gate_up.shape[-1]), [1, 2, bn // 2, bk // 2]), s


def _sum_topk(y: torch.Tensor, topk_ids: torch.Tensor, x: torch.Tensor, num_experts: int,
              pdl: bool = False, bias=None) -> torch.Tensor:
    """``out [T, H]`` (x's dtype) = sum over each token's valid slots (ids in ``[0, num_experts)``)
    of ``y [T*k, H]`` fp32; ``bias = (down_bias [E, H], topk_weights)`` adds ``w * down_bias[e]`` per slot."""
    num_tokens, hidden = x.shape
    out = torch.empty_like(x)
    bh = min(1024, next_power_of_2(hidden))
    launch_or_compile(
        _sum_topk_kernel, (num_tokens, cdiv(hidden, bh)), y, topk_ids.contiguous(), out, hidden, num_experts,
        TOPK=topk_ids.shape[1], BH=bh, **_pdl_args(pdl),
        **({} if bias is None else dict(down_bias_ptr=bias[0], topk_w_ptr=bias[1], HAS_BIAS=True)),
    )
    return out


# --- NVFP4 linear layers -----------------------------------------------------------------------

LINEAR_GEMV_MAX_TOKENS = 64  # past this, decode the weight to 16 bits once and let cuBLAS multiply
SM_COUNT_TARGET = 264  # programs to aim for: two per SM of an H100/H200 (132 SMs)
LINEAR_MAX_PARTS = 16  # K split at most this many ways (each part writes a float32 [T, N] of partial sums)
# Paired weights (what NVFP4Linear holds on Hopper), bf16: the kernel path up to this many tokens
# (decode_v3's linear, or the GEMV in 32/64-token blocks for wide weights), then dequantize + cuBLAS,
# where that became the faster (measurements: benchmarks/NOTES.md, "Where launch.py's settings come from")
LINEAR_V3_MAX_TOKENS = 128
LINEAR_WIDE_N = 16384  # from this many output features the GEMV's 32/64-token blocks beat decode_v3 past 16 tokens


def linear_supported(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why the Triton linear cannot run these tensors, or None: a CUDA device of compute
    capability 9.0+ (TMA), 16-bit activations, N a multiple of 64 and K of 256 (its tiles).
    ``weight``: ``[N, K/2]`` uint8 as stored, or ``[N/2, K/4]`` int32 in the paired layout."""
    n, k = linear_shape(weight)
    if triton is None:
        return "Triton is not installed"
    if not x.is_cuda:  # (tests call triton_nvfp4_linear itself in Triton's CPU interpreter)
        return f"x is on {x.device}, the Triton linear runs on CUDA"
    if torch.cuda.get_device_capability(x.device) < (9, 0):
        return "the Triton linear needs TMA (compute capability 9.0+)"
    if x.dtype not in (torch.bfloat16, torch.float16):
        return f"x is {x.dtype}; the Triton linear takes bfloat16 or float16"
    if n % 64 or k % 256:
        return f"weight [N={n}, K={k}]: the Triton linear needs N a multiple of 64 and K of 256"
    return None


def linear_shape(weight: torch.Tensor) -> tuple[int, int]:
    """``(N, K)`` of a packed linear weight in either layout."""
    if weight.dtype == torch.int32:
        return 2 * weight.shape[0], 4 * weight.shape[1]
    return weight.shape[0], 2 * weight.shape[1]


def _divisor_near(slots: int, want: int) -> int:
    """The divisor of ``slots`` (at most LINEAR_MAX_PARTS) closest to ``want``, the smaller on a tie."""
    divisors = [d for d in range(1, min(slots, LINEAR_MAX_PARTS) + 1) if slots % d == 0]
    return min(divisors, key=lambda d: (abs(d - want), d))


def linear_config(tokens: int, n: int, k: int, paired: bool = False, v3: bool = False) -> dict:
    """Tiles for ``[tokens, k] x [n, k]^T``: with paired weights and ``v3`` (bf16 activations, the
    Gluon kernels available) decode_v3's linear up to LINEAR_V3_MAX_TOKENS tokens (the GEMV in
    32/64-token blocks past 16 tokens on wide weights); else the GEMV path (up to
    LINEAR_GEMV_MAX_TOKENS tokens), split along K until about SM_COUNT_TARGET programs run; past
    those, the dequantize + cuBLAS path."""
    if paired and v3 and tokens <= LINEAR_V3_MAX_TOKENS:
        # Token blocks and K parts as the sweep found best (bench_linear.py --sweep, NOTES.md):
        # a weight decoded once per token block, so blocks grow with the tokens, but small weights
        # (a latency-bound call) prefer more, narrower blocks; K parts for about two programs per SM
        weight_mb = n * k / 2 / 2**20
        wide = n >= LINEAR_WIDE_N
        if tokens > 16 and wide:
            bm = 32 if tokens <= 32 else 64
            tiles = (n // 64) * cdiv(tokens, bm)
            parts = max(1, min(LINEAR_MAX_PARTS, k // 256, cdiv(SM_COUNT_TARGET, tiles)))
            return dict(path="gemv", BM=bm, BN=64, BK=256, PARTS=parts, SERIAL=True, X_TMA=True, num_warps=4,
                        num_stages=2, PAIRED=True)
        if tokens <= 8:
            bm = 8
        elif tokens <= 16:
            bm = 8 if weight_mb < 16 and not wide else 16
        elif tokens <= 32:
            bm = 16 if weight_mb < 16 else 32
        else:
            bm = 16 if weight_mb < 6 else 32
        tiles = (n // 64) * cdiv(tokens, bm)
        slots = k // (512 if k % 512 == 0 else 256)
        want = max(1, SM_COUNT_TARGET // tiles)
        if 4 * tiles >= SM_COUNT_TARGET:
            # tiles for half the SMs already: a part shorter than two ring depths (4 slots) costs
            # its ring's fill and the parts' sum for little
            want = min(want, max(1, slots // 4))
        return dict(path="v3", BM=bm, PARTS=_divisor_near(slots, want), STAGES=2)
    if tokens > LINEAR_GEMV_MAX_TOKENS:
        return dict(path="dequantize", BN=64, BK=256, PAIRED=paired)
    # 16- or 32-row token blocks: past 32 tokens two 32-row blocks beat one 64-row block, and 2
    # pipeline stages beat 3 (NOTES.md)
    bm = 16 if tokens <= 16 else 32
    bn, bk = 64, 256
    tiles = max(1, (n // bn) * cdiv(tokens, bm))
    steps = k // bk
    parts = max(1, min(LINEAR_MAX_PARTS, steps, cdiv(SM_COUNT_TARGET, tiles)))
    # SERIAL: the parts are summed in the same launch by the last to finish (no second kernel).
    # X_TMA: x's tiles through TMA, permuted in registers, from 8 tokens, where it beats reading x
    # with permuted addresses on most shapes (below 8, on few; NOTES.md)
    return dict(path="gemv", BM=bm, BN=bn, BK=bk, PARTS=parts, SERIAL=True, X_TMA=tokens >= 8, num_warps=4,
                num_stages=2, PAIRED=paired)


def triton_nvfp4_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                        global_scale: torch.Tensor, bias: torch.Tensor | None = None,
                        config: dict | None = None, counters: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K]`` (bf16/fp16) x NVFP4 ``weight`` (``[N, K/2]`` uint8, or ``[N/2, K/4]`` int32 in
    the paired layout) -> ``[..., N]``; see :func:`linear_supported` for what runs. No host syncs;
    the tiles depend on shapes only. ``counters`` (:func:`fp4moe_ops.linear.split_counters`):
    split-K parts summed in the same launch; without, a second kernel sums them."""
    n, k = linear_shape(weight)
    paired = weight.dtype == torch.int32
    x2 = x.reshape(-1, k).contiguous()
    tokens = x2.shape[0]
    if tokens == 0:
        return x.new_empty(*x.shape[:-1], n)
    weight, weight_scale = weight.contiguous(), weight_scale.contiguous()  # the kernels assume dense rows
    if config is None and _compile_ahead():
        compile_linear_once(x2, weight, weight_scale, global_scale, bias, counters)
    cfg = config or linear_config(tokens, n, k, paired, paired and _gluon_runs(x2))
    fast = not interpreting()
    has_bias = bias is not None
    if cfg["path"] == "dequantize":
        w = x.new_empty(16) if compiling_ahead() else torch.empty(n, k, dtype=x.dtype, device=x.device)
        w_desc = _weight_descriptor(weight, cfg["BN"], cfg["BK"]) if paired else None
        launch_or_compile(_dequant_kernel, (n // cfg["BN"], k // cfg["BK"]), weight, weight_scale.view(torch.uint8),
                          global_scale, w, k, w_desc, BN=cfg["BN"], BK=cfg["BK"], FAST_DECODE=fast, PAIRED=paired)
        if compiling_ahead():  # only the kernel's compile: no n x k buffer, no GEMM on garbage
            return x.new_empty(*x.shape[:-1], n)
        # on x2, not x (fp4moe_ops.linear.as_matrix says why)
        return torch.nn.functional.linear(x2, w, bias).reshape(*x.shape[:-1], n)
    out = torch.empty(tokens, n, dtype=x.dtype, device=x.device)
    parts = cfg["PARTS"]
    partials = out if parts == 1 else torch.empty(parts, tokens, n, dtype=torch.float32, device=x.device)
    if cfg["path"] == "v3":
        from .decode_v3 import linear_v3

        tiles = (n // 64) * cdiv(tokens, cfg["BM"])
        serial = counters if parts > 1 and counters is not None and tiles <= counters.numel() else None
        linear_v3(x2, weight, weight_scale, global_scale, bias, out, partials, serial, cfg["BM"], parts,
                  cfg["STAGES"])
    else:
        bm, bn, bk = cfg["BM"], cfg["BN"], cfg["BK"]
        w_desc, s_desc = _descriptors(weight[None], weight_scale.view(torch.uint8)[None], bn, bk)
        x_tma = cfg["X_TMA"] and x2.data_ptr() % 16 == 0  # TMA needs a 16-byte aligned base (a view may not be)
        if x_tma:
            from triton.tools.tensor_descriptor import TensorDescriptor

            x_desc = TensorDescriptor.from_tensor(x2, [bm, bk])  # rows past T read as zeros
        grid = (n // bn, cdiv(tokens, bm), parts)
        serial = counters if parts > 1 and cfg["SERIAL"] and counters is not None and \
            grid[0] * grid[1] <= counters.numel() else None
        launch_or_compile(
            _linear_kernel, grid, x2, weight, weight_scale.view(torch.uint8), global_scale,
            bias if has_bias else out, out, partials, out if serial is None else serial, tokens, n, k,
            cdiv(k // bk, parts) * bk, w_desc, s_desc, x_desc if x_tma else None, BM=bm, BN=bn, BK=bk,
            FAST_DECODE=fast, INTERPRET=interpreting(), HAS_BIAS=has_bias, SPLIT=parts > 1, SERIAL=serial is not None,
            X_TMA=x_tma, PAIRED=paired, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
    if parts > 1 and serial is None:
        block = 1024
        launch_or_compile(_linear_parts_kernel, (cdiv(tokens * n, block),), partials,
                          bias if has_bias else out, out, tokens * n, n, parts, HAS_BIAS=has_bias, BLOCK=block)
    return out.reshape(*x.shape[:-1], n)


def linear_plans(x2, weight, weight_scale, global_scale, bias=None, counters=None):
    """:func:`.compile_ahead.compile_all`'s plans for an NVFP4 linear (a call's arguments, ``x2 [T,
    K]``): the launch sequence of every token count up to the first past the GEMV path, on a fresh
    input of that many tokens (made when the plan runs). Every count, not one per kernel set: which
    kernels a count launches follows :func:`linear_config` and the split-K table (``counters``),
    and a count whose kernels are already compiled costs a cache lookup. The token count itself is
    no specialization (``T`` is ``do_not_specialize``), so these kernels serve every larger count of
    their path."""
    k = linear_shape(weight)[1]

    def plan(t):
        return triton_nvfp4_linear(x2.new_empty(t, k), weight, weight_scale, global_scale, bias, counters=counters)

    last = max(LINEAR_GEMV_MAX_TOKENS, LINEAR_V3_MAX_TOKENS if weight.dtype == torch.int32 else 0) + 1
    return [(t, partial(plan, t)) for t in range(1, last + 1)]


def compile_linear_once(x2, weight, weight_scale, global_scale, bias=None, counters=None):
    """At the first call of a linear shape in this process, compile every kernel variant it can
    launch (:func:`linear_plans`), together (see :func:`_compile_once`). A variant's code depends on
    N and K only through their divisibility, so later shapes find most of theirs compiled; which
    variants a shape launches also follows N and K (whether K is split, whether the split-K table
    covers its tiles)."""
    key = ("linear", x2.device, x2.dtype, weight.dtype, tuple(weight.shape), bias is not None,
           None if counters is None else counters.numel())
    _compile_once(key, x2, lambda: linear_plans(x2, weight, weight_scale, global_scale, bias, counters), "linear")
