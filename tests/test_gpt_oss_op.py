"""fp4moe::gpt_oss_moe, gpt-oss's MXFP4 experts: the reference backend against the float64 oracle and
against Transformers' own GptOss experts and MLP on the same decoded weights; opcheck, compile,
backend choice and bad input."""

import logging
import re

import pytest
import torch

import fp4moe_ops
from fp4moe_ops import mxfp4
from fp4moe_ops.backends import BACKENDS
from fp4moe_ops.gpt_oss_op import MXFP4_EXPERT_TENSORS
from fp4moe_ops.oracle64 import gpt_oss_moe64

SWIGLU_ALPHA = 1.702  # gpt-oss's swiglu_alpha


def make_experts(e=5, h=64, i=96, seed=0, bias_dtype=torch.bfloat16):
    """Random gpt-oss expert tensors in the checkpoint layout: random bytes (every code), E8M0 scales
    2^-6..2^-2 (gate_up GEMM outputs of a few units, so a small ``limit`` clamps some), random biases."""
    g = torch.Generator().manual_seed(seed)
    (gub, gus), (db, ds) = mxfp4.gpt_oss_shapes(2 * i, h, e), mxfp4.gpt_oss_shapes(h, i, e)
    byte = lambda shape: torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    scale = lambda shape: torch.randint(121, 126, shape, dtype=torch.uint8, generator=g)
    bias = lambda shape: (torch.randn(shape, generator=g) * 0.5).to(bias_dtype)
    return [byte(gub), scale(gus), bias((e, 2 * i)), byte(db), scale(ds), bias((e, h))]


