"""Host side of the CUDA prefill GEMMs (``prefill.cu``, an issue-17 experiment): the cubin loaded
and launched through the CUDA driver (ctypes, no extension to build), TMA descriptors encoded per
call. Same interface and layouts as :func:`..triton_moe.prefill_rs.prefill_gemms`, so the two can be
compared on the same inputs (``benchmarks/bench_gluon_prefill.py --compare-module``).

The kernels are compiled at first use with NVRTC (the ``nvidia-cuda-nvrtc`` library PyTorch's CUDA
builds bring) and cached on disk; :func:`build` compiles them with ``nvcc`` instead, for inspection.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
CUBIN = HERE / "prefill.cubin"
BK = 64
BOX_PAIRS = 32
KERNELS = {128: 6, 64: 8, 32: 8}  # rows per block (wgmma N) -> ring slots compiled in prefill.cu
THREADS = 384  # a loading warpgroup and two MMA warpgroups
MAX_CLUSTERS = 0  # programs in clusters of 2: at most this many clusters (0: half the SMs); an experiment's knob
ARCH = "sm_90a"  # wgmma and setmaxnreg need the architecture-specific target
# prefill.cu's compile-time knobs (-D), for A/B runs in one process; each set is its own cubin
DEFINES: dict[str, int] = {}


SCALE_AHEAD = 4  # prefill.cu's default (a CPU test holds the two equal)


def _scale_ahead() -> int:
    return DEFINES.get("SCALE_AHEAD", SCALE_AHEAD)


def build(out: Path = CUBIN) -> Path:
    """Compile ``prefill.cu`` for sm_90a into ``out`` with ``nvcc`` (for inspecting the code: ptxas's
    notes, SASS; at run time :func:`cubin` compiles with NVRTC instead)."""
    subprocess.run(["nvcc", "-diag-suppress", "177", f"-gencode=arch=compute_90a,code={ARCH}", "-cubin", "-O3",
                    "-std=c++17", "-o", str(out), str(HERE / "prefill.cu")], check=True)
    return out


def _find_nvrtc() -> ctypes.CDLL:
    """libnvrtc: already loaded or on the loader's path, else from an ``nvidia-cuda-nvrtc`` wheel
    (PyTorch's CUDA builds depend on it)."""
    for name in ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            pass
    for root in map(Path, sys.path):
        for lib in sorted((root / "nvidia").glob("**/libnvrtc.so*")) if (root / "nvidia").is_dir() else ():
            if "builtins" not in lib.name and "alt" not in lib.name:
                return ctypes.CDLL(str(lib))
    raise RuntimeError("the CUDA prefill kernels need NVRTC (libnvrtc, e.g. from the nvidia-cuda-nvrtc wheel)")


def compile_nvrtc(arch: str = ARCH) -> bytes:
    """``prefill.cu`` compiled by NVRTC to a cubin for ``arch``."""
    nvrtc = _find_nvrtc()
    source = (HERE / "prefill.cu").read_bytes()
    header = (HERE / "wgmma_rs.cuh").read_bytes()
    prog = ctypes.c_void_p()

    def check(result, what):
        if result != 0:
            nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p
            raise RuntimeError(f"NVRTC {what}: {nvrtc.nvrtcGetErrorString(result).decode()}")

    check(nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source, b"prefill.cu", 1, (ctypes.c_char_p * 1)(header),
                                   (ctypes.c_char_p * 1)(b"wgmma_rs.cuh")), "create")
    try:
        options = [f"--gpu-architecture={arch}".encode(), b"-std=c++17", b"-diag-suppress=177"]
        options += [f"-D{name}={value}".encode() for name, value in sorted(DEFINES.items())]
        result = nvrtc.nvrtcCompileProgram(prog, len(options), (ctypes.c_char_p * len(options))(*options))
        if result != 0:
            size = ctypes.c_size_t()
            nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC could not compile prefill.cu:\n{log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        check(nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "cubin size")
        image = ctypes.create_string_buffer(size.value)
        check(nvrtc.nvrtcGetCUBIN(prog, image), "cubin")
        return image.raw
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))


def cubin() -> bytes:
    """The compiled kernels, from the on-disk cache (keyed by the sources) or compiled now."""
    defines = repr(sorted(DEFINES.items())).encode()
    key = hashlib.sha256((HERE / "prefill.cu").read_bytes() + (HERE / "wgmma_rs.cuh").read_bytes()
                         + defines).hexdigest()[:16]
    cache = Path(os.environ.get("FP4MOE_CACHE", Path.home() / ".cache" / "fp4moe")) / f"prefill-{ARCH}-{key}.cubin"
    if cache.exists():
        return cache.read_bytes()
    image = compile_nvrtc()
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(image)
    tmp.replace(cache)  # (atomic: another process may be writing the same entry)
    return image


