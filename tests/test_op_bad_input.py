"""A layer's NVFP4 weights, the op and the backends given bad tensors, metadata and modes: checked on every call without a host sync.

As a hostile user would bring them: every case gets an error of a stated type whose message
names the culprit (tensor, file, layer), or the documented correct result."""

import pytest
import torch

import fp4moe_ops
from fp4moe_ops import NVFP4MoEWeights
from bad_input_helpers import layer


# --- NVFP4MoEWeights and quantize_moe_weights ---------------------------------------------------


FIELDS = ("gate_up", "gate_up_scale", "gate_up_global_scale", "down", "down_scale", "down_global_scale")


@pytest.mark.parametrize("field", FIELDS)
def test_moe_weights_wrong_dtype_names_the_tensor(field):
    w = layer()
    tensors = dict(zip(FIELDS, w.tensors()))
    t = tensors[field]
    tensors[field] = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t.to(torch.float16)
    with pytest.raises(TypeError, match=f"{field} must be"):
        NVFP4MoEWeights(**tensors)


def test_moe_weights_raw_scale_bytes_get_a_hint():
    w = layer()
    with pytest.raises(TypeError, match=r"raw E4M3 bytes\? pass t.view\(torch.float8_e4m3fn\)"):
        NVFP4MoEWeights(w.gate_up, w.gate_up_scale.view(torch.uint8), w.gate_up_global_scale, w.down, w.down_scale, w.down_global_scale)


@pytest.mark.parametrize("field", FIELDS[1:])
def test_moe_weights_wrong_shape_names_the_tensor(field):
    w = layer()
    tensors = dict(zip(FIELDS, w.tensors()))
    tensors[field] = tensors[field][:3]  # one expert short
    with pytest.raises(ValueError, match=f"{field} must have shape"):
        NVFP4MoEWeights(**tensors)


@pytest.mark.parametrize("field", ["down", "gate_up_global_scale"])
def test_moe_weights_on_another_device(field):
    w = layer()
    tensors = dict(zip(FIELDS, w.tensors()))
    tensors[field] = tensors[field].to("meta")
    with pytest.raises(ValueError, match=f"{field} is on meta"):
        NVFP4MoEWeights(**tensors)


@pytest.mark.parametrize("which", ["gate_up", "down", "weights"])
def test_empty_expert_stacks(which):
    if which == "weights":
        w = layer()
        with pytest.raises(ValueError, match="is empty"):
            NVFP4MoEWeights(*(t[:0] for t in w.tensors()))
        return
    gate_up, down = torch.randn(2, 64, 32), torch.randn(2, 32, 32)
    if which == "gate_up":
        gate_up = gate_up[:0]
    else:
        down = down[:0]
    with pytest.raises(ValueError, match=f"{which} .* is empty"):
        fp4moe_ops.quantize_moe_weights(gate_up, down)


@pytest.mark.parametrize("field,value,match", [
    ("gate_up_global_scale", float("nan"), r"gate_up_global_scale\[2\] must be finite and > 0 \(got nan\)"),
    ("gate_up_global_scale", float("inf"), r"gate_up_global_scale\[2\] must be finite and > 0 \(got inf\)"),
    ("gate_up_global_scale", 0.0, r"gate_up_global_scale\[2\] must be finite and > 0 \(got 0.0\)"),
    ("gate_up_global_scale", -1e-3, r"gate_up_global_scale\[2\] must be finite and > 0"),
    ("down_global_scale", float("nan"), r"down_global_scale\[2\] must be finite and > 0"),
    ("down_global_scale", 0.0, r"down_global_scale\[2\] must be finite and > 0"),
    ("gate_up_input_scale", float("nan"), r"gate_up_input_scale\[2\] must be finite and >= 0"),
    ("down_input_scale", float("inf"), r"down_input_scale\[2\] must be finite and >= 0"),
    ("down_input_scale", -1.0, r"down_input_scale\[2\] must be finite and >= 0"),
])
def test_scale_values_are_checked_before_use(field, value, match):
    w = layer(scales=True)
    getattr(w, field)[2] = value
    with pytest.raises(ValueError, match=match):
        w.check_values()
    with pytest.raises(ValueError, match=match):  # prepare checks them too (once, not per call)
        fp4moe_ops.prepare_experts(w, "reference")


