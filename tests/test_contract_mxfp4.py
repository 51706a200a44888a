"""gpt-oss's MXFP4 experts under the contract every quantized module keeps: a checked, all-or-nothing
``load_state_dict`` (dtype, shape, E8M0 NaN and range, integer-for-float, missing tensors), the same
refusals at ``from_pretrained`` naming tensor and file, casts that keep the bytes and a
``dequantize()`` in the current dtype, ``.double()`` refused, and atomic saves that leave nothing of
an earlier checkpoint (index, ``hf_quant_config.json``) and keep the folder's other files and
links. Correct results are checked against a float64 decode written here from the format's
definition (OCP MX v1.0), not fp4moe's decoder."""

import json
import os

import pytest
import torch

import hf_integration  # noqa: F401 (registers the quantizers)
from hf_integration import MXFP4GptOssExperts
from hf_integration.checkpoint_format import CheckpointError
from hf_integration.mxfp4_quantizer import MIN_TRANSFORMERS, supported
from hf_integration.tiny_models import write_gpt_oss_mxfp4_checkpoint

if not supported():
    pytest.skip(f"fp4moe's gpt-oss path needs Transformers {'.'.join(map(str, MIN_TRANSFORMERS))} or later",
                allow_module_level=True)
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

LAYER1 = "model.layers.1.mlp.experts"
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def decode64(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """gpt-oss ``blocks [E, N, K/32, 16]`` / ``scales [E, N, K/32]`` -> ``[E, N, K]`` float64, from the
    definition: each byte two E2M1 codes (low nibble first; bit 3 the sign), times 2^(scale - 127)."""
    codes = torch.stack((blocks & 0xF, blocks >> 4), dim=-1).flatten(-2).long()  # [E, N, K/32, 32]
    magnitude = torch.tensor(E2M1, dtype=torch.float64)[codes & 7]
    values = torch.where(codes >= 8, -magnitude, magnitude)
    return (values * torch.pow(2.0, scales.double() - 127)[..., None]).flatten(-2)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Two random tiny checkpoints (fresh seeds every run): the model's and another one's, whose
    state dict differs from the model's in every expert tensor (so any partial load shows)."""
    seed = int(torch.randint(0, 2**30, ()))
    paths = []
    for n in range(2):
        path = tmp_path_factory.mktemp(f"mxfp4-{n}")
        write_gpt_oss_mxfp4_checkpoint(path, seed=seed + 7 * n)
        paths.append(path)
    return paths


def load(path, **kwargs):
    return AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()


def snapshot(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_unchanged(model, before: dict) -> None:
    after = model.state_dict()
    assert sorted(after) == sorted(before)
    for k, v in before.items():
        assert after[k].dtype == v.dtype and torch.equal(after[k], v), k


def other_state(checkpoints) -> dict:
    return {k: v.clone() for k, v in load(checkpoints[1]).state_dict().items()}


def set_byte(t: torch.Tensor, value: int) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[5] = value
    return t


# (change to the other model's state dict, error naming the key of layer 1); layer 0's tensors come
# first in the state dict, so a load that is not all-or-nothing would change them
REFUSALS = {
    "scale_nan": (lambda sd: sd.update({f"{LAYER1}.down_proj_scales": set_byte(sd[f"{LAYER1}.down_proj_scales"], 255)}),
                  rf"{LAYER1}.down_proj_scales\[\d\] holds E8M0 scale byte 0xFF \(NaN\)"),
    "scale_past_bf16": (lambda sd: sd.update({f"{LAYER1}.gate_up_proj_scales":
                                              set_byte(sd[f"{LAYER1}.gate_up_proj_scales"], 253)}),
                        rf"{LAYER1}.gate_up_proj_scales\[\d\] holds an E8M0 scale byte above 252"),
    "scales_as_float": (lambda sd: sd.update({f"{LAYER1}.down_proj_scales": sd[f"{LAYER1}.down_proj_scales"].float()}),
                        rf"{LAYER1}.down_proj_scales must be torch.uint8, got torch.float32"),
    "blocks_as_int8": (lambda sd: sd.update({f"{LAYER1}.down_proj_blocks": sd[f"{LAYER1}.down_proj_blocks"].view(torch.int8)}),
                       rf"{LAYER1}.down_proj_blocks must be torch.uint8, got torch.int8"),
    "scales_wrong_shape": (lambda sd: sd.update({f"{LAYER1}.down_proj_scales": sd[f"{LAYER1}.down_proj_scales"][:, :, :1]}),
                           rf"{LAYER1}.down_proj_scales must have shape \[4, 64, 2\], got \[4, 64, 1\]"),
    "bias_int32": (lambda sd: sd.update({f"{LAYER1}.down_proj_bias": sd[f"{LAYER1}.down_proj_bias"].to(torch.int32)}),
                   rf"{LAYER1}.down_proj_bias is torch.int32, but the model's tensor is torch.bfloat16"),
    "bias_missing": (lambda sd: sd.pop(f"{LAYER1}.down_proj_bias"), rf"{LAYER1}.down_proj_bias is missing"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_load_state_dict_refuses_naming_the_key_and_changes_nothing(checkpoints, case):
    model = load(checkpoints[0])
    before = snapshot(model)
    state = other_state(checkpoints)
    change, error = REFUSALS[case]
    change(state)
    with pytest.raises((ValueError, TypeError, RuntimeError), match=error):
        model.load_state_dict(state)
    assert_unchanged(model, before)


def test_a_module_refuses_on_its_own_too(checkpoints):
    # the module's own hook (a load into the experts module alone, no model-wide guard)
    model = load(checkpoints[0])
    experts = model.model.layers[1].mlp.experts
    before = {k: v.clone() for k, v in experts.state_dict().items()}
    state = {k: v.clone() for k, v in experts.state_dict().items()}
    state["gate_up_proj_scales"] = set_byte(state["gate_up_proj_scales"], 255)
    with pytest.raises(ValueError, match=r"^load_state_dict: gate_up_proj_scales\[\d\] holds E8M0 scale byte 0xFF"):
        experts.load_state_dict(state)
    for k, v in experts.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_a_good_load_decodes_as_the_format_defines(checkpoints):
    model, other = load(checkpoints[0], dtype=torch.float32), load(checkpoints[1], dtype=torch.float32)
    state = other.state_dict()
    model.load_state_dict(state)
    ids = torch.randint(3, 256, (1, 6))
    with torch.no_grad():  # the same bytes and the same code: identical logits
        assert torch.equal(model(ids).logits, other(ids).logits)
    experts = model.model.layers[1].mlp.experts
    decoded = experts.dequantized(model.config, torch.float32)
    for proj in ("gate_up_proj", "down_proj"):
        want = decode64(state[f"{LAYER1}.{proj}_blocks"], state[f"{LAYER1}.{proj}_scales"])
        # every value is e2m1 x 2^(s-127) with s in 121..123: exact in float32, so no tolerance
        assert torch.equal(getattr(decoded, proj).double(), want.transpose(1, 2)), proj
        assert want.abs().max() > 0 and want.std() > 0  # not a degenerate model


def test_cast_then_dequantize_decodes_in_the_current_dtype(checkpoints):
    model = load(checkpoints[0]).to(torch.float16)
    written = {k: v.clone() for k, v in model.state_dict().items() if k.endswith(("_blocks", "_scales"))}
    model.dequantize()
    experts = model.model.layers[0].mlp.experts
    assert type(experts).__name__ == "GptOssExperts"
    key = "model.layers.0.mlp.experts.down_proj"
    want = decode64(written[f"{key}_blocks"], written[f"{key}_scales"]).transpose(1, 2)
    assert experts.down_proj.dtype == torch.float16
    # values 2^-9..6 x 2^-4 are exact in float16: decoded and cast once, equal to the float64 decode
    assert torch.equal(experts.down_proj.double(), want)


def test_double_is_refused_with_the_model_unchanged(checkpoints):
    model = load(checkpoints[0])
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"model\.to\(torch\.float64\): model\.layers\.0\.mlp\.experts "
                                         r"\(MXFP4GptOssExperts\) runs bfloat16 or float16 or float32"):
        model.double()
    assert model.dtype == torch.bfloat16
    assert_unchanged(model, before)
    model.to(torch.float32)  # a dtype the op runs: allowed, the bytes kept
    assert model.model.layers[0].mlp.experts.down_proj_scales.dtype == torch.uint8


def test_double_is_refused_for_nvfp4_gpt_oss_too():
    from pathlib import Path

    export = Path(__file__).parent / "fixtures" / "gpt_oss_nvfp4" / "modelopt" / "checkpoint"
    model = load(export)
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"model\.to\(torch\.float64\): .*\(NVFP4GptOssExperts\) runs"):
        model.double()
    assert_unchanged(model, before)


# --- from_pretrained --------------------------------------------------------------------------


def rewrite(src, dst, change):
    """Copy checkpoint ``src`` to ``dst`` with ``change(tensors)`` applied to the tensors of every
    shard; the index follows (a removed tensor is dropped from it)."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            with safe_open(str(f), framework="pt") as handle:
                tensors = {k: handle.get_tensor(k) for k in handle.keys()}
            change(tensors)
            save_file(tensors, str(dst / f.name), metadata={"format": "pt"})
        else:
            (dst / f.name).write_bytes(f.read_bytes())
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    held = set()
    for f in dst.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as handle:
            held |= set(handle.keys())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k in held}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))


def changed(key, fn):
    return lambda t: t.update({key: fn(t[key])}) if key in t else None


SHARD = r"model-0000\d-of-00002\.safetensors"


@pytest.mark.parametrize("change,error", [
    (changed(f"{LAYER1}.gate_up_proj_scales", lambda t: set_byte(t, 254)),
     rf"checkpoint tensor '{LAYER1}.gate_up_proj_scales' in {SHARD} \(expert \d\) holds an E8M0 scale byte above 252"),
    (lambda t: t.pop(f"{LAYER1}.down_proj_bias", None),
     rf"checkpoint tensor '{LAYER1}.down_proj_bias' is missing \(gpt-oss MXFP4 experts of '{LAYER1}'\)"),
    (changed(f"{LAYER1}.down_proj_bias", lambda t: t.to(torch.int32)),
     rf"checkpoint tensor '{LAYER1}.down_proj_bias' in {SHARD}: expected dtype .*found torch.int32"),
    (changed(f"{LAYER1}.gate_up_proj_bias", lambda t: t[:, :3].contiguous()),
     rf"checkpoint tensor '{LAYER1}.gate_up_proj_bias' in {SHARD}: expected shape \[4, 128\], found \[4, 3\]"),
], ids=["scale_past_bf16", "bias_missing", "bias_int32", "bias_shape"])
def test_from_pretrained_refuses_naming_tensor_and_file(checkpoints, tmp_path, change, error):
    bad = tmp_path / "bad"
    rewrite(checkpoints[0], bad, change)
    with pytest.raises(CheckpointError, match=error):
        load(bad)


def test_modules_to_not_convert_naming_an_mxfp4_layer_is_refused(checkpoints, tmp_path):
    # the checkpoint's config lists the layer as kept in 16 bits while its files hold it in MXFP4:
    # Transformers' GptOssExperts would take none of its _blocks / _scales and keep random weights
    bad = tmp_path / "bad"
    rewrite(checkpoints[0], bad, lambda t: None)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"].append(LAYER1)
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=rf"modules_to_not_convert names '{LAYER1}', but the checkpoint holds "
                                              rf"its experts in MXFP4 \('{LAYER1}\.\w+' in {SHARD}\)"):
        load(bad)


# --- saving -----------------------------------------------------------------------------------


def folder_files(folder) -> dict:
    return {p.name: (os.readlink(p) if p.is_symlink() else p.read_bytes() if p.is_file() else None)
            for p in folder.iterdir()}


def test_a_save_over_an_earlier_sharded_save_leaves_no_stale_index(checkpoints, tmp_path):
    model = load(checkpoints[0])
    folder = tmp_path / "saved"
    model.save_pretrained(folder, max_shard_size="40KB")
    assert (folder / "model.safetensors.index.json").exists() and len(list(folder.glob("*.safetensors"))) > 1
    model.save_pretrained(folder)  # one file this time
    assert sorted(p.name for p in folder.glob("model*")) == ["model.safetensors"]
    again = load(folder)
    assert isinstance(again.model.layers[1].mlp.experts, MXFP4GptOssExperts)
    assert_unchanged(again, snapshot(model))


def test_a_dequantized_save_over_a_quantized_one_keeps_user_files_and_links(checkpoints, tmp_path):
    folder, elsewhere = tmp_path / "saved", tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "notes.txt").write_text("mine")
    model = load(checkpoints[0])
    model.save_pretrained(folder)
    # what an NVFP4 save leaves beside its weights, and the user's own files
    (folder / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "NVFP4"}}))
    (folder / "tokenizer_config.json").write_text("{}")
    (folder / "data").symlink_to(elsewhere, target_is_directory=True)
    model.dequantize()
    model.save_pretrained(folder)
    files = folder_files(folder)
    assert "hf_quant_config.json" not in files
    assert files["tokenizer_config.json"] == b"{}"
    assert (folder / "data").is_symlink() and files["data"] == str(elsewhere)
    assert (elsewhere / "notes.txt").read_text() == "mine"
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config
    again = load(folder)
    assert type(again.model.layers[0].mlp.experts).__name__ == "GptOssExperts"


def test_a_failed_save_leaves_the_folder_as_it_was(checkpoints, tmp_path, monkeypatch):
    model = load(checkpoints[0])
    folder = tmp_path / "saved"
    model.save_pretrained(folder, max_shard_size="40KB")
    (folder / "README.md").write_text("mine")
    before = folder_files(folder)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    import transformers.modeling_utils as modeling_utils

    monkeypatch.setattr(modeling_utils, "safe_save_file", full_disk)  # Transformers' shard writer
    with pytest.raises(OSError, match="No space left"):
        model.save_pretrained(folder)
    assert folder_files(folder) == before
