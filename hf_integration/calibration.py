"""Calibrating activation scales for NVFP4 x NVFP4 (Blackwell's ``flashinfer_nvfp4``): each routed
expert's gate_up and down GEMM input amax is observed while the model runs on calibration data through
the reference MoE math, then stored as ModelOpt's ``input_scale = amax / (6*448)``."""

from __future__ import annotations

import types
from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn
from transformers.utils import logging

from fp4moe_ops import activation_scales, nvfp4
from fp4moe_ops.backends.reference import reference_moe
from fp4moe_ops.prepared import INPUT_SCALE_BUFFERS

from .expert_parallel import ExpertShard
from .surgery import nvfp4_experts

logger = logging.get_logger("transformers.fp4moe")  # under Transformers: set_verbosity_* applies


class _Observer:
    """Running per-expert amax of one experts module's GEMM inputs."""

    def __init__(self, name: str, num_experts: int, device):
        self.name = name
        self.gate_up_amax = torch.zeros(num_experts, device=device)
        self.down_amax = torch.zeros(num_experts, device=device)

    def __call__(self, e: int, gate_up_input: torch.Tensor, down_input: torch.Tensor) -> None:
        self.gate_up_amax[e] = torch.maximum(self.gate_up_amax[e], gate_up_input.float().abs().max())
        self.down_amax[e] = torch.maximum(self.down_amax[e], down_input.float().abs().max())


def _observed_forward(module, hidden_states, top_k_index, top_k_weights):
    """The experts forward during calibration: reference W4A16 math with the observer on."""
    ids = module.dispatch.prepare(top_k_index)
    out = reference_moe(hidden_states, ids, top_k_weights.float(), module.op_tensors(), observe=module._fp4moe_observer)
    return module.dispatch.finalize(out)


@torch.no_grad()
def calibrate_activation_scales(model: nn.Module, batches: Iterable) -> nn.Module:
    """Record per-expert activation amax of the gate_up and down GEMMs' inputs over ``batches`` and
    store ModelOpt's ``input_scale = amax / (6*448)`` as the experts' ``gate_up_proj_input_scale`` /
    ``down_proj_input_scale``.

    ``batches``: dicts of model kwargs (e.g. tokenizer output) or ``input_ids`` tensors. Every
    token of a batch counts toward the amax, padding included (``attention_mask`` reaches only the
    attention; ModelOpt and llm-compressor calibrate the same way): pass unpadded batches to leave
    padding out. Experts no batch routed to get the layer's largest scale (logged; under expert
    parallelism the largest of every rank's experts); a layer none of whose experts saw a token is
    refused, naming it. NaN or Inf
    activations, an empty batch, or scales the modules' activation mode refuses raise, naming the
    layer or batch, and leave the model as it was. A module already running NVFP4 activations
    runs the new scales afterwards. Needed only by ``backend="flashinfer_nvfp4"`` (or the
    reference backend's W4A4 math); then ``set_backend(model, backend, act_scale_mode)``.
    """
    modules = nvfp4_experts(model)
    if not modules:
        raise ValueError("model is not patched by fp4moe; call patch_moe / patch_deepseek first")
    backends = [(m.backend, m.act_scale_mode) for _, m in modules]
    observers = []
    try:
        for name, m in modules:
            m.set_backend("reference")  # the observed math reads the canonical tensors
            m._fp4moe_observer = _Observer(name, m.num_experts, m.gate_up_proj_scale.device)
            m.forward = types.MethodType(_observed_forward, m)
            observers.append(m._fp4moe_observer)
        n = 0
        for batch in batches:
            mapping = isinstance(batch, Mapping)  # a dict, or a tokenizer's BatchEncoding
            ids = batch.get("input_ids", batch.get("inputs_embeds")) if mapping else batch
            if isinstance(ids, torch.Tensor) and ids.numel() == 0:
                raise ValueError(f"calibration batch {n} holds no tokens (shape {list(ids.shape)})")
            model(**batch) if mapping else model(batch)
            n += 1
        if n == 0:
            raise ValueError("calibrate_activation_scales got no batches")
        for obs in observers:
            if not bool(torch.isfinite(obs.gate_up_amax).all() & torch.isfinite(obs.down_amax).all()):
                raise ValueError(f"calibration: {obs.name} saw NaN or Inf activations; check the calibration batches")
    finally:
        for (_, m), (backend, mode) in zip(modules, backends):
            m.__dict__.pop("forward", None)
            m.__dict__.pop("_fp4moe_observer", None)
            if backend is not None:
                m.set_backend(backend, mode)
    scales = [_input_scales(name, m, obs, n) for (name, m), obs in zip(modules, observers)]
    for (name, _), (_, mode), (gate_up_input_scale, down_input_scale) in zip(modules, backends, scales):
        if mode is not None:  # a mode the new scales cannot run is refused before anything changes
            try:
                activation_scales(gate_up_input_scale, down_input_scale, mode)
            except ValueError as exc:
                raise ValueError(f"calibration: {name}: {exc}") from None
    unseen = 0
    for (_, m), obs, (backend, mode), scale_pair in zip(modules, observers, backends, scales):
        unseen += int((obs.gate_up_amax == 0).sum())
        for name, t in zip(INPUT_SCALE_BUFFERS, scale_pair):
            m.register_buffer(name, t)
        if mode is not None:  # the mode's scales are derived from these buffers: derive them again
            m.set_backend(backend, mode)
    if unseen:
        logger.warning("fp4moe calibration: %d experts saw no tokens; they use their layer's largest scale", unseen)
    return model


def _input_scales(name: str, m: nn.Module, obs: _Observer, batches: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gate_up, down)`` input scales of one layer's experts; an expert that saw no token gets the layer's
    largest scale, over every rank's experts under expert parallelism (one collective per layer:
    every rank calibrates). A layer none of whose experts saw a token is refused, naming it:
    a scale for it would be made up."""
    largest = torch.stack([obs.gate_up_amax.max(), obs.down_amax.max()])
    if isinstance(m.dispatch, ExpertShard):
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=m.dispatch.group)
    if not bool((largest > 0).all()):
        raise ValueError(f"calibration: none of {name}'s experts saw a token in {batches} batch(es), so it has no "
                         "activation amax to give them an input scale; calibrate with batches that reach this layer "
                         "(the model is left as it was)")
    return tuple(nvfp4.global_scale_from_amax(torch.where(amax > 0, amax, top)) for amax, top in
                 zip((obs.gate_up_amax, obs.down_amax), largest))


__all__ = ["calibrate_activation_scales"]
