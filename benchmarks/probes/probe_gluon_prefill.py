"""The Gluon prefill GEMMs (``prefill_rs.py``) against the Triton backend's single-role kernels, one
process.

    python benchmarks/probes/probe_gluon_prefill.py [--tokens 2048,4096,6144,8192] [--stages 3,4] [--diag 0,1]
        [--block-m auto|8,16,...] [--tail 0,64,64-32] [--compare-module NAME] [--balanced] [--no-layer]
        [--skip-small]

``--compare-module`` also takes a dotted module path (any module with a ``prefill_gemms`` of the
same interface), timed beside the Gluon GEMMs when ``--diag`` is given.

First a small shape (E=8, H=1024, I=512, top-2; partial row blocks, rows past the end of the
activations) checked against the reference backend, then the DeepSeek-V3 layer: each token count
checked against the reference on the first 32 tokens (tokens are independent) and timed as in
``bench_moe.py`` (4 routings per CUDA graph, median of replays): the whole layer (routing, gather,
both GEMMs, top-k sum) for both implementations, and with ``--diag`` the Gluon GEMMs alone
(``--diag 0,1,2,3``: as they are; without the decode; without the MMA; both, the MMA on a constant
operand so that neither waits for the other: wrong results, to time each side; 128-row blocks, no
tails). ``--block-m``: row blocks of these sizes (``auto``: the sizes around the expected rows per
expert), each with the deepest ring that fits (at most 8 slots) unless ``--stages``, and with tail
blocks (``--tail``: an expert's last block of at most that many rows in narrower tiles);
``--compare-module``: also the layer through another module of the same interface at 128 rows (a
copy of an earlier ``prefill_rs.py`` in ``fp4moe_ops/backends/triton_moe/``, for A/B).
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
from fp4moe_ops.backends.triton_moe import launch, prefill_rs  # noqa: E402


def gluon_moe(x, ids, rw, tensors, stages=4, block_m=128, tails=()):
    """The backend's Gluon prefill path (routing, gather, both GEMMs, top-k sum) with these row
    blocks, ring depth and tail blocks."""
    return launch._gluon_prefill_moe(x, ids, rw, tensors, block_m=block_m, stages=stages, tails=tails)


def module_moe(module, x, ids, rw, tensors, stages=4):
    """The same path through ``module.prefill_gemms`` (an earlier copy: 128-row blocks)."""
    num_experts = tensors[1].shape[0]  # (gate_up_scale [E, 2I, H/16])
    *routed, x_fragment = launch.route(ids, num_experts, 128, x, 64)
    x_sorted = x_fragment.index_select(0, routed[0].long() // ids.shape[1])
    y = module.prefill_gemms(x_sorted, *tensors, rw.contiguous(), *routed, stages=stages)
    return launch._sum_topk(y, ids, x, num_experts)


def configs(block_ms, stages, rows_per_expert, tails=((),)):
    """(block_m, stages, tails) triples: ``block_ms`` or, for ``auto``, the smallest block holding
    the expected rows per expert and its neighbours; ring depths given or the deepest that fits
    (<= 8); the tails below block_m."""
    if block_ms == "auto":
        sizes = prefill_rs.BLOCK_MS
        first = next((j for j, b in enumerate(sizes) if b >= rows_per_expert), len(sizes) - 1)
        block_ms = sizes[max(0, first - 1):first + 2]
    else:
        block_ms = ints(block_ms)
    out = []
    for bm in block_ms:
        depths = stages or [max(st for st in range(3, 9) if prefill_rs.ring_fits(bm, st))]
        out += [(bm, st, tm) for st in depths for tm in tails if all(m < bm for m in tm)]
    return out


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
    ap.add_argument("--stages", default="", type=ints, help="ring depths to compare (default: the deepest that fits)")
    ap.add_argument("--block-m", default="128", help="row block sizes, or auto")
    ap.add_argument("--tail", default="0", help="tail block sizes to try: 0 (none), 64, 64-32, ...",
                    type=lambda s: [tuple(int(m) for m in v.split("-") if m != "0") for v in s.split(",")])
    ap.add_argument("--compare-module", default="",
                    help="a module in fp4moe_ops.backends.triton_moe to A/B at 128 rows")
    ap.add_argument("--skip-small", action="store_true")
    ap.add_argument("--diag", default="", type=ints,
                    help="GEMM-only timings: 0 normal, 1 without the decode, 2 without the MMA, 3 both unlinked "
                         "(prefill_rs.prefill_gemms' diag)")
    ap.add_argument("--no-layer", action="store_true", help="GEMM-only timings")
    ap.add_argument("--balanced", action="store_true",
                    help="every expert gets exactly T k / E rows (no partial row blocks where that divides)")
    args = ap.parse_args()
    torch.manual_seed(0)
    other = None
    if args.compare_module:
        import importlib

        name = args.compare_module  # a module of the backend, or a dotted path
        other = importlib.import_module(name if "." in name else f"fp4moe_ops.backends.triton_moe.{name}")

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
            for bm, st, tm in configs(args.block_m, args.stages, t * k / e, args.tail):
                check(f"gluon {bm}:{st}:{tm}", gluon_moe(x, ids, rw, tensors, st, bm, tm), ref)
            if other is not None:
                check(f"{args.compare_module} 4", module_moe(other, x, ids, rw, tensors), ref)

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
            print(f"  triton single-role layer {ms:.4f} ms {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
        for bm, st, tm in configs(args.block_m, args.stages, t * k / e, args.tail):
            name = f"gluon {bm}:{st}:{'-'.join(map(str, tm)) or 0}"
            if not check(name, gluon_moe(x, ids, rw, tensors, st, bm, tm)[sub], ref) or args.no_layer:
                continue
            ms = graph_time_ms(lambda a, b, c: gluon_moe(a, b, c, tensors, st, bm, tm), inputs)
            print(f"  {name} layer {ms:.4f} ms {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
        if other is not None and check(f"{args.compare_module} 4", module_moe(other, x, ids, rw, tensors)[sub], ref):
            ms = graph_time_ms(lambda a, b, c: module_moe(other, a, b, c, tensors), inputs)
            print(f"  {args.compare_module} 128:4 layer {ms:.4f} ms {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
        # the GEMMs alone (routing and gather outside the graph)
        pre = []
        for x, ids, rw in inputs:
            *routed, x_fragment = launch.route(ids, e, 128, x, prefill_rs.BK.value)
            pre.append((x_fragment.index_select(0, routed[0].long() // k), rw.float().contiguous(), *routed))
        for diag in args.diag:
            for st in args.stages or [4]:
                ms = graph_time_ms(lambda xs, rw, *r: prefill_rs.prefill_gemms(xs, *tensors, rw, *r, stages=st, diag=diag),
                                   pre)
                print(f"  gluon {st} GEMMs alone, diag {diag}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
        if other is not None and args.diag:
            ms = graph_time_ms(lambda xs, rw, *r: other.prefill_gemms(xs, *tensors, rw, *r), pre)
            print(f"  {args.compare_module} GEMMs alone: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
        del inputs, pre
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
