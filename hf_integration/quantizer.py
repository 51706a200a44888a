"""fp4moe's Transformers quantizer: ``AutoModelForCausalLM.from_pretrained`` of ModelOpt NVFP4
checkpoints, and ``save_pretrained`` back to the same format.

Importing :mod:`hf_integration` registers :class:`ModelOptQuantizer` for ``quant_method:
"modelopt"``. Transformers then does what it does for any checkpoint (download and cache,
index and shards, ``device_map`` placement through accelerate, the LOAD REPORT, progress bars) and
calls this quantizer at its plug-in points:

* before loading, on the meta model: read every safetensors header (no tensor bytes), decide from
  the files which modules are NVFP4, check every NVFP4 tensor's presence, dtype and shape (a
  :class:`~hf_integration.checkpoint_format.CheckpointError` naming file and tensor otherwise), and
  swap in :class:`~hf_integration.experts.NVFP4Experts` for the routed experts and
  :class:`~hf_integration.experts.NVFP4Linear` for other NVFP4 linears;
* the weight conversion: Transformers' own per-expert -> stacked-experts converters are replaced
  by one that stacks the per-expert NVFP4 tensors as they are read (:class:`StackNVFP4Experts`:
  file bytes straight into the stacked buffers, never BF16);
* after loading: NVFP4 linears outside the experts stay
  :class:`~hf_integration.experts.NVFP4Linear` (or become ``nn.Linear`` with dequantized weights
  with ``nvfp4_linears="dequantize"``),
  the experts are prepared for a backend, routers are fused, and the model is marked quantized
  (``model.hf_quantizer``): dtype casts keep the scales, switching the experts implementation away
  from fp4moe fails at the call, ``save_pretrained`` writes a ModelOpt checkpoint atomically.

Which quantizer wins if Transformers ever ships its own ``"modelopt"``: fp4moe's, once
``hf_integration`` is imported (a log line says it replaced Transformers' entry).
"""

from __future__ import annotations

import itertools
import re
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers.modeling_utils import str_to_torch_dtype  # safetensors' dtype names -> torch
from transformers.quantizers import HfQuantizer
from transformers.utils import logging

from fp4moe_ops.moe_weights import check_scale_values, check_weight_range
from fp4moe_ops.op import _HIDDEN_DTYPES
from fp4moe_ops.prepared import CANONICAL_BUFFERS, INPUT_SCALE_BUFFERS, PreparedExperts, check_incoming_tensors

from .experts import FP8Linear, NVFP4Experts, NVFP4Linear
from .checkpoint_format import (
    COMPRESSED_TENSORS,
    KV_CACHE_SCALES,
    MODELOPT,
    QUANT_METHOD,
    CheckpointError,
    CompressedTensorsNVFP4Config,
    ExpertLeaves,
    ModelOptConfig,
    TensorScheme,
    expert_converter_targets,
    expert_leaves,
    model_conversions,
    read_json,
)
from .fused_linears import tie_fused_linears
from .llama4 import FUSED_LEAVES, NVFP4Llama4TextMoe, canonical_from_fused, fused_key, fused_specs, is_llama4_experts
from .router import fuse_routers
from .shared_experts import fuse_shared_experts
from .surgery import is_transformers_experts, log_activation_modes, replace_module

logger = logging.get_logger("transformers.fp4moe")  # under Transformers: set_verbosity_* applies

# the per-tensor names that only quantized linears have, in either format
QUANTIZED_TENSOR_NAMES = {*MODELOPT.tensors[1:], *COMPRESSED_TENSORS.tensors}

# --- reading the checkpoint's layout --------------------------------------------------------------


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

    def check(self, key: str, shape: tuple, dtype: torch.dtype, what: str = "") -> None:
        """Raise naming ``key`` (and its file) unless it exists with ``shape`` and ``dtype``."""
        if key not in self.tensors:
            raise CheckpointError(f"checkpoint tensor {key!r} is missing{what}")
        file, found_dtype, found_shape = self.tensors[key]
        if found_dtype != dtype:
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
class LoadPlan:
    scheme: TensorScheme
    experts: dict[str, ExpertsPlan] = field(default_factory=dict)
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
        # any expert's input scale: one missing (expert 0's included) is then named below as missing
        p.input_scales = not config.weights_only and any(
            f"{ckpt_prefix}.{e}.{leaf}.{input_}" in scan.tensors for e in range(e_total) for leaf in lv)
        for e in ids:
            for leaf, (n_out, k_in) in ((lv.gate, (inter, hidden)), (lv.up, (inter, hidden)), (lv.down, (hidden, inter))):
                specs = scheme.specs(f"{ckpt_prefix}.{e}.{leaf}", n_out, k_in, p.input_scales)
                for key, (shape, dtype) in specs.items():
                    what = " (the other experts of this layer have input scales)" if key.endswith(input_) else ""
                    scan.check(key, shape, dtype, what)
                claimed.update(specs)
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


