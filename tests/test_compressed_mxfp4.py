"""llm-compressor's MXFP4 exports of ordinary MoE families (tests/fixtures/llmcompressor: genuine files,
``mxfp4-pack-quantized``) through plain ``from_pretrained``: every quantized linear kept in MXFP4 (the
routed experts through ``fp4moe::fused_moe``), the logits against the tool's own fake-quant forward,
``save_pretrained`` back to the same bytes, the bad inputs refused by name; and the op's E8M0 block
scales (int8) on the reference backend and on the Triton kernels (Triton's interpreter on a CPU)
against a float64 decode written here from the format definition."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM

import hf_integration  # noqa: F401  (routes the MXFP4 compressed-tensors configs to fp4moe)
from fp4moe_ops.oracle64 import e2m1_64
from hf_integration import CheckpointError
from hf_integration.compressed_mxfp4 import CompressedTensorsMXFP4Config
from hf_integration.mxfp4_layers import MXFP4Experts, MXFP4Linear

FIXTURES = Path(__file__).parent / "fixtures" / "llmcompressor"
NAMES = ["qwen3_moe_mxfp4a16", "deepseek_v3_mxfp4a16", "qwen3_moe_mxfp4"]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def decode64(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``[..., N, K/2]`` E2M1 bytes and ``[..., N, K/32]`` E8M0 bytes -> ``[..., N, K]`` float64:
    ``e2m1 x 2^(byte - 127)``, the format's definition (0xFF is refused before it gets here)."""
    return (e2m1_64(packed).unflatten(-1, (-1, 32)) * torch.pow(2.0, scale.double() - 127)[..., None]).flatten(-2)


def per_token_error(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    got, want = got.double().flatten(0, -2), want.double().flatten(0, -2)
    return (got - want).norm(dim=-1) / want.norm(dim=-1)


def load(folder, **kwargs):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, **kwargs)


def transformers_model_of_the_decoded_weights(folder: Path, dtype: torch.dtype) -> nn.Module:
    """The BF16 source model with every quantized weight replaced by its float64 decode from the
    checkpoint (in ``dtype``): what Transformers computes with the same weights."""
    tensors = load_file(folder / "model.safetensors")
    decoded = {k.removesuffix("_packed"): decode64(v, tensors[k.replace("_packed", "_scale")])
               for k, v in tensors.items() if k.endswith(".weight_packed")}
    model = AutoModelForCausalLM.from_pretrained(folder / "source", dtype=dtype)
    state = {k: v.to(dtype) for k, v in decoded.items() if ".experts." not in k}
    for name, m in model.named_modules():
        if name.endswith("mlp.experts"):
            e = range(m.gate_up_proj.shape[0])
            state[f"{name}.gate_up_proj"] = torch.stack([torch.cat([decoded[f"{name}.{i}.gate_proj.weight"],
                                                                    decoded[f"{name}.{i}.up_proj.weight"]]) for i in e]).to(dtype)
            state[f"{name}.down_proj"] = torch.stack([decoded[f"{name}.{i}.down_proj.weight"] for i in e]).to(dtype)
    assert set(state) <= set(model.state_dict())
    model.load_state_dict(state, strict=False)
    return model


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


# --- loading and running --------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_every_quantized_linear_is_kept_in_mxfp4_with_the_files_bytes(name):
    folder = FIXTURES / name
    tensors = load_file(folder / "model.safetensors")
    model = load(folder)
    quantized = {k.removesuffix(".weight_packed") for k in tensors if k.endswith(".weight_packed")}
    held = set()
    for module_name, m in model.named_modules():
        if isinstance(m, MXFP4Experts):
            assert m.backend == "reference"  # (on a CPU; "auto" picks Triton on Hopper)
            for e in range(m.num_experts):
                for leaf, proj, rows in (("gate_proj", "gate_up_proj", slice(0, m.intermediate_size)),
                                         ("up_proj", "gate_up_proj", slice(m.intermediate_size, None)),
                                         ("down_proj", "down_proj", slice(None))):
                    key = f"{module_name}.{e}.{leaf}"
                    for t in ("packed", "scale"):
                        assert torch.equal(getattr(m, f"{proj}_{t}")[e, rows], tensors[f"{key}.weight_{t}"]), key
                    held.add(key)
        elif isinstance(m, MXFP4Linear):
            assert torch.equal(m.weight_packed, tensors[f"{module_name}.weight_packed"])
            assert torch.equal(m.weight_scale, tensors[f"{module_name}.weight_scale"])
            held.add(module_name)
    assert held == quantized
    # nothing decoded into a 16-bit weight: the only 2-D float weights left are the file's own
    floats = {n for n, p in model.named_parameters() if p.dim() == 2}
    assert floats == {k for k, v in tensors.items() if v.dim() == 2 and v.is_floating_point()}


