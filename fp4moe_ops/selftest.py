"""``python -m fp4moe_ops.selftest``: every fp4moe backend this machine can run, checked against an
independent answer on a few shapes, token counts and activation-scale modes, one table row per case.

* CPU: the reference backend against the float64 oracle (:mod:`fp4moe_ops.oracle64`).
* A GPU: each GPU backend it runs (on Hopper ``triton``, ``flashinfer_bf16``, ``flashinfer_mxfp4``;
  on Blackwell ``triton``, ``flashinfer_bf16``, ``flashinfer_nvfp4``) against the reference backend on the same NVFP4 weights; for
  ``flashinfer_nvfp4`` the kernel-faithful reference (GEMM outputs rounded to BF16 where the CUTLASS
  kernel stores them). On a Blackwell GPU this is the first hardware check of the NVFP4 x NVFP4 path:
  run it first, and if a row says FAIL, send the whole output (and ``nvidia-smi``, ``pip list``).

Every case also routes some slots to ids outside ``[0, E)``, as expert parallelism does. Then
``fp4moe::nvfp4_linear`` (the NVFP4 linears outside the experts) as ``"auto"`` runs it, with the
weight in the layout an ``NVFP4Linear`` holds on this device (paired on Hopper), against the
float64 oracle. Exit code 1 on any FAIL. ``--quick`` runs the small shapes only.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from . import ACT_SCALE_MODES, activation_scales, available_backends, nvfp4, prepare_experts, quantize_moe_weights
from .backends.reference import reference_moe
from .moe_weights import NVFP4MoEWeights
from .oracle64 import linear64, moe64

# name -> (E, H, I, top-k); "odd" has an odd expert count and I % 128 == 64 (FlashInfer pads it)
SHAPES = {"deepseek-v3": (256, 7168, 2048, 8), "small": (8, 512, 256, 2), "odd": (7, 512, 192, 3)}
TOKENS = (1, 7, 128, 1000)
# relative Frobenius error allowed against the comparison, and why
TOLERANCE = {
    "reference": 4e-3,        # vs float64: fp32 accumulation, bf16 intermediate and output roundings
    "triton": 4e-3,           # vs reference: the same math, other summation order
    "flashinfer_bf16": 1e-2,  # vs reference: weights rounded once to bf16
    "flashinfer_mxfp4": 0.3,  # vs reference: NVFP4 re-quantized to MXFP4, ~12% per weight matrix, two GEMMs
}
# the linear vs float64: the weight exact and float32 sums, or (reference, and the Triton path past
# its kernels) the weight rounded to bf16 once (<= 2^-9 relative each), and the bf16 output rounding
LINEAR_TOLERANCE = 4e-3
LINEAR_TOKENS = (1, 16, 100, 300)
# flashinfer_nvfp4 vs the kernel-faithful reference: FP4 rounding of the activations is discontinuous,
# so most tokens agree to bf16 rounding and a few flip a code (tests/test_flashinfer_args.py)
NVFP4_MEDIAN, NVFP4_FLIP, NVFP4_FLIP_SHARE = 5e-3, 2e-2, 0.25


def make_layer(e: int, h: int, i: int, device) -> NVFP4MoEWeights:
    """Gaussian experts whose magnitudes span 100x, quantized 16 at a time (bounded fp32 scratch)."""
    spread = torch.logspace(-1, 1, e, device=device)
    parts = []
    for e0 in range(0, e, 16):
        n = min(16, e - e0)
        gate_up = torch.randn(n, 2 * i, h, device=device) / h**0.5 * spread[e0:e0 + n, None, None]
        parts.append(quantize_moe_weights(gate_up, torch.randn(n, h, i, device=device) / i**0.5))
    return NVFP4MoEWeights(*(torch.cat(ts) for ts in zip(*(p.tensors() for p in parts))))


def make_inputs(t: int, e: int, h: int, k: int, device):
    x = torch.randn(t, h, device=device, dtype=torch.bfloat16)
    ids = torch.rand(t, e, device=device).argsort(dim=1)[:, :k]
    ids[::8, -1] = e + torch.arange(ids[::8].shape[0], device=device) % 3  # another rank's experts
    ids[3::8, 0] = -1
    return x, ids, torch.rand(t, k, device=device)


def calibrate(w: NVFP4MoEWeights, x, ids, rw) -> NVFP4MoEWeights:
    """Input scales ``amax / (6*448)`` of what each expert sees on this batch (as ModelOpt calibrates)."""
    amax1 = torch.zeros(w.num_experts, device=x.device)
    amax2 = torch.zeros(w.num_experts, device=x.device)

    def observe(e, a1, a2):
        amax1[e] = torch.maximum(amax1[e], a1.float().abs().max())
        amax2[e] = torch.maximum(amax2[e], a2.float().abs().max())

    reference_moe(x, ids, rw, w.tensors(), observe=observe)
    seen = lambda a: nvfp4.global_scale_from_amax(torch.where(a > 0, a, a.max()))  # noqa: E731  experts no token reached
    return NVFP4MoEWeights(*w.tensors(), seen(amax1), seen(amax2))


def timed(fn, device) -> float:
    """Median ms of 5 calls after one warm-up (informational; benchmarks/ has the real method)."""
    fn()
    times = []
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[2]


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def run(shapes, tokens, device) -> list[dict]:
    rows = []
    backends = [b for b in available_backends(device) if device.type == "cpu" or b != "reference"]
    for shape in shapes:
        e, h, i, k = SHAPES[shape]
        torch.manual_seed(0)
        w = make_layer(e, h, i, device)
        inputs = {t: make_inputs(t, e, h, k, device) for t in tokens}
        answers = {}  # (T, None) -> the float64 / reference answer at T, shared by the backends
        for backend in backends:
            modes = {"reference": [None, *ACT_SCALE_MODES], "flashinfer_nvfp4": list(ACT_SCALE_MODES)}.get(backend, [None])
            w4a16 = None  # one preparation per backend (FlashInfer's are costly); act modes per batch
            for t in tokens:
                x, ids, rw = inputs[t]
                for mode in modes:
                    def case(row, mode=mode, x=x, ids=ids, rw=rw):
                        nonlocal w4a16
                        weights = calibrate(w, x, ids, rw) if mode else w
                        if mode is None:
                            w4a16 = w4a16 or prepare_experts(w, backend)
                        experts = w4a16 if mode is None else prepare_experts(weights, backend, mode)
                        _check(row, experts, weights, x, ids, rw, device, answers)

                    rows.append(_row(dict(backend=backend, shape=shape, tokens=t, mode=mode or "w4a16"), case))
            del w4a16
    return rows


def run_linears(device, tokens=LINEAR_TOKENS) -> list[dict]:
    """``fp4moe::nvfp4_linear`` on a ``[384, 3072]`` weight (bias included) against float64, the
    weight in the paired layout on Hopper as ``NVFP4Linear`` holds it there."""
    from .linear import nvfp4_linear, split_counters

    torch.manual_seed(1)
    q = nvfp4.quantize_nvfp4(torch.randn(384, 3072, device=device) * torch.logspace(-2, 0, 384, device=device)[:, None])
    g = q.global_scale.reshape(())
    paired = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
    weight = q.packed
    if paired:
        from .backends.triton_moe.layout import paired_weight_layout

        weight = paired_weight_layout(q.packed)
    bias = torch.randn(384, device=device, dtype=torch.bfloat16)
    counters = split_counters(device)
    rows = []
    for t in tokens:
        def case(row, t=t):
            x = torch.randn(t, 3072, device=device, dtype=torch.bfloat16)
            out = nvfp4_linear(x, weight, q.block_scale, g, bias, counters=counters)
            row["kernels"] = _linear_kernels(x, weight)
            row["ms"] = timed(lambda: nvfp4_linear(x, weight, q.block_scale, g, bias, counters=counters), device)
            want = linear64(x.cpu(), q.packed.cpu(), q.block_scale.cpu(), g.cpu(), bias.cpu())
            row["error"], row["tolerance"] = rel(out.cpu(), want), LINEAR_TOLERANCE
            row["pass"] = row["error"] < row["tolerance"] and bool(torch.isfinite(out).all())

        rows.append(_row(dict(backend="nvfp4_linear", shape="384x3072", tokens=t,
                              mode="paired" if paired else "as stored"), case))
    return rows


def _row(row: dict, case) -> dict:
    """``case(row)`` fills in the row's result; whatever it raises fails the row, named. Printed."""
    try:
        case(row)
    except Exception as exc:  # noqa: BLE001 - a row per case, whatever happens
        row.update(error=float("nan"), tolerance=float("nan"), why=f"{type(exc).__name__}: {exc}")
        row["pass"] = False
    print(_format(row), flush=True)
    return row


