"""fp4moe's Transformers quantizer: ``AutoModelForCausalLM.from_pretrained`` of ModelOpt NVFP4
checkpoints, and ``save_pretrained`` back to the same format.

Importing :mod:`hf_integration` registers :class:`ModelOptQuantizer` for ``quant_method:
"modelopt"``. Transformers then does what it does for any checkpoint (download and cache,
index and shards, ``device_map`` placement through accelerate, the LOAD REPORT, progress bars) and
calls this quantizer at its plug-in points:

* before loading, on the meta model: the load plan (:mod:`hf_integration.load_plan`: every
  safetensors header read, no tensor bytes; which modules are NVFP4, decided from the files; every
  NVFP4 tensor's presence, dtype and shape checked, a
  :class:`~hf_integration.checkpoint_format.CheckpointError` naming file and tensor otherwise), then
  :class:`~hf_integration.experts.NVFP4Experts` swapped in for the routed experts and
  :class:`~hf_integration.experts.NVFP4Linear` for other NVFP4 linears;
* the weight conversion: Transformers' own per-expert -> stacked-experts converters are replaced
  by ones that stack the per-expert NVFP4 tensors as they are read
  (:mod:`hf_integration.expert_conversion`: file bytes straight into the stacked buffers, never BF16);
* after loading: NVFP4 linears outside the experts stay
  :class:`~hf_integration.experts.NVFP4Linear` (or become ``nn.Linear`` with dequantized weights
  with ``nvfp4_linears="dequantize"``),
  the experts are prepared for a backend, routers are fused, and the model is marked quantized
  (``model.hf_quantizer``): dtype casts keep the scales, switching the experts implementation away
  from fp4moe fails at the call, ``save_pretrained`` writes a ModelOpt checkpoint atomically.

A 16-bit checkpoint given this quantization config has its routed experts quantized while it
loads (:mod:`hf_integration.quantize_at_load`: Transformers' ``get_quantize_ops`` step, the same
recipe as ``patch_moe``).

Which quantizer wins if Transformers ever ships its own ``"modelopt"``: fp4moe's, once
``hf_integration`` is imported (a log line says it replaced Transformers' entry).
"""

from __future__ import annotations

import os
import re
import sys
import types
from collections import OrderedDict

import torch
from torch import nn
from transformers.quantizers import HfQuantizer
from transformers.utils import logging

from fp4moe_ops.moe_weights import check_scale_values, check_weight_range
from fp4moe_ops.prepared import check_incoming_tensors, rename_old_input_scales

from .experts import FP8Linear, NVFP4Experts, NVFP4Linear
from .checkpoint_format import (
    KV_CACHE_SCALES,
    QUANT_METHOD,
    CheckpointError,
    CompressedTensorsNVFP4Config,
    ModelOptConfig,
    expert_converter_targets,
)
from .expert_conversion import converters_for, is_ours
from .activation_modes import log_activation_modes
from .fused_linears import tie_fused_linears
from .gpt_oss import NVFP4GptOssExperts
from .load_plan import CheckpointScan, LoadPlan, check_float_tensors, plan_load, read_kv_cache_scales, refuse_meta_device
from .kinds import quantized_modules
from .llama4 import NVFP4Llama4Experts, NVFP4Llama4TextMoe
from .router import fuse_routers
from .shared_experts import fuse_shared_experts
from .surgery import replace_module

logger = logging.get_logger("transformers.fp4moe")  # under Transformers: set_verbosity_* applies


# --- the quantizer ------------------------------------------------------------------------------


class CurrentDtypeDequantize:
    """``model.dequantize(dtype)`` for fp4moe's quantizers: decoded into ``dtype``, by default the
    dtype the model holds now (Transformers' default, the dtype it was loaded in, is stale after
    ``model.to(torch.float16)`` and would leave decoded weights of one dtype beside activations of
    another). A quantizer supplies ``_dequantize(model, dtype)``."""

    def dequantize(self, model, dtype=None):
        dtype = dtype if dtype is not None else model.dtype
        model = self._dequantize(model, dtype=dtype)
        self.remove_quantization_config(model)
        model.config.dtype = dtype
        return model


