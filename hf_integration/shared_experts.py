"""The shared expert inside the routed experts' call: a DeepSeek-V3-style MoE block (DeepSeek-V3/R1,
Kimi-K2, GLM4-MoE) whose NVFP4 shared expert has the routed experts' shape runs it as one more
expert, chosen by every token with weight 1, in the same ``fp4moe::fused_moe`` launch.

Why: at decode the shared expert is a separate op call (a one-expert MoE, or three NVFP4 linears)
with its own launches and a separate add; inside the routed call it costs one more weight stream in
kernels that are already running, and its output is summed with the routed experts' in float32.

:class:`SharedExpertMoE` replaces the block. Its ``experts`` hold ``E + 1`` experts (the shared one
last); its state dict is the unfused block's (``experts.*`` with E experts, ``shared_experts.*`` as
:class:`~hf_integration.experts.NVFP4GatedMLP` holds it), and a save writes the checkpoint layout
(routed experts per expert, the shared expert as ``gate_proj``/``up_proj``/``down_proj`` NVFP4
linears). Not with expert parallelism (each rank would add the shared expert once).
"""

from __future__ import annotations

import torch
from torch import nn

from fp4moe_ops import NVFP4MoEWeights
from fp4moe_ops.prepared import CANONICAL_BUFFERS, INPUT_SCALE_BUFFERS

from .experts import LocalExperts, NVFP4Experts, NVFP4GatedMLP, NVFP4Linear
from .surgery import replace_module

# Transformers MoE blocks whose forward is ``routed(x) + shared_experts(x)`` with a gate returning
# ``(logits, weights [T, k], ids [T, k])`` (checked against them in tests/test_shared_experts.py)
SHARED_EXPERT_BLOCKS = ("DeepseekV3MoE", "Glm4MoeMoE")
_LEAVES = ("gate_proj", "up_proj", "down_proj")


class SharedExpertMoE(nn.Module):
    """A MoE block computing ``sum_j w_j routed_j(x) + shared(x)`` as one op call over ``E + 1`` experts.

    Children: ``gate`` (the block's router, unchanged) and ``experts`` (an
    :class:`~hf_integration.experts.NVFP4Experts` whose last expert is the shared one).
    ``num_routed`` = E.
    """

    def __init__(self, gate: nn.Module, experts: NVFP4Experts, num_routed: int):
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.num_routed = num_routed
        self._register_state_dict_hook(_split_state_dict)
        self._register_load_state_dict_pre_hook(_join_state_dict, with_module=True)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        _, weights, ids = self.gate(hidden_states)
        flat = hidden_states.view(-1, shape[-1])
        t = flat.shape[0]
        ids = torch.cat([ids, ids.new_full((t, 1), self.num_routed)], dim=1)
        weights = torch.cat([weights.float(), weights.new_ones((t, 1), dtype=torch.float32)], dim=1)
        return self.experts(flat, ids, weights).view(shape)

    def split(self) -> tuple[NVFP4MoEWeights, NVFP4MoEWeights]:
        """``(routed [E], shared [1])`` canonical weights (views of the fused tensors where the
        layout allows)."""
        w = self.experts.canonical()
        e = self.num_routed
        parts = [t if t is None else (t[:e], t[e:]) for t in (*w.tensors(), w.fc1_input_scale, w.fc2_input_scale)]
        return tuple(NVFP4MoEWeights(*(None if p is None else p[i] for p in parts)) for i in (0, 1))

    def extra_repr(self) -> str:
        return f"routed_experts={self.num_routed}, shared_experts=1 (inside the routed call)"


def _split_state_dict(module: SharedExpertMoE, state_dict, prefix, local_metadata):
    """``experts.<buffer> [E + 1]`` -> ``experts.<buffer> [E]`` and ``shared_experts.<buffer> [1]``."""
    e = module.num_routed
    for name in CANONICAL_BUFFERS + INPUT_SCALE_BUFFERS:
        key = f"{prefix}experts.{name}"
        if key in state_dict:
            t = state_dict.pop(key)
            state_dict[key], state_dict[f"{prefix}shared_experts.{name}"] = t[:e], t[e:]


