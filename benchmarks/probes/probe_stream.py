"""How fast the decode bucket's weight stream can go at all: the layer
(routing, both GEMMs, top-k sum) against kernels that only stream the same bytes, in the same
programs, the same way.

    python benchmarks/probes/probe_stream.py [--tokens 1,8,64,256,512] [--stages 3,4] [--parts]

DeepSeek-V3's layer (E=256, H=7168, I=2048, top-8; paired weights with random bytes and valid
block scales: the timing does not depend on the values). The stream kernels take the decode
bucket's grid (a program per row block of 16 tokens and weight tile of 64 rows: the gate_up GEMM 2I/64 tiles,
the down GEMM H/64) and load each program's weight tile (32 pair rows x 256 bytes) and scale tile (64 rows x
16 bytes) through TMA, pipelined over ``--stages``, for every K step of 256, as the GEMM kernels
do; then they fold the words with XOR (a few instructions per step, so nothing is left but the
loads) and store one word per program. No decode, no MMA, no activations. They use fewer registers
and less shared memory than the GEMMs, so more programs share an SM: an upper bound for this
grid and pipeline, not the same occupancy. Between them, the layer without the decode (config
key ``DIAG`` 1, wrong results: the decode's registers set to a constant, the weight tiles still
copied and waited for; routing, activations, MMA and epilogues as they are). Each row: median of
CUDA-graph replays over 8 routings (``bench_moe.graph_time_ms``), the routing kernel included in all; TB/s over the bytes of the
distinct experts hit (24.8 MB each), and the ratio to the copy-bandwidth floor.

``--parts`` (instead of the stream rows): what each of the layer's four launches (routing, the gate_up GEMM,
the down GEMM, top-k sum) adds, by timing graphs that leave some out. Routing then runs outside the graph
(its outputs computed once per routing before capture), and a left-out kernel is not launched at
all; also the layer with programmatic dependent launch (config key ``PDL``), and with the routing
launch at one token too (config key ``SLOT_BLOCKS`` off; it is on by default, and only one-token
calls differ). What a fusion of the routing or the top-k sum into the GEMMs could save at most is
the difference between rows.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
from bench_moe import copy_bandwidth, graph_time_ms, make_inputs  # noqa: E402
from fp4moe_ops.backends.triton_moe import launch  # noqa: E402

E, H, I, K = 256, 7168, 2048, 8
BN, BK = 64, 256  # the decode bucket's tiles (launch.kernel_config)


@triton.jit
def _stream_kernel(w_desc, s_desc, block_expert_ptr, out_ptr, W_ROWS_PER_EXPERT: tl.constexpr,
                   S_ROWS_PER_EXPERT: tl.constexpr, STEPS: tl.constexpr, STAGES: tl.constexpr):
    """Program (row block b, weight tile n): every K step's weight box ``[32 pair rows, 64 words]``
    and scale box ``[64 rows, 4 words]`` of tile n of block b's expert, XOR-folded."""
    b = tl.program_id(0)
    n = tl.program_id(1)
    e = tl.load(block_expert_ptr + b)
    if e >= 0:
        w_row = e * W_ROWS_PER_EXPERT + n * 32
        s_row = e * S_ROWS_PER_EXPERT + n * 64
        acc = tl.zeros((32, 64), tl.int32)
        acc_s = tl.zeros((64, 4), tl.int32)
        for k in tl.range(STEPS, num_stages=STAGES):  # (static trip count; pipelined like the GEMMs' loads)
            acc ^= w_desc.load([w_row, k * 64])
            acc_s ^= s_desc.load([s_row, k * 4])
        tl.store(out_ptr + b * tl.num_programs(1) + n, tl.xor_sum(tl.xor_sum(acc, axis=1), axis=0)
                 ^ tl.xor_sum(tl.xor_sum(acc_s, axis=1), axis=0))