# --- the weight conversion --------------------------------------------------------------------


try:
    from transformers.core_model_loading import ConversionOps
except ImportError:  # pragma: no cover - Transformers without the v5 loader
    ConversionOps = object


class StackNVFP4Experts(ConversionOps):
    """Transformers conversion op: one layer's per-expert ModelOpt tensors (as read from the files)
    -> the stacked buffers of :class:`NVFP4Experts`. Gate and up global scales that differ are
    reconciled (their max, the other side's block scales rescaled and re-rounded, logged).

    Every scale value is checked here, by its checkpoint name. Transformers turns any exception
    inside a conversion into a generic report entry, so a bad value is recorded on the quantizer
    and raised as a :class:`CheckpointError` naming the tensor once loading is done."""

    # (leaf index into ExpertLeaves, tensor role) of each source pattern, in order
    ROLES = ("packed", "block", "global", "input")
    SOURCES = tuple(itertools.product(range(3), ROLES))

    def __init__(self, hf_quantizer: ModelOptQuantizer):
        # Transformers (>= 5.22) keeps the checkpoint dtypes of tensors that an op with an
        # ``hf_quantizer`` consumes; older versions keep them for every renamed key
        self.hf_quantizer = hf_quantizer

    def __deepcopy__(self, memo):
        # Transformers deep-copies a converter per layer: the op holds no per-layer state, and the
        # quantizer (its plan, the errors found) must stay the one shared object
        return self

    def convert(self, input_dict, source_patterns=None, target_patterns=None, full_layer_name=None, **kwargs):
        module_name = full_layer_name.rsplit(".", 1)[0]
        plan = self.hf_quantizer.plan.experts[module_name]
        scheme = self.hf_quantizer.plan.scheme
        names = dict(zip(self.ROLES, scheme.tensors))
        got = {self.SOURCES[source_patterns.index(p)]: tensors for p, tensors in input_dict.items()}
        input_dict.clear()
        leaves, count, inter = list(plan.leaves), len(plan.ids), plan.inter
        for (leaf, role), tensors in got.items():
            if len(tensors) != count:
                raise CheckpointError(f"{module_name}: read {len(tensors)} '{leaves[leaf]}.{names[role]}' tensors "
                                      f"for {count} experts")

        def stack(parts: list[tuple[int, str]]) -> torch.Tensor:
            """The experts' tensors of ``parts`` (concatenated along rows), each per-expert tensor
            dropped as soon as it is copied: one layer plus one expert tensor in memory, not two layers."""
            lists = [got.pop(p) for p in parts]
            first = lists[0][0]
            rows = [ts[0].shape[0] if ts[0].dim() else 0 for ts in lists]  # scalars: [] (ModelOpt) or [1]
            out = torch.empty(count, *((sum(rows),) if first.dim() else ()), *first.shape[1:], dtype=first.dtype,
                              device=first.device)
            for e in range(count):
                r0 = 0
                for ts, n in zip(lists, rows):
                    if first.dim():
                        out[e, r0:r0 + n] = ts[e]
                    else:
                        out[e] = ts[e]
                    ts[e], r0 = None, r0 + n
            return out

        g_gate, g_up = stack([(0, "global")]), stack([(1, "global")])
        fc1_gate = stack([(0, "input")]) if plan.input_scales else None
        fc1_up = stack([(1, "input")]) if plan.input_scales else None
        w13 = stack([(0, "packed"), (1, "packed")])
        s13 = stack([(0, "block"), (1, "block")])
        w2, s2, g2 = stack([(2, "packed")]), stack([(2, "block")]), stack([(2, "global")])
        fc2_in = stack([(2, "input")]) if plan.input_scales else None
        # values as the file has them: ModelOpt's input scales may be 0 (never calibrated), a
        # compressed-tensors input global scale (it divides) may not
        input_kind = "global" if scheme.reciprocal else "input"
        errors_before = len(self.hf_quantizer.load_errors)
        for leaf, role, kind, values in ((0, "global", "global", g_gate), (1, "global", "global", g_up),
                                         (2, "global", "global", g2), (0, "block", "block", s13[:, :inter]),
                                         (1, "block", "block", s13[:, inter:]), (2, "block", "block", s2),
                                         (0, "input", input_kind, fc1_gate), (1, "input", input_kind, fc1_up),
                                         (2, "input", input_kind, fc2_in)):
            if values is not None:
                self._check(lambda d, v=values, k=kind: check_scale_values(v, k, d), plan, leaves[leaf], names[role])
        g_gate, g_up, g2 = scheme.multiplier(g_gate), scheme.multiplier(g_up), scheme.multiplier(g2)
        if len(self.hf_quantizer.load_errors) == errors_before:  # valid values: do they decode in range?
            for leaf, block, multiplier in ((0, s13[:, :inter], g_gate), (1, s13[:, inter:], g_up), (2, s2, g2)):
                self._check(lambda d, b=block, m=multiplier: check_weight_range(b, m, d), plan, leaves[leaf],
                            names["global"])
        if plan.input_scales:
            fc1_gate, fc1_up, fc2_in = scheme.multiplier(fc1_gate), scheme.multiplier(fc1_up), scheme.multiplier(fc2_in)

        g13 = torch.maximum(g_gate, g_up)
        differ = g_gate != g_up
        if bool(differ.any()):
            # one global scale for [gate; up]: rescale the smaller side's block scales (re-rounded)
            s13[:, :inter] = (s13[:, :inter].float() * (g_gate / g13)[:, None, None]).to(torch.float8_e4m3fn)
            s13[:, inter:] = (s13[:, inter:].float() * (g_up / g13)[:, None, None]).to(torch.float8_e4m3fn)
            logger.warning("fp4moe: %s: %d experts had different gate/up weight_scale_2; used their max and "
                           "rescaled the other's block scales (re-rounded to E4M3)", module_name, int(differ.sum()))
        base = target_patterns[0][:-len(CANONICAL_BUFFERS[0])]
        out = {base + name: t for name, t in zip(CANONICAL_BUFFERS, (w13, s13, g13, w2, s2, g2))}
        if plan.input_scales:
            out[base + INPUT_SCALE_BUFFERS[0]] = torch.maximum(fc1_gate, fc1_up)
            out[base + INPUT_SCALE_BUFFERS[1]] = fc2_in
        return out

    def _check(self, check, plan: ExpertsPlan, leaf: str, tensor: str) -> None:
        """Run ``check(describe)`` (a value or range check of stacked per-expert scales); its error,
        naming the checkpoint key and file of the expert, is raised once loading is done."""
        def describe(e: int) -> str:
            key = plan.key(plan.ids[e], leaf, tensor)
            return f"checkpoint tensor {key!r} in {self.hf_quantizer.plan.files.get(key)}"

        try:
            check(describe)
        except ValueError as exc:
            self.hf_quantizer.load_errors.append(CheckpointError(str(exc)))

    @property
    def reverse_op(self):
        # Saving goes through ModelOptQuantizer.get_state_dict_and_metadata, and the loader drops
        # this converter from the model's conversions once loaded: nothing to reverse.
        raise NotImplementedError("NVFP4 experts are saved by the fp4moe quantizer, not by reverse conversion")


