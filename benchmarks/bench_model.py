"""A whole model at its real depth on one GPU: Qwen3-30B-A3B's config (48 layers, 128 experts,
top-8; random weights in the real shapes), HF BF16 and fp4moe side by side in one process.

    python benchmarks/bench_model.py [--layers 48] [--batches 1,32] [--prompts 4096,16384] [--prefill-chunk N]
        [--variants bf16,fp4moe,fp4moe-attn] [--requests 16,64] [--eager-decode] [--relaunch-off]
        [--checkpoint DIR] [--out benchmarks/out]
    python benchmarks/bench_model.py --tiny --layers 2     # the same code path on a CPU, small shapes
    python benchmarks/bench_model.py --cpu --layers 4 --batches= --prompts= --checkpoint DIR  # loading, on a CPU

Variants, in this order on the same weights (each on top of the last):

* ``bf16``: Transformers' model as built, compiled ``generate()`` (static cache, CUDA graphs;
  Transformers switches the experts to ``batched_mm`` for decoding);
* ``fp4moe``: after ``patch_moe`` (routed experts NVFP4, router as one op);
* ``fp4moe-attn``: the attention projections NVFP4 too (``quantize_linears(attention=True)``), as a
  ModelOpt NVFP4 export of the model quantizes them.

Per variant:

* decode tokens/s at each batch: batch / the median period of a ``generate()`` step, read from
  inside one call (:func:`bench_e2e.generate_step_ms`: a CUDA event per step from a logits
  processor, 1 + 16 + D new tokens, the last D steps; median over 5 calls after a warm-up that
  compiles), with the mean and the slowest of those steps, the first decoding step after the
  prefill and the mean of the steps between. Each variant's ``generate()`` runs as a user's runs:
  fp4moe's models read the stop flag one step late on CUDA (Transformers' ``DeferredStopCheck``,
  :mod:`hf_integration.deferred_stop`), HF BF16 waits for the GPU every step. At batch 1 also with
  the other loop (BF16 deferred, fp4moe waiting), so that the loop's share and the kernels' share
  of the difference are both on the table. (Subtracting the times of two calls of different
  lengths, as :func:`bench_e2e.time_generate` does, erred here by up to 154 ms over 16 steps and once
  gave a negative rate: the two calls do not cost the same apart from their steps.)
* with ``--eager-decode``, the same at batch 1 with ``generate()`` uncompiled (Transformers'
  default: a dynamic cache, every kernel launched from the host each step), where the host's time
  per layer, the op's launches included, sets the step;
* the CUDA graphs torch.compile recorded over the variant's ``generate()`` calls (the per-step
  reading's included), and the steps it
  ran without one (:func:`bench_e2e.cuda_graph_counts`): a step recorded again and again, or run
  without a graph, launches every kernel from the host;
* the decode step's GPU time alone at each batch: the compiled model called back to back, timed
  with CUDA events (:func:`bench_decoder_layer.forward_step_ms`), the experts as ``generate()``
  decodes with them (``batched_mm`` for BF16). The difference to the ``generate()`` step is the
  time ``generate()``'s loop adds on the host where it waits for the GPU every step, and what the
  process's state adds (fp4moe's batch-32 step inside ``generate()`` once read 80.8 ms after HF
  BF16's runs in the same process, 10.6 ms in a process of its own: RESULTS.md);
* time to first token for each prompt length: ``generate(max_new_tokens=1)`` at batch 1 (the
  prefill runs eagerly, as ``generate()`` runs it), median of 3 after a warm-up; with
  ``--prefill-chunk N`` also through Transformers' chunked prefill, which runs the prompt through
  the compiled model N tokens a call (the eager prefill's host time per layer is what sets
  fp4moe's first token at 4096 tokens: RESULTS.md); an empty ``--batches=`` times first tokens
  without the decode timings;
* with ``--relaunch-off``, fp4moe's first tokens and uncompiled step also with every kernel launched
  through Triton's own call (``FP4MOE_RELAUNCH=0``, :mod:`fp4moe_ops.relaunch`), in the same process;
* ``generate_batch`` tokens/s with each of ``--requests`` concurrent requests
  (:func:`bench_generate_batch.time_generate_batch`: 128-token prompts, 128 new tokens);
* peak GPU memory (``max_memory_allocated``) over the variant's decoding, and over all its runs
  (the longest prompt's prefill included).

``--checkpoint DIR``: after HF BF16 and after the first fp4moe variant, ``save_pretrained`` into
``DIR/bf16`` (Transformers' own checkpoint) and ``DIR/fp4moe`` (a ModelOpt NVFP4 one) and
``from_pretrained`` as a user loads it: save and load seconds, the checkpoint's size, the memory the
loaded model takes, and whether its greedy tokens equal the model's (1 or 0); each folder is
deleted after. The BF16 checkpoint of the full depth (61 GB) does not fit the GPU machines' 64 GiB
disk, nor its loaded copy an H100 beside the first: compare loading at ``--layers 24`` (a kind that
would not fit is skipped with a note; a failure is noted and the run goes on). ``--loads N`` loads
each checkpoint N times and adds the median (the first load after the save finds the files in the
page cache as far as memory allows). ``--cpu`` builds the real shapes on the CPU, where, with
``--batches= --prompts=``, only the checkpoints are timed.

Writes ``model.json`` and ``model.md`` to ``--out`` after every measurement. Not measured here:
``transformers serve`` (``bench_serve.py``) and gpt-oss (``bench_gpt_oss.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decoder_layer import forward_step_ms  # noqa: E402
from bench_e2e import cuda_graph_counts, deferred_stop_on_cuda, generate_step_ms, transformers_loop  # noqa: E402
from bench_generate_batch import QWEN3_30B_A3B, TINY, qwen3_moe, time_generate_batch  # noqa: E402
from hf_integration import patch_moe, quantize_linears  # noqa: E402


# decoding steps after the prefill left out of the timed ones (the first costs twice a later one on a
# GPU; each is still reported)
SKIP = 16


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_to_first_token_ms(model, tokens: int, repeats: int = 3, chunk: int = 0) -> float:
    """Median wall time of ``generate(max_new_tokens=1)`` over one ``tokens``-long prompt. ``chunk``
    > 0: Transformers' chunked prefill (``prefill_chunk_size``), which runs the prompt through the
    compiled model (static cache, CUDA graphs) ``chunk`` tokens a call instead of one eager forward;
    the warm-up call compiles it."""
    from transformers import CompileConfig

    prompt = torch.randint(1, min(1000, model.config.vocab_size), (1, tokens), generator=torch.Generator().manual_seed(tokens))
    prompt = prompt.to(model.device)
    kw = dict(do_sample=False)
    if chunk:
        kw.update(prefill_chunk_size=chunk, cache_implementation="static",
                  compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead"))
    times = []
    for run in range(repeats + 1):  # the first warms up
        sync()
        t0 = time.perf_counter()
        model.generate(prompt, max_new_tokens=1, **kw)
        sync()
        if run:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


@contextlib.contextmanager
def relaunch_off():
    """Every fp4moe kernel launched through Triton's own call while active (``FP4MOE_RELAUNCH=0``)."""
    from fp4moe_ops import relaunch

    relaunch.ENABLED = False
    try:
        yield
    finally:
        relaunch.ENABLED = None  # read again from the environment at the next launch