def stream(ids, gate_up, gate_up_scale, down, down_scale, stages):
    """Routing (as the layer's decode bucket does), then the two stream launches."""
    block_expert = launch.route(ids, E, 16)[1]
    out = torch.empty(block_expert.numel() * (H // BN), dtype=torch.int32, device=ids.device)
    for w, s, w_rows, s_rows, steps, tiles in ((gate_up, gate_up_scale, I, 2 * I, H // BK, 2 * I // BN),
                                               (down, down_scale, H // 2, H, I // BK, H // BN)):
        w_desc = TensorDescriptor.from_tensor(w.view(-1, w.shape[-1]), [32, 64])
        s_desc = TensorDescriptor.from_tensor(s.view(torch.int32).view(-1, s.shape[-1] // 4), [64, 4])
        _stream_kernel[(block_expert.numel(), tiles)](w_desc, s_desc, block_expert, out, W_ROWS_PER_EXPERT=w_rows,
                                                      S_ROWS_PER_EXPERT=s_rows, STEPS=steps, STAGES=stages,
                                                      num_warps=4, num_stages=stages)
    return out


def parts(t, inputs, tensors, row):
    """The ``--parts`` rows (see the module docstring) for one token count."""
    from fp4moe_ops.backends.triton_moe import kernels

    real_route, real_launch = launch.route, launch.launch_or_compile
    routed = {}

    def cached_route(topk_ids, *args, **kwargs):  # computed eagerly before capture, then replayed without it
        key = (topk_ids.data_ptr(), args, tuple(sorted(kwargs.items())))
        if key not in routed:
            routed[key] = real_route(topk_ids, *args, **kwargs)
        return routed[key]

    def without(*left_out):
        def launch_or_skip(kernel, grid, *args, **kwargs):
            if not any(kernel is k for k in left_out):
                real_launch(kernel, grid, *args, **kwargs)
        return launch_or_skip

    layer = lambda x, ids, rw: launch.triton_fused_moe(x, ids, rw, tensors)
    pdl = launch.kernel_config(t * K, E, H, I) | {"PDL": True}
    with_routing = launch.kernel_config(t * K, E, H, I) | {"SLOT_BLOCKS": False}
    routed_layer = lambda x, ids, rw: launch.triton_fused_moe(x, ids, rw, tensors, config=with_routing)
    for _ in range(2):  # A B A B: the drift between runs shows
        row("layer", graph_time_ms(layer, inputs))
        row("layer, routing launch", graph_time_ms(routed_layer, inputs))
    row("layer, PDL", graph_time_ms(lambda x, ids, rw: launch.triton_fused_moe(x, ids, rw, tensors, config=pdl),
                                    inputs))
    row("routing alone", graph_time_ms(lambda x, ids, rw: real_route(ids, E, 16, x, BK), inputs))
    sum_out = [torch.randn(t * K, H, device=x.device) for x, _, _ in inputs]
    row("top-k sum alone", graph_time_ms(lambda x, ids, rw, y: launch._sum_topk(y, ids, x, E),
                                         [(*a, y) for a, y in zip(inputs, sum_out)]))
    launch.route = cached_route
    try:
        for name, left_out in (("no routing", ()), ("gate_up + down GEMMs", (kernels._sum_topk_kernel,)),
                               ("the gate_up GEMM alone", (kernels._sum_topk_kernel, kernels._down_kernel)),
                               ("the down GEMM alone", (kernels._sum_topk_kernel, kernels._gate_up_swiglu_kernel))):
            launch.launch_or_compile = without(*left_out)
            row(name, graph_time_ms(routed_layer, inputs))  # (the routing launch's kernels, routing outside)
    finally:
        launch.route, launch.launch_or_compile = real_route, real_launch


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,8,64,256,512")
    ap.add_argument("--stages", default="2,3,4")
    ap.add_argument("--parts", action="store_true", help="the launches' parts instead of the stream rows")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    # paired weights as the backend holds them (int32 words, scale bytes), random; scales 0x30-0x3f (E4M3 0.5-0.94)
    gate_up = torch.randint(-2**31, 2**31 - 1, (E, I, H // 4), dtype=torch.int32, device=dev)
    down = torch.randint(-2**31, 2**31 - 1, (E, H // 2, I // 4), dtype=torch.int32, device=dev)
    gate_up_scale = torch.randint(0x30, 0x40, (E, 2 * I, H // 16), dtype=torch.uint8, device=dev)
    down_scale = torch.randint(0x30, 0x40, (E, H, I // 16), dtype=torch.uint8, device=dev)
    g = torch.full((E,), 1e-3, device=dev)
    tensors = (gate_up, gate_up_scale, g, down, down_scale, g)
    bw = copy_bandwidth(dev)
    per_expert = 3 * H * I * (0.5 + 1 / 16)
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s; {per_expert / 1e6:.1f} MB per expert")
    for t in (int(v) for v in args.tokens.split(",")):
        inputs = make_inputs(t, H, K, E, dev, n=8)
        hit = sum(ids.unique().numel() for _, ids, _ in inputs) / len(inputs)
        nbytes = hit * per_expert
        floor = nbytes / bw * 1e3

        def row(name, ms):
            print(f"  T={t:4d} {name:18s} {ms:8.4f} ms  {nbytes / ms / 1e9:6.2f} TB/s  {ms / floor:5.2f}x floor", flush=True)

        print(f"T={t}: {hit:.0f} experts, floor {floor:.4f} ms", flush=True)
        if args.parts:
            parts(t, inputs, tensors, row)
            del inputs
            continue
        row("layer", graph_time_ms(lambda x, ids, rw: launch.triton_fused_moe(x, ids, rw, tensors), inputs))
        no_decode = launch.kernel_config(t * K, E, H, I) | {"DIAG": 1}
        row("layer, no decode", graph_time_ms(lambda x, ids, rw: launch.triton_fused_moe(x, ids, rw, tensors,
                                                                                          config=no_decode), inputs))
        for st in (int(v) for v in args.stages.split(",")):
            row(f"stream, {st} stages",
                graph_time_ms(lambda x, ids, rw: stream(ids, gate_up, gate_up_scale, down, down_scale, st), inputs))
        del inputs


if __name__ == "__main__":
    main()
