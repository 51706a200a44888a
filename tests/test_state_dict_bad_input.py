"""``load_state_dict`` and casts on a patched model: quantized tensors only in their own dtype and shape, fused shared experts whole, decoded weights in the current dtype.

As a hostile user would bring them: every case gets an error of a stated type whose message
names the culprit (tensor, file, layer), or the documented correct result."""

import re

import pytest
import torch

from hf_integration import calibrate_activation_scales, patch_deepseek
from hf_integration.tiny_models import tiny_deepseek_v3
from bad_input_helpers import IDS, logits, snapshot, unchanged


# --- load_state_dict: a quantized tensor only in its own dtype and shape ---------------------------
# load_state_dict copies by value into a buffer of another dtype (raw E4M3 bytes 125 -> scale 128.0)
# and takes a [1] tensor into a [] one: every such tensor is checked as the buffer would hold it,
# before any module of the model changes.


def patched_pair(fuse=True, calibrate=False):
    def one(seed):
        m = patch_deepseek(tiny_deepseek_v3(num_hidden_layers=2, seed=seed), quantize_dense_mlps=True,
                           fuse_shared_experts=fuse, verbose=False)
        return calibrate_activation_scales(m, [IDS]) if calibrate else m

    return one(5), one(6)


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


# --- a fused shared expert: what runs is what the state dict says -----------------------------------
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


# --- casts: quantized tensors and their scales keep their dtype; what decodes follows the cast -----


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
