"""gpt-oss's experts with NVFP4 weights (ModelOpt's export of gpt-oss): ``fp4moe::gpt_oss_moe`` on
eight NVFP4 tensors against the float64 oracle (the reference backend, and the Triton kernels in
Triton's interpreter on the CPU; every kernel family on the GPU: tests/test_mxfp4_triton.py), the
Triton layout's round trip, and the genuine ModelOpt export of a tiny gpt-oss loaded, run and saved
back byte for byte."""

import pytest
import torch

from fp4moe_ops import nvfp4
from fp4moe_ops.oracle64 import gpt_oss_moe64

SWIGLU_ALPHA = 1.702  # gpt-oss's swiglu_alpha
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def experts(e, h, i, bias_dtype=torch.bfloat16):
    """Random NVFP4 gpt-oss tensors ``[gate_up, gate_up_scale, gate_up_global_scale, gate_up_bias, down,
    down_scale, down_global_scale, down_bias]``: random bytes (every E2M1 code), E4M3 block scales 0.5 .. 4
    times per-expert global scales (gate_up GEMM outputs of a few units, so limit 7 clamps some), random
    biases; rows interleave gate and up."""
    def matrix(n, k, scale):
        block = (torch.rand(e, n, k // 16) * 3.5 + 0.5).to(torch.float8_e4m3fn)
        return torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8), block.view(torch.uint8), \
            torch.rand(e) * scale + scale / 2

    bias = lambda shape: (torch.randn(shape) * 0.5).to(bias_dtype)  # noqa: E731
    gate_up, gate_up_scale, gate_up_global_scale = matrix(2 * i, h, 0.6 / h**0.5)
    down, down_scale, down_global_scale = matrix(h, i, 0.6 / i**0.5)
    return [gate_up, gate_up_scale, gate_up_global_scale, bias((e, 2 * i)),
            down, down_scale, down_global_scale, bias((e, h))]


def routing(t, e, k):
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    ids[-1, -1] = -1  # an unused slot (expert parallelism's sentinel) contributes nothing
    return ids, torch.softmax(torch.randn(t, k), -1)


def check(out, ref):
    # the intermediate stored in bf16 and the output rounded to bf16: a few bf16 ulps (2^-8) of the
    # row scale; over the whole output about one ulp (two in Triton's CPU interpreter, which
    # truncates float32 -> bf16), as the MXFP4 tests
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=2**-6, atol=2**-6 * ref.abs().max().item())
    assert ((out.double() - ref).norm() / ref.norm()).item() < 2**-6


@pytest.mark.parametrize("limit", [7.0, 1.0])
def test_reference_backend_matches_float64(limit):
    e, h, i, t, k = 4, 64, 96, 9, 2
    tensors = experts(e, h, i)
    x = torch.randn(t, h, dtype=torch.bfloat16)
    ids, rw = routing(t, e, k)
    out = torch.ops.fp4moe.gpt_oss_moe(x, ids, rw, tensors, SWIGLU_ALPHA, limit, "reference")
    check(out, gpt_oss_moe64(x, ids, rw, tensors, SWIGLU_ALPHA, limit))


def test_strided_views_run_as_their_values():
    # the ModelOpt module passes its transposed tensors as views and a shared global scale expanded
    e, h, i = 3, 32, 32
    gate_up, gate_up_scale, gate_up_global_scale, gate_up_bias, down, down_scale, down_global_scale, down_bias = \
        experts(e, h, i)
    transposed = lambda t: t.transpose(1, 2).contiguous().transpose(1, 2)  # noqa: E731
    views = [transposed(gate_up), transposed(gate_up_scale), gate_up_global_scale[:1].expand(e), gate_up_bias,
             transposed(down), down_scale, down_global_scale[:1].expand(e), down_bias]
    assert not views[0].is_contiguous()
    x = torch.randn(5, h, dtype=torch.bfloat16)
    ids, rw = routing(5, e, 2)
    out = torch.ops.fp4moe.gpt_oss_moe(x, ids, rw, views, SWIGLU_ALPHA, 7.0, "reference")
    same = [gate_up, gate_up_scale, gate_up_global_scale[:1].repeat(e), gate_up_bias,
            down, down_scale, down_global_scale[:1].repeat(e), down_bias]
    assert torch.equal(out, torch.ops.fp4moe.gpt_oss_moe(x, ids, rw, same, SWIGLU_ALPHA, 7.0, "reference"))


def test_op_checks_name_the_tensor():
    tensors = experts(2, 32, 32)
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    ids, rw = routing(3, 2, 2)
    bad = list(tensors)
    bad[3] = bad[3][:, :-2]
    with pytest.raises(ValueError, match=r"gate_up_bias: expected .*\[2, 64\]"):
        torch.ops.fp4moe.gpt_oss_moe(x, ids, rw, bad, SWIGLU_ALPHA, 7.0, "reference")
    bad = list(tensors)
    bad[2] = bad[2].double()
    with pytest.raises(ValueError, match=r"gate_up_global_scale: expected torch.float32"):
        torch.ops.fp4moe.gpt_oss_moe(x, ids, rw, bad, SWIGLU_ALPHA, 7.0, "reference")


