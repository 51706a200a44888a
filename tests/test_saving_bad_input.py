"""Saving: a failed save leaves the previous checkpoint; a save is its folder's whole truth.

As a hostile user would bring them: every case gets an error of a stated type whose message
names the culprit (tensor, file, layer), or the documented correct result."""

import json
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import fp4moe_ops
from hf_integration import (
    CheckpointError,
    calibrate_activation_scales,
    load_modelopt_nvfp4,
    patch_deepseek,
    patch_moe,
    save_modelopt_nvfp4,
)
from hf_integration.tiny_models import tiny_deepseek_v3, tiny_qwen3_moe
from bad_input_helpers import IDS, logits


# --- saving ----------------------------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path):
    model = patch_deepseek(tiny_deepseek_v3(num_hidden_layers=2, seed=5))
    out = tmp_path / "out"
    model.save_pretrained(out)
    return model, out, logits(model, IDS), {f.name: f.read_bytes() for f in out.iterdir()}


def still_there(out, files, want):
    assert {f.name: f.read_bytes() for f in out.iterdir()} == files
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16), IDS), want)


@pytest.mark.parametrize("where", ["config", "hf_quant_config", "swap", "copy_user_file"])
def test_a_save_failing_at_any_step_leaves_the_old_checkpoint(saved, tmp_path, monkeypatch, where):
    import hf_integration.saving as saving

    model, out, want, files = saved
    (out / "README.md").write_text("mine")
    files["README.md"] = b"mine"
    other = patch_deepseek(tiny_deepseek_v3(num_hidden_layers=2, seed=6))  # a different model saves over it
    if where == "config":
        monkeypatch.setattr(type(other.config), "save_pretrained", lambda *a, **k: (_ for _ in ()).throw(OSError("EIO")))
    elif where == "hf_quant_config":
        real = saving.Path.write_text
        monkeypatch.setattr(saving.Path, "write_text", lambda self, *a, **k: (_ for _ in ()).throw(PermissionError(
            "denied")) if self.name == "hf_quant_config.json" else real(self, *a, **k))
    elif where == "swap":
        real_replace = os.replace
        calls = []

        def replace(src, dst):
            calls.append(src)
            if len(calls) == 2:  # the new folder into place: fails after the old one moved aside
                raise OSError("EXDEV")
            return real_replace(src, dst)

        monkeypatch.setattr(saving.os, "replace", replace)
    elif where == "copy_user_file":
        monkeypatch.setattr(saving, "_copy", lambda src, dst: (_ for _ in ()).throw(OSError("ENOSPC")))
    with pytest.raises(OSError):
        other.save_pretrained(out)
    monkeypatch.undo()
    still_there(out, files, want)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]  # nothing left beside it
    other.save_pretrained(out)  # and the same save works once the fault is gone
    assert (out / "README.md").read_text() == "mine"
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16), IDS), logits(other, IDS))


def test_disk_offload_of_bf16_modules_works_and_of_nvfp4_modules_is_refused_naming_them(tmp_path):
    # all disk offload was refused, naming "NVFP4 experts" even when only lm_head went to disk
    folder = Path(__file__).parent / "fixtures" / "modelopt" / "qwen3_moe_nvfp4_default"
    ids = torch.randint(1, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    want = logits(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16), ids)
    rest = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu"}
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, offload_folder=tmp_path / "off",
                                                 device_map=rest | {"model.layers": "cpu", "lm_head": "disk"})
    assert torch.equal(logits(model, ids), want)
    with pytest.raises(ValueError, match=r"NVFP4 module 'model.layers.1.mlp.experts' to disk \(device_map entry "
                                         r"'model.layers.1': 'disk'\); put it on a GPU or the CPU"):
        AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, offload_folder=tmp_path / "off2",
                                             device_map=rest | {"model.layers.0": "cpu", "model.layers.1": "disk",
                                                                "lm_head": "cpu"})
    with pytest.raises(ValueError, match=r"to disk .*; raise max_memory"):
        AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map="auto",
                                             max_memory={"cpu": "60KB"}, offload_folder=tmp_path / "off3")


