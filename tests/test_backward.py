"""Backward through fp4moe's ops with the NVFP4 weights frozen (fp4moe_ops/autograd.py): gradients
of activations, routing weights and router logits against float64 autograd of the format
definition (fp4moe_ops.oracle64), per op and through a patched model; NaN isolation; the
backends without a backward refused by name; one compiled backward."""

import copy

import pytest
import torch
import torch.nn.functional as F

import fp4moe_ops
from fp4moe_ops import NVFP4MoEWeights, nvfp4, prepare_experts, quantize_moe_weights
from fp4moe_ops.oracle64 import dequant64
from fp4moe_ops.routing import grouped_topk_torch
from hf_integration import patch_deepseek
from hf_integration.experts import NVFP4Experts, NVFP4Linear
from hf_integration.tiny_models import tiny_deepseek_v3

E, H, I, T, K = 6, 64, 32, 12, 2


def layer(seed=0, h=H, i=I):
    torch.manual_seed(seed)
    return quantize_moe_weights(torch.randn(E, 2 * i, h) * 0.1, torch.randn(E, h, i) * 0.1)


def moe64_autograd(w, x, ids, rw):
    """The layer in float64 torch ops on dequant64 weights, for torch's own autograd."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    i = w.down.shape[2] * 2
    for e in range(E):
        rows, slots = (ids == e).nonzero(as_tuple=True)
        if rows.numel():
            h = x[rows] @ dequant64(w.gate_up[e], w.gate_up_scale[e], w.gate_up_global_scale[e]).T
            act = F.silu(h[:, :i]) * h[:, i:]
            y = act @ dequant64(w.down[e], w.down_scale[e], w.down_global_scale[e]).T
            out = out.index_add(0, rows, rw[rows, slots, None] * y)
    return out


def bf16_close(got, want):
    """``got`` (bfloat16) is ``want`` (float64) rounded: within one bfloat16 ulp (2^-8 relative)
    plus a float32-accumulation floor."""
    err = (got.double() - want).abs()
    assert (err <= 2.0**-8 * want.abs() + 1e-6 * want.abs().max()).all(), err.max()


@pytest.mark.parametrize("layout", ["canonical", "paired"])
def test_fused_moe_gradients_match_float64_autograd(layout):
    h = i = 256  # the paired layout needs multiples of 256
    w = layer(0, h, i)
    tensors, backend = prepare_experts(w, "reference").op_tensors(), "reference"
    if layout == "paired":  # the Triton backend's paired words: the backward converts them expert by expert (no GPU needed)
        pytest.importorskip("triton")
        from fp4moe_ops.backends.triton_moe.layout import paired_weight_layout

        tensors = [torch.stack([paired_weight_layout(m) for m in t]) if n in (0, 3) else t
                   for n, t in enumerate(tensors)]
        assert tensors[0].dtype == torch.int32
        backend = "triton"
    torch.manual_seed(1)
    x = torch.randn(T, h).bfloat16()
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    ids[3, 1] = E  # an id outside [0, E): contributes nothing, gets no gradient
    rw = torch.rand(T, K)
    g = torch.randn(T, h).bfloat16()
    grad_x, grad_w = torch.ops.fp4moe.fused_moe_backward(g, x, ids, rw, tensors, None, None, backend)

    x64, rw64 = x.double().requires_grad_(), rw.double().requires_grad_()
    (moe64_autograd(w, x64, ids, rw64) * g.double()).sum().backward()
    assert grad_x.dtype == torch.bfloat16 and grad_w.dtype == torch.float32
    bf16_close(grad_x, x64.grad)
    torch.testing.assert_close(grad_w.double(), rw64.grad, rtol=1e-5, atol=1e-6)  # float32 math
    assert grad_w[3, 1] == 0


def test_fused_moe_backward_through_autograd_and_nan_isolation():
    # a NaN global scale in expert 4 (value checks skipped to build it): the gradients of tokens not
    # routed there stay finite, as their outputs do
    w = layer(2)
    w.down_global_scale[4] = float("nan")
    experts = fp4moe_ops.PreparedExperts(w, "reference", check_values=False)
    torch.manual_seed(3)
    x = torch.randn(T, H).bfloat16().requires_grad_()
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    rw = torch.rand(T, K).requires_grad_()
    experts(x, ids, rw).float().sum().backward()
    clean = ~(ids == 4).any(1)
    assert clean.any() and (~clean).any()
    assert torch.isfinite(x.grad[clean]).all() and torch.isfinite(rw.grad[clean]).all()
    assert torch.isnan(x.grad[~clean]).any(1).all()


@pytest.mark.parametrize("paired", [False, True])
def test_nvfp4_linear_and_grouped_topk_gradients_match_float64_autograd(paired):
    # (paired: the weight as NVFP4Linear holds it on Hopper, [N/2, K/4] int32; the backward decodes it too)
    from fp4moe_ops.backends.triton_moe.layout import paired_weight_layout

    torch.manual_seed(4)
    q = nvfp4.quantize_nvfp4(torch.randn(48, H))
    weight = paired_weight_layout(q.packed) if paired else q.packed
    x, b = torch.randn(3, 5, H).bfloat16().requires_grad_(), torch.randn(48).bfloat16().requires_grad_()
    y = torch.ops.fp4moe.nvfp4_linear(x, weight, q.block_scale, q.global_scale.reshape(()), b, "reference")
    meta = [t.to("meta") for t in (y, weight, q.block_scale, q.global_scale.reshape(()))]
    assert torch.ops.fp4moe.nvfp4_linear_grad_input(*meta).shape == x.shape  # the compiled backward's shape
    g = torch.randn_like(y)
    (y * g).sum().backward()
    x64, b64 = x.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    w64 = dequant64(q.packed, q.block_scale, q.global_scale)
    ((x64 @ w64.T + b64) * g.double()).sum().backward()
    # as the forward, the backward decodes W to bfloat16 (each weight rounded, <= 2^-9 relative) and
    # rounds its bfloat16 result: |error| <= 2^-9 (|g| . |W|) + 2^-9 |d x|, doubled for accumulation
    bound = 2.0**-8 * (g.double().abs() @ w64.abs() + x64.grad.abs())
    assert ((x.grad.double() - x64.grad).abs() <= bound).all()
    bf16_close(b.grad, b64.grad)  # a sum of 15 bfloat16 rows in float32, rounded once

    logits = torch.randn(7, 16).requires_grad_()
    bias = torch.randn(16) * 0.1
    weights, ids = torch.ops.fp4moe.grouped_topk(logits, bias, 4, 2, 3, True, 2.5)
    gw = torch.randn_like(weights)
    (weights * gw).sum().backward()
    l64 = logits.detach().double().requires_grad_()
    w64, ids64 = grouped_topk_torch(l64, bias.double(), 4, 2, 3, True, 2.5)
    assert torch.equal(ids.sort(1)[0], ids64.sort(1)[0])
    by_expert = torch.zeros(7, 16).scatter(1, ids, gw).double()
    (torch.zeros(7, 16, dtype=torch.float64).scatter(1, ids64, w64) * by_expert).sum().backward()
    torch.testing.assert_close(logits.grad.double(), l64.grad, rtol=1e-5, atol=1e-7)


def test_backends_with_tensors_of_their_own_have_no_backward_and_say_which_to_use():
    from fp4moe_ops.autograd import _refuse_own_tensors

    for backend in ("flashinfer_bf16", "flashinfer_mxfp4"):
        with pytest.raises(NotImplementedError, match=rf"no backward through backend '{backend}'.*'triton'.*'reference'"):
            _refuse_own_tensors(backend)


def reference_model(bf16_model, patched):
    """``bf16_model`` in float64 with every NVFP4 weight of ``patched`` decoded by dequant64."""
    ref = copy.deepcopy(bf16_model).double()
    ref.config._experts_implementation = "eager"
    for name, m in patched.named_modules():
        if isinstance(m, NVFP4Experts):
            c = m.canonical()
            target = ref.get_submodule(name)
            with torch.no_grad():
                for e in range(c.num_experts):
                    target.gate_up_proj[e] = dequant64(c.gate_up[e], c.gate_up_scale[e], c.gate_up_global_scale[e])
                    target.down_proj[e] = dequant64(c.down[e], c.down_scale[e], c.down_global_scale[e])
        elif isinstance(m, NVFP4Linear):
            packed, block, scale, _ = m.linear_tensors()
            with torch.no_grad():
                ref.get_submodule(name).weight.copy_(dequant64(packed, block, scale))
    return ref


def test_a_patched_model_backpropagates_to_its_embeddings_as_its_float64_twin():
    # everything NVFP4 that a patch makes (routed experts, router op, dense MLPs, attention) on the
    # gradient's path from the loss to the embeddings, against the float64 model with the same
    # decoded weights; the embedding gradient without the experts' backward is far off (control)
    bf16 = tiny_deepseek_v3(num_hidden_layers=3, seed=5)
    model = patch_deepseek(copy.deepcopy(bf16), quantize_dense_mlps=True, quantize_attention=True,
                           fuse_shared_experts=False)
    ref = reference_model(bf16, model)
    ids = torch.randint(1, 256, (2, 10), generator=torch.Generator().manual_seed(6))
    model.train()
    model(ids, labels=ids).loss.backward()
    ref(ids, labels=ids).loss.backward()
    want = ref.model.embed_tokens.weight.grad

    def off(grad):
        return ((grad.double() - want).norm() / want.norm()).item()

    # the yardstick: the same decoded weights in a plain bfloat16 model are 17% off float64 here
    twin = copy.deepcopy(ref).bfloat16()
    twin.zero_grad()
    twin(ids, labels=ids).loss.backward()
    rel, floor = off(model.model.embed_tokens.weight.grad), off(twin.model.embed_tokens.weight.grad)
    assert rel < 1.5 * floor, (rel, floor)  # measured: 3.0% (its experts compute in float32)
    for m in model.modules():  # no gradient reaches a quantized tensor
        assert all(b.grad is None for b in m.buffers(recurse=False))
    model.zero_grad()
    for m in model.modules():
        if isinstance(m, NVFP4Experts):
            m.register_full_backward_hook(lambda mod, gin, gout: tuple(None if t is None else torch.zeros_like(t)
                                                                       for t in gin))
    model(ids, labels=ids).loss.backward()
    assert off(model.model.embed_tokens.weight.grad) > 10 * rel  # measured: 94%


def test_compiled_backward_of_all_three_ops_matches_eager():
    # the linear's backward decoded its weight in traced torch ops: the compiled backward failed, and
    # the decode's cached codebook was left a traced tensor that broke later eager calls too
    w = layer(7)
    experts = prepare_experts(w, "reference")
    q = nvfp4.quantize_nvfp4(torch.randn(H, H))
    torch.manual_seed(8)
    x0 = torch.randn(T, H).bfloat16()
    router0 = torch.randn(E, H) * 0.1
    bias = torch.randn(E) * 0.1

    def loss(x, router):
        h = torch.ops.fp4moe.nvfp4_linear(x, q.packed, q.block_scale, q.global_scale.reshape(()), None, "reference")
        rw, ids = torch.ops.fp4moe.grouped_topk(h.float() @ router.T, bias, 2, 1, K, True, 2.5)
        return (experts(h, ids, rw).float() ** 2).sum()

    grads = []
    for f in (loss, torch.compile(loss, fullgraph=True), loss):
        x, router = x0.clone().requires_grad_(), router0.clone().requires_grad_()
        f(x, router).backward()
        grads.append((x.grad, router.grad))
    # eager twice: bitwise; compiled: inductor computes the router GEMM and the loss around the ops
    # in its own order (float32), which can move a bfloat16 rounding: within two bfloat16 ulps
    assert torch.equal(grads[2][0], grads[0][0]) and torch.equal(grads[2][1], grads[0][1])
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got.float(), want.float(), rtol=2.0**-7, atol=2.0**-7 * want.abs().max().item())
    assert q.dequantize().isfinite().all()  # eager decoding still works after the compile


@pytest.mark.gpu
def test_backward_on_the_triton_backend_equals_the_reference_backends_on_cuda():
    # the backward decodes the paired words the Triton backend holds: the same gradients as from
    # the canonical tensors, bit for bit, and float64's within bfloat16 rounding
    w = layer(9, 256, 256)
    torch.manual_seed(10)
    x0 = torch.randn(T, 256).bfloat16()
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    rw0, g = torch.rand(T, K), torch.randn(T, 256).bfloat16()
    grads = {}
    for backend in ("triton", "reference"):
        experts = prepare_experts(w, backend).cuda() if backend == "reference" else prepare_experts(
            NVFP4MoEWeights(*(t.cuda() for t in w.tensors())), backend)
        x, rw = x0.cuda().requires_grad_(), rw0.cuda().requires_grad_()
        (experts(x, ids.cuda(), rw).float() * g.cuda().float()).sum().backward()
        grads[backend] = (x.grad.cpu(), rw.grad.cpu())
    assert torch.equal(grads["triton"][0], grads["reference"][0])
    assert torch.equal(grads["triton"][1], grads["reference"][1])
    x64, rw64 = x0.double().requires_grad_(), rw0.double().requires_grad_()
    (moe64_autograd(w, x64, ids, rw64) * g.double()).sum().backward()
    bf16_close(grads["triton"][0], x64.grad)


@pytest.mark.gpu
def test_nvfp4_linear_backward_on_cuda_and_compiled_with_the_triton_forward():
    # forward through the Triton kernel, backward through the decode op: the same gradient as the
    # reference forward's, and compiled as eager
    torch.manual_seed(11)
    q = nvfp4.quantize_nvfp4(torch.randn(512, 1024, device="cuda"))
    x0 = torch.randn(7, 1024, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(7, 512, device="cuda", dtype=torch.bfloat16)

    def f(x, backend):
        y = torch.ops.fp4moe.nvfp4_linear(x, q.packed, q.block_scale, q.global_scale.reshape(()), None, backend)
        return (y.float() * g.float()).sum()

    grads = []
    for fn, backend in ((f, "reference"), (f, "triton"), (torch.compile(f, fullgraph=True), "triton")):
        x = x0.clone().requires_grad_()
        fn(x, backend).backward()
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1]) and torch.equal(grads[0], grads[2])
