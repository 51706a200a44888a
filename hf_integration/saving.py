"""Saving an fp4moe model as a ModelOpt NVFP4 checkpoint: the state dict in ModelOpt's layout, the
quantization config it declares, and the atomic write.

``model.save_pretrained(path)`` of a model that fp4moe loaded or patched runs Transformers' own
``save_pretrained`` (the quantizer supplies the ModelOpt state dict; shards, index, config and
generation config are Transformers') into a fresh folder beside ``path``, adds
``hf_quant_config.json``, carries over the files of ``path`` that Transformers keeps when it saves
into a folder (anything but the old checkpoint's weights and configs: tokenizer files, a README),
and only then swaps the new folder in. A failure before the swap (disk full, permission error, a
bad tensor) leaves ``path`` exactly as it was; the swap itself is two renames. As a plain save would:
``path`` may be ``"."`` or a symlink (the real folder is replaced, the link keeps pointing at it), and
the new folder gets the old one's permissions (or mkdir's under the umask).
"""

from __future__ import annotations

import inspect
import json
import os
import re
import secrets
import shutil
import stat
import tempfile
from contextlib import ExitStack
from pathlib import Path

import torch
from torch import nn

from .checkpoint_format import ModelOptConfig, model_conversions
from .experts import NVFP4Linear
from .fused_linears import check_fused_scales
from .kinds import quantized_modules

# what a save replaces in the folder it saves into: the configs and every weights file or index of
# an earlier save, ``variant=`` ones included (``model.fp16-00001-of-00002.safetensors``,
# ``model.safetensors.index.fp16.json``: a loader given that variant would read the stale ones), and
# ``hf_quant_config.json``, which ModelOpt-aware readers take to say the weights are NVFP4
_REPLACED = re.compile(r"^(config\.json|generation_config\.json|hf_quant_config\.json|"
                       r"(model|pytorch_model)(\.[^.]+)?(-\d+-of-\d+)?\.(safetensors|bin)|"
                       r"(model|pytorch_model)\.(safetensors|bin)\.index(\.[^.]+)?\.json)$")


def modelopt_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict in ModelOpt's layout: every quantized module (NVFP4 experts, shared
    experts run inside the routed call, NVFP4 linears, gpt-oss's experts) as its own ModelOpt
    tensors (per expert / per linear, canonical bytes, as views where the layout allows), the rest
    as the model holds it; the FP8 KV-cache scales of the checkpoint it was loaded from, as they
    were (fp4moe does not use them)."""
    written = quantized_modules(model, outermost=True)
    if not _routed_experts(model):  # (NVFP4 linears alone: quantize_linears, which no format holds)
        raise ValueError("the model holds no fp4moe NVFP4 modules: nothing to save as a ModelOpt NVFP4 checkpoint")
    _refuse_unsaveable(written)
    _, converters = model_conversions(model)
    state = {}
    for name, m in written:
        state |= m.modelopt_tensors(name, converters)
    for key, t in model.state_dict().items():
        if not any(key.startswith(f"{n}.") for n, _ in written):
            state[key] = t
    state |= kv_cache_scales(model)
    check_fused_scales(state)
    return state


# Fields that vLLM and SGLang read from a DeepSeek-V3-architecture config.json, which DeepSeek's own
# configs carry and Transformers' DeepseekV3Config drops (its router is always this one). Without
# them vLLM routes with softmax and no correction bias: it fails on the checkpoint's
# e_score_correction_bias, or (with the bias removed) routes differently from the model saved.
def _minimax_rotary_dim(config: dict) -> int:
    """The rotated part of a MiniMax-M2 head, as Transformers' rotary embedding takes it."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return int(head_dim * (config.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0))


# Config fields vLLM and SGLang read that Transformers' config classes do not write (released
# checkpoints carry them), as Transformers' implementation runs the model; a callable computes
# the value from the saved config.
SERVING_CONFIG_FIELDS = {
    "deepseek_v3": {"topk_method": "noaux_tc", "scoring_func": "sigmoid"},
    "kimi_k2": {"topk_method": "noaux_tc", "scoring_func": "sigmoid"},
    "minimax_m2": {"scoring_func": "sigmoid", "use_routing_bias": True, "rotary_dim": _minimax_rotary_dim},
}


