"""FlashInfer NVFP4 (Blackwell) arguments, checked on CPU by independent routes:
de-swizzle + float64 dequantize back to the reference weights, and a simulation that consumes
exactly the prepared tensors in FlashInfer's semantics vs the reference backend."""

import pytest
import torch

import fp4moe_ops
from fp4moe_ops.backends.flashinfer_cutlass import nvfp4_quant_scales, nvfp4_weight_arguments, up_gate_order
from fp4moe_ops.backends.reference import reference_moe
from fp4moe_ops.flashinfer_sim import simulate_cutlass_nvfp4_moe
from fp4moe_ops.oracle64 import dequant64


def calibrated_layer(e=8, h=128, i=128, x=None):
    """Experts whose down GEMM input ranges differ ~100x, with input scales calibrated on ``x``
    (as ModelOpt does: amax / (6*448) of what each expert sees)."""
    gate_up = torch.randn(e, 2 * i, h) / h**0.5 * torch.logspace(-0.5, 0.5, e)[:, None, None]
    w = fp4moe_ops.quantize_moe_weights(gate_up, torch.randn(e, h, i) / i**0.5)
    x = torch.randn(64, h).bfloat16() if x is None else x
    decoded_gate_up, _ = w.dequantize()
    hgu = x.float() @ decoded_gate_up.transpose(1, 2)  # [E, T, 2I]
    act = (torch.nn.functional.silu(hgu[..., :i]) * hgu[..., i:]).bfloat16().float()
    w.gate_up_input_scale = torch.full((e,), x.float().abs().max().item() / (6 * 448))
    w.down_input_scale = act.abs().amax(dim=(1, 2)) / (6 * 448)
    return w


