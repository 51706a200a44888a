"""Transformers integration on tiny random models (CPU): numerics, compile, generate, pipeline,
errors. The experts run through the reference backend on CPU (the GPU backends are covered by
tests/test_gpu.py)."""

import copy

import pytest
import torch

from fp4moe_ops import nvfp4
from hf_integration import calibrate_activation_scales, find_experts_modules, patch_deepseek, patch_moe, set_backend
from hf_integration.tiny_models import (
    tiny_deepseek_v2,
    tiny_deepseek_v3,
    tiny_glm4_moe,
    tiny_mixtral,
    tiny_qwen3_moe,
    tiny_tokenizer,
)
from fp4moe_ops.oracle64 import moe64


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def capture_experts_call(model, layer_module):
    cap = {}
    handle = layer_module.register_forward_hook(lambda mod, args, out: cap.update(args=args, out=out))
    return cap, handle


def dequantized_copy(patched, original):
    """The original model with each experts module's weights replaced by its NVFP4 weights,
    dequantized (bf16, exact up to the fp32 global-scale product)."""
    ref = copy.deepcopy(original)
    pairs = zip([m for _, m in find_experts_modules(patched)], [m for _, m in find_experts_modules(ref)])
    for p, r in pairs:
        gate_up, down = p.canonical().dequantize(torch.float32)
        r.gate_up_proj.data.copy_(gate_up)
        r.down_proj.data.copy_(down)
    return ref


DEEPSEEK_FAMILY = (tiny_deepseek_v3, tiny_deepseek_v2, tiny_glm4_moe)


@pytest.mark.parametrize("make", [*DEEPSEEK_FAMILY, tiny_qwen3_moe, tiny_mixtral])
def test_patched_layer_matches_float64_on_its_nvfp4_weights(make):
    model = make()
    original = copy.deepcopy(model)
    (patch_deepseek if make in DEEPSEEK_FAMILY else patch_moe)(model)
    experts = find_experts_modules(model)[0][1]
    assert type(experts).__name__ == "NVFP4Experts"
    cap, _ = capture_experts_call(model, experts)
    ids = torch.randint(1, 256, (2, 9))
    with torch.no_grad():
        model(ids)
    x, top_k, weights = cap["args"]
    w = experts.canonical()
    ref64 = moe64(x, top_k, weights, *w.tensors())
    # Exact wiring: only fp32-vs-fp64 accumulation and bf16 rounding of intermediate/output.
    assert rel(cap["out"], ref64) < 4e-3
    # Against the BF16 experts: NVFP4's own error, ~10% per Gaussian weight matrix,
    # compounded through gate/up and down (~17% measured on these models).
    orig_experts = find_experts_modules(original)[0][1]
    with torch.no_grad():
        bf16_out = orig_experts(x, top_k, weights)
    assert 0.03 < rel(cap["out"], bf16_out) < 0.3


def test_patched_logits_equal_model_with_dequantized_weights():
    # One MoE layer, the last: with more, a tiny arithmetic difference upstream can flip a
    # later router's discrete top-k choice and swamp the comparison.
    model = tiny_deepseek_v3(num_hidden_layers=2)
    original = copy.deepcopy(model)
    patch_deepseek(model)
    ref = dequantized_copy(model, original)
    ids = torch.randint(1, 256, (2, 11))
    with torch.no_grad():
        got, want, bf16 = model(ids).logits, ref(ids).logits, original(ids).logits
    # Same weights; fp32 (reference backend) vs bf16 (HF eager experts) arithmetic only.
    assert rel(got, want) < 3e-2
    assert rel(got, bf16) > rel(got, want)  # quantization is really in effect
    assert torch.isfinite(got).all()


def test_repr_state_dict_and_memory():
    model = tiny_deepseek_v3()
    before = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".mlp.experts." in n)
    patch_deepseek(model)
    text = repr(model)
    assert "weights=NVFP4" in text and "backend='reference'" in text
    keys = [k for k in model.state_dict() if "experts" in k]
    assert "model.layers.1.mlp.experts.gate_up_proj_packed" in keys
    assert not any(k.endswith("experts.gate_up_proj") for k in keys)
    after = sum(t.numel() * t.element_size() for n, t in model.state_dict().items() if ".mlp.experts." in n)
    assert after <= 0.3 * before  # NVFP4: 0.5 + 1/16 bytes per weight vs 2


