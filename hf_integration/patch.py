"""Patch Transformers MoE models so their routed experts run in NVFP4 through
``torch.ops.fp4moe.fused_moe``.

Plugs in through Transformers' public experts machinery: every experts module decorated with
``@use_experts_implementation`` (DeepSeek-V2/V3, Kimi-K2, GLM4-MoE, Qwen3-MoE, Mixtral, ...)
dispatches its forward through ``ExpertsInterface``; we register ``"fp4moe"`` there and switch
the model with ``model.set_experts_implementation("fp4moe")``. Attention, shared experts and
dense MLPs are untouched (the last two can be quantized too, by option). DeepSeek-V3-style
group-limited routers (DeepSeek-V3/R1, Kimi-K2, GLM4-MoE) are swapped for
:class:`GroupedTopkRouter`: the same parameters and state-dict keys, the routing in one kernel
(``torch.ops.fp4moe.grouped_topk``) instead of Transformers' ~10 small ones.

Each patched experts module trades its BF16 parameters ``gate_up_proj [E, 2I, H]`` and
``down_proj [E, H, I]`` for NVFP4 buffers (ModelOpt-style names, so state dicts read naturally)::

    gate_up_proj_packed        [E, 2I, H/2]  uint8          E2M1 pairs, low nibble first
    gate_up_proj_scale         [E, 2I, H/16] float8_e4m3fn  block scales
    gate_up_proj_global_scale  [E]           float32
    down_proj_packed / down_proj_scale / down_proj_global_scale   (same for [E, H, I])
    fc1_input_scale, fc2_input_scale  [E] float32   only after calibration

A backend that keeps its own packed-weight layout (the Triton backend's paired words) holds it
in the ``*_packed`` buffers themselves, so the weights are not stored twice; ``state_dict()``
and ``nvfp4_weights()`` still give the canonical bytes. Backends with other tensors of their own
(FlashInfer) get extra non-persistent ``fp4moe_prepared_<i>`` buffers.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

import fp4moe_ops
from fp4moe_ops import NVFP4MoEWeights, nvfp4
from fp4moe_ops.backends import get_backend, resolve_backend
from fp4moe_ops.backends.base import canonical_layout

logger = logging.getLogger("fp4moe")

IMPLEMENTATION = "fp4moe"
DEEPSEEK_FAMILY = ("deepseek_v3", "kimi_k2", "deepseek_v2", "glm4_moe")
_CANONICAL = ("gate_up_proj_packed", "gate_up_proj_scale", "gate_up_proj_global_scale",
              "down_proj_packed", "down_proj_scale", "down_proj_global_scale")


# --- the experts forward registered in Transformers' ExpertsInterface ---------------------


def fp4moe_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor) -> torch.Tensor:
    """``ExpertsInterface`` entry: ``[T, H]`` hidden, ``[T, k]`` ids and weights -> ``[T, H]``."""
    if getattr(self, "_fp4moe_calibration", None) is not None:
        return _calibration_forward(self, hidden_states, top_k_index, top_k_weights)
    fc1, fc2 = self.fp4moe_act_scales()
    shard = getattr(self, "fp4moe_shard", None)
    if shard is not None:  # expert parallel: other ranks' experts become out-of-range sentinels
        top_k_index = top_k_index - shard.offset
    out = torch.ops.fp4moe.fused_moe(
        hidden_states, top_k_index, top_k_weights.float(), self.fp4moe_tensors(), fc1, fc2, self.fp4moe_backend,
        shard.count * shard.world_size if shard is not None else 0,
    )
    if shard is not None:
        from .expert_parallel import reduce_partial_outputs

        out = reduce_partial_outputs(out, shard)
    return out


def _register_implementation() -> None:
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPLEMENTATION, fp4moe_experts_forward)


# --- per-module state ---------------------------------------------------------------------


class _NVFP4ExpertsMixin:
    """Methods grafted onto a patched experts module (its class keeps its Transformers name)."""

    def nvfp4_weights(self) -> NVFP4MoEWeights:
        """The canonical NVFP4 weights (packed weights converted back if the backend keeps its
        own layout in the buffers)."""
        b = self._buffers
        tensors = [b[n] for n in _CANONICAL]
        tensors[0], tensors[3] = _canonical_packed(self, tensors[0], tensors[3])
        return NVFP4MoEWeights(*tensors, b.get("fc1_input_scale"), b.get("fc2_input_scale"))

    def fp4moe_tensors(self) -> list[torch.Tensor]:
        if self._fp4moe_prepared_count:
            return [self._buffers[f"fp4moe_prepared_{i}"] for i in range(self._fp4moe_prepared_count)]
        return canonical_layout([self._buffers[n] for n in _CANONICAL])  # no checks: every forward

    def fp4moe_act_scales(self):
        if self._fp4moe_act_mode is None:
            return None, None
        b = self._buffers
        return fp4moe_ops.activation_scales(b.get("fc1_input_scale"), b.get("fc2_input_scale"), self._fp4moe_act_mode)

    def fp4moe_extra_repr(self) -> str:
        e, two_i, h_blocks = self._buffers["gate_up_proj_scale"].shape
        acts = "NVFP4" if self._fp4moe_act_mode else "bf16"
        return (f"num_experts={e}, hidden={h_blocks * nvfp4.BLOCK_SIZE}, intermediate={two_i // 2}, "
                f"weights=NVFP4, activations={acts}, backend={self.fp4moe_backend!r}")


def _canonical_packed(module: nn.Module, w13: torch.Tensor, w2: torch.Tensor):
    if w13.dtype == torch.uint8:
        return w13, w2
    return get_backend(module.fp4moe_backend).canonical_packed(w13, w2)


def _canonical_state_dict_hook(module, state_dict, prefix, local_metadata):
    """State dicts always hold canonical packed weights, whatever layout the backend keeps."""
    keys = (prefix + "gate_up_proj_packed", prefix + "down_proj_packed")
    if all(k in state_dict for k in keys):
        state_dict[keys[0]], state_dict[keys[1]] = _canonical_packed(module, *(state_dict[k] for k in keys))


def _backend_layout_load_hook(module, state_dict, prefix, *args):
    """Loading canonical packed weights into a module whose backend keeps its own layout."""
    keys = (prefix + "gate_up_proj_packed", prefix + "down_proj_packed")
    if all(k in state_dict for k in keys) and module._buffers["gate_up_proj_packed"].dtype != torch.uint8:
        new = get_backend(module.fp4moe_backend).relayout_packed(*(state_dict[k] for k in keys))
        state_dict[keys[0]], state_dict[keys[1]] = new


def _set_backend(module: nn.Module, backend: str, act_scale_mode: str | None) -> None:
    """Prepare the module's experts for ``backend``. A backend that only re-lays out the packed
    weights (``owns_packed_layout``) gets them in the module's own buffers, so they are not held
    twice; other backends with their own tensors get extra ``fp4moe_prepared_<i>`` buffers."""
    weights = module.nvfp4_weights()
    have_scales = weights.fc1_input_scale is not None and weights.fc2_input_scale is not None
    b = resolve_backend(backend, weights.device, have_activation_scales=have_scales)
    prepared = fp4moe_ops.prepare_experts(weights, b.name, act_scale_mode)
    for i in range(getattr(module, "_fp4moe_prepared_count", 0)):
        module._buffers.pop(f"fp4moe_prepared_{i}", None)
    canonical = canonical_layout(weights.tensors())
    module._buffers["gate_up_proj_packed"], module._buffers["down_proj_packed"] = weights.w13, weights.w2
    same = len(prepared.tensors) == len(canonical) and all(
        p.data_ptr() == c.data_ptr() for p, c in zip(prepared.tensors, canonical))
    if b.owns_packed_layout:
        if not all(prepared.tensors[i].data_ptr() == canonical[i].data_ptr() for i in (1, 2, 4, 5)):
            raise AssertionError(f"backend {b.name!r} owns the packed layout but changed other tensors")
        module._buffers["gate_up_proj_packed"], module._buffers["down_proj_packed"] = prepared.tensors[0], prepared.tensors[3]
        same = True
    module._fp4moe_prepared_count = 0 if same else len(prepared.tensors)
    if not same:
        for i, t in enumerate(prepared.tensors):
            module.register_buffer(f"fp4moe_prepared_{i}", t, persistent=False)
    module.fp4moe_backend = b.name
    module._fp4moe_act_mode = (act_scale_mode or "per_expert") if prepared.fc1_act_scale is not None else None


class NVFP4GatedMLP(nn.Module):
    """A dense gated MLP ``down(silu(gate(x)) * up(x))`` (DeepSeek's dense layers and shared
    experts) in NVFP4, computed by the same op as a one-expert MoE with every token routed to
    it with weight 1. Buffers as in a patched experts module, with E = 1."""

    def __init__(self, weights: NVFP4MoEWeights, backend: str):
        super().__init__()
        install_nvfp4_experts(self, weights, backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        ids = torch.zeros(flat.shape[0], 1, dtype=torch.int32, device=x.device)
        ones = torch.ones(flat.shape[0], 1, dtype=torch.float32, device=x.device)
        out = torch.ops.fp4moe.fused_moe(flat, ids, ones, self.fp4moe_tensors(), None, None, self.fp4moe_backend)
        return out.reshape(x.shape)


def _children_where(model: nn.Module, predicate) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, module) of every submodule for which ``predicate(module)`` holds:
    what :func:`_replace_module` needs to swap it."""
    return [(parent, attr, m) for parent in model.modules() for attr, m in parent.named_children() if predicate(m)]


