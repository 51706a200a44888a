"""NVFP4 expert weights of one MoE layer, in the canonical (checkpoint-like) layout.

This is the backend-neutral form: what a ModelOpt checkpoint holds, stacked over experts.
Backends run on these tensors (the Triton backend with its packed weights re-laid out in place)
or build their own from them once, at load time (FlashInfer; :func:`fp4moe_ops.prepare_experts`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .nvfp4 import BLOCK_SIZE, E2M1_MAX, NVFP4Tensor, dequantize_nvfp4, quantize_nvfp4

QUANTIZE_CHUNK_ELEMENTS = 1 << 22  # weights quantized at a time (whole experts, at least one)


def expert_chunks(t: torch.Tensor, elements: int = QUANTIZE_CHUNK_ELEMENTS):
    """``(start, stop)`` ranges of whole experts of ``t [E, N, K]`` (or of whole rows of a linear's
    ``[N, K]``), ~``elements`` weights each: work
    over a layer in pieces keeps its float32 and boolean temporaries at a few times the piece's
    size instead of the layer's (a whole-layer ``isfinite`` of DeepSeek-V3's ``gate_up_proj``
    alone is 7.5 G booleans)."""
    step = max(1, elements // max(1, t[0].numel()))
    return [(e0, min(e0 + step, t.shape[0])) for e0 in range(0, t.shape[0], step)]


@dataclass
class NVFP4MoEWeights:
    """One MoE layer's experts in NVFP4, gated-SiLU MLPs ``down(silu(gate(x)) * up(x))``.

    Shapes (E experts, hidden size H, intermediate size I):

    * ``gate_up``               ``[E, 2I, H/2]  uint8``          rows ``[gate; up]`` (Transformers' order)
    * ``gate_up_scale``         ``[E, 2I, H/16] float8_e4m3fn``  block scales, linear layout
    * ``gate_up_global_scale``  ``[E] float32``                  one global scale for gate and up
    * ``down``                  ``[E, H, I/2]   uint8``
    * ``down_scale``            ``[E, H, I/16]  float8_e4m3fn``
    * ``down_global_scale``     ``[E] float32``
    * ``gate_up_input_scale``, ``down_input_scale``: ``[E] float32`` or None. Calibrated activation
      scales ``amax / (6*448)`` of each expert's gate_up / down GEMM input (ModelOpt's
      ``input_scale``); only the NVFP4 x NVFP4 path needs them.
    """

    gate_up: torch.Tensor
    gate_up_scale: torch.Tensor
    gate_up_global_scale: torch.Tensor
    down: torch.Tensor
    down_scale: torch.Tensor
    down_global_scale: torch.Tensor
    gate_up_input_scale: torch.Tensor | None = None
    down_input_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        validate_moe_weights(self)

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.down.shape[1]

    @property
    def intermediate_size(self) -> int:
        return self.gate_up.shape[1] // 2

    @property
    def device(self) -> torch.device:
        return self.gate_up.device

    def tensors(self) -> list[torch.Tensor]:
        """The six weight tensors ``[gate_up, gate_up_scale, gate_up_global_scale, down, down_scale,
        down_global_scale]``."""
        return [self.gate_up, self.gate_up_scale, self.gate_up_global_scale,
                self.down, self.down_scale, self.down_global_scale]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """``(gate_up [E, 2I, H], down [E, H, I])`` in ``dtype``. Memory heavy: tests and setup only."""
        return (
            dequantize_nvfp4(self.gate_up, self.gate_up_scale, self.gate_up_global_scale, dtype),
            dequantize_nvfp4(self.down, self.down_scale, self.down_global_scale, dtype),
        )

    def nbytes(self) -> int:
        """Bytes of packed weights plus block and global scales (what a kernel must read)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def check_values(self) -> None:
        """Raise ValueError if a scale's value would give wrong numbers (see :data:`SCALE_CHECKS`):
        a global scale that is not finite and > 0, an E4M3 NaN byte (0x7F / 0xFF) or a negative
        block scale, a calibrated input scale that is NaN, Inf or negative (0 is allowed: an expert
        calibration never routed to; NVFP4 activations refuse it, see
        :func:`fp4moe_ops.activation_scales`), or scales whose largest weight is past bfloat16's range
        (:func:`check_weight_range`).

        The message names the tensor and expert (``"gate_up_global_scale[3]"``). One host sync per tensor:
        for load time, not per call.
        """
        for name, kind in (("gate_up_global_scale", "global"), ("down_global_scale", "global"),
                           ("gate_up_scale", "block"), ("down_scale", "block"),
                           ("gate_up_input_scale", "input"), ("down_input_scale", "input")):
            t = getattr(self, name)
            if t is not None:
                check_scale_values(t, kind, lambda e, name=name: f"{name}[{e}]")
        for proj in ("gate_up", "down"):
            check_weight_range(getattr(self, f"{proj}_scale"), getattr(self, f"{proj}_global_scale"),
                               lambda e, proj=proj: f"{proj}_global_scale[{e}]")