@pytest.mark.parametrize("make", [tiny_deepseek_v3, tiny_glm4_moe, tiny_qwen3_moe, tiny_mixtral])
def test_router_swapped_for_one_op_with_same_keys_and_results(make):
    """fuse_router (the default) swaps the routers fp4moe runs as one op (DeepSeek-V3-style for
    GroupedTopkRouter, softmax top-k for SoftmaxTopkRouter): same state-dict keys and values; on
    CPU the ops' torch paths make Transformers' own calls, so the logits are bitwise those of the
    model patched with Transformers' router."""
    from hf_integration.router import ROUTERS

    model = make()
    for name, bias in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # a bf16 bias (as a bf16 model may carry) works too
            bias.data = (torch.randn_like(bias) * 0.05).to(torch.bfloat16 if "layers.1." in name else bias.dtype)
    hf_routed = patch_moe(copy.deepcopy(model), fuse_router=False)
    keys = hf_routed.state_dict().keys()
    hf_routers = [type(m).__name__ for m in hf_routed.modules() if type(m).__name__ in ROUTERS]
    patch_moe(model)
    routers = [m for m in model.modules() if isinstance(m, tuple(ROUTERS.values()))]
    assert len(routers) == len(hf_routers) > 0
    assert {type(m).__bases__ for m in routers} == {(ROUTERS[n], type(h)) for h in hf_routed.modules()
                                                     if (n := type(h).__name__) in ROUTERS}
    assert model.state_dict().keys() == keys
    for k, v in hf_routed.state_dict().items():
        if ".gate." in k:
            assert torch.equal(model.state_dict()[k], v), k
    ids = torch.randint(1, 256, (2, 9))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, hf_routed(ids).logits)


@pytest.mark.parametrize("make", [tiny_qwen3_moe, tiny_mixtral])
def test_swapped_router_keeps_router_logits_and_aux_loss(make):
    """output_router_logits: Transformers hooks every instance of the model's router class to
    collect the logits; the swapped router is still one, so the logits and the auxiliary loss are
    those of Transformers' router (bitwise on CPU, where the op runs Transformers' calls)."""
    model = make()
    model.config.output_router_logits = True
    hf_routed = patch_moe(copy.deepcopy(model), fuse_router=False)
    patch_moe(model)
    ids = torch.randint(1, 256, (2, 9))
    with torch.no_grad():
        got, want = model(ids, labels=ids), hf_routed(ids, labels=ids)
    assert len(got.router_logits) == len(want.router_logits) == model.config.num_hidden_layers
    for a, b in zip(got.router_logits, want.router_logits):
        assert torch.equal(a, b)
    assert want.aux_loss > 0 and torch.equal(got.aux_loss, want.aux_loss)
    assert torch.equal(got.loss, want.loss)


def test_swapped_router_keeps_accelerate_hook():
    """A router that accelerate's dispatch gave a hook (device_map) keeps it after the swap."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    from hf_integration.router import GroupedTopkRouter

    model = tiny_deepseek_v3()
    add_hook_to_module(model.model.layers[1].mlp.gate, AlignDevicesHook(execution_device="cpu", io_same_device=True))
    patch_deepseek(model)
    router = model.model.layers[1].mlp.gate
    assert isinstance(router, GroupedTopkRouter) and isinstance(router._hf_hook, AlignDevicesHook)
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(1, 256, (1, 5))).logits).all()


def test_compile_fullgraph_no_graph_breaks_and_dynamic_lengths():
    import torch._dynamo.testing

    model = patch_deepseek(tiny_deepseek_v3(num_hidden_layers=2))
    ids = torch.randint(1, 256, (1, 6))
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model)(ids)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, fullgraph=True, backend=counter, dynamic=True)
    frames = []
    with torch.no_grad():
        for length in (5, 8, 13):
            ids = torch.randint(1, 256, (1, length))
            # inductor's fused bf16 kernels round differently from eager, and a router near a
            # tie may then pick other experts for a token: most tokens must agree closely
            got, want = compiled(ids).logits[0].double(), model(ids).logits[0].double()
            per_token = (got - want).norm(dim=-1) / want.norm(dim=-1)
            assert per_token.median() < 2e-2, per_token
            frames.append(counter.frame_count)
    assert frames[0] == frames[1] == frames[2], frames  # no recompilation per length


def test_generate_compiled_static_cache_matches_eager():
    from transformers import CompileConfig

    model = patch_deepseek(tiny_deepseek_v3())
    ids = torch.randint(1, 256, (1, 5))
    # min_new_tokens: a random prompt can make the tiny model say EOS at once (~1% of seeds), and then
    # no decode step runs to be compiled
    eager = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, disable_compile=True)
    # aot_eager: Dynamo + AOTAutograd trace the decode step (op included, fullgraph) but run
    # eager kernels, so tokens must match exactly; inductor's different bf16 rounding can flip
    # a near-tied router or logit and is compared by tolerance elsewhere.
    cfg = CompileConfig(fullgraph=True, backend="aot_eager", mode=None)
    cfg._compile_all_devices = True  # Transformers compiles generate() on CUDA only unless told
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                              cache_implementation="static", compile_config=cfg)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # the decode step was compiled
    assert torch.equal(eager, compiled), (eager, compiled)


def test_generate_compiled_chunked_prefill_matches_eager():
    """Transformers' chunked prefill (``prefill_chunk_size``) runs the prompt through the compiled
    model a chunk at a time, the route around the eager prefill's host time: fp4moe's experts and
    router trace there without a graph break (fullgraph), and the first token's logits are the eager
    prefill's."""
    from transformers import CompileConfig

    model = patch_moe(tiny_qwen3_moe(), verbose=False)
    ids = torch.randint(1, 200, (1, 24), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=1, do_sample=False, output_logits=True, return_dict_in_generate=True)
    eager = model.generate(ids, disable_compile=True, **kw).logits[0].float()
    cfg = CompileConfig(fullgraph=True, backend="aot_eager", mode=None)
    cfg._compile_all_devices = True
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    chunked = model.generate(ids, prefill_chunk_size=8, cache_implementation="static", compile_config=cfg,
                             **kw).logits[0].float()
    # one token asked: only the prefill's chunks can have been compiled (none without chunking)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    assert not torch._dynamo.utils.counters["graph_break"]
    # the same bf16 model over 8-token chunks: only summation orders change (aot_eager runs eager
    # kernels), so within 2 bf16 ulps (2^-7 relative) of the largest logit
    torch.testing.assert_close(chunked, eager, rtol=0, atol=2 ** -7 * eager.abs().max().item())


