"""NVFP4 checkpoints of each MoE architecture fp4moe runs, in the layout of their published exports
(config fields of the architecture's Transformers config, checkpoint key names from Transformers'
own reverse conversion: ``mlp.experts.<e>.gate_proj`` for DeepSeek / Kimi-K2 / GLM-4.5 / Qwen3-MoE,
``block_sparse_moe.experts.<e>.w1`` for MiniMax-M2 and Mixtral), loaded through plain
``from_pretrained`` and compared with an fp32 model holding the file's weights decoded in float64."""

import copy
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import hf_integration  # noqa: F401  (registers the quantizer and kimi_k2)
from fp4moe_ops.oracle64 import dequant64
from hf_integration import CheckpointError, ModelOptConfig
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


def test_llama4_fused_experts_are_refused_naming_the_layout(tmp_path):
    """ModelOpt keeps Llama-4's fused, transposed experts 3-D (``feed_forward.experts.gate_up_proj``
    packed, ``gate_up_proj_weight_scale`` ...): not read yet, and it must not load with random experts."""
    from safetensors.torch import save_file

    model = tiny_llama4_text()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for layer in range(2):
        prefix = f"model.layers.{layer}.feed_forward.experts"
        e, h, two_i = state[f"{prefix}.gate_up_proj"].shape
        state[f"{prefix}.gate_up_proj"] = torch.zeros(e, h, two_i // 2, dtype=torch.uint8)
        state[f"{prefix}.gate_up_proj_weight_scale"] = torch.ones(e, h // 16, two_i).to(torch.float8_e4m3fn)
        state[f"{prefix}.gate_up_proj_weight_scale_2"] = torch.ones(e)
    save_file(state, str(tmp_path / "model.safetensors"))
    cfg = model.config.to_dict() | {"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}}
    (tmp_path / "config.json").write_text(json.dumps(cfg, default=str))
    with pytest.raises(CheckpointError, match="fused 3-D NVFP4 experts .*Llama-4.* not supported"):
        AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)


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