def test_largest_weights_reduce_the_block_scale_bytes_as_their_float_values():
    from fp4moe_ops.moe_weights import largest_weights

    scale = (torch.rand(5, 32, 8) * 448).to(torch.float8_e4m3fn)
    scale.view(torch.uint8)[1, 3, 2] = 0x80  # -0: valid, and the largest byte as uint8
    scale[4] = 0.0
    scale.view(torch.uint8)[4, 0, 0] = 0x80
    g = torch.rand(5) * 1e-2 + 1e-4
    want = scale.double().flatten(1).amax(1).clamp(min=0) * 6 * g.double()
    assert torch.equal(largest_weights(scale, g), want)


@pytest.mark.parametrize("field", ["gate_up_global_scale", "down_global_scale"])
def test_global_scales_whose_weights_decode_past_bfloat16(field):
    w = layer()
    scale = getattr(w, field.replace("_global_scale", "_scale"))
    fits = torch.finfo(torch.bfloat16).max / (6 * scale[2].float().max().item())
    getattr(w, field)[2] = fits * 0.99
    w.check_values()  # large but representable
    getattr(w, field)[2] = fits * 1.01
    with pytest.raises(ValueError, match=rf"{field}\[2\]: its largest weight would be 3\.4\de\+38"):
        w.check_values()
    with pytest.raises(ValueError, match=rf"{field}\[2\]: its largest weight"):
        fp4moe_ops.prepare_experts(w, "reference")


@pytest.mark.parametrize("field", ["gate_up_scale", "down_scale"])
@pytest.mark.parametrize("byte", [0x7F, 0xFF, 0x81, 0xC0])
def test_e4m3_nan_bytes_and_negative_block_scales(field, byte):
    w = layer()
    getattr(w, field).view(torch.uint8)[1, 3, 0] = byte
    with pytest.raises(ValueError, match=rf"{field}\[1\] holds an E4M3 NaN byte \(0x7F/0xFF\) or a negative block scale"):
        w.check_values()


def test_zero_input_scales_and_negative_zero_block_scales_are_valid():
    w = layer(scales=True)
    w.gate_up_input_scale[1] = 0.0  # an expert calibration never reached
    w.gate_up_scale.view(torch.uint8)[0, 0, 0] = 0x80  # -0
    w.check_values()


