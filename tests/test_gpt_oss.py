"""gpt-oss MXFP4 checkpoints through ``from_pretrained`` / ``save_pretrained`` on the CPU: a tiny
checkpoint written in the published layout (checked against Transformers' own dequantizer), the
experts kept in MXFP4 (fp4moe's reference backend), logits and greedy tokens against Transformers'
dequantized model, a byte-identical save, compile without graph breaks, which quantizer wins, and
bad checkpoints."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import hf_integration  # noqa: F401 (registers the quantizers)
from fp4moe_ops import mxfp4
from hf_integration import MXFP4GptOssExperts
from hf_integration.checkpoint_format import CheckpointError
from hf_integration.mxfp4_quantizer import MIN_TRANSFORMERS, supported
from hf_integration.tiny_models import write_gpt_oss_mxfp4_checkpoint

if not supported():
    pytest.skip(f"fp4moe's gpt-oss path needs Transformers {'.'.join(map(str, MIN_TRANSFORMERS))} or later",
                allow_module_level=True)
from transformers import AutoModelForCausalLM, Mxfp4Config

PROJS = ("gate_up_proj", "down_proj")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    seed = int(torch.randint(0, 2**30, ()))  # fresh weights every run (replayable with FP4MOE_SEED)
    return path, write_gpt_oss_mxfp4_checkpoint(path, seed=seed)


def transformers_dequantized(path, dtype):
    """Transformers' own MXFP4 quantizer, dequantizing the experts (its CPU path)."""
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=Mxfp4Config(dequantize=True), dtype=dtype)
    assert type(model.model.layers[0].mlp.experts).__name__ == "GptOssExperts"
    return model.eval()


def file_tensors(folder) -> dict:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as handle:
            out.update({k: handle.get_tensor(k) for k in handle.keys()})
    return out


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_fixture_decodes_as_transformers_decodes_it(checkpoint):
    path, written = checkpoint
    ref = transformers_dequantized(path, torch.float32)
    for layer in range(2):
        experts = ref.model.layers[layer].mlp.experts
        for proj in PROJS:
            key = f"model.layers.{layer}.mlp.experts.{proj}"
            ours = mxfp4.dequantize_gpt_oss(written[f"{key}_blocks"], written[f"{key}_scales"])
            # Transformers holds [E, K, N]; every value is e2m1 * 2^e, exact in float32
            torch.testing.assert_close(getattr(experts, proj), ours.transpose(1, 2), rtol=0, atol=0)


def test_experts_load_as_the_files_bytes_never_decoded(checkpoint, monkeypatch):
    path, written = checkpoint

    def refuse(*args, **kwargs):
        raise AssertionError("the experts were decoded while loading")

    import transformers.integrations.mxfp4 as hf_mxfp4

    monkeypatch.setattr(hf_mxfp4, "convert_moe_packed_tensors", refuse)  # Transformers' dequantizer
    monkeypatch.setattr(mxfp4, "dequantize_mxfp4", refuse)  # fp4moe's
    model = AutoModelForCausalLM.from_pretrained(path)
    monkeypatch.undo()
    assert model.dtype == torch.bfloat16 and model.hf_quantizer is not None
    for layer in range(2):
        experts = model.model.layers[layer].mlp.experts
        assert isinstance(experts, MXFP4GptOssExperts) and experts.backend == "reference"
        for name, t in experts.state_dict().items():
            assert torch.equal(t, written[f"model.layers.{layer}.mlp.experts.{name}"]), name
            assert t.dtype == (torch.uint8 if name.endswith(("_blocks", "_scales")) else torch.bfloat16), name
    # the experts' only float tensors are their biases: no decoded matrix is held anywhere
    floats = {n.rpartition(".")[2] for n, t in model.state_dict().items() if ".mlp.experts." in n and t.is_floating_point()}
    assert floats == {"gate_up_proj_bias", "down_proj_bias"}, floats


