"""Does vLLM load an fp4moe save as fp4moe wrote it? vLLM's own config parsing and its model class's
``load_weights``, on the CPU, against tiny fp4moe saves; then every vLLM parameter is compared
byte for byte with what the safetensors files say it should hold.

    /path/to/venv-with-vllm/bin/python tools/check_vllm_load.py [--archs deepseek_v3 qwen3_moe]
        [--saves-python /path/to/python-with-fp4moe] [--keep NEW_DIR]
    ... --archs gpt_oss_mxfp4 gpt_oss_nvfp4      # gpt-oss (also part of the default run)

Outside CI: it needs vLLM (not a dependency of fp4moe; its CUDA wheel is fine, no GPU is used).
Exit status 0 when every save loads exactly (gpt_oss_nvfp4: exactly as ModelOpt's own export, see
below) and both controls (below) are caught. On a machine without an NVIDIA GPU it sets
``CUDA_VISIBLE_DEVICES=""`` for itself: a CUDA build of torch then makes vLLM take its CPU platform
(otherwise vLLM on x86 refuses to start without a Triton build for CPUs).

Per architecture of :mod:`hf_integration.tiny_models` that vLLM has:

1. A subprocess (``--saves-python``, default this interpreter; it needs fp4moe importable) builds
   the tiny random model, ``patch_moe(quantize_dense_mlps=True, quantize_attention=True)`` and
   ``save_pretrained``: ModelOpt W4A16 NVFP4 with NVFP4 routed experts, dense/shared MLPs and
   attention linears. DeepSeek-V3 and Qwen3-MoE are also saved after
   ``calibrate_activation_scales`` (experts only: ModelOpt "NVFP4", W4A4, with input scales). The
   checking process itself never imports fp4moe: only vLLM reads the saves.
2. vLLM parses the save (``ModelConfig``/``VllmConfig``: config.json, hf_quant_config.json ->
   ``modelopt_fp4``), builds its model class on the CPU under a one-rank gloo process group, and
   runs ``model.load_weights`` over vLLM's own safetensors iterator (``DefaultModelLoader``).
   ``process_weights_after_loading`` is NOT run: it repacks for GPU kernels; what is checked is
   what ``load_weights`` put into the parameters. vLLM picks its NVFP4 GEMM kernels while building
   the layers and has none for a CPU, so kernel selection is stubbed (parameter creation and the
   weight loaders stay vLLM's own).
3. For every vLLM parameter the expected contents are rebuilt from the files (``qkv_proj`` rows =
   q, k, v; ``fused_qkv_a_proj`` = q_a, kv_a; ``gate_up_proj`` = gate, up; experts'
   ``w13_*[e]`` = gate, up of expert e, ``w2_*[e]`` = down; the per-tensor scales of fused shards
   one slot per shard) and required byte-equal. Where vLLM keeps a tensor in another dtype (its
   loader's ``copy_`` casts), the expected value is the file's rounded to that dtype: e.g. the tiny
   models' float32 router weights, which vLLM holds in the model dtype (bfloat16). Such a rounding is
   vLLM's own choice, named in the report ("rounded by vLLM"), not a defect of the file; a parameter
   that differs from the file even after that rounding is one. Every file tensor must
   land in a parameter; parameters no file tensor fills are listed (they keep vLLM's defaults).
   Global scales: vLLM keeps one ``weight_scale_2`` (and ``input_scale``) per fused shard at load
   and collapses them afterwards (max for linears, the gate's for experts); only if all shards
   hold the same value does that single value equal every shard's file value: "tied".

gpt-oss (``--archs gpt_oss_mxfp4 gpt_oss_nvfp4``):

* ``gpt_oss_mxfp4``: a tiny checkpoint in OpenAI's published MXFP4 layout
  (``tiny_models.write_gpt_oss_mxfp4_checkpoint``), loaded by fp4moe (``from_pretrained`` after
  ``import hf_integration``) and saved again with ``save_pretrained``. vLLM parses it as
  ``gpt_oss_mxfp4``. None of its MXFP4 MoE backends is usable here (even the CPU one needs a
  Triton build for CPUs) and it refuses to build the experts, so the backend choice is forced to
  TRITON, which pads nothing (the padding of other
  backends would move the expected bytes; the choice sticks for the rest of the process). Expected:
  ``w13_weight[e] = gate_up_proj_blocks[e]`` with its last two axes flattened (rows stay
  interleaved gate/up, nothing is transposed), ``w13_weight_scale[e] = gate_up_proj_scales[e]``,
  ``w2_*`` from ``down_proj_*`` alike, biases as stored; attention q/k/v fused into ``qkv_proj``
  as above, ``self_attn`` -> ``attn``, ``embed_tokens`` -> ``embedding``.
* ``gpt_oss_nvfp4``: fp4moe's save of the ModelOpt NVFP4 gpt-oss export kept in
  ``tests/fixtures/gpt_oss_nvfp4/modelopt/checkpoint``. vLLM 0.33 cannot load this format at all
  (ModelOpt's own export included): it parses it as ``modelopt_fp4``, whose MoE method creates no
  expert bias parameters, and gpt-oss's ``load_weights`` then fails with ``KeyError:
  '...mlp.experts.w2_bias'``; without the biases it would still drop the experts' weight scales,
  global scales and input scales, which gpt-oss's name mapper does not map. So what is checked is
  that vLLM reads fp4moe's save exactly as it reads the ModelOpt export itself: the same exception
  (type and message), or the same bytes in every parameter. The run prints the finding with the
  vLLM source locations.

Two controls show the checks can fail: a DeepSeek-V3 save with ``topk_method``/``scoring_func``
removed from config.json (vLLM then builds no ``e_score_correction_bias`` and the load fails), and
a Qwen3-MoE save with one ``k_proj.weight_scale_2`` doubled ("tied" must say no).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def cpu_platform() -> None:
    """Make vLLM, imported after this, take its CPU platform (this process and the saves' subprocess)."""
    # vLLM picks its platform at first use; without this a CUDA wheel on a GPU-less host gets
    # "UnspecifiedPlatform" (no device). An explicit CPU target is what vLLM's own CPU jobs set.
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    # With a CUDA build of torch and no GPU, vLLM on x86 still looks for a Triton that runs on CPUs
    # ("vLLM on x86 CPUs requires Triton (triton-cpu)") unless no CUDA device is visible at all.
    if not any(Path("/dev").glob("nvidia[0-9]*")):
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

# Architectures of hf_integration.tiny_models that vLLM has a model class for; the builder
# expression is evaluated in the saves subprocess (kimi_k2 is DeepSeek-V3 under its model_type).
ARCHITECTURES = {
    "deepseek_v3": "tm.tiny_deepseek_v3(num_hidden_layers=2)",
    "kimi_k2": "tm.tiny_deepseek_v3(num_hidden_layers=2)",
    "deepseek_v2": "tm.tiny_deepseek_v2()",
    "glm4_moe": "tm.tiny_glm4_moe()",
    "qwen3_moe": "tm.tiny_qwen3_moe()",
    "minimax_m2": "tm.tiny_minimax_m2()",
    "mixtral": "tm.tiny_mixtral()",
}

# gpt-oss saves are made from checkpoints rather than patched models (see write_gpt_oss_save).
GPT_OSS = ("gpt_oss_mxfp4", "gpt_oss_nvfp4")
ALL_ARCHS = [*ARCHITECTURES, *GPT_OSS]
# A genuine ModelOpt NVFP4 export of a tiny gpt-oss: what vLLM does with it is the reference for
# what it should do with fp4moe's save of it.
MODELOPT_GPT_OSS = Path(__file__).resolve().parents[1] / "tests/fixtures/gpt_oss_nvfp4/modelopt/checkpoint"

# Also saved after calibrate_activation_scales: ModelOpt "NVFP4" (W4A4) with per-expert input scales,
# which vLLM loads per gate/up shard like the global weight scales.
CALIBRATED = ("deepseek_v3", "qwen3_moe")

# Linears vLLM runs as one GEMM: fused parameter -> checkpoint shards in vLLM's shard order
# (from the stacked_params_mapping / hf_to_vllm_mapper of its model classes).
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
         "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
         "gate_up_proj": ("gate_proj", "up_proj")}
