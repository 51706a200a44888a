"""A/B of the MoE kernels' tiles in one process (issue 17): the previous commit's kernels
(``launch_old``, runtime K: ptxas serializes every wgmma) against the current ones (static K:
wgmma pipelined), and GEMM1 with gate and up rows in one K loop (MERGED_GATE_UP). Each config's
output is compared with the old default's before it is timed.

    python benchmarks/sweep_pipeline.py --tokens 1,8,64,512,2048,8192
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import fp4moe_ops  # noqa: E402
from fp4moe_ops.backends.triton_moe import launch, launch_old  # noqa: E402
from bench_moe import SHAPES, copy_bandwidth, distinct_experts, graph_time_ms, make_inputs, random_weights  # noqa: E402


def configs(t, k, e, h, i):
    """Named configs per bucket: ``(kernels, config)``; P1/P2: GEMM1/GEMM2 with a static K loop
    (wgmma pipelined), U1/U2: with a run-time one (a wait after every wgmma, fewer registers);
    w: warps per program; r: a register cap (ptxas ``maxnreg``)."""
    base = launch.kernel_config(t * k, e, h, i)
    u12 = dict(PIPELINED_MMA1=False, PIPELINED_MMA2=False)
    m = dict(MERGED_GATE_UP=True, SPLIT_GATE_UP=False)
    out = {"old default": ("old", base)}
    if base["SPLIT_GATE_UP"]:  # decode bucket
        out["new split U1 U2 (= old)"] = ("new", base | u12)
        out["new merged BN1=64 P1 P2"] = ("new", base | m | dict(BN1=64))
        out["new merged BN1=128 P1 P2"] = ("new", base | m | dict(BN1=128))
        out["new merged BN1=64 U1 U2"] = ("new", base | m | dict(BN1=64) | u12)
    elif base["BM"] == 32:  # middle
        out["new merged BN1=128 P1 P2 w4"] = ("new", base | m | dict(BN1=128))
        out["new merged BN1=128 P1 P2 w8 r128"] = ("new", base | m | dict(BN1=128, num_warps=8, maxnreg=128))
        out["new merged BN 256/256 P1 P2 w8"] = ("new", base | m | dict(BN1=256, BN2=256, num_warps=8))
        out["new merged BN 256/128 P1 P2 w8 r128"] = ("new", base | m | dict(BN1=256, num_warps=8, maxnreg=128))
    else:  # prefill
        out["new merged P1 P2 w8"] = ("new", base | m)
        out["new merged P1 P2 w16"] = ("new", base | m | dict(num_warps=16))
        out["new merged P1 P2 w16 s2"] = ("new", base | m | dict(num_warps=16, num_stages=2))
        out["new merged P1 P2 w16 BN2=128"] = ("new", base | m | dict(num_warps=16, BN2=128))
        out["new merged P1 P2 w8 BN 128/128 r128 s2"] = ("new", base | m | dict(BN1=128, BN2=128, maxnreg=128, num_stages=2))
    out["old default, again"] = ("old", base)  # the drift over the row
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,8,64,512,2048,8192")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    e, h, i, k, routed = SHAPES["deepseek"]
    bw = copy_bandwidth("cuda")
    w = random_weights(e, h, i, "cuda")
    tensors = fp4moe_ops.prepare_experts(w, "triton").op_tensors()
    bytes_per_expert = 3 * h * i * (0.5 + 1 / 16)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    results = []
    for t in (int(x) for x in args.tokens.split(",")):
        inputs = make_inputs(t, h, k, routed, "cuda")
        floor = distinct_experts(inputs, e) * bytes_per_expert / bw * 1e3
        flops = 2 * 3 * h * i * t * k
        ref = launch_old.triton_fused_moe(*inputs[0], tensors)
        for name, (which, cfg) in configs(t, k, e, h, i).items():
            fn = (launch_old if which == "old" else launch).triton_fused_moe
            try:
                out = fn(*inputs[0], tensors, cfg)
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                ms = graph_time_ms(lambda x, ids, rw: fn(x, ids, rw, tensors, cfg), inputs) if err < 1e-2 else None
            except Exception as exc:  # noqa: BLE001 - report and go on
                err, ms = None, None
                print(f"{t:5d} {name:34s} FAILED {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            row = dict(tokens=t, config=name, ms=ms, err=err, floor_ms=floor,
                       tflops=flops / ms / 1e9 if ms else None, cfg={a: (b if isinstance(b, (int, bool)) else str(b))
                                                                      for a, b in cfg.items()})
            results.append(row)
            print(f"{t:5d} {name:34s} {ms if ms else float('nan'):9.4f} ms  err vs old {err:.1e}  "
                  f"floor {floor:.4f}  x floor {ms / floor if ms else float('nan'):.2f}  "
                  f"{row['tflops'] or 0:.0f} TFLOP/s", flush=True)
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "sweep_pipeline.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
