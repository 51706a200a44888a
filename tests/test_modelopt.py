"""ModelOpt NVFP4 checkpoints through Transformers: ``from_pretrained`` with fp4moe's quantizer,
``save_pretrained`` back, on tiny checkpoints written in ModelOpt's exact layout (per-expert names,
dtypes, shapes; valid FP4/FP8 bytes from quantizing random weights). Genuine ModelOpt exports are
in tests/test_real_exports.py."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from hf_integration import CheckpointError, ModelOptConfig, load_modelopt_nvfp4, patch_deepseek
from hf_integration.checkpoint_format import read_quant_config
from hf_integration.tiny_models import tiny_deepseek_v3, write_modelopt_checkpoint
from fp4moe_ops.oracle64 import dequant64

E3 = "model.layers.1.mlp.experts.3.up_proj"


@pytest.fixture
def checkpoint(tmp_path):
    model = tiny_deepseek_v3(num_hidden_layers=2)  # layer 0 dense NVFP4 MLP, layer 1 MoE (last)
    tensors = write_modelopt_checkpoint(model, tmp_path / "ckpt")
    return tmp_path / "ckpt", model, tensors


def with_config_json_quantization(path):
    """The newer export form: the ModelOpt config in config.json, no hf_quant_config.json."""
    cfg = json.loads((path / "config.json").read_text())
    quant = json.loads((path / "hf_quant_config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "modelopt", **quant["quantization"], "producer": quant["producer"]}
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "hf_quant_config.json").unlink()


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def file_tensors(folder):
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def bytes_of(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_from_pretrained_loads_experts_straight_from_the_file_bytes(checkpoint, monkeypatch):
    from hf_integration.expert_conversion import StackNVFP4Experts

    path, _, tensors = checkpoint
    with_config_json_quantization(path)
    seen = []
    convert = StackNVFP4Experts.convert

    def recording(self, input_dict, *args, **kwargs):  # what the loader hands the experts: file dtypes
        seen.extend(t.dtype for ts in input_dict.values() for t in ts)
        return convert(self, input_dict, *args, **kwargs)

    monkeypatch.setattr(StackNVFP4Experts, "convert", recording)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)  # plain Transformers call
    assert set(seen) == {torch.uint8, torch.float8_e4m3fn, torch.float32}  # never a 16-bit expert tensor
    experts = model.model.layers[1].mlp.experts
    assert type(experts).__name__ == "NVFP4Experts" and model.is_quantized and model.hf_quantizer.is_compileable
    w = experts.canonical()
    prefix = "model.layers.1.mlp.experts"
    for e in range(8):
        assert torch.equal(w.gate_up[e, :32], tensors[f"{prefix}.{e}.gate_proj.weight"])
        assert torch.equal(w.gate_up[e, 32:], tensors[f"{prefix}.{e}.up_proj.weight"])
        assert torch.equal(bytes_of(w.gate_up_scale[e, 32:]), bytes_of(tensors[f"{prefix}.{e}.up_proj.weight_scale"]))
        assert torch.equal(w.down[e], tensors[f"{prefix}.{e}.down_proj.weight"])
        assert torch.equal(bytes_of(w.down_scale[e]), bytes_of(tensors[f"{prefix}.{e}.down_proj.weight_scale"]))
        assert w.gate_up_global_scale[e] == tensors[f"{prefix}.{e}.gate_proj.weight_scale_2"]
        assert w.down_global_scale[e] == tensors[f"{prefix}.{e}.down_proj.weight_scale_2"]
        assert w.down_input_scale[e] == tensors[f"{prefix}.{e}.down_proj.input_scale"]
    # excluded modules (attention, router, lm_head) are loaded as they are
    assert torch.equal(model.model.layers[1].self_attn.o_proj.weight, tensors["model.layers.1.self_attn.o_proj.weight"])
    assert torch.equal(model.lm_head.weight, tensors["lm_head.weight"])
    router = model.model.layers[1].mlp.gate  # swapped for the one-op router, holding the file's tensors
    assert "op=fp4moe::grouped_topk" in repr(router)
    assert torch.equal(router.weight.to(tensors["model.layers.1.mlp.gate.weight"].dtype),
                       tensors["model.layers.1.mlp.gate.weight"])
    # NVFP4 linears outside the experts: kept in 4 bits (the default), the file's bytes; their
    # weight is exactly the file's values in bf16 (what nvfp4_linears="dequantize" would hold)
    dense = model.model.layers[0].mlp.down_proj
    assert type(dense).__name__ == "NVFP4Linear" and dense.dtype == torch.bfloat16
    for t in ("weight", "weight_scale", "weight_scale_2"):
        assert torch.equal(bytes_of(dense._buffers[t]), bytes_of(tensors[f"model.layers.0.mlp.down_proj.{t}"])), t
    want = dequant64(tensors["model.layers.0.mlp.down_proj.weight"], tensors["model.layers.0.mlp.down_proj.weight_scale"],
                     tensors["model.layers.0.mlp.down_proj.weight_scale_2"])
    assert torch.equal(dense.weight_value(), want.to(torch.bfloat16))
    dequantized = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                       quantization_config=ModelOptConfig(nvfp4_linears="dequantize"))
    assert torch.equal(dequantized.model.layers[0].mlp.down_proj.weight, want.to(torch.bfloat16))


def float64_reference_model(tensors, original):
    """The same architecture in float32 with every NVFP4 tensor dequantized in float64 from the
    raw checkpoint tensors (independent decode: fp4moe_ops.oracle64.dequant64)."""
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
    model = load_modelopt_nvfp4(path)  # hf_quant_config.json only, as NVIDIA's DeepSeek exports
    ref = float64_reference_model(tensors, original)
    ids = torch.randint(1, 256, (2, 9))
    got, want = logits(model, ids).double(), logits(ref, ids).double()
    # bf16 model (fp32 expert math) vs fp32 model on the same dequantized weights; one MoE
    # layer at the end so no router sees a perturbed input
    per_token = (got - want).norm(dim=-1) / want.norm(dim=-1)
    assert per_token.median() < 3e-2, per_token


def test_hf_quant_config_only_checkpoint_through_from_pretrained(checkpoint):
    path, _, _ = checkpoint
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, quantization_config=ModelOptConfig())
    wrapped = load_modelopt_nvfp4(path)
    ids = torch.randint(1, 256, (1, 5))
    assert torch.equal(logits(plain, ids), logits(wrapped, ids))


def test_save_round_trip_is_bit_identical(checkpoint, tmp_path):
    path, _, tensors = checkpoint
    model = load_modelopt_nvfp4(path)
    out = tmp_path / "saved"
    model.save_pretrained(out)
    saved = file_tensors(out)
    for key, t in tensors.items():
        if ".mlp.experts." in key:  # experts written back byte for byte, same names and dtypes
            assert saved[key].dtype == t.dtype and torch.equal(bytes_of(saved[key]), bytes_of(t)), key
    assert sum(".mlp.experts." in k for k in saved) == sum(".mlp.experts." in k for k in tensors)
    quant = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert quant["quant_algo"] == "NVFP4" and quant["group_size"] == 16 and "kv_cache_quant_algo" in quant
    assert "model.layers.0.mlp.down_proj" not in quant["exclude_modules"]  # kept NVFP4 at load, saved NVFP4
    for t in ("weight", "weight_scale", "weight_scale_2"):
        key = f"model.layers.0.mlp.down_proj.{t}"
        assert saved[key].dtype == tensors[key].dtype and torch.equal(bytes_of(saved[key]), bytes_of(tensors[key])), key
    assert "model.layers.0.self_attn.o_proj" in quant["exclude_modules"]  # BF16 in the file, saved in BF16
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "modelopt"
    again = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)  # plain: config.json says modelopt
    ids = torch.randint(1, 256, (1, 5))
    assert torch.equal(logits(again, ids), logits(model, ids))


def test_patched_bf16_model_saves_as_modelopt_and_loads_bit_identical(tmp_path):
    model = patch_deepseek(tiny_deepseek_v3(num_hidden_layers=3))
    model.save_pretrained(tmp_path / "out")
    saved = file_tensors(tmp_path / "out")
    assert saved["model.layers.2.mlp.experts.5.down_proj.weight"].dtype == torch.uint8
    assert saved["model.layers.2.mlp.experts.5.gate_proj.weight_scale"].dtype == torch.float8_e4m3fn
    assert saved["model.layers.2.mlp.experts.5.up_proj.weight_scale_2"].shape == ()
    assert not any(k.endswith("input_scale") for k in saved)  # uncalibrated: a W4A16 export
    assert json.loads((tmp_path / "out" / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == "W4A16_NVFP4"
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.bfloat16)
    ids = torch.randint(1, 256, (2, 6))
    assert torch.equal(logits(again, ids), logits(model, ids))


@pytest.mark.parametrize("config", ["modelopt", "compressed-tensors"])
def test_a_16_bit_checkpoint_with_a_quantization_config_quantizes_its_experts(tmp_path, config):
    """A 16-bit folder given an NVFP4 quantization config loads with NVFP4 experts (quantized while
    loading, tests/test_quantize_at_load.py), never as a "quantized" model whose experts all stay
    16-bit; a 16-bit model without routed experts fp4moe quantizes is refused, naming the folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_integration import CompressedTensorsNVFP4Config, NVFP4Experts

    tiny_deepseek_v3().save_pretrained(tmp_path / "bf16")
    qc = ModelOptConfig() if config == "modelopt" else CompressedTensorsNVFP4Config()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16, quantization_config=qc)
    assert isinstance(model.model.layers[1].mlp.experts, NVFP4Experts)
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2)).save_pretrained(tmp_path / "dense")
    with pytest.raises(CheckpointError, match=r"dense holds no quantized tensors fp4moe loads, and the model has no "
                                              r"routed experts"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "dense", dtype=torch.bfloat16, quantization_config=qc)


