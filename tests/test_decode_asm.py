"""The GPU decode routine's PTX (``_E2M1X8_TO_BF16``) run on the CPU by a small interpreter of
the instructions it uses, against the E2M1 definition: every byte value in every position, a
different block scale per element (E4M3 subnormals and the largest scale included). The GPU
tests run the same PTX on the hardware; this one catches a wrong bit trick or a wrong
scale-register pairing without a GPU."""

import random
import re
import struct

import pytest

from fp4moe_ops import nvfp4

triton_moe = pytest.importorskip("fp4moe_ops.backends.triton_moe")
if triton_moe.triton is None:  # pragma: no cover
    pytest.skip("triton not installed", allow_module_level=True)

MASK32 = 0xFFFFFFFF


def bf16_to_float(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]


def float_to_bf16(x: float) -> int:
    """Round to nearest even, as ``mul.rn.bf16x2`` does (no NaNs here)."""
    u = struct.unpack("<I", struct.pack("<f", x))[0]
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF


def prmt(a: int, b: int, selector: int) -> int:
    """PTX ``prmt.b32`` default mode: output byte i is byte (sel_i & 7) of {b, a}, or that
    byte's sign bit replicated if sel_i & 8."""
    source = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        nib = (selector >> (4 * i)) & 0xF
        byte = source[nib & 7]
        if nib & 8:
            byte = 0xFF if byte & 0x80 else 0x00
        out |= byte << (8 * i)
    return out


def run_ptx(text: str, inputs: dict[str, int]) -> dict[str, int]:
    """Execute the straight-line PTX block: .reg, mov, prmt, and, or, shl, shf.l.wrap, add.u32,
    mul.lo.u32, mul.rn.bf16x2."""
    regs = dict(inputs)

    def val(tok: str) -> int:
        tok = tok.strip()
        return int(tok, 0) & MASK32 if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", tok) else regs[tok]

    for stmt in text.replace("{", ";").replace("}", ";").split(";"):
        stmt = stmt.strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, args = stmt.split(None, 1)
        d, *src = [a.strip() for a in args.split(",")]
        if op == "mov.b32":
            regs[d] = val(src[0])
        elif op == "prmt.b32":
            regs[d] = prmt(val(src[0]), val(src[1]), val(src[2]))
        elif op == "and.b32":
            regs[d] = val(src[0]) & val(src[1])
        elif op == "or.b32":
            regs[d] = val(src[0]) | val(src[1])
        elif op == "shl.b32":
            regs[d] = (val(src[0]) << val(src[1])) & MASK32
        elif op == "shf.l.wrap.b32":  # funnel shift of {b:a}, here a rotate (a == b)
            n = val(src[2]) & 31
            regs[d] = ((val(src[1]) << 32 | val(src[0])) << n >> 32) & MASK32
        elif op == "add.u32":
            regs[d] = (val(src[0]) + val(src[1])) & MASK32
        elif op == "mul.lo.u32":
            regs[d] = (val(src[0]) * val(src[1])) & MASK32
        elif op == "mul.rn.bf16x2":
            a, b = val(src[0]), val(src[1])
            halves = [float_to_bf16(bf16_to_float(a >> s) * bf16_to_float(b >> s)) for s in (0, 16)]
            regs[d] = halves[0] | (halves[1] << 16)
        else:
            raise AssertionError(f"instruction {op} not modelled: extend run_ptx")
    return regs


