"""Compile one MoE layer's Triton kernels for sm90 on a machine without a GPU (CI's check that every
kernel variant compiles on a Triton release: tests/test_triton_releases.py), as
``launch.compile_layer_once`` does at a layer's first call: all variant sets
(``launch.variant_slots``) one by one, or together in threads (``compile_ahead.compile_all``), timed.

    pip install --no-deps --target /tmp/t36 triton==3.6.0   # any release of GLUON_TRITON (3.6-3.9)
    PYTHONPATH=/tmp/t36 TRITON_CACHE_DIR=$(mktemp -d) python tools/compile_ahead_cpu.py together [--shape deepseek]
        [--check-tokens 1,9,300] [--linear]

A stand-in driver answers Triton's JIT as an sm90 device would; nothing launches. The tensors are
CPU tensors, so two things differ from the GPU: routing takes the torch path (the routing kernel
is not compiled), and the script lets the Gluon prefill kernels past their CUDA check. The script
then checks that a second pass finds every kernel in the JIT cache (compiles nothing), and
(``--check-tokens``) that the launch sequences of calls of those token counts, at their full
size, find theirs there too: what the one-token plans compiled is what the calls use. Together,
it checks that the pool asked the driver for each kernel's launcher (the stand-in builds none).
``--linear``: the NVFP4 linear kernels (``launch.compile_linear_once``) of the shape's linear
layers instead, with and without bias, weights as stored and paired: compiled, then every call of 1-130
tokens checked against the
cache (the launcher requests are not checked there). Use
an empty TRITON_CACHE_DIR per run, or the disk cache answers.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # bench_linear
from bench_linear import SHAPES  # noqa: E402


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

    launchers = []  # the kernels compile_all built a launcher for (no C module: no CUDA library to link)

    def launcher_cls(self, src, metadata):
        self.launchers.append(src.fn.__name__)


def _short(error) -> str:
    """A compile error's last line (Triton's CompilationError repeats the kernel's source)."""
    while error.__cause__ is not None:  # (a failure inside a called function: its own error)
        error = error.__cause__
    lines = [line for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[-1] if lines else ''}"