def test_sharded_save_has_an_index_and_loads(checkpoint, tmp_path):
    model = load_modelopt_nvfp4(checkpoint[0])
    model.save_pretrained(tmp_path / "out", max_shard_size="100KB")
    shards = sorted((tmp_path / "out").glob("model-*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "out" / "model.safetensors.index.json").exists()
    ids = torch.randint(1, 256, (1, 5))
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.bfloat16), ids),
                       logits(model, ids))


def test_a_failed_save_leaves_the_previous_checkpoint_intact(checkpoint, tmp_path, monkeypatch):
    import transformers.modeling_utils as mu

    model = load_modelopt_nvfp4(checkpoint[0])
    out = tmp_path / "out"
    model.save_pretrained(out, max_shard_size="100KB")
    (out / "tokenizer.json").write_text("{}")  # a file of the user's beside the checkpoint
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    ids = torch.randint(1, 256, (1, 5))
    want = logits(model, ids)
    calls = []
    real = mu.safe_save_file

    def disk_full(*args, **kwargs):  # the second shard fails, after the first was written
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(mu, "safe_save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        model.save_pretrained(out, max_shard_size="50KB")
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before  # byte for byte, nothing added
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")]  # no staging folder left behind
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16), ids), want)
    monkeypatch.setattr(mu, "safe_save_file", real)
    model.save_pretrained(out)  # one shard now: the old shards and index go, the user's file stays
    names = sorted(f.name for f in out.iterdir())
    assert names == ["config.json", "generation_config.json", "hf_quant_config.json", "model.safetensors",
                     "tokenizer.json"]
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16), ids), want)


