"""Quantizing a 16-bit checkpoint's routed experts to NVFP4 while ``from_pretrained`` loads it:
``from_pretrained(<bf16 folder>, quantization_config=ModelOptConfig())``, as Transformers' own
quantization configs (FP8, bitsandbytes) quantize a 16-bit checkpoint while loading.

* Before loading, every routed-experts module of the meta model that fp4moe's NVFP4 experts can
  stand for (SiLU-gated, concatenated ``[gate; up]``, no biases: what ``patch_moe`` quantizes)
  becomes an :class:`~hf_integration.experts.NVFP4Experts`. Besides its NVFP4 buffers it holds two
  meta placeholders under Transformers' names, ``gate_up_proj`` and ``down_proj``, so that
  Transformers' own converters (per-expert checkpoint tensors -> one stacked tensor) collect the
  checkpoint's tensors for them.
* Each time one of those stacked 16-bit tensors is ready, :class:`QuantizeWhileLoading` (Transformers'
  quantize step) checks it (finite, the module's shape) and quantizes it with ModelOpt's recipe
  (the one ``patch_moe`` uses, ``quantize_expert_stack``) on the device it was loaded to, and
  Transformers sets the result into the module's NVFP4 buffers; the placeholder and the 16-bit
  tensor are dropped. One projection of one
  layer exists in 16 bits at a time, beside what Transformers holds in flight.
* With ``quantize_dense_mlps`` / ``quantize_attention``, those ``nn.Linear`` s become
  :class:`~hf_integration.experts.NVFP4Linear` s the same way (their packed ``weight`` buffer has
  the checkpoint's name; until quantized it has the 16-bit weight's shape and dtype). Linears that share one global scale (an
  MLP's gate and up, attention's q/k/v: one GEMM in vLLM and SGLang) need the whole group's
  maximum first: each member's 16-bit weight waits until the group's last one arrives, then the
  group is quantized on one scale, as ``quantize_linears`` does.
* The rest of the model (routers, embeddings, what is not configured) loads as the checkpoint has
  it; a problem is raised once loading is done, naming the module and tensor, and the model is not
  returned.

Everything is W4A16 (no input scales), as after ``patch_moe``: the same model, bit for bit;
``save_pretrained`` then writes a ModelOpt NVFP4 checkpoint. Experts fp4moe cannot quantize
(Llama-4's, gpt-oss's) are refused.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.core_model_loading import ConversionOps

from fp4moe_ops import nvfp4
from fp4moe_ops.moe_weights import expert_chunks, quantize_expert_stack

from .checkpoint_format import MODELOPT, CheckpointError
from .experts import NVFP4Experts, NVFP4Linear, weight_amax
from .fused_linears import linear_groups
from .llama4 import is_llama4_experts
from .surgery import is_transformers_experts, nvfp4_experts_problem, replace_module

PLACEHOLDERS = ("gate_up_proj", "down_proj")  # Transformers' names; each quantizes into "<name>_packed" ...
_NVFP4_SUFFIXES = ("_packed", "_scale", "_global_scale")


def experts_to_quantize(model: nn.Module, skip=lambda name: False) -> list[str]:
    """The routed-experts modules of the meta ``model`` to quantize while loading (names), those
    ``skip(name)`` names (the config's ``exclude_modules``) left out. CheckpointError for experts
    fp4moe cannot quantize, naming the module and why."""
    names = []
    for name, m in model.named_modules():
        if is_llama4_experts(m) and not skip(name):
            raise CheckpointError(f"fp4moe cannot quantize {name} ({type(m).__name__}) while loading: Llama-4's "
                                  "fused experts are read from NVFP4 checkpoints only. Load the 16-bit model without "
                                  "quantization_config")
        if not is_transformers_experts(m) or skip(name):
            continue
        problem = nvfp4_experts_problem(m)
        if problem is not None:
            raise CheckpointError(f"fp4moe cannot quantize {name} ({type(m).__name__}) while loading: {problem}. "
                                  "Load the 16-bit model without quantization_config")
        names.append(name)
    return names


class LinearGroup:
    """Linears quantized on one global scale while loading: their 16-bit weights, by module name,
    until every member's has arrived."""

    def __init__(self, names: list[str]):
        self.names = names
        self.pending: dict[str, torch.Tensor] = {}
        self.arrived: set[str] = set()


def linears_to_quantize(model: nn.Module, dense_mlps: bool, attention: bool, skip=lambda name: False) -> list[list[str]]:
    """The groups of ``nn.Linear`` names (each on one global scale) of ``model``'s dense gated MLPs
    and/or attention modules, as ``quantize_linears`` groups them; those ``skip`` names left out."""
    groups = []
    for name, m, kind, leaves in linear_groups(model, dense_mlps, attention):
        for group in leaves:
            names = [f"{name}.{leaf}" for leaf in group if not skip(f"{name}.{leaf}")]
            for full in names:
                lin = model.get_submodule(full)
                if lin.in_features % nvfp4.BLOCK_SIZE:
                    raise CheckpointError(f"fp4moe cannot quantize {full} ({kind}) while loading: in_features "
                                          f"{lin.in_features} must be a multiple of {nvfp4.BLOCK_SIZE}")
            if names:
                groups.append(names)
    return groups


def replace_linears_for_loading(model: nn.Module, groups: list[list[str]]) -> None:
    """Each linear becomes an NVFP4Linear waiting for its group (module docstring)."""
    for names in groups:
        group = LinearGroup(names)
        for name in names:
            linear = model.get_submodule(name)
            with torch.device("meta"):
                new = NVFP4Linear(linear, MODELOPT, input_scale=False)
                # until it is quantized, the packed weight's buffer holds the 16-bit weight's shape and
                # dtype: Transformers (5.17) casts what it reads to the buffer's dtype before the
                # quantize step sees it
                new.register_buffer(MODELOPT.packed, torch.empty(linear.weight.shape, dtype=linear.weight.dtype))
            new.quantizes_at_load = True
            new.load_group = group
            parent, _, attr = name.rpartition(".")
            replace_module(model.get_submodule(parent), attr, new)


def replace_for_loading(model: nn.Module, names: list[str]) -> None:
    """Each named experts module becomes an NVFP4Experts with the two placeholders (module docstring)."""
    for name in names:
        m = model.get_submodule(name)
        e, two_i, h = m.gate_up_proj.shape
        with torch.device("meta"):
            new = NVFP4Experts(None, None, num_experts=e, hidden_size=h, intermediate_size=two_i // 2)
            for placeholder in PLACEHOLDERS:
                source = getattr(m, placeholder)
                new.register_buffer(placeholder, torch.empty(source.shape, dtype=source.dtype))
        new.quantizes_at_load = True
        parent, _, attr = name.rpartition(".")
        replace_module(model.get_submodule(parent), attr, new)


def is_placeholder(model: nn.Module, key: str) -> bool:
    """Whether ``key`` names a 16-bit checkpoint tensor a module quantizes into NVFP4 while loading:
    an experts placeholder, or a waiting linear's ``weight``."""
    module_name, _, tensor = key.rpartition(".")
    try:
        m = model.get_submodule(module_name)
    except AttributeError:
        return False
    if not getattr(m, "quantizes_at_load", False):
        return False
    return tensor == "weight" if hasattr(m, "load_group") else tensor in PLACEHOLDERS and tensor in m._buffers


def left_unfilled(model: nn.Module) -> list[str]:
    """The 16-bit tensors no checkpoint tensor came for (``module.tensor``)."""
    missing = []
    for name, m in model.named_modules():
        if not getattr(m, "quantizes_at_load", False):
            continue
        if hasattr(m, "load_group"):  # never arrived (its group's others wait for it)
            if name not in m.load_group.arrived:
                missing.append(f"{name}.weight")
        else:
            missing += [f"{name}.{p}" for p in PLACEHOLDERS if p in m._buffers]
    return missing


def finish_loading(model: nn.Module) -> None:
    """After loading: the modules are NVFP4 modules like any other (the placeholders are gone)."""
    for m in model.modules():
        if getattr(m, "quantizes_at_load", False):
            del m.quantizes_at_load
            if hasattr(m, "load_group"):
                del m.load_group


class QuantizeWhileLoading(ConversionOps):
    """Transformers' quantize step: an experts placeholder's stacked 16-bit tensor becomes its three
    NVFP4 tensors, under the module's buffer names, for Transformers to set; a linear's weight
    waits for its group (:meth:`_linear`). Errors are kept by the
    quantizer (``load_errors``) and raised once loading is done (Transformers' loader would log
    them and go on)."""

    def __init__(self, hf_quantizer):
        self.hf_quantizer = hf_quantizer

    def convert(self, input_dict: dict, model=None, full_layer_name: str | None = None, missing_keys=None,
                **kwargs) -> dict:
        (value,) = input_dict.values()
        input_dict.clear()
        value = value[0] if isinstance(value, list) else value
        module_name, _, proj = full_layer_name.rpartition(".")
        m = model.get_submodule(module_name)
        if hasattr(m, "load_group"):
            return self._linear(model, m.load_group, module_name, value, missing_keys)
        try:
            quantized = _quantize(full_layer_name, value, m._buffers[proj])
        except CheckpointError as exc:
            self.hf_quantizer.load_errors.append(exc)
            return {}
        del value, m._buffers[proj]  # the placeholder: from here on, the NVFP4 buffers stand for it
        if missing_keys is not None:
            missing_keys.discard(full_layer_name)
        return {f"{full_layer_name}{suffix}": t for suffix, t in zip(_NVFP4_SUFFIXES, quantized)}


    def _linear(self, model, group: LinearGroup, name: str, value: torch.Tensor, missing_keys) -> dict:
        """A linear's 16-bit weight waits for its group; the group's last one quantizes them all on
        the group's global scale (``quantize_linears``' recipe)."""
        lin = model.get_submodule(name)
        want = (lin.out_features, lin.in_features)
        try:
            if tuple(value.shape) != want or not value.is_floating_point():
                raise CheckpointError(f"checkpoint tensor {name}.weight: {value.dtype} {list(value.shape)}, the "
                                      f"model expects a 16-bit {list(want)} weight")
            if not bool(torch.isfinite(weight_amax(value))):
                raise CheckpointError(f"checkpoint tensor {name}.weight holds NaN or Inf")
        except CheckpointError as exc:
            self.hf_quantizer.load_errors.append(exc)
            return {}
        group.arrived.add(name)
        group.pending[name] = value.to(lin.dtype)
        if len(group.pending) < len(group.names):
            return {}
        weights, group.pending = group.pending, {}
        scale = nvfp4.global_scale_from_amax(torch.stack([weight_amax(w) for w in weights.values()]).amax())
        return {f"{member}.{tensor}": t for member, w in weights.items()
                for tensor, t in NVFP4Linear.quantized_tensors(w, scale).items()}


def _quantize(key: str, value: torch.Tensor, placeholder: torch.Tensor):
    if tuple(value.shape) != tuple(placeholder.shape):
        raise CheckpointError(f"checkpoint tensor(s) for {key}: stacked shape {list(value.shape)}, the model "
                              f"expects {list(placeholder.shape)}")
    if not value.is_floating_point():
        raise CheckpointError(f"checkpoint tensor(s) for {key} are {value.dtype}, not 16-bit weights")
    for e0, e1 in expert_chunks(value):
        finite = torch.isfinite(value[e0:e1]).flatten(1).all(dim=1)
        if not bool(finite.all()):
            bad = (e0 + (~finite).nonzero().flatten()).tolist()
            raise CheckpointError(f"checkpoint tensor(s) for {key} hold NaN or Inf (experts {bad[:8]})")
    return quantize_expert_stack(value.to(placeholder.dtype))


__all__ = ["PLACEHOLDERS", "LinearGroup", "QuantizeWhileLoading", "experts_to_quantize", "finish_loading",
           "is_placeholder", "left_unfilled", "linears_to_quantize", "replace_for_loading",
           "replace_linears_for_loading"]
