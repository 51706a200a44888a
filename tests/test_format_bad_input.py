"""The format functions (quantize, pack, swizzle, dequantize) given bad values, shapes and dtypes.

As a hostile user would bring them: every case gets an error of a stated type whose message
names the culprit (tensor, file, layer), or the documented correct result."""

import pytest
import torch

from fp4moe_ops import mxfp4, nvfp4


# --- format functions ------------------------------------------------------------------------


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_quantize_nvfp4_rejects_non_finite(value):
    x = torch.randn(4, 32)
    x[1, 5] = value
    with pytest.raises(ValueError, match=r"x \(4, 32\) contains NaN or Inf"):
        nvfp4.quantize_nvfp4(x)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_quantize_mxfp4_rejects_non_finite_like_nvfp4(value):
    x = torch.randn(4, 64)
    x[0, 0] = value
    with pytest.raises(ValueError, match=r"quantize_mxfp4: x \(4, 64\) contains NaN or Inf"):
        mxfp4.quantize_mxfp4(x)


@pytest.mark.parametrize("x,error,match", [
    (torch.randn(4, 40), ValueError, "K a multiple of 16"),
    (torch.randn(64), ValueError, r"\[\.\.\., N, K\]"),
    (torch.randint(0, 5, (4, 32)), TypeError, "float32/bfloat16/float16"),
    (torch.randn(4, 32).to(torch.float8_e4m3fn), TypeError, "float32/bfloat16/float16"),
])
def test_quantize_nvfp4_bad_shapes_and_dtypes(x, error, match):
    with pytest.raises(error, match=match):
        nvfp4.quantize_nvfp4(x)


@pytest.mark.parametrize("g", [torch.tensor(float("nan")), torch.tensor(0.0), torch.tensor(-1e-3),
                               torch.tensor(float("inf"))])
def test_quantize_nvfp4_rejects_bad_global_scales(g):
    with pytest.raises(ValueError, match="global_scale must be finite and > 0"):
        nvfp4.quantize_nvfp4(torch.randn(4, 32), g)


@pytest.mark.parametrize("x,error,match", [
    (torch.randn(4, 48), ValueError, "K a multiple of 32"),
    (torch.randint(0, 5, (4, 64)), TypeError, "float32/bfloat16/float16"),
])
def test_quantize_mxfp4_bad_shapes_and_dtypes(x, error, match):
    with pytest.raises(error, match=match):
        mxfp4.quantize_mxfp4(x)


def test_pack_and_unpack_bad_input():
    with pytest.raises(ValueError, match="even last dim"):
        nvfp4.pack_e2m1(torch.zeros(3, 5, dtype=torch.uint8))
    with pytest.raises(TypeError, match="packed E2M1 must be uint8"):
        nvfp4.unpack_e2m1(torch.zeros(3, 4, dtype=torch.int32))


@pytest.mark.parametrize("shape", [(100, 4), (128, 3), (256 * 8,), (3, 127, 8)])
def test_unswizzle_with_shapes_that_do_not_fit(shape):
    with pytest.raises(ValueError, match=r"holds no \[128, 8\] scales"):
        nvfp4.unswizzle_block_scale(torch.zeros(shape, dtype=torch.uint8), 128, 8)


def test_dequantize_with_raw_scale_bytes_or_mismatched_scales():
    q = nvfp4.quantize_nvfp4(torch.randn(2, 8, 32))
    with pytest.raises(TypeError, match=r"block_scale must be float8_e4m3fn, got torch.uint8 \(raw E4M3 bytes"):
        nvfp4.dequantize_nvfp4(q.packed, q.block_scale.view(torch.uint8), q.global_scale)
    with pytest.raises(ValueError, match="does not match packed"):
        nvfp4.dequantize_nvfp4(q.packed, q.block_scale[:, :, :1], q.global_scale)
    with pytest.raises(ValueError, match=r"global_scale \[3\] must be \[\] or one per matrix \[2\]"):
        nvfp4.dequantize_nvfp4(q.packed, q.block_scale, torch.ones(3))



@pytest.mark.parametrize("shape,g,error,match", [
    ((3, 4, 32), torch.ones(2), ValueError, r"global_scale \[2\] must be \[\] or one per matrix \[3\]"),
    ((4, 32), torch.ones(4), ValueError, r"global_scale \[4\] must be \[\] or one per matrix \[\]"),
    ((3, 4, 32), torch.ones(3, 1), ValueError, r"global_scale \[3, 1\] must be \[\] or one per matrix \[3\]"),
    ((2, 3, 4, 32), torch.ones(3, 2), ValueError, r"global_scale \[3, 2\] must be"),
    ((4, 32), 0.5, TypeError, "global_scale must be a float tensor, got float"),
    ((4, 32), torch.tensor(1), TypeError, "global_scale must be a float tensor, got a torch.int64 tensor"),
])
def test_quantize_nvfp4_with_a_global_scale_of_the_wrong_shape_or_type(shape, g, error, match):
    with pytest.raises(error, match=rf"quantize_nvfp4: {match}"):
        nvfp4.quantize_nvfp4(torch.randn(shape), g)


@pytest.mark.parametrize("g_shape", [(), (1,), (3,), (2, 1), (2, 3)])
def test_quantize_nvfp4_global_scales_that_expand_are_per_matrix(g_shape):
    x = torch.randn(2, 3, 4, 32)
    g = torch.rand(g_shape) * 1e-3 + 1e-4
    q = nvfp4.quantize_nvfp4(x, g)
    full = g.expand(2, 3)
    for i in range(2):
        for j in range(3):  # each matrix alone with its own scalar: the same bytes
            one = nvfp4.quantize_nvfp4(x[i, j], full[i, j].clone())
            assert torch.equal(q.packed[i, j], one.packed) and torch.equal(q.global_scale[i, j], full[i, j])
            assert torch.equal(q.block_scale[i, j].view(torch.uint8), one.block_scale.view(torch.uint8))
