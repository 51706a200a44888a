"""Linears that serving engines run as one GEMM, and the one global scale they must share.

vLLM and SGLang load a checkpoint's ``q_proj`` / ``k_proj`` / ``v_proj`` as one ``qkv_proj``,
DeepSeek's ``q_a_proj`` / ``kv_a_proj_with_mqa`` as one ``fused_qkv_a_proj``, and ``gate_proj`` /
``up_proj`` (dense MLPs, shared experts, each routed expert) as one ``gate_up_proj`` (their
``packed_modules_mapping`` / ``stacked_params_mapping``). The fused weight has one ``weight_scale_2``
and one ``input_scale``: where the shards' differ they take the max, so a shard quantized with a
smaller global scale comes out too large by the ratio, silently. ModelOpt and llm-compressor export
such linears with one shared scale; so does fp4moe, in what it quantizes
(:func:`hf_integration.quantize_linears`), loads (:func:`tie_fused_linears`, for checkpoints that do
not) and saves (:func:`check_fused_scales`).
"""

from __future__ import annotations

import torch
from torch import nn

from fp4moe_ops.moe_weights import rescale_block_scales

from .experts import NVFP4Linear
from .surgery import is_dense_gated_mlp

# shards of one serving-engine GEMM, by the checkpoint's leaf names
FUSED_LINEARS = (("q_proj", "k_proj", "v_proj"), ("q_a_proj", "kv_a_proj_with_mqa"), ("gate_proj", "up_proj"))


def shared_scale_groups(leaves: list[str]) -> list[list[str]]:
    """``leaves`` (a module's linears) split into the groups that share one global scale: each
    fused set that is complete among them, then every other leaf alone."""
    groups = [list(fused) for fused in FUSED_LINEARS if set(fused) <= set(leaves)]
    grouped = {leaf for group in groups for leaf in group}
    return groups + [[leaf] for leaf in leaves if leaf not in grouped]


def is_attention(m: nn.Module) -> bool:
    """A Transformers language-model attention module (``DeepseekV3Attention``,
    ``Qwen3MoeAttention``, ...); vision towers' (``*VisionAttention``) stay as they are, as in
    ModelOpt's default NVFP4 config."""
    name = type(m).__name__
    return name.endswith("Attention") and "Vision" not in name


def linear_groups(model: nn.Module, dense_mlps: bool, attention: bool):
    """``(name, module, kind, [[leaf, ...], ...])`` for every module whose ``nn.Linear`` children
    become NVFP4: each inner list shares one global scale, as ModelOpt exports them: an MLP's gate
    and up (so that they can run as one expert), attention's q/k/v and DeepSeek's q_a/kv_a (which
    vLLM and SGLang run as one GEMM, :mod:`hf_integration.fused_linears`)."""
    groups = []
    for name, m in model.named_modules():
        if dense_mlps and is_dense_gated_mlp(m):
            groups.append((name, m, "dense MLP", shared_scale_groups(["gate_proj", "up_proj", "down_proj"])))
        elif attention and is_attention(m):
            leaves = [attr for attr, child in m.named_children() if type(child) is nn.Linear]
            if leaves:
                groups.append((name, m, "attention", shared_scale_groups(leaves)))
    return groups


def tie_global_scales(linears: list) -> tuple[int, int] | None:
    """Give NVFP4 linears (:class:`~hf_integration.experts.NVFP4Linear`, one tensor scheme) one global
    scale, the largest, as the ModelOpt export of the same weights would have: the others' block
    scales are rescaled by ``own / largest`` and re-rounded to E4M3 (the linear with the largest is
    unchanged, byte for byte). Input scales likewise become their max (what serving engines use for
    the fused GEMM). Returns None if nothing changed, else ``(rows changed, rows zeroed)`` of the
    rescaled block scales (:func:`~fp4moe_ops.moe_weights.rescale_block_scales`)."""
    schemes = {m.scheme for m in linears}
    if len(schemes) != 1:
        raise ValueError(f"linears of one fused GEMM hold different tensor formats: {sorted(s.packed for s in schemes)}")
    s = schemes.pop()
    changed, rows, zeroed = False, 0, 0
    multipliers = [m.scale_multipliers()[0] for m in linears]
    top = max(range(len(linears)), key=lambda i: float(multipliers[i]))
    for m, g in zip(linears, multipliers):
        if m is linears[top] or torch.equal(m._buffers[s.global_scale], linears[top]._buffers[s.global_scale]):
            continue
        block = m._buffers[s.block_scale]
        rescaled, changed_rows, zeroed_rows = rescale_block_scales(block, g / multipliers[top])
        block.copy_(rescaled.to(block.dtype))
        rows, zeroed = rows + changed_rows, zeroed + zeroed_rows
        m._buffers[s.global_scale].copy_(linears[top]._buffers[s.global_scale])
        changed = True
    if all(s.input_scale in m._buffers for m in linears):
        inputs = [m.scale_multipliers()[1] for m in linears]
        largest = linears[max(range(len(linears)), key=lambda i: float(inputs[i]))]._buffers[s.input_scale]
        for m in linears:
            if not torch.equal(m._buffers[s.input_scale], largest):
                m._buffers[s.input_scale].copy_(largest)
                changed = True
    return (rows, zeroed) if changed else None


def tie_fused_linears(model: nn.Module) -> list[str]:
    """:func:`tie_global_scales` on every fused set of NVFP4 linears in ``model``; returns the sets
    that changed (``"<module>.{q_proj,k_proj,v_proj} (R rows changed, Z zeroed)"``)."""
    changed = []
    for name, m in model.named_modules():
        linears = {leaf: child for leaf, child in m.named_children() if isinstance(child, NVFP4Linear)}
        for group in shared_scale_groups(list(linears)):
            tied = tie_global_scales([linears[leaf] for leaf in group]) if len(group) > 1 else None
            if tied is not None:
                changed.append(f"{name}.{{{','.join(group)}}} ({tied[0]} rows changed, {tied[1]} zeroed)")
    return changed


def check_fused_scales(state: dict[str, torch.Tensor]) -> None:
    """Raise, naming the tensors, unless every fused set of NVFP4 linears in a ModelOpt state dict
    (``<module>.<leaf>.weight_scale_2``; routed experts' ``<experts>.<e>.gate_proj`` included)
    shares one ``weight_scale_2`` and one ``input_scale``."""
    modules = {key.rsplit(".", 2)[0] for key in state if key.endswith(".weight_scale_2")}
    for module in sorted(modules):
        for fused in FUSED_LINEARS:
            for tensor in ("weight_scale_2", "input_scale"):
                keys = [f"{module}.{leaf}.{tensor}" for leaf in fused]
                if not all(k in state for k in keys):
                    continue
                values = [state[k] for k in keys]
                if not all(torch.equal(values[0], v) for v in values[1:]):
                    raise ValueError(
                        f"{', '.join(keys)} differ ({', '.join(f'{float(v):.6g}' for v in values)}): vLLM and SGLang "
                        "run these linears as one GEMM with one scale (their max), which would scale the others "
                        "wrongly; quantize them with one global scale (hf_integration.quantize_linears does)")


__all__ = ["FUSED_LINEARS", "check_fused_scales", "is_attention", "linear_groups", "shared_scale_groups", "tie_fused_linears",
           "tie_global_scales"]