def add_serving_config_fields(config_file: Path) -> None:
    """Write :data:`SERVING_CONFIG_FIELDS` of the saved ``config.json``'s ``model_type`` into it
    (where absent); a saved value that says otherwise is refused, naming it."""
    config = json.loads(config_file.read_text())
    fields = SERVING_CONFIG_FIELDS.get(config.get("model_type"), {})
    for key, value in fields.items():
        value = value(config) if callable(value) else value
        if config.setdefault(key, value) != value:
            raise ValueError(f"config {key}={config[key]!r}: a {config['model_type']} model routes as {key}={value!r} "
                             "(Transformers' implementation), and vLLM and SGLang would read the saved value")
    if fields:
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def kv_cache_scales(model: nn.Module) -> dict[str, torch.Tensor]:
    """The FP8 KV-cache scales the quantizer read from the loaded checkpoint, by model key."""
    return dict(getattr(getattr(model, "hf_quantizer", None), "kv_cache_scales", None) or {})


def _refuse_unsaveable(modules: list[tuple[str, nn.Module]]) -> None:
    for name, m in modules:
        refusal = m.save_refusal()
        if refusal:
            raise ValueError(f"{name}: {refusal}")


def saved_config(model: nn.Module, config: ModelOptConfig) -> ModelOptConfig:
    """The quantization config a save writes: every module kept in 16 bits (attention, dequantized
    linears, routers, LM head) listed in ``exclude_modules``, so vLLM and SGLang read them as such."""
    _refuse_unsaveable(quantized_modules(model, outermost=True))  # (first: before any other reason the save might stop)
    kept = sorted(n for n, m in model.named_modules() if isinstance(m, nn.Linear) or (
        not isinstance(m, nn.Embedding) and isinstance(m._parameters.get("weight"), torch.Tensor)
        and m._parameters["weight"].dim() == 2))
    return ModelOptConfig(quant_algo="NVFP4" if _has_input_scales(model) else "W4A16_NVFP4",
                          exclude_modules=kept, kv_cache_quant_algo="FP8" if kv_cache_scales(model) else None,
                          producer={"name": "fp4moe"},
                          backend=config.backend, act_scale_mode=config.act_scale_mode,
                          fuse_router=config.fuse_router, expert_parallel=config.expert_parallel,
                          nvfp4_linears=config.nvfp4_linears, fuse_shared_experts=config.fuse_shared_experts)


def _has_input_scales(model: nn.Module) -> bool:
    """Whether the saved checkpoint is ``NVFP4`` (every NVFP4 tensor with an input scale) or
    ``W4A16_NVFP4``; kept NVFP4 linears must agree with the experts, since readers of a ModelOpt
    checkpoint take ``quant_algo`` to say which linears carry an ``input_scale``."""
    experts = _routed_experts(model)
    with_input = bool(experts) and all(m.holds_input_scales() for m in experts)
    for name, m in nvfp4_modules(model, NVFP4Linear):
        if m.holds_input_scales() != with_input:
            if with_input:  # calibrated experts (calibration covers only them), or a mixed checkpoint
                why = (f"NVFP4 linear {name} has no input scale while the experts have them (calibration gives "
                       "them only to the routed experts); load with nvfp4_linears='dequantize', or patch "
                       "without quantize_dense_mlps / quantize_attention")
            else:
                why = (f"NVFP4 linear {name} has an input scale while the experts have none; load with "
                       "nvfp4_linears='dequantize'")
            raise ValueError(f"cannot save as one ModelOpt quant_algo: {why}, to save this model")
    return with_input


def _routed_experts(model: nn.Module) -> list[nn.Module]:
    """The quantized modules that run routed experts (those that take a backend)."""
    return [m for _, m in quantized_modules(model) if m.takes_backend]


