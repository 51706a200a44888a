"""Llama-4's routed experts: ModelOpt's fused 3-D NVFP4 layout, and the MoE block that runs them.

Transformers' ``Llama4TextExperts`` holds all experts as two bmm-layout parameters,
``gate_up_proj [E, H, 2I]`` and ``down_proj [E, I, H]`` (input dim first, ``[gate | up]`` along
the last dim). ModelOpt exports them fused, under the same names (seen in a genuine export,
``tests/fixtures/modelopt/llama4_text_nvfp4_mlp_only``)::

    <experts>.gate_up_proj               U8       [E, H/2, 2I]   E2M1 pairs along H, low nibble = even h
    <experts>.gate_up_proj_weight_scale  F8_E4M3  [E, H/16, 2I]  one block scale per 16 h of a column
    <experts>.gate_up_proj_weight_scale_2 F32     []             one global scale for all experts
    <experts>.gate_up_proj_input_scale   F32      []             one activation scale for all experts
    <experts>.down_proj ...              U8 [E, I/2, H], F8_E4M3 [E, I/16, H], F32 [], F32 []

i.e. ``transpose(1, 2)`` of fp4moe's canonical per-expert tensors (``[E, 2I, H/2]`` ...), with the
per-expert global and input scales all equal. :func:`canonical_from_fused` and
:func:`fused_from_canonical` convert between the two, exactly (byte moves, no arithmetic).

Llama-4 routes differently from the other MoEs: the sigmoid router score multiplies the expert's
*input*, not its output (``experts(x * score)``), and a shared expert is added.
:class:`NVFP4Llama4TextMoe` replaces ``Llama4TextMoe`` with the same call and outputs, running the
routed experts through :class:`~hf_integration.experts.NVFP4Experts` on the scaled inputs, one row
per (token, chosen expert) with weight 1.
"""

from __future__ import annotations

import torch
from torch import nn

from fp4moe_ops import NVFP4MoEWeights, nvfp4

from .experts import NVFP4Experts

EXPERTS_CLASS = "Llama4TextExperts"
FUSED_LEAVES = ("gate_up_proj", "down_proj")
# tensor suffixes of one fused leaf: packed bytes keep the parameter's own name
FUSED_SUFFIXES = {"packed": "", "block": "_weight_scale", "global": "_weight_scale_2", "input": "_input_scale"}


def is_llama4_experts(m: nn.Module) -> bool:
    """Transformers' ``Llama4TextExperts`` (bmm-layout fused experts) with its weights."""
    return type(m).__name__ == EXPERTS_CLASS and isinstance(getattr(m, "gate_up_proj", None), torch.Tensor)


def fused_key(prefix: str, leaf: str, role: str) -> str:
    """The checkpoint key of one fused tensor, e.g. ``<prefix>.gate_up_proj_weight_scale``."""
    return f"{prefix}.{leaf}{FUSED_SUFFIXES[role]}"


