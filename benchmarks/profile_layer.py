"""Per-kernel GPU time of one fused-MoE call of the Triton backend (DeepSeek-V3 layer), from
torch.profiler over several calls on rotated inputs: where the decode time goes.

    python3 benchmarks/profile_layer.py --tokens 1,8,64 [--graph]

Eager by default: ``--calls`` calls, launched from the host. ``--graph``: the CUDA graph of
bench_moe's ``graph_time_ms`` (one call per routing, 8 routings as in issue 17's measurement),
profiled over ``--replays`` replays, and beside it the replays' own time from CUDA events. At 64
tokens the eager kernels summed 1.32 ms while graph replays measured 1.41-1.56 ms per call
(benchmarks/RESULTS.md, twenty-second session): this says whether the difference is in the
kernels (each instance's duration, median and slowest) or between them.
"""

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import fp4moe_ops  # noqa: E402
from fp4moe_ops.backends.triton_moe import triton_fused_moe  # noqa: E402
from bench_moe import SHAPES, make_inputs, random_weights  # noqa: E402


def kernel_durations(prof, name_chars: int = 70) -> dict[str, list[float]]:
    """GPU milliseconds of every kernel instance in a finished profile, by kernel name."""
    out = defaultdict(list)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            out[ev.name[:name_chars]].append(ev.device_time_total / 1e3)
    return out


def report(label: str, durations: dict[str, list[float]], per: int, wall_ms: float | None = None) -> None:
    """Per call: each kernel's total, its instances' median and slowest; the sum against the wall."""
    total = sum(sum(d) for d in durations.values()) / per
    wall = f"; wall {wall_ms:.4f} ms per call, {wall_ms - total:+.4f} outside the kernels" if wall_ms else ""
    print(f"{label}: kernels sum {total:.4f} ms per call{wall}")
    for name, d in sorted(durations.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {sum(d) / per:8.4f} ms  {name}  ({len(d)} instances: median {statistics.median(d):.4f}, "
              f"slowest {max(d):.4f})")


def graph_profile(inputs, tensors, replays: int) -> tuple[dict[str, list[float]], float, int]:
    """The CUDA graph of one call per input set: kernel instances over ``replays`` replays, and the
    median replay time per call from CUDA events (the same replays, outside the profiler too)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for args_ in inputs:
            triton_fused_moe(*args_, tensors)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for args_ in inputs:
                triton_fused_moe(*args_, tensors)
    torch.cuda.current_stream().wait_stream(s)
    for _ in range(3):
        g.replay()
    walls = []
    for _ in range(replays):
        st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        st.record(); g.replay(); en.record(); torch.cuda.synchronize()
        walls.append(st.elapsed_time(en) / len(inputs))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            g.replay()
        torch.cuda.synchronize()
    return kernel_durations(prof), statistics.median(walls), replays * len(inputs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="deepseek", choices=sorted(SHAPES))
    ap.add_argument("--tokens", default="1,8,64")
    ap.add_argument("--calls", type=int, default=20, help="eager: calls profiled")
    ap.add_argument("--graph", action="store_true", help="also profile CUDA-graph replays (8 routings per graph)")
    ap.add_argument("--replays", type=int, default=10, help="graph: replays profiled and timed")
    args = ap.parse_args()
    e, h, i, k, routed = SHAPES[args.shape]
    tensors = fp4moe_ops.prepare_experts(random_weights(e, h, i, "cuda"), "triton").op_tensors()
    for t in (int(x) for x in args.tokens.split(",")):
        inputs = make_inputs(t, h, k, routed, "cuda", n=8 if args.graph else 4)
        for args_ in inputs:  # compile and warm up
            triton_fused_moe(*args_, tensors)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for c in range(args.calls):
                triton_fused_moe(*inputs[c % len(inputs)], tensors)
            torch.cuda.synchronize()
        report(f"T={t} eager", kernel_durations(prof), args.calls)
        if args.graph:
            durations, wall, calls = graph_profile(inputs, tensors, args.replays)
            report(f"T={t} graph", durations, calls, wall)


if __name__ == "__main__":
    main()
