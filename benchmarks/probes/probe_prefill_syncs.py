"""Which calls make the host wait for the GPU during an eager forward (as ``generate()`` runs its
prefill, into a static cache), on a Qwen3-30B-A3B-shaped model of ``--layers`` layers, HF BF16 then after ``patch_moe``:
``torch.cuda.set_sync_debug_mode("warn")`` reports every synchronizing call with its stack, and
the distinct call sites are printed with their counts.

    python3 benchmarks/probes/probe_prefill_syncs.py [--layers 2] [--tokens 16,4096]
"""

from __future__ import annotations

import argparse
import sys
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_generate_batch import QWEN3_30B_A3B, qwen3_moe  # noqa: E402
from hf_integration import patch_moe  # noqa: E402


def sync_sites(model, tokens: int) -> Counter:
    prompt = torch.randint(1, 1000, (1, tokens), generator=torch.Generator().manual_seed(tokens)).cuda()
    from transformers import StaticCache

    def forward():
        # as generate() runs its prefill: eagerly, into a static cache
        cache = StaticCache(config=model.config, max_cache_len=tokens + 8)
        model(prompt, past_key_values=cache, use_cache=True)

    with torch.no_grad():
        forward()  # warm-up: first-call work is not the question
        torch.cuda.synchronize()
        sites = Counter()

        def record(message, category, filename, lineno, file=None, line=None):
            # the warning names the synchronizing op; the Python stack at that moment shows whose code
            # called it (torch's own frames left out)
            frames = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-1]
                      if "torch/nn/modules" not in f.filename and "warnings.py" not in f.filename]
            sites[(str(message).splitlines()[0][:100], " <- ".join(frames[-6:][::-1]))] += 1

        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.set_warn_always(True)  # C++ warnings are otherwise shown once per call site
            torch.cuda.set_sync_debug_mode("warn")
            try:
                forward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
                torch.set_warn_always(False)
    return sites


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", default="16,4096")
    args = ap.parse_args()
    model = qwen3_moe(args.layers, QWEN3_30B_A3B, "cuda")
    for variant in ("HF BF16", "fp4moe"):
        if variant == "fp4moe":
            patch_moe(model, verbose=False)
        for t in map(int, args.tokens.split(",")):
            sites = sync_sites(model, t)
            print(f"{variant}, {args.layers} layers, eager forward of {t} tokens: {sum(sites.values())} synchronizing calls",
                  flush=True)
            for (what, where), n in sites.most_common(12):
                print(f"  {n:4d} x {what}\n         at {where}", flush=True)


if __name__ == "__main__":
    main()
