"""``fp4moe::nvfp4_linear`` and NVFP4 linears kept in 4 bits through loading and saving: the op
against the float64 oracle, under torch.compile, with bad inputs; genuine ModelOpt and
llm-compressor exports loaded with ``nvfp4_linears="nvfp4"`` against the dequantized path and the
tools' own fake quant, and saved back byte for byte."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import fp4moe_ops
import hf_integration  # noqa: F401  (registers the quantizer)
from fp4moe_ops import nvfp4
from fp4moe_ops.oracle64 import dequant64, linear64
from hf_integration.checkpoint_format import CompressedTensorsNVFP4Config, ModelOptConfig
from hf_integration.experts import NVFP4Linear

FIXTURES = Path(__file__).parent / "fixtures"


def nvfp4_weight(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = nvfp4.quantize_nvfp4(torch.randn(n, k, generator=g) * torch.logspace(-2, 1, n)[:, None])
    return w.packed, w.block_scale, w.global_scale.reshape(())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,n,bias", [((5, 64), 48, False), ((2, 3, 128), 32, True), ((1, 32), 16, True)])
def test_nvfp4_linear_matches_float64(dtype, shape, n, bias):
    packed, scale, g = nvfp4_weight(n, shape[-1])
    x = torch.randn(shape, dtype=dtype)
    b = torch.randn(n, dtype=dtype) if bias else None
    got = fp4moe_ops.nvfp4_linear(x, packed, scale, g, b)
    want = linear64(x, packed, scale, g, b)
    assert got.dtype == dtype and got.shape == (*shape[:-1], n)
    # Two roundings to the dtype (unit roundoff u: bf16 2^-9, fp16 2^-12): each decoded weight
    # (as dequantizing at load does), and the float32 sum at the end. So per output element
    # |got - want| <= u * sum_k |x_k W_nk| + u * |want| (+ float32 summation, far below), with 2u
    # as margin. fp16 covers these weights' range (largest 6 * 448 * global scale).
    u = 2.0**-9 if dtype == torch.bfloat16 else 2.0**-12
    bound = 2 * u * (x.double().abs() @ dequant64(packed, scale, g).abs().T) + 2 * u * want.abs()
    assert ((got.double() - want).abs() <= bound).all()


def test_nvfp4_linear_compiles_without_graph_breaks_and_dynamic_tokens():
    packed, scale, g = nvfp4_weight(32, 64)

    def f(x):
        return torch.relu(fp4moe_ops.nvfp4_linear(x, packed, scale, g)) * 2

    explanation = torch._dynamo.explain(f)(torch.randn(3, 64, dtype=torch.bfloat16))
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    for t in (1, 7, 20):
        x = torch.randn(t, 64, dtype=torch.bfloat16)
        assert torch.equal(compiled(x), f(x))


@pytest.mark.parametrize("change,error,words", [
    (dict(weight=lambda w: w.view(torch.int8)), TypeError, "weight must be"),
    (dict(weight=lambda w: w[:, :-1]), ValueError, "does not match x's K=64"),
    (dict(weight_scale=lambda s: s.view(torch.uint8)), TypeError, "weight_scale must be"),
    (dict(weight_scale=lambda s: s[:-1]), TypeError, "weight_scale must be"),
    (dict(global_scale=lambda g: g.reshape(1)), TypeError, "global_scale must be a 0-dim"),
    (dict(global_scale=lambda g: g.double()), TypeError, "global_scale"),
    (dict(x=lambda x: x.double()), TypeError, "x must be"),
    (dict(bias=lambda b: torch.zeros(31, dtype=torch.bfloat16)), TypeError, "bias must be"),
    (dict(bias=lambda b: torch.zeros(32)), TypeError, "bias must be"),
    (dict(backend=lambda b: "cutlass"), ValueError, "unknown nvfp4_linear backend 'cutlass'"),
])
def test_nvfp4_linear_refuses_bad_inputs_by_name(change, error, words):
    packed, scale, g = nvfp4_weight(32, 64)
    args = dict(x=torch.randn(4, 64, dtype=torch.bfloat16), weight=packed, weight_scale=scale, global_scale=g,
                bias=None, backend="reference")
    (name, fn), = change.items()
    args[name] = fn(args[name])
    with pytest.raises(error, match=words):
        fp4moe_ops.nvfp4_linear(**args)
    with pytest.raises(error, match=words), torch._subclasses.FakeTensorMode(allow_non_fake_inputs=True):
        fp4moe_ops.nvfp4_linear(**args)  # the fake function runs the same checks


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def triton_linear(x, packed, scale, g, bias=None, config=None, counters=None):
    """The Triton backend: through the op on a GPU, the launcher itself in Triton's CPU interpreter."""
    from fp4moe_ops.backends.triton_moe.launch import triton_nvfp4_linear

    if config is None and x.is_cuda:
        return fp4moe_ops.nvfp4_linear(x, packed, scale, g, bias, backend="triton", counters=counters)
    return triton_nvfp4_linear(x, packed, scale, g, bias, config, counters)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,parts,bias", [(1, None, False), (3, 1, True), (9, 3, False), (20, None, True),
                                               (40, 2, False), (5, 16, True), (70, None, True)])
