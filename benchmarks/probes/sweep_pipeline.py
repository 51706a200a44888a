"""A/B of the MoE kernels' configs in one process: the defaults against named variants
(tiles, stages) and, with --pdl, against the same with programmatic dependent launch, next to
the previous kernels' config (the gate_up GEMM's gate and up in two K loops with run-time bounds). Each
config's output is compared with the first row's before it is timed.

    python benchmarks/probes/sweep_pipeline.py --tokens 1,8,64 --pdl
    python benchmarks/probes/sweep_pipeline.py --tokens 2048,8192 --variant prefill_bm128:BM=128,BN_GATE_UP=128,BN_DOWN=128,num_stages=2

The logs of 2026-12-01 (``results/sweep_pipeline_2026-12-01{a,b,c}.log``,
``sweep_pipeline_decode_2026-12-01d.log``) ran earlier forms of this script, against the previous
kernels (a copy of them, then the same kernels with the previous defaults), decode's gate/up split
included.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
import fp4moe_ops  # noqa: E402
from fp4moe_ops.backends.triton_moe import launch  # noqa: E402
from bench_moe import SHAPES, copy_bandwidth, distinct_experts, graph_time_ms, make_inputs, random_weights  # noqa: E402


def previous_config(t, k, e, h, i):
    """The reference row: the gate_up GEMM's gate and up in two K loops, every K loop with a run-time bound,
    4 warps in the middle bucket: the previous prefill and middle defaults. (The previous decode
    default split gate and up into separate programs plus a SiLU kernel; that path is gone, and
    ``results/sweep_pipeline_2026-12-01*.log`` compared against it.)"""
    cfg = launch.kernel_config(t * k, e, h, i)
    return cfg | dict(GLUON_PREFILL=False, MERGED_GATE_UP=False, PIPELINED_GATE_UP=False, PIPELINED_DOWN=False, maxnreg=0,
                      num_warps=4 if cfg["BM"] in (16, 32) else cfg["num_warps"])


def configs(t, k, e, h, i, variants=(), pdl=False):
    """Named configs: the reference row, the defaults, each ``variants`` entry (``NAME:KEY=INT,...``
    on top of the defaults; a NAME starting with ``decode_``, ``middle_`` or ``prefill_`` applies
    only to that bucket's token counts), the defaults again (the drift over the rows) and, with ``pdl``,
    the defaults with programmatic dependent launch (opt-in), twice (A B A B)."""
    # the single-role kernels' configs (with the Gluon prefill path on, their tiles would be ignored)
    base = launch.kernel_config(t * k, e, h, i) | {"GLUON_PREFILL": False}
    out = {"two K loops U1 U2": previous_config(t, k, e, h, i), "default": base}
    for v in variants:
        name, _, sets = v.partition(":")
        bucket_bm = {"decode": 16, "middle": 32, "prefill": 64}.get(name.split("_")[0])
        if bucket_bm and base["BM"] != bucket_bm:  # a variant named for a bucket applies there only
            continue
        out[name] = base | {a: int(b) for a, b in (kv.split("=") for kv in sets.split(","))}
    out["default, again"] = base
    if pdl:
        out["PDL"] = base | dict(PDL=True)
        out["default, third"] = base
        out["PDL, again"] = base | dict(PDL=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,8,64,512,2048,8192")
    ap.add_argument("--out", default=None)
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=INT,...",
                    help="a config on top of the defaults, e.g. prefill_bm128:BM=128,BN_GATE_UP=128,BN_DOWN=128,num_stages=2")
    ap.add_argument("--pdl", action="store_true", help="rows with programmatic dependent launch")
    args = ap.parse_args()
    e, h, i, k, routed = SHAPES["deepseek"]
    bw = copy_bandwidth("cuda")
    w = random_weights(e, h, i, "cuda")
    tensors = fp4moe_ops.prepare_experts(w, "triton").op_tensors()
    del w
    bytes_per_expert = 3 * h * i * (0.5 + 1 / 16)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    results = []
    for t in (int(x) for x in args.tokens.split(",")):
        inputs = make_inputs(t, h, k, routed, "cuda")
        floor = distinct_experts(inputs, e) * bytes_per_expert / bw * 1e3
        flops = 2 * 3 * h * i * t * k
        fn = launch.triton_fused_moe
        ref = fn(*inputs[0], tensors, previous_config(t, k, e, h, i))
        for name, cfg in configs(t, k, e, h, i, args.variant, args.pdl).items():
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
            print(f"{t:5d} {name:34s} {ms if ms else float('nan'):9.4f} ms  err vs first row {err:.1e}  "
                  f"floor {floor:.4f}  x floor {ms / floor if ms else float('nan'):.2f}  "
                  f"{row['tflops'] or 0:.0f} TFLOP/s", flush=True)
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "sweep_pipeline.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
