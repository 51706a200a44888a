"""Launching a Triton kernel again without Triton's per-call work.

``kernel[grid](*args)`` costs the host ~20 us before the driver sees the launch (Triton 3.6-3.9
on a CPU: binding and specializing every argument, a string cache key, a check of the kernel's
globals), and 50-100 us a launch were measured on an H100 host. An eager prefill call of
the MoE op launches 7 kernels, and at 4096 tokens its host time sets the first token
(benchmarks/NOTES.md, "Host time of an eager call"). :func:`launch` does that work once per
*specialization*: the first launch of a kernel with arguments of a new kind goes through Triton's
own ``run`` (which compiles, checks and launches) and keeps the compiled kernel it returns under a
key made from what Triton specializes on; later launches with arguments of the same kind call that
compiled kernel's launcher directly, as ``run`` itself ends by doing.

The key is made so that two calls under one key always get the same compiled kernel from Triton
(finer where cheaper: a key may split what Triton would not). Per parameter:

* ``constexpr``: its value;
* a tensor: its dtype and whether its address is a multiple of 16 (Triton's ``D`` attribute);
* an int: whether it is 1 (Triton makes 1 a constant), a multiple of 16, and its width (i32,
  i64, u64, or too wide, which Triton refuses), whether or not the parameter is specialized;
* a float, a bool, None: the type (Triton specializes floats and bools by type, None as a constant);
* a tensor descriptor: its class, element dtype, block shape and every other field but the base,
  shape and strides (the layout, padding); Triton keys descriptors by dtype, block and layout;
* anything else: the launch goes through Triton every time.

Also in the key: the device, the option keywords (``num_warps``... with their types), the kernel's
``debug`` and the knobs Triton reads into its options at each call (debug, instrumentation). The
globals the kernel read when it compiled are compared by identity before each fast launch (where
one changed, Triton's run decides: it raises). Calls of kernels with ``*args`` or keyword-only
parameters, calls with more positional arguments than parameters or a parameter given twice,
and kernels with pre-run hooks or a stage-inspection hook set go through Triton every time.
Launch hooks (profilers) still run: the launcher gets Triton's launch metadata and hooks as from ``run``.
``tools/relaunch_cpu.py`` checks on a CPU, against Triton's own launches, that both paths launch
the same compiled kernel with the same arguments (MoE calls, a linear, the routing ops, and
arguments chosen to change Triton's specialization); CI runs it on Triton 3.6 to 3.9.

``FP4MOE_RELAUNCH=0`` sends every launch through Triton (a diagnostic).
"""

from __future__ import annotations

import threading

import torch

from .env import env_switch

try:
    import triton
    from triton import knobs
    from triton.compiler import CompiledKernel
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction
except ImportError:  # pragma: no cover - the package imports without Triton
    triton = None

ENABLED = None  # FP4MOE_RELAUNCH, read at the first launch
_UNUSABLE = object()  # a plan for calls the fast path does not take
_plans: dict = {}  # (id(kernel), positional count, keyword names) -> (kernel, its binder (_binder) or _UNUSABLE)
_compiled: dict = {}  # key -> (Triton's compiled kernel for it, the globals it read: (dict, name, value))
_lock = threading.Lock()


def _enabled() -> bool:
    global ENABLED
    if ENABLED is None:
        ENABLED = triton is not None and env_switch("FP4MOE_RELAUNCH", True)
    return ENABLED


def launch(kernel, grid, args: tuple, kwargs: dict) -> None:
    """``kernel[grid](*args, **kwargs)``, past Triton's per-call work where this kind of call was
    launched before (see the module docstring)."""
    if not _enabled() or not isinstance(kernel, JITFunction) or not isinstance(grid, tuple) or kernel.pre_run_hooks \
            or getattr(knobs.runtime, "add_stages_inspection_hook", None) is not None:
        kernel[grid](*args, **kwargs)
        return
    # (by id: a JITFunction hashes through a lock; the entry holds the kernel, whose id stays its own)
    plan_key = (id(kernel), len(args), *kwargs)
    entry = _plans.get(plan_key)
    if entry is None or entry[0] is not kernel:
        entry = _plans[plan_key] = (kernel, _binder(kernel, len(args), kwargs))
    bind = entry[1]
    if bind is _UNUSABLE:
        kernel[grid](*args, **kwargs)
        return
    values, key = bind(args, kwargs)
    device = driver.active.get_current_device()
    key = (key, device, kernel.debug or knobs.runtime.debug, knobs.compilation.instrumentation_mode,
           getattr(knobs.compilation, "fpsan_homomorphic_casts", None))
    try:
        entry = _compiled.get(key)
    except TypeError:  # an unhashable constexpr, or an argument of a kind the key does not cover
        entry = key = None
    # the kernel's globals, by identity with what they held when cached (where one changed, Triton's
    # run decides: it raises)
    if entry is None or any(where.get(name, _UNUSABLE) is not value for where, name, value in entry[1]):
        compiled = kernel[grid](*args, **kwargs)  # Triton's run: compiles if needed, checks, launches
        if key is not None and isinstance(compiled, CompiledKernel):
            # (the objects the globals hold now, which Triton's run has just found equal to those it
            # compiled with: Triton keeps copies, which an identity test would never match)
            used = tuple((where, name, where.get(name, _UNUSABLE)) for (name, _), (_, where) in kernel.used_global_vals.items())
            with _lock:
                _compiled[key] = (compiled, used)
        return
    compiled = entry[0]
    stream = driver.active.get_current_stream(device)
    grid_x, grid_y, grid_z = (*grid, 1, 1)[:3]
    compiled.run(grid_x, grid_y, grid_z, stream, compiled.function, compiled.packed_metadata,
                 compiled.launch_metadata(grid, stream, *values), knobs.runtime.launch_enter_hook,
                 knobs.runtime.launch_exit_hook, *values)


