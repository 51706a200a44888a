"""The host's time in one eager MoE call on a machine without a GPU: every line of Python and every
torch op the call runs, with the kernels compiled for sm_90 but launched into a stand-in that does
nothing (``tools/relaunch_cpu.py``'s recording driver, not recording). What an H100 host adds to it:
the driver's launch (~5-10 us a kernel) and, per torch op, CUDA's dispatch instead of the CPU's.

    TRITON_CACHE_DIR=... python benchmarks/probes/probe_host_cpu.py [--shape qwen3] [--tokens 1,8,64]
        [--calls 200] [--rounds 7] [--repo PATH]

Per token count (the decode path: ``triton_fused_moe`` at 1-64 tokens runs the Gluon decode
kernels, and from 2 tokens the routing kernel, whose Python path runs as on CUDA), the median microseconds of a call and the torch ops it dispatched, with fp4moe's
relaunch on and off (``FP4MOE_RELAUNCH``; where the checkout has it). ``--repo`` times another
checkout of fp4moe (an older commit, for a before / after in one table; the stand-in driver and
the layer's arguments come from this checkout's tools). The prefill path is timed at the small
shape (``--shape small --tokens 300``: 600 slots over 8 experts), where the gather's copy, real on
a CPU and a kernel on a GPU, is ~600 rows of 512.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[2]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=["small", "qwen3", "deepseek"], default="qwen3")
    ap.add_argument("--tokens", default="1,8,64")
    ap.add_argument("--calls", type=int, default=200, help="calls a round")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--repo", type=Path, default=HERE)
    args = ap.parse_args()
    sys.path.insert(0, str(args.repo.resolve()))
    import fp4moe_ops  # noqa: F401 - first, from --repo (the tools below put this checkout first on the path)

    sys.path.insert(0, str(HERE / "tools"))
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime import driver

    from relaunch_cpu import _RecordingLauncher, _Sm90Recording

    driver.set_active(_Sm90Recording())
    _RecordingLauncher.recording = False
    from fp4moe_ops.backends.triton_moe import launch
    from fp4moe_ops.backends.triton_moe.layout import scale_columns

    from fp4moe_ops.backends.triton_moe import compile_ahead

    relaunch = None  # (a checkout from before relaunch)
    if hasattr(compile_ahead, "relaunched"):
        from fp4moe_ops import relaunch
    launch._gluon_runs = lambda x: True  # (CPU tensors, compiled for sm_90: see compile_ahead_cpu.py)
    launch.COMPILE_AHEAD = False
    assert Path(launch.__file__).resolve().is_relative_to(args.repo.resolve()), launch.__file__
    # route's CUDA path (the routing kernel, as on the GPU; on CPU tensors it would take torch's sort,
    # and the prefill path would split its tail blocks with torch ops): the module's interpreting()
    # says yes inside those two only, and route's tables are zeroed, as while compiling ahead (the
    # prefill path's gather indexes with them)
    interpreting, compiling_ahead = launch.interpreting, launch.compiling_ahead

    def as_on_cuda(fn):
        def wrapped(*a, **kw):
            launch.interpreting = launch.compiling_ahead = lambda: True
            try:
                return fn(*a, **kw)
            finally:
                launch.interpreting, launch.compiling_ahead = interpreting, compiling_ahead
        return wrapped

    launch.route, launch._gluon_prefill_moe = as_on_cuda(launch.route), as_on_cuda(launch._gluon_prefill_moe)
    from compile_ahead_cpu import layer_arguments

    e, h, i, k = {"deepseek": (256, 7168, 2048, 8), "qwen3": (128, 2048, 768, 8)}.get(args.shape, (8, 512, 256, 2))
    _, _, _, tensors = layer_arguments(e, h, i, k)
    # the scales as PreparedExperts holds them for the Gluon kernels: whole 256-value steps
    tensors[1] = torch.zeros(e, 2 * i, scale_columns(h, 16), dtype=torch.uint8)
    tensors[4] = torch.zeros(e, h, scale_columns(i, 16), dtype=torch.uint8)

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    print(f"fp4moe at {args.repo}; {args.shape} experts (E={e}, H={h}, I={i}, top-{k}); torch {torch.__version__}, "
          f"Triton {__import__('triton').__version__}")
    print("| tokens | relaunch | host us a call (median of rounds) | rounds' medians, low-high | torch ops a call |")
    print("|---:|---|---:|---|---:|")
    for t in (int(n) for n in args.tokens.split(",") if n):
        x = torch.randn(t, h, dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)]).to(torch.int32)
        w = torch.rand(t, k)
        settings = (True, False) if relaunch is not None else (None,)
        rounds = {enabled: [] for enabled in settings}
        for _ in range(args.rounds):  # (the settings interleaved: a noisy host drifts between rounds)
            for enabled in settings:
                if relaunch is not None:
                    relaunch.ENABLED = enabled
                    relaunch.clear()
                for _ in range(3):
                    launch.triton_fused_moe(x, ids, w, tensors)
                times = []
                for _ in range(args.calls):
                    t0 = time.perf_counter()
                    launch.triton_fused_moe(x, ids, w, tensors)
                    times.append(time.perf_counter() - t0)
                rounds[enabled].append(statistics.median(times) * 1e6)
        for enabled in settings:
            if relaunch is not None:
                relaunch.ENABLED = enabled
            Count.ops = 0
            with Count():
                launch.triton_fused_moe(x, ids, w, tensors)
            label = "absent" if enabled is None else ("on" if enabled else "off")
            r = rounds[enabled]
            print(f"| {t} | {label} | {statistics.median(r):.1f} | {min(r):.1f}-{max(r):.1f} | {Count.ops} |", flush=True)


if __name__ == "__main__":
    main()