SHARD_OF = {leaf: (fused, i) for fused, leaves in FUSED.items() for i, leaf in enumerate(leaves)}
# Routed experts in the files: <prefix>.experts.<e>.<leaf>.<tensor>; gate/up go to w13 (in that
# order), down to w2. Mixtral-style checkpoints name them w1 (gate), w3 (up), w2 (down).
EXPERT_KEY = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<leaf>gate_proj|up_proj|down_proj|w1|w3|w2)\."
                        r"(?P<tensor>weight|weight_scale|weight_scale_2|input_scale)$")
EXPERT_SLOT = {"gate_proj": ("w13", 0), "w1": ("w13", 0), "up_proj": ("w13", 1), "w3": ("w13", 1),
               "down_proj": ("w2", None), "w2": ("w2", None)}
PER_TENSOR = ("weight_scale_2", "input_scale")  # one value per linear (per shard once fused)
SENTINEL = 0xFF  # every parameter byte before loading: a byte still 0xFF.. was never written


# ---------------------------------------------------------------------------------------------
# 1. The saves (run in a subprocess that has fp4moe)
# ---------------------------------------------------------------------------------------------

def write_saves(out: Path, archs: list[str]) -> None:
    """fp4moe saves of each tiny model under ``out/<arch>``, plus ``out/versions.json``."""
    import torch
    import transformers

    import hf_integration  # noqa: F401  (registers the kimi_k2 config with Transformers)
    from hf_integration import calibrate_activation_scales, patch_moe
    from hf_integration import tiny_models as tm  # noqa: F401  (used by the ARCHITECTURES expressions)

    for arch in archs:
        if arch in GPT_OSS:
            write_gpt_oss_save(arch, out)
    archs = [arch for arch in archs if arch not in GPT_OSS]
    cases = [(arch, arch) for arch in archs] + [(f"{arch}+calibrated", arch) for arch in archs if arch in CALIBRATED]
    for case, arch in cases:
        torch.manual_seed(0)
        model = eval(ARCHITECTURES[arch])  # noqa: S307  (our own constant expressions)
        if arch == "kimi_k2":
            model.config.model_type = "kimi_k2"
        if case == arch:
            patch_moe(model, quantize_dense_mlps=True, quantize_attention=True, verbose=False)
        else:  # calibration scales only the routed experts' inputs, so only they are quantized
            patch_moe(model, verbose=False)
            calibrate_activation_scales(model, [torch.randint(1, 256, (4, 16))])
        model.save_pretrained(out / case)
    (out / "versions.json").write_text(json.dumps({"torch": torch.__version__,
                                                   "transformers": transformers.__version__}))