def test_prepared_weights_deswizzle_to_reference():
    w = calibrated_layer(e=3, h=128, i=192)  # 2I = 384 rows: three 128-row tiles; I/16 = 12 cols
    fc1, fc1_sf, fc1_g, fc2, fc2_sf, fc2_g = nvfp4_weight_arguments(w)
    assert fc1.dtype == torch.int64 and fc1.shape == (3, 384, 128 // 16)
    assert fc1_sf.dtype == torch.int32 and fc1_sf.shape == (3, 384, 128 // 16 // 4)
    assert fc2.shape == (3, 128, 192 // 16) and fc2_sf.shape == (3, 128, 12 // 4)
    for e in range(3):
        # Independent route: CUTLASS offset formula applied per element, float64 decode.
        flat = fc1_sf[e].view(torch.uint8).reshape(-1)
        rows, cols = 384, 8
        sf = torch.empty(rows, cols, dtype=torch.uint8)
        for r in range(rows):
            for c in range(cols):
                sf[r, c] = flat[((r // 128) * 2 + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4]
        got = dequant64(fc1[e].view(torch.uint8), sf.view(torch.float8_e4m3fn), fc1_g[e])
        ref = dequant64(w.gate_up[e], w.gate_up_scale[e], w.gate_up_global_scale[e])
        gate, up = ref.chunk(2)
        assert torch.equal(got, torch.cat([up, gate]))  # FlashInfer order [up; gate]
        assert torch.equal(up_gate_order(up_gate_order(w.gate_up))[e], w.gate_up[e])


@pytest.mark.parametrize("mode", ["per_expert", "global_max"])
def test_simulation_of_prepared_args_matches_reference_backend(mode):
    t, k = 24, 3
    x = torch.randn(t, 128).bfloat16()
    w = calibrated_layer(x=x)
    ids = torch.stack([torch.randperm(8)[:k] for _ in range(t)])
    rw = torch.rand(t, k)
    gate_up_in, down_in = fp4moe_ops.activation_scales(w.gate_up_input_scale, w.down_input_scale, mode)
    assert gate_up_in.numel() == (8 if mode == "per_expert" else 1)
    args = nvfp4_weight_arguments(w)
    qs = nvfp4_quant_scales(args[2], args[1], args[5], args[4], gate_up_in, down_in)
    sim = simulate_cutlass_nvfp4_moe(x, ids, rw, args[0], args[3], qs)
    tensors = fp4moe_ops.prepare_experts(w, "reference").op_tensors()
    # the kernel-faithful reference: GEMM outputs rounded to bf16 where the CUTLASS kernel stores them
    ref = reference_moe(x, ids, rw, tensors, gate_up_in, down_in, cutlass_rounding=True).float()
    w4a16 = torch.ops.fp4moe.fused_moe(x, ids, rw, tensors, None, None, "reference").float()
    # FP4 rounding is discontinuous: FlashInfer's formulation (x * g / sf) and ours
    # (x / (sf * s)) differ in the last fp32 bit, which now and then flips an E4M3 block scale
    # or an E2M1 code of some token (the bf16 intermediate feeds the down GEMM quantizer too).
    # So: most tokens must agree to bf16 output rounding, a few may differ by a flip, and a
    # wrong argument (gate/up order, alpha, swizzle) would make every token wrong.
    per_token = ((sim - ref).norm(dim=1) / ref.norm(dim=1))
    assert per_token.median() < 5e-3, per_token
    assert (per_token > 2e-2).float().mean() < 0.25, per_token
    noise = ((ref - w4a16).norm() / ref.norm()).item()  # activation quantization really happened
    assert noise > 0.02, noise


def test_preseed_bug_shrinks_each_expert_by_its_scale_ratio():
    """Pre-seed FlashInfer quantized the down GEMM's inputs with 1/max(down_input_scale) but
    dequantized with per-expert alphas. Against a consistent down GEMM at that same scale (identical
    quantization grid), expert e's output is exactly down_input_scale[e] / max(down_input_scale) times
    too small."""
    x = torch.randn(16, 128).bfloat16()
    w = calibrated_layer(x=x)
    args = nvfp4_weight_arguments(w)
    gate_up_in, down_in = w.gate_up_input_scale, w.down_input_scale
    consistent = nvfp4_quant_scales(args[2], args[1], args[5], args[4], gate_up_in, down_in.max())
    buggy = nvfp4_quant_scales(args[2], args[1], args[5], args[4], gate_up_in, down_in, preseed_fc2_bug=True)
    for e in (0, 3, 7):
        ids, rw = torch.full((16, 1), e), torch.ones(16, 1)
        good = simulate_cutlass_nvfp4_moe(x, ids, rw, args[0], args[3], consistent)
        bad = simulate_cutlass_nvfp4_moe(x, ids, rw, args[0], args[3], buggy)
        expected = (down_in[e] / down_in.max()).item()
        # exact up to the kernel's bf16 store of each down GEMM output: each side is rounded once, by up to
        # half a bf16 ulp (2^-8 relative), in either direction
        torch.testing.assert_close(bad, good * expected, rtol=2**-7, atol=1e-6 * good.abs().max().item())
        if e < 7:
            assert expected < 0.5  # the bug is large for all but the widest-range expert


@pytest.mark.parametrize("inter", [192, 80])
def test_intermediate_size_not_a_multiple_of_128_is_padded(inter):
    """I % 128 != 0 (192, gpt-oss-like 2880 % 128 = 64): the CUTLASS kernels need 128-row FC1 tiles,
    so the prepared weights are padded with zero rows (gate and up) and zero columns (down); the
    simulated kernel on them gives the kernel-faithful reference's answer on the unpadded layer."""
    from fp4moe_ops.backends import BACKENDS

    t, k, h = 20, 2, 128
    x = torch.randn(t, h).bfloat16()
    w = calibrated_layer(e=4, h=h, i=inter, x=x)
    args = BACKENDS["flashinfer_nvfp4"].prepare(w)
    padded = -(-inter // 128) * 128
    assert args[0].shape == (4, 2 * padded, h // 16) and args[3].shape == (4, h, padded // 16)
    ids = torch.stack([torch.randperm(4)[:k] for _ in range(t)])
    rw = torch.rand(t, k)
    qs = nvfp4_quant_scales(args[2], args[1], args[5], args[4], w.gate_up_input_scale, w.down_input_scale)
    sim = simulate_cutlass_nvfp4_moe(x, ids, rw, args[0], args[3], qs)
    ref = reference_moe(x, ids, rw, w.tensors(), w.gate_up_input_scale, w.down_input_scale, cutlass_rounding=True).float()
    per_token = (sim - ref).norm(dim=1) / ref.norm(dim=1)
    # the same tolerance as the unpadded comparison above (FP4 rounding flips of single tokens)
    assert per_token.median() < 5e-3 and (per_token > 2e-2).float().mean() < 0.25, per_token


def test_flashinfer_bad_input_errors_on_cpu():
    from fp4moe_ops.backends import BACKENDS

    small = fp4moe_ops.quantize_moe_weights(torch.randn(2, 2 * 64, 96), torch.randn(2, 96, 64))
    with pytest.raises(ValueError, match="H a multiple of 128.*triton"):
        BACKENDS["flashinfer_nvfp4"].prepare(small)
    with pytest.raises(ValueError, match="H a multiple of 128.*triton"):
        BACKENDS["flashinfer_mxfp4"].prepare(small)
    # the NVFP4 op refuses to run without both activation scales
    w = calibrated_layer()
    args = nvfp4_weight_arguments(w)
    x = torch.randn(4, 128).bfloat16()
    ids, rw = torch.zeros(4, 1, dtype=torch.long), torch.ones(4, 1)
    with pytest.raises(ValueError, match="needs both gate_up_input_scale and down_input_scale"):
        torch.ops.fp4moe.fused_moe(x, ids, rw, args, w.gate_up_input_scale, None, "flashinfer_nvfp4")
    with pytest.raises(ValueError, match="int64"):
        torch.ops.fp4moe.fused_moe(x, ids, rw, w.tensors(), w.gate_up_input_scale, w.down_input_scale, "flashinfer_nvfp4")


def test_flashinfer_import_errors_are_clear(monkeypatch):
    import sys
    import types

    from fp4moe_ops.backends.flashinfer_cutlass import _import_flashinfer

    old = types.ModuleType("flashinfer")
    old.__version__ = "0.2.5"
    old.fused_moe = types.ModuleType("flashinfer.fused_moe")
    monkeypatch.setitem(sys.modules, "flashinfer", old)
    monkeypatch.setitem(sys.modules, "flashinfer.fused_moe", old.fused_moe)
    with pytest.raises(RuntimeError, match="0.2.5 has a different cutlass_fused_moe contract"):
        _import_flashinfer()
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # not installed
    with pytest.raises(RuntimeError, match="FlashInfer is not usable here"):
        _import_flashinfer()


def test_nvfp4_call_contract_with_a_recording_flashinfer(monkeypatch):
    """The exact cutlass_fused_moe call of the Blackwell backend, recorded on CPU: argument
    order, dtypes, quant_scales, ids cleaned of sentinels, workspace and the deterministic flag."""
    import types

    from fp4moe_ops.backends import BACKENDS, flashinfer_cutlass as fc

    calls = []

    def cutlass_fused_moe(*args, **kwargs):
        calls.append((args, kwargs))
        return [torch.zeros(args[0].shape, dtype=args[5])]

    fake = types.SimpleNamespace(cutlass_fused_moe=cutlass_fused_moe,
                                 cutlass_fused_moe_workspace_size=lambda *a, **k: 1024)
    monkeypatch.setattr(fc, "_import_flashinfer", lambda: fake)
    backend = BACKENDS["flashinfer_nvfp4"]
    monkeypatch.setattr(backend, "_workspaces", {})
    monkeypatch.setattr(torch.cuda, "device", lambda device: __import__("contextlib").nullcontext())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    w = calibrated_layer()
    args = backend.prepare(w)
    x = torch.randn(3, 128).bfloat16()
    ids = torch.tensor([[0, 5], [7, -1], [8, 2]])
    rw = torch.rand(3, 2)
    fc.set_deterministic(True)
    try:
        backend.run(x, ids, rw, args, w.gate_up_input_scale, w.down_input_scale)
    finally:
        fc.set_deterministic(None)
    (pos, kw), = calls
    assert pos[0] is not None and pos[0].dtype == torch.bfloat16
    # ids outside [0, E) go in as they are: the kernel skips them (a remap to expert 0 with weight
    # 0 would make every expert-parallel remote pair a GEMM row of local expert 0)
    assert pos[1].dtype == torch.int32 and pos[1].tolist() == [[0, 5], [7, -1], [8, 2]]
    assert pos[2] is rw
    assert pos[3] is args[0] and pos[4] is args[3] and pos[3].dtype == torch.int64
    qs = kw["quant_scales"]
    assert qs[1] is args[1] and qs[4] is args[4]  # swizzled block scales, int32
    torch.testing.assert_close(qs[0], 1 / w.gate_up_input_scale)
    torch.testing.assert_close(qs[2], w.gate_up_global_scale * w.gate_up_input_scale)
    torch.testing.assert_close(qs[5], w.down_global_scale * w.down_input_scale)
    assert kw["use_fused_finalize"] is False and kw["workspace_buffer"].numel() == 1024
    # the activation recipe is ours, not FLASHINFER_NVFP4_4OVER6* from the environment
    assert "nvfp4_4over6" in kw and kw["nvfp4_4over6"] is None


def test_kernel_faithful_reference_is_what_the_cutlass_kernel_computes():
    """The CUTLASS kernel stores the gate_up and the down GEMM's outputs in BF16; the reference in its
    kernel-faithful mode does the same, and is then measurably closer to the simulated kernel than
    the float32 reference (which a tight hardware comparison would wrongly fail).

    256 tokens: the median's spread across seeds then stays well under the bound (the ratio of
    the two errors was 0.16-0.40 over 100 seeds; at 64 tokens its tail reached 0.62)."""
    t, k = 256, 3
    x = torch.randn(t, 128).bfloat16()
    w = calibrated_layer(x=x)
    ids = torch.stack([torch.randperm(8)[:k] for _ in range(t)])
    rw = torch.rand(t, k)
    args = nvfp4_weight_arguments(w)
    qs = nvfp4_quant_scales(args[2], args[1], args[5], args[4], w.gate_up_input_scale, w.down_input_scale)
    sim = simulate_cutlass_nvfp4_moe(x, ids, rw, args[0], args[3], qs)
    tensors = fp4moe_ops.prepare_experts(w, "reference").op_tensors()
    faithful = reference_moe(x, ids, rw, tensors, w.gate_up_input_scale, w.down_input_scale, cutlass_rounding=True).float()
    fp32 = reference_moe(x, ids, rw, tensors, w.gate_up_input_scale, w.down_input_scale).float()
    err = lambda ref: ((sim - ref).norm(dim=1) / ref.norm(dim=1)).median().item()  # noqa: E731
    assert err(faithful) < 0.6 * err(fp32), (err(faithful), err(fp32))
