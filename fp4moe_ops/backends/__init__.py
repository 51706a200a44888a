"""Backends behind ``torch.ops.fp4moe.fused_moe``; importing this registers all of them."""

from .base import (AUTO_ORDER, BACKENDS, Backend, available_backends, get_backend, register_backend, resolve_backend,
                   resolve_gpt_oss_backend)
from . import flashinfer_cutlass, reference, triton_moe  # noqa: F401  (registering imports)

__all__ = [
    "AUTO_ORDER", "BACKENDS", "Backend", "available_backends", "get_backend",
    "register_backend", "resolve_backend", "resolve_gpt_oss_backend",
]
