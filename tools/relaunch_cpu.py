"""Check on a machine without a GPU that ``relaunch.launch`` launches what Triton's own call path
launches: the same compiled kernel, grid and arguments, for every launch of a layer's calls and
for arguments chosen to change Triton's specialization.

    PYTHONPATH=/tmp/t36 TRITON_CACHE_DIR=$(mktemp -d) python tools/relaunch_cpu.py [--shape small]
        [--tokens 1,9,300,5000] [--time]

The stand-in sm90 driver of ``compile_ahead_cpu.py`` compiles the kernels; here it also loads them
(nothing: no GPU) and gives each compiled kernel a launcher that records its calls instead of
launching. Per token count, one MoE call's launches are recorded three times: with every launch
through Triton (``FP4MOE_RELAUNCH`` off), then twice with relaunch on (the first fills its table
through Triton, the second must take the fast path for every launch, Triton's ``run`` never
called). The three records must be equal: the launcher (one per compiled kernel), the grid, the
stream, and each argument (a tensor by dtype, shape, strides and storage offset, a descriptor by
its fields and its base's dtype and offset, a number by value). Then a small kernel is launched with arguments that Triton
specializes differently (an address off 16 bytes, ints 1 / 16 / 17 / 2^31, a dtype, None, a
constexpr), each must get the compiled kernel Triton's own call picks; calls Triton refuses (an
unknown keyword, an extra argument, a parameter given twice, a float ``num_warps``, an int wider
than 64 bits) must raise Triton's error both ways, also after a valid call of the same kind; and
after the kernel's ``debug`` flag or a global it reads changes, relaunch must do what Triton does
(launch the debug kernel; raise). ``--time``: the host
microseconds a launch takes both ways (median), per kernel.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository
sys.path.insert(0, str(Path(__file__).resolve().parent))  # compile_ahead_cpu
from compile_ahead_cpu import _Sm90WithoutGpu, gpt_oss_arguments, layer_arguments, linear_arguments  # noqa: E402

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

RECORD: list = []


class _Utils:
    """What a compiled kernel asks of the driver's utilities when it is first launched."""

    def load_binary(self, name, kernel, shared, device):
        return 0, 0, 0, 0, 1024  # module, function, registers, spills, max threads

    def get_device_properties(self, device):
        return {"max_shared_mem": 232448, "multiprocessor_count": 132}

    def unload_module(self, module):
        pass


class _RecordingLauncher:
    """A compiled kernel's launcher that records each call (as ``CompiledKernel.run`` is called:
    grid, stream, function, metadata, launch metadata, hooks, then every parameter's value)."""

    def __init__(self, name):
        self.name = name

    recording = True

    def __call__(self, *call):
        if self.recording:
            RECORD.append((self, call[:4], _described(call[6]), call[7:9], tuple(_described(a) for a in call[9:])))


def _described(a):
    if hasattr(a, "extras"):  # Triton's launch metadata (a LazyDict)
        return "launch metadata", sorted(a.data.items()), len(a.extras)
    if isinstance(a, torch.Tensor):
        return "tensor", a.dtype, tuple(a.shape), a.stride(), a.storage_offset()
    if hasattr(a, "base") and hasattr(a, "block_shape"):  # a launch reads the base's address and dtype only
        return (type(a).__name__, a.base.dtype, a.base.storage_offset(),
                *(str(v) for k, v in sorted(vars(a).items()) if k != "base"))
    return type(a).__name__, a


class _Sm90Recording(_Sm90WithoutGpu):
    def __init__(self):
        self.utils = _Utils()

    def launcher_cls(self, src, metadata):
        return _RecordingLauncher(src.fn.__name__)


def _runs_of_triton():
    """Count JITFunction.run calls that launch (not warmups) while active."""
    counts = {"run": 0}
    original = JITFunction.run

    def counting(self, *args, grid, warmup, **kwargs):
        if not warmup:
            counts["run"] += 1
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    class _Patch:
        def __enter__(self):
            JITFunction.run = counting
            return counts

        def __exit__(self, *exc):
            JITFunction.run = original

    return _Patch()


def check_calls(calls: dict) -> bool:
    """Each ``label -> call`` recorded three times (the module docstring); True where all agree."""
    from fp4moe_ops import relaunch

    ok = True
    for label, call in calls.items():
        records = []
        for enabled, clear in ((False, True), (True, True), (True, False)):
            relaunch.ENABLED = enabled
            if clear:
                relaunch.clear()
            RECORD.clear()
            with _runs_of_triton() as runs:
                call()
            records.append((list(RECORD), runs["run"]))
        (triton_launches, _), (first, _), (fast, fast_runs) = records
        names = [r[0].name for r in triton_launches]
        same = triton_launches == first == fast
        if not same:
            for a, b, c in zip(triton_launches, first, fast):
                if not a == b == c:
                    print("differs:", a[0].name, a[1:4], b[1:4], c[1:4])
                    for u, v, w in zip(a[4], b[4], c[4]):
                        if not u == v == w:
                            print("   ", u, v, w)
                    break
        print(f"{label}: {len(triton_launches)} launches {names}; relaunched the same: {same}; "
              f"Triton's run called on the fast pass: {fast_runs}")
        ok &= same and fast_runs == 0 and len(triton_launches) > 0
    relaunch.ENABLED = None
    return ok