@pytest.mark.parametrize("serial,x_tma", [(True, False), (False, False), (True, True)])
def test_triton_linear_matches_float64(dtype, tokens, parts, bias, serial, x_tma):
    # GEMV path at 1-64 tokens (16/32-row blocks; K's 4 steps split in 1, 2, 3 (2 + 2 + an empty
    # part) or 16 parts (12 past K), or as chosen; split parts summed in the same launch (serial)
    # or by a second kernel; x read permuted, or through TMA and permuted in registers),
    # dequantize + F.linear past 64; N = 192 is three 64-row tiles,
    # K = 1024 four 256-wide steps
    from fp4moe_ops.backends.triton_moe.launch import linear_config
    from fp4moe_ops.linear import split_counters

    if DEVICE == "cpu" and (not serial or x_tma) and (tokens, parts) not in ((9, 3), (5, 16), (40, 2)):
        pytest.skip("the interpreter is slow: the two-launch sum and TMA x are covered by the split cases")

    n, k = 192, 1024
    packed, scale, g = (t.to(DEVICE) for t in nvfp4_weight(n, k))
    x = torch.randn(tokens, k, dtype=dtype, device=DEVICE)
    b = torch.randn(n, dtype=dtype, device=DEVICE) if bias else None
    config = linear_config(tokens, n, k)
    if parts:
        config["PARTS"] = parts
    config["X_TMA"] = x_tma
    counters = split_counters(DEVICE)
    got = triton_linear(x, packed, scale, g, b, config, counters if serial else None).cpu()
    assert int(counters.abs().sum()) == 0  # every tile's counter back at zero
    want = linear64(x.cpu(), packed.cpu(), scale.cpu(), g.cpu(), None if b is None else b.cpu())
    w64 = dequant64(packed.cpu(), scale.cpu(), g.cpu())
    assert got.dtype == dtype and got.shape == (tokens, n)
    assert_within_kernel_bound(got, want, x, w64, dtype, exact_weight=config["path"] != "dequantize")


def assert_within_kernel_bound(got, want, x, w64, dtype, exact_weight: bool):
    """``got`` against float64 ``want`` within what the kernel's arithmetic allows (``exact_weight``:
    the weight decoded exactly, summed in float32; else the reference's weight rounded to the dtype)."""
    k = x.shape[-1]
    abs_products = x.cpu().double().abs() @ w64.abs().T
    if exact_weight:
        # The weight decodes exactly; errors: float32 summation (<= K 2^-24 sum|x w|) and one
        # rounding of the result to the dtype (half an ulp on a GPU; Triton's CPU interpreter
        # truncates bf16: under one ulp, <= 2^-7 |y|; fp16 2^-10). The reference backend's weight
        # rounding (u sum|x w|) is absent: any decode or pairing error is far above this bound.
        out_round = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
        bound = k * 2.0**-24 * abs_products + out_round * want.abs() + 1e-30
    else:  # the reference's arithmetic: the bound of test_nvfp4_linear_matches_float64
        u = 2.0**-9 if dtype == torch.bfloat16 else 2.0**-12
        bound = 2 * u * abs_products + 4 * u * want.abs()
    assert ((got.double() - want).abs() <= bound).all(), ((got.double() - want).abs() / bound).max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,parts,bias", [(1, None, False), (2, 3, True), (9, 6, False), (17, 2, True),
                                               (40, None, False), (64, 1, True), (70, None, True),
                                               (128, 3, False), (130, None, True)])
@pytest.mark.parametrize("serial", [True, False])
def test_triton_linear_on_paired_weights_matches_float64(dtype, tokens, parts, bias, serial):
    # Weights in the paired layout (what NVFP4Linear holds on Hopper): on a GPU with bf16
    # activations decode_v3's mma.sync linear up to 128 tokens (8/16/32-token blocks; K's 6 ring
    # slots in 1, 2, 3 or 6 parts, summed in the same launch or by a second kernel), else the
    # Triton GEMV up to 64; past those the paired weight decoded to 16 bits for F.linear. N = 192:
    # three 64-row tiles; K = 3072: six 512-wide slots.
    from fp4moe_ops.backends.triton_moe.launch import linear_config
    from fp4moe_ops.backends.triton_moe.layout import paired_weight_layout
    from fp4moe_ops.linear import split_counters

    v3 = DEVICE == "cuda" and dtype == torch.bfloat16
    if DEVICE == "cpu" and (tokens not in (2, 70) or not serial):
        pytest.skip("the interpreter is slow: one split GEMV and the dequantize path")
    n, k = 192, 3072
    packed, scale, g = nvfp4_weight(n, k, seed=7)
    words = paired_weight_layout(packed).to(DEVICE)
    scale, g = scale.to(DEVICE), g.to(DEVICE)
    x = torch.randn(tokens, k, dtype=dtype, device=DEVICE)
    b = torch.randn(n, dtype=dtype, device=DEVICE) if bias else None
    config = linear_config(tokens, n, k, True, v3)
    assert config["path"] == ("v3" if v3 and tokens <= 128 else "gemv" if tokens <= 64 else "dequantize")
    if parts and config["path"] != "dequantize":
        config["PARTS"] = parts
    counters = split_counters(DEVICE)
    got = triton_linear(x, words, scale, g, b, config, counters if serial else None).cpu()
    assert int(counters.abs().sum()) == 0  # every tile's counter back at zero
    want = linear64(x.cpu(), packed, scale.cpu(), g.cpu(), None if b is None else b.cpu())
    assert got.dtype == dtype and got.shape == (tokens, n)
    assert_within_kernel_bound(got, want, x, dequant64(packed, scale.cpu(), g.cpu()), dtype,
                               exact_weight=config["path"] != "dequantize")


