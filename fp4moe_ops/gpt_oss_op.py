"""``torch.ops.fp4moe.gpt_oss_moe``: gpt-oss's routed experts as one graph node, with MXFP4 or NVFP4 weights.

    out[t] = sum_j  w[t, j] * (down_e(clamped_swiglu(gate_up_e(x_t) + gate_up_bias_e)) + down_bias_e),   e = ids[t, j]

``gate_up``'s rows interleave gate and up (row ``2j`` gate's ``j``, as gpt-oss holds them), and
``clamped_swiglu`` (:func:`fp4moe_ops.moe_math.clamped_swiglu`) is ``(clamp(up, -limit, limit) + 1) *
g * sigmoid(swiglu_alpha * g)`` with ``g = min(gate, limit)``. The routing weights are applied as given
(gpt-oss's router takes the softmax over its top-k logits). Activations stay 16-bit (W4A16).

The weights come in one of two formats, told apart by the number of tensors:

* MXFP4, gpt-oss's release: the checkpoint's six tensors (:data:`MXFP4_EXPERT_TENSORS`, format in
  :mod:`fp4moe_ops.mxfp4`);
* NVFP4, as ModelOpt exports gpt-oss: eight tensors (:data:`NVFP4_GPT_OSS_TENSORS`), the canonical
  NVFP4 experts with gpt-oss's interleaved rows and the two biases
  (:func:`~fp4moe_ops.backends.base.check_nvfp4_gpt_oss_tensors`).

A backend may take either in a layout of its own (the ``triton`` backend:
:func:`fp4moe_ops.backends.triton_moe.layout.gpt_oss_kernel_tensors`).

The contract is ``fp4moe::fused_moe``'s: the real and the fake function share their metadata
checks (no host sync), so Dynamo traces one opaque node and ``torch.compile(fullgraph=True)`` never
breaks on it; the backend is named per call and must run gpt-oss's experts
(:meth:`~fp4moe_ops.backends.base.Backend.gpt_oss_refusal`: ``reference`` anywhere, ``triton`` on Hopper
and newer, on tensors in its own layout).
"""

from __future__ import annotations

import torch

from .backends import get_backend
from .backends.base import NVFP4_GPT_OSS_TENSORS
from .mxfp4 import MXFP4_EXPERT_TENSORS, check_mxfp4_experts
from .op import check_routing

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # the activations'


def _check_inputs(hidden_states, topk_ids, topk_weights, expert_tensors, swiglu_alpha, limit, backend):
    """Metadata checks shared by the real and the fake implementation."""
    b = get_backend(backend)
    reason = b.gpt_oss_refusal(hidden_states.device)
    if reason is not None:
        raise ValueError(f"backend {backend!r} cannot run gpt-oss's experts on {hidden_states.device}: {reason}")
    if hidden_states.dim() != 2 or hidden_states.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"hidden_states must be [T, H] bfloat16/float16/float32, got {hidden_states.dtype} "
                        f"{list(hidden_states.shape)}")
    if not (limit > 0):  # also refuses NaN
        raise ValueError(f"limit (swiglu_limit) must be > 0, got {limit}")
    if swiglu_alpha != swiglu_alpha:
        raise ValueError("swiglu_alpha is NaN")
    check_routing(hidden_states, topk_ids, topk_weights, expert_tensors, backend=backend)
    b.check_gpt_oss_tensors(expert_tensors, hidden_states.shape[1])


@torch.library.custom_op("fp4moe::gpt_oss_moe", mutates_args=())
def gpt_oss_moe(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    expert_tensors: list[torch.Tensor],
    swiglu_alpha: float,
    limit: float,
    backend: str,
) -> torch.Tensor:
    """gpt-oss's experts: ``out[t] = sum_j w[t,j] * expert_{ids[t,j]}(x[t])``.

    Args:
        hidden_states: ``[T, H]`` bfloat16/float16/float32.
        topk_ids: ``[T, k]`` int32/int64; ids outside ``[0, E)`` contribute nothing.
        topk_weights: ``[T, k]`` float32 routing weights (applied as given).
        expert_tensors: :data:`MXFP4_EXPERT_TENSORS`, as in the checkpoint: ``gate_up_proj_blocks
            [E, 2I, H/32, 16]`` and ``_scales [E, 2I, H/32]`` uint8, ``gate_up_proj_bias [E, 2I]``,
            ``down_proj_blocks [E, H, I/32, 16]`` and ``_scales [E, H, I/32]`` uint8,
            ``down_proj_bias [E, H]``; or NVFP4 weights, :data:`NVFP4_GPT_OSS_TENSORS` (``gate_up [E, 2I,
            H/2]`` uint8, ``gate_up_scale [E, 2I, H/16]`` uint8 E4M3 bytes, ``gate_up_global_scale [E]`` float32, ``gate_up_bias
            [E, 2I]``, then ``down``, ``down_scale``, ``down_global_scale``, ``down_bias [E, H]``; any strides); for the
            ``triton`` backend either in its layout
            (:func:`fp4moe_ops.backends.triton_moe.layout.gpt_oss_kernel_tensors`).
        swiglu_alpha, limit: gpt-oss's ``swiglu_alpha`` (1.702) and ``swiglu_limit`` (7.0).
        backend: a concrete backend that runs gpt-oss's experts (:func:`resolve_gpt_oss_backend`).

    Returns:
        ``[T, H]`` in ``hidden_states.dtype``.
    """
    _check_inputs(hidden_states, topk_ids, topk_weights, expert_tensors, swiglu_alpha, limit, backend)
    if hidden_states.shape[0] == 0:
        return torch.empty_like(hidden_states)
    return get_backend(backend).run_gpt_oss(hidden_states, topk_ids, topk_weights, list(expert_tensors), swiglu_alpha,
                                            limit)


@gpt_oss_moe.register_fake
def _(hidden_states, topk_ids, topk_weights, expert_tensors, swiglu_alpha, limit, backend):
    _check_inputs(hidden_states, topk_ids, topk_weights, expert_tensors, swiglu_alpha, limit, backend)
    return torch.empty_like(hidden_states)


__all__ = ["MXFP4_EXPERT_TENSORS", "NVFP4_GPT_OSS_TENSORS", "check_mxfp4_experts", "gpt_oss_moe"]
