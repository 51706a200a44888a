"""The routers: Transformers' router modules swapped for fp4moe's, which keep their parameters and
state-dict keys and run the routing after the router's GEMM as one op (one Triton launch on CUDA
instead of Transformers' several small kernels):

* :class:`GroupedTopkRouter` for DeepSeek-V3-style group-limited top-k routers (DeepSeek-V3/R1,
  Kimi-K2, GLM4-MoE): ``torch.ops.fp4moe.grouped_topk``;
* :class:`SoftmaxTopkRouter` for softmax top-k routers (Qwen2/3-MoE, Qwen3-Next, OLMoE, Mixtral,
  MiniMax): ``torch.ops.fp4moe.router_softmax_topk``, the router's GEMM included.

Which Transformers classes compute exactly an op's definition is listed by name below; the tests
compare every listed class that the installed Transformers has against its replacement.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import fp4moe_ops  # noqa: F401  (registers torch.ops.fp4moe.grouped_topk, softmax_topk, router_softmax_topk)
from fp4moe_ops.routing import router_counters

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

    def dequantized_state(self, dtype: torch.dtype, config=None) -> dict[str, torch.Tensor]:
        """The router's own tensors: it replaced Transformers' with the same ones."""
        return self.state_dict()

    def __init__(self, router: nn.Module):
        nn.Module.__init__(self)  # not super(): in a fused_class the next class is Transformers' router
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


# Transformers routers that compute fp4moe::softmax_topk's definition after ``F.linear(hidden,
# weight)``: {class name: (renormalize: True or the attribute that says, weights cast to the
# logits' dtype)}. Mixtral's and MiniMax's return float32 weights; the Qwen family's, 16-bit ones.
SOFTMAX_TOPK_ROUTERS = {
    **dict.fromkeys(("Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter", "Qwen3NextTopKRouter", "OlmoeTopKRouter",
                     "FlexOlmoTopKRouter", "Qwen3OmniMoeThinkerTextTopKRouter", "Qwen3OmniMoeTalkerTextTopKRouter"),
                    ("norm_topk_prob", True)),
    **dict.fromkeys(("Qwen3_5MoeTopKRouter", "Qwen3VLMoeTextTopKRouter", "Qwen3OmniMoeTextTopKRouter"), (True, True)),
    **dict.fromkeys(("MixtralTopKRouter", "MiniMaxTopKRouter"), (True, False)),
}


class SoftmaxTopkRouter(nn.Module):
    """Drop-in for a softmax top-k router (:data:`SOFTMAX_TOPK_ROUTERS`): the same ``weight [E, H]``
    parameter, so the same state-dict keys, and the same outputs ``(logits [T, E], weights [T, k],
    ids [T, k] int64)`` in the same dtypes. Without gradients the whole router is one
    ``fp4moe::router_softmax_topk`` op (on CUDA one launch up to 16 tokens: its GEMV, softmax,
    top-k and renormalization; its arrival counters are the non-persistent ``counters`` buffer, so
    one router must not run on two streams at once); with them, ``F.linear`` then
    ``fp4moe::softmax_topk``, which has a backward. Off CUDA the results are bitwise
    Transformers'; on CUDA the softmax's exponent and sums are computed in another order, so a
    near-tied token may pick another expert, and up to 16 tokens the logits' sums too, so a logit
    may round to a neighbouring value."""

    def dequantized_state(self, dtype: torch.dtype, config=None) -> dict[str, torch.Tensor]:
        """The router's own tensors: it replaced Transformers' with the same ones."""
        return self.state_dict()

    def __init__(self, router: nn.Module):
        nn.Module.__init__(self)  # not super(): in a fused_class the next class is Transformers' router
        renormalize, self.cast_weights = SOFTMAX_TOPK_ROUTERS[type(router).__name__]
        self.renormalize = bool(renormalize if renormalize is True else getattr(router, renormalize))
        self.weight = router.weight
        self.top_k, self.num_experts, self.hidden_dim = router.top_k, router.num_experts, router.hidden_dim
        self.register_buffer("counters", router_counters(router.weight.device), persistent=False)

    def _apply(self, fn, recurse=True):
        # a move or to_empty() must not carry a non-zero (or uninitialized) counter along: a token
        # whose counter never reaches its last program would keep garbage experts on every call
        super()._apply(fn, recurse)
        if self.counters.device.type != "meta":
            self.counters.zero_()
        return self

    def forward(self, hidden_states: torch.Tensor):
        x = hidden_states.reshape(-1, self.hidden_dim)
        trains = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
        # mixed dtypes: Transformers' F.linear says what it says; counters elsewhere than the
        # activations (a router made on the meta device for offloading, which never fills them): as well
        if trains or x.dtype != self.weight.dtype or self.counters.device != x.device:
            logits = F.linear(x, self.weight)
            weights, ids = torch.ops.fp4moe.softmax_topk(logits, self.top_k, self.renormalize)
        else:
            logits, weights, ids = torch.ops.fp4moe.router_softmax_topk(x, self.weight, self.counters, self.top_k,
                                                                        self.renormalize)
        return logits, weights.to(logits.dtype) if self.cast_weights else weights, ids

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, renormalize={self.renormalize}, "
                f"op=fp4moe::router_softmax_topk")


ROUTERS = {**dict.fromkeys(GROUPED_TOPK_ROUTERS, GroupedTopkRouter),
           **dict.fromkeys(SOFTMAX_TOPK_ROUTERS, SoftmaxTopkRouter)}


_FUSED_CLASSES: dict[tuple[type, type], type] = {}


def fused_class(router_class: type) -> type:
    """fp4moe's router for ``router_class`` (a class named in :data:`ROUTERS`), as a subclass of both:
    Transformers finds routers by class (``output_router_logits`` hooks every instance of the
    model's router class to collect the logits its auxiliary loss needs), so the replacement must
    still be one. fp4moe's ``__init__`` and ``forward`` come first; one class per router class."""
    base = ROUTERS[router_class.__name__]
    key = (base, router_class)
    if key not in _FUSED_CLASSES:
        name = f"{base.__name__}_{router_class.__name__}"
        cls = type(name, (base, router_class), {"__module__": __name__, "__qualname__": name})
        globals()[name] = cls  # pickle finds a class by module and name
        _FUSED_CLASSES[key] = cls
    return _FUSED_CLASSES[key]


def grouped_topk_routers(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, router) of the routers :class:`GroupedTopkRouter` replaces."""
    return children_where(model, lambda m: type(m).__name__ in GROUPED_TOPK_ROUTERS)


def fusable_routers(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, router) of every router :func:`fuse_routers` replaces."""
    return children_where(model, lambda m: type(m).__name__ in ROUTERS)


def fuse_routers(model: nn.Module) -> int:
    """Swap every router fp4moe runs as one op (:data:`ROUTERS`) for fp4moe's module, made an
    instance of the replaced router's class too (:func:`fused_class`); returns how many."""
    routers = fusable_routers(model)
    for parent, attr, m in routers:
        replace_module(parent, attr, fused_class(type(m))(m))
    return len(routers)


__all__ = ["GROUPED_TOPK_ROUTERS", "GroupedTopkRouter", "ROUTERS", "SOFTMAX_TOPK_ROUTERS", "SoftmaxTopkRouter",
           "fusable_routers", "fuse_routers", "fused_class", "grouped_topk_routers"]
