"""Patching a loaded BF16 Transformers MoE model so that its routed experts run in NVFP4:
``patch_deepseek`` / ``patch_moe``, ``quantize_linears`` for its other linears, and
``set_backend`` to switch kernels afterwards.

Every fused-experts module of Transformers (``@use_experts_implementation``: DeepSeek-V2/V3,
Kimi-K2, GLM4-MoE, Qwen3-MoE, Mixtral, ...) is replaced by an
:class:`~hf_integration.experts.NVFP4Experts` holding its weights quantized with ModelOpt's
recipe; optionally the linears of dense gated MLPs (shared experts, dense layers) and of attention
become :class:`~hf_integration.experts.NVFP4Linear` s (W4A16, ``fp4moe::nvfp4_linear``) inside the
model's own modules, and shared experts of the routed experts' shape run inside the routed call;
routers become :mod:`hf_integration.router`'s one-op modules. The model is
then marked quantized as if loaded from a ModelOpt checkpoint (``save_pretrained`` writes one).
"""

from __future__ import annotations

import copy
import traceback
import types

import torch
from torch import nn
from transformers.utils import logging

from fp4moe_ops import nvfp4
from fp4moe_ops.backends import resolve_backend
from fp4moe_ops.moe_weights import NVFP4MoEWeights, expert_chunks, quantize_expert_stack

from .activation_modes import log_activation_modes
from .experts import NVFP4Experts, NVFP4Linear, weight_amax
from .checkpoint_format import ModelOptConfig
from .fused_linears import linear_groups
from .kinds import quantized_modules
from .llama4 import is_llama4_experts
from .quantizer import ModelOptQuantizer, attach, quantizer_for
from .saving import refuse_unpatched_save
from .router import fuse_routers
from .shared_experts import fuse_shared_experts as fuse_shared
from .surgery import find_experts_modules, is_transformers_experts, nvfp4_experts, nvfp4_experts_problem, \
    replace_module

logger = logging.get_logger("transformers.fp4moe")  # under Transformers: set_verbosity_* applies

DEEPSEEK_FAMILY = ("deepseek_v3", "kimi_k2", "deepseek_v2", "glm4_moe")


def _check_experts(name: str, m: nn.Module) -> None:
    problems = [p for p in (nvfp4_experts_problem(m),) if p is not None]
    if m.gate_up_proj.device.type == "meta":
        problems.append("weights are on the meta device (not loaded)")
    elif m.gate_up_proj.dtype not in (torch.bfloat16, torch.float16):
        problems.append(f"weights are {m.gate_up_proj.dtype}: NVFP4 experts run with 16-bit activations, load the "
                        "model with dtype=torch.bfloat16 (or float16)")
    else:
        for pname in ("gate_up_proj", "down_proj"):
            t = getattr(m, pname)
            if not all(bool(torch.isfinite(t[e0:e1]).all()) for e0, e1 in expert_chunks(t)):
                problems.append(f"{pname} holds NaN or Inf")
    if problems:
        raise ValueError(f"cannot patch {name} ({type(m).__name__}): " + "; ".join(problems))


class _HostStage:
    """Where a layer's 16-bit ``down_proj`` waits, on the host, from the moment its NVFP4 bytes exist
    until the layer's NVFP4 module has replaced it: one buffer reused from layer to layer,
    page-locked where the system allows (faster copies), given back by :meth:`close`."""

    def __init__(self):
        self.buffer = None
        self.held = None  # (parameter, device) whose data is in the buffer

    def hold(self, p: torch.Tensor) -> None:
        """Copy ``p``'s data to the host buffer and release its device memory."""
        t = p.data
        if self.buffer is None or self.buffer.shape != t.shape or self.buffer.dtype != t.dtype:
            self.buffer = None
            try:
                self.buffer = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            except RuntimeError as e:  # no page-locked memory to be had (container limits): pageable
                logger.info("fp4moe: staging down_proj in pageable host memory (slower copies): %s", e)
                self.buffer = torch.empty(t.shape, dtype=t.dtype)
        self.buffer.copy_(t)
        self.held = (p, t.device)
        p.data = t.new_empty(0)

    def restore(self) -> None:
        """Put the held data back on its device, as it was (its own copy, not the buffer)."""
        if self.held is not None:
            p, device = self.held
            p.data = self.buffer.to(device, copy=True)
            self.held = None

    def release(self) -> None:
        self.held = None

    def close(self) -> None:
        """Give the buffer back, and the page-locked memory the allocator caches for it."""
        self.release()
        pinned = self.buffer is not None and self.buffer.is_pinned()
        self.buffer = None
        if pinned and hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()


