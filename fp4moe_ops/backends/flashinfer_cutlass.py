"""FlashInfer CUTLASS fused-MoE backends (``flashinfer.fused_moe.cutlass_fused_moe``, 0.7.x).

* ``flashinfer_nvfp4``: NVFP4 weights x NVFP4 activations, Blackwell only (SM100/103/110/120).
  **Never run on hardware by this project** (we have only an SM90 GPU): the arguments follow
  FlashInfer 0.7.4's documented contract and are checked on CPU by de-swizzling/dequantizing
  them and by a simulation that consumes exactly these tensors (tests/test_flashinfer_args.py).
* ``flashinfer_bf16``: weights dequantized once to bf16 (exact: E2M1 x E4M3 fits bf16, the
  fp32 global scale costs one bf16 rounding), FlashInfer's BF16 CUTLASS kernel. SM90+.
* ``flashinfer_mxfp4``: NVFP4 re-quantized to MXFP4 (lossy, see
  :func:`fp4moe_ops.mxfp4.mxfp4_requant_error`), FlashInfer's SM90 BF16 x MXFP4 W4A16 kernel.

FlashInfer's contract that matters here: fc1 rows are ``[up; gate]`` (Transformers and our
canonical layout are ``[gate; up]``); ids outside ``[0, E)`` are skipped by the kernel (probed on
the H200 with -1, E, E+5 and 2^20 through the SM90 backends; ``flashinfer_nvfp4`` shares that
routing code in FlashInfer but is unprobed, and the self-test sends such ids on Blackwell), so
expert-parallel sentinels go in as they are; the 4over6
activation recipe is switched off explicitly (``nvfp4_4over6=None``), since left unset FlashInfer
reads it from ``FLASHINFER_NVFP4_4OVER6*`` environment variables, and its E4M3-256 variant does
not fit our 448-based global scales; an intermediate size that is not a multiple of 128 is padded
with zero rows/columns (the CUTLASS kernels need 128-row FC1 tiles).
"""

from __future__ import annotations

import torch

import torch.nn.functional as F

from ..moe_weights import NVFP4MoEWeights
from ..mxfp4 import nvfp4_to_mxfp4
from ..nvfp4 import BLOCK_SIZE, NVFP4Tensor, swizzle_block_scale
from .base import Backend, register_backend

MIN_FLASHINFER = (0, 7)
DEFAULT_MAX_TOKENS = 8192  # workspace is sized for this many tokens per call