def test_a_moved_or_emptied_nvfp4_linear_starts_with_a_zeroed_counter_table():
    # a non-zero counter would make a tile's parts sum early on every later call: moves and
    # to_empty() (uninitialized memory) zero the module's table
    from hf_integration.checkpoint_format import MODELOPT
    from hf_integration.experts import NVFP4Linear

    m = NVFP4Linear.quantize(torch.nn.Linear(256, 64, bias=False).to(torch.bfloat16))
    for move in (lambda: m.to("cpu"), lambda: m.to(torch.float16), lambda: m.to_empty(device="cpu")):
        m.split_counters.fill_(7)
        move()
        assert m.split_counters.dtype == torch.int32 and int(m.split_counters.abs().sum()) == 0
    assert m.scheme is MODELOPT and m.weight.dtype == torch.uint8  # the quantized buffers keep their dtypes


def test_split_k_parts_are_summed_through_the_callers_counter_table():
    # the same-launch sum really counts arrivals in the table: tile 0 (output rows 0-63) ends at
    # 0 again with the right result; tile 1's counter, set to 100 beforehand, only counts its 4
    # parts (none of them sees 3 arrivals before it, so none sums or resets). A table too small
    # for the call is not used: a second kernel sums the parts.
    from fp4moe_ops.backends.triton_moe.launch import linear_config
    from fp4moe_ops.linear import split_counters

    n, k = 128, 1024
    packed, scale, g = (t.to(DEVICE) for t in nvfp4_weight(n, k, seed=21))
    x = torch.randn(2, k, dtype=torch.bfloat16, device=DEVICE)
    config = dict(linear_config(2, n, k), PARTS=4)
    want = linear64(x.cpu(), packed.cpu(), scale.cpu(), g.cpu())
    bound = 2.0**-7 * want.abs() + 1024 * 2.0**-24 * (x.cpu().double().abs() @ dequant64(packed.cpu(), scale.cpu(),
                                                                                           g.cpu()).abs().T)
    counters = split_counters(DEVICE)
    counters[1] = 100
    got = triton_linear(x, packed, scale, g, None, config, counters).cpu().double()
    assert counters[:3].tolist() == [0, 104, 0]
    assert ((got - want).abs() <= bound)[:, :64].all()
    tiny = torch.zeros(1, dtype=torch.int32, device=DEVICE)  # 2 tiles need 2 entries
    got = triton_linear(x, packed, scale, g, None, config, tiny).cpu().double()
    assert ((got - want).abs() <= bound).all() and int(tiny[0]) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_dequantize_kernel_is_bitwise_the_reference_weight(dtype):
    from fp4moe_ops.backends.triton_moe.kernels import _dequant_kernel
    from fp4moe_ops.backends.triton_moe.launch import interpreting

    if dtype == torch.bfloat16 and not torch.cuda.is_available():
        pytest.skip("Triton's CPU interpreter truncates float32 -> bf16 (the GPU rounds to nearest)")
    packed, scale, g = (t.to(DEVICE) for t in nvfp4_weight(128, 512, seed=3))
    out = torch.empty(128, 512, dtype=dtype, device=DEVICE)
    _dequant_kernel[(2, 2)](packed, scale.view(torch.uint8), g, out, 512, None, BN=64, BK=256,
                            FAST_DECODE=not interpreting())
    assert torch.equal(out, nvfp4.dequantize_nvfp4(packed, scale, g, dtype))
    # the same weight in the paired layout, its bytes through TMA
    from triton.tools.tensor_descriptor import TensorDescriptor

    from fp4moe_ops.backends.triton_moe.layout import paired_weight_layout

    words = paired_weight_layout(packed.cpu()).to(DEVICE)
    desc = TensorDescriptor.from_tensor(words.view(torch.uint8).reshape(64, 512), [32, 256])
    paired = torch.empty_like(out)
    _dequant_kernel[(2, 2)](words, scale.view(torch.uint8), g, paired, 512, desc, BN=64, BK=256,
                            FAST_DECODE=not interpreting(), PAIRED=True)
    assert torch.equal(paired, out)