def _staged(device: torch.device) -> bool:
    """Whether ``down_proj`` waits on the host while a layer on ``device`` is quantized: on an
    accelerator (on the host it would only be a copy)."""
    return device.type != "cpu"


def _quantize_experts(m: nn.Module, stage: _HostStage | None) -> NVFP4MoEWeights:
    """A Transformers experts module's weights in NVFP4, ``down_proj`` first. With a ``stage``, the
    16-bit ``down_proj`` then waits on the host and its device memory is freed while
    ``gate_up_proj`` is quantized, so the device holds at most the 16-bit layer plus the NVFP4
    ``down_proj`` (not plus the whole layer's NVFP4 bytes). If this fails, ``down_proj`` comes
    back as it was; after it returns, the caller restores it (``stage.restore()``) if what follows
    fails, and releases it once the layer is replaced."""
    down = quantize_expert_stack(m.down_proj.data)
    if stage is None:
        return NVFP4MoEWeights(*quantize_expert_stack(m.gate_up_proj.data), *down)
    stage.hold(m.down_proj)
    try:
        gate_up = quantize_expert_stack(m.gate_up_proj.data)
    except BaseException as e:  # out of memory, most likely: free what this layer made before restoring
        traceback.clear_frames(e.__traceback__)
        del down
        stage.restore()
        raise
    return NVFP4MoEWeights(*gate_up, *down)


def _checked_linear_groups(model: nn.Module, dense_mlps: bool, attention: bool):
    """:func:`~hf_integration.fused_linears.linear_groups`, every linear checked first (sizes, device, dtype, finite weights):
    an error names the linear."""
    groups = linear_groups(model, dense_mlps, attention)
    for name, m, kind, leaves in groups:
        _check_linears(name, m, kind, leaves)
    return groups


def _check_linears(name: str, m: nn.Module, kind: str, groups: list[list[str]]) -> None:
    for leaf in (leaf for group in groups for leaf in group):
        lin = getattr(m, leaf)
        w = lin.weight
        if lin.in_features % nvfp4.BLOCK_SIZE:
            raise ValueError(f"cannot quantize {kind} {name}.{leaf}: in_features {lin.in_features} must be a "
                             f"multiple of {nvfp4.BLOCK_SIZE}")
        if w.device.type == "meta":
            raise ValueError(f"cannot quantize {kind} {name}.{leaf}: its weight is on the meta device (not loaded)")
        if w.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"cannot quantize {kind} {name}.{leaf}: weight is {w.dtype}, not a float")
        if not bool(torch.isfinite(weight_amax(w))):
            raise ValueError(f"cannot quantize {kind} {name}.{leaf}: its weight holds NaN or Inf")


def _quantize_linears(groups, verbose: bool) -> None:
    for name, m, kind, leaves in groups:
        for group in leaves:
            amax = torch.stack([weight_amax(getattr(m, leaf).weight) for leaf in group]).amax()
            scale = nvfp4.global_scale_from_amax(amax)
            for leaf in group:  # the BF16 linear is freed as it is replaced
                replace_module(m, leaf, NVFP4Linear.quantize(getattr(m, leaf), scale))
        if verbose:
            logger.info("fp4moe: %s (%s) linears -> NVFP4", name, kind)


def quantize_linears(model: nn.Module, *, dense_mlps: bool = True, attention: bool = False,
                     verbose: bool = False) -> int:
    """Quantize the ``nn.Linear`` s of ``model``'s dense gated MLPs (shared experts, dense layers)
    and/or attention modules to :class:`~hf_integration.experts.NVFP4Linear` (W4A16, ModelOpt's
    recipe and tensors; an MLP's gate and up on one global scale, attention's q/k/v and DeepSeek's
    q_a/kv_a likewise). What ``patch_moe``'s
    ``quantize_dense_mlps`` / ``quantize_attention`` do; usable on its own, e.g. on a patched model.
    Every linear is checked first (sizes, dtype, device, finite weights): on an error nothing has
    changed. Returns the number of modules whose linears were quantized. A model whose routed
    experts are not patched yet refuses ``save_pretrained`` (:func:`patch_moe` it first: the NVFP4
    linears are kept, and it saves as a ModelOpt checkpoint)."""
    groups = _checked_linear_groups(model, dense_mlps, attention)
    _quantize_linears(groups, verbose)
    if groups and not isinstance(getattr(model, "hf_quantizer", None), ModelOptQuantizer):
        # not an fp4moe model: Transformers' save would write the packed bytes as BF16 weights
        # under no quantization config, which no loader reads; patch_moe attaches the real save
        model.save_pretrained = types.MethodType(refuse_unpatched_save, model)
    return len(groups)


