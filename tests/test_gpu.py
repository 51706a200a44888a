"""GPU-only checks (on a Hopper GPU with FlashInfer installed, see CONTRIBUTING.md): our layouts against
FlashInfer's own helpers, every GPU backend against the reference backend, CUDA graphs."""

import pytest
import torch

import fp4moe_ops
from fp4moe_ops import mxfp4, nvfp4

pytestmark = pytest.mark.gpu

flashinfer = pytest.importorskip("flashinfer") if torch.cuda.is_available() else None


def layer(e, h, i, device="cuda"):
    """Random NVFP4 experts whose magnitudes span 100x, built 16 experts at a time (a whole
    DeepSeek-V3 layer in float32 would need ~45 GB)."""
    spread = torch.logspace(-1, 1, e, device=device)
    parts = []
    for e0 in range(0, e, 16):
        n = min(16, e - e0)
        gate_up = torch.randn(n, 2 * i, h, device=device) / h**0.5 * spread[e0:e0 + n, None, None]
        parts.append(fp4moe_ops.quantize_moe_weights(gate_up, torch.randn(n, h, i, device=device) / i**0.5))
    return fp4moe_ops.NVFP4MoEWeights(*(torch.cat([p.tensors()[n] for p in parts]) for n in range(6)))


def routing(t, e, k, device="cuda"):
    ids = torch.rand(t, e, device=device).argsort(dim=1)[:, :k]
    return ids, torch.rand(t, k, device=device)


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_swizzle_matches_flashinfer_block_scale_interleave():
    from flashinfer import block_scale_interleave

    for rows, cols in [(256, 448), (200, 12), (4096, 128)]:
        s = torch.randint(0, 255, (3, rows, cols), dtype=torch.uint8, device="cuda")
        ours = nvfp4.swizzle_block_scale(s).reshape(-1)
        theirs = block_scale_interleave(s).reshape(-1)
        assert torch.equal(ours, theirs), (rows, cols)


def test_dequantize_matches_flashinfer_e2m1_and_ufp8sf():
    from flashinfer import e2m1_and_ufp8sf_scale_to_float

    x = torch.randn(256, 512, device="cuda") * 3
    q = nvfp4.quantize_nvfp4(x)
    theirs = e2m1_and_ufp8sf_scale_to_float(
        q.packed.cpu(), nvfp4.swizzle_block_scale(q.block_scale.view(torch.uint8)).reshape(-1).cpu(),
        q.global_scale.reshape(1).cpu(), 16, 1, True)
    # Same products; FlashInfer may associate e2m1 * (sf * global) differently: 1 fp32 ulp.
    torch.testing.assert_close(q.dequantize().cpu(), theirs.float(), rtol=2.4e-7, atol=0)


@pytest.mark.parametrize("e,h,i,k", [(8, 512, 256, 2), (64, 2048, 768, 8), (256, 7168, 2048, 8)])
@pytest.mark.parametrize("t", [1, 8, 64, 300])
def test_triton_matches_reference_on_gpu(e, h, i, k, t):
    w = layer(e, h, i)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    ids, rw = routing(t, e, k)
    ids[0, 0] = -1
    ours = fp4moe_ops.prepare_experts(w, "triton")(x, ids, rw)
    sub = slice(0, min(t, 32))  # the dense reference is slow at E=256; tokens are independent
    ref = fp4moe_ops.prepare_experts(w, "reference")(x[sub], ids[sub], rw[sub])
    # Same math up to fp32 summation order and bf16 rounding of intermediate/output.
    err = rel_err(ours[sub], ref)
    print(f"triton vs reference E={e} H={h} I={i} k={k} T={t}: rel err {err:.2e}")
    assert err < 4e-3
    assert torch.isfinite(ours).all()


