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
