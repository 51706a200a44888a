"""The fp4moe::grouped_topk op (DeepSeek-V3 / GLM4-MoE routing) against Transformers' own router
module, the independent reference. On CPU the Triton kernel runs in Triton's interpreter; on a
GPU the compiled kernel runs."""

import pytest
import torch

from fp4moe_ops.routing import grouped_topk_torch, grouped_topk_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OP = torch.ops.fp4moe.grouped_topk


def hf_router(num_experts, n_group, topk_group, top_k, renormalize, scaling, hidden=96):
    """Transformers' DeepseekV3TopkRouter with random weight and correction bias."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(hidden_size=hidden, n_routed_experts=num_experts, n_group=n_group, topk_group=topk_group,
                           num_experts_per_tok=top_k, norm_topk_prob=renormalize, routed_scaling_factor=scaling)
    router = DeepseekV3TopkRouter(cfg)
    with torch.no_grad():
        router.weight.normal_(std=2 * hidden**-0.5)  # logits ~ N(0, 4): scores spread over (0, 1)
        router.e_score_correction_bias.uniform_(-0.1, 0.1)
    return router


def by_id(weights, ids):
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


CASES = [  # E, groups, kept groups, top-k, renormalize, scaling
    (256, 8, 4, 8, True, 2.5),  # DeepSeek-V3 / R1, Kimi-K2 (384 experts, 1 group: below)
    (384, 1, 1, 8, True, 2.827),  # Kimi-K2
    (160, 1, 1, 8, True, 2.5),  # GLM-4.5: groups and experts not powers of two
    (72, 6, 2, 5, False, 1.0),  # 12 experts per group, no renormalization
]


@pytest.mark.parametrize("e,g,tg,k,renorm,scale", CASES)
def test_grouped_topk_matches_transformers_router(e, g, tg, k, renorm, scale):
    router = hf_router(e, g, tg, k, renorm, scale)
    hidden = torch.randn(37, 96)
    logits, hf_w, hf_ids = router(hidden)

    # The torch path makes Transformers' calls in its order: bitwise the same.
    w, ids = grouped_topk_torch(logits, router.e_score_correction_bias, g, tg, k, renorm, scale)
    assert torch.equal(ids, hf_ids) and torch.equal(w, hf_w)

    # The kernel: same experts; weights within a few fp32 ulps (its sigmoid and the order of the
    # renormalizing sum differ from torch's), rtol 2e-6 ~ 16 ulps.
    w, ids = grouped_topk_triton(logits.to(DEVICE), router.e_score_correction_bias.to(DEVICE), g, tg, k, renorm, scale)
    got_w, got_ids = by_id(w.cpu(), ids.cpu())
    ref_w, ref_ids = by_id(hf_w, hf_ids)
    assert torch.equal(got_ids, ref_ids)
    torch.testing.assert_close(got_w, ref_w, rtol=2e-6, atol=0)


def test_kernel_picks_lower_ids_on_ties():
    """All choices equal: groups 0..topk_group-1 are kept and, within them, experts 0..k-1."""
    logits = torch.full((3, 64), torch.randn(()).item())
    w, ids = grouped_topk_triton(logits.to(DEVICE), torch.zeros(64, device=DEVICE), 4, 2, 6, True, 1.0)
    assert ids.cpu().tolist() == [list(range(6))] * 3
    torch.testing.assert_close(w.cpu(), torch.full((3, 6), 1 / 6))


def test_op_dispatch_opcheck_and_compile():
    router = hf_router(64, 4, 2, 4, True, 2.5)
    bias = router.e_score_correction_bias.to(DEVICE)
    logits = router(torch.randn(9, 96))[0].detach().to(DEVICE)
    torch.library.opcheck(OP, (logits, bias, 4, 2, 4, True, 2.5))

    compiled = torch.compile(lambda x: OP(x, bias, 4, 2, 4, True, 2.5), fullgraph=True, dynamic=True)
    for t in (9, 3):
        w, ids = compiled(logits[:t])
        ref_w, ref_ids = by_id(*OP(logits[:t], bias, 4, 2, 4, True, 2.5))
        got_w, got_ids = by_id(w, ids)
        assert torch.equal(got_ids, ref_ids) and torch.equal(got_w, ref_w)


def test_bad_inputs_have_clear_errors():
    logits, bias = torch.randn(4, 64), torch.zeros(64)
    with pytest.raises(TypeError, match="float32"):
        OP(logits.bfloat16(), bias, 4, 2, 4, True, 1.0)
    with pytest.raises(TypeError, match=r"correction_bias must be float32 \[64\]"):
        OP(logits, torch.zeros(63), 4, 2, 4, True, 1.0)
    with pytest.raises(ValueError, match="groups of at least 2"):
        OP(logits, bias, 5, 2, 4, True, 1.0)
    with pytest.raises(ValueError, match="topk_group"):
        OP(logits, bias, 4, 5, 4, True, 1.0)
    with pytest.raises(ValueError, match="top_k=33"):
        OP(logits, bias, 4, 2, 33, True, 1.0)


@pytest.mark.gpu
def test_router_module_bf16_gemm_matches_transformers_on_gpu():
    """On CUDA with bf16 weights GroupedTopkRouter computes logits by a bf16 GEMM with fp32
    output: the same exact products as Transformers' fp32 GEMM, summed in another order, so
    logits agree to fp32 rounding of a 7168-term sum (rtol 1e-5, atol 1e-5 * max |logit|);
    the experts chosen are the same for all but near-tied tokens (at most 1 in 1000)."""
    from hf_integration.router import GroupedTopkRouter

    hf = hf_router(256, 8, 4, 8, True, 2.5, hidden=7168).cuda().to(torch.bfloat16)
    ours = GroupedTopkRouter(hf)
    x = torch.randn(4096, 7168, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        hf_logits, hf_w, hf_ids = hf(x)
        logits, w, ids = ours(x)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, hf_logits, rtol=1e-5, atol=1e-5 * hf_logits.abs().max().item())
    differ = (ids.sort(dim=-1)[0] != hf_ids.sort(dim=-1)[0]).any(dim=-1)
    assert differ.sum() <= 4, int(differ.sum())
    same = ~differ
    torch.testing.assert_close(by_id(w[same], ids[same])[0], by_id(hf_w[same], hf_ids[same])[0], rtol=1e-5, atol=0)


# fp4moe::softmax_topk ----------------------------------------------------------------------------

SOFTMAX_OP = torch.ops.fp4moe.softmax_topk
# where each router of hf_integration.router.SOFTMAX_TOPK_ROUTERS lives in Transformers
ROUTER_MODULES = {
    "Qwen2MoeTopKRouter": "qwen2_moe", "Qwen3MoeTopKRouter": "qwen3_moe", "Qwen3NextTopKRouter": "qwen3_next",
    "OlmoeTopKRouter": "olmoe", "FlexOlmoTopKRouter": "flex_olmo", "Qwen3OmniMoeThinkerTextTopKRouter": "qwen3_omni_moe",
    "Qwen3OmniMoeTalkerTextTopKRouter": "qwen3_omni_moe", "Qwen3_5MoeTopKRouter": "qwen3_5_moe",
    "Qwen3VLMoeTextTopKRouter": "qwen3_vl_moe", "Qwen3OmniMoeTextTopKRouter": "qwen3_omni_moe",
    "MixtralTopKRouter": "mixtral", "MiniMaxTopKRouter": "minimax",
}


def softmax_topk64(logits, top_k, renormalize):
    """The definition in float64 from the logits as given: softmax, the k largest, renormalized."""
    probs = torch.softmax(logits.double(), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    return (weights / weights.sum(dim=-1, keepdim=True) if renormalize else weights), ids


def transformers_softmax_router(name, num_experts=60, top_k=4, hidden=96, norm_topk_prob=True):
    """Transformers' router class ``name`` with a random weight (logits ~ N(0, 4): probabilities
    far from uniform, few near ties), or a skip where this Transformers lacks it."""
    import importlib
    from types import SimpleNamespace

    module = importlib.import_module(f"transformers.models.{ROUTER_MODULES[name]}.modeling_{ROUTER_MODULES[name]}")
    if not hasattr(module, name):
        pytest.skip(f"this Transformers has no {name}")
    config = SimpleNamespace(num_experts_per_tok=top_k, num_experts=num_experts, num_local_experts=num_experts,
                             hidden_size=hidden, norm_topk_prob=norm_topk_prob)
    router = getattr(module, name)(config)
    with torch.no_grad():
        router.weight.normal_(std=2 * hidden**-0.5)
    return router


def test_every_listed_softmax_router_has_a_test():
    from hf_integration.router import SOFTMAX_TOPK_ROUTERS

    assert set(SOFTMAX_TOPK_ROUTERS) == set(ROUTER_MODULES)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("name", sorted(ROUTER_MODULES))
def test_softmax_router_module_matches_transformers(name, norm):
    """Off CUDA the module makes Transformers' calls: bitwise its logits, weights (in its dtype)
    and ids, for a bf16 router as loaded and a float32 one. A family that always renormalizes
    ignores ``norm_topk_prob``, as Transformers' own class does."""
    from hf_integration.router import SoftmaxTopkRouter

    for dtype in (torch.bfloat16, torch.float32):
        hf = transformers_softmax_router(name, norm_topk_prob=norm).to(dtype)
        ours = SoftmaxTopkRouter(hf)
        assert ours.weight is hf.weight and "op=fp4moe::router_softmax_topk" in repr(ours)
        x = torch.randn(2, 19, 96, dtype=dtype)
        with torch.no_grad():
            want, got = hf(x), ours(x)
        for w, g in zip(want, got):
            assert w.dtype == g.dtype and torch.equal(w, g), name