class UnfuseNVFP4Experts(StackNVFP4Experts):
    """Transformers conversion op for Llama-4's fused 3-D NVFP4 experts: one layer's eight file
    tensors (:mod:`hf_integration.llama4`) -> the canonical buffers of :class:`NVFP4Experts`, every
    scale value checked by its checkpoint name (errors raised after loading, as for the per-expert op)."""

    SOURCES = tuple(itertools.product(FUSED_LEAVES, StackNVFP4Experts.ROLES))

    def convert(self, input_dict, source_patterns=None, target_patterns=None, full_layer_name=None, **kwargs):
        module_name = full_layer_name.rsplit(".", 1)[0]
        plan = self.hf_quantizer.plan.experts[module_name]
        got = {}
        for p, tensors in input_dict.items():
            leaf, role = self.SOURCES[source_patterns.index(p)]
            if len(tensors) != 1:
                raise CheckpointError(f"{module_name}: read {len(tensors)} {fused_key(plan.checkpoint_prefix, leaf, role)!r} tensors")
            got[f"{leaf}.{role}"] = tensors[0]
        input_dict.clear()
        if not plan.input_scales:  # a weights-only load of a W4A4 export: the input scales go unused
            got = {k: v for k, v in got.items() if not k.endswith(".input")}
        errors_before = len(self.hf_quantizer.load_errors)
        for name, t in got.items():
            leaf, role = name.split(".")
            if role == "packed":
                continue
            key = fused_key(plan.checkpoint_prefix, leaf, role)
            where = f"checkpoint tensor {key!r} in {self.hf_quantizer.plan.files.get(key)}"
            describe = (lambda e: f"{where} (expert {e})") if t.dim() else (lambda e: where)
            try:  # the roles name their checks: block scales [E, K/16, N] per expert, scalars once
                check_scale_values(t if t.dim() else t.reshape(1), role, describe)
            except ValueError as exc:
                self.hf_quantizer.load_errors.append(CheckpointError(str(exc)))
        weights = canonical_from_fused(got, plan.ids)
        if len(self.hf_quantizer.load_errors) == errors_before:  # valid values: do they decode in range?
            for leaf, w in zip(FUSED_LEAVES, ("w13", "w2")):
                key = fused_key(plan.checkpoint_prefix, leaf, "global")
                where = f"checkpoint tensor {key!r} in {self.hf_quantizer.plan.files.get(key)}"
                try:
                    check_weight_range(getattr(weights, f"{w}_scale"), getattr(weights, f"{w}_global"),
                                       lambda e, where=where: f"{where} (expert {e})")
                except ValueError as exc:
                    self.hf_quantizer.load_errors.append(CheckpointError(str(exc)))
        base = target_patterns[0][:-len(CANONICAL_BUFFERS[0])]
        out = {base + name: t for name, t in zip(CANONICAL_BUFFERS, weights.tensors())}
        if plan.input_scales:
            out[base + INPUT_SCALE_BUFFERS[0]] = weights.fc1_input_scale
            out[base + INPUT_SCALE_BUFFERS[1]] = weights.fc2_input_scale
        return out


