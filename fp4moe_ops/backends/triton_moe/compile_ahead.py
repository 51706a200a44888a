"""Launch sequences that only compile: with :func:`compile_all`, every kernel launch of a sequence
(:func:`launch_or_compile`) becomes Triton's own ``warmup`` under its ``AsyncCompileMode``: the
kernel is compiled in a thread pool, with the others, and not run. Triton's JIT cache then holds
the kernels, and the real launches find them there.

What it is for: a layer launches a different set of kernels per token-count bucket of
:func:`.launch.kernel_config` and per routing path (18 Triton variants on DeepSeek-V3). Each new
bucket used to stop the call that first reached it for the serial compile of its kernels, a few
seconds each, so a user with varied prompts paid that several times over.
:func:`.launch.compile_layer_once` compiles them all at a layer's first call instead; most of a
compile is ``ptxas``, a process of its own, so the compiles overlap in threads (an NVFP4 linear
shape's token counts the same way, :func:`.launch.compile_linear_once`). Each thread then also
builds its kernel's launcher (Triton compiles a small C module per kernel function and argument
types with the host's C compiler, at the kernel's first launch: about a second each with an
empty cache, serial, on the call that launches it).

A launch sequence that runs here must not read what its kernels would have written as indices
(:func:`.launch.route` fills its outputs with zeros here). Nothing here changes what a launch
computes: a kernel that fails to compile is left to its launch, which compiles (and raises) as
before.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar

from ...relaunch import launch as relaunched

# The slot (or token) count whose launch sequence is being compiled, or None: launches run
_PLANNED_SLOTS: ContextVar[int | None] = ContextVar("fp4moe_planned_slots", default=None)
MAX_THREADS = 16  # compiles at once (each runs ptxas): several processes per host may do this together


def launch_or_compile(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)`` (``fp4moe_ops.relaunch.launch``: past Triton's per-call work where it
    can), or inside :func:`compile_all` only its compile."""
    if _PLANNED_SLOTS.get() is None:
        relaunched(kernel, grid, args, kwargs)
    else:
        kernel.warmup(*args, grid=grid, **kwargs)


def planned_slots(num_slots: int) -> int:
    """The slot count a launch sequence decides by: the call's own, or inside :func:`compile_all`
    the one its plan stands for."""
    return _PLANNED_SLOTS.get() or num_slots


def compiling_ahead() -> bool:
    """Whether launches are being compiled, not run (their outputs are never written)."""
    return _PLANNED_SLOTS.get() is not None


def async_compile_active() -> bool:
    """Whether Triton's async compile mode is active (a caller's own, or :func:`compile_all`'s)."""
    from triton.runtime import _async_compile

    return _async_compile.active_mode.get() is not None


class _CompileThenBuildLauncher(ThreadPoolExecutor):
    """The pool for Triton's ``AsyncCompileMode``: each task compiles a kernel, then builds its
    launcher into Triton's cache, where the kernel's first launch finds it."""

    def submit(self, fn, /, *args, **kwargs):
        return super().submit(_compile_then_build_launcher, fn, *args, **kwargs)


_LAUNCHER_LOCKS: dict[object, threading.Lock] = {}
_LAUNCHER_LOCKS_GUARD = threading.Lock()
_DESCRIPTOR_RANK = re.compile(r"tensordesc<[^\[]*\[([^\]]*)\]")


def launcher_key(src) -> tuple:
    """What a kernel's launcher (its C module) follows: the kernel function and the kind of each
    argument, with pointers of any dtype alike (a device address) and tensor descriptors by rank;
    not the constexpr values or the descriptors' block shapes, which Triton's launcher source
    (3.6's ``make_launcher``) does not depend on. Variants under one key build one launcher."""
    kinds = []
    for kind in src.signature.values():
        kind = str(kind)
        if kind.startswith("*"):
            kind = "*"
        elif kind.startswith("tensordesc"):
            rank = _DESCRIPTOR_RANK.match(kind)
            kind = f"tensordesc{len(rank.group(1).split(',')) if rank else '?'}"
        kinds.append(kind)
    return (src.fn, tuple(kinds))


def _compile_then_build_launcher(compile_fn, *args, **kwargs):
    kernel = compile_fn(*args, **kwargs)
    try:
        from triton.runtime import driver

        # Variants that share a launcher build it in one thread, the others wait and then find it
        # in the cache (DeepSeek-V3's 13 CPU-compiled variants have 4 launchers; a signature-repr
        # key split them into 11 and built several at once). Should two variants under one key
        # differ after all, the second builds its own after the wait: slower, not wrong.
        key = launcher_key(kernel.src)
        with _LAUNCHER_LOCKS_GUARD:
            lock = _LAUNCHER_LOCKS.setdefault(key, threading.Lock())
        with lock:  # (only the C module: the kernel is loaded into the GPU context at its first launch)
            driver.active.launcher_cls(kernel.src, kernel.metadata)
    except Exception as exc:  # a head start only: the first launch builds it, as before
        logging.getLogger(__name__).debug("building the launcher of %s ahead failed: %r", kernel, exc)
    return kernel


def compile_all(plans, together: bool = True) -> list[Exception]:
    """Run each ``(slots, fn)`` of ``plans`` with its launches compiled, not run, deciding as for
    ``slots`` (a layer's slot count; an NVFP4 linear's plans pass their token count);
    ``together``: all compiles at once, in a pool of threads, with the kernels' launchers (else
    one by one, the launchers left to the first launches). Plans start in order:
    put the longest compiles first. Returns the plans' errors (a failing plan does not stop the
    others). Not while :func:`async_compile_active`."""
    from triton.runtime import _async_compile

    if async_compile_active():
        raise RuntimeError("compile_all: Triton's async compile mode is already active")
    errors, mode = [], None
    pool = _CompileThenBuildLauncher(min(MAX_THREADS, os.cpu_count() or 1)) if together else None
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
                except Exception as exc:
                    errors.append(exc)
                finally:
                    _PLANNED_SLOTS.reset(token)
        finally:
            if mode is not None:
                mode.__exit__(None, None, None)  # waits for every compile
    except BaseException:  # (an interrupt: drop the compiles not started)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
            pool = None
        raise
    finally:
        # Triton 3.6's AsyncCompileMode stays active if its exit raises: later compiles would fail
        if mode is not None and _async_compile.active_mode.get() is mode:
            _async_compile.active_mode.set(None)
        if pool is not None:
            pool.shutdown()
    return errors
