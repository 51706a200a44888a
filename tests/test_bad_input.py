"""Bad values and bad files, as a hostile user would bring them: every case gets an error of a
stated type whose message names the culprit (tensor, file, layer), or the documented correct
result; a failed patch leaves the model exactly as it was (it still runs and gives its old
logits); a failed save leaves the previous checkpoint loadable with its old logits."""

import json
import os
import re
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import fp4moe_ops
from fp4moe_ops import NVFP4MoEWeights, mxfp4, nvfp4
from hf_integration import (
    CheckpointError,
    calibrate_activation_scales,
    load_modelopt_nvfp4,
    patch_deepseek,
    patch_moe,
    quantize_linears,
    save_modelopt_nvfp4,
    set_backend,
)
from hf_integration.tiny_models import tiny_deepseek_v3, tiny_qwen3_moe, write_modelopt_checkpoint

E3 = "model.layers.1.mlp.experts.3"


def layer(e=4, h=64, i=32, scales=False):
    w = fp4moe_ops.quantize_moe_weights(torch.randn(e, 2 * i, h) / h**0.5, torch.randn(e, h, i) / i**0.5)
    if scales:
        w.fc1_input_scale, w.fc2_input_scale = torch.rand(e) * 1e-3 + 1e-4, torch.rand(e) * 1e-3 + 1e-4
    return w


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


IDS = torch.arange(1, 10).reshape(1, 9)


# --- 1. format functions ------------------------------------------------------------------------


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


# --- 2. NVFP4MoEWeights and quantize_moe_weights ---------------------------------------------------


FIELDS = ("w13", "w13_scale", "w13_global", "w2", "w2_scale", "w2_global")


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
        NVFP4MoEWeights(w.w13, w.w13_scale.view(torch.uint8), w.w13_global, w.w2, w.w2_scale, w.w2_global)


@pytest.mark.parametrize("field", FIELDS[1:])
def test_moe_weights_wrong_shape_names_the_tensor(field):
    w = layer()
    tensors = dict(zip(FIELDS, w.tensors()))
    tensors[field] = tensors[field][:3]  # one expert short
    with pytest.raises(ValueError, match=f"{field} must have shape"):
        NVFP4MoEWeights(**tensors)


@pytest.mark.parametrize("field", ["w2", "w13_global"])
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
    ("w13_global", float("nan"), r"w13_global\[2\] must be finite and > 0 \(got nan\)"),
    ("w13_global", float("inf"), r"w13_global\[2\] must be finite and > 0 \(got inf\)"),
    ("w13_global", 0.0, r"w13_global\[2\] must be finite and > 0 \(got 0.0\)"),
    ("w13_global", -1e-3, r"w13_global\[2\] must be finite and > 0"),
    ("w2_global", float("nan"), r"w2_global\[2\] must be finite and > 0"),
    ("w2_global", 0.0, r"w2_global\[2\] must be finite and > 0"),
    ("fc1_input_scale", float("nan"), r"fc1_input_scale\[2\] must be finite and >= 0"),
    ("fc2_input_scale", float("inf"), r"fc2_input_scale\[2\] must be finite and >= 0"),
    ("fc2_input_scale", -1.0, r"fc2_input_scale\[2\] must be finite and >= 0"),
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


@pytest.mark.parametrize("field", ["w13_global", "w2_global"])
def test_global_scales_whose_weights_decode_past_bfloat16(field):
    w = layer()
    scale = getattr(w, field.replace("global", "scale"))
    fits = torch.finfo(torch.bfloat16).max / (6 * scale[2].float().max().item())
    getattr(w, field)[2] = fits * 0.99
    w.check_values()  # large but representable
    getattr(w, field)[2] = fits * 1.01
    with pytest.raises(ValueError, match=rf"{field}\[2\]: its largest weight would be 3\.4\de\+38"):
        w.check_values()
    with pytest.raises(ValueError, match=rf"{field}\[2\]: its largest weight"):
        fp4moe_ops.prepare_experts(w, "reference")


@pytest.mark.parametrize("field", ["w13_scale", "w2_scale"])
@pytest.mark.parametrize("byte", [0x7F, 0xFF, 0x81, 0xC0])
def test_e4m3_nan_bytes_and_negative_block_scales(field, byte):
    w = layer()
    getattr(w, field).view(torch.uint8)[1, 3, 0] = byte
    with pytest.raises(ValueError, match=rf"{field}\[1\] holds an E4M3 NaN byte \(0x7F/0xFF\) or a negative block scale"):
        w.check_values()


def test_zero_input_scales_and_negative_zero_block_scales_are_valid():
    w = layer(scales=True)
    w.fc1_input_scale[1] = 0.0  # an expert calibration never reached
    w.w13_scale.view(torch.uint8)[0, 0, 0] = 0x80  # -0
    w.check_values()


