"""``torch.ops.fp4moe.fused_moe``: the one graph node every backend sits behind.

Dynamo traces the op as a single opaque node (its fake function gives the output shape), so
``torch.compile(fullgraph=True)`` never graph-breaks on it and never traces into a kernel
library's Python. Its tensors are prepared once (:class:`fp4moe_ops.prepared.PreparedExperts`);
the op itself only validates metadata (no host syncs) and dispatches.
"""

from __future__ import annotations

import torch

from .backends import get_backend

_HIDDEN_DTYPES = (torch.bfloat16, torch.float16)


def _check_inputs(hidden_states, topk_ids, topk_weights, expert_tensors, gate_up_input_scale, down_input_scale,
                  backend, routed_experts=0):
    """Metadata checks shared by the real and the fake implementation."""
    b = get_backend(backend)
    if routed_experts < 0:
        raise ValueError(f"routed_experts must be >= 0 (0: all experts are local), got {routed_experts}")
    if hidden_states.dim() != 2 or hidden_states.dtype not in _HIDDEN_DTYPES:
        # a float32 model reaches here when something took the model.to guard away (accelerate's
        # remove_hook_from_module pops instance attributes named "to")
        hint = ("; a model with NVFP4 experts runs in bfloat16 or float16: cast it back with "
                "model.to(torch.bfloat16)") if hidden_states.is_floating_point() and hidden_states.dtype not in _HIDDEN_DTYPES \
            else ""
        raise TypeError(
            f"hidden_states must be [T, H] bfloat16/float16, got {hidden_states.dtype} "
            f"{list(hidden_states.shape)}{hint}"
        )
    scales = [(n, s) for n, s in (("gate_up_input_scale", gate_up_input_scale), ("down_input_scale", down_input_scale))
              if s is not None]
    check_routing(hidden_states, topk_ids, topk_weights, expert_tensors, scales, backend)
    num_experts = b.check_expert_tensors(expert_tensors, hidden_states.shape[1])
    scales = [s for _, s in scales]
    if b.activation_scales == "forbidden" and scales:
        raise ValueError(
            f"backend {backend!r} keeps activations in 16 bits (W4A16) and would ignore the "
            "activation scales; pass none, or use backend 'flashinfer_nvfp4' / 'reference'"
        )
    if b.activation_scales == "required" and len(scales) != 2:
        raise ValueError(f"backend {backend!r} needs both gate_up_input_scale and down_input_scale")
    for s in scales:
        # a [1]-shaped scale is refused too: FlashInfer reads every 1-D scale as per-expert [E]
        if s.dtype != torch.float32 or not (s.dim() == 0 or tuple(s.shape) == (num_experts,)):
            raise ValueError(
                f"activation scales must be float32 0-dim scalars or [E={num_experts}], got "
                f"{s.dtype} {list(s.shape)}"
            )


def _check_device(hidden_states, backend) -> None:
    """That ``backend``'s kernels run on hidden_states' device: the forward's real and fake
    functions, after the metadata checks (the backward, ``fused_moe_backward``, computes in torch
    on any device and checks only the metadata). Off CUDA the refusal is a cheap test of the device
    type (the Triton and FlashInfer backends need a GPU); on a GPU prepare_experts has checked the
    backend against the device, and asking every call would query its capability on the hot path.
    Meta tensors (shape inference) run nothing."""
    device = hidden_states.device
    if device.type not in ("cuda", "meta"):
        reason = get_backend(backend).unavailable_reason(device)
        if reason is not None:
            raise ValueError(f"fp4moe backend {backend!r} cannot run on {device} (hidden_states is on {device}): "
                             f"{reason}; prepare_experts(weights, 'auto') picks a backend this device runs")


