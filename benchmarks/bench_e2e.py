"""End-to-end decode benchmark: a DeepSeek-V3-shaped model (full expert dims, 256 experts, a few
decoder layers, random weights) on one GPU, side by side in one process:

* HF BF16 eager   - Transformers' default experts implementation, no compile
* HF BF16 compiled - static cache + CompileConfig(fullgraph, "reduce-overhead": CUDA graphs)
* fp4moe compiled  - the same after patch_deepseek (NVFP4 experts, backend "auto")

    python benchmarks/bench_e2e.py --layers 2 --batches 1,8,32 --out benchmarks/out

Decode tokens/s = batch * new tokens / decode time, where decode time is the time of generate()
with 1 + new tokens minus that with 1 (prompt of 16 tokens; so prefill and setup cancel), each the
median of 5 timed runs after a warm-up (which compiles). generate() tokens/s with the prefill
included is recorded too. Peak memory: torch.cuda max allocated. fp4moe's models generate with
Transformers' deferred stop check on CUDA (``hf_integration.deferred_stop``), HF BF16 with
Transformers' loop, each as a user runs it.
Writes ``e2e.json`` and ``e2e.md`` to ``--out`` after every measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after PYTHONPATH: an older tree can go first
from hf_integration import patch_deepseek  # noqa: E402
from hf_integration.router import grouped_topk_routers  # noqa: E402


def deepseek_v3_layers(num_layers: int):
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    cfg = DeepseekV3Config(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=num_layers, first_k_dense_replace=0, n_routed_experts=256, num_experts_per_tok=8,
        n_group=8, topk_group=4, n_shared_experts=1, num_attention_heads=128, num_key_value_heads=128,
        q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        max_position_embeddings=4096, routed_scaling_factor=2.5,
    )
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return model.eval()


@contextlib.contextmanager
def transformers_loop():
    """fp4moe's models generate with Transformers' own stop check (waits every step) while active."""
    saved = os.environ.get("FP4MOE_DEFERRED_STOP")
    os.environ["FP4MOE_DEFERRED_STOP"] = "0"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["FP4MOE_DEFERRED_STOP"]
        else:
            os.environ["FP4MOE_DEFERRED_STOP"] = saved


@contextlib.contextmanager
def deferred_stop_on_cuda():
    """Transformers' ``DeferredStopCheck`` on CUDA for every model (HF BF16's too) in this thread
    while active, through fp4moe's own switch (:func:`hf_integration.deferred_stop.deferring`)."""
    from hf_integration.deferred_stop import deferring

    with deferring():
        yield


def generate_inputs(model, batch: int, compiled: bool) -> tuple[torch.Tensor, dict]:
    """``(prompt, generate() keywords)`` of the timings here: the same 16-token prompt for every
    variant at a batch size (the routing, hence the work, follows the tokens), greedy; compiled
    with a static cache and CUDA graphs, or not compiled at all."""
    from transformers import CompileConfig

    high = min(1000, model.config.vocab_size)
    prompt = torch.randint(1, high, (batch, 16), generator=torch.Generator().manual_seed(batch)).to(model.device)
    kw = dict(do_sample=False)
    if compiled:
        kw.update(cache_implementation="static", compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead"))
    else:
        kw.update(disable_compile=True)
    return prompt, kw


def time_generate(model, batch: int, new_tokens: int, compiled: bool, skip: int = 0) -> tuple[float, float, torch.Tensor]:
    """(decode tokens/s, generate() tokens/s with prefill, output of the long run).

    Decode tokens/s = batch * new_tokens / (time of generate(1 + skip + new_tokens) - time of
    generate(1 + skip)): the prefill step and generate()'s setup cancel, and with ``skip`` > 0
    also the first decoding steps after the prefill (the first one costs more than the rest on
    a GPU, and only Transformers' waiting loop leaves it out of generate(1)). Each time is the
    median of 5 runs after a warm-up run of each length (which compiles and records the CUDA
    graphs)."""
    prompt, kw = generate_inputs(model, batch, compiled)
    sync = torch.cuda.synchronize if prompt.is_cuda else (lambda: None)

    def run(n):
        return model.generate(prompt, max_new_tokens=n, min_new_tokens=n, **kw)

    short, long = 1 + skip, 1 + skip + new_tokens
    run(long), run(short)  # warm-up / compile
    seconds = {}
    for n in (short, long):
        times = []
        for _ in range(5):
            sync()
            t0 = time.perf_counter()
            out = run(n)
            sync()
            times.append(time.perf_counter() - t0)
        seconds[n] = statistics.median(times)
    decode = batch * new_tokens / (seconds[long] - seconds[short])
    return decode, batch * long / seconds[long], out


class StepClock:
    """A logits processor that changes nothing and stamps each decoding step: ``generate()`` calls
    it once a step, after that step's forward is queued, so on CUDA an event recorded there
    completes when the step's forward does. The gaps between consecutive stamps are the steps'
    periods as the GPU lived them (its idle time waiting for the host included), with no host
    sync added to the loop; on a CPU the host's clock stands in."""

    def __init__(self):
        self.stamps = []

    def __call__(self, input_ids, scores):
        if scores.is_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.stamps.append(event)
        else:
            self.stamps.append(time.perf_counter())
        return scores

    def periods_ms(self) -> list[float]:
        """The period of every step after the first (the first stamp follows the prefill)."""
        if self.stamps and isinstance(self.stamps[0], torch.cuda.Event):
            self.stamps[-1].synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.stamps, self.stamps[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.stamps, self.stamps[1:])]