@pytest.mark.parametrize("tensor", ["gate_up", "down"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_quantize_moe_weights_rejects_non_finite(tensor, value):
    gate_up, down = torch.randn(2, 64, 32), torch.randn(2, 32, 32)
    (gate_up if tensor == "gate_up" else down)[1, 2, 3] = value
    with pytest.raises(ValueError, match="NaN or Inf"):
        fp4moe_ops.quantize_moe_weights(gate_up, down)


# --- 3. the op: metadata checked on every call (no host syncs) ------------------------------------


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
    tensors, fc1, fc2, backend, routed = p.op_tensors(), None, None, "reference", 0
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
        fc1, fc2 = torch.ones(1), torch.ones(1)
    elif case == "scale_dtype":
        fc1, fc2 = torch.ones((), dtype=torch.float16), torch.ones(())
    elif case == "scale_len":
        fc1, fc2 = torch.ones(5), torch.ones(4)
    elif case == "one_scale":  # the reference takes scales optionally: one without the other is allowed
        out = torch.ops.fp4moe.fused_moe(x, ids, rw, tensors, w.fc1_input_scale, None, backend)
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
        torch.ops.fp4moe.fused_moe(x, ids, rw, tensors, fc1, fc2, backend, routed)


def test_op_refuses_activation_scales_on_a_16_bit_backend(monkeypatch):
    from fp4moe_ops.backends import BACKENDS

    monkeypatch.setattr(type(BACKENDS["triton"]), "unavailable_reason", lambda self, device: None)
    w, p, x, ids, rw = op_args()
    with pytest.raises(ValueError, match="keeps activations in 16 bits"):
        torch.ops.fp4moe.fused_moe(x, ids, rw, p.op_tensors(), w.fc1_input_scale, w.fc2_input_scale, "triton")


# --- 4. activation-scale modes and backends ---------------------------------------------------------


def test_per_expert_mode_refuses_zero_scales_naming_the_experts():
    w = layer(scales=True)
    w.fc2_input_scale[[1, 3]] = 0.0
    with pytest.raises(ValueError, match=r"fc2_input_scale is 0 for experts \[1, 3\].*global_max"):
        fp4moe_ops.prepare_experts(w, "reference", "per_expert")
    fc1, fc2 = fp4moe_ops.prepare_experts(w, "reference", "global_max").activation_scales()  # the documented way out
    assert fc2 == w.fc2_input_scale.max()


def test_global_max_with_every_scale_zero():
    w = layer(scales=True)
    w.fc1_input_scale.zero_()
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
    w.fc1_input_scale.zero_()  # the module holds these tensors
    with pytest.raises(ValueError, match="fc1_input_scale is 0"):
        p.set_backend("reference", "per_expert")
    assert p.backend == "reference" and p.act_scale_mode is None and torch.equal(p(x, ids, rw), before)


# --- 5. patching is atomic ----------------------------------------------------------------------------


def untouched(model, before):
    """The model is exactly as it was: BF16 experts, same logits, still runs."""
    from hf_integration import find_experts_modules

    assert all(type(m).__name__ != "NVFP4Experts" for _, m in find_experts_modules(model))
    assert not getattr(model, "is_quantized", False)
    assert torch.equal(logits(model, IDS), before)


@pytest.mark.parametrize("case,match", [
    ("float32", "are torch.float32: NVFP4 experts run with 16-bit activations, load the model with dtype=torch.bfloat16"),
    ("nan_last_layer", r"cannot patch model.layers.2.mlp.experts .*gate_up_proj holds NaN or Inf"),
    ("inf_down", r"cannot patch model.layers.1.mlp.experts .*down_proj holds NaN or Inf"),
    ("backend", "'triton' cannot run on cpu"),
    ("act_scale_mode", "needs calibrated activation scales: patch first"),
    ("not_deepseek", "patch_deepseek supports model types"),
])
def test_patch_failures_leave_the_model_as_it_was(case, match):
    model = tiny_deepseek_v3(dtype=torch.float32 if case == "float32" else torch.bfloat16)
    if case == "nan_last_layer":
        model.model.layers[2].mlp.experts.gate_up_proj.data[5, 3, 1] = float("nan")
    if case == "inf_down":
        model.model.layers[1].mlp.experts.down_proj.data[0, 0, 0] = float("inf")
    with torch.no_grad():
        before = logits(model, IDS)
    kwargs = {"backend": "triton"} if case == "backend" else {"act_scale_mode": "per_expert"} if case == "act_scale_mode" else {}
    if case == "not_deepseek":
        model.config.model_type = "qwen3_moe"
    with pytest.raises(ValueError, match=match):
        patch_deepseek(model, **kwargs)
    if case != "nan_last_layer" and case != "inf_down":  # NaN weights give NaN logits, before and after
        untouched(model, before)
    else:
        assert all(type(layer.mlp).__name__ != "NVFP4Experts" for layer in model.model.layers)


def test_patch_refuses_unloaded_and_odd_sized_experts():
    odd = tiny_deepseek_v3(moe_intermediate_size=24)
    before = logits(odd, IDS)
    with pytest.raises(ValueError, match="intermediate 24 must be multiples of 16"):
        patch_deepseek(odd)
    untouched(odd, before)
    with torch.device("meta"):
        meta = tiny_deepseek_v3()
    with pytest.raises(ValueError, match="meta device"):
        patch_deepseek(meta)


def test_patch_twice_and_non_moe_models():
    from transformers import LlamaConfig

    model = patch_deepseek(tiny_deepseek_v3())
    with pytest.raises(ValueError, match="already patched by fp4moe"):
        patch_moe(model)
    llama = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                         num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(ValueError, match="has no Transformers experts modules"):
        patch_moe(llama)


@pytest.mark.parametrize("cast", ["to_float32", "to_device_and_float64", "double"])
def test_casting_a_model_with_nvfp4_experts_to_a_dtype_the_op_does_not_run_is_refused(cast):
    # .half() / .float() Transformers refuses for any quantized model; .to(torch.float32) and
    # .double() used to succeed and leave a model whose every forward failed, naming no layer
    model = patch_deepseek(tiny_deepseek_v3(num_hidden_layers=2, seed=5))
    want = logits(model, IDS)
    with pytest.raises(ValueError, match=r"model\.to\(torch\.float(32|64)\): .*bfloat16 or float16"):
        if cast == "to_float32":
            model.to(torch.float32)
        elif cast == "to_device_and_float64":
            model.to("cpu", dtype=torch.float64)
        else:
            model.double()
    assert model.dtype == torch.bfloat16
    assert torch.equal(logits(model, IDS), want)
    model.to(torch.float16)  # the op's other dtype, and devices, as before
    assert model.dtype == torch.float16 and torch.isfinite(logits(model.to("cpu"), IDS)).all()


@pytest.mark.parametrize("key,value", [("model.layers.1.mlp.experts.gate_up_proj_global_scale", float("nan")),
                                       ("model.layers.1.mlp.experts.down_proj_global_scale", 0.0),
                                       ("model.layers.1.mlp.experts.fc1_input_scale", -1.0),
                                       ("model.layers.1.mlp.shared_experts.down_proj.weight_scale_2", float("nan")),
                                       ("model.layers.0.mlp.up_proj.weight_scale_2", float("nan"))])
def test_load_state_dict_checks_scale_values_as_loading_a_checkpoint_does(key, value):
    # a zero global scale zeroed its expert's output and a NaN one poisoned it, silently: the
    # constructors and from_pretrained refuse them; load_state_dict now does too, before any module
    # of the model changes (another model's state dict: every tensor differs, so any partial load shows)
    def calibrated(seed):
        m = patch_deepseek(tiny_deepseek_v3(num_hidden_layers=2, seed=seed), quantize_dense_mlps=True)
        return calibrate_activation_scales(m, [IDS])

    model, other = calibrated(5), calibrated(6)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = {k: v.clone() for k, v in other.state_dict().items()}
    assert key in state
    state[key][...] = value
    with pytest.raises(ValueError, match=rf"load_state_dict: {key}(\[\d+\])? must be finite and >=? 0"):
        model.load_state_dict(state)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    del state[key]
    model.load_state_dict(state | {key: other.state_dict()[key]})  # the fault gone, the load goes through
    assert torch.equal(logits(model, IDS), logits(other, IDS))


@pytest.mark.parametrize("key", ["model.layers.1.mlp.experts.down_proj_global_scale",
                                 "model.layers.1.mlp.shared_experts.up_proj.weight_scale_2",
                                 "model.layers.0.mlp.up_proj.weight_scale_2"])
@pytest.mark.parametrize("fuse", [True, False])
def test_load_state_dict_refuses_global_scales_that_decode_past_bfloat16(key, fuse):
    # another model's state dict (every tensor differs, so a partial load shows); a fused shared
    # expert holds one expert more than the state dict, which skipped the model-level check; and a
    # partial load (strict=False) of the global scale alone was not checked against the held block scales
    def patched(seed):
        return patch_deepseek(tiny_deepseek_v3(num_hidden_layers=2, seed=seed), quantize_dense_mlps=True,
                              fuse_shared_experts=fuse)

    model, other = patched(5), patched(6)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = {k: v.clone() for k, v in other.state_dict().items()}
    state[key][...] = 1e38  # finite and > 0: passes the value rules, decodes to Inf
    for load in (state, {key: state[key]}):
        # a fused shared expert takes its tensors together: a lone scale is refused as such; and it
        # runs up on gate's global scale, so an up scale of its own is refused before its range
        match = "takes its weights and scales together" if fuse and "shared" in key and load is not state else \
            rf"load_state_dict: {key} .*differs from gate_proj" if fuse and "shared_experts.up" in key else \
            rf"load_state_dict: {key}(\[\d+\])?: its largest weight would be"
        with pytest.raises(ValueError, match=match):
            model.load_state_dict(load, strict=load is state)
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_cast_past_the_dtype_guard_fails_at_the_forward_saying_how_to_cast_back():
    # accelerate 1.15 and older: remove_hook_from_module pops the instance attribute "to", and the
    # guard with it; 1.16 pops only attributes accelerate added, so the guard stays (and refuses)
    from accelerate.hooks import remove_hook_from_module

    model = patch_deepseek(tiny_deepseek_v3(num_hidden_layers=2, seed=5))
    experts = model.model.layers[1].mlp.experts
    held = {k: v.clone() for k, v in experts.state_dict().items()}
    remove_hook_from_module(model, recurse=True)
    if "to" in model.__dict__:
        with pytest.raises(ValueError, match="float32"):
            model.to(torch.float32)
        model.__dict__.pop("to")  # what the older accelerate does
    model.to(torch.float32)
    with pytest.raises(TypeError, match=r"got torch.float32 .*cast it back with model.to\(torch.bfloat16\)"):
        model(IDS)
    model.to(torch.bfloat16)  # the NVFP4 buffers never took the cast (float32 buffers such as
    # the rotary frequencies come back rounded to bfloat16, as in any model, so logits are not compared)
    assert all(torch.equal(v, held[k]) for k, v in experts.state_dict().items())
    assert torch.isfinite(logits(model, IDS)).all()
    with pytest.raises(TypeError) as bad_shape:  # a 16-bit input of the wrong shape gets no cast hint
        experts(torch.zeros(2, 3, 64, dtype=torch.bfloat16), torch.zeros(6, 2, dtype=torch.long), torch.ones(6, 2))
    assert "bfloat16 [2, 3, 64]" in str(bad_shape.value) and "cast it back" not in str(bad_shape.value)


def test_the_dtype_guard_runs_a_to_already_on_the_model_and_scale_checks_skip_meta_tensors():
    # accelerate's dispatch puts its own guard on model.to (refusing moves of offloaded models)
    # before Transformers marks the model quantized: ours must run it, not replace it
    from hf_integration.experts import NVFP4Linear

    model = tiny_deepseek_v3(num_hidden_layers=2, seed=5)
    calls = []
    model.to = lambda *a, **k: calls.append(a) or model
    patch_deepseek(model)
    from hf_integration.quantizer import attach

    attach(model, model.hf_quantizer)  # a second attach must not chain the guard onto itself
    model.to("cpu")
    with pytest.raises(ValueError, match="float32"):
        model.to(torch.float32)
    assert calls == [("cpu",)]
    # load_state_dict(assign=True) of meta tensors (building a model skeleton) checks no values
    linear = NVFP4Linear.quantize(torch.nn.Linear(64, 32, dtype=torch.bfloat16))
    linear.load_state_dict({k: torch.empty_like(v, device="meta") for k, v in linear.state_dict().items()}, assign=True)
    assert linear.weight_scale_2.is_meta


def test_patching_does_not_touch_a_config_shared_with_another_model(tmp_path):
    """Today's models from one config object: patching one must not change the other (it used to fail
    with "has no attribute 'fp4moe_act_scales'")."""
    a = tiny_deepseek_v3(seed=1)
    b = AutoModelForCausalLM.from_config(a.config, dtype=torch.bfloat16)
    b.load_state_dict(a.state_dict())
    before = logits(b, IDS)
    patch_deepseek(a)
    assert torch.equal(logits(b, IDS), before)
    assert getattr(b.config, "quantization_config", None) is None and b.config._experts_implementation != "fp4moe"
    b.save_pretrained(tmp_path)  # the unpatched one saves as the BF16 model it is
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
    assert not (tmp_path / "hf_quant_config.json").exists()


def test_dense_mlp_quantization_checks_every_size_first():
    model = tiny_deepseek_v3()
    before = logits(model, IDS)
    model.model.layers[0].mlp.gate_proj = torch.nn.Linear(64, 120, bias=False).to(torch.bfloat16)
    model.model.layers[0].mlp.up_proj = torch.nn.Linear(64, 120, bias=False).to(torch.bfloat16)
    model.model.layers[0].mlp.down_proj = torch.nn.Linear(120, 64, bias=False).to(torch.bfloat16)
    before = logits(model, IDS)
    with pytest.raises(ValueError, match="cannot quantize dense MLP model.layers.0.mlp.down_proj: in_features 120 "
                                         "must be a multiple of 16"):
        patch_deepseek(model, quantize_dense_mlps=True)
    untouched(model, before)


@pytest.mark.parametrize("where,option", [("model.layers.1.mlp.shared_experts.up_proj", "quantize_dense_mlps"),
                                          ("model.layers.1.self_attn.kv_b_proj", "quantize_attention")])
def test_nan_in_a_dense_or_attention_linear_is_named_before_anything_changes(where, option):
    model = tiny_deepseek_v3()
    before = logits(model, IDS)
    weight = model.get_submodule(where).weight
    value = weight[3, 5].item()
    with torch.no_grad():
        weight[3, 5] = float("nan")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=f"{where.replace('.', '[.]')}: its weight holds NaN or Inf"):
        patch_deepseek(model, **{option: True})
    after = model.state_dict()  # every tensor as it was, the NaN included (checked before any change)
    assert state.keys() == after.keys()
    for k in state:
        torch.testing.assert_close(after[k], state[k], rtol=0, atol=0, equal_nan=True)
    assert type(model.get_submodule(where)) is torch.nn.Linear
    with torch.no_grad():
        weight[3, 5] = value
    untouched(model, before)


def test_set_backend_and_calibration_on_a_model_without_nvfp4_experts():
    model = tiny_deepseek_v3()
    with pytest.raises(ValueError, match="no fp4moe NVFP4 experts"):
        set_backend(model, "reference")
    with pytest.raises(ValueError, match="not patched by fp4moe"):
        calibrate_activation_scales(model, [IDS])


def test_set_backend_checks_every_layer_first():
    model = patch_deepseek(tiny_deepseek_v3())
    calibrate_activation_scales(model, [torch.randint(1, 256, (2, 12))])
    before = logits(model, IDS)
    model.model.layers[2].mlp.experts.fc2_input_scale[4] = 0.0  # the last layer cannot run per_expert
    with pytest.raises(ValueError, match=r"fc2_input_scale is 0 for experts \[4\]"):
        set_backend(model, "reference", "per_expert")
    assert all(layer.mlp.experts.act_scale_mode is None for layer in model.model.layers[1:])
    assert torch.equal(logits(model, IDS), before)


@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_calibration_with_non_finite_activations_leaves_the_model_as_it_was(bad):
    model = patch_deepseek(tiny_deepseek_v3())
    before = logits(model, IDS)
    emb = model.model.embed_tokens.weight
    saved = emb.data[7].clone()
    emb.data[7] = float(bad)  # token 7's activations become non-finite
    with pytest.raises(ValueError, match=r"calibration: model.layers.1.mlp.experts saw NaN or Inf activations"):
        calibrate_activation_scales(model, [torch.tensor([[5, 6, 7, 8]])])
    emb.data[7] = saved
    experts = model.model.layers[1].mlp.experts
    assert "fc1_input_scale" not in experts._buffers and experts.backend == "reference"
    assert torch.equal(logits(model, IDS), before)


def test_calibration_without_batches():
    model = patch_deepseek(tiny_deepseek_v3())
    with pytest.raises(ValueError, match="got no batches"):
        calibrate_activation_scales(model, [])
    from transformers import BatchEncoding

    for empty in (torch.zeros(1, 0, dtype=torch.long), {"input_ids": torch.zeros(2, 0, dtype=torch.long)},
                  BatchEncoding({"input_ids": torch.zeros(1, 0, dtype=torch.long)})):
        with pytest.raises(ValueError, match=r"calibration batch 1 holds no tokens \(shape \[\d, 0\]\)"):
            calibrate_activation_scales(model, [torch.randint(1, 256, (1, 5)), empty])
    from hf_integration import find_experts_modules

    assert all(getattr(m, "fc1_input_scale", None) is None for _, m in find_experts_modules(model))


# --- 6. checkpoint files ------------------------------------------------------------------------------


@pytest.fixture
def ckpt(tmp_path):
    model = tiny_deepseek_v3(num_hidden_layers=2, seed=3)
    tensors = write_modelopt_checkpoint(model, tmp_path / "ckpt", shards=2)
    return tmp_path / "ckpt", tensors


def shard_of(path, key):
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    return path / index[key]


def rewrite(path, key, value=None, drop=False):
    f = shard_of(path, key)
    data = load_file(f)
    if drop:
        del data[key]
    else:
        data[key] = value
    save_file(data, str(f))
    if drop:
        index = json.loads((path / "model.safetensors.index.json").read_text())
        del index["weight_map"][key]
        (path / "model.safetensors.index.json").write_text(json.dumps(index))


# a global scale multiplies every weight: it must be > 0; an input scale may be 0 (never calibrated)
BAD_SCALAR_VALUES = [(leaf, "weight_scale_2", v, "finite and > 0") for leaf in ("gate_proj", "up_proj", "down_proj")
                     for v in (float("nan"), float("inf"), 0.0, -2e-4)] + \
                    [(leaf, "input_scale", v, "finite and >= 0") for leaf in ("up_proj", "down_proj")
                     for v in (float("nan"), float("inf"), -1.0)]


@pytest.mark.parametrize("leaf,tensor,value,rule", BAD_SCALAR_VALUES)
def test_bad_scalar_scale_values_in_a_checkpoint_name_the_key_and_file(ckpt, leaf, tensor, value, rule):
    path, _ = ckpt
    key = f"{E3}.{leaf}.{tensor}"
    rewrite(path, key, torch.tensor(value))
    with pytest.raises(CheckpointError, match=rf"'{key}' in {shard_of(path, key).name} must be {rule}"):
        load_modelopt_nvfp4(path)


@pytest.mark.parametrize("leaf", ["gate_proj", "down_proj"])
@pytest.mark.parametrize("byte", [0x7F, 0xFF, 0x90])
def test_e4m3_nan_and_negative_block_scales_in_a_checkpoint(ckpt, leaf, byte):
    path, tensors = ckpt
    key = f"{E3}.{leaf}.weight_scale"
    scale = tensors[key].clone()
    scale.view(torch.uint8)[2, 1] = byte
    rewrite(path, key, scale)
    with pytest.raises(CheckpointError, match=rf"'{key}' in .* holds an E4M3 NaN byte"):
        load_modelopt_nvfp4(path)


@pytest.mark.parametrize("tensor,value", [("weight_scale_2", torch.tensor(float("nan"))),
                                          ("weight_scale_2", torch.tensor(0.0))])
def test_bad_scales_of_a_dequantized_linear(ckpt, tensor, value):
    path, _ = ckpt
    key = f"model.layers.0.mlp.down_proj.{tensor}"
    rewrite(path, key, value)
    with pytest.raises(CheckpointError, match=rf"'{key}' in .* must be finite and > 0"):
        load_modelopt_nvfp4(path)


# finite and > 0, yet 6 x 448 x 1e38 is past bfloat16's largest value: every decoded weight of the
# expert's top block is Inf, and every token routed there gets Inf or NaN logits
@pytest.mark.parametrize("key", [f"{E3}.gate_proj.weight_scale_2", f"{E3}.down_proj.weight_scale_2",
                                 "model.layers.0.mlp.up_proj.weight_scale_2"])
def test_a_global_scale_that_decodes_past_bfloat16_names_the_key_and_file(ckpt, key):
    path, tensors = ckpt
    block = tensors[key.replace("weight_scale_2", "weight_scale")].float().max().item()
    fits = torch.finfo(torch.bfloat16).max / (6 * block)  # its largest weight just inside the range
    rewrite(path, key, torch.tensor(fits * 0.99))
    model = load_modelopt_nvfp4(path)  # loads: large but representable
    del model
    rewrite(path, key, torch.tensor(fits * 1.01))
    with pytest.raises(CheckpointError, match=rf"'{key}' in {shard_of(path, key).name}: its largest weight "
                                              r"would be 3\.4\de\+38 .* past bfloat16's largest finite value"):
        load_modelopt_nvfp4(path)


@pytest.mark.parametrize("export,key,value", [
    # compressed-tensors' global scale divides: 1e-38 is a multiplier of 1e38
    ("llmcompressor/qwen3_moe_nvfp4a16", "model.layers.1.mlp.experts.2.up_proj.weight_global_scale", torch.tensor([1e-38])),
    # Llama-4's fused experts: one scalar for the layer's gate_up_proj
    ("modelopt/llama4_text_nvfp4_mlp_only", "model.layers.1.feed_forward.experts.gate_up_proj_weight_scale_2",
     torch.tensor(1e38)),
])
def test_global_scales_past_bfloat16_in_genuine_exports(tmp_path, export, key, value):
    source = Path(__file__).parent / "fixtures" / export
    folder = tmp_path / "export"
    folder.mkdir()
    for f in source.iterdir():
        if f.is_file():
            (folder / f.name).write_bytes(f.read_bytes())
    data = load_file(folder / "model.safetensors")
    assert data[key].dtype == value.dtype and data[key].shape == value.shape
    data[key] = value
    save_file(data, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"'{key}' in model.safetensors.*: its largest weight would be"):
        AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)