def write_gpt_oss_save(arch: str, out: Path) -> None:
    """fp4moe's round trip of a gpt-oss checkpoint: loaded through its Transformers integration,
    then ``save_pretrained`` to ``out/<arch>``."""
    import torch
    from transformers import AutoModelForCausalLM

    from hf_integration import tiny_models as tm

    if arch == "gpt_oss_mxfp4":
        source = out / f"{arch}.original"
        tm.write_gpt_oss_mxfp4_checkpoint(source, seed=0)
        model = AutoModelForCausalLM.from_pretrained(source)
    else:
        model = AutoModelForCausalLM.from_pretrained(MODELOPT_GPT_OSS, dtype=torch.bfloat16)
    model.save_pretrained(out / arch)


def make_saves(python: str, out: Path, archs: list[str]) -> dict:
    subprocess.run([python, __file__, "--write-saves", str(out), "--archs", *archs], check=True)
    return json.loads((out / "versions.json").read_text())


def control_saves(root: Path) -> dict[str, tuple[str, Path]]:
    """Copies of two saves, each broken in one way a check must catch: name -> (architecture, path)."""
    from safetensors.torch import load_file, save_file

    controls = {}
    if (root / "deepseek_v3").exists():
        path = root / "control_deepseek_v3_no_routing_fields"
        shutil.copytree(root / "deepseek_v3", path)
        cfg = json.loads((path / "config.json").read_text())
        for field in ("topk_method", "scoring_func"):
            cfg.pop(field, None)
        (path / "config.json").write_text(json.dumps(cfg, indent=1))
        controls["control: deepseek_v3 without topk_method/scoring_func"] = ("deepseek_v3", path)
    if (root / "qwen3_moe").exists():
        path = root / "control_qwen3_moe_untied_k_scale"
        shutil.copytree(root / "qwen3_moe", path)
        for file in path.glob("*.safetensors"):
            tensors = load_file(file)
            key = "model.layers.0.self_attn.k_proj.weight_scale_2"
            if key in tensors:
                tensors[key] = tensors[key] * 2
                save_file(tensors, str(file), metadata={"format": "pt"})
        controls["control: qwen3_moe, one k_proj.weight_scale_2 doubled"] = ("qwen3_moe", path)
    return controls


