"""The CUDA prefill GEMMs (fp4moe_ops/backends/cuda_prefill, an issue-17 experiment): the code ptxas
makes of them (CPU, with nvcc) and, on a Hopper GPU, the layer against the float64 oracle."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from fp4moe_ops.oracle64 import moe64
from test_triton_backend import kernel_tensors, layer, skewed_ids

SOURCE = Path(__file__).resolve().parent.parent / "fp4moe_ops" / "backends" / "cuda_prefill" / "prefill.cu"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CUDA 12.4+)")
def test_ptxas_keeps_the_wgmma_pipelined_and_nothing_spills(tmp_path):
    # wgmma's register operand is decoded while earlier chunks' wgmma run; if ptxas cannot prove
    # those registers are left alone it serializes every wgmma (note C7513/C7515), which costs
    # most of the overlap; a branch between the wgmma of one step was enough (prefill.cu's
    # predicated arrive). Spills would put the accumulators in local memory.
    out = subprocess.run(["nvcc", "-diag-suppress", "177", "-gencode=arch=compute_90a,code=sm_90a", "-cubin", "-O3",
                          "-std=c++17", "-Xptxas", "-v", "-o", str(tmp_path / "p.cubin"), str(SOURCE)],
                         capture_output=True, text=True, check=True)
    log = out.stdout + out.stderr
    kernels = re.findall(r"Compiling entry function '(\w+)'", log)
    assert len(kernels) >= 6, log
    assert not re.search(r"C75\d\d", log), log
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert len(spills) == len(kernels) and all(a == "0" and b == "0" for a, b in spills), log


def test_the_host_knows_each_kernels_ring_and_it_fits_in_shared_memory():
    # the ring depth is a template argument in prefill.cu and a table in prefill.py: a mismatch would
    # launch a kernel with less shared memory than it indexes
    from fp4moe_ops.backends.cuda_prefill.prefill import KERNELS, shared_bytes

    kernels = re.findall(r"^PREFILL_KERNEL\((\w+), (true|false), (\d+), (\d+), \d\)", SOURCE.read_text(), re.M)
    assert len(kernels) >= 6
    for name, gemm1, bm, stages in kernels:
        assert KERNELS[int(bm)] == int(stages), name
        assert shared_bytes(int(bm), gemm1 == "true") <= 227 * 1024, name  # Hopper's limit per block


def test_the_host_knows_how_far_ahead_the_kernels_read_scales():
    # the host refuses a K that is not a multiple of the kernels' scale read-ahead; a stale copy of the
    # default would let such a K reach the kernels, which then read scales past the row
    from fp4moe_ops.backends.cuda_prefill.prefill import SCALE_AHEAD

    assert re.search(r"^#define SCALE_AHEAD (\d+)$", SOURCE.read_text(), re.M).group(1) == str(SCALE_AHEAD)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="wgmma: Hopper only")
@pytest.mark.parametrize("block_m,t,tails,cluster,scale_ahead",
                         [(128, 1100, (64, 32), 1, None), (64, 300, (32,), 1, None), (32, 150, (), 1, None),
                          # past 4096 slots: routing by torch ops
                          (128, 2100, (64,), 1, None),
                          # programs in pairs sharing the activations
                          (128, 1100, (64, 32), 2, None), (64, 300, (), 2, None),
                          # scale bytes read 1 and 2 steps ahead instead of prefill.cu's default
                          (32, 150, (), 1, 1), (128, 1100, (64, 32), 1, 2)])
def test_cuda_prefill_matches_float64(block_m, t, tails, cluster, scale_ahead, monkeypatch):
    # as test_gluon_row_blocks_and_tails_match_float64: H = 2048, I = 1024 (the ring wraps), skewed
    # loads (partial and several blocks per expert), a tail block at every level, sentinel ids dropped
    from fp4moe_ops.backends.cuda_prefill import prefill
    from fp4moe_ops.backends.cuda_prefill.prefill import prefill_moe

    if scale_ahead is not None:  # prefill.cu's compile-time knob (its own cubin)
        monkeypatch.setattr(prefill, "DEFINES", {"SCALE_AHEAD": scale_ahead})

    e, h, i, k = 8, 2048, 1024, 2
    w = layer(e, h, i)
    x = torch.randn(t, h, dtype=torch.bfloat16)
    ids = skewed_ids(t, e, k, block_m, tails, sentinels=(-1, e))
    rw = torch.rand(t, k)
    out = prefill_moe(x.cuda(), ids.cuda(), rw.cuda(), [a.cuda() for a in kernel_tensors(w)], block_m=block_m,
                      tails=tails, cluster=cluster).cpu()
    ref = moe64(x, ids, rw, *w.tensors())
    # the intermediate and the output rounded to bf16, fp32 sums (test_gluon_prefill_matches_float64)
    ulp = 2.0**-8
    torch.testing.assert_close(out.double(), ref, rtol=4 * ulp, atol=4 * ulp * ref.abs().max().item())
    assert ((out.double() - ref).norm() / ref.norm()).item() < 4 * ulp