def test_logits_and_greedy_tokens_match_transformers_dequantized_model(checkpoint):
    path, _ = checkpoint
    ids = torch.randint(3, 256, (2, 12))
    ours16 = AutoModelForCausalLM.from_pretrained(path).eval()  # the checkpoint's dtype: bfloat16
    ours32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ref32, ref16 = transformers_dequantized(path, torch.float32), transformers_dequantized(path, torch.bfloat16)
    assert isinstance(ours32.model.layers[1].mlp.experts, MXFP4GptOssExperts)
    with torch.no_grad():
        logits = {name: m(ids).logits for name, m in
                  (("ours16", ours16), ("ours32", ours32), ("ref32", ref32), ("ref16", ref16))}
    # float32 on the same decoded weights: the same math up to accumulation order
    assert rel(logits["ours32"], logits["ref32"]) < 1e-5
    # bfloat16: "within bf16 rounding" of the float32 logits, measured by Transformers' own bfloat16 model
    # on the same weights. Per token (median over the tokens): a router near a tie may pick another expert
    # for a token in bf16 (either model, each its own way), a discrete jump that a norm over all tokens
    # would turn into a coin toss. fp4moe's median error is no more than 1.5x Transformers' (fp4moe rounds
    # the experts' intermediate and output to bf16 where Transformers rounds every step)
    def per_token(a, b):
        return ((a.double() - b.double()).norm(dim=-1) / b.double().norm(dim=-1)).flatten().median().item()

    err_ours, err_theirs = per_token(logits["ours16"], logits["ref32"]), per_token(logits["ref16"], logits["ref32"])
    assert err_ours < 1.5 * err_theirs + 1e-3, (err_ours, err_theirs)
    assert 1e-3 < err_theirs < 0.05  # a real bf16 error (bf16's step is 2^-8), not a degenerate model
    prompt = ids[:1, :5]
    greedy = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = ref32.generate(prompt, **greedy)
        assert torch.equal(ours32.generate(prompt, **greedy), want)
        # bfloat16: every greedy choice equal where it is not a tie within bf16 noise. Teacher-forced on
        # Transformers' float32 tokens, a choice counts as decided when the float32 top-2 margin exceeds
        # twice fp4moe's largest logit error at that position (a plain token-for-token comparison fails
        # on a near-tie in a few percent of random models)
        ours, ref = ours16(want).logits[0, 4:-1].float(), ref32(want).logits[0, 4:-1]
    top2 = ref.topk(2, dim=-1).values
    decided = (top2[:, 0] - top2[:, 1]) > 2 * (ours - ref).abs().amax(dim=-1)
    assert decided.sum() >= 4, decided  # at least half of the 8 choices are clear, so the check has teeth
    assert torch.equal(ours.argmax(-1)[decided], want[0, 5:][decided])
    assert len(set(want[0, 5:].tolist())) > 1  # not one token repeated


def test_save_pretrained_writes_the_checkpoint_back_byte_for_byte(checkpoint, tmp_path):
    path, written = checkpoint
    AutoModelForCausalLM.from_pretrained(path).save_pretrained(tmp_path)
    saved, source = file_tensors(tmp_path), file_tensors(path)
    assert sorted(saved) == sorted(source)
    for key, t in source.items():
        s = saved[key]
        assert s.dtype == t.dtype and s.shape == t.shape, key
        assert torch.equal(s.contiguous().view(torch.uint8), t.contiguous().view(torch.uint8)), key
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    # and it loads again, through both quantizers
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(again.model.layers[0].mlp.experts, MXFP4GptOssExperts)
    transformers_dequantized(tmp_path, torch.float32)


