"""Saving an fp4moe model as a ModelOpt NVFP4 checkpoint, atomically.

``model.save_pretrained(path)`` of a model that fp4moe loaded or patched runs Transformers' own
``save_pretrained`` (the quantizer supplies the ModelOpt state dict; shards, index, config and
generation config are Transformers') into a fresh folder beside ``path``, adds
``hf_quant_config.json``, carries over the files of ``path`` that Transformers keeps when it saves
into a folder (anything but the old checkpoint's weights and configs: tokenizer files, a README),
and only then swaps the new folder in. A failure before the swap (disk full, permission error, a
bad tensor) leaves ``path`` exactly as it was; the swap itself is two renames.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from contextlib import ExitStack
from pathlib import Path

from torch import nn

from fp4moe_ops import PreparedExperts

# what a save rewrites or Transformers deletes as stale in the folder it saves into
_REPLACED = re.compile(r"^(config\.json|generation_config\.json|hf_quant_config\.json|"
                       r"(model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)|(model|pytorch_model)\.(safetensors|bin)\.index\.json)$")


def atomic_save_pretrained(model: nn.Module, save_directory, *args, push_to_hub: bool = False, **kwargs):
    """``save_pretrained`` for fp4moe models (installed on the model by
    :func:`hf_integration.quantizer.attach`); arguments as Transformers'. See the module docstring."""
    from .quantizer import saved_config

    cls_save = type(model).save_pretrained
    if push_to_hub:  # the Hub upload is Transformers' own business (it stages in a folder of its own)
        return cls_save(model, save_directory, *args, push_to_hub=True, **kwargs)
    target = Path(save_directory)
    if target.is_file():
        raise ValueError(f"save_pretrained: {target} is a file, not a folder")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.fp4moe-", dir=target.parent))
    previous = model.hf_quantizer.quantization_config
    try:
        config = saved_config(model, previous)
        model.hf_quantizer.quantization_config = config
        model.config.quantization_config = config
        with ExitStack() as stack:  # packed weights read in the canonical layout, in place (no copy)
            for m in model.modules():
                if isinstance(m, PreparedExperts):
                    stack.enter_context(m.canonical_layout())
            cls_save(model, staging, *args, **kwargs)
        (staging / "hf_quant_config.json").write_text(json.dumps(config.hf_quant_config(), indent=2) + "\n")
        if target.is_dir():
            for f in target.iterdir():
                if not _REPLACED.match(f.name) and not (staging / f.name).exists():
                    _copy(f, staging / f.name)
        _swap_in(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        model.hf_quantizer.quantization_config = previous
        model.config.quantization_config = previous
        raise


def _copy(src: Path, dst: Path) -> None:
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
    os.replace(target, old)
    try:
        os.replace(staging, target)
    except BaseException:
        os.replace(old, target)  # put the previous checkpoint back
        raise
    shutil.rmtree(old, ignore_errors=True)


__all__ = ["atomic_save_pretrained"]
