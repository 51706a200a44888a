"""The modules that hold llm-compressor's MXFP4 weights (compressed-tensors ``mxfp4-pack-quantized``)
inside an ordinary MoE model (Qwen3-MoE, DeepSeek-V3, ...: SiLU-gated experts, no biases):

* :class:`MXFP4Experts` replaces a Transformers fused-experts module (same call as
  :class:`~hf_integration.experts.NVFP4Experts`) and computes through ``torch.ops.fp4moe.fused_moe``;
* :class:`MXFP4Linear` replaces any other quantized ``nn.Linear`` (attention projections, a dense
  MLP, a shared expert).

Both hold the file's bytes as they are: E2M1 codes two a byte (low nibble = even column) and one
E8M0 scale byte per 32 columns of a row, ``W = e2m1 x 2^(byte - 127)``, no global scale. They stay
in MXFP4 rather than being decoded at load: the decoded values do not determine the scale bytes (a
block whose largest code is below 4 decodes the same with a scale one power of two smaller and the
codes doubled), so only the bytes themselves save back to the same checkpoint.

The op takes MXFP4 experts as NVFP4-shaped tensors whose block scales are the E8M0 bytes as int8,
each written for both 16-value halves of its block, with global scales of 1
(:func:`fp4moe_ops.backends.base.canonical_specs`): the Triton kernels and the reference backend
tell the formats apart by that dtype. :class:`MXFP4Experts` keeps those op scales beside the
checkpoint's (an eighth of the packed bytes more), rebuilt after every load.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fp4moe_ops.backends import resolve_backend
from fp4moe_ops.mxfp4 import MX_BLOCK_SIZE, dequantize_mxfp4
from fp4moe_ops.op import _HIDDEN_DTYPES
from fp4moe_ops.prepared import QuantizedBuffers, TensorSpec

from .experts import linear_state

SAVE_REFUSAL = ("MXFP4 weights cannot be written as a ModelOpt NVFP4 checkpoint; a model loaded from an "
                "llm-compressor MXFP4 checkpoint saves back to that format")


class MXFP4Experts(QuantizedBuffers):
    """A layer's routed experts in MXFP4: ``(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])
    -> [T, H]``, 16-bit activations. State dict (the checkpoint's bytes, stacked over experts, gate's
    rows then up's)::

        gate_up_proj_packed [E, 2I, H/2] uint8    gate_up_proj_scale [E, 2I, H/32] uint8 (E8M0)
        down_proj_packed    [E, H, I/2]  uint8    down_proj_scale    [E, H, I/32]  uint8 (E8M0)
    """

    COMPUTE_DTYPES = _HIDDEN_DTYPES
    takes_backend = True
    PROJECTIONS = ("gate_up_proj", "down_proj")

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        for spec in self.tensor_specs():
            self.register_buffer(spec.name, torch.empty(spec.shape, dtype=spec.dtype))
        self.backend: str | None = None
        self.register_load_state_dict_post_hook(_rebuild_op_scales)

    def tensor_specs(self) -> list[TensorSpec]:
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        specs = []
        for proj, n, k in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
            specs += [TensorSpec(f"{proj}_packed", torch.uint8, (e, n, k // 2), "packed"),
                      TensorSpec(f"{proj}_scale", torch.uint8, (e, n, k // MX_BLOCK_SIZE), "block_scale")]
        return specs

    def _build_op_scales(self) -> None:
        for proj in self.PROJECTIONS:
            scale = self._buffers[f"{proj}_scale"]
            self.register_buffer(f"{proj}_op_scale", scale.repeat_interleave(2, dim=-1).view(torch.int8),
                                 persistent=False)
        self.register_buffer("op_global_scale", torch.ones(self.num_experts, device=scale.device), persistent=False)

    def check_backend(self, backend: str = "auto", act_scale_mode: str | None = None):
        """The backend object :meth:`set_backend` would use; ValueError (the module unchanged) for one
        whose kernels do not read E8M0 scales, an activation mode (MXFP4 exports hold no calibrated
        scales: their activations stay 16-bit here), or on Triton a scale byte its kernels cannot
        decode exactly (above 2^23)."""
        if act_scale_mode is not None:
            raise ValueError(f"act_scale_mode={act_scale_mode!r}: MXFP4 experts run with 16-bit activations only")
        b = resolve_backend(backend, self._buffers["gate_up_proj_scale"].device)
        if not b.reads_e8m0_scales:
            raise ValueError(f"backend {b.name!r} runs NVFP4 experts only, not MXFP4's E8M0 block scales")
        if b.name == "triton":
            from fp4moe_ops.backends.triton_moe.layout import GPT_OSS_MAX_SCALE_BYTE

            for proj in self.PROJECTIONS:
                top = int(self._buffers[f"{proj}_scale"].max())
                if top > GPT_OSS_MAX_SCALE_BYTE:
                    raise ValueError(f"{proj}_scale holds E8M0 byte {top} (2^{top - 127}): the Triton kernels decode "
                                     f"scales up to 2^{GPT_OSS_MAX_SCALE_BYTE - 127}; the reference backend runs these "
                                     "experts")
        return b

    def set_backend(self, backend: str = "auto", act_scale_mode: str | None = None) -> str:
        """Run on ``backend`` (``"auto"``: Triton where it runs, else the reference); checked first."""
        self.backend = self.check_backend(backend, act_scale_mode).name
        self._build_op_scales()
        return self.backend

    def op_tensors(self) -> list[torch.Tensor]:
        b = self._buffers
        return [b["gate_up_proj_packed"].contiguous(), b["gate_up_proj_op_scale"], b["op_global_scale"],
                b["down_proj_packed"].contiguous(), b["down_proj_op_scale"], b["op_global_scale"]]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        if self.backend is None:
            raise RuntimeError("these experts are not prepared for a backend yet: call set_backend(...)")
        return torch.ops.fp4moe.fused_moe(hidden_states, top_k_index, top_k_weights.float(), self.op_tensors(), None,
                                          None, self.backend, 0)

    def dequantized_state(self, dtype: torch.dtype, config=None) -> dict[str, torch.Tensor]:
        """Transformers' fused experts tensors ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``."""
        b = self._buffers
        return {proj: dequantize_mxfp4(b[f"{proj}_packed"], b[f"{proj}_scale"], dtype) for proj in self.PROJECTIONS}

    def save_refusal(self) -> str | None:
        return SAVE_REFUSAL

    def checkpoint_tensors(self, name: str, leaves) -> dict[str, torch.Tensor]:
        """The file's per-expert tensors ``<name>.<e>.<leaf>.weight_packed`` / ``weight_scale``
        (``leaves``: the checkpoint's names of gate, up and down)."""
        b, inter = self._buffers, self.intermediate_size
        out = {}
        for e in range(self.num_experts):
            for leaf, proj, rows in ((leaves.gate, "gate_up_proj", slice(0, inter)),
                                     (leaves.up, "gate_up_proj", slice(inter, 2 * inter)),
                                     (leaves.down, "down_proj", slice(None))):
                out[f"{name}.{e}.{leaf}.weight_packed"] = b[f"{proj}_packed"][e, rows]
                out[f"{name}.{e}.{leaf}.weight_scale"] = b[f"{proj}_scale"][e, rows]
        return out

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}, "
                f"weights=MXFP4, activations=16-bit, backend={self.backend!r}")