def _converters_for(plan: LoadPlan, quantizer: ModelOptQuantizer) -> list:
    """One converter per distinct experts naming (e.g. ``mlp.experts`` with ``gate_proj`` ...), whose
    sources are the per-expert NVFP4 tensors in model terms (after Transformers' renamings)."""
    from transformers.core_model_loading import WeightConverter

    converters, seen = [], set()
    for p in plan.experts.values():
        base = ".".join(p.name.split(".")[-2:])  # e.g. "mlp.experts": what the layer-independent pattern needs
        if p.fused:
            if base not in seen:
                seen.add(base)
                sources = [rf"{re.escape(base)}\.{re.escape(fused_key('', leaf, role)[1:])}$"
                           for leaf, role in UnfuseNVFP4Experts.SOURCES]
                converters.append(WeightConverter(sources, f"{base}.{CANONICAL_BUFFERS[0]}", [UnfuseNVFP4Experts(quantizer)]))
            continue
        ids = r"\d+" if len(p.ids) == p.total else "|".join(str(e) for e in p.ids)  # a shard: its ids only
        key = (base, tuple(p.leaves), ids)
        if key in seen:
            continue
        seen.add(key)
        names = dict(zip(StackNVFP4Experts.ROLES, plan.scheme.tensors))
        sources = [rf"{re.escape(base)}\.(?:{ids})\.{re.escape(list(p.leaves)[leaf])}\.{names[role]}$"
                   for leaf, role in StackNVFP4Experts.SOURCES]
        converters.append(WeightConverter(sources, f"{base}.{CANONICAL_BUFFERS[0]}", [StackNVFP4Experts(quantizer)]))
    return converters


# --- the quantizer ------------------------------------------------------------------------------