def test_flashinfer_deterministic_finalize_is_bitwise_repeatable():
    from fp4moe_ops.backends import flashinfer_cutlass as fc

    w = layer(8, 512, 256)
    x = torch.randn(512, 512, device="cuda", dtype=torch.bfloat16)
    ids, rw = routing(512, 8, 4)
    fc.set_deterministic(True)
    try:
        p = fp4moe_ops.prepare_experts(w, "flashinfer_bf16")
        outs = [p(x, ids, rw) for _ in range(5)]
    finally:
        fc.set_deterministic(None)
    for o in outs[1:]:
        assert torch.equal(o, outs[0])
    ref = fp4moe_ops.prepare_experts(w, "reference")(x, ids, rw)
    assert rel_err(outs[0], ref) < 1e-2  # bf16 weights, as test_flashinfer_sm90_backends_vs_reference


@pytest.mark.parametrize("t", [1, 8, 64, 300])
def test_triton_tma_loads_match_reference_on_gpu(t):
    from fp4moe_ops.backends.triton_moe import kernel_config, triton_fused_moe

    e, h, i, k = 256, 7168, 2048, 8
    w = layer(e, h, i)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    ids, rw = routing(t, e, k)
    ids[0, 0] = -1
    # (the wgmma kernels: decode_v3 has test_decode_v3_matches_float64)
    cfg = kernel_config(t * k, e, h, i) | dict(TMA=True, BK_GATE_UP=256, BK_DOWN=256, PREFETCH=False, num_stages=4,
                                               DECODE_V3=False)
    ours = triton_fused_moe(x, ids, rw, fp4moe_ops.prepare_experts(w, "triton").op_tensors(), cfg)
    sub = slice(0, min(t, 16))
    ref = fp4moe_ops.prepare_experts(w, "reference")(x[sub], ids[sub], rw[sub])
    err = rel_err(ours[sub], ref)  # as test_triton_matches_reference_on_gpu
    print(f"triton TMA vs reference T={t}: rel err {err:.2e}")
    assert err < 4e-3 and torch.isfinite(ours).all()


@pytest.mark.parametrize("t", [2, 8])  # a row per expert, two (both decode_v3's routed blocks on Hopper)
def test_triton_cuda_graph_and_compile(t):
    w = layer(16, 1024, 512)
    p = fp4moe_ops.prepare_experts(w, "triton")
    x = torch.randn(t, 1024, device="cuda", dtype=torch.bfloat16)
    ids, rw = routing(t, 16, 4)
    eager = p(x, ids, rw)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        p(x, ids, rw)  # warm-up (Triton compiles) outside the capture
        with torch.cuda.graph(g):
            out = p(x, ids, rw)
    torch.cuda.current_stream().wait_stream(s)
    x2 = torch.randn_like(x)
    ids2, rw2 = routing(t, 16, 4)
    x.copy_(x2), ids.copy_(ids2), rw.copy_(rw2)
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, p(x2, ids2, rw2), rtol=0, atol=0)  # deterministic kernels
    assert not torch.equal(out, eager)

    compiled = torch.compile(lambda a, b, c: p(a, b, c), fullgraph=True, mode="reduce-overhead", dynamic=False)
    for _ in range(3):
        got = compiled(x2, ids2, rw2)
    torch.testing.assert_close(got, p(x2, ids2, rw2), rtol=0, atol=0)