class ModelOptQuantizer(CurrentDtypeDequantize, HfQuantizer):
    """Loads ModelOpt NVFP4 checkpoints with NVFP4 routed experts; see the module docstring."""

    requires_calibration = False

    def __init__(self, quantization_config: ModelOptConfig, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.plan: LoadPlan | None = None
        self.kv_cache_scales: dict[str, torch.Tensor] = {}  # FP8 KV-cache scales, by model key (not used)
        self.load_errors: list[CheckpointError] = []  # found while converting, raised once loading is done

    def validate_environment(self, *args, device_map=None, **kwargs):
        # called before the plan exists (the device_map as given: checked again once the plan is
        # made, in _process_model_before_weight_loading) and after "auto" placed the modules
        refuse_meta_device(device_map)
        if self.plan is not None:
            self._refuse_nvfp4_on_disk(device_map, inferred=True)

    def _refuse_nvfp4_on_disk(self, device_map, inferred: bool = False) -> None:
        """Raise ValueError naming the first NVFP4 module ``device_map`` puts on disk: accelerate's
        disk offload round-trips parameters through numpy files, and the quantized tensors are
        buffers the quantizer fills itself. BF16 modules (an ``lm_head``, say) may go to disk."""
        if not isinstance(device_map, dict) or "disk" not in device_map.values():
            return
        for name in [*self.plan.experts, *self.plan.gpt_oss, *self.plan.linears]:
            for key, where in device_map.items():
                if where == "disk" and (key == "" or name == key or name.startswith(key + ".") or key.startswith(name + ".")):
                    hint = ("raise max_memory (or leave it out) so that every NVFP4 module fits on the GPUs and the CPU"
                            if inferred else "put it on a GPU or the CPU in device_map")
                    raise ValueError(f"fp4moe cannot offload the NVFP4 module {name!r} to disk (device_map entry "
                                     f"{key!r}: 'disk'); {hint}")

    def update_dtype(self, dtype):
        if dtype not in (torch.bfloat16, torch.float16):
            logger.warning("fp4moe: NVFP4 experts run with 16-bit activations; loading in bfloat16 instead of %s "
                           "(pass dtype=torch.bfloat16 or torch.float16)", dtype)
            return torch.bfloat16
        return dtype

    def param_element_size(self, model, param_name, param):
        # a checkpoint linear becomes a 16-bit nn.Linear after loading (2 weights per packed NVFP4
        # byte), unless NVFP4 linears are kept as they are
        module, _, tensor = param_name.rpartition(".")
        if getattr(self, "quantizing", None):
            from .quantize_at_load import is_placeholder

            if is_placeholder(model, param_name):
                # an experts placeholder: quantized into the NVFP4 buffers, which count themselves; a
                # linear's 16-bit weight: its own buffer, half a byte a weight once packed
                return 0.5 if tensor == "weight" else 0
        kind = self.plan.linears.get(module, (None,))[0] if self.plan is not None else None
        if kind == "nvfp4" and self.quantization_config.nvfp4_linears == "nvfp4":
            return param.element_size()
        if kind is not None and tensor in ("weight", self.plan.scheme.packed):
            return (2 if kind == "nvfp4" else 1) * torch.finfo(model.dtype).bits // 8
        return param.element_size()

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        if not checkpoint_files or not all(str(f).endswith(".safetensors") for f in checkpoint_files):
            raise CheckpointError(f"fp4moe loads ModelOpt checkpoints from .safetensors files, got {checkpoint_files}")
        self.pre_quantized = True  # also when the config came from hf_quant_config.json
        self.quantizing: list[str] = []  # experts quantized while loading a 16-bit checkpoint
        if self.quantization_config.expert_parallel and self.quantization_config.fuse_shared_experts:
            raise ValueError("fuse_shared_experts=True and expert_parallel=True cannot be combined: a rank holds a "
                             "shard of the routed experts, which cannot also hold the shared expert; load with one of them")
        shard_of = None
        if self.quantization_config.expert_parallel:
            from .expert_parallel import this_rank_shard

            shard_of = this_rank_shard
        files = [str(f) for f in checkpoint_files]
        scan = CheckpointScan(files)
        scan.check_index(files)
        self.plan = plan_load(model, scan, self.quantization_config, shard_of)
        if not (self.plan.experts or self.plan.gpt_oss or self.plan.linears):
            # a 16-bit checkpoint given a quantization config: its routed experts are quantized as they load
            return self._quantize_while_loading(model, os.path.dirname(files[0]) or ".", kwargs.get("device_map"))
        if self.quantization_config.quantize_dense_mlps or self.quantization_config.quantize_attention:
            logger.warning("fp4moe: quantize_dense_mlps / quantize_attention apply to a 16-bit checkpoint quantized "
                           "while loading; this checkpoint is NVFP4, and its own tensors decide which linears are")
        check_float_tensors(model, scan, self.plan)
        self._refuse_nvfp4_on_disk(kwargs.get("device_map"))
        if self.plan.gpt_oss and self.quantization_config.expert_parallel:
            raise ValueError("expert_parallel=True: fp4moe does not split gpt-oss's experts over ranks yet; load "
                             "without it")
        text_config = model.config.get_text_config()
        for name, m in list(model.named_modules()):
            parent_name, _, attr = name.rpartition(".")
            if name in self.plan.gpt_oss:
                with torch.device("meta"):
                    p = self.plan.gpt_oss[name]
                    p.bias_dtype = m.gate_up_proj_bias.dtype
                    new = NVFP4GptOssExperts(text_config, dtype=p.bias_dtype, input_scales=p.input_scales,
                                             per_expert_scales=p.per_expert is not None)
                replace_module(model.get_submodule(parent_name), attr, new)
            elif name in self.plan.experts:
                p = self.plan.experts[name]
                kind = NVFP4Llama4Experts if p.fused else NVFP4Experts
                new = kind(None, None, num_experts=len(p.ids), hidden_size=p.hidden, intermediate_size=p.inter,
                           input_scales=p.input_scales)
                if shard_of is not None:
                    from .expert_parallel import use_shard

                    use_shard(new, shard_of(p.total))
                if p.fused:  # Llama-4: the whole MoE block changes (the router score scales the input)
                    block_name, _, block_attr = parent_name.rpartition(".")
                    new = NVFP4Llama4TextMoe(model.get_submodule(parent_name), new)
                    replace_module(model.get_submodule(block_name), block_attr, new)
                else:
                    replace_module(model.get_submodule(parent_name), attr, new)
            elif name in self.plan.linears:
                kind, has_input = self.plan.linears[name]
                new = NVFP4Linear(m, self.plan.scheme, has_input) if kind == "nvfp4" else FP8Linear(m, has_input)
                replace_module(model.get_submodule(parent_name), attr, new)
        ignore = getattr(model, "_keys_to_ignore_on_load_unexpected", None)
        model._keys_to_ignore_on_load_unexpected = set(ignore or [])
        self.kv_cache_scales = {}
        kv_algo = self.quantization_config.kv_cache_quant_algo
        if kv_algo == "FP8":  # a save writes them back under this name (the only KV format it writes)
            self.kv_cache_scales = read_kv_cache_scales(model, files, scan)
            logger.warning("fp4moe: the checkpoint's FP8 KV-cache scales (k_scale, v_scale) are not used; the KV "
                           "cache stays in the model dtype (its %d scales are kept for save_pretrained)",
                           len(self.kv_cache_scales))
        elif kv_algo:
            logger.warning("fp4moe: the checkpoint's KV-cache scales (k_scale, v_scale; KV cache %s) are not used, "
                           "and save_pretrained does not write them back: the KV cache stays in the model dtype",
                           kv_algo)
        if kv_algo:
            model._keys_to_ignore_on_load_unexpected.add(rf"\.({'|'.join(KV_CACHE_SCALES)})$")
        if shard_of is not None:  # other ranks' experts: never read, not reported
            for p in self.plan.experts.values():
                model._keys_to_ignore_on_load_unexpected.add(rf"{re.escape(p.name.split('.')[-1])}\.\d+\.")
        return model

    def _quantize_while_loading(self, model, folder: str, device_map):
        """A 16-bit checkpoint's routed experts quantized to NVFP4 as they load
        (:mod:`hf_integration.quantize_at_load`)."""
        from fnmatch import fnmatch

        from .quantize_at_load import (experts_to_quantize, linears_to_quantize, replace_for_loading,
                                       replace_linears_for_loading)

        config = self.quantization_config
        if config.expert_parallel:
            raise ValueError("expert_parallel=True: fp4moe does not quantize while loading a rank's shard; load "
                             "without it, or from an NVFP4 checkpoint")
        if isinstance(device_map, dict) and "disk" in device_map.values():
            raise ValueError("fp4moe cannot quantize while loading with modules offloaded to disk (device_map has "
                             "'disk'); put every layer on a GPU or the CPU")
        patterns = config.exclude_modules
        excluded = lambda name: any(fnmatch(name, p) for p in patterns)  # noqa: E731
        names = experts_to_quantize(model, skip=excluded)
        if not names:
            raise CheckpointError(
                f"{folder} holds no quantized tensors fp4moe loads, and the model has no routed experts fp4moe "
                "quantizes while loading: load it without quantization_config")
        linears = linears_to_quantize(model, config.quantize_dense_mlps, config.quantize_attention, skip=excluded)
        if config.quant_algo != "W4A16_NVFP4":
            logger.warning("fp4moe: quantizing %s's routed experts while loading, weights only (W4A16_NVFP4): "
                           "activation scales (%s) need calibration, hf_integration.calibrate_activation_scales",
                           folder, config.quant_algo)
        replace_for_loading(model, names)
        replace_linears_for_loading(model, linears)
        self.quantizing = names + [name for group in linears for name in group]
        self.pre_quantized = False  # Transformers then runs get_quantize_ops on what param_needs_quantization names
        return model

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        from .quantize_at_load import is_placeholder

        return bool(self.quantizing) and is_placeholder(model, param_name)

    def get_quantize_ops(self):
        from .quantize_at_load import QuantizeWhileLoading

        return QuantizeWhileLoading(self)

    def update_weight_conversions(self, weight_conversions, model=None):
        """Transformers' per-expert -> stacked converters of the NVFP4 experts give way to ours."""
        kept = []
        for c in weight_conversions:
            found = expert_converter_targets(c) if hasattr(c, "operations") else None
            if found is not None and any(name.endswith(found[0]) for name in self.plan.experts):
                continue
            kept.append(c)
        return converters_for(self.plan, self) + kept

    def _process_model_after_weight_loading(self, model, **kwargs):
        if self.load_errors:
            raise self.load_errors[0]
        if self.quantizing:
            from .quantize_at_load import finish_loading, left_unfilled

            missing = left_unfilled(model)
            if missing:
                raise CheckpointError(f"the checkpoint has no weights for {missing[0]}"
                                      f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}: "
                                      "nothing to quantize it from")
            finish_loading(model)
            self.pre_quantized = True  # what is loaded now is quantized (saving, reloading)
        check_all_filled(model)
        loaded = quantized_modules(model)
        # every value checked before any module changes (those a converter filled: as they arrived,
        # under the file's per-expert keys)
        for name, m in loaded:
            if m.converter_checks_values:
                continue
            for tensor, kind in m.scale_checks():
                key = self._checkpoint_key(name, tensor)
                values = m._buffers[tensor]
                try:  # (a gpt-oss layer's [E, K/16, N] block scales: named per expert)
                    check_scale_values(values if values.dim() == 3 else values[None] if kind == "block"
                                       else values.reshape(-1), kind,
                                       lambda e, key=key: f"checkpoint tensor {key!r} in {self.plan.files.get(key)}")
                except ValueError as exc:
                    raise CheckpointError(str(exc)) from None
            for block, scale, to_multiplier in m.weight_ranges():  # valid: in range?
                key = self._checkpoint_key(name, scale)
                values, multiplier = m._buffers[block], m._buffers[scale]
                multiplier = (to_multiplier(multiplier) if to_multiplier is not None else multiplier).reshape(1)
                try:
                    check_weight_range(values if values.dim() == 3 else values[None],
                                       multiplier.expand(values.shape[0] if values.dim() == 3 else 1),
                                       lambda e, key=key: f"checkpoint tensor {key!r} in {self.plan.files.get(key)}")
                except ValueError as exc:
                    raise CheckpointError(str(exc)) from None
        config = self.quantization_config
        if config.nvfp4_linears == "nvfp4":  # kept in 4 bits, and saved so: one scale per fused GEMM
            tied = tie_fused_linears(model)
            if tied:
                logger.warning("fp4moe: %d sets of linears that vLLM and SGLang run as one GEMM had different "
                               "weight_scale_2 or input_scale (%s); used their max and rescaled the others' block "
                               "scales (re-rounded to E4M3)", len(tied), ", ".join(tied[:3]) + (" ..." if len(tied) > 3 else ""))
        for name, m in loaded:  # prepared for the backend, kept, or replaced by its decoded plain module
            try:
                ready = m.after_loading(config)
            except ValueError as exc:  # (a backend that cannot run them, say): name the layer
                raise ValueError(f"{name}: {exc}") from exc
            if ready is not m:
                parent, _, attr = name.rpartition(".")
                replace_module(model.get_submodule(parent), attr, ready)
        if config.fuse_router:
            fuse_routers(model)
        if config.fuse_shared_experts and config.nvfp4_linears == "nvfp4":
            fuse_shared_experts(model)
        for m in model.modules():  # the linears kept: paired on Hopper (the small-batch kernel reads that)
            if isinstance(m, NVFP4Linear):
                m.set_layout(m.kernel_layout())
        log_activation_modes(model)
        conversions = getattr(model, "_weight_conversions", None)
        if conversions:  # saving goes through get_state_dict_and_metadata, not reverse conversion
            model._weight_conversions = [c for c in conversions if not is_ours(c)]
        attach(model, self)
        return model

    def _checkpoint_key(self, name: str, tensor: str) -> str:
        """The checkpoint's key of a gpt-oss experts module's tensor, else the module path's."""
        p = self.plan.gpt_oss.get(name)
        return f"{p.checkpoint_prefix}.{tensor}" if p is not None else f"{name}.{tensor}"

    def get_state_dict_and_metadata(self, model):
        from .saving import modelopt_state_dict

        return modelopt_state_dict(model), {}

    def is_serializable(self, *args, **kwargs):
        return True

    def saved_quantization_config(self, model) -> ModelOptConfig:
        """The quantization config ``save_pretrained`` writes (also as ``hf_quant_config.json``)."""
        from .saving import saved_config

        return saved_config(model, self.quantization_config)

    def _dequantize(self, model, dtype=None):
        """``model.dequantize()``: :func:`hf_integration.dequantize.dequantize_model`."""
        from .dequantize import dequantize_model

        return dequantize_model(model, dtype)

    @property
    def is_trainable(self) -> bool:
        # adapters (PEFT LoRA) train on a frozen NVFP4 model: the ops pass gradients to their
        # activations (fp4moe_ops/autograd.py), never to the quantized tensors
        return True

    @property
    def is_compileable(self) -> bool:
        return True