@pytest.mark.parametrize("key,value,match", [
    (f"{E3}.gate_proj.weight_scale_2", torch.tensor([1e-3]), r"expected shape \[\], found \[1\]"),
    (f"{E3}.gate_proj.weight_scale_2", torch.tensor(1e-3, dtype=torch.float16), "expected dtype torch.float32"),
    (f"{E3}.down_proj.weight", torch.zeros(64, 16, dtype=torch.int8), "expected dtype torch.uint8, found torch.int8"),
    (f"{E3}.down_proj.weight_scale", torch.zeros(64, 2, dtype=torch.uint8), "expected dtype torch.float8_e4m3fn"),
    ("model.layers.0.mlp.up_proj.weight", torch.zeros(128, 30, dtype=torch.uint8), r"expected shape \[128, 32\]"),
])
def test_mis_shaped_and_wrongly_typed_tensors(ckpt, key, value, match):
    path, _ = ckpt
    rewrite(path, key, value)
    with pytest.raises(CheckpointError, match=rf"'{key}' in model-0000.-of-00002.safetensors: {match}"):
        load_modelopt_nvfp4(path)


@pytest.mark.parametrize("key", [f"{E3}.gate_proj.weight", f"{E3}.up_proj.weight_scale_2", f"{E3}.down_proj.input_scale",
                                 "model.layers.0.mlp.gate_proj.weight_scale_2"])
