"""Patching, casting, quantizing linears and calibrating a model, given bad models and values: atomic, the culprit named.

As a hostile user would bring them: every case gets an error of a stated type whose message
names the culprit (tensor, file, layer), or the documented correct result."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_integration import (
    calibrate_activation_scales,
    load_modelopt_nvfp4,
    patch_deepseek,
    patch_moe,
    quantize_linears,
    set_backend,
)
from hf_integration.tiny_models import tiny_deepseek_v3
from bad_input_helpers import IDS, logits, snapshot, unchanged


# --- patching is atomic ----------------------------------------------------------------------------


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
                                       ("model.layers.1.mlp.experts.gate_up_proj_input_scale", -1.0),
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
    model.model.layers[2].mlp.experts.down_proj_input_scale[4] = 0.0  # the last layer cannot run per_expert
    with pytest.raises(ValueError, match=r"down_input_scale is 0 for experts \[4\]"):
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
    assert "gate_up_proj_input_scale" not in experts._buffers and experts.backend == "reference"
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

    assert all(getattr(m, "gate_up_proj_input_scale", None) is None for _, m in find_experts_modules(model))


# --- quantize_linears on a model fp4moe has not patched --------------------------------------------


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


# --- calibration: no made-up input scales ----------------------------------------------------------


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
    for s in (experts.gate_up_proj_input_scale, experts.down_proj_input_scale):
        top = s.max()
        assert (s == top).sum() >= 6 and bool((s > 0).all())