# --- marking a model quantized ------------------------------------------------------------------


def attach(model: nn.Module, quantizer: ModelOptQuantizer) -> None:
    """Mark ``model`` quantized the Hugging Face way and give it fp4moe's guards:

    * ``model.hf_quantizer`` / ``is_quantized`` / ``config.quantization_config``: Transformers then
      refuses ``.half()`` / ``.float()``, compiles ``generate`` (``is_compileable``) and saves through
      the quantizer (the NVFP4 modules also keep their dtypes under ``model.to(dtype)``);
    * ``model.to(dtype)`` to a dtype the experts' op does not run (float32) and ``.double()`` raise
      at the call, leaving the model as it was (the forward would fail later, naming no cause);
      a ``to`` already on the model (accelerate's guard of a dispatched model) still runs after;
    * ``load_state_dict`` checks every incoming scale value of the model's NVFP4 modules before
      any module changes (each module also checks its own, as it loads);
    * ``set_experts_implementation`` away from fp4moe raises at the call;
    * continuous batching (``generate_batch``, ``init_continuous_batching``) of an MLA model raises at
      the call where Transformers' paged cache cannot hold MLA (:func:`_refuse_continuous_batching`)
      instead of returning empty outputs;
    * ``save_pretrained`` writes a ModelOpt checkpoint atomically (:mod:`hf_integration.saving`).
    """
    model.hf_quantizer = quantizer
    model.is_quantized = True
    model.quantization_method = QUANT_METHOD
    model.config.quantization_config = quantizer.quantization_config
    model.config._is_quantized = True
    register_experts_implementation()
    if getattr(type(model), "set_experts_implementation", None) is not None and model._can_set_experts_implementation():
        # says what runs, and keeps generate() from switching grouped_mm -> batched_mm around decoding
        type(model).set_experts_implementation(model, EXPERTS_IMPLEMENTATION)
    model.set_experts_implementation = types.MethodType(_guarded_set_experts_implementation, model)
    if uses_mla(model.config) and not paged_cache_holds_mla() and hasattr(type(model), "init_continuous_batching"):
        # generate_batch and `transformers serve --continuous-batching` start here
        model.init_continuous_batching = types.MethodType(_refuse_continuous_batching, model)
    model.num_parameters = types.MethodType(_num_parameters, model)
    attach_guards(model)