def test_linear_config_splits_k_to_fill_the_gpu_and_switches_to_cublas_past_64_tokens():
    from fp4moe_ops.backends.triton_moe.launch import SM_COUNT_TARGET, linear_config

    q_a = linear_config(1, 1536, 7168)  # DeepSeek-V3 q_a_proj: 24 weight tiles of 64 rows, 28 K steps
    assert q_a["path"] == "gemv" and q_a["PARTS"] == 11 and 24 * q_a["PARTS"] >= SM_COUNT_TARGET
    o_proj = linear_config(8, 7168, 16384)  # 112 tiles
    assert o_proj["PARTS"] == 3 and 112 * o_proj["PARTS"] >= SM_COUNT_TARGET
    assert linear_config(1, 64, 512)["PARTS"] == 2  # never more parts than K steps
    # paired weights with the Gluon kernels: decode_v3 up to 128 tokens, K parts a divisor of its
    # 512-wide slots near two programs per SM; wide weights in the GEMV's 64-token blocks past 32
    v3 = [linear_config(t, 7168, 16384, True, True) for t in (1, 16, 64, 128, 129)]
    assert [c["path"] for c in v3] == ["v3"] * 4 + ["dequantize"]
    assert [(c["BM"], c["PARTS"]) for c in v3[:4]] == [(8, 2), (16, 2), (32, 1), (32, 1)]
    assert linear_config(1, 1536, 7168, True, True)["PARTS"] == 14  # 24 tiles, 14 slots
    # shared down: 112 tiles (half the SMs or more) and 4 slots, too short to split
    assert [linear_config(t, 7168, 2048, True, True)["PARTS"] for t in (1, 8)] == [1, 1]
    assert linear_config(64, 36864, 7168, True, True)["path"] == "gemv"
    assert linear_config(8, 7168, 16384, True, False)["path"] == "gemv"  # fp16 or no Gluon
    assert linear_config(1, 32768, 512)["PARTS"] == 1  # kv_b_proj: 512 tiles already
    assert linear_config(64, 7168, 2048)["BM"] == 32 and linear_config(65, 7168, 2048)["path"] == "dequantize"


def test_triton_linear_refusals_name_the_reason_and_auto_falls_back_to_the_reference():
    packed, scale, g = nvfp4_weight(32, 64)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="backend 'triton' cannot run this call: .*(on cpu|multiple of 64)"):
        fp4moe_ops.nvfp4_linear(x, packed, scale, g, backend="triton")
    assert torch.equal(fp4moe_ops.nvfp4_linear(x, packed, scale, g), fp4moe_ops.nvfp4_linear(x, packed, scale, g,
                                                                                             backend="reference"))
    from fp4moe_ops.backends.triton_moe.launch import linear_supported

    reason = linear_supported(x.to(DEVICE), torch.empty(48, 128, dtype=torch.uint8))
    assert ("multiple of 64" if torch.cuda.is_available() else "runs on CUDA") in reason


@pytest.mark.parametrize("tokens", [0, 5, 70])
def test_triton_linear_with_no_tokens_and_with_a_strided_weight(tokens):
    # an empty batch returns an empty result on both paths; a weight that is a strided view (every
    # other row of a larger one) is read as the values it holds
    from fp4moe_ops.backends.triton_moe.launch import linear_config

    n, k = 64, 512
    big, big_scale, g = (t.to(DEVICE) for t in nvfp4_weight(2 * n, k, seed=11))
    packed, scale = big[::2], big_scale[::2]
    assert not packed.is_contiguous()
    x = torch.randn(2, tokens, k, dtype=torch.bfloat16, device=DEVICE)
    got = triton_linear(x, packed, scale, g, None, None if x.is_cuda else linear_config(2 * tokens, n, k))
    assert got.shape == (2, tokens, n)
    if tokens:
        want = linear64(x.cpu(), packed.cpu(), scale.cpu(), g.cpu())
        w64 = dequant64(packed.cpu(), scale.cpu(), g.cpu())
        bound = 2.0**-7 * want.abs() + 2.0**-7 * (x.cpu().double().abs() @ w64.abs().T)  # both paths (see above)
        assert ((got.cpu().double() - want).abs() <= bound).all()


@pytest.mark.parametrize("path", ["dequantize", "reference", "backward"])
def test_cublas_gets_the_tokens_as_one_matrix(path):
    # attention hands o_proj at decode a [B, 1, K] tensor whose size-1 axis has a stride of its own:
    # is_contiguous() holds, but F.linear cannot fold it into one matrix and runs a batched GEMM
    # that reads the weight once per row (o_proj at 512 rows: 31 ms instead of 0.17 on an H100).
    # The paths that end in F.linear, and the backward's d x, run one GEMM over all tokens
    from torch.profiler import profile

    from fp4moe_ops.backends.triton_moe.launch import linear_config

    n, k, rows = 64, 512, 6
    packed, scale, g = (t.to(DEVICE) for t in nvfp4_weight(n, k, seed=3))
    x = torch.randn(rows, k, dtype=torch.bfloat16, device=DEVICE).as_strided((rows, 1, k), (k, 128, 1))
    assert x.is_contiguous()
    dy = torch.randn(rows, n, dtype=torch.bfloat16, device=DEVICE).as_strided((rows, 1, n), (n, 8, 1))
    with profile() as prof:
        if path == "dequantize":
            got = triton_linear(x, packed, scale, g, None, linear_config(65, n, k))
        elif path == "reference":
            got = fp4moe_ops.nvfp4_linear(x, packed, scale, g, backend="reference")
        else:
            got = torch.ops.fp4moe.nvfp4_linear_grad_input(dy, packed, scale, g)
    gemms = [e.name for e in prof.events() if e.name in ("aten::mm", "aten::addmm", "aten::bmm")]
    assert gemms and "aten::bmm" not in gemms
    w64 = dequant64(packed.cpu(), scale.cpu(), g.cpu())
    if path == "backward":
        assert got.shape == (rows, 1, k)
        a, b = dy.cpu().double(), w64  # d x = d y . W
    else:
        assert got.shape == (rows, 1, n)
        a, b = x.cpu().double(), w64.T
    want = a @ b
    bound = 2.0**-7 * want.abs() + 2.0**-7 * (a.abs() @ b.abs())  # bf16 weight and output
    assert ((got.cpu().double() - want).abs() <= bound).all()


