"""NVFP4 format tests against independent references: the E2M1/E4M3 definitions,
hand-computed vectors, float64 per-element math written here, and the CUTLASS swizzle formula."""

import math

import pytest
import torch

import fp4moe_ops
from fp4moe_ops import mxfp4, nvfp4

CODEBOOK = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def nearest_e2m1_index(v: float) -> int:
    """Definition: nearest codebook magnitude, ties to the even index, saturate at 6."""
    a = min(abs(v), 6.0)
    best = min(range(8), key=lambda i: (abs(CODEBOOK[i] - a), i % 2))
    return best


def test_e2m1_hand_vectors():
    x = torch.tensor([0.0, 0.25, 0.26, 0.74, 0.75, 1.25, 1.3, 1.75, 2.5, 2.51, 3.5, 4.9, 5.0, 5.01, 7.0, 1e9,
                      -0.25, -0.3, -2.5, -3.5, -6.0, -100.0])
    expected_values = [0, 0, 0.5, 0.5, 1, 1, 1.5, 2, 2, 3, 4, 4, 4, 6, 6, 6,
                       0, -0.5, -2, -4, -6, -6]
    got = nvfp4.e2m1_decode(nvfp4.e2m1_encode(x))
    assert got.tolist() == expected_values
    # sign bit is nibble bit 3; 1.5 is code 3, -1.5 is code 11
    assert nvfp4.e2m1_encode(torch.tensor([1.5, -1.5])).tolist() == [3, 11]


def test_e2m1_matches_definition_on_random_values():
    x = (torch.randn(4000) * 3).double()
    codes = nvfp4.e2m1_encode(x)
    for v, c in zip(x.tolist(), codes.tolist()):
        assert c & 7 == nearest_e2m1_index(v), v
        assert (c >> 3) == (1 if v < 0 else 0)


def test_pack_low_nibble_first_and_roundtrip():
    assert nvfp4.pack_e2m1(torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)).tolist() == [[0x21, 0x0F]]
    codes = torch.randint(0, 16, (3, 5, 32), dtype=torch.uint8)
    assert torch.equal(nvfp4.unpack_e2m1(nvfp4.pack_e2m1(codes)), codes)


def float64_nvfp4_roundtrip(w: torch.Tensor) -> torch.Tensor:
    """Independent scalar-by-block ModelOpt recipe in float64 (E4M3 rounding via torch's cast)."""
    w = w.double()
    amax = w.abs().max().item()
    g = amax / (6 * 448) if amax > 0 else 1.0
    g = float(torch.tensor(g, dtype=torch.float32))  # the stored global scale is fp32
    out = torch.empty_like(w)
    n, k = w.shape
    for r in range(n):
        for b in range(0, k, 16):
            blk = w[r, b:b + 16]
            s = min(blk.abs().max().item() / 6 / g, 448.0)
            s = float(torch.tensor(s, dtype=torch.float32).to(torch.float8_e4m3fn).double())
            for j in range(16):
                v = blk[j].item() / (s * g) if s > 0 else 0.0
                q = CODEBOOK[nearest_e2m1_index(v)] * (-1 if v < 0 else 1)
                out[r, b + j] = q * s * g
    return out


def test_quantize_dequantize_matches_float64_definition():
    w = torch.randn(6, 64) * torch.logspace(-2, 2, 6)[:, None]  # rows of very different ranges
    q = nvfp4.quantize_nvfp4(w)
    assert q.packed.shape == (6, 32) and q.packed.dtype == torch.uint8
    assert q.block_scale.shape == (6, 4) and q.block_scale.dtype == torch.float8_e4m3fn
    assert q.global_scale.shape == () and q.global_scale.dtype == torch.float32
    ref = float64_nvfp4_roundtrip(w)
    got = q.dequantize(torch.float64)
    # Only fp32-vs-fp64 rounding of the scale products separates them: 1e-6 relative.
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)
    # NVFP4's own error on Gaussian data: E2M1 has 1 mantissa bit -> ~10% relative.
    rel = ((got - w.double()).norm() / w.double().norm()).item()
    assert 0.02 < rel < 0.15