def _bad_global(t):
    return ~(torch.isfinite(t) & (t > 0)), "must be finite and > 0"


def _bad_input(t):
    return ~(torch.isfinite(t) & (t >= 0)), "must be finite and >= 0"


def _bad_block(t):
    b = t.view(torch.uint8)
    # all exponent and mantissa bits set (NaN), or the sign bit (a negative scale; 0x80 is -0, harmless)
    bad = ((b & 0x7F) == 0x7F) | (((b & 0x80) != 0) & (b != 0x80))
    return bad.flatten(1).any(1), "holds an E4M3 NaN byte (0x7F/0xFF) or a negative block scale"


# The largest weight a layer may hold: bfloat16's (float32's is 0.4% above). Past it a decoded
# weight is Inf in the kernels, and every token routed to the expert gets Inf or NaN.
LARGEST_WEIGHT = torch.finfo(torch.bfloat16).max
# The largest MXFP4 (E8M0) scale byte whose weights stay within it: 6 x 2^(252 - 127) is; 2^126 x 6 is not
E8M0_LARGEST = 127 + math.floor(math.log2(LARGEST_WEIGHT / E2M1_MAX))


def _bad_e8m0(t):
    # MXFP4 has no global scale, so a block's scale byte alone says whether its weights decode in range
    nan = t == 0xFF
    if bool(nan.any()):
        return nan.flatten(1).any(1), "holds E8M0 scale byte 0xFF (NaN), which makes its 32 weights NaN"
    return (t > E8M0_LARGEST).flatten(1).any(1), (
        f"holds an E8M0 scale byte above {E8M0_LARGEST} (2^{E8M0_LARGEST - 127}): 6 x its power of two is past "
        f"bfloat16's largest finite value {LARGEST_WEIGHT:.3g}, so its weights decode to Inf")


# kind -> (per-expert "bad" mask [E], what the values must be); "block": NVFP4's E4M3 block
# scales, "e8m0": MXFP4's uint8 ones (also checked for range: they are the whole multiplier)
SCALE_CHECKS = {"global": _bad_global, "block": _bad_block, "input": _bad_input, "e8m0": _bad_e8m0}
# the kinds that are per-block tensors ([E, N, K/b], or a linear's [N, K/b]), not one value per expert
BLOCK_KINDS = ("block", "e8m0")


def check_scale_values(t: torch.Tensor, kind: str, describe) -> None:
    """Raise ValueError naming ``describe(e)`` of the first expert whose ``kind`` scales (``t``:
    ``[E]`` or ``[E, N, K/16]``) are bad; one host sync."""
    bad, what = SCALE_CHECKS[kind](t)
    if bool(bad.any()):
        e = int(bad.nonzero()[0, 0])
        value = f" (got {t[e].item()})" if t.dim() == 1 else ""
        raise ValueError(f"{describe(e)} {what}{value}; {int(bad.sum())} expert(s) affected")


