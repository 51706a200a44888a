"""The router: DeepSeek-V3-style group-limited top-k routers (DeepSeek-V3/R1, Kimi-K2, GLM4-MoE)
swapped for :class:`GroupedTopkRouter`, which keeps their parameters and state-dict keys and runs
the routing as one ``torch.ops.fp4moe.grouped_topk`` op (one Triton launch on CUDA instead of
Transformers' ~10 small kernels)."""

from __future__ import annotations

import torch
from torch import nn

import fp4moe_ops  # noqa: F401  (registers torch.ops.fp4moe.grouped_topk)

from .surgery import children_where, replace_module

# Transformers routers that compute exactly fp4moe::grouped_topk's definition (sigmoid scores,
# correction bias for choosing, group score = sum of the top 2, renormalize, scale).
GROUPED_TOPK_ROUTERS = ("DeepseekV3TopkRouter", "Glm4MoeTopkRouter")


class GroupedTopkRouter(nn.Module):
    """Drop-in for a DeepSeek-V3-style router (:data:`GROUPED_TOPK_ROUTERS`): the same
    ``weight [E, H]`` parameter (float32 or the model's dtype) and ``e_score_correction_bias [E]``
    buffer, so the same state-dict keys, and the same outputs ``(logits [T, E] float32,
    weights [T, k] float32, ids [T, k] int64)``; the group-limited top-k runs as one
    ``fp4moe::grouped_topk`` op. Off CUDA the results are bitwise Transformers'; on CUDA the
    logits' summation order differs, so a near-tied token may pick another expert."""

    def __init__(self, router: nn.Module):
        super().__init__()
        self.weight = router.weight
        persistent = "e_score_correction_bias" not in router._non_persistent_buffers_set
        self.register_buffer("e_score_correction_bias", router.e_score_correction_bias, persistent=persistent)
        for name in ("hidden_dim", "num_experts", "num_group", "topk_group", "top_k", "norm_topk_prob",
                     "routed_scaling_factor"):
            setattr(self, name, getattr(router, name))

    def forward(self, hidden_states: torch.Tensor):
        x = hidden_states.view(-1, self.hidden_dim)
        if x.is_cuda and x.dtype == self.weight.dtype == torch.bfloat16:
            # Transformers casts both to float32 first (a float32 copy of the weight per call, and
            # an fp32 GEMM: 0.6 ms per layer at 8192 tokens). bf16 x bf16 products are exact in
            # fp32, so one bf16 GEMM with fp32 accumulation and output gives the same logits up
            # to summation order.
            logits = torch.mm(x, self.weight.t(), out_dtype=torch.float32)
        else:
            logits = nn.functional.linear(x.float(), self.weight.float())
        weights, ids = torch.ops.fp4moe.grouped_topk(  # bias: float32 math, as Transformers' add promotes
            logits, self.e_score_correction_bias.float(), self.num_group, self.topk_group, self.top_k,
            bool(self.norm_topk_prob), float(self.routed_scaling_factor))
        return logits, weights, ids

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, groups={self.num_group}, topk_group={self.topk_group}, "
                f"top_k={self.top_k}, op=fp4moe::grouped_topk")


def grouped_topk_routers(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, router) of the routers :class:`GroupedTopkRouter` replaces."""
    return children_where(model, lambda m: type(m).__name__ in GROUPED_TOPK_ROUTERS)


def fuse_routers(model: nn.Module) -> int:
    """Swap every DeepSeek-V3-style router for a :class:`GroupedTopkRouter`; returns how many."""
    routers = grouped_topk_routers(model)
    for parent, attr, m in routers:
        replace_module(parent, attr, GroupedTopkRouter(m))
    return len(routers)


__all__ = ["GROUPED_TOPK_ROUTERS", "GroupedTopkRouter", "fuse_routers", "grouped_topk_routers"]
