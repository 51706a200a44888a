"""``torch.ops.fp4moe.nvfp4_linear``: one NVFP4 linear layer ``y = x W^T (+ b)`` as one graph node,
for the NVFP4 tensors of a checkpoint outside the routed experts (attention, shared experts,
dense MLPs), kept in 4 bits instead of dequantized at load.

Weights as a ModelOpt checkpoint holds them (the last one is its ``weight_scale_2``)::

    weight        [N, K/2]  uint8          two E2M1 codes per byte, low nibble first
    weight_scale  [N, K/16] float8_e4m3fn  one scale per 16 weights along K
    global_scale  []        float32        the per-tensor scale that multiplies

or the packed weight in the Triton backend's paired layout, ``[N/2, K/4] int32``
(:func:`fp4moe_ops.backends.triton_moe.layout.paired_weight_layout`: the same bytes, rows ``r`` and
``r + 8`` interleaved and their bits permuted for the GPU decode), which
:class:`~hf_integration.experts.NVFP4Linear` holds on Hopper.

Activations are not quantized (W4A16): ``x [..., K]`` bfloat16/float16 (float32 too) -> ``[..., N]`` of
x's dtype.

Backends:

* ``"reference"``: pure torch on any device. It decodes the weight as ``e2m1 * block scale *
  per-tensor scale`` in float32 rounded once to x's dtype (the weight that dequantizing at load
  gives, and that ModelOpt's and llm-compressor's fake quant compute with) and calls ``F.linear``
  with it: exactly the dequantized ``nn.Linear``'s arithmetic, so a model that keeps its NVFP4
  linears gives the dequantized model's logits. Memory stays NVFP4 between calls (the decoded copy
  lives for one call); the decode costs time on every call.
* ``"triton"`` (CUDA, compute capability 9.0+, 16-bit x, N % 64 == 0, K % 256 == 0): up to 64
  tokens a GEMV-shaped kernel that reads the 4-bit weight once, decodes it exactly in registers
  and multiplies on the tensor cores (split along K where N alone gives too few programs), the
  global scale applied to the float32 sum, so it is closer to float64 than the reference: with
  paired weights and bf16 x on Hopper ``decode_v3``'s ``mma.sync`` kernel, else a wgmma one. Past
  64 tokens one kernel decodes the weight to 16 bits (bitwise the reference's weight) and cuBLAS
  multiplies. See :mod:`fp4moe_ops.backends.triton_moe.launch`.
* ``"flashinfer"`` (Blackwell, compute capability 10.0+, bf16 x, FlashInfer >= 0.7 with cuDNN >=
  9.23.1): FlashInfer's W4A16 GEMM ``mm_bf16_fp4(..., backend="cudnn")``, which computes
  ``(x @ (e2m1 * block scale)^T) * alpha`` from exactly the checkpoint's tensors: the packed
  weight, the linear ``[N, K/16]`` E4M3 block scales (what ``prepare_bf16_fp4_weights(...,
  backend="cudnn")`` makes of the 128x4-swizzled ones) and ``alpha = global_scale``. **Never run
  on Blackwell hardware** (we have none): the arguments are checked on CPU against the float64
  oracle through a simulation of that definition, and on the H200 against FlashInfer's own
  preparation (``tests/test_linear.py``).
* ``"auto"``: ``"triton"`` where it runs, else ``"reference"``. ``"flashinfer"`` is never chosen
  for you until it has run on Blackwell hardware: ask for it by name.

Like :func:`fp4moe_ops.op.fused_moe`, the real and the fake function share their checks, which read
metadata only (no host syncs).
"""

from __future__ import annotations

import functools
import logging
import warnings

import torch
import torch.nn.functional as F

from .nvfp4 import BLOCK_SIZE, dequantize_nvfp4

LINEAR_BACKENDS = ("auto", "reference", "triton", "flashinfer")
SPLIT_COUNTERS = 1024  # tiles of a split-K Triton call one counter table serves (it needs < 264)
LINEAR_X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def split_counters(device) -> torch.Tensor:
    """A zeroed ``[SPLIT_COUNTERS] int32`` table for :func:`nvfp4_linear`'s ``counters``: the Triton
    GEMV path then sums its split-K parts in the same launch (the last part of each tile to
    finish does, and sets the tile's counter back to zero). The caller owns it (an
    :class:`~hf_integration.experts.NVFP4Linear` holds one); calls that share a table must not run
    at the same time (on two streams)."""
    return torch.zeros(SPLIT_COUNTERS, dtype=torch.int32, device=device)