def test_hub_id_from_a_local_cache_snapshot_offline(checkpoint, tmp_path):
    """A Hub id resolves through Transformers' download and cache; with HF_HUB_OFFLINE=1 it must
    come from the cache alone (no network here)."""
    path, _, _ = checkpoint
    with_config_json_quantization(path)
    snapshot = tmp_path / "hub" / "models--nvidia--Tiny-DeepSeek-NVFP4"
    sha = "0123456789abcdef0123456789abcdef01234567"
    (snapshot / "refs").mkdir(parents=True)
    (snapshot / "refs" / "main").write_text(sha)
    (snapshot / "snapshots").mkdir()
    os.symlink(path, snapshot / "snapshots" / sha)
    script = ("import torch, hf_integration\nfrom transformers import AutoModelForCausalLM\n"
              "m = AutoModelForCausalLM.from_pretrained('nvidia/Tiny-DeepSeek-NVFP4', dtype=torch.bfloat16)\n"
              "print(type(m.model.layers[1].mlp.experts).__name__)\n")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "hub"), HF_HOME=str(tmp_path / "home"))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("NVFP4Experts")


def test_kimi_k2_config_loads_as_deepseek_v3(checkpoint):
    path, _, _ = checkpoint
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "kimi_k2"
    (path / "config.json").write_text(json.dumps(cfg))
    model = load_modelopt_nvfp4(path)
    assert isinstance(model, __import__("transformers").DeepseekV3ForCausalLM)
    assert type(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                    quantization_config=ModelOptConfig())).__name__ == "KimiK2ForCausalLM"


