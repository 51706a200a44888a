"""The CUDA prefill GEMMs (``fp4moe_ops/backends/cuda_prefill``, an issue-17 experiment) against the
Gluon ones (``prefill_rs.py``) on the same routed inputs, one process.

    python benchmarks/bench_cuda_prefill.py [--tokens 2048,8192] [--diag 1,2,4,5,7] [--balanced]

DeepSeek-V3 layer (E=256, H=7168, I=2048, top-8), 128-row blocks. Per token count: the CUDA GEMMs'
``y`` against the Gluon GEMMs' (max abs difference and the share of bit-equal values: the same
products summed in the same order should agree bit for bit) and the layer through the CUDA GEMMs
against the reference backend on the first 32 tokens; then times (4 routings per CUDA graph, median
of replays, routing and gather outside the graph): both GEMMs of each, the CUDA GEMM1 and GEMM2
alone, and with ``--diag``, for each of ``--configs``, the CUDA GEMMs without the decode (1),
without the MMA (2), without the epilogue's stores (4), or several of them (bits: 5 neither decode
nor stores, 7 only the loads) (wrong results, to time each side). ``--layer``: the whole layer (routing, gather, GEMMs, top-k
sum) as the backend dispatches it, through the CUDA GEMMs and through the Gluon ones, per config.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import fp4moe_ops  # noqa: E402
from bench_gluon_prefill import check, ints, module_moe  # noqa: E402
from bench_moe import graph_time_ms, make_inputs, random_weights  # noqa: E402
from fp4moe_ops.backends.cuda_prefill import prefill as cuda  # noqa: E402
from fp4moe_ops.backends.triton_moe import launch, prefill_rs  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="2048,8192", type=ints)
    ap.add_argument("--diag", default="", type=ints)
    ap.add_argument("--balanced", action="store_true", help="every expert exactly T k / E rows")
    ap.add_argument("--configs", default="128", help="row block sizes with tails: 128,128-64,64-32 ...; "
                                                     "c2 after one: clusters of 2 (128c2, 128-64c2)")
    ap.add_argument("--clusters", default="0", type=ints, help="cluster counts to try with c2 configs (0: SMs / 2)")
    ap.add_argument("--scale-ahead", default="4", type=ints,
                    help="prefill.cu's SCALE_AHEAD values to compare (each its own cubin), per config")
    ap.add_argument("--layer", action="store_true",
                    help="also the whole layer: the backend as it dispatches (its bucket's kernels) against "
                         "cuda.prefill_moe and the Gluon path in each of --configs (no clusters)")
    args = ap.parse_args()
    torch.manual_seed(0)
    e, h, i, k = 256, 7168, 2048, 8
    w = random_weights(e, h, i, "cuda")
    ref_impl = fp4moe_ops.prepare_experts(w, "reference")
    tensors = fp4moe_ops.prepare_experts(w, "triton").op_tensors()
    del w
    w13, s13, g13, w2, s2, g2 = tensors
    for t in args.tokens:
        inputs = make_inputs(t, h, k, e, "cuda")
        if args.balanced:
            slots = torch.arange(t * k, device="cuda").view(t, k) % e
            inputs = [(x, torch.randperm(e, device="cuda")[slots], rw) for x, _, rw in inputs]
        flops = 2 * 3 * h * i * t * k
        print(f"T={t}{' balanced' if args.balanced else ''}", flush=True)
        x, ids, rw = inputs[0]
        sub = slice(0, 32)
        ref = ref_impl(x[sub], ids[sub], rw[sub])
        check("cuda layer", module_moe(cuda, x, ids, rw, tensors)[sub], ref)

        def report(name, fn, data, work=flops):
            ms = graph_time_ms(fn, data)
            print(f"  {name}: {ms:.3f} ms {work / ms / 1e9:.0f} TFLOP/s", flush=True)

        if args.layer:
            report("backend layer (as dispatched)", lambda a, b, c: launch.triton_fused_moe(a, b, c, tensors), inputs)
            for config in args.configs.split(","):
                if config.endswith("c2"):
                    continue
                bm, *tails = (int(v) for v in config.split("-"))
                check(f"cuda layer {config}", cuda.prefill_moe(x, ids, rw, tensors, bm, tails)[sub], ref)
                report(f"cuda layer {config}", lambda a, b, c: cuda.prefill_moe(a, b, c, tensors, bm, tails), inputs)
                report(f"gluon layer {config}",
                       lambda a, b, c: launch._gluon_prefill_moe(a, b, c, tensors, block_m=bm, tails=tuple(tails)), inputs)
        pre = []
        for x, ids, rw in inputs:
            *routed, x_fragment = launch.route(ids, e, 128, x, prefill_rs.BK.value)
            pre.append((x_fragment.index_select(0, routed[0].long() // k), rw.float().contiguous(), *routed))
        y_cuda = cuda.prefill_gemms(pre[0][0], w13, s13, g13, w2, s2, g2, *pre[0][1:])
        y_gluon = prefill_rs.prefill_gemms(pre[0][0], w13, s13, g13, w2, s2, g2, *pre[0][1:])
        used = slice(0, t * k)  # y is by slot; rows past the slots are not written
        diff = (y_cuda[used] - y_gluon[used]).abs()
        same = (y_cuda[used] == y_gluon[used]).float().mean().item()
        print(f"  cuda vs gluon y: max abs diff {diff.max().item():.3e} (scale {y_gluon[used].abs().max().item():.3e}), "
              f"bit-equal {100 * same:.2f}%", flush=True)

        report("gluon GEMMs", lambda xs, r, *b: prefill_rs.prefill_gemms(xs, w13, s13, g13, w2, s2, g2, r, *b), pre)
        report("cuda GEMMs", lambda xs, r, *b: cuda.prefill_gemms(xs, w13, s13, g13, w2, s2, g2, r, *b), pre)

        def report_apart(label, data, bm=128):
            """GEMM1 and GEMM2 each alone (GEMM2 on GEMM1's outputs)."""
            report(f"cuda GEMM1{label}", lambda xs, r, slot, *b: cuda.gemm1(xs, w13, s13, g13, slot, *b, block_m=bm),
                   data, flops * 2 / 3)
            hs = [(cuda.gemm1(xs, w13, s13, g13, slot, *b, block_m=bm), r, slot, *b) for xs, r, slot, *b in data]
            report(f"cuda GEMM2{label}", lambda hh, r, *b: cuda.gemm2(hh, w2, s2, g2, r, *b, block_m=bm), hs, flops / 3)

        report_apart("", pre)
        for config, ahead in ((c, a) for a in args.scale_ahead for c in args.configs.split(",")):
            cuda.DEFINES["SCALE_AHEAD"] = ahead
            label = f"{config} ahead {ahead}" if len(args.scale_ahead) > 1 else config
            cl = 2 if config.endswith("c2") else 1
            bm, *tails = (int(v) for v in config.removesuffix("c2").split("-"))
            routed_bm = []
            for x, ids, rw in inputs:
                *routed, x_fragment = launch.route(ids, e, bm, x, prefill_rs.BK.value)
                routed_bm.append((x_fragment.index_select(0, routed[0].long() // k), rw.float().contiguous(), *routed))
            y_c = cuda.prefill_gemms(routed_bm[0][0], w13, s13, g13, w2, s2, g2, *routed_bm[0][1:], block_m=bm,
                                     tails=tails, cluster=cl)
            err = (y_c[used] - y_gluon[used]).abs().max().item()
            for clusters in args.clusters if cl == 2 else [0]:
                cuda.MAX_CLUSTERS = clusters
                report(f"cuda GEMMs {label} {clusters or ''} (max abs diff to gluon {err:.2e})",
                       lambda xs, r, *b: cuda.prefill_gemms(xs, w13, s13, g13, w2, s2, g2, r, *b, block_m=bm,
                                                            tails=tails, cluster=cl),
                       routed_bm)
                if not tails and cl == 1:
                    report_apart(f" {label}", routed_bm, bm)
                for d in args.diag:
                    report(f"cuda GEMMs {label} {clusters or ''} diag {d}",
                           lambda xs, r, *b: cuda.prefill_gemms(xs, w13, s13, g13, w2, s2, g2, r, *b, block_m=bm,
                                                                tails=tails, cluster=cl, diag=d),
                           routed_bm)
            cuda.MAX_CLUSTERS = 0
            cuda.DEFINES.clear()
            del routed_bm
        del inputs, pre
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
