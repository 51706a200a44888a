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

from fp4moe_ops.nvfp4 import dequantize_nvfp4

from .expert_parallel import ExpertShard
from .experts import NVFP4Experts, NVFP4Linear
from .gpt_oss import NVFP4GptOssExperts
from .llama4 import NVFP4Llama4TextMoe
from .router import GroupedTopkRouter, SoftmaxTopkRouter
from .saving import atomic_save_pretrained
from .shared_experts import SharedExpertMoE
from .surgery import replace_module


def _experts_state(m: NVFP4Experts, dtype: torch.dtype, num_experts: int | None = None) -> dict[str, torch.Tensor]:
    """Transformers' fused experts tensors (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) of the
    first ``num_experts`` experts of ``m``."""
    w = m.canonical()
    e = w.num_experts if num_experts is None else num_experts
    return {"gate_up_proj": dequantize_nvfp4(w.w13[:e], w.w13_scale[:e], w.w13_global[:e], dtype),
            "down_proj": dequantize_nvfp4(w.w2[:e], w.w2_scale[:e], w.w2_global[:e], dtype)}


def _linear_state(m: NVFP4Linear, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    packed, block_scale, scale, _ = m.linear_tensors()
    weight = dequantize_nvfp4(packed, block_scale, scale, dtype)
    return {"weight": weight} | ({} if m.bias is None else {"bias": m.bias.to(dtype)})


def _shared_block_state(m: SharedExpertMoE, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The unfused block's tensors: its router, routed experts and the shared expert's three linears."""
    state = {f"gate.{k}": v for k, v in m.gate.state_dict().items()}
    state |= {f"experts.{k}": v for k, v in _experts_state(m.experts, dtype, m.num_routed).items()}
    shared = m.split()[1]
    inter = shared.intermediate_size
    w13 = dequantize_nvfp4(shared.w13[0], shared.w13_scale[0], shared.w13_global[0], dtype)
    state |= {"shared_experts.gate_proj.weight": w13[:inter], "shared_experts.up_proj.weight": w13[inter:],
              "shared_experts.down_proj.weight": dequantize_nvfp4(shared.w2[0], shared.w2_scale[0],
                                                                  shared.w2_global[0], dtype)}
    return state


def dequantize_model(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """Replace fp4moe's modules of ``model`` by Transformers' with decoded weights (see the module
    docstring); ``dtype``: of the decoded weights (default: the model's). Returns ``model``."""
    dtype = dtype or model.dtype
    if isinstance(dtype, str):  # config.dtype after a save_pretrained: "bfloat16"
        dtype = getattr(torch, dtype.removeprefix("torch."))
    for name, m in model.named_modules():
        if isinstance(m, NVFP4Llama4TextMoe):
            raise NotImplementedError(f"dequantize(): {name} is Llama-4's fused NVFP4 experts block, which fp4moe "
                                      "cannot turn back into Transformers' module; load the BF16 checkpoint instead")
        if isinstance(m, NVFP4Experts) and isinstance(m.dispatch, ExpertShard):
            raise NotImplementedError(f"dequantize(): {name} holds only this rank's experts (expert parallelism); "
                                      "dequantize an unsharded model")
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
        if isinstance(m, SharedExpertMoE):
            state = _shared_block_state(m, dtype)
        elif isinstance(m, NVFP4Experts):
            state = _experts_state(m, dtype)
        elif isinstance(m, NVFP4Linear):
            state = _linear_state(m, dtype)
        elif isinstance(m, (GroupedTopkRouter, SoftmaxTopkRouter)):
            state = m.state_dict()
        elif isinstance(m, NVFP4GptOssExperts):
            state = m.dequantized(config.get_text_config(), dtype).state_dict()
        else:
            continue
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
