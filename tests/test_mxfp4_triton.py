"""gpt-oss's MXFP4 experts on the Triton kernels: the checkpoint tensors moved into the kernels'
layout and back byte for byte, and every kernel family against the float64 oracle of gpt-oss's
expert math (there with NVFP4 weights too). On the CPU the single-role kernels run in Triton's interpreter; the GPU tests add the
fast scale decode and the Gluon decode and prefill kernels (Hopper)."""

import pytest
import torch

from fp4moe_ops import mxfp4
from fp4moe_ops.gpt_oss_op import MXFP4_EXPERT_TENSORS
from fp4moe_ops.oracle64 import gpt_oss_moe64

triton_moe = pytest.importorskip("fp4moe_ops.backends.triton_moe")
from fp4moe_ops.backends.triton_moe import (gpt_oss_checkpoint_tensors, gpt_oss_kernel_tensors,  # noqa: E402
                                            kernel_config, triton_gpt_oss_moe)

SWIGLU_ALPHA = 1.702  # gpt-oss's swiglu_alpha
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def experts(e, h, i, low=119, high=126, bias_dtype=torch.bfloat16):
    """Random gpt-oss checkpoint tensors: random bytes (every E2M1 code), E8M0 scales 2^(low-127) ..
    2^(high-128) (gate_up GEMM outputs of a few units, so limit 7 clamps some), random biases."""
    (gub, gus), (db, ds) = mxfp4.gpt_oss_shapes(2 * i, h, e), mxfp4.gpt_oss_shapes(h, i, e)
    byte = lambda shape: torch.randint(0, 256, shape, dtype=torch.uint8)
    scale = lambda shape: torch.randint(low, high, shape, dtype=torch.uint8)
    bias = lambda shape: (torch.randn(shape) * 0.5).to(bias_dtype)
    return [byte(gub), scale(gus), bias((e, 2 * i)), byte(db), scale(ds), bias((e, h))]