def test_flashinfer_linear_call_adds_the_bias_and_keeps_the_leading_shape(monkeypatch):
    # the call around mm_bf16_fp4, with FlashInfer replaced by the CPU model of its definition
    import sys
    import types

    from fp4moe_ops.flashinfer_sim import simulate_mm_bf16_fp4
    from fp4moe_ops.linear import _flashinfer_linear

    fake = types.ModuleType("flashinfer")
    fake.mm_bf16_fp4 = lambda **kw: simulate_mm_bf16_fp4(**kw).to(kw["out_dtype"])
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    packed, scale, g = nvfp4_weight(64, 256, seed=4)
    x, b = torch.randn(2, 3, 256, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16)
    got = _flashinfer_linear(x, packed, scale, g, b)
    want = linear64(x, packed, scale, g, b)
    assert got.shape == (2, 3, 64) and got.dtype == torch.bfloat16
    # two bf16 roundings (the GEMM's output, then the bias add)
    assert ((got.double() - want).abs() <= 2 * 2.0**-8 * (want.abs() + b.double().abs())).all()
    assert _flashinfer_linear(x[:, :0], packed, scale, g, b).shape == (2, 0, 64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("paired", [False, True])
def test_triton_linear_compiles_and_replays_in_a_cuda_graph(paired):
    from fp4moe_ops.backends.triton_moe.layout import paired_weight_layout

    packed, scale, g = (t.cuda() for t in nvfp4_weight(256, 512, seed=5))
    packed = paired_weight_layout(packed) if paired else packed

    def f(x):
        return fp4moe_ops.nvfp4_linear(x, packed, scale, g, backend="auto") * 2

    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    for t in (1, 7, 33, 100):  # both paths
        x = torch.randn(t, 512, dtype=torch.bfloat16, device="cuda")
        assert torch.equal(compiled(x), f(x))
    static = torch.randn(4, 512, dtype=torch.bfloat16, device="cuda")
    f(static)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = f(static)
    fresh = torch.randn(4, 512, dtype=torch.bfloat16, device="cuda")
    static.copy_(fresh)
    graph.replay()
    assert torch.equal(out, f(fresh))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("bias", [False, True])
def test_first_linear_call_compiles_every_variant(bias, monkeypatch, tmp_path):
    # The first pass over new shapes, for NVFP4 linears: the first call of a linear shape
    # compiles the kernels of every token count (launch.compile_linear_once), so no later count
    # compiles a kernel or builds a launcher. A variant's code is shared by shapes whose N and K
    # divide alike, so the kernels' in-process caches are emptied first and Triton's disk cache is
    # a fresh directory: the first call must compile them all itself.
    import triton.backends.nvidia.driver
    import triton.runtime.build

    from fp4moe_ops.backends.triton_moe import kernels, launch
    from fp4moe_ops.linear import split_counters

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the Triton linear needs TMA (compute capability 9.0+)")
    # (Triton releases that launch through one generic module build no launcher per kernel)
    per_kernel_launchers = hasattr(triton.backends.nvidia.driver, "make_launcher")

    monkeypatch.setattr(launch, "COMPILE_AHEAD", True)
    monkeypatch.setattr(launch, "_COMPILED_SHAPES", set())
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    fns = [kernels._linear_kernel, kernels._linear_parts_kernel, kernels._dequant_kernel]
    for fn in fns:
        fn.device_caches.clear()
    builds, build = [], triton.runtime.build._build
    monkeypatch.setattr(triton.runtime.build, "_build",  # (launchers only: not the driver's own C module)
                        lambda name, *a, **kw: (name == "__triton_launcher" and builds.append(name)) or build(name, *a, **kw))

    def variants():
        return [sum(len(c[0]) for c in fn.device_caches.values()) for fn in fns]

    n, k = 192, 1024  # 3 column tiles: K split in 4 parts at every GEMV count (both ways of summing them)
    packed, scale, g = (t.cuda() for t in nvfp4_weight(n, k, seed=11))
    b = torch.randn(n, dtype=torch.bfloat16, device="cuda") if bias else None
    for counters in (split_counters("cuda"), None):
        x = torch.randn(3, k, dtype=torch.bfloat16, device="cuda")
        fp4moe_ops.nvfp4_linear(x, packed, scale, g, b, backend="triton", counters=counters)
        first, built = variants(), len(builds)
        assert first[0] > 0 and first[2] == 1, first  # GEMV kernels, the dequantize one
        assert built > 0 or not per_kernel_launchers
        for t in (*range(1, 71), 100, 257):  # every token count of the GEMV path, and the dequantize path
            x = torch.randn(t, k, dtype=torch.bfloat16, device="cuda")
            got = fp4moe_ops.nvfp4_linear(x, packed, scale, g, b, backend="triton", counters=counters)
            assert variants() == first and len(builds) == built, (t, first, variants(), builds)
            if t in (1, 8, 17, 33, 65, 257):
                xc, pc, sc, gc = x.cpu(), packed.cpu(), scale.cpu(), g.cpu()  # (the oracle runs on the CPU)
                want = linear64(xc, pc, sc, gc, None if b is None else b.cpu())
                # as test_nvfp4_linear_matches_float64 (bf16 weights decoded exactly here, then a
                # float32 sum rounded once to bf16; cuBLAS on the dequantize path)
                bound = 2 * 2.0**-9 * (xc.double().abs() @ dequant64(pc, sc, gc).abs().T + want.abs())
                assert ((got.cpu().double() - want).abs() <= bound).all(), t
    assert variants()[1] > 0  # without counters, the parts' second kernel compiled ahead too


def test_flashinfer_linear_arguments_compute_the_linear_in_flashinfers_semantics():
    # Blackwell's W4A16 GEMM (never run here): the exact arguments, consumed by a CPU model of
    # mm_bf16_fp4's definition that enforces its argument contract, against the float64 oracle
    from fp4moe_ops.flashinfer_sim import simulate_mm_bf16_fp4
    from fp4moe_ops.linear import flashinfer_linear_arguments

    packed, scale, g = nvfp4_weight(96, 256, seed=7)
    x = torch.randn(2, 3, 256, dtype=torch.bfloat16)
    args = flashinfer_linear_arguments(x, packed, scale, g)
    assert args["b"].data_ptr() == packed.data_ptr() and args["b_descale"].data_ptr() == scale.data_ptr()  # views
    got = simulate_mm_bf16_fp4(**args)
    want = linear64(x, packed, scale, g).reshape(6, 96)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12 * want.abs().max().item())  # both float64
    with pytest.raises(TypeError, match="linear"):  # the 128x4-swizzled scales are not what this path takes
        simulate_mm_bf16_fp4(**(args | dict(b_descale=nvfp4.swizzle_block_scale(scale.view(torch.uint8)).view(
            torch.float8_e4m3fn))))
    with pytest.raises(ValueError, match="cannot run this call: FlashInfer's FP4 GEMM needs a Blackwell GPU"):
        fp4moe_ops.nvfp4_linear(x, packed, scale, g, backend="flashinfer")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_flashinfer_linear_arguments_are_what_flashinfers_own_preparation_makes():
    # FlashInfer prepares the cuDNN path's weights from nvfp4_quantize's 128x4-swizzled scales;
    # ours are the checkpoint's tensors as they are: the same bytes
    flashinfer = pytest.importorskip("flashinfer")
    from fp4moe_ops.linear import flashinfer_linear_arguments

    packed, scale, g = (t.cuda() for t in nvfp4_weight(200, 512, seed=9))  # N not a multiple of 128
    args = flashinfer_linear_arguments(torch.randn(3, 512, dtype=torch.bfloat16, device="cuda"), packed, scale, g)
    swizzled = nvfp4.swizzle_block_scale(scale.view(torch.uint8)).view(torch.float8_e4m3fn)
    b, b_descale, alpha = flashinfer.prepare_bf16_fp4_weights(packed, swizzled, g.reshape(1), backend="cudnn")
    assert torch.equal(b, args["b"])
    assert b_descale.dtype == args["b_descale"].dtype and torch.equal(b_descale.view(torch.uint8),
                                                                        args["b_descale"].view(torch.uint8))
    assert torch.equal(alpha, args["alpha"])