def test_pipeline_text_generation_matches_generate():
    from transformers import pipeline

    model = patch_deepseek(tiny_deepseek_v3())
    tok = tiny_tokenizer()
    pipe = pipeline("text-generation", model=model, tokenizer=tok, device="cpu")
    text = pipe("w1 w2 w3", max_new_tokens=4, do_sample=False, return_full_text=False)[0]["generated_text"]
    ids = tok("w1 w2 w3", return_tensors="pt").input_ids
    direct = model.generate(ids, max_new_tokens=4, do_sample=False)[0, ids.shape[1]:]
    # the pipeline's text skips special tokens ([EOS] can come out of a random model)
    assert text.split() == [t for t in tok.convert_ids_to_tokens(direct.tolist()) if t not in tok.all_special_tokens]


def test_errors_leave_model_untouched():
    from transformers import AutoModelForCausalLM, LlamaConfig

    llama = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                         num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(ValueError, match="supports model types"):
        patch_deepseek(llama)
    with pytest.raises(ValueError, match="no Transformers experts modules"):
        patch_moe(llama)

    odd = tiny_deepseek_v3(moe_intermediate_size=24)  # I not a multiple of 16
    with pytest.raises(ValueError, match="multiples of 16"):
        patch_deepseek(odd)
    assert all(isinstance(m.gate_up_proj, torch.nn.Parameter) for _, m in
               __import__("hf_integration").find_experts_modules(odd))  # nothing half-patched

    model = patch_deepseek(tiny_deepseek_v3())
    with pytest.raises(ValueError, match="already patched"):
        patch_deepseek(model)
    with pytest.raises(ValueError, match="cannot run on cpu"):
        patch_deepseek(tiny_deepseek_v3(), backend="triton")


def test_calibration_enables_nvfp4_activations():
    model = patch_deepseek(tiny_deepseek_v3())
    ids = torch.randint(1, 256, (2, 9))
    calibrate_activation_scales(model, [torch.randint(1, 256, (2, 16)) for _ in range(3)] + [ids])
    experts = [m for _, m in find_experts_modules(model)]
    for m in experts:
        s1 = m.gate_up_proj_input_scale
        assert s1.shape == (8,) and (s1 > 0).all()
    with pytest.raises(ValueError, match="cannot run on cpu"):
        set_backend(model, "flashinfer_nvfp4")
    set_backend(model, "reference", act_scale_mode="per_expert")
    assert experts[0].activation_scales()[0] is not None
    cap, _ = capture_experts_call(model, experts[0])
    with torch.no_grad():
        model(ids)
    x, top_k, weights = cap["args"]
    w4a16_layer = torch.ops.fp4moe.fused_moe(x, top_k, weights.float(), experts[0].op_tensors(), None, None,
                                             "reference")
    # the layer's activations now go through NVFP4 too: NVFP4 noise on both GEMM inputs
    # (~10% each on Gaussian-like data), so a different but close answer
    assert 0.01 < rel(cap["out"], w4a16_layer) < 0.35
    # the calibrated scales cover the calibration data: no gate_up GEMM input exceeds 6*448*scale
    x = x.float()
    assert x.abs().max() <= experts[0].gate_up_proj_input_scale.max() * nvfp4.E2M1_MAX * nvfp4.E4M3_MAX * (1 + 1e-6)