def test_compile_fullgraph_no_graph_breaks(checkpoint):
    path, _ = checkpoint
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.randint(3, 256, (1, 7))
    torch._dynamo.reset()
    with torch.no_grad():
        explanation = torch._dynamo.explain(model)(ids)
        assert explanation.graph_break_count == 0, explanation.break_reasons
        assert explanation.graph_count == 1
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        # aot_eager runs the same ops as eager: equal up to bf16 ties decided alike
        torch.testing.assert_close(compiled(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_which_quantizer_wins(checkpoint, monkeypatch):
    path, _ = checkpoint
    kind = lambda model: type(model.model.layers[0].mlp.experts).__name__
    assert kind(AutoModelForCausalLM.from_pretrained(path)) == "MXFP4GptOssExperts"
    assert kind(AutoModelForCausalLM.from_pretrained(path, quantization_config=Mxfp4Config())) == "MXFP4GptOssExperts"
    # asking Transformers to dequantize is Transformers' own quantizer
    assert kind(AutoModelForCausalLM.from_pretrained(path, quantization_config=Mxfp4Config(dequantize=True))) == \
        "GptOssExperts"
    # FP4MOE_MXFP4=transformers: Transformers' own quantizer, asked of the registry as from_pretrained
    # asks it (a load with it would fetch Transformers' Hub kernels where the `kernels` package is
    # installed, which needs the network)
    from transformers.quantizers.auto import AutoHfQuantizer
    from transformers.quantizers.quantizer_mxfp4 import Mxfp4HfQuantizer

    from hf_integration.mxfp4_quantizer import MXFP4Quantizer

    assert type(AutoHfQuantizer.from_config(Mxfp4Config(), pre_quantized=True)) is MXFP4Quantizer
    monkeypatch.setenv("FP4MOE_MXFP4", "transformers")
    assert type(AutoHfQuantizer.from_config(Mxfp4Config(), pre_quantized=True)) is Mxfp4HfQuantizer


def _rewrite(src, dst, change):
    """Copy checkpoint ``src`` to ``dst`` with ``change(tensors)`` applied to every shard's tensors."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            tensors = {k: v for k, v in file_tensors_of(f).items()}
            change(tensors)
            save_file(tensors, str(dst / f.name), metadata={"format": "pt"})
        else:
            (dst / f.name).write_bytes(f.read_bytes())


def file_tensors_of(f):
    with safe_open(str(f), framework="pt") as handle:
        return {k: handle.get_tensor(k) for k in handle.keys()}


KEY = "model.layers.1.mlp.experts.down_proj_scales"


@pytest.mark.parametrize("change,error", [
    (lambda t: t.update({KEY: t[KEY].view(torch.int8)}) if KEY in t else None,
     rf"checkpoint tensor '{KEY}' in model-0000\d-of-00002.safetensors: expected dtype torch.uint8, found torch.int8"),
    (lambda t: t.update({KEY: t[KEY][:, :, :1].contiguous()}) if KEY in t else None,
     rf"checkpoint tensor '{KEY}' in .*: expected shape \[4, 64, 2\], found \[4, 64, 1\]"),
    (lambda t: t.pop(KEY, None), rf"checkpoint tensor '{KEY}' is missing \(gpt-oss MXFP4 experts of "
                                 r"'model.layers.1.mlp.experts'\)"),
    (lambda t: t[KEY].view(-1)[5].fill_(0xFF) if KEY in t else None,
     rf"checkpoint tensor '{KEY}' in model-0000\d-of-00002.safetensors \(expert \d\) holds E8M0 scale byte 0xFF \(NaN\)"),
])
def test_bad_checkpoints_name_the_tensor(checkpoint, tmp_path, change, error):
    path, _ = checkpoint
    bad = tmp_path / "bad"
    _rewrite(path, bad, change)
    if "missing" in error:  # the index still lists the removed tensor: drop it there too
        index = json.loads((bad / "model.safetensors.index.json").read_text())
        index["weight_map"].pop(KEY)
        (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=error):
        AutoModelForCausalLM.from_pretrained(bad)


def test_casts_keep_the_mxfp4_bytes(checkpoint):
    path, written = checkpoint
    model = AutoModelForCausalLM.from_pretrained(path).to(torch.float16)
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj_blocks.dtype == torch.uint8 and experts.gate_up_proj_bias.dtype == torch.float16
    assert torch.equal(experts.down_proj_scales, written["model.layers.0.mlp.experts.down_proj_scales"])
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(3, 256, (1, 4))).logits).all()


def test_set_backend_checks_every_layer_and_names_the_refusal(checkpoint):
    from hf_integration import set_backend

    path, _ = checkpoint
    model = AutoModelForCausalLM.from_pretrained(path)
    with pytest.raises(ValueError, match=r"fp4moe backend 'triton' cannot run gpt-oss's experts on cpu"):
        set_backend(model, "triton")
    assert {m.backend for m in model.modules() if isinstance(m, MXFP4GptOssExperts)} == {"reference"}
    with pytest.raises(ValueError, match="act_scale_mode must be None"):
        set_backend(model, "reference", act_scale_mode="global_max")
    set_backend(model, "auto")
    assert model.model.layers[1].mlp.experts.backend == "reference"


def test_static_cache_generate_compiled_no_graph_breaks(checkpoint):
    from transformers import StaticCache

    path, _ = checkpoint
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    prompt = torch.randint(3, 256, (1, 5))
    greedy = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = model.generate(prompt, **greedy)
        assert torch.equal(model.generate(prompt, cache_implementation="static", **greedy), want)
        # one decode step over a static cache, as generate's compiled forward runs it
        cache = StaticCache(config=model.config, max_cache_len=16)
        model(prompt, past_key_values=cache, use_cache=True)
        step = dict(input_ids=want[:, 5:6], past_key_values=cache, use_cache=True,
                    cache_position=torch.tensor([5]))
        torch._dynamo.reset()
        explanation = torch._dynamo.explain(model)(**step)
    assert explanation.graph_break_count == 0, explanation.break_reasons


def test_dequantize_gives_transformers_own_model(checkpoint, tmp_path):
    path, _ = checkpoint
    ids = torch.randint(3, 256, (1, 9))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ref = transformers_dequantized(path, torch.float32)
    model.dequantize()
    assert type(model.model.layers[0].mlp.experts).__name__ == "GptOssExperts"
    assert not getattr(model, "is_quantized", False) and getattr(model.config, "quantization_config", None) is None
    with torch.no_grad():  # the same decoded weights and the same code: identical
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=0, atol=0)
