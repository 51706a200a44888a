"""Accuracy of the MoE layer under each quantization path, against a float64 unquantized reference.

    python benchmarks/accuracy_study.py          # CPU, ~10 s; on a GPU also the GPU kernels

Synthetic but realistic layer: experts whose down GEMM input ranges differ ~1000x (gate/up scaled
per expert), hidden states with a few outlier channels (x20), top-4 routing. Activation scales
are calibrated (per-expert amax, as ModelOpt does) on a separate calibration set, then the
layer is evaluated on fresh tokens. Paths:

* NVFP4 x NVFP4, per-expert scales  (FlashInfer after the seed change)      - CPU simulation of
* NVFP4 x NVFP4, global-max scale   (vLLM / SGLang / TRT-LLM today)          the exact FlashInfer
* NVFP4 x NVFP4, pre-seed bug       (fc2 quantized with min, per-expert alpha) arguments
* W4A16 NVFP4  (exact NVFP4 weights, bf16 activations: fp4moe's Triton/reference backends)
* W4A16 MXFP4  (NVFP4 re-quantized to MXFP4: FlashInfer's SM90 W4A16 kernel)
* W4A8 NVFP4  (activations per token to E4M3, weights to E4M3 with a row scale: the planned Hopper FP8
  path, emulated exactly by benchmarks/accuracy_w4a8.py, which owns it)
* BF16 of the NVFP4 weights (FlashInfer BF16 backend), and BF16 of the original weights.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import fp4moe_ops  # noqa: E402
from fp4moe_ops import NVFP4MoEWeights, mxfp4, nvfp4  # noqa: E402
from fp4moe_ops.backends.flashinfer_cutlass import nvfp4_quant_scales, nvfp4_weight_arguments  # noqa: E402
from fp4moe_ops.flashinfer_sim import simulate_cutlass_nvfp4_moe  # noqa: E402

E, H, I, K = 16, 512, 256, 4


def moe_dense(x, ids, rw, gate_up, down, dtype, round_intermediate):
    """Plain MoE math in ``dtype`` with float weights ``gate_up [E,2I,H]`` ([gate; up]), ``down``."""
    out = torch.zeros(x.shape, dtype=dtype)
    for e in range(E):
        route = (rw.to(dtype) * (ids == e)).sum(-1)
        h = x.to(dtype) @ gate_up[e].to(dtype).T
        act = F.silu(h[:, :I]) * h[:, I:]
        if round_intermediate:
            act = act.bfloat16()
        out += route[:, None] * (act.to(dtype) @ down[e].to(dtype).T)
    return out


def tokens(t, outliers):
    x = torch.randn(t, H)
    x[:, outliers] *= 20
    logits = torch.randn(t, E)
    rw, ids = torch.softmax(logits, -1).topk(K, -1)
    return x.bfloat16(), ids, (rw / rw.sum(-1, keepdim=True)).float()


def build_layer() -> dict:
    """The study's layer, calibrated, and its CPU paths: ``weights`` (NVFP4MoEWeights with the
    calibrated input scales), the evaluation tokens ``x``, ``ids``, ``rw``, ``err(out)`` (relative
    error against the float64 unquantized layer), ``rows`` [(label, error)], ``amax2``, ``mx_err``."""
    torch.manual_seed(0)
    spread = torch.logspace(0, 1.5, E)  # down GEMM inputs scale ~ spread^2: 1x .. 1000x
    gate_up = torch.randn(E, 2 * I, H) / H**0.5 * spread[:, None, None]
    down = torch.randn(E, H, I) / I**0.5 / spread[:, None, None] ** 2
    outliers = torch.randperm(H)[:8]
    w = fp4moe_ops.quantize_moe_weights(gate_up, down)

    # calibrate per-expert activation amax on separate tokens (W4A16 math, like ModelOpt)
    xc, idc, _ = tokens(512, outliers)
    w13q, w2q = w.dequantize()
    amax1, amax2 = torch.zeros(E), torch.zeros(E)
    for e in range(E):
        rows = (idc == e).any(-1)
        h = xc[rows].float() @ w13q[e].T
        amax1[e] = xc[rows].float().abs().max()
        amax2[e] = (F.silu(h[:, :I]) * h[:, I:]).bfloat16().float().abs().max()
    w.gate_up_input_scale = amax1 / (6 * 448)
    w.down_input_scale = amax2 / (6 * 448)

    x, ids, rw = tokens(256, outliers)
    exact = moe_dense(x, ids, rw, gate_up.double(), down.double(), torch.float64, False)

    def err(out):
        return ((out.double() - exact).norm() / exact.norm()).item()

    rows = []
    args = nvfp4_weight_arguments(w)
    for label, mode, bug in [("NVFP4 x NVFP4, per-expert scales (seed)", "per_expert", False),
                             ("NVFP4 x NVFP4, global-max scale (vLLM/SGLang/TRT-LLM)", "global_max", False),
                             ("NVFP4 x NVFP4, pre-seed bug (min scale, per-expert alpha)", "per_expert", True)]:
        gate_up_in, down_in = fp4moe_ops.activation_scales(w.gate_up_input_scale, w.down_input_scale, mode)
        qs = nvfp4_quant_scales(args[2], args[1], args[5], args[4], gate_up_in, down_in, preseed_fc2_bug=bug)
        rows.append((label, err(simulate_cutlass_nvfp4_moe(x, ids, rw, args[0], args[3], qs))))
    ref = fp4moe_ops.prepare_experts(w, "reference")  # act_scale_mode None: W4A16
    rows.append(("W4A16 NVFP4 (exact weights; fp4moe triton/reference)", err(ref(x, ids, rw))))
    mx13 = mxfp4.dequantize_mxfp4(*mxfp4.nvfp4_to_mxfp4(nvfp4.NVFP4Tensor(w.gate_up, w.gate_up_scale, w.gate_up_global_scale)))
    mx2 = mxfp4.dequantize_mxfp4(*mxfp4.nvfp4_to_mxfp4(nvfp4.NVFP4Tensor(w.down, w.down_scale, w.down_global_scale)))
    rows.append(("W4A16 MXFP4 (re-quantized; FlashInfer SM90 W4A16)", err(moe_dense(x, ids, rw, mx13, mx2, torch.float32, True))))
    rows.append(("BF16 of the NVFP4 weights (FlashInfer BF16)",
                 err(moe_dense(x, ids, rw, w13q.bfloat16(), w2q.bfloat16(), torch.float32, True))))
    rows.append(("BF16 of the original weights (no quantization)",
                 err(moe_dense(x, ids, rw, gate_up.bfloat16(), down.bfloat16(), torch.float32, True))))
    mx_err = mxfp4.mxfp4_requant_error(nvfp4.NVFP4Tensor(w.gate_up, w.gate_up_scale, w.gate_up_global_scale))
    return dict(weights=w, x=x, ids=ids, rw=rw, err=err, rows=rows, amax2=amax2, mx_err=mx_err)


def main() -> None:
    layer = build_layer()
    w, x, ids, rw, err, rows = (layer[k] for k in ("weights", "x", "ids", "rw", "err", "rows"))
    from accuracy_w4a8 import Weight, emulated_moe  # (this folder is on sys.path when run as a script)

    w4a8 = emulated_moe(x, ids, rw, [Weight(w.gate_up[e], w.gate_up_scale[e], w.gate_up_global_scale[e])
                                     for e in range(E)],
                        [Weight(w.down[e], w.down_scale[e], w.down_global_scale[e]) for e in range(E)], "w4a8")
    rows.insert(4, ("W4A8 NVFP4 (E4M3 activations per token, E4M3 weights + row scale; planned Hopper FP8)", err(w4a8)))

    if torch.cuda.is_available():  # the same case through the GPU kernels, beside the CPU models
        wc = NVFP4MoEWeights(*(t.cuda() for t in w.tensors()))
        xc, idc, rwc = x.cuda(), ids.cuda(), rw.cuda()
        for label, backend in [("GPU: fp4moe triton (W4A16 NVFP4)", "triton"),
                               ("GPU: FlashInfer CUTLASS W4A16 MXFP4", "flashinfer_mxfp4"),
                               ("GPU: FlashInfer CUTLASS BF16", "flashinfer_bf16")]:
            try:
                rows.append((label, err(fp4moe_ops.prepare_experts(wc, backend)(xc, idc, rwc).cpu())))
            except Exception as exc:  # report and go on
                rows.append((f"{label}: not run ({type(exc).__name__}: {str(exc)[:80]})", float("nan")))

    amax2, mx_err = layer["amax2"], layer["mx_err"]
    print(f"E={E} H={H} I={I} top-{K}; down GEMM input amax across experts: {amax2.min():.3g} .. {amax2.max():.3g} "
          f"({(amax2.max() / amax2.min()).item():.0f}x); MXFP4 re-quantization weight error {mx_err:.3f}")
    print("| path | MoE output rel. error vs float64 unquantized |\n|---|---|")
    for label, e_ in rows:
        print(f"| {label} | {e_:.4f} |")


if __name__ == "__main__":
    main()
