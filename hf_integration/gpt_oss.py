"""gpt-oss's routed experts kept in MXFP4 inside a Transformers model: :class:`MXFP4GptOssExperts`.

It takes the place of Transformers' ``GptOssExperts`` (same call: ``(hidden [T, H], router_indices
[T, k], routing_weights [T, k])``, Transformers' own ``GptOssTopKRouter`` in front) and holds the
checkpoint's tensors under the checkpoint's names and in its bytes (``gate_up_proj_blocks``,
``gate_up_proj_scales``, ``gate_up_proj_bias``, ``down_proj_blocks``, ``down_proj_scales``,
``down_proj_bias``: :mod:`fp4moe_ops.mxfp4`), so loading copies the file's bytes straight in and
``save_pretrained`` writes them back unchanged. Its forward is one ``fp4moe::gpt_oss_moe`` call.
The blocks and scales are uint8 buffers (never cast by ``model.to(dtype)``); the biases are frozen
parameters in the model's dtype, as Transformers holds them.

On the Triton backend (Hopper) the blocks and scales are held once, in the kernels' layout
(:func:`fp4moe_ops.backends.triton_moe.layout.gpt_oss_kernel_tensors`: the same codes and E8M0
bytes, H and I padded to multiples of 256), as non-persistent buffers; the state dict still holds the
checkpoint's tensors, converted back exactly, and ``load_state_dict`` goes through them.
"""

from __future__ import annotations

import torch
from torch import nn

from fp4moe_ops.backends import resolve_gpt_oss_backend
from fp4moe_ops.mxfp4 import dequantize_gpt_oss, gpt_oss_shapes
from fp4moe_ops.gpt_oss_op import MXFP4_EXPERT_TENSORS, check_mxfp4_experts

_QUANTIZED = ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales")
_KERNEL_BUFFERS = ("kernel_w13", "kernel_s13", "kernel_b1", "kernel_w2", "kernel_s2", "kernel_b2")