# ---------------------------------------------------------------------------------------------
# 2. vLLM: config parsing, model class, load_weights
# ---------------------------------------------------------------------------------------------

def stub_kernel_selection() -> None:
    """vLLM chooses NVFP4 kernels (Marlin, FlashInfer, CUTLASS) in the layers' constructors and
    refuses when none runs on this device. The kernels only act in process_weights_after_loading
    and forward, neither of which runs here, so a stand-in lets the layers be built; parameter
    creation and weight loaders are vLLM's own, untouched."""
    import vllm.model_executor.layers.quantization.modelopt as modelopt
    from vllm.model_executor.layers.fused_moe.oracle.nvfp4 import NvFp4MoeBackend

    class NoKernel:
        def input_quant_key(self):  # asked once at construction; None = quantizes its own input
            return None

    modelopt.select_linear_kernel = lambda *args, **kwargs: NoKernel()
    # Marlin: the backend vLLM runs W4A16 NVFP4 experts with on Hopper; the choice only decides
    # whether input scales are sized per local or per global expert (the same on one rank).
    modelopt.select_nvfp4_moe_backend = lambda *args, **kwargs: (NvFp4MoeBackend.MARLIN, None)

    # gpt-oss MXFP4 experts: vLLM finds no MXFP4 MoE backend usable here and refuses (even its CPU
    # one needs a Triton build for CPUs). TRITON is one it
    # runs on GPUs and, unlike some others, pads no expert dimension, so the parameters keep the
    # checkpoint's shapes and can be compared with it directly.
    import vllm.model_executor.layers.quantization.mxfp4 as mxfp4
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend

    mxfp4.select_mxfp4_moe_backend = lambda *args, **kwargs: (Mxfp4MoeBackend.TRITON, None)


def init_one_rank() -> None:
    """A one-process gloo group: vLLM's parallel layers ask for their (tensor/expert) rank. Once per
    process, under the first model's config (vLLM reads its parallel and MoE settings)."""
    import socket

    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                 distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
    initialize_model_parallel(1, 1)


def vllm_load(path: Path):
    """vLLM's model with the weights loaded, the config and quantization method vLLM parsed, and the
    parameter names ``load_weights`` says it loaded."""
    import torch
    from vllm.config import DeviceConfig, LoadConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    model_config = ModelConfig(model=str(path), dtype="bfloat16", enforce_eager=True)
    vllm_config = VllmConfig(model_config=model_config, load_config=LoadConfig(), device_config=DeviceConfig("cpu"))
    # as vLLM's loader builds it (BaseModelLoader.load_model), minus process_weights_after_loading
    with set_current_vllm_config(vllm_config), set_default_torch_dtype(model_config.dtype), torch.device("cpu"):
        if not torch.distributed.is_initialized():
            init_one_rank()
        model = initialize_model(vllm_config=vllm_config, model_config=model_config)
        for p in model.parameters():  # so that a byte never written is recognizable
            p.data.reshape(-1).view(torch.uint8).fill_(SENTINEL)
        weights = DefaultModelLoader(vllm_config.load_config).get_all_weights(model_config, model)
        loaded = model.load_weights(weights)
    quantization = f"{model_config.quantization} ({getattr(vllm_config.quant_config, 'quant_method', None)})"
    return model, model_config.hf_config, quantization, set(loaded or ())


# ---------------------------------------------------------------------------------------------
# 3. What each parameter should hold, from the files
# ---------------------------------------------------------------------------------------------

def read_files(path: Path) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors |= load_file(file)
    return tensors