@pytest.mark.parametrize("e,k,renorm", [(128, 8, True), (60, 4, False), (8, 2, True), (256, 1, True), (5, 5, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_topk_kernel_against_float64(e, k, renorm, dtype):
    """The kernel (Triton's interpreter on a CPU) against the float64 definition: the same experts
    for every token (random logits ~ N(0, 4) have no ties closer than float32's rounding of a
    probability here) and weights within 4e-6 relative, a bound rather than the typical error: a
    float32 exp (a few ulps of 1.2e-7) and tree sums of at most 256 terms (8 roundings deep), then
    one division, keep a weight within ~30 ulps of float64."""
    logits = (torch.randn(33, e, generator=torch.Generator().manual_seed(e)) * 2).to(dtype)
    w, ids = softmax_topk_triton_on_device(logits, k, renorm)
    ref_w, ref_ids = softmax_topk64(logits, k, renorm)
    got_w, got_ids = by_id(w.cpu().double(), ids.cpu())
    want_w, want_ids = by_id(ref_w, ref_ids)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=4e-6, atol=0)


def softmax_topk_triton_on_device(logits, k, renorm):
    from fp4moe_ops.routing import softmax_topk_triton

    return softmax_topk_triton(logits.to(DEVICE), k, renorm)


def test_softmax_topk_kernel_ties_and_strided_rows():
    """Equal logits: experts 0..k-1, weights 1/k. A row-strided view (a slice of wider logits) is
    read in place."""
    w, ids = softmax_topk_triton_on_device(torch.zeros(3, 16), 4, True)
    assert ids.cpu().tolist() == [[0, 1, 2, 3]] * 3
    torch.testing.assert_close(w.cpu(), torch.full((3, 4), 0.25))
    wide = torch.randn(5, 40) * 2
    w, ids = softmax_topk_triton_on_device(wide[:, :32], 3, False)
    ref_w, ref_ids = softmax_topk64(wide[:, :32], 3, False)
    (got_w, got_ids), (want_w, want_ids) = by_id(w.cpu().double(), ids.cpu()), by_id(ref_w, ref_ids)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=4e-6, atol=0)  # as in the test above


ROUTER_OP = torch.ops.fp4moe.router_softmax_topk


def logits64(x, w):
    return x.double() @ w.double().t()


@pytest.mark.parametrize("tokens,e,h,k,renorm", [(1, 128, 2048, 8, True), (16, 60, 96, 4, False),
                                                 (3, 8, 4104, 2, True), (5, 5, 32, 5, False)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_router_kernel_against_float64(tokens, e, h, k, renorm, dtype):
    """The one-launch router (Triton's interpreter on a CPU): each logit within float32
    summation's bound of its float64 dot product, then one unit in the last place of the dtype
    (the cast); the experts and weights are the float64
    softmax top-k of those logits (equal logits to the lower id), within softmax_topk's bound.
    Shapes: Qwen3-30B-A3B's
    router; E and H not powers of two; H past one 4096-wide step; k = E. The counters are zero
    after every call (the next call and a graph's next replay need them so)."""
    from fp4moe_ops.routing import router_counters, router_softmax_topk_triton

    gen = torch.Generator().manual_seed(tokens * e + h)
    x = torch.randn(tokens, h, generator=gen).to(dtype)
    w = (torch.randn(e, h, generator=gen) * 2 * h**-0.5).to(dtype)
    counters = router_counters(DEVICE)
    for _ in range(2):
        logits, weights, ids = router_softmax_topk_triton(x.to(DEVICE), w.to(DEVICE), counters, k, renorm)
        assert not counters.any()
    want = logits64(x, w)
    # float32 sums: each addition within 2^-24 of its result, itself at most sum |x_i w_i|, so any
    # summation order of depth D errs by at most D 2^-24 sum |x_i w_i| (to first order). Depth here:
    # ceil(H / 4096) chunk additions per element, then tl.sum over a [4, 4096]-element tile held by
    # 128 threads, at most 64 elements each added in sequence, 5 shuffle levels and 2 across warps
    # (the interpreter's numpy sums are shallower); float32 products add one rounding. Then the cast
    # to the dtype: one unit in its last place.
    depth = -(-h // 4096) + 64 + 5 + 2 + 1
    sum_err = depth * 2.0**-24 * (x.double().abs() @ w.double().abs().t())
    ulp = want.abs() * torch.finfo(dtype).eps
    assert logits.dtype == dtype
    assert ((logits.cpu().double() - want).abs() <= sum_err + ulp).all()
    # the softmax top-k of the fused logits in float64, equal logits (frequent in bf16) to the lower id
    probs = torch.softmax(logits.cpu().double(), dim=-1)
    want_ids = probs.neg().argsort(dim=-1, stable=True)[:, :k]
    want_w = probs.gather(1, want_ids)
    if renorm:
        want_w = want_w / want_w.sum(dim=-1, keepdim=True)
    (got_w, got_ids), (want_w, want_ids) = by_id(weights.cpu().double(), ids.cpu()), by_id(want_w, want_ids)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=4e-6, atol=0)  # as test_softmax_topk_kernel_against_float64


def test_fused_router_launch_refuses_more_tokens_than_counters():
    from fp4moe_ops.routing import ROUTER_FUSED_MAX_TOKENS, router_counters, router_softmax_topk_triton

    x, w = torch.randn(ROUTER_FUSED_MAX_TOKENS + 1, 64), torch.randn(8, 64)
    with pytest.raises(ValueError, match="at most 16 tokens"):
        router_softmax_topk_triton(x.to(DEVICE), w.to(DEVICE), router_counters(DEVICE), 2, True)


def test_fused_router_op_opcheck_compile_and_errors():
    """Off CUDA the op is F.linear then softmax_topk: bitwise. Its fake shares the checks; it
    compiles without a graph break at any token count."""
    from fp4moe_ops.routing import router_counters

    x, w = torch.randn(9, 64, dtype=torch.bfloat16), torch.randn(16, 64, dtype=torch.bfloat16)
    counters = router_counters("cpu")
    logits, weights, ids = ROUTER_OP(x, w, counters, 4, True)
    assert torch.equal(logits, torch.nn.functional.linear(x, w))
    want = SOFTMAX_OP(logits, 4, True)
    assert torch.equal(weights, want[0]) and torch.equal(ids, want[1])
    torch.library.opcheck(ROUTER_OP, (x, w, counters, 4, True))
    compiled = torch.compile(lambda a: ROUTER_OP(a, w, counters, 4, False), fullgraph=True, dynamic=True)
    for t in (9, 3):
        assert all(torch.equal(a, b) for a, b in zip(compiled(x[:t]), ROUTER_OP(x[:t], w, counters, 4, False)))
    with pytest.raises(TypeError, match=r"weight must be \[E, H=64\] torch.bfloat16"):
        ROUTER_OP(x, w.float(), counters, 4, True)
    with pytest.raises(TypeError, match="counters must be router_counters"):
        ROUTER_OP(x, w, torch.zeros(3, dtype=torch.int32), 4, True)
    with pytest.raises(ValueError, match=r"top_k=17 must be in \[1, 16\]"):
        ROUTER_OP(x, w, counters, 17, True)


def test_router_module_takes_the_differentiable_path_with_gradients():
    """With gradients on (a router being trained), the module runs F.linear and softmax_topk, which
    have a backward: the router's weight gets a gradient; without, the one-op router, unless its
    counters are not where the activations are (offloading)."""
    from hf_integration.router import SoftmaxTopkRouter

    from torch.profiler import ProfilerActivity, profile

    def ops_run(fn):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = fn()
        return out, {e.name for e in prof.events() if e.name.startswith("fp4moe::")}

    ours = SoftmaxTopkRouter(transformers_softmax_router("Qwen3MoeTopKRouter", norm_topk_prob=True))
    x = torch.randn(5, 96)
    (logits, weights, ids), ran = ops_run(lambda: ours(x))
    assert ran == {"fp4moe::softmax_topk"}
    (weights ** 2).sum().backward()  # (not weights.sum(): renormalized weights sum to 1, a zero gradient)
    assert ours.weight.grad is not None and ours.weight.grad.abs().sum() > 0
    with torch.no_grad():
        again, ran = ops_run(lambda: ours(x))
        assert "fp4moe::router_softmax_topk" in ran
        assert all(torch.equal(a, b) for a, b in zip(again, (logits.detach(), weights.detach(), ids)))
        ours.counters = ours.counters.to("meta")  # as a router made for offloading keeps them: not used
        out, ran = ops_run(lambda: ours(x))
        assert ran == {"fp4moe::softmax_topk"} and all(torch.equal(a, b) for a, b in zip(out, again))


def test_router_counters_are_zero_after_a_move_or_to_empty():
    """A move or ``to_empty()`` zeroes the fused router's arrival counters (uninitialized memory
    there would leave a token's experts unset on every later call)."""
    from hf_integration.router import SoftmaxTopkRouter

    ours = SoftmaxTopkRouter(transformers_softmax_router("Qwen3MoeTopKRouter", norm_topk_prob=True))
    ours.counters.fill_(3)
    ours.to_empty(device="cpu")
    assert not ours.counters.any()
    ours.counters.fill_(3)
    ours.to(torch.float32)
    assert not ours.counters.any() and ours.counters.dtype == torch.int32


@pytest.mark.gpu
def test_fused_router_matches_cublas_and_softmax_topk_on_gpu():
    """On CUDA at Qwen3-30B-A3B's router (128 experts, top 8, H=2048, bf16), 1-16 tokens (the fused
    launch): logits within the float64 test's bound of their float64 dot products (float32
    summation, then one bf16 unit in the last place) and mostly bitwise cuBLAS's (another summation
    order: a logit near zero, where the sums cancel, can round apart by more than its own last
    place); experts and weights as softmax_topk's on the fused logits; the counters zero after
    calls inside a CUDA graph's replays too."""
    from fp4moe_ops.routing import router_counters

    w = (torch.randn(128, 2048, device="cuda") * 2 * 2048**-0.5).bfloat16()
    counters = router_counters("cuda")
    for t in (1, 2, 7, 16):
        x = torch.randn(t, 2048, device="cuda").bfloat16()
        logits, weights, ids = ROUTER_OP(x, w, counters, 8, True)
        want = logits64(x, w)
        sum_err = (1 + 64 + 5 + 2 + 1) * 2.0**-24 * (x.double().abs() @ w.double().abs().t())  # as in the float64 test
        assert ((logits.double() - want).abs() <= sum_err + want.abs() * torch.finfo(torch.bfloat16).eps).all()
        assert (logits == torch.nn.functional.linear(x, w)).float().mean() > 0.9
        want_w, want_ids = by_id(*SOFTMAX_OP(logits, 8, True))
        got_w, got_ids = by_id(weights, ids)
        assert torch.equal(got_ids, want_ids)
        torch.testing.assert_close(got_w, want_w, rtol=4e-6, atol=0)
    x = torch.randn(4, 2048, device="cuda").bfloat16()
    graph = torch.cuda.CUDAGraph()
    eager = ROUTER_OP(x, w, counters, 8, True)
    with torch.cuda.graph(graph):
        out = ROUTER_OP(x, w, counters, 8, True)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(out, eager)) and not counters.any()


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["Qwen3MoeTopKRouter", "MixtralTopKRouter"])
def test_softmax_router_module_matches_transformers_on_gpu(name):
    """On CUDA at Qwen3-30B-A3B's shapes (128 experts, top 8, H=2048, bf16, 4096 tokens): the
    logits are the same GEMM, so bitwise; the kernel's exp and sums run in another order than
    torch's softmax, so a token whose k-th and (k+1)-th probabilities are within float32 rounding
    may pick the other expert: at most 1 token in 1000 (random routers give a handful at most).
    Where the experts agree, weights within 1e-5 relative of Transformers' float32 ones (a few
    ulps apart, then Transformers' own bf16 cast for the Qwen family: compared before that cast
    by recomputing it from the logits). Exactly tied logits (a zero router row) take the lower
    expert ids."""
    from hf_integration.router import SoftmaxTopkRouter

    hf = transformers_softmax_router(name, num_experts=128, top_k=8, hidden=2048).cuda().to(torch.bfloat16)
    ours = SoftmaxTopkRouter(hf)
    x = torch.randn(4096, 2048, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        hf_logits, _, hf_ids = hf(x)
        logits, _, ids = ours(x)
        w, _ = SOFTMAX_OP(logits, 8, True)
        hf_w, _ = torch.topk(torch.softmax(hf_logits, dtype=torch.float, dim=-1), 8, dim=-1)
    assert torch.equal(logits, hf_logits)
    differ = (ids.sort(dim=-1)[0] != hf_ids.sort(dim=-1)[0]).any(dim=-1)
    assert differ.sum() <= 4, int(differ.sum())
    same = ~differ
    hf_w = hf_w / hf_w.sum(dim=-1, keepdim=True)
    torch.testing.assert_close(by_id(w, ids)[0][same], by_id(hf_w, hf_ids)[0][same], rtol=1e-5, atol=0)
    _, tied = SOFTMAX_OP(torch.zeros(3, 128, dtype=torch.bfloat16, device="cuda"), 8, True)
    assert tied.cpu().tolist() == [list(range(8))] * 3


def test_softmax_topk_op_opcheck_compile_and_errors():
    logits = (torch.randn(9, 64) * 2).to(DEVICE)
    torch.library.opcheck(SOFTMAX_OP, (logits, 4, True))
    torch.library.opcheck(SOFTMAX_OP, (logits.bfloat16(), 4, False))
    compiled = torch.compile(lambda x: SOFTMAX_OP(x, 4, True), fullgraph=True, dynamic=True)
    for t in (9, 3):
        got, want = by_id(*compiled(logits[:t])), by_id(*SOFTMAX_OP(logits[:t], 4, True))
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
    with pytest.raises(TypeError, match="floating point"):
        SOFTMAX_OP(torch.ones(4, 8, dtype=torch.int32), 2, True)
    with pytest.raises(TypeError, match=r"\[T, E\]"):
        SOFTMAX_OP(torch.randn(8), 2, True)
    with pytest.raises(ValueError, match=r"top_k=9 must be in \[1, 8\]"):
        SOFTMAX_OP(torch.randn(4, 8), 9, True)


@pytest.mark.parametrize("renorm", [True, False])
def test_softmax_topk_gradient_matches_float64_autograd(renorm):
    """d logits flows through the softmax over every expert (not only the chosen ones) and the
    renormalization: against torch's float64 autograd of the definition, within float32 rounding."""
    logits = (torch.randn(7, 24) * 2).requires_grad_()
    grad = torch.randn(7, 3)
    w, ids = SOFTMAX_OP(logits, 3, renorm)
    (got,) = torch.autograd.grad(w, logits, grad)
    l64 = logits.detach().double().requires_grad_()
    probs = torch.softmax(l64, dim=-1).gather(1, ids)
    w64 = probs / probs.sum(dim=-1, keepdim=True) if renorm else probs
    (want,) = torch.autograd.grad(w64, l64, grad.double())
    assert (got != 0).sum() > 7 * 3  # every logit of a token moves its weights
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7)