def test_compile_ahead_inside_a_compiled_graph(monkeypatch):
    """A layer's first call inside ``torch.compile(mode="reduce-overhead")`` (CUDA graph trees run
    it eagerly first, then capture) compiles every bucket's kernels there (launch.compile_layer_once),
    and the replays match eager calls bit for bit (deterministic kernels)."""
    from fp4moe_ops.backends.triton_moe import kernels, launch

    monkeypatch.setattr(launch, "COMPILE_AHEAD", True)
    w = layer(16, 1024, 768)  # a shape no other test uses

    from fp4moe_ops.backends.triton_moe.decode_v3 import _gate_up_v3_kernel

    def gemm_variants():  # (the gate_up GEMM's: the wgmma kernel's, and decode_v3's up to 6 rows per expert)
        fns = (kernels._gate_up_swiglu_kernel, _gate_up_v3_kernel)
        return sum(len(c[0]) for fn in fns for c in fn.device_caches.values())

    p = fp4moe_ops.prepare_experts(w, "triton")
    compiled = torch.compile(lambda a, b, c: p(a, b, c), fullgraph=True, mode="reduce-overhead", dynamic=False)
    x = torch.randn(4, 1024, device="cuda", dtype=torch.bfloat16)
    ids, rw = routing(4, 16, 4)
    before = gemm_variants()
    for _ in range(3):
        got = compiled(x, ids, rw)
    # one token (its blocks read from the ids: top-4 here), decode with static and run-time K loops,
    # middle and prefill: all compiled by 4-token calls (on Hopper: one token and up to 6 rows per
    # expert on decode_v3, then run-time K loops, middle and prefill)
    assert gemm_variants() - before == 5
    torch.testing.assert_close(got, p(x, ids, rw), rtol=0, atol=0)
    x2 = torch.randn_like(x)
    ids2, rw2 = routing(4, 16, 4)
    torch.testing.assert_close(compiled(x2, ids2, rw2), p(x2, ids2, rw2), rtol=0, atol=0)


@pytest.mark.parametrize("t", [1, 8, 64, 512, 2048])
def test_pdl_chain_in_a_graph_matches_plain_launches(t):
    """Programmatic dependent launch lets each kernel start while the previous one drains: a kernel
    that read its inputs before waiting would see stale or half-written values. Ten layers where each
    feeds the next (in a CUDA graph and eagerly, with PDL) must give bitwise the output of plain
    launches: the arithmetic is the same, only the launch overlaps. Full-size rows and columns (long
    kernels, many waves) on 64 experts; every bucket from decode to prefill."""
    from fp4moe_ops.backends.triton_moe import kernel_config, triton_fused_moe

    e, h, i, k = 64, 7168, 2048, 8
    tensors = fp4moe_ops.prepare_experts(layer(e, h, i), "triton").op_tensors()
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    ids, rw = routing(t, e, k)
    cfg = kernel_config(t * k, e, h, i)  # PDL is opt-in: the config key, set below

    def chain(x, pdl):
        for _ in range(10):  # each layer's routing, GEMMs and sum depend on the previous layer's sum
            y = triton_fused_moe(x, ids, rw, tensors, cfg | dict(PDL=pdl))
            x = (x.float() + y.float() / (y.float().norm(dim=1, keepdim=True) / h**0.5 + 1e-6)).to(x.dtype)
        return x

    plain = chain(x, False)
    assert torch.isfinite(plain).all()
    torch.testing.assert_close(chain(x, True), plain, rtol=0, atol=0)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(g):
        out = chain(x, True)
    torch.cuda.current_stream().wait_stream(s)
    for _ in range(3):
        out.zero_()
        g.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, plain, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["flashinfer_bf16", "flashinfer_mxfp4"])
@pytest.mark.parametrize("e,h,i,k,t", [(8, 512, 256, 2, 16), (8, 512, 192, 2, 16),  # I % 128 = 64: padded
                                       (256, 7168, 2048, 8, 8), (256, 7168, 2048, 8, 64)])
def test_flashinfer_sm90_backends_vs_reference(backend, e, h, i, k, t):
    w = layer(e, h, i)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    ids, rw = routing(t, e, k)
    ids[0, 0] = e + 5  # out-of-range id must contribute nothing
    out = fp4moe_ops.prepare_experts(w, backend)(x, ids, rw)
    ref = fp4moe_ops.prepare_experts(w, "reference")(x, ids, rw)
    err = rel_err(out, ref)
    weight_err = mxfp4.mxfp4_requant_error(nvfp4.NVFP4Tensor(w.down[:4], w.down_scale[:4], w.down_global_scale[:4]))
    print(f"{backend} vs reference E={e} H={h} I={i} T={t}: rel err {err:.2e} (down MXFP4 weight err {weight_err:.2e})")
    # bf16: weights rounded to bf16 once (2^-9) + bf16 intermediate. MXFP4: each weight
    # matrix re-quantized with ~12% error (printed), compounded over two GEMMs: < 30%.
    assert err < (1e-2 if backend == "flashinfer_bf16" else 0.3)