def attach_guards(model: nn.Module) -> None:
    """The guards every model holding fp4moe's quantized modules gets, whatever their format (the
    modules' own contract, :class:`~fp4moe_ops.prepared.QuantizedBuffers`, made model-wide):

    * ``model.to(dtype)`` / ``.double()`` to a dtype one of its quantized modules does not run
      (``COMPUTE_DTYPES``) raise at the call, leaving the model as it was; a ``to`` already on the
      model (accelerate's guard of a dispatched model) still runs after;
    * ``load_state_dict`` checks every incoming tensor of every quantized module before any module
      changes (each module also checks its own, as it loads, which alone would leave the earlier
      modules loaded), and with ``strict=True`` refuses a missing declared tensor first;
    * ``save_pretrained`` is atomic and replaces the whole checkpoint of the folder it saves into
      (:func:`hf_integration.saving.atomic_save_pretrained`);
    * on CUDA, ``generate()`` reads its stop flag one step late instead of waiting for the GPU at
      every step (:mod:`hf_integration.deferred_stop`)."""
    from .deferred_stop import defer_stop_checks
    from .saving import atomic_save_pretrained

    model.save_pretrained = types.MethodType(atomic_save_pretrained, model)
    defer_stop_checks(model)
    if getattr(model.__dict__.get("to"), "__func__", None) is not _guarded_to:  # (attached once)
        model._fp4moe_next_to = model.__dict__.get("to")  # accelerate's, on a dispatched model
        model.to = types.MethodType(_guarded_to, model)
        model.double = types.MethodType(_guarded_double, model)
        model.load_state_dict = types.MethodType(_guarded_load_state_dict, model)
        model._register_load_state_dict_pre_hook(_check_model_scales, with_module=True)


