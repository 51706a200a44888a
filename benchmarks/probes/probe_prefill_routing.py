"""The Gluon prefill's routing step alone, as the prefill runs it eagerly (each call synchronized,
so host launch time counts): ``route(..., tail=64)`` with the activations' permute (two launches
past 4096 slots) against the torch ops that did it before (``_route_torch``, ``fragment_order``
and ``split_blocks``), at Qwen3-30B-A3B's experts (E=128, top-8, H=2048) and DeepSeek-V3's
(E=256, H=7168). Also the GPU time of each (CUDA events over 20 back-to-back calls).

    python3 benchmarks/probes/probe_prefill_routing.py [--tokens 4096,16384]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
from fp4moe_ops.backends.triton_moe.launch import _route_torch, route  # noqa: E402
from fp4moe_ops.backends.triton_moe.layout import fragment_order  # noqa: E402
from fp4moe_ops.backends.triton_moe.prefill_rs import split_blocks  # noqa: E402


def kernel_path(ids, x, e):
    return route(ids, e, 128, x, 128, tail=64)


def torch_path(ids, x, e):
    flat = ids.reshape(-1)
    routed = _route_torch(flat, e, 128, min(flat.numel(), e) + flat.numel() // 128)
    return split_blocks(*routed[1:], e, 128, (64,)), fragment_order(x, 128)


def wall_ms(fn, reps=10) -> float:
    times = []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[1:])


def gpu_ms(fn, reps=20) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="4096,16384")
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d')}: prefill routing, ms per call")
    print("| experts, H | tokens | routing kernel: wall (GPU) | torch ops: wall (GPU) |")
    print("|---|---|---|---|")
    for e, h in ((128, 2048), (256, 7168)):
        for t in (int(v) for v in args.tokens.split(",")):
            ids = torch.stack([torch.randperm(e, device="cuda")[:8] for _ in range(t)])
            x = torch.randn(t, h, dtype=torch.bfloat16, device="cuda")
            new, old = (lambda: kernel_path(ids, x, e)), (lambda: torch_path(ids, x, e))
            print(f"| {e}, {h} | {t} | {wall_ms(new):.3f} ({gpu_ms(new):.3f}) | {wall_ms(old):.3f} ({gpu_ms(old):.3f}) |",
                  flush=True)


if __name__ == "__main__":
    main()