class MXFP4GptOssExperts(nn.Module):
    """One gpt-oss layer's experts in MXFP4, run by ``fp4moe::gpt_oss_moe`` on ``backend``."""

    def __init__(self, config, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.num_experts = config.num_local_experts
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size
        self.alpha = float(config.swiglu_alpha)
        self.limit = float(config.swiglu_limit)
        self.backend = "reference"
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        for proj, rows, cols in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
            blocks, scales = gpt_oss_shapes(rows, cols, e)
            self.register_buffer(f"{proj}_blocks", torch.zeros(blocks, dtype=torch.uint8))
            self.register_buffer(f"{proj}_scales", torch.zeros(scales, dtype=torch.uint8))
            self.register_parameter(f"{proj}_bias", nn.Parameter(torch.zeros(e, rows, dtype=dtype), requires_grad=False))
        check_mxfp4_experts(self.checkpoint_tensors(), h)  # dimensions that are no multiple of 32 fail here
        self._register_state_dict_hook(_checkpoint_state_dict)
        self._register_load_state_dict_pre_hook(_load_through_checkpoint_layout, with_module=True)
        self.register_load_state_dict_post_hook(_back_to_kernel_layout)

    @property
    def kernel_layout(self) -> bool:
        """Whether the blocks and scales are held in the Triton kernels' layout."""
        return self._buffers.get("kernel_w13") is not None

    def checkpoint_tensors(self) -> list[torch.Tensor]:
        """The six tensors of :data:`MXFP4_EXPERT_TENSORS`, as the checkpoint holds them."""
        if self.kernel_layout:
            from fp4moe_ops.backends.triton_moe.layout import gpt_oss_checkpoint_tensors

            tensors = gpt_oss_checkpoint_tensors(self.expert_tensors(), self.hidden_size, self.intermediate_size,
                                                 self.gate_up_proj_bias.dtype)
            tensors[2], tensors[5] = self.gate_up_proj_bias, self.down_proj_bias  # (the held ones, exactly)
            return tensors
        return [getattr(self, name) for name in MXFP4_EXPERT_TENSORS]

    def expert_tensors(self) -> list[torch.Tensor]:
        """What the op runs: the kernels' layout on Triton, else the checkpoint's tensors."""
        if self.kernel_layout:
            return [self._buffers[name] for name in _KERNEL_BUFFERS]
        return [getattr(self, name) for name in MXFP4_EXPERT_TENSORS]

    def set_backend(self, backend: str = "auto") -> str:
        """Resolve ``backend`` for the device the experts are on (``auto``: the fastest that runs
        MXFP4 experts there, with a warning naming any faster one that does not) and hold the
        tensors in its layout; returns its name. Nothing changes when it raises."""
        device = (self.kernel_w13 if self.kernel_layout else self.gate_up_proj_blocks).device
        name = resolve_gpt_oss_backend(backend, device).name
        if name == "triton" and not self.kernel_layout:
            self._to_kernel_layout()
        elif name != "triton" and self.kernel_layout:
            self._to_checkpoint_layout()
        self.backend = name
        return self.backend

    @torch.no_grad()
    def _to_kernel_layout(self) -> None:
        from fp4moe_ops.backends.triton_moe.layout import gpt_oss_kernel_tensors

        kernel = gpt_oss_kernel_tensors(self.checkpoint_tensors())  # (raises, naming the tensor, before any change)
        for name in _QUANTIZED:
            self._buffers[name] = None  # held once: the kernels' copy
        for name, t in zip(_KERNEL_BUFFERS, kernel):
            self.register_buffer(name, t, persistent=False)

    def _apply(self, fn, recurse=True):
        """Moves and casts: the kernels' float32 biases follow the bias parameters (as cast), the
        blocks and scales stay bytes."""
        super()._apply(fn, recurse)
        if self.kernel_layout:
            from fp4moe_ops.backends.triton_moe.layout import gpt_oss_kernel_biases

            with torch.no_grad():
                self.kernel_b1, self.kernel_b2 = gpt_oss_kernel_biases(
                    self.gate_up_proj_bias.to(self.kernel_b1.device), self.down_proj_bias.to(self.kernel_b2.device),
                    self.kernel_s13.shape[1] // 2, self.kernel_s2.shape[1])
        return self

    @torch.no_grad()
    def _to_checkpoint_layout(self) -> None:
        tensors = self.checkpoint_tensors()
        for name, t in zip(MXFP4_EXPERT_TENSORS, tensors):
            if name in _QUANTIZED:
                self._buffers[name] = t
        for name in _KERNEL_BUFFERS:
            del self._buffers[name]

    def forward(self, hidden_states: torch.Tensor, router_indices: torch.Tensor,
                routing_weights: torch.Tensor) -> torch.Tensor:
        return torch.ops.fp4moe.gpt_oss_moe(hidden_states, router_indices, routing_weights.float(), self.expert_tensors(),
                                          self.alpha, self.limit, self.backend)

    @torch.no_grad()
    def dequantized(self, config, dtype: torch.dtype) -> nn.Module:
        """Transformers' ``GptOssExperts`` holding these experts decoded to ``dtype`` (its ``[E, K, N]``
        layout: the transposes of the checkpoint's matrices), on the same device."""
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

        with torch.device(self.gate_up_proj_blocks.device):
            bf16 = GptOssExperts(config).to(dtype)
        tensors = dict(zip(MXFP4_EXPERT_TENSORS, self.checkpoint_tensors()))
        for proj in ("gate_up_proj", "down_proj"):
            decoded = dequantize_gpt_oss(tensors[f"{proj}_blocks"], tensors[f"{proj}_scales"], dtype)
            getattr(bf16, proj).copy_(decoded.transpose(1, 2))
            getattr(bf16, f"{proj}_bias").copy_(getattr(self, f"{proj}_bias"))
        return bf16

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}, "
                f"MXFP4, backend={self.backend!r}")


def _checkpoint_state_dict(module: MXFP4GptOssExperts, state_dict, prefix, local_metadata):
    """The state dict holds the checkpoint's blocks and scales whatever layout runs."""
    if module.kernel_layout:
        for name, t in zip(MXFP4_EXPERT_TENSORS, module.checkpoint_tensors()):
            if name in _QUANTIZED:
                state_dict[prefix + name] = t
    return state_dict


def _load_through_checkpoint_layout(module: MXFP4GptOssExperts, state_dict, prefix, *args):
    """A load into the kernels' layout goes through the checkpoint's (back after the load)."""
    if module.kernel_layout:
        module._to_checkpoint_layout()


def _back_to_kernel_layout(module: MXFP4GptOssExperts, incompatible_keys) -> None:
    if module.backend == "triton" and not module.kernel_layout:
        module._to_kernel_layout()


def is_gpt_oss_experts(module: nn.Module) -> bool:
    """Transformers' BF16 ``GptOssExperts`` (by class name: no import of the model's module needed)."""
    return type(module).__name__ == "GptOssExperts"


__all__ = ["MXFP4GptOssExperts", "is_gpt_oss_experts"]