def layer_calls(shape: str, tokens: list[int]) -> dict:
    """One MoE call per token count (NVFP4, and gpt-oss's MXFP4 experts at a small shape), an NVFP4
    linear's, and the routing ops' Triton launches."""
    from fp4moe_ops import routing
    from fp4moe_ops.backends.triton_moe import launch

    e, h, i, k = {"deepseek": (256, 7168, 2048, 8), "qwen3": (128, 2048, 768, 8)}.get(shape, (8, 512, 256, 2))
    _, _, _, tensors = layer_arguments(e, h, i, k)
    calls = {}
    for t in tokens:
        xt = torch.randn(t, h, dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)]).to(torch.int32)
        rwt = torch.rand(t, k)
        calls[f"MoE, {t} tokens"] = lambda xt=xt, ids=ids, rwt=rwt: launch.triton_fused_moe(xt, ids, rwt, tensors)
    oss_tensors, gpt_oss = gpt_oss_arguments(8, 512, 256)
    for t in tokens:
        xt, ids = torch.randn(t, 512, dtype=torch.bfloat16), torch.stack([torch.randperm(8)[:2] for _ in range(t)]).int()
        calls[f"gpt-oss MoE, {t} tokens"] = lambda xt=xt, ids=ids: launch.triton_fused_moe(
            xt, ids, torch.rand(t, 2), oss_tensors, gpt_oss=gpt_oss)
    x, *linear = linear_arguments(576, 512, bias=True, paired=True)
    for t in tokens:
        xt = x.expand(t, 512).contiguous()
        calls[f"NVFP4 linear, {t} tokens"] = lambda xt=xt: launch.triton_nvfp4_linear(xt, *linear[:4], counters=linear[4])
    logits = torch.randn(5, 64)
    hidden = torch.randn(5, h, dtype=torch.bfloat16)
    calls["routing ops"] = lambda: (
        routing.softmax_topk_triton(logits, 4, True),
        routing.grouped_topk_triton(logits, torch.randn(64), 8, 4, 4, True, 2.5),
        routing.router_softmax_topk_triton(hidden, torch.randn(64, h, dtype=torch.bfloat16),
                                           torch.zeros(routing.ROUTER_COUNTERS, dtype=torch.int32), 4, True))
    return calls


_TOY_SCALE = tl.constexpr(2)  # (a global the kernel reads: check_specializations changes it)


