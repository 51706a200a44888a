"""Decode time per decoder layer: one DeepSeek-V3-shaped model of 4 full-size
layers (bench_e2e.py's), timed as its first 2 layers and as all 4, so that the host's time, the
embedding and the LM head cancel: per layer = (step time with 4 layers - with 2) / 2.
``--layer-counts 1,2`` times 1 and 2 layers instead, which fit an 80 GB GPU.

Two step times (``--timing``):

* ``forward`` (default): the compiled model (CUDA graphs) called back to back on a static cache,
  one new token per row per call, the next token the argmax of the last (no host sync), timed with
  CUDA events over 32 calls after 4 warm-up calls. The host issues a call in ~0.1-0.3 ms, less than
  the GPU needs, so this is the GPU's time per step, gaps between kernels included.
* ``generate``: compiled ``generate()`` (:func:`bench_e2e.time_generate`). At batch 1 its host
  time per step (1-2 ms) exceeds the GPU's, so the 2- and 4-layer times both measure the host and
  their difference is noise (H200, 2026-12-01: BF16 0.66 and 0.93 ms per layer in two runs).

Variants, in this order on the same weights (each on top of the last): HF BF16 compiled with its
default experts implementation (``grouped_mm``), the same with ``batched_mm`` (bf16-batched: what
``generate()`` switches the experts to for decoding on a GPU; it gathers a copy of each chosen
expert's weights per token), fp4moe
(routed experts NVFP4), fp4moe-linears (the shared expert's three linears NVFP4 too, through
``fp4moe::nvfp4_linear``), fp4moe-shared (that shared expert inside the routed call), fp4moe-attn
(the attention projections NVFP4 too: ``quantize_attention=True``, W4A16). Step
time = batch / decode tokens per second of bench_e2e.time_generate (compiled generate() with
static cache and CUDA graphs; median of 5, 1 + D new tokens minus 1).

    python benchmarks/bench_decoder_layer.py --batches 1,32 --new-tokens 48
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_e2e import deepseek_v3_layers, time_generate  # noqa: E402
from hf_integration import fuse_shared_experts, patch_deepseek, quantize_linears  # noqa: E402


def forward_step_ms(model, batch: int, steps: int = 32, warmup: int = 4, decode_experts: str | None = None) -> float:
    """GPU time per decode step, mean over ``steps`` calls: see the module docstring (``forward``).
    ``decode_experts``: a Transformers experts implementation for the decode steps only (as
    ``generate()`` switches to ``batched_mm`` after the prefill, which it would not survive)."""
    from transformers import StaticCache

    device = next(model.parameters()).device
    high = min(1000, model.config.vocab_size)
    prompt = torch.randint(1, high, (batch, 16), generator=torch.Generator().manual_seed(batch)).to(device)
    total = 16 + warmup + steps
    cache = StaticCache(config=model.config, max_cache_len=total)
    positions = torch.arange(total, device=device)
    step = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    cuda = device.type == "cuda"
    with torch.no_grad():
        out = model(prompt, past_key_values=cache, cache_position=positions[:16], use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        if decode_experts:
            model.set_experts_implementation(decode_experts)
        for i in range(warmup + steps):
            if i == warmup:
                if cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                t0 = time.perf_counter()
            p = 16 + i
            out = step(input_ids=token, past_key_values=cache, cache_position=positions[p:p + 1], use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
        if not cuda:
            return (time.perf_counter() - t0) * 1e3 / steps
        end.record()
        end.synchronize()
    return start.elapsed_time(end) / steps


def step_ms(model, layers, all_layers, batch, new_tokens, timing="forward", decode_experts=None) -> float:
    model.model.layers = torch.nn.ModuleList(all_layers[:layers])
    model.config.num_hidden_layers = layers
    torch._dynamo.reset()
    if timing == "forward":
        try:
            return forward_step_ms(model, batch, decode_experts=decode_experts)
        finally:
            if decode_experts:
                model.set_experts_implementation("grouped_mm")
    tps, _, _ = time_generate(model, batch, new_tokens, compiled=True)
    return batch * 1e3 / tps


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--variants", default="bf16,bf16-batched,fp4moe,fp4moe-linears,fp4moe-shared,fp4moe-attn")
    ap.add_argument("--timing", choices=("forward", "generate"), default="forward")
    ap.add_argument("--out", default="benchmarks/out")
    ap.add_argument("--layer-counts", default="2,4",
                    help="the two model depths timed; per layer = the difference over theirs (1,2 fits an 80 GB GPU)")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    few, many = (int(n) for n in args.layer_counts.split(","))
    if not 0 < few < many:
        ap.error(f"--layer-counts: two depths, the first smaller, both positive; got {args.layer_counts}")
    model = deepseek_v3_layers(many)
    all_layers = list(model.model.layers)
    rows = []
    import transformers
    import triton

    print(f"{torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d')}, torch {torch.__version__}, Triton "
          f"{triton.__version__}, Transformers {transformers.__version__}: DeepSeek-V3 layers (E=256, H=7168, "
          f"I=2048), decode step ms ({args.timing} timing) with {few} and {many} layers", flush=True)
    print(f"| variant | batch | step ms, {few} layers | step ms, {many} layers | ms per decoder layer |")
    print("|---|---|---|---|---|", flush=True)
    for variant in args.variants.split(","):
        model.model.layers = torch.nn.ModuleList(all_layers)
        model.config.num_hidden_layers = many
        if variant == "bf16-batched" and not hasattr(model, "set_experts_implementation"):
            print("skipping bf16-batched: this Transformers cannot switch experts implementations")
            continue
        decode_experts = "batched_mm" if variant == "bf16-batched" else None
        patched = any(n.endswith("gate_up_proj_packed") for n, _ in model.named_buffers())
        if variant.startswith("fp4moe") and not patched:  # each fp4moe variant has the routed experts NVFP4
            patch_deepseek(model, verbose=False)
        if variant == "fp4moe-linears":
            quantize_linears(model, dense_mlps=True)
        elif variant == "fp4moe-shared":
            quantize_linears(model, dense_mlps=True)  # (nothing left to do after fp4moe-linears)
            fuse_shared_experts(model)
        elif variant == "fp4moe-attn":
            quantize_linears(model, dense_mlps=True, attention=True)
            fuse_shared_experts(model)
        all_layers = list(model.model.layers)
        for b in batches:
            try:
                t_few, t_many = (step_ms(model, n, all_layers, b, args.new_tokens, args.timing, decode_experts)
                                 for n in (few, many))
            except torch.OutOfMemoryError as e:  # batched_mm copies each chosen expert's weights per token
                print(f"| {variant} | {b} | out of memory: {str(e).splitlines()[0][:80]} | | |", flush=True)
                torch._dynamo.reset()
                torch.cuda.empty_cache()
                continue
            per_layer = (t_many - t_few) / (many - few)
            rows.append(dict(variant=variant, batch=b, layers=(few, many), few_ms=t_few, many_ms=t_many, per_layer=per_layer))
            print(f"| {variant} | {b} | {t_few:.3f} | {t_many:.3f} | {per_layer:.3f} |", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decoder_layer.json").write_text(json.dumps(rows, indent=1))
    for b in batches:
        for ref in ("bf16", "bf16-batched"):
            base = next((r["per_layer"] for r in rows if r["variant"] == ref and r["batch"] == b), None)
            for r in rows:
                if base and r["batch"] == b and not r["variant"].startswith("bf16"):
                    print(f"batch {b}: {r['variant']} per decoder layer {base / r['per_layer']:.2f}x {ref}")


if __name__ == "__main__":
    main()