def _is_dense_gated_mlp(m: nn.Module) -> bool:
    lin = [getattr(m, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    return all(isinstance(x, nn.Linear) and x.bias is None for x in lin) and isinstance(
        getattr(m, "act_fn", None), nn.Module) and type(m.act_fn).__name__ in ("SiLUActivation", "SiLU")


def _dense_gated_mlps(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, module) of bias-free SiLU gated MLPs outside the routed experts."""
    return _children_where(model, _is_dense_gated_mlp)


def _quantize_dense_mlp(m: nn.Module, backend: str) -> NVFP4GatedMLP:
    with torch.no_grad():
        gate_up = torch.cat([m.gate_proj.weight, m.up_proj.weight])[None]
        w = fp4moe_ops.quantize_moe_weights(gate_up, m.down_proj.weight[None])
    return NVFP4GatedMLP(w, backend)


# Transformers routers that compute exactly fp4moe::grouped_topk's definition (sigmoid scores,
# correction bias for choosing, group score = sum of the top 2, renormalize, scale).
GROUPED_TOPK_ROUTERS = ("DeepseekV3TopkRouter", "Glm4MoeTopkRouter")


class GroupedTopkRouter(nn.Module):
    """Drop-in for a DeepSeek-V3-style router (:data:`GROUPED_TOPK_ROUTERS`): the same
    ``weight [E, H]`` parameter (float32 or the model's dtype) and ``e_score_correction_bias [E]``
    buffer, so the same state-dict keys, and the same outputs ``(logits [T, E] float32,
    weights [T, k] float32, ids [T, k] int64)``; the group-limited top-k runs as one
    ``fp4moe::grouped_topk`` op. Off CUDA the results are bitwise Transformers'; on CUDA the
    logits' summation order differs, so a near-tied token may pick another expert."""

    def __init__(self, router: nn.Module):
        super().__init__()
        self.weight = router.weight
        persistent = "e_score_correction_bias" not in router._non_persistent_buffers_set
        self.register_buffer("e_score_correction_bias", router.e_score_correction_bias, persistent=persistent)
        for name in ("hidden_dim", "num_experts", "num_group", "topk_group", "top_k", "norm_topk_prob",
                     "routed_scaling_factor"):
            setattr(self, name, getattr(router, name))

    def forward(self, hidden_states: torch.Tensor):
        x = hidden_states.view(-1, self.hidden_dim)
        if x.is_cuda and x.dtype == self.weight.dtype == torch.bfloat16:
            # Transformers casts both to float32 first (a float32 copy of the weight per call, and
            # an fp32 GEMM: 0.6 ms per layer at 8192 tokens). bf16 x bf16 products are exact in
            # fp32, so one bf16 GEMM with fp32 accumulation and output gives the same logits up
            # to summation order.
            logits = torch.mm(x, self.weight.t(), out_dtype=torch.float32)
        else:
            logits = nn.functional.linear(x.float(), self.weight.float())
        weights, ids = torch.ops.fp4moe.grouped_topk(  # bias: float32 math, as Transformers' add promotes
            logits, self.e_score_correction_bias.float(), self.num_group, self.topk_group, self.top_k,
            bool(self.norm_topk_prob), float(self.routed_scaling_factor))
        return logits, weights, ids

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, groups={self.num_group}, topk_group={self.topk_group}, "
                f"top_k={self.top_k}, op=fp4moe::grouped_topk")


def _grouped_topk_routers(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, router) of the routers :class:`GroupedTopkRouter` replaces."""
    return _children_where(model, lambda m: type(m).__name__ in GROUPED_TOPK_ROUTERS)


def fuse_routers(model: nn.Module) -> int:
    """Swap every DeepSeek-V3-style router for a :class:`GroupedTopkRouter`; returns how many."""
    routers = _grouped_topk_routers(model)
    for parent, attr, m in routers:
        _replace_module(parent, attr, GroupedTopkRouter(m))
    return len(routers)


def _replace_module(parent: nn.Module, attr: str, new: nn.Module) -> None:
    """``parent.attr = new``, keeping an accelerate hook (device_map dispatch) the old one had."""
    old = getattr(parent, attr)
    setattr(parent, attr, new)
    if hasattr(old, "_hf_hook"):
        from accelerate.hooks import add_hook_to_module

        add_hook_to_module(new, old._hf_hook)


# --- patching -----------------------------------------------------------------------------


def find_experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Experts modules that Transformers dispatches through ``ExpertsInterface``."""
    found = []
    for name, m in model.named_modules():
        if hasattr(m, "is_concatenated") and hasattr(m, "has_gate") and (
            isinstance(getattr(m, "gate_up_proj", None), torch.Tensor) or "gate_up_proj_packed" in m._buffers
        ):
            found.append((name, m))
    return found


def _check_experts(name: str, m: nn.Module) -> None:
    if "gate_up_proj_packed" in m._buffers:
        raise ValueError(f"model is already patched by fp4moe ({name} holds NVFP4 experts)")
    problems = []
    if not m.has_gate or not m.is_concatenated or m.is_transposed or m.has_bias:
        problems.append("only gated, concatenated [gate; up], untransposed, bias-free experts are supported")
    act = getattr(m, "act_fn", None)
    if act is not None and not isinstance(act, nn.SiLU) and type(act).__name__ not in ("SiLUActivation", "SiLU"):
        problems.append(f"activation {type(act).__name__} is not SiLU")
    e, two_i, h = m.gate_up_proj.shape
    if h % nvfp4.BLOCK_SIZE or (two_i // 2) % nvfp4.BLOCK_SIZE:
        problems.append(f"hidden {h} and intermediate {two_i // 2} must be multiples of {nvfp4.BLOCK_SIZE}")
    if m.gate_up_proj.device.type == "meta":
        problems.append("weights are on the meta device (not loaded)")
    if problems:
        raise ValueError(f"cannot patch {name} ({type(m).__name__}): " + "; ".join(problems))


def patch_moe(model: nn.Module, *, backend: str = "auto", act_scale_mode: str | None = None,
              quantize_dense_mlps: bool = False, fuse_router: bool = True, verbose: bool = True) -> nn.Module:
    """Quantize every routed-experts module of ``model`` to NVFP4 and run it through the op.

    Args:
        model: a loaded Transformers MoE model (``DeepseekV3ForCausalLM``, Qwen3-MoE, ...).
        backend: ``"auto"`` (fastest exact backend for the experts' device), or a name from
            ``fp4moe_ops.BACKENDS``. Checked for every layer's device before anything changes.
        act_scale_mode: None (16-bit activations); ``"per_expert"`` / ``"global_max"`` need
            calibrated scales, so they apply through :func:`set_backend` after
            :func:`calibrate_activation_scales`.
        quantize_dense_mlps: also run dense gated MLPs (shared experts, DeepSeek's first dense
            layers) in NVFP4 through the op, as one-expert MoEs. Off by default: the checkpoint's
            own format for them is kept.
        fuse_router: replace DeepSeek-V3-style routers by :class:`GroupedTopkRouter` (same
            parameters, same experts chosen up to near ties, one kernel instead of ~10). Off:
            Transformers' router runs.
        verbose: log one progress line per layer.

    Quantizes expert by expert on the experts' own device and frees each layer's BF16 weights
    before the next layer, so peak memory stays near the BF16 model's size. All modules are
    validated first: on an error nothing is changed.
    """
    modules = find_experts_modules(model)
    if not modules:
        raise ValueError(f"{type(model).__name__} has no Transformers experts modules to patch")
    for name, m in modules:
        _check_experts(name, m)
    for name, m in modules:  # every layer's device can run the backend (uncalibrated: W4A16 only)
        resolve_backend(backend, m.gate_up_proj.device)
    dense = _dense_gated_mlps(model) if quantize_dense_mlps else []
    for _, attr, m in dense:
        h, i = m.gate_proj.in_features, m.gate_proj.out_features
        if h % nvfp4.BLOCK_SIZE or i % nvfp4.BLOCK_SIZE:
            raise ValueError(f"cannot quantize dense MLP {attr}: sizes {h}, {i} must be multiples of {nvfp4.BLOCK_SIZE}")
    if act_scale_mode is not None:
        raise ValueError(f"act_scale_mode={act_scale_mode!r} needs calibrated activation scales: patch first, "
                         "then calibrate_activation_scales(model, batches), then set_backend(model, backend, mode)")

    for i, (name, m) in enumerate(modules):
        with torch.no_grad():
            w = fp4moe_ops.quantize_moe_weights(m.gate_up_proj.data, m.down_proj.data)
        del m.gate_up_proj, m.down_proj  # free the BF16 copy before the next layer
        install_nvfp4_experts(m, w, backend)
        if verbose:
            logger.info("fp4moe: %s -> NVFP4 (%d/%d, backend %s)", name, i + 1, len(modules), m.fp4moe_backend)
    for parent, attr, m in dense:
        _replace_module(parent, attr, _quantize_dense_mlp(m, backend))
    if fuse_router:
        fuse_routers(model)
    use_fp4moe(model)
    return model


def install_nvfp4_experts(module: nn.Module, weights: NVFP4MoEWeights, backend: str = "auto") -> None:
    """Give an experts module (its ``gate_up_proj``/``down_proj`` already removed) NVFP4 buffers
    and the fp4moe methods, prepared for ``backend``."""
    for buf_name, t in zip(_CANONICAL, weights.tensors()):
        module.register_buffer(buf_name, t)
    for name in ("fc1_input_scale", "fc2_input_scale"):
        if getattr(weights, name) is not None:
            module.register_buffer(name, getattr(weights, name))
    for method in ("nvfp4_weights", "fp4moe_tensors", "fp4moe_act_scales"):
        setattr(module, method, getattr(_NVFP4ExpertsMixin, method).__get__(module))
    module.extra_repr = _NVFP4ExpertsMixin.fp4moe_extra_repr.__get__(module)
    if not getattr(module, "_fp4moe_hooks", False):
        module._register_state_dict_hook(_canonical_state_dict_hook)
        module._register_load_state_dict_pre_hook(_backend_layout_load_hook, with_module=True)
        module._fp4moe_hooks = True
    module.fp4moe_backend = None  # buffers are canonical until _set_backend
    _set_backend(module, backend, None)


def use_fp4moe(model: nn.Module) -> None:
    """Route the model's experts modules through fp4moe (Transformers' ExpertsInterface)."""
    _register_implementation()
    model.set_experts_implementation(IMPLEMENTATION)


def patch_deepseek(model: nn.Module, *, backend: str = "auto", act_scale_mode: str | None = None,
                   quantize_dense_mlps: bool = False, fuse_router: bool = True, verbose: bool = True) -> nn.Module:
    """:func:`patch_moe` for DeepSeek-V3/R1 and kin (Kimi-K2, DeepSeek-V2, GLM4-MoE).

    ``model = patch_deepseek(AutoModelForCausalLM.from_pretrained(..., dtype=torch.bfloat16))``
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in DEEPSEEK_FAMILY:
        raise ValueError(
            f"patch_deepseek supports model types {DEEPSEEK_FAMILY}, got {model_type!r}; "
            "use hf_integration.patch_moe for other MoE models with Transformers experts modules")
    return patch_moe(model, backend=backend, act_scale_mode=act_scale_mode,
                     quantize_dense_mlps=quantize_dense_mlps, fuse_router=fuse_router, verbose=verbose)


def set_backend(model: nn.Module, backend: str, act_scale_mode: str | None = None) -> nn.Module:
    """Switch a patched model's experts to another backend, and to NVFP4 activations with
    ``act_scale_mode`` (see :func:`fp4moe_ops.prepare_experts`); re-prepares every layer."""
    modules = [(n, m) for n, m in find_experts_modules(model) if "gate_up_proj_packed" in m._buffers]
    if not modules:
        raise ValueError("model is not patched by fp4moe; call patch_moe / patch_deepseek first")
    for _, m in modules:  # validate every layer first
        w = m.nvfp4_weights()
        resolve_backend(backend, w.device, have_activation_scales=w.fc1_input_scale is not None)
    for _, m in modules:
        _set_backend(m, backend, act_scale_mode)
    return model


# --- calibration for the NVFP4 x NVFP4 path -----------------------------------------------


def _calibration_forward(self, hidden_states, top_k_index, top_k_weights):
    """Reference W4A16 math, recording each expert's GEMM1/GEMM2 input amax."""
    amax1, amax2 = self._fp4moe_calibration
    w = self.nvfp4_weights()
    inter = w.intermediate_size
    out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
    for e in top_k_index.unique().tolist():
        if not 0 <= e < w.num_experts:
            continue
        token, slot = torch.where(top_k_index == e)
        x = hidden_states[token]
        amax1[e] = torch.maximum(amax1[e], x.float().abs().max())
        w13 = nvfp4.dequantize_nvfp4(w.w13[e], w.w13_scale[e], w.w13_global[e])
        h = x.float() @ w13.T
        act = (nn.functional.silu(h[:, :inter]) * h[:, inter:]).to(hidden_states.dtype)
        amax2[e] = torch.maximum(amax2[e], act.float().abs().max())
        y = act.float() @ nvfp4.dequantize_nvfp4(w.w2[e], w.w2_scale[e], w.w2_global[e]).T
        out.index_add_(0, token, y * top_k_weights[token, slot, None].float())
    return out.to(hidden_states.dtype)


@torch.no_grad()
def calibrate_activation_scales(model: nn.Module, batches: Iterable) -> nn.Module:
    """Record per-expert activation amax for GEMM1 and GEMM2 inputs over ``batches`` and store
    ModelOpt's ``input_scale = amax / (6*448)`` as ``fc1_input_scale`` / ``fc2_input_scale``.

    ``batches``: dicts of model kwargs (e.g. tokenizer output) or ``input_ids`` tensors. Experts
    no batch routed to get the layer's largest scale (logged). Needed only by
    ``backend="flashinfer_nvfp4"``; then ``set_backend(model, "flashinfer_nvfp4")``.
    """
    modules = [m for _, m in find_experts_modules(model) if "gate_up_proj_packed" in m._buffers]
    if not modules:
        raise ValueError("model is not patched by fp4moe; call patch_moe / patch_deepseek first")
    for m in modules:
        e = m._buffers["gate_up_proj_packed"].shape[0]
        dev = m._buffers["gate_up_proj_packed"].device
        m._fp4moe_calibration = (torch.zeros(e, device=dev), torch.zeros(e, device=dev))
    try:
        n = 0
        for batch in batches:
            model(**batch) if isinstance(batch, dict) else model(batch)
            n += 1
        if n == 0:
            raise ValueError("calibrate_activation_scales got no batches")
    finally:
        stats = [m.__dict__.pop("_fp4moe_calibration") for m in modules]
    unseen = 0
    for m, (amax1, amax2) in zip(modules, stats):
        unseen += int((amax1 == 0).sum())
        amax1 = torch.where(amax1 > 0, amax1, amax1.max()).clamp_min(1e-12)
        amax2 = torch.where(amax2 > 0, amax2, amax2.max()).clamp_min(1e-12)
        denom = nvfp4.E2M1_MAX * nvfp4.E4M3_MAX
        m.register_buffer("fc1_input_scale", (amax1 / denom).float())
        m.register_buffer("fc2_input_scale", (amax2 / denom).float())
    if unseen:
        logger.warning("fp4moe calibration: %d experts saw no tokens; they use their layer's largest scale", unseen)
    return model
