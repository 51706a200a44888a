"""Backward of fp4moe's ops, for training adapters (LoRA) on a model whose NVFP4 weights stay
frozen: gradients flow to the ops' activations and routing weights, never to the quantized tensors.

* ``fp4moe::fused_moe``: ``d hidden_states`` and ``d topk_weights`` through a second op,
  ``fp4moe::fused_moe_backward``, opaque to Dynamo like the forward. It recomputes each expert's
  GEMMs for the tokens routed to it (as :mod:`fp4moe_ops.moe_math` does for the forward), in
  float32 on weights decoded one expert at a time, so a NaN in one expert reaches only the
  gradients of its own tokens. It is the derivative of the forward's math without the forward's
  roundings (the 16-bit intermediate, NVFP4 activations under activation scales: straight
  through). Eager torch with one host sync per call, on any device: a correctness path, as the
  reference backend is, not a kernel.
* ``fp4moe::nvfp4_linear``: ``d x = d y . W`` with W decoded to the gradient's dtype as the
  reference backend decodes it, through ``fp4moe::nvfp4_linear_grad_input`` (``d bias`` summed).
* ``fp4moe::grouped_topk``: ``d router_logits`` of the chosen experts' sigmoid scores
  (renormalized and scaled as the forward); the ids and the correction bias get none (they only
  choose).
* ``fp4moe::softmax_topk``: ``d router_logits`` through the softmax over all experts (every logit
  moves the chosen probabilities) and the renormalization.

Which backends: the canonical tensors and the Triton backend's paired layout (converted expert by
expert). FlashInfer's own tensors (MXFP4 re-quantized, dequantized BF16) are refused, naming the
backend to use instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .backends.base import CANONICAL, convert_packed, get_backend
from .linear import as_matrix, decoded_weight, nvfp4_linear
from .moe_math import expert_groups, expert_scale
from .nvfp4 import dequantize_nvfp4, quantize_activation_nvfp4
from .op import _check_inputs, fused_moe
from .routing import grouped_topk, softmax_topk

# the Triton backend's packed weights are int32 words where they are paired (backends/triton_moe/layout.py)
_PAIRED = "paired"


def _packed_expert(packed: torch.Tensor, e: int) -> torch.Tensor:
    """Expert ``e``'s canonical ``[N, K/2]`` uint8 bytes from a packed tensor in either layout."""
    if packed.dtype == torch.uint8:
        return packed[e]
    return convert_packed(packed[e:e + 1], _PAIRED, CANONICAL)[0]


def _refuse_own_tensors(backend: str) -> None:
    if get_backend(backend).tensors != "canonical":
        raise NotImplementedError(
            f"fp4moe: no backward through backend {backend!r}, whose tensors are its own copy of the weights; "
            "train with backend 'triton' (CUDA) or 'reference' (model: hf_integration.set_backend)")


