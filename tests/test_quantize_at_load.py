"""``from_pretrained(<16-bit folder>, quantization_config=ModelOptConfig(...))`` quantizes the routed
experts to NVFP4 while loading (``hf_integration.quantize_at_load``): the weights the file holds,
quantized with the recipe ``patch_moe`` uses (so the model's state dict equals the 16-bit model's
patched after loading, byte for byte), each expert's decoded weights within NVFP4's rounding of the
file's (float64 decode from the format definition), saved and loaded back as a ModelOpt checkpoint
to the same bytes, and bad input refused by name with no model returned. Models are compared by
their tensors' bytes, not by logits (a float result through BLAS may differ between machines)."""

import logging

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import hf_integration  # noqa: F401
from fp4moe_ops.oracle64 import dequant64
from hf_integration import CheckpointError, ModelOptConfig, NVFP4Experts, patch_moe
from hf_integration.tiny_models import tiny_deepseek_v3, tiny_llama4_text, tiny_mixtral, tiny_qwen3_moe

FAMILIES = {"qwen3_moe": tiny_qwen3_moe, "deepseek_v3": lambda: tiny_deepseek_v3(num_hidden_layers=2),
            "mixtral": tiny_mixtral}
W4A16 = ModelOptConfig(quant_algo="W4A16_NVFP4")


def assert_same_tensors(a, b):
    """Two models' state dicts: the same keys, every tensor the same dtype, shape and bytes."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key, t in sa.items():
        u = sb[key]
        assert (t.dtype, t.shape) == (u.dtype, u.shape), key
        assert torch.equal(t.reshape(-1).view(torch.uint8), u.reshape(-1).view(torch.uint8)), key


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def folder(request, tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(request.param)
    FAMILIES[request.param]().save_pretrained(path)
    return path


def load(path, config=W4A16, **kwargs):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, quantization_config=config, **kwargs)


def test_the_experts_load_as_nvfp4_equal_to_patch_moe_after_loading(folder, caplog):
    with caplog.at_level(logging.WARNING):
        model = load(folder)
    assert not [r for r in caplog.records if "missing" in r.getMessage().lower() or "unexpected" in r.getMessage().lower()]
    experts = [m for m in model.modules() if isinstance(m, NVFP4Experts)]
    assert experts and model.is_quantized
    assert not any(name in m._buffers for m in experts for name in ("gate_up_proj", "down_proj"))
    patched = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    patch_moe(patched, verbose=False)
    assert_same_tensors(model, patched)


def test_each_expert_is_the_files_weights_rounded_to_nvfp4(folder):
    """Per expert and projection, the float64 decode of the NVFP4 buffers against the file's 16-bit
    weights: a relative error of NVFP4's size (E2M1 has 3 bits: a Gaussian-like weight rounds with
    ~9% relative error; 0.15 allows small experts' spread), and never exactly zero (it was rounded)."""
    model = load(folder)
    bf16 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    for name, m in model.named_modules():
        if not isinstance(m, NVFP4Experts):
            continue
        source = bf16.get_submodule(name)
        for proj in ("gate_up_proj", "down_proj"):
            want = getattr(source, proj).double()
            for e in range(want.shape[0]):
                got = dequant64(m._buffers[f"{proj}_packed"][e], m._buffers[f"{proj}_scale"][e],
                                m._buffers[f"{proj}_global_scale"][e])
                err = ((got - want[e]).norm() / want[e].norm()).item()
                assert 0 < err < 0.15, (name, proj, e, err)


def test_saved_and_loaded_back_as_a_modelopt_checkpoint(folder, tmp_path):
    model = load(folder)
    model.save_pretrained(tmp_path / "nvfp4")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "nvfp4", dtype=torch.bfloat16)
    assert_same_tensors(again, model)
    assert any(k.endswith("weight_scale_2") for k in load_file(next((tmp_path / "nvfp4").glob("*.safetensors"))))


def test_a_weights_and_activations_config_quantizes_the_weights_and_says_so(folder, caplog):
    with caplog.at_level(logging.WARNING):
        model = load(folder, ModelOptConfig())  # quant_algo "NVFP4"
    assert any("weights only" in r.getMessage() for r in caplog.records)
    assert not any(m.holds_input_scales() for m in model.modules() if isinstance(m, NVFP4Experts))


def test_excluded_experts_stay_16_bit(tmp_path):
    torch.manual_seed(0)
    tiny_qwen3_moe().save_pretrained(tmp_path)
    model = load(tmp_path, ModelOptConfig(quant_algo="W4A16_NVFP4", exclude_modules=["model.layers.0.*"]))
    assert not isinstance(model.model.layers[0].mlp.experts, NVFP4Experts)
    assert isinstance(model.model.layers[1].mlp.experts, NVFP4Experts)


def test_a_non_finite_expert_weight_is_refused_naming_it(tmp_path):
    torch.manual_seed(0)
    tiny_qwen3_moe().save_pretrained(tmp_path)
    file = next(tmp_path.glob("*.safetensors"))
    tensors = load_file(file)
    key = next(k for k in sorted(tensors) if ".mlp.experts." in k and k.endswith("down_proj.weight") or
               k.endswith("mlp.experts.down_proj"))
    tensors[key] = tensors[key].clone()
    tensors[key].view(-1)[3] = float("nan")
    save_file(tensors, file, metadata={"format": "pt"})
    layer = key.split(".mlp.")[0]
    with pytest.raises(CheckpointError, match=rf"{layer}\.mlp\.experts\.down_proj.*NaN or Inf"):
        load(tmp_path)