@pytest.mark.parametrize("h,i,multiple", [(2880 // 9, 2880 // 9, 64), (2880, 2880, 64), (256, 512, 64), (96, 160, 64),
                                          (320, 320, 256)])
def test_kernel_layout_round_trip_is_byte_exact(h, i, multiple):
    # 320 = 2880 / 9: gpt-oss's kind of size (a multiple of 64, not of 256), held as it is; 96 and
    # 160 (multiples of 32 only) padded to 128 and 192; multiple=256 the earlier padded layout
    from fp4moe_ops.backends.triton_moe.layout import scale_columns

    tensors = experts(3, h, i)
    tensors[1][0, 0, 0], tensors[4][1, 2, 1] = 0, 150  # the smallest scale, the largest the kernels decode
    kernel = gpt_oss_kernel_tensors(tensors, multiple)
    # the sizes the layout holds, worked out by hand: H and I where they are multiples of 64
    hp, ip = {(96, 160, 64): (128, 192), (320, 320, 256): (512, 512)}.get((h, i, multiple), (h, i))
    assert [tuple(t.shape) for t in kernel] == [(3, ip, hp // 4), (3, 2 * ip, scale_columns(hp, 32)), (3, 2 * ip),
                                                (3, hp // 2, ip // 4), (3, hp, scale_columns(ip, 32)), (3, hp)]
    back = gpt_oss_checkpoint_tensors(kernel, h, i, torch.bfloat16)
    for a, b in zip(tensors, back):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_scale_rows_are_whole_steps_in_tma_units():
    # scale rows in whole 256-value steps: E4M3 per 16 values (NVFP4) 16 bytes a step, 2880 values'
    # 180 bytes held as 192; gpt-oss's E8M0 per 32 values held once, 8 bytes a step, 2880 values'
    # 90 bytes held as 96 (zeros past K), rows in pairs so that each 16-byte TMA unit holds one
    # step of two rows
    from fp4moe_ops.backends.triton_moe.layout import pair_scale_rows, scale_columns, unpair_scale_rows

    assert [scale_columns(k) for k in (64, 256, 320, 2880, 3072)] == [16, 16, 32, 192, 192]
    assert [scale_columns(k, 32) for k in (64, 256, 320, 768, 2880, 3072)] == [8, 8, 16, 24, 96, 96]
    tensors = experts(2, 2880, 320)
    gate_up_scale, down_scale = gpt_oss_kernel_tensors(tensors)[1::3]
    assert gate_up_scale.shape == (2, 640, 96) and down_scale.shape == (2, 2880, 16)
    rows = unpair_scale_rows(gate_up_scale).view(torch.uint8)
    assert torch.equal(rows[:, :320, :90], tensors[1][:, 0::2]) and not rows[..., 90:].any()  # each byte once
    units = gate_up_scale.view(torch.uint8).reshape(2, 320, 12, 16)  # [E, row pair, step, 16 bytes]
    assert torch.equal(units[1, 5, 3], torch.cat([rows[1, 10, 24:32], rows[1, 11, 24:32]]))
    assert not unpair_scale_rows(down_scale)[..., 10:].any()
    assert torch.equal(pair_scale_rows(unpair_scale_rows(down_scale)), down_scale)


def held_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_bytes_per_expert_of_gpt_oss_layers():
    # per expert of gpt-oss's layers (H = I = 2880), from the shapes alone: the checkpoint's
    # 13,236,480 bytes (blocks, one E8M0 byte per 32 values, bf16 biases); the kernels' layout
    # 13,305,600 (the same bytes, scale rows of 96 for 90 in pairs, float32 biases): 1.005x, where the E8M0
    # bytes written per 16 values held 14,135,040 (1.068x); the padded layout (3072) 15,077,376
    e, h, i = 1, 2880, 2880
    checkpoint = [torch.empty(s, dtype=d) for s, d in
                  zip([(e, 2 * i, h // 32, 16), (e, 2 * i, h // 32), (e, 2 * i), (e, h, i // 32, 16), (e, h, i // 32),
                       (e, h)], [torch.uint8, torch.uint8, torch.bfloat16] * 2)]
    assert held_bytes(checkpoint) == 13_236_480
    zeros = [torch.zeros_like(t) for t in checkpoint]
    assert held_bytes(gpt_oss_kernel_tensors(zeros)) == 13_305_600
    assert held_bytes(gpt_oss_kernel_tensors(zeros, 256)) == 15_077_376


@pytest.mark.parametrize("h,i", [(96, 160), (320, 192)])
def test_kernel_layout_holds_the_same_values(h, i):
    # independent of the kernels: the kernel layout decoded as NVFP4-shaped tensors (E8M0 per 32
    # values, rows [gate; up]) equals gpt-oss's matrices de-interleaved, zeros in any padding
    from fp4moe_ops.backends.triton_moe.layout import canonical_from_paired

    e = 2
    hp, ip = -(-h // 64) * 64, -(-i // 64) * 64
    tensors = experts(e, h, i)
    gate_up, gate_up_scale, gate_up_bias, down, down_scale, down_bias = gpt_oss_kernel_tensors(tensors)
    assert gate_up.shape == (e, ip, hp // 4) and down.shape == (e, hp // 2, ip // 4)
    from fp4moe_ops.backends.triton_moe.layout import unpair_scale_rows

    packed = canonical_from_paired(gate_up)
    rows = unpair_scale_rows(gate_up_scale).view(torch.uint8)
    values = mxfp4.dequantize_mxfp4(packed, rows[..., :hp // 32], torch.float64)  # [E, 2Ip, Hp]
    assert not rows[..., hp // 32:].any()
    dense = mxfp4.dequantize_gpt_oss(tensors[0], tensors[1], torch.float64)  # [E, 2I, H], interleaved
    assert torch.equal(values[:, :i, :h], dense[:, 0::2]) and torch.equal(values[:, ip:ip + i, :h], dense[:, 1::2])
    assert not values[:, i:ip].any() and not values[:, :, h:].any()
    assert torch.equal(gate_up_bias[:, :i], tensors[2][:, 0::2].float()) and not gate_up_bias[:, i:ip].any()
    assert torch.equal(down_bias[:, :h], tensors[5].float()) and not down_bias[:, h:].any()


@pytest.mark.parametrize("byte", [151, 255])
def test_scales_the_kernels_cannot_decode_are_refused_by_name(byte):
    tensors = experts(2, 64, 64)
    tensors[4][1, 3, 0] = byte
    with pytest.raises(ValueError, match=rf"down_proj_scales\[1, 3, 0\] is E8M0 byte {byte}.*reference"):
        gpt_oss_kernel_tensors(tensors)


def run(tensors, x, ids, rw, limit, config=None, multiple=64):
    kernel = [t.to(DEVICE) for t in gpt_oss_kernel_tensors(tensors, multiple)]
    return triton_gpt_oss_moe(x.to(DEVICE), ids.to(DEVICE), rw.to(DEVICE), kernel, SWIGLU_ALPHA, limit, config).cpu()


def routing(e, t, k, unused=(-1, -1)):
    """Ids of ``t`` tokens' ``k`` distinct experts (one slot unused), softmax weights."""
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    ids[unused] = -1
    return ids, torch.softmax(torch.randn(t, k), -1)


def check(out, x, ids, rw, tensors, limit):
    ref = gpt_oss_moe64(x, ids, rw, tensors, SWIGLU_ALPHA, limit)
    assert out.shape == x.shape and torch.isfinite(out).all()
    # h stored in bf16 and the output rounded to bf16: a few bf16 ulps (2^-8) of the row scale, as
    # the NVFP4 layer tests; over the whole output about one ulp on the GPU (round to nearest), two
    # in Triton's CPU interpreter, which truncates float32 -> bf16 (both roundings biased one way)
    torch.testing.assert_close(out.double(), ref, rtol=2**-6, atol=2**-6 * ref.abs().max().item())
    bound = 2**-6 if DEVICE == "cpu" else 2**-7
    assert ((out.double() - ref).norm() / ref.norm()).item() < bound


def check_single_role(e, h, i, t, k, limit=7.0, layout=None, multiple=64):
    """The single-role kernels (no Gluon prefill, no decode_v3) on ``e`` random experts and ``t``
    tokens of ``k`` slots against the float64 oracle, their config chosen for the ``layout``
    ``(H, I)`` the kernels see (default: as they are, edges allowed); returns the config."""
    tensors = experts(e, h, i)
    x = torch.randn(t, h, dtype=torch.bfloat16)
    ids, rw = routing(e, t, k)
    lh, li = layout or (h, i)
    cfg = kernel_config(t * k, e, lh, li, edges=multiple == 64) | {"GLUON_PREFILL": False, "DECODE_V3": False}
    check(run(tensors, x, ids, rw, limit, cfg, multiple=multiple), x, ids, rw, tensors, limit)
    return cfg


@pytest.mark.parametrize("t,k,limit", [(1, 4, 7.0), (6, 2, 1.0)])
def test_single_role_kernels_match_float64(t, k, limit):
    # the kernels' TMA path with paired weights (merged gate/up tiles), H = I = 320 as they are (a
    # 256-wide K step, then a partial one of 64); one token (a row block per slot, x read in natural
    # order) and several (routed blocks, x and h with their last partial chunk in natural order), an
    # unused slot; limit 1 clamps
    cfg = check_single_role(4, 320, 320, t, k, limit)
    assert cfg["TMA"] and cfg["MERGED_GATE_UP"] and cfg["BK_GATE_UP"] == cfg["BK_DOWN"] == 256


@pytest.mark.parametrize("h,i,t,rows", [(448, 192, 3, 16), (192, 448, 1, 16), (320, 448, 20, 32), (448, 320, 70, 64)])
def test_partial_k_steps_in_every_single_role_bucket(h, i, t, rows):
    # H and I multiples of 64, not of 256, in each bucket's tiles (decode 16 rows, middle 32 with
    # 128-row tiles, prefill 64 with 256-row ones cut to divisors of N): K of 192 is one partial
    # step alone, 448 a full one and a partial of 192; the run-time K loop too (decode, 3 tokens)
    cfg = check_single_role(4, h, i, t, 2)
    assert cfg["BM"] == rows and cfg["TMA"] and h % cfg["BN_DOWN"] == 0 and (2 * i) % cfg["BN_GATE_UP"] == 0


def test_sizes_not_multiples_of_64_are_padded_as_little_as_possible():
    # 96 and 160 (multiples of 32, MXFP4's block): the layout pads them to 128 and 192 and the call
    # pads the activations and cuts the output, the one case that still copies per call
    check_single_role(4, 96, 160, 3, 2, layout=(128, 192))


def test_padded_layout_gives_the_same_result():
    # the earlier layout (multiple=256: 320 -> 512, activations padded per call), which benchmarks
    # compare, runs the same kernels to the same float64 oracle
    check_single_role(4, 320, 320, 2, 2, layout=(512, 512), multiple=256)
    check_single_role(4, 320, 320, 2, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="inline PTX needs a GPU")
def test_e8m0_scale_ptx_on_the_gpu_every_byte():
    # the fast E8M0 decode (kernels._E8M0X4_TO_BF16) and the portable one: every byte the kernels
    # take (0 .. 150) is exactly scale * 2^104 in bf16
    import triton
    import triton.language as tl

    @triton.jit
    def convert(src, dst, FAST: tl.constexpr):
        offs = tl.arange(0, 256)
        tl.store(dst + offs, triton_moe.kernels._scales_bf16(tl.load(src + offs), FAST))

    data = torch.arange(256).clamp(max=150).to(torch.uint8)
    want = torch.exp2(data.double() - 127 + 104)
    for fast in (True, False):
        out = torch.empty(256, dtype=torch.bfloat16, device="cuda")
        convert[(1,)](data.view(torch.int8).cuda(), out, FAST=fast)
        assert torch.equal(out.double().cpu(), want), fast


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon kernels: Hopper only")
@pytest.mark.parametrize("e,t,k,family", [(32, 1, 4, "gluon-decode"), (32, 8, 4, "gluon-decode"),
                                          (8, 40, 4, "triton-wgmma"), (8, 600, 4, "gluon-prefill")])
@pytest.mark.parametrize("weights", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("h,i", [(2880, 2880), (320, 448)])
def test_every_kernel_family_matches_float64(e, t, k, family, weights, h, i):
    # gpt-oss-20b's H = I = 2880 as they are (the last K step partial: 64 of 256 in decode_v3 and
    # the single-role kernels, 64 of a 128-wide pair step in the prefill; the prefill's last
    # weight tiles half past N), and a shape whose H and I end differently; each family the
    # layer's token counts pick, with gpt-oss's MXFP4 weights and with NVFP4 ones (ModelOpt's
    # export of gpt-oss)
    from fp4moe_ops.backends.triton_moe.launch import kernel_family
    from test_gpt_oss_nvfp4 import experts as nvfp4_experts

    tensors = (experts if weights == "mxfp4" else nvfp4_experts)(e, h, i)
    x = torch.randn(t, h, dtype=torch.bfloat16)
    ids, rw = routing(e, t, k, unused=(0, -1))
    assert kernel_family(x.cuda(), t * k, e, h, i, edges=True) == family
    check(run(tensors, x, ids, rw, 7.0), x, ids, rw, tensors, 7.0)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon kernels: Hopper only")
@pytest.mark.parametrize("t", [1, 8, 600])
def test_held_and_padded_layouts_agree_on_the_gpu(t):
    # the layout as held (2880) and the earlier padded one (3072, activations padded per call):
    # the padding only adds zero products, so both meet the oracle and each other closely
    e, h, i, k = 32, 2880, 2880, 4
    tensors = experts(e, h, i)
    x = torch.randn(t, h, dtype=torch.bfloat16)
    ids, rw = routing(e, t, k)
    held, padded = run(tensors, x, ids, rw, 7.0), run(tensors, x, ids, rw, 7.0, multiple=256)
    check(held, x, ids, rw, tensors, 7.0)
    check(padded, x, ids, rw, tensors, 7.0)
    torch.testing.assert_close(held, padded, rtol=2**-7, atol=2**-7 * padded.abs().max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon kernels: Hopper only")
def test_op_and_module_run_triton_on_the_gpu():
    # the op with backend "triton" on kernel tensors equals the reference backend on the checkpoint's
    e, h, i, t, k = 8, 2880, 2880, 5, 4
    tensors = experts(e, h, i)
    x = torch.randn(t, h, dtype=torch.bfloat16, device="cuda")
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)]).cuda()
    rw = torch.softmax(torch.randn(t, k), -1).cuda()
    kernel = [a.cuda() for a in gpt_oss_kernel_tensors(tensors)]
    out = torch.ops.fp4moe.gpt_oss_moe(x, ids, rw, kernel, SWIGLU_ALPHA, 7.0, "triton")
    ref = torch.ops.fp4moe.gpt_oss_moe(x, ids, rw, [a.cuda() for a in tensors], SWIGLU_ALPHA, 7.0, "reference")
    torch.testing.assert_close(out.double(), ref.double(), rtol=2**-6, atol=2**-6 * ref.abs().max().item())


def module(e=3, h=96, i=160):
    from types import SimpleNamespace

    from hf_integration import MXFP4GptOssExperts

    config = SimpleNamespace(num_local_experts=e, hidden_size=h, intermediate_size=i, swiglu_alpha=SWIGLU_ALPHA,
                             swiglu_limit=7.0)
    m = MXFP4GptOssExperts(config)
    m.load_state_dict(dict(zip(MXFP4_EXPERT_TENSORS, experts(e, h, i))))
    return m


def test_module_in_the_kernel_layout_keeps_the_checkpoint_state_dict():
    # on the CPU the layout change itself (what set_backend("triton") does on a GPU): the blocks and
    # scales held once, the state dict the checkpoint's bytes, a load going through them, casts
    m = module()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    m._to_kernel_layout()
    m.backend = "triton"
    assert m.kernel_layout and m._buffers["gate_up_proj_blocks"] is None
    after = m.state_dict()
    assert list(after) and set(after) == set(before)
    assert all(torch.equal(after[k], before[k]) and after[k].dtype == before[k].dtype for k in before)
    other = dict(zip(MXFP4_EXPERT_TENSORS, experts(3, 96, 160)))
    m.load_state_dict(other)
    assert m.kernel_layout  # what the state dict said, in the kernels' layout again
    assert all(torch.equal(m.state_dict()[k], other[k]) for k in other)
    torch.testing.assert_close(m.kernel_gate_up_bias[:, :160], other["gate_up_proj_bias"][:, 0::2].float(), rtol=0, atol=0)
    m.to(torch.float16)  # the biases cast as Transformers casts them; the kernels' copies follow, float32
    assert m.gate_up_proj_bias.dtype == torch.float16 and m.kernel_gate_up_bias.dtype == torch.float32
    assert torch.equal(m.kernel_down_bias[:, :96], m.down_proj_bias.float())
    m._to_checkpoint_layout()
    assert not m.kernel_layout and torch.equal(m.gate_up_proj_blocks, other["gate_up_proj_blocks"])


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon kernels: Hopper only")
def test_module_runs_triton_on_the_gpu_as_the_reference_does():
    m = module(8, 2880, 2880).cuda()
    x = torch.randn(7, 2880, dtype=torch.bfloat16, device="cuda")
    ids = torch.stack([torch.randperm(8)[:4] for _ in range(7)]).cuda()
    rw = torch.softmax(torch.randn(7, 4), -1).cuda()
    ref = m(x, ids, rw)
    assert m.backend == "reference"
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    assert m.set_backend("auto") == "triton" and m.kernel_layout
    out = m(x, ids, rw)
    torch.testing.assert_close(out.double(), ref.double(), rtol=2**-6, atol=2**-6 * ref.abs().max().item())
    assert all(torch.equal(v, sd[k]) for k, v in m.state_dict().items())


def _tma_box(view, coords, box):
    """What a TMA load of ``box`` at ``coords`` copies from ``view``: zeros where a coordinate is past
    its dimension (the emulation the next test reads the Gluon kernels' views with)."""
    out = torch.zeros(box, dtype=view.dtype)
    src, dst = [], []
    for c, b, n in zip(coords, box, view.shape):
        lo, hi = max(c, 0), min(c + b, n)
        if hi <= lo:
            return out
        src.append(slice(lo, hi))
        dst.append(slice(lo - c, hi - c))
    out[tuple(dst)] = view[tuple(src)]
    return out


@pytest.mark.parametrize("h,i,sps", [(320, 448, 1), (2880, 2880, 1), (512, 1024, 2)])
def test_decode_v3_boxes_hold_each_warps_k_chunk(h, i, sps):
    # on the CPU, the TMA boxes the Gluon decode kernels load, as their views define them: ring slot
    # q's box holds warp w's K chunk of each step (chunk 4 (SPS q + j) + w), zeros past K; the
    # scales (one E8M0 byte per 32 values, two per chunk, rows in pairs) as 64 rows of four int16 a
    # step, the checkpoint's bytes of those rows, zeros past K
    decode_v3 = pytest.importorskip("fp4moe_ops.backends.triton_moe.decode_v3")
    e = 2
    tensors = experts(e, h, i)
    gate_up, gate_up_scale, _, down, down_scale, _ = gpt_oss_kernel_tensors(tensors)
    down_bytes = down.view(torch.uint8).reshape(e * h // 2, i)
    weights, scales = decode_v3.weight_view(down, sps), decode_v3.pair_scale_view(down_scale)
    pair0, row0 = h // 2 + 32, h + 64  # expert 1, weight tile 1
    for q in range(-(-i // (256 * sps))):
        box = _tma_box(weights, [4 * sps * q, pair0, 0], [4 * sps, 32, 64])
        sbox = _tma_box(scales, [sps * q, row0 // 2, 0], [sps, 32, 8])  # as decode_v3._scale_copy places it
        for j in range(sps):
            rows = sbox[j].reshape(64, 4)  # as the kernel's shared memory is read
            for w in range(4):
                c = 4 * (sps * q + j) + w
                want = down_bytes[pair0:pair0 + 32, 64 * c:64 * c + 64] if 64 * c < i else torch.zeros(32, 64)
                assert torch.equal(box[4 * j + w], want.to(box.dtype))
                # rows row0 .. row0 + 63 (expert 1's 64 ..): the E8M0 bytes of the chunk's two 32-value blocks
                got = rows[:, w].contiguous().view(torch.uint8).reshape(64, 2)
                want = tensors[4][1, 64:128, 2 * c:2 * c + 2] if 64 * c < i else torch.zeros(64, 2)
                assert torch.equal(got, want.to(got.dtype))
    gate_up_bytes = gate_up.view(torch.uint8).reshape(2 * e, i // 2, h)
    weights, scales = decode_v3.gate_up_views(gate_up, gate_up_scale, 32)
    n = 1  # gate rows 32 .. 63 and the same up rows of expert 1
    for step in range(-(-h // 256)):
        box = _tma_box(weights, [4 * step, 2, 16 * n, 0], [4, 2, 16, 64])
        sbox = _tma_box(scales, [step, 1, 0, 16 * n, 0], [1, 1, 2, 16, 8])  # as decode_v3._gate_up_scale_copy
        rows = sbox.reshape(2, 32, 4)
        for w in range(4):
            c = 4 * step + w
            for u in range(2):
                want = gate_up_bytes[2 + u, 16 * n:16 * n + 16, 64 * c:64 * c + 64] if 64 * c < h else torch.zeros(16, 64)
                assert torch.equal(box[w, u], want.to(box.dtype))
                got = rows[u, :, w].contiguous().view(torch.uint8).reshape(32, 2)
                # gate rows are the checkpoint's even rows, up rows its odd ones
                want = tensors[1][1, u + 2 * (32 * n):u + 2 * (32 * n + 32):2, 2 * c:2 * c + 2] if 64 * c < h else \
                    torch.zeros(32, 2)
                assert torch.equal(got, want.to(got.dtype))


@pytest.mark.parametrize("t,k,h,i", [(1, 2, 2880, 2880), (3, 2, 320, 704)])
def test_single_role_kernels_at_gpt_oss_sizes(t, k, h, i):
    # gpt-oss's H = I = 2880 as held: 12 K steps whose E8M0 scales (one byte per 32 values, rows in
    # pairs) come 8 bytes a row, the last step the partial one (64 values); and I = 704 (two full
    # steps, then a partial one of 192: an odd number of steps); one token (a row block
    # per slot, one of them unused: a single slot's programs, ~40 s in the interpreter) and several
    # (the run-time K loop)
    e = 3
    tensors = experts(e, h, i)
    x = torch.randn(t, h, dtype=torch.bfloat16)
    ids, rw = routing(e, t, k, unused=(0, -1))
    cfg = kernel_config(t * k, e, h, i, edges=True) | {"GLUON_PREFILL": False, "DECODE_V3": False}
    assert cfg["TMA"] and cfg["BK_GATE_UP"] == cfg["BK_DOWN"] == 256
    check(run(tensors, x, ids, rw, 7.0, cfg), x, ids, rw, tensors, 7.0)
