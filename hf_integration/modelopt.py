"""Load ModelOpt NVFP4 checkpoints (the ``nvidia/DeepSeek-R1-FP4`` format) into Transformers with
NVFP4 experts from the start: nothing is materialized in BF16 but the non-expert NVFP4 linears.

Checkpoint layout, per quantized linear ``<name>``::

    <name>.weight          uint8          [N, K/2]   E2M1 pairs, low nibble first
    <name>.weight_scale    float8_e4m3fn  [N, K/16]
    <name>.weight_scale_2  float32        []         per-tensor global scale
    <name>.input_scale     float32        []         calibrated activation scale amax/(6*448)

and ``hf_quant_config.json`` (or ``config.json`` ``quantization_config`` with
``quant_method: "modelopt"``) saying ``quant_algo: "NVFP4"``, ``group_size: 16`` and
``exclude_modules``. Routed experts are ``...mlp.experts.<e>.{gate,up,down}_proj``.

What happens to each tensor:
* routed experts -> the fused NVFP4 buffers of :mod:`hf_integration.patch` (gate and up rows
  stacked ``[gate; up]``), copied straight from the memory-mapped file into the stacked tensor;
* other NVFP4 linears (dense MLPs, shared experts, ``o_proj`` in v2 checkpoints) -> dequantized
  to the model dtype at load (exact up to one rounding of the fp32 global scale product);
* everything else -> loaded as is.
Every model tensor must be filled exactly once and every checkpoint tensor used: anything
missing, unexpected, mis-shaped or of the wrong dtype raises an error naming it.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from fp4moe_ops import NVFP4MoEWeights, nvfp4

from .device_map import auto_device_map, device_for, dispatch, materialize, normalize_device_map
from .patch import NVFP4GatedMLP, find_experts_modules, fuse_routers, install_nvfp4_experts, use_fp4moe

logger = logging.getLogger("fp4moe")

_PROJ = ("gate_proj", "up_proj", "down_proj")
_QUANT_SUFFIXES = ("weight", "weight_scale", "weight_scale_2", "input_scale")


class CheckpointError(ValueError):
    """A checkpoint tensor is missing, unexpected, mis-shaped or of the wrong dtype."""


@dataclass
class ModelOptNVFP4Config:
    """The parts of ModelOpt's quantization config that loading needs."""

    exclude_modules: list[str] = field(default_factory=list)
    group_size: int = 16

    def is_excluded(self, module_name: str) -> bool:
        """Exact name, wildcard pattern (``*``/``?``), or a plain substring of the name."""
        for pattern in self.exclude_modules:
            if module_name == pattern or fnmatch.fnmatchcase(module_name, pattern):
                return True
            if not any(c in pattern for c in "*?[") and pattern in module_name:
                return True
        return False


def read_quant_config(path: str | Path) -> ModelOptNVFP4Config:
    """Read ``hf_quant_config.json`` or ``config.json``'s ``quantization_config``."""
    path = Path(path)
    quant = None
    if (path / "hf_quant_config.json").exists():
        quant = json.loads((path / "hf_quant_config.json").read_text()).get("quantization")
    if quant is None:
        qc = json.loads((path / "config.json").read_text()).get("quantization_config") or {}
        if qc.get("quant_method") != "modelopt":
            raise ValueError(f"{path} has no ModelOpt quantization config (hf_quant_config.json or "
                             "config.json quantization_config with quant_method 'modelopt')")
        quant = qc
    algo = quant.get("quant_algo")
    if algo != "NVFP4":
        raise ValueError(f"{path}: quant_algo {algo!r} is not supported (only NVFP4)")
    group = int(quant.get("group_size", 16))
    if group != nvfp4.BLOCK_SIZE:
        raise ValueError(f"{path}: group_size {group} is not supported (NVFP4 uses 16)")
    return ModelOptNVFP4Config(list(quant.get("exclude_modules") or []), group)


def _model_config(path: Path):
    from transformers import AutoConfig, DeepseekV3Config

    raw = json.loads((path / "config.json").read_text())
    raw.pop("quantization_config", None)  # we do the quantization; keep Transformers' hands off
    if raw.get("model_type") == "kimi_k2":  # Kimi-K2 is DeepSeek-V3 under another name
        keys = set(DeepseekV3Config().to_dict())
        return DeepseekV3Config(**{k: v for k, v in raw.items() if k in keys and k != "model_type"})
    model_type = raw.pop("model_type")
    return AutoConfig.for_model(model_type, **raw)


