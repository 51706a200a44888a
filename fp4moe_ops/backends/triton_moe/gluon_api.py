"""Gluon's names that moved between the Triton releases fp4moe supports (3.6 to 3.9, the releases
torch 2.11 to 2.15 pin), resolved once here so that each Gluon kernel has one source.

Gluon is Triton's experimental low-level language; its API is renamed from release to release.
The kernels (``decode_v3.py``, ``prefill_rs.py``) import these names instead of Gluon's, and
``tests/test_triton_releases.py``, the sm_90 compile check CI runs (``tools/compile_ahead_cpu.py``
on the oldest and newest supported Triton) catch a release that moves one more.

| name here | Triton 3.6 | 3.7 | 3.8 | 3.9 |
|---|---|---|---|---|
| ``tma_load`` (global -> shared through TMA) | ``tma.async_copy_global_to_shared`` | same | ``tma.async_load`` (old name kept) | ``tma.async_load`` (old name raises) |
| ``thread_barrier`` (all threads of the program) | ``gl.thread_barrier`` | ``gl.barrier`` | ``gl.barrier`` | ``gl.barrier`` |
| ``reinterpret(smem, dtype, shape, layout)`` | ``smem._reinterpret`` | same | same | ``smem.reinterpret`` |
"""

from __future__ import annotations

from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma
from triton.language.core import builtin

tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
thread_barrier = getattr(gl, "barrier", None) or gl.thread_barrier

_REINTERPRET = "reinterpret" if hasattr(gl.shared_memory_descriptor, "reinterpret") else "_reinterpret"


@builtin
def reinterpret(smem, dtype, shape, layout, _semantic=None):
    """The shared memory of ``smem`` viewed as ``dtype``, ``shape`` and ``layout`` (a method of
    Gluon's shared memory descriptor whose name changed; a builtin, so kernels call it as one)."""
    return getattr(smem, _REINTERPRET)(dtype, shape, layout, _semantic=_semantic)
