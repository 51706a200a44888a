"""What vLLM and SGLang need of an fp4moe save, on every architecture fp4moe runs: linears they fuse
into one GEMM (q/k/v, DeepSeek's q_a/kv_a, gate/up of dense MLPs, shared experts and each routed
expert) share one ``weight_scale_2`` and one ``input_scale`` in the files, and DeepSeek-V3-family
configs carry the routing fields they read (``topk_method``, ``scoring_func``)."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import hf_integration  # noqa: F401  (registers the quantizer and kimi_k2)
from fp4moe_ops.oracle64 import dequant64
from hf_integration import ModelOptConfig, NVFP4Linear, patch_moe
from hf_integration.tiny_models import write_modelopt_checkpoint

from test_architectures import ARCHITECTURES
from test_real_exports import FIXTURES, MODELOPT

# The serving engines' fused GEMMs, written out here from vLLM's deepseek_v2.py / qwen3_moe.py
# stacked_params_mapping (independent of hf_integration.fused_linears).
ENGINE_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
                "gate_up_proj": ("gate_proj", "up_proj"), "w13": ("w1", "w3")}


def fused_sets(tensors: dict) -> list[list[str]]:
    """Every set of a file's NVFP4 linears that a serving engine fuses (module prefixes)."""
    modules = {k.rsplit(".", 2)[0] for k in tensors if k.endswith(".weight_scale_2")}
    return [[f"{m}.{leaf}" for leaf in leaves] for m in sorted(modules) for leaves in ENGINE_FUSED.values()
            if all(f"{m}.{leaf}.weight_scale_2" in tensors for leaf in leaves)]