def test_saving_into_a_file_path_and_unquantized_models(saved, tmp_path):
    model, out, want, files = saved
    f = tmp_path / "a_file"
    f.write_text("keep me")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        model.save_pretrained(f)
    assert f.read_text() == "keep me"
    with pytest.raises(ValueError, match="has no fp4moe quantizer"):
        save_modelopt_nvfp4(tiny_deepseek_v3(), tmp_path / "plain")
    assert not (tmp_path / "plain").exists()


def test_push_to_hub_uploads_what_a_local_save_writes_and_a_given_state_dict_is_refused(saved, tmp_path, monkeypatch):
    # save_pretrained(push_to_hub=True) went straight to Transformers: no hf_quant_config.json, and a
    # config whose ignore list left out the BF16 modules (other readers would take them for NVFP4)
    import huggingface_hub
    import transformers.utils.hub as hf_hub

    model, out, want, files = saved
    repos, uploads = [], []

    class Repo:
        repo_id = "me/tiny-nvfp4"

    monkeypatch.setattr(huggingface_hub, "create_repo", lambda repo_id, **kw: repos.append((repo_id, kw)) or Repo())
    monkeypatch.setattr(hf_hub, "create_and_tag_model_card",
                        lambda repo_id, tags=None, token=None: huggingface_hub.ModelCard("---\nlicense: mit\n---\ncard"))

    def upload(self, working_dir, repo_id, files_timestamps, **kw):
        uploads.append((repo_id, {f.name: f.read_bytes() for f in Path(working_dir).iterdir()}, kw))

    monkeypatch.setattr(type(model), "_upload_modified_files", upload)
    pushed = tmp_path / "pushed"
    model.save_pretrained(pushed, push_to_hub=True, repo_id="me/tiny-nvfp4", commit_message="nvfp4", private=True)
    assert repos == [("me/tiny-nvfp4", {"exist_ok": True, "token": None, "private": True})]
    [(repo_id, sent, kw)] = uploads
    assert repo_id == "me/tiny-nvfp4" and kw["commit_message"] == "nvfp4"
    assert {k: v for k, v in sent.items() if k != "README.md"} == files  # byte for byte the local save
    assert "card" in sent["README.md"].decode()
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(pushed, dtype=torch.bfloat16), IDS), want)

    with pytest.raises(ValueError, match=r"save_pretrained\(state_dict=...\).*load_state_dict"):
        model.save_pretrained(tmp_path / "sd", state_dict={k: v.clone() for k, v in model.state_dict().items()})
    assert not (tmp_path / "sd").exists()


def test_a_non_main_rank_save_leaves_rank_0s_checkpoint_and_pushes_nothing(saved, monkeypatch):
    # accelerate's recipe: every rank calls save_pretrained(..., is_main_process=rank == 0); the
    # swap replaced rank 0's checkpoint by a folder holding only hf_quant_config.json
    model, out, want, files = saved
    monkeypatch.setattr(type(model), "_upload_modified_files", lambda *a, **k: pytest.fail("a non-main rank uploaded"))
    model.save_pretrained(out, is_main_process=False)
    model.save_pretrained(out, False, push_to_hub=True, repo_id="me/x")
    still_there(out, files, want)
    # a rank other than 0 that leaves is_main_process at its default (Transformers checks the rank too)
    monkeypatch.setattr(type(model), "should_save_on_this_rank", lambda self, main: False, raising=False)
    model.save_pretrained(out, push_to_hub=True, repo_id="me/x")
    still_there(out, files, want)
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"save_pretrained\(state_dict=...\)"):  # given by position too
        model.save_pretrained(out, True, {k: v.clone() for k, v in model.state_dict().items()})
    still_there(out, files, want)