@torch.library.custom_op("fp4moe::fused_moe_backward", mutates_args=())
def fused_moe_backward(grad_out: torch.Tensor, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                       topk_weights: torch.Tensor, expert_tensors: list[torch.Tensor],
                       gate_up_input_scale: torch.Tensor | None, down_input_scale: torch.Tensor | None,
                       backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d hidden_states [T, H] in its dtype, d topk_weights [T, k] float32)`` of
    :func:`fp4moe_ops.op.fused_moe` for ``grad_out [T, H]`` (see the module docstring)."""
    _check_inputs(hidden_states, topk_ids, topk_weights, expert_tensors, gate_up_input_scale, down_input_scale,
                  backend)
    _refuse_own_tensors(backend)
    gate_up, gate_up_scale, gate_up_global_scale, down, down_scale, down_global_scale = expert_tensors
    if gate_up_scale.dtype == torch.int8:  # (decoded below as E4M3, they would give wrong gradients)
        raise NotImplementedError("fp4moe: no backward through MXFP4 experts (E8M0 block scales) yet")
    gate_up_scale, down_scale = gate_up_scale.view(torch.float8_e4m3fn), down_scale.view(torch.float8_e4m3fn)
    num_experts, k = gate_up_global_scale.shape[0], topk_ids.shape[1]
    grad_x = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
    grad_w = torch.zeros(topk_weights.shape, dtype=torch.float32, device=hidden_states.device)
    for e, routed in expert_groups(topk_ids, num_experts):
        token = routed // k
        x = hidden_states[token].float()
        gate_up_in, down_in = expert_scale(gate_up_input_scale, e), expert_scale(down_input_scale, e)
        if gate_up_in is not None:  # the values the forward multiplied; the gradient passes straight through
            x = quantize_activation_nvfp4(x, 1.0 / gate_up_in) * gate_up_in
        gate_up_w = dequantize_nvfp4(_packed_expert(gate_up, e), gate_up_scale[e], gate_up_global_scale[e])  # [2I, H]
        gate, up = (x @ gate_up_w.T).chunk(2, dim=-1)
        act = F.silu(gate) * up
        down_x = act if down_in is None else quantize_activation_nvfp4(act, 1.0 / down_in) * down_in
        down_w = dequantize_nvfp4(_packed_expert(down, e), down_scale[e], down_global_scale[e])  # [H, I] float32
        g = grad_out[token].float()
        grad_w.view(-1)[routed] = (g * (down_x @ down_w.T)).sum(-1)
        d_act = (g * topk_weights.reshape(-1)[routed, None]) @ down_w
        sig = torch.sigmoid(gate)
        d_gate = d_act * up * sig * (1 + gate * (1 - sig))
        d_up = d_act * gate * sig
        grad_x.index_add_(0, token, torch.cat([d_gate, d_up], dim=-1) @ gate_up_w)
    return grad_x.to(hidden_states.dtype), grad_w


@fused_moe_backward.register_fake
def _(grad_out, hidden_states, topk_ids, topk_weights, expert_tensors, gate_up_input_scale, down_input_scale, backend):
    _check_inputs(hidden_states, topk_ids, topk_weights, expert_tensors, gate_up_input_scale, down_input_scale,
                  backend)
    return torch.empty_like(hidden_states), torch.empty_like(topk_weights)


def _moe_setup(ctx, inputs, output):
    hidden_states, topk_ids, topk_weights, expert_tensors, gate_up_input_scale, down_input_scale, backend, _ = inputs
    ctx.save_for_backward(hidden_states, topk_ids, topk_weights, gate_up_input_scale, down_input_scale, *expert_tensors)
    ctx.backend = backend


def _moe_backward(ctx, grad_out):
    hidden_states, topk_ids, topk_weights, gate_up_input_scale, down_input_scale, *expert_tensors = ctx.saved_tensors
    grad_x, grad_w = torch.ops.fp4moe.fused_moe_backward(grad_out.contiguous(), hidden_states, topk_ids, topk_weights,
                                                         expert_tensors, gate_up_input_scale, down_input_scale,
                                                         ctx.backend)
    grads = (grad_x, None, grad_w, [None] * len(expert_tensors), None, None, None, None)
    return grads[:len(ctx.needs_input_grad)]  # one per argument the caller passed (a default left out: none)


@torch.library.custom_op("fp4moe::nvfp4_linear_grad_input", mutates_args=())
def nvfp4_linear_grad_input(grad_y: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                            global_scale: torch.Tensor) -> torch.Tensor:
    """``d x [..., K] = d y [..., N] . W`` with W decoded to d y's dtype, as the reference
    forward decodes it (an op of its own, so that a compiled backward does not trace the decode)."""
    grad_x = as_matrix(grad_y) @ decoded_weight(weight, weight_scale, global_scale, grad_y.dtype)
    return grad_x.reshape(*grad_y.shape[:-1], grad_x.shape[-1])


@nvfp4_linear_grad_input.register_fake
def _(grad_y, weight, weight_scale, global_scale):
    return grad_y.new_empty(*grad_y.shape[:-1], weight_scale.shape[1] * 16)  # (either weight layout)


def _linear_setup(ctx, inputs, output):
    x, weight, weight_scale, global_scale, bias, _, _ = inputs
    ctx.save_for_backward(weight, weight_scale, global_scale)
    ctx.bias_shape = None if bias is None else bias.shape


def _linear_backward(ctx, grad_y):
    weight, weight_scale, global_scale = ctx.saved_tensors
    grad_x = torch.ops.fp4moe.nvfp4_linear_grad_input(grad_y, weight, weight_scale, global_scale)
    grad_bias = None if ctx.bias_shape is None else grad_y.reshape(-1, grad_y.shape[-1]).sum(0)
    return (grad_x, None, None, None, grad_bias, None, None)[:len(ctx.needs_input_grad)]


def _topk_setup(ctx, inputs, output):
    router_logits, _, _, _, _, renormalize, scaling_factor = inputs
    _, ids = output
    ctx.save_for_backward(router_logits, ids)
    ctx.renormalize, ctx.scaling_factor = renormalize, scaling_factor


def _topk_backward(ctx, grad_weights, grad_ids):
    router_logits, ids = ctx.saved_tensors
    with torch.enable_grad():  # the forward's weight formula on the chosen logits, differentiated by torch
        chosen = router_logits.gather(1, ids).detach().requires_grad_()
        weights = chosen.sigmoid()
        if ctx.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        (grad_chosen,) = torch.autograd.grad(weights * ctx.scaling_factor, chosen, grad_weights)
    grad_logits = torch.zeros_like(router_logits).scatter_add_(1, ids, grad_chosen)
    return (grad_logits, None, None, None, None, None, None)[:len(ctx.needs_input_grad)]


def _softmax_topk_setup(ctx, inputs, output):
    router_logits, _, renormalize = inputs
    ctx.save_for_backward(router_logits, output[1])
    ctx.renormalize = renormalize


def _softmax_topk_backward(ctx, grad_weights, grad_ids):
    router_logits, ids = ctx.saved_tensors
    with torch.enable_grad():  # the forward's weight formula, differentiated by torch
        logits = router_logits.detach().requires_grad_()
        weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, ids)
        if ctx.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        (grad_logits,) = torch.autograd.grad(weights, logits, grad_weights)
    return grad_logits, None, None


fused_moe.register_autograd(_moe_backward, setup_context=_moe_setup)
nvfp4_linear.register_autograd(_linear_backward, setup_context=_linear_setup)
grouped_topk.register_autograd(_topk_backward, setup_context=_topk_setup)
softmax_topk.register_autograd(_softmax_topk_backward, setup_context=_softmax_topk_setup)

__all__ = ["fused_moe_backward", "nvfp4_linear_grad_input"]
