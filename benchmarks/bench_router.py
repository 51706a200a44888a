"""Routers per layer, Transformers' module compiled by Inductor against fp4moe's, both timed as
CUDA-graph replays over 8 hidden-state sets; counts the tokens for which the two choose different
experts.

* ``--router deepseek-v3`` (E=256, 8 groups, 4 kept, top-8, H=7168): ``DeepseekV3TopkRouter`` against
  ``GroupedTopkRouter`` (the same GEMV, then one ``fp4moe::grouped_topk`` launch); also the routing
  op alone.
* ``--router qwen3`` (Qwen3-30B-A3B: E=128, top-8, H=2048): ``Qwen3MoeTopKRouter`` against
  ``SoftmaxTopkRouter`` as it runs (``fp4moe::router_softmax_topk``: one launch up to 16 tokens)
  and with the fused launch off (cuBLAS's GEMV, then ``fp4moe::softmax_topk``).

    python3 benchmarks/bench_router.py [--router qwen3] --tokens 1,8,64,512,2048,8192
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import fp4moe_ops  # noqa: E402,F401  (registers the ops)
from fp4moe_ops import routing  # noqa: E402
from hf_integration.router import GroupedTopkRouter, SoftmaxTopkRouter  # noqa: E402
from bench_moe import graph_time_ms  # noqa: E402


def deepseek_router(dtype):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(hidden_size=7168, n_routed_experts=256, n_group=8, topk_group=4, num_experts_per_tok=8,
                           routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(cfg).to("cuda", dtype)
    with torch.no_grad():
        router.weight.normal_(std=7168**-0.5)
        router.e_score_correction_bias.uniform_(-0.05, 0.05)
    return router


@torch.no_grad()
def qwen3_router():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cfg = Qwen3MoeConfig(hidden_size=2048, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True)
    router = Qwen3MoeTopKRouter(cfg).to("cuda", torch.bfloat16)
    with torch.no_grad():
        router.weight.normal_(std=2 * 2048**-0.5)
    return router


def bench_qwen3(tokens):
    hf = qwen3_router()
    ours = SoftmaxTopkRouter(hf)
    hf_c = torch.compile(hf, fullgraph=True, dynamic=False)
    ours_c = torch.compile(ours, fullgraph=True, dynamic=False)
    print(f"{torch.cuda.get_device_name()}: ms per router call (median CUDA-graph replay, 8 input sets), "
          "Qwen3-30B-A3B's router (bf16)")
    print("| tokens | HF router (inductor) | fp4moe router | speedup | fp4moe, GEMV and softmax_topk apart | "
          "tokens routed differently |")
    print("|---|---|---|---|---|---|")
    with torch.no_grad():
        for t in tokens:
            inputs = [(torch.randn(t, 2048, dtype=torch.bfloat16, device="cuda"),) for _ in range(8)]
            differ = sum(int((hf(x)[2].sort(dim=-1)[0] != ours(x)[2].sort(dim=-1)[0]).any(dim=-1).sum())
                         for (x,) in inputs)
            t_hf = graph_time_ms(lambda x: hf_c(x), inputs)
            t_ours = graph_time_ms(lambda x: ours_c(x), inputs)
            fused, routing.ROUTER_FUSED_MAX_TOKENS = routing.ROUTER_FUSED_MAX_TOKENS, 0  # (read at capture)
            try:
                t_apart = graph_time_ms(lambda x: ours_c(x), inputs)
            finally:
                routing.ROUTER_FUSED_MAX_TOKENS = fused
            print(f"| {t} | {t_hf:.4f} | {t_ours:.4f} | {t_hf / t_ours:.2f}x | {t_apart:.4f} | {differ} of {8 * t} |",
                  flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--router", default="deepseek-v3", choices=["deepseek-v3", "qwen3"])
    ap.add_argument("--tokens", default="1,8,64,512,2048,8192")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="DeepSeek-V3's router weight dtype (a bf16 model's router is bf16; Transformers declares float32)")
    args = ap.parse_args()
    if args.router == "qwen3":
        return bench_qwen3([int(x) for x in args.tokens.split(",")])
    hf = deepseek_router(getattr(torch, args.dtype))
    ours = GroupedTopkRouter(hf)
    hf_c = torch.compile(hf, fullgraph=True, dynamic=False)
    ours_c = torch.compile(ours, fullgraph=True, dynamic=False)
    op = torch.ops.fp4moe.grouped_topk
    bias = hf.e_score_correction_bias.float()
    print(f"{torch.cuda.get_device_name()}: ms per router call (median CUDA-graph replay, 8 input sets), "
          f"{args.dtype} router weight")
    print("| tokens | HF router (inductor) | fp4moe router | speedup | routing op alone | tokens routed differently |")
    print("|---|---|---|---|---|---|")
    for t in (int(x) for x in args.tokens.split(",")):
        inputs = [(torch.randn(t, 7168, dtype=torch.bfloat16, device="cuda"),) for _ in range(8)]
        logits = [(hf(x)[0],) for (x,) in inputs]
        differ = sum(int((hf(x)[2].sort(dim=-1)[0] != ours(x)[2].sort(dim=-1)[0]).any(dim=-1).sum()) for (x,) in inputs)
        t_hf = graph_time_ms(lambda x: hf_c(x), inputs)
        t_ours = graph_time_ms(lambda x: ours_c(x), inputs)
        t_op = graph_time_ms(lambda lg: op(lg, bias, 8, 4, 8, True, 2.5), logits)
        print(f"| {t} | {t_hf:.4f} | {t_ours:.4f} | {t_hf / t_ours:.2f}x | {t_op:.4f} | {differ} of {8 * t} |", flush=True)


if __name__ == "__main__":
    main()