@pytest.mark.parametrize("name", NAMES)
def test_the_logits_are_the_tools_own_within_the_arithmetic_of_a_16_bit_model(name):
    """The tool's ``logits_weights_only`` (its fake-quant forward in BF16; for the W4A4 export, the
    same model with the activations' quantization off: what fp4moe runs, see below). fp4moe's
    experts accumulate in float32 with a bf16 intermediate, its MXFP4 linears compute in bf16 on the
    exact decoded weights; the tolerance is how far the tool's logits are from Transformers' own
    model of the same decoded weights (computed here from the files), in bf16 and in float32, the
    larger of the two per statistic: a change of arithmetic alone moves them that much. A misread
    tensor would show MXFP4's own error on these models (~47% median, ``logits_bf16``)."""
    folder = FIXTURES / name
    ref = load_file(folder / "reference_logits.safetensors")
    ids, want = ref["input_ids"], ref["logits_weights_only"]
    err = per_token_error(logits(load(folder), ids), want)
    bounds = [per_token_error(logits(transformers_model_of_the_decoded_weights(folder, dtype), ids), want)
              for dtype in (torch.bfloat16, torch.float32)]
    assert err.median() <= max(b.median() for b in bounds), (err.median(), [b.median() for b in bounds])
    assert err.max() <= max(b.max() for b in bounds), (err.max(), [b.max() for b in bounds])
    assert per_token_error(ref["logits_bf16"], want).median() > 0.2  # the quantization is really there


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", NAMES)
def test_on_a_gpu_the_experts_run_triton_within_the_same_bounds(name):
    """Loaded onto a GPU, ``auto`` puts the MXFP4 experts on the Triton kernels, and the logits
    stay within the bounds of the CPU test above, with Transformers' own bf16/float32 models of the
    decoded weights run on the GPU too: the GPU's BLAS changes every other layer's arithmetic as
    well (on the H100 a CPU-only bound, 0.0098, was below fp4moe's 0.0107 on one export). The
    largest per-token error, over 24 tokens, is a noisier statistic: the four arithmetic-only models'
    maxima spread over 1.5x among themselves (0.0119-0.0183 on the DeepSeek-V3 MXFP4A16 export, H100),
    so fp4moe's, a fifth arithmetic, may exceed the largest by that spread (it measured 0.0188)."""
    folder = FIXTURES / name
    ref = load_file(folder / "reference_logits.safetensors")
    ids, want = ref["input_ids"], ref["logits_weights_only"]
    model = load(folder, device_map="cuda")
    assert {m.backend for m in model.modules() if isinstance(m, MXFP4Experts)} == {"triton"}
    err = per_token_error(logits(model, ids.cuda()).cpu(), want)
    bounds = [per_token_error(logits(transformers_model_of_the_decoded_weights(folder, dtype).to(device), ids.to(device))
                              .cpu(), want)
              for dtype in (torch.bfloat16, torch.float32) for device in ("cpu", "cuda")]
    assert err.median() <= max(b.median() for b in bounds), (err.median(), [b.median() for b in bounds])
    maxima = [b.max() for b in bounds]
    assert err.max() <= max(maxima) + (max(maxima) - min(maxima)), (err.max(), maxima)