def e4m3_values() -> list[float]:
    """Every positive finite E4M3 value (subnormals included), from the format's definition."""
    vals = []
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:
                continue  # NaN
            vals.append(m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return vals


def test_decode_ptx_matches_the_e2m1_definition():
    rng = random.Random(0)
    scales = e4m3_values()
    code_value = nvfp4.E2M1_VALUES
    decode = lambda c: (-1.0 if c & 8 else 1.0) * code_value[c & 7]
    checked = 0
    for position in range(4):
        for byte in range(256):
            data = [rng.randrange(256) for _ in range(4)]
            data[position] = byte
            s = [rng.choice(scales) for _ in range(4)]
            s[position] = scales[byte % len(scales)]  # sweeps subnormal and large scales too
            # the kernel passes scale * 2^104 in bf16 (exact: E4M3 has 3 mantissa bits)
            sbits = [float_to_bf16(v * 2.0**104) for v in s]
            regs = run_ptx(triton_moe.kernels._E2M1X8_TO_BF16.value, {
                "$4": sum(b << (8 * i) for i, b in enumerate(data)),
                "$5": sbits[0] | (sbits[1] << 16), "$6": sbits[2] | (sbits[3] << 16),
            })
            lo = [bf16_to_float(regs["$0"]), bf16_to_float(regs["$0"] >> 16),
                  bf16_to_float(regs["$1"]), bf16_to_float(regs["$1"] >> 16)]
            hi = [bf16_to_float(regs["$2"]), bf16_to_float(regs["$2"] >> 16),
                  bf16_to_float(regs["$3"]), bf16_to_float(regs["$3"] >> 16)]
            for i in range(4):  # exact: value * scale * 2^-22 (the 2^22 is folded into the global scale)
                assert lo[i] == decode(data[i] & 0xF) * s[i] * 2.0**-22, (data, i, "low nibble")
                assert hi[i] == decode(data[i] >> 4) * s[i] * 2.0**-22, (data, i, "high nibble")
                checked += 2
    assert checked == 4 * 256 * 8


def test_paired_word_ptx_matches_the_e2m1_definition():
    # One word of the paired layout: rows r and r + 8 of a 16-row group, one 2-byte unit each
    # (codes 0..3: nibbles, low first). Built by paired_weight_layout from canonical bytes; the
    # PTX must give row r's codes 0, 2 / 1, 3 in $0 / $2 and row r+8's in $1 / $3, times each
    # row's scale, for every byte value in every position.
    import torch

    rng = random.Random(1)
    scales = e4m3_values()
    decode = lambda c: (-1.0 if c & 8 else 1.0) * nvfp4.E2M1_VALUES[c & 7]
    checked = 0
    for position in range(4):  # row r byte 0, row r byte 1, row r+8 byte 0, row r+8 byte 1
        for byte in range(256):
            packed = torch.tensor([[rng.randrange(256), rng.randrange(256)] for _ in range(16)], dtype=torch.uint8)
            r = rng.randrange(8)
            packed[r + 8 * (position // 2), position % 2] = byte
            word = int(triton_moe.paired_weight_layout(packed[None])[0, r, 0]) & MASK32
            s = [rng.choice(scales), scales[byte % len(scales)]]  # rows r, r+8
            sbits = [float_to_bf16(v * 2.0**104) for v in s]
            regs = run_ptx(triton_moe.kernels._PAIRED_WORD_TO_BF16.value, {
                "$4": word, "$5": sbits[0] | (sbits[0] << 16), "$6": sbits[1] | (sbits[1] << 16)})
            for reg, row, codes in (("$0", 0, (0, 2)), ("$1", 1, (0, 2)), ("$2", 0, (1, 3)), ("$3", 1, (1, 3))):
                unit = packed[r + 8 * row]
                for half, q in enumerate(codes):
                    code = (int(unit[q // 2]) >> (4 * (q % 2))) & 0xF
                    got = bf16_to_float(regs[reg] >> (16 * half))
                    assert got == decode(code) * s[row] * 2.0**-22, (position, byte, reg, half)
                    checked += 1
    assert checked == 4 * 256 * 8


def test_scale_ptx_matches_the_e4m3_definition():
    # Every E4M3 byte (NaN 0x7F/0xFF excepted; the sign bit is dropped: scales are >= 0, and a
    # -0 byte must stay 0) in every one of the 4 packed positions -> bf16 scale * 2^104, exactly.
    rng = random.Random(2)
    positive = e4m3_values()  # byte b < 0x7F has the value positive[b]
    checked = 0
    for position in range(4):
        for byte in [b for b in range(256) if b & 0x7F != 0x7F]:
            data = [rng.randrange(0x7F) for _ in range(4)]
            data[position] = byte
            regs = run_ptx(triton_moe.kernels._E4M3X4_TO_BF16.value, {"$2": sum(b << (8 * i) for i, b in enumerate(data))})
            got = [bf16_to_float(regs["$0"]), bf16_to_float(regs["$0"] >> 16),
                   bf16_to_float(regs["$1"]), bf16_to_float(regs["$1"] >> 16)]
            for i in range(4):
                assert got[i] == positive[data[i] & 0x7F] * 2.0**104, (data, i)
                checked += 1
    assert checked == 4 * 254 * 4


@pytest.mark.parametrize("per", [16, 32])
def test_decode_v3_e8m0_scales_reach_each_threads_block(per):
    # decode_v3's E8M0 scale PTX (MXFP4) with the selector its _scale_selector builds: thread t of a
    # quad decodes K 16t .. 16t + 15 of a 64-wide chunk, block t of the chunk's 4 bytes of a row (one
    # scale per 16 values, an int32 word) or block t // 2 of its 2 (gpt-oss's E8M0 held once per 32
    # values: an int16, sign-extended to 32 bits, whose upper bytes must never be picked); rows r and
    # r + 8 -> bf16x2 (S, S), S = 2^(byte - 127) * 2^104, every byte the kernels take (0 .. 150)
    decode_v3 = pytest.importorskip("fp4moe_ops.backends.triton_moe.decode_v3")
    rng = random.Random(3)
    blocks = 64 // per
    checked = 0
    for byte in range(151):
        for position in range(2 * blocks):  # (row r's blocks, then row r + 8's)
            data = [rng.randrange(151) for _ in range(2 * blocks)]
            data[position] = byte
            words = []
            for row in range(2):
                value = sum(b << (8 * j) for j, b in enumerate(data[blocks * row:blocks * (row + 1)]))
                if per == 32 and value & 0x8000:  # the int16's sign extension
                    value |= 0xFFFF0000
                words.append(value)
            for t in range(4):
                tb = t if per == 16 else t // 2
                sel = tb | tb << 4 | (4 + tb) << 8 | (4 + tb) << 12
                regs = run_ptx(decode_v3._E8M0X2_TO_BF16X2.value, {"$2": words[0], "$3": words[1], "$4": sel})
                for reg, row in (("$0", 0), ("$1", 1)):
                    want = 2.0 ** (data[blocks * row + tb] - 127 + 104)
                    assert bf16_to_float(regs[reg]) == bf16_to_float(regs[reg] >> 16) == want, (byte, position, t)
                    checked += 1
    assert checked == 151 * 2 * blocks * 4 * 2