def test_saving_through_a_symlink_into_dot_and_the_folder_mode_as_a_plain_save(saved, tmp_path, monkeypatch):
    # the new folder is swapped in whole, so what a plain save keeps must be kept by hand: the
    # folder's mode (tempfile's 0700 hid the checkpoint from other users), a symlink (the real
    # folder is replaced; the link had been replaced by a folder), "." (renaming "." failed)
    model, out, want, _ = saved
    other = patch_deepseek(tiny_deepseek_v3(num_hidden_layers=2, seed=6))
    umask = os.umask(0)
    os.umask(umask)
    model.save_pretrained(tmp_path / "new")
    assert (tmp_path / "new").stat().st_mode & 0o777 == 0o777 & ~umask
    out.chmod(0o750)
    link = tmp_path / "link"
    link.symlink_to(out, target_is_directory=True)
    other.save_pretrained(link)
    assert link.is_symlink() and link.resolve() == out.resolve()
    assert out.stat().st_mode & 0o777 == 0o750
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16), IDS), logits(other, IDS))
    monkeypatch.chdir(out)
    model.save_pretrained(".")
    assert Path.cwd() == out.resolve() and "config.json" in os.listdir(".")  # still standing in the folder
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(".", dtype=torch.bfloat16), IDS), want)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "new", "out"]  # nothing left beside them


def test_saving_over_a_bigger_sharded_checkpoint_leaves_no_stale_shards(saved, tmp_path):
    model, out, want, files = saved
    big = tmp_path / "big"
    model.save_pretrained(big, max_shard_size="50KB")
    assert len(list(big.glob("model-*.safetensors"))) > 2
    small = patch_moe(tiny_qwen3_moe())
    small.save_pretrained(big)
    assert sorted(f.name for f in big.glob("*.safetensors")) == ["model.safetensors"]
    assert not (big / "model.safetensors.index.json").exists()
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(big, dtype=torch.bfloat16), IDS), logits(small, IDS))


def test_a_failure_while_a_layer_is_quantized_puts_its_staged_down_proj_back(monkeypatch):
    # patch_moe quantizes down_proj first and, on an accelerator, keeps its 16-bit copy on the host
    # until the layer's NVFP4 module has replaced it (bench_patch_memory.py); a failure before that
    # (out of memory, injected here) restores it, as its own copy, so the layer is whole again.
    # Staging is forced on here (the CPU is not staged: the copy would gain nothing).
    from hf_integration import find_experts_modules
    from hf_integration import patch as patch_module

    monkeypatch.setattr(patch_module, "_staged", lambda device: True)
    model = tiny_deepseek_v3()
    layers = [m for _, m in find_experts_modules(model)]
    originals = [(m.gate_up_proj.detach().clone(), m.down_proj.detach().clone()) for m in layers]
    real, shapes = patch_module.quantize_expert_stack, []

    def second_fails(w):
        shapes.append(tuple(w.shape))
        if len(shapes) == 2:
            raise RuntimeError("CUDA out of memory (injected)")
        return real(w)

    # 1. while gate_up_proj is quantized
    monkeypatch.setattr(patch_module, "quantize_expert_stack", second_fails)
    stage = patch_module._HostStage()
    with pytest.raises(RuntimeError, match="injected"):
        patch_module._quantize_experts(layers[0], stage)
    assert shapes[0] == tuple(originals[0][1].shape)  # down_proj first
    assert torch.equal(layers[0].down_proj, originals[0][1]) and torch.equal(layers[0].gate_up_proj, originals[0][0])
    assert layers[0].down_proj.data_ptr() != stage.buffer.data_ptr()  # its own copy, not the reused buffer
    monkeypatch.setattr(patch_module, "quantize_expert_stack", real)
    got = patch_module._quantize_experts(layers[0], stage)
    want = fp4moe_ops.quantize_moe_weights(*originals[0])
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype != torch.float32 else torch.equal(a, b)
               for a, b in zip(got.tensors(), want.tensors()))
    assert layers[0].down_proj.numel() == 0  # its memory was given back while gate_up_proj was quantized
    stage.restore()

    # 2. after both are quantized, when the second layer's NVFP4 module is built: the first layer is
    # NVFP4, the second BF16 and whole
    built, real_module = [], patch_module.NVFP4Experts

    def second_module_fails(*args, **kwargs):
        if built:
            raise RuntimeError("CUDA out of memory (injected)")
        built.append(1)
        return real_module(*args, **kwargs)

    monkeypatch.setattr(patch_module, "NVFP4Experts", second_module_fails)
    with pytest.raises(RuntimeError, match="injected"):
        patch_deepseek(model)
    now = [m for _, m in find_experts_modules(model)]
    assert type(now[0]).__name__ == "NVFP4Experts" and now[1] is layers[1]
    assert torch.equal(now[1].down_proj, originals[1][1]) and torch.equal(now[1].gate_up_proj, originals[1][0])


