"""The modules that hold NVFP4 weights inside a Transformers model.

* :class:`NVFP4Experts` replaces a Transformers fused-experts module (``DeepseekV3NaiveMoe``,
  ``Qwen3MoeExperts``, ...): the same call ``(hidden [T, H], top_k_index [T, k], top_k_weights
  [T, k]) -> [T, H]``, computed by ``torch.ops.fp4moe.fused_moe`` on NVFP4 weights held as a
  :class:`fp4moe_ops.PreparedExperts` (buffers ``gate_up_proj_packed`` ...). Expert parallelism
  plugs in as a dispatch step around the op (:mod:`hf_integration.expert_parallel`).
* :class:`NVFP4Linear` / :class:`FP8Linear`: a quantized linear outside the routed experts, as a
  checkpoint's tensors. The loader fills them from the file; NVFP4 ones stay (computed by
  ``fp4moe::nvfp4_linear``) unless ``nvfp4_linears="dequantize"``, FP8 ones become ``nn.Linear`` s
  with the dequantized weight; ``patch_moe(..., quantize_dense_mlps=True)`` quantizes dense MLPs'
  and shared experts' linears into them (:meth:`NVFP4Linear.quantize`).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from fp4moe_ops import PreparedExperts, nvfp4
from fp4moe_ops.backends.base import CANONICAL, convert_packed
from fp4moe_ops.linear import LINEAR_X_DTYPES, split_counters
from fp4moe_ops.moe_weights import expert_chunks
from fp4moe_ops.prepared import QuantizedBuffers, TensorSpec

from .checkpoint_format import MODELOPT, expert_leaves, expert_tensors, linear_tensors


class LocalExperts:
    """The default dispatch of :class:`NVFP4Experts`: every expert is here, nothing to exchange."""

    routed_experts = 0

    def prepare(self, top_k_index: torch.Tensor) -> torch.Tensor:
        return top_k_index

    def finalize(self, out: torch.Tensor) -> torch.Tensor:
        return out


LOCAL = LocalExperts()


class NVFP4Experts(PreparedExperts):
    """A layer's routed experts in NVFP4, in place of a Transformers fused-experts module.

    ``dispatch`` prepares the router's ids for this module's experts and finalizes the output
    (:class:`LocalExperts`, or an expert-parallel shard). What the generic code asks of a quantized
    kind (:mod:`hf_integration.kinds`) is answered below the call.
    """

    takes_backend = True
    converter_checks_values = True  # the converter that stacks the file's per-expert tensors checks them

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.dispatch = LOCAL

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        ids = self.dispatch.prepare(top_k_index)
        out = super().forward(hidden_states, ids, top_k_weights.float())
        return self.dispatch.finalize(out)

    def after_loading(self, config) -> nn.Module:
        self.set_backend(config.backend, config.act_scale_mode)
        return self

    @property
    def sharded(self) -> bool:
        """Whether this module holds only this rank's experts (expert parallelism)."""
        return not isinstance(self.dispatch, LocalExperts)  # (deepcopy copies LOCAL: not an identity test)

    def dequantized_state(self, dtype: torch.dtype, config=None, num_experts: int | None = None) -> dict[str, torch.Tensor]:
        """Transformers' fused experts tensors (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``)
        of the first ``num_experts`` experts (default: all)."""
        if self.sharded:
            raise NotImplementedError("holds only this rank's experts (expert parallelism); dequantize an unsharded "
                                      "model")
        w = self.canonical()
        e = w.num_experts if num_experts is None else num_experts
        return {"gate_up_proj": nvfp4.dequantize_nvfp4(w.gate_up[:e], w.gate_up_scale[:e], w.gate_up_global_scale[:e],
                                                       dtype),
                "down_proj": nvfp4.dequantize_nvfp4(w.down[:e], w.down_scale[:e], w.down_global_scale[:e], dtype)}

    def save_refusal(self) -> str | None:
        if self.sharded:
            return "an expert-parallel model holds only this rank's experts; save the unsharded model"
        return None

    def modelopt_tensors(self, name: str, converters=()) -> dict[str, torch.Tensor]:
        """ModelOpt's per-expert tensors ``<name>.<e>.<leaf>.*``, the leaves named as the model's
        own expert ``converters`` name them."""
        return expert_tensors(name, self.canonical(), expert_leaves(name, converters))


