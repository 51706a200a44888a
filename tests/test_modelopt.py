"""ModelOpt NVFP4 checkpoints: tiny checkpoints written in the exact ModelOpt layout (per-expert
names, dtypes, shapes; valid FP4/FP8 bytes from quantizing random weights), loaded and checked
against the file bytes and a float64 reference built from the raw tensors."""

import json
import logging

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hf_integration.modelopt import CheckpointError, load_modelopt_nvfp4, read_quant_config, save_modelopt_nvfp4
from hf_integration.tiny_models import tiny_deepseek_v3, write_modelopt_checkpoint
from moe_reference64 import dequant64


@pytest.fixture
def checkpoint(tmp_path):
    model = tiny_deepseek_v3(num_hidden_layers=2)  # layer 0 dense NVFP4 MLP, layer 1 MoE (last)
    tensors = write_modelopt_checkpoint(model, tmp_path)
    return tmp_path, model, tensors


def test_loaded_experts_equal_file_bytes(checkpoint):
    path, _, tensors = checkpoint
    model = load_modelopt_nvfp4(path)
    experts = model.model.layers[1].mlp.experts
    w = experts.nvfp4_weights()
    prefix = "model.layers.1.mlp.experts"
    for e in range(8):
        assert torch.equal(w.w13[e, :32], tensors[f"{prefix}.{e}.gate_proj.weight"])
        assert torch.equal(w.w13[e, 32:], tensors[f"{prefix}.{e}.up_proj.weight"])
        assert torch.equal(w.w13_scale[e, 32:].view(torch.uint8), tensors[f"{prefix}.{e}.up_proj.weight_scale"].view(torch.uint8))
        assert torch.equal(w.w2[e], tensors[f"{prefix}.{e}.down_proj.weight"])
        assert torch.equal(w.w2_scale[e].view(torch.uint8), tensors[f"{prefix}.{e}.down_proj.weight_scale"].view(torch.uint8))
        assert w.w13_global[e] == tensors[f"{prefix}.{e}.gate_proj.weight_scale_2"]
        assert w.w2_global[e] == tensors[f"{prefix}.{e}.down_proj.weight_scale_2"]
        assert w.fc2_input_scale[e] == tensors[f"{prefix}.{e}.down_proj.input_scale"]
    # excluded modules (attention, router, lm_head) are loaded as they are
    attn = model.model.layers[1].self_attn
    assert torch.equal(attn.o_proj.weight, tensors["model.layers.1.self_attn.o_proj.weight"])
    assert torch.equal(model.lm_head.weight, tensors["lm_head.weight"])
    assert "weights=NVFP4" in repr(experts)
    router = model.model.layers[1].mlp.gate  # swapped for the one-op router, holding the file's tensors
    assert "op=fp4moe::grouped_topk" in repr(router)
    assert torch.equal(router.weight, tensors["model.layers.1.mlp.gate.weight"])


def float64_reference_model(tensors, original):
    """The same architecture in float32 with every NVFP4 tensor dequantized in float64 from the
    raw checkpoint tensors (independent decode: tests/moe_reference64.dequant64)."""
    import copy

    ref = copy.deepcopy(original).float()
    state = {}
    for key, t in tensors.items():
        if key.endswith(".weight_scale") or key.endswith("_scale_2") or key.endswith("input_scale"):
            continue
        name = key[:-len(".weight")]
        if f"{name}.weight_scale" in tensors:
            state[key] = dequant64(t, tensors[f"{name}.weight_scale"], tensors[f"{name}.weight_scale_2"])
        else:
            state[key] = t.double()
    prefix = "model.layers.1.mlp.experts"
    gate_up = torch.stack([torch.cat([state.pop(f"{prefix}.{e}.gate_proj.weight"), state.pop(f"{prefix}.{e}.up_proj.weight")])
                           for e in range(8)])
    down = torch.stack([state.pop(f"{prefix}.{e}.down_proj.weight") for e in range(8)])
    state[f"{prefix}.gate_up_proj"], state[f"{prefix}.down_proj"] = gate_up, down
    missing, unexpected = ref.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return ref


def test_logits_match_float64_dequantized_reference(checkpoint):
    path, original, tensors = checkpoint
    model = load_modelopt_nvfp4(path)
    ref = float64_reference_model(tensors, original)
    ids = torch.randint(1, 256, (2, 9))
    with torch.no_grad():
        got, want = model(ids).logits.double(), ref(ids).logits.double()
    # bf16 model (fp32 expert math) vs fp32 model on the same dequantized weights; one MoE
    # layer at the end so no router sees a perturbed input
    per_token = (got - want).norm(dim=-1) / want.norm(dim=-1)
    assert per_token.median() < 3e-2, per_token


def test_save_round_trip_is_byte_exact(checkpoint, tmp_path_factory):
    path, _, tensors = checkpoint
    model = load_modelopt_nvfp4(path)
    out = tmp_path_factory.mktemp("saved")
    save_modelopt_nvfp4(model, out)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            if ".mlp.experts." in key:
                bytes_of = lambda t: t.reshape(-1).view(torch.uint8)
                assert torch.equal(bytes_of(f.get_tensor(key)), bytes_of(tensors[key])), key
        assert sum(".mlp.experts." in k for k in f.keys()) == sum(".mlp.experts." in k for k in tensors)
    again = load_modelopt_nvfp4(out)
    ids = torch.randint(1, 256, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_kimi_k2_config_and_config_json_quantization(checkpoint, tmp_path):
    path, _, _ = checkpoint
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "kimi_k2"
    quant = json.loads((path / "hf_quant_config.json").read_text())["quantization"]
    cfg["quantization_config"] = {"quant_method": "modelopt", **quant}
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "hf_quant_config.json").unlink()
    assert read_quant_config(path).exclude_modules == quant["exclude_modules"]
    model = load_modelopt_nvfp4(path)
    assert type(model).__name__ == "DeepseekV3ForCausalLM"


