"""Per-kernel GPU time of one fused-MoE call of the Triton backend (DeepSeek-V3 layer), from
torch.profiler over several calls on rotated inputs: where the decode time goes.

    python3 benchmarks/probes/profile_layer.py --tokens 1,8,64 [--graph [--idle-us 0,2000]]

Eager by default: ``--calls`` calls, launched from the host. ``--graph``: the CUDA graph of
bench_moe's ``graph_time_ms`` (one call per routing, 8 routings per graph),
profiled over ``--replays`` replays, and beside it the replays' own time from CUDA events. At 64
tokens the eager kernels summed 1.32 ms while graph replays measured 1.41-1.56 ms per call
(H200, 2026-12-02; benchmarks/NOTES.md, "Decode"): this says whether the difference is in the
kernels (each instance's duration, median and slowest) or between them, and (nvidia-smi sampled
every 20 ms during a second of replays) whether the SM clock or the power draw moves under that load.
``--idle-us``: graphs with the GPU left idle that long after each call (``torch.cuda._sleep``, its
kernel counted apart): if the layer's own kernels get faster with idle time between calls, sustained
load (power, clocks) slows them, not the kernels' design.
"""

import argparse
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
import fp4moe_ops  # noqa: E402
from fp4moe_ops.backends.triton_moe import triton_fused_moe  # noqa: E402
from bench_moe import SHAPES, capture_graph, make_inputs, random_weights, replay_times_ms  # noqa: E402


def kernel_durations(prof, name_chars: int = 70) -> dict[str, list[float]]:
    """GPU milliseconds of every kernel instance in a finished profile, by kernel name."""
    out = defaultdict(list)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            out[ev.name[:name_chars]].append(ev.device_time_total / 1e3)
    return out


IDLE_KERNEL = "spin_kernel"  # torch.cuda._sleep's


def report(label: str, durations: dict[str, list[float]], per: int, wall_ms: float | None = None) -> None:
    """Per call: each kernel's total, its instances' median and slowest; the layer's kernels' sum
    (idle kernels apart) against the wall."""
    total = sum(sum(d) for name, d in durations.items() if IDLE_KERNEL not in name) / per
    idle = sum(sum(d) for name, d in durations.items() if IDLE_KERNEL in name) / per
    wall = (f"; wall {wall_ms:.4f} ms per call, {wall_ms - total - idle:+.4f} outside the kernels"
            if wall_ms else "")
    print(f"{label}: kernels sum {total:.4f} ms per call{wall}")
    for name, d in sorted(durations.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {sum(d) / per:8.4f} ms  {name}  ({len(d)} instances: median {statistics.median(d):.4f}, "
              f"slowest {max(d):.4f})")


def graph_profile(inputs, tensors, replays: int,
                  idle_cycles: int = 0) -> tuple[dict[str, list[float]], float, int, str]:
    """The CUDA graph of one call per input set (each followed by ``idle_cycles`` of
    ``torch.cuda._sleep`` if given): kernel instances over ``replays`` replays, the median replay
    time per call from CUDA events (the same replays, outside the profiler too), the calls
    profiled, and :func:`clocks_under_load`'s line."""

    def call(*a):
        triton_fused_moe(*a, tensors)
        if idle_cycles:
            torch.cuda._sleep(idle_cycles)

    g = capture_graph(call, inputs)
    walls = replay_times_ms(g, len(inputs), replays)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            g.replay()
        torch.cuda.synchronize()
    load = clocks_under_load(g)
    return kernel_durations(prof), statistics.median(walls), replays * len(inputs), load


SMI_FIELDS = ("clocks.sm", "power.draw")
# the reasons' field was renamed in newer drivers; whichever one this nvidia-smi accepts
SMI_REASONS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")


def smi_fields() -> list[str] | None:
    """The query fields this nvidia-smi accepts (None: no nvidia-smi)."""
    for reasons in SMI_REASONS:
        fields = [*SMI_FIELDS, reasons]
        try:
            done = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader"],
                                  capture_output=True, timeout=20, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if done.returncode == 0:
            return fields
    return None


def board_limits() -> str:
    """The board's power limit and top SM clock, as nvidia-smi reports them ('' without it)."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=power.limit,clocks.max.sm", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def clocks_under_load(graph, seconds: float = 1.0) -> str:
    """nvidia-smi's SM clock, power draw and clock-event reasons, sampled every 20 ms while the
    graph replays for about ``seconds``; a summary line ('' where nvidia-smi does not run). The
    samples include 0.2 s before the replays start, so each range's low end is the idle GPU."""
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    st.record(); graph.replay(); en.record(); torch.cuda.synchronize()
    replays = max(1, int(seconds * 1e3 / st.elapsed_time(en)))
    fields = smi_fields()
    if fields is None:
        return ""
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits",
                            "-lms", "20"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    time.sleep(0.2)  # its first samples: before the load
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    smi.terminate()
    rows = [line.split(", ") for line in smi.communicate()[0].splitlines() if line.count(",") == 2]
    if not rows:
        return "nvidia-smi gave no samples"
    try:
        clocks, power = [float(r[0]) for r in rows], [float(r[1]) for r in rows]
    except ValueError:
        return f"nvidia-smi samples not numbers: {rows[:2]}"
    return (f"{len(rows)} samples over {replays} replays: SM clock {min(clocks):.0f}-{max(clocks):.0f} MHz "
            f"(median {statistics.median(clocks):.0f}), power {min(power):.0f}-{max(power):.0f} W, "
            f"reasons {sorted({r[2] for r in rows})}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="deepseek", choices=sorted(SHAPES))
    ap.add_argument("--tokens", default="1,8,64")
    ap.add_argument("--calls", type=int, default=20, help="eager: calls profiled")
    ap.add_argument("--graph", action="store_true", help="also profile CUDA-graph replays (8 routings per graph)")
    ap.add_argument("--replays", type=int, default=10, help="graph: replays profiled and timed")
    ap.add_argument("--idle-us", default="0", help="graph: idle microseconds after each call, one graph per value")
    args = ap.parse_args()
    e, h, i, k, routed = SHAPES[args.shape]
    if args.graph:
        print(f"board: power limit, top SM clock: {board_limits() or 'nvidia-smi did not answer'}")
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
            for idle_us in (int(v) for v in args.idle_us.split(",")):
                # cycles at the H200's 1980 MHz boost clock; the profile reports the idle time spent
                durations, wall, calls, load = graph_profile(inputs, tensors, args.replays, idle_us * 1980)
                report(f"T={t} graph, idle {idle_us} us after each call", durations, calls, wall)
                print(f"  under a second of replays: {load}")


if __name__ == "__main__":
    main()
