"""llm-compressor's MXFP4 checkpoints of ordinary MoE families (compressed-tensors, format
``mxfp4-pack-quantized``, schemes ``MXFP4A16`` and ``MXFP4``): ``from_pretrained`` keeps every
quantized linear in MXFP4 (:mod:`hf_integration.mxfp4_layers`), and ``save_pretrained`` writes the
same checkpoint back, tensor for tensor and byte for byte.

The files (tests/fixtures/llmcompressor/README.md): per linear ``<name>.weight_packed [N, K/2]``
uint8 (E2M1 pairs, low nibble = even column) and ``<name>.weight_scale [N, K/32]`` uint8 (E8M0,
``2^(byte - 127)``); no global or input scale; the routed experts as per-expert linears
``<experts>.<e>.<gate|up|down>``. Importing :mod:`hf_integration` routes such configs here
(:func:`register`); every other compressed-tensors config keeps its loader.

Before loading, every expected tensor's presence, dtype and shape is checked from the safetensors
headers, and a packed or scale tensor that no module takes is refused; after loading, every scale
byte (0xFF is NaN in the OCP MX format, and bytes whose weights decode past bfloat16 are refused),
each a :class:`~hf_integration.checkpoint_format.CheckpointError` naming the tensor and its file.

W4A4 (``MXFP4``: ``input_activations`` dynamic MXFP4, nothing stored for them) runs as fp4moe runs
NVFP4 W4A4 checkpoints: activations in 16 bits, said in a warning naming the config group; the
config is saved back as it was.
"""

from __future__ import annotations

import re

import torch
from torch import nn
from transformers.quantizers import HfQuantizer
from transformers.utils import logging
from transformers.utils.quantization_config import QuantizationConfigMixin

from fp4moe_ops.moe_weights import check_scale_values
from fp4moe_ops.mxfp4 import MX_BLOCK_SIZE

from .checkpoint_format import CheckpointError, expert_converter_targets, expert_leaves, model_conversions
from .kinds import quantized_modules
from .load_plan import CheckpointScan, refuse_meta_device
from .mxfp4_layers import MXFP4Experts, MXFP4Linear
from .quantizer import COMPRESSED_TENSORS_FORMATS, CurrentDtypeDequantize, attach_guards, check_all_filled
from .surgery import experts_form_problem, is_transformers_experts, replace_module

logger = logging.get_logger("transformers.fp4moe")

FORMAT = "mxfp4-pack-quantized"
TENSORS = ("weight_packed", "weight_scale")


class CompressedTensorsMXFP4Config(QuantizationConfigMixin):
    """An MXFP4 compressed-tensors config, kept as the file has it (``to_dict`` gives it back);
    loading option ``backend`` (``"auto"``: Triton where it runs, else the reference)."""

    LOADING_ATTRIBUTES = ("backend",)

    def __init__(self, raw: dict | None = None, backend: str = "auto", **kwargs):
        self.quant_method = "compressed-tensors"
        self.raw = dict(raw or {})
        self.backend = backend

    @staticmethod
    def is_mxfp4(d: dict) -> bool:
        """Every config group is MXFP4 (4-bit float weights in groups of 32, mxfp4-pack-quantized)."""
        groups = (d.get("config_groups") or {}).values()
        formats = {g.get("format") or d.get("format") for g in groups}
        weights = [g.get("weights") or {} for g in groups]
        return bool(groups) and formats == {FORMAT} and all(
            (w.get("num_bits"), w.get("type"), w.get("group_size")) == (4, "float", MX_BLOCK_SIZE) for w in weights)

    @property
    def quantized_activation_groups(self) -> list[str]:
        """The config groups that quantize activations too (W4A4)."""
        return [name for name, g in self.raw["config_groups"].items() if g.get("input_activations") is not None]

    @classmethod
    def from_dict(cls, config_dict: dict, return_unused_kwargs: bool = False, **kwargs):
        if not cls.is_mxfp4(config_dict):
            raise ValueError(f"not an MXFP4 compressed-tensors config (every group {FORMAT}, 4-bit float weights in "
                             f"groups of {MX_BLOCK_SIZE})")
        config = cls(raw=config_dict, **{k: v for k, v in config_dict.items() if k in cls.LOADING_ATTRIBUTES})
        return (config, kwargs) if return_unused_kwargs else config

    def to_dict(self) -> dict:
        return dict(self.raw)

    def get_loading_attributes(self) -> dict:
        return {k: getattr(self, k) for k in self.LOADING_ATTRIBUTES}