def pad_intermediate(w: NVFP4MoEWeights, multiple: int = 128) -> NVFP4MoEWeights:
    """The same experts with I padded up to a multiple of ``multiple``: zero gate and up rows
    (zero bytes, zero block scales: exactly 0, and ``silu(0) * 0 = 0``) and zero down columns.
    The layer's output is unchanged."""
    inter = w.intermediate_size
    pad = -inter % multiple
    if pad == 0:
        return w

    def rows(t: torch.Tensor) -> torch.Tensor:  # [E, 2I, *] -> [E, 2(I + pad), *], per half
        gate, up = t.view(torch.uint8).chunk(2, dim=1)
        return torch.cat([F.pad(gate, (0, 0, 0, pad)), F.pad(up, (0, 0, 0, pad))], dim=1).view(t.dtype)

    def cols(t: torch.Tensor, per_byte: int) -> torch.Tensor:  # [E, H, I/per_byte] -> padded along I
        return F.pad(t.view(torch.uint8), (0, pad // per_byte)).view(t.dtype)

    return NVFP4MoEWeights(rows(w.gate_up), rows(w.gate_up_scale), w.gate_up_global_scale,
                           cols(w.down, 2), cols(w.down_scale, BLOCK_SIZE), w.down_global_scale,
                           w.gate_up_input_scale, w.down_input_scale)


def up_gate_order(w: torch.Tensor) -> torch.Tensor:
    """``[E, 2I, ...]`` rows ``[gate; up]`` -> FlashInfer's ``[up; gate]``."""
    gate, up = w.chunk(2, dim=1)
    return torch.cat([up, gate], dim=1).contiguous()


# --- NVFP4 x NVFP4 (Blackwell) argument preparation: plain torch, testable anywhere ---------


def nvfp4_weight_arguments(w: NVFP4MoEWeights) -> list[torch.Tensor]:
    """``[fc1_w int64 [E,2I,H/16], fc1_sf int32, fc1_wglobal [E], fc2_w int64 [E,H,I/16],
    fc2_sf int32, fc2_wglobal [E]]``.

    Packed weights are viewed as int64 (16 FP4 per element); block scales are swizzled 128x4
    per expert and viewed as int32 (``[E, ceil128(N), ceil4(K/16)/4]``).
    """
    def scales(s: torch.Tensor) -> torch.Tensor:
        return swizzle_block_scale(s.view(torch.uint8)).contiguous().view(torch.int32)

    return [
        up_gate_order(w.gate_up).view(torch.int64),
        scales(up_gate_order(w.gate_up_scale)),
        w.gate_up_global_scale,
        w.down.contiguous().view(torch.int64),
        scales(w.down_scale),
        w.down_global_scale,
    ]


def nvfp4_quant_scales(
    fc1_wglobal: torch.Tensor, fc1_sf: torch.Tensor, fc2_wglobal: torch.Tensor, fc2_sf: torch.Tensor,
    gate_up_input_scale: torch.Tensor, down_input_scale: torch.Tensor, *, preseed_fc2_bug: bool = False,
) -> list[torch.Tensor]:
    """FlashInfer's ``quant_scales`` for NVFP4:
    ``[fc1_act_global, fc1_sf, fc1_alpha, fc2_act_global, fc2_sf, fc2_alpha]``.

    The input scales are ModelOpt's ``input_scale`` (``amax/(6*448)``, scalar or ``[E]``) of the
    gate_up GEMM's (FlashInfer's fc1) and the down GEMM's (fc2) inputs; FlashInfer quantizes with
    their reciprocal ``act_global`` and rescales each GEMM's output by what we call its output scale,
    FlashInfer's ``alpha[e] = weight global scale[e] * input_scale[e]``.

    ``preseed_fc2_bug`` reproduces FlashInfer before the seed change (tests/benchmarks only): the
    down GEMM's inputs quantized with the single ``min(act_global)`` while alphas stay per-expert,
    which shrinks expert e's output by ``down_input_scale[e] / max(down_input_scale)``.
    """
    fc1_alpha = (fc1_wglobal * gate_up_input_scale).float().contiguous()
    fc2_alpha = (fc2_wglobal * down_input_scale).float().contiguous()
    fc2_act_global = 1.0 / down_input_scale
    if preseed_fc2_bug:
        fc2_act_global = fc2_act_global.min().reshape(())
    return [(1.0 / gate_up_input_scale).float(), fc1_sf, fc1_alpha, fc2_act_global.float(), fc2_sf, fc2_alpha]


# --- the backends ---------------------------------------------------------------------------


def _import_flashinfer():
    """flashinfer.fused_moe, or a clear error saying what is missing or incompatible."""
    try:
        import flashinfer
        from flashinfer import fused_moe
    except Exception as exc:  # ImportError, or a CUDA/JIT failure at import
        raise RuntimeError(f"FlashInfer is not usable here: {exc}. pip install 'fp4moe[flashinfer]'") from exc
    version = tuple(int(p) for p in flashinfer.__version__.split(".")[:2] if p.isdigit())
    if version < MIN_FLASHINFER:
        raise RuntimeError(
            f"flashinfer {flashinfer.__version__} has a different cutlass_fused_moe contract; "
            f"fp4moe needs >= {'.'.join(map(str, MIN_FLASHINFER))}"
        )
    return fused_moe


class _FlashInferBackend(Backend):
    activation_scales = "forbidden"
    tensors = "own"
    min_capability: tuple[int, int] = (9, 0)
    max_capability: tuple[int, int] = (99, 0)

    def __init__(self) -> None:
        self._workspaces: dict = {}

    def unavailable_reason(self, device: torch.device) -> str | None:
        if device.type != "cuda":
            return "needs a CUDA GPU"
        cap = torch.cuda.get_device_capability(device)
        if not self.min_capability <= cap <= self.max_capability:
            return (f"needs compute capability {self.min_capability}..{self.max_capability}, "
                    f"device has {cap}")
        try:
            _import_flashinfer()
        except RuntimeError as exc:
            return str(exc)
        return None

    # Subclasses: the prepared-tensor layout and the kernel flags.
    weight_kwargs: dict = {}

    def quant_scales(self, expert_tensors, gate_up_input_scale, down_input_scale) -> list[torch.Tensor]:
        return []

    def kernel_weights(self, expert_tensors):
        return expert_tensors[0], expert_tensors[1]

    def workspace(self, device, hidden, inter, num_experts, top_k, x_dtype, weight_dtype, num_tokens):
        """One scratch buffer per device and shape, allocated outside any CUDA-graph capture
        (run the model once eagerly, or :func:`autotune`, before capturing) and reused by every layer."""
        fused_moe = _import_flashinfer()
        key = (device, hidden, inter, num_experts, top_k, x_dtype, weight_dtype)
        ws = self._workspaces.get(key)
        if ws is None or ws[0] < num_tokens:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "FlashInfer workspace must be allocated before CUDA-graph capture: run the model once "
                    "eagerly with the largest token count, or fp4moe_ops.backends.flashinfer_cutlass.autotune")
            max_tokens = max(num_tokens, DEFAULT_MAX_TOKENS if ws is None else ws[0])
            size = fused_moe.cutlass_fused_moe_workspace_size(
                max_tokens, hidden, inter, num_experts, top_k, x_dtype=x_dtype,
                weight_dtype=weight_dtype, output_dtype=x_dtype, device=device,
                use_fused_finalize=self.use_fused_finalize, **self.weight_kwargs)
            ws = (max_tokens, torch.empty(size, dtype=torch.uint8, device=device))
            self._workspaces[key] = ws
        return ws[1]

    # None: FlashInfer's default, the fused (atomic, not bitwise deterministic) finalize unless
    # torch.use_deterministic_algorithms(True) is on.
    use_fused_finalize: bool | None = None

    def run(self, hidden_states, topk_ids, topk_weights, expert_tensors, gate_up_input_scale, down_input_scale,
            routed_experts=0):
        fused_moe = _import_flashinfer()
        fc1, fc2 = self.kernel_weights(expert_tensors)
        num_experts = fc1.shape[0]
        ids = topk_ids.to(torch.int32)  # ids outside [0, E) are skipped by the kernel
        hidden, inter = hidden_states.shape[1], fc1.shape[1] // 2
        ws = self.workspace(hidden_states.device, hidden, inter, num_experts, ids.shape[1],
                            hidden_states.dtype, fc1.dtype, hidden_states.shape[0])
        with torch.cuda.device(hidden_states.device):  # layers may sit on different GPUs
            out = fused_moe.cutlass_fused_moe(
                hidden_states.contiguous(), ids, topk_weights, fc1, fc2, hidden_states.dtype,
                quant_scales=self.quant_scales(expert_tensors, gate_up_input_scale, down_input_scale),
                workspace_buffer=ws, use_fused_finalize=self.use_fused_finalize,
                tune_max_num_tokens=max(DEFAULT_MAX_TOKENS, hidden_states.shape[0]),
                nvfp4_4over6=None,  # not the environment's recipe: our scales are 448-based
                **self.weight_kwargs,
            )
        return out[0] if isinstance(out, (list, tuple)) else out


class FlashInferBF16Backend(_FlashInferBackend):
    """FlashInfer CUTLASS BF16 on weights dequantized once to bf16 (4x the memory)."""

    name = "flashinfer_bf16"

    def prepare(self, weights):
        # 16 experts at a time: dequantizing a whole layer goes through ~30 GB of float32
        parts = [NVFP4MoEWeights(*(t[e:e + 16] for t in weights.tensors())).dequantize(torch.bfloat16)
                 for e in range(0, weights.num_experts, 16)]
        return [up_gate_order(torch.cat([p[0] for p in parts])), torch.cat([p[1] for p in parts])]

    def check_expert_tensors(self, expert_tensors, hidden_size):
        if len(expert_tensors) != 2:
            raise ValueError(f"{self.name}: expected [fc1 [E,2I,H], fc2 [E,H,I]] bf16, got {len(expert_tensors)} tensors")
        fc1, fc2 = expert_tensors
        if fc1.dim() != 3 or fc1.shape[2] != hidden_size or fc2.shape[1] != hidden_size or fc1.dtype != torch.bfloat16:
            raise ValueError(f"{self.name}: fc1 {list(fc1.shape)} {fc1.dtype} / fc2 {list(fc2.shape)} do not match H={hidden_size}")
        return fc1.shape[0]


class FlashInferMXFP4Backend(_FlashInferBackend):
    """FlashInfer CUTLASS BF16 x MXFP4 (W4A16) on SM90; weights re-quantized (lossy)."""

    name = "flashinfer_mxfp4"
    max_capability = (9, 0)  # the mixed-input W4A16 GEMM is Hopper's
    weight_kwargs = {"use_w4_group_scaling": True}

    def prepare(self, weights):
        hidden = weights.hidden_size
        if hidden % 128:
            # weights need n % 16 and k % 64; the folded E8M0 scales need rows % 64, k % 128
            raise ValueError(f"{self.name}: SM90 W4A16 needs H a multiple of 128 (I is padded); got H={hidden}; "
                             "use backend 'triton' (exact) or 'reference'")
        weights = pad_intermediate(weights)
        from flashinfer.fused_moe import (
            interleave_moe_scales_for_sm90_mixed_gemm as interleave_scales,
            interleave_moe_weights_for_sm90_mixed_gemm as interleave_weights,
        )
        def to_mxfp4(packed, scale, global_scale):
            # 16 experts at a time: the float32 detour of a whole layer would need ~30 GB
            parts = [nvfp4_to_mxfp4(NVFP4Tensor(packed[e:e + 16], scale[e:e + 16], global_scale[e:e + 16]))
                     for e in range(0, packed.shape[0], 16)]
            return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

        gate_up = to_mxfp4(weights.gate_up, weights.gate_up_scale, weights.gate_up_global_scale)
        down = to_mxfp4(weights.down, weights.down_scale, weights.down_global_scale)
        return [
            interleave_weights(up_gate_order(gate_up[0]), "fp4"), interleave_weights(down[0].contiguous(), "fp4"),
            interleave_scales(up_gate_order(gate_up[1]), 32), interleave_scales(down[1].contiguous(), 32),
        ]

    def quant_scales(self, expert_tensors, gate_up_input_scale, down_input_scale):
        return [expert_tensors[2], expert_tensors[3]]

    def check_expert_tensors(self, expert_tensors, hidden_size):
        if len(expert_tensors) != 4:
            raise ValueError(f"{self.name}: expected 4 prepared tensors, got {len(expert_tensors)}")
        fc1, fc2 = expert_tensors[:2]
        if fc1.dtype != torch.uint8 or fc1.shape[2] * 2 != hidden_size or fc2.shape[1] != hidden_size:
            raise ValueError(f"{self.name}: fc1 {list(fc1.shape)} / fc2 {list(fc2.shape)} do not match H={hidden_size}")
        return fc1.shape[0]


class FlashInferNVFP4Backend(_FlashInferBackend):
    """FlashInfer CUTLASS NVFP4 x NVFP4 (Blackwell; not run on hardware by this project)."""

    name = "flashinfer_nvfp4"
    activation_scales = "required"
    min_capability = (10, 0)

    def prepare(self, weights):
        if weights.hidden_size % 128:
            raise ValueError(
                f"{self.name}: CUTLASS NVFP4 needs H a multiple of 128 (I is padded; got H={weights.hidden_size}); "
                "use backend 'triton' or 'reference'")
        return nvfp4_weight_arguments(pad_intermediate(weights))

    def kernel_weights(self, expert_tensors):
        return expert_tensors[0], expert_tensors[3]

    def quant_scales(self, expert_tensors, gate_up_input_scale, down_input_scale):
        _, fc1_sf, fc1_wg, _, fc2_sf, fc2_wg = expert_tensors
        return nvfp4_quant_scales(fc1_wg, fc1_sf, fc2_wg, fc2_sf, gate_up_input_scale, down_input_scale)

    def check_expert_tensors(self, expert_tensors, hidden_size):
        if len(expert_tensors) != 6:
            raise ValueError(f"{self.name}: expected 6 prepared tensors, got {len(expert_tensors)}")
        fc1 = expert_tensors[0]
        if fc1.dtype != torch.int64 or fc1.shape[2] * BLOCK_SIZE != hidden_size:
            raise ValueError(f"{self.name}: fc1 must be int64 [E, 2I, H/16] for H={hidden_size}, got {fc1.dtype} {list(fc1.shape)}")
        return fc1.shape[0]

    def run(self, hidden_states, topk_ids, topk_weights, expert_tensors, gate_up_input_scale, down_input_scale,
            routed_experts=0):
        if hidden_states.dtype != torch.bfloat16:
            raise TypeError(f"{self.name}: per-expert activation scales need bf16 input, got {hidden_states.dtype}")
        return super().run(hidden_states, topk_ids, topk_weights, expert_tensors, gate_up_input_scale, down_input_scale)


BACKENDS_BY_NAME = {b.name: b for b in (FlashInferNVFP4Backend(), FlashInferBF16Backend(), FlashInferMXFP4Backend())}
for _backend in BACKENDS_BY_NAME.values():
    register_backend(_backend)


def set_deterministic(deterministic: bool | None = True) -> None:
    """Bitwise-reproducible FlashInfer results: True turns FlashInfer's fused (atomic) top-k
    finalize off (``use_fused_finalize=False``) for every FlashInfer backend; None restores
    FlashInfer's default (fused, unless ``torch.use_deterministic_algorithms(True)``)."""
    _FlashInferBackend.use_fused_finalize = None if deterministic is None else not deterministic
    for backend in BACKENDS_BY_NAME.values():
        backend._workspaces.clear()  # the workspace size depends on the finalize mode


def autotune(prepared, hidden_size: int, top_k: int, max_num_tokens: int = DEFAULT_MAX_TOKENS,
             dtype: torch.dtype = torch.bfloat16) -> None:
    """Profile FlashInfer's CUTLASS tactics for ``prepared`` (a FlashInfer backend's
    :class:`~fp4moe_ops.PreparedExperts`) for token counts up to ``max_num_tokens``.

    Call it once after loading and before any CUDA-graph capture (``generate()`` with
    ``mode="reduce-overhead"`` captures): FlashInfer refuses to profile inside a capture, and the
    op itself never profiles. It also sizes the shared workspace for ``max_num_tokens``.
    Deterministic results: call :func:`set_deterministic` first (or turn on
    ``torch.use_deterministic_algorithms(True)``), so tuning and running use the same finalize.
    """
    backend = BACKENDS_BY_NAME.get(prepared.backend)
    if backend is None:
        raise ValueError(f"autotune is for FlashInfer backends, got backend {prepared.backend!r}")
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("autotune must run before CUDA-graph capture, not inside it")
    import flashinfer

    num_experts = backend.check_expert_tensors(prepared.op_tensors(), hidden_size)
    device = prepared.op_tensors()[0].device
    x = torch.randn(max_num_tokens, hidden_size, dtype=dtype, device=device)
    ids = torch.rand(max_num_tokens, num_experts, device=device).argsort(dim=1)[:, :top_k].int()
    weights = torch.softmax(torch.randn(max_num_tokens, top_k, device=device), -1)
    with flashinfer.autotune(True):
        prepared(x, ids, weights)
    torch.cuda.synchronize(device)
