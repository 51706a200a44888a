"""The load plan of a ModelOpt or compressed-tensors NVFP4 checkpoint, made before a byte of tensor
data is read: every safetensors header scanned (:class:`CheckpointScan`, safetensors' own parser),
the modules that are NVFP4 decided from the files (:func:`plan_load`: routed experts, NVFP4 and FP8
linears), every quantized tensor's presence, dtype and shape checked, and the loader's other
refusals (:func:`refuse_meta_device`, :func:`check_float_tensors`). Anything wrong is a
:class:`~hf_integration.checkpoint_format.CheckpointError` naming the tensor and its file.
:mod:`hf_integration.quantizer` calls these at Transformers' plug-in points."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers.modeling_utils import str_to_torch_dtype  # safetensors' dtype names -> torch

from fp4moe_ops.mxfp4 import BIAS_DTYPES

from .checkpoint_format import (
    COMPRESSED_TENSORS,
    KV_CACHE_SCALES,
    MODELOPT,
    CheckpointError,
    ExpertLeaves,
    ModelOptConfig,
    TensorScheme,
    expert_leaves,
    model_conversions,
    read_json,
)
from .gpt_oss import MIN_TRANSFORMERS, is_gpt_oss_experts, modelopt_gpt_oss_specs
from .gpt_oss import supported as gpt_oss_supported
from .llama4 import fused_key, fused_specs, is_llama4_experts
from .surgery import experts_form_problem, is_transformers_experts


# the per-tensor names that only quantized linears have, in either format
QUANTIZED_TENSOR_NAMES = {*MODELOPT.tensors[1:], *COMPRESSED_TENSORS.tensors}


class CheckpointScan:
    """Every tensor's file, dtype and shape, from the safetensors headers (safetensors' own
    parser and checks; no tensor bytes are read): ``tensors[key] = (file name, dtype, shape)``."""

    def __init__(self, files: list[str]):
        self.tensors: dict[str, tuple[str, torch.dtype | str, tuple]] = {}
        for f in files:
            name = Path(f).name
            try:
                with safe_open(f, framework="pt") as handle:
                    for key in handle.keys():
                        piece = handle.get_slice(key)
                        if key in self.tensors:
                            raise CheckpointError(f"tensor {key!r} is in two files: {self.tensors[key][0]} and {name}")
                        dtype = piece.get_dtype()
                        self.tensors[key] = (name, str_to_torch_dtype.get(dtype, dtype), tuple(piece.get_shape()))
            except CheckpointError:
                raise
            except Exception as exc:  # safetensors' SafetensorError, OSError: a truncated or malformed file
                raise CheckpointError(f"{f}: not a valid safetensors file ({exc})") from exc

    @classmethod
    def of_files_to_load(cls, checkpoint_files, format_name: str) -> "CheckpointScan":
        """The scan of the files Transformers is about to load (a quantizer's ``checkpoint_files``),
        their index checked; anything but ``.safetensors`` files is refused, naming the format."""
        if not checkpoint_files or not all(str(f).endswith(".safetensors") for f in checkpoint_files):
            raise CheckpointError(f"fp4moe loads {format_name} checkpoints from .safetensors files, got {checkpoint_files}")
        files = [str(f) for f in checkpoint_files]
        scan = cls(files)
        scan.check_index(files)
        return scan

    def check_index(self, files: list[str]) -> None:
        """The shards agree with their index: every key is in the file the index names, and no
        other ``.safetensors`` file in the folder holds a tensor of this checkpoint (a stale shard
        of an interrupted save, say), which Transformers would otherwise silently skip."""
        folder = Path(files[0]).parent
        listed = {Path(f).name for f in files}
        for index_file in folder.glob("*.safetensors.index.json"):
            weight_map = read_json(index_file).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index_file}: no 'weight_map' object")
            if not set(weight_map.values()) & listed:
                continue  # another variant's index
            for key, file in weight_map.items():
                found = self.tensors.get(key)
                if found is None or found[0] != file:
                    where = f"it is in {found[0]}" if found else "no listed shard holds it"
                    raise CheckpointError(f"{index_file.name} maps tensor {key!r} to {file}, but {where}")
            for other in sorted(set(folder.glob("*.safetensors")) - {folder / f for f in listed}):
                try:
                    with safe_open(str(other), framework="pt") as handle:
                        keys = list(handle.keys())
                except Exception:  # noqa: BLE001 - not a readable shard: certainly not one of ours
                    keys = []
                clash = [k for k in keys if k in self.tensors or k.rsplit(".", 1)[-1] in QUANTIZED_TENSOR_NAMES]
                if clash:
                    raise CheckpointError(f"{other.name} holds {clash[0]!r} but {index_file.name} does not list the "
                                          "file (a stale shard?); remove it or fix the index")

    def check(self, key: str, shape: tuple, dtype: torch.dtype | tuple[torch.dtype, ...], what: str = "") -> None:
        """Raise naming ``key`` (and its file) unless it exists with ``shape`` and ``dtype`` (or one of
        several)."""
        if key not in self.tensors:
            raise CheckpointError(f"checkpoint tensor {key!r} is missing{what}")
        file, found_dtype, found_shape = self.tensors[key]
        if found_dtype not in (dtype if isinstance(dtype, tuple) else (dtype,)):
            raise CheckpointError(f"checkpoint tensor {key!r} in {file}: expected dtype {dtype}, found {found_dtype}")
        if found_shape != tuple(shape):
            raise CheckpointError(f"checkpoint tensor {key!r} in {file}: expected shape {list(shape)}, "
                                  f"found {list(found_shape)}")


@dataclass
class ExpertsPlan:
    """One routed-experts module to load as NVFP4."""

    name: str               # module path in the model
    checkpoint_prefix: str  # the same in checkpoint keys (before Transformers' renamings)
    leaves: ExpertLeaves | None  # None: Llama-4's fused 3-D tensors (:mod:`hf_integration.llama4`)
    total: int              # experts of the layer
    ids: range              # global expert ids held here: all, or this rank's
    hidden: int
    inter: int
    input_scales: bool

    @property
    def fused(self) -> bool:
        return self.leaves is None

    def key(self, e: int, leaf: str, tensor: str) -> str:
        return f"{self.checkpoint_prefix}.{e}.{leaf}.{tensor}"


@dataclass
class GptOssPlan:
    """One gpt-oss experts module to load as NVFP4 (:class:`~hf_integration.gpt_oss.NVFP4GptOssExperts`):
    from ModelOpt's fused tensors, or from llm-compressor's one linear per expert (``per_expert``:
    its tensors as for other experts, read by :class:`~hf_integration.expert_conversion.StackGptOssExperts`)."""

    name: str               # module path in the model
    checkpoint_prefix: str  # the same in checkpoint keys
    input_scales: bool      # input scales held (ModelOpt's, for saving)
    per_expert: ExpertsPlan | None = None
    bias_dtype: torch.dtype | None = None  # the model's (set when the module is made): per-expert biases cast to it


@dataclass
class LoadPlan:
    scheme: TensorScheme
    experts: dict[str, ExpertsPlan] = field(default_factory=dict)
    gpt_oss: dict[str, GptOssPlan] = field(default_factory=dict)
    linears: dict[str, tuple[str, bool]] = field(default_factory=dict)  # module path -> ("nvfp4"|"fp8", input scale?)
    files: dict[str, str] = field(default_factory=dict)                 # checkpoint key -> file


def _to_model_key(key: str, renamings, prefix: str, owners: set[str]) -> str:
    """A checkpoint key in model terms: Transformers' renamings, then its base-model prefix rule
    (``owners``: module paths that own tensors, per-expert paths included)."""
    for renaming in renamings:
        key, _ = renaming.rename_source_key(key)
    owner = key.rsplit(".", 1)[0]
    if owner not in owners:
        if key.startswith(prefix + ".") and key[len(prefix) + 1:].rsplit(".", 1)[0] in owners:
            return key[len(prefix) + 1:]
        if f"{prefix}.{owner}" in owners:
            return f"{prefix}.{key}"
    return key


def read_kv_cache_scales(model: nn.Module, files: list[str], scan: CheckpointScan) -> dict[str, torch.Tensor]:
    """The checkpoint's FP8 KV-cache scales (``<attn>.k_proj.k_scale``, ``<attn>.v_proj.v_scale``),
    by model key, read from ``files``. fp4moe does not use them (the KV cache stays 16-bit), so they
    are not loaded into the model (where casts such as ``model.to(torch.float16)`` would round them):
    the quantizer holds them, and ``save_pretrained`` writes them back for readers that use them
    (vLLM, SGLang)."""
    renamings, _ = model_conversions(model)
    owners = {n for n, _ in model.named_modules()}
    prefix = getattr(model, "base_model_prefix", "model")
    wanted: dict[str, list[str]] = {}  # file -> its KV-scale keys: each shard opened once
    for key, (file, _, _) in scan.tensors.items():
        if key.rpartition(".")[2] in KV_CACHE_SCALES:
            wanted.setdefault(file, []).append(key)
    scales = {}
    for f in files:
        if Path(f).name in wanted:
            with safe_open(f, framework="pt") as handle:
                for key in wanted[Path(f).name]:
                    scales.update([_modelopt_kv_scale(_to_model_key(key, renamings, prefix, owners),
                                                      handle.get_tensor(key), owners)])
    return scales


def _modelopt_kv_scale(key: str, scale: torch.Tensor, owners: set[str]) -> tuple[str, torch.Tensor]:
    """A KV-cache scale under ModelOpt's key and dtype, which a save writes: compressed-tensors
    keeps ``<attn>.k_scale`` as bfloat16 ``[1]``, ModelOpt ``<attn>.k_proj.k_scale`` float32 ``[]``.
    Both multiply (key = fp8 x k_scale; tests/fixtures/llmcompressor/README.md), so the value is
    kept (a bfloat16 value is exact in float32). Left as it is where the model has no such
    projection (another attention layout)."""
    parent, _, leaf = key.rpartition(".")
    proj = f"{parent}.{leaf[0]}_proj"
    if parent.endswith(f".{leaf[0]}_proj") or proj not in owners:
        return key, scale
    return f"{proj}.{leaf}", scale.float().reshape(()) if scale.numel() == 1 else scale


def _nvfp4_experts_prefix(in_model: dict[str, str], scan: CheckpointScan, name: str, e_total: int, lv,
                          packed: str, block: str) -> str | None:
    """The checkpoint prefix of experts module ``name`` if any of its linears is NVFP4 in the
    checkpoint (an E4M3 block scale or packed uint8 bytes), else None. Any expert, not only the
    first: a bad or missing tensor of expert 0 is then reported as itself by the checks, instead of
    the layer being taken for a BF16 or FP8 one."""
    for e in range(e_total):
        for leaf in lv:
            for tensor, dtype in ((block, torch.float8_e4m3fn), (packed, torch.uint8)):
                key = in_model.get(f"{name}.{e}.{leaf}.{tensor}")
                if key is not None and scan.tensors[key][1] == dtype:
                    return key[:-len(f".{e}.{leaf}.{tensor}")]
    return None


def plan_load(model: nn.Module, scan: CheckpointScan, config: ModelOptConfig, shard_of=None) -> LoadPlan:
    """Decide from the checkpoint which modules load as NVFP4 and check all their tensors.

    ``shard_of(num_experts) -> ExpertShard`` under expert parallelism. Raises
    :class:`CheckpointError` for any NVFP4 tensor missing, unexpected, mis-shaped or of the wrong
    dtype."""
    scheme = config.scheme
    packed, block, global_, input_ = scheme.tensors
    renamings, converters = model_conversions(model)
    modules = dict(model.named_modules())
    experts = {n: m for n, m in modules.items() if is_transformers_experts(m)}
    owners = set(modules)
    leaves = {n: expert_leaves(n, converters) for n in experts}
    for n, m in experts.items():
        owners.update(f"{n}.{e}.{leaf}" for e in range(m.gate_up_proj.shape[0]) for leaf in leaves[n])
    prefix = getattr(model, "base_model_prefix", "model")
    in_model = {_to_model_key(k, renamings, prefix, owners): k for k in scan.tensors}
    plan = LoadPlan(scheme, files={k: v[0] for k, v in scan.tensors.items()})
    claimed: set[str] = set()

    for name, m in experts.items():
        problem = experts_form_problem(m)
        if problem is not None:  # (read by shape, its tensors could even fit: never load them as NVFP4Experts)
            own = in_model.get(f"{name}.gate_up_proj")
            if own is not None and scan.tensors[own][1] != torch.uint8:
                continue  # 16-bit experts in the checkpoint: loaded as they are
            if is_gpt_oss_experts(m) and own is not None and scheme is MODELOPT:
                plan.gpt_oss[name] = _plan_gpt_oss(name, own[:-len(".gate_up_proj")], m, scan, config, claimed)
                continue
            if is_gpt_oss_experts(m) and own is None:
                per_expert = _plan_gpt_oss_per_expert(name, m, scan, in_model, leaves[name], config, claimed)
                if per_expert is not None:
                    plan.gpt_oss[name] = per_expert
                    continue
            if is_gpt_oss_experts(m):
                problem = ("fp4moe reads gpt-oss's NVFP4 experts as ModelOpt exports them (fused gate_up_proj / "
                           "down_proj tensors) or as llm-compressor does (one linear per expert), and this "
                           "checkpoint holds neither")
            raise CheckpointError(
                f"{name} ({type(m).__name__}): fp4moe does not load these experts from an NVFP4 checkpoint: {problem}"
                + ("; gpt-oss also loads through fp4moe from its MXFP4 release (quant_method 'mxfp4')"
                   if is_gpt_oss_experts(m) else ""))
        e_total, two_i, hidden = m.gate_up_proj.shape
        inter = two_i // 2
        lv = leaves[name]
        ckpt_prefix = _nvfp4_experts_prefix(in_model, scan, name, e_total, lv, packed, block)
        if ckpt_prefix is None:
            if f"{name}.0.{lv.gate}.weight" in in_model:
                continue  # this layer's experts are not NVFP4 in the checkpoint: loaded as they are
            raise CheckpointError(f"checkpoint has no NVFP4 tensors for the experts of {name} "
                                  f"(looked for {name}.<e>.{lv.gate}.{block} ...)")
        shard = shard_of(e_total) if shard_of else None
        ids = range(shard.offset, shard.offset + shard.count) if shard else range(e_total)
        p = ExpertsPlan(name, ckpt_prefix, lv, e_total, ids, hidden, inter, input_scales=False)
        _claim_expert_linears(p, config, scan, claimed)
        # every expert tensor of this layer is accounted for: ours, or (expert parallelism) another rank's
        layer_keys = [k for k in scan.tensors if k.startswith(ckpt_prefix + ".")]
        pattern = re.compile(rf"{re.escape(ckpt_prefix)}\.(\d+)\.({'|'.join(map(re.escape, lv))})\.(\w+)$")
        for k in layer_keys:
            match = pattern.match(k)
            if match is None or int(match.group(1)) >= e_total or match.group(3) not in scheme.tensors:
                raise CheckpointError(f"unexpected checkpoint tensor {k!r} in {plan.files[k]}: {name} has "
                                      f"{e_total} experts with linears {list(lv)}")
            if shard and int(match.group(1)) not in ids:
                claimed.add(k)  # another rank's expert: never read here
        plan.experts[name] = p

    for name, m in modules.items():  # Llama-4: all experts in two 3-D tensors, bmm layout [E, K, N]
        if not is_llama4_experts(m):
            continue
        e_total, hidden, two_i = m.gate_up_proj.shape
        first = in_model.get(f"{name}.gate_up_proj")
        if first is None or scan.tensors[first][1] != torch.uint8 or scheme is not MODELOPT:
            continue  # BF16 experts (or a layout checked below as unknown packed bytes)
        ckpt_prefix = first[:-len(".gate_up_proj")]
        shard = shard_of(e_total) if shard_of else None
        ids = range(shard.offset, shard.offset + shard.count) if shard else range(e_total)
        input_scales = not config.weights_only and fused_key(ckpt_prefix, "gate_up_proj", "input") in scan.tensors
        specs = fused_specs(ckpt_prefix, e_total, hidden, two_i // 2, input_scales)
        for key, (shape, dtype) in specs.items():
            scan.check(key, shape, dtype)
        claimed.update(specs)
        plan.experts[name] = ExpertsPlan(name, ckpt_prefix, None, e_total, ids, hidden, two_i // 2, input_scales)

    for name, m in modules.items():
        if not isinstance(m, nn.Linear) or f"{name}.{block}" not in in_model:
            continue
        ckpt_name = in_model[f"{name}.{block}"][:-len(f".{block}")]
        has_input = f"{ckpt_name}.{input_}" in scan.tensors
        if scan.tensors.get(f"{ckpt_name}.weight", (None, None))[1] == torch.float8_e4m3fn and not scheme.reciprocal:
            # an FP8 layer of a MIXED_PRECISION export: weight [N, K] float8, one float32 scale
            specs = {f"{ckpt_name}.weight": ((m.out_features, m.in_features), torch.float8_e4m3fn),
                     f"{ckpt_name}.weight_scale": ((), torch.float32)}
            if has_input:
                specs[f"{ckpt_name}.input_scale"] = ((), torch.float32)
            kind = "fp8"
        else:
            specs, kind = scheme.specs(ckpt_name, m.out_features, m.in_features, has_input), "nvfp4"
        for key, (shape, dtype) in specs.items():
            scan.check(key, shape, dtype)
        claimed.update(specs)
        plan.linears[name] = (kind, has_input)

    ignored = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])]
    fused = [k for k in scan.tensors if k not in claimed and re.search(r"_(weight_scale_2|weight_scale|input_scale)$", k)]
    if fused:
        raise CheckpointError(f"{fused[0]!r} in {plan.files[fused[0]]}: fused NVFP4 tensors that no module of "
                              f"{type(model).__name__} takes (fp4moe reads them for Llama-4's experts only)")
    packed_bytes = [k for k in scan.tensors if k not in claimed and scan.tensors[k][1] == torch.uint8
                    and not any(p.search(k) for p in ignored)]
    if packed_bytes:  # would be cast into a 16-bit parameter, or dropped: never load that silently
        raise CheckpointError(f"checkpoint tensor {packed_bytes[0]!r} in {plan.files[packed_bytes[0]]} holds packed "
                              f"bytes (uint8) that no NVFP4 module of {type(model).__name__} takes: an NVFP4 layout "
                              "fp4moe does not read")
    stray = [k for k in scan.tensors if k not in claimed and k.rsplit(".", 1)[-1] in scheme.tensors[1:]
             and not any(p.search(k) for p in ignored)]
    if stray:
        raise CheckpointError(f"unexpected quantized checkpoint tensors (no NVFP4 module of the model takes them): "
                              f"{[f'{k} in {plan.files[k]}' for k in stray[:6]]}{' ...' if len(stray) > 6 else ''}")
    return plan



def _plan_gpt_oss(name: str, prefix: str, m: nn.Module, scan: CheckpointScan, config: ModelOptConfig,
                  claimed: set[str]) -> GptOssPlan:
    """Check every tensor of the gpt-oss experts module ``name`` in ModelOpt's fused layout
    (:func:`~hf_integration.gpt_oss.modelopt_gpt_oss_specs`, biases included) and claim them."""
    _require_gpt_oss_transformers(name)
    input_scales = not config.weights_only and f"{prefix}.gate_up_proj_input_scale" in scan.tensors
    e, h, i = m.num_experts, m.hidden_size, m.intermediate_size
    for proj, n, k in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
        specs = modelopt_gpt_oss_specs(proj, e, n, k, input_scales)
        specs[f"{proj}_bias"] = (BIAS_DTYPES, (e, n))  # any float dtype: Transformers casts it, as any bias
        for tensor, (dtype, shape) in specs.items():
            what = " (its other projection has an input scale)" if tensor.endswith("input_scale") else ""
            scan.check(f"{prefix}.{tensor}", shape, dtype, what)
            claimed.add(f"{prefix}.{tensor}")
    return GptOssPlan(name, prefix, input_scales)


def _plan_gpt_oss_per_expert(name: str, m: nn.Module, scan: CheckpointScan, in_model: dict[str, str], lv,
                             config: ModelOptConfig, claimed: set[str]) -> GptOssPlan | None:
    """The plan of gpt-oss experts module ``name`` if the checkpoint holds it as llm-compressor exports
    it (one biased NVFP4 linear per expert: ``<e>.gate_proj`` ...), every tensor checked and claimed;
    None if it holds no such NVFP4 tensors. Input scales, as for other experts, are read unless the
    config says weights only, and then checked (all or none) and not held: the activations stay 16-bit."""
    scheme = config.scheme
    e_total, h, i = m.num_experts, m.hidden_size, m.intermediate_size
    prefix = _nvfp4_experts_prefix(in_model, scan, name, e_total, lv, scheme.packed, scheme.block_scale)
    if prefix is None:
        return None
    _require_gpt_oss_transformers(name)
    p = ExpertsPlan(name, prefix, lv, e_total, range(e_total), h, i, input_scales=False)
    _claim_expert_linears(p, config, scan, claimed, biases=True)
    for k in scan.tensors:
        if k.startswith(prefix + ".") and k not in claimed:
            raise CheckpointError(f"unexpected checkpoint tensor {k!r} in {scan.tensors[k][0]}: {name} has {e_total} "
                                  f"experts, each three biased NVFP4 linears {list(lv)}")
    return GptOssPlan(name, prefix, input_scales=False, per_expert=p)


def _claim_expert_linears(p: ExpertsPlan, config: ModelOptConfig, scan: CheckpointScan, claimed: set[str],
                          biases: bool = False) -> None:
    """Check and claim the per-expert NVFP4 linears of ``p`` (its experts' ``gate`` / ``up`` / ``down``,
    with a ``bias`` each where ``biases``: gpt-oss), setting ``p.input_scales`` from the checkpoint:
    any expert's input scale means all must have them (a missing one, expert 0's included, is named)."""
    scheme, input_ = config.scheme, config.scheme.input_scale
    prefix, lv, h, i = p.checkpoint_prefix, p.leaves, p.hidden, p.inter
    p.input_scales = not config.weights_only and any(
        f"{prefix}.{e}.{leaf}.{input_}" in scan.tensors for e in range(p.total) for leaf in lv)
    for e in p.ids:
        for leaf, (n_out, k_in) in ((lv.gate, (i, h)), (lv.up, (i, h)), (lv.down, (h, i))):
            specs = scheme.specs(f"{prefix}.{e}.{leaf}", n_out, k_in, p.input_scales)
            if biases:
                specs[f"{prefix}.{e}.{leaf}.bias"] = ((n_out,), BIAS_DTYPES)
            for key, (shape, dtype) in specs.items():
                what = " (the other experts of this layer have input scales)" if key.endswith(input_) else ""
                scan.check(key, shape, dtype, what)
            claimed.update(specs)


def _require_gpt_oss_transformers(name: str) -> None:
    if not gpt_oss_supported():  # (the same reason as for MXFP4: this Transformers' gpt-oss computes otherwise)
        raise CheckpointError(f"{name}: fp4moe loads gpt-oss's NVFP4 experts on Transformers "
                              f"{'.'.join(map(str, MIN_TRANSFORMERS))} or later, whose gpt-oss it is tested against; "
                              f"this is {__import__('transformers').__version__}")


def refuse_meta_device(device_map) -> None:
    """Raise ValueError if ``device_map`` (a device, or a ``{module: device}`` map) puts anything on the
    meta device: the loader reads and checks the checkpoint's NVFP4 bytes and scales, which a meta
    tensor cannot hold. A skeleton without weights is Transformers' ``from_config`` under
    ``torch.device("meta")``."""
    places = device_map.values() if isinstance(device_map, dict) else [device_map]
    for where in places:
        if isinstance(where, (str, torch.device)) and str(where).split(":")[0] == "meta":
            raise ValueError("fp4moe cannot load NVFP4 weights onto the meta device (device or device_map 'meta'): "
                             "it reads and checks the checkpoint's bytes and scales; load onto 'cpu' or a GPU, or "
                             "build an empty skeleton with AutoModelForCausalLM.from_config under "
                             "torch.device('meta')")


def check_float_tensors(model: nn.Module, scan: CheckpointScan, plan: LoadPlan) -> None:
    """Raise CheckpointError naming the tensor and its file for a checkpoint tensor of an integer or
    bool dtype whose model tensor is a float one (a router weight stored as I32, say): Transformers
    would convert it by value, silently. The NVFP4 / FP8 modules' tensors are the plan's (checked there)."""
    renamings, _ = model_conversions(model)
    held = dict(model.named_parameters()) | dict(model.named_buffers())
    owners = {n for n, _ in model.named_modules()}
    prefix = getattr(model, "base_model_prefix", "model")
    quantized = tuple(f"{name}." for name in [*plan.experts, *plan.gpt_oss, *plan.linears])
    for key, (file, dtype, _) in scan.tensors.items():
        if not isinstance(dtype, torch.dtype) or dtype.is_floating_point or dtype.is_complex:
            continue
        model_key = _to_model_key(key, renamings, prefix, owners)
        if model_key.startswith(quantized):
            continue
        # a per-expert tensor of a BF16 experts module (experts.<e>.<leaf>.weight) goes into its stacked one
        target = held.get(model_key)
        if target is None:
            target = held.get(re.sub(r"\.\d+\.\w+\.(weight|bias)$", "", model_key) + ".gate_up_proj")
        if target is not None and target.is_floating_point():
            raise CheckpointError(f"checkpoint tensor {key!r} in {file} is {dtype}, but the model's tensor is "
                                  f"{target.dtype}: an integer tensor where a float one belongs would be converted by "
                                  "value; re-export the checkpoint with float tensors")


__all__ = ["CheckpointScan", "ExpertsPlan", "GptOssPlan", "LoadPlan", "check_float_tensors", "plan_load", "read_kv_cache_scales",
           "refuse_meta_device"]