@pytest.mark.parametrize("h,i", [(320, 320), (96, 160)])
def test_kernel_layout_round_trip_is_byte_exact(h, i):
    layout = pytest.importorskip("fp4moe_ops.backends.triton_moe.layout")
    tensors = experts(3, h, i)
    kernel = layout.gpt_oss_kernel_tensors(tensors)
    hp, ip = -(-h // 64) * 64, -(-i // 64) * 64  # (320 as it is; 96, 160 padded to 128, 192)
    hs, is_ = layout.scale_columns(hp), layout.scale_columns(ip)  # whole 256-value steps
    assert [(t.dtype, tuple(t.shape)) for t in kernel] == [
        (torch.int32, (3, ip, hp // 4)), (torch.uint8, (3, 2 * ip, hs)), (torch.float32, (3,)),
        (torch.float32, (3, 2 * ip)), (torch.int32, (3, hp // 2, ip // 4)), (torch.uint8, (3, hp, is_)),
        (torch.float32, (3,)), (torch.float32, (3, hp))]
    back = layout.gpt_oss_checkpoint_tensors(kernel, h, i, torch.bfloat16)
    for a, b in zip(tensors, back):
        assert a.dtype == b.dtype and torch.equal(a, b)
    # the same values, independent of the kernels: rows [gate; up] de-interleaved, zeros in the padding
    values = nvfp4.dequantize_nvfp4(layout.canonical_from_paired(kernel[0]),
                                    kernel[1][..., :hp // 16].view(torch.float8_e4m3fn), kernel[2], torch.float64)
    dense = nvfp4.dequantize_nvfp4(tensors[0], tensors[1].view(torch.float8_e4m3fn), tensors[2], torch.float64)
    assert torch.equal(values[:, :i, :h], dense[:, 0::2]) and torch.equal(values[:, ip:ip + i, :h], dense[:, 1::2])
    assert not values[:, i:ip].any() and not values[:, :, h:].any()


@pytest.mark.parametrize("t,k,limit", [(1, 4, 7.0), (6, 2, 1.0)])
def test_triton_single_role_kernels_match_float64(t, k, limit):
    # the TMA path with paired weights (merged gate/up tiles), H = I = 320 as they are (a partial
    # last K step), E4M3 scales and per-expert global scales; one token (a row block per slot) and
    # several (routed blocks)
    triton_moe = pytest.importorskip("fp4moe_ops.backends.triton_moe")
    e, h, i = 4, 320, 320
    tensors = experts(e, h, i)
    x = torch.randn(t, h, dtype=torch.bfloat16)
    ids, rw = routing(t, e, k)
    cfg = triton_moe.kernel_config(t * k, e, h, i, edges=True) | {"GLUON_PREFILL": False, "DECODE_V3": False}
    kernel = [a.to(DEVICE) for a in triton_moe.gpt_oss_kernel_tensors(tensors)]
    out = triton_moe.triton_gpt_oss_moe(x.to(DEVICE), ids.to(DEVICE), rw.to(DEVICE), kernel, SWIGLU_ALPHA, limit, cfg).cpu()
    check(out, gpt_oss_moe64(x, ids, rw, tensors, SWIGLU_ALPHA, limit))


# --- ModelOpt's export of a tiny gpt-oss (tests/fixtures/gpt_oss_nvfp4/modelopt) ---------------------

from pathlib import Path  # noqa: E402

MODELOPT = Path(__file__).parent / "fixtures" / "gpt_oss_nvfp4" / "modelopt"
LLMCOMPRESSOR = MODELOPT.parent / "llmcompressor"  # the same model exported by llm-compressor (tests at the end)
# both exports, for what they share once loaded (the same module, per-expert or one global scale)
EXPORTS = pytest.mark.parametrize("export", [MODELOPT, LLMCOMPRESSOR], ids=["modelopt", "llmcompressor"])


def transformers_only():
    from hf_integration.mxfp4_quantizer import MIN_TRANSFORMERS, supported

    if not supported():
        pytest.skip(f"fp4moe's gpt-oss path needs Transformers {'.'.join(map(str, MIN_TRANSFORMERS))} or later")
    import hf_integration  # noqa: F401 (registers the quantizer)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM


def file_tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                      b.reshape(-1).view(torch.uint8))


def held_from_files(export: Path, layer: int) -> dict:
    """What fp4moe's experts module of ``layer`` should hold, built from the files by indexing alone:
    ModelOpt's tensors as they are; llm-compressor's per-expert linears placed in ModelOpt's fused
    layout (the transposes of ``[E, N, K/2]``; gate and up rows of expert e at 2i and 2i + 1) with the
    multiplying global scale ``1 / weight_global_scale``."""
    files = file_tensors(export / "checkpoint")
    prefix = f"model.layers.{layer}.mlp.experts."
    if export == MODELOPT:
        return {k[len(prefix):]: t for k, t in files.items() if k.startswith(prefix)}
    experts = range(4)

    def per_expert(leaf, tensor):
        return torch.stack([files[f"{prefix}{e}.{leaf}.{tensor}"] for e in experts])

    held = {}
    for tensor, name in (("weight_packed", ""), ("weight_scale", "_weight_scale")):
        gate, up = per_expert("gate_proj", tensor), per_expert("up_proj", tensor)  # [E, I, K']
        fused = torch.empty(gate.shape[0], gate.shape[2], 2 * gate.shape[1], dtype=gate.dtype)
        fused[:, :, 0::2], fused[:, :, 1::2] = gate.transpose(1, 2), up.transpose(1, 2)
        held[f"gate_up_proj{name}"] = fused
        held[f"down_proj{name}"] = per_expert("down_proj", tensor).transpose(1, 2).contiguous()
    gate_b, up_b = per_expert("gate_proj", "bias"), per_expert("up_proj", "bias")
    held["gate_up_proj_bias"] = torch.stack((gate_b, up_b), dim=2).flatten(1, 2)
    held["down_proj_bias"] = per_expert("down_proj", "bias")
    assert torch.equal(per_expert("gate_proj", "weight_global_scale"), per_expert("up_proj", "weight_global_scale"))
    held["gate_up_proj_weight_scale_2"] = 1 / per_expert("gate_proj", "weight_global_scale").reshape(-1)
    held["down_proj_weight_scale_2"] = 1 / per_expert("down_proj", "weight_global_scale").reshape(-1)
    return held


def model_holding(folder: Path, state: dict, dtype):
    """Transformers' gpt-oss of ``folder``'s config (quantization config dropped, eager attention)
    holding exactly ``state``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder / "checkpoint")
    del config.quantization_config
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return model


def decoded_model(dtype):
    """Transformers' gpt-oss holding the export's weights decoded in float64 by the oracle (from the
    format definition, independent of fp4moe's loader): ModelOpt's fused experts ``[E, K/2, N]`` are the
    transposes of ``[E, N, K/2]`` NVFP4 matrices, whose decoded ``[E, N, K]`` transposed again is
    Transformers' ``[E, K, N]``; attention ``[N, K/2]`` as usual; the rest as stored."""
    from fp4moe_ops.oracle64 import dequant64

    files = file_tensors(MODELOPT / "checkpoint")
    state = {}
    for key, t in files.items():
        if key.endswith(("_weight_scale", "_weight_scale_2", "_input_scale", ".weight_scale", ".weight_scale_2",
                         ".input_scale")):
            continue
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            scale, scale_2 = files[f"{key}_weight_scale"], files[f"{key}_weight_scale_2"]
            state[key] = torch.stack([dequant64(t[e].T, scale[e].T, scale_2).T for e in range(t.shape[0])]).to(dtype)
        elif key.endswith(".weight") and f"{key}_scale" in files:
            state[key] = dequant64(t, files[f"{key}_scale"], files[f"{key}_scale_2"]).to(dtype)
        else:
            state[key] = t.to(dtype)
    return model_holding(MODELOPT, state, dtype)


def test_modelopt_export_loads_with_the_experts_kept_4_bit():
    from hf_integration import NVFP4GptOssExperts

    auto = transformers_only()
    model = auto.from_pretrained(MODELOPT / "checkpoint", dtype=torch.bfloat16)
    files = file_tensors(MODELOPT / "checkpoint")
    for layer in (0, 1):
        experts = model.model.layers[layer].mlp.experts
        assert isinstance(experts, NVFP4GptOssExperts) and experts.backend == "reference"
        prefix = f"model.layers.{layer}.mlp.experts."
        for name, t in experts.state_dict().items():  # the file's bytes, never decoded
            assert same_bytes(t, files[prefix + name]), name
        assert experts.gate_up_proj.dtype == torch.uint8 and not any(
            p.dim() == 3 for p in experts.parameters())  # no decoded [E, K, N] weight anywhere


def test_modelopt_export_logits_within_bf16_rounding_of_its_float_weights():
    auto = transformers_only()
    ids = torch.load(MODELOPT / "reference_logits.pt")["input_ids"]
    ours = auto.from_pretrained(MODELOPT / "checkpoint", dtype=torch.bfloat16).eval()
    ref32, ref16 = decoded_model(torch.float32), decoded_model(torch.bfloat16)
    with torch.no_grad():
        logits = {name: m(ids).logits.double() for name, m in (("ours", ours), ("ref32", ref32), ("ref16", ref16))}

    # per token (median over tokens), as for MXFP4 (tests/test_gpt_oss.py): fp4moe's bf16 error against
    # the float32 model is no more than 1.5x Transformers' own bf16 model's on the same weights
    def per_token(a, b):
        return ((a - b).norm(dim=-1) / b.norm(dim=-1)).flatten().median().item()

    err_ours, err_theirs = per_token(logits["ours"], logits["ref32"]), per_token(logits["ref16"], logits["ref32"])
    assert err_ours < 1.5 * err_theirs + 1e-3, (err_ours, err_theirs)
    assert 1e-3 < err_theirs < 0.05  # a real bf16 error, not a degenerate model


def test_modelopt_export_reproduces_modelopts_own_weight_only_forward():
    # ModelOpt's own forward with its input quantizers off (reference_logits.pt's weight_only_logits, the
    # bf16 eager model that exported these files). Its experts are exactly what fp4moe loaded: fp4moe's
    # experts decoded (dequantize()) with the attention quantized the way ModelOpt's forward holds it
    # (each projection on its own scale: the export re-quantizes q/k/v onto one shared scale, so the
    # files' attention differs) reproduce ModelOpt's logits to within bfloat16 rounding
    import sys

    from fp4moe_ops.nvfp4 import dequantize_nvfp4, quantize_nvfp4

    auto = transformers_only()
    sys.path.insert(0, str(MODELOPT.parent))
    try:
        from common import build_tiny_gptoss
    finally:
        sys.path.remove(str(MODELOPT.parent))
    reference = torch.load(MODELOPT / "reference_logits.pt")
    model = auto.from_pretrained(MODELOPT / "checkpoint", dtype=torch.bfloat16, attn_implementation="eager")
    model.dequantize()
    source = build_tiny_gptoss().state_dict()
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")):
                q = quantize_nvfp4(source[f"{name}.weight"].float())
                module.weight.copy_(dequantize_nvfp4(q.packed, q.block_scale, q.global_scale))
        logits = model(reference["input_ids"]).logits.float()
    # The reference logits were computed on another machine: its BLAS/oneDNN sums the bf16 GEMMs in
    # another order, which can flip the bf16 rounding of a value and so move a logit by an ulp or a few
    # (seen: one logit of 12,288 off by 1.5e-5 on an AVX-512 CPU). 2^-8 of the largest logit allows a
    # few bf16 ulps at that scale; the BF16 source's logits (NVFP4's own error) lie ~100x further off.
    want = reference["weight_only_logits"]
    tol = want.abs().max().item() * 2.0**-8
    torch.testing.assert_close(logits, want, rtol=0, atol=tol)
    assert (logits - reference["bf16_source_logits"]).abs().max() > 20 * tol


def test_modelopt_export_saves_back_byte_for_byte(tmp_path):
    import json

    from hf_integration import NVFP4GptOssExperts

    auto = transformers_only()
    model = auto.from_pretrained(MODELOPT / "checkpoint", dtype=torch.bfloat16)
    model.save_pretrained(tmp_path)
    saved, source = file_tensors(tmp_path), file_tensors(MODELOPT / "checkpoint")
    assert sorted(saved) == sorted(source)
    for key, t in source.items():
        assert same_bytes(saved[key], t), key
    assert json.loads((tmp_path / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == "NVFP4"
    again = auto.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert isinstance(again.model.layers[1].mlp.experts, NVFP4GptOssExperts)
    ids = torch.randint(0, 256, (1, 7))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)


@EXPORTS
def test_export_compiles_without_graph_breaks(export):
    auto = transformers_only()
    model = auto.from_pretrained(export / "checkpoint", dtype=torch.bfloat16).eval()
    ids = torch.randint(0, 256, (1, 7))
    torch._dynamo.reset()
    with torch.no_grad():
        explanation = torch._dynamo.explain(model)(ids)
    assert explanation.graph_break_count == 0, explanation.break_reasons


@EXPORTS
def test_export_static_cache_generate_has_no_graph_breaks(export):
    from transformers import StaticCache

    auto = transformers_only()
    model = auto.from_pretrained(export / "checkpoint", dtype=torch.bfloat16).eval()
    prompt = torch.randint(0, 256, (1, 5))
    greedy = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = model.generate(prompt, **greedy)
        assert torch.equal(model.generate(prompt, cache_implementation="static", **greedy), want)
        cache = StaticCache(config=model.config, max_cache_len=16)  # one decode step, as generate compiles it
        model(prompt, past_key_values=cache, use_cache=True)
        step = dict(input_ids=want[:, 5:6], past_key_values=cache, use_cache=True, cache_position=torch.tensor([5]))
        torch._dynamo.reset()
        explanation = torch._dynamo.explain(model)(**step)
    assert explanation.graph_break_count == 0, explanation.break_reasons


def test_modelopt_export_dequantizes_to_transformers_own_model():
    # dequantize(): Transformers' own modules holding the weights decoded once to bf16, exactly the
    # oracle's float64 decode rounded to bf16 (on this fixture; a float32 product rounded twice could
    # differ by an ulp elsewhere), so the same logits as the oracle-decoded model
    auto = transformers_only()
    model = auto.from_pretrained(MODELOPT / "checkpoint", dtype=torch.bfloat16, attn_implementation="eager")
    model.dequantize()
    assert type(model.model.layers[0].mlp.experts).__name__ == "GptOssExperts"
    ref = decoded_model(torch.bfloat16)
    state, want = model.state_dict(), ref.state_dict()
    assert sorted(state) == sorted(want)
    assert all(torch.equal(state[k], want[k]) for k in want), [k for k in want if not torch.equal(state[k], want[k])]
    ids = torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)


@EXPORTS
def test_module_in_the_kernel_layout_keeps_the_checkpoint_state_dict(export):
    # on the CPU the layout change itself (what set_backend("triton") does on a GPU): the weights and
    # block scales held once, the state dict the file's bytes, a load going through them, casts
    auto = transformers_only()
    model = auto.from_pretrained(export / "checkpoint", dtype=torch.bfloat16)
    m = model.model.layers[0].mlp.experts
    before = {k: v.clone() for k, v in m.state_dict().items()}
    m._to_kernel_layout()
    m.backend = "triton"
    assert m.kernel_layout and m._buffers["gate_up_proj"] is None and m.kernel_gate_up_scale.dtype == torch.uint8
    after = m.state_dict()
    assert set(after) == set(before) and all(same_bytes(after[k], before[k]) for k in before)
    other = {k: v.clone() for k, v in model.model.layers[1].mlp.experts.state_dict().items()}
    m.load_state_dict(other)
    assert m.kernel_layout  # what the state dict said, in the kernels' layout again
    assert all(same_bytes(m.state_dict()[k], other[k]) for k in other)
    assert torch.equal(m.kernel_down_global_scale, other["down_proj_weight_scale_2"].expand(4))
    m.to(torch.float16)  # the biases cast as Transformers casts them; scales and the kernels' biases stay float32
    assert m.gate_up_proj_bias.dtype == torch.float16 and m.kernel_gate_up_bias.dtype == torch.float32
    assert m.gate_up_proj_weight_scale_2.dtype == torch.float32 and m.kernel_gate_up_global_scale.dtype == torch.float32
    assert torch.equal(m.kernel_down_bias[:, :64], m.down_proj_bias.float())
    m._to_checkpoint_layout()
    assert not m.kernel_layout and same_bytes(m.gate_up_proj, other["gate_up_proj"])


def test_bad_scales_are_refused_naming_the_tensor(tmp_path):
    # a NaN E4M3 byte in a block scale, at from_pretrained (naming key and file) and at load_state_dict
    import shutil

    from safetensors.torch import save_file

    from hf_integration.checkpoint_format import CheckpointError

    auto = transformers_only()
    bad = tmp_path / "bad"
    shutil.copytree(MODELOPT / "checkpoint", bad)
    tensors = file_tensors(bad)
    key = "model.layers.1.mlp.experts.down_proj_weight_scale"
    tensors[key].view(torch.uint8)[2, 1, 5] = 0x7F
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"checkpoint tensor '{key}' in model.safetensors .*E4M3 NaN"):
        auto.from_pretrained(bad, dtype=torch.bfloat16)
    model = auto.from_pretrained(MODELOPT / "checkpoint", dtype=torch.bfloat16)
    state = model.state_dict()
    held = state[key].clone()
    state[key] = tensors[key]
    with pytest.raises(ValueError, match=rf"load_state_dict: {key}\[2\] holds an E4M3 NaN"):
        model.load_state_dict(state)
    assert same_bytes(model.state_dict()[key], held)  # nothing changed


HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon kernels: Hopper only")
@EXPORTS
def test_export_runs_triton_on_the_gpu_as_the_reference_does(export):
    auto = transformers_only()
    ids = torch.randint(0, 256, (2, 11), device="cuda")
    model = auto.from_pretrained(export / "checkpoint", dtype=torch.bfloat16, device_map="cuda")
    assert model.model.layers[0].mlp.experts.backend == "triton"  # auto on Hopper
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        out = model(ids).logits
        from hf_integration import set_backend

        set_backend(model, "reference")
        ref = model(ids).logits
    assert ((out.double() - ref.double()).norm() / ref.double().norm()).item() < 2**-6
    assert all(same_bytes(v, state[k]) for k, v in model.state_dict().items())


@EXPORTS
def test_float16_load_casts_the_biases_only(export):
    auto = transformers_only()
    model = auto.from_pretrained(export / "checkpoint", dtype=torch.float16)
    experts = model.model.layers[0].mlp.experts
    want = held_from_files(export, 0)
    assert experts.gate_up_proj_bias.dtype == experts.down_proj_bias.dtype == torch.float16
    assert torch.equal(experts.gate_up_proj_bias, want["gate_up_proj_bias"].half())
    assert same_bytes(experts.down_proj_weight_scale, want["down_proj_weight_scale"])
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(0, 256, (1, 5))).logits).all()


@EXPORTS
def test_partial_load_in_the_kernel_layout_is_checked_against_the_held_scales(export):
    # a global scale alone (strict=False) whose largest weight overflows with the held block scales: refused
    # in either layout, the module unchanged
    auto = transformers_only()
    model = auto.from_pretrained(export / "checkpoint", dtype=torch.bfloat16)
    m = model.model.layers[0].mlp.experts
    for kernel in (False, True):
        if kernel:
            m._to_kernel_layout()
            m.backend = "triton"
        before = {k: v.clone() for k, v in m.state_dict().items()}
        with pytest.raises(ValueError, match=r"down_proj_weight_scale_2.*largest weight"):
            m.load_state_dict({"down_proj_weight_scale_2": torch.full_like(before["down_proj_weight_scale_2"], 1e36)},
                              strict=False)
        assert all(same_bytes(m.state_dict()[k], v) for k, v in before.items())
        assert m.kernel_layout == kernel


@pytest.mark.parametrize("h,i", [(40, 32), (32, 24)])
def test_sizes_the_format_cannot_hold_are_refused_by_name(h, i):
    from types import SimpleNamespace

    from hf_integration import NVFP4GptOssExperts

    config = SimpleNamespace(num_local_experts=2, hidden_size=h, intermediate_size=i, swiglu_alpha=SWIGLU_ALPHA,
                             swiglu_limit=7.0)
    with pytest.raises(ValueError, match=rf"a (hidden|intermediate) size that is a multiple of 16, got {40 if h == 40 else 24}"):
        NVFP4GptOssExperts(config)
    tensors = experts(2, 32, 32)
    x = torch.randn(3, 40, dtype=torch.bfloat16)
    ids, rw = routing(3, 2, 2)
    with pytest.raises(ValueError, match="multiple of 16"):
        torch.ops.fp4moe.gpt_oss_moe(x, ids, rw, tensors, SWIGLU_ALPHA, 7.0, "reference")


# --- llm-compressor's export of the same tiny gpt-oss (tests/fixtures/gpt_oss_nvfp4/llmcompressor) ---------


def llmcompressor_decoded_model(dtype):
    """Transformers' gpt-oss holding llm-compressor's export decoded in float64 from the format
    definition, independent of fp4moe's loader: compressed-tensors' global scales divide (W = e2m1 *
    block scale / weight_global_scale); expert e's ``gate_proj`` / ``up_proj`` ``[I, H]`` become
    the even / odd columns of Transformers' ``gate_up_proj [E, H, 2I]`` (gpt-oss's interleaved
    gate and up), its ``down_proj [H, I]`` the transpose in ``down_proj [E, I, H]``; biases alike."""
    from transformers import AutoConfig

    from fp4moe_ops.oracle64 import dequant64

    files = file_tensors(LLMCOMPRESSOR / "checkpoint")
    config = AutoConfig.from_pretrained(LLMCOMPRESSOR / "checkpoint")

    def decode(prefix):
        return (dequant64(files[f"{prefix}.weight_packed"], files[f"{prefix}.weight_scale"], 1.0)
                / files[f"{prefix}.weight_global_scale"].double())

    state = {}
    for key, t in files.items():
        if ".experts." in key or key.endswith((".weight_scale", ".weight_global_scale", ".input_global_scale")):
            continue
        if key.endswith(".weight_packed"):
            state[key.replace(".weight_packed", ".weight")] = decode(key[:-len(".weight_packed")]).to(dtype)
        else:
            state[key] = t.to(dtype)
    for layer in range(config.num_hidden_layers):
        base = f"model.layers.{layer}.mlp.experts"
        experts = range(config.num_local_experts)
        gate, up, down = (torch.stack([decode(f"{base}.{e}.{leaf}") for e in experts]) for leaf in
                          ("gate_proj", "up_proj", "down_proj"))
        gate_b, up_b, down_b = (torch.stack([files[f"{base}.{e}.{leaf}.bias"] for e in experts]) for leaf in
                                ("gate_proj", "up_proj", "down_proj"))
        gate_up = torch.stack((gate, up), dim=2).flatten(1, 2)  # [E, 2I, H]: rows gate 0, up 0, gate 1, ...
        state[f"{base}.gate_up_proj"] = gate_up.transpose(1, 2).to(dtype)
        state[f"{base}.gate_up_proj_bias"] = torch.stack((gate_b, up_b), dim=2).flatten(1, 2).to(dtype)
        state[f"{base}.down_proj"] = down.transpose(1, 2).to(dtype)
        state[f"{base}.down_proj_bias"] = down_b.to(dtype)
    return model_holding(LLMCOMPRESSOR, state, dtype)


def test_llmcompressor_export_loads_with_the_experts_kept_4_bit():
    # one biased linear per expert in the files, held in ModelOpt's fused layout with a global scale per
    # expert: every byte is the file's (gate and up rows interleaved, transposed), the global scale the
    # reciprocal of the file's dividing one
    from hf_integration import NVFP4GptOssExperts

    auto = transformers_only()
    model = auto.from_pretrained(LLMCOMPRESSOR / "checkpoint", dtype=torch.bfloat16)
    for layer in (0, 1):
        experts = model.model.layers[layer].mlp.experts
        assert isinstance(experts, NVFP4GptOssExperts) and experts.per_expert_scales
        held, want = experts.state_dict(), held_from_files(LLMCOMPRESSOR, layer)
        assert sorted(held) == sorted(want)
        assert all(same_bytes(held[k], want[k]) for k in want), [k for k in want if not same_bytes(held[k], want[k])]
        assert not any(p.dim() == 3 for p in experts.parameters())  # no decoded [E, K, N] weight anywhere


def test_llmcompressor_export_logits_match_its_float_weights_and_its_own_forward():
    # against the float32 model of the oracle-decoded weights: fp4moe's bf16 error per token (median) is
    # no more than 1.5x Transformers' own bf16 model's on the same weights; against llm-compressor's own
    # weight-only forward (reference_logits.pt: its per-expert linears, bf16, input quantizers off),
    # no further than Transformers' bf16 model of the same weights is (1.5x)
    auto = transformers_only()
    reference = torch.load(LLMCOMPRESSOR / "reference_logits.pt")
    ours = auto.from_pretrained(LLMCOMPRESSOR / "checkpoint", dtype=torch.bfloat16, attn_implementation="eager")
    ref32, ref16 = llmcompressor_decoded_model(torch.float32), llmcompressor_decoded_model(torch.bfloat16)
    with torch.no_grad():
        logits = {name: m(reference["input_ids"]).logits.double() for name, m in
                  (("ours", ours), ("ref32", ref32), ("ref16", ref16))}
    tool = reference["weight_only_logits"].double()

    def per_token(a, b):
        return ((a - b).norm(dim=-1) / b.norm(dim=-1)).flatten().median().item()

    err_ours, err_theirs = per_token(logits["ours"], logits["ref32"]), per_token(logits["ref16"], logits["ref32"])
    assert err_ours < 1.5 * err_theirs + 1e-3, (err_ours, err_theirs)
    assert 1e-3 < err_theirs < 0.05  # a real bf16 error, not a degenerate model
    tool_ours, tool_theirs = per_token(logits["ours"], tool), per_token(logits["ref16"], tool)
    assert tool_ours < 1.5 * tool_theirs + 1e-3, (tool_ours, tool_theirs)
    assert per_token(tool, reference["bf16_source_logits"].double()) > 5 * tool_ours  # the quantization is visible


def test_llmcompressor_export_dequantizes_to_the_oracles_model():
    auto = transformers_only()
    model = auto.from_pretrained(LLMCOMPRESSOR / "checkpoint", dtype=torch.bfloat16, attn_implementation="eager")
    model.dequantize()
    state, want = model.state_dict(), llmcompressor_decoded_model(torch.bfloat16).state_dict()
    assert sorted(state) == sorted(want)
    assert all(torch.equal(state[k], want[k]) for k in want), [k for k in want if not torch.equal(state[k], want[k])]


def test_llmcompressor_export_save_is_refused_naming_the_layer_and_the_folder_is_untouched(tmp_path):
    # ModelOpt's gpt-oss format (what fp4moe saves) has one global scale per projection; llm-compressor's
    # experts have one each, which only re-quantizing could fit
    auto = transformers_only()
    model = auto.from_pretrained(LLMCOMPRESSOR / "checkpoint", dtype=torch.bfloat16)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts: these gpt-oss experts have one global "
                                         r"scale per expert .*dequantize\(\)"):
        model.save_pretrained(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"] and (tmp_path / "config.json").read_text() == "{}"
    model.dequantize()
    model.save_pretrained(tmp_path / "bf16")  # the way out the message names
    assert (tmp_path / "bf16" / "model.safetensors").exists()


def test_llmcompressor_export_bad_scales_are_refused_naming_the_expert_tensor(tmp_path):
    import re
    import shutil

    from safetensors.torch import save_file

    from hf_integration.checkpoint_format import CheckpointError

    auto = transformers_only()
    for key, value in (("model.layers.1.mlp.experts.2.up_proj.weight_scale", 0x7F),  # an E4M3 NaN
                       ("model.layers.0.mlp.experts.3.down_proj.weight_global_scale", 0.0)):  # divides: never 0
        bad = tmp_path / key
        shutil.copytree(LLMCOMPRESSOR / "checkpoint", bad)
        tensors = file_tensors(bad)
        if tensors[key].dtype == torch.float8_e4m3fn:
            tensors[key].view(torch.uint8)[5, 1] = value
        else:
            tensors[key].fill_(value)
        save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(CheckpointError, match=rf"checkpoint tensor '{re.escape(key)}' in model.safetensors"):
            auto.from_pretrained(bad, dtype=torch.bfloat16)


def test_llmcompressor_export_missing_expert_tensor_is_named(tmp_path):
    import shutil

    from safetensors.torch import save_file

    from hf_integration.checkpoint_format import CheckpointError

    auto = transformers_only()
    shutil.copytree(LLMCOMPRESSOR / "checkpoint", tmp_path / "ckpt")
    tensors = file_tensors(tmp_path / "ckpt")
    del tensors["model.layers.1.mlp.experts.3.gate_proj.bias"]
    save_file(tensors, str(tmp_path / "ckpt" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts\.3\.gate_proj\.bias"):
        auto.from_pretrained(tmp_path / "ckpt", dtype=torch.bfloat16)


@EXPORTS
def test_older_transformers_refuse_nvfp4_gpt_oss_naming_the_version(export):
    # before 5.24 Transformers' gpt-oss computes otherwise (tests/test_gpt_oss.py): both exports stop at
    # from_pretrained, naming the layer and the version, instead of loading into experts that differ
    import hf_integration  # noqa: F401 (registers the quantizer)
    from transformers import AutoModelForCausalLM

    from hf_integration.checkpoint_format import CheckpointError
    from hf_integration.gpt_oss import supported

    if supported():
        pytest.skip("this Transformers runs NVFP4 gpt-oss (the tests above)")
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.experts: fp4moe loads gpt-oss's NVFP4 experts "
                                              r"on Transformers 5\.24 or later"):
        AutoModelForCausalLM.from_pretrained(export / "checkpoint", dtype=torch.bfloat16)


@EXPORTS
def test_a_zero_global_scale_in_load_state_dict_is_refused_in_either_layout(export):
    # one expert's global scale 0 (ModelOpt: the layer's one scale), refused by name, the module unchanged
    auto = transformers_only()
    m = auto.from_pretrained(export / "checkpoint", dtype=torch.bfloat16).model.layers[0].mlp.experts
    for kernel in (False, True):
        if kernel:
            m._to_kernel_layout()
            m.backend = "triton"
        before = {k: v.clone() for k, v in m.state_dict().items()}
        bad = before["down_proj_weight_scale_2"].clone()
        bad.view(-1)[-1] = 0.0
        index = r"\[3\]" if bad.dim() else ""
        with pytest.raises(ValueError, match=rf"load_state_dict: down_proj_weight_scale_2{index}"):
            m.load_state_dict({**before, "down_proj_weight_scale_2": bad})
        assert all(same_bytes(m.state_dict()[k], v) for k, v in before.items()) and m.kernel_layout == kernel


def test_llmcompressor_gate_and_up_global_scales_that_differ_are_reconciled_and_logged(tmp_path, caplog):
    # gpt-oss runs gate and up of an expert on one global scale: where the file's differ (expert 1's up
    # scale tripled here), the larger multiplier is kept and the other side's block scales are rescaled,
    # re-rounded to E4M3 (3 mantissa bits: within 2^-4 of each scale, relative, where it stays normal),
    # with a warning naming the layer; every other expert and every gate row decodes exactly
    import shutil

    from safetensors.torch import save_file

    auto = transformers_only()
    folder = tmp_path / "ckpt"
    shutil.copytree(LLMCOMPRESSOR / "checkpoint", folder)
    tensors = file_tensors(folder)
    key = "model.layers.0.mlp.experts.1.up_proj.weight_global_scale"
    tensors[key] = tensors[key] * 3
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level("WARNING", logger="transformers.fp4moe"):
        model = auto.from_pretrained(folder, dtype=torch.bfloat16)
    assert "model.layers.0.mlp.experts: 1 experts had different weight_global_scale for gate_proj and up_proj " \
           "(experts [1])" in caplog.text
    experts = model.model.layers[0].mlp.experts
    gate_up = experts._decoded(torch.float32)[0]  # [E, 2I, H]
    from fp4moe_ops.oracle64 import dequant64

    for e in range(4):
        for leaf, rows in (("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2))):
            f = f"model.layers.0.mlp.experts.{e}.{leaf}."
            want = dequant64(tensors[f + "weight_packed"], tensors[f + "weight_scale"], 1.0) / \
                tensors[f + "weight_global_scale"].double()
            got = gate_up[e, rows].double()
            if (e, leaf) != (1, "up_proj"):
                assert torch.allclose(got, want, rtol=2**-23, atol=0), (e, leaf)
            else:
                err = (got - want).abs().max() / want.abs().max()
                assert 0 < err < 2**-4, err  # re-rounded, and visibly so