def test_nvfp4_linears_option_is_checked():
    with pytest.raises(ValueError, match="nvfp4_linears must be one of"):
        ModelOptConfig(nvfp4_linears="fp8")


def _load(folder, nvfp4_linears, **options):
    """from_pretrained with the loading option (the config class must be the checkpoint's own)."""
    cls = CompressedTensorsNVFP4Config if "llmcompressor" in str(folder) else ModelOptConfig
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16,
                                                quantization_config=cls(nvfp4_linears=nvfp4_linears, **options))


def assert_reloads_identically(model, saved_folder, source_folder):
    """The saved checkpoint loads back (NVFP4 linears kept) to the same logits, bit for bit."""
    again = _load(saved_folder, "nvfp4")
    ids = load_file(source_folder / "reference_logits.safetensors")["input_ids"]
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)


def per_token_error(got, want):
    got, want = got.double().flatten(0, -2), want.double().flatten(0, -2)
    return (got - want).norm(dim=-1) / want.norm(dim=-1)


@pytest.mark.parametrize("fmt,name", [("modelopt", "deepseek_v3_nvfp4_default"), ("modelopt", "qwen3_moe_nvfp4_default"),
                                      ("llmcompressor", "qwen3_moe_nvfp4")])
def test_kept_nvfp4_linears_match_the_dequantized_path_and_the_tools_fake_quant(fmt, name):
    folder = FIXTURES / fmt / name
    ref = load_file(folder / "reference_logits.safetensors")
    # shared experts stay three linears here (fused into the experts' call they sum in another
    # order: tests/test_shared_experts.py)
    kept, dequantized = _load(folder, "nvfp4", fuse_shared_experts=False), _load(folder, "dequantize")
    linears = [n for n, m in kept.named_modules() if isinstance(m, NVFP4Linear)]
    assert linears, "this export has NVFP4 linears outside the experts"
    assert not any(isinstance(m, NVFP4Linear) for m in dequantized.modules())
    assert isinstance(kept.get_submodule(linears[0]).weight if fmt == "modelopt" else
                      kept.get_submodule(linears[0]).weight_packed, torch.Tensor)
    with torch.no_grad():
        got, base = kept(ref["input_ids"]).logits, dequantized(ref["input_ids"]).logits
    # the op decodes the weight as loading would and sums in float32 like nn.Linear on CPU
    assert torch.equal(got, base)
    err = per_token_error(got, ref["logits_weights_only"])
    assert err.median() < 2e-2 and err.max() < 5e-2, err  # as tests/test_real_exports.py
    # the checkpoint's tensors (a 4 KB counter table per linear aside, which tiny layers do not amortize)
    bytes_kept = sum(b.numel() * b.element_size() for n in linears for b in kept.get_submodule(n).state_dict().values())
    params = sum(dequantized.get_submodule(n).weight.numel() * 2 for n in linears)
    assert bytes_kept < 0.3 * params  # 0.5625 + scalars vs 2 bytes per weight