def test_quant_config_forms_and_names():
    a = ModelOptConfig.from_dict({"producer": {"name": "modelopt"}, "quantization": {
        "quant_algo": "nvfp4", "group_size": 16, "exclude_modules": ["lm_head"], "kv_cache_quant_algo": None}})
    b = ModelOptConfig.from_dict({"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": ["lm_head"]})
    assert a.quant_algo == b.quant_algo == "NVFP4" and a.exclude_modules == b.exclude_modules == ["lm_head"]
    assert ModelOptConfig.from_dict({"quant_algo": "W4A16_NVFP4"}).weights_only
    with pytest.raises(ValueError, match="quant_algo 'FP8' is not supported"):
        ModelOptConfig.from_dict({"quant_algo": "FP8"})
    with pytest.raises(ValueError, match="group_size 32"):
        ModelOptConfig.from_dict({"quant_algo": "NVFP4", "group_size": 32})


def test_gate_up_scale_reconciliation_logs_and_is_deterministic(tmp_path, hf_logs):
    original = tiny_deepseek_v3(num_hidden_layers=2)
    write_modelopt_checkpoint(original, tmp_path, equal_gate_up_scales=False)
    model = load_modelopt_nvfp4(tmp_path)
    assert re.search(r"experts had different weight_scale_2 for gate_proj and up_proj \(experts \[", hf_logs.text)
    ids = torch.randint(1, 256, (1, 6))
    assert torch.equal(logits(model, ids), logits(load_modelopt_nvfp4(tmp_path), ids))


def test_weights_only_export_loads_and_refuses_nvfp4_activations(tmp_path):
    write_modelopt_checkpoint(tiny_deepseek_v3(num_hidden_layers=2), tmp_path, input_scales=False)
    assert read_quant_config(tmp_path).weights_only
    model = load_modelopt_nvfp4(tmp_path)
    assert "gate_up_proj_input_scale" not in model.model.layers[1].mlp.experts._buffers
    with pytest.raises(ValueError, match="calibrate"):
        load_modelopt_nvfp4(tmp_path, act_scale_mode="global_max")


def test_model_is_marked_quantized_the_hf_way(checkpoint):
    model = load_modelopt_nvfp4(checkpoint[0])
    experts = model.model.layers[1].mlp.experts
    scale_before = experts.gate_up_proj_scale.clone()
    with pytest.raises(ValueError, match="not supported for quantized model"):
        model.half()
    model.to(torch.float16)  # the 16-bit parts move; the NVFP4 bytes and scales keep their dtypes
    assert experts.gate_up_proj_scale.dtype == torch.float8_e4m3fn
    assert torch.equal(bytes_of(experts.gate_up_proj_scale), bytes_of(scale_before))
    assert experts.gate_up_proj_global_scale.dtype == torch.float32
    assert model.model.embed_tokens.weight.dtype == torch.float16
    assert torch.isfinite(logits(model, torch.randint(1, 256, (1, 4)))).all()  # fp16 activations run
    with pytest.raises(ValueError, match="only fp4moe's op can run"):
        model.set_experts_implementation("eager")
    # what runs is "fp4moe" (so generate() on a GPU does not switch grouped_mm -> batched_mm around decoding)
    assert model.get_experts_implementation() == {"": "fp4moe"}
    model.set_experts_implementation("fp4moe")


