"""fp4moe's Transformers quantizer for gpt-oss's MXFP4 checkpoints (``quant_method: "mxfp4"``).

``from_pretrained`` of a gpt-oss checkpoint (OpenAI's layout: :mod:`fp4moe_ops.mxfp4`) then keeps
the routed experts in MXFP4 on every device: :class:`~hf_integration.gpt_oss.MXFP4GptOssExperts`
takes the place of ``GptOssExperts`` on the meta model, the checkpoint's ``*_blocks`` / ``*_scales``
bytes load straight into it (no conversion op, never a BF16 copy of the experts), and its forward
is one ``fp4moe::gpt_oss_moe`` call (``auto``: the ``triton`` backend on Hopper and newer, else the
``reference`` backend, with a warning on a GPU). ``save_pretrained`` writes the
same tensors back under the same names, so the saved checkpoint is the published format again,
byte for byte.

Which quantizer wins for ``"mxfp4"``: once :mod:`hf_integration` is imported, fp4moe's, except

* ``quantization_config=Mxfp4Config(dequantize=True)``: Transformers' own quantizer, which
  dequantizes the experts to BF16 (what was asked for);
* the environment variable ``FP4MOE_MXFP4=transformers`` (read at each load): Transformers' own
  quantizer for every MXFP4 checkpoint (its Hub ``kernels`` on a GPU; on the CPU it dequantizes);
  ``FP4MOE_MXFP4=fp4moe`` or unset: fp4moe's; any other value is refused, naming it.

Before loading, every checkpoint tensor of the experts (biases included) is checked from the
safetensors headers (presence, dtype, shape: a
:class:`~hf_integration.checkpoint_format.CheckpointError` naming the tensor and its file); after
loading, every scale byte by the experts module's own rules (E8M0's NaN 0xFF, and bytes whose
weights decode past bfloat16's range, are refused, naming the tensor). A layer that
``modules_to_not_convert`` names while the checkpoint holds it in MXFP4 is refused (Transformers
would leave it randomly initialised). The loaded model gets fp4moe's model-wide guards
(:func:`hf_integration.quantizer.attach_guards`: checked ``load_state_dict``, refused casts, atomic
saves).
"""

from __future__ import annotations

import torch
from transformers.quantizers import HfQuantizer
from transformers.quantizers.quantizers_utils import should_convert_module
from transformers.utils import logging

from fp4moe_ops.env import env_choice
from fp4moe_ops.moe_weights import check_scale_values
from fp4moe_ops.mxfp4 import BIAS_DTYPES

from .checkpoint_format import CheckpointError
from .gpt_oss import MIN_TRANSFORMERS, MXFP4GptOssExperts, is_gpt_oss_experts, supported
from .quantizer import CheckpointScan, CurrentDtypeDequantize, attach_guards, refuse_meta_device
from .surgery import replace_module

logger = logging.get_logger("transformers.fp4moe")

QUANT_METHOD = "mxfp4"
ENV_VAR = "FP4MOE_MXFP4"  # "transformers": Transformers' own quantizer for MXFP4 checkpoints; "fp4moe" (default)


def wants_transformers_quantizer(quantization_config) -> bool:
    """Transformers' own quantizer handles this load: ``dequantize=True`` was asked for, or
    ``FP4MOE_MXFP4=transformers``."""
    return bool(getattr(quantization_config, "dequantize", False)) or \
        env_choice(ENV_VAR, ("fp4moe", "transformers"), "fp4moe") == "transformers"