@pytest.mark.parametrize("mode", ["global_max", "per_expert"])
def test_recalibrating_a_model_running_nvfp4_activations_runs_the_new_scales(mode):
    # the backend and mode were put back before the new scales were stored, so global_max kept
    # deriving its one scale from the old ones
    model = patch_deepseek(tiny_deepseek_v3(seed=4))
    calibrate_activation_scales(model, [torch.randint(1, 256, (1, 4))])
    set_backend(model, "reference", act_scale_mode=mode)
    from transformers import BatchEncoding  # a tokenizer's output is a Mapping, not a dict

    calibrate_activation_scales(model, [BatchEncoding({"input_ids": torch.randint(1, 256, (2, 16))}) for _ in range(3)])
    ids = torch.randint(1, 256, (2, 9))
    with torch.no_grad():
        got = model(ids).logits
        set_backend(model, "reference", act_scale_mode=mode)  # derived afresh from the stored scales
        want = model(ids).logits
    assert torch.equal(got, want)
    for _, m in find_experts_modules(model):
        assert torch.equal(m.activation_scales()[0], m.gate_up_proj_input_scale.max().reshape(())
                           if mode == "global_max" else m.gate_up_proj_input_scale)


def test_nvfp4_backend_without_calibration_says_how(monkeypatch):
    from fp4moe_ops.backends import BACKENDS

    # Pretend the device were a Blackwell GPU, to reach the calibration check on CPU.
    monkeypatch.setattr(BACKENDS["flashinfer_nvfp4"], "unavailable_reason", lambda device: None)
    model = patch_deepseek(tiny_deepseek_v3())
    with pytest.raises(ValueError, match="calibrate_activation_scales"):
        set_backend(model, "flashinfer_nvfp4")
    with pytest.raises(ValueError, match="calibrate_activation_scales"):
        patch_deepseek(tiny_deepseek_v3(), backend="flashinfer_nvfp4")


def test_patch_model_loaded_with_device_map_auto(tmp_path):
    """from_pretrained(device_map="auto") then patch. On a CPU-only machine everything lands on
    "cpu" (no accelerate hooks); tests/test_gpu.py spreads a model over two GPUs."""
    from transformers import AutoModelForCausalLM

    tiny_deepseek_v3(seed=3).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, device_map="auto", dtype=torch.bfloat16)
    reference = copy.deepcopy(model)
    patch_deepseek(model)
    cap, _ = capture_experts_call(model, find_experts_modules(model)[0][1])
    ids = torch.randint(1, 256, (1, 6))
    with torch.no_grad():
        model(ids)
        want = find_experts_modules(reference)[0][1](*cap["args"])
    assert 0.03 < rel(cap["out"], want) < 0.3  # NVFP4 experts of the same model (see above)
    assert model.generate(ids, max_new_tokens=3, do_sample=False).shape == (1, 9)


def test_quantize_dense_mlps_option():
    # the dense MLPs keep Transformers' module; their linears become NVFP4 linears, gate and up on
    # one global scale (as ModelOpt exports them; tests/test_real_exports.py compares the bytes)
    torch.manual_seed(0)
    model = tiny_deepseek_v3()
    original = copy.deepcopy(model)
    patch_deepseek(model, quantize_dense_mlps=True, fuse_shared_experts=False)  # fused: tests/test_shared_experts.py
    dense, shared = model.model.layers[0].mlp, model.model.layers[1].mlp.shared_experts
    assert type(dense).__name__ == type(shared).__name__ == "DeepseekV3MLP"
    gate, up, down = dense.gate_proj, dense.up_proj, dense.down_proj
    assert all(type(m).__name__ == "NVFP4Linear" for m in (gate, up, down, shared.gate_proj))
    assert torch.equal(gate.weight_scale_2, up.weight_scale_2)
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        got = dense(x)
        bf16 = original.model.layers[0].mlp(x)
    ids, ones = torch.zeros(10, 1, dtype=torch.long), torch.ones(10, 1)
    one_expert = (torch.cat([gate.weight, up.weight])[None], torch.cat([gate.weight_scale, up.weight_scale])[None],
                  gate.weight_scale_2.reshape(1), down.weight[None], down.weight_scale[None],
                  down.weight_scale_2.reshape(1))
    want = moe64(x.reshape(10, 64), ids, ones, *one_expert).reshape(2, 5, 64)
    # float64 from the bytes vs Transformers' MLP in bf16: gate, up, silu, the product and down
    # each round to bf16 (2^-9 relative at most), on weights rounded to bf16 once
    assert rel(got, want) < 8e-3
    assert 0.02 < rel(got, bf16) < 0.3  # NVFP4 weight error
    explanation = torch._dynamo.explain(model)(torch.randint(1, 256, (1, 6)))
    assert explanation.graph_break_count == 0