@triton.jit
def _toy(x_ptr, y_ptr, n, f, flag, z_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    v = tl.load(x_ptr + offs, mask=offs < n).to(tl.float32) * _TOY_SCALE
    if z_ptr is not None:
        v += tl.load(z_ptr + offs, mask=offs < n).to(tl.float32)
    if flag:
        v = v * f
    tl.store(y_ptr + offs, v, mask=offs < n)


def check_specializations() -> bool:
    """Arguments that change Triton's specialization, launched in turn, each twice through relaunch:
    each launch must reach the compiled kernel (launcher) Triton's own call reaches."""
    from fp4moe_ops import relaunch

    buf16, buf32 = torch.empty(4096, dtype=torch.bfloat16), torch.empty(4096, dtype=torch.float32)
    y = torch.empty(4096, dtype=torch.bfloat16)
    cases = {
        "aligned": (buf16, y, 64, 2.0, True, None),
        "x off 16 bytes": (buf16[1:], y, 64, 2.0, True, None),
        "x off 16 bytes again, another offset": (buf16[3:], y, 64, 2.0, True, None),
        "n = 1": (buf16, y, 1, 2.0, True, None),
        "n = 16": (buf16, y, 16, 2.0, True, None),
        "n = 17": (buf16, y, 17, 2.0, True, None),
        "n = 2^31": (buf16, y, 1 << 31, 2.0, True, None),
        "another float": (buf16, y, 64, 0.5, True, None),
        "flag False": (buf16, y, 64, 2.0, False, None),
        "z a tensor": (buf16, y, 64, 2.0, True, buf16),
        "x float32": (buf32, y, 64, 2.0, True, None),
    }
    ok = True
    relaunch.clear()
    for block in (64, 128):
        for label, args in list(cases.items()) * 2:  # (twice: the second pass is the fast path)
            relaunch.ENABLED = False
            RECORD.clear()
            _toy[(1,)](*args, BLOCK=block)
            expected = RECORD[-1][0]
            relaunch.ENABLED = True
            RECORD.clear()
            relaunch.launch(_toy, (1,), args, {"BLOCK": block})
            relaunch.launch(_toy, (1,), args, {"BLOCK": block})
            got = {r[0] for r in RECORD}
            if got != {expected} or len(RECORD) != 2:
                print(f"BLOCK={block}, {label}: relaunch reached {len(got)} kernels, not Triton's: WRONG")
                ok = False
    # calls Triton refuses, each after a valid call of the same kind was kept: Triton's own error,
    # both ways
    aligned = cases["aligned"]
    refused = {
        "an unknown keyword": (aligned, {"BLOCK": 64, "BLOK": 64}),
        "an extra positional argument": ((*aligned, 64, "junk"), {}),
        "a parameter given twice": (aligned, {"n": 9, "BLOCK": 64}),
        "num_warps as a float": (aligned, {"BLOCK": 64, "num_warps": 4.0}),
        "an int wider than 64 bits": ((buf16, y, (1 << 64) + 16, 2.0, True, None), {"BLOCK": 64}),
    }
    relaunch.ENABLED = True
    relaunch.launch(_toy, (1,), aligned, {"BLOCK": 64, "num_warps": 4})
    relaunch.launch(_toy, (1,), (buf16, y, 1 << 63, 2.0, True, None), {"BLOCK": 64})  # (a u64, kept)
    for label, (args, kwargs) in refused.items():
        errors = []
        for enabled in (False, True):
            relaunch.ENABLED = enabled
            try:
                relaunch.launch(_toy, (1,), args, kwargs)
                errors.append(None)
            except Exception as exc:  # noqa: BLE001 - the error itself is compared
                errors.append(type(exc))
        if errors[0] is None or errors[0] != errors[1]:
            print(f"{label}: {errors[0]} through Triton, {errors[1]} through relaunch: WRONG")
            ok = False
    # what Triton's run reads per call besides the arguments: the kernel's debug flag, its globals
    for label, change, undo in (("kernel.debug set", lambda: setattr(_toy, "debug", True),
                                 lambda: setattr(_toy, "debug", None)),
                                ("a global the kernel read changed", lambda: globals().update(_TOY_SCALE=tl.constexpr(3)),
                                 lambda: globals().update(_TOY_SCALE=tl.constexpr(2)))):
        relaunch.ENABLED = True
        relaunch.launch(_toy, (1,), aligned, {"BLOCK": 64})  # (kept before the change)
        change()
        try:
            outcomes = []
            for enabled in (False, True):
                relaunch.ENABLED = enabled
                RECORD.clear()
                try:
                    relaunch.launch(_toy, (1,), aligned, {"BLOCK": 64})
                    outcomes.append(RECORD[-1][0] if RECORD else None)
                except Exception as exc:  # noqa: BLE001 - the error itself is compared
                    outcomes.append(type(exc))
        finally:
            undo()
        if outcomes[0] != outcomes[1]:
            print(f"{label}: Triton {outcomes[0]}, relaunch {outcomes[1]}: WRONG")
            ok = False
    kernels = len({r for c in _toy.device_caches.values() for r in c[0].values()})
    print(f"specializations: {len(cases)} cases x 2 block sizes, {kernels} compiled kernels, "
          f"{'each relaunched as Triton launches it' if ok else 'WRONG'}")
    relaunch.ENABLED = None
    return ok


def time_launches(shape: str, tokens: int, calls: int = 300) -> None:
    """Median host microseconds of each launch of one call, through Triton and through relaunch."""
    from fp4moe_ops import relaunch
    from fp4moe_ops.backends.triton_moe import compile_ahead, launch

    e, h, i, k = {"deepseek": (256, 7168, 2048, 8), "qwen3": (128, 2048, 768, 8)}.get(shape, (8, 512, 256, 2))
    x, _, rw, tensors = layer_arguments(e, h, i, k)
    xt = torch.randn(tokens, h, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(tokens)]).to(torch.int32)
    launches = []
    original = compile_ahead.relaunched
    compile_ahead.relaunched = lambda kernel, grid, args, kwargs: launches.append((kernel, grid, args, kwargs))
    try:
        launch.triton_fused_moe(xt, ids, torch.rand(tokens, k), tensors)
    finally:
        compile_ahead.relaunched = original

    def median_us(fn):
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6

    relaunch.ENABLED = True
    _RecordingLauncher.recording = False
    for kernel, grid, args, kwargs in launches:
        relaunch.launch(kernel, grid, args, kwargs)
        through_triton = median_us(lambda: kernel[grid](*args, **kwargs))
        relaunched = median_us(lambda: relaunch.launch(kernel, grid, args, kwargs))
        print(f"{tokens} tokens, {kernel.fn.__name__}: {len(args) + len(kwargs)} arguments, "
              f"Triton's call {through_triton:.1f} us, relaunch {relaunched:.1f} us (stand-in launcher)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=["small", "qwen3", "deepseek"], default="small")
    ap.add_argument("--tokens", default="1,9,300,5000")
    ap.add_argument("--time", action="store_true")
    args = ap.parse_args()
    driver.set_active(_Sm90Recording())
    from fp4moe_ops.backends.triton_moe import launch

    launch._gluon_runs = lambda x: True  # (CPU tensors: as compile_ahead_cpu.py)
    launch.COMPILE_AHEAD = False  # (each call compiles what it launches)
    ok = check_calls(layer_calls(args.shape, [int(t) for t in args.tokens.split(",") if t]))
    ok &= check_specializations()
    if args.time:
        for t in (int(t) for t in args.tokens.split(",") if t):
            time_launches(args.shape, t)
    print("relaunch: same launches as Triton's" if ok else "relaunch: WRONG")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
