"""gpt-oss's experts with NVFP4 weights (ModelOpt's export of gpt-oss): ``fp4moe::gpt_oss_moe`` on
eight NVFP4 tensors against the float64 oracle (the reference backend, and the Triton kernels in
Triton's interpreter on the CPU), the Triton layout's round trip, and the genuine ModelOpt export of
a tiny gpt-oss loaded, run and saved back byte for byte."""

import pytest
import torch

from fp4moe_ops import nvfp4
from fp4moe_ops.oracle64 import gpt_oss_moe64

ALPHA = 1.702  # gpt-oss's swiglu_alpha
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def experts(e, h, i, bias_dtype=torch.bfloat16):
    """Random NVFP4 gpt-oss tensors ``[w13, w13_scale, w13_global, b1, w2, w2_scale, w2_global, b2]``:
    random bytes (every E2M1 code), E4M3 block scales 0.5 .. 4 times per-expert global scales (GEMM1
    outputs of a few units, so limit 7 clamps some), random biases; rows interleave gate and up."""
    def matrix(n, k, scale):
        block = (torch.rand(e, n, k // 16) * 3.5 + 0.5).to(torch.float8_e4m3fn)
        return torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8), block.view(torch.uint8), \
            torch.rand(e) * scale + scale / 2

    bias = lambda shape: (torch.randn(shape) * 0.5).to(bias_dtype)  # noqa: E731
    w13, s13, g13 = matrix(2 * i, h, 0.6 / h**0.5)
    w2, s2, g2 = matrix(h, i, 0.6 / i**0.5)
    return [w13, s13, g13, bias((e, 2 * i)), w2, s2, g2, bias((e, h))]


def routing(t, e, k):
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    ids[-1, -1] = -1  # an unused slot (expert parallelism's sentinel) contributes nothing
    return ids, torch.softmax(torch.randn(t, k), -1)


def check(out, ref):
    # the intermediate stored in bf16 and the output rounded to bf16: a few bf16 ulps (2^-8) of the
    # row scale; over the whole output about one ulp (two in Triton's CPU interpreter, which
    # truncates float32 -> bf16), as the MXFP4 tests
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=2**-6, atol=2**-6 * ref.abs().max().item())
    assert ((out.double() - ref).norm() / ref.norm()).item() < 2**-6


@pytest.mark.parametrize("limit", [7.0, 1.0])
def test_reference_backend_matches_float64(limit):
    e, h, i, t, k = 4, 64, 96, 9, 2
    tensors = experts(e, h, i)
    x = torch.randn(t, h, dtype=torch.bfloat16)
    ids, rw = routing(t, e, k)
    out = torch.ops.fp4moe.gpt_oss_moe(x, ids, rw, tensors, ALPHA, limit, "reference")
    check(out, gpt_oss_moe64(x, ids, rw, tensors, ALPHA, limit))


def test_strided_views_run_as_their_values():
    # the ModelOpt module passes its transposed tensors as views and a shared global scale expanded
    e, h, i = 3, 32, 32
    w13, s13, g13, b1, w2, s2, g2, b2 = experts(e, h, i)
    views = [w13.transpose(1, 2).contiguous().transpose(1, 2), s13.transpose(1, 2).contiguous().transpose(1, 2),
             g13[:1].expand(e), b1, w2.transpose(1, 2).contiguous().transpose(1, 2), s2, g2[:1].expand(e), b2]
    assert not views[0].is_contiguous()
    x = torch.randn(5, h, dtype=torch.bfloat16)
    ids, rw = routing(5, e, 2)
    out = torch.ops.fp4moe.gpt_oss_moe(x, ids, rw, views, ALPHA, 7.0, "reference")
    same = [w13, s13, g13[:1].repeat(e), b1, w2, s2, g2[:1].repeat(e), b2]
    assert torch.equal(out, torch.ops.fp4moe.gpt_oss_moe(x, ids, rw, same, ALPHA, 7.0, "reference"))


def test_op_checks_name_the_tensor():
    tensors = experts(2, 32, 32)
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    ids, rw = routing(3, 2, 2)
    bad = list(tensors)
    bad[3] = bad[3][:, :-2]
    with pytest.raises(ValueError, match=r"b1: expected .*\[2, 64\]"):
        torch.ops.fp4moe.gpt_oss_moe(x, ids, rw, bad, ALPHA, 7.0, "reference")
    bad = list(tensors)
    bad[2] = bad[2].double()
    with pytest.raises(ValueError, match=r"w13_global: expected torch.float32"):
        torch.ops.fp4moe.gpt_oss_moe(x, ids, rw, bad, ALPHA, 7.0, "reference")


@pytest.mark.parametrize("h,i", [(320, 320), (96, 160)])
def test_kernel_layout_round_trip_is_byte_exact(h, i):
    layout = pytest.importorskip("fp4moe_ops.backends.triton_moe.layout")
    tensors = experts(3, h, i)
    kernel = layout.gpt_oss_kernel_tensors(tensors)
    hp, ip = -(-h // 256) * 256, -(-i // 256) * 256
    assert [(t.dtype, tuple(t.shape)) for t in kernel] == [
        (torch.int32, (3, ip, hp // 4)), (torch.uint8, (3, 2 * ip, hp // 16)), (torch.float32, (3,)),
        (torch.float32, (3, 2 * ip)), (torch.int32, (3, hp // 2, ip // 4)), (torch.uint8, (3, hp, ip // 16)),
        (torch.float32, (3,)), (torch.float32, (3, hp))]
    back = layout.gpt_oss_checkpoint_tensors(kernel, h, i, torch.bfloat16)
    for a, b in zip(tensors, back):
        assert a.dtype == b.dtype and torch.equal(a, b)
    # the same values, independent of the kernels: rows [gate; up] de-interleaved, zeros in the padding
    values = nvfp4.dequantize_nvfp4(layout.canonical_from_paired(kernel[0]), kernel[1].view(torch.float8_e4m3fn),
                                    kernel[2], torch.float64)
    dense = nvfp4.dequantize_nvfp4(tensors[0], tensors[1].view(torch.float8_e4m3fn), tensors[2], torch.float64)
    assert torch.equal(values[:, :i, :h], dense[:, 0::2]) and torch.equal(values[:, ip:ip + i, :h], dense[:, 1::2])
    assert not values[:, i:ip].any() and not values[:, :, h:].any()


@pytest.mark.parametrize("t,k,limit", [(1, 4, 7.0), (6, 2, 1.0)])
def test_triton_single_role_kernels_match_float64(t, k, limit):
    # the TMA path with paired weights (merged gate/up tiles), H and I padded 320 -> 512, E4M3 scales
    # and per-expert global scales; one token (a row block per slot) and several (routed blocks)
    triton_moe = pytest.importorskip("fp4moe_ops.backends.triton_moe")
    e, h, i = 4, 320, 320
    tensors = experts(e, h, i)
    x = torch.randn(t, h, dtype=torch.bfloat16)
    ids, rw = routing(t, e, k)
    cfg = triton_moe.kernel_config(t * k, e, 512, 512) | {"GLUON_PREFILL": False, "DECODE_V3": False}
    kernel = [a.to(DEVICE) for a in triton_moe.gpt_oss_kernel_tensors(tensors)]
    out = triton_moe.triton_gpt_oss_moe(x.to(DEVICE), ids.to(DEVICE), rw.to(DEVICE), kernel, ALPHA, limit, cfg).cpu()
    check(out, gpt_oss_moe64(x, ids, rw, tensors, ALPHA, limit))