def _join_state_dict(module: SharedExpertMoE, state_dict, prefix, *args):
    for name in CANONICAL_BUFFERS + INPUT_SCALE_BUFFERS:
        routed, shared = f"{prefix}experts.{name}", f"{prefix}shared_experts.{name}"
        if routed in state_dict and shared in state_dict:
            state_dict[routed] = torch.cat([state_dict[routed], state_dict.pop(shared)])


def shared_expert_weights(shared: nn.Module) -> NVFP4MoEWeights | None:
    """The shared expert as a one-expert NVFP4 layer: from an
    :class:`~hf_integration.experts.NVFP4GatedMLP`, or from ``gate_proj``/``up_proj``/``down_proj``
    :class:`~hf_integration.experts.NVFP4Linear` s (a loaded checkpoint's) whose gate and up share
    their global and input scales (ModelOpt's export makes them so); None if neither."""
    if isinstance(shared, NVFP4GatedMLP):
        return shared.canonical()
    lin = [getattr(shared, leaf, None) for leaf in _LEAVES]
    if not all(isinstance(m, NVFP4Linear) and m.bias is None for m in lin):
        return None
    gate, up, down = lin
    tensors = [m.linear_tensors() for m in lin]  # (packed, block scale, global scale, input scale or None)
    (gp, gs, gg, gi), (up_, us, ug, ui), (dp, ds, dg, di) = tensors
    if not torch.equal(gg, ug) or (gi is None) != (ui is None) or (gi is not None and not torch.equal(gi, ui)):
        return None  # gate and up on different scales: one expert cannot hold them
    if (gi is None) != (di is None):
        return None
    return NVFP4MoEWeights(torch.cat([gp, up_])[None], torch.cat([gs, us])[None], gg.reshape(1), dp[None], ds[None],
                           dg.reshape(1), None if gi is None else gi.reshape(1), None if di is None else di.reshape(1))


def _fusable(block: nn.Module) -> NVFP4MoEWeights | None:
    experts = getattr(block, "experts", None)
    if type(block).__name__ not in SHARED_EXPERT_BLOCKS or not isinstance(experts, NVFP4Experts):
        return None
    if not isinstance(experts.dispatch, LocalExperts) or experts.backend is None:  # (deepcopy copies LOCAL)
        return None
    shared = shared_expert_weights(getattr(block, "shared_experts", None))
    if shared is None or (shared.hidden_size, shared.intermediate_size) != (experts.hidden_size, experts.intermediate_size):
        return None
    if (shared.fc1_input_scale is None) != (INPUT_SCALE_BUFFERS[0] not in experts._buffers):
        return None
    return shared


def fuse_shared_experts(model: nn.Module) -> int:
    """Replace every MoE block that can run its shared expert inside the routed call (see the module
    docstring) by a :class:`SharedExpertMoE`; returns how many. Blocks that cannot (a BF16 shared
    expert, another shape, gate and up on different scales, expert parallelism) stay as they are."""
    blocks = [(parent, attr, m) for parent in model.modules() for attr, m in parent.named_children()]
    count = 0
    for parent, attr, block in blocks:
        shared = _fusable(block)
        if shared is None:
            continue
        routed = block.experts
        w = routed.canonical()
        joined = [None if a is None else torch.cat([a, b.to(a.device)])
                  for a, b in zip((*w.tensors(), w.fc1_input_scale, w.fc2_input_scale),
                                  (*shared.tensors(), shared.fc1_input_scale, shared.fc2_input_scale))]
        fused = NVFP4Experts(NVFP4MoEWeights(*joined), routed.backend, routed.act_scale_mode, owns_weights=True)
        replace_module(parent, attr, SharedExpertMoE(block.gate, fused, w.num_experts))
        count += 1
    return count


__all__ = ["SHARED_EXPERT_BLOCKS", "SharedExpertMoE", "fuse_shared_experts", "shared_expert_weights"]
