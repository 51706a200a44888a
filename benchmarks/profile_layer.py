"""Per-kernel GPU time of one fused-MoE call of the Triton backend (DeepSeek-V3 layer), from
torch.profiler over several calls on rotated inputs: where the decode time goes.

    python3 benchmarks/profile_layer.py --tokens 1,8,64
"""

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import fp4moe_ops  # noqa: E402
from fp4moe_ops.backends.triton_moe import triton_fused_moe  # noqa: E402
from bench_moe import SHAPES, make_inputs, random_weights  # noqa: E402


def kernel_ms(prof, per: int, name_chars: int = 70) -> dict[str, float]:
    """GPU milliseconds per kernel name in a finished profile, divided by ``per`` (calls, tokens)."""
    out = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            out[ev.name[:name_chars]] += ev.device_time_total / 1e3 / per
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="deepseek", choices=sorted(SHAPES))
    ap.add_argument("--tokens", default="1,8,64")
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    e, h, i, k, routed = SHAPES[args.shape]
    tensors = fp4moe_ops.prepare_experts(random_weights(e, h, i, "cuda"), "triton").op_tensors()
    for t in (int(x) for x in args.tokens.split(",")):
        inputs = make_inputs(t, h, k, routed, "cuda")
        for args_ in inputs:  # compile and warm up
            triton_fused_moe(*args_, tensors)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for c in range(args.calls):
                triton_fused_moe(*inputs[c % len(inputs)], tensors)
            torch.cuda.synchronize()
        per_kernel = kernel_ms(prof, args.calls)
        total = sum(per_kernel.values())
        print(f"T={t}: kernels sum {total:.4f} ms per call")
        for name, ms in sorted(per_kernel.items(), key=lambda kv: -kv[1]):
            print(f"  {ms:8.4f} ms  {name}")


if __name__ == "__main__":
    main()