def test_missing_quantized_tensors(ckpt, key):
    path, _ = ckpt
    rewrite(path, key, drop=True)
    with pytest.raises(CheckpointError, match=rf"'{key}' is missing"):
        load_modelopt_nvfp4(path)


@pytest.mark.parametrize("leaf,tensor,drop", [("gate_proj", "weight_scale", True), ("gate_proj", "weight_scale", False),
                                               ("gate_proj", "input_scale", True), ("down_proj", "weight", True)])
def test_a_bad_tensor_of_expert_0_is_named_as_itself(ckpt, leaf, tensor, drop):
    # the loader once decided from expert 0's gate alone whether a layer is NVFP4 and has input
    # scales: with that tensor missing or float32 it named another tensor, or listed 23 as unexpected
    path, tensors = ckpt
    key = f"model.layers.1.mlp.experts.0.{leaf}.{tensor}"
    if drop:
        rewrite(path, key, drop=True)
        match = rf"'{key}' is missing"
    else:
        rewrite(path, key, tensors[key].float())
        match = rf"'{key}' in model-0000.-of-00002.safetensors: expected dtype torch.float8_e4m3fn, found torch.float32"
    with pytest.raises(CheckpointError, match=match):
        load_modelopt_nvfp4(path)


def test_config_that_lies_about_the_number_of_experts(ckpt):
    path, _ = ckpt
    cfg = json.loads((path / "config.json").read_text())
    for n, match in ((6, r"unexpected checkpoint tensor 'model.layers.1.mlp.experts.[67]\..*' in .*has 6 experts"),
                     (10, "'model.layers.1.mlp.experts.8.gate_proj.weight' is missing")):
        (path / "config.json").write_text(json.dumps(cfg | {"n_routed_experts": n}))
        with pytest.raises(CheckpointError, match=match):
            load_modelopt_nvfp4(path)


def test_unexpected_quantized_tensor_of_no_module(ckpt):
    path, _ = ckpt
    shard = sorted(path.glob("model-*.safetensors"))[0]
    data = load_file(shard)
    data["model.layers.1.self_attn.o_proj.weight_scale_2"] = torch.tensor(1e-3)
    save_file(data, str(shard))
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.1.self_attn.o_proj.weight_scale_2"] = shard.name
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="unexpected quantized checkpoint tensors.*self_attn.o_proj.weight_scale_2"):
        load_modelopt_nvfp4(path)


def header(path):
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return raw, n, json.loads(raw[8:8 + n])


def write_header(path, raw, n, h):
    text = json.dumps(h).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage", "header_too_long", "overlap", "alias",
                                    "short_data", "bad_dtype"])
def test_malformed_safetensors_files_name_the_file(ckpt, damage):
    path, _ = ckpt
    f = shard_of(path, f"{E3}.gate_proj.weight")
    raw, n, h = header(f)
    keys = [k for k in h if k != "__metadata__"]
    if damage == "truncated":
        f.write_bytes(raw[:len(raw) - 100])
    elif damage == "empty":
        f.write_bytes(b"")
    elif damage == "garbage":
        f.write_bytes(b"\x00" * 64)
    elif damage == "header_too_long":
        f.write_bytes(struct.pack("<Q", 10**9) + raw[8:])
    elif damage in ("overlap", "alias"):
        a, b = sorted(keys, key=lambda k: h[k]["data_offsets"][0])[:2]
        if damage == "overlap":
            h[b]["data_offsets"] = [h[b]["data_offsets"][0] - 1, h[b]["data_offsets"][1]]
        else:
            h[b] = dict(h[b], data_offsets=h[a]["data_offsets"], shape=h[a]["shape"], dtype=h[a]["dtype"])
        write_header(f, raw, n, h)
    elif damage == "short_data":
        k = keys[0]
        h[k] = dict(h[k], shape=[s * 2 for s in h[k]["shape"]] or [2])
        write_header(f, raw, n, h)
    elif damage == "bad_dtype":
        h[keys[0]]["dtype"] = "Q9"
        write_header(f, raw, n, h)
    with pytest.raises(CheckpointError, match=rf"{f.name}: not a valid safetensors file"):
        load_modelopt_nvfp4(path)


def test_index_that_points_to_the_wrong_shard(ckpt):
    path, _ = ckpt
    index = json.loads((path / "model.safetensors.index.json").read_text())
    key = f"{E3}.gate_proj.weight"
    index["weight_map"][key] = "model-00001-of-00002.safetensors" if index["weight_map"][key].startswith(
        "model-00002") else "model-00002-of-00002.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"maps tensor '{key}' to model-0000.-of-00002.safetensors, but it is in"):
        load_modelopt_nvfp4(path)


def test_a_shard_the_index_does_not_list(ckpt):
    path, tensors = ckpt
    save_file({f"{E3}.gate_proj.weight": tensors[f"{E3}.gate_proj.weight"]}, str(path / "model-00003-of-00002.safetensors"))
    with pytest.raises(CheckpointError, match="model-00003-of-00002.safetensors holds .* does not list the file"):
        load_modelopt_nvfp4(path)


def test_the_same_tensor_in_two_files(ckpt):
    path, tensors = ckpt
    key = f"{E3}.gate_proj.weight"
    other = [f for f in sorted(path.glob("model-*.safetensors")) if f != shard_of(path, key)][0]
    data = load_file(other)
    data[key] = tensors[key]
    save_file(data, str(other))
    with pytest.raises(CheckpointError, match=rf"tensor '{key}' is in two files"):
        load_modelopt_nvfp4(path)


@pytest.mark.parametrize("name,content,match", [
    ("config.json", "{not json", "config.json: not a readable JSON file"),
    ("config.json", "[]", "config.json: expected a JSON dict, found list"),
    ("hf_quant_config.json", "{not json", "hf_quant_config.json: not a readable JSON file"),
    ("hf_quant_config.json", "[]", "hf_quant_config.json: expected a JSON dict, found list"),
    ("hf_quant_config.json", '{"producer": {}}', "hf_quant_config.json: no 'quantization' object"),
    ("hf_quant_config.json", '{"quantization": {"quant_algo": "FP8"}}', "quant_algo 'FP8' is not supported"),
    ("hf_quant_config.json", '{"quantization": {"quant_algo": "NVFP4", "group_size": 32}}', "group_size 32"),
    ("hf_quant_config.json", '{"quantization": {"quant_algo": "NVFP4", "bogus_field": 1, "exclude_modules": 5}}',
     "hf_quant_config.json: exclude_modules must be a list of module names, got int"),
])
def test_malformed_or_wrong_configs(ckpt, name, content, match):
    path, _ = ckpt
    (path / name).write_text(content)
    with pytest.raises(CheckpointError, match=match):
        load_modelopt_nvfp4(path)


def test_from_pretrained_with_a_broken_config_json_names_the_file(ckpt):
    path, _ = ckpt
    (path / "config.json").write_text("{not json")
    with pytest.raises(OSError, match="config.json"):  # Transformers' own error, before any quantizer runs
        AutoModelForCausalLM.from_pretrained(path)