def test_exclude_module_matching():
    from hf_integration.modelopt import ModelOptNVFP4Config

    q = ModelOptNVFP4Config(["lm_head", "*self_attn*", "model.layers.0.mlp"])
    assert q.is_excluded("lm_head")
    assert q.is_excluded("model.layers.3.self_attn.o_proj")
    assert q.is_excluded("model.layers.0.mlp.down_proj")  # substring
    assert not q.is_excluded("model.layers.1.mlp.down_proj")


def test_gate_up_scale_reconciliation_logs_and_stays_close(tmp_path, caplog):
    original = tiny_deepseek_v3(num_hidden_layers=2)
    write_modelopt_checkpoint(original, tmp_path, equal_gate_up_scales=False)
    with caplog.at_level(logging.WARNING, logger="fp4moe"):
        model = load_modelopt_nvfp4(tmp_path)
    assert "different gate/up weight_scale_2" in caplog.text
    ref = load_modelopt_nvfp4(tmp_path)  # same file: deterministic
    ids = torch.randint(1, 256, (1, 6))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=0, atol=0)


def corrupt(path, key, new_value=None, *, drop=False, add=None):
    """Rewrite the shard holding ``key`` (or the first shard, to add a tensor)."""
    shards = sorted(path.glob("*.safetensors"))
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            data = {k: f.get_tensor(k) for k in f.keys()}
        if key in data or (add and shard == shards[0]):
            if drop:
                del data[key]
            elif add:
                data[add[0]] = add[1]
            else:
                data[key] = new_value
            save_file(data, str(shard))
            return


E0 = "model.layers.1.mlp.experts.3.up_proj"


@pytest.mark.parametrize("case,match", [
    ("missing", f"{E0}.weight_scale' is missing"),
    ("shape", f"{E0}.weight': expected shape \\[32, 32\\], found \\[32, 30\\]"),
    ("dtype", f"{E0}.weight_scale': expected dtype torch.float8_e4m3fn, found torch.float32"),
    ("unexpected", "unexpected checkpoint tensors.*model.layers.1.mlp.experts.8.up_proj.weight"),
    ("missing_dense", "model.layers.0.self_attn.o_proj.weight' is missing"),
    ("missing_input", f"{E0}.input_scale' is missing"),
])
def test_corrupted_checkpoints_fail_with_the_tensor_named(checkpoint, case, match):
    path, _, tensors = checkpoint
    if case == "missing":
        corrupt(path, f"{E0}.weight_scale", drop=True)
    elif case == "shape":
        corrupt(path, f"{E0}.weight", tensors[f"{E0}.weight"][:, :30].clone())
    elif case == "dtype":
        corrupt(path, f"{E0}.weight_scale", tensors[f"{E0}.weight_scale"].float())
    elif case == "unexpected":
        corrupt(path, None, add=("model.layers.1.mlp.experts.8.up_proj.weight", torch.zeros(32, 32, dtype=torch.uint8)))
    elif case == "missing_dense":
        corrupt(path, "model.layers.0.self_attn.o_proj.weight", drop=True)
    elif case == "missing_input":
        corrupt(path, f"{E0}.input_scale", drop=True)
    with pytest.raises(CheckpointError, match=match):
        load_modelopt_nvfp4(path)


def test_save_patched_model_with_nvfp4_dense_mlps_and_reload(tmp_path):
    from hf_integration import patch_deepseek

    model = patch_deepseek(tiny_deepseek_v3(num_hidden_layers=2), quantize_dense_mlps=True)
    save_modelopt_nvfp4(model, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        packed = f.get_tensor("model.layers.0.mlp.down_proj.weight")
    assert "model.layers.0.mlp.gate_proj.weight_scale" in keys  # ModelOpt names for the dense MLP
    assert torch.equal(packed, model.model.layers[0].mlp.nvfp4_weights().w2[0])
    again = load_modelopt_nvfp4(tmp_path)  # dense NVFP4 MLPs come back dequantized (BF16)
    ids = torch.randint(1, 256, (1, 6))
    with torch.no_grad():
        per_token = (again(ids).logits.double() - model(ids).logits.double()).norm(dim=-1)
        per_token /= model(ids).logits.double().norm(dim=-1)
    assert per_token.median() < 3e-2, per_token  # same weights; bf16 vs fp32 dense math


def test_checkpoint_fingerprint_sees_layout_not_file_split(tmp_path):
    # expert-parallel ranks compare this digest: equal for the same tensors split into other
    # files, different when a tensor's shape differs
    from safetensors.torch import load_file

    from hf_integration.modelopt import _Checkpoint, _fingerprint, _model_config

    a, b = tmp_path / "a", tmp_path / "b"
    write_modelopt_checkpoint(tiny_deepseek_v3(seed=0, num_hidden_layers=2), a, shards=2)
    b.mkdir()
    merged = {k: v for f in sorted(a.glob("*.safetensors")) for k, v in load_file(f).items()}
    save_file(merged, str(b / "model.safetensors"))
    for name in ("config.json", "hf_quant_config.json"):
        (b / name).write_text((a / name).read_text())
    digest = lambda p: _fingerprint(read_quant_config(p), _model_config(p), _Checkpoint(p))  # noqa: E731
    assert len(list(a.glob("*.safetensors"))) > 1 and digest(a) == digest(b)
    key = "model.layers.1.mlp.experts.3.down_proj.weight_scale_2"
    merged[key] = merged[key].reshape(1)
    save_file(merged, str(b / "model.safetensors"))
    assert digest(a) != digest(b)