def _own_config(model: nn.Module) -> None:
    """Give ``model`` a copy of its config (the quantization config set on it is this model's alone,
    not another model's built from the same config object), held by every module of the model that
    held the old one or one of its sub-configs: Transformers' modules read the shared object, so a
    later change through ``model.config`` (``set_attn_implementation``, which continuous batching
    uses to switch to paged attention) must reach them."""
    memo = {}
    model.config = copy.deepcopy(model.config, memo)
    for m in model.modules():
        held = m.__dict__.get("config")
        if held is not None and id(held) in memo:
            m.config = memo[id(held)]


def patch_moe(model: nn.Module, *, backend: str = "auto", act_scale_mode: str | None = None,
              quantize_dense_mlps: bool = False, quantize_attention: bool = False, fuse_router: bool = True,
              fuse_shared_experts: bool = True, verbose: bool = True) -> nn.Module:
    """Quantize every routed-experts module of ``model`` to NVFP4 and run it through the op.

    Args:
        model: a loaded Transformers MoE model in bfloat16/float16 (``DeepseekV3ForCausalLM``,
            Qwen3-MoE, ...).
        backend: ``"auto"`` (fastest exact backend for the experts' device), or a name from
            ``fp4moe_ops.BACKENDS``. Checked for every layer's device before anything changes.
        act_scale_mode: must be None here: NVFP4 activations need calibrated scales, so they apply
            through :func:`set_backend` after :func:`~hf_integration.calibrate_activation_scales`.
        quantize_dense_mlps: also quantize the linears of dense gated MLPs (shared experts,
            DeepSeek's first dense layers) to :class:`~hf_integration.experts.NVFP4Linear` (W4A16,
            ``fp4moe::nvfp4_linear``; gate and up share one global scale, as ModelOpt exports
            them). Off by default.
        quantize_attention: also quantize every ``nn.Linear`` of the attention modules (W4A16, as
            ModelOpt's default NVFP4 config does). Off by default: it changes the model's
            attention, which the routed experts alone do not.
        fuse_router: replace the routers fp4moe runs as one op (DeepSeek-V3-style by
            :class:`~hf_integration.router.GroupedTopkRouter`, softmax top-k ones of Qwen-MoE,
            OLMoE, Mixtral and MiniMax by :class:`~hf_integration.router.SoftmaxTopkRouter`; same
            parameters, same experts chosen up to near ties, one kernel after the router's GEMM
            instead of several). Off: Transformers' router runs.
        fuse_shared_experts: with ``quantize_dense_mlps``, run each DeepSeek-V3-style block's
            shared expert as one more expert inside the routed experts' op call
            (:class:`~hf_integration.shared_experts.SharedExpertMoE`; same state dict and saved
            checkpoint as unfused).
        verbose: one progress line per layer through ``transformers.logging`` (logger ``"fp4moe"``,
            INFO: ``transformers.logging.set_verbosity_info()`` shows it).

    Everything is checked first (architecture, dtypes, finite weights, dimensions, backend per
    device): on such an error nothing has changed. Then each layer is quantized on its own device
    (whole experts, ~4 M weights at a time) and its BF16 weights are freed before the next. On an
    accelerator its BF16 ``down_proj`` waits on the host while ``gate_up_proj`` is quantized
    (:func:`_quantize_experts`), so the peak is the BF16 model plus one layer's NVFP4 ``down_proj``
    and one chunk's scratch (``benchmarks/bench_patch_memory.py``); a failure there (out of memory)
    puts it back, so every layer is whole: BF16 or NVFP4. The model is marked quantized
    (``model.hf_quantizer``); its config is copied first, so other models built from the same
    config object are untouched.
    """
    modules = [(n, m) for n, m in find_experts_modules(model) if is_transformers_experts(m)]
    if nvfp4_experts(model):
        raise ValueError(f"model is already patched by fp4moe ({nvfp4_experts(model)[0][0]} holds NVFP4 experts)")
    if not modules:
        if any(is_llama4_experts(m) for m in model.modules()):
            raise ValueError(f"{type(model).__name__}: patch_moe does not quantize Llama-4's bmm-layout experts "
                             "(one global scale per layer in ModelOpt's format); load a ModelOpt NVFP4 export of "
                             "the model with from_pretrained instead")
        raise ValueError(f"{type(model).__name__} has no Transformers experts modules to patch")
    for name, m in modules:
        _check_experts(name, m)
    for name, m in modules:  # every layer's device can run the backend (uncalibrated: W4A16 only)
        resolve_backend(backend, m.gate_up_proj.device)
    linear_groups = _checked_linear_groups(model, quantize_dense_mlps, quantize_attention)
    if act_scale_mode is not None:
        raise ValueError(f"act_scale_mode={act_scale_mode!r} needs calibrated activation scales: patch first, "
                         "then calibrate_activation_scales(model, batches), then set_backend(model, backend, mode)")

    _own_config(model)
    stage = _HostStage()
    try:
        for i in range(len(modules)):
            (name, m), modules[i] = modules[i], None
            with torch.no_grad():
                weights = _quantize_experts(m, stage if _staged(m.down_proj.device) else None)
            parent, _, attr = name.rpartition(".")
            try:
                replace_module(model.get_submodule(parent), attr, NVFP4Experts(weights, backend, owns_weights=True))
            except BaseException as e:
                traceback.clear_frames(e.__traceback__)
                del weights
                stage.restore()  # this layer stays BF16 and whole
                raise
            stage.release()
            del m, weights  # the last references: the BF16 experts go before the next layer is quantized
            if verbose:
                logger.info("fp4moe: %s -> NVFP4 (%d/%d)", name, i + 1, len(modules))
    finally:
        stage.close()
    _quantize_linears(linear_groups, verbose)
    if fuse_router:
        fuse_routers(model)
    if fuse_shared_experts:
        fuse_shared(model)
    attach(model, quantizer_for(ModelOptConfig(quant_algo="W4A16_NVFP4", backend=backend, fuse_router=fuse_router,
                                               fuse_shared_experts=fuse_shared_experts)))
    return model