class MXFP4Quantizer(CurrentDtypeDequantize, HfQuantizer):
    """Loads gpt-oss MXFP4 checkpoints with the experts kept in MXFP4 (see the module docstring)."""

    requires_calibration = False

    def __init__(self, quantization_config, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.experts: dict[str, dict[str, str]] = {}  # module name -> {tensor: checkpoint key}
        self.files: dict[str, str] = {}               # checkpoint key -> its file

    def validate_environment(self, *args, device_map=None, **kwargs):
        if not self.pre_quantized:
            raise ValueError("fp4moe loads MXFP4 checkpoints but does not quantize a BF16 gpt-oss to MXFP4; for "
                             f"that, use Transformers' own quantizer ({ENV_VAR}=transformers)")
        refuse_meta_device(device_map)
        if isinstance(device_map, dict) and "disk" in device_map.values():
            raise ValueError("fp4moe cannot offload MXFP4 experts to disk (device_map has 'disk'); put every layer "
                             "on a GPU or the CPU")

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        scan = CheckpointScan.of_files_to_load(checkpoint_files, "MXFP4")
        skip = self.get_modules_to_not_convert(model, self.quantization_config.modules_to_not_convert,
                                               model._keep_in_fp32_modules)
        config = model.config.get_text_config()
        prefix = getattr(model, "base_model_prefix", "model")
        for name, m in list(model.named_modules()):
            if not is_gpt_oss_experts(m):
                continue
            with torch.device("meta"):
                new = MXFP4GptOssExperts(config, dtype=m.gate_up_proj_bias.dtype)
            specs = new.tensor_specs()
            if not should_convert_module(name, skip):
                quantized = [k for k in (_checkpoint_key(scan, f"{name}.{s.name}", prefix) for s in specs
                                         if s.role != "bias") if k in scan.tensors]
                if quantized:  # Transformers' GptOssExperts would not read them, and keep random weights
                    raise CheckpointError(
                        f"modules_to_not_convert names {name!r}, but the checkpoint holds its experts in MXFP4 "
                        f"({quantized[0]!r} in {scan.tensors[quantized[0]][0]}): loaded as 16-bit experts they "
                        "would keep randomly initialised weights; leave it out of modules_to_not_convert (kept "
                        "in MXFP4) or load with Mxfp4Config(dequantize=True) for 16-bit experts")
                continue  # the checkpoint holds this layer's experts in 16 bits: Transformers loads them
            keys = {}
            for spec in specs:  # the experts module's own declaration: every tensor, the biases too
                key = _checkpoint_key(scan, f"{name}.{spec.name}", prefix)
                dtypes = BIAS_DTYPES if spec.role == "bias" else spec.dtype  # (a bias is cast to the model's)
                scan.check(key, spec.shape, dtypes, f" (gpt-oss MXFP4 experts of {name!r})")
                keys[spec.name] = key
                self.files[key] = scan.tensors[key][0]
            parent, _, attr = name.rpartition(".")
            replace_module(model.get_submodule(parent), attr, new)
            self.experts[name] = keys
        if not self.experts:
            raise ValueError(f"fp4moe's MXFP4 loader runs gpt-oss experts only, and this {type(model).__name__} has "
                             f"none to load as MXFP4; for other MXFP4 models use Transformers' own quantizer "
                             f"({ENV_VAR}=transformers)")
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        for name, keys in self.experts.items():  # every layer checked before any is prepared
            m = model.get_submodule(name)
            for tensor in keys:
                t = getattr(m, tensor)
                if t.is_meta or not getattr(t, "_is_hf_initialized", True):
                    raise CheckpointError(f"{name}.{tensor} was not filled from the checkpoint")
            for tensor, kind in m.scale_checks():
                key = keys[tensor]
                try:
                    check_scale_values(getattr(m, tensor), kind, lambda e, key=key: f"checkpoint tensor {key!r} "
                                       f"in {self.files[key]} (expert {e})")
                except ValueError as exc:
                    raise CheckpointError(str(exc)) from None
        for name in self.experts:
            m = model.get_submodule(name)
            try:
                m.set_backend(getattr(self.quantization_config, "backend", "auto"))
            except ValueError as exc:  # (e.g. a scale the Triton kernels cannot decode): name the layer
                raise ValueError(f"{name}: {exc}") from exc
        logger.info("fp4moe: %d gpt-oss experts layers kept in MXFP4, backend %r", len(self.experts),
                    next(iter(model.get_submodule(n).backend for n in self.experts)))
        attach_guards(model)
        return model

    def saved_quantization_config(self, model):
        """What ``save_pretrained`` writes: the checkpoint's own config (the tensors are its format)."""
        return self.quantization_config

    def _dequantize(self, model, dtype=None):
        """``model.dequantize()``: every MXFP4 experts module becomes Transformers' ``GptOssExperts``
        decoded to ``dtype`` (by default the dtype the model holds now), as for every fp4moe model
        (:func:`hf_integration.dequantize.dequantize_model`)."""
        from .dequantize import dequantize_model

        return dequantize_model(model, dtype)

    def is_serializable(self, *args, **kwargs):
        return True  # the modules hold the checkpoint's tensors under its names: state_dict is the format

    @property
    def is_trainable(self) -> bool:
        return False  # fp4moe::gpt_oss_moe has no backward yet

    @property
    def is_compileable(self) -> bool:
        return True


def _checkpoint_key(scan: CheckpointScan, model_key: str, prefix: str) -> str:
    """The checkpoint's name for ``model_key``: the same, or with / without the base-model prefix
    (a ``GptOssModel`` loaded from a ``GptOssForCausalLM`` checkpoint, or the reverse)."""
    for key in (model_key, f"{prefix}.{model_key}", model_key.removeprefix(f"{prefix}.")):
        if key in scan.tensors:
            return key
    return model_key  # missing: scan.check names it


class _MXFP4Quantizers:
    """Transformers' ``"mxfp4"`` quantizer entry: fp4moe's :class:`MXFP4Quantizer`, or Transformers'
    own where :func:`wants_transformers_quantizer`."""

    def __init__(self, transformers_quantizer):
        self.transformers_quantizer = transformers_quantizer

    def __call__(self, quantization_config, **kwargs):
        if wants_transformers_quantizer(quantization_config):
            return self.transformers_quantizer(quantization_config, **kwargs)
        return MXFP4Quantizer(quantization_config, **kwargs)


def register() -> None:
    """Route ``"mxfp4"`` checkpoints to fp4moe (idempotent; Transformers' own quantizer stays behind
    it for :func:`wants_transformers_quantizer`); on Transformers before :data:`MIN_TRANSFORMERS`
    nothing changes (Transformers' own quantizer loads them)."""
    from transformers.quantizers import auto

    if not supported():
        return

    current = auto.AUTO_QUANTIZER_MAPPING.get(QUANT_METHOD)
    if not isinstance(current, _MXFP4Quantizers):
        auto.AUTO_QUANTIZER_MAPPING[QUANT_METHOD] = _MXFP4Quantizers(current)


__all__ = ["ENV_VAR", "MIN_TRANSFORMERS", "MXFP4Quantizer", "register", "supported", "wants_transformers_quantizer"]
