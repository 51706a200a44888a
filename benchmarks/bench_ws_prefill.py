"""The warp-specialized prefill GEMMs (``prefill_ws.py``, Gluon) against the Triton backend's
single-role kernels, one process (issue 17).

    python benchmarks/bench_ws_prefill.py [--tokens 512,2048,8192] [--variant XS,WS,DS ...] [--diag 0,1,2,3]
        [--balanced] [--no-layer] [--skip-small]

First a small shape (E=8, H=1024, I=512, top-2; partial row blocks, rows past the end of the
activations) checked against the reference backend, then the DeepSeek-V3 layer: each token count
checked against the reference on the first 32 tokens (tokens are independent) and timed as in
``bench_moe.py`` (4 routings per CUDA graph, median of replays): the whole layer (routing,
gather, both GEMMs, top-k sum) for both implementations, and each of the new GEMMs alone.
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
from fp4moe_ops.backends.triton_moe import launch, prefill_rs, prefill_ws  # noqa: E402


def ws_moe(x, ids, rw, tensors, stages=(4, 6, 2)):
    """The backend's warp-specialized path (routing, gather, both GEMMs, top-k sum) with these ring depths."""
    return launch._warp_specialized_moe(x, ids, rw, tensors, stages=stages)


def rs_moe(x, ids, rw, tensors, stages=6, diag=0):
    """Routing, gather in fragment order, the register-operand GEMMs (prefill_rs.py), top-k sum."""
    w13, s13, g13, w2, s2, g2 = tensors
    e = s13.shape[0]
    sorted_slot, block_expert, row_start, row_end = launch.route(ids, e, prefill_rs.BLOCK_M)
    xs = prefill_rs.gather_fragment_order(x, sorted_slot.long() // ids.shape[1])
    y = prefill_rs.rs_prefill_gemms(xs, w13, s13, g13, w2, s2, g2, rw.float().contiguous(), sorted_slot, block_expert,
                                    row_start, row_end, stages=stages, diag=diag)
    return launch._sum_topk(y, ids, x, e)


def single_role(x, ids, rw, tensors):
    """The Triton backend's single-role kernels (its config with the warp-specialized path off)."""
    cfg = launch.kernel_config(ids.numel(), tensors[2].shape[0], x.shape[1], tensors[1].shape[1] // 2)
    return launch.triton_fused_moe(x, ids, rw, tensors, cfg | {"WARP_SPECIALIZED": False})


def check(name, out, ref, limit=2e-3):
    err = error_vs_reference(out.double(), ref.double())
    ok = err < limit  # exact weights: fp32 summation order and bf16 roundings only (bench_moe: <= 1.2e-3)
    print(f"  {name}: rel err vs reference {err:.2e} {'ok' if ok else 'WRONG'}", flush=True)
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="512,2048,8192")
    ap.add_argument("--variant", action="append", default=[], help="XS,WS,DS ring depths")
    ap.add_argument("--skip-small", action="store_true")
    ap.add_argument("--diag", default="0", type=lambda s: [int(v) for v in s.split(",")],
                    help="GEMM-only timings: 0 normal, 1 without the decode, 2 without the wgmma, "
                         "3 step 0's scales at every step")
    ap.add_argument("--no-layer", action="store_true", help="GEMM-only timings")
    ap.add_argument("--rs-stages", default="6", type=lambda s: [int(v) for v in s.split(",") if v],
                    help="ring depths of the register-operand kernels (prefill_rs.py); empty: not run")
    ap.add_argument("--balanced", action="store_true",
                    help="every expert gets exactly T k / E rows (no partial row blocks where that divides)")
    args = ap.parse_args()
    variants = [(4, 6, 2)] + [tuple(int(v) for v in s.split(",")) for s in args.variant]
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
            for v in variants:
                check(f"ws {v}", ws_moe(x, ids, rw, tensors, v), ref)
            for st in args.rs_stages:
                check(f"rs {st}", rs_moe(x, ids, rw, tensors, st), ref)

    if not args.tokens:
        return
    e, h, i, k = 256, 7168, 2048, 8
    w = random_weights(e, h, i, "cuda")
    ref_impl = fp4moe_ops.prepare_experts(w, "reference")
    tensors = fp4moe_ops.prepare_experts(w, "triton").op_tensors()
    del w
    for t in (int(s) for s in args.tokens.split(",") if s):
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
        for v in variants if not args.no_layer else ():
            try:
                if not check(f"ws {v}", ws_moe(x, ids, rw, tensors, v)[sub], ref):
                    continue
                ms = graph_time_ms(lambda a, b, c: ws_moe(a, b, c, tensors, v), inputs)
                print(f"  ws {v} layer {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
            except Exception as exc:  # noqa: BLE001 - report and go on
                print(f"  ws {v} FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        for st in args.rs_stages if not args.no_layer else ():
            try:
                if not check(f"rs {st}", rs_moe(x, ids, rw, tensors, st)[sub], ref):
                    continue
                ms = graph_time_ms(lambda a, b, c: rs_moe(a, b, c, tensors, st), inputs)
                print(f"  rs {st} layer {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
            except Exception as exc:  # noqa: BLE001 - report and go on
                print(f"  rs {st} FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        # the new GEMMs alone (routing and gather outside the graph)
        w13, s13, g13, w2, s2, g2 = tensors
        pre = []
        for x, ids, rw in inputs:
            routed = launch.route(ids, e, prefill_ws.BLOCK_M)
            pre.append((x.index_select(0, routed[0].long() // k), rw.float().contiguous(), *routed))
        pre_rs = [(prefill_rs.gather_fragment_order(x, p[2].long() // k), *p[1:]) for (x, _, _), p in zip(inputs, pre)]
        for diag in args.diag:  # 1: no decode, 2: no wgmma, 3: scales from L1 (diagnostics, wrong results)
            for v in variants:
                ms = graph_time_ms(lambda xs, rw, *r: prefill_ws.ws_prefill_gemms(xs, w13, s13, g13, w2, s2, g2, rw, *r,
                                                                                  stages=v, diag=diag), pre)
                print(f"  ws {v} GEMMs alone, diag {diag}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
            for st in args.rs_stages if diag in (0, 1) else ():
                ms = graph_time_ms(lambda xs, rw, *r: prefill_rs.rs_prefill_gemms(xs, w13, s13, g13, w2, s2, g2, rw, *r,
                                                                                  stages=st, diag=diag), pre_rs)
                print(f"  rs {st} GEMMs alone, diag {diag}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
        del inputs, pre, pre_rs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