def test_pickle_files_are_never_unpickled(tmp_path):
    """A folder with a pickled checkpoint: fp4moe's quantizer refuses it before anything reads it, so a
    malicious pickle never runs."""
    import pickle

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    model = tiny_deepseek_v3(num_hidden_layers=2)
    folder = tmp_path / "ckpt"
    write_modelopt_checkpoint(model, folder, shards=1)
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps({"x": Evil()}))
    cfg = json.loads((folder / "config.json").read_text())
    quant = json.loads((folder / "hf_quant_config.json").read_text())["quantization"]
    (folder / "config.json").write_text(json.dumps(cfg | {"quantization_config": {"quant_method": "modelopt", **quant}}))
    with pytest.raises(Exception) as info:
        AutoModelForCausalLM.from_pretrained(folder, use_safetensors=False)
    assert ".safetensors" in str(info.value) or "pickle" in str(info.value).lower() or "weights_only" in str(info.value)
    assert not marker.exists()


# --- 7. saving ----------------------------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path):
    model = patch_deepseek(tiny_deepseek_v3(num_hidden_layers=2, seed=5))
    out = tmp_path / "out"
    model.save_pretrained(out)
    return model, out, logits(model, IDS), {f.name: f.read_bytes() for f in out.iterdir()}


def still_there(out, files, want):
    assert {f.name: f.read_bytes() for f in out.iterdir()} == files
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16), IDS), want)


@pytest.mark.parametrize("where", ["config", "hf_quant_config", "swap", "copy_user_file"])
def test_a_save_failing_at_any_step_leaves_the_old_checkpoint(saved, tmp_path, monkeypatch, where):
    import hf_integration.saving as saving

    model, out, want, files = saved
    (out / "README.md").write_text("mine")
    files["README.md"] = b"mine"
    other = patch_deepseek(tiny_deepseek_v3(num_hidden_layers=2, seed=6))  # a different model saves over it
    if where == "config":
        monkeypatch.setattr(type(other.config), "save_pretrained", lambda *a, **k: (_ for _ in ()).throw(OSError("EIO")))
    elif where == "hf_quant_config":
        real = saving.Path.write_text
        monkeypatch.setattr(saving.Path, "write_text", lambda self, *a, **k: (_ for _ in ()).throw(PermissionError(
            "denied")) if self.name == "hf_quant_config.json" else real(self, *a, **k))
    elif where == "swap":
        real_replace = os.replace
        calls = []

        def replace(src, dst):
            calls.append(src)
            if len(calls) == 2:  # the new folder into place: fails after the old one moved aside
                raise OSError("EXDEV")
            return real_replace(src, dst)

        monkeypatch.setattr(saving.os, "replace", replace)
    elif where == "copy_user_file":
        monkeypatch.setattr(saving, "_copy", lambda src, dst: (_ for _ in ()).throw(OSError("ENOSPC")))
    with pytest.raises(OSError):
        other.save_pretrained(out)
    monkeypatch.undo()
    still_there(out, files, want)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]  # nothing left beside it
    other.save_pretrained(out)  # and the same save works once the fault is gone
    assert (out / "README.md").read_text() == "mine"
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16), IDS), logits(other, IDS))


def test_disk_offload_of_bf16_modules_works_and_of_nvfp4_modules_is_refused_naming_them(tmp_path):
    # all disk offload was refused, naming "NVFP4 experts" even when only lm_head went to disk
    folder = Path(__file__).parent / "fixtures" / "modelopt" / "qwen3_moe_nvfp4_default"
    ids = torch.randint(1, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    want = logits(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16), ids)
    rest = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu"}
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, offload_folder=tmp_path / "off",
                                                 device_map=rest | {"model.layers": "cpu", "lm_head": "disk"})
    assert torch.equal(logits(model, ids), want)
    with pytest.raises(ValueError, match=r"NVFP4 module 'model.layers.1.mlp.experts' to disk \(device_map entry "
                                         r"'model.layers.1': 'disk'\); put it on a GPU or the CPU"):
        AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, offload_folder=tmp_path / "off2",
                                             device_map=rest | {"model.layers.0": "cpu", "model.layers.1": "disk",
                                                                "lm_head": "cpu"})
    with pytest.raises(ValueError, match=r"to disk .*; raise max_memory"):
        AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map="auto",
                                             max_memory={"cpu": "60KB"}, offload_folder=tmp_path / "off3")


def test_saving_into_a_file_path_and_unquantized_models(saved, tmp_path):
    model, out, want, files = saved
    f = tmp_path / "a_file"
    f.write_text("keep me")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        model.save_pretrained(f)
    assert f.read_text() == "keep me"
    with pytest.raises(ValueError, match="has no fp4moe quantizer"):
        save_modelopt_nvfp4(tiny_deepseek_v3(), tmp_path / "plain")
    assert not (tmp_path / "plain").exists()


def test_push_to_hub_uploads_what_a_local_save_writes_and_a_given_state_dict_is_refused(saved, tmp_path, monkeypatch):
    # save_pretrained(push_to_hub=True) went straight to Transformers: no hf_quant_config.json, and a
    # config whose ignore list left out the BF16 modules (other readers would take them for NVFP4)
    import huggingface_hub
    import transformers.utils.hub as hf_hub

    model, out, want, files = saved
    repos, uploads = [], []

    class Repo:
        repo_id = "me/tiny-nvfp4"

    monkeypatch.setattr(huggingface_hub, "create_repo", lambda repo_id, **kw: repos.append((repo_id, kw)) or Repo())
    monkeypatch.setattr(hf_hub, "create_and_tag_model_card",
                        lambda repo_id, tags=None, token=None: huggingface_hub.ModelCard("---\nlicense: mit\n---\ncard"))

    def upload(self, working_dir, repo_id, files_timestamps, **kw):
        uploads.append((repo_id, {f.name: f.read_bytes() for f in Path(working_dir).iterdir()}, kw))

    monkeypatch.setattr(type(model), "_upload_modified_files", upload)
    pushed = tmp_path / "pushed"
    model.save_pretrained(pushed, push_to_hub=True, repo_id="me/tiny-nvfp4", commit_message="nvfp4", private=True)
    assert repos == [("me/tiny-nvfp4", {"exist_ok": True, "token": None, "private": True})]
    [(repo_id, sent, kw)] = uploads
    assert repo_id == "me/tiny-nvfp4" and kw["commit_message"] == "nvfp4"
    assert {k: v for k, v in sent.items() if k != "README.md"} == files  # byte for byte the local save
    assert "card" in sent["README.md"].decode()
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(pushed, dtype=torch.bfloat16), IDS), want)

    with pytest.raises(ValueError, match=r"save_pretrained\(state_dict=...\).*load_state_dict"):
        model.save_pretrained(tmp_path / "sd", state_dict={k: v.clone() for k, v in model.state_dict().items()})
    assert not (tmp_path / "sd").exists()


def test_a_non_main_rank_save_leaves_rank_0s_checkpoint_and_pushes_nothing(saved, monkeypatch):
    # accelerate's recipe: every rank calls save_pretrained(..., is_main_process=rank == 0); the
    # swap replaced rank 0's checkpoint by a folder holding only hf_quant_config.json
    model, out, want, files = saved
    monkeypatch.setattr(type(model), "_upload_modified_files", lambda *a, **k: pytest.fail("a non-main rank uploaded"))
    model.save_pretrained(out, is_main_process=False)
    model.save_pretrained(out, False, push_to_hub=True, repo_id="me/x")
    still_there(out, files, want)
    # a rank other than 0 that leaves is_main_process at its default (Transformers checks the rank too)
    monkeypatch.setattr(type(model), "should_save_on_this_rank", lambda self, main: False, raising=False)
    model.save_pretrained(out, push_to_hub=True, repo_id="me/x")
    still_there(out, files, want)
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"save_pretrained\(state_dict=...\)"):  # given by position too
        model.save_pretrained(out, True, {k: v.clone() for k, v in model.state_dict().items()})
    still_there(out, files, want)


def test_saving_through_a_symlink_into_dot_and_the_folder_mode_as_a_plain_save(saved, tmp_path, monkeypatch):
    # the new folder is swapped in whole, so what a plain save keeps must be kept by hand: the
    # folder's mode (tempfile's 0700 hid the checkpoint from other users), a symlink (the real
    # folder is replaced; the link had been replaced by a folder), "." (renaming "." failed)
    model, out, want, _ = saved
    other = patch_deepseek(tiny_deepseek_v3(num_hidden_layers=2, seed=6))
    umask = os.umask(0)
    os.umask(umask)
    model.save_pretrained(tmp_path / "new")
    assert (tmp_path / "new").stat().st_mode & 0o777 == 0o777 & ~umask
    out.chmod(0o750)
    link = tmp_path / "link"
    link.symlink_to(out, target_is_directory=True)
    other.save_pretrained(link)
    assert link.is_symlink() and link.resolve() == out.resolve()
    assert out.stat().st_mode & 0o777 == 0o750
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16), IDS), logits(other, IDS))
    monkeypatch.chdir(out)
    model.save_pretrained(".")
    assert Path.cwd() == out.resolve() and "config.json" in os.listdir(".")  # still standing in the folder
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(".", dtype=torch.bfloat16), IDS), want)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "new", "out"]  # nothing left beside them