def test_a_w4a4_export_runs_its_activations_in_16_bits_and_says_so(hf_logs):
    # fp4moe's policy for W4A4 checkpoints, as for NVFP4 ones: 16-bit activations, in a warning
    folder = FIXTURES / "qwen3_moe_mxfp4"
    raw = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert raw["config_groups"]["group_0"]["input_activations"]["dynamic"] is True
    model = load(folder)
    assert "quantizes activations too (W4A4: input_activations of config group group_0" in hf_logs.text
    assert "runs its activations in 16 bits (W4A16)" in hf_logs.text
    ref = load_file(folder / "reference_logits.safetensors")
    a16 = load(FIXTURES / "qwen3_moe_mxfp4a16")  # the same bytes, weights only
    assert torch.equal(logits(model, ref["input_ids"]), logits(a16, ref["input_ids"]))
    hf_logs.clear()
    load(FIXTURES / "qwen3_moe_mxfp4a16")
    assert "W4A4" not in hf_logs.text


def test_the_configs_come_to_fp4moe_and_others_do_not():
    import transformers.quantizers.auto as auto

    entry = auto.AUTO_QUANTIZATION_CONFIG_MAPPING["compressed-tensors"]
    for name in NAMES:
        config = json.loads((FIXTURES / name / "config.json").read_text())["quantization_config"]
        made = entry.from_dict(config)
        assert isinstance(made, CompressedTensorsMXFP4Config) and made.to_dict() == config
    if not torch.cuda.is_available():  # the loading option overrides the checkpoint's ("auto")
        with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts: .*'triton'"):
            load(FIXTURES / NAMES[0], quantization_config=CompressedTensorsMXFP4Config(backend="triton"))
    nvfp4 = json.loads((FIXTURES / "qwen3_moe_nvfp4a16" / "config.json").read_text())["quantization_config"]
    assert not CompressedTensorsMXFP4Config.is_mxfp4(nvfp4)


# --- saving ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_save_pretrained_writes_the_checkpoint_back_byte_for_byte(name, tmp_path):
    folder = FIXTURES / name
    model = load(folder)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "tokenizer.json").write_text("{}")  # kept: the save is fp4moe's atomic one
    model.save_pretrained(tmp_path / "out")
    saved, original = load_file(tmp_path / "out" / "model.safetensors"), load_file(folder / "model.safetensors")
    assert sorted(saved) == sorted(original)
    for key, t in original.items():
        assert saved[key].dtype == t.dtype and saved[key].shape == t.shape, key
        assert torch.equal(saved[key].contiguous().view(torch.uint8), t.contiguous().view(torch.uint8)), key
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert config == json.loads((folder / "config.json").read_text())["quantization_config"]
    assert (tmp_path / "out" / "tokenizer.json").exists() and not (tmp_path / "out" / "hf_quant_config.json").exists()
    ids = load_file(folder / "reference_logits.safetensors")["input_ids"]
    assert torch.equal(logits(load(tmp_path / "out"), ids), logits(model, ids))


def test_dequantize_gives_transformers_model_of_the_decoded_weights():
    folder = FIXTURES / "deepseek_v3_mxfp4a16"
    model = load(folder).dequantize()
    want = transformers_model_of_the_decoded_weights(folder, torch.bfloat16)
    assert not any(isinstance(m, (MXFP4Experts, MXFP4Linear)) for m in model.modules())
    theirs = want.state_dict()
    for key, t in model.state_dict().items():
        assert torch.equal(t, theirs[key]), key


# --- bad files ------------------------------------------------------------------------------------


def broken_copy(tmp_path, name, key, change):
    """The fixture ``name`` with tensor ``key`` changed by ``change(tensors)`` (in place)."""
    folder = tmp_path / name
    shutil.copytree(FIXTURES / name, folder, ignore=shutil.ignore_patterns("source", "reference_logits*"))
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


EXPERT = "model.layers.1.mlp.experts.5.up_proj"
LINEAR = "model.layers.0.self_attn.o_proj"
SHARED = "model.layers.2.mlp.shared_experts.down_proj"


def set_byte(key, value):
    def change(tensors):
        tensors[key][3, 0] = value
    return change


@pytest.mark.parametrize("name,key", [("qwen3_moe_mxfp4a16", f"{EXPERT}.weight_scale"),
                                      ("qwen3_moe_mxfp4a16", f"{LINEAR}.weight_scale"),
                                      ("deepseek_v3_mxfp4a16", f"{SHARED}.weight_scale")])