@pytest.mark.parametrize("tensor", ["gate_up", "down"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_quantize_moe_weights_rejects_non_finite(tensor, value):
    gate_up, down = torch.randn(2, 64, 32), torch.randn(2, 32, 32)
    (gate_up if tensor == "gate_up" else down)[1, 2, 3] = value
    with pytest.raises(ValueError, match="NaN or Inf"):
        fp4moe_ops.quantize_moe_weights(gate_up, down)


# --- the op: metadata checked on every call (no host syncs) ------------------------------------


def op_args():
    w = layer(scales=True)
    p = fp4moe_ops.prepare_experts(w, "reference")
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    ids = torch.randint(0, 4, (5, 2))
    return w, p, x, ids, torch.rand(5, 2)


@pytest.mark.parametrize("case,error,match", [
    ("hidden_fp32", TypeError, "hidden_states must be .* bfloat16/float16"),
    ("hidden_3d", TypeError, "hidden_states must be"),
    ("ids_float", TypeError, "topk_ids must be"),
    ("ids_1d", TypeError, "topk_ids must be"),
    ("ids_rows", ValueError, "must have T=5 rows"),
    ("weights_bf16", TypeError, "topk_weights must be float32"),
    ("weights_shape", TypeError, "topk_weights must be float32"),
    ("device", ValueError, "topk_weights is on meta"),
    ("scale_shape1", ValueError, r"0-dim scalars or \[E=4\], got torch.float32 \[1\]"),
    ("scale_dtype", ValueError, "float32 0-dim scalars"),
    ("scale_len", ValueError, r"\[E=4\], got torch.float32 \[5\]"),
    ("one_scale", ValueError, None),
    ("backend", ValueError, "unknown fp4moe backend 'cuda9000'"),
    ("five_tensors", ValueError, "expected 6 expert tensors"),
    ("hidden_size", ValueError, "hidden size 32"),
    ("routed_negative", ValueError, "routed_experts must be >= 0"),
])
def test_op_metadata_errors(case, error, match):
    w, p, x, ids, rw = op_args()
    tensors, gate_up_in, down_in, backend, routed = p.op_tensors(), None, None, "reference", 0
    if case == "hidden_fp32":
        x = x.float()
    elif case == "hidden_3d":
        x = x[None]
    elif case == "ids_float":
        ids = ids.float()
    elif case == "ids_1d":
        ids = ids[:, 0]
    elif case == "ids_rows":
        ids, rw = ids[:4], rw[:4]
    elif case == "weights_bf16":
        rw = rw.bfloat16()
    elif case == "weights_shape":
        rw = rw[:, :1]
    elif case == "device":
        rw = rw.to("meta")
    elif case == "scale_shape1":
        gate_up_in, down_in = torch.ones(1), torch.ones(1)
    elif case == "scale_dtype":
        gate_up_in, down_in = torch.ones((), dtype=torch.float16), torch.ones(())
    elif case == "scale_len":
        gate_up_in, down_in = torch.ones(5), torch.ones(4)
    elif case == "one_scale":  # the reference takes scales optionally: one without the other is allowed
        out = torch.ops.fp4moe.fused_moe(x, ids, rw, tensors, w.gate_up_input_scale, None, backend)
        assert torch.isfinite(out).all()
        return
    elif case == "backend":
        backend = "cuda9000"
    elif case == "five_tensors":
        tensors = tensors[:5]
    elif case == "hidden_size":
        x = x[:, :32]
    elif case == "routed_negative":
        routed = -1
    with pytest.raises(error, match=match):
        torch.ops.fp4moe.fused_moe(x, ids, rw, tensors, gate_up_in, down_in, backend, routed)


def test_op_refuses_activation_scales_on_a_16_bit_backend(monkeypatch):
    from fp4moe_ops.backends import BACKENDS

    monkeypatch.setattr(type(BACKENDS["triton"]), "unavailable_reason", lambda self, device: None)
    w, p, x, ids, rw = op_args()
    with pytest.raises(ValueError, match="keeps activations in 16 bits"):
        torch.ops.fp4moe.fused_moe(x, ids, rw, p.op_tensors(), w.gate_up_input_scale, w.down_input_scale, "triton")


# --- activation-scale modes and backends ---------------------------------------------------------


def test_per_expert_mode_refuses_zero_scales_naming_the_experts():
    w = layer(scales=True)
    w.down_input_scale[[1, 3]] = 0.0
    with pytest.raises(ValueError, match=r"down_input_scale is 0 for experts \[1, 3\].*global_max"):
        fp4moe_ops.prepare_experts(w, "reference", "per_expert")
    gate_up_in, down_in = fp4moe_ops.prepare_experts(w, "reference", "global_max").activation_scales()  # the documented way out
    assert down_in == w.down_input_scale.max()


def test_global_max_with_every_scale_zero():
    w = layer(scales=True)
    w.gate_up_input_scale.zero_()
    with pytest.raises(ValueError, match="every calibrated input scale is 0"):
        fp4moe_ops.prepare_experts(w, "reference", "global_max")


@pytest.mark.parametrize("mode", ["per_expert", "global_max", "per_token"])
def test_activation_modes_without_scales_or_unknown(mode):
    w = layer()
    match = "calibrate_activation_scales" if mode != "per_token" else "act_scale_mode must be one of"
    with pytest.raises(ValueError, match=match):
        fp4moe_ops.prepare_experts(w, "reference", mode)


@pytest.mark.parametrize("backend", ["triton", "flashinfer_bf16", "flashinfer_mxfp4", "flashinfer_nvfp4"])
def test_backends_this_device_cannot_run(backend):
    if torch.cuda.is_available():
        pytest.skip("a CPU-machine case")
    with pytest.raises(ValueError, match=rf"'{backend}' cannot run on cpu.*Backends that can: \['reference'\]"):
        fp4moe_ops.prepare_experts(layer(scales=True), backend)


def test_a_failed_set_backend_leaves_the_experts_as_they_were():
    w = layer(scales=True)
    p = fp4moe_ops.prepare_experts(w, "reference")
    x, ids, rw = torch.randn(3, 64, dtype=torch.bfloat16), torch.randint(0, 4, (3, 2)), torch.rand(3, 2)
    before = p(x, ids, rw)
    w.gate_up_input_scale.zero_()  # the module holds these tensors
    with pytest.raises(ValueError, match="gate_up_input_scale is 0"):
        p.set_backend("reference", "per_expert")
    assert p.backend == "reference" and p.act_scale_mode is None and torch.equal(p(x, ids, rw), before)
