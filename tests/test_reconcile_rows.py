"""Reconciling global scales (gate and up of an expert, or the linears vLLM fuses into one GEMM) moves
block scales onto a larger global scale and re-rounds them to E4M3; a ratio far below 1 flushes small
ones to zero. :func:`fp4moe_ops.moe_weights.rescale_block_scales` counts the rows that changed and
the rows zeroed, which the loader's warning names."""

import torch

from fp4moe_ops.moe_weights import rescale_block_scales

E4M3_HALF_SMALLEST = 2.0**-10  # half E4M3's smallest subnormal (2^-9): a product at or below it rounds to 0 (ties to even)


def test_rows_changed_and_zeroed_are_counted():
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**30, ())))
    # [2 experts, 16 rows, 4 blocks]: block scales 2^-2 .. 2^6, rows 0-3 of expert 0 all small
    values = torch.exp2(torch.randint(-2, 7, (2, 16, 4), generator=g).double())
    values[0, :4] = 0.25
    values[1, 5, 2] = 0.0  # a zero block stays zero and does not count as zeroed
    block = values.to(torch.float8_e4m3fn)
    ratio = torch.tensor([2.0**-9, 1.0], dtype=torch.float64)[:, None, None]  # expert 1 unchanged
    rescaled, changed, zeroed = rescale_block_scales(block, ratio.float())
    exact = values * ratio  # powers of two: exact in float64 and, unless flushed, in E4M3
    flushed = (exact <= E4M3_HALF_SMALLEST) & (values > 0)
    want_zeroed = int(((values > 0).any(-1) & ((exact <= E4M3_HALF_SMALLEST) | (values == 0)).all(-1)).sum())
    assert changed == 16 and zeroed == want_zeroed >= 4  # every row of expert 0 moved, rows 0-3 lost
    assert torch.equal(rescaled.double() == 0, flushed | (values == 0))
    assert torch.equal(rescaled[1].view(torch.uint8), block[1].view(torch.uint8))