@pytest.mark.parametrize("byte,reason", [(0xFF, "0xFF \\(NaN\\)"), (253, "decode to Inf")])
def test_a_bad_e8m0_byte_is_refused_naming_the_tensor_and_file(tmp_path, name, key, byte, reason):
    folder = broken_copy(tmp_path, name, key, set_byte(key, byte))
    with pytest.raises(CheckpointError, match=rf"'{key}' in model.safetensors .*{reason}"):
        load(folder)


@pytest.mark.parametrize("key,change,what", [
    (f"{EXPERT}.weight_packed", lambda t: t.view(torch.int8), "expected dtype torch.uint8, found torch.int8"),
    (f"{EXPERT}.weight_scale", lambda t: t.float(), "expected dtype torch.uint8, found torch.float32"),
    (f"{EXPERT}.weight_scale", lambda t: t[:, :1].contiguous(), r"expected shape \[32, 2\], found \[32, 1\]"),
    (f"{LINEAR}.weight_packed", lambda t: t[:-1].contiguous(), r"expected shape \[64, 32\], found \[63, 32\]"),
    (f"{LINEAR}.weight_scale", lambda t: t.view(torch.float8_e8m0fnu), "expected dtype torch.uint8"),
])
def test_a_wrong_dtype_or_shape_is_refused_naming_the_tensor_and_file(tmp_path, key, change, what):
    def apply(tensors):
        tensors[key] = change(tensors[key])
    folder = broken_copy(tmp_path, "qwen3_moe_mxfp4a16", key, apply)
    with pytest.raises(CheckpointError, match=rf"'{key}' in model.safetensors: {what}"):
        load(folder)


@pytest.mark.parametrize("key", [f"{EXPERT}.weight_scale", "model.layers.1.mlp.experts.0.gate_proj.weight_packed",
                                 f"{LINEAR}.weight_scale"])
def test_a_missing_tensor_is_refused_naming_it(tmp_path, key):
    folder = broken_copy(tmp_path, "qwen3_moe_mxfp4a16", key, lambda tensors: tensors.pop(key))
    with pytest.raises(CheckpointError, match=rf"'{key}' is missing"):
        load(folder)


def test_a_quantized_tensor_no_module_takes_is_refused_naming_it(tmp_path):
    key = "model.layers.0.mlp.gate.weight_packed"  # the router is no nn.Linear: nothing would read it

    def add(tensors):
        tensors[key] = torch.zeros(8, 32, dtype=torch.uint8)
    folder = broken_copy(tmp_path, "qwen3_moe_mxfp4a16", key, add)
    with pytest.raises(CheckpointError, match=rf"'{key}' in model.safetensors is quantized, but no MXFP4"):
        load(folder)


# --- the op's E8M0 block scales, against a float64 decode -----------------------------------------


