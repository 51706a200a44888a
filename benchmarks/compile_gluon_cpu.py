"""Compile the Gluon prefill kernels (``prefill_rs.py``) for sm90 on a machine without a GPU, as their
first call does: one after another, or together (``prefill_rs._compile_together``), timed.

    pip install --no-deps --target /tmp/t36 triton==3.6.0   # the release the kernels are written for
    PYTHONPATH=/tmp/t36 TRITON_CACHE_DIR=$(mktemp -d) python benchmarks/compile_gluon_cpu.py together [--shape deepseek]

A stand-in driver answers Triton's JIT as an sm90 device would; nothing launches. The kernels
of the default path (both GEMMs at 128-row blocks and at each tail level of
``launch.GLUON_PREFILL_TAILS``) go through Triton's own warm-up (``JITFunction.warmup``), so the
JIT cache holds them after; the script checks that, and that a second warm-up compiles nothing.
Use an empty TRITON_CACHE_DIR per run, or the disk cache answers.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.driver import CudaDriver
from triton.runtime import driver

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


class _Caught(Exception):
    """Stops prefill_gemms once its launches are known."""


class _Sm90WithoutGpu(CudaDriver):
    """What the JIT asks of a driver before it launches: the target, a device and a stream."""

    def __init__(self):  # (no CUDA library to load)
        self.utils = None

    def is_active(self):
        return True

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def layer_arguments(e: int, h: int, i: int, slots: int):
    """``prefill_gemms``' arguments for a layer of ``e`` experts (contents irrelevant: nothing runs)."""
    blocks = e + slots // 128
    row_start = torch.arange(blocks, dtype=torch.int32) * 10
    return (torch.zeros(slots, h, dtype=torch.bfloat16), torch.zeros(e, i, h // 4, dtype=torch.int32),
            torch.zeros(e, 2 * i, h // 16, dtype=torch.uint8), torch.ones(e),
            torch.zeros(e, h // 2, i // 4, dtype=torch.int32),
            torch.zeros(e, h, i // 16, dtype=torch.uint8), torch.ones(e), torch.ones(slots),
            torch.arange(slots, dtype=torch.int32), torch.arange(blocks, dtype=torch.int32) % e, row_start,
            row_start + torch.arange(blocks, dtype=torch.int32) % 100 + 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["serial", "together"])
    ap.add_argument("--shape", choices=["small", "deepseek"], default="small")
    args = ap.parse_args()
    driver.set_active(_Sm90WithoutGpu())
    from fp4moe_ops.backends.triton_moe import launch, prefill_rs

    # the launches prefill_gemms would make, caught before the first
    caught = {}

    def catch(calls, common, key):
        caught.update(calls=calls, common=common)
        raise _Caught

    real, prefill_rs._compile_together = prefill_rs._compile_together, catch
    h, i = (7168, 2048) if args.shape == "deepseek" else (512, 256)
    try:
        prefill_rs.prefill_gemms(*layer_arguments(8, h, i, 600), tails=launch.GLUON_PREFILL_TAILS)
    except _Caught:
        pass
    prefill_rs._compile_together = real
    calls, common = caught["calls"], caught["common"]

    t0 = time.time()
    if args.mode == "together":
        prefill_rs._compile_together(calls, common, ("compile_gluon_cpu",))
    else:
        for grid, arguments, consts in calls:
            prefill_rs._prefill_gemm_kernel.warmup(*arguments, grid=grid, **consts, **common)
    seconds = time.time() - t0
    cache = prefill_rs._prefill_gemm_kernel.device_caches[0][0]
    t0 = time.time()
    for grid, arguments, consts in calls:
        prefill_rs._prefill_gemm_kernel.warmup(*arguments, grid=grid, **consts, **common)
    again = time.time() - t0
    ok = len(cache) == len(calls) and again < 0.5
    print(f"{args.mode}, {args.shape} (H={h}, I={i}): {len(calls)} kernels (row blocks "
          f"{[c[2]['BLOCK_M'] for c in calls]}) in {seconds:.1f} s; in the JIT cache after: {len(cache)}; "
          f"a second warm-up {again:.2f} s {'ok' if ok else 'WRONG'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
