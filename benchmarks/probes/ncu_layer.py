"""One MoE call for Nsight Compute: the Triton backend on a DeepSeek-V3-shaped layer
with ``--experts`` experts, called twice (the first compiles); profile the second call's GEMMs:

    ncu --clock-control none --kernel-name "regex:_gate_up_|_down_|_prefill_gemm" --launch-skip 2 --launch-count 2 \\
        --section SpeedOfLight --section WarpStateStats python3 benchmarks/probes/ncu_layer.py --tokens 1024
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
from bench_moe import make_inputs, random_weights  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--experts", type=int, default=32)
ap.add_argument("--tokens", type=int, default=1024)
ap.add_argument("--config", default="{}", help="JSON overrides of kernel_config")
args = ap.parse_args()
h, i, k = 7168, 2048, 8
w = random_weights(args.experts, h, i, "cuda")
tensors = fp4moe_ops.prepare_experts(w, "triton").op_tensors()
x, ids, rw = make_inputs(args.tokens, h, k, args.experts, "cuda", n=1)[0]
cfg = launch.kernel_config(args.tokens * k, args.experts, h, i) | json.loads(args.config)
print(cfg, flush=True)
for _ in range(2):
    launch.triton_fused_moe(x, ids, rw, tensors, cfg)
    torch.cuda.synchronize()
