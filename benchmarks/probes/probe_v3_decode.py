"""The layer at decode sizes on decode_v3 (mma.sync, weights and scales through a TMA ring) against
the wgmma kernels, A B A B in one process.

    python benchmarks/probes/probe_v3_decode.py [--tokens 1,2,4,8,16,32,64] [--variants 2:2:2:8,2:1:2:8]

DeepSeek-V3's layer, random NVFP4 weights and routing (bench_moe's), 8 routings per CUDA graph,
median of replays. Variants: ``STAGES:SPS:STAGES1[:BM]`` (the down GEMM's ring slots and steps per slot,
the gate_up GEMM's ring slots, the routed row blocks' rows); kernel_config's own choice is reported as "as
configured". Every variant is checked against the reference backend on the first 32 tokens.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
import fp4moe_ops  # noqa: E402
from bench_moe import error_vs_reference, graph_time_ms, make_inputs, random_weights  # noqa: E402
from fp4moe_ops.backends.triton_moe import launch  # noqa: E402

E, H, I, K = 256, 7168, 2048, 8


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64")
    ap.add_argument("--variants", default="2:2:2:8,2:1:2:8,2:2:2:16",
                    help="STAGES:SPS:STAGES1[:BM] of decode_v3 (BM: routed row blocks, 16 unless given)")
    ap.add_argument("--rounds", type=int, default=2, help="A B A B rounds")
    args = ap.parse_args()
    torch.manual_seed(0)
    w = random_weights(E, H, I, "cuda")
    ref_impl = fp4moe_ops.prepare_experts(w, "reference")
    tensors = fp4moe_ops.prepare_experts(w, "triton").op_tensors()
    del w
    for t in [int(v) for v in args.tokens.split(",")]:
        inputs = make_inputs(t, H, K, E, "cuda", n=8)
        cfg = launch.kernel_config(t * K, E, H, I)
        variants = {"wgmma": cfg | {"DECODE_V3": False}, "as configured": cfg}
        for v in args.variants.split(","):
            stages, sps, stages1, bm = ([int(f) for f in v.split(":")] + [16])[:4]
            variants[f"v3 {v}"] = cfg | dict(DECODE_V3=True, V3_STAGES=stages, V3_SPS=sps, V3_SPS_ONE_TOKEN=sps,
                                             V3_STAGES_GATE_UP=stages1, V3_BM=bm)
        x, ids, rw = inputs[0]
        sub = slice(0, 32)
        ref = ref_impl(x[sub], ids[sub], rw[sub])
        times = {name: [] for name in variants}
        for name, c in variants.items():
            err = error_vs_reference(launch.triton_fused_moe(x, ids, rw, tensors, c)[sub].double(), ref.double())
            print(f"T={t} {name}: rel err vs reference {err:.2e}", flush=True)
        for _ in range(args.rounds):  # A B A B
            for name, c in variants.items():
                times[name].append(graph_time_ms(lambda a, b, r, c=c: launch.triton_fused_moe(a, b, r, tensors, c),
                                                 inputs))
        print(f"T={t} (DECODE_V3 {cfg['DECODE_V3']}): "
              + "; ".join(f"{name} {' / '.join(f'{v:.4f}' for v in ts)} ms" for name, ts in times.items()), flush=True)


if __name__ == "__main__":
    main()