class NVFP4Linear(QuantizedBuffers):
    """A checkpoint's NVFP4 linear ``y = x W^T (+ b)``, held as its file tensors, named as the file's
    format names them (:class:`~hf_integration.checkpoint_format.TensorScheme`: ModelOpt's
    ``weight [N, K/2] uint8`` / ``weight_scale [N, K/16] float8_e4m3fn`` / ``weight_scale_2 []`` /
    ``input_scale []``, or compressed-tensors' ``weight_packed`` / ``weight_scale`` /
    ``weight_global_scale [1]`` / ``input_global_scale [1]``, whose per-tensor scales divide).

    The loader keeps it (``ModelOptConfig(nvfp4_linears="dequantize")``: it dequantizes it,
    :meth:`dequantized`); ``patch_moe`` makes ModelOpt ones from a 16-bit ``nn.Linear``
    (:meth:`quantize`). Kept, it computes through
    ``torch.ops.fp4moe.nvfp4_linear`` (:mod:`fp4moe_ops.linear`) and saves as ModelOpt tensors
    (:meth:`modelopt_tensors`). Its buffers keep their dtypes under ``model.to(dtype)``; the bias
    follows. Inference only: the op has no autograd formula and no autocast rule (under autocast
    it needs activations, and a bias, of one 16-bit dtype). One module must not run on two CUDA
    streams at the same time: its split-K counter table (``split_counters``) is shared by its calls.

    On a Hopper GPU the packed weight is held in the Triton kernels' paired layout (``[N/2, K/4]``
    int32, the same bytes reordered; :attr:`layout`), which their fastest small-batch kernel reads:
    the layout follows the module's device (:meth:`set_layout`), while its state dict, saves and
    ``dequantized()`` give the checkpoint's bytes as ever, and ``load_state_dict`` takes them.
    accelerate's offloading stores the state dict's bytes: ``from_pretrained(device_map=...)`` keeps
    offloaded linears canonical; to offload a model already on a Hopper GPU by hand
    (``cpu_offload``, ``dispatch_model``), ``set_layout("canonical")`` its NVFP4 linears first."""

    backend = "auto"  # fp4moe::nvfp4_linear: Triton where it runs, else the reference ("flashinfer": set it)
    COMPUTE_DTYPES = LINEAR_X_DTYPES  # the op's activations: a float64 model would fail at the first call
    layout = CANONICAL  # of the packed weight buffer; "paired" on Hopper (set_layout)

    def __init__(self, linear: nn.Linear, scheme, input_scale: bool, device: torch.device | None = None):
        super().__init__()
        n, k = linear.out_features, linear.in_features
        self.in_features, self.out_features, self.scheme = k, n, scheme
        on = dict(dtype=torch.float32, device=device)
        self.register_buffer(scheme.packed, torch.empty(n, k // 2, dtype=torch.uint8, device=device))
        self.register_buffer(scheme.block_scale, torch.empty(n, k // nvfp4.BLOCK_SIZE, dtype=torch.float8_e4m3fn,
                                                             device=device))
        self.register_buffer(scheme.global_scale, torch.empty(scheme.scalar_shape, **on))
        if input_scale:
            self.register_buffer(scheme.input_scale, torch.empty(scheme.scalar_shape, **on))
        # the Triton GEMV's split-K arrival counters (zero between calls; not part of the checkpoint)
        self.register_buffer("split_counters", split_counters(device), persistent=False)
        self.bias = linear.bias
        self.dtype = linear.weight.dtype
        self._register_state_dict_hook(_linear_canonical_state_dict)
        self._register_load_state_dict_pre_hook(_linear_load_into_layout, with_module=True)

    @classmethod
    def quantize(cls, linear: nn.Linear, global_scale: torch.Tensor | None = None) -> NVFP4Linear:
        """``linear``'s weight quantized with ModelOpt's recipe into ModelOpt's tensors (no input
        scale: W4A16), on the weight's device, a few million weights at a time.

        ``global_scale``: the multiplying per-tensor scale ``[]`` float32; default ``amax / (6*448)``
        of this weight. Linears that ModelOpt exports with one shared scale (gate and up of an MLP)
        pass it from :func:`weight_amax` of both."""
        w = linear.weight.detach()
        if global_scale is None:
            global_scale = nvfp4.global_scale_from_amax(weight_amax(w))
        q = cls(linear, MODELOPT, input_scale=False, device=w.device)
        q._buffers.update(cls.quantized_tensors(w, global_scale))
        q.set_layout(q.kernel_layout())
        return q

    @staticmethod
    def quantized_tensors(w: torch.Tensor, global_scale: torch.Tensor) -> dict[str, torch.Tensor]:
        """A 16-bit weight ``[N, K]`` in NVFP4 on ``global_scale``, as ModelOpt's tensors under their
        names (``weight``, ``weight_scale``, ``weight_scale_2``), on the weight's device, filled a few
        million weights at a time (the float32 scratch stays a chunk's)."""
        n, k = w.shape
        packed = torch.empty(n, k // 2, dtype=torch.uint8, device=w.device)
        block = torch.empty(n, k // nvfp4.BLOCK_SIZE, dtype=torch.float8_e4m3fn, device=w.device)
        with torch.no_grad():
            for r0, r1 in expert_chunks(w):
                part = nvfp4.quantize_nvfp4(w[r0:r1], global_scale)
                packed[r0:r1], block[r0:r1] = part.packed, part.block_scale
        return {MODELOPT.packed: packed, MODELOPT.block_scale: block,
                MODELOPT.global_scale: global_scale.detach().reshape(()).float().clone()}

    def scale_checks(self) -> list[tuple[str, str]]:
        """``(buffer, kind)`` of the scales whose values the loader checks (see ``check_scale_values``)."""
        s = self.scheme
        checks = [(s.global_scale, "global"), (s.block_scale, "block")]
        if s.input_scale in self._buffers:  # a compressed-tensors input scale divides: 0 is not allowed
            checks.append((s.input_scale, "global" if s.reciprocal else "input"))
        return checks

    def weight_ranges(self):
        s = self.scheme
        return [(s.block_scale, s.global_scale, s.multiplier)]

    def tensor_specs(self) -> list[TensorSpec]:
        """The file's tensors (the packed weight as the checkpoint holds it, whatever layout is held)."""
        s, n, k = self.scheme, self.out_features, self.in_features
        specs = [TensorSpec(s.packed, torch.uint8, (n, k // 2), "packed"),
                 TensorSpec(s.block_scale, torch.float8_e4m3fn, (n, k // nvfp4.BLOCK_SIZE), "block_scale"),
                 TensorSpec(s.global_scale, torch.float32, s.scalar_shape, "global_scale")]
        if s.input_scale in self._buffers:
            specs.append(TensorSpec(s.input_scale, torch.float32, s.scalar_shape, "input_scale"))
        return specs + ([] if self.bias is None else [TensorSpec("bias", self.bias.dtype, (n,), "bias")])

    def packed(self) -> torch.Tensor:
        """The packed weight as the checkpoint holds it, ``[N, K/2]`` uint8 (converted from the
        paired layout where held so: a copy)."""
        return convert_packed(self._buffers[self.scheme.packed][None], self.layout, CANONICAL)[0]

    def kernel_layout(self, device: torch.device | None = None) -> str:
        """The layout this module holds its packed weight in on ``device`` (default: its own):
        ``"paired"`` on a Hopper GPU (compute capability 9.x) where the Triton kernels run this
        shape (N % 64, K % 256) with backend ``"auto"`` or ``"triton"``, else ``"canonical"``."""
        device = torch.device(device) if device is not None else self._buffers[self.scheme.packed].device
        hook = getattr(self, "_hf_hook", None)  # accelerate's offloading keeps the state dict's bytes: canonical
        if device.type != "cuda" or self.backend not in ("auto", "triton") or self.out_features % 64 or \
                self.in_features % 256 or torch.cuda.get_device_capability(device)[0] != 9 or \
                getattr(hook, "offload", False):
            return CANONICAL
        try:
            import triton  # noqa: F401
        except ImportError:
            return CANONICAL
        from fp4moe_ops.backends.triton_moe.backend import PAIRED

        return PAIRED

    def set_layout(self, layout: str) -> None:
        """Hold the packed weight in ``layout``: ``"canonical"`` (the checkpoint's ``[N, K/2]`` uint8) or
        ``"paired"`` (``[N/2, K/4]`` int32, :func:`fp4moe_ops.backends.triton_moe.layout.paired_weight_layout`).
        A move to another device sets :meth:`kernel_layout`'s."""
        name = self.scheme.packed
        t = self._buffers[name]
        if layout == self.layout:
            return
        if layout != CANONICAL and (self.out_features % 16 or self.in_features % 4):
            raise ValueError(f"the {layout} layout needs N % 16 == 0 and K % 4 == 0; this linear is "
                             f"[{self.out_features}, {self.in_features}]")
        if t.is_meta:  # (no bytes to convert: the shape and dtype the layout has)
            n, k = self.out_features, self.in_features
            self._buffers[name] = torch.empty(*((n // 2, k // 4) if layout != CANONICAL else (n, k // 2)),
                                              dtype=torch.int32 if layout != CANONICAL else torch.uint8, device="meta")
        else:
            self._buffers[name] = convert_packed(t[None], self.layout, layout)[0]
        self.layout = layout

    @contextmanager
    def canonical_layout(self):
        """Hold the packed weight in the canonical layout for the duration of the block (converted
        in place), so that a save reads it as a view instead of a converted copy."""
        layout = self.layout
        if layout == CANONICAL:
            yield
            return
        name = self.scheme.packed
        self._buffers[name] = convert_packed(self._buffers[name][None], layout, CANONICAL, in_place=True)[0]
        self.layout = CANONICAL
        try:
            yield
        finally:
            self._buffers[name] = convert_packed(self._buffers[name][None], CANONICAL, layout, in_place=True)[0]
            self.layout = layout

    def weight_value(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The decoded weight in ``dtype`` (default: the replaced linear's)."""
        b, s = self._buffers, self.scheme
        return nvfp4.dequantize_nvfp4(self.packed(), b[s.block_scale], s.multiplier(b[s.global_scale]),
                                      dtype or self.dtype)

    def dequantized(self) -> nn.Linear:
        """An ``nn.Linear`` of the original dtype holding ``e2m1 * block scale * global scale``
        (exact up to one rounding of the float32 scale product to the dtype)."""
        return _linear_like(self, self.weight_value())

    def scale_multipliers(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(global scale, input scale or None)`` as ModelOpt's that multiply (no packed bytes read)."""
        b, s = self._buffers, self.scheme
        return s.multiplier(b[s.global_scale]), s.multiplier(b[s.input_scale]) if s.input_scale in b else None

    def linear_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(weight [N, K/2] uint8, weight_scale [N, K/16] float8, global scale, input scale or None)``,
        the scales as ModelOpt's that multiply (compressed-tensors' dividing ones as reciprocals)."""
        return (self.packed(), self._buffers[self.scheme.block_scale], *self.scale_multipliers())

    def modelopt_tensors(self, name: str, converters=()) -> dict[str, torch.Tensor]:
        """This linear's tensors under ModelOpt's names (``{name}.weight`` ...): the file's own
        bytes for a ModelOpt checkpoint; compressed-tensors' dividing scales as their reciprocals."""
        out = linear_tensors(name, *self.linear_tensors())
        return out if self.bias is None else out | {f"{name}.bias": self.bias}

    def save_refusal(self) -> str | None:
        return None

    def dequantized_state(self, dtype: torch.dtype, config=None) -> dict[str, torch.Tensor]:
        return linear_state(self.weight_value(dtype), self.bias, dtype)

    def after_loading(self, config) -> nn.Module:
        """Kept in 4 bits (``nvfp4_linears="nvfp4"``), else an ``nn.Linear`` of the decoded weight."""
        if config.nvfp4_linears != "nvfp4":
            return self.dequantized()
        self.reset_counters()
        return self

    def reset_counters(self) -> None:
        """A zeroed counter table on the weight's device (after loading, which leaves a
        non-persistent buffer unset)."""
        self.split_counters = split_counters(self._buffers[self.scheme.packed].device)

    def _apply(self, fn, recurse=True):
        # a move or to_empty() must not carry a non-zero (or uninitialized) counter along: one would
        # make a tile's parts sum early on every later call
        super()._apply(fn, recurse)
        if self.split_counters.device.type != "meta":
            self.split_counters.zero_()
        packed = self._buffers[self.scheme.packed]
        if not packed.is_meta:  # the layout follows the device
            self.set_layout(self.kernel_layout(packed.device))
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = self._buffers, self.scheme
        counters = self.split_counters if self.split_counters.device == x.device else None  # (offloaded: none)
        return torch.ops.fp4moe.nvfp4_linear(x, b[s.packed], b[s.block_scale], s.multiplier(b[s.global_scale]),
                                             self.bias, self.backend, counters)


class FP8Linear(QuantizedBuffers):
    """An FP8 linear of a ModelOpt ``MIXED_PRECISION`` export (``weight [N, K] float8_e4m3fn``,
    ``weight_scale [] float32`` that multiplies, ``input_scale``), held until the loader dequantizes it
    to the model dtype: fp4moe runs FP8 layers in 16 bits."""

    def __init__(self, linear: nn.Linear, input_scale: bool):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", torch.empty(linear.out_features, linear.in_features, dtype=torch.float8_e4m3fn))
        self.register_buffer("weight_scale", torch.empty((), dtype=torch.float32))
        if input_scale:
            self.register_buffer("input_scale", torch.empty((), dtype=torch.float32))
        self.bias = linear.bias
        self.dtype = linear.weight.dtype

    def tensor_specs(self) -> list[TensorSpec]:
        n, k = self.out_features, self.in_features
        specs = [TensorSpec("weight", torch.float8_e4m3fn, (n, k), "packed"),
                 TensorSpec("weight_scale", torch.float32, (), "global_scale")]
        if "input_scale" in self._buffers:
            specs.append(TensorSpec("input_scale", torch.float32, (), "input_scale"))
        return specs + ([] if self.bias is None else [TensorSpec("bias", self.bias.dtype, (n,), "bias")])

    def weight_value(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The decoded weight in ``dtype`` (default: the replaced linear's)."""
        return (self.weight.float() * self.weight_scale).to(dtype or self.dtype)

    def dequantized(self) -> nn.Linear:
        return _linear_like(self, self.weight_value())

    def dequantized_state(self, dtype: torch.dtype, config=None) -> dict[str, torch.Tensor]:
        return linear_state(self.weight_value(dtype), self.bias, dtype)

    def modelopt_tensors(self, name: str, converters=()) -> dict[str, torch.Tensor]:
        """The file's own FP8 tensors (ModelOpt's ``MIXED_PRECISION`` names)."""
        return {f"{name}.{key}": t for key, t in self.state_dict().items()}

    def save_refusal(self) -> str | None:
        return None

    def after_loading(self, config) -> nn.Module:
        return self.dequantized()  # fp4moe runs FP8 layers in 16 bits

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # only before the loader has swapped it
        return nn.functional.linear(x, self.weight_value().to(x.dtype), self.bias)


def _linear_canonical_state_dict(module: NVFP4Linear, state_dict, prefix, local_metadata):
    """State dicts hold the checkpoint's packed bytes, whatever layout the module keeps."""
    key = prefix + module.scheme.packed
    if key in state_dict and module.layout != CANONICAL:
        state_dict[key] = convert_packed(state_dict[key][None], module.layout, CANONICAL)[0]


def _linear_load_into_layout(module: NVFP4Linear, state_dict, prefix, *args):
    """The checkpoint's packed bytes in (checked by the earlier hook), the module's layout kept."""
    key = prefix + module.scheme.packed
    t = state_dict.get(key)
    if module.layout != CANONICAL and isinstance(t, torch.Tensor) and not t.is_meta:
        state_dict[key] = convert_packed(t[None], CANONICAL, module.layout)[0]


def weight_amax(w: torch.Tensor) -> torch.Tensor:
    """``max |w|`` as a 0-dim float32, a row chunk at a time (no full-size temporary)."""
    return torch.stack([w[r0:r1].abs().amax().float() for r0, r1 in expert_chunks(w)]).amax()


def linear_state(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A quantized linear's ``dequantized_state``: the ``nn.Linear`` tensors of its decoded weight."""
    return {"weight": weight} | ({} if bias is None else {"bias": bias.to(dtype)})


def _linear_like(m: nn.Module, weight: torch.Tensor) -> nn.Linear:
    linear = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if m.bias is not None:
        linear.bias = m.bias
    return linear


__all__ = ["FP8Linear", "LOCAL", "LocalExperts", "NVFP4Experts", "NVFP4Linear", "linear_state", "weight_amax"]
