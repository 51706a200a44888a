"""Where ``generate()``'s time per token goes beyond the compiled decode step, on a whole
Qwen3-30B-A3B-shaped model (random weights) patched by ``patch_moe``, at batch 1:

* the decode step's GPU time alone (graph replays back to back, CUDA events);
* the host's time per compiled call (the same loop timed on the host, no sync inside);
* ``generate()``'s decode time per token as Transformers runs it, which waits for the GPU every
  step (``StopCheck``: ``bool(unfinished.max() == 0)``; ``FP4MOE_DEFERRED_STOP=0``);
* the same as fp4moe runs it (:mod:`hf_integration.deferred_stop`: Transformers' own
  ``DeferredStopCheck``, which reads the stop flag one step late, so the host queues the next step
  while the GPU runs this one; Transformers enables it only on ``mps``). The greedy tokens of both
  must be equal;
* where the host's time per step goes inside ``generate()`` (the compiled call, preparing inputs,
  updating kwargs, logits processing, stopping criteria, the stop check with its wait), in both
  loops: the parts are timed with ``time.perf_counter`` around Transformers' own methods;
* ``generate()``'s time for 1, 17 and 65 new tokens (median of 3), in both loops: the slope over
  16 -> 64 is the cost of a decode step, the rest what each call pays once (its eager prefill, its
  cache); ``--lengths-only`` measures only these, for HF BF16 before the patch too (its deferred
  loop switched on for this thread with fp4moe's own switch, ``deferred_stop.deferring``, which
  the product uses for fp4moe's models only);
* ``--calls N``: N ``generate()`` calls of 33 new tokens in a row, each timed, with the CUDA-graph
  recordings they made: Transformers makes a new ``StaticCache`` per call, and new addresses would
  make the compiled step record a new CUDA graph (torch before 2.13 counts those toward
  ``cudagraph_unexpected_rerecord_limit``, 128, and then runs the step without graphs); the
  caching allocator hands the freed cache's memory to the next one, so they record none;
* ``--host-profile``: cProfile of one ``generate()`` by own time;
* ``--timeline``: one ``generate()`` of 4 new tokens under the PyTorch profiler, after a warm-up,
  as a sequence of the host's CUDA launches (kernels launched one by one, graph replays,
  synchronizations) with the top-level host events of 0.2 ms or more between them, in both loops:
  what the first decoding step after the eager prefill does that later steps do not;
* ``--gaps``: one ``generate()`` of 24 new tokens under the profiler, after a warm-up: per decoding
  step (CUDA-graph launch to launch) the GPU's busy time and the kernels launched outside the
  graph, and the longest GPU idle gaps with the host events running in them, in both loops;
* ``--first-token N``: one ``generate(max_new_tokens=1)`` over an N-token prompt (as
  ``bench_model.py`` times the first token) under the profiler, HF BF16 and then fp4moe: wall and
  GPU busy time, the GPU's idle time before, among and after its kernels, the host's waits, and the
  longest idle gaps with the host events in them;
* ``--prefill N``: one eager forward over N prompt tokens (no cache, as ``generate()`` runs its
  prefill eagerly), wall time, median of 3, for HF BF16 before the patch and fp4moe after.

    python3 benchmarks/probes/probe_generate_loop.py [--layers 48] [--new-tokens 32] [--host-profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
from bench_decoder_layer import forward_step_ms  # noqa: E402
from bench_e2e import deferred_stop_on_cuda, time_generate, transformers_loop  # noqa: E402
from bench_generate_batch import QWEN3_30B_A3B, qwen3_moe  # noqa: E402
from hf_integration import patch_moe, quantize_linears  # noqa: E402


def host_ms_per_call(model, steps: int = 32) -> float:
    """Host time per compiled decode call, the loop never waiting for the GPU (the GPU's queue
    absorbs the launches as long as the host is the slower one)."""
    from transformers import StaticCache

    prompt = torch.randint(1, 1000, (1, 16), generator=torch.Generator().manual_seed(1)).cuda()
    total = 16 + 4 + steps
    cache = StaticCache(config=model.config, max_cache_len=total)
    positions = torch.arange(total, device="cuda")
    step = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        token = model(prompt, past_key_values=cache, cache_position=positions[:16]).logits[:, -1:].argmax(-1)
        for i in range(4 + steps):
            if i == 4:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
            p = 16 + i
            token = step(input_ids=token, past_key_values=cache, cache_position=positions[p:p + 1]).logits[:, -1:].argmax(-1)
        host = time.perf_counter() - t0
        torch.cuda.synchronize()
    return host * 1e3 / steps


def generate_lengths(model) -> str:
    """``generate()`` wall ms for 1, 17 and 65 new tokens and the per-step slope between the last two."""
    from transformers import CompileConfig

    prompt = torch.randint(1, 1000, (1, 16), generator=torch.Generator().manual_seed(1)).cuda()
    ms = {}
    for n in (1, 17, 65):
        times = []
        for _ in range(4):  # the first warms up
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, cache_implementation="static",
                           compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead"))
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        ms[n] = sorted(times[1:])[1] * 1e3
    slope = (ms[65] - ms[17]) / 48
    return (f"generate() of 1 / 17 / 65 new tokens: {ms[1]:.1f} / {ms[17]:.1f} / {ms[65]:.1f} ms; a step "
            f"(17 -> 65) {slope:.3f} ms = {1e3 / slope:.1f} tokens/s; once per call {ms[17] - 16 * slope:.1f} ms")


def generate_calls(model, calls: int) -> str:
    """Wall ms of ``calls`` ``generate()`` calls of 33 new tokens in a row, and the CUDA-graph
    recordings they made (counted by wrapping cudagraph trees' ``record_function``)."""
    from torch._inductor import cudagraph_trees
    from transformers import CompileConfig

    prompt = torch.randint(1, 1000, (1, 16), generator=torch.Generator().manual_seed(1)).cuda()
    kw = dict(max_new_tokens=33, min_new_tokens=33, do_sample=False, cache_implementation="static",
              compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead"))
    recorded = [0]
    record = cudagraph_trees.CUDAGraphTreeManager.record_function

    def counting(self, *a, **k):
        recorded[0] += 1
        return record(self, *a, **k)

    cudagraph_trees.CUDAGraphTreeManager.record_function = counting
    walls = []
    try:
        for _ in range(calls):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.generate(prompt, **kw)
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - t0) * 1e3)
    finally:
        cudagraph_trees.CUDAGraphTreeManager.record_function = record
    skips = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
    groups = [(i, min(i + 10, calls)) for i in range(0, calls, 10)]
    shown = ", ".join(f"{a + 1}-{b}: {sorted(walls[a:b])[(b - a) // 2]:.0f}" for a, b in groups)
    return (f"{calls} calls of 33 new tokens, median ms by calls {shown}; CUDA-graph recordings {recorded[0]}; "
            f"cudagraph skips so far in the process {skips}")


LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaGraphLaunch",
            "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync", "cudaEventSynchronize",
            # a CUDA graph recorded (again) inside the call
            "cudaStreamBeginCapture", "cudaStreamEndCapture", "cudaGraphInstantiate", "cudaGraphInstantiateWithFlags")


def profiled_generate(model, new_tokens: int, prompt_len: int = 16, compiled: bool = True):
    """The PyTorch profiler over one ``generate()`` of ``new_tokens`` (compiled, static cache; or as
    ``generate()`` runs by default: eager, dynamic cache), after a warm-up call of the same length
    (which compiles and records the CUDA graphs)."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import CompileConfig

    prompt = torch.randint(1, 1000, (1, prompt_len), generator=torch.Generator().manual_seed(1)).cuda()
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    if compiled:
        kw.update(cache_implementation="static", compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead"))
    model.generate(prompt, **kw)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        model.generate(prompt, **kw)
        torch.cuda.synchronize()
    return prof


def timeline(model, new_tokens: int = 4) -> str:
    """One ``generate()`` under the profiler (after one warm-up call): the host's launches in
    order, runs of the same call merged ("cuLaunchKernel x 960, 14.2 ms"), with the top-level
    host events of 0.2 ms or more among them, times from the start of the call."""
    prof = profiled_generate(model, new_tokens)
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    t0 = min(e.time_range.start for e in events)
    marks = [e for e in events if e.name in LAUNCHES or (e.cpu_parent is None and e.time_range.elapsed_us() >= 200)]
    marks.sort(key=lambda e: e.time_range.start)
    lines, run = [], None
    for e in marks:
        start, dur = (e.time_range.start - t0) / 1e3, e.time_range.elapsed_us() / 1e3
        if run and run[0] == e.name and e.name in LAUNCHES:
            run[2] += 1
            run[3] = start + dur
            continue
        if run:
            lines.append(f"  {run[1]:9.2f} ms  {run[0]} x {run[2]} (until {run[3]:.2f} ms)")
        run = [e.name, start, 1, start + dur]
    lines.append(f"  {run[1]:9.2f} ms  {run[0]} x {run[2]} (until {run[3]:.2f} ms)")
    gpu = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return "\n".join(lines) + f"\n  GPU kernel time in the call: {gpu / 1e3:.2f} ms"


def merge_intervals(intervals) -> list[list[float]]:
    """The union of ``(start, end)`` intervals sorted by start, as disjoint ``[start, end]`` in order."""
    merged = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def idle_gaps(merged, a: float, b: float) -> list[tuple[float, float]]:
    """The parts of ``[a, b]`` that no interval of ``merged`` (from :func:`merge_intervals`) covers."""
    gaps, free = [], a
    for start, end in merged:
        if end <= free or start >= b:
            continue
        if start > free:
            gaps.append((free, start))
        free = end
    if free < b:
        gaps.append((free, b))
    return gaps


def gap_lines(gaps, origin: float, cpu) -> list[str]:
    """One line per GPU idle gap ``(start, end)`` (profiler microseconds): its length, its start from
    ``origin``, and the chain of host events (``cpu``) running at its middle, outermost first."""
    lines = []
    for g0, g1 in gaps:
        t = (g0 + g1) / 2
        names = [e.name[:60] for e in sorted((e for e in cpu if e.time_range.start <= t <= e.time_range.end),
                                             key=lambda e: e.time_range.start)]
        chain = " > ".join(names if len(names) <= 5 else names[:3] + ["..."] + names[-2:])
        lines.append(f"    {(g1 - g0) / 1e3:6.3f} ms at {(g0 - origin) / 1e3:8.2f} ms: {chain}")
    return lines


def gpu_gaps(model, new_tokens: int = 24, shown: int = 12) -> str:
    """One ``generate()`` under the profiler (after a warm-up call of the same length): per decoding
    step (the interval between two consecutive CUDA-graph launches on the host), the GPU's busy
    and idle time and the kernels launched from the host outside the graph; then the longest GPU
    idle gaps among the steps, each with the chain of host events running at its middle. A step
    longer than its graph's kernels is either the host (idle gaps under Python) or a wait (idle
    gaps under a synchronization)."""
    prof = profiled_generate(model, new_tokens)
    cpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    gpu = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA)
    replays = sorted(e.time_range.start for e in cpu if e.name == "cudaGraphLaunch")
    if len(replays) < 3:
        return f"  {len(replays)} CUDA-graph launches in the call: the decoding steps did not replay graphs"
    host_launches = sorted(e.time_range.start for e in cpu if e.name in LAUNCHES[:4])
    merged = merge_intervals(gpu)

    steps, gaps = [], []
    for a, b in zip(replays, replays[1:]):
        step_gaps = idle_gaps(merged, a, b)
        busy = b - a - sum(g1 - g0 for g0, g1 in step_gaps)
        steps.append((b - a, busy, sum(1 for t in host_launches if a <= t < b)))
        gaps += step_gaps
    steps.sort()
    mid = steps[len(steps) // 2]
    longest = sorted(gaps, key=lambda g: g[1] - g[0], reverse=True)[:shown]
    lines = [f"  {len(replays)} graph launches ({len(replays) / (new_tokens - 1):.2f} a decoding step); a step "
             f"(launch to launch), median: {mid[0] / 1e3:.3f} ms, GPU busy {mid[1] / 1e3:.3f} ms, kernels launched "
             f"outside the graph {mid[2]}",
             f"  GPU idle over all steps: {sum(b - a for a, b in gaps) / 1e3:.2f} ms in {len(gaps)} gaps; the longest:"]
    lines += gap_lines(longest, replays[0], cpu)
    return "\n".join(lines)


def first_token_gaps(model, prompt_len: int, shown: int = 12) -> str:
    """One ``generate(max_new_tokens=1)`` over a ``prompt_len``-token prompt as ``bench_model.py``
    times the first token (eager prefill, Transformers' default cache), under the profiler after a
    warm-up: the call's wall time, the GPU's busy time, its idle time before the first kernel, among
    the kernels and after the last, the host's synchronizations, and the longest idle gaps with the
    host events running in them."""
    prof = profiled_generate(model, 1, prompt_len, compiled=False)
    cpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    gpu = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA)
    a = min(e.time_range.start for e in cpu if e.cpu_parent is None)
    b = max(e.time_range.end for e in cpu if e.cpu_parent is None)
    merged = merge_intervals(gpu)
    gaps = idle_gaps(merged, a, b)
    busy = sum(min(end, b) - max(start, a) for start, end in merged if end > a and start < b)
    inside = [g for g in gaps if merged and merged[0][0] <= g[0] and g[1] <= merged[-1][1]]
    syncs = {}
    for e in cpu:
        if e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize") or (
                e.name == "cudaMemcpyAsync" and e.time_range.elapsed_us() > 50):
            syncs[e.name] = syncs.get(e.name, 0) + 1

    lines = [f"  wall {(b - a) / 1e3:.2f} ms, GPU busy {busy / 1e3:.2f} ms; GPU idle before its first kernel "
             f"{(merged[0][0] - a) / 1e3 if merged else 0:.2f} ms, among the kernels "
             f"{sum(g1 - g0 for g0, g1 in inside) / 1e3:.2f} ms in {len(inside)} gaps, after the last "
             f"{(b - merged[-1][1]) / 1e3 if merged else 0:.2f} ms",
             f"  host waits: {', '.join(f'{n} x {c}' for n, c in sorted(syncs.items())) or 'none'} "
             "(cudaMemcpyAsync counted where it took over 50 us)",
             "  the longest GPU idle gaps:"]
    lines += gap_lines(sorted(gaps, key=lambda g: g[1] - g[0], reverse=True)[:shown], a, cpu)
    return "\n".join(lines)


def prefill_ms(model, tokens: int) -> float:
    prompt = torch.randint(1, 1000, (1, tokens), generator=torch.Generator().manual_seed(tokens)).cuda()
    times = []
    with torch.no_grad():
        for _ in range(4):  # the first warms up
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model(prompt, use_cache=False)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    return sorted(times[1:])[1] * 1e3


class HostTimer:
    """Accumulates host seconds spent in named methods while active (wrapping them in place)."""

    def __init__(self, model):
        from transformers.generation import logits_process, stopping_criteria
        from transformers.generation import utils as gen_utils

        self.seconds: dict[str, float] = {}
        self.targets = [
            (model, "prepare_inputs_for_generation", "prepare_inputs_for_generation"),
            (model, "_update_model_kwargs_for_generation", "_update_model_kwargs_for_generation"),
            (logits_process.LogitsProcessorList, "__call__", "logits processors"),
            (stopping_criteria.StoppingCriteriaList, "__call__", "stopping criteria"),
            (gen_utils.StopCheck, "__call__", "stop check (waits for the GPU)"),
            (gen_utils.DeferredStopCheck, "__call__", "stop check (waits for the GPU)"),
        ]
        self.model = model

    def _wrap(self, fn, label):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - t0
        return timed

    def __enter__(self):
        self.saved = []
        for owner, attr, label in self.targets:
            self.saved.append((owner, attr, owner.__dict__.get(attr)))
            setattr(owner, attr, self._wrap(getattr(owner, attr), label))
        get_compiled = self.model.get_compiled_call
        self.model.get_compiled_call = lambda *a, **k: self._wrap(get_compiled(*a, **k), "compiled model call")
        return self

    def __exit__(self, *exc):
        for owner, attr, old in self.saved:
            if old is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, old)
        del self.model.get_compiled_call


def host_breakdown(model, new_tokens: int) -> dict[str, float]:
    """Host ms per decode step by part (generate(1 + N) minus generate(1), over N), and the step's wall."""
    from transformers import CompileConfig

    prompt = torch.randint(1, 1000, (1, 16), generator=torch.Generator().manual_seed(1)).cuda()

    def run(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with HostTimer(model) as timer:
            model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, cache_implementation="static",
                           compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead"))
            torch.cuda.synchronize()
        return time.perf_counter() - t0, timer.seconds

    run(1 + new_tokens), run(1)
    wall_long, long = run(1 + new_tokens)
    wall_short, short = run(1)
    parts = {k: (long[k] - short.get(k, 0.0)) * 1e3 / new_tokens for k in long}
    parts["wall a step"] = (wall_long - wall_short) * 1e3 / new_tokens
    parts["rest of the loop"] = parts["wall a step"] - sum(v for k, v in parts.items() if k != "wall a step")
    return parts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--attention", action="store_true", help="also quantize the attention projections")
    ap.add_argument("--host-profile", action="store_true")
    ap.add_argument("--prefill", type=int, default=0)
    ap.add_argument("--calls", type=int, default=0,
                    help="only N generate() calls in a row, a new cache each vs one cache reused")
    ap.add_argument("--timeline", action="store_true",
                    help="only the profiled launch sequence of one generate() of 4 new tokens, both loops")
    ap.add_argument("--gaps", action="store_true",
                    help="only the GPU's busy and idle time per decoding step of one generate(), both loops")
    ap.add_argument("--first-token", type=int, default=0, metavar="N",
                    help="only the profiled generate(max_new_tokens=1) over an N-token prompt, HF BF16 then fp4moe")
    ap.add_argument("--lengths-only", action="store_true",
                    help="only generate()'s time for 1, 17 and 65 new tokens, both loops")
    args = ap.parse_args()
    import transformers

    model = qwen3_moe(args.layers, QWEN3_30B_A3B, "cuda")
    if args.lengths_only:
        print("HF BF16, Transformers' loop:", generate_lengths(model), flush=True)
        with deferred_stop_on_cuda():
            print("HF BF16, DeferredStopCheck on CUDA:", generate_lengths(model), flush=True)
        torch._dynamo.reset()
    if args.first_token:
        print(f"HF BF16, generate(max_new_tokens=1) over {args.first_token} tokens:\n"
              + first_token_gaps(model, args.first_token), flush=True)
    bf16_prefill = prefill_ms(model, args.prefill) if args.prefill else None
    patch_moe(model, verbose=False)
    if args.attention:
        quantize_linears(model, dense_mlps=False, attention=True)
    print(f"{torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d')}: Qwen3-30B-A3B shapes, {args.layers} layers, "
          f"fp4moe{' + NVFP4 attention' if args.attention else ''}, batch 1; torch {torch.__version__}, "
          f"transformers {transformers.__version__}", flush=True)

    if args.prefill and (args.first_token or args.gaps or args.timeline or args.calls or args.lengths_only):
        ours = prefill_ms(model, args.prefill)  # (those modes return before the full run's line below)
        print(f"prefill {args.prefill} tokens, eager forward: HF BF16 {bf16_prefill:.2f} ms, fp4moe {ours:.2f} ms "
              f"({bf16_prefill / ours:.2f}x)", flush=True)
    if args.first_token:
        print(f"fp4moe, generate(max_new_tokens=1) over {args.first_token} tokens:\n"
              + first_token_gaps(model, args.first_token), flush=True)
        if not (args.gaps or args.timeline or args.calls or args.lengths_only):
            return
    if args.gaps:
        with transformers_loop():
            print("fp4moe, Transformers' loop, GPU per decoding step:\n" + gpu_gaps(model), flush=True)
        print("fp4moe (deferred stop check), GPU per decoding step:\n" + gpu_gaps(model), flush=True)
        if not (args.timeline or args.calls or args.lengths_only):
            return
    if args.timeline:
        with transformers_loop():
            print("fp4moe, Transformers' loop, one generate() of 4 new tokens:\n" + timeline(model), flush=True)
        print("fp4moe (deferred stop check), one generate() of 4 new tokens:\n" + timeline(model), flush=True)
        if not (args.calls or args.lengths_only):
            return
    if args.calls:
        print("a new StaticCache per call (Transformers' own):", generate_calls(model, args.calls), flush=True)
        if not args.lengths_only:
            return
    if args.lengths_only:
        with transformers_loop():
            print("fp4moe, Transformers' loop:", generate_lengths(model), flush=True)
        print("fp4moe (deferred stop check):", generate_lengths(model), flush=True)
        return
    if args.prefill:
        ours = prefill_ms(model, args.prefill)
        print(f"prefill {args.prefill} tokens, eager forward: HF BF16 {bf16_prefill:.2f} ms, fp4moe {ours:.2f} ms "
              f"({bf16_prefill / ours:.2f}x)", flush=True)
    step_gpu = forward_step_ms(model, 1)
    step_host = host_ms_per_call(model)
    print(f"decode step alone: GPU {step_gpu:.3f} ms; host per compiled call {step_host:.3f} ms", flush=True)

    with transformers_loop():
        tok_s, _, out_sync = time_generate(model, 1, args.new_tokens, compiled=True)
    print(f"generate(), Transformers' loop (waits every step): {tok_s:.1f} tokens/s = {1e3 / tok_s:.3f} ms a token",
          flush=True)
    if args.host_profile:
        from transformers import CompileConfig

        prompt = torch.randint(1, 1000, (1, 16), generator=torch.Generator().manual_seed(1)).cuda()
        with cProfile.Profile() as host:
            model.generate(prompt, max_new_tokens=1 + args.new_tokens, min_new_tokens=1 + args.new_tokens,
                           do_sample=False, cache_implementation="static",
                           compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead"))
            torch.cuda.synchronize()
        pstats.Stats(host).sort_stats("tottime").print_stats(30)

    with transformers_loop():
        for label, ms in host_breakdown(model, args.new_tokens).items():
            print(f"    {ms:7.3f} ms  {label}", flush=True)
        print(generate_lengths(model), flush=True)

    tok_s2, _, out_deferred = time_generate(model, 1, args.new_tokens, compiled=True)
    same = torch.equal(out_sync, out_deferred)
    print(f"generate() as fp4moe runs it (DeferredStopCheck, no wait per step): {tok_s2:.1f} tokens/s = "
          f"{1e3 / tok_s2:.3f} ms a token; tokens equal to Transformers' loop's: {same}", flush=True)
    for label, ms in host_breakdown(model, args.new_tokens).items():
        print(f"    {ms:7.3f} ms  {label}", flush=True)
    print(generate_lengths(model), flush=True)


if __name__ == "__main__":
    main()
