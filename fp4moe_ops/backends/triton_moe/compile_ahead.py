"""Compiling ahead: the first call of a layer shape compiles every kernel variant that shape can
ever launch, all at once in threads, instead of one variant per token-count bucket as calls first
reach it.

Why: a layer launches a different set of kernels per bucket of :func:`.launch.kernel_config`
(decode, middle, prefill, the Gluon prefill kernels) and per routing path, about 20 variants on
DeepSeek-V3. Each new bucket used to stop the call that first reached it for the serial compile
of its kernels (a few seconds each on an H200), so a user with varied prompts paid that several
times over (issue 17, target 4). Most of a compile is ``ptxas``, a process of its own, so the
compiles overlap in threads.

How: :func:`.launch.triton_fused_moe` calls :func:`compile_layer_once`. That reruns the call's
launch sequence on a one-token slice of its inputs once per variant set, with the tile config
and routing decisions of a representative slot count (:func:`variant_slots`). During the rerun,
every launch (:func:`launch`) becomes Triton's own ``warmup`` under its ``AsyncCompileMode``:
the kernel is compiled in a thread pool and not run. Afterwards the launches find their kernels
in Triton's JIT cache; with a filled disk cache the "compiles" are loads.

Nothing here changes what a launch computes: a compile that fails is left to the launch, which
compiles (and raises) as before.
"""

from __future__ import annotations

import warnings
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar

import torch

# The slot count whose launches are being compiled, or None: launches run
_PLANNED_SLOTS: ContextVar[int | None] = ContextVar("fp4moe_planned_slots", default=None)
_DONE = set()  # layer shapes compile_layer_once has handled in this process


def launch(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``, or while compiling ahead only its compile (no launch)."""
    if _PLANNED_SLOTS.get() is None:
        kernel[grid](*args, **kwargs)
    else:
        kernel.warmup(*args, grid=grid, **kwargs)


def planned_slots(num_slots: int) -> int:
    """The slot count a launch sequence decides by: the call's own, or while compiling ahead the
    representative one of the variant set being compiled."""
    return _PLANNED_SLOTS.get() or num_slots


def compiling_ahead() -> bool:
    """Whether launches are being compiled, not run (their outputs are never written)."""
    return _PLANNED_SLOTS.get() is not None


def variant_slots(num_experts: int, hidden: int, inter: int, top_k: int, routed_experts: int = 0) -> list[int]:
    """One slot count per distinct set of kernels the layer can launch: the smallest slot count
    (a multiple of ``top_k``) of each combination of :func:`.launch.kernel_config` and routing path.
    Past the Gluon threshold and the routing kernel's limit nothing changes with the count."""
    from .launch import FAST_ROUTE_MAX_SLOTS, GLUON_PREFILL_MIN_ROWS, _count_block, kernel_config

    routed = routed_experts or num_experts
    last = max(GLUON_PREFILL_MIN_ROWS * routed, FAST_ROUTE_MAX_SLOTS + 1)
    seen = {}
    for slots in range(top_k, last + 2 * top_k, top_k):
        cfg = kernel_config(slots, num_experts, hidden, inter, routed_experts)
        key = (tuple(sorted(cfg.items())), slots <= FAST_ROUTE_MAX_SLOTS, _count_block(slots))
        seen.setdefault(key, slots)
    return sorted(seen.values())


def compile_all(plans, together: bool = True):
    """Run each ``(slots, fn)`` of ``plans`` with its launches compiled, not run, deciding as for
    ``slots``; ``together``: all compiles at once, in a pool of threads (else one by one). Returns
    False (nothing compiled) when Triton's async compile mode is already active (a caller's)."""
    from triton.runtime import _async_compile

    if _async_compile.active_mode.get() is not None:
        return False
    mode = None
    pool = ThreadPoolExecutor() if together else None  # (min(32, CPUs + 4) threads)
    try:
        if pool is not None:
            # ignore_errors: a kernel that fails to compile here is left to its launch, which raises
            mode = _async_compile.AsyncCompileMode(pool, ignore_errors=True)
            mode.__enter__()
        try:
            for slots, fn in plans:
                token = _PLANNED_SLOTS.set(slots)
                try:
                    fn()
                finally:
                    _PLANNED_SLOTS.reset(token)
        finally:
            if mode is not None:
                mode.__exit__(None, None, None)  # waits for every compile
    finally:
        # Triton 3.6's AsyncCompileMode stays active if its exit raises: later compiles would fail
        if mode is not None and _async_compile.active_mode.get() is mode:
            _async_compile.active_mode.set(None)
        if pool is not None:
            pool.shutdown()
    return True


def layer_plans(hidden_states, topk_ids, topk_weights, expert_tensors, routed_experts: int = 0):
    """:func:`compile_all`'s plans for a layer (a call's arguments): per :func:`variant_slots`
    entry, the call's launch sequence with that slot count's tile config, on a one-token slice.
    One token is enough: the kernels are specialized on dtypes, alignment, the layer's sizes and
    the tile config, not on the token count (the routing path follows :func:`planned_slots`)."""
    from .launch import kernel_config, triton_fused_moe

    num_experts, inter = expert_tensors[1].shape[0], expert_tensors[1].shape[1] // 2
    hidden, top_k = hidden_states.shape[1], topk_ids.shape[1]
    args = (hidden_states[:1], topk_ids[:1], topk_weights[:1], expert_tensors)
    return [(slots, lambda cfg=kernel_config(slots, num_experts, hidden, inter, routed_experts):
             triton_fused_moe(*args, config=cfg, routed_experts=routed_experts))
            for slots in variant_slots(num_experts, hidden, inter, top_k, routed_experts)]


def compile_layer_once(hidden_states, topk_ids, topk_weights, expert_tensors, routed_experts: int = 0):
    """At the first call of a layer shape in this process, compile every kernel variant it can
    launch (:func:`layer_plans`), together. Skipped (and tried again at the next call) while a
    CUDA graph is being captured; on any failure a warning, and the launches compile as they come."""
    from .launch import interpreting

    if interpreting() or not hidden_states.is_cuda or compiling_ahead() or hidden_states.shape[0] == 0:
        return
    w13, s13 = expert_tensors[0], expert_tensors[1]
    key = (hidden_states.device, hidden_states.dtype, topk_ids.dtype, topk_weights.dtype, w13.dtype,
           tuple(s13.shape), hidden_states.shape[1], topk_ids.shape[1], routed_experts)
    if key in _DONE or torch.cuda.is_current_stream_capturing():
        return
    _DONE.add(key)
    try:
        compile_all(layer_plans(hidden_states, topk_ids, topk_weights, expert_tensors, routed_experts))
    except Exception as exc:  # a head start only
        warnings.warn(f"fp4moe: compiling the layer's Triton kernels ahead failed ({exc!r}); "
                      "they compile one by one as calls reach them")