def generate_step_ms(model, batch: int, new_tokens: int, skip: int = 16, runs: int = 5, compiled: bool = True) -> dict:
    """Per-step periods inside one ``generate()`` of ``1 + skip + new_tokens`` tokens (the inputs of
    :func:`time_generate`), from :class:`StepClock`: ``"step"``, the median period of the last
    ``new_tokens`` steps (median over ``runs`` calls after a warm-up call), ``"mean"`` their mean
    (median over the calls) and ``"slowest"`` the longest of them in any call; ``"first"``, the first
    decoding step after the prefill; ``"early"``, the mean of the steps between it and the timed ones
    (the 2nd to the ``skip``-th). Unlike subtracting two calls' times, nothing here depends on two
    calls costing the same apart from their steps."""
    from transformers import LogitsProcessorList

    prompt, kw = generate_inputs(model, batch, compiled)
    n = 1 + skip + new_tokens
    kw.update(max_new_tokens=n, min_new_tokens=n)
    rows = []
    for i in range(runs + 1):
        clock = StepClock()
        model.generate(prompt, logits_processor=LogitsProcessorList([clock]), **kw)
        periods = clock.periods_ms()  # one stamp a token, in both stop checks (Transformers 5.17-5.25)
        if len(periods) < n - 1:
            raise RuntimeError(f"StepClock saw {len(periods) + 1} steps of {n}")
        if i:  # the first call compiles
            rows.append(periods[:n - 1])
    return {"step": statistics.median(statistics.median(r[skip:]) for r in rows),
            # what subtracting two calls measures is a mean: the occasional slow step counts there
            "mean": statistics.median(statistics.fmean(r[skip:]) for r in rows),
            "slowest": max(max(r[skip:]) for r in rows),
            "first": statistics.median(r[0] for r in rows),
            "early": statistics.median(statistics.fmean(r[1:skip]) for r in rows) if skip > 1 else float("nan")}


@contextlib.contextmanager
def cuda_graph_counts():
    """Counts, while active, the compiled steps torch.compile's CUDA-graph trees were called for, how
    many of those replayed a graph, recorded one or warmed up (ran eagerly), and the cudagraph skips
    it logged: a step that records again at every call, or runs without a graph, launches its
    kernels one at a time from the host, which the timings alone do not show."""
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.CUDAGraphTreeManager
    counts = {"called": 0, "replayed": 0, "recorded": 0, "warmed up (run eagerly)": 0, "skipped": 0}
    # a call neither replayed, recorded nor warmed up ran its kernels without a graph
    saved = {"run": manager.run, "execute_node": manager.execute_node, "record_function": manager.record_function,
             "run_eager": manager.run_eager}
    skips = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]

    def counting(method, key):
        def counted(self, *args, **kwargs):
            counts[key] += 1
            return method(self, *args, **kwargs)
        return counted

    manager.run = counting(saved["run"], "called")
    manager.execute_node = counting(saved["execute_node"], "replayed")
    manager.record_function = counting(saved["record_function"], "recorded")
    manager.run_eager = counting(saved["run_eager"], "warmed up (run eagerly)")
    try:
        yield counts
    finally:
        for name, method in saved.items():
            setattr(manager, name, method)
        counts["skipped"] = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] - skips


