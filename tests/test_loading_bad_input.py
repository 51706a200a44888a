"""Loading bad checkpoint files: every bad tensor, header, index and config is named with its file before the model changes.

As a hostile user would bring them: every case gets an error of a stated type whose message
names the culprit (tensor, file, layer), or the documented correct result."""

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from hf_integration import CheckpointError, load_modelopt_nvfp4, patch_deepseek
from hf_integration.tiny_models import tiny_deepseek_v3, write_modelopt_checkpoint
from bad_input_helpers import E3


# --- checkpoint files ------------------------------------------------------------------------------


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


# --- loader edges: the culprit named -------------------------------------------------------------


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
