"""Run the prefill GEMMs of the warp-specialized kernels (prefill_ws.py) or of the register-operand
kernels (prefill_rs.py, ``--kernel rs``) twice on the DeepSeek-V3 layer for Nsight Compute (the
second call's kernels are the ones to profile: --launch-skip past the first).

    ncu --kernel-name regex:_ws_gemm --launch-skip 2 --launch-count 2 python benchmarks/ncu_ws.py --tokens 8192
    ncu --kernel-name regex:_rs_gemm --launch-skip 2 --launch-count 1 python benchmarks/ncu_ws.py --kernel rs
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import fp4moe_ops  # noqa: E402
from bench_moe import make_inputs, random_weights  # noqa: E402
from bench_ws_prefill import rs_moe, ws_moe  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--tokens", type=int, default=8192)
ap.add_argument("--stages", default="4,6,2", help="ring depths: XS,WS,DS (ws) or one number (rs)")
ap.add_argument("--kernel", default="ws", choices=("ws", "rs"))
args = ap.parse_args()
e, h, i, k = 256, 7168, 2048, 8
tensors = fp4moe_ops.prepare_experts(random_weights(e, h, i, "cuda"), "triton").op_tensors()
x, ids, rw = make_inputs(args.tokens, h, k, e, "cuda", n=1)[0]
stages = tuple(int(s) for s in args.stages.split(","))
for _ in range(2):
    if args.kernel == "ws":
        ws_moe(x, ids, rw, tensors, stages)
    else:
        rs_moe(x, ids, rw, tensors, *stages)
torch.cuda.synchronize()
print("done")
