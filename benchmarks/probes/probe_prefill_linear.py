"""Bound for one dense NVFP4 weight on the experts' Gluon prefill GEMM (``prefill_rs.py``): the FP4
weight decoded into wgmma's register operand, 256 weight rows x 64/128 tokens per program.

The kernel has no K split; a split into ``P`` parts is emulated with ``P`` "experts", each the
weight's ``K/P`` columns (contiguous copies of the paired words and scales), every part seeing all
tokens, the float32 parts summed by torch afterwards. So the times include work a product kernel
would not do (the parts' float32 round trip, the activations' fragment-order copy), and bound the
route from above. Timed in CUDA graphs against BF16 ``F.linear`` and the op as it is, one process,
weights cycled from HBM (bench_linear's copies). Every output is checked against BF16 ``F.linear``.

    python benchmarks/probes/probe_prefill_linear.py --tokens 128,256,512,1024,2048
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fp4moe_ops  # noqa: E402
from bench_linear import SHAPES, time_ms, weight_copies  # noqa: E402


def part_tensors(words, scales, g, parts: int):
    """The weight's K split into ``parts`` experts: paired words ``[P, N/2, K/4P]``, scale bytes
    ``[P, N, K/16P]``, global scales ``[P]``."""
    w = torch.stack(list(words.chunk(parts, dim=1))).contiguous()
    s = torch.stack(list(scales.view(torch.uint8).chunk(parts, dim=1))).contiguous()
    return w, s, g.float().reshape(1).expand(parts).contiguous()


def prefill_linear(x, w, s, g, block_m: int, stages: int, tails=()):
    """``x [T, K]`` bf16 times the weight held as ``part_tensors`` -> ``[T, N]`` bf16."""
    from fp4moe_ops.backends.triton_moe.compile_ahead import launch_or_compile
    from fp4moe_ops.backends.triton_moe.layout import fragment_order
    from fp4moe_ops.backends.triton_moe.prefill_rs import (BK, PAIRS, _by_k_step, _descriptor, _prefill_gemm_kernel,
                                                           _weight_boxes, split_blocks)

    parts, half_n, quarter_kp = w.shape
    n, kp, t = 2 * half_n, 4 * quarter_kp, x.shape[0]
    xs = fragment_order(x, BK.value).view(t, parts, kp).transpose(0, 1).reshape(parts * t, kp)
    blocks_per_part = -(-t // block_m)
    b = torch.arange(parts * blocks_per_part, device=x.device, dtype=torch.int32)
    expert = b // blocks_per_part
    start = expert * t + (b % blocks_per_part) * block_m
    end = torch.minimum(start + block_m, (expert + 1) * t)
    slots = torch.arange(parts * t, device=x.device, dtype=torch.int32)
    ones = torch.ones(parts * t, device=x.device, dtype=torch.float32)
    y = torch.empty(parts * t, n, device=x.device, dtype=torch.float32)
    w_bytes = w.view(torch.uint8).reshape(parts * n // 64, PAIRS.value // 2, kp)
    w_desc = _descriptor(_weight_boxes(w_bytes), [2, 2, PAIRS.value // 2, BK.value], 0)
    for bm, experts, starts, ends in split_blocks(expert, start, end, parts, block_m, tails):
        launch_or_compile(_prefill_gemm_kernel, (n // 256, experts.numel()),
                          _descriptor(_by_k_step(xs), [2, bm, BK.value], 128), w_desc, s, g, y, ones, slots,
                          experts, starts, ends, N_OUT=n, K=kp, EXPERT_PAIR_ROWS=n // 2, GATE_UP=False, BLOCK_M=bm,
                          gate_up_bias_ptr=g, swiglu_alpha=1.0, limit=1.0, GPT_OSS=False, STAGES=stages, REGS=248, DIAG=0, num_warps=4)
    return y.view(parts, t, n).sum(0).to(torch.bfloat16)


def part_counts(n: int, k: int, t: int, block_m: int) -> list[int]:
    """K splits worth timing: 1, and those giving ~1-3 programs per SM (132 SMs) with parts of
    K a multiple of 256."""
    tiles = (n // 256) * -(-t // block_m)
    ok = [p for p in range(1, k // 256 + 1) if k % (256 * p) == 0]
    near = [p for p in ok if 100 <= tiles * p <= 400]
    return sorted({1, *near[:3]})


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="128,256,512,1024,2048")
    ap.add_argument("--shapes", default="")
    ap.add_argument("--block-m", default="64,128")
    args = ap.parse_args()
    from fp4moe_ops.backends.triton_moe.prefill_rs import ring_fits
    from fp4moe_ops.linear import split_counters

    table = split_counters("cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| layer | N | K | tokens | BF16 ms | op ms | prefill ms (block, parts) | BF16 / prefill | BF16 / op | err |")
    print("|---|---|---|---|---|---|---|---|---|---|", flush=True)
    wanted = set(args.shapes.split(",")) if args.shapes else None
    for name, n, k in SHAPES:
        if (wanted and name not in wanted) or n % 256 or k % 256:
            continue
        weights = weight_copies(n, k, "cuda")
        for t in (int(v) for v in args.tokens.split(",")):
            inputs = [(torch.randn(t, k, device="cuda", dtype=torch.bfloat16), *c) for c in weights]
            base = time_ms(lambda x, w, s, g, b, p: F.linear(x, b), inputs, True)
            op = time_ms(lambda x, w, s, g, b, p: fp4moe_ops.nvfp4_linear(x, p, s, g, counters=table), inputs, True)
            best, err = None, float("nan")
            for bm in (int(v) for v in args.block_m.split(",")):
                stages = max(st for st in range(3, 7) if ring_fits(bm, st))
                for parts in part_counts(n, k, t, bm):
                    held = [(x, *part_tensors(p, s, g, parts)) for x, w, s, g, b, p in inputs]
                    x0, bf0 = inputs[0][0], inputs[0][4]
                    want = F.linear(x0, bf0).double()
                    got = prefill_linear(*held[0], bm, stages).double()
                    e = ((got - want).norm() / want.norm()).item()
                    ms = time_ms(lambda x, w, s, g: prefill_linear(x, w, s, g, bm, stages), held, True)
                    print(f"  {name} t={t} block {bm} parts {parts}: {ms:.4f} ms, err {e:.1e}", flush=True)
                    if best is None or ms < best[0]:
                        best, err = (ms, bm, parts), e
                    del held
            print(f"| {name} | {n} | {k} | {t} | {base:.4f} | {op:.4f} | {best[0]:.4f} ({best[1]}, {best[2]}) | "
                  f"{base / best[0]:.2f}x | {base / op:.2f}x | {err:.1e} |", flush=True)
        del weights
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