EXPERTS_IMPLEMENTATION = "fp4moe"


def _bf16_experts_forward(self, *args, **kwargs):
    """``"fp4moe"`` in Transformers' ExpertsInterface: fp4moe's NVFP4Experts never dispatch through
    it; an experts module still holding BF16 weights (not NVFP4 in the checkpoint) runs
    Transformers' grouped_mm."""
    from transformers.integrations.moe import ExpertsInterface

    return ExpertsInterface._global_mapping["grouped_mm"](self, *args, **kwargs)


def register_experts_implementation() -> None:
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(EXPERTS_IMPLEMENTATION, _bf16_experts_forward)


def check_all_filled(model: nn.Module) -> None:
    """Every quantized module's tensors were filled from the checkpoint (Transformers marks what it
    loads): none is left as uninitialized memory. Checked before any module is prepared."""
    for name, m in quantized_modules(model):
        for buf_name, buf in m.named_buffers(recurse=False):
            if buf_name in m._non_persistent_buffers_set:
                continue
            if buf.is_meta or not getattr(buf, "_is_hf_initialized", False):
                raise CheckpointError(f"{name}.{buf_name} was not filled from the checkpoint")


def _guarded_to(model, *args, **kwargs):
    """``model.to(...)``: any device, and the dtypes every quantized module's op runs (its
    ``COMPUTE_DTYPES``: NVFP4 experts bfloat16 and float16, gpt-oss's experts and NVFP4 linears
    float32 too); another dtype is refused before anything moves, naming the experts first (they
    set the dtypes a model runs)."""
    dtype = torch._C._nn._parse_to(*args, **kwargs)[1]
    if dtype is not None:
        for name, m in sorted(model.named_modules(), key=lambda item: not getattr(item[1], "takes_backend", False)):
            runs = getattr(m, "COMPUTE_DTYPES", None)
            if runs is not None and dtype not in runs:
                names = " or ".join(str(d).removeprefix("torch.") for d in runs)
                raise ValueError(f"model.to({dtype}): {name} ({type(m).__name__}) runs {names} activations only, so "
                                 "the model's float parts must stay in one of those (model.to(torch.float16) works); "
                                 "the model is left as it was")
    inner = model.__dict__.get("_fp4moe_next_to")
    return inner(*args, **kwargs) if inner is not None else type(model).to(model, *args, **kwargs)