try:
    from transformers.core_model_loading import ConversionOps
except ImportError:  # pragma: no cover - Transformers without the v5 loader
    ConversionOps = object


class StackMXFP4Experts(ConversionOps):
    """Transformers conversion op: one layer's per-expert ``weight_packed`` / ``weight_scale``
    (gate, up, down; as read from the files) -> the stacked buffers of :class:`MXFP4Experts`, the
    bytes as they are (gate's rows, then up's)."""

    SOURCES = tuple((leaf, tensor) for leaf in range(3) for tensor in TENSORS)

    def __init__(self, hf_quantizer: HfQuantizer):
        # Transformers keeps the checkpoint dtypes of what an op with an ``hf_quantizer`` consumes
        self.hf_quantizer = hf_quantizer

    def __deepcopy__(self, memo):
        return self  # (Transformers copies a converter per layer; the op holds no per-layer state)

    def convert(self, input_dict, source_patterns=None, target_patterns=None, full_layer_name=None, **kwargs):
        module_name = full_layer_name.rsplit(".", 1)[0]
        prefix, leaves, count = self.hf_quantizer.experts[module_name]
        got = {self.SOURCES[source_patterns.index(p)]: tensors for p, tensors in input_dict.items()}
        input_dict.clear()
        for (leaf, tensor), tensors in got.items():
            if len(tensors) != count:
                raise CheckpointError(f"{module_name}: read {len(tensors)} '{list(leaves)[leaf]}.{tensor}' tensors for "
                                      f"{count} experts")
        base = target_patterns[0][:-len("gate_up_proj_packed")]
        out = {}
        for tensor, short in (("weight_packed", "packed"), ("weight_scale", "scale")):
            gate, up, down = (got.pop((leaf, tensor)) for leaf in range(3))
            out[f"{base}gate_up_proj_{short}"] = torch.stack([torch.cat(pair) for pair in zip(gate, up)])
            out[f"{base}down_proj_{short}"] = torch.stack(down)
        return out

    @property
    def reverse_op(self):
        raise NotImplementedError("MXFP4 experts are saved by fp4moe's quantizer, not by reverse conversion")


