"""Where the decode kernels' per-wgmma descriptor instructions come from (issue 17), without a GPU:
a minimal Gluon loop (A from registers, B, the activations, from a shared-memory ring) compiled
for sm90, its K loop's SASS counted as in ``sass_count.py``. With the ring slot chosen at run time
(``k % STAGES``, as in Triton's pipelined loops) each wgmma's shared-memory descriptor is rebuilt
from the address (``bfe``: UIADD3, USHF, USGXT, UMOV); with the slot a constant (the loop unrolled
by the number of stages) ptxas computes the descriptors once and each wgmma costs two UMOVs.

    PYTHONPATH=/tmp/t36 python benchmarks/gluon_wgmma_probe.py     # Triton 3.6, the GPU machine's

Numbers: NOTES.md, eleventh session. A probe of code generation only: the kernel is not run.
"""

import sys
from pathlib import Path

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sass_count import loop_histograms  # noqa: E402


@gluon.jit
def _k_step(acc, w_ptr, x_ptr, x_smem, k, K: gl.constexpr, BK: gl.constexpr):
    """One K step: the step's ``[16, BK]`` activation tile into ``x_smem`` (one ring slot), then
    BK/16 wgmma of ``[64, 16]`` weight registers x that slot, at most one in flight."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    blocked: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows = gl.arange(0, 16, layout=gl.SliceLayout(1, blocked))
    cols = gl.arange(0, BK, layout=gl.SliceLayout(0, blocked))
    wr = gl.arange(0, 64, layout=gl.SliceLayout(1, a_layout))
    wc = gl.arange(0, 16, layout=gl.SliceLayout(0, a_layout))
    x_smem.store(gl.load(x_ptr + rows[:, None] * K + k * BK + cols[None, :]))
    fence_async_shared()
    for kk in gl.static_range(BK // 16):
        a = gl.load(w_ptr + wr[:, None] * K + k * BK + kk * 16 + wc[None, :])
        acc = warpgroup_mma(a, x_smem.slice(kk * 16, 16, dim=1).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(1, deps=[acc])
    return acc


@gluon.jit
def _probe(w_ptr, x_ptr, out_ptr, K: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
           STATIC_SLOT: gl.constexpr):
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
    x_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 16, BK], x_layout)
    acc = gl.zeros([64, 16], gl.float32, mma)
    if STATIC_SLOT:
        for k0 in range(0, K // BK, STAGES):
            for s in gl.static_range(STAGES):
                acc = _k_step(acc, w_ptr, x_ptr, x_smem.index(s), k0 + s, K, BK)
    else:
        for k in range(0, K // BK):
            acc = _k_step(acc, w_ptr, x_ptr, x_smem.index(k % STAGES), k, K, BK)
    acc = warpgroup_mma_wait(0, deps=[acc])
    orow = gl.arange(0, 64, layout=gl.SliceLayout(1, mma))
    ocol = gl.arange(0, 16, layout=gl.SliceLayout(0, mma))
    gl.store(out_ptr + orow[:, None] * 16 + ocol[None, :], acc)


def main():
    descriptor_ops = ("UIADD3", "USHF.R.U32.HI", "USGXT.U32", "UMOV")
    for static in (False, True):
        constants = dict(K=3 * 2048, BK=256, STAGES=3, STATIC_SLOT=static)
        signature = {"w_ptr": "*bf16", "x_ptr": "*bf16", "out_ptr": "*fp32"} | {k: "constexpr" for k in constants}
        regs, _, _, loops, _ = loop_histograms(_probe, signature, constants, num_warps=4, num_stages=1,
                                               source=GluonASTSource)
        n, ops = min(loops, key=lambda loop: loop[0])
        wgmma = ops["HGMMA.64x16x16.F32.BF16"]
        uniform = sum(ops[o] for o in descriptor_ops)
        print(f"ring slot {'static (unrolled by stage)' if static else 'chosen at run time'}: {wgmma} wgmma in the "
              f"K loop, {uniform} descriptor instructions ({uniform / wgmma:.1f} per wgmma: "
              f"{ {o: ops[o] for o in descriptor_ops} }), {n} instructions in all, {regs} registers")


if __name__ == "__main__":
    main()