def _num_parameters(model, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
    """Transformers' ``num_parameters`` plus the NVFP4 weights, which are buffers (two per packed
    byte, as Transformers counts bitsandbytes' 4-bit weights): the model's logical weight count.
    Frozen, so not counted with ``only_trainable``."""
    total = type(model).num_parameters(model, only_trainable=only_trainable, exclude_embeddings=exclude_embeddings)
    if only_trainable:
        return total
    return total + sum(m.packed_weight_count() for _, m in quantized_modules(model))


def _check_model_scales(model, state_dict, prefix, *args):
    """The model's own pre-hook runs before any module loads: a bad tensor of a quantized module
    anywhere is refused with the model untouched (the modules' hooks alone would leave the earlier
    modules loaded)."""
    rename_old_input_scales(model, state_dict, prefix)  # (torch's copy of the caller's state dict)
    check_incoming_tensors(model, state_dict, prefix)


def _guarded_load_state_dict(model, state_dict, strict: bool = True, assign: bool = False):
    """``model.load_state_dict``: with ``strict=True``, a tensor a quantized module declares that is
    missing is refused before anything changes (torch loads the others first and reports it at the
    end; its hooks are told strict=True whatever the call says, so the check is made here)."""
    if strict:
        metadata = getattr(state_dict, "_metadata", None)
        state_dict = OrderedDict(state_dict)  # (a copy, as torch's load makes: the caller's keeps its keys)
        if metadata is not None:
            state_dict._metadata = metadata
        rename_old_input_scales(model, state_dict)
        check_incoming_tensors(model, state_dict, "", strict=True)
    return type(model).load_state_dict(model, state_dict, strict=strict, assign=assign)


def _guarded_double(model):
    return _guarded_to(model, torch.float64)  # (Transformers refuses .half() and .float() itself)


def _guarded_set_experts_implementation(model, experts_implementation):
    values = experts_implementation.values() if isinstance(experts_implementation, dict) else [experts_implementation]
    if all(v == EXPERTS_IMPLEMENTATION for v in values):
        return
    raise ValueError(
        f"set_experts_implementation({experts_implementation!r}): this model's routed experts are fp4moe "
        "NVFP4Experts modules, which only fp4moe's op can run; Transformers' implementations need BF16 weights. "
        "Choose the kernel with hf_integration.set_backend(model, ...)")


def uses_mla(config) -> bool:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): keys and values of different head sizes."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "kv_lora_rank", None) is not None


