"""gpt-oss's routed experts kept 4-bit inside a Transformers model: :class:`MXFP4GptOssExperts` (OpenAI's
MXFP4 release) and :class:`NVFP4GptOssExperts` (ModelOpt's NVFP4 export of gpt-oss).

Each takes the place of Transformers' ``GptOssExperts`` (same call: ``(hidden [T, H], router_indices
[T, k], routing_weights [T, k])``, Transformers' own ``GptOssTopKRouter`` in front) and holds the
checkpoint's tensors under the checkpoint's names and in its bytes, so loading copies the file's
bytes straight in and ``save_pretrained`` writes them back unchanged. Its forward is one
``fp4moe::gpt_oss_moe`` call. The biases are frozen parameters in the model's dtype, as Transformers
holds them; the quantized tensors never follow ``model.to(dtype)``.

* MXFP4: ``gate_up_proj_blocks``, ``gate_up_proj_scales``, ``gate_up_proj_bias``, ``down_proj_blocks``,
  ``down_proj_scales``, ``down_proj_bias`` (:mod:`fp4moe_ops.mxfp4`);
* NVFP4: ModelOpt's fused tensors, the transposes of the op's (``gate_up_proj [E, H/2, 2I]`` uint8
  packed along H, ``gate_up_proj_weight_scale [E, H/16, 2I]`` E4M3, one ``gate_up_proj_weight_scale_2``
  float32 for the layer, ``gate_up_proj_input_scale`` where calibrated, ``gate_up_proj_bias [E, 2I]``;
  ``down_proj`` alike with ``[E, I/2, H]``), gate and up interleaved along 2I. The activations stay
  16-bit: calibrated input scales are kept for saving, and not used. llm-compressor's export (one
  linear per expert, one global scale per expert) is held in the same layout with ``weight_scale_2 [E]``
  (``per_expert_scales``; :class:`~hf_integration.expert_conversion.StackGptOssExperts` reads it): its
  dividing global scales as their multiplying reciprocals, its gate and up rows interleaved, its
  input scales (checked at load) not held. ModelOpt's gpt-oss format has one global scale per
  projection, so such a layer cannot be saved as ModelOpt's (``save_pretrained`` refuses it).

On the Triton backend (Hopper) the weights and block scales are held once, in the kernels' layout
(:func:`fp4moe_ops.backends.triton_moe.layout.gpt_oss_kernel_tensors`: the same codes and scale
bytes, H and I as they are where they are multiples of 64, as gpt-oss's 2880), as non-persistent buffers; the state dict still holds
the checkpoint's tensors, converted back exactly, and ``load_state_dict`` goes through them. The
kernels' copies (float32 biases, NVFP4's global scales) follow ``load_state_dict``, moves and casts,
not in-place edits of the held tensors: change them through ``load_state_dict``.
"""

from __future__ import annotations

import torch
from torch import nn

from fp4moe_ops.backends import resolve_gpt_oss_backend
from fp4moe_ops.backends.base import check_nvfp4_gpt_oss_tensors
from fp4moe_ops.mxfp4 import dequantize_gpt_oss, gpt_oss_shapes
from fp4moe_ops.gpt_oss_op import _FLOAT_DTYPES, MXFP4_EXPERT_TENSORS, check_mxfp4_experts
from fp4moe_ops.nvfp4 import dequantize_nvfp4
from fp4moe_ops.prepared import QuantizedBuffers, TensorSpec

# gpt-oss as fp4moe reads it (``swiglu_alpha`` / ``swiglu_limit`` in its config, the experts' math
# checked against Transformers' own GptOssMLP) is Transformers 5.24's and 5.25's; 5.17's differs
# (its config has no swiglu_alpha, and its MLP's outputs are not those of the same weights here).
# Older releases keep their own "mxfp4" quantizer, and NVFP4 gpt-oss is refused there.
MIN_TRANSFORMERS = (5, 24)


def supported() -> bool:
    """Whether this Transformers' gpt-oss is the one fp4moe's gpt-oss modules are tested against."""
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__).release >= MIN_TRANSFORMERS


