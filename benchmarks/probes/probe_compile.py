"""Where a DeepSeek-V3 layer's cold compile goes on the GPU machine: in a fresh
process with an empty Triton cache, ``compile_all`` over the layer's plans (``launch.layer_plans``),
one by one or together, with each kernel's compile traced (start, end, seconds from the start of
``compile_all``); then the first real call of each variant set's token count, timed (what is left
to them: launcher builds, loading the kernels into the GPU context).

    python benchmarks/probes/probe_compile.py [--modes serial,together,together-nolauncher]

``together-nolauncher``: as ``together`` without the launcher builds in the pool (the code before).
``linear`` and ``linear-off``: DeepSeek-V3's NVFP4 linear shapes instead, called as a model calls
them (every shape at 1 token, then at 8, 17, 33 and 65: the first count of each kernel set), with
their first call compiling every token count's kernels (``launch.compile_linear_once``) or
without it; each call timed, ``compile_all`` then being inside the first.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]  # benchmarks/
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "tools"))  # compile_ahead_cpu
E, H, I, K = 256, 7168, 2048, 8


def linear_process(mode: str) -> dict:
    import torch
    import triton.compiler

    from compile_ahead_cpu import LINEAR_SHAPES
    from fp4moe_ops.backends.triton_moe import launch
    from fp4moe_ops.linear import split_counters

    launch.COMPILE_AHEAD = mode == "linear"
    trace, compile_ = [], triton.compiler.compile
    triton.compiler.compile = lambda src, *a, **kw: trace.append(getattr(src, "name", "?")) or compile_(src, *a, **kw)
    layers = [(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda"),
               torch.full((n, k // 16), 1.0, device="cuda").to(torch.float8_e4m3fn), torch.ones((), device="cuda"),
               split_counters("cuda")) for n, k in LINEAR_SHAPES["deepseek"]]
    calls = []
    for t in (1, 8, 17, 33, 65):
        for (n, k), (w, s, g, counters) in zip(LINEAR_SHAPES["deepseek"], layers):
            x = torch.randn(t, k, dtype=torch.bfloat16, device="cuda")
            torch.cuda.synchronize()
            start = time.perf_counter()
            launch.triton_nvfp4_linear(x, w, s, g, counters=counters)
            torch.cuda.synchronize()
            calls.append((t, n, k, round(time.perf_counter() - start, 3)))
    return {"mode": mode, "compiles": len(trace), "calls": calls}


def one_process(mode: str) -> dict:
    import torch
    import triton.compiler
    import triton.runtime.build
    from concurrent.futures import ThreadPoolExecutor

    from compile_ahead_cpu import layer_arguments
    from fp4moe_ops.backends.triton_moe import compile_ahead, launch

    trace, builds, compile_ = [], [], triton.compiler.compile
    t0 = time.perf_counter()

    def timed(src, *a, **kw):
        start = time.perf_counter()
        kernel = compile_(src, *a, **kw)
        trace.append((getattr(src, "name", "?"), round(start - t0, 2), round(time.perf_counter() - t0, 2)))
        return kernel

    triton.compiler.compile = timed
    build = triton.runtime.build._build
    triton.runtime.build._build = lambda name, *a, **kw: (  # launchers only, not the driver's own module
        (name == "__triton_launcher" and builds.append(time.perf_counter())) or build(name, *a, **kw))
    if mode == "together-nolauncher":
        compile_ahead._CompileThenBuildLauncher.submit = ThreadPoolExecutor.submit
    tensors = layer_arguments(E, H, I, K, device="cuda")[3]  # (the weights; calls below make their own inputs)
    slots = launch.variant_slots(E, H, I, K)

    def call(t):
        x = torch.randn(t, H, dtype=torch.bfloat16, device="cuda")
        ids = torch.rand(t, E, device="cuda").argsort(dim=1)[:, :K]
        return x, ids, torch.rand(t, K, device="cuda")

    x, ids, rw = call(1)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    errors = compile_ahead.compile_all(launch.layer_plans(x, ids, rw, tensors), together=mode != "serial")
    compile_s, n_compiled, builds_ahead = time.perf_counter() - t0, len(trace), len(builds)
    launch.COMPILE_AHEAD = False  # (done above)
    first_calls = []
    for t in (s // K for s in slots):
        args = call(t)
        torch.cuda.synchronize()
        start = time.perf_counter()
        launch.triton_fused_moe(*args, tensors)
        torch.cuda.synchronize()
        first_calls.append((t, round(time.perf_counter() - start, 3)))
    return {"mode": mode, "compile_all_s": compile_s, "errors": [repr(e) for e in errors], "trace": trace[:n_compiled],
            "launcher_builds_ahead": builds_ahead, "launcher_builds_in_calls": len(builds) - builds_ahead,
            "compiles_in_calls": len(trace) - n_compiled, "first_calls": first_calls}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="serial,together,together-nolauncher")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        fn = linear_process if args.one.startswith("linear") else one_process
        Path(args.json).write_text(json.dumps(fn(args.one)))
        return
    print(f"CPUs {len(os.sched_getaffinity(0))}")
    for mode in args.modes.split(","):
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            env = dict(os.environ, TRITON_CACHE_DIR=tempfile.mkdtemp())
            proc = subprocess.run([sys.executable, __file__, "--one", mode, "--json", f.name], env=env,
                                  capture_output=True, text=True)
            if proc.returncode:
                print(mode, "failed", proc.stderr[-3000:])
                continue
            r = json.loads(Path(f.name).read_text())
        if mode.startswith("linear"):
            print(f"{mode}: {r['compiles']} kernels compiled, calls {sum(c[-1] for c in r['calls']):.2f} s in all; "
                  f"per token count {[(t, round(sum(c[-1] for c in r['calls'] if c[0] == t), 3)) for t in (1, 8, 17, 33, 65)]}")
            for t, n, k, sec in r["calls"]:
                print(f"    {t:3d} tokens [{n:5d}, {k:5d}] {sec:7.3f} s")
            continue
        total = r["compile_all_s"] + sum(s for _, s in r["first_calls"])
        print(f"{mode}: compile_all {r['compile_all_s']:.2f} s ({len(r['trace'])} kernels, "
              f"{r['launcher_builds_ahead']} launchers built), then the first calls of "
              f"{[t for t, _ in r['first_calls']]} tokens {[s for _, s in r['first_calls']]} s "
              f"({r['compiles_in_calls']} compiles, {r['launcher_builds_in_calls']} launcher builds in them); "
              f"total {total:.2f} s {r['errors'] or ''}")
        for name, start, end in sorted(r["trace"], key=lambda c: c[1]):
            print(f"    {name:24s} {start:6.2f} {end:6.2f} {end - start:6.2f}")


if __name__ == "__main__":
    main()