def paged_cache_holds_mla() -> bool:
    """Whether Transformers' paged KV cache (continuous batching) runs MLA models: from 5.25 on (its
    BF16 DeepSeek-V2/V3 and fp4moe's under ``generate_batch`` are token-equal to greedy ``generate``,
    tests/test_continuous_batching.py); 5.24 and before fail inside the cache at every step."""
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__).release >= (5, 25)


def _refuse_continuous_batching(model, *args, **kwargs):
    """``init_continuous_batching`` of an MLA model where :func:`paged_cache_holds_mla` is false:
    refused at the call. Transformers' MLA attention
    caches one head of compressed latents per token (``kv_lora_rank`` values as the "keys",
    ``qk_rope_head_dim`` rotary keys as the "values"); its paged cache allocates ``num_key_value_heads``
    heads of one ``head_dim`` for keys and values alike. Every step then fails inside the cache, and
    ``generate_batch`` returns every request with no tokens, the error only in a log line (the BF16
    model does the same). Running it needs a paged cache with per-layer key and value sizes."""
    text = model.config.get_text_config()
    raise NotImplementedError(
        f"continuous batching (generate_batch, init_continuous_batching, transformers serve --continuous-batching) "
        f"does not run {type(model).__name__}: its multi-head latent attention caches 1 head of "
        f"{text.kv_lora_rank} latents and {text.qk_rope_head_dim} rotary keys per token, and Transformers' paged "
        f"KV cache holds {getattr(text, 'num_key_value_heads', None)} heads of head_dim={getattr(text, 'head_dim', None)} "
        "for keys and values alike (the BF16 model fails inside the cache too, returning empty outputs). "
        f"Transformers 5.25 and later run it; this is {__import__('transformers').__version__}. "
        "Or use model.generate on a padded batch")


def quantizer_for(config: ModelOptConfig) -> ModelOptQuantizer:
    return ModelOptQuantizer(config, pre_quantized=True)


# --- registration -------------------------------------------------------------------------------