@pytest.mark.parametrize("fmt,name", [("modelopt", "deepseek_v3_nvfp4_default"), ("llmcompressor", "qwen3_moe_nvfp4")])
def test_every_kept_linear_matches_float64_from_the_file_bytes(fmt, name):
    """Each kept linear against the oracle decoding the file's own tensors (compressed-tensors'
    global scale divides), within the rounding bound of test_nvfp4_linear_matches_float64."""
    folder = FIXTURES / fmt / name
    files = load_file(folder / "model.safetensors")
    model = _load(folder, "nvfp4", fuse_shared_experts=False)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, NVFP4Linear)]
    assert len(linears) >= 8
    for n, m in linears:
        if fmt == "modelopt":
            packed, scale, g = files[f"{n}.weight"], files[f"{n}.weight_scale"], files[f"{n}.weight_scale_2"].item()
        else:
            packed, scale = files[f"{n}.weight_packed"], files[f"{n}.weight_scale"]
            g = 1.0 / files[f"{n}.weight_global_scale"].double().item()
        x = torch.randn(3, m.in_features, dtype=torch.bfloat16)
        with torch.no_grad():
            got = m(x).double()
        want = linear64(x, packed, scale, g)
        bound = 2 * 2.0**-9 * (x.double().abs() @ dequant64(packed, scale, g).abs().T + want.abs())
        assert ((got - want).abs() <= bound).all(), n


def test_kept_nvfp4_linears_save_back_byte_for_byte(tmp_path):
    folder = FIXTURES / "modelopt" / "deepseek_v3_nvfp4_default"
    model = _load(folder, "nvfp4")
    model.save_pretrained(tmp_path)
    original, saved = load_file(folder / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    linears = [n for n, m in model.named_modules() if isinstance(m, NVFP4Linear)]
    keys = [k for k in original if any(k.startswith(f"{n}.") for n in linears)]
    assert keys and all(k in saved for k in keys)
    for k in keys:
        a, b = original[k], saved[k]
        assert a.dtype == b.dtype and a.shape == b.shape, k
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b), k
    assert_reloads_identically(model, tmp_path, folder)