def test_quantize_attention_option(tmp_path):
    from transformers import AutoModelForCausalLM

    from fp4moe_ops.oracle64 import linear64
    from hf_integration import ModelOptConfig, NVFP4Linear

    torch.manual_seed(0)
    model = tiny_deepseek_v3()
    original = copy.deepcopy(model)
    patch_deepseek(model, quantize_attention=True)
    attn, before = model.model.layers[1].self_attn, original.model.layers[1].self_attn
    names = [n for n, m in before.named_children() if type(m) is torch.nn.Linear]
    assert names and all(isinstance(getattr(attn, n), NVFP4Linear) for n in names)
    assert isinstance(model.model.layers[1].mlp.shared_experts.gate_proj, torch.nn.Linear)  # not asked for
    for n in names:
        lin, x = getattr(attn, n), torch.randn(3, getattr(attn, n).in_features, dtype=torch.bfloat16)
        with torch.no_grad():
            got = lin(x)
        want = linear64(x, lin.weight, lin.weight_scale, lin.weight_scale_2)
        assert rel(got, want) < 4e-3, n  # bf16 output and the weight rounded to bf16 once (2^-9 each at most)
        assert 0.02 < rel(got, getattr(before, n)(x)) < 0.3, n  # NVFP4 weight error
    ids = torch.randint(1, 256, (2, 7))
    assert torch._dynamo.explain(model)(ids).graph_break_count == 0
    model.save_pretrained(tmp_path)
    kept = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16,
                                                quantization_config=ModelOptConfig(nvfp4_linears="nvfp4"))
    dequantized = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16,
                                                       quantization_config=ModelOptConfig(nvfp4_linears="dequantize"))
    assert all(type(getattr(dequantized.model.layers[1].self_attn, n)) is torch.nn.Linear for n in names)
    for n in names:
        assert torch.equal(getattr(kept.model.layers[1].self_attn, n).weight, getattr(attn, n).weight)
    with torch.no_grad():
        want = model(ids).logits
        # the same bytes and math: kept NVFP4 linears (reference backend on CPU) and the loader's
        # dequantized ones multiply by the same bf16 weight
        assert torch.equal(kept(ids).logits, want) and torch.equal(dequantized(ids).logits, want)


def test_backend_layout_is_held_once_and_state_dict_stays_canonical(monkeypatch):
    # The Triton backend re-lays out the packed weights (paired words, H and I multiples of 256):
    # a prepared module keeps only that copy (converted in place when it owns the weights), while
    # state_dict() / canonical() give the canonical bytes, load_state_dict() takes canonical bytes,
    # and another backend gets them back. (Layout only: the Triton kernels themselves run in
    # tests/test_triton_backend.py and on GPU.)
    import fp4moe_ops
    from fp4moe_ops.backends import BACKENDS

    monkeypatch.setattr(type(BACKENDS["triton"]), "unavailable_reason", lambda self, device: None)
    w = fp4moe_ops.quantize_moe_weights(torch.randn(3, 512, 256), torch.randn(3, 256, 256))
    owned = fp4moe_ops.NVFP4MoEWeights(*(t.clone() for t in w.tensors()))
    m = fp4moe_ops.PreparedExperts(owned, "triton", owns_weights=True)
    assert m.layout == "paired" and m._buffers["gate_up_proj_packed"].dtype == torch.int32
    assert m._buffers["gate_up_proj_packed"].data_ptr() == owned.gate_up.data_ptr()  # re-laid out in place
    assert not any(n.startswith("prepared_") for n in m._buffers)
    held = sum(b.numel() * b.element_size() for b in m.buffers())
    assert held == sum(t.numel() * t.element_size() for t in w.tensors())  # not twice
    sd = m.state_dict()
    assert torch.equal(sd["gate_up_proj_packed"], w.gate_up) and torch.equal(sd["down_proj_packed"], w.down)
    assert torch.equal(m.canonical().gate_up, w.gate_up) and torch.equal(m.canonical().down, w.down)
    assert "num_experts=3, hidden=256, intermediate=256" in repr(m) and "layout='paired'" in repr(m)
    with m.canonical_layout():  # for a save: canonical bytes in place, then back
        assert m.layout == "canonical" and torch.equal(m.gate_up_proj_packed, w.gate_up)
    assert m.layout == "paired" and torch.equal(m.state_dict()["gate_up_proj_packed"], w.gate_up)

    before = m._buffers["gate_up_proj_packed"].clone()
    m._buffers["gate_up_proj_packed"].zero_()
    m.load_state_dict(sd)  # canonical bytes in, the backend's layout kept
    assert torch.equal(m._buffers["gate_up_proj_packed"], before)

    m.set_backend("reference")
    assert m.layout == "canonical" and m._buffers["gate_up_proj_packed"].dtype == torch.uint8
    assert torch.equal(m._buffers["gate_up_proj_packed"], w.gate_up)

    user = fp4moe_ops.prepare_experts(w, "triton")  # the caller's weights are not touched
    assert user.layout == "paired" and w.gate_up.dtype == torch.uint8 and torch.equal(user.canonical().gate_up, w.gate_up)