def expert_bytes(model) -> int:
    total = 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if ".mlp.experts." in name:
            total += t.numel() * t.element_size()
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--out", default="benchmarks/out")
    ap.add_argument("--time-budget", type=float, default=420, help="seconds; later cases are skipped past it")
    ap.add_argument("--router-ab", action="store_true",
                    help="also time fp4moe with Transformers' router (batch first and last), then the fused one again")
    ap.add_argument("--replot", metavar="E2E_JSON", help="only draw e2e.png next to a saved e2e.json")
    ap.add_argument("--variants", default="bf16-eager,bf16,fp4moe",
                    help="comma-separated, in this order: bf16-eager, bf16 (compiled), fp4moe (routed experts "
                         "NVFP4), fp4moe-shared (then the shared experts NVFP4 too, inside the routed call)")
    args = ap.parse_args()
    if args.replot:
        saved = Path(args.replot)
        plot_e2e(json.loads(saved.read_text()), saved.with_suffix(".png"))
        return
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    batches = [int(b) for b in args.batches.split(",")]
    start = time.time()
    result = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "layers": args.layers,
              "new_tokens": args.new_tokens, "torch": torch.__version__, "rows": []}

    def record(variant, batch, tps, generate_tps, peak, note=""):
        row = {"variant": variant, "batch": batch, "tokens_per_s": tps, "generate_tokens_per_s": generate_tps,
               "peak_GB": peak, "note": note}
        result["rows"].append(row)
        print(f"{variant:18s} batch {batch:3d}: decode {tps:9.1f} tok/s (generate() with prefill "
              f"{generate_tps:8.1f}), peak {peak:6.1f} GB {note}", flush=True)
        (out_dir / "e2e.json").write_text(json.dumps(result, indent=1))

    model = deepseek_v3_layers(args.layers)
    result["expert_GB_bf16"] = expert_bytes(model) / 1e9
    print(f"model: {args.layers} DeepSeek-V3 MoE layers, experts {result['expert_GB_bf16']:.1f} GB bf16 "
          f"({time.time() - start:.0f}s)", flush=True)
    variants = args.variants.split(",")
    cases = [("HF BF16 eager", False)] * ("bf16-eager" in variants) + [("HF BF16 compiled", True)] * ("bf16" in variants)
    for variant, compiled in cases:
        for b in batches:
            if time.time() - start > args.time_budget:
                print(f"skipping {variant} batch {b}: time budget", flush=True)
                continue
            torch.cuda.reset_peak_memory_stats()
            tps, generate_tps, _ = time_generate(model, b, args.new_tokens, compiled)
            record(variant, b, tps, generate_tps, torch.cuda.max_memory_allocated() / 1e9)
        torch._dynamo.reset()

    hf_routers = grouped_topk_routers(model)  # kept for the --router-ab rows
    torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    patch_deepseek(model, verbose=False)
    torch.cuda.synchronize()
    result["patch_s"] = time.time() - t0
    result["patch_peak_GB"] = torch.cuda.max_memory_allocated() / 1e9
    result["expert_GB_nvfp4"] = expert_bytes(model) / 1e9
    backend = [m for m in model.modules() if type(m).__name__ == "NVFP4Experts"][0].backend
    print(f"patched in {result['patch_s']:.1f}s (peak {result['patch_peak_GB']:.1f} GB), experts now "
          f"{result['expert_GB_nvfp4']:.2f} GB ({result['expert_GB_nvfp4'] / result['expert_GB_bf16']:.3f}x), "
          f"backend {backend}", flush=True)
    def fp4moe_rows(variant):
        for b in batches:
            if time.time() - start > args.time_budget:
                print(f"skipping {variant} batch {b}: time budget", flush=True)
                continue
            torch.cuda.reset_peak_memory_stats()
            tps, generate_tps, out = time_generate(model, b, args.new_tokens, compiled=True)
            eager_out = time_generate(model, b, 4, compiled=False)[2] if b == batches[0] else None
            note = ""
            if eager_out is not None:
                same = torch.equal(out[:, :eager_out.shape[1]], eager_out)
                note = f"(first 4 greedy tokens {'match' if same else 'DIFFER from'} eager fp4moe)"
            record(variant, b, tps, generate_tps, torch.cuda.max_memory_allocated() / 1e9, note)

    if "fp4moe" in variants:
        fp4moe_rows(f"fp4moe compiled ({backend})")
    if "fp4moe-shared" in variants:  # the shared experts to NVFP4 as well, run inside the routed call
        from hf_integration import fuse_shared_experts, quantize_linears

        quantize_linears(model, dense_mlps=True)
        fused = fuse_shared_experts(model)
        torch._dynamo.reset()
        print(f"{fused} shared experts now inside the routed call", flush=True)
        fp4moe_rows(f"fp4moe + NVFP4 shared expert inside ({backend})")

    if args.router_ab:  # same process, same weights: Transformers' router, then the fused one again
        fused_routers = [(parent, attr, getattr(parent, attr)) for parent, attr, _ in hf_routers]
        for name, routers in (("Transformers router", hf_routers), ("fused router, again", fused_routers)):
            for parent, attr, router in routers:
                setattr(parent, attr, router)
            torch._dynamo.reset()
            for b in (batches[0], batches[-1]):
                torch.cuda.reset_peak_memory_stats()
                tps, generate_tps, _ = time_generate(model, b, args.new_tokens, compiled=True)
                record(f"fp4moe compiled, {name}", b, tps, generate_tps, torch.cuda.max_memory_allocated() / 1e9)

    lines = [f"{result['device']}, {result['date']}: {args.layers} DeepSeek-V3 MoE layers (E=256, H=7168, I=2048, "
             f"top-8; random weights), decode of {args.new_tokens} tokens after a 16-token prompt",
             "", "| variant | batch | decode tokens/s | generate() tokens/s (prefill incl.) | peak GB |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['variant']} | {r['batch']} | {r['tokens_per_s']:.1f} | {r.get('generate_tokens_per_s', 0):.1f} "
              f"| {r['peak_GB']:.1f} |" for r in result["rows"]]
    lines += ["", f"Expert weights: {result['expert_GB_bf16']:.1f} GB BF16 -> {result.get('expert_GB_nvfp4', 0):.2f} GB NVFP4."]
    (out_dir / "e2e.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot_e2e(result, out_dir / "e2e.png")


def plot_e2e(result: dict, path) -> None:
    """Grouped bars: decode tokens/s per variant at each batch size, speedup over HF BF16
    compiled written on the fp4moe bars. Re-plot a saved run: ``python bench_e2e.py --replot e2e.json``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = list(dict.fromkeys(r["variant"] for r in result["rows"]))
    batches = sorted({r["batch"] for r in result["rows"]})
    tps = {(r["variant"], r["batch"]): r["tokens_per_s"] for r in result["rows"]}
    width = 0.8 / len(variants)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for j, v in enumerate(variants):
        xs = [i + (j - (len(variants) - 1) / 2) * width for i in range(len(batches))]
        ys = [tps.get((v, b), 0.0) for b in batches]
        bars = ax.bar(xs, ys, width, label=v)
        if v.startswith("fp4moe"):
            for bar, b in zip(bars, batches):
                base = tps.get(("HF BF16 compiled", b))
                if base and (v, b) in tps:
                    ax.annotate(f"{tps[(v, b)] / base:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                                ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    ax.set_yscale("log")
    ax.set_ylabel(f"decode tokens/s ({result['new_tokens']} tokens, prefill excluded)")
    ax.set_title(f"{result['device']}, {result['date']}: {result['layers']} DeepSeek-V3 MoE layers")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