def fused_specs(prefix: str, num_experts: int, hidden: int, inter: int, input_scales: bool) -> dict:
    """``{key: (shape, dtype)}`` of one layer's fused NVFP4 experts in a ModelOpt checkpoint."""
    e, block = num_experts, nvfp4.BLOCK_SIZE
    specs = {}
    for leaf, k_in, n_out in (("gate_up_proj", hidden, 2 * inter), ("down_proj", inter, hidden)):
        specs[fused_key(prefix, leaf, "packed")] = ((e, k_in // 2, n_out), torch.uint8)
        specs[fused_key(prefix, leaf, "block")] = ((e, k_in // block, n_out), torch.float8_e4m3fn)
        specs[fused_key(prefix, leaf, "global")] = ((), torch.float32)
        if input_scales:
            specs[fused_key(prefix, leaf, "input")] = ((), torch.float32)
    return specs


def canonical_from_fused(tensors: dict[str, torch.Tensor], experts: range) -> NVFP4MoEWeights:
    """The canonical NVFP4 experts ``experts`` (all, or an expert-parallel shard) from one layer's
    fused file tensors.

    ``tensors`` maps ``"<leaf>.<role>"`` (leaf ``gate_up_proj`` / ``down_proj``, role ``packed`` /
    ``block`` / ``global`` / ``input``) to the file's tensor. The per-layer scalars become per-expert ``[E]``.
    """
    def part(leaf: str, role: str) -> torch.Tensor | None:
        t = tensors.get(f"{leaf}.{role}")
        if t is None:
            return None
        if t.dim() == 0:
            return t.float().reshape(1).expand(len(experts)).contiguous()
        return t[experts.start:experts.stop].transpose(1, 2).contiguous()  # [E, K/2, N] -> [E, N, K/2]

    return NVFP4MoEWeights(
        part("gate_up_proj", "packed"), part("gate_up_proj", "block"), part("gate_up_proj", "global"),
        part("down_proj", "packed"), part("down_proj", "block"), part("down_proj", "global"),
        part("gate_up_proj", "input"), part("down_proj", "input"))


def fused_from_canonical(prefix: str, weights: NVFP4MoEWeights) -> dict[str, torch.Tensor]:
    """One layer's experts as ModelOpt's fused Llama-4 tensors (the inverse of
    :func:`canonical_from_fused`). The file has one global and one input scale per 3-D tensor:
    unequal global scales cannot be written without re-quantizing and are refused; unequal input
    scales (per-expert calibration) are written as their max, ModelOpt's own amax over all experts."""
    out = {}
    for leaf, packed, block, global_, input_ in (
            ("gate_up_proj", weights.gate_up, weights.gate_up_scale, weights.gate_up_global_scale,
             weights.gate_up_input_scale),
            ("down_proj", weights.down, weights.down_scale, weights.down_global_scale, weights.down_input_scale)):
        if not bool((global_ == global_[0]).all()):
            raise ValueError(f"{prefix}.{leaf}: the experts have different global scales, but Llama-4's fused "
                             "checkpoint layout stores one per layer; cannot save without re-quantizing")
        out[fused_key(prefix, leaf, "packed")] = packed.transpose(1, 2).contiguous()
        out[fused_key(prefix, leaf, "block")] = block.transpose(1, 2).contiguous()
        out[fused_key(prefix, leaf, "global")] = global_[0].reshape(()).clone()
        if input_ is not None:
            out[fused_key(prefix, leaf, "input")] = input_.max().reshape(()).clone()
    return out


class NVFP4Llama4Experts(NVFP4Experts):
    """The routed experts of :class:`NVFP4Llama4TextMoe`: saved in ModelOpt's fused layout, and not
    turned back into Transformers' module (Llama-4's routes differently from the others)."""

    def dequantized_state(self, dtype: torch.dtype, config=None, num_experts: int | None = None):
        raise NotImplementedError("is Llama-4's fused NVFP4 experts, which fp4moe cannot turn back into "
                                  "Transformers' module; load the BF16 checkpoint instead")

    def modelopt_tensors(self, name: str, converters=()) -> dict[str, torch.Tensor]:
        return fused_from_canonical(name, self.canonical())


class NVFP4Llama4TextMoe(nn.Module):
    """``Llama4TextMoe`` with NVFP4 routed experts: ``forward(x [..., H]) -> (out [T, H], router_logits
    [T, E])`` as Transformers' block. Keeps its ``router`` and ``shared_expert`` modules (and their
    state-dict keys); ``experts`` is an :class:`NVFP4Llama4Experts`."""

    def __init__(self, moe: nn.Module, experts: NVFP4Llama4Experts):
        super().__init__()
        self.top_k, self.hidden_dim, self.num_experts = moe.top_k, moe.hidden_dim, moe.num_experts
        self.router = moe.router
        self.shared_expert = moe.shared_expert
        self.experts = experts

    def dequantized_state(self, dtype: torch.dtype, config=None):
        return self.experts.dequantized_state(dtype, config)  # (refused: named as this block)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = hidden_states.reshape(-1, self.hidden_dim)
        logits = nn.functional.linear(x, self.router.weight, self.router.bias)
        top_value, top_index = torch.topk(logits, self.top_k, dim=1)
        # Llama4Router's sigmoid (in float32, back to the model dtype), applied to each chosen
        # expert's input as Transformers does; the other experts see a zero input and give 0
        scores = torch.sigmoid(top_value.float()).to(x.dtype)
        routed_in = (x[:, None, :] * scores[:, :, None]).reshape(-1, self.hidden_dim)  # [T*k, H]
        ids = top_index.reshape(-1, 1)
        ones = torch.ones(ids.shape, dtype=torch.float32, device=x.device)
        routed = self.experts(routed_in, ids, ones).reshape(x.shape[0], self.top_k, self.hidden_dim)
        out = self.shared_expert(x)
        return out + routed.sum(dim=1).to(out.dtype), logits


__all__ = ["FUSED_LEAVES", "NVFP4Llama4Experts", "NVFP4Llama4TextMoe", "canonical_from_fused", "fused_from_canonical", "fused_key",
           "fused_specs", "is_llama4_experts"]