def layer_arguments(e: int, h: int, i: int, top_k: int, device: str = "cpu"):
    """A one-token call's arguments for a layer of ``e`` experts in the paired layout (the weights
    uninitialized: nothing here reads them)."""
    import fp4moe_ops
    from fp4moe_ops.backends import BACKENDS
    from fp4moe_ops.backends.base import CANONICAL, canonical_layout, convert_packed

    small = canonical_layout(fp4moe_ops.quantize_moe_weights(torch.randn(1, 512, 256), torch.randn(1, 256, 256)).tensors())
    small[0], small[3] = (convert_packed(small[j], CANONICAL, BACKENDS["triton"].packed_layout(256, 256)) for j in (0, 3))
    shapes = [(e, i, h // 4), (e, 2 * i, h // 16), (e,), (e, h // 2, i // 4), (e, h, i // 16), (e,)]
    tensors = [torch.empty(shape, dtype=t.dtype, device=device) for shape, t in zip(shapes, small)]
    ids = torch.arange(top_k, device=device).reshape(1, top_k)
    return torch.randn(1, h, dtype=torch.bfloat16, device=device), ids, torch.rand(1, top_k, device=device), tensors


def gpt_oss_arguments(e: int, hp: int, ip: int, nvfp4: bool = False):
    """``(expert tensors, gpt_oss)`` of ``launch.triton_fused_moe`` for gpt-oss's experts in the kernels'
    layout (``layout.gpt_oss_kernel_tensors``; uninitialized): MXFP4's E8M0 scales (int8, one per 32
    values, no global scale), or with ``nvfp4`` E4M3 scales (uint8, one per 16) and global scales."""
    from fp4moe_ops.backends.triton_moe.layout import GptOssTerms, scale_columns

    scale, per = (torch.uint8, 16) if nvfp4 else (torch.int8, 32)
    shapes = [((e, ip, hp // 4), torch.int32), ((e, 2 * ip, scale_columns(hp, per)), scale),
              ((e, 2 * ip), torch.float32), ((e, hp // 2, ip // 4), torch.int32),
              ((e, hp, scale_columns(ip, per)), scale), ((e, hp), torch.float32)]
    gate_up, gate_up_scale, gate_up_bias, down, down_scale, down_bias = (torch.empty(shape, dtype=dtype)
                                                                         for shape, dtype in shapes)
    global_scales = (torch.empty(e) for _ in range(2)) if nvfp4 else (gate_up_bias, gate_up_bias)  # (E8M0: unused)
    gate_up_global_scale, down_global_scale = global_scales
    return ([gate_up, gate_up_scale, gate_up_global_scale, down, down_scale, down_global_scale],
            GptOssTerms(gate_up_bias, down_bias, 1.702, 7.0))


def cached_variants() -> int:
    from fp4moe_ops.backends.triton_moe import decode_v3, kernels, prefill_rs

    fns = (kernels._gate_up_swiglu_kernel, kernels._down_kernel, kernels._sum_topk_kernel,
           prefill_rs._prefill_gemm_kernel, decode_v3._gate_up_v3_kernel, decode_v3._down_v3_kernel,
           kernels._linear_kernel, kernels._linear_parts_kernel, kernels._dequant_kernel, decode_v3._linear_v3_kernel)
    return sum(len(c[0]) for fn in fns for c in fn.device_caches.values())


# DeepSeek-V3's NVFP4 attention linears [N, K] (bench_linear.py's first five shapes), and small ones
LINEAR_SHAPES = {"deepseek": [(n, k) for _, n, k in SHAPES[:5]], "small": [(128, 256), (576, 512)]}


def linear_arguments(n: int, k: int, bias: bool, paired: bool = False):
    """A one-token call's arguments for an NVFP4 linear of weight ``[n, k/2]`` (uninitialized; paired:
    ``[n/2, k/4]`` int32) with a split-K counter table, as ``NVFP4Linear`` calls it."""
    from fp4moe_ops.linear import SPLIT_COUNTERS

    weight = torch.empty(n // 2, k // 4, dtype=torch.int32) if paired else torch.empty(n, k // 2, dtype=torch.uint8)
    return (torch.randn(1, k, dtype=torch.bfloat16), weight,
            torch.empty(n, k // 16, dtype=torch.float8_e4m3fn), torch.ones(()), torch.randn(n, dtype=torch.bfloat16) if bias else None,
            torch.zeros(SPLIT_COUNTERS, dtype=torch.int32))


def linear_main(args) -> bool:
    """The linear shapes' plans (``launch.linear_plans``) compiled as for the layer, then every token
    count of 1-130 at each shape checked against the cache."""
    from fp4moe_ops.backends.triton_moe import compile_ahead, launch

    shapes = [(n, k, bias, paired) for n, k in LINEAR_SHAPES[args.shape] for bias in (False, True)
              for paired in (False, True)]
    t0 = time.time()
    errors, per_shape = [], []
    for n, k, bias, paired in shapes:
        before = cached_variants()
        errors += compile_ahead.compile_all(launch.linear_plans(*linear_arguments(n, k, bias, paired)),
                                            together=args.mode == "together")
        per_shape.append(cached_variants() - before)
    seconds, compiled, ok = time.time() - t0, cached_variants(), not errors
    for n, k, bias, paired in shapes:
        x, *rest = linear_arguments(n, k, bias, paired)
        for t in range(1, 131):
            failed = compile_ahead.compile_all([(t, lambda: launch.triton_nvfp4_linear(x.expand(t, k), *rest[:4],
                                                                                      counters=rest[4]))],
                                               together=False)
            if failed or cached_variants() != compiled:
                print(f"a call of {t} tokens at [{n}, {k}] (bias {bias}, paired {paired}) compiled {cached_variants() - compiled} "
                      f"more kernels {failed}: WRONG")
                ok, compiled = False, cached_variants()
    print(f"{args.mode}, linears {args.shape}: {compiled} kernels in {seconds:.1f} s (new per shape, without / with "
          f"bias, canonical / paired weights: {per_shape}); calls of 1-130 tokens {'compiled nothing' if ok else 'WRONG'} {errors or ''}")
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["serial", "together"])
    ap.add_argument("--shape", choices=["small", "deepseek", "gpt-oss", "gpt-oss-nvfp4"], default="small",
                    help="gpt-oss: gpt-oss-20b's MXFP4 experts (E=32, H=I=2880, the kernels' partial K steps, "
                         "top-4); gpt-oss-nvfp4: the same in NVFP4")
    ap.add_argument("--check-tokens", default="", help="comma-separated token counts (see the module docstring)")
    ap.add_argument("--linear", action="store_true", help="the NVFP4 linear shapes instead of the MoE layer")
    args = ap.parse_args()
    stand_in = _Sm90WithoutGpu()
    driver.set_active(stand_in)
    from fp4moe_ops.backends.triton_moe import compile_ahead, launch

    launch._gluon_runs = lambda x: True  # (CPU tensors: see the module docstring)
    if args.linear:
        sys.exit(0 if linear_main(args) else 1)
    e, h, i, k = {"deepseek": (256, 7168, 2048, 8)}.get(args.shape, (32, 2880, 2880, 4) if
                                                        args.shape.startswith("gpt-oss") else (8, 512, 256, 2))
    gpt_oss = gpt_oss_arguments(e, h, i, args.shape == "gpt-oss-nvfp4") if args.shape.startswith("gpt-oss") else None
    x, ids, rw, tensors = layer_arguments(e, h, i, k)
    if gpt_oss is not None:  # the kernels' layout of gpt-oss's experts: their scales, biases
        tensors, gpt_oss = gpt_oss
    plans = launch.layer_plans(x, ids, rw, tensors, gpt_oss=gpt_oss)
    t0 = time.time()
    errors = compile_ahead.compile_all(plans, together=args.mode == "together")
    seconds = time.time() - t0
    compiled = cached_variants()
    launchers = len(stand_in.launchers)
    if args.mode == "together" and launchers != compiled:  # every compile in the pool builds its launcher
        print(f"{launchers} launchers for {compiled} kernels: WRONG")
        errors.append("launchers")
    t0 = time.time()
    errors += compile_ahead.compile_all(plans, together=False)
    again = time.time() - t0
    ok = cached_variants() == compiled and again < 1.0 and not errors
    if errors:
        print("plans failed:", *{_short(e) for e in errors}, sep="\n  ")
    for t in (int(n) for n in args.check_tokens.split(",") if n):
        xt, idst, rwt = x.expand(t, h).contiguous(), (torch.arange(t * k) % e).reshape(t, k), rw.expand(t, k).contiguous()
        failed = compile_ahead.compile_all([(t * k, lambda: launch.triton_fused_moe(xt, idst, rwt, tensors,
                                                                                     gpt_oss=gpt_oss))],
                                           together=False)
        if failed or cached_variants() != compiled:
            print(f"a call of {t} tokens compiled {cached_variants() - compiled} more kernels {failed}: WRONG")
            ok, compiled = False, cached_variants()
    print(f"{args.mode}, {args.shape} (E={e}, H={h}, I={i}, top-{k}): variant sets at slots "
          f"{[s for s, _ in plans]}, {compiled} kernels in {seconds:.1f} s; a second pass {again:.2f} s, "
          f"{'nothing compiled' if ok else 'WRONG'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
