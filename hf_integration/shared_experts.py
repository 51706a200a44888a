"""The shared expert inside the routed experts' call: a DeepSeek-V3-style MoE block (DeepSeek-V3/R1,
Kimi-K2, GLM4-MoE) whose NVFP4 shared expert has the routed experts' shape runs it as one more
expert, chosen by every token with weight 1, in the same ``fp4moe::fused_moe`` launch.

Why: at decode the shared expert is three separate NVFP4 linear calls and a separate add; inside
the routed call it costs one more weight stream in kernels that are already running, and its
output is summed with the routed experts' in float32.

:class:`SharedExpertMoE` replaces the block. Its ``experts`` hold ``E + 1`` experts (the shared one
last); its state dict is the unfused block's: ``experts.*`` with E experts, and
``shared_experts.gate_proj``/``up_proj``/``down_proj`` as the NVFP4 linears had them (a loaded
checkpoint's names and its file's own scalars, or ModelOpt's for a patched model). A save writes
the checkpoint layout (routed experts per expert, the shared expert as three NVFP4 linears). W4A16
only: NVFP4 activations would put the shared expert under the routed experts' activation scales
(``global_max``), so a backend or mode that quantizes activations is refused, as is expert
parallelism (each rank would add the shared expert once).
"""

from __future__ import annotations

import torch
from torch import nn

from fp4moe_ops import NVFP4MoEWeights
from fp4moe_ops.nvfp4 import BLOCK_SIZE, dequantize_nvfp4
from fp4moe_ops.prepared import CANONICAL_BUFFERS, INPUT_SCALE_BUFFERS, QuantizedBuffers

from .checkpoint_format import dense_mlp_tensors, expert_leaves, expert_tensors
from .experts import LocalExperts, NVFP4Experts, NVFP4Linear
from .surgery import replace_module

# Transformers MoE blocks whose forward is ``routed(x) + shared_experts(x)`` with a gate returning
# ``(logits, weights [T, k], ids [T, k])`` (checked against them in tests/test_shared_experts.py)
SHARED_EXPERT_BLOCKS = ("DeepseekV3MoE", "Glm4MoeMoE")
_LEAVES = ("gate_proj", "up_proj", "down_proj")


class ExpertsWithShared(NVFP4Experts):
    """:class:`~hf_integration.experts.NVFP4Experts` whose last expert is a shared expert: 16-bit
    activations only (see the module docstring)."""

    def check_backend(self, backend: str = "auto", act_scale_mode: str | None = None):
        checked = super().check_backend(backend, act_scale_mode)
        if checked[1] is not None:
            raise ValueError(
                f"backend {checked[0].name!r} with NVFP4 activations ({checked[1]}) would quantize the shared "
                "expert that runs inside these routed experts with their activation scales; to run NVFP4 "
                "activations, load without fuse_shared_experts=True, or patch with fuse_shared_experts=False")
        return checked

    def incoming_expert_counts(self) -> tuple[int, ...]:
        # the unfused state dict's routed experts, or all of them once the block has joined the shared one
        return (self.num_experts - 1, self.num_experts)