def _linear_kernels(x, weight) -> str:
    """The path ``"auto"`` takes for this call: ``reference``, or the Triton config's path."""
    from .linear import _triton_refusal

    if _triton_refusal(x, weight):
        return "reference"
    from .backends.triton_moe.launch import _gluon_runs, linear_config, linear_shape

    n, k = linear_shape(weight)
    paired = weight.dtype == torch.int32
    return "triton-" + linear_config(x.shape[0], n, k, paired, paired and _gluon_runs(x))["path"]


def _check(row, experts, w, x, ids, rw, device, answers) -> None:
    backend, mode, t = row["backend"], None if row["mode"] == "w4a16" else row["mode"], row["tokens"]
    out = experts(x, ids, rw)
    row["kernels"] = _kernels(experts, x, ids)
    row["ms"] = timed(lambda: experts(x, ids, rw), device)
    gate_up_in, down_in = activation_scales(w.gate_up_input_scale, w.down_input_scale, mode) if mode else (None, None)
    if backend == "reference":  # against float64, on a few tokens (the oracle loops in Python)
        sub = slice(0, min(t, 64))
        quant = (lambda v, s: nvfp4.quantize_activation_nvfp4(v, 1.0 / s) * s) if mode else None
        want = moe64(x[sub].cpu(), ids[sub].cpu(), rw[sub].cpu(), *(p.cpu() for p in w.tensors()),
                     gate_up_input_scale=None if gate_up_in is None else gate_up_in.cpu(),
                     down_input_scale=None if down_in is None else down_in.cpu(), quant=quant)
        row["error"], row["tolerance"] = rel(out[sub].cpu(), want), TOLERANCE["reference"]
        row["pass"] = row["error"] < row["tolerance"]
    elif backend == "flashinfer_nvfp4":
        want = reference_moe(x, ids, rw, w.tensors(), gate_up_in, down_in, cutlass_rounding=True)
        per_token = (out.double() - want.double()).norm(dim=1) / want.double().norm(dim=1).clamp_min(1e-30)
        row["error"], row["tolerance"] = per_token.median().item(), NVFP4_MEDIAN
        row["pass"] = row["error"] < NVFP4_MEDIAN and (per_token > NVFP4_FLIP).float().mean().item() < NVFP4_FLIP_SHARE
    else:
        if (t, None) not in answers:
            answers[(t, None)] = reference_moe(x, ids, rw, w.tensors())
        row["error"], row["tolerance"] = rel(out, answers[(t, None)]), TOLERANCE[backend]
        row["pass"] = row["error"] < row["tolerance"]
    row["pass"] = row["pass"] and bool(torch.isfinite(out).all())