class _Args(ctypes.Structure):  # prefill.cu's Args, field for field
    _fields_ = [("scales", ctypes.c_void_p), ("global_scale", ctypes.c_void_p), ("out", ctypes.c_void_p),
                ("topk_weights", ctypes.c_void_p), ("sorted_slot", ctypes.c_void_p),
                ("block_expert", ctypes.c_void_p), ("row_start", ctypes.c_void_p), ("row_end", ctypes.c_void_p),
                ("n_out", ctypes.c_int), ("k", ctypes.c_int), ("rows_per_expert", ctypes.c_int),
                ("num_blocks", ctypes.c_int)]


class _Driver:
    """The few driver calls needed, on the context PyTorch made current."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        torch.cuda.init()
        torch.zeros(1, device="cuda")  # makes the primary context current on this thread
        self.module = ctypes.c_void_p()
        self._check(self.lib.cuModuleLoadData(ctypes.byref(self.module), cubin()), "cuModuleLoadData")
        self.functions = {}
        self.sm_count = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count

    def _check(self, result, what):
        if result != 0:
            raise RuntimeError(f"{what} failed with CUresult {result}")

    def function(self, name: str, shared_bytes: int):
        if name not in self.functions:
            fn = ctypes.c_void_p()
            self._check(self.lib.cuModuleGetFunction(ctypes.byref(fn), self.module, name.encode()), name)
            self._check(self.lib.cuFuncSetAttribute(fn, 8, shared_bytes), "max dynamic shared memory")
            self.functions[name] = fn
        return self.functions[name]

    def tensor_map(self, t: torch.Tensor, box: tuple[int, int], swizzle: int, dtype: int):
        """A 2-D tiled TMA descriptor of ``t`` (rows, inner); ``box`` (inner, rows)."""
        rows, inner = t.shape
        desc = (ctypes.c_ubyte * 128)()
        dims = (ctypes.c_uint64 * 2)(inner, rows)
        strides = (ctypes.c_uint64 * 1)(t.stride(0) * t.element_size())
        boxes = (ctypes.c_uint32 * 2)(*box)
        ones = (ctypes.c_uint32 * 2)(1, 1)
        self._check(self.lib.cuTensorMapEncodeTiled(desc, dtype, 2, ctypes.c_void_p(t.data_ptr()), dims, strides, boxes,
                                                    ones, 0, swizzle, 2, 0), "cuTensorMapEncodeTiled")
        return desc

    def launch(self, fn, grid, shared_bytes: int, *params):
        pointers = (ctypes.c_void_p * len(params))(*[ctypes.cast(ctypes.pointer(p), ctypes.c_void_p) for p in params])
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        self._check(self.lib.cuLaunchKernel(fn, grid[0], grid[1], 1, THREADS, 1, 1, shared_bytes, stream, pointers, None),
                    "cuLaunchKernel")


_DRIVERS = {}  # by DEFINES
_BF16, _UINT8, _SWIZZLE_128B, _SWIZZLE_NONE = 9, 0, 3, 0


def _driver() -> _Driver:
    key = tuple(sorted(DEFINES.items()))
    if key not in _DRIVERS:
        _DRIVERS[key] = _Driver()
    return _DRIVERS[key]


def shared_bytes(block_m: int, gemm1: bool) -> int:
    """prefill.cu's shared memory: the ring, the output staging of both MMA warpgroups (a padded
    row of 64 outputs per token), GEMM2's routing weights, the barriers, 1 KB for alignment."""
    stages = KERNELS[block_m]
    out_row = (128 if gemm1 else 256) + 16
    return stages * (block_m * BK * 2 + 4 * BOX_PAIRS * BK) + 2 * block_m * (out_row + 4) + 2 * stages * 8 + 1024


