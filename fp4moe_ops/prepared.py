"""``PreparedExperts``: one MoE layer's NVFP4 experts, prepared for a backend, as the module that
owns them.

It holds the layer's tensors as buffers, the resolved backend, the layout of the packed weights
in memory, the activation-scale mode with its scales, and makes the one op call. The state dict
is always the canonical, checkpoint-like layout whatever the backend keeps in memory::

    gate_up_proj_packed        [E, 2I, H/2]  uint8          E2M1 pairs, low nibble first, rows [gate; up]
    gate_up_proj_scale         [E, 2I, H/16] float8_e4m3fn  block scales
    gate_up_proj_global_scale  [E]           float32
    down_proj_packed / down_proj_scale / down_proj_global_scale   (the same for [E, H, I])
    gate_up_proj_input_scale, down_proj_input_scale  [E] float32   calibrated activation scales, if any

In memory the ``*_packed`` buffers are in the backend's packed layout (``layout``, e.g. the
Triton backend's ``"paired"`` words: the weights are held once). A backend with tensors of its
own (FlashInfer) gets them as non-persistent ``prepared_<i>`` buffers beside the canonical ones.
State dicts saved when the input scales' buffers were named ``fc1_input_scale`` / ``fc2_input_scale``
still load (:func:`rename_old_input_scales`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from typing import NamedTuple

import torch
from torch import nn

from .backends import resolve_backend
from .backends.base import CANONICAL, convert_packed
from .backends.base import canonical_layout as op_layout  # contiguous + views; not the context manager below
from .moe_weights import BLOCK_KINDS, NVFP4MoEWeights, check_scale_values, check_weight_range
from .nvfp4 import BLOCK_SIZE
from .op import _HIDDEN_DTYPES

CANONICAL_BUFFERS = ("gate_up_proj_packed", "gate_up_proj_scale", "gate_up_proj_global_scale",
                     "down_proj_packed", "down_proj_scale", "down_proj_global_scale")
INPUT_SCALE_BUFFERS = ("gate_up_proj_input_scale", "down_proj_input_scale")
# global_max's one scale per projection, reduced from the input scales once (non-persistent)
PREPARED_INPUT_SCALE_BUFFERS = ("prepared_gate_up_input_scale", "prepared_down_input_scale")
# The input scales' buffer names before they took their projections' names: a state dict saved with
# them still loads, renamed by :func:`rename_old_input_scales` (with a warning)
OLD_INPUT_SCALE_BUFFERS = dict(zip(("fc1_input_scale", "fc2_input_scale"), INPUT_SCALE_BUFFERS))
ACT_SCALE_MODES = ("per_expert", "global_max")
_PACKED = (CANONICAL_BUFFERS[0], CANONICAL_BUFFERS[3])


def activation_scales(gate_up_input_scale: torch.Tensor | None, down_input_scale: torch.Tensor | None,
                      mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's activation scales from calibrated per-expert input scales ``[E]``.

    ``per_expert``: each expert quantizes its inputs with its own scale (the seed change).
    ``global_max``: one scale, the max over experts (vLLM / SGLang / TRT-LLM today); never
    saturates a block scale and keeps all experts on one grid. A zero scale (an expert that
    calibration never routed to) would turn that expert's inputs into zeros: refused in
    ``per_expert`` mode.
    """
    if mode not in ACT_SCALE_MODES:
        raise ValueError(f"act_scale_mode must be one of {ACT_SCALE_MODES}, got {mode!r}")
    if gate_up_input_scale is None or down_input_scale is None:
        raise ValueError("activation scales need calibrated gate_up_input_scale and down_input_scale: run "
                         "hf_integration.calibrate_activation_scales first")
    named = (("gate_up_input_scale", gate_up_input_scale), ("down_input_scale", down_input_scale))
    for name, s in named:
        bad = (~torch.isfinite(s) | (s < 0)).nonzero().flatten().tolist()
        if bad:
            raise ValueError(f"{name} is NaN, Inf or negative for experts {bad[:8]}")
    if mode == "global_max":
        gate_up_max, down_max = gate_up_input_scale.max().reshape(()), down_input_scale.max().reshape(())
        if not bool((gate_up_max > 0) & (down_max > 0)):
            raise ValueError("act_scale_mode='global_max': every calibrated input scale is 0; calibrate first")
        return gate_up_max, down_max
    for name, s in named:
        zero = (s <= 0).nonzero().flatten().tolist()
        if zero:
            raise ValueError(f"act_scale_mode='per_expert': {name} is 0 for experts {zero[:8]} (never calibrated), "
                             "which would zero their inputs; use act_scale_mode='global_max' or calibrate "
                             "with data that reaches them")
    return gate_up_input_scale, down_input_scale