def expert_param(params: dict, prefix: str, kind: str, tensor: str) -> str | None:
    """vLLM's name of the fused experts parameter for a file's ``<prefix>.experts`` (vLLM nests
    it, e.g. ``<prefix>.experts.routed_experts.w13_weight``)."""
    leaf = f"{kind}_{tensor}"
    found = [n for n in params if n.startswith(prefix + ".") and n.rsplit(".", 1)[-1] == leaf]
    return found[0] if len(found) == 1 else None


def gpt_oss_as_vllm_names(files: dict, params: dict) -> dict:
    """gpt-oss file tensors under the names vLLM's gpt-oss class gives them (its ``hf_to_vllm_mapper``),
    so that :func:`target` can place them like any other model's. The MXFP4 experts become whole
    ``w13_*``/``w2_*`` parameters: vLLM copies each expert's blocks with the last two axes flattened
    (``[2I, H/32, 16]`` -> ``[2I, H/2]``, the gate/up rows left interleaved, nothing transposed) and
    the scales and biases as stored. Tensors of any other layout keep their file names."""
    mxfp4 = {"gate_up_proj_blocks": ("w13", "weight"), "gate_up_proj_scales": ("w13", "weight_scale"),
             "gate_up_proj_bias": ("w13", "bias"), "down_proj_blocks": ("w2", "weight"),
             "down_proj_scales": ("w2", "weight_scale"), "down_proj_bias": ("w2", "bias")}
    renamed = {}
    for name, t in files.items():
        prefix, _, leaf = name.rpartition(".")
        if prefix.endswith(".mlp.experts") and leaf in mxfp4:
            param = expert_param(params, prefix, *mxfp4[leaf])
            if param is not None:
                renamed[param] = t.flatten(2) if leaf.endswith("_blocks") else t
                continue
        renamed[name.replace(".self_attn.", ".attn.").replace(".embed_tokens.", ".embedding.")] = t
    return renamed


def target(name: str, t, files: dict, params: dict):
    """(vLLM parameter, index into it, fused-set key or None) where file tensor ``name`` belongs;
    None if vLLM has no parameter for it."""
    m = EXPERT_KEY.match(name)
    if m:
        kind, shard = EXPERT_SLOT[m["leaf"]]
        param = expert_param(params, m["prefix"], kind, m["tensor"])
        if param is None:
            return None
        e = int(m["e"])
        if m["tensor"] in PER_TENSOR:
            index = (e,) if shard is None else (e, shard)
        elif shard is None:
            index = (e,)
        else:  # rows of w13[e]: the gate's first, then the up's (same row count)
            rows = t.shape[0]
            index = (e, slice(shard * rows, (shard + 1) * rows))
        return param, index, (f"{m['prefix']}.{e}", kind) if shard is not None else None

    module, leaf, tensor = name.rsplit(".", 2) if name.count(".") >= 2 else ("", "", name)
    if leaf in SHARD_OF and f"{module}.{SHARD_OF[leaf][0]}.{tensor}" in params:
        fused, i = SHARD_OF[leaf]
        param = f"{module}.{fused}.{tensor}"
        if tensor in PER_TENSOR:
            return param, (i,), (module, fused)
        # rows: the earlier shards' rows first (sizes from their own file tensors)
        start = sum(files[f"{module}.{FUSED[fused][j]}.{tensor}"].shape[0] for j in range(i))
        return param, (slice(start, start + t.shape[0]),), (module, fused)
    if name in params:
        if tensor in PER_TENSOR and params[name].dim() == 1 and t.dim() == 0:
            return name, (0,), None  # an unfused linear's per-tensor scale: vLLM's shape [1]
        return name, (), None
    return None