def test_device_map_dict_places_modules(checkpoint):
    path, _, _ = checkpoint
    plain = load_modelopt_nvfp4(path)
    mapped = load_modelopt_nvfp4(path, device_map={"model.embed_tokens": "cpu", "model.layers": "cpu",
                                                   "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"})
    ids = torch.randint(1, 100, (2, 7))
    assert torch.equal(logits(mapped, ids), logits(plain, ids))
    assert not any(t.is_meta for t in list(mapped.parameters()) + list(mapped.buffers()))


def corrupt(path, key, new_value=None, *, drop=False, add=None):
    """Rewrite the shard holding ``key`` (or the first shard, to add a tensor) and its index."""
    shards = sorted(path.glob("*.safetensors"))
    index = path / "model.safetensors.index.json"
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
            if index.exists():
                weight_map = json.loads(index.read_text())["weight_map"]
                weight_map.pop(key, None) if drop else weight_map.setdefault(add[0] if add else key, shard.name)
                index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
            return


@pytest.mark.parametrize("case,match", [
    ("missing", f"{E3}.weight_scale' is missing"),
    ("shape", f"{E3}.weight' in model-0000.-of-00002.safetensors: expected shape \\[32, 32\\], found \\[32, 30\\]"),
    ("dtype", f"{E3}.weight_scale' in .*: expected dtype torch.float8_e4m3fn, found torch.float32"),
    ("unexpected", "unexpected checkpoint tensor 'model.layers.1.mlp.experts.8.up_proj.weight'"),
    ("missing_input", f"{E3}.input_scale' is missing \\(the other experts of this layer have input scales\\)"),
    ("nan_scale", f"{E3[:-len('up_proj')]}gate_proj.weight_scale_2' .*must be finite and > 0"),
])
def test_corrupted_checkpoints_fail_with_the_tensor_named(checkpoint, case, match):
    path, _, tensors = checkpoint
    if case == "missing":
        corrupt(path, f"{E3}.weight_scale", drop=True)
    elif case == "shape":
        corrupt(path, f"{E3}.weight", tensors[f"{E3}.weight"][:, :30].clone())
    elif case == "dtype":
        corrupt(path, f"{E3}.weight_scale", tensors[f"{E3}.weight_scale"].float())
    elif case == "unexpected":
        corrupt(path, None, add=("model.layers.1.mlp.experts.8.up_proj.weight", torch.zeros(32, 32, dtype=torch.uint8)))
    elif case == "missing_input":
        corrupt(path, f"{E3}.input_scale", drop=True)
    elif case == "nan_scale":
        corrupt(path, f"{E3[:-len('up_proj')]}gate_proj.weight_scale_2", torch.tensor(float("nan")))
    with pytest.raises(CheckpointError, match=match):
        load_modelopt_nvfp4(path)