class TensorSpec(NamedTuple):
    """One tensor a quantized module holds, as its state dict (and checkpoint) names it: ``role``
    is one of :data:`ROLE_CHECKS`' keys, ``"packed"`` (quantized codes), ``"bias"`` or ``"plain"``."""

    name: str
    dtype: torch.dtype
    shape: tuple
    role: str


# role -> the value rule of moe_weights.SCALE_CHECKS the tensor follows (a block scale's rule is
# its format's: E4M3 for NVFP4, E8M0 bytes for MXFP4)
ROLE_CHECKS = {"block_scale": {torch.float8_e4m3fn: "block", torch.uint8: "e8m0"},
               "global_scale": {torch.float32: "global"}, "input_scale": {torch.float32: "input"}}
# the roles whose tensors a load must give exactly as declared (quantized bytes and their scales)
QUANTIZED_ROLES = ("packed", *ROLE_CHECKS)


class QuantizedBuffers(nn.Module):
    """A module whose buffers are quantized bytes and their scales: moves apply, dtype casts do
    not (``model.to(torch.bfloat16)`` / ``.half()`` must not round the FP8 block scales or the
    float32 scales, or reinterpret the packed bytes). Parameters (a bias) follow casts as usual.
    ``load_state_dict`` checks the incoming tensors' dtypes and shapes (:meth:`incoming_layout`)
    and the values of the scales :meth:`scale_checks` names, as the constructors and the checkpoint
    loader do: a NaN or zero global scale, say, or raw E4M3 bytes as uint8, is refused naming its
    key before this module changes (it would poison or zero its outputs).

    A kind declares its tensors once in :meth:`tensor_specs`; :meth:`incoming_layout` and
    :meth:`scale_checks` follow from it. ``COMPUTE_DTYPES``: the model dtypes its op runs (a cast of
    the model to another is refused before anything changes; None: any)."""

    COMPUTE_DTYPES: tuple[torch.dtype, ...] | None = None
    # whether it runs on a backend of its choosing (``check_backend`` / ``set_backend(backend,
    # act_scale_mode)``), and whether the loader's converter checks its scale values as they arrive
    takes_backend = False
    converter_checks_values = False

    def __init__(self):
        super().__init__()
        # (first: the checks, and a parent's hooks, read the keys under their current names)
        self._register_load_state_dict_pre_hook(_rename_old_keys, with_module=True)
        self._register_load_state_dict_pre_hook(_check_incoming_scales, with_module=True)

    def tensor_specs(self) -> list[TensorSpec]:
        """The tensors this kind holds, as its state dict names them (none declared: the buffers as
        held, see :meth:`incoming_layout`)."""
        return []

    def scale_checks(self) -> list[tuple[str, str]]:
        """``(buffer, kind)`` of the scales whose values are checked (kinds of
        :data:`fp4moe_ops.moe_weights.SCALE_CHECKS`): by default the declared scales'."""
        return [(spec.name, ROLE_CHECKS[spec.role][spec.dtype]) for spec in self.tensor_specs()
                if spec.role in ROLE_CHECKS]

    def weight_ranges(self) -> list[tuple[str, str, Callable | None]]:
        """``(block scale buffer, global scale buffer, to_multiplier)`` of the weights whose largest
        decoded value is checked (:func:`fp4moe_ops.moe_weights.check_weight_range`);
        ``to_multiplier`` turns a stored global scale into the multiplying one (None: it is)."""
        return []

    def holds_input_scales(self) -> bool:
        """Whether it holds calibrated input scales (NVFP4 activations), by default a declared one."""
        return any(s.role == "input_scale" and s.name in self._buffers for s in self.tensor_specs())

    def packed_weight_count(self) -> int:
        """The weights its packed tensors hold (two E2M1 codes a byte, one FP8 code an element): the
        model's parameter count includes them. By default the declared ones, whatever layout holds them."""
        return sum(math.prod(s.shape) * (2 if s.dtype == torch.uint8 else 1) for s in self.tensor_specs()
                   if s.role == "packed")

    def incoming_layout(self) -> dict[str, tuple[torch.dtype, tuple]]:
        """``{state dict name: (dtype, shape)}`` of the quantized tensors a load must give exactly as
        held (:func:`check_incoming_layout`): the declared quantized tensors, else the persistent
        buffers, every one of them quantized bytes or a float32 scale."""
        specs = self.tensor_specs()
        if specs:
            return {s.name: (s.dtype, tuple(s.shape)) for s in specs if s.role in QUANTIZED_ROLES}
        return {name: (t.dtype, tuple(t.shape)) for name, t in self._buffers.items()
                if t is not None and name not in self._non_persistent_buffers_set}

    def _apply(self, fn, recurse=True):
        before = dict(self._buffers)
        super()._apply(fn, recurse)
        for name, new in self._buffers.items():
            old = before.get(name)
            if old is not None and new is not None and new.dtype != old.dtype:
                self._buffers[name] = old.to(device=new.device)
        dtype = self.__dict__.get("dtype")
        if isinstance(dtype, torch.dtype):  # the dtype it computes and dequantizes in follows casts, as a bias does
            self.dtype = fn(torch.empty(0, dtype=dtype)).dtype
        return self


