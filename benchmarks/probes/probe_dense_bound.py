"""What the best BF16 tensor-core GEMMs on this GPU take for a MoE layer's expert math, with no
FP4 decode, no routing and no load imbalance: a bound for the prefill kernels.

    python benchmarks/probes/probe_dense_bound.py [--tokens 512,2048,8192]

For T tokens of the DeepSeek-V3 layer (E=256, H=7168, I=2048, top-8: S = 8T rows), in one
process, CUDA-graph replays of several input sets (bench_moe.graph_time_ms):

- ``dense``: one GEMM pair with the same FLOPs, ``[S, H] @ [H, 2I]`` then ``[S, I] @ [I, H]``
  (cuBLAS; one weight matrix, so its reads are cheap): the MMA rate this GPU reaches at all;
- ``bmm``: perfectly balanced experts, ``[E, S/E, H] @ [E, H, 2I]`` then ``[E, S/E, I] @ [E, I, H]``
  (cuBLAS batched; all 22.5 GB of BF16 weights read);
- ``grouped_mm``: the same balanced rows through ``torch._grouped_mm`` (the BF16 anchor's GEMMs);
- ``fp4moe``: our whole layer (routing, gather, both GEMMs, SwiGLU, top-k sum) on random routing,
  NVFP4 weights, for comparison in the same process.

Only the GEMMs are timed for the BF16 rows (no SwiGLU, no routing): they are lower bounds of a
BF16 layer built from these kernels.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
import fp4moe_ops  # noqa: E402
from bench_moe import graph_time_ms, make_inputs, random_weights  # noqa: E402

E, H, I, K = 256, 7168, 2048, 8


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="512,2048,8192")
    ap.add_argument("--sets", type=int, default=3, help="input sets per graph")
    args = ap.parse_args()
    dev = "cuda"
    torch.manual_seed(0)
    gate_up = torch.randn(E, H, 2 * I, device=dev, dtype=torch.bfloat16) / H**0.5  # [E, H, 2I]
    down = torch.randn(E, I, H, device=dev, dtype=torch.bfloat16) / I**0.5  # [E, I, H]
    ours = fp4moe_ops.prepare_experts(random_weights(E, H, I, dev), "triton")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| tokens | GEMM FLOPs | dense pair | bmm balanced | grouped_mm balanced | fp4moe layer |")
    print("|---|---|---|---|---|---|")
    for t in [int(v) for v in args.tokens.split(",")]:
        s = t * K
        m = s // E
        flops = 2 * s * H * 3 * I
        xs = [torch.randn(s, H, device=dev, dtype=torch.bfloat16) for _ in range(args.sets)]
        hs = [torch.randn(s, I, device=dev, dtype=torch.bfloat16) for _ in range(args.sets)]
        offs = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * m
        cells = []
        for fn in (lambda x, h: (x @ gate_up[0], h @ down[0]),
                   lambda x, h: (torch.bmm(x.view(E, m, H), gate_up), torch.bmm(h.view(E, m, I), down)),
                   lambda x, h: (torch._grouped_mm(x, gate_up, offs=offs), torch._grouped_mm(h, down, offs=offs))):
            ms = graph_time_ms(fn, list(zip(xs, hs)))
            cells.append(f"{ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s)")
        del xs, hs
        inputs = make_inputs(t, H, K, E, dev)
        ms = graph_time_ms(lambda x, ids, rw: ours(x, ids, rw), inputs)
        cells.append(f"{ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s)")
        print(f"| {t} | {flops / 1e12:.2f} T | " + " | ".join(cells) + " |", flush=True)
        del inputs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
