"""Backend contract and registry for ``torch.ops.fp4moe.fused_moe``.

A backend turns canonical :class:`~fp4moe_ops.moe_weights.NVFP4MoEWeights` into its own list
of prepared tensors once (``prepare``), and computes the MoE layer from them on every call
(``run``). ``backend="auto"`` picks the first backend in :data:`AUTO_ORDER` that the device
can run.
"""

from __future__ import annotations

import torch

from ..moe_weights import NVFP4MoEWeights


class Backend:
    """Base class. Subclasses set the class attributes and implement the three methods.

    Attributes:
        name: the string users pass as ``backend=``.
        activation_scales: ``"required"`` (NVFP4 x NVFP4: activations are quantized with the
            calibrated scales), ``"forbidden"`` (the backend keeps activations in 16 bits and
            passing scales would silently be ignored), or ``"optional"`` (reference).
        exact_weights: False where the backend re-quantizes weights (lossy), e.g. MXFP4.
    """

    name: str = ""
    activation_scales: str = "optional"
    exact_weights: bool = True
    description: str = ""

    def unavailable_reason(self, device: torch.device) -> str | None:
        """None if this backend can run on ``device``, else a one-line reason."""
        raise NotImplementedError

    def prepare(self, weights: NVFP4MoEWeights) -> list[torch.Tensor]:
        """Build the backend's tensors from canonical weights, once, at load time."""
        raise NotImplementedError

    def run(
        self,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        expert_tensors: list[torch.Tensor],
        fc1_act_scale: torch.Tensor | None,
        fc2_act_scale: torch.Tensor | None,
    ) -> torch.Tensor:
        """Compute ``[T, H]`` in ``hidden_states.dtype``; inputs are already validated."""
        raise NotImplementedError

    def check_expert_tensors(self, expert_tensors: list[torch.Tensor], hidden_size: int) -> int:
        """Validate the prepared tensors' shapes/dtypes (fake tensors too); return E."""
        raise NotImplementedError


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
    Raises ValueError naming the backends that can run here.
    """
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
            "activation scales (fc1_input_scale / fc2_input_scale); calibrate with "
            "hf_integration.calibrate_activation_scales, or use a W4A16 backend "
            f"(available here: {available_backends(device)})"
        )
    return backend