def test_saving_over_a_bigger_sharded_checkpoint_leaves_no_stale_shards(saved, tmp_path):
    model, out, want, files = saved
    big = tmp_path / "big"
    model.save_pretrained(big, max_shard_size="50KB")
    assert len(list(big.glob("model-*.safetensors"))) > 2
    small = patch_moe(tiny_qwen3_moe())
    small.save_pretrained(big)
    assert sorted(f.name for f in big.glob("*.safetensors")) == ["model.safetensors"]
    assert not (big / "model.safetensors.index.json").exists()
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(big, dtype=torch.bfloat16), IDS), logits(small, IDS))


def test_a_failure_while_a_layer_is_quantized_puts_its_staged_down_proj_back(monkeypatch):
    # patch_moe quantizes down_proj first and, on an accelerator, keeps its 16-bit copy on the host
    # until the layer's NVFP4 module has replaced it (bench_patch_memory.py); a failure before that
    # (out of memory, injected here) restores it, as its own copy, so the layer is whole again.
    # Staging is forced on here (the CPU is not staged: the copy would gain nothing).
    from hf_integration import find_experts_modules
    from hf_integration import patch as patch_module

    monkeypatch.setattr(patch_module, "_staged", lambda device: True)
    model = tiny_deepseek_v3()
    layers = [m for _, m in find_experts_modules(model)]
    originals = [(m.gate_up_proj.detach().clone(), m.down_proj.detach().clone()) for m in layers]
    real, shapes = patch_module.quantize_expert_stack, []

    def second_fails(w):
        shapes.append(tuple(w.shape))
        if len(shapes) == 2:
            raise RuntimeError("CUDA out of memory (injected)")
        return real(w)

    # 1. while gate_up_proj is quantized
    monkeypatch.setattr(patch_module, "quantize_expert_stack", second_fails)
    stage = patch_module._HostStage()
    with pytest.raises(RuntimeError, match="injected"):
        patch_module._quantize_experts(layers[0], stage)
    assert shapes[0] == tuple(originals[0][1].shape)  # down_proj first
    assert torch.equal(layers[0].down_proj, originals[0][1]) and torch.equal(layers[0].gate_up_proj, originals[0][0])
    assert layers[0].down_proj.data_ptr() != stage.buffer.data_ptr()  # its own copy, not the reused buffer
    monkeypatch.setattr(patch_module, "quantize_expert_stack", real)
    got = patch_module._quantize_experts(layers[0], stage)
    want = fp4moe_ops.quantize_moe_weights(*originals[0])
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype != torch.float32 else torch.equal(a, b)
               for a, b in zip(got.tensors(), want.tensors()))
    assert layers[0].down_proj.numel() == 0  # its memory was given back while gate_up_proj was quantized
    stage.restore()

    # 2. after both are quantized, when the second layer's NVFP4 module is built: the first layer is
    # NVFP4, the second BF16 and whole
    built, real_module = [], patch_module.NVFP4Experts

    def second_module_fails(*args, **kwargs):
        if built:
            raise RuntimeError("CUDA out of memory (injected)")
        built.append(1)
        return real_module(*args, **kwargs)

    monkeypatch.setattr(patch_module, "NVFP4Experts", second_module_fails)
    with pytest.raises(RuntimeError, match="injected"):
        patch_deepseek(model)
    now = [m for _, m in find_experts_modules(model)]
    assert type(now[0]).__name__ == "NVFP4Experts" and now[1] is layers[1]
    assert torch.equal(now[1].down_proj, originals[1][1]) and torch.equal(now[1].gate_up_proj, originals[1][0])


def test_a_calibrated_patched_model_with_nvfp4_dense_linears_is_not_saved_half_calibrated(tmp_path):
    # calibration gives the routed experts input scales, not the NVFP4 linears of the dense MLPs:
    # one ModelOpt quant_algo cannot describe both, so the save is refused and writes nothing
    model = patch_deepseek(tiny_deepseek_v3(), quantize_dense_mlps=True, fuse_shared_experts=False)
    calibrate_activation_scales(model, [torch.randint(1, 256, (2, 8))])
    target = tmp_path / "out"
    with pytest.raises(ValueError, match="has no input scale while the experts have them .calibration gives"):
        model.save_pretrained(target)
    assert not target.exists() and list(tmp_path.iterdir()) == []


# --- 8. load_state_dict: a quantized tensor only in its own dtype and shape ---------------------------
# load_state_dict copies by value into a buffer of another dtype (raw E4M3 bytes 125 -> scale 128.0)
# and takes a [1] tensor into a [] one: every such tensor is checked as the buffer would hold it,
# before any module of the model changes.


def patched_pair(fuse=True, calibrate=False):
    def one(seed):
        m = patch_deepseek(tiny_deepseek_v3(num_hidden_layers=2, seed=seed), quantize_dense_mlps=True,
                           fuse_shared_experts=fuse, verbose=False)
        return calibrate_activation_scales(m, [IDS]) if calibrate else m

    return one(5), one(6)


def snapshot(module):
    """Every tensor a module holds, non-persistent buffers included (a fused shared expert's file scalars)."""
    return {k: v.clone() for k, v in [*module.named_buffers(), *module.named_parameters()]}


def unchanged(module, before):
    now = dict([*module.named_buffers(), *module.named_parameters()])
    return now.keys() == before.keys() and all(now[k].dtype == v.dtype and torch.equal(now[k], v)
                                               for k, v in before.items())


L0_UP = "model.layers.0.mlp.up_proj"
EXPERTS = "model.layers.1.mlp.experts"


@pytest.mark.parametrize("key,make,error,match", [
    # a float64 NaN once slipped past the value checks; a valid float64 value is refused alike (no conversion)
    (f"{L0_UP}.weight_scale_2", lambda t: torch.full_like(t, float("nan"), dtype=torch.float64), TypeError,
     "must be torch.float32, got torch.float64"),
    (f"{L0_UP}.weight_scale_2", lambda t: t.double(), TypeError, "must be torch.float32, got torch.float64"),
    (f"{EXPERTS}.down_proj_global_scale", lambda t: t.to(torch.bfloat16), TypeError, "got torch.bfloat16"),
    # the raw bytes of E4M3 scales: converted by value they were other scales (byte 125 -> 128.0)
    (f"{EXPERTS}.gate_up_proj_scale", lambda t: t.view(torch.uint8), TypeError, r"raw E4M3 bytes\? pass"),
    (f"{L0_UP}.weight_scale", lambda t: t.view(torch.uint8), TypeError, r"raw E4M3 bytes\? pass"),
    (f"{L0_UP}.weight_scale", lambda t: t.float(), TypeError, "must be torch.float8_e4m3fn, got torch.float32"),
    # packed E2M1 bytes as int8 (negative values wrap to other codes) or as float
    (f"{EXPERTS}.down_proj_packed", lambda t: t.view(torch.int8), TypeError, "must be torch.uint8, got torch.int8"),
    (f"{L0_UP}.weight", lambda t: t.float(), TypeError, "must be torch.uint8, got torch.float32"),
    # shapes: a [1] NaN stands for a [] one (torch takes it), a [2] or [E, 1] is refused up front
    (f"{L0_UP}.weight_scale_2", lambda t: torch.tensor([float("nan")]), ValueError, "must be finite and > 0"),
    (f"{L0_UP}.weight_scale_2", lambda t: t.reshape(1).repeat(2), ValueError, r"must have shape \[\], got \[2\]"),
    (f"{EXPERTS}.down_proj_global_scale", lambda t: t[:, None], ValueError, r"must have shape \[8\], got \[8, 1\]"),
    (f"{EXPERTS}.down_proj_scale", lambda t: t[:, :, :1], ValueError, r"must have shape \[8, 64, 2\]"),
])
def test_load_state_dict_takes_quantized_tensors_only_in_their_dtype_and_shape(key, make, error, match):
    model, other = patched_pair(fuse=False)
    before = snapshot(model)
    state = {k: v.clone() for k, v in other.state_dict().items()}
    state[key] = make(state[key])
    for load, strict in ((state, True), ({key: state[key]}, False)):  # the whole state dict, and the key alone
        with pytest.raises(error, match=rf"load_state_dict: {key}\b.*{match}|load_state_dict: {key} {match}"):
            model.load_state_dict(load, strict=strict)
        assert unchanged(model, before)


