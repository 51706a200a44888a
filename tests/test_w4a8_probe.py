"""The W4A8 probe's kernels (benchmarks/probes/probe_w4a8_bound.py) against its float64 oracle, and the
oracle against the format definitions, on small random shapes. Without a GPU the kernels run in
Triton's interpreter (conftest sets TRITON_INTERPRET): the interpreter runs ``tl.dot`` on float8e4nv
operands, but its float32 -> float8e4nv and float32 -> bf16 casts do not round to nearest even, so
the kernels round in integer arithmetic there (the probe's ``EXACT=True``, its default in the
interpreter); the hardware casts are checked against the same oracle by the probe's device check.
CPU-sized: the whole file takes well under a minute."""

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "probes"))
import probe_w4a8_bound as probe  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_nvfp4(n: int, k: int, zero_row: bool = True):
    """Random bytes (every E2M1 code, -0 included); block scales over E4M3's whole range, each row's
    within 18 binades below its own top and the rows' tops binades apart (so rows fold differently,
    and a row's smallest blocks decode to E4M3 subnormals and zeros); a row of zero scales; a global
    scale that is not a power of two."""
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    row_top = torch.randint(0, 9, (n, 1)).float()
    scale = torch.pow(2.0, row_top - 18 * torch.rand(n, k // 16)) * (1 + torch.rand(n, k // 16))
    scale = scale.clamp(min=2.0**-9, max=448).to(torch.float8_e4m3fn)
    # row 0 for certain: a block at E4M3's largest scale beside one at its smallest, whose products
    # then decode to a subnormal (6 * 2^-9 * 2^-3 = 0.75 * 2^-9 rounds up to 2^-9) and to zeros
    scale[0, :2] = torch.tensor([448.0, 2.0**-9])
    packed[0, 8], packed[0, 9:16] = 0x77, 0x21
    if zero_row:
        scale[n // 2] = 0.0
    g = torch.tensor([3.7e-3 * (1 + torch.rand(()).item())])
    return packed.to(DEVICE), scale.to(DEVICE), g.to(DEVICE)


def random_activations(t: int, k: int):
    """Gaussian bf16 rows at different magnitudes, one row all zero, one with a single large value."""
    x = torch.randn(t, k) * torch.pow(2.0, torch.randint(-8, 8, (t, 1)).float())
    x[1] = 0.0
    x[2, 3] = 300.0
    return x.to(torch.bfloat16).to(DEVICE)


def e4m3_midpoints() -> torch.Tensor:
    """Every positive E4M3 value, the midpoints between neighbours (ties), one float32 ulp either side
    of them, and both signs: the cases a rounding gets wrong first."""
    values = probe.e4m3_64(torch.arange(0, 127, dtype=torch.uint8)).float()  # 0 .. 448
    mids = (values[1:] + values[:-1]) / 2
    near = torch.cat([values, mids, torch.nextafter(mids, torch.zeros_like(mids)),
                      torch.nextafter(mids, torch.full_like(mids, 1e9)), torch.rand(4096) * 448,
                      torch.rand(1024) * 2.0**-6, torch.tensor([2.0**-10, 3 * 2.0**-10, 2.0**-11, 447.9, 448.0])])
    return torch.cat([near, -near])


def test_oracle_e4m3_decode_is_the_format():
    """e4m3_64 of every byte equals torch's float8_e4m3fn widened (NaN at S.1111.111 only)."""
    b = torch.arange(256, dtype=torch.uint8)
    ours, torchs = probe.e4m3_64(b), b.view(torch.float8_e4m3fn).double()
    assert torch.equal(ours.isnan(), torchs.isnan()) and int(ours.isnan().sum()) == 2
    assert torch.equal(ours[~ours.isnan()], torchs[~torchs.isnan()])


def test_oracle_rounding_matches_torch_cast():
    """round_e4m3_64 (frexp, round half to even) against torch's float32 -> float8_e4m3fn cast, which
    rounds to nearest even: equal values and signs (zeros included) on ties and their neighbours."""
    v = e4m3_midpoints()
    ours = probe.round_e4m3_64(v.double())
    torchs = v.to(torch.float8_e4m3fn).double()
    assert torch.equal(ours, torchs)
    assert torch.equal(torch.signbit(ours), torch.signbit(torchs))
    assert probe.round_e4m3_64(torch.tensor([1.0625, 1.1875, 2.0**-10, 3 * 2.0**-10], dtype=torch.float64)).tolist() \
        == [1.0, 1.25, 0.0, 2.0**-8]


def test_oracle_w4a16_matches_the_package_decode():
    """The oracle's own E2M1 and E4M3 decode gives fp4moe's dequantized weight (an independent check of
    both) on ModelOpt-recipe weights."""
    from fp4moe_ops import nvfp4

    q = nvfp4.quantize_nvfp4(torch.randn(48, 256))
    x = torch.eye(256, dtype=torch.bfloat16)
    w = probe.oracle_w4a16_64(x, q.packed, q.block_scale, q.global_scale).T
    assert torch.equal(w, nvfp4.dequantize_nvfp4(q.packed, q.block_scale, q.global_scale, torch.float64))


@triton.jit
def _round_kernel(x_ptr, e4m3_ptr, bf16_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    v = tl.load(x_ptr + offs, mask=ok, other=0.0)
    tl.store(e4m3_ptr + offs, probe._to_e4m3(v, True), mask=ok)
    tl.store(bf16_ptr + offs, probe._to_bf16(v, True), mask=ok)


def test_kernel_rounding_helpers_round_to_nearest_even():
    """_rne_e4m3 (integer arithmetic) gives the oracle's bytes, signed zeros included; _to_bf16's
    integer rounding gives torch's round-to-nearest-even bf16 cast."""
    v = e4m3_midpoints()
    # bf16 ties (the low 16 bits 0x8000) and random low bits, over float32's normal range around 1
    high = torch.randint(0, 2, (4096,), dtype=torch.int32) << 31
    high |= torch.randint(100, 140, (4096,), dtype=torch.int32) << 23
    high |= torch.randint(0, 2**7, (4096,), dtype=torch.int32) << 16
    low = torch.where(torch.arange(4096) % 2 == 0, 0x8000, torch.randint(0, 2**16, (4096,))).to(torch.int32)
    v = torch.cat([v, (high | low).view(torch.float32)]).to(DEVICE)
    e4m3 = torch.empty(v.shape, dtype=torch.float8_e4m3fn, device=DEVICE)
    bf16 = torch.empty(v.shape, dtype=torch.bfloat16, device=DEVICE)
    _round_kernel[(triton.cdiv(v.numel(), 1024),)](v, e4m3, bf16, v.numel(), BLOCK=1024)
    assert torch.equal(e4m3.view(torch.uint8), probe.e4m3_bytes(probe.round_e4m3_64(v.double())))
    assert torch.equal(bf16.view(torch.int16), v.to(torch.bfloat16).view(torch.int16))


@pytest.mark.parametrize("n,k,experts", [(32, 64, 1), (48, 160, 1), (96, 256, 2), (80, 96, 1)])
def test_decode_kernel_matches_oracle(n, k, experts):
    """E4M3 bytes and row scales of the decode kernel (and of the load-time row-scale kernel) equal
    the oracle's exactly; with two stacked experts, each with its own global scale."""
    packed, scale, g = random_nvfp4(n, k)
    rows = None
    if experts > 1:
        g = torch.tensor([2.1e-3, 5.3e-2], device=DEVICE)
        rows = n // experts
    w8, r = probe.decode_to_e4m3(packed, scale, g, rows_per_global=rows)
    want, want_r = probe.oracle_decode64(packed, scale, g, rows_per_global=rows)
    assert torch.equal(w8.view(torch.uint8), probe.e4m3_bytes(want))
    assert torch.equal(r.double(), want_r)
    _, r2 = probe.weight_row_scales(packed, scale, g, rows_per_global=rows)
    assert torch.equal(r2.double(), want_r)
    # the fold rounds (6 significant bits into E4M3's 4), by at most 1/16 of a weight in E4M3's normal
    # range, and never past 448
    k_row, _ = probe.oracle_row_fold64(scale, g, rows)
    products = probe.e2m1_64(packed) * probe.e4m3_64(scale).repeat_interleave(16, -1)
    products = products * torch.pow(2.0, k_row.double())[:, None]
    assert not torch.equal(want, products)
    normal = products.abs() >= 2.0**-6
    assert bool(((want - products).abs()[normal] <= products.abs()[normal] / 16).all())
    assert float(want.abs().max()) <= 448
    subnormal = (want.abs() < 2.0**-6) & (want != 0)
    assert bool(subnormal.any()) and bool(((want == 0) & (products != 0)).any())  # both paths exercised


@pytest.mark.parametrize("t,k", [(5, 64), (17, 256), (33, 160)])
def test_activation_quantization_matches_oracle(t, k):
    x = random_activations(t, k)
    x8, sx = probe.quantize_activations(x)
    want, want_s = probe.oracle_act_quant64(x)
    assert torch.equal(x8.view(torch.uint8), probe.e4m3_bytes(want))
    assert torch.equal(sx.double(), want_s)
    assert float(want[1].abs().max()) == 0.0  # the zero row gives zeros, not NaN
    assert float(want.abs().amax(-1)[0]) == 448.0  # each row's largest value lands on E4M3's largest


SMALL_CONFIGS = [probe.Config(16, 32, 32, False), probe.Config(16, 32, 64, True),
                 probe.Config(32, 16, 32, True, fp32_acc=False), probe.Config(32, 32, 64, False, fp32_acc=False)]


@pytest.mark.parametrize("t,n,k", [(5, 32, 64), (17, 48, 128), (33, 96, 256), (9, 80, 192)])
def test_fused_gemm_matches_oracle(t, n, k):
    """Every small config (both operand orders, float32 promotion or not) and the probe's own configs
    where K allows: within fp32_tolerance of the W4A8 oracle (float32 accumulation of exact products,
    two float32 scale products, one bf16 rounding; the bound is derived in fp32_tolerance), and far
    from a W4A8 that skipped a rounding (so the check can fail)."""
    packed, scale, g = random_nvfp4(n, k)
    x = random_activations(t, k)
    y64, bound = probe.oracle_w4a8_64(x, packed, scale, g)
    tol = probe.fp32_tolerance(y64, bound, k)
    shift, r = probe.weight_row_scales(packed, scale, g)
    configs = [c for c in SMALL_CONFIGS + probe.CONFIGS if k % c.BK == 0]
    for cfg in configs:
        y = probe.w4a8_linear(x, packed, scale, shift, r, cfg)
        assert y.dtype == torch.bfloat16 and y.shape == (t, n)
        err = (y.double() - y64).abs()
        assert bool((err <= tol).all()), (cfg.name, float((err / tol).max()))
    w16 = probe.oracle_w4a16_64(x, packed, scale, g)
    assert bool(((w16 - y64).abs() > 10 * tol).any())  # W4A16 is not W4A8 within this tolerance


def test_pick_config_is_in_the_timed_table():
    for t in probe.LINEAR_TOKENS:
        for _, n, k in probe.LINEAR_SHAPES:
            cfg = probe.pick_config(t, n, k)
            assert cfg in probe.CONFIGS and k % cfg.BK == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU, run the probe itself")
def test_probe_tables_run_on_cpu(monkeypatch):
    """The script's GPU path at tiny shapes with an eager timer, so its plumbing (tables, the device
    check, the failure reporting) is exercised where CI runs: the interpreter's numbers are not timings."""
    monkeypatch.setattr(probe, "DEVICE", "cpu")
    monkeypatch.setattr(probe, "COPY_BYTES", 1)

    class EagerTimer:
        errors: list = []

        def __call__(self, fn, inputs, what, replays=20):
            try:
                start = time.perf_counter()
                for args in inputs:
                    fn(*args)
                return (time.perf_counter() - start) * 1e3 / len(inputs)
            except Exception as e:  # noqa: BLE001
                self.errors.append(f"{what}: {probe._first_line(e)}")
                return float("nan")

    lines, timer = [], EagerTimer()
    probe.device_check(lines, probe.QUICK_CONFIGS[:2], t=9, n=64, k=256)
    probe.linear_tables(lines, timer, [("tiny", 64, 256)], (8,), probe.QUICK_CONFIGS[:2])
    probe.moe_tables(lines, timer, [("tiny moe", 4, 256, 128, 2)], (16,))
    text = "\n".join(lines)
    assert "integer rounding (EXACT=True): decoded E4M3 bytes differing from the oracle's: 0 of" in text
    assert "activation bytes 0 of" in text and "token scales 0 of" in text
    ratios = [float(line.split("max |err| / tolerance ")[1].split(",")[0]) for line in lines if "/ tolerance" in line]
    rowwise = cpu_rowwise_scaled_mm()
    # 2 fused configs, and 2 _scaled_mm rows where this torch's CPU build scales by row (exact bytes here)
    assert len(ratios) == 2 + 2 * rowwise and max(ratios) <= 1.0, ratios
    assert "| tiny | 64 | 256 | 8 |" in text and "| tiny moe | gate_up | 16 | 8 |" in text
    # the CPU has no FP8 grouped GEMM (and before torch 2.13 no row-scaled FP8 GEMM): those failures
    # are reported, nothing else fails
    missing = ("_scaled_grouped_mm",) if rowwise else ("_scaled_grouped_mm", "_scaled_mm")
    assert all(any(name in e for name in missing) for e in timer.errors), timer.errors


def cpu_rowwise_scaled_mm() -> bool:
    """Whether this torch's CPU ``_scaled_mm`` takes row-wise scales (torch 2.11 takes only one scale
    per tensor on the CPU)."""
    a = torch.ones(16, 32).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


def test_kernels_compile_for_sm90_to_fp8_wgmma():
    """Without a GPU: every kernel variant the GPU run launches compiles for sm_90 under this Triton
    (the probe's --compile-only, in a subprocess outside the interpreter, with an empty cache), every
    fused config lowers to FP8 wgmma (e4m3 x e4m3 -> f32), and the ``Wa`` configs feed wgmma the
    decoded weight from registers."""
    env = dict(os.environ, TRITON_CACHE_DIR=tempfile.mkdtemp(prefix="fp4moe-w4a8-"), TRITON_DEFAULT_FP_FUSION="1")
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, str(Path(probe.__file__)), "--compile-only"], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| _")]
    assert len(rows) == 5 + len(probe.CONFIGS) and not any("FAILED" in row for row in rows), done.stdout
    for row in rows:
        if "_w4a8_gemm_kernel" in row:
            assert ".f32.e4m3.e4m3" in row, row
            assert ("| registers |" in row) == (" Wa " in row), row
