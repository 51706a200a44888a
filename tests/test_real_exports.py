"""Genuine exports made by the real tools (tests/fixtures/*/make_fixtures.py: nvidia-modelopt 0.47,
llmcompressor 0.14), loaded through plain ``from_pretrained`` and compared with the tool's own
fake-quant forward, and fp4moe's quantizer checked byte for byte against ModelOpt's."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import hf_integration  # noqa: F401  (registers the "modelopt" quantizer)
from hf_integration import patch_moe
from fp4moe_ops.oracle64 import CODEBOOK

FIXTURES = Path(__file__).parent / "fixtures"
MODELOPT = ["deepseek_v3_nvfp4_mlp_only", "deepseek_v3_nvfp4_default", "qwen3_moe_nvfp4_default",
            "qwen3_moe_nvfp4_fp8kv"]


def per_token_error(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    got, want = got.double().flatten(0, -2), want.double().flatten(0, -2)
    return (got - want).norm(dim=-1) / want.norm(dim=-1)


@pytest.mark.parametrize("name", MODELOPT)
def test_modelopt_export_through_from_pretrained_matches_modelopt_fake_quant(name):
    folder = FIXTURES / "modelopt" / name
    ref = load_file(folder / "reference_logits.safetensors")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)  # plain Transformers
    assert type(model.model.layers[1].mlp.experts).__name__ == "NVFP4Experts"
    with torch.no_grad():
        got = model(ref["input_ids"]).logits
    want = ref["logits_weights_only"]  # ModelOpt's weights-only fake quant (16-bit activations, as ours)
    err = per_token_error(got, want)
    # What remains is arithmetic, not format: fp4moe computes the experts in float32 on the exact
    # NVFP4 values with a bf16 intermediate, ModelOpt's eager path in bf16 (Transformers' own two
    # BF16 expert paths differ by 0.6% median on the same weights, tests/fixtures/modelopt/README.md).
    # A misread tensor would show the size of NVFP4's own error on these models (27-36%,
    # logits_bf16 below), so 2% / 5% separates them widely.
    assert err.median() < 2e-2 and err.max() < 5e-2, err
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.95
    assert per_token_error(ref["logits_bf16"], want).median() > 0.2  # the quantization is really there


def test_modelopt_fp8_kv_cache_scales_are_accepted_and_reported_unused(hf_logs):
    folder = FIXTURES / "modelopt" / "qwen3_moe_nvfp4_fp8kv"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    assert model.config.quantization_config.kv_cache_quant_algo == "FP8"
    assert "KV-cache scales (k_scale, v_scale) are not used" in hf_logs.text


def _decode32(packed, block_scale, global_scale):
    """The format definition in ModelOpt's float32 arithmetic: ``e2m1 * (float(block) * global)``
    (the codebook and nibble order of fp4moe_ops.oracle64)."""
    p = packed.long()
    codes = torch.stack([p & 15, p >> 4], dim=-1).flatten(-2)
    values = (CODEBOOK[codes & 7] * torch.where(codes >= 8, -1.0, 1.0).double()).float()
    return values * (block_scale.float() * global_scale.float()).repeat_interleave(16, dim=-1)


def _dequantized_source(folder: Path):
    """The BF16 source model with every NVFP4 tensor of the export put in, decoded by the format
    definition in float32 and rounded to bf16: what ModelOpt's weights-only fake quant computes
    with, as an independent oracle of the file."""
    model = AutoModelForCausalLM.from_pretrained(folder / "source", dtype=torch.bfloat16,
                                                 experts_implementation="eager")
    tensors = load_file(folder / "model.safetensors")
    state = model.state_dict()
    for key in list(tensors):
        if key.endswith(".weight_scale"):
            name = key[:-len(".weight_scale")]
            w = _decode32(tensors[f"{name}.weight"], tensors[key], tensors[f"{name}.weight_scale_2"]).to(torch.bfloat16)
            expert = name.rsplit(".", 2)
            if expert[0].endswith(".experts"):  # per-expert file keys -> Transformers' fused experts
                e, leaf = int(expert[1]), expert[2]
                inter = state[f"{expert[0]}.gate_up_proj"].shape[1] // 2
                if leaf == "down_proj":
                    state[f"{expert[0]}.down_proj"][e] = w
                else:
                    rows = slice(0, inter) if leaf == "gate_proj" else slice(inter, 2 * inter)
                    state[f"{expert[0]}.gate_up_proj"][e, rows] = w
            else:
                state[f"{name}.weight"].copy_(w)
    return model


@pytest.mark.parametrize("name", ["deepseek_v3_nvfp4_mlp_only", "qwen3_moe_nvfp4_default"])
def test_modelopt_oracle_is_exactly_modelopt(name):
    """The fixture's reference logits are what the file's bytes mean: the BF16 source with the
    file's weights decoded by the format definition gives ModelOpt's logits exactly."""
    import json

    import transformers
    from safetensors import safe_open

    folder = FIXTURES / "modelopt" / name
    ref = load_file(folder / "reference_logits.safetensors")
    with safe_open(str(folder / "reference_logits.safetensors"), "pt") as f:
        made_with = json.loads(f.metadata()["fixture_info"])["transformers"]
    with torch.no_grad():
        got = _dequantized_source(folder)(ref["input_ids"]).logits
    if transformers.__version__ == made_with:
        assert torch.equal(got.float(), ref["logits_weights_only"])
    else:  # another Transformers' BF16 model code rounds differently (e.g. 5.17 vs the fixtures' 5.24)
        assert per_token_error(got, ref["logits_weights_only"]).median() < 2e-2


@pytest.mark.parametrize("name,dense", [("deepseek_v3_nvfp4_mlp_only", True), ("qwen3_moe_nvfp4_default", False)])
def test_fp4moe_quantizer_is_byte_identical_to_modelopt(name, dense, tmp_path):
    """``patch_moe`` + ``save_pretrained`` of the BF16 source writes the same NVFP4 bytes, block
    scales and global scales as ModelOpt's export of it (experts; dense/shared MLPs too)."""
    folder = FIXTURES / "modelopt" / name
    model = AutoModelForCausalLM.from_pretrained(folder / "source", dtype=torch.bfloat16)
    patch_moe(model, quantize_dense_mlps=dense)
    model.save_pretrained(tmp_path)
    ours, theirs = load_file(tmp_path / "model.safetensors"), load_file(folder / "model.safetensors")
    compared = 0
    for key, t in ours.items():
        if key.endswith((".weight_scale", ".weight_scale_2")) or (key.endswith(".weight") and t.dtype == torch.uint8):
            assert theirs[key].dtype == t.dtype and theirs[key].shape == t.shape, key
            assert torch.equal(t.view(torch.uint8) if t.dtype != torch.float32 else t,
                               theirs[key].view(torch.uint8) if t.dtype != torch.float32 else theirs[key]), key
            compared += 1
    experts = sum(1 for k in theirs if ".experts." in k and k.endswith(".weight_scale"))
    assert compared >= 3 * experts  # every expert linear's weight, block and global scales