@pytest.mark.parametrize("key,make,error,match", [
    # a 16-bit module's tensors of a model with NVFP4 modules: refused before any module changes
    # (load_state_dict itself loads every other tensor first, then reports the size mismatch)
    ("model.layers.1.mlp.gate.weight", lambda t: (t * 100).to(torch.int32), TypeError,
     "is torch.int32, but the model's tensor is torch.(bfloat16|float32)"),
    ("model.embed_tokens.weight", lambda t: t[:, :32], ValueError, r"must have shape \[\d+, 64\], got \[\d+, 32\]"),
    ("model.layers.1.mlp.gate.weight", lambda t: t[:4], ValueError, r"must have shape \[8, 64\], got \[4, 64\]"),
    # a fused block's routed experts of another count
    (f"{EXPERTS}.down_proj_global_scale", lambda t: t[:7], ValueError, r"holds 7 experts; this block has 8 routed"),
])
@pytest.mark.parametrize("into", ["model", "block"])
def test_a_tensor_of_another_shape_or_an_integer_one_is_refused_before_any_module_changes(key, make, error, match, into):
    model, other = patched_pair()
    block = "model.layers.1.mlp."
    if into == "block" and not key.startswith(block):
        pytest.skip("not a tensor of the block")
    target = model if into == "model" else model.get_submodule(block[:-1])
    before = snapshot(target)
    state = {k: v.clone() for k, v in other.state_dict().items()}
    state[key] = make(state[key])
    if into == "block":
        state = {k[len(block):]: v for k, v in state.items() if k.startswith(block)}
        key = key[len(block):]
    with pytest.raises(error, match=rf"load_state_dict: {model_key_of(key, into)}.*{match}"):
        target.load_state_dict(state)
    assert unchanged(target, before)


def model_key_of(key, into):
    return re.escape(key) if into == "model" else rf"(model.layers.1.mlp.)?{re.escape(key)}"


def test_raw_scale_bytes_viewed_as_e4m3_and_a_one_element_scale_load_as_the_other_model():
    model, other = patched_pair(fuse=False)
    state = {k: v.clone() for k, v in other.state_dict().items()}
    model.load_state_dict(state | {f"{EXPERTS}.gate_up_proj_scale": state[f"{EXPERTS}.gate_up_proj_scale"]
                                   .view(torch.uint8).view(torch.float8_e4m3fn),
                                   f"{L0_UP}.weight_scale_2": state[f"{L0_UP}.weight_scale_2"].reshape(1)})
    assert model.get_submodule(L0_UP).weight_scale_2.shape == ()
    assert torch.equal(logits(model, IDS), logits(other, IDS))


# --- 9. a fused shared expert: what runs is what the state dict says -----------------------------------
# its three linears' tensors are joined into the fused experts' last row: all of them are checked
# (together, under their own keys) before anything changes, and gate and up must share their scales


SHARED = "model.layers.1.mlp.shared_experts"


def composed(model, other, prefix):
    """``model``'s state dict with ``other``'s tensors under ``prefix``."""
    mine = {k: v.clone() for k, v in model.state_dict().items()}
    return mine | {k: v.clone() for k, v in other.state_dict().items() if k.startswith(prefix)}


def unfused_reference(state):
    """A model built the other way: unfused, loaded with ``state``, then fused by fuse_shared_experts
    (which concatenates the linears' own tensors, not the state dict's)."""
    from hf_integration import fuse_shared_experts

    ref = patch_deepseek(tiny_deepseek_v3(num_hidden_layers=2, seed=7), quantize_dense_mlps=True,
                         fuse_shared_experts=False, verbose=False)
    ref.load_state_dict(state)
    assert fuse_shared_experts(ref) == 1
    return ref


@pytest.mark.parametrize("part", [SHARED, EXPERTS])
def test_a_partial_load_of_the_shared_or_the_routed_experts_alone_runs_what_its_state_dict_says(part):
    # the shared expert's tensors alone were dropped (only its file scalars were taken: another
    # model's scales beside our bytes); the routed experts alone failed with a size mismatch
    model, other = patched_pair()
    want = composed(model, other, part)
    given = {k: v for k, v in other.state_dict().items() if k.startswith(part)}
    result = model.load_state_dict(given, strict=False)
    assert not result.unexpected_keys
    got = model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert torch.equal(logits(model, IDS), logits(unfused_reference(want), IDS))


@pytest.mark.parametrize("tensor,calibrate", [("weight_scale_2", False), ("input_scale", True)])
def test_a_shared_up_scale_other_than_gates_is_refused_not_reported_and_unused(tensor, calibrate):
    model, other = patched_pair(calibrate=calibrate)
    if calibrate:  # a calibrated fused model's state dict gives the shared expert its input scales
        assert f"{SHARED}.up_proj.input_scale" in model.state_dict()
    before = snapshot(model)
    state = {k: v.clone() for k, v in other.state_dict().items()}
    state[f"{SHARED}.up_proj.{tensor}"] *= 2
    with pytest.raises(ValueError, match=rf"load_state_dict: {SHARED}.up_proj.{tensor} .*differs from "
                                         rf"gate_proj.{tensor}.*fuse_shared_experts=False"):
        model.load_state_dict(state)
    assert unchanged(model, before)
    if calibrate:
        return  # (calibration gives an unfused model's shared expert no input scales)
    # the unfused model runs up on its own scale: it takes the same state dict
    unfused = patch_deepseek(tiny_deepseek_v3(num_hidden_layers=2, seed=5), quantize_dense_mlps=True,
                             fuse_shared_experts=False, verbose=False)
    unfused.load_state_dict(state)
    assert torch.equal(unfused.state_dict()[f"{SHARED}.up_proj.{tensor}"], state[f"{SHARED}.up_proj.{tensor}"])


@pytest.mark.parametrize("key,value,match", [
    ("down_proj.weight_scale_2", float("nan"), r"shared_experts.down_proj.weight_scale_2 must be finite and > 0"),
    ("gate_proj.weight_scale", 0xFF, r"shared_experts.gate_proj.weight_scale holds an E4M3 NaN byte"),
    ("up_proj.weight", "shape", r"shared_experts.up_proj.weight must have shape \[32, 32\], got \[32, 16\]"),
    ("down_proj.weight_scale", "bytes", r"shared_experts.down_proj.weight_scale must be torch.float8_e4m3fn"),
])
def test_a_bad_shared_tensor_loaded_into_the_block_names_its_own_key_and_changes_nothing(key, value, match):
    # loaded into the block itself (no model-level check): a NaN was reported as
    # experts.down_proj_global_scale[8] after the block's file scalars had changed
    model, other = patched_pair()
    block = model.model.layers[1].mlp
    before = snapshot(block)
    state = {k[len("model.layers.1.mlp."):]: v.clone() for k, v in other.state_dict().items()
             if k.startswith("model.layers.1.mlp.")}
    t = state[f"shared_experts.{key}"]
    if value == "shape":
        state[f"shared_experts.{key}"] = t[:, :16]
    elif value == "bytes":
        state[f"shared_experts.{key}"] = t.view(torch.uint8)
    elif t.dtype == torch.float8_e4m3fn:
        t.view(torch.uint8)[0, 0] = value
    else:
        t[...] = value
    with pytest.raises((ValueError, TypeError), match=rf"load_state_dict: {match}"):
        block.load_state_dict(state)
    assert unchanged(block, before)


@pytest.mark.parametrize("missing", ["down_proj.input_scale", "up_proj.weight_scale_2", "gate_proj.weight"])
def test_a_partial_shared_load_is_refused_naming_what_is_missing_never_a_key_error(missing):
    model, other = patched_pair(calibrate=True)
    before = snapshot(model)
    state = {k: v for k, v in other.state_dict().items() if k.startswith(SHARED) and not k.endswith(missing)}
    with pytest.raises(ValueError, match=rf"takes its weights and scales together; missing \['{missing}'\]"):
        model.load_state_dict(state, strict=False)
    assert unchanged(model, before)


# --- 10. casts: quantized tensors and their scales keep their dtype; what decodes follows the cast -----


def test_a_cast_leaves_a_fused_shared_experts_float32_scales_and_a_large_valid_scale_finite():
    model, _ = patched_pair()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for leaf in ("gate_proj", "up_proj"):  # 1e5 is a valid global scale (6 x 448 x 1e5 is far below
        state[f"{SHARED}.{leaf}.weight_scale_2"] = torch.tensor(1e5)  # bfloat16's top) but past float16's
    model.load_state_dict(state)
    model.to(torch.bfloat16)  # a no-op for what fp4moe holds (Transformers casts the router's float32 bias)
    nvfp4 = [k for k in state if k.startswith((SHARED, EXPERTS, "model.layers.0.mlp."))]
    assert all(model.state_dict()[k].dtype == state[k].dtype and torch.equal(model.state_dict()[k], state[k])
               for k in nvfp4)
    model.to(torch.float16)
    got = model.state_dict()[f"{SHARED}.up_proj.weight_scale_2"]
    assert got.dtype == torch.float32 and got.item() == 1e5 == torch.tensor(1e5).item()
    buffers = dict(model.model.layers[1].mlp.named_buffers(recurse=False))
    assert buffers and all(b.dtype == torch.float32 for b in buffers.values())


