"""The fp4moe::fused_moe op: reference numerics vs float64, opcheck, compile, bad input."""

import pytest
import torch

import fp4moe_ops
from fp4moe_ops import nvfp4
from fp4moe_ops.oracle64 import moe64


def make_layer(e=6, h=64, i=32, scale_spread=True, with_act_scales=False):
    gate_up = torch.randn(e, 2 * i, h) / h**0.5
    down = torch.randn(e, h, i) / i**0.5
    if scale_spread:  # experts of very different magnitudes
        gate_up *= torch.logspace(-1, 1, e)[:, None, None]
    w = fp4moe_ops.quantize_moe_weights(gate_up, down)
    if with_act_scales:
        w.gate_up_input_scale = torch.rand(e) * 0.002 + 0.0005
        w.down_input_scale = torch.rand(e) * 0.002 + 0.0005
    return w


def routing(t, e, k):
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)]) if t else torch.zeros(0, k, dtype=torch.long)
    weights = torch.rand(t, k)
    return ids, weights


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_reference_w4a16_matches_float64(dtype, ids_dtype):
    w = make_layer()
    x = torch.randn(9, 64, dtype=dtype)
    ids, rw = routing(9, 6, 3)
    out = fp4moe_ops.prepare_experts(w, "reference")(x, ids.to(ids_dtype), rw)
    assert out.dtype == dtype and out.shape == x.shape
    ref = moe64(x, ids, rw, *w.tensors())
    # Differences: fp32 accumulation order (~1e-6), the bf16/fp16 intermediate rounding of
    # the reference vs float64 rounding of the same values (identical up to rare 1-ulp flips),
    # and the final cast to dtype (bf16: 2^-8 relative per element).
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    assert rel < (4e-3 if dtype == torch.bfloat16 else 1e-3), rel
    assert torch.isfinite(out).all()


def test_reference_nvfp4_activations_per_expert_and_global():
    w = make_layer(with_act_scales=True)
    x = torch.randn(7, 64, dtype=torch.bfloat16) * 0.3
    ids, rw = routing(7, 6, 2)
    # the activation quantizer's definition is tested in test_nvfp4_format
    quant = lambda v, s: nvfp4.quantize_activation_nvfp4(v, 1.0 / s) * s
    for mode in fp4moe_ops.ACT_SCALE_MODES:
        gate_up_in, down_in = fp4moe_ops.activation_scales(w.gate_up_input_scale, w.down_input_scale, mode)
        out = torch.ops.fp4moe.fused_moe(x, ids, rw, fp4moe_ops.prepare_experts(w, "reference").op_tensors(),
                                         gate_up_in, down_in, "reference")
        ref = moe64(x, ids, rw, *w.tensors(), gate_up_input_scale=gate_up_in, down_input_scale=down_in, quant=quant)
        rel = ((out.double() - ref).norm() / ref.norm()).item()
        assert rel < 4e-3, (mode, rel)
    # prepare_experts: W4A16 unless asked; asked on a 16-bit-activation backend, a clear error
    assert fp4moe_ops.prepare_experts(w, "reference").activation_scales() == (None, None)
    gate_up_in, down_in = fp4moe_ops.prepare_experts(w, "reference", act_scale_mode="global_max").activation_scales()
    assert gate_up_in.shape == down_in.shape == ()
    w.down_input_scale = None
    with pytest.raises(ValueError, match="calibrate_activation_scales"):
        fp4moe_ops.prepare_experts(w, "reference", act_scale_mode="per_expert")


def test_out_of_range_ids_contribute_nothing_and_t0():
    w = make_layer()
    p = fp4moe_ops.prepare_experts(w, "reference")
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    ids, rw = routing(5, 6, 2)
    sentinel = ids.clone()
    sentinel[:, 1] = torch.tensor([-1, 6, 100, -7, 6])
    expected = p(x, ids[:, :1], rw[:, :1])
    torch.testing.assert_close(p(x, sentinel, rw), expected, rtol=0, atol=0)
    empty = p(x[:0], ids[:0], rw[:0])
    assert empty.shape == (0, 64)


def test_opcheck():
    w = make_layer(with_act_scales=True)
    p = fp4moe_ops.prepare_experts(w, "reference")
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    ids, rw = routing(4, 6, 2)
    op = torch.ops.fp4moe.fused_moe.default
    torch.library.opcheck(op, (x, ids, rw, p.op_tensors(), None, None, "reference"))
    torch.library.opcheck(op, (x, ids, rw, p.op_tensors(), w.gate_up_input_scale, w.down_input_scale, "reference"))


