"""A whole model at its real depth on one GPU: Qwen3-30B-A3B's config (48 layers, 128 experts,
top-8; random weights in the real shapes), HF BF16 and fp4moe side by side in one process.

    python benchmarks/bench_model.py [--layers 48] [--batches 1,32] [--prompts 4096,16384]
        [--variants bf16,fp4moe,fp4moe-attn] [--out benchmarks/out]

Variants, in this order on the same weights (each on top of the last):

* ``bf16``: Transformers' model as built, compiled ``generate()`` (static cache, CUDA graphs;
  Transformers switches the experts to ``batched_mm`` for decoding);
* ``fp4moe``: after ``patch_moe`` (routed experts NVFP4, router as one op);
* ``fp4moe-attn``: the attention projections NVFP4 too (``quantize_linears(attention=True)``), as a
  ModelOpt NVFP4 export of the model quantizes them.

Per variant:

* decode tokens/s at each batch: :func:`bench_e2e.time_generate` (1 + D new tokens minus 1, so
  prefill and setup cancel; median of 5 after a warm-up that compiles);
* the decode step's GPU time alone at batch 1: the compiled model called back to back, timed
  with CUDA events (:func:`bench_decoder_layer.forward_step_ms`). The difference to the
  ``generate()`` step is the time ``generate()``'s loop adds on the host: it synchronizes every
  step, so the host's work is not hidden behind the GPU's;
* time to first token for each prompt length: ``generate(max_new_tokens=1)`` at batch 1 (the
  prefill runs eagerly, as ``generate()`` runs it), median of 3 after a warm-up;
* peak GPU memory (``max_memory_allocated``) over the variant's runs.

Writes ``model.json`` and ``model.md`` to ``--out`` after every measurement. Not measured here:
loading a checkpoint from disk, ``generate_batch`` and ``transformers serve`` (see RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decoder_layer import forward_step_ms  # noqa: E402
from bench_e2e import time_generate  # noqa: E402
from bench_generate_batch import QWEN3_30B_A3B, qwen3_moe  # noqa: E402
from hf_integration import patch_moe, quantize_linears  # noqa: E402


def time_to_first_token_ms(model, tokens: int, repeats: int = 3) -> float:
    """Median wall time of ``generate(max_new_tokens=1)`` over one ``tokens``-long prompt."""
    prompt = torch.randint(1, 1000, (1, tokens), generator=torch.Generator().manual_seed(tokens)).cuda()
    times = []
    for run in range(repeats + 1):  # the first warms up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(prompt, max_new_tokens=1, do_sample=False)
        torch.cuda.synchronize()
        if run:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--prompts", default="4096,16384", help="prompt lengths for the time to first token")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--variants", default="bf16,fp4moe,fp4moe-attn")
    ap.add_argument("--out", default="benchmarks/out")
    args = ap.parse_args()
    import transformers
    import triton

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    batches = [int(b) for b in args.batches.split(",")]
    prompts = [int(p) for p in args.prompts.split(",") if p]
    result = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "layers": args.layers,
              "versions": f"torch {torch.__version__}, Triton {triton.__version__}, "
                          f"Transformers {transformers.__version__}", "rows": []}

    def save():
        (out / "model.json").write_text(json.dumps(result, indent=1))
        lines = [f"{result['device']}, {result['date']}: Qwen3-30B-A3B shapes, {args.layers} layers, random "
                 f"weights; {result['versions']}", "",
                 "| variant | what | value |", "|---|---|---|"]
        lines += [f"| {r['variant']} | {r['what']} | {r['value']:.2f} |" for r in result["rows"]]
        (out / "model.md").write_text("\n".join(lines) + "\n")

    def record(variant, what, value):
        result["rows"].append({"variant": variant, "what": what, "value": value})
        print(f"{variant:12s} {what:40s} {value:10.2f}", flush=True)
        save()

    start = time.time()
    model = qwen3_moe(args.layers, QWEN3_30B_A3B, "cuda")
    print(f"built in {time.time() - start:.0f} s; {result['versions']}", flush=True)
    for variant in args.variants.split(","):
        if variant == "fp4moe" or (variant == "fp4moe-attn" and "fp4moe" not in args.variants.split(",")):
            patch_moe(model, verbose=False)
        if variant == "fp4moe-attn":
            quantize_linears(model, dense_mlps=False, attention=True)
        torch._dynamo.reset()
        torch.cuda.reset_peak_memory_stats()
        for b in batches:
            tps, _, _ = time_generate(model, b, args.new_tokens, compiled=True)
            record(variant, f"decode tokens/s, batch {b}", tps)
        torch._dynamo.reset()
        record(variant, "decode step alone, batch 1 (ms)", forward_step_ms(model, 1))
        for p in prompts:
            record(variant, f"time to first token, {p} tokens (ms)", time_to_first_token_ms(model, p))
        record(variant, "peak GPU memory (GB)", torch.cuda.max_memory_allocated() / 1e9)
    print((out / "model.md").read_text())


if __name__ == "__main__":
    main()