def test_set_weights_never_re_lays_out_the_callers_tensors(monkeypatch):
    """After ``set_weights(caller's weights)`` on a module that owned its previous ones, the next
    backend with its own layout converts a copy, not the caller's tensors."""
    import fp4moe_ops
    from fp4moe_ops.backends import BACKENDS

    monkeypatch.setattr(type(BACKENDS["triton"]), "unavailable_reason", lambda self, device: None)
    w = fp4moe_ops.quantize_moe_weights(torch.randn(3, 512, 256), torch.randn(3, 256, 256))
    m = fp4moe_ops.PreparedExperts(fp4moe_ops.NVFP4MoEWeights(*(t.clone() for t in w.tensors())), "triton",
                                   owns_weights=True)
    callers = fp4moe_ops.NVFP4MoEWeights(*(t.clone() for t in w.tensors()))
    m.set_weights(callers)
    m.set_backend("triton")
    assert m.layout == "paired" and callers.gate_up.dtype == torch.uint8 and torch.equal(callers.gate_up, w.gate_up)
    assert torch.equal(m.canonical().gate_up, w.gate_up)


def test_global_max_activation_scale_follows_a_loaded_state_dict():
    """``global_max`` derives one activation scale from the input scales: loading new input scales
    re-derives it (and re-checks them), instead of running on the old one."""
    import fp4moe_ops

    w = fp4moe_ops.quantize_moe_weights(torch.randn(4, 64, 64), torch.randn(4, 64, 32))
    w = fp4moe_ops.NVFP4MoEWeights(*w.tensors(), torch.full((4,), 0.01), torch.full((4,), 0.02))
    m = fp4moe_ops.PreparedExperts(w, "reference", "global_max")
    sd = m.state_dict()
    sd["gate_up_proj_input_scale"] = torch.tensor([0.01, 0.5, 0.01, 0.01])
    m.load_state_dict(sd)
    assert m.activation_scales()[0].item() == 0.5
    sd["down_proj_input_scale"] = torch.tensor([float("nan"), 0.02, 0.02, 0.02])
    with pytest.raises(ValueError, match="down_proj_input_scale"):
        m.load_state_dict(sd)


def saved_with_old_input_scale_names(state: dict, tmp_path) -> dict:
    """``state`` as torch saved it when the experts' input-scale buffers were named ``fc1_input_scale``
    / ``fc2_input_scale`` (read back from the file)."""
    from fp4moe_ops.prepared import OLD_INPUT_SCALE_BUFFERS

    old_name = {new: old for old, new in OLD_INPUT_SCALE_BUFFERS.items()}

    def renamed(key: str) -> str:
        head, dot, leaf = key.rpartition(".")
        return head + dot + old_name.get(leaf, leaf)

    old = {renamed(k): t for k, t in state.items()}
    assert {k.rpartition(".")[2] for k in old} >= set(OLD_INPUT_SCALE_BUFFERS)
    torch.save(old, tmp_path / "old_names.pt")
    return torch.load(tmp_path / "old_names.pt")


def same_state(got: dict, want: dict) -> bool:
    as_bytes = lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # noqa: E731  (no float8 equal on CPU)
    return set(got) == set(want) and all(torch.equal(as_bytes(t), as_bytes(want[k])) for k, t in got.items())


def test_a_state_dict_with_the_old_input_scale_names_loads_with_one_warning(tmp_path, monkeypatch):
    import warnings

    import fp4moe_ops
    from fp4moe_ops import prepared

    monkeypatch.setattr(prepared, "_warned_old_names", False)
    w = fp4moe_ops.quantize_moe_weights(torch.randn(4, 64, 64), torch.randn(4, 64, 32))
    saved = fp4moe_ops.PreparedExperts(fp4moe_ops.NVFP4MoEWeights(*w.tensors(), torch.full((4,), 0.01),
                                                                  torch.full((4,), 0.02)), "reference", "global_max")
    m = fp4moe_ops.PreparedExperts(fp4moe_ops.NVFP4MoEWeights(*w.tensors(), torch.full((4,), 0.03),
                                                              torch.full((4,), 0.04)), "reference", "global_max")
    old = saved_with_old_input_scale_names(saved.state_dict(), tmp_path)
    with pytest.warns(FutureWarning, match="deprecated input-scale names"):
        m.load_state_dict(old)
    assert same_state(m.state_dict(), saved.state_dict())
    assert torch.equal(torch.stack(m.activation_scales()), torch.tensor([0.01, 0.02]))  # global_max's, re-derived
    assert "fc1_input_scale" in old  # the caller's state dict keeps its keys
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m.load_state_dict(old)  # warned once