def routing(t, e, k, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if t else torch.zeros(0, k, dtype=torch.long)
    return ids, torch.rand(t, k, generator=g)


@pytest.mark.parametrize("dtype,limit", [(torch.bfloat16, 1.0), (torch.float16, 1.0), (torch.float32, 1.0),
                                         (torch.float32, 7.0)])
def test_reference_matches_float64_oracle(dtype, limit):
    tensors = make_experts()
    x = torch.randn(11, 64).to(dtype)
    ids, rw = routing(11, 5, 2)
    out = torch.ops.fp4moe.gpt_oss_moe(x, ids, rw, tensors, SWIGLU_ALPHA, limit, "reference")
    assert out.dtype == dtype and out.shape == x.shape
    ref = gpt_oss_moe64(x, ids, rw, tensors, SWIGLU_ALPHA, limit)
    # the clamps bite: some gate outputs are above limit and some up outputs outside +-limit
    h = x.double() @ mxfp4.dequantize_gpt_oss(tensors[0], tensors[1], torch.float64)[0].T
    if limit == 1.0:
        assert (h[:, ::2] > limit).any() and (h[:, 1::2] < -limit).any()
    # float32: only accumulation order differs (~1e-6); 16-bit: the intermediate rounded to dtype on both
    # sides (rare 1-ulp flips where float32 and float64 gate_up GEMMs round differently) and the output cast
    # (bf16 2^-8, fp16 2^-11 relative per element)
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    assert rel < {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 4e-3}[dtype], rel


def _transformers_mlp(tensors, h, i, e, k, dtype):
    """Transformers' GptOssMLP (router and experts) holding the decoded weights, in ``dtype``."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    config = GptOssConfig(hidden_size=h, intermediate_size=i, num_local_experts=e, num_experts_per_tok=k,
                          swiglu_limit=1.0)
    mlp = GptOssMLP(config)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        mlp.router.weight.copy_(torch.randn(e, h, generator=g))
        mlp.router.bias.copy_(torch.randn(e, generator=g))
        # Transformers holds [E, H, 2I] / [E, I, H]: the transposes of the checkpoint's row-major matrices
        mlp.experts.gate_up_proj.copy_(mxfp4.dequantize_gpt_oss(tensors[0], tensors[1]).transpose(1, 2))
        mlp.experts.down_proj.copy_(mxfp4.dequantize_gpt_oss(tensors[3], tensors[4]).transpose(1, 2))
        mlp.experts.gate_up_proj_bias.copy_(tensors[2].float())
        mlp.experts.down_proj_bias.copy_(tensors[5].float())
    return mlp.to(dtype)


@pytest.mark.skipif(not __import__("hf_integration.mxfp4_quantizer").mxfp4_quantizer.supported(),
                    reason="Transformers' gpt-oss before 5.24 differs (see hf_integration.mxfp4_quantizer)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_transformers_gpt_oss_mlp(dtype):
    e, h, i, k = 5, 64, 96, 2
    tensors = make_experts(e, h, i)
    mlp = _transformers_mlp(tensors, h, i, e, k, dtype)
    x = torch.randn(1, 13, h).to(dtype)
    with torch.no_grad():
        expected, _ = mlp(x)
        _, scores, ids = mlp.router(x.reshape(-1, h))  # Transformers' router: softmax over the top-k logits
        ours = torch.ops.fp4moe.gpt_oss_moe(x.reshape(-1, h), ids, scores.float(), tensors, SWIGLU_ALPHA, 1.0, "reference")
    rel = ((ours.double() - expected.reshape(-1, h).double()).norm() / expected.double().norm()).item()
    # float32: the same math, accumulation order only. bfloat16: Transformers rounds every step to bf16
    # (GEMM outputs, bias adds, the activation, each weighted expert output, the sum), fp4moe only the
    # intermediate and the output: a few bf16 roundings (2^-8 each) apart
    assert rel < (1e-5 if dtype == torch.float32 else 2e-2), rel


def test_out_of_range_ids_contribute_nothing_and_no_tokens():
    tensors = make_experts()
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    ids, rw = routing(5, 5, 2)
    sentinel = ids.clone()
    sentinel[:, 1] = torch.tensor([-1, 5, 100, -7, 5])
    op = torch.ops.fp4moe.gpt_oss_moe
    torch.testing.assert_close(op(x, sentinel, rw, tensors, SWIGLU_ALPHA, 7.0, "reference"),
                               op(x, ids[:, :1], rw[:, :1], tensors, SWIGLU_ALPHA, 7.0, "reference"), rtol=0, atol=0)
    assert op(x[:0], ids[:0], rw[:0], tensors, SWIGLU_ALPHA, 7.0, "reference").shape == (0, 64)


def test_opcheck():
    tensors = make_experts(e=3, h=32, i=32)
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    ids, rw = routing(4, 3, 2)
    torch.library.opcheck(torch.ops.fp4moe.gpt_oss_moe.default, (x, ids, rw, tensors, SWIGLU_ALPHA, 7.0, "reference"))


def test_compile_fullgraph_dynamic_tokens_no_recompile():
    import torch._dynamo.testing

    tensors = make_experts()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")

    def layer(x, ids, rw):
        return torch.ops.fp4moe.gpt_oss_moe(x * 2, ids, rw, tensors, SWIGLU_ALPHA, 7.0, "reference") + 1

    compiled = torch.compile(layer, fullgraph=True, backend=counter)
    torch._dynamo.reset()
    for t in (3, 5, 11):
        x = torch.randn(t, 64, dtype=torch.bfloat16)
        ids, rw = routing(t, 5, 2)
        if t == 3:
            for a in (x, ids, rw):
                torch._dynamo.mark_dynamic(a, 0)
        torch.testing.assert_close(compiled(x, ids, rw), layer(x, ids, rw), rtol=0, atol=0)
    assert counter.frame_count == 1, counter.frame_count


def test_triton_refuses_with_its_reason_and_auto_falls_to_reference(monkeypatch, caplog):
    reason = BACKENDS["triton"].gpt_oss_refusal(torch.device("cpu"))
    assert reason  # on the CPU: it needs CUDA
    tensors = make_experts(e=3, h=32, i=32)
    x = torch.randn(2, 32, dtype=torch.bfloat16)
    ids, rw = routing(2, 3, 2)
    with pytest.raises(ValueError, match=r"backend 'triton' cannot run gpt-oss's experts"):
        torch.ops.fp4moe.gpt_oss_moe(x, ids, rw, tensors, SWIGLU_ALPHA, 7.0, "triton")
    # as on an Ampere GPU (triton runs NVFP4 there, FlashInfer is not installed): triton refuses these
    # experts (its MXFP4 path is the TMA kernels'), saying why, and auto says so
    for name, backend in BACKENDS.items():
        if name != "reference":
            simulated = None if name == "triton" else "FlashInfer is not installed"
            monkeypatch.setattr(backend, "unavailable_reason", lambda device, r=simulated: r)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    reason = BACKENDS["triton"].gpt_oss_refusal(torch.device("cuda"))
    assert "compute capability 9.0+" in reason
    with pytest.raises(ValueError, match=r"'triton' cannot run gpt-oss's experts on cuda: .*9\.0\+.*"
                                         r"Backends that can: \[.*'reference'"):
        fp4moe_ops.resolve_gpt_oss_backend("triton", "cuda")
    with caplog.at_level(logging.WARNING, logger="fp4moe"):
        assert fp4moe_ops.resolve_gpt_oss_backend("auto", "cuda").name == "reference"
    assert "'triton' does not run them (gpt-oss's experts run on its TMA kernels" in caplog.text
    # on Hopper auto takes triton
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fp4moe_ops.resolve_gpt_oss_backend("auto", "cuda").name == "triton"
    caplog.clear()
    monkeypatch.undo()
    with caplog.at_level(logging.WARNING, logger="fp4moe"):
        assert fp4moe_ops.resolve_gpt_oss_backend("auto", "cpu").name == "reference"
    assert caplog.text == ""  # on the CPU nothing faster was passed over


def test_triton_takes_its_own_layout_only():
    # the checkpoint's tensors on the triton backend are refused with the way to convert them
    from fp4moe_ops.backends.triton_moe import gpt_oss_kernel_tensors

    tensors = make_experts(e=3, h=64, i=32)
    with pytest.raises(ValueError, match=r"its own layout .*gpt_oss_kernel_tensors"):
        BACKENDS["triton"].check_gpt_oss_tensors(tensors, 64)
    kernel = gpt_oss_kernel_tensors(tensors)
    assert BACKENDS["triton"].check_gpt_oss_tensors(kernel, 64) == 3
    with pytest.raises(ValueError, match=r"kernel tensor down_bias: expected torch.float32"):
        BACKENDS["triton"].check_gpt_oss_tensors(kernel[:5] + [kernel[5].bfloat16()], 64)


def test_bad_inputs_name_the_culprit():
    tensors = make_experts(e=3, h=64, i=32)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    ids, rw = routing(4, 3, 2)
    op = torch.ops.fp4moe.gpt_oss_moe
    with pytest.raises(TypeError, match="hidden_states must be"):
        op(x.double(), ids, rw, tensors, SWIGLU_ALPHA, 7.0, "reference")
    with pytest.raises(TypeError, match="topk_weights must be float32"):
        op(x, ids, rw.bfloat16(), tensors, SWIGLU_ALPHA, 7.0, "reference")
    with pytest.raises(ValueError, match=r"gate_up_proj_blocks: expected uint8 \[3, 64, 1, 16\]"):
        op(x[:, :32], ids, rw, tensors, SWIGLU_ALPHA, 7.0, "reference")
    with pytest.raises(ValueError, match=r"down_proj_bias: expected bfloat16/float16/float32 \[3, 64\]"):
        op(x, ids, rw, tensors[:5] + [tensors[5][:, :8]], SWIGLU_ALPHA, 7.0, "reference")
    with pytest.raises(ValueError, match=r"down_proj_scales: expected uint8"):
        op(x, ids, rw, tensors[:4] + [tensors[4].view(torch.int8), tensors[5]], SWIGLU_ALPHA, 7.0, "reference")
    with pytest.raises(ValueError, match=re.escape(f"expected 6 expert tensors {list(MXFP4_EXPERT_TENSORS)}, got 5")):
        op(x, ids, rw, tensors[:5], SWIGLU_ALPHA, 7.0, "reference")
    with pytest.raises(ValueError, match="limit"):
        op(x, ids, rw, tensors, SWIGLU_ALPHA, float("nan"), "reference")
    with pytest.raises(ValueError, match="is on meta"):
        op(x, ids.to("meta"), rw, tensors, SWIGLU_ALPHA, 7.0, "reference")
    with pytest.raises(ValueError, match="unknown fp4moe backend"):
        op(x, ids, rw, tensors, SWIGLU_ALPHA, 7.0, "nope")