def _launch(gemm1: bool, x, w, s, g, out, topk_weights, sorted_slot, block_expert, row_start, row_end, block_m: int,
            diag: int, cluster: int = 1):
    drv = _driver()
    n_out, k = out.shape[1], x.shape[1]
    if k % (BK * _scale_ahead()):
        raise ValueError(f"the CUDA prefill kernels need K ({k}) a multiple of {BK * _scale_ahead()} "
                         f"(steps of {BK}, scales read {_scale_ahead()} steps ahead)")
    smem = shared_bytes(block_m, gemm1)
    fn = drv.function(f"gemm{1 if gemm1 else 2}_bm{block_m}" + (f"_diag{diag}" if diag else "")
                      + ("_c2" if cluster == 2 else ""), smem)
    # (in a cluster each program loads half of a row block's tile and multicasts it: half-height boxes)
    x_map = drv.tensor_map(x, (BK, block_m // cluster), _SWIZZLE_128B, _BF16)
    w_map = drv.tensor_map(w, (BK, BOX_PAIRS), _SWIZZLE_NONE, _UINT8)
    rows = 2 * n_out if gemm1 else n_out  # weight rows per expert
    args = _Args(s.data_ptr(), g.data_ptr(), out.data_ptr(), topk_weights.data_ptr(), sorted_slot.data_ptr(),
                 block_expert.data_ptr(), row_start.data_ptr(), row_end.data_ptr(), n_out, k, rows,
                 block_expert.numel())
    units = n_out // (128 if gemm1 else 256) * block_expert.numel() // cluster  # (an even tile count)
    slots = drv.sm_count // cluster if cluster == 1 or not MAX_CLUSTERS else MAX_CLUSTERS
    drv.launch(fn, (cluster * min(units, slots), 1), smem, x_map, w_map, args)  # persistent
    return out


def gemm1(x_sorted, w13, s13, g13, sorted_slot, block_expert, row_start, row_end, block_m: int = 128, diag: int = 0,
          cluster: int = 1, out=None):
    """``h [S, I]`` bf16 = SwiGLU of the gate and up GEMMs (K of GEMM2 in fragment order), into
    ``out`` when given (the launches of several row-block sizes fill one ``h``)."""
    num_experts, inter = w13.shape[0], s13.shape[1] // 2
    if out is None:
        out = torch.empty(x_sorted.shape[0], inter, dtype=torch.bfloat16, device=x_sorted.device)
    w = w13.view(torch.uint8).reshape(num_experts * inter, x_sorted.shape[1])
    # (GEMM1 reads no routing weights: any float pointer stands in)
    return _launch(True, x_sorted, w, s13, g13, out, g13, sorted_slot, block_expert, row_start, row_end, block_m,
                   diag, cluster)


def gemm2(h, w2, s2, g2, topk_weights, sorted_slot, block_expert, row_start, row_end, block_m: int = 128,
          diag: int = 0, cluster: int = 1, out=None):
    """``y [S, H]`` float32 by slot: the down GEMM times the routing weight (float32 ``topk_weights``),
    into ``out`` when given."""
    num_experts, hidden = w2.shape[0], s2.shape[1]
    if out is None:
        out = torch.empty(h.shape[0], hidden, dtype=torch.float32, device=h.device)
    w = w2.view(torch.uint8).reshape(num_experts * hidden // 2, h.shape[1])
    return _launch(False, h, w, s2, g2, out, topk_weights, sorted_slot, block_expert, row_start, row_end, block_m,
                   diag, cluster)


def prefill_gemms(x_sorted, w13, s13, g13, w2, s2, g2, topk_weights, sorted_slot, block_expert, row_start, row_end,
                  block_m: int = 128, stages: int = 0, diag: int = 0, tails=(), cluster: int = 1, **_):
    """Both GEMMs, as :func:`..triton_moe.prefill_rs.prefill_gemms` (``stages`` is fixed per kernel
    here): ``x_sorted [S, H]`` bf16, K in fragment order -> ``y [S, H]`` float32 by slot. ``tails``:
    narrower row blocks (of :data:`KERNELS`, decreasing) for an expert's last block when it holds
    that few rows, each size a launch of its own (``prefill_rs.split_blocks``). ``diag`` (wrong
    results), bits: 1 no decode, 2 no MMA, 4 no output copies (1, 2, 4, 5 and 7 built for every
    block size). ``cluster`` 2: programs in pairs that share the activation tiles (TMA multicast)."""
    from ..triton_moe.prefill_rs import split_blocks

    launches = split_blocks(block_expert, row_start, row_end, w13.shape[0], block_m, tails)
    options = dict(diag=diag, cluster=cluster)
    h = y = None
    for bm, experts, starts, ends in launches:
        h = gemm1(x_sorted, w13, s13, g13, sorted_slot, experts, starts, ends, block_m=bm, out=h, **options)
    for bm, experts, starts, ends in launches:
        y = gemm2(h, w2, s2, g2, topk_weights, sorted_slot, experts, starts, ends, block_m=bm, out=y, **options)
    return y


def prefill_moe(x, topk_ids, topk_weights, expert_tensors, block_m: int = 128, tails=(), **options):
    """The whole layer with these GEMMs: ``triton_moe.launch._gluon_prefill_moe`` (routing into
    ``block_m``-row blocks, the gather in expert order with K in fragment order, top-k sum) with
    :func:`prefill_gemms` in place of the Gluon ones. Expert tensors in the Triton backend's paired
    layout; ``topk_weights`` are taken as float32."""
    from ..triton_moe.launch import _gluon_prefill_moe

    return _gluon_prefill_moe(x, topk_ids, topk_weights.float(), expert_tensors, block_m=block_m, tails=tuple(tails),
                              gemms=prefill_gemms, **options)
