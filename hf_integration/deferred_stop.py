"""``generate()`` on a GPU without a wait for the GPU at every decoding step, for models holding
fp4moe's quantized modules.

After every decoding step Transformers' loop asks whether all sequences have finished
(``StopCheck``: ``bool(unfinished.max() == 0)``). The answer is on the GPU, so the host waits for
the step to finish before it queues the next one, and its own work per step (the compiled call,
preparing the inputs: ~1.8 ms on a 48-layer Qwen3-30B-A3B) adds to the GPU's instead of overlapping
it. Transformers has the remedy, ``DeferredStopCheck``: the flag is copied asynchronously and read
one step late; the one extra forward at the end is undone (its token dropped, and a returned cache
cropped back). Transformers turns it on only on Apple's ``mps``.

fp4moe turns it on for CUDA too, for its own models only: while such a model's ``generate()``
runs, a context variable is set, and ``DeferredStopCheck.is_supported`` (wrapped once, for the
process) answers for a CUDA device as Transformers answers for ``mps`` where the variable is set,
and exactly as before everywhere else (other models, other threads' calls, other devices).
Transformers' own conditions still apply: never for assisted generation, and a cache returned to
the caller must be croppable. Measured on an H100 (48-layer Qwen3-30B-A3B, batch 1): 6.48 -> 4.14
ms a decoding step, the same tokens (``benchmarks/RESULTS.md``, "generate()'s loop").
``FP4MOE_DEFERRED_STOP=0`` keeps Transformers' loop as it is.
"""

from __future__ import annotations

import contextlib
import contextvars
import types

import torch
from torch import nn

from fp4moe_ops.env import env_switch

ENV_VAR = "FP4MOE_DEFERRED_STOP"
DEVICE_TYPES = ("cuda",)
_IN_GENERATE = contextvars.ContextVar("fp4moe_generate", default=False)


def defer_stop_checks(model: nn.Module) -> None:
    """``model.generate()`` reads its stop flag one step late on CUDA (see the module docstring).
    Idempotent; nothing happens for a model without ``generate`` or a Transformers without
    ``DeferredStopCheck``."""
    if not _install() or getattr(type(model), "generate", None) is None:
        return
    if getattr(model.__dict__.get("generate"), "__func__", None) is not _generate:
        model.generate = types.MethodType(_generate, model)


@contextlib.contextmanager
def deferring():
    """While active, every ``generate()`` in this thread defers its stop check on CUDA, whatever
    the model (a benchmark's HF BF16 model, to measure what the loop costs it)."""
    _install()
    token = _IN_GENERATE.set(True)
    try:
        yield
    finally:
        _IN_GENERATE.reset(token)


def _install() -> bool:
    """``DeferredStopCheck.is_supported`` wrapped (once); False for a Transformers without it."""
    try:
        from transformers.generation.utils import DeferredStopCheck
    except ImportError:  # a Transformers from before it
        return False
    if not callable(getattr(DeferredStopCheck, "is_supported", None)):
        return False
    if not getattr(DeferredStopCheck.is_supported, "_fp4moe", False):
        DeferredStopCheck.is_supported = staticmethod(_wrap(DeferredStopCheck.is_supported))
    return True


def _generate(model, *args, **kwargs):
    token = _IN_GENERATE.set(env_switch(ENV_VAR, True))
    try:
        return type(model).generate(model, *args, **kwargs)
    finally:
        _IN_GENERATE.reset(token)


def _wrap(is_supported):
    def deferred_on_cuda_too(device, *args, **kwargs):
        if _IN_GENERATE.get() and torch.device(device).type in DEVICE_TYPES:
            # Transformers' own answer for the device it defers on, so that its other conditions
            # (assisted generation, a returned cache that cannot be cropped) still decide
            device = torch.device("mps")
        return is_supported(device, *args, **kwargs)

    deferred_on_cuda_too._fp4moe = True
    return deferred_on_cuda_too


__all__ = ["ENV_VAR", "defer_stop_checks", "deferring"]
