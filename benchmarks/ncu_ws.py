"""Run the warp-specialized prefill GEMMs (prefill_ws.py) twice on the DeepSeek-V3 layer for
Nsight Compute (the second call's kernels are the ones to profile: --launch-skip past the first).

    ncu --kernel-name regex:_ws_gemm --launch-skip 2 --launch-count 2 python benchmarks/ncu_ws.py --tokens 8192
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import fp4moe_ops  # noqa: E402
from bench_moe import make_inputs, random_weights  # noqa: E402
from bench_ws_prefill import ws_moe  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--tokens", type=int, default=8192)
ap.add_argument("--stages", default="4,6,2")
args = ap.parse_args()
e, h, i, k = 256, 7168, 2048, 8
tensors = fp4moe_ops.prepare_experts(random_weights(e, h, i, "cuda"), "triton").op_tensors()
x, ids, rw = make_inputs(args.tokens, h, k, e, "cuda", n=1)[0]
stages = tuple(int(s) for s in args.stages.split(","))
for _ in range(2):
    ws_moe(x, ids, rw, tensors, stages)
torch.cuda.synchronize()
print("done")