def test_flashinfer_nvfp4_refuses_sm90_clearly():
    w = layer(4, 256, 128)
    w.gate_up_input_scale = torch.full((4,), 0.001, device="cuda")
    w.down_input_scale = torch.full((4,), 0.001, device="cuda")
    with pytest.raises(ValueError, match=r"cannot run on cuda.*capability"):
        fp4moe_ops.prepare_experts(w, "flashinfer_nvfp4")
    assert fp4moe_ops.prepare_experts(w, "auto").backend == "triton"


@pytest.mark.parametrize("backend", ["flashinfer_bf16", "flashinfer_mxfp4"])
def test_flashinfer_autotune_then_graph_capture(backend):
    from fp4moe_ops.backends.flashinfer_cutlass import autotune

    w = layer(8, 512, 256)
    p = fp4moe_ops.prepare_experts(w, backend)
    autotune(p, hidden_size=512, top_k=2, max_num_tokens=256)
    x = torch.randn(16, 512, device="cuda", dtype=torch.bfloat16)
    ids, rw = routing(16, 8, 2)
    eager = p(x, ids, rw)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = p(x, ids, rw)
        with pytest.raises(RuntimeError, match="before CUDA-graph capture"):
            autotune(p, hidden_size=512, top_k=2)
    g.replay()
    torch.cuda.synchronize()
    # the fused finalize reduces with atomics: equal up to summation order
    torch.testing.assert_close(out, eager, rtol=1e-2, atol=1e-2)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_device_map_over_two_gpus_launches_on_each_layers_device(tmp_path):
    from transformers import AutoModelForCausalLM

    from hf_integration import find_experts_modules, patch_deepseek
    from hf_integration.tiny_models import tiny_deepseek_v3

    tiny_deepseek_v3(seed=0, num_hidden_layers=4).save_pretrained(tmp_path)
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 0,
                  "model.layers.2": 1, "model.layers.3": 1, "model.norm": 1, "lm_head": 1}
    model = AutoModelForCausalLM.from_pretrained(tmp_path, device_map=device_map, dtype=torch.bfloat16)
    patch_deepseek(model)  # auto -> triton on each layer's own GPU
    devices = {m._buffers["gate_up_proj_packed"].device.index for _, m in find_experts_modules(model)}
    assert devices == {0, 1}
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).cuda()
    patch_deepseek(ref)
    ids = torch.randint(1, 256, (1, 8), device="cuda:0")
    torch.testing.assert_close(model(ids).logits.to("cuda:0"), ref(ids).logits, rtol=0, atol=0)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_modelopt_device_map_auto_over_two_gpus(tmp_path):
    from hf_integration import find_experts_modules, load_modelopt_nvfp4
    from hf_integration.tiny_models import tiny_deepseek_v3, write_modelopt_checkpoint

    write_modelopt_checkpoint(tiny_deepseek_v3(seed=0, num_hidden_layers=5), tmp_path)
    spread = load_modelopt_nvfp4(tmp_path, device_map="auto")
    devices = {m._buffers["gate_up_proj_packed"].device.index for _, m in find_experts_modules(spread)}
    assert devices == {0, 1}
    assert {v for v in spread.hf_device_map.values()} == {"cuda:0", "cuda:1"}
    one = load_modelopt_nvfp4(tmp_path, device="cuda:0")
    ids = torch.randint(1, 256, (2, 9), device="cuda:0")
    # same kernels on the same weights, only on other devices: equal bit for bit
    torch.testing.assert_close(spread(ids).logits.to("cuda:0"), one(ids).logits, rtol=0, atol=0)
    kw = dict(max_new_tokens=6, do_sample=False)
    assert torch.equal(spread.generate(ids, **kw).to("cuda:0"), one.generate(ids, **kw))
    for d in (0, 1):
        print(f"device_map auto: cuda:{d} holds {torch.cuda.memory_allocated(d) / 1e6:.1f} MB")


