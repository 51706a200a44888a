"""benchmarks/accuracy_w4a8.py's W4A8 emulation against a float64 computation written here from the
formats (E4M3 rounding by torch's own float32 -> float8_e4m3fn cast, which rounds to nearest even:
independent of the W4A8 probe's integer-free oracle that the script reuses), its MXFP4 fold, its
W4A16 path against fp4moe's own CPU forward, and the script on one genuine export. CPU, a few seconds."""

import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import accuracy_w4a8 as acc  # noqa: E402

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                    dtype=torch.float64)


def e2m1(packed: torch.Tensor) -> torch.Tensor:
    """``[N, K/2]`` bytes, low nibble first -> ``[N, K]`` float64 (a table lookup)."""
    p = packed.long()
    return E2M1[torch.stack((p & 15, p >> 4), -1).flatten(-2)]


def to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """float32 values (exact where given) to E4M3, to nearest even, saturating, back as float64."""
    return v.float().clamp(-448, 448).to(torch.float8_e4m3fn).double()


def row_shift(largest: torch.Tensor) -> torch.Tensor:
    """Per row, the largest integer ``k`` with ``6 * largest * 2^k <= 448``, by search."""
    ks = torch.arange(-60, 61, dtype=torch.float64)
    fits = 6 * largest.double()[:, None] * torch.pow(2.0, ks)[None] <= 448
    return ks[fits.long().cumsum(-1).argmax(-1)]  # (the last k that fits: fits is a prefix)


def w4a8_weight(packed, scale, g):
    """NVFP4 -> ``(w8, r)``: ``w8 = E4M3(e2m1 * s_b * 2^k)`` (the product exact in float32), ``r = g 2^-k``."""
    s = scale.float().double()
    k = row_shift(s.amax(-1))
    return to_e4m3(e2m1(packed) * (s * torch.pow(2.0, k)[:, None]).repeat_interleave(16, -1)), g * torch.pow(2.0, -k)


def w4a8_gemm(x, packed, scale, g):
    """``x [n, K]`` 16-bit per token to E4M3 (``a = max|x|``, ``x * fl32(448/a)``, scale ``fl32(a/448)``)
    times the W4A8 weight: ``[n, N]`` float64."""
    x32 = x.float()
    a = x32.abs().amax(-1).clamp(min=2.0**-100)
    x8, sx = to_e4m3(x32 * (448 / a)[:, None]), (a / 448).double()
    w8, r = w4a8_weight(packed, scale, g)
    return (x8 @ w8.T) * sx[:, None] * r[None, :]


