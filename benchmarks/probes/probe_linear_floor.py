"""What one kernel launch costs an NVFP4 linear at few tokens: the fixed part of a call against
the weight's own stream, for ``bench_linear.SHAPES``.

    python benchmarks/probes/probe_linear_floor.py [--tokens 1,16,64] [--shapes q_a_proj,o_proj]

Per shape and token count, each a median of CUDA-graph replays over the same rotating weight
copies as ``bench_linear.py`` (>= 150 MB of NVFP4 bytes, so weights come from HBM):
- ``empty``: a Triton kernel that does nothing, on the grid the op's chosen ``decode_v3`` config
  launches (tiles x K parts): the launch and drain of that many programs in a graph.
- ``fp4 stream`` / ``bf16 stream``: the fastest of a few grids of a Triton kernel that only reads
  the NVFP4 weight + scale bytes (N K 0.5625), or the BF16 weight's (2 N K), XOR-folds them and
  stores one word per program: what reading those bytes in one kernel costs at this size, without
  decode, MMA, activations or a split-K sum.
- ``fp4moe``: ``fp4moe::nvfp4_linear`` on the paired weight with its counter table (as
  ``NVFP4Linear`` calls it); ``BF16``: ``F.linear`` on the dequantized weight.
The last two columns: BF16 over fp4moe, and BF16 over the fp4 stream: an estimate of the most a
one-kernel FP4 linear could reach against BF16 at this size (the stream is one simple kernel's
best of five grids, not a proven floor).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
import fp4moe_ops  # noqa: E402
from bench_linear import SHAPES, weight_copies  # noqa: E402
from bench_moe import copy_bandwidth, graph_time_ms  # noqa: E402
from fp4moe_ops.backends.triton_moe.launch import linear_config  # noqa: E402
from fp4moe_ops.linear import split_counters  # noqa: E402


@triton.jit
def _empty_kernel(out_ptr):
    pass


@triton.jit
def _stream_kernel(src_ptr, out_ptr, n_words, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Program p XOR-folds words [p CHUNK, (p+1) CHUNK) of ``src`` and stores one word."""
    p = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(0, CHUNK, BLOCK):
        idx = p * CHUNK + i + offs
        acc ^= tl.load(src_ptr + idx, mask=idx < n_words, other=0)
    tl.store(out_ptr + p, tl.xor_sum(acc, axis=0))


def stream_ms(buffers: list[torch.Tensor]) -> tuple[float, int]:
    """The fastest of a few grids reading each buffer (int32, flat) once: (ms per buffer, programs)."""
    n = buffers[0].numel()
    out = torch.empty(4096, dtype=torch.int32, device=buffers[0].device)
    best = (float("inf"), 0)
    for programs in (132, 264, 528, 1056, 2112):
        chunk = triton.next_power_of_2(max(1024, -(-n // programs)))
        grid = (triton.cdiv(n, chunk),)
        if grid[0] > out.numel():
            continue
        ms = graph_time_ms(lambda b: _stream_kernel[grid](b, out, n, CHUNK=chunk, BLOCK=1024, num_warps=4),
                           [(b,) for b in buffers])
        best = min(best, (ms, grid[0]))
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,16,64")
    ap.add_argument("--shapes", default="", help="comma-separated names from bench_linear.SHAPES (default: all)")
    args = ap.parse_args()
    table = split_counters("cuda")
    bw = copy_bandwidth("cuda")
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}, "
          f"copy bandwidth {bw / 1e12:.2f} TB/s")
    print("| layer | NVFP4 MB | tokens | chosen | programs | empty ms | fp4 stream ms (programs) | bf16 stream ms "
          "| fp4moe ms | BF16 ms | BF16 / fp4moe | BF16 / fp4 stream |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    wanted = set(args.shapes.split(",")) if args.shapes else None
    empty_out = torch.empty(1, device="cuda")
    for name, n, k in SHAPES:
        if wanted and name not in wanted:
            continue
        copies = weight_copies(n, k, "cuda")
        # the NVFP4 bytes (paired words, then block scales) and the BF16 weight, as flat int32 buffers
        fp4 = [torch.cat([c[4].view(torch.int32).reshape(-1), c[1].view(torch.uint8).reshape(-1).view(torch.int32)])
               for c in copies]
        bf16 = [c[3].view(torch.int32).reshape(-1) for c in copies]
        fp4_ms, fp4_programs = stream_ms(fp4)
        bf16_ms, _ = stream_ms(bf16)
        for t in (int(v) for v in args.tokens.split(",")):
            xs = [torch.randn(t, k, device="cuda", dtype=torch.bfloat16) for _ in copies]
            cfg = linear_config(t, n, k, paired=True, v3=True)
            if cfg["path"] == "v3":
                grid = (n // 64, -(-t // cfg["BM"]), cfg["PARTS"])
                chosen = f"v3 BM{cfg['BM']} P{cfg['PARTS']}"
            else:
                grid = (n // cfg.get("BN", 64), -(-t // cfg.get("BM", 64)), cfg.get("PARTS", 1))
                chosen = f"{cfg['path']} BM{cfg.get('BM', '')} P{cfg.get('PARTS', '')}"
            programs = grid[0] * grid[1] * grid[2]
            empty = graph_time_ms(lambda x: _empty_kernel[grid](empty_out), [(x,) for x in xs])
            ours = graph_time_ms(lambda x, c: fp4moe_ops.nvfp4_linear(x, c[4], c[1], c[2], counters=table),
                                 list(zip(xs, copies)))
            base = graph_time_ms(lambda x, c: F.linear(x, c[3]), list(zip(xs, copies)))
            print(f"| {name} | {n * k * 0.5625 / 1e6:.1f} | {t} | {chosen} | {programs} | {empty:.4f} | "
                  f"{fp4_ms:.4f} ({fp4_programs}) | {bf16_ms:.4f} | {ours:.4f} | {base:.4f} | {base / ours:.2f}x | "
                  f"{base / fp4_ms:.2f}x |", flush=True)
        del copies, fp4, bf16
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
