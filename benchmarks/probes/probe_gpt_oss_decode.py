"""Where gpt-oss's decode time goes on the Triton kernels: gpt-oss-120b's and gpt-oss-20b's expert
layers (E=128 and 32, H=I=2880, top-4) at decode token counts, in CUDA graphs of 8 routings
(bench_gpt_oss.py's method), against the MXFP4 checkpoint's byte floor measured in the same process:

* ``held``: ``fp4moe::gpt_oss_moe`` on the kernel layout as fp4moe holds it (H and I as they are,
  the kernels' last K step partial; no per-call copies);
* ``padded``: the same op on the earlier layout (``gpt_oss_kernel_tensors(..., multiple=256)``: H
  and I zero-padded to 3072, the activations padded per call and the output cut back), for a
  before/after comparison on the same kernels;
* ``nvfp4`` (``--variants``): the op on NVFP4 gpt-oss weights of the same size (E4M3 scales,
  global scales), as held;
* ``silu`` (``--variants``): ``launch.triton_fused_moe`` on those NVFP4 tensors without gpt-oss's
  terms (NVFP4's own epilogue).

Columns: each variant's time, its layout's bytes per expert, and the time over the MXFP4 floor
(the checkpoint bytes of the experts hit, blocks + E8M0 scales + BF16 biases, over the copy
bandwidth measured here). At H = I = 2880, from the shapes: the checkpoint 13.24 MB an expert,
``held`` 13.31 MB (each E8M0 byte once, one per 32 values, in 96-byte rows; float32 biases; 14.14
MB while the E8M0 bytes were written once per 16 values), ``padded`` 15.08 MB, ``nvfp4`` 14.14 MB. Each variant is checked against the ``reference`` backend on the first
routing before it is timed (a wrong one is reported, not timed).

    python3 benchmarks/probes/probe_gpt_oss_decode.py                  # 120b and 20b, 1/8/64 tokens
    python3 benchmarks/probes/probe_gpt_oss_decode.py --variants held,padded,nvfp4,silu --shapes 120b
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench_gpt_oss import LAYERS, LIMIT, SWIGLU_ALPHA, bytes_per_expert, make_routings, random_gpt_oss_experts  # noqa: E402
from bench_moe import capture_graph, copy_bandwidth, error_vs_reference, replay_times_ms  # noqa: E402
from fp4moe_ops.backends.triton_moe import gpt_oss_kernel_tensors  # noqa: E402
from fp4moe_ops.backends.triton_moe.launch import triton_fused_moe  # noqa: E402

VARIANTS = ("held", "padded", "nvfp4", "silu")
MAX_ERROR = 1e-2  # relative to the reference backend (bench_gpt_oss.py's bound for fp4moe)


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


def variant_fns(wanted, mx_checkpoint, e, h, i, device):
    """``{name: (fn(x, ids, rw), kernel tensors, checkpoint tensors its reference runs)}``."""
    op = lambda tensors: (lambda x, ids, rw: torch.ops.fp4moe.gpt_oss_moe(x, ids, rw, tensors, SWIGLU_ALPHA, LIMIT,  # noqa: E731
                                                                           "triton"))
    out = {}
    if "held" in wanted:
        held = gpt_oss_kernel_tensors(mx_checkpoint)
        out["held"] = (op(held), held, mx_checkpoint)
    if "padded" in wanted:
        padded = gpt_oss_kernel_tensors(mx_checkpoint, multiple=256)
        out["padded"] = (op(padded), padded, mx_checkpoint)
    if "nvfp4" in wanted or "silu" in wanted:
        nv_checkpoint = nvfp4_gpt_oss(e, h, i, device)
        nv = gpt_oss_kernel_tensors(nv_checkpoint)
        if "nvfp4" in wanted:
            out["nvfp4"] = (op(nv), nv, nv_checkpoint)
        if "silu" in wanted:
            gate_up, gate_up_scale, gate_up_global, _, down, down_scale, down_global, _ = nv
            silu = [gate_up, gate_up_scale, gate_up_global, down, down_scale, down_global]
            out["silu"] = ((lambda x, ids, rw: triton_fused_moe(x, ids, rw, silu)), silu, None)
    return out


@torch.no_grad()
def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,8,64")
    ap.add_argument("--shapes", default="120b,20b", help="of 120b, 20b")
    ap.add_argument("--variants", default="held,padded", help=f"comma-separated, of {','.join(VARIANTS)}")
    args = ap.parse_args()
    wanted = args.variants.split(",")
    if not set(wanted) <= set(VARIANTS):
        ap.error(f"--variants: unknown {sorted(set(wanted) - set(VARIANTS))}")
    device = torch.device("cuda")
    torch.manual_seed(0)
    bw = copy_bandwidth(device)
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s, variants {wanted}", flush=True)
    print("| layer | tokens | experts hit | variant | layout MB/expert | ms | MXFP4 floor ms | / MXFP4 floor |")
    print("|---|---:|---:|---|---:|---:|---:|---:|", flush=True)
    start = time.time()
    for shape in args.shapes.split(","):
        e, h, i, k = LAYERS[f"gpt-oss-{shape}"]
        checkpoint = random_gpt_oss_experts(e, h, i, device)
        floor_bytes = bytes_per_expert(checkpoint, e)
        variants = variant_fns(wanted, checkpoint, e, h, i, device)
        for t in (int(v) for v in args.tokens.split(",")):
            sets = make_routings(t, h, e, k, device)
            hit = statistics.mean(len(torch.unique(ids)) for _, ids, _ in sets)
            floor = hit * floor_bytes / bw * 1e3
            for name, (fn, kernel, reference_tensors) in variants.items():
                mb = bytes_per_expert(kernel, e) / 1e6
                if reference_tensors is not None:
                    ref = torch.ops.fp4moe.gpt_oss_moe(*sets[0], reference_tensors, SWIGLU_ALPHA, LIMIT, "reference")
                    err = error_vs_reference(fn(*sets[0]).double(), ref.double())
                    if not err <= MAX_ERROR:
                        print(f"| {shape} | {t} | {hit:.1f} | {name} | {mb:.2f} | WRONG (rel err {err:.1e}) | "
                              f"{floor:.4f} | - |", flush=True)
                        continue
                ms = graph_ms(fn, sets)
                print(f"| {shape} | {t} | {hit:.1f} | {name} | {mb:.2f} | {ms:.4f} | {floor:.4f} | {ms / floor:.2f}x |",
                      flush=True)
        del checkpoint, variants
        torch.cuda.empty_cache()
    print(f"({time.time() - start:.0f} s; MXFP4 checkpoint {floor_bytes / 1e6:.2f} MB/expert)")


if __name__ == "__main__":
    main()
