"""The Triton backend's data layouts, in plain torch: the paired packed-weight layout (converted
expert by expert both ways) and the MMA-fragment order of the K axis."""

from __future__ import annotations

import torch

try:  # triton.jit compiles fragment_column / fragment_source and wants triton.language in their globals
    import triton.language as tl  # noqa: F401
except ImportError:  # pragma: no cover - CPU installs without triton
    tl = None

# --- the paired packed-weight layout -----------------------------------------------------------
#
# Where tiles come through TMA, the packed weights are stored as "row-pair words" so that the GPU
# decode needs 1.5 instead of 2.25 instructions per element. The MMA gives each thread rows r and
# r+8 of every 16-row group and, in fragment order, one 2-byte unit (4 codes) of each row per
# 16-wide K step; a word holds exactly those 4 bytes, bits permuted so that each of its four bf16x2
# registers comes out of a mask (_PAIRED_WORD_TO_BF16).

_BF16_CODE_BITS = (6, 7, 8, 15)  # where an E2M1 code's bits m, e0, e1, s go in a bf16 half
# The word's registers in PTX output order: (row of the pair, code in the low half, code in the
# high half), codes 0..3 of a row's 2-byte unit (code q is nibble q, low nibble first).
_WORD_REGISTERS = ((0, 0, 2), (1, 0, 2), (0, 1, 3), (1, 1, 3))
_PRODUCT_SOURCE = {6: 3, 7: 4, 8: 0, 15: 1}  # register 3: ((w & 0x001B001B) * 0x4108), per half


def _register_source_bit(register: int, target: int) -> int:
    """The stored word's bit that the PTX moves to bit ``target`` (0..31) of output ``register``:
    registers 0-2 rotate the word left by 0, 10, 13; register 3 multiplies (see above)."""
    if register == 3:
        return 16 * (target // 16) + _PRODUCT_SOURCE[target % 16]
    return (target - (0, 10, 13)[register]) % 32


def _plain_to_stored_bits() -> list[int]:
    """``dest[b]``: where bit ``b`` of a plain word (bytes: row r's unit, row r+8's unit; bit
    ``16*row + 4*code + i``) goes in the stored word. A permutation of 0..31."""
    dest = [0] * 32
    for register, (row, *codes) in enumerate(_WORD_REGISTERS):
        for half, code in enumerate(codes):
            for i, target in enumerate(_BF16_CODE_BITS):
                dest[16 * row + 4 * code + i] = _register_source_bit(register, 16 * half + target)
    assert sorted(dest) == list(range(32))
    return dest


def _permute_word_bits(words: torch.Tensor, dest: list[int]) -> torch.Tensor:
    """``words [..., 4]`` uint8 (little-endian 32-bit words) -> int32 ``[...]`` with bit ``b``
    moved to ``dest[b]``, by one 256-entry table per byte."""
    v = torch.arange(256, device=words.device)
    out = torch.zeros(words.shape[:-1], dtype=torch.int64, device=words.device)
    for byte in range(4):
        table = sum(((v >> j) & 1) << dest[8 * byte + j] for j in range(8))
        out |= table[words[..., byte].long()]
    return (out - ((out >> 31) << 32)).to(torch.int32)  # two's complement view of the 32 bits


def paired_weight_layout(packed: torch.Tensor) -> torch.Tensor:
    """Canonical NVFP4 weights ``[N, K/2]`` uint8 (or a stack ``[E, N, K/2]``, converted expert by
    expert) -> the Triton backend's ``[N/2, K/4]`` int32: row ``p`` holds rows ``16(p//8) + p%8``
    and that + 8, word ``u`` their 2-byte units ``u`` (row r's first), bits permuted for the GPU
    decode. N multiple of 16."""
    if packed.dim() == 3:
        return torch.stack([paired_weight_layout(p) for p in packed])
    n, k_half = packed.shape
    if n % 16 or k_half % 2:
        raise ValueError(f"paired layout needs N % 16 == 0 and K % 4 == 0, got {list(packed.shape)}")
    units = packed.reshape(n // 16, 2, 8, k_half // 2, 2).permute(0, 2, 3, 1, 4)
    return _permute_word_bits(units.reshape(n // 2, k_half // 2, 4), _plain_to_stored_bits())


def canonical_from_paired(words: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`paired_weight_layout`: ``[N/2, K/4]`` int32 (or ``[E, N/2, K/4]``, expert
    by expert) -> ``[N, K/2]`` uint8."""
    if words.dim() == 3:
        return torch.stack([canonical_from_paired(w) for w in words])
    half_n, quarter_k = words.shape
    dest = _plain_to_stored_bits()
    inverse = [dest.index(b) for b in range(32)]
    plain = _permute_word_bits(words.contiguous().view(torch.uint8).reshape(half_n, quarter_k, 4), inverse)
    units = plain.view(torch.uint8).reshape(half_n // 8, 8, quarter_k, 2, 2).permute(0, 3, 1, 2, 4)
    return units.reshape(2 * half_n, 2 * quarter_k).contiguous()


def fits_tma(hidden: int, inter: int) -> bool:
    """TMA boxes need BK >= 256 (a box row of scales >= 16 bytes, every row 16-byte aligned),
    i.e. H and I multiples of 256, as in every DeepSeek/Qwen/Mixtral shape."""
    return hidden % 256 == 0 and inter % 256 == 0


# --- MMA-fragment order of the K axis ----------------------------------------------------------
#
# Within each ``chunk``-wide piece of K, column ``16j + 8s + 2t + e`` holds natural index
# ``(chunk/4)t + 4j + 2e + s`` (t < 4, j < chunk/16, e, s < 2): the order in which the kernels lay
# out decoded weight columns (see kernels._decode_tile_fragment_order). The two functions below
# are that permutation and its inverse as plain index arithmetic, so the same code runs on ints
# and torch tensors here and, compiled with triton.jit, inside the kernels.


def fragment_column(k, chunk):
    """The column that natural index ``k`` moves to."""
    kp = k % chunk
    return k - kp + 16 * ((kp % (chunk // 4)) // 4) + 8 * (kp % 2) + 2 * (kp // (chunk // 4)) + (kp // 2) % 2


def fragment_source(c, chunk):
    """The natural index that column ``c`` holds (inverse of :func:`fragment_column`)."""
    cp = c % chunk
    return c - cp + (chunk // 4) * ((cp // 2) % 4) + 4 * (cp // 16) + 2 * (cp % 2) + (cp // 8) % 2


def fragment_order(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """``x [..., K]`` with each ``chunk``-wide piece of K in fragment order (a copy)."""
    return x[..., fragment_source(torch.arange(x.shape[-1], device=x.device), chunk)]
