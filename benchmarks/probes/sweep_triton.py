"""Sweep the Triton backend's tile configs on the GPU for a few token counts; prints the best
per bucket (feeds ``triton_moe.kernel_config``). Each config's output is checked against the
default config's before it is timed.

    python benchmarks/probes/sweep_triton.py --tokens 1,8,64
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
import fp4moe_ops  # noqa: E402
from fp4moe_ops.backends.triton_moe import kernel_config, route, triton_fused_moe  # noqa: E402
from bench_moe import SHAPES, graph_time_ms, make_inputs, random_weights  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="deepseek", choices=sorted(SHAPES))
    ap.add_argument("--tokens", default="1,8,64")
    ap.add_argument("--middle", action="store_true",
                    help="try the decode and prefill tile families with BM 16/32/64 at every token count "
                         "(for the bucket boundary, ~512 tokens on DeepSeek-V3)")
    args = ap.parse_args()
    e, h, i, k, routed = SHAPES[args.shape]
    w = random_weights(e, h, i, "cuda")
    paired = fp4moe_ops.prepare_experts(w, "triton").op_tensors()  # the backend's layout
    canonical = fp4moe_ops.prepare_experts(w, "reference").op_tensors()
    for t in (int(x) for x in args.tokens.split(",")):
        inputs = make_inputs(t, h, k, routed, "cuda")
        # the single-role kernels' tiles (with the Gluon prefill path on, tiles would be ignored)
        base = kernel_config(t * k, e, h, i) | {"GLUON_PREFILL": False}
        # the reference: canonical weights, portable decode
        ref = triton_fused_moe(*inputs[0], canonical, base | {"FAST_DECODE": False})
        results = []
        decode = base["BM"] == 16  # the decode bucket (not the middle one)
        # (BM, BN_GATE_UP, BK_GATE_UP, BN_DOWN, BK_DOWN, warps, stages, prefetch, tma, fragment order, merged gate/up, paired)
        if args.middle:
            tiles = [(bm, 64, 256, 64, 256, 4, 3, 0, 1, 1, merged, 1) for bm in (16, 32, 64) for merged in (1, 0)]
            tiles += [(bm, 128, 256, 128, 256, 4, 3, 0, 1, 1, 1, 1) for bm in (32, 64)]
            tiles += [(bm, 256, 256, 256, 256, 8, 3, 0, 1, 1, 1, 1) for bm in (32, 64)]
        elif decode:
            tiles = [(16, 64, 256, 64, 256, 4, 3, 0, 1, 1, 1, 0), (16, 64, 256, 64, 256, 4, 3, 0, 1, 1, 1, 1),
                     (16, 64, 256, 128, 256, 4, 3, 0, 1, 1, 1, 1), (16, 128, 256, 64, 256, 4, 3, 0, 1, 1, 1, 1)]
        # (BN 16/32 with fragment order gave wrong sums on H200 and are refused: results/sweep_narrow_*.log)
        else:
            tiles = [(64, 256, 256, 256, 256, 8, 3, 0, 1, 1, merged, 1) for merged in (1, 0)]
            tiles += [(64, 128, 256, 256, 256, 8, 3, 0, 1, 1, 1, 1)]
        configs = [
            dict(BM=bm, BN_GATE_UP=bn1, BK_GATE_UP=bk1, BN_DOWN=bn2, BK_DOWN=bk2, num_warps=warps, num_stages=stages,
                 PREFETCH=bool(prefetch), FAST_DECODE=True, TMA=bool(tma), FRAGMENT_ORDER=bool(frag),
                 MERGED_GATE_UP=bool(merged), PAIRED=bool(pair),
                 PIPELINED_GATE_UP=base["PIPELINED_GATE_UP"], PIPELINED_DOWN=base["PIPELINED_DOWN"])
            for bm, bn1, bk1, bn2, bk2, warps, stages, prefetch, tma, frag, merged, pair in tiles]
        # the scale conversion through fp16/fp32 instead of the PTX, on the default tiles
        configs.append(base | dict(FAST_DECODE=True, PAIRED=True, FAST_SCALES=False))
        for cfg in configs:
            tensors = paired if cfg["PAIRED"] else canonical  # (triton_fused_moe reads the layout off the dtype)
            try:
                out = triton_fused_moe(*inputs[0], tensors, cfg)
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                if err > 1e-2:
                    print(f"T={t} {cfg}: WRONG rel err {err:.2e}")
                    continue
                ms = graph_time_ms(lambda x, ids, rw: triton_fused_moe(x, ids, rw, tensors, cfg), inputs, replays=10)
            except Exception as exc:
                print(f"T={t} {cfg}: {type(exc).__name__} {str(exc)[:120]}")
                continue
            results.append((ms, cfg | {"rel_err": round(err, 6)}))
        results.sort(key=lambda r: r[0])
        for r in results:
            print(f"T={t}: {r[0]:.4f} ms {r[1]}")
        routing_ms = graph_time_ms(lambda x, ids, rw: route(ids, e, base["BM"]), inputs)
        print(f"T={t}: routing alone {routing_ms:.4f} ms")
        base_ms = graph_time_ms(lambda x, ids, rw: triton_fused_moe(x, ids, rw, paired, base), inputs)
        print(f"T={t}: default {base} {base_ms:.4f} ms")
        for ms, cfg in results[:3]:
            print(f"T={t}:   {ms:.4f} ms {cfg}")


if __name__ == "__main__":
    main()