def test_expert_stack_has_per_expert_global_scale():
    w = torch.randn(3, 32, 48) * torch.tensor([1e-3, 1.0, 1e3])[:, None, None]
    q = nvfp4.quantize_nvfp4(w)
    torch.testing.assert_close(q.global_scale, w.abs().amax(dim=(1, 2)) / (6 * 448))
    for e in range(3):
        torch.testing.assert_close(q.dequantize()[e].double(), float64_nvfp4_roundtrip(w[e]), rtol=1e-6, atol=0)


@pytest.mark.parametrize("scale", [0.0, 1e-30, 1e-20, 1e20, 3e37])
def test_extreme_ranges_finite(scale):
    w = torch.randn(4, 32) * scale
    w[1, :16] = 0  # an all-zero block beside non-zero ones
    q = nvfp4.quantize_nvfp4(w)
    d = q.dequantize(torch.float64)
    assert torch.isfinite(d).all()
    assert (d[1, :16] == 0).all()
    if scale > 0:
        rel = ((d - w.double()).norm() / w.double().norm()).item()
        assert rel < 0.15, rel


def test_block_scale_saturates_and_activation_clipping():
    # With a fixed global scale (calibrated activations) values beyond 6*448*g saturate to it.
    g = torch.tensor(1.0 / (6 * 448))
    x = torch.full((1, 16), 5.0)
    x[0, 0] = 1.0
    assert nvfp4.quantize_nvfp4(x, g).dequantize().max().item() == pytest.approx(1.0)
    assert nvfp4.quantize_nvfp4(x, g).block_scale.float().max().item() == 448.0
    # FlashInfer's activation formulation: act_global = 1/g; q*sf saturates at 6*448
    assert nvfp4.quantize_activation_nvfp4(x, 1 / g).max().item() == 6 * 448


def test_activation_quantization_definition():
    """sf = e4m3(act_global * amax16 / 6), q = e2m1(x * act_global / sf), returns q * sf."""
    x = torch.randn(3, 32).bfloat16()
    act_global = torch.tensor(448 * 6 / 3.0)
    got = nvfp4.quantize_activation_nvfp4(x, act_global)
    for r in range(3):
        for b in range(2):
            blk = x[r, b * 16:(b + 1) * 16].double()
            sf = float(torch.tensor(min(float(act_global) * blk.abs().max().item() / 6, 448.0)).to(torch.float8_e4m3fn).double())
            for j in range(16):
                v = float(torch.tensor(blk[j].item(), dtype=torch.float32) * act_global / torch.tensor(sf, dtype=torch.float32))
                q = CODEBOOK[nearest_e2m1_index(v)] * (-1 if v < 0 else 1)
                assert got[r, b * 16 + j].item() == q * sf


def test_bad_input_errors():
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4.quantize_nvfp4(torch.randn(4, 24))
    with pytest.raises(ValueError, match="NaN or Inf"):
        nvfp4.quantize_nvfp4(torch.tensor([[float("nan")] * 16]))
    with pytest.raises(ValueError, match="NaN or Inf"):
        nvfp4.quantize_nvfp4(torch.tensor([[float("inf")] * 16]))
    with pytest.raises(TypeError, match="float32/bfloat16/float16"):
        nvfp4.quantize_nvfp4(torch.zeros(4, 16, dtype=torch.int32))
    with pytest.raises(TypeError, match="uint8"):
        nvfp4.unpack_e2m1(torch.zeros(4, dtype=torch.int8))