def test_compile_fullgraph_dynamic_tokens_no_recompile():
    import torch._dynamo.testing

    w = make_layer()
    p = fp4moe_ops.prepare_experts(w, "reference")
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")

    def layer(x, ids, rw):
        return p(x * 2, ids, rw) + 1

    compiled = torch.compile(layer, fullgraph=True, backend=counter)
    torch._dynamo.reset()
    for t in (3, 5, 11):
        x = torch.randn(t, 64, dtype=torch.bfloat16)
        ids, rw = routing(t, 6, 2)
        if t == 3:
            for a in (x, ids, rw):
                torch._dynamo.mark_dynamic(a, 0)
        torch.testing.assert_close(compiled(x, ids, rw), layer(x, ids, rw), rtol=0, atol=0)
    assert counter.frame_count == 1, counter.frame_count


def test_bad_inputs_have_clear_errors():
    w = make_layer()
    p = fp4moe_ops.prepare_experts(w, "reference")
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    ids, rw = routing(4, 6, 2)
    op = torch.ops.fp4moe.fused_moe
    with pytest.raises(TypeError, match="hidden_states must be"):
        op(x.float(), ids, rw, p.op_tensors(), None, None, "reference")
    with pytest.raises(TypeError, match="topk_ids must be"):
        op(x, ids.float(), rw, p.op_tensors(), None, None, "reference")
    with pytest.raises(TypeError, match="topk_weights must be float32"):
        op(x, ids, rw.bfloat16(), p.op_tensors(), None, None, "reference")
    with pytest.raises(ValueError, match="T=4 rows"):
        op(x, ids[:3], rw[:3], p.op_tensors(), None, None, "reference")
    with pytest.raises(ValueError, match="hidden size 32"):
        op(x[:, :32], ids, rw, p.op_tensors(), None, None, "reference")
    with pytest.raises(ValueError, match="is on meta"):
        op(x, ids.to("meta"), rw, p.op_tensors(), None, None, "reference")
    with pytest.raises(ValueError, match=r"float32 0-dim scalars or \[E=6\]"):
        op(x, ids, rw, p.op_tensors(), torch.ones(5), None, "reference")
    with pytest.raises(ValueError, match=r"float32 0-dim scalars or \[E=6\], got torch.float32 \[1\]"):
        op(x, ids, rw, p.op_tensors(), torch.ones(1), torch.ones(1), "reference")  # FlashInfer reads [1] as per-expert
    with pytest.raises(ValueError, match="unknown fp4moe backend"):
        op(x, ids, rw, p.op_tensors(), None, None, "nope")
    with pytest.raises(ValueError, match="expected 6 expert tensors"):
        op(x, ids, rw, p.op_tensors()[:5], None, None, "reference")


def test_bad_weights_have_clear_errors():
    w = make_layer()
    with pytest.raises(TypeError, match="gate_up_scale must be torch.float8_e4m3fn"):
        fp4moe_ops.NVFP4MoEWeights(w.gate_up, w.gate_up_scale.view(torch.uint8), w.gate_up_global_scale, w.down, w.down_scale, w.down_global_scale)
    with pytest.raises(ValueError, match=r"down must have shape \[6, 64, 16\]"):
        fp4moe_ops.NVFP4MoEWeights(w.gate_up, w.gate_up_scale, w.gate_up_global_scale, w.down[:, :, :8], w.down_scale, w.down_global_scale)
    with pytest.raises(ValueError, match="multiple of 16"):
        fp4moe_ops.quantize_moe_weights(torch.randn(2, 16, 40), torch.randn(2, 40, 8))
    with pytest.raises(ValueError, match="down must be"):
        fp4moe_ops.quantize_moe_weights(torch.randn(2, 64, 32), torch.randn(2, 32, 16))
    bad = torch.randn(2, 64, 32)
    bad[1, 3, 5] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        fp4moe_ops.quantize_moe_weights(bad, torch.randn(2, 32, 32))


def test_backend_selection():
    w = make_layer()
    assert fp4moe_ops.prepare_experts(w, "auto").backend == "reference"  # CPU
    assert "reference" in fp4moe_ops.available_backends("cpu")
    for name in ("triton", "flashinfer_nvfp4", "flashinfer_bf16", "flashinfer_mxfp4"):
        if name in fp4moe_ops.BACKENDS:
            with pytest.raises(ValueError, match=r"cannot run on cpu.*Backends that can: \['reference'"):
                fp4moe_ops.prepare_experts(w, name)
    with pytest.raises(ValueError, match="unknown fp4moe backend"):
        fp4moe_ops.prepare_experts(w, "cutlass9000")


