"""Continuous-batching throughput (Transformers' ``generate_batch``: paged KV cache, requests scheduled
token by token), fp4moe vs BF16, on a Qwen3-MoE-shaped model: Qwen3-30B-A3B's dimensions (128
experts of 768, top-8, hidden 2048, 32 query / 4 KV heads of 128) with a few decoder layers and
random weights, on one GPU.

    python benchmarks/bench_generate_batch.py                       # 2 layers; 16, 32, 64 requests
    python benchmarks/bench_generate_batch.py --layers 4 --requests 16,32,64 --out benchmarks/out

The same model is timed in BF16 (Transformers' own experts), then patched by ``patch_moe`` (NVFP4
experts, backend "auto") and timed again. Per concurrency N: N requests of ``--prompt`` random tokens,
each generating ``--new`` tokens (EOS off), all submitted at once; tokens/s = generated tokens / wall
time of ``generate_batch``, median of ``--repeats`` runs after one warm-up run at that N. Every request
must come back with all its tokens (an empty one fails the run: continuous batching reports errors
only in a log line). Prints a Markdown table; ``--out`` also writes ``generate_batch.json``.
``--tiny`` runs small dimensions on the CPU (a smoke test of the script, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after PYTHONPATH: an older tree can go first
from hf_integration import patch_moe  # noqa: E402

QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_experts=128, num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4,
                     head_dim=128, norm_topk_prob=True, rms_norm_eps=1e-6, max_position_embeddings=40960)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
            num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=512)


def qwen3_moe(layers: int, dims: dict, device: str):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(num_hidden_layers=layers, **dims)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()


def time_generate_batch(model, requests: int, prompt: int, new: int, repeats: int, vocab: int,
                        small_cache: bool = False, cuda_graph: bool = False, compile_level: int = 0) -> dict:
    """Tokens/s of ``generate_batch`` with ``requests`` concurrent requests (median of ``repeats``
    timed runs after a warm-up). ``small_cache``: a paged cache sized for this workload (the CPU
    smoke test) instead of Transformers' own sizing from free memory. ``cuda_graph`` and
    ``compile_level``: Transformers' own switches (``ContinuousBatchingConfig.use_cuda_graph``, which
    it leaves off by default where attention needs a mask, as SDPA does, and
    ``default_compile_level``)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    inputs = torch.randint(1, vocab, (requests, prompt), generator=torch.Generator().manual_seed(requests)).tolist()
    config = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    options = {}
    if small_cache:
        # On the CPU Transformers sizes the cache from free RAM (0.8-0.9 of it): gigabytes even for the
        # tiny model. Here: every request's prompt and new tokens in blocks of 256 tokens, one spare.
        blocks = requests * -(-(prompt + new) // 256) + 1
        options.update(num_blocks=blocks, max_batch_tokens=max(256, min(requests * prompt, 8192)))
    if cuda_graph:
        options["use_cuda_graph"] = True
    if compile_level:
        options["default_compile_level"] = compile_level
    cache = ContinuousBatchingConfig(**options) if options else None
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = []
    for run in range(repeats + 1):  # the first run warms up (allocations, kernels)
        sync()
        start = time.perf_counter()
        out = model.generate_batch(inputs=inputs, generation_config=config, continuous_batching_config=cache,
                                   progress_bar=False)
        sync()
        elapsed = time.perf_counter() - start
        short = {k: len(v.generated_tokens) for k, v in out.items() if len(v.generated_tokens) != new}
        if len(out) != requests or short:
            raise RuntimeError(f"generate_batch returned {len(out)} of {requests} requests, with fewer than {new} "
                               f"tokens: {dict(list(short.items())[:5])} (see the ContinuousBatchingLogger error)")
        if run:
            times.append(elapsed)
    seconds = statistics.median(times)
    return {"requests": requests, "seconds": seconds, "tokens_per_s": requests * new / seconds}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--requests", default="16,32,64", help="concurrent requests, comma-separated")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--new", type=int, default=128, help="generated tokens per request")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cuda-graph", action="store_true", help="ContinuousBatchingConfig(use_cuda_graph=True)")
    parser.add_argument("--compile-level", type=int, default=0, help="ContinuousBatchingConfig(default_compile_level=N)")
    parser.add_argument("--tiny", action="store_true", help="small dimensions on the CPU (smoke test)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (or --tiny for a CPU smoke test)")
    dims = TINY if args.tiny else QWEN3_30B_A3B
    counts = [int(n) for n in args.requests.split(",")]
    torch.manual_seed(0)
    model = qwen3_moe(args.layers, dims, "cpu" if args.tiny else "cuda")
    rows = []
    for variant in ("BF16", "fp4moe"):
        if variant == "fp4moe":
            patch_moe(model, verbose=False)
        for n in counts:
            row = {"variant": variant} | time_generate_batch(model, n, args.prompt, args.new, args.repeats,
                                                             dims["vocab_size"], small_cache=args.tiny,
                                                             cuda_graph=args.cuda_graph, compile_level=args.compile_level)
            rows.append(row)
            print(f"{variant:7s} {n:3d} requests: {row['tokens_per_s']:9.1f} tokens/s", flush=True)
    device = "CPU" if args.tiny else torch.cuda.get_device_name()
    print(f"\ngenerate_batch, Qwen3-MoE {'tiny' if args.tiny else '30B-A3B'} shapes, {args.layers} layers, "
          f"prompt {args.prompt} + {args.new} new tokens per request, CUDA graphs {'on' if args.cuda_graph else 'default'}, "
          f"compile level {args.compile_level}, {device}\n")
    print("| requests | BF16 tokens/s | fp4moe tokens/s | fp4moe / BF16 |")
    print("|---:|---:|---:|---:|")
    for n in counts:
        bf16, ours = (next(r for r in rows if r["variant"] == v and r["requests"] == n) for v in ("BF16", "fp4moe"))
        print(f"| {n} | {bf16['tokens_per_s']:.1f} | {ours['tokens_per_s']:.1f} | "
              f"{ours['tokens_per_s'] / bf16['tokens_per_s']:.2f} |")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "generate_batch.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                                  "device": device, "rows": rows}, indent=2))
    return rows


if __name__ == "__main__":
    main()