class SharedExpertMoE(QuantizedBuffers):
    """A MoE block computing ``sum_j w_j routed_j(x) + shared(x)`` as one op call over ``E + 1`` experts.

    Children: ``gate`` (the block's router, unchanged) and ``experts`` (an
    :class:`ExpertsWithShared` whose last expert is the shared one). ``num_routed`` = E;
    ``shared_scheme``: the :class:`~hf_integration.checkpoint_format.TensorScheme` of the shared
    expert's three NVFP4 linears, whose file scalars are kept (non-persistent
    ``shared_<leaf>_<tensor>`` buffers, float32 under any ``model.to(dtype)``) so that the state
    dict gives them back exactly.

    ``load_state_dict`` takes the unfused layout: everything is checked first (the shared
    expert's tensors together, dtypes, shapes, values, gate and up on one global scale), then the
    shared expert's tensors become the fused experts' last row; a failed load changes nothing.
    """

    def __init__(self, gate: nn.Module, experts: ExpertsWithShared, num_routed: int, shared_scheme,
                 shared_scalars: dict[str, torch.Tensor]):
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.num_routed = num_routed
        self.shared_scheme = shared_scheme
        for key, t in shared_scalars.items():  # key "<leaf>.<tensor>"
            self.register_buffer(_scalar_buffer(key), t, persistent=False)
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

    def scale_checks(self) -> list[tuple[str, str]]:
        """``(key, kind)`` of the shared expert's scales in the unfused state dict (see
        :func:`fp4moe_ops.prepared.check_incoming_scales`); compressed-tensors' input scales divide."""
        s = self.shared_scheme
        return [check for leaf in ("gate_proj", "up_proj", "down_proj")
                for check in ((f"shared_experts.{leaf}.{s.global_scale}", "global"),
                              (f"shared_experts.{leaf}.{s.block_scale}", "block"),
                              (f"shared_experts.{leaf}.{s.input_scale}", "global" if s.reciprocal else "input"))]

    def weight_ranges(self):
        """The shared expert's linears in the unfused state dict (see ``scale_checks``)."""
        s = self.shared_scheme
        return [(f"shared_experts.{leaf}.{s.block_scale}", f"shared_experts.{leaf}.{s.global_scale}", s.multiplier)
                for leaf in _LEAVES]

    def incoming_layout(self) -> dict[str, tuple[torch.dtype, tuple]]:
        """The shared expert's tensors in the unfused state dict, as its three linears hold them (see
        :func:`fp4moe_ops.prepared.check_incoming_layout`)."""
        s, h, i = self.shared_scheme, self.experts.hidden_size, self.experts.intermediate_size
        rows = {"gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
        layout = {}
        for leaf, (n, k) in rows.items():
            layout[f"shared_experts.{leaf}.{s.packed}"] = (torch.uint8, (n, k // 2))
            layout[f"shared_experts.{leaf}.{s.block_scale}"] = (torch.float8_e4m3fn, (n, k // BLOCK_SIZE))
            for tensor in (s.global_scale, s.input_scale):
                layout[f"shared_experts.{leaf}.{tensor}"] = (torch.float32, s.scalar_shape)
        return layout

    def load_refusal(self, state_dict: dict, prefix: str) -> str | None:
        """Why ``load_state_dict`` cannot take this block's experts in ``state_dict``, or None: routed
        experts of another count, some but not all of the shared expert's linears' weights and scales (they are joined into the fused experts
        together, so a partial load would change the state dict and not what runs), or gate and up
        on different global or input scales (the fused expert runs both on gate's: up's would be
        reported by the state dict and never used)."""
        for name in CANONICAL_BUFFERS + INPUT_SCALE_BUFFERS:  # the routed part: E experts, joined to the shared one
            t = state_dict.get(f"{prefix}experts.{name}")
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] != self.num_routed:
                return (f"load_state_dict: {prefix}experts.{name} holds {t.shape[0]} experts; this block has "
                        f"{self.num_routed} routed experts (and runs its shared expert as one more)")
        s, shared = self.shared_scheme, f"{prefix}shared_experts."
        given = {k[len(shared):]: t for k, t in state_dict.items() if k.startswith(shared)}
        if not given:
            return None
        tensors = (s.packed, s.block_scale, s.global_scale)
        if INPUT_SCALE_BUFFERS[0] in self.experts._buffers or any(k.endswith(f".{s.input_scale}") for k in given):
            tensors += (s.input_scale,)
        needed = {f"{leaf}.{t}" for leaf in _LEAVES for t in tensors}
        if not needed <= set(given):
            return (f"load_state_dict: {shared[:-1]} runs inside the routed experts' call and takes its weights and "
                    f"scales together; missing {sorted(needed - set(given))}: load all of them (or load into a model "
                    "patched or loaded with fuse_shared_experts=False)")
        for tensor in (s.global_scale, s.input_scale):
            gate, up = given.get(f"gate_proj.{tensor}"), given.get(f"up_proj.{tensor}")
            # (NaNs compare equal: one scale, refused as not finite by the value checks)
            if isinstance(gate, torch.Tensor) and isinstance(up, torch.Tensor) and not (gate.is_meta or up.is_meta) \
                    and not _same_values(gate, up):
                return (f"load_state_dict: {shared}up_proj.{tensor} ({up.reshape(-1).tolist()}) differs from "
                        f"gate_proj.{tensor} ({gate.reshape(-1).tolist()}): the fused shared expert runs gate and up "
                        "on one scale; load into a model patched or loaded with fuse_shared_experts=False")
        return None

    def split(self) -> tuple[NVFP4MoEWeights, NVFP4MoEWeights]:
        """``(routed [E], shared [1])`` canonical weights (views of the fused tensors where the
        layout allows)."""
        w = self.experts.canonical()
        return _split_weights(w, self.num_routed)

    def dequantized_state(self, dtype: torch.dtype, config=None) -> dict[str, torch.Tensor]:
        """The unfused block's tensors: its router, routed experts and the shared expert's three linears."""
        state = {f"gate.{k}": v for k, v in self.gate.state_dict().items()}
        state |= {f"experts.{k}": v for k, v in self.experts.dequantized_state(dtype, num_experts=self.num_routed).items()}
        shared = self.split()[1]
        inter = shared.intermediate_size
        gate_up = dequantize_nvfp4(shared.gate_up[0], shared.gate_up_scale[0], shared.gate_up_global_scale[0], dtype)
        state |= {"shared_experts.gate_proj.weight": gate_up[:inter], "shared_experts.up_proj.weight": gate_up[inter:],
                  "shared_experts.down_proj.weight": dequantize_nvfp4(shared.down[0], shared.down_scale[0],
                                                                      shared.down_global_scale[0], dtype)}
        return state

    def save_refusal(self) -> str | None:
        return None  # (never sharded: expert parallelism is refused for these blocks)

    def modelopt_tensors(self, name: str, converters=()) -> dict[str, torch.Tensor]:
        """The checkpoint's layout: the router, the routed experts per expert, then the shared
        expert's three linears."""
        routed, one = self.split()
        state = {f"{name}.gate.{k}": v for k, v in self.gate.state_dict().items()}
        state |= expert_tensors(f"{name}.experts", routed, expert_leaves(f"{name}.experts", converters))
        return state | dense_mlp_tensors(f"{name}.shared_experts", one)

    def extra_repr(self) -> str:
        return f"num_routed={self.num_routed}, shared_experts=1 (inside the routed call)"


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.reshape(-1).double(), b.reshape(-1).double()
    return a.shape == b.shape and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)


def _scalar_buffer(key: str) -> str:
    return "shared_" + key.replace(".", "_")


def _split_weights(w: NVFP4MoEWeights, e: int) -> tuple[NVFP4MoEWeights, NVFP4MoEWeights]:
    parts = [t if t is None else (t[:e], t[e:])
             for t in (*w.tensors(), w.gate_up_input_scale, w.down_input_scale)]
    return tuple(NVFP4MoEWeights(*(None if p is None else p[i] for p in parts)) for i in (0, 1))


def _linear_state(module: SharedExpertMoE, one: NVFP4MoEWeights) -> dict[str, torch.Tensor]:
    """The shared expert ``[1]`` as its three linears' tensors, under the scheme's names, with the
    file's scalars (``<leaf>.<tensor>`` keys). Input scales that calibration gave the fused layer
    after loading or patching (no file scalar, or one it made stale) come from ``one``, in the
    scheme's units."""
    s, i = module.shared_scheme, one.intermediate_size
    rows = {"gate_proj": (one.gate_up[0, :i], one.gate_up_scale[0, :i], one.gate_up_input_scale),
            "up_proj": (one.gate_up[0, i:], one.gate_up_scale[0, i:], one.gate_up_input_scale),
            "down_proj": (one.down[0], one.down_scale[0], one.down_input_scale)}
    out = {}
    for leaf, (packed, block, calibrated) in rows.items():
        out[f"{leaf}.{s.packed}"], out[f"{leaf}.{s.block_scale}"] = packed, block
        for tensor in (s.global_scale, s.input_scale):
            kept = module._buffers.get(_scalar_buffer(f"{leaf}.{tensor}"))
            if tensor == s.input_scale and calibrated is not None and not calibrated.is_meta and (
                    kept is None or s.multiplier(kept).reshape(-1)[0].item() != calibrated[0].item()):
                # calibrated after loading or patching: the file's scalar (if any) is stale
                out[f"{leaf}.{tensor}"] = s.multiplier(calibrated[0]).reshape(s.scalar_shape)
            elif kept is not None:
                out[f"{leaf}.{tensor}"] = kept
    return out


def _split_state_dict(module: SharedExpertMoE, state_dict, prefix, local_metadata):
    """``experts.<buffer> [E + 1]`` -> ``experts.<buffer> [E]`` and the shared expert's own keys."""
    e = module.num_routed
    fused = {name: state_dict.pop(f"{prefix}experts.{name}") for name in CANONICAL_BUFFERS + INPUT_SCALE_BUFFERS
             if f"{prefix}experts.{name}" in state_dict}
    for name, t in fused.items():
        state_dict[f"{prefix}experts.{name}"] = t[:e]
    w = NVFP4MoEWeights(*(fused[n] for n in CANONICAL_BUFFERS), *(fused.get(n) for n in INPUT_SCALE_BUFFERS))
    for key, t in _linear_state(module, _split_weights(w, e)[1]).items():
        state_dict[f"{prefix}shared_experts.{key}"] = t


def _join_state_dict(module: SharedExpertMoE, state_dict, prefix, *args):
    """The unfused layout in (after :func:`~fp4moe_ops.prepared.check_incoming_scales`, registered
    first, has checked all of it): the shared expert's tensors become the fused experts' last row.
    A partial load (``strict=False``) of the routed experts alone, or of the shared expert alone,
    keeps the module's own tensors for the other part."""
    shared, s = f"{prefix}shared_experts.", module.shared_scheme
    get = {k[len(shared):]: state_dict.pop(k) for k in [k for k in state_dict if k.startswith(shared)]}
    routed = {name: f"{prefix}experts.{name}" for name in CANONICAL_BUFFERS + INPUT_SCALE_BUFFERS
              if name in module.experts._buffers}
    if not get and not any(key in state_dict for key in routed.values()):
        return  # nothing of this block's experts here: load_state_dict reports the missing keys
    e, mult = module.num_routed, s.multiplier
    held = None
    parts = {}
    if get:
        parts = {
            "gate_up_proj_packed": torch.cat([get[f"gate_proj.{s.packed}"], get[f"up_proj.{s.packed}"]])[None],
            "gate_up_proj_scale": torch.cat([get[f"gate_proj.{s.block_scale}"], get[f"up_proj.{s.block_scale}"]])[None],
            "gate_up_proj_global_scale": mult(get[f"gate_proj.{s.global_scale}"]).reshape(1),
            "down_proj_packed": get[f"down_proj.{s.packed}"][None],
            "down_proj_scale": get[f"down_proj.{s.block_scale}"][None],
            "down_proj_global_scale": mult(get[f"down_proj.{s.global_scale}"]).reshape(1),
        }
        if f"gate_proj.{s.input_scale}" in get:
            parts[INPUT_SCALE_BUFFERS[0]] = mult(get[f"gate_proj.{s.input_scale}"]).reshape(1)
            parts[INPUT_SCALE_BUFFERS[1]] = mult(get[f"down_proj.{s.input_scale}"]).reshape(1)
    for name, key in routed.items():
        if key not in state_dict and name not in parts:
            continue
        if key not in state_dict or name not in parts:  # one part given: the other is the module's own
            held = held if held is not None else _canonical_tensors(module.experts)
        head = state_dict[key] if key in state_dict else held[name][:e]
        tail = parts[name] if name in parts else held[name][e:]
        state_dict[key] = torch.cat([head, tail.to(head.device)])
    for key, t in get.items():  # the file's scalars, kept as they are
        if _scalar_buffer(key) in module._buffers:
            module._buffers[_scalar_buffer(key)].copy_(t.reshape(module._buffers[_scalar_buffer(key)].shape))


def _canonical_tensors(experts: ExpertsWithShared) -> dict[str, torch.Tensor]:
    w = experts.canonical()
    return dict(zip(CANONICAL_BUFFERS + INPUT_SCALE_BUFFERS,
                    (*w.tensors(), w.gate_up_input_scale, w.down_input_scale)))


def shared_expert_weights(shared: nn.Module):
    """The shared expert as a one-expert NVFP4 layer, with how it was held: ``(weights, scheme,
    file scalars)`` from ``gate_proj``/``up_proj``/``down_proj``
    :class:`~hf_integration.experts.NVFP4Linear` s (a loaded checkpoint's, or ``patch_moe``'s) whose
    gate and up share their global and input scales (ModelOpt's export and ``patch_moe`` make them
    so); None otherwise."""
    lin = [getattr(shared, leaf, None) for leaf in _LEAVES]
    if not all(isinstance(m, NVFP4Linear) and m.bias is None for m in lin):
        return None
    if len({m.scheme for m in lin}) != 1:
        return None
    (gp, gs, gg, gi), (up, us, ug, ui), (dp, ds, dg, di) = (m.linear_tensors() for m in lin)
    if not torch.equal(gg, ug) or (gi is None) != (ui is None) or (gi is not None and not torch.equal(gi, ui)):
        return None  # gate and up on different scales: one expert cannot hold them
    if (gi is None) != (di is None):
        return None
    scheme = lin[0].scheme
    scalars = {f"{leaf}.{t}": m._buffers[t].clone() for leaf, m in zip(_LEAVES, lin)
               for t in (scheme.global_scale, scheme.input_scale) if t in m._buffers}
    weights = NVFP4MoEWeights(torch.cat([gp, up])[None], torch.cat([gs, us])[None], gg.reshape(1), dp[None], ds[None],
                              dg.reshape(1), None if gi is None else gi.reshape(1), None if di is None else di.reshape(1))
    return weights, scheme, scalars


def _fusable(block: nn.Module):
    experts = getattr(block, "experts", None)
    if type(block).__name__ not in SHARED_EXPERT_BLOCKS or not isinstance(experts, NVFP4Experts):
        return None
    if not isinstance(experts.dispatch, LocalExperts) or experts.act_scale_mode is not None:  # (deepcopy copies LOCAL)
        return None
    if any(b.device.type == "meta" for b in experts.buffers()):  # offloaded by a device_map: its hook owns them
        return None
    found = shared_expert_weights(getattr(block, "shared_experts", None))
    if found is None:
        return None
    shared = found[0]
    if any(t.device.type == "meta" for t in shared.tensors()):
        return None
    if (shared.hidden_size, shared.intermediate_size) != (experts.hidden_size, experts.intermediate_size):
        return None
    if (shared.gate_up_input_scale is None) != (INPUT_SCALE_BUFFERS[0] not in experts._buffers):
        return None
    return found


def routed_rows_hint(num_routed: int, top_k: int) -> int:
    """``fp4moe::fused_moe``'s ``routed_experts`` hint for ``num_routed`` experts of top-``top_k``
    (``top_k >= 1``) with the shared expert as one more on every token. The Triton backend picks
    its tiles by the expected rows per expert, slots over this hint: counted over E + 1 experts,
    the shared expert's T slots put 512 DeepSeek-V3 tokens at 17.9 rows per expert (the prefill
    bucket) where the routed experts hold 16 (the middle bucket). Over E (k + 1) / k the (k + 1) T
    slots give the routed experts' own k T / E, and so their tiles (what that gains, and which
    token counts were not measured: benchmarks/NOTES.md, "The shared expert inside the routed
    call")."""
    return round(num_routed * (top_k + 1) / top_k)


def fuse_shared_experts(model: nn.Module) -> int:
    """Replace every MoE block that can run its shared expert inside the routed call (see the module
    docstring) by a :class:`SharedExpertMoE`; returns how many. Blocks that cannot (a BF16 shared
    expert, another shape, gate and up on different scales, NVFP4 activations, expert parallelism,
    tensors offloaded to the meta device) stay as they are. The fused experts get the op's bucket
    hint from the gate's ``top_k`` (:func:`routed_rows_hint`)."""
    blocks = [(parent, attr, m) for parent in model.modules() for attr, m in parent.named_children()]
    count = 0
    for parent, attr, block in blocks:
        found = _fusable(block)
        if found is None:
            continue
        shared, scheme, scalars = found
        routed = block.experts
        with routed.canonical_layout():  # views of the routed bytes: the concatenation is the one copy
            w = routed.canonical()
            joined = [None if a is None else torch.cat([a, b.to(a.device)])
                      for a, b in zip((*w.tensors(), w.gate_up_input_scale, w.down_input_scale),
                                      (*shared.tensors(), shared.gate_up_input_scale, shared.down_input_scale))]
        fused = ExpertsWithShared(NVFP4MoEWeights(*joined), routed.backend, owns_weights=True)
        if hasattr(routed, "_hf_hook"):  # a device_map hook placed on the experts themselves
            from accelerate.hooks import add_hook_to_module

            add_hook_to_module(fused, routed._hf_hook)
        top_k = getattr(block.gate, "top_k", None)
        if top_k:
            fused.routed_experts = routed_rows_hint(w.num_experts, top_k)
        replace_module(parent, attr, SharedExpertMoE(block.gate, fused, w.num_experts, scheme, scalars))
        count += 1
    return count


__all__ = ["SHARED_EXPERT_BLOCKS", "ExpertsWithShared", "SharedExpertMoE", "fuse_shared_experts",
           "routed_rows_hint", "shared_expert_weights"]