def nvfp4_modules(model: nn.Module, kind) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, kind)]


def atomic_save_pretrained(model: nn.Module, save_directory, *args, push_to_hub: bool = False, **kwargs):
    """``save_pretrained`` for fp4moe models (installed on the model by
    :func:`hf_integration.quantizer.attach`, and kept by ``dequantize()``, after which it saves the
    plain Transformers model the same way); arguments as Transformers'. See the module docstring.
    ``push_to_hub=True`` uploads the folder this save wrote (Transformers' own upload steps), so the
    Hub gets the same files and config as a local save. ``state_dict=`` is refused: Transformers
    saves a quantized model's state dict from its quantizer and would ignore it."""
    cls_save = type(model).save_pretrained
    signature = inspect.signature(cls_save)
    own = set(signature.parameters)  # what save_pretrained takes itself; the rest are hub arguments
    bound = signature.bind_partial(model, save_directory, *args, **kwargs).arguments
    main = bound.get("is_main_process", True)
    should_save = getattr(model, "should_save_on_this_rank", None)  # Transformers 5.24: rank 0 only, too
    if not (should_save(main) if should_save is not None else main):
        # another rank of a distributed save (accelerate's recipe: every rank calls save_pretrained):
        # Transformers writes nothing there, and neither may the swap or the Hub upload (some
        # Transformers releases create the repository from every rank: the hub arguments stay here)
        return cls_save(model, save_directory, *args, **{k: v for k, v in kwargs.items() if k in own})
    quantizer = getattr(model, "hf_quantizer", None)
    if bound.get("state_dict") is not None and quantizer is not None:
        raise ValueError("save_pretrained(state_dict=...): a model with fp4moe NVFP4 modules is saved from its own "
                         "tensors (Transformers takes a quantized model's state dict from its quantizer and would "
                         "ignore the one given); load the changed tensors into the model with load_state_dict, "
                         "then save it")
    upload = _HubUpload(model, save_directory, own, kwargs) if push_to_hub else None
    target = Path(save_directory).resolve()  # "." and symlinks: the real folder is swapped
    if target.is_file():
        raise ValueError(f"save_pretrained: {target} is a file, not a folder")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = _staging_folder(target)
    previous = quantizer.quantization_config if quantizer is not None else None
    try:
        if quantizer is None:  # a dequantized model: Transformers' own files, nothing of the old checkpoint
            cls_save(model, staging, *args, **kwargs)
        else:  # the config the quantizer saves (ModelOpt's: the modules kept in 16 bits listed)
            config = quantizer.saved_quantization_config(model)
            quantizer.quantization_config = config
            model.config.quantization_config = config
            with ExitStack() as stack:  # packed weights read in the canonical layout, in place (no copy)
                for m in model.modules():
                    if callable(getattr(m, "canonical_layout", None)):
                        stack.enter_context(m.canonical_layout())
                cls_save(model, staging, *args, **kwargs)
            if callable(getattr(config, "hf_quant_config", None)):  # ModelOpt's second copy of its config
                (staging / "hf_quant_config.json").write_text(json.dumps(config.hf_quant_config(), indent=2) + "\n")
        add_serving_config_fields(staging / "config.json")  # (a dequantized DeepSeek too: vLLM reads them in BF16)
        if target.is_dir():
            for f in target.iterdir():
                if not _REPLACED.match(f.name) and not (staging / f.name).exists():
                    _copy(f, staging / f.name)
        _swap_in(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if quantizer is not None:
            quantizer.quantization_config = previous
            model.config.quantization_config = previous
        raise
    if upload is not None:
        upload.finish(target)


def refuse_unpatched_save(model: nn.Module, *args, **kwargs):
    """``save_pretrained`` of a model that :func:`hf_integration.quantize_linears` gave NVFP4 linears
    but fp4moe did not patch or load: refused, naming a linear (Transformers would save its packed
    bytes as a BF16 weight under no quantization config, which no loader reads). Without NVFP4
    linears any more, the model's own save."""
    linears = nvfp4_modules(model, NVFP4Linear)
    if linears:
        raise ValueError(f"save_pretrained: {linears[0][0]} (and {len(linears) - 1} more) are NVFP4 linears of a model "
                         "fp4moe has not patched (quantize_linears alone), which no checkpoint format fp4moe writes "
                         "holds; patch its experts with patch_moe(model) (the NVFP4 linears are kept) and save "
                         "that: a ModelOpt NVFP4 checkpoint. Nothing was written")
    return type(model).save_pretrained(model, *args, **kwargs)


class _HubUpload:
    """``save_pretrained(..., push_to_hub=True)``'s Hub steps, in Transformers' order and with its
    helpers: the repository is created before the save, then the model card is written and the
    files the save changed are uploaded. The hub arguments (``repo_id``, ``commit_message``,
    ``create_pr``, and any that ``save_pretrained`` does not take itself, which go to
    ``create_repo``) are taken out of ``kwargs``."""

    def __init__(self, model: nn.Module, save_directory, own: set[str], kwargs: dict):
        from huggingface_hub import create_repo

        self.model, self.token = model, kwargs.get("token")
        self.commit_message = kwargs.pop("commit_message", None)
        self.create_pr = kwargs.pop("create_pr", False)
        repo_id = kwargs.pop("repo_id", os.fspath(save_directory).split(os.path.sep)[-1])
        repo_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k not in own}
        self.repo_id = create_repo(repo_id, exist_ok=True, token=self.token, **repo_kwargs).repo_id
        self.timestamps = model._get_files_timestamps(save_directory) if os.path.isdir(save_directory) else {}

    def finish(self, folder: Path) -> None:
        from transformers.utils.hub import create_and_tag_model_card

        card = create_and_tag_model_card(self.repo_id, self.model.model_tags, token=self.token)
        card.save(os.path.join(folder, "README.md"))
        self.model._upload_modified_files(folder, self.repo_id, self.timestamps, commit_message=self.commit_message,
                                          token=self.token, create_pr=self.create_pr)