def patch_deepseek(model: nn.Module, *, backend: str = "auto", act_scale_mode: str | None = None,
                   quantize_dense_mlps: bool = False, quantize_attention: bool = False, fuse_router: bool = True,
                   fuse_shared_experts: bool = True, verbose: bool = True) -> nn.Module:
    """:func:`patch_moe` for DeepSeek-V3/R1 and kin (Kimi-K2, DeepSeek-V2, GLM4-MoE).

    ``model = patch_deepseek(AutoModelForCausalLM.from_pretrained(..., dtype=torch.bfloat16))``
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in DEEPSEEK_FAMILY:
        raise ValueError(
            f"patch_deepseek supports model types {DEEPSEEK_FAMILY}, got {model_type!r}; "
            "use hf_integration.patch_moe for other MoE models with Transformers experts modules")
    return patch_moe(model, backend=backend, act_scale_mode=act_scale_mode,
                     quantize_dense_mlps=quantize_dense_mlps, quantize_attention=quantize_attention,
                     fuse_router=fuse_router,
                     fuse_shared_experts=fuse_shared_experts, verbose=verbose)


def set_backend(model: nn.Module, backend: str, act_scale_mode: str | None = None) -> nn.Module:
    """Switch a model's experts (NVFP4 experts, gpt-oss's: every quantized kind that takes a backend)
    to another backend, and to NVFP4 activations with ``act_scale_mode`` (see
    :meth:`fp4moe_ops.PreparedExperts.set_backend`; gpt-oss's experts refuse it). Every layer is
    checked before any changes."""
    modules = [m for _, m in quantized_modules(model) if m.takes_backend]
    if not modules:
        raise ValueError("model has no fp4moe NVFP4 experts (nor gpt-oss ones); call patch_moe / patch_deepseek "
                         "or load an NVFP4 or gpt-oss MXFP4 checkpoint first")
    for m in modules:  # validate every layer first
        m.check_backend(backend, act_scale_mode)
    for m in modules:
        m.set_backend(backend, act_scale_mode)
    log_activation_modes(model)
    config = getattr(getattr(model, "hf_quantizer", None), "quantization_config", None)
    if isinstance(config, ModelOptConfig):  # a save writes the loading options (an MXFP4 checkpoint's are its own)
        config.backend = backend
        config.act_scale_mode = act_scale_mode
    return model


__all__ = ["DEEPSEEK_FAMILY", "patch_deepseek", "patch_moe", "quantize_linears", "set_backend"]