def check_routing(hidden_states, topk_ids, topk_weights, expert_tensors, others=(), backend: str = "") -> None:
    """The routing inputs of an experts op against ``hidden_states [T, H]``: ``topk_ids [T, k]``
    int32/int64, ``topk_weights`` float32 of the same shape, and every tensor (``expert_tensors``,
    ``others`` as ``(name, tensor)``) on hidden_states' device (the error names ``backend``, the
    call's). Metadata only: no host sync."""
    t = hidden_states.shape[0]
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be [T, k] int32/int64, got {topk_ids.dtype} {list(topk_ids.shape)}")
    if topk_ids.shape[0] != t:
        raise ValueError(f"topk_ids {list(topk_ids.shape)} must have T={t} rows like hidden_states")
    if topk_weights.dtype != torch.float32 or topk_weights.shape != topk_ids.shape:
        raise TypeError(
            f"topk_weights must be float32 {list(topk_ids.shape)} like topk_ids, got "
            f"{topk_weights.dtype} {list(topk_weights.shape)}"
        )
    device = hidden_states.device
    for i, x in enumerate((topk_ids, topk_weights, *expert_tensors, *(t for _, t in others))):
        if x.device != device:  # (the names made only here: this loop runs on every call)
            names = ["topk_ids", "topk_weights", *(f"expert_tensors[{j}]" for j in range(len(expert_tensors))),
                     *(name for name, _ in others)]
            raise ValueError(f"{names[i]} is on {x.device} but hidden_states is on {device} (fp4moe backend {backend!r})")


@torch.library.custom_op("fp4moe::fused_moe", mutates_args=())
def fused_moe(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    expert_tensors: list[torch.Tensor],
    gate_up_input_scale: torch.Tensor | None,
    down_input_scale: torch.Tensor | None,
    backend: str,
    routed_experts: int = 0,
) -> torch.Tensor:
    """Fused NVFP4 MoE experts: ``out[t] = sum_j w[t,j] * expert_{ids[t,j]}(x[t])``.

    Args:
        hidden_states: ``[T, H]`` bfloat16/float16.
        topk_ids: ``[T, k]`` int32/int64; ids outside ``[0, E)`` contribute nothing.
        topk_weights: ``[T, k]`` float32 routing weights (applied as given).
        expert_tensors: the backend's prepared tensors (:func:`prepare_experts`).
        gate_up_input_scale, down_input_scale: the input scales ``amax / (6*448)`` of the gate_up and
            the down GEMM's activations, float32 scalars or ``[E]``, for NVFP4 x NVFP4; None for
            W4A16 backends.
        backend: a concrete backend name (``"auto"`` is resolved in :func:`prepare_experts`).
        routed_experts: how many experts the router chooses among, when this call holds only a
            shard of them (expert parallelism: ``E * world_size``); 0 means all ``E`` are here.
            A performance hint only (the Triton backend sizes its tiles by the expected rows
            per expert, slots over this count); results do not depend on it. A shared expert
            run as one more expert on every token passes the count that gives the routed
            experts' rows (``hf_integration.shared_experts.routed_rows_hint``).

    Returns:
        ``[T, H]`` in ``hidden_states.dtype``.
    """
    _check_inputs(hidden_states, topk_ids, topk_weights, expert_tensors, gate_up_input_scale, down_input_scale, backend,
                  routed_experts)
    _check_device(hidden_states, backend)
    if hidden_states.shape[0] == 0:
        return torch.empty_like(hidden_states)
    return get_backend(backend).run(
        hidden_states, topk_ids, topk_weights, list(expert_tensors), gate_up_input_scale, down_input_scale,
        routed_experts=routed_experts,
    )


@fused_moe.register_fake
def _(hidden_states, topk_ids, topk_weights, expert_tensors, gate_up_input_scale, down_input_scale, backend,
      routed_experts=0):
    _check_inputs(hidden_states, topk_ids, topk_weights, expert_tensors, gate_up_input_scale, down_input_scale, backend,
                  routed_experts)
    _check_device(hidden_states, backend)
    return torch.empty_like(hidden_states)