def random_nvfp4(n: int, k: int, gen: torch.Generator):
    """Random bytes; block scales spread over ~14 binades below each row's top (so some products
    become E4M3 subnormals or zero after the fold); a global scale that is not a power of two."""
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    top = torch.randint(0, 8, (n, 1), generator=gen).float()
    spread, mantissa = torch.rand(n, k // 16, generator=gen), torch.rand(n, k // 16, generator=gen)
    scale = torch.pow(2.0, top - 14 * spread) * (1 + mantissa)
    return packed, scale.clamp(2.0**-9, 448).to(torch.float8_e4m3fn), float(0.013 * (1 + torch.rand((), generator=gen)))


def test_the_w4a8_experts_equal_an_independent_float64_computation():
    gen = torch.Generator().manual_seed(7)
    e, h, i, t, top_k = 3, 64, 32, 24, 2
    experts = [(random_nvfp4(2 * i, h, gen), random_nvfp4(h, i, gen)) for _ in range(e)]
    x = (torch.randn(t, h, generator=gen) * torch.pow(2.0, torch.randint(-6, 6, (t, 1), generator=gen))).bfloat16()
    x[3, 5] = 200.0  # a token with one outlier: the rest of it goes to coarse E4M3 steps and subnormals
    ids = torch.stack([torch.randperm(e, generator=gen)[:top_k] for _ in range(t)])
    rw = torch.softmax(torch.randn(t, top_k, generator=gen), -1)

    want = torch.zeros(t, h, dtype=torch.float64)
    for tok in range(t):
        for j in range(top_k):
            (gu, dn) = experts[int(ids[tok, j])]
            hh = w4a8_gemm(x[tok:tok + 1], *gu)
            act = (F.silu(hh[:, :i]) * hh[:, i:]).bfloat16()  # the intermediate as the kernels store it
            want[tok] += float(rw[tok, j]) * w4a8_gemm(act, *dn)[0]

    gate_up = [acc.Weight(*gu) for gu, _ in experts]
    down = [acc.Weight(*dn) for _, dn in experts]
    got = acc.emulated_moe(x, ids, rw, gate_up, down, "w4a8")
    assert got.dtype == torch.bfloat16
    # the same products summed in float64 in another order: equal up to the final bf16 rounding
    torch.testing.assert_close(got.double(), want.bfloat16().double(), rtol=2**-8, atol=1e-6 * want.abs().max().item())
    assert (got == want.bfloat16()).float().mean() > 0.98
    # and W4A8 is not W4A16: the roundings are there (E4M3's 3-bit significand: a few percent)
    w4a16 = acc.emulated_moe(x, ids, rw, gate_up, down, "w4a16").double()
    assert 5e-3 < ((got.double() - w4a16).norm() / w4a16.norm()).item() < 0.2
    # each half of the W4A8 rounding alone moves it too
    for half in ("w4a8_weights", "w4a8_acts"):
        alone = acc.emulated_moe(x, ids, rw, gate_up, down, half).double()
        assert 1e-3 < ((alone - w4a16).norm() / w4a16.norm()).item()


def test_the_mxfp4_fold_is_exact_within_2_to_13_of_a_rows_top_and_rounds_once_below():
    gen = torch.Generator().manual_seed(3)
    n, k = 8, 128
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    e8m0 = (127 + torch.randint(-12, 1, (n, k // 32), generator=gen)).to(torch.uint8)  # within 2^12 of the top
    w8, r = acc.mxfp4_decode_w4a8_64(packed, e8m0)
    exact = e2m1(packed) * torch.pow(2.0, e8m0.double() - 127).repeat_interleave(32, -1)
    assert torch.equal(w8 * r[:, None], exact)
    assert bool(((w8.abs().amax(-1) > 224) | (w8.abs().amax(-1) == 0)).all()) and bool((w8.abs() <= 448).all())
    e8m0[0, 1] = 127 - 20  # a block 2^20 below its row's top: its products fall under E4M3's subnormals
    e8m0[0, 0] = 127
    w8, r = acc.mxfp4_decode_w4a8_64(packed, e8m0)
    shift = 6 - (e8m0.double() - 127).amax(-1)
    independent = to_e4m3(e2m1(packed) * torch.pow(2.0, e8m0.double() - 127 + shift[:, None]).repeat_interleave(32, -1))
    assert torch.equal(w8, independent)
    exact = e2m1(packed) * torch.pow(2.0, e8m0.double() - 127).repeat_interleave(32, -1)
    assert not torch.equal(w8 * r[:, None], exact)


LLAMA4 = [c for c in acc.CASES if c[0] == "modelopt/llama4_text_nvfp4_mlp_only"][0]


def test_the_w4a16_emulation_is_fp4moes_own_forward_and_the_patch_comes_off():
    model, ids, want, _ = acc.load_case(LLAMA4[1], LLAMA4[2])
    with torch.no_grad():
        native = model(ids).logits
        with acc.emulate(model, "w4a16"):
            emulated = model(ids).logits
        with acc.emulate(model, "w4a8"):
            w4a8 = model(ids).logits
        again = model(ids).logits
    # float64 against fp4moe's float32 on the same exact weights: the same bf16 logits here, but another
    # CPU's BLAS may round a float32 sum the other way, so a bf16 ulp (2^-8) bounds it, 2.5x under
    # W4A8's own distance below
    assert acc.per_token_error(emulated, native).max() < 2**-8
    assert torch.equal(again, native)  # (the same computation twice in one process)
    assert acc.per_token_error(w4a8, native).median() > 1e-2


def test_the_script_runs_on_one_export(capsys):
    assert acc.main(["--cases", "llama4_text_nvfp4_mlp_only", "--no-synthetic"]) == 0
    out = capsys.readouterr().out
    row = [line for line in out.splitlines() if line.startswith("| modelopt/llama4_text_nvfp4_mlp_only | routed")][0]
    w4a16, w4a8, nvfp4_act = (float(v) for v in re.findall(r"([\d.]+)%", row)[:3])
    assert 0 < w4a16 < 2 < w4a8 < nvfp4_act < 50, row  # W4A16 ~ arithmetic only; the activations' rounding above
    assert "| yes |" in row


def test_nvfp4_activations_are_refused_where_the_export_has_no_input_scales():
    folder = acc.FIXTURES / "llmcompressor" / "qwen3_moe_mxfp4a16"
    model, _, _, _ = acc.load_case(folder, folder / "reference_logits.safetensors")
    with pytest.raises(LookupError, match="no input scale"):
        with acc.emulate(model, "nvfp4_act"):
            pass
