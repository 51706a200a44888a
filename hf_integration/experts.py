"""The modules that hold NVFP4 weights inside a Transformers model.

* :class:`NVFP4Experts` replaces a Transformers fused-experts module (``DeepseekV3NaiveMoe``,
  ``Qwen3MoeExperts``, ...): the same call ``(hidden [T, H], top_k_index [T, k], top_k_weights
  [T, k]) -> [T, H]``, computed by ``torch.ops.fp4moe.fused_moe`` on NVFP4 weights held as a
  :class:`fp4moe_ops.PreparedExperts` (buffers ``gate_up_proj_packed`` ...). Expert parallelism
  plugs in as a dispatch step around the op (:mod:`hf_integration.expert_parallel`).
* :class:`NVFP4Linear` / :class:`FP8Linear`: a quantized linear outside the routed experts, as a
  checkpoint's tensors. The loader fills them from the file; NVFP4 ones stay (computed by
  ``fp4moe::nvfp4_linear``) unless ``nvfp4_linears="dequantize"``, FP8 ones become ``nn.Linear`` s
  with the dequantized weight; ``patch_moe(..., quantize_dense_mlps=True)`` quantizes dense MLPs'
  and shared experts' linears into them (:meth:`NVFP4Linear.quantize`).
"""

from __future__ import annotations

import torch
from torch import nn

from fp4moe_ops import PreparedExperts, nvfp4
from fp4moe_ops.linear import split_counters
from fp4moe_ops.moe_weights import expert_chunks
from fp4moe_ops.prepared import QuantizedBuffers

from .checkpoint_format import MODELOPT, linear_tensors


class LocalExperts:
    """The default dispatch of :class:`NVFP4Experts`: every expert is here, nothing to exchange."""

    routed_experts = 0

    def prepare(self, top_k_index: torch.Tensor) -> torch.Tensor:
        return top_k_index

    def finalize(self, out: torch.Tensor) -> torch.Tensor:
        return out


LOCAL = LocalExperts()


