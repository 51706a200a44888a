"""``model.dequantize()`` for fp4moe models: every module fp4moe put in (NVFP4 experts, NVFP4 linears,
the fused router, a shared expert run inside the routed call) goes back to the Transformers module
it replaced, holding the decoded weights (``e2m1 x block scale x global scale`` in float32, rounded
once to the model dtype: the weights the float model computes with), and the model is an ordinary
Transformers model again (no quantizer, no quantization config, its default experts
implementation) whose ``save_pretrained`` stays atomic and replaces the whole checkpoint of the
folder it saves into (:mod:`hf_integration.saving`).

The Transformers modules come from a skeleton of the model built on the meta device from its
config, so each is of the class and shape the model's own code makes; each takes its tensors with
``load_state_dict(strict=True, assign=True)``, so a tensor left unset is an error, never
uninitialized memory. Everything is decoded and checked before the first module is swapped: a
failure leaves the model as it was. Llama-4's fused experts and expert-parallel shards are refused.
"""

from __future__ import annotations

import copy
import types

import torch
from torch import nn

from .kinds import SWAPPED_IN
from .saving import atomic_save_pretrained
from .surgery import replace_module


def dequantize_model(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """Replace fp4moe's modules of ``model`` by Transformers' with decoded weights (see the module
    docstring); ``dtype``: of the decoded weights (default: the model's). Returns ``model``."""
    dtype = dtype or model.dtype
    if isinstance(dtype, str):  # config.dtype after a save_pretrained: "bfloat16"
        dtype = getattr(torch, dtype.removeprefix("torch."))
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        skeleton = type(model)(config)
    # outermost first: a fused block's own experts and router are not taken twice
    plan, inside = [], set()
    for name, m in model.named_modules():
        if any(name.startswith(p + ".") for p in inside):
            continue
        if not isinstance(m, SWAPPED_IN):
            continue
        try:
            state = m.dequantized_state(dtype, config)
        except NotImplementedError as exc:
            raise NotImplementedError(f"dequantize(): {name} {exc}") from None
        inside.add(name)
        original = skeleton.get_submodule(name)
        original.load_state_dict(state, strict=True, assign=True)
        left = [n for n, t in (*original.named_parameters(), *original.named_buffers()) if t.is_meta]
        if left:
            raise RuntimeError(f"dequantize(): {name}'s Transformers module has tensors fp4moe does not hold: {left}")
        plan.append((name, original))
    for name, original in plan:
        parent, _, attr = name.rpartition(".")
        replace_module(model.get_submodule(parent), attr, original)
    inner = model.__dict__.get("_fp4moe_next_to")  # accelerate's to(), which the dtype guard ran
    for attr in ("to", "double", "num_parameters", "set_experts_implementation", "_fp4moe_next_to"):
        model.__dict__.pop(attr, None)
    # the atomic save stays: saved into the folder of its NVFP4 checkpoint, the BF16 model's files
    # replace that checkpoint's whole (hf_quant_config.json would label the BF16 weights NVFP4)
    model.save_pretrained = types.MethodType(atomic_save_pretrained, model)
    if inner is not None:
        model.to = inner
    hooks = model._load_state_dict_pre_hooks
    for key in [k for k, h in hooks.items() if getattr(h, "hook", h).__name__ == "_check_model_scales"]:
        del hooks[key]
    default = getattr(model, "get_correct_experts_implementation", None)
    if default is not None and getattr(type(model), "set_experts_implementation", None) is not None:
        type(model).set_experts_implementation(model, default(None))
    return model


__all__ = ["dequantize_model"]
