"""gpt-oss's routed experts kept in MXFP4 inside a Transformers model: :class:`MXFP4GptOssExperts`.

It takes the place of Transformers' ``GptOssExperts`` (same call: ``(hidden [T, H], router_indices
[T, k], routing_weights [T, k])``, Transformers' own ``GptOssTopKRouter`` in front) and holds the
checkpoint's tensors under the checkpoint's names and in its bytes (``gate_up_proj_blocks``,
``gate_up_proj_scales``, ``gate_up_proj_bias``, ``down_proj_blocks``, ``down_proj_scales``,
``down_proj_bias``: :mod:`fp4moe_ops.mxfp4`), so loading copies the file's bytes straight in and
``save_pretrained`` writes them back unchanged. Its forward is one ``fp4moe::mxfp4_moe`` call.
The blocks and scales are uint8 buffers (never cast by ``model.to(dtype)``); the biases are frozen
parameters in the model's dtype, as Transformers holds them.
"""

from __future__ import annotations

import torch
from torch import nn

from fp4moe_ops.backends import resolve_mxfp4_backend
from fp4moe_ops.mxfp4 import dequantize_gpt_oss, gpt_oss_shapes
from fp4moe_ops.mxfp4_op import MXFP4_EXPERT_TENSORS, check_mxfp4_experts


class MXFP4GptOssExperts(nn.Module):
    """One gpt-oss layer's experts in MXFP4, run by ``fp4moe::mxfp4_moe`` on ``backend``."""

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
        check_mxfp4_experts(self.expert_tensors(), h)  # dimensions that are no multiple of 32 fail here

    def expert_tensors(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in MXFP4_EXPERT_TENSORS]

    def set_backend(self, backend: str = "auto") -> str:
        """Resolve ``backend`` for the device the experts are on (``auto``: the fastest that runs
        MXFP4 experts there, with a warning naming any faster one that does not); returns its name."""
        self.backend = resolve_mxfp4_backend(backend, self.gate_up_proj_blocks.device).name
        return self.backend

    def forward(self, hidden_states: torch.Tensor, router_indices: torch.Tensor,
                routing_weights: torch.Tensor) -> torch.Tensor:
        return torch.ops.fp4moe.mxfp4_moe(hidden_states, router_indices, routing_weights.float(), self.expert_tensors(),
                                          self.alpha, self.limit, self.backend)

    @torch.no_grad()
    def dequantized(self, config, dtype: torch.dtype) -> nn.Module:
        """Transformers' ``GptOssExperts`` holding these experts decoded to ``dtype`` (its ``[E, K, N]``
        layout: the transposes of the checkpoint's matrices), on the same device."""
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

        with torch.device(self.gate_up_proj_blocks.device):
            bf16 = GptOssExperts(config).to(dtype)
        for proj in ("gate_up_proj", "down_proj"):
            decoded = dequantize_gpt_oss(getattr(self, f"{proj}_blocks"), getattr(self, f"{proj}_scales"), dtype)
            getattr(bf16, proj).copy_(decoded.transpose(1, 2))
            getattr(bf16, f"{proj}_bias").copy_(getattr(self, f"{proj}_bias"))
        return bf16

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}, "
                f"MXFP4, backend={self.backend!r}")


def is_gpt_oss_experts(module: nn.Module) -> bool:
    """Transformers' BF16 ``GptOssExperts`` (by class name: no import of the model's module needed)."""
    return type(module).__name__ == "GptOssExperts"


__all__ = ["MXFP4GptOssExperts", "is_gpt_oss_experts"]
