"""The quantized module kinds: the list of fp4moe's module classes that hold checkpoint bytes, and
what each one answers, so that loading, saving, dequantizing, backends and logging ask the module
instead of branching on its class.

Every kind is a :class:`~fp4moe_ops.prepared.QuantizedBuffers` (its tensors, checked loads, casts
that keep the bytes) and answers, as methods and attributes of its class:

* ``dequantized_state(dtype, config)``: the state dict of the plain Transformers module it stands
  for, decoded to ``dtype`` (``model.dequantize()``; NotImplementedError saying why it cannot);
* ``save_refusal()`` and ``modelopt_tensors(name, converters)``: why it cannot be saved as a
  ModelOpt NVFP4 checkpoint (None: it can), and its tensors in that checkpoint's layout, under the
  state dict's keys of its whole subtree;
* ``takes_backend``, with ``check_backend(backend, act_scale_mode)`` / ``set_backend(backend,
  act_scale_mode)``: whether it runs on a backend of its choosing (checked, then set);
* ``packed_weight_count()``: the weights its packed tensors hold (the model's parameter count);
* ``holds_input_scales()``: whether it holds calibrated input scales (NVFP4 activations);
* for the kinds the ModelOpt loader creates (experts, linears, gpt-oss's NVFP4 experts):
  ``converter_checks_values`` (the converter that fills it checked its scale values; otherwise the
  loader checks them once loaded) and ``after_loading(config)``: the module that stands in its
  place once the checkpoint is in (itself, prepared; or a plain module of its decoded weights).

A new kind declares its tensors, answers these, and is added to :data:`KINDS`; the contract suite
(``tests/test_contract.py``) then runs on it.
"""

from __future__ import annotations

from torch import nn

from .experts import FP8Linear, NVFP4Experts, NVFP4Linear
from .gpt_oss import MXFP4GptOssExperts, NVFP4GptOssExperts
from .llama4 import NVFP4Llama4Experts, NVFP4Llama4TextMoe
from .mxfp4_layers import MXFP4Experts, MXFP4Linear
from .router import GroupedTopkRouter, SoftmaxTopkRouter
from .shared_experts import SharedExpertMoE

# (a subclass is its parent's kind for isinstance, so the fused shared expert's ExpertsWithShared
# needs no entry; Llama-4's experts have one: they answer differently)
KINDS: tuple[type[nn.Module], ...] = (NVFP4Experts, NVFP4Llama4Experts, SharedExpertMoE, NVFP4Linear, FP8Linear,
                                      MXFP4GptOssExperts, NVFP4GptOssExperts, MXFP4Experts, MXFP4Linear)
# every module fp4moe swaps into a Transformers model: the kinds, and those holding no checkpoint
# bytes of their own (fused routers, Llama-4's MoE block), which answer ``dequantized_state`` too
SWAPPED_IN: tuple[type[nn.Module], ...] = (*KINDS, GroupedTopkRouter, SoftmaxTopkRouter, NVFP4Llama4TextMoe)


def is_quantized(module: nn.Module) -> bool:
    return isinstance(module, KINDS)


def quantized_modules(model: nn.Module, outermost: bool = False) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every quantized module of ``model``; ``outermost``: not those inside
    another (a fused shared expert's own experts), which answers for its whole subtree."""
    found = []
    for name, m in model.named_modules():
        if not is_quantized(m):
            continue
        if outermost and any(not outer or name.startswith(f"{outer}.") for outer, _ in found):
            continue
        found.append((name, m))
    return found


__all__ = ["KINDS", "SWAPPED_IN", "is_quantized", "quantized_modules"]
