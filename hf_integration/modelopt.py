"""``load_modelopt_nvfp4``: ``from_pretrained`` of a ModelOpt NVFP4 checkpoint with fp4moe's options,
for what plain ``from_pretrained`` cannot know by itself:

* checkpoints whose ModelOpt config is only in ``hf_quant_config.json`` (NVIDIA's DeepSeek
  exports drop ``config.json``'s ``quantization_config``): the config is read and passed on;
* expert parallelism: every rank checks that all ranks read the same checkpoint, and a failure on
  any rank is raised on every rank (no rank is left waiting in a collective).

Everything else is Transformers' ``from_pretrained`` with :class:`~hf_integration.quantizer.ModelOptQuantizer`.
"""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path

import torch
from torch import nn

from .checkpoint_format import CheckpointError, ModelOptConfig, read_json, read_quant_config


def _resolve(path_or_id: str | Path, filename: str, **hub_kwargs) -> Path | None:
    """A file of a local folder or of a Hub repo (Transformers' download and cache), or None."""
    from transformers.utils import cached_file

    local = Path(path_or_id)
    if local.is_dir():
        return local / filename if (local / filename).exists() else None
    found = cached_file(str(path_or_id), filename, _raise_exceptions_for_missing_entries=False, **hub_kwargs)
    return Path(found) if found else None


def _check_local_path(path: str | Path) -> None:
    """A clear error for a path that is a file, or a folder that does not exist, instead of the Hub's
    "Repo id must be in the form ..." (anything not on disk is tried as a Hub id only if it is one)."""
    local = Path(path)
    if local.is_dir():
        return
    if local.exists():
        raise NotADirectoryError(f"{path} is a file: load_modelopt_nvfp4 takes a checkpoint folder (config.json, "
                                 "*.safetensors) or a Hub repo id")
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(str(path))
    except HFValidationError:
        raise FileNotFoundError(f"{path}: no such checkpoint folder (nor a Hub repo id, 'name' or "
                                "'namespace/name')") from None


def _model_config(config_file: Path):
    """Transformers' config of the checkpoint (a malformed file: a CheckpointError naming it)."""
    from transformers import AutoConfig

    from .architectures import register

    register()  # Kimi-K2 as DeepSeek-V3
    read_json(config_file)
    return AutoConfig.from_pretrained(config_file.parent)


def load_modelopt_nvfp4(path: str | Path, *, dtype: torch.dtype = torch.bfloat16, device: str | torch.device | None = None,
                        device_map=None, backend: str = "auto", act_scale_mode: str | None = None,
                        expert_parallel: bool = False, fuse_router: bool = True, nvfp4_linears: str = "nvfp4",
                        fuse_shared_experts: bool = False, **from_pretrained_kwargs) -> nn.Module:
    """Load a ModelOpt NVFP4 checkpoint (a local folder or a Hub id) with NVFP4 routed experts.

    Args:
        path: folder or Hub id with ``config.json``, ``hf_quant_config.json`` (or a ModelOpt
            ``quantization_config``) and ``*.safetensors`` (sharded with an index, or not).
        dtype: dtype of the non-quantized parts and of dequantized non-expert linears.
        device / device_map: where the model goes (``device_map`` as in ``from_pretrained``:
            ``"auto"``, ``"cuda"``, ``{module prefix: device}``; ``max_memory`` also passes through).
        backend, act_scale_mode, fuse_router, expert_parallel, nvfp4_linears, fuse_shared_experts:
            see :class:`~hf_integration.checkpoint_format.ModelOptConfig`.
        from_pretrained_kwargs: anything else ``from_pretrained`` takes (``revision``, ``max_memory``, ...).

    Returns:
        the model, routed experts computed by ``torch.ops.fp4moe.fused_moe``; the checkpoint's
        input scales are kept for NVFP4 activations (:func:`hf_integration.set_backend`).
    """
    from transformers import AutoModelForCausalLM

    from .load_plan import refuse_meta_device
    from .quantizer import register

    register()
    refuse_meta_device(device_map if device_map is not None else device)
    _check_local_path(path)

    def read():
        folder_file = _resolve(path, "hf_quant_config.json") or _resolve(path, "config.json")
        if folder_file is None:
            raise FileNotFoundError(f"{path}: no config.json")
        config = read_quant_config(folder_file.parent)
        config.backend, config.act_scale_mode = backend, act_scale_mode
        config.fuse_router, config.expert_parallel = fuse_router, expert_parallel
        config.nvfp4_linears, config.fuse_shared_experts = nvfp4_linears, fuse_shared_experts
        config.post_init()  # (checks nvfp4_linears)
        return config, _model_config(_resolve(path, "config.json"))

    def load(config, model_config):
        kwargs = dict(from_pretrained_kwargs)
        kwargs.setdefault("device_map", device_map if device_map is not None else device)
        with warnings.catch_warnings():  # "you passed quantization_config ...": on purpose, for the options
            warnings.filterwarnings("ignore", message="You passed `quantization_config`")
            return AutoModelForCausalLM.from_pretrained(path, config=model_config, dtype=dtype,
                                                        quantization_config=config, **kwargs)

    if not expert_parallel:
        return load(*read())
    import torch.distributed as dist

    from .expert_parallel import same_on_every_rank, same_outcome_on_every_rank

    config, model_config = same_outcome_on_every_rank("reading the checkpoint", read)
    same_on_every_rank("checkpoint (config and tensor names, dtypes, shapes)",
                       checkpoint_fingerprint(path, config, model_config), error=CheckpointError)
    if not dist.is_initialized():
        raise RuntimeError("expert_parallel=True needs torch.distributed initialized on every rank")
    return same_outcome_on_every_rank("loading this rank's experts", lambda: load(config, model_config))


def checkpoint_fingerprint(path, config: ModelOptConfig, model_config) -> str:
    """A digest of what a rank is about to load: model config, quant config and every tensor's
    name, dtype and shape (not the bytes, and not how tensors are split into files)."""
    from .load_plan import CheckpointScan

    folder = _resolve(path, "config.json").parent
    scan = CheckpointScan([str(f) for f in sorted(folder.glob("*.safetensors"))])
    layout = sorted((k, str(v[1]), v[2]) for k, v in scan.tensors.items())
    return hashlib.sha256(repr((model_config.to_json_string(), config.to_json_string(), layout)).encode()).hexdigest()[:16]


def save_modelopt_nvfp4(model: nn.Module, path: str | Path, **kwargs) -> None:
    """``model.save_pretrained(path)`` of an fp4moe model (kept as a name for the same thing); a
    model without fp4moe's NVFP4 modules is refused rather than saved unlabelled in BF16."""
    from .quantizer import ModelOptQuantizer

    if not isinstance(getattr(model, "hf_quantizer", None), ModelOptQuantizer):
        raise ValueError("save_modelopt_nvfp4 saves fp4moe models (loaded NVFP4 or patched): this model has no fp4moe "
                         "quantizer; patch it with patch_moe / patch_deepseek first")
    model.save_pretrained(path, **kwargs)


__all__ = ["CheckpointError", "checkpoint_fingerprint", "load_modelopt_nvfp4", "read_quant_config", "save_modelopt_nvfp4"]
