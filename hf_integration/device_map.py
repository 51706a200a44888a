"""Spreading a model's layers over several GPUs (accelerate's ``device_map`` convention) when
fp4moe builds the model itself, as :func:`hf_integration.load_modelopt_nvfp4` does.

A device map sends module-name prefixes to devices (``{"model.layers.0": 0, "lm_head": 1, ...}``;
``""`` is the whole model); a module goes where its longest matching prefix says. Modules are
materialized directly on their device, experts never in BF16, and accelerate's
``dispatch_model`` then adds the hooks that move activations between devices, exactly as
``from_pretrained(device_map=...)`` does. Each fp4moe kernel launches on its experts' device.
"""

from __future__ import annotations

import torch
from torch import nn

# Bytes per routed-expert weight once loaded as NVFP4: 4 bits + one E4M3 scale per 16.
_NVFP4_BYTES_PER_WEIGHT = 0.5 + 1 / 16


def _as_device(d) -> torch.device:
    """accelerate's convention: an int is a CUDA ordinal."""
    return torch.device("cuda", d) if isinstance(d, int) else torch.device(d)


def normalize_device_map(device_map: dict) -> dict[str, torch.device]:
    """``{prefix: int | str | torch.device}`` -> ``{prefix: torch.device}``."""
    return {prefix: _as_device(d) for prefix, d in device_map.items()}


def device_for(name: str, device_map: dict[str, torch.device]) -> torch.device:
    """The device of module ``name``: its longest matching prefix in ``device_map``."""
    best = None
    for prefix in device_map:
        if prefix == "" or name == prefix or name.startswith(prefix + "."):
            if best is None or len(prefix) > len(best):
                best = prefix
    if best is None:
        raise ValueError(f"device_map places no prefix of module {name!r}; add it or a '' entry")
    return device_map[best]


def _decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    for name, mod in model.named_modules():
        if name.endswith("layers") and isinstance(mod, nn.ModuleList):
            return name, mod
    raise ValueError(f"{type(model).__name__} has no '*.layers' ModuleList to spread over devices")


def _loaded_bytes(module: nn.Module, prefix: str, expert_names: set[str]) -> float:
    """Bytes ``module`` will hold once loaded: routed experts as NVFP4, the rest as declared."""
    total = 0.0
    for name, t in list(module.named_parameters(prefix=prefix)) + list(module.named_buffers(prefix=prefix)):
        owner = name.rsplit(".", 1)[0]
        total += t.numel() * (_NVFP4_BYTES_PER_WEIGHT if owner in expert_names else t.element_size())
    return total


def auto_device_map(model: nn.Module, devices: list, expert_names: set[str] = frozenset()) -> dict[str, torch.device]:
    """Contiguous runs of decoder layers per device, balanced by the bytes each will hold
    (embeddings count on the first device, final norm and LM head on the last).

    Args:
        model: the model (meta tensors are fine: only shapes are read).
        devices: devices in pipeline order, e.g. ``[0, 1]``.
        expert_names: module names of routed experts, counted at their NVFP4 size.
    """
    devices = [_as_device(d) for d in devices]
    layers_name, layers = _decoder_layers(model)
    sizes = [_loaded_bytes(layer, f"{layers_name}.{i}", expert_names) for i, layer in enumerate(layers)]
    device_map = {"": devices[0]}  # embeddings, rotary tables and anything else before the layers
    # parameters outside the layers: the input embedding before them, norm + LM head after (~half each)
    outside = sum(t.numel() * t.element_size() for n, t in model.named_parameters() if not n.startswith(layers_name))
    total = sum(sizes) + outside
    done = outside / 2
    for i, size in enumerate(sizes):
        middle = done + size / 2
        device_map[f"{layers_name}.{i}"] = devices[min(len(devices) - 1, int(middle / total * len(devices)))]
        done += size
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    for name, _ in model.named_modules():
        if name and name.endswith(("norm", "lm_head")) and not name.startswith(layers_name):
            # a head tied to the input embedding must stay with it
            device_map[name] = devices[0] if tied and name.endswith("lm_head") else devices[-1]
    return device_map


def materialize(model: nn.Module, device_map: dict[str, torch.device], skip: set[str] = frozenset()) -> None:
    """Allocate each meta module's own tensors (uninitialized) on its device; modules named in
    ``skip`` (routed experts, replaced by NVFP4 buffers) stay on meta."""
    for name, mod in model.named_modules():
        if name in skip or not (mod._parameters or mod._buffers):
            continue
        mod.to_empty(device=device_for(name, device_map), recurse=False)


def flat_device_map(module: nn.Module, prefix: str = "") -> dict[str, torch.device]:
    """Where ``module``'s tensors are, as non-overlapping module names: the form ``from_pretrained`` hands to
    accelerate (a ``""`` entry next to others would make accelerate route every submodule's
    inputs to the ``""`` device)."""
    devices = {t.device for t in list(module.parameters()) + list(module.buffers())}
    if prefix and len(devices) == 1:
        return {prefix: devices.pop()}
    if prefix and (module._parameters or module._buffers):
        raise ValueError(f"module {prefix!r} holds tensors itself and its children span devices {sorted(map(str, devices))}")
    flat = {}
    for name, child in module.named_children():
        flat.update(flat_device_map(child, f"{prefix}.{name}" if prefix else name))
    return flat


def dispatch(model: nn.Module) -> nn.Module:
    """accelerate's hooks that move each block's inputs to its device, where the model's tensors
    span more than one device; records ``model.hf_device_map`` as ``from_pretrained`` does."""
    flat = flat_device_map(model)
    if len(set(flat.values())) < 2:
        return model
    from accelerate import dispatch_model

    return dispatch_model(model, device_map={k: str(v) for k, v in flat.items()})