def _rebuild_op_scales(module: MXFP4Experts, incompatible_keys) -> None:
    """The op's scales are derived from the checkpoint's: rebuilt after a load (once prepared)."""
    if module.backend is not None:
        module._build_op_scales()


class MXFP4Linear(QuantizedBuffers):
    """A checkpoint's MXFP4 linear ``y = x W^T (+ b)``, held as the file's ``weight_packed [N, K/2]``
    uint8 and ``weight_scale [N, K/32]`` uint8 (E8M0). Each call decodes the weight into the
    activations' dtype (exact: an E2M1 value times a power of two, in range by the load's checks)
    and runs ``F.linear``, so it computes what the 16-bit model of the decoded weights computes."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        for spec in self.tensor_specs()[:2]:
            self.register_buffer(spec.name, torch.empty(spec.shape, dtype=spec.dtype))

    def tensor_specs(self) -> list[TensorSpec]:
        n, k = self.out_features, self.in_features
        specs = [TensorSpec("weight_packed", torch.uint8, (n, k // 2), "packed"),
                 TensorSpec("weight_scale", torch.uint8, (n, k // MX_BLOCK_SIZE), "block_scale")]
        return specs + ([] if self.bias is None else [TensorSpec("bias", self.bias.dtype, (n,), "bias")])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, dequantize_mxfp4(self.weight_packed, self.weight_scale, x.dtype), self.bias)

    def dequantized_state(self, dtype: torch.dtype, config=None) -> dict[str, torch.Tensor]:
        return linear_state(dequantize_mxfp4(self.weight_packed, self.weight_scale, dtype), self.bias, dtype)

    def save_refusal(self) -> str | None:
        return SAVE_REFUSAL

    def checkpoint_tensors(self, name: str, leaves=None) -> dict[str, torch.Tensor]:
        return {f"{name}.{key}": t for key, t in self.state_dict().items()}

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weights=MXFP4"


__all__ = ["MXFP4Experts", "MXFP4Linear"]
