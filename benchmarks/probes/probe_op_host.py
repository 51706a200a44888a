"""How long the host spends in one eager ``fp4moe::fused_moe`` call, and where: the question the
4096-token time to first token leaves open (RESULTS.md, "Whole model": the GPU is busy 109 ms of
fp4moe's 145, and the longest idle gaps lie inside the op's host code).

    python benchmarks/probes/probe_op_host.py [--shape qwen3] [--tokens 1,512,4096,16384] [--calls 20]

Per token count, Qwen3-30B-A3B's experts (E=128, H=2048, I=768, top-8; ``--shape deepseek`` for
DeepSeek-V3's), random NVFP4 weights on the ``triton`` backend:

* the host's wall time per call, with the GPU kept busy by ``torch.cuda._sleep`` queued before the
  calls, so that no call waits for a kernel to finish (a call that took longer than the sleep would
  have waited: reported as a synchronization); again with every launch through Triton's own call
  (``FP4MOE_RELAUNCH=0``, ``fp4moe_ops/relaunch.py``);
* the same for Transformers' BF16 experts as its eager prefill runs them (``torch._grouped_mm``,
  ``bench_moe.grouped_mm_moe``), the baseline whose host time BF16's slower kernels hide;
* with ``--model-layers 1,2``: the host's time per eager forward of Qwen3-30B-A3B cut to that many
  decoder layers (``DynamicCache``, as ``generate()``'s prefill runs it), HF BF16 and after
  ``patch_moe`` (also with every launch through Triton's own call), GPU kept busy the same way: the
  step between the depths is one decoder layer's host time, Transformers' attention and norms included;
* inclusive host time in the functions of the op's launch path (wrapped in place while timing:
  ``kernel_config``, ``route``, ``prefill_gemms``, the descriptors, ``_sum_topk`` and each kernel
  launch by kernel name); nested functions count in their callers too. What the op's dispatch and
  checks take is the call minus ``triton_fused_moe``.

On a CPU it runs the small shape (``reference``, or ``--backend triton`` under ``TRITON_INTERPRET=1``): a
smoke test of the script only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import fp4moe_ops  # noqa: E402
from bench_moe import bf16_weights, grouped_mm_moe, make_inputs, random_weights  # noqa: E402

SHAPES = {"qwen3": (128, 2048, 768, 8), "deepseek": (256, 7168, 2048, 8), "small": (8, 256, 128, 2)}
SLEEP_CYCLES = 2_000_000_000  # ~1 s of GPU time at ~2 GHz: longer than any batch of calls below
# forwards timed per depth: a forward queues ~150 kernels at 1-2 layers, and CUDA's queue of pending
# launches (~1024) must not fill behind the sleep, or the host would wait for it
MODEL_CALLS = 5


@contextmanager
def timed_functions(seconds: dict):
    """Wrap the launch path's functions in their modules (each name where it is looked up) and add
    each call's host seconds to ``seconds[name]``; restored on exit."""
    from fp4moe_ops.backends.triton_moe import compile_ahead, decode_v3, launch, prefill_rs

    def wrap(fn, name):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[name] += time.perf_counter() - t0
        return timed

    def wrap_launch(fn):
        def timed(kernel, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(kernel, *args, **kwargs)
            finally:
                seconds[f"launch {getattr(kernel, '__name__', None) or getattr(getattr(kernel, 'fn', None), '__name__', '?')}"] += \
                    time.perf_counter() - t0
        return timed

    targets = [(launch, n) for n in ("triton_fused_moe", "kernel_config", "route", "_gluon_prefill_moe", "_decode_v3_moe",
                                     "_descriptors", "_gate_up_descriptors", "_sum_topk", "compile_layer_once")]
    targets += [(prefill_rs, n) for n in ("prefill_gemms", "descriptor", "split_blocks")]
    targets += [(decode_v3, n) for n in ("gate_up_v3", "down_v3", "descriptor")]
    saved = []
    for module, name in targets:
        if hasattr(module, name):
            saved.append((module, name, getattr(module, name)))
            setattr(module, name, wrap(getattr(module, name), name))
    for module in (launch, prefill_rs, decode_v3, compile_ahead):
        if hasattr(module, "launch_or_compile"):
            saved.append((module, "launch_or_compile", module.launch_or_compile))
            module.launch_or_compile = wrap_launch(module.launch_or_compile)
    try:
        yield
    finally:
        for module, name, fn in reversed(saved):
            setattr(module, name, fn)


def host_us(fn, inputs, calls: int, cuda: bool) -> tuple[float, bool]:
    """Median host microseconds per call of ``fn`` over ``calls`` calls, the GPU kept busy; and
    whether any call waited for the GPU (took longer than the queued sleep could explain)."""
    times = []
    if cuda:
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
    start = time.perf_counter()
    for j in range(calls):
        x, ids, rw = inputs[j % len(inputs)]
        t0 = time.perf_counter()
        fn(x, ids, rw)
        times.append(time.perf_counter() - t0)
    host_total = time.perf_counter() - start
    waited = False
    if cuda:
        done = torch.cuda.Event()
        done.record()
        waited = done.query()  # the sleep already over: some call may have waited for it
        torch.cuda.synchronize()
    return statistics.median(times) * 1e6, waited or host_total > 0.9


def model_host_ms(layers: int, tokens: int, calls: int, cuda: bool = True) -> dict:
    """Host milliseconds per eager forward of a ``layers``-deep Qwen3-30B-A3B (``tokens`` prompt tokens,
    a new ``DynamicCache`` each), HF BF16 then fp4moe; and whether any forward waited for the GPU.
    Off CUDA the tiny Qwen3-MoE shapes (a smoke test)."""
    from bench_generate_batch import QWEN3_30B_A3B, TINY, qwen3_moe
    from hf_integration import patch_moe

    torch.manual_seed(0)
    dims = QWEN3_30B_A3B if cuda else TINY
    model = qwen3_moe(layers, dims, "cuda" if cuda else "cpu")
    prompt = torch.randint(1, min(1000, dims["vocab_size"]), (1, tokens),
                           generator=torch.Generator().manual_seed(tokens)).to(model.device)

    def forward(*_):
        model(prompt, use_cache=True, logits_to_keep=1)  # (the model makes its own DynamicCache)

    from fp4moe_ops import relaunch

    out = {}
    with torch.no_grad():
        for variant in ("bf16", "fp4moe", "fp4moe, relaunch off"):
            if variant == "fp4moe":
                patch_moe(model, verbose=False)
            relaunch.ENABLED = False if variant.endswith("off") else None
            try:
                for _ in range(3):  # warm-up (fp4moe's first call compiles its kernels)
                    forward()
                if cuda:
                    torch.cuda.synchronize()
                us, waited = host_us(forward, [(None, None, None)], calls, cuda)
            finally:
                relaunch.ENABLED = None
            out[variant] = (us / 1e3, waited)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default=None, choices=sorted(SHAPES))
    ap.add_argument("--tokens", default=None)
    ap.add_argument("--calls", type=int, default=20, help="calls timed per case (each queues ~8 launches, BF16 ~35: the ~1024 pending launches CUDA queues must hold them all behind the sleep)")
    ap.add_argument("--model-layers", default="", help="also the host's time per eager forward of Qwen3-30B-A3B "
                    "cut to these depths, e.g. 1,2 (tiny shapes on the CPU)")
    ap.add_argument("--model-tokens", type=int, default=4096)
    ap.add_argument("--cprofile", type=int, default=0, help="also print cProfile's N costliest functions by "
                    "own time over the timed calls of each token count (the profiler slows every call alike)")
    ap.add_argument("--backend", default=None, help="default: triton on a GPU, reference on the CPU (under "
                    "TRITON_INTERPRET=1 triton runs there too, to try the wrappers)")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    shape = args.shape or ("qwen3" if cuda else "small")
    e, h, i, k = SHAPES[shape]
    tokens = [int(t) for t in (args.tokens or ("1,512,4096,16384" if cuda else "1,64")).split(",")]
    import triton

    print(f"{torch.cuda.get_device_name() if cuda else 'CPU'}, {time.strftime('%Y-%m-%d')}: shape {shape} (E={e} H={h} "
          f"I={i} top-{k}); torch {torch.__version__}, Triton {triton.__version__}", flush=True)
    w = random_weights(e, h, i, device)
    experts = fp4moe_ops.prepare_experts(w, args.backend or ("triton" if cuda else "reference"))
    gate_up, down = bf16_weights(w) if cuda else (None, None)
    from fp4moe_ops import relaunch

    print("| tokens | fp4moe host us a call | the same, FP4MOE_RELAUNCH=0 | BF16 grouped_mm host us a call | "
          "fp4moe: where (inclusive us a call) |")
    print("|---:|---:|---:|---:|---|")
    for t in tokens:
        inputs = make_inputs(t, h, k, e, device, n=4)
        for x, ids, rw in inputs:  # compiles every variant (compile_layer_once) and warms the launchers
            experts(x, ids, rw)
        if cuda:
            torch.cuda.synchronize()
        ours, ours_waited = host_us(experts, inputs, args.calls, cuda)
        relaunch.ENABLED = False  # every launch through Triton's own call
        try:
            host_us(experts, inputs, 2, cuda)
            through_triton, triton_waited = host_us(experts, inputs, args.calls, cuda)
        finally:
            relaunch.ENABLED = None
        seconds = defaultdict(float)
        with timed_functions(seconds):
            host_us(experts, inputs, args.calls, cuda)
        parts = ", ".join(f"{name} {s / args.calls * 1e6:.0f}" for name, s in sorted(seconds.items(), key=lambda kv: -kv[1]))
        if args.cprofile:
            import cProfile
            import pstats

            profiler = cProfile.Profile()
            profiler.enable()
            host_us(experts, inputs, args.calls, cuda)
            profiler.disable()
            pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(args.cprofile)
        if cuda:
            gt, dt = gate_up.transpose(1, 2), down.transpose(1, 2)
            bf16, bf16_waited = host_us(lambda x, ids, rw: grouped_mm_moe(x, ids, rw, gt, dt, e), inputs, args.calls, cuda)
        else:
            bf16, bf16_waited = float("nan"), False
        print(f"| {t} | {ours:.0f}{' (waited)' if ours_waited else ''} | {through_triton:.0f}{' (waited)' if triton_waited else ''} "
              f"| {bf16:.0f}{' (waited)' if bf16_waited else ''} "
              f"| {parts} |", flush=True)
    if args.model_layers:
        del experts, gate_up, down
        if cuda:
            torch.cuda.empty_cache()
        print(f"\nhost ms per eager forward of Qwen3-30B-A3B{'' if cuda else ' (tiny shapes)'}, {args.model_tokens} tokens, "
              "by depth (GPU kept busy):")
        print("| layers | HF BF16 | fp4moe | fp4moe, FP4MOE_RELAUNCH=0 |\n|---:|---:|---:|---:|")
        for layers in (int(n) for n in args.model_layers.split(",")):
            row = model_host_ms(layers, args.model_tokens, MODEL_CALLS, cuda)
            if cuda:
                torch.cuda.empty_cache()
            print(f"| {layers} | " + " | ".join(f"{ms:.2f}{' (waited)' if waited else ''}" for ms, waited in
                                                 (row["bf16"], row["fp4moe"], row["fp4moe, relaunch off"])) + " |", flush=True)


if __name__ == "__main__":
    main()
