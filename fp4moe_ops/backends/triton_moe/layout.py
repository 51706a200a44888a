"""The Triton backend's data layouts, in plain torch: the paired packed-weight layout (converted
expert by expert both ways), the MMA-fragment order of the K axis, and gpt-oss's experts (MXFP4 or
NVFP4) in the kernels' layout."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ...mxfp4 import interleave_gate_up, to_gpt_oss_blocks

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


def fits_tma_edges(hidden: int, inter: int) -> bool:
    """Whether the kernels run H and I as they are in gpt-oss's kernel layout, the last K step
    partial (TMA fills what lies past K with zeros): multiples of 64, the K chunk of the Gluon
    kernels' views and the narrowest weight tile (gpt-oss's 2880 = 45 x 64)."""
    return hidden % KERNEL_MULTIPLE == 0 and inter % KERNEL_MULTIPLE == 0


KERNEL_MULTIPLE = 64  # see fits_tma_edges


def scale_columns(k: int, values_per_byte: int = 16) -> int:
    """Bytes per row of block scales over K = ``k`` as the kernels hold them: whole 256-value steps,
    16 bytes of E4M3 scales (one per 16 values; gpt-oss's 2880 values: 180 bytes, held as 192), or
    with ``values_per_byte`` 32 (gpt-oss's E8M0, one per 32) 8 bytes, rows held in pairs
    (:func:`pair_scale_rows`: 16 bytes a step again; 2880: 90 bytes, held as 96)."""
    return -(-k // 256) * (256 // values_per_byte)


def pair_scale_rows(scales: torch.Tensor) -> torch.Tensor:
    """Scales one per 32 values ``[E, N, S*8]`` (8 bytes a 256-value step; N even) -> the same shape
    with the bytes of rows 2p and 2p + 1 interleaved step by step (a copy): viewed ``[E, N/2, S, 2,
    8]``, entry ``[e, p, s, r]`` is row ``2p + r``'s 8 bytes of step s. Why: TMA copies whole 16-byte
    units (box rows and their starts), so a step's 8 bytes a row come in one unit with the other
    row's, each byte once, not in a window of two steps to pick from."""
    experts, n, cols = scales.shape
    return scales.reshape(experts, n // 2, 2, cols // 8, 8).transpose(2, 3).reshape(experts, n, cols).contiguous()


def unpair_scale_rows(paired: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pair_scale_rows`."""
    experts, n, cols = paired.shape
    return paired.reshape(experts, n // 2, cols // 8, 2, 8).transpose(2, 3).reshape(experts, n, cols).contiguous()


def values_per_scale(block_scale: torch.Tensor, gpt_oss: bool) -> int:
    """K values per block-scale byte in the kernels' tensors: 32 for gpt-oss's MXFP4 experts in
    :func:`gpt_oss_kernel_tensors` (E8M0, int8, held once per block), 16 otherwise (E4M3, and the
    MXFP4 experts of ``fp4moe::fused_moe``, whose E8M0 bytes come written once per 16 values)."""
    return 32 if gpt_oss and block_scale.dtype == torch.int8 else 16


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
    """``x [..., K]`` with each whole ``chunk``-wide piece of K in fragment order (a copy); a partial
    last piece (K not a multiple of ``chunk``) stays in natural order."""
    k = x.shape[-1]
    c = torch.arange(k, device=x.device)
    return x[..., torch.where(c < k - k % chunk, fragment_source(c, chunk), c)]


# --- gpt-oss's experts in the kernels' layout ------------------------------------------------------
#
# The kernels read NVFP4-shaped tensors: rows [gate; up], block-scale rows along K, the paired
# weight words. gpt-oss's experts (rows interleaving gate and up, H = I = 2880) are moved into that
# shape without changing a value: the same E2M1 codes and scale bytes, and float32 biases. H and I
# stay as they are where they are multiples of 64 (fits_tma_edges; gpt-oss's are): the kernels
# mask the last, partial K step and tile N by divisors. Otherwise (small test shapes) they are
# zero-padded to the next multiple of 64 (zero codes, scales and biases: a padded row of gate/up
# yields h = 0), and the activations are padded per call. Scale rows are held in whole 16-byte TMA
# rows (scale_columns), zeros past K. MXFP4 (fp4moe_ops.mxfp4) keeps its one E8M0 byte per 32
# values, each held once as in the checkpoint (values_per_scale: the kernels read a scale per 32
# values there, per 16 for E4M3), rows in pairs (pair_scale_rows: a step's 16-byte TMA unit holds
# two rows' 8 bytes), as int8, which is how the kernels tell E8M0 from E4M3 (uint8);
# 2^-127 .. 2^23 decode exactly on the GPU, larger scales and NaN (0xFF) are refused. NVFP4 keeps
# its E4M3 bytes (one per 16 values) and per-expert global scales.

GPT_OSS_MAX_SCALE_BYTE = 127 + 23  # E8M0 byte of 2^23: the largest the kernels decode exactly


class GptOssTerms(NamedTuple):
    """What gpt-oss's experts add to the kernels' math: ``gate_up_bias [E, 2Ip]`` float32 (gate's, then
    up's) before the clamped SwiGLU of ``swiglu_alpha`` and ``limit`` (the gate_up GEMM's epilogue),
    ``down_bias [E, Hp]`` float32 times the routing weight (the top-k sum)."""

    gate_up_bias: torch.Tensor
    down_bias: torch.Tensor
    swiglu_alpha: float
    limit: float

    def gate_up_args(self) -> dict:
        """A gate_up GEMM kernel's keyword arguments for this activation."""
        return dict(gate_up_bias_ptr=self.gate_up_bias, swiglu_alpha=float(self.swiglu_alpha), limit=float(self.limit),
                    GPT_OSS=True)


def _pad_to(n: int, multiple: int = KERNEL_MULTIPLE) -> int:
    return -(-n // multiple) * multiple


def _padded(packed: torch.Tensor, scales: torch.Tensor, rows: int, cols: int, values_per_byte: int = 16):
    """``packed [E, N, K/2]`` uint8 and ``scales [E, N, K/values_per_byte]`` -> the same zero-padded
    to ``[E, rows, cols/2]`` and ``[E, rows, scale_columns(cols, values_per_byte)]`` (N <= rows, K <= cols)."""
    experts, n, k_half = packed.shape
    out = torch.zeros(experts, rows, cols // 2, dtype=torch.uint8, device=packed.device)
    out[:, :n, :k_half] = packed
    held = torch.zeros(experts, rows, scale_columns(cols, values_per_byte), dtype=torch.uint8, device=packed.device)
    held[:, :n, :scales.shape[2]] = scales.view(torch.uint8)
    return out, held


def _mxfp4_kernel_matrix(name: str, blocks: torch.Tensor, scales: torch.Tensor, rows: int, cols: int):
    """gpt-oss ``blocks [E, N, K/32, 16]`` / ``scales [E, N, K/32]`` -> canonical packed ``[E, rows,
    cols/2]`` uint8 and int8 scales ``[E, rows, scale_columns(cols, 32)]`` (each byte once, rows in
    pairs: :func:`pair_scale_rows`), zero-padded (N <= rows, K <= cols)."""
    bad = scales.gt(GPT_OSS_MAX_SCALE_BYTE)
    if bool(bad.any()):
        e, n, b = bad.nonzero()[0].tolist()
        byte = int(scales[e, n, b])
        raise ValueError(f"{name}_scales[{e}, {n}, {b}] is E8M0 byte {byte} ({'NaN' if byte == 255 else f'2^{byte - 127}'}):"
                         f" the Triton kernels decode scales up to 2^{GPT_OSS_MAX_SCALE_BYTE - 127}; the reference "
                         "backend runs these experts")
    packed, held = _padded(blocks.flatten(-2), scales, rows, cols, 32)
    return packed, pair_scale_rows(held).view(torch.int8)


def gpt_oss_kernel_tensors(expert_tensors: list[torch.Tensor], multiple: int = KERNEL_MULTIPLE) -> list[torch.Tensor]:
    """gpt-oss's experts as ``fp4moe::gpt_oss_moe`` takes them -> the Triton backend's layout (Hp, Ip:
    H, I rounded up to multiples of ``multiple``, 64: H and I themselves for gpt-oss's 2880; the
    gate_up rows of packed weights, scales and bias: gate's, then up's):

    * MXFP4, the six checkpoint tensors (:data:`fp4moe_ops.mxfp4.MXFP4_EXPERT_TENSORS`) -> ``[gate_up
      [E, Ip, Hp/4] int32 (paired), gate_up_scale [E, 2Ip, Hs] int8 (E8M0, one byte per 32 values),
      gate_up_bias [E, 2Ip] float32, down [E, Hp/2, Ip/4] int32, down_scale [E, Hp, Is] int8,
      down_bias [E, Hp] float32]``, Hs, Is: ``scale_columns(Hp, 32)``, ``scale_columns(Ip, 32)`` (96
      for 2880), rows in pairs (:func:`pair_scale_rows`; gate's rows, then up's); ValueError naming
      the tensor for a scale the kernels cannot decode exactly;
    * NVFP4, the eight tensors ``[gate_up, gate_up_scale, gate_up_global_scale, gate_up_bias, down,
      down_scale, down_global_scale, down_bias]`` -> the same with uint8 (E4M3, one per 16 values)
      scales, Hs, Is: ``scale_columns(Hp)``, ``scale_columns(Ip)`` (192 for 2880), and the float32
      global scales ``[E]`` after each scale: ``[gate_up, gate_up_scale, gate_up_global_scale,
      gate_up_bias, down, down_scale, down_global_scale, down_bias]``.

    ``multiple`` 256 gives the earlier, padded layout (3072 for gpt-oss; benchmarks compare it)."""
    if multiple % KERNEL_MULTIPLE:
        raise ValueError(f"multiple must be a multiple of {KERNEL_MULTIPLE}, got {multiple}")
    if len(expert_tensors) == 8:
        gate_up, gate_up_scale, gate_up_global_scale, gate_up_bias, down, down_scale, down_global_scale, down_bias = \
            expert_tensors
        inter, hidden = gate_up.shape[1] // 2, gate_up.shape[2] * 2
        hp, ip = _pad_to(hidden, multiple), _pad_to(inter, multiple)
        gate, up = (_padded(gate_up[:, half::2], gate_up_scale[:, half::2], ip, hp) for half in (0, 1))
        down_k, down_scale_k = _padded(down, down_scale, hp, ip)
        gate_up_bias_k, down_bias_k = gpt_oss_kernel_biases(gate_up_bias, down_bias, ip, hp)
        return [paired_weight_layout(torch.cat([gate[0], up[0]], dim=1)), torch.cat([gate[1], up[1]], dim=1),
                gate_up_global_scale.float().contiguous(), gate_up_bias_k, paired_weight_layout(down_k), down_scale_k,
                down_global_scale.float().contiguous(), down_bias_k]
    gate_up_blocks, gate_up_scales, gate_up_bias, down_blocks, down_scales, down_bias = expert_tensors
    experts, two_i, h_blocks = gate_up_scales.shape
    inter, hidden = two_i // 2, h_blocks * 32
    hp, ip = _pad_to(hidden, multiple), _pad_to(inter, multiple)
    gate, up = (_mxfp4_kernel_matrix("gate_up_proj", gate_up_blocks[:, half::2], gate_up_scales[:, half::2], ip, hp)
                for half in (0, 1))  # gate (even rows), up (odd rows)
    down_k, down_scale_k = _mxfp4_kernel_matrix("down_proj", down_blocks, down_scales, hp, ip)
    gate_up_bias_k, down_bias_k = gpt_oss_kernel_biases(gate_up_bias, down_bias, ip, hp)
    return [paired_weight_layout(torch.cat([gate[0], up[0]], dim=1)), torch.cat([gate[1], up[1]], dim=1),
            gate_up_bias_k, paired_weight_layout(down_k), down_scale_k, down_bias_k]


def gpt_oss_kernel_biases(gate_up_bias: torch.Tensor, down_bias: torch.Tensor, ip: int, hp: int):
    """gpt-oss's ``gate_up_proj_bias [E, 2I]`` (interleaved) and ``down_proj_bias [E, H]`` -> the kernels'
    float32 ``[E, 2Ip]`` (gate's, then up's) and ``[E, Hp]``, zero-padded where Ip > I, Hp > H."""
    experts, inter, hidden = gate_up_bias.shape[0], gate_up_bias.shape[1] // 2, down_bias.shape[1]
    gate_up_k = torch.zeros(experts, 2 * ip, dtype=torch.float32, device=gate_up_bias.device)
    gate_up_k[:, :inter], gate_up_k[:, ip:ip + inter] = gate_up_bias[:, 0::2], gate_up_bias[:, 1::2]
    down_k = torch.zeros(experts, hp, dtype=torch.float32, device=down_bias.device)
    down_k[:, :hidden] = down_bias
    return gate_up_k, down_k


def gpt_oss_checkpoint_tensors(kernel_tensors: list[torch.Tensor], hidden: int, inter: int,
                               bias_dtype: torch.dtype) -> list[torch.Tensor]:
    """Inverse of :func:`gpt_oss_kernel_tensors`: gpt-oss's tensors as ``fp4moe::gpt_oss_moe`` takes
    them (six MXFP4 or eight NVFP4, as given) for hidden size ``hidden`` and intermediate size
    ``inter``, biases in ``bias_dtype`` (exact when they came from it)."""
    nvfp4 = len(kernel_tensors) == 8
    if nvfp4:
        gate_up_k, gate_up_scale_k, gate_up_global_scale, gate_up_bias_k, down_k, down_scale_k, down_global_scale, \
            down_bias_k = kernel_tensors
    else:
        gate_up_k, gate_up_scale_k, gate_up_bias_k, down_k, down_scale_k, down_bias_k = kernel_tensors
    ip = gate_up_scale_k.shape[1] // 2
    per = 16 if nvfp4 else 32  # values per scale byte, held and in the result
    if not nvfp4:
        gate_up_scale_k, down_scale_k = unpair_scale_rows(gate_up_scale_k), unpair_scale_rows(down_scale_k)
    gate_up_scale_bytes = gate_up_scale_k.view(torch.uint8)
    gate_up_packed = canonical_from_paired(gate_up_k)
    gate_up = interleave_gate_up(gate_up_packed[:, :inter, :hidden // 2], gate_up_packed[:, ip:ip + inter, :hidden // 2])
    gate_up_scales = interleave_gate_up(gate_up_scale_bytes[:, :inter, :hidden // per],
                                        gate_up_scale_bytes[:, ip:ip + inter, :hidden // per])
    gate_up_bias = interleave_gate_up(gate_up_bias_k[:, :inter], gate_up_bias_k[:, ip:ip + inter], dim=-1).to(bias_dtype)
    down = canonical_from_paired(down_k)[:, :hidden, :inter // 2].contiguous()
    down_scales = down_scale_k.view(torch.uint8)[:, :hidden, :inter // per].contiguous()
    down_bias = down_bias_k[:, :hidden].to(bias_dtype)
    if nvfp4:
        return [gate_up.contiguous(), gate_up_scales.contiguous(), gate_up_global_scale, gate_up_bias, down, down_scales,
                down_global_scale, down_bias]
    return [to_gpt_oss_blocks(gate_up).contiguous(), gate_up_scales.contiguous(), gate_up_bias,
            to_gpt_oss_blocks(down), down_scales, down_bias]