@pytest.mark.parametrize("loaded", [False, True])
def test_a_model_state_dict_with_the_old_input_scale_names_loads(tmp_path, loaded):
    # a calibrated model with fused shared experts (a module whose own load hook reads its experts'
    # keys), patched, or loaded from a checkpoint (whose model-wide guards check every key before
    # any module loads, strict=True)
    from hf_integration import SharedExpertMoE
    from hf_integration.tiny_models import write_modelopt_checkpoint

    if loaded:
        from hf_integration import ModelOptConfig
        from transformers import AutoModelForCausalLM

        write_modelopt_checkpoint(tiny_deepseek_v3(seed=0), tmp_path / "ckpt")
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.bfloat16,
                                                     quantization_config=ModelOptConfig(fuse_shared_experts=True))
    else:
        model = patch_deepseek(tiny_deepseek_v3(seed=0), quantize_dense_mlps=True, fuse_shared_experts=True)
        calibrate_activation_scales(model, [torch.randint(1, 256, (2, 12))])
    assert any(isinstance(m, SharedExpertMoE) for m in model.modules())
    want = {k: t.clone() for k, t in model.state_dict().items()}
    old = saved_with_old_input_scale_names(want, tmp_path)
    for _, m in find_experts_modules(model):
        m.gate_up_proj_input_scale.mul_(2)
        m.down_proj_input_scale.mul_(3)
    model.load_state_dict(old)
    assert same_state(model.state_dict(), want)
    assert any(k.endswith(".fc1_input_scale") for k in old)  # the caller's state dict keeps its keys
    block = next(m for m in model.modules() if isinstance(m, SharedExpertMoE))  # its own load, unguarded
    block_want = {k: t.clone() for k, t in block.state_dict().items()}
    block_old = saved_with_old_input_scale_names(block_want, tmp_path)
    block.experts.gate_up_proj_input_scale.mul_(2)
    block.load_state_dict(block_old)
    assert same_state(block.state_dict(), block_want)


@pytest.mark.parametrize("export", ["modelopt/qwen3_moe_nvfp4_default", "llmcompressor/qwen3_moe_nvfp4",
                                    "modelopt/deepseek_v3_nvfp4_default"])
def test_num_parameters_counts_the_nvfp4_weights_as_the_bf16_source_model_does(export):
    # the packed weights are buffers: Transformers' count left out every NVFP4 weight (34,176
    # against 157,056 for the Qwen3-MoE export)
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    folder = Path(__file__).parent / "fixtures" / export
    source = AutoModelForCausalLM.from_pretrained(folder / "source", dtype=torch.bfloat16)
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    for kw in ({}, {"exclude_embeddings": True}):
        assert loaded.num_parameters(**kw) == source.num_parameters(**kw)
    bf16_left = sum(p.numel() for p in loaded.parameters())
    assert loaded.num_parameters(only_trainable=True) == bf16_left < source.num_parameters()


def _decoded_twin(bf16_model, patched):
    """``bf16_model`` with every NVFP4 weight of ``patched`` decoded by the float64 oracle and rounded
    to bfloat16 once (the fused shared expert as its three linears)."""
    from fp4moe_ops.oracle64 import dequant64
    from hf_integration import SharedExpertMoE
    from hf_integration.experts import NVFP4Experts, NVFP4Linear

    twin = copy.deepcopy(bf16_model)

    def put(name, value):
        target = twin.get_submodule(name.rpartition(".")[0])
        with torch.no_grad():
            getattr(target, name.rpartition(".")[2]).copy_(value.to(torch.bfloat16))

    for name, m in patched.named_modules():
        if isinstance(m, NVFP4Experts):
            w = m.canonical()
            block = name.rpartition(".")[0]
            routed = patched.get_submodule(block).num_routed if isinstance(patched.get_submodule(block), SharedExpertMoE) \
                else w.num_experts
            for e in range(w.num_experts):
                gate_up = dequant64(w.gate_up[e], w.gate_up_scale[e], w.gate_up_global_scale[e])
                down = dequant64(w.down[e], w.down_scale[e], w.down_global_scale[e])
                if e < routed:
                    with torch.no_grad():
                        twin.get_submodule(name).gate_up_proj[e] = gate_up.to(torch.bfloat16)
                        twin.get_submodule(name).down_proj[e] = down.to(torch.bfloat16)
                else:  # the shared expert inside the routed call
                    inter = gate_up.shape[0] // 2
                    put(f"{block}.shared_experts.gate_proj.weight", gate_up[:inter])
                    put(f"{block}.shared_experts.up_proj.weight", gate_up[inter:])
                    put(f"{block}.shared_experts.down_proj.weight", down)
        elif isinstance(m, NVFP4Linear):
            packed, block_scale, scale, _ = m.linear_tensors()
            put(f"{name}.weight", dequant64(packed, block_scale, scale))
    return twin