def compare(model, files: dict) -> dict:
    """Rebuild every parameter from the files (in a sentinel-filled copy) and compare bytes."""
    import torch

    params = dict(model.named_parameters())
    expected = {n: torch.full_like(p.data.reshape(-1).view(torch.uint8), SENTINEL).view(p.dtype).view(p.shape)
                for n, p in params.items()}
    written = {n: torch.zeros(p.shape, dtype=torch.bool) for n, p in params.items()}
    unconsumed, casts, fused_sets = [], [], {}
    for name, t in sorted(files.items()):
        hit = target(name, t, files, params)
        if hit is None:
            unconsumed.append(name)
            continue
        param, index, fused_key = hit
        slot = expected[param][index]
        if slot.shape != t.shape:
            unconsumed.append(f"{name} (shape {tuple(t.shape)} vs {param}{list(index)} {tuple(slot.shape)})")
            continue
        if t.dtype != slot.dtype:
            # vLLM holds this tensor in another dtype (its loader's copy_ casts): what it should hold
            # is the file's value rounded to that dtype, so that is compared; whether the rounding
            # changed any value is reported (vLLM's choice of dtype, not the file's doing)
            exact = torch.equal(t.to(slot.dtype).to(t.dtype), t)
            casts.append((name, str(t.dtype).removeprefix("torch."), str(slot.dtype).removeprefix("torch."), exact))
        expected[param][index] = t.to(slot.dtype)
        written[param][index] = True
        if fused_key is not None and name.rsplit(".", 1)[1] in PER_TENSOR:
            fused_sets.setdefault((*fused_key, name.rsplit(".", 1)[1]), []).append((name, t, param, index))

    mismatched = [n for n, p in params.items()
                  if not torch.equal(p.data.reshape(-1).view(torch.uint8), expected[n].reshape(-1).view(torch.uint8))]
    untouched = [n for n, w in written.items() if not w.any()]
    partial = [n for n, w in written.items() if w.any() and not w.all()]

    # tied global scales (weight_scale_2, and input_scale where saved): each fused set's file values
    # all equal, and vLLM's per-shard slots equal them
    untied = []
    for key, shards in fused_sets.items():
        shards.sort(key=lambda s: s[3])  # vLLM's shard order (q, k, v; gate, up)
        file_values = [float(t) for _, t, _, _ in shards]
        vllm_values = [float(params[p].data[i]) for _, _, p, i in shards]
        if len(set(file_values)) != 1 or vllm_values != file_values:
            untied.append(f"{'/'.join(n for n, *_ in shards)}: file {file_values}, vLLM {vllm_values}")
    return dict(params=len(params), compared=len(params) - len(untouched), mismatched=mismatched,
                untouched=untouched, partial=partial, unconsumed=unconsumed, casts=casts,
                fused_sets=len(fused_sets), untied=untied)


def leaf_counts(names) -> str:
    """``input_scale x12, k_scale x2``: parameter names grouped by their last component."""
    counts = {}
    for n in names:
        leaf = n.rsplit(".", 1)[-1]
        counts[leaf] = counts.get(leaf, 0) + 1
    return ", ".join(f"{leaf} x{c}" for leaf, c in sorted(counts.items())) or "none"


# ---------------------------------------------------------------------------------------------

def check(label: str, arch: str, path: Path) -> dict:
    row = dict(label=label, arch=arch)
    files = read_files(path)
    try:
        model, hf_config, quantization, loaded = vllm_load(path)
    except Exception as exc:  # noqa: BLE001  (a control expects this; reported, not hidden)
        return row | dict(error=f"{type(exc).__name__}: {exc}"[:300])
    if arch in GPT_OSS:
        files = gpt_oss_as_vllm_names(files, dict(model.named_parameters()))
    result = compare(model, files)
    result["not_in_vllm_loaded_set"] = sorted(set(dict(model.named_parameters())) - loaded)
    # the routing fields vLLM's MoE classes read (DeepSeek's from fp4moe's save, see saving.py)
    routing = {k: getattr(hf_config, k) for k in ("topk_method", "scoring_func") if hasattr(hf_config, k)}
    return row | result | dict(quantization=quantization, routing=routing, file_tensors=len(files))


def load_outcome(path: Path) -> dict:
    """What vLLM's load of ``path`` ends in: the exception (message with the folder's path taken
    out, and the vLLM source line that raised it), or every parameter's bytes."""
    import traceback

    import torch

    try:
        model, *_ = vllm_load(path)
    except Exception as exc:  # noqa: BLE001  (the outcome being compared)
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        parts = Path(frame.filename).parts
        source = "/".join(parts[len(parts) - 1 - parts[::-1].index("vllm"):]) if "vllm" in parts else frame.filename
        return dict(error=f"{type(exc).__name__}: {exc}".replace(str(path), "<checkpoint>"),
                    where=f"{source}:{frame.lineno} ({frame.name})")
    return dict(params={n: p.data.reshape(-1).view(torch.uint8).clone() for n, p in model.named_parameters()})