def _check_linear(x, weight, weight_scale, global_scale, bias, backend, counters=None) -> None:
    """Metadata checks shared by the real and the fake implementation; each error names the tensor."""
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"unknown nvfp4_linear backend {backend!r}; available: {', '.join(LINEAR_BACKENDS)}")
    if x.dim() < 1 or x.dtype not in LINEAR_X_DTYPES:
        raise TypeError(f"x must be [..., K] bfloat16/float16/float32, got {x.dtype} {list(x.shape)}")
    k = x.shape[-1]
    if weight.dtype not in (torch.uint8, torch.int32) or weight.dim() != 2:
        raise TypeError(f"weight must be [N, K/2] uint8 (packed E2M1) or [N/2, K/4] int32 (the paired layout), got "
                        f"{weight.dtype} {list(weight.shape)}")
    paired = weight.dtype == torch.int32
    n = 2 * weight.shape[0] if paired else weight.shape[0]
    if paired and n % 16:
        raise ValueError(f"weight {list(weight.shape)} in the paired layout ([N/2, K/4] int32) needs N a multiple of "
                         f"16, got N={n}")
    if k % BLOCK_SIZE or weight.shape[1] * (4 if paired else 2) != k:
        want = f"[N/2, {k // 4}] int32" if paired else f"[N, {k // 2}]"
        raise ValueError(f"weight {list(weight.shape)} does not match x's K={k}: expected {want} "
                         f"and K a multiple of {BLOCK_SIZE}")
    if weight_scale.dtype != torch.float8_e4m3fn or tuple(weight_scale.shape) != (n, k // BLOCK_SIZE):
        raise TypeError(f"weight_scale must be [N={n}, K/16={k // BLOCK_SIZE}] float8_e4m3fn, got "
                        f"{weight_scale.dtype} {list(weight_scale.shape)}")
    if global_scale.dtype != torch.float32 or global_scale.dim() != 0:
        raise TypeError(f"global_scale must be a 0-dim float32 (the multiplying per-tensor scale), got "
                        f"{global_scale.dtype} {list(global_scale.shape)}")
    if bias is not None and (tuple(bias.shape) != (n,) or bias.dtype != x.dtype):
        raise TypeError(f"bias must be [N={n}] {x.dtype} like x, got {bias.dtype} {list(bias.shape)}")
    if counters is not None and (counters.dtype != torch.int32 or counters.dim() != 1 or not counters.is_contiguous()):
        raise TypeError(f"counters must be a contiguous 1-D int32 table (split_counters()), got {counters.dtype} "
                        f"{list(counters.shape)} with strides {list(counters.stride())}")
    for name, t in (("weight", weight), ("weight_scale", weight_scale), ("global_scale", global_scale),
                    ("bias", bias), ("counters", counters)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device} (nvfp4_linear backend {backend!r})")
    if backend in ("triton", "flashinfer"):
        reason = _triton_refusal(x, weight) if backend == "triton" else _flashinfer_refusal(x, weight)
        if reason:
            raise ValueError(f"nvfp4_linear backend {backend!r} cannot run this call: {reason}")


def _triton_refusal(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    try:
        from .backends.triton_moe.launch import linear_supported
    except ImportError as e:  # pragma: no cover - a torch without triton
        return str(e)
    return linear_supported(x, weight)


def _flashinfer_refusal(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    if weight.dtype == torch.int32:
        return "the weight is in the Triton backend's paired layout (FlashInfer reads the checkpoint's bytes)"
    if not x.is_cuda or torch.cuda.get_device_capability(x.device) < (10, 0):
        return f"FlashInfer's FP4 GEMM needs a Blackwell GPU (compute capability 10.0+); x is on {x.device}"
    if x.dtype != torch.bfloat16:
        return f"FlashInfer's W4A16 GEMM takes bfloat16 activations, got {x.dtype}"
    return _flashinfer_missing()


@functools.cache
def _flashinfer_missing() -> str | None:
    """Checked once per process: FlashInfer's W4A16 GEMM and the cuDNN it needs (>= 9.23.1)."""
    try:
        from flashinfer import mm_bf16_fp4  # noqa: F401
        import cudnn
    except ImportError as e:
        return f"FlashInfer with mm_bf16_fp4 (0.7+) and cuDNN's Python frontend are needed: {e}"
    if cudnn.backend_version() < 92301:
        return f"FlashInfer's W4A16 GEMM needs cuDNN >= 9.23.1, found backend version {cudnn.backend_version()}"
    return None


def _resolve(backend: str, x: torch.Tensor, weight: torch.Tensor) -> str:
    if backend == "auto":
        refusal = _triton_refusal(x, weight)
        if x.is_cuda:
            _announce_once(x, refusal)
        return "reference" if refusal else "triton"
    return backend


_ANNOUNCED = set()


def _announce_once(x: torch.Tensor, refusal: str | None) -> None:
    """Say once per device, dtype and reason which kernels ``"auto"`` runs NVFP4 linears with on a
    GPU: at info level, and as a warning where it falls back to the reference path (the weight
    decoded in PyTorch at every call)."""
    key = (x.device, x.dtype, refusal)
    if key in _ANNOUNCED:
        return
    _ANNOUNCED.add(key)
    if refusal is None:
        import triton

        from .backends.triton_moe.launch import gluon_unavailable

        gluon = gluon_unavailable(x)
        kernels = ("decode_v3's mma.sync kernel up to 128 tokens on weights in the paired layout (NVFP4Linear's on "
                   "Hopper), else a wgmma GEMV up to 64" if gluon is None else f"a wgmma GEMV up to 64 tokens ({gluon})")
        logging.getLogger("fp4moe").info(
            "fp4moe: NVFP4 linears on %s run Triton %s's kernels: %s; the weight decoded to 16 bits for cuBLAS "
            "beyond", x.device, triton.__version__, kernels)
    else:
        warnings.warn(f"fp4moe: an NVFP4 linear on {x.device} runs the slow reference path (its weight decoded "
                      f"in PyTorch at every call), not the Triton kernels: {refusal}", stacklevel=3)


def flashinfer_linear_arguments(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                                global_scale: torch.Tensor) -> dict:
    """The arguments of ``flashinfer.mm_bf16_fp4(a, b, b_descale, alpha, backend="cudnn")`` for this
    linear: ``a [M, K]`` bf16 (x flattened), ``b`` the packed weight as stored (low nibble first, as
    FlashInfer's ``nvfp4_quantize`` packs), ``b_descale`` the ``[N, K/16]`` E4M3 block scales in
    the linear (non-swizzled) layout the cuDNN path consumes, ``alpha [1]`` float32 the multiplying
    per-tensor scale. All views: nothing is copied or prepared."""
    return dict(a=x.reshape(-1, x.shape[-1]), b=weight, b_descale=weight_scale,
                alpha=global_scale.reshape(1), backend="cudnn", out_dtype=x.dtype)


def _flashinfer_linear(x, weight, weight_scale, global_scale, bias):
    from flashinfer import mm_bf16_fp4

    if x.numel() == 0:
        return x.new_empty(*x.shape[:-1], weight.shape[0])
    args = flashinfer_linear_arguments(x.contiguous(), weight, weight_scale, global_scale)
    out = mm_bf16_fp4(**args)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


# ``counters`` is written during a call but left as it was found (all zero): no mutation to declare,
# which would have functionalization copy it around every call
@torch.library.custom_op("fp4moe::nvfp4_linear", mutates_args=())
def nvfp4_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, global_scale: torch.Tensor,
                 bias: torch.Tensor | None = None, backend: str = "auto",
                 counters: torch.Tensor | None = None) -> torch.Tensor:
    """``y = x (e2m1 * weight_scale * global_scale)^T + bias``: ``x [..., K]`` -> ``[..., N]``
    in x's dtype (tensors as in the module docstring). ``counters``: an optional
    :func:`split_counters` table, zero before and after the call, that saves the Triton GEMV path
    a second launch."""
    _check_linear(x, weight, weight_scale, global_scale, bias, backend, counters)
    resolved = _resolve(backend, x, weight)
    if resolved == "flashinfer":
        return _flashinfer_linear(x, weight, weight_scale, global_scale, bias)
    if resolved == "triton":
        from .backends.triton_moe.launch import triton_nvfp4_linear

        return triton_nvfp4_linear(x, weight, weight_scale, global_scale, bias, counters=counters)
    y = F.linear(as_matrix(x), decoded_weight(weight, weight_scale, global_scale, x.dtype), bias)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def as_matrix(t: torch.Tensor) -> torch.Tensor:
    """``t [..., K]`` as one ``[T, K]`` matrix for cuBLAS. A ``[B, 1, K]`` tensor with its own stride on
    the size-1 axis (attention's output at decode) passes ``is_contiguous()``, but ``F.linear`` and
    ``@`` cannot fold it and run a batched GEMM that reads the weight once per row (two orders of
    magnitude slower at 512 rows: benchmarks/NOTES.md, "NVFP4 linears")."""
    return t.reshape(t.shape[:-1].numel(), t.shape[-1])


def decoded_weight(weight: torch.Tensor, weight_scale: torch.Tensor, global_scale: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """The reference's weight ``[N, K]``: ``e2m1 * block scale * per-tensor scale`` in float32 rounded
    once to ``dtype``, from the packed weight in either layout."""
    if weight.dtype == torch.int32:
        from .backends.triton_moe.layout import canonical_from_paired

        weight = canonical_from_paired(weight)
    return dequantize_nvfp4(weight, weight_scale, global_scale, dtype)


@nvfp4_linear.register_fake
def _(x, weight, weight_scale, global_scale, bias=None, backend="auto", counters=None):
    _check_linear(x, weight, weight_scale, global_scale, bias, backend, counters)
    return x.new_empty(*x.shape[:-1], weight_scale.shape[0])


__all__ = ["LINEAR_BACKENDS", "LINEAR_X_DTYPES", "SPLIT_COUNTERS", "decoded_weight", "flashinfer_linear_arguments", "nvfp4_linear",
           "split_counters"]