def swizzled_offset(r: int, c: int, s_pad: int) -> int:
    """CUTLASS block-scale layout (128x4 tiles), written from its definition."""
    tile = (r // 128) * (s_pad // 4) + c // 4
    return tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + (c % 4)


@pytest.mark.parametrize("rows,cols", [(128, 4), (200, 7), (256, 448), (5, 1)])
def test_swizzle_matches_cutlass_formula_and_inverts(rows, cols):
    s = torch.randint(1, 255, (2, rows, cols), dtype=torch.uint8)
    sw = nvfp4.swizzle_block_scale(s)
    rp, cp = math.ceil(rows / 128) * 128, math.ceil(cols / 4) * 4
    assert sw.shape == (2, rp, cp)
    flat = sw.reshape(2, -1)
    for e in range(2):
        for r in range(rows):
            for c in range(cols):
                assert flat[e, swizzled_offset(r, c, cp)] == s[e, r, c]
    assert int((flat != 0).sum()) == 2 * rows * cols  # padding is zero
    assert torch.equal(nvfp4.unswizzle_block_scale(sw, rows, cols), s)
    assert torch.equal(nvfp4.unswizzle_block_scale(flat, rows, cols), s)


def test_mxfp4_requant_definition_and_error_report():
    w = nvfp4.quantize_nvfp4(torch.randn(2, 16, 64))
    packed, scale = mxfp4.nvfp4_to_mxfp4(w)
    assert packed.shape == (2, 16, 32) and scale.shape == (2, 16, 2) and scale.dtype == torch.uint8
    # E8M0 definition: value = e2m1 * 2^(byte - 127), elements of a 32-block share one scale
    codes = nvfp4.unpack_e2m1(packed).double()
    vals = nvfp4.e2m1_decode(codes.to(torch.uint8)).double()
    manual = vals * torch.pow(2.0, scale.double() - 127).repeat_interleave(32, -1)
    torch.testing.assert_close(mxfp4.dequantize_mxfp4(packed, scale).double(), manual)
    err = mxfp4.mxfp4_requant_error(w)
    assert 0.0 < err < 0.25  # lossy: power-of-two scales over 32 elements lose NVFP4's detail
    # Values already on an MXFP4 grid survive exactly.
    exact_packed = nvfp4.pack_e2m1(torch.randint(0, 16, (1, 4, 64), dtype=torch.uint8))
    exact_scale = torch.randint(120, 130, (1, 4, 2), dtype=torch.uint8)
    x = mxfp4.dequantize_mxfp4(exact_packed, exact_scale)
    x[..., ::32] = 6.0 * torch.pow(2.0, exact_scale.float() - 127)  # make each block's amax 6*2^e
    back = mxfp4.dequantize_mxfp4(*mxfp4.quantize_mxfp4(x))
    assert torch.equal(back, x)


def test_quantize_moe_weights_in_chunks_equals_whole_stacks(monkeypatch):
    # the layer is quantized a few experts at a time into preallocated tensors; per-matrix global
    # scales make that identical to quantizing each whole stack at once
    from fp4moe_ops import moe_weights
    from fp4moe_ops.moe_weights import expert_chunks

    monkeypatch.setattr(moe_weights, "expert_chunks", lambda t: expert_chunks(t, elements=3 * t[0].numel()))

    gate_up = torch.randn(7, 64, 96, dtype=torch.bfloat16) * torch.logspace(-2, 2, 7)[:, None, None]
    down = torch.randn(7, 96, 32, dtype=torch.bfloat16)
    assert [c for c in expert_chunks(gate_up, elements=64 * 96 * 3)] == [(0, 3), (3, 6), (6, 7)]
    assert expert_chunks(gate_up, elements=1) == [(e, e + 1) for e in range(7)]  # at least one expert
    w = fp4moe_ops.quantize_moe_weights(gate_up, down)
    for got, whole in ((w.gate_up, w.gate_up_scale, w.gate_up_global_scale), nvfp4.quantize_nvfp4(gate_up)), \
                      ((w.down, w.down_scale, w.down_global_scale), nvfp4.quantize_nvfp4(down)):
        assert torch.equal(got[0], whole.packed) and torch.equal(got[2], whole.global_scale)
        assert torch.equal(got[1].view(torch.uint8), whole.block_scale.view(torch.uint8))
