"""The Gluon prefill GEMMs (``prefill_rs.py``) against the Triton backend's single-role kernels, one
process (issue 17).

    python benchmarks/bench_gluon_prefill.py [--tokens 2048,4096,6144,8192] [--stages 3,4] [--diag 0,1]
        [--balanced] [--no-layer] [--skip-small]

First a small shape (E=8, H=1024, I=512, top-2; partial row blocks, rows past the end of the
activations) checked against the reference backend, then the DeepSeek-V3 layer: each token count
checked against the reference on the first 32 tokens (tokens are independent) and timed as in
``bench_moe.py`` (4 routings per CUDA graph, median of replays): the whole layer (routing, gather,
both GEMMs, top-k sum) for both implementations, and the Gluon GEMMs alone (``--diag 1``: without
the decode, to time the rest alone).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import fp4moe_ops  # noqa: E402
from bench_moe import error_vs_reference, graph_time_ms, make_inputs, random_weights  # noqa: E402
from fp4moe_ops.backends.triton_moe import launch, prefill_rs  # noqa: E402


def gluon_moe(x, ids, rw, tensors, stages=4):
    """The backend's Gluon prefill path (routing, gather, both GEMMs, top-k sum) with this ring depth."""
    return launch._gluon_prefill_moe(x, ids, rw, tensors, stages=stages)


def single_role(x, ids, rw, tensors):
    """The Triton backend's single-role kernels (its config with the Gluon path off)."""
    cfg = launch.kernel_config(ids.numel(), tensors[2].shape[0], x.shape[1], tensors[1].shape[1] // 2)
    return launch.triton_fused_moe(x, ids, rw, tensors, cfg | {"GLUON_PREFILL": False})


def check(name, out, ref, limit=2e-3):
    err = error_vs_reference(out.double(), ref.double())
    ok = err < limit  # exact weights: fp32 summation order and bf16 roundings only (bench_moe: <= 1.2e-3)
    print(f"  {name}: rel err vs reference {err:.2e} {'ok' if ok else 'WRONG'}", flush=True)
    return ok


def ints(s):
    return [int(v) for v in s.split(",") if v]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="2048,4096,6144,8192", type=ints)
    ap.add_argument("--stages", default="4", type=ints, help="ring depths to compare (3 or 4)")
    ap.add_argument("--skip-small", action="store_true")
    ap.add_argument("--diag", default="0", type=ints, help="GEMM-only timings: 0 normal, 1 without the decode")
    ap.add_argument("--no-layer", action="store_true", help="GEMM-only timings")
    ap.add_argument("--balanced", action="store_true",
                    help="every expert gets exactly T k / E rows (no partial row blocks where that divides)")
    args = ap.parse_args()
    torch.manual_seed(0)

    if not args.skip_small:
        e, h, i, k = 8, 1024, 512, 2
        w = random_weights(e, h, i, "cuda")
        ref_impl = fp4moe_ops.prepare_experts(w, "reference")
        tensors = fp4moe_ops.prepare_experts(w, "triton").op_tensors()
        for t in (1, 37, 300, 1000):
            x, ids, rw = make_inputs(t, h, k, e, "cuda", n=1)[0]
            ref = ref_impl(x, ids, rw)
            print(f"small T={t}", flush=True)
            check("triton", single_role(x, ids, rw, tensors), ref)
            for st in args.stages:
                check(f"gluon {st}", gluon_moe(x, ids, rw, tensors, st), ref)

    e, h, i, k = 256, 7168, 2048, 8
    w = random_weights(e, h, i, "cuda")
    ref_impl = fp4moe_ops.prepare_experts(w, "reference")
    tensors = fp4moe_ops.prepare_experts(w, "triton").op_tensors()
    del w
    for t in args.tokens:
        inputs = make_inputs(t, h, k, e, "cuda")
        if args.balanced:  # token t's experts perm[(t k + j) % E], j < k: distinct, E | T k -> equal counts
            slots = torch.arange(t * k, device="cuda").view(t, k) % e
            inputs = [(x, torch.randperm(e, device="cuda")[slots], rw) for x, _, rw in inputs]
        x, ids, rw = inputs[0]
        sub = slice(0, 32)
        ref = ref_impl(x[sub], ids[sub], rw[sub])
        flops = 2 * 3 * h * i * t * k
        print(f"T={t}", flush=True)
        check("triton single-role", single_role(x, ids, rw, tensors)[sub], ref)
        if not args.no_layer:
            ms = graph_time_ms(lambda a, b, c: single_role(a, b, c, tensors), inputs)
            print(f"  triton single-role layer {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
        for st in args.stages:
            if not check(f"gluon {st}", gluon_moe(x, ids, rw, tensors, st)[sub], ref) or args.no_layer:
                continue
            ms = graph_time_ms(lambda a, b, c: gluon_moe(a, b, c, tensors, st), inputs)
            print(f"  gluon {st} layer {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
        # the GEMMs alone (routing and gather outside the graph)
        w13, s13, g13, w2, s2, g2 = tensors
        pre = []
        for x, ids, rw in inputs:
            *routed, x_fragment = launch.route(ids, e, prefill_rs.BLOCK_M.value, x, prefill_rs.BK.value)
            pre.append((x_fragment.index_select(0, routed[0].long() // k), rw.float().contiguous(), *routed))
        for diag in args.diag:
            for st in args.stages:
                ms = graph_time_ms(lambda xs, rw, *r: prefill_rs.prefill_gemms(xs, w13, s13, g13, w2, s2, g2, rw, *r,
                                                                               stages=st, diag=diag), pre)
                print(f"  gluon {st} GEMMs alone, diag {diag}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
        del inputs, pre
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
