"""What a new token count costs the Triton backend: the first call's wall time (compiles or
disk-cache loads included) and the steady time (CUDA-graph replay, 8 routings) of the routing
step alone and of a whole DeepSeek-V3 layer (E=256, H=7168, I=2048, top-8), token count by
token count in one process, plus how many variants of each kernel the process compiled.

    TRITON_CACHE_DIR=$(mktemp -d) python benchmarks/probes/probe_route.py --tokens 1,8,20,57,160,231,512
    PYTHONPATH=/old/tree python benchmarks/probes/probe_route.py ...   # an older commit, for comparison
"""

import argparse
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parents[1]  # benchmarks/
sys.path.insert(0, str(HERE))
sys.path.append(str(HERE.parent))  # after PYTHONPATH: an older tree on PYTHONPATH goes first
import fp4moe_ops  # noqa: E402
from fp4moe_ops.backends.triton_moe import kernel_config, route  # noqa: E402
from bench_first_pass import triton_variants  # noqa: E402
from bench_moe import graph_time_ms, make_inputs, random_weights  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,8,20,57,64,160,231,512")
    args = ap.parse_args()
    e, h, i, k = 256, 7168, 2048, 8
    print(f"fp4moe_ops from {Path(fp4moe_ops.__file__).parent}")
    experts = fp4moe_ops.prepare_experts(random_weights(e, h, i, "cuda"), "triton")

    print("| tokens | first route call ms | first layer call ms | route ms (graph) | layer ms (graph) |")
    print("|---|---|---|---|---|")
    for t in (int(x) for x in args.tokens.split(",")):
        inputs = make_inputs(t, h, k, e, "cuda")
        bm = kernel_config(t * k, e, h, i)["BM"]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        route(inputs[0][1], e, bm)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        experts(*inputs[0])
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        route_ms = graph_time_ms(lambda x, ids, rw: route(ids, e, bm), inputs)
        layer_ms = graph_time_ms(experts, inputs)
        print(f"| {t} | {1e3 * (t1 - t0):.1f} | {1e3 * (t2 - t1):.1f} | {route_ms:.4f} | {layer_ms:.4f} |", flush=True)
    print("Triton variants compiled or loaded:", triton_variants())


if __name__ == "__main__":
    main()
