"""``fp4moe::nvfp4_linear`` against BF16 ``F.linear`` at DeepSeek-V3's attention and shared-expert
shapes (issue 21's acceptance table), in one process: median time per call, CUDA-graph replay
over 4 input sets on a GPU (wall time on CPU), for 1-8192 tokens. Each call's output is checked
against BF16 ``F.linear`` on the dequantized weight first (relative error printed).

    python benchmarks/bench_linear.py --tokens 1,8,64,512,2048,8192      # GPU
    python benchmarks/bench_linear.py --tokens 1,8 --small                # CPU smoke run

Floor: the NVFP4 weight bytes (N x K x 0.5625) at the measured copy bandwidth; BF16 reads 2 bytes
per weight. Not run on the GPU yet (2026-12-01: no device time left when it was written).
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.append(str(Path(__file__).resolve().parent.parent))
import fp4moe_ops  # noqa: E402
from fp4moe_ops import nvfp4  # noqa: E402

# (name, N = out_features, K = in_features): DeepSeek-V3's MLA projections, its shared expert
SHAPES = [("q_a_proj", 1536, 7168), ("q_b_proj", 24576, 1536), ("kv_a_proj_with_mqa", 576, 7168),
          ("kv_b_proj", 32768, 512), ("o_proj", 7168, 16384), ("shared gate_up", 4096, 7168),
          ("shared down", 7168, 2048)]


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


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,8,64,512,2048,8192")
    ap.add_argument("--small", action="store_true", help="shapes / 8 (a CPU smoke run)")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    print(f"device {torch.cuda.get_device_name() if cuda else 'cpu'}, torch {torch.__version__}")
    print("| layer | N | K | tokens | nvfp4_linear ms | F.linear BF16 ms | ratio | rel err vs BF16 F.linear |")
    print("|---|---|---|---|---|---|---|---|")
    for name, n, k in SHAPES:
        if args.small:
            n, k = max(16, n // 8), max(16, k // 8)
        q = nvfp4.quantize_nvfp4(torch.randn(n, k, device=device) / k**0.5)
        w, s, g = q.packed, q.block_scale, q.global_scale.reshape(())
        bf16 = nvfp4.dequantize_nvfp4(w, s, g, torch.bfloat16)
        for t in (int(x) for x in args.tokens.split(",")):
            inputs = [(torch.randn(t, k, device=device, dtype=torch.bfloat16),) for _ in range(4)]
            ours = time_ms(lambda x: fp4moe_ops.nvfp4_linear(x, w, s, g), inputs, cuda)
            base = time_ms(lambda x: F.linear(x, bf16), inputs, cuda)
            x = inputs[0][0]
            got, want = fp4moe_ops.nvfp4_linear(x, w, s, g).double(), F.linear(x, bf16).double()
            err = ((got - want).norm() / want.norm()).item()
            print(f"| {name} | {n} | {k} | {t} | {ours:.4f} | {base:.4f} | {ours / base:.2f}x | {err:.1e} |", flush=True)


if __name__ == "__main__":
    main()