def mxfp4_layer(e, h, i, gen):
    """Random MXFP4 experts (every E2M1 code; scales 2^-8 .. 2^-3) as the op takes them, and their
    float64 matrices."""
    packed = [torch.randint(0, 256, (e, n, k // 2), generator=gen, dtype=torch.uint8) for n, k in ((2 * i, h), (h, i))]
    scales = [torch.randint(119, 125, (e, n, k // 32), generator=gen, dtype=torch.uint8) for n, k in ((2 * i, h), (h, i))]
    ones = torch.ones(e)
    tensors = [packed[0], scales[0].repeat_interleave(2, -1).view(torch.int8), ones,
               packed[1], scales[1].repeat_interleave(2, -1).view(torch.int8), ones]
    return tensors, [decode64(p, s) for p, s in zip(packed, scales)]


def moe64(x, ids, weights, gate_up, down):
    """SiLU-gated experts in float64 on float64 matrices, the intermediate rounded to x's dtype."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    inter = gate_up.shape[1] // 2
    for t, j in ((t, j) for t in range(ids.shape[0]) for j in range(ids.shape[1])):
        e = int(ids[t, j])
        if 0 <= e < gate_up.shape[0]:
            h = x[t].double() @ gate_up[e].T
            act = (torch.nn.functional.silu(h[:inter]) * h[inter:]).to(x.dtype).double()
            out[t] += float(weights[t, j]) * (act @ down[e].T)
    return out


def run_triton(x, ids, rw, tensors, h, i):
    """The Triton kernels on the op's tensors (on a CPU in Triton's interpreter, called directly:
    the op refuses the CPU for them); the paired weight layout and TMA tiles where H and I allow."""
    from fp4moe_ops.backends.triton_moe import kernel_config, triton_fused_moe
    from fp4moe_ops.backends.triton_moe.layout import fits_tma, paired_weight_layout

    tensors = list(tensors)
    config = None
    if fits_tma(h, i):
        tensors[0], tensors[3] = paired_weight_layout(tensors[0]), paired_weight_layout(tensors[3])
        config = kernel_config(ids.numel(), tensors[1].shape[0], h, i) | {"GLUON_PREFILL": False, "DECODE_V3": False}
    if DEVICE == "cuda":
        config = None
    args = [a.to(DEVICE) for a in (x, ids, rw)]
    return triton_fused_moe(*args, [a.to(DEVICE) for a in tensors], config).cpu()


@pytest.mark.parametrize("backend,h,i", [("reference", 128, 64), ("triton", 128, 64), ("triton", 256, 256)])
def test_the_op_runs_e8m0_block_scales_as_the_float64_decode(backend, h, i):
    if backend == "triton":
        pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(5)
    e, t, k = 4, 6, 2
    tensors, (gate_up, down) = mxfp4_layer(e, h, i, gen)
    x = torch.randn(t, h, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    ids[-1, -1] = -1
    rw = torch.softmax(torch.randn(t, k, generator=gen), -1)
    if backend == "reference":
        out = torch.ops.fp4moe.fused_moe(x, ids, rw, tensors, None, None, backend, 0)
    else:
        out = run_triton(x, ids, rw, tensors, h, i)
    ref = moe64(x, ids, rw, gate_up, down)
    # the output rounded to bf16, float32 sums in another order: a few bf16 ulps (2^-8) of the row
    # scale (Triton's interpreter truncates float32 -> bf16), as the NVFP4 layer tests allow
    torch.testing.assert_close(out.double(), ref, rtol=2**-6, atol=2**-6 * ref.abs().max().item())
    assert ((out.double() - ref).norm() / ref.norm()).item() < 2**-6


def test_the_experts_module_refuses_what_its_backends_cannot_run():
    m = MXFP4Experts(2, 64, 32)
    gen = torch.Generator().manual_seed(1)
    m.load_state_dict({s.name: torch.randint(119, 125, s.shape, generator=gen, dtype=torch.uint8)
                       for s in m.tensor_specs()})
    with pytest.raises(ValueError, match="MXFP4 experts run with 16-bit activations only"):
        m.set_backend("reference", "per_expert")
    with pytest.raises(RuntimeError, match="not prepared for a backend"):
        m(torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1))
    assert m.set_backend("auto") == ("triton" if torch.cuda.is_available() else "reference")


def test_the_op_refuses_mixed_scale_formats_and_a_backward_through_e8m0_scales():
    tensors, _ = mxfp4_layer(2, 64, 32, torch.Generator().manual_seed(2))
    x, ids, rw = torch.randn(3, 64, dtype=torch.bfloat16), torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1)
    mixed = list(tensors)
    mixed[4] = mixed[4].view(torch.uint8)
    with pytest.raises(ValueError, match=r"down_scale: expected torch.int8"):
        torch.ops.fp4moe.fused_moe(x, ids, rw, mixed, None, None, "reference", 0)
    # a backend on the canonical tensors whose kernels read only E4M3 scales refuses E8M0 ones
    from fp4moe_ops.backends.reference import ReferenceBackend

    nvfp4_only = type("NVFP4Only", (ReferenceBackend,), {"name": "nvfp4_only", "reads_e8m0_scales": False})()
    with pytest.raises(ValueError, match="'nvfp4_only' reads NVFP4 \\(E4M3\\) block scales only"):
        nvfp4_only.check_expert_tensors(tensors, 64)
    x.requires_grad_(True)
    out = torch.ops.fp4moe.fused_moe(x, ids, rw, tensors, None, None, "reference", 0)
    with pytest.raises(NotImplementedError, match="no backward through MXFP4 experts"):
        out.sum().backward()
