"""Where a decode step's time goes, end to end, on the DeepSeek-V3-shaped model of bench_e2e.py or
Qwen3-30B-A3B's (``--model qwen3-30b``): GPU time per decode step by kernel (launch count and
milliseconds) against the host's wall time per step, for HF BF16 compiled and for fp4moe compiled
(CUDA graphs in both); ``--prefill N`` also profiles one eager forward over N prompt tokens.

Decode only: every number is the difference between a compiled ``generate()`` of ``1 + D`` new
tokens and one of 1 new token, divided by D, so the prefill step and generate()'s setup cancel.

    python3 benchmarks/probes/profile_decode_step.py --layers 2 --batch 1 [--variants bf16,fp4moe,fp4moe-dense]

Variants apply in the order given, each on top of the last: ``fp4moe-hf-router`` patches the
experts and keeps Transformers' router, ``fp4moe`` is ``patch_deepseek``'s default (router as one
``fp4moe::grouped_topk`` op), ``fp4moe-dense`` also quantizes the shared experts' linears
(``quantize_dense_mlps=True`` without fusing), ``fp4moe-shared`` runs them inside the routed call,
``fp4moe-attn`` quantizes the attention projections too (``quantize_attention=True``). For Qwen3
``fp4moe-hf-router`` keeps Transformers' softmax top-k router, ``fp4moe`` is ``patch_moe``'s default
(router as one ``fp4moe::softmax_topk`` op) and ``fp4moe-attn`` adds the attention projections.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
from hf_integration import fuse_routers, fuse_shared_experts, patch_deepseek, patch_moe, quantize_linears  # noqa: E402
from bench_e2e import deepseek_v3_layers  # noqa: E402
from bench_decoder_layer import forward_step_ms  # noqa: E402
from bench_generate_batch import QWEN3_30B_A3B, qwen3_moe  # noqa: E402

GROUPS = [  # first match wins; lower-case substrings of kernel names
    ("fp4moe experts (Triton)", ("_gate_up_", "_down_", "_prefill_gemm", "_route_kernel", "_sum_topk")),
    ("fp4moe NVFP4 linears (Triton)", ("_linear", "_dequant_kernel")),
    ("attention (SDPA/flash)", ("flash", "fmha", "attention", "sdpa", "softmax")),
    ("GEMM/GEMV (cuBLAS, cutlass, grouped_mm)", ("gemm", "gemv", "cutlass", "xmma", "nvjet", "grouped", "matmul")),
    ("inductor-fused elementwise/reductions", ("triton_",)),
]


def group_of(name: str) -> str:
    low = name.lower()
    for group, keys in GROUPS:
        # fp4moe's kernels by the start of their names (Inductor's fused kernels may name an op inside)
        if any(low.startswith(k) if k.startswith("_") else k in low for k in keys):
            return group
    return "other (copies, index, sort, topk, ...)"


def kernels(prof, name_chars: int = 90) -> dict[str, list[float]]:
    """{kernel name: [launches, GPU ms]} over a finished profile."""
    out = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            out[ev.name[:name_chars]][0] += 1
            out[ev.name[:name_chars]][1] += ev.device_time_total / 1e3
    return out


def profile_prefill(model, tokens: int) -> None:
    """Wall time of one eager forward over ``tokens`` prompt tokens (median of 3, no cache) and its
    GPU kernels by group."""
    prompt = torch.randint(1, 1000, (1, tokens), generator=torch.Generator().manual_seed(tokens)).cuda()
    with torch.no_grad():
        model(prompt, use_cache=False)
        times = []
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model(prompt, use_cache=False)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model(prompt, use_cache=False)
            torch.cuda.synchronize()
    ks = kernels(prof)
    gpu = sum(ms for _, ms in ks.values())
    print(f"  prefill {tokens} tokens: wall {sorted(times)[1] * 1e3:.2f} ms, GPU kernels {gpu:.2f} ms in "
          f"{sum(c for c, _ in ks.values())} launches")
    for name, (c, ms) in sorted(ks.items(), key=lambda kv: -kv[1][1])[:25]:
        print(f"    {ms:8.3f} ms  {c:5d}x  {name}")


def profile_decode(model, batch: int, decode_steps: int, host_profile: bool = False) -> dict:
    from transformers import CompileConfig

    prompt = torch.randint(1, 1000, (batch, 16), generator=torch.Generator().manual_seed(batch)).cuda()

    def generate(new_tokens):
        return model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              cache_implementation="static",
                              compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead"))

    for n in (1 + decode_steps, 1, 1 + decode_steps):  # compile, record graphs
        generate(n)
    walls, profiles = {}, {}
    for n in (1, 1 + decode_steps):
        times = []
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            generate(n)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        walls[n] = sorted(times)[1]
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            generate(n)
            torch.cuda.synchronize()
        profiles[n] = kernels(prof)
    per_step = {}
    for name, (count, ms) in profiles[1 + decode_steps].items():
        c0, ms0 = profiles[1].get(name, [0, 0.0])
        per_step[name] = ((count - c0) / decode_steps, (ms - ms0) / decode_steps)
    if host_profile:  # where the host's time per step goes (Python functions, by own time)
        import cProfile
        import pstats

        with cProfile.Profile() as host:
            generate(1 + decode_steps)
            torch.cuda.synchronize()
        pstats.Stats(host).sort_stats("tottime").print_stats(25)
        pstats.Stats(host).sort_stats("cumulative").print_stats(35)
    wall = (walls[1 + decode_steps] - walls[1]) * 1e3 / decode_steps
    gpu = sum(ms for _, ms in per_step.values())
    launches = sum(c for c, _ in per_step.values())
    print(f"  decode step: wall {wall:.3f} ms, GPU kernels {gpu:.3f} ms in {launches:.0f} launches, "
          f"{batch * 1e3 / wall:.1f} tokens/s")
    per_group = defaultdict(lambda: [0.0, 0.0])
    for name, (c, ms) in per_step.items():
        per_group[group_of(name)][0] += c
        per_group[group_of(name)][1] += ms
    for g, (c, ms) in sorted(per_group.items(), key=lambda kv: -kv[1][1]):
        print(f"    {ms:7.4f} ms  {c:5.0f} launches  {g}")
    print("  kernels (ms per step, launches per step):")
    for name, (c, ms) in sorted(per_step.items(), key=lambda kv: -kv[1][1]):
        if c > 0 or ms > 1e-4:
            print(f"    {ms:7.4f} ms  {c:4.0f}x  {name}")
    return dict(wall_ms=wall, gpu_ms=gpu, launches=launches)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--variants", default="bf16,fp4moe-hf-router,fp4moe")
    ap.add_argument("--host-profile", action="store_true", help="cProfile one generate() of each variant (BF16 included)")
    ap.add_argument("--model", choices=("deepseek-v3", "qwen3-30b"), default="deepseek-v3")
    ap.add_argument("--forward-step", action="store_true",
                    help="also time the compiled model's decode step alone (bench_decoder_layer's forward timing)")
    ap.add_argument("--prefill", type=int, default=0, help="also profile one eager forward over this many tokens")
    args = ap.parse_args()
    variants = args.variants.split(",")
    known = {"bf16", "fp4moe-hf-router", "fp4moe", "fp4moe-attn"} | (
        {"fp4moe-dense", "fp4moe-shared"} if args.model == "deepseek-v3" else set())
    if set(variants) - known:  # Qwen3-MoE has no shared expert or dense MLP layers
        ap.error(f"--model {args.model} takes variants {sorted(known)}, not {sorted(set(variants) - known)}")
    import transformers

    if args.model == "qwen3-30b":
        model = qwen3_moe(args.layers, QWEN3_30B_A3B, "cuda")
    else:
        model = deepseek_v3_layers(args.layers)
    print(f"{torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d')}: {args.layers} {args.model} layers, "
          f"batch {args.batch}, {args.decode_steps} decode steps; torch {torch.__version__}, "
          f"transformers {transformers.__version__}")
    if "bf16" in variants:
        print("HF BF16 compiled (CUDA graphs):")
        profile_decode(model, args.batch, args.decode_steps, args.host_profile)
        if args.forward_step:
            print(f"  graph replays alone (no generate loop): {forward_step_ms(model, args.batch):.3f} ms a step")
        if args.prefill:
            profile_prefill(model, args.prefill)
    for variant in [v for v in variants if v.startswith("fp4moe")]:  # applied in order, cumulatively
        torch._dynamo.reset()
        patched = any(n.endswith("gate_up_proj_packed") for n, _ in model.named_buffers())
        if args.model == "qwen3-30b":
            if not patched:
                patch_moe(model, verbose=False, fuse_router=variant != "fp4moe-hf-router")
            if variant in ("fp4moe", "fp4moe-attn"):
                fuse_routers(model)
            if variant == "fp4moe-attn":
                quantize_linears(model, dense_mlps=False, attention=True)
            print(f"{variant} compiled (CUDA graphs):")
            profile_decode(model, args.batch, args.decode_steps, args.host_profile)
            if args.forward_step:
                print(f"  graph replays alone (no generate loop): {forward_step_ms(model, args.batch):.3f} ms a step")
            if args.prefill:
                profile_prefill(model, args.prefill)
            continue
        if not patched:
            patch_deepseek(model, verbose=False, fuse_router=variant != "fp4moe-hf-router")
        if variant in ("fp4moe", "fp4moe-dense"):
            fuse_routers(model)
        if variant in ("fp4moe-dense", "fp4moe-shared", "fp4moe-attn"):
            quantize_linears(model, dense_mlps=True, attention=variant == "fp4moe-attn")
        if variant in ("fp4moe-shared", "fp4moe-attn"):
            fuse_shared_experts(model)
        print(f"{variant} compiled (CUDA graphs):")
        profile_decode(model, args.batch, args.decode_steps, args.host_profile)

if __name__ == "__main__":
    main()