class CompressedTensorsMXFP4Quantizer(CurrentDtypeDequantize, HfQuantizer):
    """Loads llm-compressor MXFP4 checkpoints with every quantized linear kept in MXFP4 (see the
    module docstring)."""

    requires_calibration = False

    def __init__(self, quantization_config: CompressedTensorsMXFP4Config, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.experts: dict[str, tuple] = {}  # module name -> (checkpoint prefix, ExpertLeaves, expert count)
        self.linears: dict[str, str] = {}    # module name -> checkpoint name
        self.files: dict[str, str] = {}      # checkpoint key -> its file
        self.file_dtypes: dict[str, torch.dtype] = {}  # model key -> the dtype the file holds it in

    def validate_environment(self, *args, device_map=None, **kwargs):
        refuse_meta_device(device_map)
        if isinstance(device_map, dict) and "disk" in device_map.values():
            raise ValueError("fp4moe cannot offload MXFP4 modules to disk (device_map has 'disk'); put every layer on "
                             "a GPU or the CPU")

    def update_dtype(self, dtype):
        if dtype not in (torch.bfloat16, torch.float16):
            logger.warning("fp4moe: MXFP4 experts run with 16-bit activations; loading in bfloat16 instead of %s", dtype)
            return torch.bfloat16
        return dtype

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        scan = CheckpointScan.of_files_to_load(checkpoint_files, "MXFP4")
        self.files = {k: v[0] for k, v in scan.tensors.items()}
        renamings, converters = model_conversions(model)
        in_model = {}  # the checkpoint's keys by the model's names (Transformers' renamings applied)
        for key in scan.tensors:
            renamed = key
            for renaming in renamings:
                renamed, _ = renaming.rename_source_key(renamed)
            in_model[renamed] = key
        self.file_dtypes = {k: scan.tensors[v][1] for k, v in in_model.items()}
        claimed: set[str] = set()
        for name, m in list(model.named_modules()):
            if is_transformers_experts(m):
                self._plan_experts(model, name, m, scan, in_model, expert_leaves(name, converters), claimed)
            elif isinstance(m, nn.Linear) and f"{name}.{TENSORS[0]}" in in_model:
                ckpt = in_model[f"{name}.{TENSORS[0]}"][:-len(f".{TENSORS[0]}")]
                n, k = m.out_features, m.in_features
                for tensor, shape in zip(TENSORS, ((n, k // 2), (n, k // MX_BLOCK_SIZE))):
                    scan.check(f"{ckpt}.{tensor}", shape, torch.uint8, f" (the MXFP4 linear {name!r})")
                    claimed.add(f"{ckpt}.{tensor}")
                with torch.device("meta"):
                    new = MXFP4Linear(m)
                parent, _, attr = name.rpartition(".")
                replace_module(model.get_submodule(parent), attr, new)
                self.linears[name] = ckpt
        stray = [k for k, (_, dtype, _) in scan.tensors.items() if k not in claimed and
                 (dtype == torch.uint8 or k.rsplit(".", 1)[-1].startswith(("weight_scale", "weight_global", "input_")))]
        if stray:  # would be cast into a 16-bit parameter, or dropped: never load that silently
            raise CheckpointError(f"checkpoint tensor {stray[0]!r} in {self.files[stray[0]]} is quantized, but no MXFP4 "
                                  f"linear or experts module of {type(model).__name__} takes it")
        if not (self.experts or self.linears):
            raise CheckpointError(f"{checkpoint_files[0]} holds no MXFP4 tensors (weight_packed / weight_scale) fp4moe loads")
        return model

    def _plan_experts(self, model, name: str, m: nn.Module, scan: CheckpointScan, in_model: dict, leaves,
                      claimed: set[str]) -> None:
        """Check and claim the per-expert MXFP4 tensors of experts module ``name``, and put an
        :class:`MXFP4Experts` in its place; nothing if the checkpoint holds it in 16 bits."""
        count, two_i, hidden = m.gate_up_proj.shape
        inter = two_i // 2
        found = [in_model[k] for k in (f"{name}.{e}.{leaf}.{t}" for e in range(count) for leaf in leaves for t in TENSORS)
                 if k in in_model]
        if not found:
            return
        problem = experts_form_problem(m)
        if problem is not None:
            raise CheckpointError(f"{name} ({type(m).__name__}): fp4moe does not load these experts from an MXFP4 "
                                  f"checkpoint: {problem}")
        prefix = re.sub(rf"\.\d+\.({'|'.join(map(re.escape, leaves))})\.\w+$", "", found[0])
        for e in range(count):
            for leaf, (n, k) in ((leaves.gate, (inter, hidden)), (leaves.up, (inter, hidden)), (leaves.down, (hidden, inter))):
                for tensor, shape in zip(TENSORS, ((n, k // 2), (n, k // MX_BLOCK_SIZE))):
                    key = f"{prefix}.{e}.{leaf}.{tensor}"
                    scan.check(key, shape, torch.uint8, f" (the MXFP4 experts of {name!r})")
                    claimed.add(key)
        with torch.device("meta"):
            new = MXFP4Experts(count, hidden, inter)
        parent, _, attr = name.rpartition(".")
        replace_module(model.get_submodule(parent), attr, new)
        self.experts[name] = (prefix, leaves, count)

    def update_weight_conversions(self, weight_conversions, model=None):
        """Transformers' per-expert -> stacked converters of the MXFP4 experts give way to ours."""
        kept = []
        for c in weight_conversions:
            found = expert_converter_targets(c) if hasattr(c, "operations") else None
            if found is None or not any(name.endswith(found[0]) for name in self.experts):
                kept.append(c)
        from transformers.core_model_loading import WeightConverter

        ours, seen = [], set()
        for name, (_, leaves, _) in self.experts.items():
            base = ".".join(name.split(".")[-2:])  # e.g. "mlp.experts": the layer-independent pattern
            if (base, tuple(leaves)) in seen:
                continue
            seen.add((base, tuple(leaves)))
            sources = [rf"{re.escape(base)}\.\d+\.{re.escape(list(leaves)[leaf])}\.{tensor}$"
                       for leaf, tensor in StackMXFP4Experts.SOURCES]
            ours.append(WeightConverter(sources, f"{base}.gate_up_proj_packed", [StackMXFP4Experts(self)]))
        return ours + kept

    def _process_model_after_weight_loading(self, model, **kwargs):
        check_all_filled(model)  # all filled and valid before any is prepared
        for name, (prefix, leaves, count) in self.experts.items():
            m, inter = model.get_submodule(name), model.get_submodule(name).intermediate_size
            for leaf, proj, rows in ((leaves.gate, "gate_up_proj", slice(0, inter)),
                                     (leaves.up, "gate_up_proj", slice(inter, None)), (leaves.down, "down_proj", slice(None))):
                self._check_scales(m._buffers[f"{proj}_scale"][:, rows], lambda e, leaf=leaf: f"{prefix}.{e}.{leaf}.weight_scale")
        for name, ckpt in self.linears.items():
            self._check_scales(model.get_submodule(name).weight_scale[None], lambda e, ckpt=ckpt: f"{ckpt}.weight_scale")
        for name in self.experts:
            try:
                model.get_submodule(name).set_backend(self.quantization_config.backend)
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from exc
        groups = self.quantization_config.quantized_activation_groups
        if groups:
            logger.warning("fp4moe: this MXFP4 checkpoint quantizes activations too (W4A4: input_activations of config "
                           "group %s, dynamic MXFP4); fp4moe runs its activations in 16 bits (W4A16), as it runs NVFP4 "
                           "W4A4 checkpoints, and save_pretrained keeps the config as it is", ", ".join(groups))
        logger.info("fp4moe: %d experts layers and %d linears kept in MXFP4, experts backend %r", len(self.experts),
                    len(self.linears), next((model.get_submodule(n).backend for n in self.experts), None))
        conversions = getattr(model, "_weight_conversions", None)
        if conversions:  # saving goes through get_state_dict_and_metadata, not reverse conversion
            model._weight_conversions = [c for c in conversions if not any(
                isinstance(op, StackMXFP4Experts) for op in getattr(c, "operations", ()))]
        attach_guards(model)
        return model

    def _check_scales(self, scales: torch.Tensor, key_of) -> None:
        """E8M0 bytes ``[E, N, K/32]`` checked by their format's rule; a bad one is a CheckpointError
        naming the checkpoint key ``key_of(e)`` and its file."""
        try:
            check_scale_values(scales, "e8m0", lambda e: f"checkpoint tensor {key_of(e)!r} in {self.files.get(key_of(e))}")
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None

    def get_state_dict_and_metadata(self, model):
        """The checkpoint's tensors: every MXFP4 module as the file holds it, the rest as the model
        does, in the file's dtype where it holds the same values there (Transformers keeps some
        tensors in float32 whatever the file has: DeepSeek-V3's router weight, BF16 in the file)."""
        _, converters = model_conversions(model)
        written = quantized_modules(model)
        state = {}
        for name, m in written:
            state |= m.checkpoint_tensors(name, expert_leaves(name, converters))
        for key, t in model.state_dict().items():
            if any(key.startswith(f"{n}.") for n, _ in written):
                continue
            dtype = self.file_dtypes.get(key, t.dtype)
            if dtype != t.dtype and t.is_floating_point() and isinstance(dtype, torch.dtype) and dtype.is_floating_point:
                narrowed = t.to(dtype)
                t = narrowed if torch.equal(narrowed.to(t.dtype), t) else t
            state[key] = t
        return state, {}

    def saved_quantization_config(self, model) -> CompressedTensorsMXFP4Config:
        return self.quantization_config

    def _dequantize(self, model, dtype=None):
        from .dequantize import dequantize_model

        return dequantize_model(model, dtype)

    def is_serializable(self, *args, **kwargs):
        return True

    @property
    def is_trainable(self) -> bool:
        return False  # the experts op's backward decodes NVFP4 only

    @property
    def is_compileable(self) -> bool:
        return True


def register() -> None:
    """Route MXFP4 compressed-tensors configs to :class:`CompressedTensorsMXFP4Quantizer` (idempotent);
    ``from_pretrained(..., quantization_config=CompressedTensorsMXFP4Config(backend=...))`` overrides
    the checkpoint's loading options, as for Transformers' own configs."""
    from transformers.quantizers import auto

    entry = (CompressedTensorsMXFP4Config.is_mxfp4, CompressedTensorsMXFP4Config, CompressedTensorsMXFP4Quantizer)
    if entry not in COMPRESSED_TENSORS_FORMATS:
        COMPRESSED_TENSORS_FORMATS.append(entry)
    if CompressedTensorsMXFP4Config not in auto.LOADING_ATTRIBUTES_CONFIG_TYPES:
        auto.LOADING_ATTRIBUTES_CONFIG_TYPES = (*auto.LOADING_ATTRIBUTES_CONFIG_TYPES, CompressedTensorsMXFP4Config)


__all__ = ["CompressedTensorsMXFP4Config", "CompressedTensorsMXFP4Quantizer", "StackMXFP4Experts", "register"]