def register() -> None:
    """Register ``"modelopt"`` with Transformers, and route NVFP4 compressed-tensors checkpoints (and
    those of :data:`COMPRESSED_TENSORS_FORMATS`) to fp4moe (idempotent). If Transformers ships its own ``"modelopt"`` quantizer, fp4moe's replaces
    it (logged once); every other compressed-tensors checkpoint still goes to Transformers' own
    compressed-tensors quantizer."""
    from transformers.quantizers import auto

    start_up_hook = sys.modules.get("fp4moe_autoload")
    if start_up_hook is not None:  # an installed fp4moe: its stand-ins give way to Transformers' own entries first
        start_up_hook.restore(auto)
    current = auto.AUTO_QUANTIZER_MAPPING.get(QUANT_METHOD)
    if current is not ModelOptQuantizer:
        if current is not None:
            logger.warning("fp4moe: replacing Transformers' own %r quantizer (%s) with fp4moe's", QUANT_METHOD,
                           getattr(current, "__name__", current))
        auto.AUTO_QUANTIZER_MAPPING[QUANT_METHOD] = ModelOptQuantizer
        auto.AUTO_QUANTIZATION_CONFIG_MAPPING[QUANT_METHOD] = ModelOptConfig
    # options passed to from_pretrained(quantization_config=ModelOptConfig(...)) override the
    # checkpoint's, as for Transformers' own FP8 and MXFP4 configs
    if ModelOptConfig not in auto.LOADING_ATTRIBUTES_CONFIG_TYPES:
        auto.LOADING_ATTRIBUTES_CONFIG_TYPES = (*auto.LOADING_ATTRIBUTES_CONFIG_TYPES, ModelOptConfig)
    ct = "compressed-tensors"
    if not isinstance(auto.AUTO_QUANTIZATION_CONFIG_MAPPING.get(ct), _NVFP4CompressedTensorsConfigs):
        auto.AUTO_QUANTIZATION_CONFIG_MAPPING[ct] = _NVFP4CompressedTensorsConfigs(auto.AUTO_QUANTIZATION_CONFIG_MAPPING.get(ct))
        auto.AUTO_QUANTIZER_MAPPING[ct] = _NVFP4CompressedTensorsQuantizers(auto.AUTO_QUANTIZER_MAPPING.get(ct))


# The compressed-tensors formats fp4moe reads, each ``(is_format(config dict), config class,
# quantizer class)``: NVFP4 here, the others added by their module's ``register()`` (MXFP4:
# hf_integration.compressed_mxfp4)
COMPRESSED_TENSORS_FORMATS: list[tuple] = [
    (CompressedTensorsNVFP4Config.is_nvfp4, CompressedTensorsNVFP4Config, ModelOptQuantizer)]


class _NVFP4CompressedTensorsConfigs:
    """Transformers' ``"compressed-tensors"`` config entry: a config of a format in
    :data:`COMPRESSED_TENSORS_FORMATS` (NVFP4: every group ``nvfp4-pack-quantized``) becomes that
    format's config class, any other goes to Transformers' own class (as without fp4moe: dense and
    other quantized checkpoints are untouched)."""

    def __init__(self, transformers_config):
        self.transformers_config = transformers_config

    def from_dict(self, config_dict, **kwargs):
        for is_format, config_class, _ in COMPRESSED_TENSORS_FORMATS:
            if is_format(config_dict):
                return config_class.from_dict(config_dict, **kwargs)
        return self.transformers_config.from_dict(config_dict, **kwargs)


class _NVFP4CompressedTensorsQuantizers:
    """Transformers' ``"compressed-tensors"`` quantizer entry: fp4moe's loader for the formats of
    :data:`COMPRESSED_TENSORS_FORMATS`, Transformers' own quantizer for anything else."""

    def __init__(self, transformers_quantizer):
        self.transformers_quantizer = transformers_quantizer

    def __call__(self, quantization_config, **kwargs):
        for _, config_class, quantizer_class in COMPRESSED_TENSORS_FORMATS:
            if isinstance(quantization_config, config_class):
                return quantizer_class(quantization_config, **kwargs)
        return self.transformers_quantizer(quantization_config, **kwargs)


__all__ = ["COMPRESSED_TENSORS_FORMATS", "CurrentDtypeDequantize", "ModelOptQuantizer", "attach", "attach_guards", "check_all_filled", "paged_cache_holds_mla", "quantizer_for", "register", "uses_mla"]
