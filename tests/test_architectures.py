"""NVFP4 checkpoints of each MoE architecture fp4moe runs, in the layout of their published exports
(config fields of the architecture's Transformers config, checkpoint key names from Transformers'
own reverse conversion: ``mlp.experts.<e>.gate_proj`` for DeepSeek / Kimi-K2 / GLM-4.5 / Qwen3-MoE,
``block_sparse_moe.experts.<e>.w1`` for MiniMax-M2 and Mixtral), loaded through plain
``from_pretrained`` and compared with an fp32 model holding the file's weights decoded in float64."""

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import hf_integration  # noqa: F401  (registers the quantizer and kimi_k2)
from fp4moe_ops.oracle64 import dequant64
from hf_integration import CheckpointError, ModelOptConfig, patch_moe
from hf_integration.tiny_models import (
    tiny_deepseek_v2,
    tiny_deepseek_v3,
    tiny_glm4_moe,
    tiny_llama4_text,
    tiny_minimax_m2,
    tiny_mixtral,
    tiny_qwen3_moe,
    write_modelopt_checkpoint,
)

# checkpoint names -> model names, written out here (independent of the loader's own mapping)
RENAMES = {".block_sparse_moe.": ".mlp."}
LEAVES = {"gate_proj": 0, "up_proj": 1, "down_proj": 2, "w1": 0, "w3": 1, "w2": 2}
ARCHITECTURES = {
    "deepseek_v3": lambda: tiny_deepseek_v3(num_hidden_layers=2),
    "kimi_k2": lambda: tiny_deepseek_v3(num_hidden_layers=2),
    "deepseek_v2": tiny_deepseek_v2,
    "glm4_moe": tiny_glm4_moe,
    "qwen3_moe": tiny_qwen3_moe,
    "minimax_m2": tiny_minimax_m2,
    "mixtral": tiny_mixtral,
}


def reference_model(original, tensors):
    """``original`` in float32 with every NVFP4 tensor of the checkpoint decoded in float64."""
    ref = copy.deepcopy(original).float()
    state = ref.state_dict()
    for key in tensors:
        if not key.endswith(".weight_scale"):
            continue
        name = key[:-len(".weight_scale")]
        w = dequant64(tensors[f"{name}.weight"], tensors[key], tensors[f"{name}.weight_scale_2"]).float()
        for a, b in RENAMES.items():
            name = name.replace(a, b)
        experts, e, leaf = name.rsplit(".", 2) if ".experts." in name else (None, None, None)
        if experts is None:
            state[f"{name}.weight"].copy_(w)
            continue
        e, which = int(e), LEAVES[leaf]
        gate_up = state[f"{experts}.gate_up_proj"]
        inter = gate_up.shape[1] // 2
        if which == 2:
            state[f"{experts}.down_proj"][e] = w
        else:
            gate_up[e, which * inter:(which + 1) * inter] = w
    return ref


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_architecture_loads_and_matches_its_decoded_weights(arch, tmp_path):
    original = ARCHITECTURES[arch]()
    tensors = write_modelopt_checkpoint(original, tmp_path, model_type="kimi_k2" if arch == "kimi_k2" else None)
    if arch == "minimax_m2":  # MiniMax-M2's published names
        assert "model.layers.0.block_sparse_moe.experts.3.w1.weight_scale" in tensors
        assert "model.layers.0.block_sparse_moe.e_score_correction_bias" in tensors
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, quantization_config=ModelOptConfig())
    experts = [m for m in model.modules() if type(m).__name__ == "NVFP4Experts"]
    assert experts and all(m.backend == "reference" for m in experts)
    ids = torch.randint(1, 256, (2, 9))
    with torch.no_grad():
        got, want = model(ids).logits.double(), reference_model(original, tensors)(ids).logits.double()
    per_token = ((got - want).norm(dim=-1) / want.norm(dim=-1)).flatten()
    # a bf16 model (fp32 expert math) against an fp32 model on the same decoded weights; in models
    # whose every layer is MoE a later router may flip a near-tied expert for a token: the median
    assert per_token.median() < 3e-2, per_token


LLAMA4_EXPORT = Path(__file__).parent / "fixtures" / "modelopt" / "llama4_text_nvfp4_mlp_only"
L4 = "model.layers.0.feed_forward.experts"


