"""Backend contract and registry for ``torch.ops.fp4moe.fused_moe``.

A backend computes the MoE layer from its prepared tensors on every call (``run``). Most take
the canonical tensors (:func:`canonical_layout`), possibly with the packed weights in a packed
layout of their own (registered here with :func:`register_packed_layout`, converted expert by
expert both ways); others build tensors of their own once (``prepare``).
:class:`~fp4moe_ops.prepared.PreparedExperts` holds whichever applies. ``backend="auto"`` picks
the first backend in :data:`AUTO_ORDER` that the device can run.

gpt-oss's experts (``torch.ops.fp4moe.gpt_oss_moe``, MXFP4 or NVFP4 weights) run on the backends that
override :meth:`Backend.gpt_oss_refusal` and :meth:`Backend.run_gpt_oss` (the reference and Triton backends);
every other backend refuses them with its reason, and :func:`resolve_gpt_oss_backend` passes over it, saying so.
"""

from __future__ import annotations

import logging

import torch

from ..env import check_backend_environment
from ..moe_weights import NVFP4MoEWeights
from ..mxfp4 import check_gpt_oss_biases, check_mxfp4_experts
from ..nvfp4 import BLOCK_SIZE


def canonical_layout(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The op's canonical expert tensors from ``NVFP4MoEWeights.tensors()`` order: contiguous,
    block scales as their raw E4M3 bytes (uint8). No checks (cheap enough for every forward)."""
    return [t.contiguous().view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t.contiguous() for t in tensors]


def check_canonical_tensors(expert_tensors: list[torch.Tensor], hidden_size: int) -> int:
    """Check the canonical tensors ``[gate_up, gate_up_scale, gate_up_global_scale, down, down_scale,
    down_global_scale]``; return E.

    Block scales travel through the op as their raw E4M3 bytes (uint8): torch has no CPU
    arithmetic for float8, which ``torch.library.opcheck``'s schema check needs. MXFP4 experts pass
    their E8M0 scale bytes as int8 instead, each written for both 16-value halves of its 32-value
    block, with global scales of 1 (the dtype is how every backend tells the two formats apart).
    """
    specs = canonical_specs(expert_tensors, hidden_size)
    check_specs(specs, hidden_size)
    return specs["gate_up_global_scale"][1][0]


def canonical_specs(expert_tensors: list[torch.Tensor], hidden_size: int) -> dict:
    """``{name: (tensor, expected shape, expected dtype)}`` of the canonical layout, with E and I
    read off the block scales ``gate_up_scale [E, 2I, H/16]``."""
    if len(expert_tensors) != 6:
        raise ValueError("expected 6 expert tensors [gate_up, gate_up_scale, gate_up_global_scale, down, down_scale, "
                         f"down_global_scale], "
                         f"got {len(expert_tensors)}")
    gate_up, gate_up_scale, gate_up_global_scale, down, down_scale, down_global_scale = expert_tensors
    if gate_up_scale.dim() != 3:
        raise ValueError(f"gate_up_scale: expected [E, 2I, H/16], got {list(gate_up_scale.shape)}")
    e, two_i = gate_up_scale.shape[:2]
    i = two_i // 2
    scale = torch.int8 if gate_up_scale.dtype == torch.int8 else torch.uint8  # E8M0 (MXFP4) or E4M3 (NVFP4) bytes
    return {
        "gate_up": (gate_up, (e, two_i, hidden_size // 2), torch.uint8),
        "gate_up_scale": (gate_up_scale, (e, two_i, hidden_size // BLOCK_SIZE), scale),
        "gate_up_global_scale": (gate_up_global_scale, (e,), torch.float32),
        "down": (down, (e, hidden_size, i // 2), torch.uint8),
        "down_scale": (down_scale, (e, hidden_size, i // BLOCK_SIZE), scale),
        "down_global_scale": (down_global_scale, (e,), torch.float32),
    }


# gpt-oss's experts with NVFP4 weights, as fp4moe::gpt_oss_moe takes them (its MXFP4 ones:
# fp4moe_ops.mxfp4.MXFP4_EXPERT_TENSORS)
NVFP4_GPT_OSS_TENSORS = ("gate_up", "gate_up_scale", "gate_up_global_scale", "gate_up_bias",
                         "down", "down_scale", "down_global_scale", "down_bias")


def check_nvfp4_gpt_oss_tensors(expert_tensors: list[torch.Tensor], hidden_size: int) -> int:
    """Check gpt-oss's experts with NVFP4 weights (:data:`NVFP4_GPT_OSS_TENSORS`): the canonical
    NVFP4 tensors with gate's and up's rows interleaved as gpt-oss's (``gate_up [E, 2I, H/2]``, row
    ``2j`` gate's ``j``), any strides, and the biases ``gate_up_bias [E, 2I]`` (interleaved alike) and ``down_bias
    [E, H]``; return E. Metadata only."""
    if len(expert_tensors) != len(NVFP4_GPT_OSS_TENSORS):
        raise ValueError(f"expected {len(NVFP4_GPT_OSS_TENSORS)} tensors {list(NVFP4_GPT_OSS_TENSORS)} for gpt-oss's "
                         f"NVFP4 experts, got {len(expert_tensors)}")
    (gate_up, gate_up_scale, gate_up_global_scale, gate_up_bias,
     down, down_scale, down_global_scale, down_bias) = expert_tensors
    if gate_up_scale.dim() != 3 or gate_up_scale.shape[1] % 2:
        raise ValueError(f"gate_up_scale: expected [E, 2I, H/16], got {list(gate_up_scale.shape)}")
    for name, size in (("hidden size", hidden_size), ("intermediate size", gate_up_scale.shape[1] // 2)):
        if size % BLOCK_SIZE:
            raise ValueError(f"gpt-oss NVFP4 experts need a {name} that is a multiple of {BLOCK_SIZE}, got {size}")
    specs = canonical_specs([gate_up, gate_up_scale, gate_up_global_scale, down, down_scale, down_global_scale],
                            hidden_size)
    for name in ("gate_up_scale", "down_scale"):  # E4M3 bytes only: gpt-oss's MXFP4 experts come as its six tensors
        specs[name] = (*specs[name][:2], torch.uint8)
    check_specs(specs, hidden_size)
    e = gate_up_scale.shape[0]
    check_gpt_oss_biases(("gate_up_bias", gate_up_bias), ("down_bias", down_bias), e, gate_up_scale.shape[1] // 2,
                         hidden_size)
    return e


def check_specs(expected: dict, hidden_size: int) -> None:
    """``{name: (tensor, shape, dtype)}``: raise ValueError naming the first mismatch."""
    for name, (t, shape, dtype) in expected.items():
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise ValueError(
                f"{name}: expected {dtype} {list(shape)} for hidden size {hidden_size}, "
                f"got {t.dtype} {list(t.shape)}"
            )


class Backend:
    """Base class. Subclasses set the class attributes, implement ``unavailable_reason`` and
    ``run``; a backend with tensors of its own sets ``tensors = "own"`` and implements
    ``prepare`` and ``check_expert_tensors``.

    Attributes:
        name: the string users pass as ``backend=``.
        activation_scales: ``"required"`` (NVFP4 x NVFP4: activations are quantized with the
            calibrated scales), ``"forbidden"`` (the backend keeps activations in 16 bits and
            passing scales would silently be ignored), or ``"optional"`` (reference).
        tensors: ``"canonical"``: the op gets :func:`canonical_layout` of the held weights, with
            the packed weights in :meth:`packed_layout`; ``"own"``: the op gets ``prepare``'s
            tensors, built once (the canonical weights are kept beside them).
    """

    name: str = ""
    activation_scales: str = "optional"
    tensors: str = "canonical"
    # whether its kernels read MXFP4 experts: canonical tensors whose block scales are E8M0 bytes
    # as int8 (check_canonical_tensors); a backend that does not is refused them, never misreads them
    reads_e8m0_scales: bool = False

    def packed_layout(self, hidden_size: int, intermediate_size: int) -> str:
        """The layout this backend wants the packed weights in (a :data:`PACKED_LAYOUTS` name)."""
        return CANONICAL

    def unavailable_reason(self, device: torch.device) -> str | None:
        """None if this backend can run on ``device``, else a one-line reason."""
        raise NotImplementedError

    def prepare(self, weights: NVFP4MoEWeights) -> list[torch.Tensor]:
        """``tensors == "own"`` only: build the backend's tensors from canonical weights, once."""
        raise NotImplementedError(f"backend {self.name!r} runs on the canonical tensors")

    def run(
        self,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        expert_tensors: list[torch.Tensor],
        gate_up_input_scale: torch.Tensor | None,
        down_input_scale: torch.Tensor | None,
        routed_experts: int = 0,
    ) -> torch.Tensor:
        """Compute ``[T, H]`` in ``hidden_states.dtype``; inputs are already validated.
        ``routed_experts`` is the op's performance hint (0: all experts are local)."""
        raise NotImplementedError

    def check_expert_tensors(self, expert_tensors: list[torch.Tensor], hidden_size: int) -> int:
        """Validate the prepared tensors' shapes/dtypes (fake tensors too); return E."""
        num_experts = check_canonical_tensors(expert_tensors, hidden_size)
        if expert_tensors[1].dtype == torch.int8 and not self.reads_e8m0_scales:
            raise ValueError(f"backend {self.name!r} reads NVFP4 (E4M3) block scales only, not MXFP4's E8M0 "
                             "scales (int8)")
        return num_experts

    # gpt-oss's experts (``fp4moe::gpt_oss_moe``): a backend runs them only if it overrides both

    def gpt_oss_refusal(self, device: torch.device) -> str | None:
        """None if this backend runs gpt-oss's experts on ``device``, else a one-line reason."""
        reason = self.unavailable_reason(device)
        if reason is not None:
            return reason
        return ("it has no kernel for gpt-oss's experts (biases, clamped SwiGLU, MXFP4's E8M0 scales) yet, only for "
                "SiLU-gated NVFP4 experts")

    def check_gpt_oss_tensors(self, expert_tensors: list[torch.Tensor], hidden_size: int) -> int:
        """Validate the gpt-oss expert tensors this backend takes (fake tensors too); return E. By
        default gpt-oss's MXFP4 checkpoint tensors (:func:`fp4moe_ops.mxfp4.check_mxfp4_experts`), or
        with eight tensors its NVFP4 ones (:func:`check_nvfp4_gpt_oss_tensors`)."""
        if len(expert_tensors) == len(NVFP4_GPT_OSS_TENSORS):
            return check_nvfp4_gpt_oss_tensors(expert_tensors, hidden_size)
        return check_mxfp4_experts(expert_tensors, hidden_size)[0]

    def run_gpt_oss(self, hidden_states, topk_ids, topk_weights, expert_tensors, swiglu_alpha: float,
                  limit: float) -> torch.Tensor:
        """``fp4moe::gpt_oss_moe``'s ``[T, H]`` in ``hidden_states.dtype``; inputs are already validated."""
        raise NotImplementedError(f"backend {self.name!r}: {self.gpt_oss_refusal(torch.device('cpu'))}")


CANONICAL = "canonical"

# Packed-weight layouts other than the canonical ``[E, N, K/2] uint8``, by name: functions that
# convert ONE expert's ``[N, K/2]`` uint8 matrix to the layout and back (so a layer is converted
# expert by expert, never all at once), registered by the backend that owns the layout.
PACKED_LAYOUTS: dict[str, tuple] = {}


def register_packed_layout(name: str, to_layout, to_canonical) -> None:
    PACKED_LAYOUTS[name] = (to_layout, to_canonical)


def convert_packed(packed: torch.Tensor, source: str, target: str, *, in_place: bool = False) -> torch.Tensor:
    """``[E, ...]`` packed weights in layout ``source`` -> layout ``target``, expert by expert.

    Every layout holds the same bytes per expert, so with ``in_place`` the result reuses
    ``packed``'s memory (one expert of scratch instead of a second copy of the layer); only for
    a tensor nobody else holds.
    """
    if source == target:
        return packed
    steps = ([PACKED_LAYOUTS[source][1]] if source != CANONICAL else []) + \
            ([PACKED_LAYOUTS[target][0]] if target != CANONICAL else [])

    def convert(expert: torch.Tensor) -> torch.Tensor:
        for step in steps:
            expert = step(expert)
        return expert

    if not in_place:
        return torch.stack([convert(p) for p in packed])
    flat = packed.contiguous().view(torch.uint8).reshape(packed.shape[0], -1)
    for e in range(packed.shape[0]):
        converted = convert(packed[e].clone())  # read expert e before its bytes are overwritten
        flat[e].copy_(converted.contiguous().view(torch.uint8).reshape(-1))
    return flat.view(converted.dtype).reshape(packed.shape[0], *converted.shape)


BACKENDS: dict[str, Backend] = {}

# Preference for backend="auto": fastest exact path first.
AUTO_ORDER = ("flashinfer_nvfp4", "triton", "reference")


def register_backend(backend: Backend) -> Backend:
    BACKENDS[backend.name] = backend
    return backend


def get_backend(name: str) -> Backend:
    if name not in BACKENDS:
        raise ValueError(f"unknown fp4moe backend {name!r}; known: {sorted(BACKENDS)}")
    return BACKENDS[name]


def available_backends(device: torch.device | str) -> list[str]:
    device = torch.device(device)
    return [n for n, b in BACKENDS.items() if b.unavailable_reason(device) is None]


def resolve_backend(
    name: str, device: torch.device | str, *, have_activation_scales: bool = False
) -> Backend:
    """Turn ``"auto"`` or a backend name into a backend that can run on ``device``.

    ``auto`` skips backends that need calibrated activation scales when there are none.
    Raises ValueError naming the backends that can run here (or a backend environment variable it
    does not understand, :func:`fp4moe_ops.env.check_backend_environment`).
    """
    check_backend_environment()
    device = torch.device(device)
    if name == "auto":
        for candidate in AUTO_ORDER:
            b = BACKENDS.get(candidate)
            if b is None or b.unavailable_reason(device) is not None:
                continue
            if b.activation_scales == "required" and not have_activation_scales:
                continue
            return b
        raise ValueError(f"no fp4moe backend can run on {device}")  # reference runs anywhere
    backend = get_backend(name)
    reason = backend.unavailable_reason(device)
    if reason is not None:
        raise ValueError(
            f"fp4moe backend {name!r} cannot run on {device}: {reason}. "
            f"Backends that can: {available_backends(device)}"
        )
    if backend.activation_scales == "required" and not have_activation_scales:
        raise ValueError(
            f"fp4moe backend {name!r} quantizes activations to NVFP4 and needs calibrated "
            "activation scales (gate_up_proj_input_scale / down_proj_input_scale); calibrate with "
            "hf_integration.calibrate_activation_scales, or use a W4A16 backend "
            f"(available here: {available_backends(device)})"
        )
    return backend


def resolve_gpt_oss_backend(name: str, device: torch.device | str) -> Backend:
    """:func:`resolve_backend` for gpt-oss's experts: ``"auto"`` takes the first backend of
    :data:`AUTO_ORDER` that runs them here, with a warning (logger ``fp4moe``) naming any faster one
    that can run on the device but refuses gpt-oss's experts, and why; a named backend that refuses raises
    ValueError with its reason."""
    check_backend_environment()
    device = torch.device(device)
    if name == "auto":
        passed_over = []
        for candidate in AUTO_ORDER:
            b = BACKENDS.get(candidate)
            if b is None:
                continue
            reason = b.gpt_oss_refusal(device)
            if reason is None:
                if passed_over:
                    logging.getLogger("fp4moe").warning(
                        "fp4moe: gpt-oss's experts on %s run on the %r backend: %s", device, b.name,
                        "; ".join(passed_over))
                return b
            if b.unavailable_reason(device) is None:  # it runs here, but not these experts
                passed_over.append(f"{b.name!r} does not run them ({reason})")
        raise ValueError(f"no fp4moe backend runs gpt-oss's experts on {device}")  # reference runs anywhere
    backend = get_backend(name)
    reason = backend.gpt_oss_refusal(device)
    if reason is not None:
        can = [n for n, b in BACKENDS.items() if b.gpt_oss_refusal(device) is None]
        raise ValueError(f"fp4moe backend {name!r} cannot run gpt-oss's experts on {device}: {reason}. "
                         f"Backends that can: {can}")
    return backend
