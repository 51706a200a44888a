"""Where gpt-oss's decode time goes on the Triton kernels: one gpt-oss-120b layer (E=128, H=I=2880,
top-4) at a few token counts, in CUDA graphs of 8 routings (bench_gpt_oss.py's method), as

* ``op MXFP4``: ``fp4moe::gpt_oss_moe`` on MXFP4 kernel tensors (what the model runs: x padded to
  3072, the output cut back to 2880);
* ``kernels MXFP4``: ``launch.triton_fused_moe`` on x already padded (no padding, no cut);
* ``op NVFP4``: the op on NVFP4 gpt-oss weights of the same size (E4M3 scales, global scales);
* ``kernels SiLU``: the kernels on the same NVFP4 tensors without gpt-oss's terms (NVFP4's own epilogue);

with each variant's byte floor (the padded layout's bytes of the experts hit over the copy
bandwidth measured here) and the MXFP4 checkpoint's floor.

    python3 benchmarks/probes/probe_gpt_oss_decode.py [--tokens 1,8,64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench_gpt_oss import SWIGLU_ALPHA, LIMIT, make_routings, random_gpt_oss_experts  # noqa: E402
from bench_moe import capture_graph, copy_bandwidth, replay_times_ms  # noqa: E402
from fp4moe_ops.backends.triton_moe import gpt_oss_kernel_tensors  # noqa: E402
from fp4moe_ops.backends.triton_moe.launch import triton_fused_moe  # noqa: E402
from fp4moe_ops.backends.triton_moe.layout import GptOssTerms  # noqa: E402


def graph_ms(fn, inputs) -> float:
    graph = capture_graph(fn, inputs)
    times = replay_times_ms(graph, len(inputs))
    del graph
    return statistics.median(times)


def nvfp4_gpt_oss(e, h, i, device):
    """Random NVFP4 gpt-oss tensors (fp4moe::gpt_oss_moe's eight), values of about unit row norm."""
    def matrix(n, k):
        block = (torch.rand(e, n, k // 16, device=device) * 3.5 + 0.5).to(torch.float8_e4m3fn).view(torch.uint8)
        return (torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device=device), block,
                torch.full((e,), 0.3 / k**0.5, device=device))

    bias = lambda n: (torch.randn(e, n, device=device) * 0.1).to(torch.bfloat16)  # noqa: E731
    gate_up, gate_up_scale, gate_up_global_scale = matrix(2 * i, h)
    down, down_scale, down_global_scale = matrix(h, i)
    return [gate_up, gate_up_scale, gate_up_global_scale, bias(2 * i), down, down_scale, down_global_scale, bias(h)]


@torch.no_grad()
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,8,64")
    args = ap.parse_args()
    device = torch.device("cuda")
    e, h, i, k = 128, 2880, 2880, 4
    bw = copy_bandwidth(device)
    mx = gpt_oss_kernel_tensors(random_gpt_oss_experts(e, h, i, device))
    nv = gpt_oss_kernel_tensors(nvfp4_gpt_oss(e, h, i, device))
    per_expert = {"mx": sum(t.nbytes for t in mx) / e, "nv": sum(t.nbytes for t in nv) / e}
    checkpoint = 13.24e6  # MXFP4 bytes an expert at these dims (bench_gpt_oss.py)
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s; kernel layout MB/expert: "
          f"MXFP4 {per_expert['mx'] / 1e6:.2f}, NVFP4 {per_expert['nv'] / 1e6:.2f}")
    gate_up, gate_up_scale, gate_up_bias, down, down_scale, down_bias = mx
    terms = GptOssTerms(gate_up_bias, down_bias, SWIGLU_ALPHA, LIMIT)
    nv_gate_up, nv_gate_up_scale, nv_gate_up_global, _, nv_down, nv_down_scale, nv_down_global, _ = nv
    variants = {
        "op MXFP4": lambda x, ids, rw: torch.ops.fp4moe.gpt_oss_moe(x, ids, rw, mx, SWIGLU_ALPHA, LIMIT, "triton"),
        # (the E8M0 scales need no global scales: the bias stands in for them)
        "kernels MXFP4": lambda x, ids, rw: triton_fused_moe(
            x, ids, rw, [gate_up, gate_up_scale, gate_up_bias, down, down_scale, gate_up_bias], gpt_oss=terms),
        "op NVFP4": lambda x, ids, rw: torch.ops.fp4moe.gpt_oss_moe(x, ids, rw, nv, SWIGLU_ALPHA, LIMIT, "triton"),
        "kernels SiLU": lambda x, ids, rw: triton_fused_moe(
            x, ids, rw, [nv_gate_up, nv_gate_up_scale, nv_gate_up_global, nv_down, nv_down_scale, nv_down_global]),
    }
    print("| tokens | experts hit | variant | ms | padded floor ms | / padded floor | / MXFP4 checkpoint floor |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    for t in (int(v) for v in args.tokens.split(",")):
        sets = make_routings(t, h, e, k, device)
        padded = [(torch.nn.functional.pad(x, (0, 3072 - h)), ids, rw) for x, ids, rw in sets]
        hit = statistics.mean(len(torch.unique(ids)) for _, ids, _ in sets)
        for name, fn in variants.items():
            inputs = padded if name.startswith("kernels") else sets
            ms = graph_ms(fn, inputs)
            floor = hit * per_expert["nv" if "NVFP4" in name or "SiLU" in name else "mx"] / bw * 1e3
            print(f"| {t} | {hit:.1f} | {name} | {ms:.4f} | {floor:.4f} | {ms / floor:.2f}x | "
                  f"{ms / (hit * checkpoint / bw * 1e3):.2f}x |", flush=True)


if __name__ == "__main__":
    main()