def _staging_folder(target: Path) -> Path:
    """A new folder beside ``target`` with the mode a plain save leaves: the existing folder's, else
    mkdir's under the umask (``tempfile.mkdtemp``'s 0700 would hide the checkpoint from other users)."""
    while True:
        staging = target.parent / f".{target.name}.fp4moe-{secrets.token_hex(4)}"
        try:
            staging.mkdir()
            break
        except FileExistsError:
            continue
    if target.is_dir():
        os.chmod(staging, stat.S_IMODE(target.stat().st_mode))
    return staging


def _copy(src: Path, dst: Path) -> None:
    if src.is_symlink():  # a link stays a link (to a folder, say: never a copy of what it points at)
        os.symlink(os.readlink(src), dst)
        return
    if src.is_dir():
        shutil.copytree(src, dst)
        return
    try:
        os.link(src, dst)  # same filesystem: no second copy of the bytes
    except OSError:
        shutil.copy2(src, dst)


def _swap_in(staging: Path, target: Path) -> None:
    """``staging`` becomes ``target``; an existing ``target`` is kept aside until the new one is in."""
    if not target.exists():
        os.replace(staging, target)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    os.rmdir(old)
    try:
        cwd = Path.cwd()
    except FileNotFoundError:
        cwd = None
    os.replace(target, old)
    try:
        os.replace(staging, target)
    except BaseException:
        os.replace(old, target)  # put the previous checkpoint back
        raise
    if cwd is not None and (cwd == target or target in cwd.parents):
        # the process stood in the old folder, about to be deleted: into the same path in the new one
        os.chdir(cwd if cwd.is_dir() else target)
    shutil.rmtree(old, ignore_errors=True)


__all__ = ["SERVING_CONFIG_FIELDS", "add_serving_config_fields", "atomic_save_pretrained", "modelopt_state_dict",
           "refuse_unpatched_save", "saved_config"]
