"""``torch.ops.fp4moe.fused_moe``: the one graph node every backend sits behind.

Dynamo traces the op as a single opaque node (its fake function gives the output shape), so
``torch.compile(fullgraph=True)`` never graph-breaks on it and never traces into a kernel
library's Python. Prepared tensors are made once by :func:`prepare_experts`; the op itself
only validates metadata (no host syncs) and dispatches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .backends import get_backend, resolve_backend
from .moe_weights import NVFP4MoEWeights

_HIDDEN_DTYPES = (torch.bfloat16, torch.float16)


def _check_inputs(hidden_states, topk_ids, topk_weights, expert_tensors, fc1_act_scale, fc2_act_scale, backend,
                  routed_experts=0):
    """Metadata checks shared by the real and the fake implementation."""
    b = get_backend(backend)
    if routed_experts < 0:
        raise ValueError(f"routed_experts must be >= 0 (0: all experts are local), got {routed_experts}")
    if hidden_states.dim() != 2 or hidden_states.dtype not in _HIDDEN_DTYPES:
        raise TypeError(
            f"hidden_states must be [T, H] bfloat16/float16, got {hidden_states.dtype} "
            f"{list(hidden_states.shape)}"
        )
    t, h = hidden_states.shape
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
    named = [("topk_ids", topk_ids), ("topk_weights", topk_weights)]
    named += [(f"expert_tensors[{i}]", x) for i, x in enumerate(expert_tensors)]
    named += [(n, s) for n, s in (("fc1_act_scale", fc1_act_scale), ("fc2_act_scale", fc2_act_scale)) if s is not None]
    for name, x in named:
        if x.device != device:
            raise ValueError(f"{name} is on {x.device} but hidden_states is on {device}")
    num_experts = b.check_expert_tensors(expert_tensors, h)
    scales = [s for s in (fc1_act_scale, fc2_act_scale) if s is not None]
    if b.activation_scales == "forbidden" and scales:
        raise ValueError(
            f"backend {backend!r} keeps activations in 16 bits (W4A16) and would ignore the "
            "activation scales; pass none, or use backend 'flashinfer_nvfp4' / 'reference'"
        )
    if b.activation_scales == "required" and len(scales) != 2:
        raise ValueError(f"backend {backend!r} needs both fc1_act_scale and fc2_act_scale")
    for s in scales:
        if s.dtype != torch.float32 or s.numel() not in (1, num_experts) or s.dim() > 1:
            raise ValueError(
                f"activation scales must be float32 scalars or [E={num_experts}], got "
                f"{s.dtype} {list(s.shape)}"
            )


@torch.library.custom_op("fp4moe::fused_moe", mutates_args=())
def fused_moe(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    expert_tensors: list[torch.Tensor],
    fc1_act_scale: torch.Tensor | None,
    fc2_act_scale: torch.Tensor | None,
    backend: str,
    routed_experts: int = 0,
) -> torch.Tensor:
    """Fused NVFP4 MoE experts: ``out[t] = sum_j w[t,j] * expert_{ids[t,j]}(x[t])``.

    Args:
        hidden_states: ``[T, H]`` bfloat16/float16.
        topk_ids: ``[T, k]`` int32/int64; ids outside ``[0, E)`` contribute nothing.
        topk_weights: ``[T, k]`` float32 routing weights (applied as given).
        expert_tensors: the backend's prepared tensors (:func:`prepare_experts`).
        fc1_act_scale, fc2_act_scale: activation global scales ``amax / (6*448)`` as float32
            scalars or ``[E]``, for NVFP4 x NVFP4; None for W4A16 backends.
        backend: a concrete backend name (``"auto"`` is resolved in :func:`prepare_experts`).
        routed_experts: how many experts the router chooses among, when this call holds only a
            shard of them (expert parallelism: ``E * world_size``); 0 means all ``E`` are here.
            A performance hint only (the Triton backend sizes its tiles by the expected rows
            per expert); results do not depend on it.

    Returns:
        ``[T, H]`` in ``hidden_states.dtype``.
    """
    _check_inputs(hidden_states, topk_ids, topk_weights, expert_tensors, fc1_act_scale, fc2_act_scale, backend,
                  routed_experts)
    if hidden_states.shape[0] == 0:
        return torch.empty_like(hidden_states)
    return get_backend(backend).run(
        hidden_states, topk_ids, topk_weights, list(expert_tensors), fc1_act_scale, fc2_act_scale,
        routed_experts=routed_experts,
    )


@fused_moe.register_fake
def _(hidden_states, topk_ids, topk_weights, expert_tensors, fc1_act_scale, fc2_act_scale, backend,
      routed_experts=0):
    _check_inputs(hidden_states, topk_ids, topk_weights, expert_tensors, fc1_act_scale, fc2_act_scale, backend,
                  routed_experts)
    return torch.empty_like(hidden_states)


@dataclass
class PreparedExperts:
    """A backend's prepared tensors for one MoE layer, ready to call.

    Made by :func:`prepare_experts`; call it as ``prepared(hidden [T,H], ids [T,k], w [T,k])``.
    """

    backend: str
    tensors: list[torch.Tensor]
    fc1_act_scale: torch.Tensor | None = None
    fc2_act_scale: torch.Tensor | None = None
    routed_experts: int = 0  # the op's hint: experts routed over when these are a shard; 0 = all

    def __call__(self, hidden_states, topk_ids, topk_weights) -> torch.Tensor:
        return torch.ops.fp4moe.fused_moe(
            hidden_states, topk_ids, topk_weights, self.tensors,
            self.fc1_act_scale, self.fc2_act_scale, self.backend, self.routed_experts,
        )


ACT_SCALE_MODES = ("per_expert", "global_max")


def activation_scales(fc1_input_scale: torch.Tensor | None, fc2_input_scale: torch.Tensor | None,
                      mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's activation scales from calibrated per-expert input scales ``[E]``.

    ``per_expert``: each expert quantizes its inputs with its own scale (the seed change).
    ``global_max``: one scale, the max over experts (vLLM / SGLang / TRT-LLM today); never
    saturates a block scale and keeps all experts on one grid.
    """
    if mode not in ACT_SCALE_MODES:
        raise ValueError(f"act_scale_mode must be one of {ACT_SCALE_MODES}, got {mode!r}")
    if fc1_input_scale is None or fc2_input_scale is None:
        raise ValueError("activation scales need calibrated fc1_input_scale and fc2_input_scale")
    if mode == "per_expert":
        return fc1_input_scale, fc2_input_scale
    return fc1_input_scale.max().reshape(()), fc2_input_scale.max().reshape(())