class PreparedExperts(QuantizedBuffers):
    """One MoE layer's NVFP4 experts, ready to call: ``experts(hidden [T, H], ids [T, k], weights [T, k] fp32)``.

    Args:
        weights: the canonical NVFP4 experts; None declares empty buffers of the given sizes
            (``num_experts``, ``hidden_size``, ``intermediate_size``, ``input_scales``) to be filled
            by a checkpoint loader, then prepared with :meth:`set_backend`.
        backend, act_scale_mode: see :meth:`set_backend`; ``backend=None`` leaves it unprepared.
        owns_weights: the module may re-lay out the weights' packed tensors in place (saves a
            copy of the layer); only for tensors nobody else holds.
        check_values: check every scale's value first (:meth:`NVFP4MoEWeights.check_values`: one
            host sync per tensor, here and never per call); off only to study a bad expert.

    Attributes:
        backend: the resolved backend name (None until prepared).
        layout: the layout of the ``*_packed`` buffers in memory (``"canonical"``, ``"paired"``).
        act_scale_mode: None (16-bit activations), ``"per_expert"`` or ``"global_max"``.
        routed_experts: the op's hint when this is a shard of the router's experts, or holds a shared
            expert as one more (see ``fp4moe::fused_moe``; 0: all experts are here, none shared).
    """

    COMPUTE_DTYPES = _HIDDEN_DTYPES

    def __init__(self, weights: NVFP4MoEWeights | None = None, backend: str | None = "auto",
                 act_scale_mode: str | None = None, *, owns_weights: bool = False, num_experts: int = 0,
                 hidden_size: int = 0, intermediate_size: int = 0, input_scales: bool = False,
                 check_values: bool = True):
        super().__init__()
        if weights is None:
            e, h, i = num_experts, hidden_size, intermediate_size
            f32 = dict(dtype=torch.float32)
            weights = NVFP4MoEWeights(
                torch.empty(e, 2 * i, h // 2, dtype=torch.uint8), torch.empty(e, 2 * i, h // BLOCK_SIZE, dtype=torch.float8_e4m3fn),
                torch.empty(e, **f32), torch.empty(e, h, i // 2, dtype=torch.uint8),
                torch.empty(e, h, i // BLOCK_SIZE, dtype=torch.float8_e4m3fn), torch.empty(e, **f32),
                *((torch.empty(e, **f32), torch.empty(e, **f32)) if input_scales else ()))
            owns_weights = True
        elif check_values:
            weights.check_values()
        self.backend: str | None = None
        self.layout = CANONICAL
        self.act_scale_mode: str | None = None
        self.routed_experts = 0
        self._own_tensors = 0
        self.set_weights(weights, owns_weights=owns_weights)
        if backend is not None:
            self.set_backend(backend, act_scale_mode)
        self._register_state_dict_hook(_canonical_state_dict)
        self._register_load_state_dict_pre_hook(_load_into_layout, with_module=True)
        self.register_load_state_dict_post_hook(_reprepare_after_load)

    def tensor_specs(self) -> list[TensorSpec]:
        """The canonical tensors (the state dict's, whatever layout the backend holds)."""
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        specs = []
        for proj, n, k in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
            specs += [TensorSpec(f"{proj}_packed", torch.uint8, (e, n, k // 2), "packed"),
                      TensorSpec(f"{proj}_scale", torch.float8_e4m3fn, (e, n, k // BLOCK_SIZE), "block_scale"),
                      TensorSpec(f"{proj}_global_scale", torch.float32, (e,), "global_scale")]
        return specs + [TensorSpec(name, torch.float32, (e,), "input_scale") for name in INPUT_SCALE_BUFFERS
                        if name in self._buffers]

    def weight_ranges(self) -> list[tuple[str, str, Callable | None]]:
        return [(CANONICAL_BUFFERS[1], CANONICAL_BUFFERS[2], None), (CANONICAL_BUFFERS[4], CANONICAL_BUFFERS[5], None)]

    def incoming_expert_counts(self) -> tuple[int, ...]:
        """The expert counts a state dict may give this module's tensors (see ``incoming_layout``)."""
        return (self.num_experts,)

    # --- the weights ------------------------------------------------------------------------

    def set_weights(self, weights: NVFP4MoEWeights, *, owns_weights: bool = False) -> None:
        """Hold ``weights`` (canonical layout) in the buffers; the module is unprepared after this.
        ``owns_weights``: as in the constructor (else a later backend keeps its layout in a copy)."""
        for name, t in zip(CANONICAL_BUFFERS, weights.tensors()):
            self.register_buffer(name, t)
        for name, t in zip(INPUT_SCALE_BUFFERS, (weights.gate_up_input_scale, weights.down_input_scale)):
            if t is not None:
                self.register_buffer(name, t)
            else:
                self._buffers.pop(name, None)
        self._drop_prepared()
        self._owns_packed = owns_weights
        self.backend, self.layout, self.act_scale_mode = None, CANONICAL, None

    def canonical(self) -> NVFP4MoEWeights:
        """The weights in the canonical layout (the packed weights converted back, expert by expert,
        if the backend keeps its own layout)."""
        b = self._buffers
        tensors = [b[n] for n in CANONICAL_BUFFERS]
        for i in (0, 3):
            tensors[i] = convert_packed(tensors[i], self.layout, CANONICAL)
        return NVFP4MoEWeights(*tensors, b.get(INPUT_SCALE_BUFFERS[0]), b.get(INPUT_SCALE_BUFFERS[1]))

    @contextmanager
    def canonical_layout(self):
        """Hold the packed weights in the canonical layout for the duration of the block (converted
        in place, expert by expert, where the module owns them), e.g. so that a save reads them as
        views instead of a converted copy of every layer."""
        layout = self.layout
        if layout == CANONICAL:
            yield
            return
        # a non-canonical layout is always the module's own converted copy: convert it in place
        for name in _PACKED:
            self._buffers[name] = convert_packed(self._buffers[name], layout, CANONICAL, in_place=True)
        self.layout = CANONICAL
        try:
            yield
        finally:
            for name in _PACKED:
                self._buffers[name] = convert_packed(self._buffers[name], CANONICAL, layout, in_place=True)
            self.layout = layout

    @property
    def num_experts(self) -> int:
        return self._buffers["gate_up_proj_scale"].shape[0]

    @property
    def hidden_size(self) -> int:
        return self._buffers["gate_up_proj_scale"].shape[2] * BLOCK_SIZE

    @property
    def intermediate_size(self) -> int:
        return self._buffers["gate_up_proj_scale"].shape[1] // 2

    # --- the backend ------------------------------------------------------------------------

    def set_backend(self, backend: str = "auto", act_scale_mode: str | None = None) -> None:
        """Prepare the experts for ``backend`` on their own device. Everything is checked first:
        on an error the module is left as it was.

        Args:
            backend: ``"auto"`` picks the fastest exact backend the device runs (see
                :data:`fp4moe_ops.backends.AUTO_ORDER`), or a name from ``BACKENDS``.
            act_scale_mode: None keeps activations in 16 bits (W4A16), except on a backend that
                always quantizes them (``flashinfer_nvfp4``), which then uses ``"per_expert"``.
                ``"per_expert"`` / ``"global_max"``: NVFP4 activations with the calibrated scales
                (``gate_up_proj_input_scale`` / ``down_proj_input_scale``, see :func:`activation_scales`);
                backends ``flashinfer_nvfp4`` and ``reference`` only.
        """
        b, mode, act = self.check_backend(backend, act_scale_mode)
        own = b.prepare(self.canonical()) if b.tensors == "own" else []
        layout = b.packed_layout(self.hidden_size, self.intermediate_size) if b.tensors == "canonical" else CANONICAL
        # checks done, the backend's tensors built: now change the module
        self._drop_prepared()
        for name in _PACKED:
            self._buffers[name] = convert_packed(self._buffers[name], self.layout, layout, in_place=self._owns_packed)
        self._owns_packed = self._owns_packed or layout != self.layout
        for i, t in enumerate(own):
            self.register_buffer(f"prepared_{i}", t, persistent=False)
        self._own_tensors = len(own)
        if mode == "global_max":
            for name, t in zip(PREPARED_INPUT_SCALE_BUFFERS, act):
                self.register_buffer(name, t, persistent=False)
        self.backend, self.layout, self.act_scale_mode = b.name, layout, mode

    def check_backend(self, backend: str = "auto", act_scale_mode: str | None = None):
        """Everything :meth:`set_backend` checks, without changing the module: ``(backend object,
        activation mode, (gate_up, down) input scales for the op or Nones)``; raises ValueError otherwise."""
        gate_up_input_scale, down_input_scale = (self._buffers.get(name) for name in INPUT_SCALE_BUFFERS)
        b = resolve_backend(backend, self._buffers[CANONICAL_BUFFERS[1]].device,
                            have_activation_scales=gate_up_input_scale is not None and down_input_scale is not None)
        mode = act_scale_mode or ("per_expert" if b.activation_scales == "required" else None)
        if mode is None:
            return b, None, (None, None)
        if b.activation_scales == "forbidden":
            raise ValueError(f"backend {b.name!r} keeps activations in 16 bits; act_scale_mode={mode!r} needs "
                             "'flashinfer_nvfp4' (Blackwell) or 'reference'")
        return b, mode, activation_scales(gate_up_input_scale, down_input_scale, mode)

    def _drop_prepared(self) -> None:
        for i in range(self._own_tensors):
            self._buffers.pop(f"prepared_{i}", None)
        self._own_tensors = 0
        for name in PREPARED_INPUT_SCALE_BUFFERS:
            self._buffers.pop(name, None)

    # --- the call ---------------------------------------------------------------------------

    def op_tensors(self) -> list[torch.Tensor]:
        """The op's ``expert_tensors`` for this backend (views of the buffers; no checks, no copies)."""
        if self._own_tensors:
            return [self._buffers[f"prepared_{i}"] for i in range(self._own_tensors)]
        return op_layout([self._buffers[n] for n in CANONICAL_BUFFERS])

    def activation_scales(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The op's ``(gate_up_input_scale, down_input_scale)``: None in 16-bit activation mode."""
        if self.act_scale_mode is None:
            return None, None
        if self.act_scale_mode == "per_expert":
            return self._buffers[INPUT_SCALE_BUFFERS[0]], self._buffers[INPUT_SCALE_BUFFERS[1]]
        return self._buffers[PREPARED_INPUT_SCALE_BUFFERS[0]], self._buffers[PREPARED_INPUT_SCALE_BUFFERS[1]]

    def forward(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """``[T, H]`` bf16/fp16, ``[T, k]`` ids, ``[T, k]`` float32 weights -> ``[T, H]``."""
        if self.backend is None:
            raise RuntimeError("these experts are not prepared for a backend yet: call set_backend(...)")
        gate_up_input_scale, down_input_scale = self.activation_scales()
        return torch.ops.fp4moe.fused_moe(hidden_states, topk_ids, topk_weights, self.op_tensors(), gate_up_input_scale,
                                          down_input_scale, self.backend, self.routed_experts)

    # --- module behaviour -------------------------------------------------------------------

    def extra_repr(self) -> str:
        acts = f"NVFP4 ({self.act_scale_mode})" if self.act_scale_mode else "bf16"
        return (f"num_experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}, "
                f"weights=NVFP4, activations={acts}, backend={self.backend!r}, layout={self.layout!r}")


def _canonical_state_dict(module: PreparedExperts, state_dict, prefix, local_metadata):
    """State dicts always hold canonical packed weights, whatever layout the backend keeps."""
    for name in _PACKED:
        key = prefix + name
        if key in state_dict:
            state_dict[key] = convert_packed(state_dict[key], module.layout, CANONICAL)


def check_incoming_scales(module: nn.Module, state_dict: dict, prefix: str, strict: bool = False) -> None:
    """Raise naming the key of the first quantized tensor in ``state_dict`` (under ``prefix``) that
    ``module`` must not take: one that ``module.load_refusal`` refuses (a tensor that cannot be
    loaded without the others), one of another dtype or shape than ``module.incoming_layout()``
    gives (TypeError / ValueError; ``load_state_dict`` would convert it by value, so raw E4M3 bytes
    as uint8 become other scales and a float64 NaN slips past the value checks), then one whose
    value breaks its rule, for the ``(name, kind)`` pairs of ``module.scale_checks()`` (names
    relative to ``module``; kinds of :data:`fp4moe_ops.moe_weights.SCALE_CHECKS`). Meta tensors
    (a skeleton's ``assign=True`` load) are not checked. Experts' scales are per expert (``[E]``,
    ``[E, N, K/16]``; a fused layer may hold more experts than the state dict's routed ones); a
    linear's are one ``[]`` / ``[1]`` / ``[N, K/16]``. ``strict``: a tensor the module declares
    (:meth:`QuantizedBuffers.tensor_specs`) missing from ``state_dict`` is refused too
    (``load_state_dict`` would load the others first, and report it only at the end)."""
    experts = isinstance(module, PreparedExperts)
    if strict:
        for spec in getattr(module, "tensor_specs", list)():
            if prefix + spec.name not in state_dict:
                raise ValueError(f"load_state_dict: {prefix + spec.name} is missing (strict=True); nothing was loaded")
    refusal = getattr(module, "load_refusal", None)
    reason = refusal(state_dict, prefix) if refusal is not None else None
    if reason:
        raise ValueError(reason)
    layout = module.incoming_layout() if callable(getattr(module, "incoming_layout", None)) else {}
    counts = module.incoming_expert_counts() if experts else None
    # what a partial load is checked against: the buffers, or a module's checkpoint tensors where it
    # holds them in another layout (gpt-oss's experts on the Triton kernels)
    buffers = module.checkpoint_buffers() if callable(getattr(module, "checkpoint_buffers", None)) else module._buffers
    for name, (dtype, shape) in layout.items():
        check_incoming_layout(prefix + name, state_dict.get(prefix + name), dtype, shape, counts)
    for name, kind in module.scale_checks():
        key = prefix + name
        block = kind in BLOCK_KINDS
        t = _incoming(state_dict.get(key), buffers.get(name), _KIND_DTYPES[kind], experts)
        if t is None:
            continue
        # (a module holding a layer's experts in one tensor: [E, K/16, N] block scales, maybe [E] global ones)
        if experts or (t.dim() == 3 if block else t.dim() == 1 and t.numel() > 1):
            check_scale_values(t, kind, lambda e, key=key: f"load_state_dict: {key}[{e}]")
        elif t.dim() == 2 if block else t.numel() == 1:
            check_scale_values(t[None] if block else t.reshape(-1), kind,
                               lambda e, key=key: f"load_state_dict: {key}")
    for block_name, global_name, to_multiplier in getattr(module, "weight_ranges", list)():  # valid: in range?
        held_block, held_scale = buffers.get(block_name), buffers.get(global_name)
        block = _incoming(state_dict.get(prefix + block_name), held_block, torch.float8_e4m3fn, experts)
        scale = _incoming(state_dict.get(prefix + global_name), held_scale, torch.float32, experts)
        if block is None and scale is None:
            continue
        key = prefix + (global_name if scale is not None else block_name)
        # a partial load (strict=False) of one of the two: the other is the module's own (its first
        # rows where a fused layer holds a shared expert past the state dict's routed ones)
        block = block if block is not None else _held(held_block)
        scale = scale if scale is not None else _held(held_scale)
        if block is None or scale is None:
            continue
        multiplier = to_multiplier(scale) if to_multiplier is not None else scale
        if experts:
            n = min(block.shape[0], multiplier.shape[0])
            check_weight_range(block[:n], multiplier[:n], lambda e, key=key: f"load_state_dict: {key}[{e}]")
        elif block.dim() in (2, 3) and multiplier.numel() in (1, block.shape[0] if block.dim() == 3 else 1):
            stack = block if block.dim() == 3 else block[None]  # a linear's, or a layer's experts in one tensor
            check_weight_range(stack, multiplier.reshape(-1).expand(stack.shape[0]),
                               lambda e, key=key: f"load_state_dict: {key}" + (f" (expert {e})" if block.dim() == 3 else ""))


# the dtype each kind of scale is held in (what an incoming tensor is compared with where the module
# holds none under that name)
_KIND_DTYPES = {"block": torch.float8_e4m3fn, "e8m0": torch.uint8, "global": torch.float32, "input": torch.float32}


def check_incoming_layout(key: str, t, dtype: torch.dtype, shape: tuple, counts: tuple[int, ...] | None = None) -> None:
    """Raise TypeError / ValueError naming ``key`` if ``t`` (None: not given) is not a ``dtype``
    tensor of ``shape`` (a ``[1]`` tensor stands for a ``[]`` one, as ``load_state_dict`` takes it;
    ``counts``: an experts tensor, whose first dim may be any of these expert counts). Checked
    before any module changes: ``load_state_dict`` itself copies what fits and reports a size
    mismatch only at the end. Quantized tensors are taken only in their own dtype:
    ``load_state_dict`` converts by value, which turns E4M3 bytes given as uint8 into other scales
    and packed E2M1 bytes given as int8 into other codes."""
    if t is None or not isinstance(t, torch.Tensor) or t.is_meta:
        return
    if t.dtype != dtype:
        hint = " (raw E4M3 bytes? pass .view(torch.float8_e4m3fn))" if dtype == torch.float8_e4m3fn and \
            t.dtype in (torch.uint8, torch.int8) else ""
        raise TypeError(f"load_state_dict: {key} must be {dtype}, got {t.dtype} (shape {list(t.shape)}): quantized "
                        f"tensors and their scales are taken only in their own dtype{hint}")
    if counts is not None:
        fits = t.dim() == len(shape) and t.shape[0] in counts and tuple(t.shape[1:]) == tuple(shape[1:])
        want = " or ".join(str([n, *shape[1:]]) for n in counts)
    else:
        fits = tuple(t.shape) == tuple(shape) or (len(shape) == 0 and tuple(t.shape) == (1,))
        want = str(list(shape))
    if not fits:
        raise ValueError(f"load_state_dict: {key} must have shape {want}, got {list(t.shape)}")


def _incoming(t, held: torch.Tensor | None, dtype: torch.dtype, experts: bool) -> torch.Tensor | None:
    """``t`` as ``load_state_dict`` would take its values into ``held`` (or into a ``dtype`` tensor
    where the module holds none under that name; a ``[1]`` one as ``[]``), else None. Experts: any
    expert count (a fused layer holds one more than its state dict)."""
    if not isinstance(t, torch.Tensor) or t.is_meta or t.dtype != (held.dtype if held is not None else dtype):
        return None
    if held is None:
        return t
    if experts:
        return t if t.dim() == held.dim() and t.shape[1:] == held.shape[1:] else None
    if held.dim() == 0 and tuple(t.shape) == (1,):
        return t.reshape(())
    return t if t.shape == held.shape else None


def _held(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None or t.is_meta else t


def check_incoming_tensors(root: nn.Module, state_dict: dict, prefix: str, strict: bool = False) -> None:
    """Raise naming the key of the first tensor in ``state_dict`` that ``root`` and its submodules
    must not take, before any of them changes: quantized modules' (those with ``scale_checks``) by
    :func:`check_incoming_scales`; every other tensor (a router's weight, a bias) of another shape
    (``load_state_dict`` would load the others first and report it at the end) or an integer one
    for a float tensor (converted by value)."""
    for name, m in root.named_modules():
        at = f"{prefix}{name}." if name else prefix
        quantized = callable(getattr(m, "scale_checks", None))
        if quantized:
            check_incoming_scales(m, state_dict, at, strict)
        plain = [*m.named_parameters(recurse=False), *([] if quantized else m.named_buffers(recurse=False))]
        for tensor, held in plain:
            _check_incoming_plain(at + tensor, state_dict.get(at + tensor), held)


def _check_incoming_plain(key: str, t, held: torch.Tensor | None) -> None:
    if not isinstance(t, torch.Tensor) or held is None or t.is_meta or held.is_meta:
        return
    if held.is_floating_point() and not t.is_floating_point():
        raise TypeError(f"load_state_dict: {key} is {t.dtype}, but the model's tensor is {held.dtype}: an integer "
                        "tensor where a float one belongs would be converted by value")
    if t.shape != held.shape and not (held.dim() == 0 and tuple(t.shape) == (1,)):
        raise ValueError(f"load_state_dict: {key} must have shape {list(held.shape)}, got {list(t.shape)}")


_warned_old_names = False


def rename_old_input_scales(root: nn.Module, state_dict: dict, prefix: str = "") -> None:
    """Rename in place the keys of ``state_dict`` that give an experts module in ``root`` (``root``
    included) its input scales under their old names (:data:`OLD_INPUT_SCALE_BUFFERS`), where the
    new name is not given too; the first time, warn that the old names are deprecated."""
    global _warned_old_names
    renamed = []
    for name, m in root.named_modules():
        if not isinstance(m, PreparedExperts):
            continue
        at = f"{prefix}{name}." if name else prefix
        for old, new in OLD_INPUT_SCALE_BUFFERS.items():
            if at + old in state_dict and at + new not in state_dict:
                state_dict[at + new] = state_dict.pop(at + old)
                renamed.append(at + old)
    if renamed and not _warned_old_names:
        _warned_old_names = True
        warnings.warn(f"fp4moe: state dict keys {renamed[:2]}{' ...' if len(renamed) > 2 else ''} use the "
                      f"deprecated input-scale names {list(OLD_INPUT_SCALE_BUFFERS)}; loaded as "
                      f"{list(INPUT_SCALE_BUFFERS)} (save the model again to write the new names)",
                      FutureWarning, stacklevel=2)


def _rename_old_keys(module: QuantizedBuffers, state_dict, prefix, *args):
    rename_old_input_scales(module, state_dict, prefix)


def _check_incoming_scales(module: QuantizedBuffers, state_dict, prefix, *args):
    # (torch passes strict=True to every hook, whatever the call's: a missing tensor is checked by
    # the model's load_state_dict, hf_integration.quantizer.attach_guards)
    check_incoming_tensors(module, state_dict, prefix)


def _load_into_layout(module: PreparedExperts, state_dict, prefix, *args):
    """Canonical packed weights in, the module's layout kept."""
    for name in _PACKED:
        key = prefix + name
        if key in state_dict and module.layout != CANONICAL:
            state_dict[key] = convert_packed(state_dict[key], CANONICAL, module.layout)


def _reprepare_after_load(module: PreparedExperts, incompatible_keys) -> None:
    """A backend's own tensors and a ``global_max`` activation scale are derived from the
    canonical buffers: rebuild (and re-check) them after a load."""
    if module._own_tensors or module.act_scale_mode is not None:
        module.set_backend(module.backend, module.act_scale_mode)


def prepare_experts(weights: NVFP4MoEWeights, backend: str = "auto", act_scale_mode: str | None = None, *,
                    check_values: bool = True) -> PreparedExperts:
    """Prepare one layer's NVFP4 experts for ``backend`` on their own device (once, at load); see
    :meth:`PreparedExperts.set_backend`. ``weights`` are left as they are; their scale values are
    checked first unless ``check_values=False``."""
    return PreparedExperts(weights, backend, act_scale_mode, check_values=check_values)


__all__ = ["ACT_SCALE_MODES", "CANONICAL_BUFFERS", "INPUT_SCALE_BUFFERS", "PreparedExperts", "QuantizedBuffers",
           "TensorSpec", "activation_scales", "prepare_experts", "rename_old_input_scales"]
