"""Run the Gluon prefill path (prefill_rs.py) twice on the DeepSeek-V3 layer for Nsight Compute (the
second call's kernels are the ones to profile: --launch-skip past the first).

    ncu --kernel-name regex:_prefill_gemm --launch-skip 2 --launch-count 2 python benchmarks/probes/ncu_gluon_prefill.py
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
import fp4moe_ops  # noqa: E402
from bench_moe import make_inputs, random_weights  # noqa: E402
from probe_gluon_prefill import gluon_moe  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--tokens", type=int, default=8192)
ap.add_argument("--stages", type=int, default=4)
args = ap.parse_args()
e, h, i, k = 256, 7168, 2048, 8
tensors = fp4moe_ops.prepare_experts(random_weights(e, h, i, "cuda"), "triton").op_tensors()
x, ids, rw = make_inputs(args.tokens, h, k, e, "cuda", n=1)[0]
for _ in range(2):
    gluon_moe(x, ids, rw, tensors, args.stages)
torch.cuda.synchronize()
print("done")
