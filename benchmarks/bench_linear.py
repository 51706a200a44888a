"""``fp4moe::nvfp4_linear`` against BF16 ``F.linear`` at DeepSeek-V3's attention, shared-expert and
dense-MLP shapes and Qwen3-MoE's attention shapes, all in one process: median time per call,
CUDA-graph replay on a GPU (wall time on CPU), for 1-8192 tokens.

    python benchmarks/bench_linear.py --tokens 1,8,64,512,2048,8192      # GPU
    python benchmarks/bench_linear.py --tokens 1,8 --small                # CPU smoke run
    python benchmarks/bench_linear.py --sweep --shapes o_proj --tokens 1,64,128   # kernel variants (GPU)

Columns: the op on the weight in the paired layout (what an ``NVFP4Linear`` holds on Hopper, as it
calls it: with its split-K counter table), the op on the weight as stored, the dequantize + cuBLAS
path forced, the ``"reference"`` backend (decode in torch every call), and BF16 ``F.linear`` on the
dequantized weight. Each graph cycles through
enough distinct weight copies (>= 150 MB of NVFP4 bytes, 3x the H200's 50 MB L2) that weights
come from HBM, as they do in a model. Floor: NVFP4 weight + scale bytes (N K 0.5625) at the
measured copy bandwidth, or the BF16 GEMM at ``--tflops`` where that is longer. Every output is
checked against BF16 ``F.linear`` first (relative error printed).
"""

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.append(str(Path(__file__).resolve().parent.parent))
import fp4moe_ops  # noqa: E402
from fp4moe_ops import nvfp4  # noqa: E402

# (name, N = out_features, K = in_features): DeepSeek-V3's MLA projections, its shared expert, the
# MLP of its first three (dense) layers; then Qwen3-MoE's attention (30B-A3B: hidden 2048, 32 query
# and 4 key/value heads of 128; 235B-A22B: hidden 4096, 64 and 4), k_proj and v_proj alike. Last,
# the linears that read one input as one weight (what a fused launch of them would stream; none of
# the models runs them so today): DeepSeek-V3's q_a_proj + kv_a_proj_with_mqa, Qwen3-30B-A3B's q/k/v
SHAPES = [("q_a_proj", 1536, 7168), ("q_b_proj", 24576, 1536), ("kv_a_proj_with_mqa", 576, 7168),
          ("kv_b_proj", 32768, 512), ("o_proj", 7168, 16384), ("shared gate_up", 4096, 7168),
          ("shared down", 7168, 2048), ("dense gate_up", 36864, 7168), ("dense down", 7168, 18432),
          ("qwen3-30b q_proj", 4096, 2048), ("qwen3-30b k/v_proj", 512, 2048), ("qwen3-30b o_proj", 2048, 4096),
          ("qwen3-235b q_proj", 8192, 4096), ("qwen3-235b k/v_proj", 512, 4096), ("qwen3-235b o_proj", 4096, 8192),
          ("q_a + kv_a as one", 2112, 7168), ("qwen3-30b q/k/v as one", 5120, 2048)]


def time_ms(fn, inputs, cuda: bool) -> float:
    if not cuda:
        fn(*inputs[0])
        times = []
        for r in range(3):
            t0 = time.perf_counter()
            fn(*inputs[r % len(inputs)])
            times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times)
    from bench_moe import graph_time_ms

    return graph_time_ms(fn, inputs)