def _kernels(experts, x, ids) -> str:
    """The kernel family that ran the case: for ``triton`` on a GPU the one its launcher picks for
    this many slots (:func:`~fp4moe_ops.backends.triton_moe.launch.kernel_family`), else the backend."""
    if experts.backend != "triton" or not x.is_cuda:
        return experts.backend
    from .backends.triton_moe.launch import kernel_family

    gate_up = experts.op_tensors()[0]
    return kernel_family(x, ids.numel(), experts.num_experts, experts.hidden_size, experts.intermediate_size,
                         experts.routed_experts, paired=gate_up.dtype == torch.int32)


def _format(row: dict) -> str:
    status = "PASS" if row["pass"] else "FAIL"
    ms = f"{row['ms']:9.3f}" if "ms" in row else "        -"
    why = f"  {row['why'][:300]}" if "why" in row else ""
    return (f"{row['backend']:17s} {row.get('kernels', '-'):17s} {row['shape']:12s} T={row['tokens']:5d} {row['mode']:10s} "
            f"err {row['error']:.2e}  tol {row['tolerance']:.1e}  {ms} ms  {status}{why}")


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "not installed"
    return triton.__version__


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small shapes only")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    shapes = ["small", "odd"] + (["deepseek-v3"] if gpu and not args.quick else [])
    tokens = TOKENS if gpu else (1, 7, 128)
    name = torch.cuda.get_device_name(device) if gpu else "cpu"
    cap = torch.cuda.get_device_capability(device) if gpu else None
    print(f"fp4moe self-test on {name} (capability {cap}), torch {torch.__version__}, Triton {_triton_version()}; "
          f"backends here: {available_backends(device)}", flush=True)
    rows = run(shapes, tokens, device) + run_linears(device)
    failed = [r for r in rows if not r["pass"]]
    print(f"{len(rows) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