def test_a_calibrated_patched_model_with_nvfp4_dense_linears_is_not_saved_half_calibrated(tmp_path):
    # calibration gives the routed experts input scales, not the NVFP4 linears of the dense MLPs:
    # one ModelOpt quant_algo cannot describe both, so the save is refused and writes nothing
    model = patch_deepseek(tiny_deepseek_v3(), quantize_dense_mlps=True, fuse_shared_experts=False)
    calibrate_activation_scales(model, [torch.randint(1, 256, (2, 8))])
    target = tmp_path / "out"
    with pytest.raises(ValueError, match="has no input scale while the experts have them .calibration gives"):
        model.save_pretrained(target)
    assert not target.exists() and list(tmp_path.iterdir()) == []


# --- saving into a folder that holds a checkpoint: the save is the folder's whole truth ------------


def names(folder):
    return sorted(f.name for f in folder.iterdir())


@pytest.mark.parametrize("first,second", [({"variant": "v2"}, {}), ({"variant": "v2", "max_shard_size": "50KB"}, {}),
                                          ({"max_shard_size": "50KB"}, {"variant": "v3"})])
def test_a_save_over_another_saves_variant_or_shards_leaves_none_of_them(tmp_path, first, second):
    model = patch_deepseek(tiny_deepseek_v3(num_hidden_layers=2, seed=5), verbose=False)
    out, fresh = tmp_path / "out", tmp_path / "fresh"
    model.save_pretrained(out, **first)
    (out / "tokenizer.json").write_text("{}")  # a user's file: kept
    model.save_pretrained(out, **second)
    model.save_pretrained(fresh, **second)
    assert names(out) == sorted(names(fresh) + ["tokenizer.json"])
    assert not any(("v2" in n) != ("v2" in str(second)) for n in names(out))
    if not second:
        assert torch.equal(logits(load_modelopt_nvfp4(out), IDS), logits(model, IDS))


def test_a_dequantized_model_saved_over_its_nvfp4_checkpoint_leaves_no_quantization_config(tmp_path):
    model = patch_deepseek(tiny_deepseek_v3(num_hidden_layers=2, seed=5), quantize_dense_mlps=True, verbose=False)
    model.save_pretrained(tmp_path, max_shard_size="50KB")
    (tmp_path / "README.md").write_text("mine")
    model.dequantize()
    want = logits(model, IDS)
    model.save_pretrained(tmp_path)
    assert names(tmp_path) == ["README.md", "config.json", "generation_config.json", "model.safetensors"]
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
    again = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert not getattr(again, "is_quantized", False) and torch.equal(logits(again, IDS), want)
    with pytest.raises(CheckpointError, match="no ModelOpt quantization config"):  # nor does our reader see one
        load_modelopt_nvfp4(tmp_path)


def test_a_dequantized_models_failed_save_leaves_the_nvfp4_checkpoint(tmp_path, monkeypatch):
    import transformers.modeling_utils

    model = patch_deepseek(tiny_deepseek_v3(num_hidden_layers=2, seed=5), verbose=False)
    out = tmp_path / "out"
    model.save_pretrained(out)
    files = {f.name: f.read_bytes() for f in out.iterdir()}
    model.dequantize()

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device (injected)")

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", disk_full)
    with pytest.raises(OSError, match="injected"):
        model.save_pretrained(out)
    assert {f.name: f.read_bytes() for f in out.iterdir()} == files
    assert names(tmp_path) == ["out"]  # no staging folder left beside it