_SAFETENSORS_DTYPES = {
    "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
    "BOOL": torch.bool, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
    "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class _Checkpoint:
    """The tensors of a checkpoint's ``*.safetensors`` files, read one at a time.

    Reads each tensor's bytes straight from the file into a fresh tensor (no memory map kept
    around), so host memory holds only what the model keeps plus one tensor in flight.
    """

    def __init__(self, path: Path):
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {path}")
        self.where: dict[str, tuple[Path, int, str, list[int], int]] = {}
        for f in files:
            with open(f, "rb") as fh:
                header_len = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(header_len))
            for key, info in header.items():
                if key == "__metadata__":
                    continue
                begin, end = info["data_offsets"]
                self.where[key] = (f, 8 + header_len + begin, info["dtype"], info["shape"], end - begin)
        self.used: set[str] = set()

    def has(self, key: str) -> bool:
        return key in self.where

    def skip(self, pattern: str, predicate) -> None:
        """Count keys matching ``pattern`` (for which ``predicate(match)`` holds) as used:
        another rank's experts under expert parallelism."""
        rx = re.compile(pattern)
        for key in self.where:
            match = rx.match(key)
            if match and predicate(match):
                self.used.add(key)

    def get(self, key: str, shape=None, dtype=None) -> torch.Tensor:
        if key not in self.where:
            raise CheckpointError(f"checkpoint tensor {key!r} is missing")
        file, offset, dtype_name, file_shape, nbytes = self.where[key]
        found = _SAFETENSORS_DTYPES.get(dtype_name)
        if found is None:
            raise CheckpointError(f"checkpoint tensor {key!r}: unsupported dtype {dtype_name}")
        if dtype is not None and found != dtype:
            raise CheckpointError(f"checkpoint tensor {key!r}: expected dtype {dtype}, found {found}")
        if shape is not None and tuple(file_shape) != tuple(shape):
            raise CheckpointError(f"checkpoint tensor {key!r}: expected shape {list(shape)}, found {list(file_shape)}")
        out = torch.empty(nbytes, dtype=torch.uint8)
        with open(file, "rb") as fh:
            fh.seek(offset)
            if fh.readinto(out.numpy()) != nbytes:
                raise CheckpointError(f"checkpoint tensor {key!r}: file {file.name} is truncated")
        self.used.add(key)
        return out.view(found).reshape(file_shape)