def _edited_llama4_export(tmp_path, edit):
    """A copy of the genuine ModelOpt Llama-4 export with ``edit(tensors)`` applied to its weights."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(LLAMA4_EXPORT, tmp_path, dirs_exist_ok=True, ignore=shutil.ignore_patterns("source"))
    tensors = load_file(tmp_path / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    return tmp_path


@pytest.mark.parametrize("edit,match", [
    # a per-expert global scale [E] where ModelOpt writes one scalar per 3-D tensor
    (lambda t: t.__setitem__(f"{L4}.gate_up_proj_weight_scale_2", torch.ones(4)),
     r"'model.layers.0.feed_forward.experts.gate_up_proj_weight_scale_2' in model.safetensors: expected shape \[\]"),
    # the packed bytes in the per-expert Linear orientation [E, 2I, H/2] instead of [E, H/2, 2I]
    (lambda t: t.__setitem__(f"{L4}.gate_up_proj", t[f"{L4}.gate_up_proj"].transpose(1, 2).contiguous()),
     r"'model.layers.0.feed_forward.experts.gate_up_proj' in model.safetensors: expected shape \[4, 32, 64\]"),
    (lambda t: t.pop(f"{L4}.down_proj_weight_scale"), r"'model.layers.0.feed_forward.experts.down_proj_weight_scale' is missing"),
    (lambda t: t.__setitem__(f"{L4}.down_proj_weight_scale_2", torch.tensor(float("nan"))),
     r"'model.layers.0.feed_forward.experts.down_proj_weight_scale_2' in model.safetensors must be finite and > 0"),
    (lambda t: t[f"{L4}.gate_up_proj_weight_scale"][2, 1, 5].view(torch.uint8).fill_(0x7F),  # an E4M3 NaN
     r"'model.layers.0.feed_forward.experts.gate_up_proj_weight_scale' in model.safetensors \(expert 2\)"),
])
def test_llama4_fused_experts_bad_tensors_name_the_tensor(tmp_path, edit, match):
    with pytest.raises(CheckpointError, match=match):
        AutoModelForCausalLM.from_pretrained(_edited_llama4_export(tmp_path, edit), dtype=torch.bfloat16)


def test_fused_scale_tensors_no_module_takes_are_refused(tmp_path):
    """A ``<name>_weight_scale`` tensor of another model (here Qwen3-MoE, which has no fused experts)
    is not dropped silently."""
    model = tiny_qwen3_moe()
    write_modelopt_checkpoint(model, tmp_path, shards=1)
    data = load_file(tmp_path / "model.safetensors")
    data["model.layers.0.self_attn.qkv_proj_weight_scale"] = torch.ones(4, 96).to(torch.float8_e4m3fn)
    from safetensors.torch import save_file

    save_file(data, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="qkv_proj_weight_scale' in model.safetensors: fused NVFP4 tensors "
                                              "that no module of Qwen3MoeForCausalLM takes"):
        AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, quantization_config=ModelOptConfig())


def test_patch_moe_refuses_llama4_naming_the_way_in():
    with pytest.raises(ValueError, match="Llama-4's bmm-layout experts .* load a ModelOpt NVFP4 export"):
        patch_moe(tiny_llama4_text())


def test_unknown_packed_tensors_are_refused(tmp_path):
    """Any other NVFP4 layout fp4moe does not read: packed bytes with no NVFP4 module to take them."""
    model = tiny_qwen3_moe()
    write_modelopt_checkpoint(model, tmp_path, shards=1)
    data = load_file(tmp_path / "model.safetensors")
    data["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(64, 32, dtype=torch.uint8)
    from safetensors.torch import save_file

    save_file(data, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="q_proj.weight' .*holds packed bytes"):
        AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, quantization_config=ModelOptConfig())


def test_llama4_multimodal_checkpoint_with_language_model_prefix(tmp_path):
    """Llama-4 Scout / Maverick checkpoints are ``Llama4ForConditionalGeneration``: the text model's
    keys under ``language_model.`` beside a vision tower. The genuine text export's tensors, moved
    under that prefix next to a tiny BF16 vision tower, load through plain ``from_pretrained``
    (NVFP4 experts inside ``language_model``), give the text model's logits exactly, and save back
    byte for byte."""
    import transformers
    from safetensors.torch import save_file

    text_config = json.loads((LLAMA4_EXPORT / "config.json").read_text())
    quantization_config = text_config.pop("quantization_config")
    text_config = {k: v for k, v in text_config.items() if k not in ("architectures", "model_type")}
    vision_config = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                         image_size=56, patch_size=14, vision_output_dim=64, projector_input_dim=64,
                         projector_output_dim=64)
    config = transformers.Llama4Config(vision_config=vision_config, text_config=text_config)
    torch.manual_seed(0)
    vision = {k: v.to(torch.bfloat16).contiguous() for k, v in
              transformers.Llama4ForConditionalGeneration(config).state_dict().items() if not k.startswith("language_model.")}
    text = {f"language_model.{k}": v for k, v in load_file(LLAMA4_EXPORT / "model.safetensors").items()}
    save_file(vision | text, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    saved = config.to_dict() | {"quantization_config": quantization_config,
                                "architectures": ["Llama4ForConditionalGeneration"]}
    (tmp_path / "config.json").write_text(json.dumps(saved, default=str))

    model = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert type(model.language_model.model.layers[0].feed_forward).__name__ == "NVFP4Llama4TextMoe"
    text_model = AutoModelForCausalLM.from_pretrained(LLAMA4_EXPORT, dtype=torch.bfloat16)
    ids = load_file(LLAMA4_EXPORT / "reference_logits.safetensors")["input_ids"]
    with torch.no_grad():  # Transformers 5.24's multimodal forward fails without pixel_values (image_outputs)
        assert torch.equal(model.language_model(input_ids=ids).logits, text_model(input_ids=ids).logits)
    model.save_pretrained(tmp_path / "saved")
    ours, theirs = load_file(tmp_path / "saved" / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for key in text:
        assert torch.equal(ours[key].reshape(-1).view(torch.uint8), theirs[key].reshape(-1).view(torch.uint8)), key