def prepare_experts(
    weights: NVFP4MoEWeights, backend: str = "auto", act_scale_mode: str | None = None
) -> PreparedExperts:
    """Prepare one layer's NVFP4 experts for ``backend`` on their own device (once, at load).

    Args:
        weights: canonical NVFP4 experts.
        backend: ``"auto"`` picks the fastest exact backend the device runs (see
            :data:`fp4moe_ops.backends.AUTO_ORDER`), or a name from ``BACKENDS``.
        act_scale_mode: None keeps activations in 16 bits (W4A16), except on a backend that
            always quantizes them (``flashinfer_nvfp4``), which then uses ``"per_expert"``.
            ``"per_expert"`` / ``"global_max"``: NVFP4 activations with the calibrated scales
            (``weights.fc1_input_scale`` / ``fc2_input_scale``); backends ``flashinfer_nvfp4``
            and ``reference`` only.
    """
    have_scales = weights.fc1_input_scale is not None and weights.fc2_input_scale is not None
    b = resolve_backend(backend, weights.device, have_activation_scales=have_scales)
    mode = act_scale_mode or ("per_expert" if b.activation_scales == "required" else None)
    if mode is None:
        return PreparedExperts(b.name, b.prepare(weights))
    if b.activation_scales == "forbidden":
        raise ValueError(
            f"backend {b.name!r} keeps activations in 16 bits; act_scale_mode={mode!r} needs "
            "'flashinfer_nvfp4' (Blackwell) or 'reference'")
    if not have_scales:
        raise ValueError(
            f"act_scale_mode={mode!r} needs calibrated activation scales (fc1_input_scale / "
            "fc2_input_scale): run hf_integration.calibrate_activation_scales first")
    fc1, fc2 = activation_scales(weights.fc1_input_scale, weights.fc2_input_scale, mode)
    return PreparedExperts(b.name, b.prepare(weights), fc1, fc2)