def rescale_block_scales(block_scale: torch.Tensor, ratio: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """E4M3 block scales ``[..., N, K/16]`` times ``ratio`` (broadcast; <= 1: moving a tensor onto a
    larger global scale), re-rounded to E4M3; returns ``(rescaled, rows changed, rows zeroed)``. A
    ratio far below 1 flushes small block scales to 0 (E4M3's smallest is 2^-9): a row whose every
    non-zero block scale flushes loses its weights entirely, which the caller must say."""
    rescaled = (block_scale.float() * ratio).to(torch.float8_e4m3fn)
    old, new = block_scale.view(torch.uint8), rescaled.view(torch.uint8)
    changed = int((old != new).any(-1).sum())
    zeroed = int(((old & 0x7F != 0).any(-1) & ~(new & 0x7F != 0).any(-1)).sum())
    return rescaled, changed, zeroed


def largest_weights(block_scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """``[E] float64``: the largest ``|W|`` each expert's scales allow, ``6 x`` its largest block
    scale ``x`` its global scale (the multiplying one). ``block_scale``
    ``[E, N, K/16]`` E4M3 with no NaN or negative bytes (:func:`check_scale_values` first);
    ``global_scale`` ``[E]``. Reduced on the bytes, without a copy of the block scales (DeepSeek-V3:
    470 MB a layer): non-negative E4M3 bytes order as their values, and as int8 the one sign-bit
    byte left, -0 (0x80), is the smallest."""
    top = block_scale.view(torch.int8).flatten(1).amax(1)
    return top.view(torch.float8_e4m3fn).double() * E2M1_MAX * global_scale.double()


def check_weight_range(block_scale: torch.Tensor, global_scale: torch.Tensor, describe) -> None:
    """Raise ValueError naming ``describe(e)`` of the first expert whose largest weight
    (:func:`largest_weights`) is past :data:`LARGEST_WEIGHT`. A global scale such as 1e38 is finite
    and > 0, passes :func:`check_scale_values`, and still decodes to Inf: a corrupt file."""
    top = largest_weights(block_scale, global_scale)
    bad = ~(top <= LARGEST_WEIGHT)
    if bool(bad.any()):
        e = int(bad.nonzero()[0, 0])
        count = int(bad.sum())
        raise ValueError(f"{describe(e)}: its largest weight would be {top[e].item():.3g} "
                         f"(6 x block scale x multiplying global scale {global_scale[e].item():.3g}), past "
                         f"bfloat16's largest finite value {LARGEST_WEIGHT:.3g}"
                         + (f"; {count} experts affected" if count > 1 else ""))


def quantize_moe_weights(gate_up: torch.Tensor, down: torch.Tensor) -> NVFP4MoEWeights:
    """Quantize float experts to NVFP4 with ModelOpt's recipe.

    Args:
        gate_up: ``[E, 2I, H]`` rows ``[gate; up]`` (Transformers v5 ``gate_up_proj``).
        down: ``[E, H, I]`` (Transformers v5 ``down_proj``).

    Gate and up share one global scale per expert (ModelOpt fuses their amax).
    """
    _check_expert_stack("gate_up", gate_up)
    _check_expert_stack("down", down)
    e, two_i, h = gate_up.shape
    if two_i % 2 or down.shape != (e, h, two_i // 2):
        raise ValueError(
            f"down must be [E, H, I] = {[e, h, two_i // 2]} to match gate_up {list(gate_up.shape)}, "
            f"got {list(down.shape)}"
        )
    if down.device != gate_up.device:
        raise ValueError(f"down is on {down.device} but gate_up is on {gate_up.device}")
    return NVFP4MoEWeights(*quantize_expert_stack(gate_up), *quantize_expert_stack(down))


def quantize_expert_stack(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One projection of a layer's experts, ``w [E, N, K]`` float, with ModelOpt's recipe:
    ``(packed [E, N, K/2] uint8, block scales [E, N, K/16] float8_e4m3fn, global [E] float32)``
    on w's device. Filled in place a chunk of experts at a time: the float32 scratch stays a
    chunk's, and the NVFP4 bytes exist once (no list of parts to concatenate)."""
    e, n, k = w.shape
    packed = torch.empty(e, n, k // 2, dtype=torch.uint8, device=w.device)
    scale = torch.empty(e, n, k // BLOCK_SIZE, dtype=torch.float8_e4m3fn, device=w.device)
    glob = torch.empty(e, dtype=torch.float32, device=w.device)
    for e0, e1 in expert_chunks(w):
        q = quantize_nvfp4(w[e0:e1])
        packed[e0:e1], scale[e0:e1], glob[e0:e1] = q.packed, q.block_scale, q.global_scale
    return packed, scale, glob


def _check_expert_stack(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 3:
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a 3-D expert stack [E, N, K], got {shape}")
    if 0 in t.shape:
        raise ValueError(f"{name} {tuple(t.shape)} is empty: an expert stack needs E, N, K > 0")
    if t.shape[-1] % BLOCK_SIZE:
        raise ValueError(
            f"{name} {tuple(t.shape)}: the reduction dim K={t.shape[-1]} must be a multiple of "
            f"{BLOCK_SIZE} for NVFP4 block scales"
        )


def _expect(name: str, t, shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        hint = " (raw E4M3 bytes? pass t.view(torch.float8_e4m3fn))" if dtype == torch.float8_e4m3fn and \
            t.dtype == torch.uint8 else ""
        raise TypeError(f"{name} must be {dtype}, got {t.dtype} (shape {tuple(t.shape)}){hint}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} like gate_up")


def validate_moe_weights(w: NVFP4MoEWeights) -> None:
    """Raise a clear error if any tensor has the wrong shape, dtype or device."""
    if not isinstance(w.gate_up, torch.Tensor) or w.gate_up.dim() != 3:
        raise ValueError("gate_up must be [E, 2I, H/2] uint8")
    e, two_i, h_half = w.gate_up.shape
    if 0 in w.gate_up.shape:
        raise ValueError(f"gate_up {list(w.gate_up.shape)} is empty: E, 2I and H must be > 0")
    if two_i % 2 or two_i // 2 % BLOCK_SIZE:
        raise ValueError(f"gate_up rows 2I={two_i}: I must be a multiple of {BLOCK_SIZE}")
    h, i, dev = h_half * 2, two_i // 2, w.gate_up.device
    if h % BLOCK_SIZE:
        raise ValueError(f"gate_up {tuple(w.gate_up.shape)}: H={h} must be a multiple of {BLOCK_SIZE}")
    _expect("gate_up", w.gate_up, (e, 2 * i, h // 2), torch.uint8, dev)
    _expect("gate_up_scale", w.gate_up_scale, (e, 2 * i, h // BLOCK_SIZE), torch.float8_e4m3fn, dev)
    _expect("gate_up_global_scale", w.gate_up_global_scale, (e,), torch.float32, dev)
    _expect("down", w.down, (e, h, i // 2), torch.uint8, dev)
    _expect("down_scale", w.down_scale, (e, h, i // BLOCK_SIZE), torch.float8_e4m3fn, dev)
    _expect("down_global_scale", w.down_global_scale, (e,), torch.float32, dev)
    for name in ("gate_up_input_scale", "down_input_scale"):
        s = getattr(w, name)
        if s is not None:
            _expect(name, s, (e,), torch.float32, dev)


__all__ = ["NVFP4MoEWeights", "NVFP4Tensor", "quantize_expert_stack", "quantize_moe_weights", "rescale_block_scales",
           "validate_moe_weights"]