def weight_copies(n: int, k: int, device) -> list[tuple]:
    """Distinct random NVFP4 weights ``(packed, block scale, global scale, BF16 dequantized, packed in
    the paired layout)``: on a GPU enough copies for >= 150 MB of NVFP4 bytes (3x the H200's L2), so
    a graph cycling through them reads weights from HBM; one on CPU."""
    from fp4moe_ops.backends.triton_moe.layout import paired_weight_layout

    copies = max(2, min(64, int(150e6 // (n * k * 0.5625)) + 1)) if device != "cpu" else 1
    out = []
    for _ in range(copies):
        q = nvfp4.quantize_nvfp4(torch.randn(n, k, device=device) / k**0.5)
        w, s, g = q.packed, q.block_scale, q.global_scale.reshape(())
        out.append((w, s, g, nvfp4.dequantize_nvfp4(w, s, g, torch.bfloat16), paired_weight_layout(w)))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,8,64,512,2048,8192")
    ap.add_argument("--small", action="store_true", help="shapes / 8 (a CPU smoke run)")
    ap.add_argument("--shapes", default="", help="comma-separated names from SHAPES (default: all)")
    ap.add_argument("--tflops", type=float, default=790.0, help="BF16 dense tensor-core rate for the floor")
    ap.add_argument("--reference", action="store_true", help="also time the reference backend")
    ap.add_argument("--sweep", action="store_true",
                    help="instead: kernel variants (K parts, warps, token block) against the chosen config and BF16")
    ap.add_argument("--gemv", action="store_true", help="with --sweep: GEMV variants at 1-16 tokens too")
    args = ap.parse_args()
    # fp4moe says once which kernel family its linears run (the Triton release, Gluon or not)
    logging.basicConfig(format="%(message)s")
    logging.getLogger("fp4moe").setLevel(logging.INFO)
    if args.sweep:
        return sweep(args)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    from fp4moe_ops.backends.triton_moe.launch import linear_config, linear_supported, triton_nvfp4_linear
    from fp4moe_ops.linear import split_counters

    table = split_counters(device)

    bw = float("nan")
    if cuda:
        from bench_moe import copy_bandwidth

        bw = copy_bandwidth(device)
    print(f"device {torch.cuda.get_device_name() if cuda else 'cpu'}, torch {torch.__version__}, "
          f"copy bandwidth {bw / 1e12:.2f} TB/s")
    print("| layer | N | K | tokens | floor ms | paired ms | x floor | stored ms | dequant+cuBLAS ms "
          "| reference ms | F.linear BF16 ms | BF16 / paired | rel err vs BF16 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    wanted = set(args.shapes.split(",")) if args.shapes else None
    for name, n, k in SHAPES:
        if wanted and name not in wanted:
            continue
        if args.small:
            n, k = max(64, n // 8 // 64 * 64), max(256, k // 8)  # (N a multiple of 64, as the kernels tile it)
        fp4_bytes = n * k * 0.5625
        weights = weight_copies(n, k, device)
        copies = len(weights)
        for t in (int(x) for x in args.tokens.split(",")):
            inputs = [(torch.randn(t, k, device=device, dtype=torch.bfloat16), *weights[i]) for i in range(copies)]
            floor = max(fp4_bytes / bw, 2 * t * n * k / (args.tflops * 1e12)) * 1e3
            x, w, s, g, bf16, words = inputs[0]
            want = F.linear(x, bf16).double()
            got = fp4moe_ops.nvfp4_linear(x, words, s, g, counters=table).double()
            err = ((got - want).norm() / want.norm()).item()
            # as NVFP4Linear calls it: its weight in the paired layout where the Triton kernels run,
            # with its counter table (split-K parts summed in one launch); then the weight as stored
            paired = time_ms(lambda x, w, s, g, b, p: fp4moe_ops.nvfp4_linear(x, p, s, g, counters=table), inputs,
                             cuda)
            stored = time_ms(lambda x, w, s, g, b, p: fp4moe_ops.nvfp4_linear(x, w, s, g, counters=table), inputs,
                             cuda)
            base = time_ms(lambda x, w, s, g, b, p: F.linear(x, b), inputs, cuda)
            dequant = None
            if linear_supported(x, w) is None:
                cfg = linear_config(65, n, k)
                dequant = time_ms(lambda x, w, s, g, b, p: triton_nvfp4_linear(x, w, s, g, None, cfg, table), inputs,
                                  cuda)
            ref = time_ms(lambda x, w, s, g, b, p: fp4moe_ops.nvfp4_linear(x, w, s, g, backend="reference"),
                          inputs[:4], cuda) if args.reference or not cuda else float("nan")
            fmt = lambda v: "" if v is None else f"{v:.4f}"  # noqa: E731
            print(f"| {name} | {n} | {k} | {t} | {floor:.4f} | {paired:.4f} | {paired / floor:.2f}x | {stored:.4f} | "
                  f"{fmt(dequant)} | {ref:.4f} | {base:.4f} | {base / paired:.2f}x | {err:.1e} |", flush=True)
        del weights, inputs
        if cuda:
            torch.cuda.empty_cache()


def sweep(args):
    """Time kernel variants per (shape, tokens) on the GPU: the GEMV's past 64 tokens too (token
    blocks of 16-128 rows, K parts, warps) and up to 64 decode_v3's linear on paired weights
    (token blocks, K parts, ring stages): prints the chosen config's time (paired weights, the
    dequantize + cuBLAS path past 64 tokens), the best variant's and BF16 ``F.linear``'s."""
    from bench_moe import copy_bandwidth, graph_time_ms

    from fp4moe_ops.backends.triton_moe.launch import LINEAR_GEMV_MAX_TOKENS, linear_config, triton_nvfp4_linear
    from fp4moe_ops.linear import split_counters

    table = split_counters("cuda")
    bw = copy_bandwidth("cuda")
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s")
    print("| layer | tokens | floor ms | chosen | chosen ms | best variant | best ms | best v3 | v3 ms | BF16 ms "
          "| BF16 / best |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    wanted = set(args.shapes.split(",")) if args.shapes else None
    short = lambda c: (f"P{c['PARTS']} S{c['num_stages']} W{c['num_warps']} BM{c['BM']}"  # noqa: E731
                       if c["path"] == "gemv" else f"v3 P{c['PARTS']} S{c['STAGES']} BM{c['BM']}"
                       if c["path"] == "v3" else c["path"])
    for name, n, k in SHAPES:
        if wanted and name not in wanted:
            continue
        fp4_bytes = n * k * 0.5625
        copies = weight_copies(n, k, "cuda")
        for t in (int(x) for x in args.tokens.split(",")):
            inputs = [(torch.randn(t, k, device="cuda", dtype=torch.bfloat16), *copies[i][:3])
                      for i in range(len(copies))]
            paired_inputs = [(x, c[4], s, g) for (x, _, s, g), c in zip(inputs, copies)]
            chosen = linear_config(t, n, k, True, True)
            gemv = linear_config(min(t, LINEAR_GEMV_MAX_TOKENS), n, k)
            blocks = {16, 32} if t <= 32 else {32, 64, 128}
            variants = []
            for bm in sorted(b for b in blocks if b < 2 * t):
                tiles = (n // gemv["BN"]) * -(-t // bm)
                target = max(1, min(16, k // 256, -(-264 // tiles)))
                for parts in sorted({max(1, target // 2), target, min(16, k // 256, 2 * target)}):
                    for warps in (4, 8):  # (2 pipeline stages: 3 lost at 1-64 tokens, benchmarks/NOTES.md)
                        variants.append(dict(gemv, PARTS=parts, num_stages=2, num_warps=warps, BM=bm))
            if t <= 4 * LINEAR_GEMV_MAX_TOKENS:  # decode_v3's linear on the paired weights
                slots = k // (512 if k % 512 == 0 else 256)
                for bm in (8, 16, 32, 64):
                    if (bm == 8 or bm < 2 * t) and bm * 32 >= t:
                        variants += [dict(path="v3", BM=bm, PARTS=p, STAGES=2) for p in range(1, 17)
                                     if slots % p == 0]
            if t <= 16 and not args.gemv:
                variants = [v for v in variants if v["path"] == "v3"]
            times = []
            for cfg in variants:
                try:
                    ms = graph_time_ms(lambda x, w, s, g, c=cfg: triton_nvfp4_linear(x, w, s, g, None, c, table),
                                       paired_inputs if cfg["path"] == "v3" else inputs)
                except Exception as e:  # noqa: BLE001 - a variant that does not compile is skipped
                    print(f"  {short(cfg)}: {type(e).__name__}", flush=True)
                    continue
                times.append((ms, cfg))
            base = graph_time_ms(lambda x, w, s, g: triton_nvfp4_linear(x, w, s, g, None, chosen, table),
                                 paired_inputs)
            bf16 = [(inp[0], c[3]) for inp, c in zip(inputs, copies)]
            ref = graph_time_ms(lambda x, b: F.linear(x, b), bf16)
            best_ms, best = min(times, key=lambda r: r[0])
            v3 = [r for r in times if r[1]["path"] == "v3"]
            v3_ms, v3_best = min(v3, key=lambda r: r[0]) if v3 else (float("nan"), None)
            print(f"| {name} | {t} | {fp4_bytes / bw * 1e3:.4f} | {short(chosen)} | {base:.4f} | {short(best)} | "
                  f"{best_ms:.4f} | {short(v3_best) if v3_best else ''} | {v3_ms:.4f} | {ref:.4f} | "
                  f"{ref / best_ms:.2f}x |", flush=True)
            del inputs, bf16
        del copies
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