def test_experts_fp4moe_cannot_quantize_are_refused_naming_them(tmp_path):
    torch.manual_seed(0)
    tiny_llama4_text().save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match=r"cannot quantize .*experts .*while loading"):
        load(tmp_path)


def test_gpt_oss_experts_are_refused_naming_them(tmp_path):
    from hf_integration.gpt_oss import supported
    from hf_integration.tiny_models import tiny_gpt_oss

    if not supported():
        pytest.skip("fp4moe's gpt-oss path needs a newer Transformers")
    tiny_gpt_oss().save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match=r"cannot quantize model\.layers\.0\.mlp\.experts .*bias-free"):
        load(tmp_path)


def test_device_map_sizing_counts_the_experts_nvfp4_bytes(tmp_path):
    """``device_map="auto"`` places modules by their loaded size: the experts' 16-bit placeholders
    count nothing, their NVFP4 buffers count, a linear's weight half a byte (so a model that fits
    in NVFP4 is not offloaded)."""
    from hf_integration.quantizer import ModelOptQuantizer

    torch.manual_seed(0)
    tiny_qwen3_moe().save_pretrained(tmp_path)
    seen = {}
    size = ModelOptQuantizer.param_element_size

    def spy(self, model, name, param):
        seen[name] = size(self, model, name, param)
        return seen[name]

    ModelOptQuantizer.param_element_size = spy
    try:
        load(tmp_path, ModelOptConfig(quant_algo="W4A16_NVFP4", quantize_attention=True), device_map="auto")
    finally:
        ModelOptQuantizer.param_element_size = size
    experts = "model.layers.0.mlp.experts"
    assert seen.get(f"{experts}.gate_up_proj") == 0 and seen.get(f"{experts}.down_proj") == 0
    assert seen.get(f"{experts}.gate_up_proj_packed") == 1
    assert seen.get("model.layers.0.self_attn.q_proj.weight") == 0.5  # a 16-bit weight until packed


LINEARS = ModelOptConfig(quant_algo="W4A16_NVFP4", quantize_dense_mlps=True, quantize_attention=True)


def test_configured_linears_are_quantized_as_quantize_linears_does(folder, tmp_path):
    """``quantize_dense_mlps`` / ``quantize_attention``: the same model as ``patch_moe`` with those
    options after loading, byte for byte (groups on one global scale: gate/up, q/k/v), saved and
    loaded back as a ModelOpt checkpoint."""
    from hf_integration import NVFP4Linear

    model = load(folder, LINEARS)
    patched = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    patch_moe(patched, quantize_dense_mlps=True, quantize_attention=True, fuse_shared_experts=False, verbose=False)
    linears = {n for n, m in model.named_modules() if isinstance(m, NVFP4Linear)}
    assert linears and linears == {n for n, m in patched.named_modules() if isinstance(m, NVFP4Linear)}
    assert not any(hasattr(m, "load_group") or hasattr(m, "quantizes_at_load") for m in model.modules())
    assert_same_tensors(model, patched)
    model.save_pretrained(tmp_path / "nvfp4")
    assert_same_tensors(AutoModelForCausalLM.from_pretrained(tmp_path / "nvfp4", dtype=torch.bfloat16), model)


def test_a_non_finite_linear_weight_is_refused_naming_it(tmp_path):
    torch.manual_seed(0)
    tiny_qwen3_moe().save_pretrained(tmp_path)
    file = next(tmp_path.glob("*.safetensors"))
    tensors = load_file(file)
    key = "model.layers.1.self_attn.k_proj.weight"
    tensors[key] = tensors[key].clone()
    tensors[key][0, 0] = float("inf")
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight holds NaN or Inf"):
        load(tmp_path, LINEARS)


def test_a_linear_missing_from_the_file_is_refused_naming_it(tmp_path):
    """A group whose member never arrives (q and v quantized only with k) is refused by name."""
    torch.manual_seed(0)
    tiny_qwen3_moe().save_pretrained(tmp_path)
    file = next(tmp_path.glob("*.safetensors"))
    tensors = load_file(file)
    del tensors["model.layers.0.self_attn.k_proj.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight"):
        load(tmp_path, LINEARS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_loading_onto_it_quantizes_there_and_decodes_as_patch_moe(folder):
    """``device_map="cuda"``: the experts and linears are quantized on the GPU while loading, to the
    same bytes as ``patch_moe`` on the GPU after loading (both run the same elementwise ops there),
    and greedy ``generate`` on the backend the GPU gets gives the same tokens for both models."""
    model = load(folder, LINEARS, device_map="cuda")
    patched = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map="cuda")
    patch_moe(patched, quantize_dense_mlps=True, quantize_attention=True, fuse_shared_experts=False, verbose=False)
    assert {p.device.type for p in model.state_dict().values()} == {"cuda"}
    assert_same_tensors(model, patched)
    prompt = torch.randint(1, 100, (2, 7), generator=torch.Generator().manual_seed(1)).cuda()
    a = model.generate(prompt, max_new_tokens=8, do_sample=False)
    b = patched.generate(prompt, max_new_tokens=8, do_sample=False)
    assert torch.equal(a, b)
