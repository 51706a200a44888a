"""Where a batch-1 decode step's time goes, end to end: GPU kernel time per generated token
(torch.profiler over a whole compiled generate(), CUDA graphs included) against the wall time per
token, for HF BF16 compiled and for fp4moe compiled, on the DeepSeek-V3-shaped model of
bench_e2e.py. Kernels are grouped by what they do.

    python3 benchmarks/profile_decode_step.py --layers 2 --batch 1
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from hf_integration import patch_deepseek  # noqa: E402
from bench_e2e import deepseek_v3_layers  # noqa: E402
from profile_layer import kernel_ms  # noqa: E402

GROUPS = [  # first match wins; lower-case substrings of kernel names
    ("fp4moe experts (Triton)", ("_gemm1_swiglu", "_gemm2_kernel", "_route_kernel", "_sum_topk", "_silu_mul")),
    ("attention (SDPA/flash)", ("flash", "fmha", "attention", "sdpa", "softmax")),
    ("GEMM/GEMV (cuBLAS, cutlass, grouped_mm)", ("gemm", "gemv", "cutlass", "xmma", "nvjet", "grouped", "matmul")),
    ("inductor-fused elementwise/reductions", ("triton_",)),
]


def group_of(name: str) -> str:
    low = name.lower()
    for group, keys in GROUPS:
        if any(k in low for k in keys):
            return group
    return "other (copies, index, sort, topk, ...)"


def profile_generate(model, batch: int, new_tokens: int) -> None:
    from transformers import CompileConfig

    prompt = torch.randint(1, 1000, (batch, 16), device="cuda")
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, cache_implementation="static",
              compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead"))
    for _ in range(2):  # compile, record graphs
        model.generate(prompt, **kw)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.generate(prompt, **kw)
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        model.generate(prompt, **kw)
        torch.cuda.synchronize()
    per_kernel = kernel_ms(prof, new_tokens)
    per_group = defaultdict(float)
    for name, ms in per_kernel.items():
        per_group[group_of(name)] += ms
    gpu = sum(per_group.values())
    print(f"  wall {wall_ms / new_tokens:.3f} ms per token (prefill included), GPU kernels {gpu:.3f} ms per token")
    for g, ms in sorted(per_group.items(), key=lambda kv: -kv[1]):
        print(f"    {ms:7.3f} ms  {g}")
    print("  top kernels:")
    for k, ms in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:12]:
        print(f"    {ms:7.3f} ms  {k}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=16)
    args = ap.parse_args()
    model = deepseek_v3_layers(args.layers)
    print(f"{torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d')}: {args.layers} DeepSeek-V3 MoE layers, "
          f"batch {args.batch}, {args.new_tokens} new tokens")
    print("HF BF16 compiled (CUDA graphs):")
    profile_generate(model, args.batch, args.new_tokens)
    torch._dynamo.reset()
    patch_deepseek(model, verbose=False)
    print("fp4moe compiled (CUDA graphs):")
    profile_generate(model, args.batch, args.new_tokens)


if __name__ == "__main__":
    main()