def _load_nvfp4_linear(ckpt: _Checkpoint, name: str, n: int, k: int):
    """``(packed [N,K/2], block_scale [N,K/16], global [], input_scale [] or None)``."""
    packed = ckpt.get(f"{name}.weight", (n, k // 2), torch.uint8)
    scale = ckpt.get(f"{name}.weight_scale", (n, k // nvfp4.BLOCK_SIZE), torch.float8_e4m3fn)
    global_scale = ckpt.get(f"{name}.weight_scale_2", (), torch.float32)
    input_scale = ckpt.get(f"{name}.input_scale", (), torch.float32) if ckpt.has(f"{name}.input_scale") else None
    return packed, scale, global_scale, input_scale


def _load_experts(ckpt: _Checkpoint, prefix: str, experts: range, hidden: int, inter: int,
                  device) -> tuple[NVFP4MoEWeights, int]:
    """Stack per-expert ModelOpt tensors (global ids ``experts``) into NVFP4MoEWeights;
    returns (weights, number of experts whose gate/up global scales were reconciled)."""
    num_experts = len(experts)
    w13 = torch.empty(num_experts, 2 * inter, hidden // 2, dtype=torch.uint8, device=device)
    s13 = torch.empty(num_experts, 2 * inter, hidden // 16, dtype=torch.float8_e4m3fn, device=device)
    w2 = torch.empty(num_experts, hidden, inter // 2, dtype=torch.uint8, device=device)
    s2 = torch.empty(num_experts, hidden, inter // 16, dtype=torch.float8_e4m3fn, device=device)
    g13, g2 = (torch.empty(num_experts, dtype=torch.float32, device=device) for _ in range(2))
    reconciled = 0
    input_scales: dict[str, torch.Tensor | None] = {}
    for e, g_e in enumerate(experts):
        gate = _load_nvfp4_linear(ckpt, f"{prefix}.{g_e}.gate_proj", inter, hidden)
        up = _load_nvfp4_linear(ckpt, f"{prefix}.{g_e}.up_proj", inter, hidden)
        down = _load_nvfp4_linear(ckpt, f"{prefix}.{g_e}.down_proj", hidden, inter)
        w13[e, :inter], w13[e, inter:] = gate[0], up[0]
        g = torch.maximum(gate[2], up[2])
        if not torch.equal(gate[2], up[2]):
            # one global scale for [gate; up]: rescale the smaller side's block scales (re-rounded)
            reconciled += 1
            s13[e, :inter] = (gate[1].float() * (gate[2] / g)).to(torch.float8_e4m3fn)
            s13[e, inter:] = (up[1].float() * (up[2] / g)).to(torch.float8_e4m3fn)
        else:
            s13[e, :inter], s13[e, inter:] = gate[1], up[1]
        g13[e] = g
        w2[e], s2[e], g2[e] = down[0], down[1], down[2]
        for proj, t in (("gate_proj", gate[3]), ("up_proj", up[3]), ("down_proj", down[3])):
            input_scales[f"{prefix}.{g_e}.{proj}.input_scale"] = t
    missing = [k for k, t in input_scales.items() if t is None]
    if missing and len(missing) < len(input_scales):
        # calibrated activation scales come for every expert or for none (a W4A16-only save)
        raise CheckpointError(f"checkpoint tensor {missing[0]!r} is missing")
    if missing:
        return NVFP4MoEWeights(w13, s13, g13, w2, s2, g2), reconciled
    scales = torch.stack(list(input_scales.values())).view(num_experts, 3).to(device)
    return NVFP4MoEWeights(w13, s13, g13, w2, s2, g2, scales[:, :2].amax(1), scales[:, 2].contiguous()), reconciled


@torch.no_grad()
def load_modelopt_nvfp4(path: str | Path, *, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                        device_map: str | dict | None = None, backend: str = "auto", expert_parallel: bool = False,
                        fuse_router: bool = True, verbose: bool = True) -> nn.Module:
    """Load a ModelOpt NVFP4 checkpoint directory as a Transformers model with NVFP4 experts.

    Args:
        path: directory with ``config.json``, ``hf_quant_config.json`` (or a ModelOpt
            ``quantization_config``) and ``*.safetensors``.
        dtype: dtype of the non-quantized parts and of dequantized non-expert linears.
        device: where the model is built, when ``device_map`` is not given.
        device_map: spread the layers over GPUs: ``"auto"`` (contiguous layers per visible GPU,
            balanced by loaded bytes) or accelerate's ``{module prefix: device}``. Each layer is
            loaded straight onto its device; activations move between devices through
            accelerate's hooks, as with ``from_pretrained(device_map=...)``.
        backend: fp4moe backend for the experts (``"auto"``: by device).
        expert_parallel: load only this rank's ``E / world_size`` experts of each layer
            (``torch.distributed`` must be initialized) and sum the ranks' outputs, as
            :func:`hf_integration.expert_parallel.shard_experts` does. Every rank must call
            this; the ranks first check that they read the same checkpoint, and a failure on
            any rank (a missing expert tensor, say) is raised on every rank, naming it.
        fuse_router: run DeepSeek-V3-style routers as one op (see :func:`hf_integration.patch_moe`).

    Returns:
        the model, experts computed by ``torch.ops.fp4moe.fused_moe``; calibrated input scales
        from the checkpoint are kept (``fc1_input_scale``/``fc2_input_scale``) for NVFP4
        activations (:func:`hf_integration.set_backend`).
    """
    path = Path(path)

    def read():
        return read_quant_config(path), _model_config(path), _Checkpoint(path)

    def build(quant, config, ckpt, expert_shard_of=None):
        return _build(quant, config, ckpt, dtype, device, device_map, backend, expert_shard_of, fuse_router, verbose)

    if not expert_parallel:
        return build(*read())
    # Collectives at each step, so that a rank that fails never leaves the others waiting
    from .expert_parallel import expert_shard, same_on_every_rank, same_outcome_on_every_rank

    quant, config, ckpt = same_outcome_on_every_rank("reading the checkpoint", read)
    same_on_every_rank("checkpoint (config and tensor names, dtypes, shapes)",
                       _fingerprint(quant, config, ckpt), error=CheckpointError)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    return same_outcome_on_every_rank("loading this rank's experts",
                                      lambda: build(quant, config, ckpt, lambda e: expert_shard(e, rank, world)))


def _fingerprint(quant: ModelOptNVFP4Config, config, ckpt: "_Checkpoint") -> str:
    """A digest of what a rank is about to load: model config, quant config and every tensor's
    name, dtype and shape (not the bytes, and not how tensors are split into files)."""
    import hashlib

    layout = sorted((k, v[2], tuple(v[3])) for k, v in ckpt.where.items())
    return hashlib.sha256(repr((config.to_json_string(), quant, layout)).encode()).hexdigest()[:16]


def _build(quant, config, ckpt, dtype, device, device_map, backend, expert_shard_of, fuse_router,
           verbose) -> nn.Module:
    """Build the model on meta, place it, and fill it from ``ckpt`` (see :func:`load_modelopt_nvfp4`);
    ``expert_shard_of(num_experts)`` gives this rank's experts under expert parallelism."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    experts = find_experts_modules(model)
    expert_prefixes = {name: m for name, m in experts}
    placement = _placement(model, device, device_map, set(expert_prefixes))
    materialize(model, placement, skip=set(expert_prefixes))  # experts stay meta until loaded as NVFP4

    shards = {}
    if expert_shard_of is not None:  # every module checked before any is loaded
        shards = {name: expert_shard_of(m.gate_up_proj.shape[0]) for name, m in experts}
    for i, (name, m) in enumerate(experts):
        e, two_i, h = m.gate_up_proj.shape
        shard = shards.get(name)
        ids = range(shard.offset, shard.offset + shard.count) if shard else range(e)
        weights, reconciled = _load_experts(ckpt, name, ids, h, two_i // 2, device_for(name, placement))
        del m.gate_up_proj, m.down_proj
        install_nvfp4_experts(m, weights, backend)
        if shard:
            m.fp4moe_shard = shard
            ckpt.skip(rf"^{re.escape(name)}\.(\d+)\.", lambda match, ids=ids: int(match.group(1)) not in ids)
        if reconciled:
            logger.warning("fp4moe: %s: %d experts had different gate/up weight_scale_2; used their max and "
                           "rescaled the other's block scales (re-rounded to E4M3)", name, reconciled)
        if verbose:
            logger.info("fp4moe: loaded %s as NVFP4 (%d/%d)", name, i + 1, len(experts))

    filled = set()
    for mod_name, mod in model.named_modules():
        if mod_name in expert_prefixes:
            continue
        for p_name, p in list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False)):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            if full in filled:  # shared (tied) tensors appear under several names
                continue
            if p_name == "weight" and isinstance(mod, nn.Linear) and not quant.is_excluded(mod_name) \
                    and ckpt.has(f"{mod_name}.weight_scale"):
                packed, scale, g, _ = _load_nvfp4_linear(ckpt, mod_name, mod.out_features, mod.in_features)
                p.copy_(nvfp4.dequantize_nvfp4(packed, scale, g, p.dtype))
            elif ckpt.has(full):
                t = ckpt.get(full)
                if tuple(t.shape) != tuple(p.shape):
                    raise CheckpointError(f"checkpoint tensor {full!r}: expected shape {list(p.shape)}, found {list(t.shape)}")
                if t.is_floating_point() != p.is_floating_point():
                    raise CheckpointError(f"checkpoint tensor {full!r}: expected dtype {p.dtype}, found {t.dtype}")
                p.copy_(t)
            elif p_name in _non_persistent_buffers(mod):
                continue  # computed at init (e.g. rotary inv_freq), re-made below
            elif _is_tied(model, full):
                continue
            else:
                raise CheckpointError(f"checkpoint tensor {full!r} is missing")
            filled.add(full)
    unexpected = sorted(set(ckpt.where) - ckpt.used - _ignored_keys(ckpt, model))
    if unexpected:
        raise CheckpointError(f"unexpected checkpoint tensors (not part of the model): {unexpected[:8]}"
                              f"{' ...' if len(unexpected) > 8 else ''}")
    _reinit_non_persistent_buffers(model, placement)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    if fuse_router:
        fuse_routers(model)
    use_fp4moe(model)
    return dispatch(model.eval())


def _placement(model: nn.Module, device, device_map, expert_names: set[str]) -> dict[str, torch.device]:
    if device_map is None:
        return {"": torch.device(device)}
    if device_map == "auto":
        if not torch.cuda.is_available():
            raise ValueError("device_map='auto' spreads layers over CUDA GPUs and none is visible; use device=...")
        return auto_device_map(model, list(range(torch.cuda.device_count())), expert_names)
    if isinstance(device_map, dict):
        return normalize_device_map(device_map)
    raise ValueError(f"device_map must be 'auto' or a {{module prefix: device}} dict, not {device_map!r}")


def _non_persistent_buffers(mod: nn.Module) -> set[str]:
    return set(getattr(mod, "_non_persistent_buffers_set", set()))


def _is_tied(model: nn.Module, name: str) -> bool:
    return bool(getattr(model.config, "tie_word_embeddings", False)) and name == "lm_head.weight"


def _ignored_keys(ckpt: _Checkpoint, model: nn.Module) -> set[str]:
    """Checkpoint entries that are not model tensors on purpose: what the model class tells
    Transformers to ignore (e.g. DeepSeek-V3's multi-token-prediction layer 61), and the
    ``input_scale`` of linears we dequantized (their activations stay 16-bit)."""
    patterns = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    ignored = set()
    for k in ckpt.where:
        if any(p.search(k) for p in patterns):
            ignored.add(k)
        elif k.endswith(".input_scale") and f"{k[:-len('.input_scale')]}.weight" in ckpt.used:
            ignored.add(k)
    return ignored


def _reinit_non_persistent_buffers(model: nn.Module, placement: dict[str, torch.device]) -> None:
    """Buffers computed in ``__init__`` (rotary frequencies) are lost by the meta-device build:
    rebuild such modules' buffers from a fresh instance."""
    for name, mod in model.named_modules():
        if "inv_freq" in mod._buffers:
            with torch.device(device_for(name, placement)):
                fresh = type(mod)(mod.config)
            for buf_name, buf in fresh.named_buffers(recurse=False):
                mod._buffers[buf_name] = buf
            if hasattr(fresh, "attention_scaling"):
                mod.attention_scaling = fresh.attention_scaling


def save_modelopt_nvfp4(model: nn.Module, path: str | Path, quant_config: ModelOptNVFP4Config | None = None) -> None:
    """Write a patched/loaded model's routed experts back in ModelOpt's per-expert layout
    (byte-exact for experts loaded from a checkpoint whose gate/up global scales agreed),
    with the other tensors as they are in the model (dequantized linears stay in ``dtype``)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    experts = {name: m for name, m in find_experts_modules(model) if "gate_up_proj_packed" in m._buffers}
    dense = {name: m for name, m in model.named_modules() if isinstance(m, NVFP4GatedMLP)}

    def put(prefix: str, w: NVFP4MoEWeights, e: int) -> None:
        inter = w.intermediate_size
        for proj, rows in {"gate_proj": slice(0, inter), "up_proj": slice(inter, 2 * inter)}.items():
            tensors[f"{prefix}.{proj}.weight"] = w.w13[e, rows]
            tensors[f"{prefix}.{proj}.weight_scale"] = w.w13_scale[e, rows]
            tensors[f"{prefix}.{proj}.weight_scale_2"] = w.w13_global[e]
            if w.fc1_input_scale is not None:
                tensors[f"{prefix}.{proj}.input_scale"] = w.fc1_input_scale[e]
        tensors[f"{prefix}.down_proj.weight"] = w.w2[e]
        tensors[f"{prefix}.down_proj.weight_scale"] = w.w2_scale[e]
        tensors[f"{prefix}.down_proj.weight_scale_2"] = w.w2_global[e]
        if w.fc2_input_scale is not None:
            tensors[f"{prefix}.down_proj.input_scale"] = w.fc2_input_scale[e]

    for name, m in experts.items():
        w = m.nvfp4_weights()
        for e in range(w.num_experts):
            put(f"{name}.{e}", w, e)
    for name, m in dense.items():  # NVFP4 dense MLPs (patch_moe(quantize_dense_mlps=True))
        put(name, m.nvfp4_weights(), 0)
    nvfp4_modules = list(experts) + list(dense)
    for key, t in model.state_dict().items():
        if not any(key.startswith(f"{name}.") for name in nvfp4_modules):
            tensors[key] = t
    if getattr(model.config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    save_file({k: v.detach().cpu().clone() for k, v in tensors.items()}, str(path / "model.safetensors"))
    cfg = model.config.to_dict()
    cfg.pop("_experts_implementation", None)
    (path / "config.json").write_text(json.dumps(cfg, indent=1, default=str))
    # everything but the routed experts is saved unquantized: say so in exclude_modules
    quant = quant_config or ModelOptNVFP4Config(exclude_modules=sorted(
        n for n, mod in model.named_modules() if isinstance(mod, nn.Linear)))
    (path / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "fp4moe"}, "quantization": {
        "quant_algo": "NVFP4", "group_size": quant.group_size, "exclude_modules": quant.exclude_modules}}, indent=1))


__all__ = ["CheckpointError", "ModelOptNVFP4Config", "load_modelopt_nvfp4", "read_quant_config", "save_modelopt_nvfp4"]