def check_same_as_modelopt(label: str, arch: str, path: Path, reference: Path) -> dict:
    """For a format vLLM may not load correctly: does vLLM treat fp4moe's save (``path``) exactly as
    the ModelOpt export it was made from (``reference``)? The same exception, or the same bytes."""
    import torch

    save, modelopt = load_outcome(path), load_outcome(reference)
    if "error" in save or "error" in modelopt:
        same = save.get("error") == modelopt.get("error")
    else:  # the same parameters, each with the same bytes (written or left at the sentinel)
        same = save["params"].keys() == modelopt["params"].keys() and all(
            torch.equal(save["params"][n], modelopt["params"][n]) for n in save["params"])
    return dict(label=label, arch=arch, save=save, modelopt=modelopt, same_as_modelopt=same)


def describe_outcome(outcome: dict) -> str:
    if "error" in outcome:
        return f"load_weights raised {outcome['error']} (at {outcome['where']})"
    return f"loaded; {len(outcome['params'])} parameters"


# Why vLLM 0.33 cannot load ModelOpt's NVFP4 gpt-oss, printed when that is what happens (line
# numbers as of vLLM 0.33.0).
GPT_OSS_NVFP4_FINDING = """  finding about vLLM (not fp4moe): vLLM 0.33 cannot load ModelOpt NVFP4 gpt-oss checkpoints, ModelOpt's
  own export included. It parses them as modelopt_fp4 and builds the experts with
  ModelOptNvFp4FusedMoE (vllm/model_executor/layers/quantization/modelopt.py, create_weights ~912),
  which creates no w13_bias/w2_bias parameters although gpt-oss's experts have biases; gpt-oss's
  loader (vllm/model_executor/models/gpt_oss.py, GptOssModel._load_weights_other) indexes
  params_dict[...w13_bias / ...w2_bias] (~1221 / ~1233): KeyError. Even without the biases the
  experts would be wrong: GptOssForCausalLM.hf_to_vllm_mapper (~1375) maps gate_up_proj/down_proj
  to w13_weight/w2_weight but not their _weight_scale, _weight_scale_2 or _input_scale, which the
  loader then skips ("if name not in params_dict: continue", ~1250), leaving the expert scales
  uninitialized."""


