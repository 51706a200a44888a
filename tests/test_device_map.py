"""Placing a loaded model's layers over devices (hf_integration.device_map). The maps and the
loader's per-module placement are checked on CPU; spreading over two GPUs is in test_gpu.py."""

import pytest
import torch

from hf_integration.device_map import auto_device_map, device_for, flat_device_map, normalize_device_map
from hf_integration.modelopt import load_modelopt_nvfp4
from hf_integration.patch import find_experts_modules
from hf_integration.tiny_models import tiny_deepseek_v3, write_modelopt_checkpoint


def test_device_for_takes_the_longest_whole_name_prefix():
    m = normalize_device_map({"": "cpu", "model.layers.1": 1, "model.layers.1.mlp": 2})
    assert device_for("model.layers.1.self_attn", m) == torch.device("cuda", 1)
    assert device_for("model.layers.1.mlp.experts", m) == torch.device("cuda", 2)
    assert device_for("model.layers.10", m) == torch.device("cpu")  # not a prefix of "layers.10"
    with pytest.raises(ValueError, match="places no prefix of module 'lm_head'"):
        device_for("lm_head", normalize_device_map({"model": 0}))


@pytest.mark.parametrize("num_devices", [2, 3])
def test_auto_device_map_is_contiguous_and_balanced(num_devices):
    with torch.device("meta"):
        model = tiny_deepseek_v3(seed=0, num_hidden_layers=8)
    experts = {name for name, _ in find_experts_modules(model)}
    devices = [torch.device("cuda", d) for d in range(num_devices)]
    m = auto_device_map(model, list(range(num_devices)), experts)
    layer_devices = [m[f"model.layers.{i}"].index for i in range(8)]
    assert layer_devices == sorted(layer_devices) and set(layer_devices) == set(range(num_devices))
    assert device_for("model.embed_tokens", m) == devices[0] and device_for("lm_head", m) == devices[-1]
    assert device_for("model.norm", m) == devices[-1]
    # balanced: no device holds more than an equal share plus one layer (experts at NVFP4 size)
    from hf_integration.device_map import _loaded_bytes
    sizes = [_loaded_bytes(model.model.layers[i], f"model.layers.{i}", experts) for i in range(8)]
    per_device = [sum(s for s, d in zip(sizes, layer_devices) if d == k) for k in range(num_devices)]
    assert max(per_device) - min(per_device) <= max(sizes) + sum(t.numel() * t.element_size() for t in model.lm_head.parameters())


def test_loader_places_each_module_by_device_map(tmp_path):
    write_modelopt_checkpoint(tiny_deepseek_v3(seed=1, num_hidden_layers=3), tmp_path)
    plain = load_modelopt_nvfp4(tmp_path, verbose=False)
    mapped = load_modelopt_nvfp4(tmp_path, verbose=False, device_map={
        "": "cpu", "model.layers.0": "cpu", "model.layers.2.mlp": torch.device("cpu"), "lm_head": "cpu"})
    ids = torch.randint(1, 100, (2, 7))
    torch.testing.assert_close(mapped(ids).logits, plain(ids).logits, rtol=0, atol=0)
    assert not any(t.is_meta for t in list(mapped.parameters()) + list(mapped.buffers()))
    with pytest.raises(ValueError, match="device_map must be 'auto' or a"):
        load_modelopt_nvfp4(tmp_path, device_map="balanced")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="none is visible"):
            load_modelopt_nvfp4(tmp_path, device_map="auto")


def test_flat_device_map_names_disjoint_blocks_covering_every_tensor():
    model = tiny_deepseek_v3(seed=0, num_hidden_layers=3)
    model.model.layers[2].to("meta")  # a second "device" that needs no GPU
    model.lm_head.to("meta")
    flat = flat_device_map(model)
    assert flat["model.layers.2"] == torch.device("meta") and flat["lm_head"] == torch.device("meta")
    assert flat["model.layers.0"] == torch.device("cpu") and "" not in flat
    names = sorted(flat)
    assert not any(b.startswith(a + ".") for a in names for b in names)  # no key nests in another
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        owner = [k for k in names if name.startswith(k + ".")]
        assert len(owner) == 1 and flat[owner[0]] == t.device, name


def test_dispatch_hooks_only_a_model_that_spans_devices():
    from hf_integration.device_map import dispatch

    model = tiny_deepseek_v3(seed=0, num_hidden_layers=3)
    assert dispatch(model) is model and not hasattr(model, "hf_device_map")  # one device: untouched
    model.model.layers[2].to("meta")  # a second "device" that needs no GPU
    model.lm_head.to("meta")
    dispatched = dispatch(model)
    assert dispatched.hf_device_map["model.layers.2"] == "meta" and dispatched.hf_device_map["lm_head"] == "meta"
    assert dispatched.hf_device_map["model.layers.0"] == "cpu" and "" not in dispatched.hf_device_map
