"""The NVFP4 checkpoint formats fp4moe reads, as the real tools write them: their quantization
configs and their tensor schemes. Used by the loader (:mod:`hf_integration.quantizer`), the saver
(:mod:`hf_integration.saving`, which always writes ModelOpt) and the tiny-checkpoint generator.

**ModelOpt** (``nvidia/DeepSeek-R1-FP4``, ``nvidia/Qwen3-30B-A3B-NVFP4``, ...). Config:
``hf_quant_config.json`` ``{"producer", "quantization": {"quant_algo", "kv_cache_quant_algo",
"group_size", "exclude_modules"}}``, and in newer exports ``config.json`` ``quantization_config``
with ``quant_method: "modelopt"`` in a compressed-tensors-like layout (``config_groups``,
``ignore``, ``kv_cache_scheme``; ``quantized_layers`` for ``MIXED_PRECISION``). Tensors of one
quantized linear ``<name>`` (W [N, K])::

    <name>.weight          U8       [N, K/2]   E2M1 pairs, low nibble = even column, bit 3 = sign
    <name>.weight_scale    F8_E4M3  [N, K/16]  block scales (linear layout)
    <name>.weight_scale_2  F32      []         global scale (multiplies)
    <name>.input_scale     F32      []         calibrated activation scale amax / (6*448); absent in
                                               weights-only (W4A16_NVFP4) exports

FP8 layers of a ``MIXED_PRECISION`` export: ``weight`` F8_E4M3 [N, K], ``weight_scale`` F32 []
(multiplies), ``input_scale``.

**compressed-tensors** (llm-compressor's ``NVFP4`` / ``NVFP4A16`` schemes, ``RedHatAI/*-NVFP4``):
``quant_method: "compressed-tensors"``, format ``nvfp4-pack-quantized``; per linear
``weight_packed`` (as ModelOpt's ``weight``), ``weight_scale``, ``weight_global_scale`` F32 [1]
and (W4A4) ``input_global_scale`` F32 [1]. **Their global scales divide**: W = e2m1 * scale /
weight_global_scale, so fp4moe's (multiplying) global scale is its reciprocal.

In both, routed experts are per-expert linears ``<experts>.<e>.<gate>|<up>|<down>`` (``gate_proj``
/ ``up_proj`` / ``down_proj``; Mixtral-style checkpoints use ``w1`` / ``w3`` / ``w2``); gate and up
normally share one global scale. FP8 KV-cache exports add ``<attn>.k_proj.k_scale`` and
``<attn>.v_proj.v_scale``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.utils.quantization_config import QuantizationConfigMixin

from fp4moe_ops import nvfp4

QUANT_METHOD = "modelopt"
KV_CACHE_SCALES = ("k_scale", "v_scale")
# the published algorithm names fp4moe reads (upper-cased: some exports write them lower case)
NVFP4_ALGOS = ("NVFP4", "W4A16_NVFP4")
LAYER_ALGOS = (*NVFP4_ALGOS, "FP8")  # per layer, in MIXED_PRECISION exports


@dataclass(frozen=True)
class TensorScheme:
    """How a format names and scales one NVFP4 linear's tensors."""

    packed: str
    block_scale: str
    global_scale: str
    input_scale: str
    scalar_shape: tuple   # shape of the two per-tensor scales in the file
    reciprocal: bool      # the file's global and input scales divide (compressed-tensors)

    @property
    def tensors(self) -> tuple[str, str, str, str]:
        return (self.packed, self.block_scale, self.global_scale, self.input_scale)

    def specs(self, name: str, out_features: int, in_features: int, input_scale: bool) -> dict:
        """``{key: (shape, dtype)}`` of one NVFP4 linear's checkpoint tensors."""
        specs = {
            f"{name}.{self.packed}": ((out_features, in_features // 2), torch.uint8),
            f"{name}.{self.block_scale}": ((out_features, in_features // nvfp4.BLOCK_SIZE), torch.float8_e4m3fn),
            f"{name}.{self.global_scale}": (self.scalar_shape, torch.float32),
        }
        if input_scale:
            specs[f"{name}.{self.input_scale}"] = (self.scalar_shape, torch.float32)
        return specs

    def multiplier(self, t: torch.Tensor) -> torch.Tensor:
        """The file's per-tensor scale(s) (``[...]`` or ``[..., 1]``) as fp4moe's multiplying scale
        ``[...]`` float32: ModelOpt's as they are, compressed-tensors' reciprocal."""
        t = t.float().reshape(t.shape[:t.dim() - len(self.scalar_shape)])
        return 1.0 / t if self.reciprocal else t


MODELOPT = TensorScheme("weight", "weight_scale", "weight_scale_2", "input_scale", (), reciprocal=False)
COMPRESSED_TENSORS = TensorScheme("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale", (1,),
                                  reciprocal=True)


class CheckpointError(ValueError):
    """A checkpoint file or tensor is missing, unexpected, malformed, mis-shaped, of the wrong
    dtype or holds a bad value; the message names the file and the tensor."""


@dataclass(frozen=True)
class ExpertLeaves:
    """The names of an expert's three linears in a checkpoint: ``<experts>.<e>.<gate>`` ..."""

    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"

    def __iter__(self):
        return iter((self.gate, self.up, self.down))


def linear_tensors(name: str, packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor,
                   input_scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """One NVFP4 linear's checkpoint tensors, with the dtypes and 0-dim scalars of ModelOpt's files."""
    # the scalars are copies: gate and up share theirs, and a file holds each tensor once
    tensors = {
        f"{name}.weight": packed,
        f"{name}.weight_scale": block_scale.view(torch.float8_e4m3fn),
        f"{name}.weight_scale_2": global_scale.reshape(()).float().clone(),
    }
    if input_scale is not None:
        tensors[f"{name}.input_scale"] = input_scale.reshape(()).float().clone()
    return tensors


def dense_mlp_tensors(prefix: str, weights) -> dict[str, torch.Tensor]:
    """A one-expert :class:`fp4moe_ops.NVFP4MoEWeights` (a dense MLP, a shared expert) as the
    checkpoint's ``<prefix>.gate_proj`` / ``up_proj`` / ``down_proj`` NVFP4 linears."""
    inter = weights.intermediate_size
    gate_up_in = None if weights.gate_up_input_scale is None else weights.gate_up_input_scale[0]
    down_in = None if weights.down_input_scale is None else weights.down_input_scale[0]
    out = {}
    for leaf, rows in (("gate_proj", slice(0, inter)), ("up_proj", slice(inter, 2 * inter))):
        out |= linear_tensors(f"{prefix}.{leaf}", weights.gate_up[0, rows], weights.gate_up_scale[0, rows],
                              weights.gate_up_global_scale[0], gate_up_in)
    return out | linear_tensors(f"{prefix}.down_proj", weights.down[0], weights.down_scale[0],
                                weights.down_global_scale[0], down_in)


def expert_tensors(prefix: str, weights, leaves: ExpertLeaves = ExpertLeaves()) -> dict[str, torch.Tensor]:
    """A layer's experts (:class:`fp4moe_ops.NVFP4MoEWeights`, canonical) as ModelOpt's per-expert
    tensors ``<prefix>.<e>.<leaf>.*``: gate and up rows of ``gate_up`` share its global scale and
    ``gate_up_input_scale``; down gets ``down``'s and ``down_input_scale``."""
    inter = weights.intermediate_size
    out = {}
    for e in range(weights.num_experts):
        gate_up_in = None if weights.gate_up_input_scale is None else weights.gate_up_input_scale[e]
        down_in = None if weights.down_input_scale is None else weights.down_input_scale[e]
        for leaf, rows in ((leaves.gate, slice(0, inter)), (leaves.up, slice(inter, 2 * inter))):
            out |= linear_tensors(f"{prefix}.{e}.{leaf}", weights.gate_up[e, rows], weights.gate_up_scale[e, rows],
                                  weights.gate_up_global_scale[e], gate_up_in)
        out |= linear_tensors(f"{prefix}.{e}.{leaves.down}", weights.down[e], weights.down_scale[e],
                              weights.down_global_scale[e], down_in)
    return out


class ModelOptConfig(QuantizationConfigMixin):
    """ModelOpt's quantization config (``quant_method: "modelopt"``), plus fp4moe's loading options.

    Checkpoint fields (as exported): ``quant_algo`` (``"NVFP4"``, ``"W4A16_NVFP4"``; any case),
    ``group_size`` (16), ``exclude_modules`` (``ignore`` in newer configs; kept and written back,
    but which modules are NVFP4 is read from the files' tensors), ``kv_cache_quant_algo``
    (``"FP8"`` or None), ``producer``.

    Loading options (``from_pretrained(..., quantization_config=ModelOptConfig(backend="triton"))``
    overrides them for a checkpoint that has its own config):
        backend: fp4moe backend for the routed experts (``"auto"``: by device).
        act_scale_mode: None (16-bit activations) or ``"per_expert"`` / ``"global_max"`` (NVFP4
            activations with the checkpoint's input scales; Blackwell's ``flashinfer_nvfp4``).
        fuse_router: run the routers :mod:`hf_integration.router` knows as one op after their GEMM
            (DeepSeek-V3-style, softmax top-k).
        expert_parallel: load only this rank's ``E / world_size`` experts of each layer and sum the
            ranks' outputs (``torch.distributed`` must be initialized).
        nvfp4_linears: what becomes of the checkpoint's NVFP4 linears outside the routed experts
            (attention, shared experts, dense MLPs): ``"nvfp4"`` (default) keeps them in 4 bits as
            :class:`~hf_integration.experts.NVFP4Linear` (a quarter of the memory; computed by
            ``fp4moe::nvfp4_linear``: on Hopper Triton kernels, faster than BF16 at a few tokens
            per call, slower at many: benchmarks/RESULTS.md, "NVFP4 linears"); ``"dequantize"``
            makes them ``nn.Linear`` in the model dtype (BF16's speed, 4x the memory).
        fuse_shared_experts: with ``nvfp4_linears="nvfp4"``, run a DeepSeek-V3-style block's NVFP4
            shared expert inside the routed experts' op call
            (:class:`~hf_integration.shared_experts.SharedExpertMoE`): one launch instead of a
            second op call, faster at batch 1 (benchmarks/NOTES.md, "The shared expert inside the
            routed call"). Off by default: fusing copies each layer's experts once, so loading then
            needs one layer's expert bytes of headroom (7.3 GB for a full-size DeepSeek-V3 layer),
            and a fused model runs neither NVFP4 activations nor expert parallelism.
        quantize_dense_mlps, quantize_attention: when a 16-bit checkpoint is quantized while it
            loads (:mod:`hf_integration.quantize_at_load`), also the linears of dense gated MLPs
            (shared experts, dense layers) / of attention, as ``patch_moe``'s options of the same
            names; an NVFP4 checkpoint's own tensors decide which of its linears are NVFP4.
    """

    LOADING_ATTRIBUTES = ("backend", "act_scale_mode", "fuse_router", "expert_parallel", "nvfp4_linears",
                          "fuse_shared_experts", "quantize_dense_mlps", "quantize_attention")
    NVFP4_LINEARS = ("dequantize", "nvfp4")
    scheme = MODELOPT

    def __init__(self, quant_algo: str = "NVFP4", group_size: int = nvfp4.BLOCK_SIZE,
                 exclude_modules: list[str] | None = None, kv_cache_quant_algo: str | None = None,
                 producer: dict | None = None, quantized_layers: dict | None = None, backend: str = "auto",
                 act_scale_mode: str | None = None, fuse_router: bool = True, expert_parallel: bool = False,
                 nvfp4_linears: str = "nvfp4", fuse_shared_experts: bool = False, quantize_dense_mlps: bool = False,
                 quantize_attention: bool = False, **kwargs):
        self.quant_method = QUANT_METHOD
        self.quant_algo = str(quant_algo).upper()
        self.quantized_layers = quantized_layers
        self.group_size = int(group_size)
        if exclude_modules is not None and not isinstance(exclude_modules, (list, tuple)):
            raise ValueError(f"exclude_modules must be a list of module names, got {type(exclude_modules).__name__}")
        self.exclude_modules = list(exclude_modules or [])
        self.kv_cache_quant_algo = kv_cache_quant_algo.upper() if isinstance(kv_cache_quant_algo, str) else None
        self.producer = producer
        self.backend, self.act_scale_mode = backend, act_scale_mode
        self.fuse_router, self.expert_parallel = fuse_router, expert_parallel
        self.nvfp4_linears = nvfp4_linears
        self.fuse_shared_experts = fuse_shared_experts
        self.quantize_dense_mlps, self.quantize_attention = quantize_dense_mlps, quantize_attention
        self.post_init()

    def post_init(self):
        if self.nvfp4_linears not in self.NVFP4_LINEARS:
            raise ValueError(f"nvfp4_linears must be one of {', '.join(map(repr, self.NVFP4_LINEARS))}, "
                             f"got {self.nvfp4_linears!r}")
        if not all(isinstance(m, str) for m in self.exclude_modules):
            raise ValueError(f"exclude_modules must be a list of module names, got {self.exclude_modules!r}")
        if self.quant_algo == "MIXED_PRECISION":
            layers = self.quantized_layers
            if not isinstance(layers, dict) or not layers:
                raise ValueError("ModelOpt quant_algo MIXED_PRECISION needs a non-empty 'quantized_layers' object")
            algos = {str((v or {}).get("quant_algo")).upper() for v in layers.values()}
            if not algos <= set(LAYER_ALGOS):
                raise ValueError(f"MIXED_PRECISION layers use {sorted(algos - set(LAYER_ALGOS))}: fp4moe reads "
                                 f"{', '.join(LAYER_ALGOS)} layers")
            if not algos & set(NVFP4_ALGOS):
                raise ValueError("MIXED_PRECISION export without NVFP4 layers: not an NVFP4 checkpoint")
        elif self.quant_algo not in NVFP4_ALGOS:
            raise ValueError(f"ModelOpt quant_algo {self.quant_algo!r} is not supported by fp4moe (supported: "
                             f"{', '.join(NVFP4_ALGOS)}, MIXED_PRECISION of {', '.join(LAYER_ALGOS)})")
        if self.group_size != nvfp4.BLOCK_SIZE:
            raise ValueError(f"ModelOpt group_size {self.group_size} is not supported (NVFP4 uses {nvfp4.BLOCK_SIZE})")

    @property
    def weights_only(self) -> bool:
        """W4A16 export: the checkpoint has no input scales."""
        return self.quant_algo == "W4A16_NVFP4"

    @classmethod
    def from_dict(cls, config_dict: dict, return_unused_kwargs: bool = False, **kwargs):
        """From ``config.json``'s ``quantization_config`` (ModelOpt's newer layout: ``ignore``,
        ``config_groups``, ``kv_cache_scheme``), or ``hf_quant_config.json`` (whole, or its
        ``quantization`` object)."""
        d = dict(config_dict)
        if isinstance(d.get("quantization"), dict):  # the whole hf_quant_config.json
            d = {"producer": d.get("producer"), **d["quantization"]}
        if "exclude_modules" not in d and "ignore" in d:
            d["exclude_modules"] = d.pop("ignore")
        weights = ((d.get("config_groups") or {}).get("group_0") or {}).get("weights") or {}
        if "group_size" not in d and weights.get("group_size") is not None:
            d["group_size"] = weights["group_size"]
        kv = d.get("kv_cache_scheme")
        if d.get("kv_cache_quant_algo") is None and isinstance(kv, dict):
            d["kv_cache_quant_algo"] = "FP8" if (kv.get("type"), kv.get("num_bits")) == ("float", 8) else str(kv)
        if "group_size" not in d and isinstance(d.get("quantized_layers"), dict):
            sizes = {v.get("group_size") for v in d["quantized_layers"].values() if isinstance(v, dict)} - {None}
            d["group_size"] = sizes.pop() if len(sizes) == 1 else nvfp4.BLOCK_SIZE
        known = {"quant_algo", "group_size", "exclude_modules", "kv_cache_quant_algo", "producer", "quantized_layers",
                 *cls.LOADING_ATTRIBUTES}
        config = cls(**{k: v for k, v in d.items() if k in known})
        return (config, kwargs) if return_unused_kwargs else config

    def to_dict(self) -> dict:
        """The ``quantization_config`` of ``config.json``, in ModelOpt's own (newer) layout; fp4moe's
        loading options are not part of a checkpoint."""
        fp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": self.group_size}
        d = {"config_groups": {"group_0": {"input_activations": None if self.weights_only else fp4, "weights": fp4,
                                           "targets": ["Linear"]}},
             "ignore": list(self.exclude_modules), "quant_algo": self.quant_algo}
        if self.quantized_layers:
            d["quantized_layers"] = self.quantized_layers
        if self.kv_cache_quant_algo == "FP8":
            d["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "float"}
        return d | {"producer": self.producer or {"name": "fp4moe"}, "quant_method": QUANT_METHOD}

    def hf_quant_config(self) -> dict:
        """The ``hf_quant_config.json`` that ModelOpt writes beside it, every field that vLLM
        requires of it present (null allowed)."""
        quantization = {"quant_algo": self.quant_algo, "kv_cache_quant_algo": self.kv_cache_quant_algo,
                        "group_size": self.group_size, "exclude_modules": list(self.exclude_modules)}
        if self.quantized_layers:
            quantization["quantized_layers"] = self.quantized_layers
        return {"producer": self.producer or {"name": "fp4moe"}, "quantization": quantization}

    def get_loading_attributes(self) -> dict:
        return {k: getattr(self, k) for k in self.LOADING_ATTRIBUTES}


class CompressedTensorsNVFP4Config(ModelOptConfig):
    """An NVFP4 compressed-tensors config (``quant_method: "compressed-tensors"``, format
    ``nvfp4-pack-quantized``, as llm-compressor writes it), read into fp4moe's loader; the loading
    options are :class:`ModelOptConfig`'s. A model loaded from it saves as ModelOpt."""

    scheme = COMPRESSED_TENSORS

    def __init__(self, raw: dict | None = None, **kwargs):
        self.raw = dict(raw or {})
        super().__init__(**kwargs)
        self.quant_method = "compressed-tensors"

    @staticmethod
    def is_nvfp4(d: dict) -> bool:
        """Every config group is NVFP4 (4-bit float weights in 16-element groups, nvfp4-pack-quantized)."""
        groups = (d.get("config_groups") or {}).values()
        formats = {g.get("format") or d.get("format") for g in groups}
        weights = [g.get("weights") or {} for g in groups]
        return bool(groups) and formats == {"nvfp4-pack-quantized"} and all(
            (w.get("num_bits"), w.get("type"), w.get("group_size")) == (4, "float", 16) for w in weights)

    @classmethod
    def from_dict(cls, config_dict: dict, return_unused_kwargs: bool = False, **kwargs):
        d = dict(config_dict)
        if not cls.is_nvfp4(d):
            raise ValueError("not an NVFP4 compressed-tensors config (every group nvfp4-pack-quantized, 4-bit float "
                             "weights in groups of 16)")
        weights_only = all(g.get("input_activations") is None for g in d["config_groups"].values())
        kv = d.get("kv_cache_scheme")
        config = cls(raw=d, quant_algo="W4A16_NVFP4" if weights_only else "NVFP4",
                     exclude_modules=[m for m in d.get("ignore") or [] if isinstance(m, str)],
                     kv_cache_quant_algo="FP8" if isinstance(kv, dict) and kv.get("num_bits") == 8 else None,
                     producer={"name": "compressed-tensors", "version": d.get("version")},
                     **{k: v for k, v in d.items() if k in cls.LOADING_ATTRIBUTES})
        return (config, kwargs) if return_unused_kwargs else config

    def to_dict(self) -> dict:
        return dict(self.raw)


# --- the checkpoint names of a model's experts, from Transformers' own conversion mapping -----


def model_conversions(model):
    """Transformers' renamings and converters for this model (no quantizer involved)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    conversions = get_model_conversion_mapping(model)
    renamings = [c for c in conversions if not isinstance(c, WeightConverter)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    return renamings, converters


def expert_converter_targets(converter) -> tuple[str, list[str]] | None:
    """``(experts module suffix, source stems)`` of a Transformers converter that merges per-expert
    tensors into ``<suffix>.gate_up_proj`` or ``<suffix>.down_proj``, else None."""
    targets = getattr(converter, "_original_target_patterns", converter.target_patterns)
    sources = getattr(converter, "_original_source_patterns", converter.source_patterns)
    if len(targets) != 1 or not re.search(r"experts\.(gate_up_proj|down_proj)$", targets[0]):
        return None
    if not all(s.endswith(".weight") and "*" in s for s in sources):
        return None
    return targets[0].rsplit(".", 1)[0].lstrip("."), [s[:-len(".weight")].rsplit(".", 1)[1] for s in sources]


def expert_leaves(experts_name: str, converters) -> ExpertLeaves:
    """The checkpoint's names of the experts' linears: from the model's own expert converters
    (``gate_proj``/``up_proj``/``down_proj``, Mixtral-style ``w1``/``w3``/``w2``)."""
    gate_up = down = None
    for c in converters:
        found = expert_converter_targets(c)
        if found is None or not experts_name.endswith(found[0]):
            continue
        if c.target_patterns[0].endswith("gate_up_proj") and len(found[1]) == 2:
            gate_up = found[1]
        elif len(found[1]) == 1:
            down = found[1][0]
    if gate_up and down:
        return ExpertLeaves(gate_up[0], gate_up[1], down)
    return ExpertLeaves()


def read_json(path: Path, expect=dict):
    """A JSON file, or a :class:`CheckpointError` naming it if it is not valid JSON of the expected type."""
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not a readable JSON file ({exc})") from exc
    if not isinstance(value, expect):
        raise CheckpointError(f"{path}: expected a JSON {expect.__name__}, found {type(value).__name__}")
    return value


def read_quant_config(folder: str | Path) -> ModelOptConfig:
    """The ModelOpt config of a checkpoint folder: ``hf_quant_config.json``, else ``config.json``'s
    ``quantization_config`` with ``quant_method: "modelopt"``."""
    folder = Path(folder)
    if (folder / "hf_quant_config.json").exists():
        raw = read_json(folder / "hf_quant_config.json")
        if not isinstance(raw.get("quantization"), dict):
            raise CheckpointError(f"{folder / 'hf_quant_config.json'}: no 'quantization' object")
        where = folder / "hf_quant_config.json"
    else:
        raw = read_json(folder / "config.json").get("quantization_config") or {}
        if raw.get("quant_method") != QUANT_METHOD:
            raise CheckpointError(f"{folder} has no ModelOpt quantization config (hf_quant_config.json or config.json "
                                  "quantization_config with quant_method 'modelopt')")
        where = folder / "config.json"
    try:
        return ModelOptConfig.from_dict(raw)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{where}: {exc}") from exc


__all__ = ["COMPRESSED_TENSORS", "CheckpointError", "CompressedTensorsNVFP4Config", "ExpertLeaves", "MODELOPT",
           "ModelOptConfig", "TensorScheme", "expert_converter_targets", "expert_leaves", "expert_tensors",
           "linear_tensors", "model_conversions", "read_quant_config"]
