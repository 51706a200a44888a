"""fp4moe's decode step at one batch size on Qwen3-30B-A3B at full depth, read three ways in one
process, and the kernels of one ``generate()`` call by GPU time: the check behind the batch-32 rows
of RESULTS.md ("Whole model"), where ``bench_model.py`` read fp4moe's step inside ``generate()`` as
80.8 ms after HF BF16's runs in the same process, and a process of fp4moe's own read 10.6 ms.

    python benchmarks/probes/probe_batch_decode.py [--batch 32] [--layers 48] [--after-bf16 4096]

The three readings: the compiled model called back to back (``forward_step_ms``, graph replays), the
periods inside ``generate()`` (``generate_step_ms``), and two ``generate()`` calls of different
lengths subtracted (``time_generate``; erred at batch 1, kept as a cross-check). Then the PyTorch
profiler over one ``generate()`` of 9 new tokens: the kernels by GPU time. ``--after-bf16 P``: first
run on the BF16 model what ``bench_model.py`` runs before patching (``generate()`` at the batch, the
step alone at batch 1 on ``batched_mm``, the first token of a P-token prompt eagerly and through
the compiled chunked prefill), so that the readings show whether that state slows fp4moe's steps;
the step alone is then read before and after fp4moe's ``generate()``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_decoder_layer import forward_step_ms  # noqa: E402
from bench_e2e import generate_inputs, generate_step_ms, time_generate  # noqa: E402
from bench_generate_batch import QWEN3_30B_A3B, qwen3_moe  # noqa: E402
from bench_model import time_to_first_token_ms  # noqa: E402
from hf_integration import patch_moe  # noqa: E402


def describe(model) -> None:
    """The experts' backends and layouts over all layers (a slow step could come from a layer that
    runs another backend or layout than the rest), and the CUDA memory held beside what is allocated."""
    from collections import Counter

    from fp4moe_ops.prepared import PreparedExperts

    kinds = Counter((m.backend, m.layout) for m in model.modules() if isinstance(m, PreparedExperts))
    print(f"experts (backend, layout): {dict(kinds)}; allocated {torch.cuda.memory_allocated() / 1e9:.2f} GB, "
          f"reserved {torch.cuda.memory_reserved() / 1e9:.2f} GB", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--after-bf16", type=int, default=0, metavar="P",
                    help="first run bench_model.py's BF16 sequence with a P-token prompt (0: patch at once)")
    args = ap.parse_args()
    b = args.batch
    torch.manual_seed(0)
    model = qwen3_moe(args.layers, QWEN3_30B_A3B, "cuda")
    print(f"{torch.cuda.get_device_name()}: Qwen3-30B-A3B shapes, {args.layers} layers, batch {b}", flush=True)
    if args.after_bf16:
        print("BF16 generate() steps", generate_step_ms(model, b, 16, skip=16), flush=True)
        torch._dynamo.reset()
        try:
            print("BF16 step alone, batch 1, batched_mm (ms)", forward_step_ms(model, 1, decode_experts="batched_mm"))
        finally:
            model.set_experts_implementation("grouped_mm")
        print("BF16 first token, eager / compiled chunks (ms)", time_to_first_token_ms(model, args.after_bf16),
              time_to_first_token_ms(model, args.after_bf16, chunk=args.after_bf16), flush=True)
    patch_moe(model, verbose=False)
    torch._dynamo.reset()
    torch.cuda.reset_peak_memory_stats()
    print(f"memory after the patch {torch.cuda.memory_allocated() / 1e9:.2f} GB", flush=True)
    describe(model)
    print("step alone (ms)", forward_step_ms(model, b), flush=True)
    torch._dynamo.reset()
    print("generate() steps", generate_step_ms(model, b, 16, skip=16), flush=True)
    print("step alone after generate() (ms)", forward_step_ms(model, b), flush=True)
    decode, *_ = time_generate(model, b, 16, True, skip=16)
    print(f"two calls subtracted: decode {decode:.1f} tokens/s ({b * 1e3 / decode:.2f} ms a step)", flush=True)
    print(f"peak memory since the patch {torch.cuda.max_memory_allocated() / 1e9:.2f} GB", flush=True)
    describe(model)
    from torch.profiler import ProfilerActivity, profile

    prompt, kw = generate_inputs(model, b, True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        model.generate(prompt, max_new_tokens=9, min_new_tokens=9, **kw)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))


if __name__ == "__main__":
    main()
