"""MXFP4 (fp4moe_ops.mxfp4) against the OCP Microscaling definition, decoded here in float64 from
the bits (not through the library's tables), and gpt-oss's checkpoint layout against Transformers'
own MXFP4 dequantizer."""

import pytest
import torch

from fp4moe_ops import mxfp4


def e2m1_value(code: int) -> float:
    """OCP FP4 E2M1: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0; exponent 0 is subnormal."""
    sign = -1.0 if code & 0b1000 else 1.0
    exponent, mantissa = (code >> 1) & 0b11, code & 1
    magnitude = mantissa * 0.5 if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2)
    return sign * magnitude


def e8m0_value(byte: int) -> float:
    """OCP E8M0: 2^(byte - 127), byte 0xFF NaN."""
    return float("nan") if byte == 0xFF else 2.0 ** (byte - 127)


def decode64(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[N, K/2] bytes (low nibble = even element) and [N, K/32] E8M0 bytes -> [N, K] float64, element by element."""
    n, half = packed.shape
    out = torch.empty(n, 2 * half, dtype=torch.float64)
    for r in range(n):
        for j in range(half):
            byte = int(packed[r, j])
            for k, code in ((2 * j, byte & 0xF), (2 * j + 1, byte >> 4)):
                out[r, k] = e2m1_value(code) * e8m0_value(int(scales[r, k // 32]))
    return out


def test_e2m1_codes_are_the_ocp_values():
    assert [e2m1_value(c) for c in range(8)] == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # the spec's table
    assert [e2m1_value(c) for c in range(8, 16)] == [-0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def test_every_scale_byte_decodes_as_a_power_of_two_or_nan():
    scales = torch.arange(256, dtype=torch.uint8)
    got64 = mxfp4.e8m0_decode(scales, torch.float64)
    expected = torch.tensor([e8m0_value(b) for b in range(256)], dtype=torch.float64)
    torch.testing.assert_close(got64, expected, rtol=0, atol=0, equal_nan=True)
    assert got64[0] == 2.0**-127 and got64[254] == 2.0**127 and got64[127] == 1.0 and torch.isnan(got64[255])
    # float32 holds every power exactly (2^-127 as a subnormal), so the cast is exact
    torch.testing.assert_close(mxfp4.e8m0_decode(scales), expected.float(), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_every_code_under_every_scale_exponent(dtype):
    # 256 rows, one per scale byte (0..254 and the NaN 0xFF); each row holds all 256 bytes twice,
    # i.e. every code in both nibbles, over 16 blocks of 32 values
    packed = torch.arange(256, dtype=torch.uint8).repeat(256, 2)  # [256, 512] -> K = 1024
    scales = torch.arange(256, dtype=torch.uint8)[:, None].repeat(1, 32)
    expected = decode64(packed, scales)
    got = mxfp4.dequantize_mxfp4(packed, scales, dtype)
    # exact: each value is e2m1 * 2^e, exact in float64; in float32 exact too (2^-128 = 0.5 * 2^-127 is
    # a float32 subnormal) except where it overflows float32 (>= 2^128: inf), as the cast of the float64 does
    torch.testing.assert_close(got, expected.to(dtype), rtol=0, atol=0, equal_nan=True)
    assert torch.isinf(got[254]).any() == (dtype == torch.float32)  # 6 * 2^127 overflows float32 only
    assert torch.isnan(got[255]).all()  # a NaN scale makes its whole block NaN, zeros included


def test_low_nibble_is_the_even_element():
    packed = torch.tensor([[0x21] * 16], dtype=torch.uint8)  # low nibble code 1 (0.5), high code 2 (1.0)
    got = mxfp4.dequantize_mxfp4(packed, torch.tensor([[128]], dtype=torch.uint8))  # scale 2
    assert got[0, :4].tolist() == [1.0, 2.0, 1.0, 2.0]


def test_random_bytes_against_the_float64_decoding():
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (3, 4, 48), dtype=torch.uint8, generator=g)  # K = 96: 3 blocks
    scales = torch.randint(100, 150, (3, 4, 3), dtype=torch.uint8, generator=g)
    got = mxfp4.dequantize_mxfp4(packed, scales, torch.float64)
    for e in range(3):
        torch.testing.assert_close(got[e], decode64(packed[e], scales[e]), rtol=0, atol=0)
    # gpt-oss's blocks are the same bytes, 16 per 32-value block
    blocks = mxfp4.to_gpt_oss_blocks(packed)
    assert blocks.shape == (3, 4, 3, 16) and torch.equal(blocks.flatten(-2), packed)
    assert torch.equal(mxfp4.dequantize_gpt_oss(blocks, scales, torch.float64), got)


def test_quantize_round_trips_values_on_the_grid_and_bounds_the_error():
    g = torch.Generator().manual_seed(1)
    packed = torch.randint(0, 256, (2, 8, 32), dtype=torch.uint8, generator=g)
    scales = torch.randint(110, 140, (2, 8, 2), dtype=torch.uint8, generator=g)
    x = mxfp4.dequantize_mxfp4(packed, scales)
    x[..., ::32] = 6.0 * mxfp4.e8m0_decode(scales)  # each block's amax 6 * 2^e: the recipe picks 2^e again
    assert torch.equal(mxfp4.dequantize_mxfp4(*mxfp4.quantize_mxfp4(x)), x)
    w = torch.randn(4, 16, 64, generator=g)
    err = (mxfp4.dequantize_mxfp4(*mxfp4.quantize_mxfp4(w)) - w).norm() / w.norm()
    assert 0.0 < err < 0.2  # E2M1's relative step is up to 1/3 near zero; a power-of-two scale wastes up to 1 bit


def test_gpt_oss_layout_matches_transformers_dequantizer():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(2)
    experts, rows, cols = 3, 10, 64
    blocks_shape, scales_shape = mxfp4.gpt_oss_shapes(rows, cols, experts)
    blocks = torch.randint(0, 256, blocks_shape, dtype=torch.uint8, generator=g)
    # every finite scale byte, 0..254 (Transformers turns the NaN byte 0xFF into inf, the spec NaN)
    scales = torch.arange(experts * rows * 2, dtype=torch.int64).remainder(255).to(torch.uint8).reshape(scales_shape)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, K, N]: the BF16 param's layout
    ours = mxfp4.dequantize_gpt_oss(blocks, scales)
    torch.testing.assert_close(ours.transpose(1, 2), theirs, rtol=0, atol=0)


def test_interleaved_gate_up_is_what_transformers_reads_as_gate_and_up():
    gate, up = torch.randn(2, 3, 5), torch.randn(2, 3, 5)  # [E, I, H]
    fused = mxfp4.interleave_gate_up(gate, up)  # rows [E, 2I, H]
    assert torch.equal(fused[:, ::2], gate) and torch.equal(fused[:, 1::2], up)
    bias = mxfp4.interleave_gate_up(gate[..., 0], up[..., 0], dim=-1)  # [E, 2I]
    assert torch.equal(bias[:, ::2], gate[..., 0]) and torch.equal(bias[:, 1::2], up[..., 0])


def test_bad_layouts_name_the_tensor():
    blocks, scales = torch.zeros(2, 8, 2, 16, dtype=torch.uint8), torch.zeros(2, 8, 2, dtype=torch.uint8)
    mxfp4.check_gpt_oss_blocks("down_proj", blocks, scales, rows=8, cols=64, experts=2)
    with pytest.raises(ValueError, match=r"down_proj_scales: expected uint8 \[2, 8, 2\].*got torch.int8"):
        mxfp4.check_gpt_oss_blocks("down_proj", blocks, scales.view(torch.int8), rows=8, cols=64, experts=2)
    with pytest.raises(ValueError, match=r"down_proj_blocks: expected uint8 \[2, 8, 1, 16\]"):
        mxfp4.check_gpt_oss_blocks("down_proj", blocks, scales, rows=8, cols=32, experts=2)
    with pytest.raises(TypeError, match="E8M0 scales must be uint8"):
        mxfp4.e8m0_decode(torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"MXFP4 scale \[8, 3\] does not match packed \[8, 32\]"):
        mxfp4.dequantize_mxfp4(torch.zeros(8, 32, dtype=torch.uint8), torch.zeros(8, 3, dtype=torch.uint8))
