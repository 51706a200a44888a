"""The MoE math that every pure-PyTorch path shares: the reference backend, the FlashInfer
simulator and calibration.

    out[t] = sum_j  w[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)),   e = ids[t, j]

and gpt-oss's variant (:func:`clamped_swiglu`): biases on both GEMMs, gate and up interleaved, and
``(clamp(up) + 1) * gate * sigmoid(swiglu_alpha * gate)`` with gate clamped from above.

computed for the routed (token, expert) pairs only. A token never meets the weights of an
expert it was not routed to, so a bad expert (NaN or Inf in its weights or scales) cannot reach
other tokens; ids outside ``[0, E)`` (expert-parallel sentinels) contribute nothing.

Each path supplies ``expert(e, rows [n, H]) -> [n, H] float32``: how expert ``e``'s two GEMMs
are computed (dequantized weights, activation fake-quantization, FlashInfer's alphas, ...).
This is eager code with one host sync per call (the experts' row counts): correctness paths, not kernels.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def expert_groups(topk_ids: torch.Tensor, num_experts: int):
    """``(e, slots)`` for every expert ``e`` with routed (token, slot) pairs: ``slots`` indexes
    ``topk_ids.reshape(-1)`` (token = slot // k), tokens in order; ids outside ``[0, num_experts)``
    belong to no expert. One host sync (the experts' counts)."""
    flat = topk_ids.reshape(-1).long()
    expert_of = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)  # invalid ids: one bin past the end
    pairs = torch.argsort(expert_of, stable=True)
    counts = torch.bincount(expert_of, minlength=num_experts + 1)[:num_experts].tolist()  # the one host sync
    start = 0
    for e, n in enumerate(counts):
        if n:
            yield e, pairs[start:start + n]
        start += n


def routed_moe(hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
               expert: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``[T, H]`` float32: the routing-weighted sum of ``expert(e, rows)`` over each token's experts.

    Args:
        hidden_states: ``[T, H]``.
        topk_ids: ``[T, k]`` integer expert ids; ids outside ``[0, num_experts)`` are skipped.
        topk_weights: ``[T, k]`` routing weights, applied in float32 as given.
        expert: ``expert(e, rows [n, H]) -> [n, H]`` float32, for the rows routed to ``e``.
    """
    out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
    weights = topk_weights.reshape(-1, 1).float()
    for e, routed in expert_groups(topk_ids, num_experts):
        token = routed // topk_ids.shape[1]
        out.index_add_(0, token, expert(e, hidden_states[token]) * weights[routed])
    return out


def expert_scale(scale: torch.Tensor | None, e: int) -> torch.Tensor | None:
    """Expert ``e``'s entry of a per-expert scale ``[E]``, or the shared scalar (0-dim)."""
    if scale is None:
        return None
    return scale.reshape(-1)[e] if scale.numel() > 1 else scale.reshape(())


def gated_silu(h: torch.Tensor, dtype: torch.dtype, *, up_first: bool = False) -> torch.Tensor:
    """``silu(gate) * up`` of a fused gate_up GEMM output ``h [n, 2I]`` (rows ``[gate; up]``, or
    ``[up; gate]`` with ``up_first`` as FlashInfer lays them out), rounded to ``dtype`` as a
    kernel stores its intermediate."""
    first, second = h.chunk(2, dim=-1)
    gate, up = (second, first) if up_first else (first, second)
    return (F.silu(gate) * up).to(dtype)


def clamped_swiglu(h: torch.Tensor, swiglu_alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation of a fused gate_up GEMM output ``h [n, 2I]`` (bias added) whose columns
    interleave gate (even) and up (odd): ``gate = min(gate, limit)``, ``up = clamp(up, -limit,
    limit)``, ``(up + 1) * gate * sigmoid(swiglu_alpha * gate)``; ``[n, I]`` in ``h``'s dtype."""
    gate, up = h[..., ::2].clamp(max=limit), h[..., 1::2].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * swiglu_alpha))


__all__ = ["clamped_swiglu", "expert_groups", "expert_scale", "gated_silu", "routed_moe"]