def test_save_patched_model_with_nvfp4_dense_mlps_and_reload(tmp_path):
    model = patch_deepseek(tiny_deepseek_v3(num_hidden_layers=2), quantize_dense_mlps=True)
    model.save_pretrained(tmp_path)
    saved = file_tensors(tmp_path)
    assert "model.layers.0.mlp.gate_proj.weight_scale" in saved  # ModelOpt names for the dense MLP
    assert torch.equal(saved["model.layers.0.mlp.down_proj.weight"], model.model.layers[0].mlp.down_proj.weight)
    again = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)  # dense NVFP4 MLPs: kept
    assert type(again.model.layers[0].mlp.down_proj).__name__ == "NVFP4Linear"
    ids = torch.randint(1, 256, (1, 6))
    # the patched model runs its shared expert inside the routed call: loaded so too, the same
    # bytes, modules and math
    fused = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16,
                                                 quantization_config=ModelOptConfig(fuse_shared_experts=True))
    assert torch.equal(logits(fused, ids), logits(model, ids))
    dequantized = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16,
                                                       quantization_config=ModelOptConfig(nvfp4_linears="dequantize"))
    assert type(dequantized.model.layers[0].mlp.down_proj) is torch.nn.Linear
    got, want = logits(dequantized, ids).double(), logits(model, ids).double()
    per_token = (got - want).norm(dim=-1) / want.norm(dim=-1)
    # the same weights; the shared expert as a BF16 MLP instead of inside the routed call (another
    # order of bf16 roundings)
    assert per_token.median() < 3e-2, per_token


def test_checkpoint_fingerprint_sees_layout_not_file_split(tmp_path):
    # expert-parallel ranks compare this digest: equal for the same tensors split into other
    # files, different when a tensor's shape differs
    from hf_integration.modelopt import _model_config, checkpoint_fingerprint

    a, b = tmp_path / "a", tmp_path / "b"
    write_modelopt_checkpoint(tiny_deepseek_v3(seed=0, num_hidden_layers=2), a, shards=2)
    b.mkdir()
    merged = file_tensors(a)
    save_file(merged, str(b / "model.safetensors"))
    for name in ("config.json", "hf_quant_config.json"):
        (b / name).write_text((a / name).read_text())
    digest = lambda p: checkpoint_fingerprint(p, read_quant_config(p), _model_config(p / "config.json"))  # noqa: E731
    assert len(list(a.glob("*.safetensors"))) > 1 and digest(a) == digest(b)
    key = "model.layers.1.mlp.experts.3.down_proj.weight_scale_2"
    merged[key] = merged[key].reshape(1)
    save_file(merged, str(b / "model.safetensors"))
    assert digest(a) != digest(b)


def test_mixed_precision_export_with_fp8_layers(checkpoint):
    """``quant_algo: MIXED_PRECISION`` (per-layer algos under ``quantized_layers``): NVFP4 layers as
    usual; an FP8 layer (weight float8_e4m3fn [N, K], one float32 ``weight_scale``) is dequantized to
    the model dtype at load, like every non-expert linear."""
    path, _, tensors = checkpoint
    name = "model.layers.1.mlp.shared_experts.down_proj"
    w = dequant64(tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"], tensors[f"{name}.weight_scale_2"]).float()
    scale = w.abs().max() / 448
    fp8 = (w / scale).to(torch.float8_e4m3fn)
    corrupt(path, f"{name}.weight_scale_2", drop=True)
    corrupt(path, f"{name}.weight", fp8)
    corrupt(path, f"{name}.weight_scale", scale.reshape(()))
    layers = {f"model.layers.1.mlp.experts.{e}.{p}": {"quant_algo": "NVFP4", "group_size": 16}
              for e in range(8) for p in ("gate_proj", "up_proj", "down_proj")}
    layers[name] = {"quant_algo": "FP8"}
    (path / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": {
        "quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None, "quantized_layers": layers,
        "exclude_modules": ["lm_head"]}}))
    model = load_modelopt_nvfp4(path)
    assert model.config.quantization_config.quant_algo == "MIXED_PRECISION"
    got = model.model.layers[1].mlp.shared_experts.down_proj.weight
    assert type(model.model.layers[1].mlp.shared_experts.down_proj) is torch.nn.Linear
    assert torch.equal(got, (fp8.float() * scale).to(torch.bfloat16))
    assert type(model.model.layers[1].mlp.experts).__name__ == "NVFP4Experts"
    with pytest.raises(ValueError, match="MIXED_PRECISION layers use \\['INT4_AWQ'\\]"):
        ModelOptConfig.from_dict({"quant_algo": "MIXED_PRECISION", "quantized_layers": {"x": {"quant_algo": "int4_awq"}}})