def test_dequantize_gives_back_the_transformers_model_with_the_decoded_weights(tmp_path):
    # model.dequantize() raised Transformers' "modelopt has no implementation of dequantize"
    from transformers import AutoModelForCausalLM

    def logits(m, ids):
        with torch.no_grad():
            return m(ids).logits

    bf16 = tiny_deepseek_v3(num_hidden_layers=3, seed=5)
    model = patch_deepseek(copy.deepcopy(bf16), quantize_dense_mlps=True, quantize_attention=True)
    twin = _decoded_twin(bf16, model)
    ids = torch.randint(1, 256, (2, 9), generator=torch.Generator().manual_seed(7))
    back = model.dequantize()
    assert back is model and not getattr(model, "is_quantized", False) and not hasattr(model, "hf_quantizer")
    assert getattr(model.config, "quantization_config", None) is None
    assert [type(m) for m in model.modules()] == [type(m) for m in twin.modules()]
    got, want = model.state_dict(), twin.state_dict()
    assert got.keys() == want.keys()
    # float32 decode then one rounding to bfloat16, against float64 then one rounding: equal but
    # for double rounding at a tie (one bfloat16 ulp)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=2.0**-8, atol=0)
    same = sum(torch.equal(got[k], want[k]) for k in want)
    assert same == len(want), [k for k in want if not torch.equal(got[k], want[k])]
    assert torch.equal(logits(model, ids), logits(twin, ids))
    model.save_pretrained(tmp_path)  # Transformers' own save: a plain BF16 checkpoint
    assert not (tmp_path / "hf_quant_config.json").exists()
    again = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert not getattr(again, "is_quantized", False)
    assert torch.equal(logits(again, ids), logits(twin, ids))
    assert model.to(torch.float32).dtype == torch.float32  # an ordinary model now: any cast


@pytest.mark.parametrize("export", ["modelopt/deepseek_v3_nvfp4_default", "llmcompressor/qwen3_moe_nvfp4a16"])
def test_dequantize_a_genuine_export_keeps_its_logits_and_llama4_is_refused_unchanged(export):
    from pathlib import Path

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    fixtures = Path(__file__).parent / "fixtures"
    ref = load_file(fixtures / export / "reference_logits.safetensors")
    model = AutoModelForCausalLM.from_pretrained(fixtures / export, dtype=torch.bfloat16)
    with torch.no_grad():
        before = model(ref["input_ids"]).logits
        after = model.dequantize()(ref["input_ids"]).logits
    assert not any(type(m).__module__.startswith("hf_integration") for m in model.modules())
    # the same decoded weights, now in BF16 Transformers modules (the experts in bfloat16 through
    # grouped_mm instead of fp4moe's float32 math): bfloat16-rounding differences, amplified by
    # these tiny models' peaky heads; the bounds test_real_exports puts on fp4moe's own forward
    for want in (before.float(), ref["logits_weights_only"]):
        err = (after.float() - want).norm(dim=-1) / want.norm(dim=-1)
        assert err.median() < 2e-2 and err.max() < 5e-2, err

    llama4 = AutoModelForCausalLM.from_pretrained(fixtures / "modelopt" / "llama4_text_nvfp4_mlp_only", dtype=torch.bfloat16)
    state = {k: v.clone() for k, v in llama4.state_dict().items()}
    with pytest.raises(NotImplementedError, match=r"dequantize\(\): model.layers.\d.feed_forward is Llama-4's fused"):
        llama4.dequantize()
    assert llama4.is_quantized and all(torch.equal(v, state[k]) for k, v in llama4.state_dict().items())


def test_dequantize_after_a_save_and_in_another_dtype(tmp_path):
    # a save leaves config.dtype the string "bfloat16", which Transformers passes on as the dtype;
    # and dequantize(torch.float32) decoded the NVFP4 linears in bfloat16 anyway
    from fp4moe_ops.oracle64 import dequant64
    from hf_integration.experts import NVFP4Linear

    model = patch_deepseek(tiny_deepseek_v3(num_hidden_layers=2, seed=5), quantize_dense_mlps=True,
                           quantize_attention=True)
    model.save_pretrained(tmp_path)
    assert isinstance(model.config.dtype, str) or model.config.dtype == torch.bfloat16
    twin = copy.deepcopy(model)
    model.dequantize()
    assert model.model.layers[0].self_attn.q_a_proj.weight.dtype == torch.bfloat16
    packed, block, scale, _ = twin.model.layers[0].self_attn.q_a_proj.linear_tensors()
    assert isinstance(twin.model.layers[0].self_attn.q_a_proj, NVFP4Linear)
    twin.dequantize(torch.float32)
    for name in ("model.layers.0.self_attn.q_a_proj", "model.layers.1.mlp.experts"):
        m = twin.get_submodule(name)
        assert all(p.dtype == torch.float32 for p in m.parameters()), name
    # decoded in float32: the float64 oracle's values to float32 rounding
    torch.testing.assert_close(twin.model.layers[0].self_attn.q_a_proj.weight.double(), dequant64(packed, block, scale),
                               rtol=2.0**-23, atol=0)