# the launch options Triton's NVIDIA backend reads from a call's keywords (not kernel parameters)
_OPTIONS = frozenset({"num_warps", "num_stages", "num_ctas", "maxnreg", "launch_pdl", "launch_cooperative_grid",
                      "enable_fp_fusion", "enable_reflect_ftz"})


def _binder(kernel, num_args: int, kwargs: dict):
    """A function of ``(args, kwargs)`` that returns every parameter's value in order and the
    call's key (the module docstring), generated for calls of ``kernel`` with ``num_args``
    positional arguments and these keywords (as Triton generates its own binder); _UNUSABLE where
    a keyword is neither a parameter nor a known option (such a call goes to Triton, which says what
    is wrong) or a parameter has no value."""
    import inspect

    names = [p.name for p in kernel.params]
    kinds = [param.kind for param in kernel.signature.parameters.values()]
    if any(kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD for kind in kinds) or num_args > len(names) \
            or any(name not in names and name not in _OPTIONS for name in kwargs) or "debug" in kwargs \
            or any(name in kwargs for name in names[:num_args]):
        return _UNUSABLE  # (*args or keyword-only parameters, or a call Triton refuses: Triton's path)
    namespace = {"spec": _spec, "Tensor": torch.Tensor}
    reads, keys = [], [str(id(kernel))]  # (the binder belongs to this kernel: see launch)
    for p in kernel.params:
        if p.num < num_args:
            reads.append(f"v{p.num} = args[{p.num}]")
        elif p.name in kwargs:
            reads.append(f"v{p.num} = kwargs[{p.name!r}]")
        elif p.has_default:
            namespace[f"d{p.num}"] = p.default
            reads.append(f"v{p.num} = d{p.num}")
        else:
            return _UNUSABLE
        # (a plain tensor's or int's part of the key inline, as _spec makes it: the common cases,
        # without a call)
        v = f"v{p.num}"
        keys.append(v if p.is_constexpr else
                    f"((({v}.dtype, not {v}.data_ptr() & 15) if {v}.__class__ is Tensor else "
                    f"({v} == 1, not {v} & 15) if {v}.__class__ is int and {_I32_LOW} <= {v} < {_I32_HIGH} "
                    f"else spec({v})))")
    keys += [f"({name!r}, kwargs[{name!r}].__class__, kwargs[{name!r}])" for name in kwargs if name in _OPTIONS]
    values = ", ".join(f"v{p.num}" for p in kernel.params)
    source = "def bind(args, kwargs):\n    " + "\n    ".join(reads) + \
        f"\n    return ({values},), ({', '.join(keys)},)\n"
    exec(source, namespace)  # noqa: S102 - code made from the kernel's own parameter names
    return namespace["bind"]


_I32_LOW, _I32_HIGH = -(1 << 31), 1 << 31
_DESCRIPTOR_FIELDS: dict = {}  # descriptor class -> the fields in its key (None: not a descriptor)


def _spec(x):
    """A non-constexpr argument's part of the key (the module docstring); an unhashable list where
    the key does not cover its kind (the lookup fails: Triton's path)."""
    if isinstance(x, torch.Tensor):  # (a subclass: the binder keys plain tensors inline)
        return x.dtype, not x.data_ptr() & 15
    kind = x.__class__
    if kind is int:  # (one outside i32: the binder keys those inline, as (x == 1, x % 16 == 0))
        width = "i64" if -(1 << 63) <= x < 1 << 63 else "u64" if 0 <= x < 1 << 64 else "too wide"
        return width, not x & 15
    if kind is float or kind is bool or x is None:
        return kind
    fields = _DESCRIPTOR_FIELDS.get(kind, ())
    if fields == ():
        fields = _DESCRIPTOR_FIELDS[kind] = _descriptor_fields(kind)
    if fields is None:
        return []
    values = fields(x)
    if list in map(type, values):  # (a block shape given as a list)
        values = [tuple(v) if v.__class__ is list else v for v in values]
    return kind, x.base.dtype, *values


def _descriptor_fields(kind):
    """A getter of the fields of a host tensor descriptor class that go in the key (all but base,
    shape and strides, as a tuple), or None for a class that is not one."""
    import dataclasses
    from operator import attrgetter

    if not (dataclasses.is_dataclass(kind) and kind.__name__ == "TensorDescriptor"):
        return None
    names = [f.name for f in dataclasses.fields(kind) if f.name not in ("base", "shape", "strides")]
    return attrgetter(*names) if len(names) > 1 else (lambda x: (getattr(x, names[0]),))


# Triton's cdiv and next_power_of_2 are constexpr functions that cost ~2 us a call on the host
# (3.6-3.9, a CPU): the launch arguments computed per call use these instead (the same values for
# the positive divisors and the sizes they take)
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 0 else 0


def clear() -> None:
    """Forget the compiled kernels kept (tests; Triton's own cache is not touched)."""
    with _lock:
        _compiled.clear()
        _plans.clear()
