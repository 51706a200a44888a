"""Which bucket a layer with its shared expert inside the routed call should run in: the slots
counted over all E + 1 experts (as the op counts them unless told), or the routed rows only.

    python benchmarks/probes/probe_shared_bucket.py [--tokens 240,256,480,512,1024,2048]

DeepSeek-V3's layer (H=7168, I=2048, top-8 of 256) with the shared expert as expert 256, weight 1,
on every token: the op sees 9 T slots over 257 experts, 17.9 rows per expert at 512 tokens (the
prefill bucket) where the routed experts hold 16 (the middle bucket). Passing ``routed_experts`` =
256 * 9 / 8 = 288 makes the op's rows per expert 9 T / 288 = 8 T / 256, the routed count. Each row:
median of CUDA-graph replays over 4 routings, both hints in one process, and the relative
difference of their outputs (the same math in other tiles: fp32 summation order only).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
import fp4moe_ops  # noqa: E402
from bench_moe import graph_time_ms, make_inputs, random_weights  # noqa: E402
from fp4moe_ops.backends.triton_moe.launch import kernel_config, kernel_family  # noqa: E402

E, H, I, K = 256, 7168, 2048, 8


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="240,256,480,512,1024,2048")
    args = ap.parse_args()
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}")
    experts = fp4moe_ops.prepare_experts(random_weights(E + 1, H, I, "cuda"), "triton")
    hints = {"none (over E + 1)": 0, "routed rows (288)": E * (K + 1) // K}
    print("| tokens | hint | rows per expert seen | kernels | ms | vs no hint | rel diff |")
    print("|---|---|---|---|---|---|---|")
    for t in (int(v) for v in args.tokens.split(",")):
        inputs = []
        for x, ids, rw in make_inputs(t, H, K, E, "cuda"):
            ids = torch.cat([ids, ids.new_full((t, 1), E)], dim=1)
            rw = torch.cat([rw.float(), rw.new_ones((t, 1), dtype=torch.float32)], dim=1)
            inputs.append((x, ids, rw))
        base_ms, base_out = None, None
        for label, hint in hints.items():
            experts.routed_experts = hint
            out = experts(*inputs[0]).float()
            ms = graph_time_ms(experts, inputs)
            seen = t * (K + 1) / (hint or E + 1)
            family = kernel_family(inputs[0][0], t * (K + 1), E + 1, H, I, hint)
            if not family.startswith("gluon"):  # (the Gluon kernels choose their own row blocks)
                family += f" BM{kernel_config(t * (K + 1), E + 1, H, I, hint)['BM']}"
            if base_ms is None:
                base_ms, base_out = ms, out
            diff = ((out - base_out).norm() / base_out.norm()).item()
            print(f"| {t} | {label} | {seen:.2f} | {family} | {ms:.4f} | {base_ms / ms:.2f}x | {diff:.1e} |",
                  flush=True)


if __name__ == "__main__":
    main()
