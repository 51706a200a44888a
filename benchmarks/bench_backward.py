"""What a training step's backward through the experts costs (fp4moe_ops/autograd.py): the layer's
forward on the Triton backend against ``fp4moe::fused_moe_backward``, DeepSeek-V3's layer.

    python3 benchmarks/bench_backward.py [--tokens 64,512,2048]

The backward is eager torch (each expert's GEMMs recomputed in float32 on weights decoded one
expert at a time, one host sync per call), so it is timed eagerly, not in a CUDA graph: CUDA events
around whole calls after a warm-up, median of ``--calls``, rotating routings. For scale, the
backward's FLOPs (twice the forward's: the gate_up GEMM recomputed, the down GEMM for the routing-weight gradient,
the two activation-gradient GEMMs) over its time.
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import fp4moe_ops  # noqa: E402
from bench_moe import SHAPES, make_inputs, random_weights  # noqa: E402


def timed(fn, calls: int) -> float:
    times = []
    for c in range(calls):
        st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        st.record()
        fn(c)
        en.record()
        torch.cuda.synchronize()
        times.append(st.elapsed_time(en))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="64,512,2048")
    ap.add_argument("--calls", type=int, default=5)
    args = ap.parse_args()
    e, h, i, k, routed = SHAPES["deepseek"]
    w = random_weights(e, h, i, "cuda")
    experts = fp4moe_ops.prepare_experts(w, "triton")
    tensors = experts.op_tensors()
    print(f"device: {torch.cuda.get_device_name()}; DeepSeek-V3 layer E={e} H={h} I={i} top-{k}")
    for t in (int(v) for v in args.tokens.split(",")):
        inputs = make_inputs(t, h, k, routed, "cuda", n=4)
        grads = [torch.randn(t, h, device="cuda", dtype=torch.bfloat16) for _ in inputs]

        def forward(c):
            x, ids, rw = inputs[c % 4]
            experts(x, ids, rw)

        def backward(c):
            x, ids, rw = inputs[c % 4]
            torch.ops.fp4moe.fused_moe_backward(grads[c % 4], x, ids, rw, tensors, None, None, "triton")

        for fn in (forward, backward):
            fn(0)
        torch.cuda.synchronize()
        fwd, bwd = timed(forward, args.calls), timed(backward, args.calls)
        # per (token, expert) pair: the gate_up GEMM again (4HI), the down GEMM for the weights' gradient (2HI), and the
        # two activation-gradient GEMMs (2HI + 4HI): twice the forward's 6HI
        flops = 12 * t * k * h * i
        print(f"T={t}: forward {fwd:.3f} ms, backward {bwd:.3f} ms ({bwd / fwd:.1f}x; "
              f"{flops / bwd / 1e9:.1f} TFLOP/s of its ~{flops / 1e12:.2f} TFLOP)", flush=True)


if __name__ == "__main__":
    main()