def test_routed_experts_hint_is_checked_and_changes_no_result():
    w = make_layer()
    tensors = fp4moe_ops.prepare_experts(w, "reference").op_tensors()
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    ids, rw = routing(5, 6, 2)
    plain = torch.ops.fp4moe.fused_moe(x, ids, rw, tensors, None, None, "reference")
    hinted = torch.ops.fp4moe.fused_moe(x, ids, rw, tensors, None, None, "reference", 48)
    assert torch.equal(plain, hinted)
    with pytest.raises(ValueError, match="routed_experts"):
        torch.ops.fp4moe.fused_moe(x, ids, rw, tensors, None, None, "reference", -1)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode, pytest.raises(ValueError, match="routed_experts"):  # at trace time too
        fake = [mode.from_tensor(v) for v in (x, ids, rw)]
        torch.ops.fp4moe.fused_moe(*fake, [mode.from_tensor(v) for v in tensors], None, None, "reference", -1)


def test_a_nan_expert_never_reaches_tokens_not_routed_to_it():
    """The reference backend computes only the routed (token, expert) pairs: an expert with NaN
    scales (which the loaders refuse; this is the op's own isolation) changes nothing for the
    other tokens, expert-parallel sentinels included, and makes its own tokens NaN."""
    w = make_layer()
    bad = fp4moe_ops.NVFP4MoEWeights(*(t.clone() for t in w.tensors()))
    bad.gate_up_global_scale[2] = float("nan")
    bad.down_global_scale[2] = float("inf")
    x = torch.randn(10, 64, dtype=torch.bfloat16)
    ids, rw = routing(10, 6, 2)
    ids = torch.where(ids == 2, 4, ids)
    ids[0, 1] = -1
    clean = fp4moe_ops.prepare_experts(w, "reference")(x, ids, rw)
    dirty = fp4moe_ops.prepare_experts(bad, "reference", check_values=False)(x, ids, rw)
    assert torch.isfinite(dirty).all() and torch.equal(dirty, clean)
    ids[3, 0] = 2
    out = fp4moe_ops.prepare_experts(bad, "reference", check_values=False)(x, ids, rw)
    assert torch.isnan(out[3]).all() and torch.equal(out[4:], clean[4:])


@pytest.mark.parametrize("name", ["fused_moe", "gpt_oss_moe", "grouped_topk", "softmax_topk", "nvfp4_linear"])
def test_help_on_each_public_op_shows_its_signature_and_docstring(name):
    import pydoc

    shown = pydoc.render_doc(getattr(fp4moe_ops, name), renderer=pydoc.plaintext)
    # the argument names come from the op's registered schema, not from the function help() reads
    schema = getattr(torch.ops.fp4moe, name).default._schema
    assert f"{name}({schema.arguments[0].name}" in shown
    assert all(a.name in shown for a in schema.arguments)
    assert "CustomOpDef" not in shown and len(shown.splitlines()) > 4  # a docstring, not torch's class


def test_version_is_the_packages():
    tomllib = pytest.importorskip("tomllib")
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert fp4moe_ops.__version__ == pyproject["project"]["version"]


def cpu_call():
    """A valid call's inputs on the CPU: hidden states, ids, weights, the canonical expert tensors."""
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    return (x, *routing(3, 6, 2), fp4moe_ops.prepare_experts(make_layer(), "reference").op_tensors())


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors on a GPU backend: this machine has a GPU")
def test_a_gpu_backend_on_cpu_tensors_names_the_backend_in_the_real_and_the_fake_call():
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, ids, rw, tensors = cpu_call()
    # the Triton backend takes the canonical tensors too: every metadata check passes, the device does not
    with pytest.raises(ValueError, match=r"fp4moe backend 'triton' cannot run on cpu \(hidden_states is on "
                                         r"cpu\): needs a CUDA GPU"):
        fp4moe_ops.fused_moe(x, ids, rw, tensors, None, None, "triton")
    with FakeTensorMode() as mode, pytest.raises(ValueError, match=r"'triton' cannot run on cpu"):
        fp4moe_ops.fused_moe(*(mode.from_tensor(t) for t in (x, ids, rw)),
                             [mode.from_tensor(t) for t in tensors], None, None, "triton")


def test_a_device_mismatch_names_the_argument_and_the_backend():
    x, ids, rw, tensors = cpu_call()
    with pytest.raises(ValueError, match=r"topk_weights is on meta but hidden_states is on cpu \(fp4moe backend "
                                         r"'reference'\)"):
        fp4moe_ops.fused_moe(x, ids, rw.to("meta"), tensors, None, None, "reference")
    moved = [t.to("meta") if i == 4 else t for i, t in enumerate(tensors)]
    with pytest.raises(ValueError, match=r"expert_tensors\[4\] is on meta but hidden_states is on cpu"):
        fp4moe_ops.fused_moe(x, ids, rw, moved, None, None, "reference")
    q = nvfp4.quantize_nvfp4(torch.randn(32, 64))
    with pytest.raises(ValueError, match=r"global_scale is on meta but x is on cpu \(nvfp4_linear backend "
                                         r"'reference'\)"):
        fp4moe_ops.nvfp4_linear(x, q.packed, q.block_scale, q.global_scale.reshape(()).to("meta"), backend="reference")