def test_kept_compressed_tensors_linears_save_as_modelopt(tmp_path):
    folder = FIXTURES / "llmcompressor" / "qwen3_moe_nvfp4"
    model = _load(folder, "nvfp4")
    assert isinstance(model.config.quantization_config, CompressedTensorsNVFP4Config)
    model.save_pretrained(tmp_path)
    original, saved = load_file(folder / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    name = next(n for n, m in model.named_modules() if isinstance(m, NVFP4Linear))
    assert torch.equal(saved[f"{name}.weight"], original[f"{name}.weight_packed"])
    assert saved[f"{name}.weight_scale_2"].shape == ()
    assert saved[f"{name}.weight_scale_2"] == 1.0 / original[f"{name}.weight_global_scale"][0]
    assert saved[f"{name}.input_scale"] == 1.0 / original[f"{name}.input_global_scale"][0]
    assert_reloads_identically(model, tmp_path, folder)


def test_kept_linears_keep_their_dtypes_under_model_casts_and_still_save_byte_for_byte(tmp_path):
    folder = FIXTURES / "modelopt" / "deepseek_v3_nvfp4_default"
    model = _load(folder, "nvfp4")
    name, linear = next((n, m) for n, m in model.named_modules() if isinstance(m, NVFP4Linear))
    model.to(torch.bfloat16)
    assert linear.weight_scale.dtype == torch.float8_e4m3fn and linear.weight_scale_2.dtype == torch.float32
    ids = load_file(folder / "reference_logits.safetensors")["input_ids"]
    with torch.no_grad():
        model(ids)
    model.save_pretrained(tmp_path)
    original, saved = load_file(folder / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    assert saved[f"{name}.weight_scale"].dtype == torch.float8_e4m3fn
    assert torch.equal(saved[f"{name}.weight_scale_2"], original[f"{name}.weight_scale_2"])
    # the loading options survive the save, and the size Transformers plans with is the file's
    assert model.config.quantization_config.nvfp4_linears == "nvfp4"
    assert model.hf_quantizer.param_element_size(model, f"{name}.weight", linear.weight) == 1


def test_a_save_whose_linears_and_experts_disagree_on_input_scales_is_refused_and_writes_nothing(tmp_path):
    folder = FIXTURES / "llmcompressor" / "qwen3_moe_nvfp4"  # W4A4: experts and linears with input scales
    model = _load(folder, "nvfp4")
    name, linear = next((n, m) for n, m in model.named_modules() if isinstance(m, NVFP4Linear))
    del linear._buffers[linear.scheme.input_scale]
    target = tmp_path / "out"
    with pytest.raises(ValueError, match=f"NVFP4 linear {name} has no input scale"):
        model.save_pretrained(target)
    assert not target.exists() and list(tmp_path.iterdir()) == []
    assert isinstance(model.config.quantization_config, CompressedTensorsNVFP4Config)  # restored


def test_linears_held_paired_read_save_and_load_as_the_checkpoint_bytes(tmp_path, monkeypatch):
    # On Hopper NVFP4Linear holds its packed weight in the paired layout. Forced here on the CPU,
    # every way out (state dict, save, dequantize, logits) must give what the file holds, and every
    # way in (load_state_dict, a refused one included) must take the file's bytes.
    folder = FIXTURES / "modelopt" / "deepseek_v3_nvfp4_default"
    files = load_file(folder / "model.safetensors")
    ids = load_file(folder / "reference_logits.safetensors")["input_ids"]
    canonical = _load(folder, "nvfp4")
    monkeypatch.setattr(NVFP4Linear, "kernel_layout",  # (where the layout holds the shape: N % 16)
                        lambda self, device=None: "paired" if self.out_features % 16 == 0 else "canonical")
    model = _load(folder, "nvfp4")
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, NVFP4Linear) and m.layout == "paired"]
    assert len(linears) >= 4 and all(m.weight.dtype == torch.int32 for _, m in linears)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, canonical(ids).logits)
    state = model.state_dict()
    for n, m in linears:
        assert torch.equal(state[f"{n}.weight"], files[f"{n}.weight"])
        assert torch.equal(m.dequantized().weight, canonical.get_submodule(n).dequantized().weight)
    held = {n: (m.weight.data_ptr(), m.weight.clone()) for n, m in linears}
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    assert all(torch.equal(saved[f"{n}.weight"], files[f"{n}.weight"]) for n, _ in linears)
    # converted in place for the save and back: the same words at the same address
    assert all(m.layout == "paired" and m.weight.data_ptr() == held[n][0] and torch.equal(m.weight, held[n][1])
               for n, m in linears)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, canonical(ids).logits)
    # a save that fails while the bytes are converted (writing the weights) leaves them as they were
    import transformers.modeling_utils

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file",
                        lambda *a, **k: (_ for _ in ()).throw(OSError("ENOSPC")))
    with pytest.raises(OSError, match="ENOSPC"):
        model.save_pretrained(tmp_path / "failed")
    assert all(m.layout == "paired" and m.weight.data_ptr() == held[n][0] and torch.equal(m.weight, held[n][1])
               for n, m in linears)
    # load_state_dict: the file's bytes in, paired kept; a bad tensor refused with nothing changed
    name, linear = linears[0]
    held = linear.weight.clone()
    bad = dict(state)
    bad[f"{linears[-1][0]}.weight_scale_2"] = torch.tensor(float("nan"))
    flipped = {k: v.clone() for k, v in state.items()}
    flipped[f"{name}.weight"] ^= 0x11
    with pytest.raises(ValueError, match="weight_scale_2"):
        model.load_state_dict(bad | {f"{name}.weight": flipped[f"{name}.weight"]})
    assert torch.equal(linear.weight, held)
    with pytest.raises(TypeError, match=rf"{name}.weight must be torch.uint8"):
        model.load_state_dict(dict(state) | {f"{name}.weight": linear.weight.clone()})  # the held words: refused
    model.load_state_dict(flipped)
    assert linear.layout == "paired" and torch.equal(linear.packed(), flipped[f"{name}.weight"])
    assert torch.equal(model.state_dict()[f"{name}.weight"], flipped[f"{name}.weight"])
    # the layout follows each move (_apply): here to what the stand-in names for the device
    model.load_state_dict(state)
    wanted = {"layout": "canonical"}
    monkeypatch.setattr(NVFP4Linear, "kernel_layout", lambda self, device=None: wanted["layout"] if
                        self.out_features % 16 == 0 else "canonical")
    model.to("cpu")
    assert all(m.layout == "canonical" and torch.equal(m.weight, files[f"{n}.weight"]) for n, m in linears)
    wanted["layout"] = "paired"
    model.to("cpu")
    assert all(m.layout == "paired" and m.weight.dtype == torch.int32 for _, m in linears)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, canonical(ids).logits)
