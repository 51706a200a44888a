"""Count the SASS instructions in the K loop of the decode kernels, without a GPU: compile for
sm90 with Triton's bundled ptxas, disassemble with its cuobjdump, histogram each backward-branch
loop. This is how the decode's instruction budget in NOTES.md was measured (Triton 3.6 matches the
GPU machine: ``pip install --target /tmp/t36 triton==3.6.0`` and ``PYTHONPATH=/tmp/t36``).

    python benchmarks/probes/sass_count.py                       # current decode config (paired weights)
    python benchmarks/probes/sass_count.py --canonical           # fragment order over canonical weights
    python benchmarks/probes/sass_count.py --no-fragment-order   # the natural-K-order decode
    python benchmarks/probes/sass_count.py --tokens 2048 --gate-up --set PIPELINED_GATE_UP=0   # wgmma serialized
"""

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
from fp4moe_ops.backends.triton_moe import kernels, launch  # noqa: E402

TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def loop_histograms(kernel, signature: dict, constants: dict, num_warps: int, num_stages: int, maxnreg: int = 0,
                    source=ASTSource):
    """Compile ``kernel`` for sm90 and return (registers, ptxas notes, wgmma waits, [(instructions,
    Counter)] per loop, shared memory bytes). The waits are the SASS ``WARPGROUP.DEPBAR.LE gsb0, N``
    by N: after every wgmma with N = 0 when ptxas serialized them. ``source``: ASTSource, or Gluon's
    GluonASTSource for a ``gluon.jit`` kernel."""
    names = list(kernel.arg_names)
    # what the JIT would specialize at run time: pointers and sizes divisible by 16
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in signature.items()
             if (t.startswith("*") or t == "i32") and n != "TOPK"}
    options = {"num_warps": num_warps, "num_stages": num_stages} | ({"maxnreg": maxnreg} if maxnreg else {})
    compiled = triton.compile(source(kernel, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                              options=options)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        Path(cubin).write_bytes(compiled.asm["cubin"])
        ptx = os.path.join(tmp, "k.ptx")
        Path(ptx).write_text(compiled.asm["ptx"])
        notes = subprocess.run([str(TOOLS / "ptxas"), "-arch=sm_90a", "-v", ptx, "-o", os.path.join(tmp, "p.cubin")],
                               capture_output=True, text=True).stderr
        sass = subprocess.run([str(TOOLS / "cuobjdump"), "-sass", cubin], capture_output=True, text=True).stdout
        usage = subprocess.run([str(TOOLS / "cuobjdump"), "-res-usage", cubin], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    instrs = [(int(a, 16), op.strip()) for a, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s*(.*?);", sass)]
    loops = []
    for addr, op in instrs:
        target = re.search(r"BRA\s+0x([0-9a-f]+)", op)
        if target and int(target.group(1), 16) < addr:
            body = [o for a, o in instrs if int(target.group(1), 16) <= a <= addr]
            if len(body) > 50:  # skip barrier spin loops
                loops.append((len(body), collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", o).split()[0] for o in body)))
    waits = collections.Counter(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)", sass))
    serialized = [line.split(") ")[-1][:150] for line in notes.splitlines() if "C751" in line]
    return int(regs.group(1)) if regs else None, serialized, dict(waits), loops, compiled.metadata.shared


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-fragment-order", action="store_true")
    ap.add_argument("--canonical", action="store_true", help="canonical instead of paired weights")
    ap.add_argument("--gate-up", action="store_true", help="the gate_up GEMM loop instead of the down GEMM")
    ap.add_argument("--top", type=int, default=12, help="how many instruction kinds to list")
    ap.add_argument("--tokens", type=int, default=8, help="picks the bucket (8: decode, 2048: prefill)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=INT", help="config overrides, e.g. BM=128")
    args = ap.parse_args()
    cfg = launch.kernel_config(args.tokens * 8, 256, 7168, 2048)
    cfg |= {k: int(v) for k, v in (kv.split("=") for kv in args.set)}
    if args.no_fragment_order:
        cfg["FRAGMENT_ORDER"] = False
    paired = cfg["FRAGMENT_ORDER"] and not args.canonical
    merged = args.gate_up and bool(cfg.get("MERGED_GATE_UP"))
    bn, bk = (cfg["BN_GATE_UP"], cfg["BK_GATE_UP"]) if args.gate_up else (cfg["BN_DOWN"], cfg["BK_DOWN"])
    if merged:  # 4-D boxes over [E, 2, I, *] (launch._gate_up_descriptors)
        w_box = f"[1, 2, {bn // 4}, {bk}]" if paired else f"[1, 2, {bn // 2}, {bk // 2}]"
        desc = {"w_desc": f"tensordesc<u8{w_box}>", "s_desc": f"tensordesc<u8[1, 2, {bn // 2}, {bk // 16}]>"}
    else:
        w_box = f"[{bn // 2}, {bk}]" if paired else f"[{bn}, {bk // 2}]"
        desc = {"w_desc": f"tensordesc<u8{w_box}>",
                "s_desc": f"tensordesc<u8[{bn}, {bk // 16}]>" if bk >= 256 else "*u8"}
    routing = {n: "*i32" for n in ("sorted_slot_ptr", "block_expert_ptr", "block_row_start_ptr", "block_row_end_ptr")}
    if args.tokens == 1:  # the flat top-k ids (int64 from a torch router)
        routing["block_expert_ptr"] = "*i64"
    constants = dict(BM=cfg["BM"], BN=bn, BK=bk, PREFETCH=cfg["PREFETCH"], FAST_DECODE=True, INTERPRET=False,
                     TMA=cfg["TMA"], FRAGMENT_ORDER=cfg["FRAGMENT_ORDER"], PAIRED=paired,
                     FAST_SCALES=bool(cfg.get("FAST_SCALES", 1)), H=7168, I=2048,
                     PIPELINED_MMA=bool(cfg["PIPELINED_GATE_UP" if args.gate_up else "PIPELINED_DOWN"]),
                     PDL=bool(cfg.get("PDL")), DIAG=int(cfg.get("DIAG", 0)),
                     SLOT_BLOCKS=args.tokens == 1, E=256,  # (one token: the GEMMs read the ids themselves)
                     SCALE_BLOCK=16)  # (NVFP4's E4M3 scales, one per 16 values)
    common = {"w_ptr": "*u8", "s_ptr": "*u8", "g_ptr": "*fp32", **routing, "K_RUNTIME": "i32"}
    if args.gate_up:
        constants |= dict(OUT_CHUNK=cfg["BK_DOWN"], MERGED_GATE_UP=merged, GPT_OSS=False, gate_up_bias_ptr=None)  # (SiLU: NVFP4's)
        kernel, sig = kernels._gate_up_swiglu_kernel, {"x_ptr": "*bf16", **common, "out_ptr": "*fp32", "TOPK": "i32",
                                                     "swiglu_alpha": "fp32", "limit": "fp32"}
    else:
        kernel, sig = kernels._down_kernel, {"a_ptr": "*bf16", **common, "topk_weights_ptr": "*fp32",
                                              "out_ptr": "*fp32"}
    sig = {n: sig[n] for n in kernel.arg_names if n in sig} | desc | {k: "constexpr" for k in constants}
    regs, serialized, waits, loops, smem = loop_histograms(kernel, sig, constants, cfg["num_warps"],
                                                           cfg["num_stages"], cfg.get("maxnreg", 0))
    gemm = "the gate_up GEMM" if args.gate_up else "the down GEMM"
    print(f"triton {triton.__version__}, {args.tokens} tokens {gemm}, paired={paired}, {cfg}\n"
          f"registers per thread: {regs}; shared memory {smem / 1024:.0f} KiB; "
          f"wgmma waits (DEPBAR.LE gsb0, N: count): {waits}"
          + (f"; ptxas: {serialized}" if serialized else ""))
    n, ops = min(loops, key=lambda loop: loop[0])  # the innermost: the K loop (others wrap it)
    print(f"K loop: {n} instructions per thread per K step of {bk}: {dict(ops.most_common(args.top))}")


if __name__ == "__main__":
    main()