def modelopt_gpt_oss_specs(proj: str, experts: int, n: int, k: int, input_scales: bool,
                           per_expert_scales: bool = False) -> dict[str, tuple]:
    """``{name: (dtype, shape)}`` of projection ``proj``'s quantized tensors (``n`` outputs, ``k``
    inputs) as ModelOpt exports gpt-oss: the packed weight ``[E, K/2, N]`` (bytes along K), E4M3 block
    scales ``[E, K/16, N]``, one float32 global scale (and input scale) for the layer, or
    (``per_expert_scales``) a global scale ``[E]`` per expert."""
    specs = {proj: (torch.uint8, (experts, k // 2, n)),
             f"{proj}_weight_scale": (torch.float8_e4m3fn, (experts, k // 16, n)),
             f"{proj}_weight_scale_2": (torch.float32, (experts,) if per_expert_scales else ())}
    if input_scales:
        specs[f"{proj}_input_scale"] = (torch.float32, ())
    return specs


# ModelOpt's gpt-oss tensor suffixes -> their role in a TensorSpec
_MODELOPT_ROLES = {"": "packed", "_weight_scale": "block_scale", "_weight_scale_2": "global_scale",
                   "_input_scale": "input_scale"}


class _GptOssExperts(QuantizedBuffers):
    """What both formats share: the call, the switch to and from the Triton kernels' layout, a
    state dict and loads that go through the checkpoint's tensors in either layout, and the
    contract of :class:`~fp4moe_ops.prepared.QuantizedBuffers` (checked loads, casts that keep the
    quantized tensors) from the tensors a subclass declares (:meth:`tensor_specs`). A subclass names
    the held tensors the kernels' layout replaces (``QUANTIZED``), the kernels' buffers
    (``KERNEL_BUFFERS``) and where the biases sit in the op's tensors (``BIASES``), and moves the
    op's tensors in and out of its held ones (:meth:`_held_op_tensors`, :meth:`_checkpoint_form`)."""

    QUANTIZED: tuple[str, ...] = ()
    KERNEL_BUFFERS: tuple[str, ...] = ()
    BIASES: tuple[int, int] = (0, 0)
    COMPUTE_DTYPES = _FLOAT_DTYPES  # fp4moe::gpt_oss_moe's activations

    def _setup(self, config) -> None:
        self.num_experts = config.num_local_experts
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size
        self.swiglu_alpha = float(config.swiglu_alpha)
        self.limit = float(config.swiglu_limit)
        self.backend = "reference"

    def _register_layout_hooks(self) -> None:
        self._register_state_dict_hook(_checkpoint_state_dict)
        self._register_load_state_dict_pre_hook(_load_through_checkpoint_layout, with_module=True)
        self.register_load_state_dict_post_hook(_back_to_kernel_layout)

    def _held_op_tensors(self) -> list[torch.Tensor]:
        """The op's tensors, read from the held checkpoint tensors (views where they can be)."""
        raise NotImplementedError

    def _checkpoint_form(self, op_tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """The :data:`QUANTIZED` tensors of the op's tensors ``op_tensors``, in the checkpoint's form."""
        raise NotImplementedError

    def _bias_specs(self) -> list[TensorSpec]:
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        return [TensorSpec(f"{proj}_bias", getattr(self, f"{proj}_bias").dtype, (e, n), "bias")
                for proj, n in (("gate_up_proj", 2 * i), ("down_proj", h))]

    def checkpoint_buffers(self) -> dict[str, torch.Tensor]:
        """The buffers under the checkpoint's names, whichever layout holds them (what a partial
        ``load_state_dict`` is checked against: a new global scale with the held block scales)."""
        held = {name: t for name, t in self._buffers.items() if t is not None}
        return held | (self._checkpoint_form(self.op_tensors()) if self.kernel_layout else {})

    @property
    def kernel_layout(self) -> bool:
        """Whether the weights and block scales are held in the Triton kernels' layout."""
        return self._buffers.get(self.KERNEL_BUFFERS[0]) is not None

    def op_tensors(self) -> list[torch.Tensor]:
        """The experts as ``fp4moe::gpt_oss_moe`` takes them outside the kernels' layout (also what
        :meth:`dequantized` decodes): read from the held tensors, or converted back from the
        kernels' layout byte for byte."""
        if not self.kernel_layout:
            return self._held_op_tensors()
        from fp4moe_ops.backends.triton_moe.layout import gpt_oss_checkpoint_tensors

        tensors = gpt_oss_checkpoint_tensors(self.expert_tensors(), self.hidden_size, self.intermediate_size,
                                             self.gate_up_proj_bias.dtype)
        gate_up_bias, down_bias = self.BIASES
        tensors[gate_up_bias], tensors[down_bias] = self.gate_up_proj_bias, self.down_proj_bias  # (the held ones, exactly)
        return tensors

    def expert_tensors(self) -> list[torch.Tensor]:
        """What the op runs: the kernels' layout on Triton, else :meth:`op_tensors`."""
        if self.kernel_layout:
            return [self._buffers[name] for name in self.KERNEL_BUFFERS]
        return self._held_op_tensors()

    takes_backend = True

    def check_backend(self, backend: str = "auto", act_scale_mode: str | None = None):
        """The backend :meth:`set_backend` would run, without changing the module; raises ValueError
        otherwise (gpt-oss's experts keep activations in 16 bits: no ``act_scale_mode``)."""
        if act_scale_mode is not None:
            raise ValueError(f"act_scale_mode={act_scale_mode!r}: gpt-oss's experts keep activations in 16 bits in "
                             "fp4moe: act_scale_mode must be None")
        return resolve_gpt_oss_backend(backend, self.gate_up_proj_bias.device)

    def set_backend(self, backend: str = "auto", act_scale_mode: str | None = None) -> str:
        """Resolve ``backend`` for the device the experts are on (``auto``: the fastest that runs
        gpt-oss's experts there, with a warning naming any faster one that does not) and hold the
        tensors in its layout; returns its name. Nothing changes when it raises."""
        name = self.check_backend(backend, act_scale_mode).name
        if name == "triton" and not self.kernel_layout:
            self._to_kernel_layout()
        elif name != "triton" and self.kernel_layout:
            self._to_checkpoint_layout()
        self.backend = name
        return self.backend

    @torch.no_grad()
    def _to_kernel_layout(self) -> None:
        from fp4moe_ops.backends.triton_moe.layout import gpt_oss_kernel_tensors

        kernel = gpt_oss_kernel_tensors(self.op_tensors())  # (raises, naming the tensor, before any change)
        for name in self.QUANTIZED:
            self._buffers[name] = None  # held once: the kernels' copy
        for name, t in zip(self.KERNEL_BUFFERS, kernel):
            self.register_buffer(name, t, persistent=False)

    @torch.no_grad()
    def _to_checkpoint_layout(self) -> None:
        self._buffers.update(self._checkpoint_form(self.op_tensors()))
        for name in self.KERNEL_BUFFERS:
            del self._buffers[name]

    def _apply(self, fn, recurse=True):
        """Moves and casts: the kernels' float32 biases follow the bias parameters (as cast), the
        quantized tensors stay as they are."""
        super()._apply(fn, recurse)
        if self.kernel_layout:
            from fp4moe_ops.backends.triton_moe.layout import gpt_oss_kernel_biases

            gate_up_scale, down_scale = self._buffers["kernel_gate_up_scale"], self._buffers["kernel_down_scale"]
            with torch.no_grad():
                self.kernel_gate_up_bias, self.kernel_down_bias = gpt_oss_kernel_biases(
                    self.gate_up_proj_bias.to(gate_up_scale.device), self.down_proj_bias.to(down_scale.device),
                    gate_up_scale.shape[1] // 2, down_scale.shape[1])
        return self

    def forward(self, hidden_states: torch.Tensor, router_indices: torch.Tensor,
                routing_weights: torch.Tensor) -> torch.Tensor:
        return torch.ops.fp4moe.gpt_oss_moe(hidden_states, router_indices, routing_weights.float(),
                                            self.expert_tensors(), self.swiglu_alpha, self.limit, self.backend)

    def _decoded(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``gate_up [E, 2I, H]`` and ``down [E, H, I]`` decoded to ``dtype`` (rows: output features)."""
        raise NotImplementedError

    @torch.no_grad()
    def dequantized(self, config, dtype: torch.dtype) -> nn.Module:
        """Transformers' ``GptOssExperts`` holding these experts decoded to ``dtype`` (its ``[E, K, N]``
        layout: the transposes of the op's matrices), on the same device."""
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

        with torch.device(self.gate_up_proj_bias.device):
            bf16 = GptOssExperts(config).to(dtype)
        for proj, decoded in zip(("gate_up_proj", "down_proj"), self._decoded(dtype)):
            getattr(bf16, proj).copy_(decoded.transpose(1, 2))
            getattr(bf16, f"{proj}_bias").copy_(getattr(self, f"{proj}_bias"))
        return bf16

    def dequantized_state(self, dtype: torch.dtype, config) -> dict[str, torch.Tensor]:
        return self.dequantized(config.get_text_config(), dtype).state_dict()

    def after_loading(self, config) -> nn.Module:
        self.set_backend(config.backend, config.act_scale_mode)
        return self

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}, "
                f"{self.FORMAT}, backend={self.backend!r}")


class MXFP4GptOssExperts(_GptOssExperts):
    """One gpt-oss layer's experts in MXFP4 (OpenAI's release), run by ``fp4moe::gpt_oss_moe``."""

    FORMAT = "MXFP4"
    QUANTIZED = ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales")
    KERNEL_BUFFERS = ("kernel_gate_up", "kernel_gate_up_scale", "kernel_gate_up_bias",
                      "kernel_down", "kernel_down_scale", "kernel_down_bias")
    BIASES = (2, 5)

    def __init__(self, config, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self._setup(config)
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        for proj, rows, cols in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
            blocks, scales = gpt_oss_shapes(rows, cols, e)
            self.register_buffer(f"{proj}_blocks", torch.zeros(blocks, dtype=torch.uint8))
            self.register_buffer(f"{proj}_scales", torch.zeros(scales, dtype=torch.uint8))
            self.register_parameter(f"{proj}_bias", nn.Parameter(torch.zeros(e, rows, dtype=dtype), requires_grad=False))
        check_mxfp4_experts(self.op_tensors(), h)  # dimensions that are no multiple of 32 fail here
        self._register_layout_hooks()

    def tensor_specs(self) -> list[TensorSpec]:
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        specs = []
        for proj, rows, cols in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
            blocks, scales = gpt_oss_shapes(rows, cols, e)
            specs += [TensorSpec(f"{proj}_blocks", torch.uint8, blocks, "packed"),
                      TensorSpec(f"{proj}_scales", torch.uint8, scales, "block_scale")]
        return specs + self._bias_specs()

    def save_refusal(self) -> str | None:
        return "gpt-oss's MXFP4 experts are saved in their own format (the mxfp4 quantizer's), not as ModelOpt NVFP4"

    def modelopt_tensors(self, name: str, converters=()) -> dict[str, torch.Tensor]:
        raise ValueError(f"{name}: {self.save_refusal()}")

    def checkpoint_tensors(self) -> list[torch.Tensor]:
        """The six tensors of :data:`MXFP4_EXPERT_TENSORS`, as the checkpoint holds them."""
        return self.op_tensors()

    def _held_op_tensors(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in MXFP4_EXPERT_TENSORS]

    def _checkpoint_form(self, op_tensors):
        return {name: t for name, t in zip(MXFP4_EXPERT_TENSORS, op_tensors) if name in self.QUANTIZED}

    def _decoded(self, dtype):
        tensors = dict(zip(MXFP4_EXPERT_TENSORS, self.op_tensors()))
        return [dequantize_gpt_oss(tensors[f"{proj}_blocks"], tensors[f"{proj}_scales"], dtype)
                for proj in ("gate_up_proj", "down_proj")]


class NVFP4GptOssExperts(_GptOssExperts):
    """One gpt-oss layer's experts in NVFP4 as ModelOpt exports them (see the module docstring), run
    by ``fp4moe::gpt_oss_moe``. ``input_scales``: the checkpoint has calibrated input scales (held
    for saving; the activations stay 16-bit). ``per_expert_scales``: one global scale per expert
    (``weight_scale_2 [E]``, llm-compressor's export), which ModelOpt's format cannot save."""

    FORMAT = "NVFP4"
    QUANTIZED = ("gate_up_proj", "gate_up_proj_weight_scale", "down_proj", "down_proj_weight_scale")
    KERNEL_BUFFERS = ("kernel_gate_up", "kernel_gate_up_scale", "kernel_gate_up_global_scale", "kernel_gate_up_bias",
                      "kernel_down", "kernel_down_scale", "kernel_down_global_scale", "kernel_down_bias")
    BIASES = (3, 7)

    def __init__(self, config, dtype: torch.dtype = torch.bfloat16, input_scales: bool = False,
                 per_expert_scales: bool = False):
        super().__init__()
        self._setup(config)
        self.per_expert_scales = per_expert_scales
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        for proj, n, k in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
            for name, (dtype_, shape) in modelopt_gpt_oss_specs(proj, e, n, k, input_scales, per_expert_scales).items():
                self.register_buffer(name, torch.zeros(shape, dtype=dtype_))
            self.register_parameter(f"{proj}_bias", nn.Parameter(torch.zeros(e, n, dtype=dtype), requires_grad=False))
        check_nvfp4_gpt_oss_tensors(self._held_op_tensors(), h)  # sizes that are no multiple of 16 fail here
        self._register_layout_hooks()

    def tensor_specs(self) -> list[TensorSpec]:
        """The checkpoint's tensors, whichever layout holds them now (a load goes through them)."""
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        has_input = "gate_up_proj_input_scale" in self._buffers
        specs = []
        for proj, n, k in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
            for name, (dtype, shape) in modelopt_gpt_oss_specs(proj, e, n, k, has_input, self.per_expert_scales).items():
                specs.append(TensorSpec(name, dtype, shape, _MODELOPT_ROLES[name[len(proj):]]))
        return specs + self._bias_specs()

    def weight_ranges(self):
        return [(f"{proj}_weight_scale", f"{proj}_weight_scale_2", None) for proj in ("gate_up_proj", "down_proj")]

    @property
    def converter_checks_values(self) -> bool:
        return self.per_expert_scales  # llm-compressor's per-expert files are checked as they are stacked

    def save_refusal(self) -> str | None:
        if self.per_expert_scales:
            return ("these gpt-oss experts have one global scale per expert (llm-compressor's export), and "
                    "ModelOpt's gpt-oss format, which fp4moe saves, holds one per projection: they cannot be saved "
                    "without re-quantizing; keep the checkpoint you loaded them from, or call model.dequantize() "
                    "first to save 16-bit experts")
        return None

    def modelopt_tensors(self, name: str, converters=()) -> dict[str, torch.Tensor]:
        """The state dict: ModelOpt's gpt-oss tensors already."""
        return {f"{name}.{key}": t for key, t in self.state_dict().items()}

    def _held_op_tensors(self) -> list[torch.Tensor]:
        e = self.num_experts
        tensors = []
        for proj in ("gate_up_proj", "down_proj"):  # ModelOpt's [E, K/2, N] are the op's [E, N, K/2] transposed
            tensors += [self._buffers[proj].transpose(1, 2),
                        self._buffers[f"{proj}_weight_scale"].transpose(1, 2).view(torch.uint8),
                        self._buffers[f"{proj}_weight_scale_2"].reshape(-1).expand(e), getattr(self, f"{proj}_bias")]
        return tensors

    def _checkpoint_form(self, op_tensors):
        gate_up, gate_up_scale, _, _, down, down_scale, _, _ = op_tensors
        held = {}
        for proj, w, s in (("gate_up_proj", gate_up, gate_up_scale), ("down_proj", down, down_scale)):
            held[proj] = w.transpose(1, 2).contiguous()
            held[f"{proj}_weight_scale"] = s.transpose(1, 2).contiguous().view(torch.float8_e4m3fn)
        return held

    def _decoded(self, dtype):
        gate_up, gate_up_scale, gate_up_global_scale, _, down, down_scale, down_global_scale, _ = self.op_tensors()
        return [dequantize_nvfp4(w, s.view(torch.float8_e4m3fn), g, dtype)
                for w, s, g in ((gate_up, gate_up_scale, gate_up_global_scale), (down, down_scale, down_global_scale))]


def _checkpoint_state_dict(module: _GptOssExperts, state_dict, prefix, local_metadata):
    """The state dict holds the checkpoint's tensors whatever layout runs."""
    if module.kernel_layout:
        for name, t in module._checkpoint_form(module.op_tensors()).items():
            state_dict[prefix + name] = t
    return state_dict


def _load_through_checkpoint_layout(module: _GptOssExperts, state_dict, prefix, *args):
    """A load into the kernels' layout goes through the checkpoint's (back after the load)."""
    if module.kernel_layout:
        module._to_checkpoint_layout()


def _back_to_kernel_layout(module: _GptOssExperts, incompatible_keys) -> None:
    if module.backend == "triton" and not module.kernel_layout:
        module._to_kernel_layout()


def is_gpt_oss_experts(module: nn.Module) -> bool:
    """Transformers' BF16 ``GptOssExperts`` (by class name: no import of the model's module needed)."""
    return type(module).__name__ == "GptOssExperts"


__all__ = ["MIN_TRANSFORMERS", "MXFP4GptOssExperts", "NVFP4GptOssExperts", "is_gpt_oss_experts", "modelopt_gpt_oss_specs",
           "supported"]