def assert_one_scale_per_gemm(tensors: dict, expect: set[str]) -> None:
    sets = fused_sets(tensors)
    found = {s[0].rsplit(".", 1)[1] for s in sets}
    assert expect <= found, f"no {expect - found} in the file: nothing checked"
    for linears in sets:
        for tensor in ("weight_scale_2", "input_scale"):
            values = [tensors[f"{name}.{tensor}"] for name in linears if f"{name}.{tensor}" in tensors]
            assert all(torch.equal(values[0], v) for v in values), (linears, tensor, values)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_patched_save_has_one_global_scale_per_fused_gemm_and_serving_config_fields(arch, tmp_path):
    model = ARCHITECTURES[arch]()
    if arch == "kimi_k2":
        model.config.model_type = "kimi_k2"
    bf16 = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    patch_moe(model, quantize_dense_mlps=True, quantize_attention=True, fuse_shared_experts=False, verbose=False)
    model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    mla = arch in ("deepseek_v3", "kimi_k2", "deepseek_v2")
    mixtral_names = arch in ("minimax_m2", "mixtral")  # experts' w1/w3, no dense MLP
    assert_one_scale_per_gemm(tensors, {"q_a_proj" if mla else "q_proj", "w1" if mixtral_names else "gate_proj"})
    # the shared scale is the set's amax / (6 * 448) (ModelOpt's recipe), and every shard still
    # decodes to its own BF16 weight within NVFP4's rounding
    for linears in fused_sets(tensors):
        if ".experts." in linears[0]:
            continue
        amax = max(float(bf16[name].abs().max()) for name in linears)
        assert float(tensors[f"{linears[0]}.weight_scale_2"]) == pytest.approx(amax / (6 * 448), rel=1e-6)
        for name in linears:
            w = dequant64(tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"], tensors[f"{name}.weight_scale_2"])
            err = (w - bf16[name].double()).norm() / bf16[name].double().norm()
            assert err < 0.15, (name, err)  # NVFP4's own error; a wrong scale gives >= 100%
    config = json.loads((tmp_path / "config.json").read_text())
    if arch in ("deepseek_v3", "kimi_k2"):
        assert (config["topk_method"], config["scoring_func"]) == ("noaux_tc", "sigmoid")
        assert "model.layers.1.mlp.gate.e_score_correction_bias" in tensors  # what noaux_tc makes vLLM read
    if arch == "deepseek_v2":
        assert config["topk_method"] == "greedy"  # Transformers' own field, as the model routes
    if arch == "minimax_m2":  # what vLLM's MiniMax-M2 class reads (it failed on a config without them)
        rope = model.model.rotary_emb.inv_freq.numel() * 2  # the rotated dims Transformers' model runs
        assert (config["scoring_func"], config["use_routing_bias"], config["rotary_dim"]) == ("sigmoid", True, rope)
        assert "model.layers.0.block_sparse_moe.e_score_correction_bias" in tensors


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe"])
def test_loaded_checkpoint_with_separate_scales_is_saved_with_one(arch, tmp_path, hf_logs):
    # a checkpoint (not ModelOpt's) whose gate/up have their own weight_scale_2: loaded kept NVFP4, the
    # fused sets are reconciled (logged), so the model computes what a re-save serves
    model = ARCHITECTURES[arch]()
    with torch.no_grad():  # every dense MLP's up apart from its gate in range: Transformers 5.17's
        for name, p in model.named_parameters():  # truncated init can give both the same largest weight
            if name.endswith("up_proj.weight") and ".experts." not in name:
                p.mul_(1.5)
    write_modelopt_checkpoint(model, tmp_path / "src", equal_gate_up_scales=False)
    source = load_file(tmp_path / "src" / "model-00001-of-00002.safetensors") | load_file(
        tmp_path / "src" / "model-00002-of-00002.safetensors")
    untied = [s for s in fused_sets(source) if not torch.equal(source[f"{s[0]}.weight_scale_2"],
                                                                source[f"{s[1]}.weight_scale_2"])]
    assert untied  # the premise
    if arch == "deepseek_v3":  # (its dense and shared MLPs are NVFP4 linears)
        assert any(".experts." not in s[0] for s in untied)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "src", dtype=torch.bfloat16,
                                                 quantization_config=ModelOptConfig(fuse_shared_experts=False))
    if arch == "deepseek_v3":
        assert "sets of linears that vLLM and SGLang run as one GEMM" in hf_logs.text
    model.save_pretrained(tmp_path / "out")
    saved = load_file(tmp_path / "out" / "model.safetensors")
    assert_one_scale_per_gemm(saved, {"gate_proj"})
    for linears in untied:  # the shard that had the larger scale is written as it was
        g = [float(source[f"{n}.weight_scale_2"]) for n in linears]
        keep = linears[g.index(max(g))]
        for tensor in ("weight", "weight_scale", "weight_scale_2"):
            assert torch.equal(saved[f"{keep}.{tensor}"].reshape(-1).view(torch.uint8),
                               source[f"{keep}.{tensor}"].reshape(-1).view(torch.uint8))


def test_save_refuses_fused_linears_with_different_scales(tmp_path):
    model = patch_moe(ARCHITECTURES["qwen3_moe"](), quantize_attention=True, verbose=False)
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.k_proj, NVFP4Linear)
    attn.k_proj.weight_scale_2.mul_(2)  # (as NVFP4Linear.quantize of k_proj alone would give)
    with pytest.raises(ValueError, match=r"self_attn\.q_proj\.weight_scale_2.*differ.*one GEMM"):
        model.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", [n for n in MODELOPT if "llama4" not in n])  # (Llama-4: gate/up one 3-D tensor)
def test_genuine_modelopt_exports_resave_with_one_scale_per_fused_gemm(name, tmp_path):
    folder = FIXTURES / "modelopt" / name
    assert_one_scale_per_gemm(load_file(folder / "model.safetensors"), set())  # ModelOpt's own, the reference
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    assert_one_scale_per_gemm(saved, {"gate_proj"} | ({"q_proj"} if "default" in name and "qwen" in name else set()))


def test_deepseek_config_contradicting_its_routing_is_refused(tmp_path):
    model = patch_moe(ARCHITECTURES["deepseek_v3"](), verbose=False)
    model.config.topk_method = "greedy"
    with pytest.raises(ValueError, match="topk_method='greedy'.*noaux_tc"):
        model.save_pretrained(tmp_path / "out")