def failures(r: dict) -> list[str]:
    """What a row fails, in words (empty: vLLM holds exactly what the files say)."""
    if "same_as_modelopt" in r:
        return [] if r["same_as_modelopt"] else ["vLLM reads fp4moe's save differently from ModelOpt's export"]
    if "error" in r:
        return ["vLLM could not load it"]
    out = []
    if r["unconsumed"]:
        out.append(f"file tensors not consumed: {len(r['unconsumed'])}")
    if r["mismatched"]:
        out.append(f"parameters differing from the files: {len(r['mismatched'])}")
    if r["partial"]:
        out.append(f"parameters only partly filled: {len(r['partial'])}")
    if r["untied"]:
        out.append(f"fused sets with differing global scales: {len(r['untied'])}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", nargs="+", default=ALL_ARCHS, choices=ALL_ARCHS)
    parser.add_argument("--saves-python", default=sys.executable,
                        help="interpreter with fp4moe that writes the saves (default: this one)")
    parser.add_argument("--keep", type=Path, help="a new folder to write the saves to and keep (default: a temp dir)")
    parser.add_argument("--write-saves", type=Path, help=argparse.SUPPRESS)  # the subprocess's role
    args = parser.parse_args()
    cpu_platform()
    if args.write_saves:
        write_saves(args.write_saves, args.archs)
        return 0

    if args.keep:
        args.keep.mkdir(parents=True)  # a new folder: the controls are written beside the saves
    root = args.keep or Path(tempfile.mkdtemp(prefix="fp4moe_vllm_check_"))
    saves_versions = make_saves(args.saves_python, root, args.archs)

    import torch
    import transformers
    import vllm

    stub_kernel_selection()
    cases = {arch: (arch, root / arch) for arch in args.archs if arch != "gpt_oss_nvfp4"}
    cases |= {f"{arch}+calibrated": (arch, root / f"{arch}+calibrated") for arch in args.archs if arch in CALIBRATED}
    cases |= control_saves(root)
    rows = []
    for label, (arch, path) in cases.items():
        rows.append(check(label, arch, path))
    if "gpt_oss_nvfp4" in args.archs:
        rows.append(check_same_as_modelopt("gpt_oss_nvfp4", "gpt_oss_nvfp4", root / "gpt_oss_nvfp4", MODELOPT_GPT_OSS))

    print(f"\nvLLM {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__} "
          f"(vLLM side); saves written with torch {saves_versions['torch']}, "
          f"transformers {saves_versions['transformers']}; fp4moe imported by the vLLM process: "
          f"{'hf_integration' in sys.modules}\n")
    for r in rows:
        r["failures"] = failures(r)
    header = ("architecture", "params compared", "bytes equal", "fused global scales tied", "vLLM", "torch")
    table = [header]
    for r in rows:
        if "same_as_modelopt" in r:
            outcome = "load failed" if "error" in r["save"] else "loaded"
            same = "as ModelOpt's export" if r["same_as_modelopt"] else "NOT as ModelOpt's export"
            table.append((r["label"], f"{outcome}, {same}", "-", "-", vllm.__version__, torch.__version__))
            continue
        if "error" in r:
            table.append((r["label"], "load failed", "-", "-", vllm.__version__, torch.__version__))
            continue
        rounded = sum(not exact for *_, exact in r["casts"])
        casts = f" (dtype casts: {len(r['casts'])}, {rounded} rounded by vLLM)" if r["casts"] else ""
        # every byte equal, where vLLM keeps a tensor in another dtype after its own rounding
        equal = ("NO" if r["mismatched"] or r["unconsumed"] or r["partial"] else "yes") + casts
        tied = ("yes" if not r["untied"] else "NO") + f" ({r['fused_sets']} sets)"
        table.append((r["label"], f"{r['compared']}/{r['params']}", equal, tied, vllm.__version__, torch.__version__))
    widths = [max(len(str(row[i])) for row in table) for i in range(len(header))]
    for i, row in enumerate(table):
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))

    print()
    ok = True
    for r in rows:
        control = r["label"].startswith("control")
        print(f"[{r['label']}]")
        if "same_as_modelopt" in r:
            print(f"  fp4moe's save:         {describe_outcome(r['save'])}")
            print(f"  ModelOpt's own export: {describe_outcome(r['modelopt'])}")
            if any("_bias" in outcome.get("error", "") for outcome in (r["save"], r["modelopt"])):
                print(GPT_OSS_NVFP4_FINDING)
            same = "vLLM reads fp4moe's save exactly as it reads ModelOpt's own export"
            print(f"  verdict: {'; '.join(r['failures']) or same}")
            ok &= not r["failures"]
            continue
        if "error" in r:
            print(f"  vLLM load failed: {r['error']}")
        else:
            print(f"  vLLM's quantization: {r['quantization']}; {r['file_tensors']} file tensors")
            if r["routing"]:
                print(f"  vLLM's parsed routing fields: {r['routing']}")
            print(f"  file tensors not consumed: {r['unconsumed'] or 'none'}")
            print(f"  parameters not equal to the files: {r['mismatched'] or 'none'}")
            print(f"  parameters no file tensor fills (vLLM keeps its defaults): {leaf_counts(r['untouched'])}")
            print(f"  ... and those load_weights reports not loaded: {leaf_counts(r['not_in_vllm_loaded_set'])}")
            if r["partial"]:
                print(f"  parameters only partly filled: {r['partial']}")
            for name, src, dst, exact in r["casts"]:
                print(f"  dtype cast: {name} {src} in the file, {dst} in vLLM: "
                      + ("values exact" if exact else f"rounded by vLLM (its {dst} parameter; compared after "
                                                      "that rounding, not a defect of the file)"))
            for line in r["untied"][:3]:
                print(f"  untied fused global scales: {line}")
        print(f"  verdict: {'; '.join(r['failures']) or 'loads exactly'}"
              + (" (a control: expected to fail)" if control else ""))
        ok &= bool(r["failures"]) == control  # a save must pass every check, a control fail one
    if not args.keep:
        shutil.rmtree(root)
    controls = ", both controls are caught" if any(r["label"].startswith("control") for r in rows) else ""
    print("\nRESULT:", f"OK: every save loads as it should{controls}" if ok else "FAILED: see the verdicts above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