class NVFP4Experts(PreparedExperts):
    """A layer's routed experts in NVFP4, in place of a Transformers fused-experts module.

    ``dispatch`` prepares the router's ids for this module's experts and finalizes the output
    (:class:`LocalExperts`, or an expert-parallel shard).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.dispatch = LOCAL

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        ids = self.dispatch.prepare(top_k_index)
        out = super().forward(hidden_states, ids, top_k_weights.float())
        return self.dispatch.finalize(out)


class NVFP4Linear(QuantizedBuffers):
    """A checkpoint's NVFP4 linear ``y = x W^T (+ b)``, held as its file tensors, named as the file's
    format names them (:class:`~hf_integration.checkpoint_format.TensorScheme`: ModelOpt's
    ``weight [N, K/2] uint8`` / ``weight_scale [N, K/16] float8_e4m3fn`` / ``weight_scale_2 []`` /
    ``input_scale []``, or compressed-tensors' ``weight_packed`` / ``weight_scale`` /
    ``weight_global_scale [1]`` / ``input_global_scale [1]``, whose per-tensor scales divide).

    The loader keeps it (``ModelOptConfig(nvfp4_linears="dequantize")``: it dequantizes it,
    :meth:`dequantized`); ``patch_moe`` makes ModelOpt ones from a 16-bit ``nn.Linear``
    (:meth:`quantize`). Kept, it computes through
    ``torch.ops.fp4moe.nvfp4_linear`` (:mod:`fp4moe_ops.linear`) and saves as ModelOpt tensors
    (:meth:`modelopt_tensors`). Its buffers keep their dtypes under ``model.to(dtype)``; the bias
    follows. Inference only: the op has no autograd formula and no autocast rule (under autocast
    it needs activations, and a bias, of one 16-bit dtype). One module must not run on two CUDA
    streams at the same time: its split-K counter table (``split_counters``) is shared by its calls."""

    backend = "auto"  # fp4moe::nvfp4_linear: Triton where it runs, else the reference ("flashinfer": set it)

    def __init__(self, linear: nn.Linear, scheme, input_scale: bool, device: torch.device | None = None):
        super().__init__()
        n, k = linear.out_features, linear.in_features
        self.in_features, self.out_features, self.scheme = k, n, scheme
        on = dict(dtype=torch.float32, device=device)
        self.register_buffer(scheme.packed, torch.empty(n, k // 2, dtype=torch.uint8, device=device))
        self.register_buffer(scheme.block_scale, torch.empty(n, k // nvfp4.BLOCK_SIZE, dtype=torch.float8_e4m3fn,
                                                             device=device))
        self.register_buffer(scheme.global_scale, torch.empty(scheme.scalar_shape, **on))
        if input_scale:
            self.register_buffer(scheme.input_scale, torch.empty(scheme.scalar_shape, **on))
        # the Triton GEMV's split-K arrival counters (zero between calls; not part of the checkpoint)
        self.register_buffer("split_counters", split_counters(device), persistent=False)
        self.bias = linear.bias
        self.dtype = linear.weight.dtype

    @classmethod
    def quantize(cls, linear: nn.Linear, global_scale: torch.Tensor | None = None) -> NVFP4Linear:
        """``linear``'s weight quantized with ModelOpt's recipe into ModelOpt's tensors (no input
        scale: W4A16), on the weight's device, a few million weights at a time.

        ``global_scale``: the multiplying per-tensor scale ``[]`` float32; default ``amax / (6*448)``
        of this weight. Linears that ModelOpt exports with one shared scale (gate and up of an MLP)
        pass it from :func:`weight_amax` of both."""
        w = linear.weight.detach()
        if global_scale is None:
            global_scale = nvfp4.global_scale_from_amax(weight_amax(w))
        q = cls(linear, MODELOPT, input_scale=False, device=w.device)
        with torch.no_grad():
            for r0, r1 in expert_chunks(w):
                part = nvfp4.quantize_nvfp4(w[r0:r1], global_scale)
                q.weight[r0:r1], q.weight_scale[r0:r1] = part.packed, part.block_scale
            q.weight_scale_2.copy_(global_scale.reshape(()))
        return q

    def scale_checks(self) -> list[tuple[str, str]]:
        """``(buffer, kind)`` of the scales whose values the loader checks (see ``check_scale_values``)."""
        s = self.scheme
        checks = [(s.global_scale, "global"), (s.block_scale, "block")]
        if s.input_scale in self._buffers:  # a compressed-tensors input scale divides: 0 is not allowed
            checks.append((s.input_scale, "global" if s.reciprocal else "input"))
        return checks

    def weight_ranges(self):
        s = self.scheme
        return [(s.block_scale, s.global_scale, s.multiplier)]

    def weight_value(self) -> torch.Tensor:
        b, s = self._buffers, self.scheme
        return nvfp4.dequantize_nvfp4(b[s.packed], b[s.block_scale], s.multiplier(b[s.global_scale]), self.dtype)

    def dequantized(self) -> nn.Linear:
        """An ``nn.Linear`` of the original dtype holding ``e2m1 * block scale * global scale``
        (exact up to one rounding of the float32 scale product to the dtype)."""
        return _linear_like(self, self.weight_value())

    def linear_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(weight [N, K/2] uint8, weight_scale [N, K/16] float8, global scale, input scale or None)``,
        the scales as ModelOpt's that multiply (compressed-tensors' dividing ones as reciprocals)."""
        b, s = self._buffers, self.scheme
        return (b[s.packed], b[s.block_scale], s.multiplier(b[s.global_scale]),
                s.multiplier(b[s.input_scale]) if s.input_scale in b else None)

    def modelopt_tensors(self, name: str) -> dict[str, torch.Tensor]:
        """This linear's tensors under ModelOpt's names (``{name}.weight`` ...): the file's own
        bytes for a ModelOpt checkpoint; compressed-tensors' dividing scales as their reciprocals."""
        out = linear_tensors(name, *self.linear_tensors())
        return out if self.bias is None else out | {f"{name}.bias": self.bias}

    def reset_counters(self) -> None:
        """A zeroed counter table on the weight's device (after loading, which leaves a
        non-persistent buffer unset)."""
        self.split_counters = split_counters(self._buffers[self.scheme.packed].device)

    def _apply(self, fn, recurse=True):
        # a move or to_empty() must not carry a non-zero (or uninitialized) counter along: one would
        # make a tile's parts sum early on every later call
        super()._apply(fn, recurse)
        if self.split_counters.device.type != "meta":
            self.split_counters.zero_()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed, block_scale, global_scale, _ = self.linear_tensors()
        counters = self.split_counters if self.split_counters.device == x.device else None  # (offloaded: none)
        return torch.ops.fp4moe.nvfp4_linear(x, packed, block_scale, global_scale, self.bias, self.backend, counters)


class FP8Linear(nn.Module):
    """An FP8 linear of a ModelOpt ``MIXED_PRECISION`` export (``weight [N, K] float8_e4m3fn``,
    ``weight_scale [] float32`` that multiplies, ``input_scale``), held until the loader dequantizes it
    to the model dtype: fp4moe runs FP8 layers in 16 bits."""

    def __init__(self, linear: nn.Linear, input_scale: bool):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", torch.empty(linear.out_features, linear.in_features, dtype=torch.float8_e4m3fn))
        self.register_buffer("weight_scale", torch.empty((), dtype=torch.float32))
        if input_scale:
            self.register_buffer("input_scale", torch.empty((), dtype=torch.float32))
        self.bias = linear.bias
        self.dtype = linear.weight.dtype

    def scale_checks(self) -> list[tuple[str, str]]:
        return [("weight_scale", "global")] + ([("input_scale", "input")] if "input_scale" in self._buffers else [])

    def weight_value(self) -> torch.Tensor:
        return (self.weight.float() * self.weight_scale).to(self.dtype)

    def dequantized(self) -> nn.Linear:
        return _linear_like(self, self.weight_value())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # only before the loader has swapped it
        return nn.functional.linear(x, self.weight_value().to(x.dtype), self.bias)


def weight_amax(w: torch.Tensor) -> torch.Tensor:
    """``max |w|`` as a 0-dim float32, a row chunk at a time (no full-size temporary)."""
    return torch.stack([w[r0:r1].abs().amax().float() for r0, r1 in expert_chunks(w)]).amax()


def _linear_like(m: nn.Module, weight: torch.Tensor) -> nn.Linear:
    linear = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if m.bias is not None:
        linear.bias = m.bias
    return linear


__all__ = ["FP8Linear", "LOCAL", "LocalExperts", "NVFP4Experts", "NVFP4Linear", "weight_amax"]