@pytest.mark.parametrize("cast", ["half", "float", "to_float16"])
def test_an_nvfp4_linear_dequantizes_in_the_dtype_it_was_cast_to(cast):
    from fp4moe_ops.oracle64 import dequant64
    from hf_integration.experts import NVFP4Linear

    torch.manual_seed(0)
    q = NVFP4Linear.quantize(torch.nn.Linear(64, 32, bias=True, dtype=torch.bfloat16))
    dtype = {"half": torch.float16, "float": torch.float32, "to_float16": torch.float16}[cast]
    q = q.half() if cast == "half" else q.float() if cast == "float" else q.to(torch.float16)
    linear = q.dequantized()
    assert linear.weight.dtype == linear.bias.dtype == dtype
    # the float64 oracle rounded once to the dtype (the library decodes in float32: the product of an
    # E2M1 value and an E4M3 scale is exact there, so only the global scale's product rounds, then the
    # cast; a double rounding can move a tie by one ulp of the dtype)
    want = dequant64(q.weight, q.weight_scale, q.weight_scale_2).to(dtype)
    torch.testing.assert_close(linear.weight, want, rtol=torch.finfo(dtype).eps, atol=0)
    x = torch.randn(3, 64, dtype=dtype)
    torch.testing.assert_close(linear(x), torch.nn.functional.linear(x, want, linear.bias))


def test_dequantize_after_a_cast_to_float16_decodes_into_float16():
    # Transformers' default decoded into the dtype the model was loaded in (config.dtype): bfloat16
    # weights beside float16 activations, a raw dtype error at the forward
    model, _ = patched_pair()
    model.to(torch.float16)
    with torch.no_grad():
        before = logits(model, IDS)
    model.dequantize()
    floats = {t.dtype for t in model.parameters() if t.is_floating_point()}
    assert floats == {torch.float16} and model.config.dtype == torch.float16
    after = logits(model, IDS)
    # the same decoded weights, now Transformers' float16 modules (its experts and shared-expert add
    # in float16 instead of fp4moe's float32 sum): float16 rounding, a few ulps of the logits' scale
    err = (after.float() - before.float()).norm(dim=-1) / before.float().norm(dim=-1)
    assert err.max() < 1e-2, err


# --- 11. saving into a folder that holds a checkpoint: the save is the folder's whole truth ------------


def names(folder):
    return sorted(f.name for f in folder.iterdir())


@pytest.mark.parametrize("first,second", [({"variant": "v2"}, {}), ({"variant": "v2", "max_shard_size": "50KB"}, {}),
                                          ({"max_shard_size": "50KB"}, {"variant": "v3"})])
def test_a_save_over_another_saves_variant_or_shards_leaves_none_of_them(tmp_path, first, second):
    model = patch_deepseek(tiny_deepseek_v3(num_hidden_layers=2, seed=5), verbose=False)
    out, fresh = tmp_path / "out", tmp_path / "fresh"
    model.save_pretrained(out, **first)
    (out / "tokenizer.json").write_text("{}")  # a user's file: kept
    model.save_pretrained(out, **second)
    model.save_pretrained(fresh, **second)
    assert names(out) == sorted(names(fresh) + ["tokenizer.json"])
    assert not any(("v2" in n) != ("v2" in str(second)) for n in names(out))
    if not second:
        assert torch.equal(logits(load_modelopt_nvfp4(out), IDS), logits(model, IDS))


def test_a_dequantized_model_saved_over_its_nvfp4_checkpoint_leaves_no_quantization_config(tmp_path):
    model = patch_deepseek(tiny_deepseek_v3(num_hidden_layers=2, seed=5), quantize_dense_mlps=True, verbose=False)
    model.save_pretrained(tmp_path, max_shard_size="50KB")
    (tmp_path / "README.md").write_text("mine")
    model.dequantize()
    want = logits(model, IDS)
    model.save_pretrained(tmp_path)
    assert names(tmp_path) == ["README.md", "config.json", "generation_config.json", "model.safetensors"]
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
    again = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert not getattr(again, "is_quantized", False) and torch.equal(logits(again, IDS), want)
    with pytest.raises(CheckpointError, match="no ModelOpt quantization config"):  # nor does our reader see one
        load_modelopt_nvfp4(tmp_path)


def test_a_dequantized_models_failed_save_leaves_the_nvfp4_checkpoint(tmp_path, monkeypatch):
    import transformers.modeling_utils

    model = patch_deepseek(tiny_deepseek_v3(num_hidden_layers=2, seed=5), verbose=False)
    out = tmp_path / "out"
    model.save_pretrained(out)
    files = {f.name: f.read_bytes() for f in out.iterdir()}
    model.dequantize()

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device (injected)")

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", disk_full)
    with pytest.raises(OSError, match="injected"):
        model.save_pretrained(out)
    assert {f.name: f.read_bytes() for f in out.iterdir()} == files
    assert names(tmp_path) == ["out"]  # no staging folder left beside it


# --- 12. quantize_linears on a model fp4moe has not patched --------------------------------------------


@pytest.mark.parametrize("attention", [False, True])
def test_quantize_linears_alone_refuses_to_save_and_patching_then_saves_a_loadable_checkpoint(tmp_path, attention):
    # Transformers' save wrote the packed bytes as BF16 weights under no quantization config
    from hf_integration import fuse_shared_experts

    model = tiny_deepseek_v3(num_hidden_layers=2, seed=5)
    quantize_linears(model, attention=attention)
    with pytest.raises(ValueError, match=r"save_pretrained: model.layers.0.(mlp.gate_proj|self_attn.\w+) .*NVFP4 "
                                         r"linears of a model fp4moe has not patched.*patch_moe"):
        model.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()
    patch_moe(model, fuse_shared_experts=False, verbose=False)
    model.save_pretrained(tmp_path / "out")
    again = load_modelopt_nvfp4(tmp_path / "out")
    assert torch.equal(logits(again, IDS), logits(model, IDS))
    assert fuse_shared_experts(again) == 1  # the shared expert's linears came back NVFP4


# --- 13. calibration: no made-up input scales ----------------------------------------------------------


class NoLocalTokens:
    """A dispatch whose experts no token reaches (an expert-parallel rank the router skipped)."""

    routed_experts = 0

    def prepare(self, ids):
        return ids + 1000  # past every local expert: the op's sentinel rule drops them

    def finalize(self, out):
        return out


def test_calibrating_a_layer_no_token_reaches_is_refused_naming_it_and_changes_nothing():
    model = patch_deepseek(tiny_deepseek_v3(num_hidden_layers=3, seed=5), verbose=False)
    experts = model.model.layers[2].mlp.experts
    experts.dispatch = NoLocalTokens()
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"calibration: none of model.layers.2.mlp.experts's experts saw a token in "
                                         r"1 batch"):
        calibrate_activation_scales(model, [IDS])
    assert unchanged(model, before)


def test_an_expert_no_token_reaches_gets_its_layers_largest_scale():
    model = patch_deepseek(tiny_deepseek_v3(num_hidden_layers=2, seed=5), verbose=False)
    ids = torch.tensor([[7]])  # one token: top-2 of 8 experts, six are never reached
    calibrate_activation_scales(model, [ids])
    experts = model.model.layers[1].mlp.experts
    for s in (experts.fc1_input_scale, experts.fc2_input_scale):
        top = s.max()
        assert (s == top).sum() >= 6 and bool((s > 0).all())


# --- 14. loader edges: the culprit named -------------------------------------------------------------


@pytest.mark.parametrize("key,dtype", [("model.layers.1.mlp.gate.weight", torch.int32),
                                       ("model.embed_tokens.weight", torch.int64),
                                       ("model.layers.0.input_layernorm.weight", torch.int16),
                                       ("model.norm.weight", torch.bool)])
def test_an_integer_tensor_where_a_float_one_belongs_names_the_tensor_and_file(ckpt, key, dtype):
    path, tensors = ckpt
    rewrite(path, key, (tensors[key].float() * 100).to(dtype))
    with pytest.raises(CheckpointError, match=rf"'{key}' in {shard_of(path, key).name} is {dtype}, but the model's "
                                              r"tensor is torch.(bfloat16|float32)"):
        load_modelopt_nvfp4(path)


def test_loading_a_missing_folder_a_file_or_onto_meta(ckpt, tmp_path):
    path, _ = ckpt
    with pytest.raises(FileNotFoundError, match=rf"{tmp_path / 'nope'}: no such checkpoint folder"):
        load_modelopt_nvfp4(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="nope/nope/x: no such checkpoint folder"):
        load_modelopt_nvfp4("nope/nope/x")
    for f in ("config.json", "model-00001-of-00002.safetensors"):
        with pytest.raises(NotADirectoryError, match=rf"{path / f} is a file: load_modelopt_nvfp4 takes a checkpoint"):
            load_modelopt_nvfp4(path / f)
    for where in ({"device": "meta"}, {"device": torch.device("meta")}, {"device_map": "meta"},
                  {"device_map": {"": "meta"}}):
        with pytest.raises(ValueError, match="cannot load NVFP4 weights onto the meta device"):
            load_modelopt_nvfp4(path, **where)
    saved = tmp_path / "saved"  # a checkpoint whose config.json declares it: plain from_pretrained alike
    patch_deepseek(tiny_deepseek_v3(num_hidden_layers=2, seed=5), verbose=False).save_pretrained(saved)
    with pytest.raises(ValueError, match="cannot load NVFP4 weights onto the meta device"):
        AutoModelForCausalLM.from_pretrained(saved, device_map="meta")


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