def greedy(model, new_tokens: int = 8) -> torch.Tensor:
    prompt = torch.randint(1, min(1000, model.config.vocab_size), (2, 12), generator=torch.Generator().manual_seed(7))
    prompt = prompt.to(model.device)
    return model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)


def save_and_load(model, folder: Path, record, loads: int = 1) -> None:
    """``--checkpoint``: save ``model`` (HF BF16: Transformers' own checkpoint; fp4moe: a ModelOpt
    one) and load it back as a user would; the folder is deleted afterwards, also on failure (a
    BF16 Qwen3-30B-A3B takes 61 GB of disk). Skipped, with a note, where the checkpoint would not
    fit the free disk or a second copy the free GPU memory; a failure is noted and the run goes on
    with the next variant."""
    weights = sum(t.nbytes for t in list(model.parameters()) + list(model.buffers()))
    folder.parent.mkdir(parents=True, exist_ok=True)
    disk = shutil.disk_usage(folder.parent).free
    gpu = torch.cuda.mem_get_info()[0] if model.device.type == "cuda" else float("inf")
    if 1.1 * weights > disk or 1.1 * weights > gpu:
        print(f"--checkpoint skipped: {weights / 1e9:.1f} GB of weights, {disk / 1e9:.1f} GB of disk and "
              f"{gpu / 1e9:.1f} GB of GPU memory free (fewer --layers fit)", flush=True)
        record("checkpoint skipped: too large for the free disk or GPU memory (GB of weights)", weights / 1e9)
        return
    try:
        _save_and_load(model, folder, record, loads)
    except Exception as exc:  # noqa: BLE001  (the other variants still run)
        print(f"--checkpoint failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        record("checkpoint save and load failed (1)", 1.0)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        gc.collect()  # fp4moe's guards hold the model in reference cycles: freed only by the collector
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _save_and_load(model, folder: Path, record, loads: int = 1) -> None:
    from transformers import AutoModelForCausalLM

    sync()
    t0 = time.perf_counter()
    model.save_pretrained(folder)
    record("save_pretrained (s)", time.perf_counter() - t0)
    record("checkpoint on disk (GB)", sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 1e9)
    record("ModelOpt's hf_quant_config.json written", float((folder / "hf_quant_config.json").exists()))
    cuda = model.device.type == "cuda"
    seconds = []
    for _ in range(loads):  # each load after the last one's model is freed
        again = None
        gc.collect()
        before = torch.cuda.memory_allocated() if cuda else 0
        sync()
        t0 = time.perf_counter()
        again = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map=str(model.device))
        sync()
        seconds.append(time.perf_counter() - t0)
    record("from_pretrained of the saved checkpoint (s)", seconds[0])
    if loads > 1:
        record(f"from_pretrained, median of {loads} loads (s)", statistics.median(seconds))
    if cuda:
        record("loaded model's GPU memory (GB)", (torch.cuda.memory_allocated() - before) / 1e9)
    record("loaded model's greedy tokens equal the model's", float(torch.equal(greedy(again), greedy(model))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--prompts", default="4096,16384", help="prompt lengths for the time to first token")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--prefill-chunk", type=int, default=0, metavar="N",
                    help="also time the first token with Transformers' compiled chunked prefill, N tokens a chunk")
    ap.add_argument("--variants", default="bf16,fp4moe,fp4moe-attn")
    ap.add_argument("--requests", default="", help="concurrent generate_batch requests, e.g. 16,64")
    ap.add_argument("--relaunch-off", action="store_true",
                    help="fp4moe's first tokens and uncompiled step also with every launch through Triton's own call "
                         "(FP4MOE_RELAUNCH=0)")
    ap.add_argument("--eager-decode", action="store_true",
                    help="also the batch-1 step of an uncompiled generate() (Transformers' default)")
    ap.add_argument("--checkpoint", type=Path, default=None,
                    help="save each kind (HF BF16, fp4moe) under this folder, load it back, delete it")
    ap.add_argument("--loads", type=int, default=1, help="--checkpoint: from_pretrained this many times (the first "
                                                           "and the median reported)")
    ap.add_argument("--tiny", action="store_true", help="small dimensions on the CPU, uncompiled (a smoke test)")
    ap.add_argument("--cpu", action="store_true", help="the real shapes on the CPU, uncompiled (for --checkpoint's "
                                                       "save and load, with --batches= --prompts=)")
    ap.add_argument("--out", default="benchmarks/out")
    args = ap.parse_args()
    import transformers

    try:
        import triton
    except ImportError:  # a CPU install without Triton (--tiny)
        triton = None
    if not (args.tiny or args.cpu) and not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (or --tiny for a CPU smoke test, --cpu for the real shapes on the CPU)")
    on_cpu = args.tiny or args.cpu

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    batches = [int(b) for b in args.batches.split(",") if b]  # empty: no decode timings (first tokens only)
    prompts = [int(p) for p in args.prompts.split(",") if p]
    requests = [int(r) for r in args.requests.split(",") if r]
    dims = TINY if args.tiny else QWEN3_30B_A3B
    result = {"device": "CPU" if on_cpu else torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
              "layers": args.layers, "shapes": "tiny" if args.tiny else "Qwen3-30B-A3B",
              "versions": f"torch {torch.__version__}, Triton {getattr(triton, '__version__', 'absent')}, "
                          f"Transformers {transformers.__version__}", "rows": []}

    def save():
        (out / "model.json").write_text(json.dumps(result, indent=1))
        lines = [f"{result['device']}, {result['date']}: {result['shapes']} shapes, {args.layers} layers, random "
                 f"weights; {result['versions']}", "",
                 "| variant | what | value |", "|---|---|---|"]
        lines += [f"| {r['variant']} | {r['what']} | {r['value']:.2f} |" for r in result["rows"]]
        (out / "model.md").write_text("\n".join(lines) + "\n")

    def record(variant, what, value):
        result["rows"].append({"variant": variant, "what": what, "value": value})
        print(f"{variant:12s} {what:40s} {value:10.2f}", flush=True)
        save()

    start = time.time()
    torch.manual_seed(0)
    model = qwen3_moe(args.layers, dims, "cpu" if on_cpu else "cuda")
    print(f"built in {time.time() - start:.0f} s; {result['versions']}", flush=True)
    cuda = not on_cpu
    saved = set()  # the kinds whose checkpoint was saved and loaded
    for variant in args.variants.split(","):
        if variant == "fp4moe" or (variant == "fp4moe-attn" and "fp4moe" not in args.variants.split(",")):
            patch_moe(model, verbose=False)
        if variant == "fp4moe-attn":
            quantize_linears(model, dense_mlps=False, attention=True)
        torch._dynamo.reset()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        with cuda_graph_counts() if cuda else contextlib.nullcontext({}) as graphs:
            for b in batches:  # (the CPU smoke test runs uncompiled: Inductor on a CPU takes minutes)
                loops = [("", contextlib.nullcontext)]
                if b == 1 and cuda:  # the other stop check: what the loop costs, apart from the kernels
                    other = "deferred stop check" if variant == "bf16" else "Transformers' stop check"
                    loops.append((f", {other}", deferred_stop_on_cuda if variant == "bf16" else transformers_loop))
                for label, loop in loops:
                    with loop():
                        steps = generate_step_ms(model, b, args.new_tokens, skip=SKIP, compiled=cuda)
                        record(variant, f"decode tokens/s, batch {b}{label}", b * 1e3 / steps["step"])
                        record(variant, f"generate() step, median, batch {b}{label} (ms)", steps["step"])
                        record(variant, f"generate() step, mean, batch {b}{label} (ms)", steps["mean"])
                        record(variant, f"generate() step, slowest, batch {b}{label} (ms)", steps["slowest"])
                        record(variant, f"generate() first decoding step, batch {b}{label} (ms)", steps["first"])
                        record(variant, f"generate() steps 2-{SKIP}, mean, batch {b}{label} (ms)", steps["early"])
        for what, n in graphs.items():
            record(variant, f"compiled steps over its generate() calls: {what}", n)
        if args.eager_decode:
            steps = generate_step_ms(model, 1, args.new_tokens, skip=SKIP, compiled=False)
            record(variant, "uncompiled generate() step, median, batch 1 (ms)", steps["step"])
            record(variant, "uncompiled decode tokens/s, batch 1", 1e3 / steps["step"])
            if args.relaunch_off and variant != "bf16":
                with relaunch_off():
                    steps = generate_step_ms(model, 1, args.new_tokens, skip=SKIP, compiled=False)
                record(variant, "uncompiled generate() step, median, batch 1, FP4MOE_RELAUNCH=0 (ms)", steps["step"])
        if cuda:
            record(variant, "peak GPU memory, decoding (GB)", torch.cuda.max_memory_allocated() / 1e9)
            torch._dynamo.reset()
            experts = "batched_mm" if variant == "bf16" else None  # as generate() decodes
            try:
                for b in batches:
                    record(variant, f"decode step alone, batch {b} (ms)", forward_step_ms(model, b, decode_experts=experts))
            finally:
                if experts:
                    model.set_experts_implementation("grouped_mm")
        for p in prompts:
            record(variant, f"time to first token, {p} tokens (ms)", time_to_first_token_ms(model, p))
            if args.relaunch_off and variant != "bf16":
                with relaunch_off():
                    record(variant, f"time to first token, {p} tokens, FP4MOE_RELAUNCH=0 (ms)",
                           time_to_first_token_ms(model, p))
            if args.prefill_chunk:
                record(variant, f"time to first token, {p} tokens, compiled prefill in chunks of {args.prefill_chunk} (ms)",
                       time_to_first_token_ms(model, p, chunk=args.prefill_chunk))
        for n in requests:
            row = time_generate_batch(model, n, 128, 128, 1 if args.tiny else 3, dims["vocab_size"],
                                      small_cache=args.tiny)
            record(variant, f"generate_batch tokens/s, {n} requests", row["tokens_per_s"])
        if cuda:
            record(variant, "peak GPU memory, all runs (GB)", torch.cuda.max_memory_allocated() / 1e9)
        kind = "fp4moe" if variant.startswith("fp4moe") else variant
        if args.checkpoint and kind not in saved:
            save_and_load(model, args.checkpoint / kind, lambda what, value: record(variant, what, value), args.loads)
            saved.add(kind)
    print((out / "model.md").read_text())


if __name__ == "__main__":
    main()