class ModelOptQuantizer(HfQuantizer):
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
        for name in [*self.plan.experts, *self.plan.linears]:
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
        check_float_tensors(model, scan, self.plan)
        self._refuse_nvfp4_on_disk(kwargs.get("device_map"))
        for name, m in list(model.named_modules()):
            parent_name, _, attr = name.rpartition(".")
            if name in self.plan.experts:
                p = self.plan.experts[name]
                new = NVFP4Experts(None, None, num_experts=len(p.ids), hidden_size=p.hidden, intermediate_size=p.inter,
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

    def update_weight_conversions(self, weight_conversions, model=None):
        """Transformers' per-expert -> stacked converters of the NVFP4 experts give way to ours."""
        kept = []
        for c in weight_conversions:
            found = expert_converter_targets(c) if hasattr(c, "operations") else None
            if found is not None and any(name.endswith(found[0]) for name in self.plan.experts):
                continue
            kept.append(c)
        return _converters_for(self.plan, self) + kept

    def _process_model_after_weight_loading(self, model, **kwargs):
        if self.load_errors:
            raise self.load_errors[0]
        self._check_all_loaded(model)
        linears = [(n, m) for n, m in model.named_modules() if isinstance(m, (NVFP4Linear, FP8Linear))]
        for name, m in linears:  # every value checked before any module changes
            for tensor, kind in m.scale_checks():
                key = f"{name}.{tensor}"
                values = m._buffers[tensor]
                try:
                    check_scale_values(values[None] if kind == "block" else values.reshape(-1), kind,
                                       lambda e, key=key: f"checkpoint tensor {key!r} in {self.plan.files.get(key)}")
                except ValueError as exc:
                    raise CheckpointError(str(exc)) from None
            for block, scale, to_multiplier in getattr(m, "weight_ranges", list)():  # valid: in range?
                key = f"{name}.{scale}"
                try:
                    check_weight_range(m._buffers[block][None], to_multiplier(m._buffers[scale]).reshape(1),
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
        for name, m in linears:
            if isinstance(m, NVFP4Linear) and config.nvfp4_linears == "nvfp4":
                m.reset_counters()
                continue  # kept in 4 bits: NVFP4Linear computes through fp4moe::nvfp4_linear
            parent, _, attr = name.rpartition(".")
            replace_module(model.get_submodule(parent), attr, m.dequantized())
        for m in model.modules():
            if not isinstance(m, NVFP4Experts):
                continue
            m.set_backend(config.backend, config.act_scale_mode)
        if config.fuse_router:
            fuse_routers(model)
        if config.fuse_shared_experts and config.nvfp4_linears == "nvfp4":
            fuse_shared_experts(model)
        log_activation_modes(model)
        conversions = getattr(model, "_weight_conversions", None)
        if conversions:  # saving goes through get_state_dict_and_metadata, not reverse conversion
            model._weight_conversions = [c for c in conversions if not _is_ours(c)]
        attach(model, self)
        return model

    def _check_all_loaded(self, model) -> None:
        """Every NVFP4 tensor was filled from the checkpoint (Transformers marks what it loads):
        none is left as uninitialized memory."""
        for name, m in model.named_modules():
            if isinstance(m, (NVFP4Experts, NVFP4Linear, FP8Linear)):
                for buf_name, buf in m.named_buffers(recurse=False):
                    if buf_name not in m._non_persistent_buffers_set and not getattr(buf, "_is_hf_initialized", False):
                        raise CheckpointError(f"{name}.{buf_name} was not filled from the checkpoint")

    def get_state_dict_and_metadata(self, model):
        from .saving import modelopt_state_dict

        return modelopt_state_dict(model), {}

    def is_serializable(self, *args, **kwargs):
        return True

    def dequantize(self, model, dtype=None):
        """``model.dequantize(dtype)``: decoded into ``dtype``, by default the dtype the model holds now
        (Transformers' default, the dtype it was loaded in, is stale after ``model.to(torch.float16)``
        and would leave decoded weights of one dtype beside activations of another)."""
        dtype = dtype if dtype is not None else model.dtype
        model = self._dequantize(model, dtype=dtype)
        self.remove_quantization_config(model)
        model.config.dtype = dtype
        return model

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
    quantized = tuple(f"{name}." for name in [*plan.experts, *plan.linears])
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


def _is_ours(conversion) -> bool:  # UnfuseNVFP4Experts included
    return any(isinstance(op, StackNVFP4Experts) for op in getattr(conversion, "operations", ()))


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
      the call (:func:`_refuse_continuous_batching`) instead of returning empty outputs;
    * ``save_pretrained`` writes a ModelOpt checkpoint atomically (:mod:`hf_integration.saving`).
    """
    from .saving import atomic_save_pretrained

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
    if uses_mla(model.config) and hasattr(type(model), "init_continuous_batching"):
        # generate_batch and `transformers serve --continuous-batching` start here
        model.init_continuous_batching = types.MethodType(_refuse_continuous_batching, model)
    model.save_pretrained = types.MethodType(atomic_save_pretrained, model)
    model.num_parameters = types.MethodType(_num_parameters, model)
    if getattr(model.__dict__.get("to"), "__func__", None) is not _guarded_to:  # (attached once)
        model._fp4moe_next_to = model.__dict__.get("to")  # accelerate's, on a dispatched model
        model.to = types.MethodType(_guarded_to, model)
        model.double = types.MethodType(_guarded_double, model)
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


def _guarded_to(model, *args, **kwargs):
    """``model.to(...)``: any device, and the dtypes fp4moe's experts op runs (bfloat16, float16);
    another dtype in a model with NVFP4 experts is refused before anything moves."""
    dtype = torch._C._nn._parse_to(*args, **kwargs)[1]
    if dtype is not None and dtype not in _HIDDEN_DTYPES and any(isinstance(m, PreparedExperts) for m in model.modules()):
        raise ValueError(f"model.to({dtype}): this model's NVFP4 experts run bfloat16 or float16 activations only, so "
                         "its 16-bit parts must stay in one of those (model.to(torch.float16) works); "
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
    for m in model.modules():
        packed = ([CANONICAL_BUFFERS[0], CANONICAL_BUFFERS[3]] if isinstance(m, PreparedExperts)
                  else [m.scheme.packed] if isinstance(m, NVFP4Linear) else [])
        total += sum(2 * m._buffers[name].numel() * m._buffers[name].element_size() for name in packed)
    return total


def _check_model_scales(model, state_dict, prefix, *args):
    """The model's own pre-hook runs before any module loads: a bad tensor anywhere is refused with
    the model untouched (the modules' hooks alone would leave the earlier modules loaded)."""
    check_incoming_tensors(model, state_dict, prefix)


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


def _refuse_continuous_batching(model, *args, **kwargs):
    """``init_continuous_batching`` of an MLA model: refused at the call. Transformers' MLA attention
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
        "Use model.generate on a padded batch")


def quantizer_for(config: ModelOptConfig) -> ModelOptQuantizer:
    return ModelOptQuantizer(config, pre_quantized=True)


# --- registration -------------------------------------------------------------------------------


def register() -> None:
    """Register ``"modelopt"`` with Transformers, and route NVFP4 compressed-tensors checkpoints to
    fp4moe (idempotent). If Transformers ships its own ``"modelopt"`` quantizer, fp4moe's replaces
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


class _NVFP4CompressedTensorsConfigs:
    """Transformers' ``"compressed-tensors"`` config entry: NVFP4 configs (every group
    ``nvfp4-pack-quantized``) become fp4moe's :class:`CompressedTensorsNVFP4Config`, any other goes
    to Transformers' own class (as without fp4moe: dense and non-NVFP4 checkpoints are untouched)."""

    def __init__(self, transformers_config):
        self.transformers_config = transformers_config

    def from_dict(self, config_dict, **kwargs):
        if CompressedTensorsNVFP4Config.is_nvfp4(config_dict):
            return CompressedTensorsNVFP4Config.from_dict(config_dict, **kwargs)
        return self.transformers_config.from_dict(config_dict, **kwargs)


class _NVFP4CompressedTensorsQuantizers:
    """Transformers' ``"compressed-tensors"`` quantizer entry: fp4moe's loader for
    :class:`CompressedTensorsNVFP4Config`, Transformers' own quantizer for anything else."""

    def __init__(self, transformers_quantizer):
        self.transformers_quantizer = transformers_quantizer

    def __call__(self, quantization_config, **kwargs):
        if isinstance(quantization_config, CompressedTensorsNVFP4Config):
            return ModelOptQuantizer(quantization_config, **kwargs)
        return self.transformers_quantizer(quantization_config, **kwargs)


__all__ = ["CheckpointScan", "ModelOptQuantizer", "StackNVFP4Experts", "attach", "plan_load", "quantizer_for",
           "register", "uses_mla"]
