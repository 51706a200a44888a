"""How fast TMA copies come from L2 (issue 17: whether a prefill tile of 256 tokens x 64 weight rows
per warpgroup would be fed). Such a tile reads 72 KB from L2 per 8.4 MFLOP against 48 KB now, so at
the present MMA-side rate (10.4 ms at 8192 tokens) it would need ~5.4 TB/s of L2-to-SM copies instead
of ~3.9 (benchmarks/NOTES.md, eighteenth session).

    python benchmarks/probe_l2.py [--programs-per-sm 2,4] [--stages 3]

Kernels that only stream ``[128, 64]`` int32 boxes (32 KB, the size of a 128-token activation
step) through TMA, pipelined, XOR-folded (a few instructions per box), one word stored per
program: from a buffer that fits in L2 (8, 16, 32 MiB) and, for comparison, from one that does not
(2 GiB, HBM). Two access patterns: each program its own run of boxes ("spread"), and groups of 16
consecutive programs reading the same boxes at the same time ("shared by 16", as the weight tiles
of one row block share its activation tile). Median of CUDA-graph replays; TB/s counts every box
each program reads.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_moe import graph_time_ms  # noqa: E402

BOX_ROWS, BOX_WORDS = 128, 64  # 32 KB per box


@triton.jit
def _read_kernel(desc, out_ptr, NUM_BOXES, STEPS: tl.constexpr, GROUP: tl.constexpr, STAGES: tl.constexpr,
                 BOX_ROWS: tl.constexpr, BOX_WORDS: tl.constexpr):
    p = tl.program_id(0)
    first = (p // GROUP) * 7919  # a group's run of boxes starts somewhere else than the next group's
    acc = tl.zeros((BOX_ROWS, BOX_WORDS), tl.int32)
    for k in tl.range(STEPS, num_stages=STAGES):
        box = (first + k) % NUM_BOXES
        acc ^= desc.load([box * BOX_ROWS, 0])
    tl.store(out_ptr + p, tl.xor_sum(tl.xor_sum(acc, axis=1), axis=0))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--programs-per-sm", default="2,4")
    ap.add_argument("--stages", default="3")
    ap.add_argument("--steps", type=int, default=64)
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    box_bytes = BOX_ROWS * BOX_WORDS * 4
    print(f"{torch.cuda.get_device_name()}, {sms} SMs, L2 {torch.cuda.get_device_properties(0).L2_cache_size / 2**20:.0f}"
          f" MiB; boxes of {box_bytes // 1024} KB, {args.steps} per program", flush=True)
    for mib in (8, 16, 32, 2048):
        words = mib * 2**20 // 4
        buf = torch.randint(-2**31, 2**31 - 1, (words // BOX_WORDS, BOX_WORDS), dtype=torch.int32, device="cuda")
        desc = TensorDescriptor.from_tensor(buf, [BOX_ROWS, BOX_WORDS])
        num_boxes = buf.shape[0] // BOX_ROWS
        for per_sm in (int(v) for v in args.programs_per_sm.split(",")):
            for stages in (int(v) for v in args.stages.split(",")):
                for group, name in ((1, "spread"), (16, "shared by 16")):
                    programs = sms * per_sm
                    out = torch.empty(programs, dtype=torch.int32, device="cuda")
                    run = lambda: _read_kernel[(programs,)](desc, out, num_boxes, STEPS=args.steps, GROUP=group,
                                                            STAGES=stages, BOX_ROWS=BOX_ROWS, BOX_WORDS=BOX_WORDS,
                                                            num_warps=4, num_stages=stages)
                    ms = graph_time_ms(run, [()])
                    tbs = programs * args.steps * box_bytes / ms / 1e9
                    print(f"  {mib:5d} MiB  {per_sm} programs/SM  {stages} stages  {name:13s} {ms:8.4f} ms  "
                          f"{tbs:6.2f} TB/s", flush=True)
        del buf


if __name__ == "__main__":
    main()