@pytest.mark.parametrize("backend,t", [("triton", 32), ("triton", 8), ("flashinfer_bf16", 32),
                                       ("flashinfer_mxfp4", 32)])
def test_a_nan_expert_never_reaches_tokens_not_routed_to_it(backend, t):
    """One expert with a NaN global scale (the loaders refuse such a file; this is the op's own
    isolation): tokens routed elsewhere, expert-parallel sentinels included, keep their exact
    outputs; tokens routed to it get NaN. (Triton at 32 tokens: 8 rows per expert, the wgmma
    kernels; at 8: 2 rows, decode_v3 on Hopper.)"""
    w = layer(8, 512, 256)
    bad = fp4moe_ops.NVFP4MoEWeights(*(a.clone() for a in w.tensors()))
    bad.gate_up_global_scale[3] = float("nan")
    bad.down_global_scale[3] = float("nan")
    x = torch.randn(t, 512, device="cuda", dtype=torch.bfloat16)
    ids, rw = routing(t, 8, 2)
    ids = torch.where(ids == 3, 5, ids)
    ids[0, 1] = -1
    ids[1, 1] = 8 + 3  # another rank's expert 3 under expert parallelism
    clean = fp4moe_ops.prepare_experts(w, backend)(x, ids, rw)
    if backend == "flashinfer_mxfp4":  # re-quantizing to MXFP4 refuses NaN weights up front
        with pytest.raises(ValueError, match="NaN"):
            fp4moe_ops.prepare_experts(bad, backend, check_values=False)
        return
    dirty = fp4moe_ops.prepare_experts(bad, backend, check_values=False)(x, ids, rw)
    assert torch.isfinite(dirty).all()
    torch.testing.assert_close(dirty, clean, rtol=0, atol=0)
    ids[2, 0] = 3
    assert torch.isnan(fp4moe_ops.prepare_experts(bad, backend, check_values=False)(x, ids, rw)[2]).all()


def test_llama4_export_on_gpu_eager_and_compiled():
    """The genuine ModelOpt Llama-4 export on the GPU (Triton backend): logits as on CPU against
    ModelOpt's fake quant (the same 2% / 5% as tests/test_real_exports.py), and the compiled model
    (fullgraph: the MoE block and the op, no graph break) gives the eager logits."""
    from pathlib import Path

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import hf_integration  # noqa: F401

    folder = Path(__file__).parent / "fixtures" / "modelopt" / "llama4_text_nvfp4_mlp_only"
    ref = load_file(folder / "reference_logits.safetensors")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map="cuda")
    assert model.model.layers[0].feed_forward.experts.backend == "triton"
    ids = ref["input_ids"].cuda()
    with torch.no_grad():
        got = model(ids).logits.float().cpu()
        moe = model.model.layers[1].feed_forward
        x = torch.randn(24, moe.hidden_dim, device="cuda", dtype=torch.bfloat16)
        compiled = torch.compile(moe, fullgraph=True)
        out, logits = compiled(x)
        want, want_logits = moe(x)
    want_model = ref["logits_weights_only"]
    err = (got.double() - want_model.double()).flatten(0, 1).norm(dim=-1) / want_model.double().flatten(0, 1).norm(dim=-1)
    print(f"llama4 on GPU vs ModelOpt fake quant: median {err.median():.4f}, max {err.max():.4f}")
    assert err.median() < 2e-2 and err.max() < 5e-2
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=0)
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)  # compiled glue may fuse bf16 ops differently
