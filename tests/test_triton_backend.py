"""The Triton (Hopper) backend. On CPU the kernels run in Triton's interpreter; on a GPU the same
tests run the compiled kernels."""

import pytest
import torch

import fp4moe_ops
from fp4moe_ops.backends import BACKENDS
from fp4moe_ops.backends.triton_moe import kernel_config, route, triton_fused_moe
from fp4moe_ops.oracle64 import moe64


def kernel_tensors(w):
    """The op's tensors for the Triton backend: canonical, the packed weights in its layout
    (paired where the tiles come through TMA)."""
    from fp4moe_ops.backends.base import CANONICAL, canonical_layout, convert_packed

    tensors = canonical_layout(w.tensors())
    layout = BACKENDS["triton"].packed_layout(w.hidden_size, w.intermediate_size)
    tensors[0], tensors[3] = (convert_packed(tensors[i], CANONICAL, layout) for i in (0, 3))
    return tensors

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

try:  # (a module-level jit function: Triton resolves the names it calls in the module's globals)
    import triton
    import triton.language as tl

    from fp4moe_ops.backends.triton_moe.kernels import _block_expert

    @triton.jit
    def _slot_block_experts(ids_ptr, out_ptr, E: tl.constexpr):
        """Each block's expert as a one-token call's GEMMs see it (``kernels._block_expert``)."""
        b = tl.program_id(0)
        tl.store(out_ptr + b, _block_expert(b, ids_ptr, E, True))
except ImportError:  # pragma: no cover - CPU installs without triton
    _slot_block_experts = None


def layer(e, h, i):
    gate_up = torch.randn(e, 2 * i, h) / h**0.5 * torch.logspace(-1, 1, e)[:, None, None]
    return fp4moe_ops.quantize_moe_weights(gate_up, torch.randn(e, h, i) / i**0.5)


def python_route(ids, num_experts, block_m):
    """Plain-Python grouping: for each expert in order, its slots in order, in blocks."""
    flat = ids.reshape(-1).tolist()
    blocks = []
    for e in range(num_experts):
        slots = [s for s, x in enumerate(flat) if x == e]
        for j in range(0, len(slots), block_m):
            blocks.append((e, slots[j:j + block_m]))
    return blocks


def test_route_matches_python_grouping():
    ids = torch.randint(-2, 9, (37, 3))  # includes invalid ids -2, -1, 8
    sorted_slot, block_expert, start, end = route(ids, 8, 4)
    got = [(int(e), sorted_slot[int(a):int(b)].tolist()) for e, a, b in zip(block_expert, start, end) if e >= 0]
    assert got == python_route(ids, 8, 4)
    assert block_expert.numel() >= len(got)


@pytest.mark.parametrize("num_experts,block_m,slots", [(256, 16, 8), (256, 16, 1000), (256, 16, 4096),
                                                       (3, 64, 130), (5, 4, 1), (5, 4, 4097), (128, 128, 33000)])
def test_route_matches_python_grouping_across_chunks(num_experts, block_m, slots):
    # the routing program places 64 slots per step: several steps, a partial last one, more
    # blocks than expert bins (the -1 fill loops), one slot, the largest batch one launch routes,
    # and past it the two-launch path (per-chunk counts, chunks of several steps, a partial last chunk)
    ids = torch.randint(-1, num_experts + 1, (slots,))
    sorted_slot, block_expert, start, end = route(ids.to(DEVICE), num_experts, block_m)
    got = [(int(e), sorted_slot[int(a):int(b)].tolist()) for e, a, b in zip(block_expert, start, end) if e >= 0]
    assert got == python_route(ids, num_experts, block_m)
    valid = ((ids >= 0) & (ids < num_experts)).sum().item()
    assert sorted(sorted_slot.tolist()) == list(range(slots))  # invalid slots placed after the valid ones
    assert set(sorted_slot[valid:].tolist()) == set(torch.nonzero((ids < 0) | (ids >= num_experts)).flatten().tolist())


def test_route_drops_int64_ids_that_would_alias_a_valid_expert_in_32_bits():
    ids = torch.tensor([[2**32 + 3, 1], [-(2**32) + 2, 3], [2**31, 0]])  # low 32 bits: 3, 2, -2^31
    sorted_slot, block_expert, start, end = route(ids.to(DEVICE), 4, 16)
    got = [(int(e), sorted_slot[int(a):int(b)].tolist()) for e, a, b in zip(block_expert, start, end) if e >= 0]
    assert got == [(0, [5]), (1, [1]), (3, [3])]
    sorted_slot, block_expert, start, end = route(ids.repeat(700, 1).to(DEVICE), 4, 16)  # > 4096 slots: two launches
    covered = [s for e, a, b in zip(block_expert, start, end) if e >= 0 for s in sorted_slot[int(a):int(b)].tolist()]
    assert sorted(covered) == [s for s in range(6 * 700) if s % 6 in (1, 3, 5)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels need a GPU")
@pytest.mark.parametrize("e,h,i,k", [(8, 768, 512, 2),  # paired weights, TMA tiles, Gluon prefill on Hopper
                                     (6, 96, 64, 2)])  # canonical weights, plain loads
def test_first_call_compiles_every_variant_of_the_layer(e, h, i, k, monkeypatch, tmp_path):
    # The first pass over new shapes: a layer's first call compiles every kernel variant its
    # shape can launch (launch.compile_layer_once), so no later token count compiles anything; in
    # particular the kernels' alignment specializations must not follow the token count. Shapes no
    # other test uses, so that their kernels are not in the JIT cache before. Nor does a later call
    # build a kernel launcher (Triton's C module per kernel function and argument types, built with
    # the C compiler at a kernel's first launch unless its cache has it): an empty Triton cache, and
    # a count of launcher builds (not Triton's own driver module).
    import triton.backends.nvidia.driver
    import triton.runtime.build

    from fp4moe_ops.backends.triton_moe import kernels
    from fp4moe_ops.backends.triton_moe.launch import _gluon_runs, compile_layer_once

    kernel_fns = [kernels._route_kernel, kernels._gate_up_swiglu_kernel, kernels._down_kernel,
                  kernels._sum_topk_kernel]
    gluon_runs = _gluon_runs(torch.empty(1, dtype=torch.bfloat16, device="cuda"))
    gluon = kernel_config(64 * e, e, h, i)["GLUON_PREFILL"] and gluon_runs
    v3 = kernel_config(k, e, h, i)["DECODE_V3"] and gluon_runs
    if v3:
        from fp4moe_ops.backends.triton_moe.decode_v3 import _gate_up_v3_kernel, _down_v3_kernel
        kernel_fns += [_gate_up_v3_kernel, _down_v3_kernel]
    if gluon:
        from fp4moe_ops.backends.triton_moe.prefill_rs import _prefill_gemm_kernel
        kernel_fns.append(_prefill_gemm_kernel)

    def variants():
        return [sum(len(c[0]) for c in fn.device_caches.values()) for fn in kernel_fns]

    w = layer(e, h, i)
    tensors = [t.cuda() for t in kernel_tensors(w)]

    def inputs(t):
        return (torch.randn(t, h, dtype=torch.bfloat16), torch.stack([torch.randperm(e)[:k] for _ in range(t)]),
                torch.rand(t, k))

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    builds, build = [], triton.runtime.build._build
    monkeypatch.setattr(triton.runtime.build, "_build",  # (launchers only: not the driver's own C module)
                        lambda name, *a, **kw: (name == "__triton_launcher" and builds.append(name)) or build(name, *a, **kw))
    before = variants()
    x, ids, rw = inputs(3)
    compile_layer_once(x.cuda(), ids.cuda(), rw.cuda(), tensors)  # (what the first call does; runs nothing)
    first, built_ahead = variants(), len(builds)
    # (the launchers of the new GEMM variants at least; Triton releases that launch through one
    # generic module build none per kernel)
    assert built_ahead > 0 or not hasattr(triton.backends.nvidia.driver, "make_launcher")
    # the GEMMs of every bucket: one token (its blocks read from the ids), decode with static and
    # run-time K loops, middle, prefill (TMA shapes); one token, decode and prefill (plain loads);
    # the Gluon kernels at 128 rows and each tail level
    # (with decode_v3: one token and the rest of up to 6 rows per expert on its two kernels, one
    # variant each per path, and the Triton GEMMs from the seventh row per expert on)
    assert first[1] - before[1] == (3 if v3 else 5 if h % 256 == 0 and i % 256 == 0 else 3), (before, first)
    if v3:
        assert [first[j] - before[j] for j in (4, 5)] == [2, 2], (before, first)
    if gluon:
        assert first[-1] - before[-1] == 4, (before, first)
    # every bucket of kernel_config and both routing paths: decode with static and run-time K loops
    # (<= 4 tokens, > 4), the routing kernel's two histogram steps (<= 64 slots, more), middle
    # (> 8 rows per expert), prefill (> 16), Gluon prefill (>= 64), routing by torch ops (> 4096 slots)
    for t in (1, 2, 3, 4, 5, 20, 32, 33, 40, 64, 65, 100, 200, 255, 256, 300, 1000, 2048, 2049, 2500):
        x, ids, rw = inputs(t)
        out = triton_fused_moe(x.cuda(), ids.cuda(), rw.cuda(), tensors).cpu()
        assert variants() == first, (t, [fn.__name__ for fn in kernel_fns], first, variants())
        assert len(builds) == built_ahead, (t, builds)
        if t in (3, 40, 100, 300, 2500):  # the kernels compiled ahead compute what they should
            ref = moe64(x, ids, rw, *w.tensors())
            ulp = 2.0**-8  # as test_triton_matches_float64 (bf16 intermediate and output, fp32 sums)
            torch.testing.assert_close(out.double(), ref, rtol=4 * ulp, atol=4 * ulp * ref.abs().max().item())


def test_launcher_key_follows_what_the_launcher_source_depends_on():
    # Triton 3.6's launcher C source follows the kernel's argument kinds: pointers of any dtype are
    # one device address, a descriptor's block shape is not in it, constexpr values are not. Checked
    # against make_launcher's output for DeepSeek-V3's layer and linear variants on the CPU machine
    # (26 variants: 7 sources, 7 keys; benchmarks/NOTES.md, "Compiling on the first call").
    from types import SimpleNamespace

    from fp4moe_ops.backends.triton_moe.compile_ahead import launcher_key

    def src(fn, **signature):
        return SimpleNamespace(fn=fn, signature=signature)

    base = launcher_key(src("f", x="*bf16", n="i32", d="tensordesc<u8[1, 2, 32, 256]>", BM="constexpr"))
    assert launcher_key(src("f", x="*fp16", n="i32", d="tensordesc<u8[1, 2, 64, 256]>", BM="constexpr")) == base
    for other in (src("g", x="*bf16", n="i32", d="tensordesc<u8[1, 2, 32, 256]>", BM="constexpr"),
                  src("f", x="*bf16", n="i64", d="tensordesc<u8[1, 2, 32, 256]>", BM="constexpr"),
                  src("f", x="*bf16", n="i32", d="tensordesc<u8[32, 256]>", BM="constexpr"),
                  src("f", x="*bf16", n="i32", d="constexpr", BM="constexpr")):  # (a None descriptor)
        assert launcher_key(other) != base, other


def test_launchers_built_ahead_once_per_launcher(monkeypatch):
    # compile_ahead's pool builds each compiled kernel's launcher; variants that share one (the
    # same compile_ahead.launcher_key) build it one at a time (the others then find it in Triton's
    # cache), different launchers build at the same time, and a failing build leaves the kernel to
    # its first launch. A stand-in driver records builds.
    import threading
    import time
    from types import SimpleNamespace

    from triton.runtime import driver

    from fp4moe_ops.backends.triton_moe import compile_ahead

    active, most, built, guard = {}, {}, [], threading.Lock()
    meet = threading.Barrier(2, timeout=5)  # the first "gemm" build and the "sum" build must overlap

    def launcher_cls(src, metadata):
        with guard:
            active[src.fn] = active.get(src.fn, 0) + 1
            most[src.fn] = max(most.get(src.fn, 0), active[src.fn])
        if src.name in ("k0", "other"):
            meet.wait()  # (broken, so the build raises and is not recorded, if a lock held both)
        time.sleep(0.05)  # (long enough for unserialized builds of one launcher to overlap)
        with guard:
            active[src.fn] -= 1
            built.append(src.name)
        if src.name == "broken":
            raise RuntimeError("no C compiler")

    monkeypatch.setattr(driver, "_active", SimpleNamespace(launcher_cls=launcher_cls))

    def kernel(name, fn, block):  # variants of one function: other constexprs, descriptor blocks, pointer dtypes
        signature = {"x": "*bf16" if block < 64 else "*fp16", "n": "i32", "d": f"tensordesc<u8[{block}, 64]>",
                     "BM": "constexpr"}
        return SimpleNamespace(src=SimpleNamespace(name=name, fn=fn, signature=signature, constants={"BM": block}),
                               metadata=SimpleNamespace())

    kernels = ([kernel(f"k{j}", "gemm", 16 * 2 ** j) for j in range(4)]
               + [kernel("other", "sum", 16), kernel("broken", "route", 16)])
    with compile_ahead._CompileThenBuildLauncher(6) as pool:
        futures = [pool.submit(lambda k=k: k) for k in kernels]
        assert [f.result() for f in futures] == kernels  # (the failed build too: its kernel is returned)
    assert sorted(built) == sorted(k.src.name for k in kernels)
    assert most["gemm"] == 1, most


def test_variant_slots_one_per_kernel_set():
    # DeepSeek-V3 (E=256, top-8; launch.kernel_config's rules, by hand): 1 token (decode_v3 with a
    # block per slot, 64-slot histogram steps), 2 (routed), 9 (1024-slot steps), 193 (the wgmma
    # kernels: > 6 rows per expert; run-time K loops), 257 (middle: > 8 rows), 513 (prefill: > 16
    # rows; past the routing kernel's 4096 slots), 2048 (Gluon prefill: 64 rows)
    from fp4moe_ops.backends.triton_moe.launch import variant_slots

    assert variant_slots(256, 7168, 2048, 8) == [8 * t for t in (1, 2, 9, 193, 257, 513, 2048)]
    # an expert-parallel rank of 32 experts counts rows over the 256 routed: the same buckets
    assert variant_slots(32, 7168, 2048, 8, routed_experts=256) == [8 * t for t in (1, 2, 9, 193, 257, 513, 2048)]
    # no TMA boxes (H, I not multiples of 256): no middle bucket, no Gluon; prefill from 16 rows (49 tokens)
    assert variant_slots(6, 64, 32, 2) == [2, 4, 66, 98, 4098]  # (1 token: no routing launch, 2: routed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("e,h,i,t,k", [(6, 64, 32, 5, 2), (8, 128, 64, 33, 3),
                                       (4, 512, 256, 3, 2),  # decode with TMA loads, fragment order
                                       (4, 512, 256, 24, 2),  # middle bucket (12 rows per expert)
                                       (2, 256, 256, 40, 1),  # prefill bucket (20 rows per expert), TMA
                                       # 400 rows per expert: the Gluon prefill kernels on Hopper in
                                       # bf16 (K = 256: 2 pair steps, fewer than the ring's slots),
                                       # the single-role ones in fp16 and on the CPU
                                       (2, 256, 256, 400, 1)])
def test_triton_matches_float64(dtype, e, h, i, t, k):
    w = layer(e, h, i)
    x = torch.randn(t, h, dtype=dtype)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    ids[0, -1] = -1  # expert-parallel sentinel
    ids[1, -1] = e
    rw = torch.rand(t, k)
    dev = [x.to(DEVICE) for x in kernel_tensors(w)]  # paired layout where TMA fits
    assert (dev[0].dtype == torch.int32) == kernel_config(t * k, e, h, i)["TMA"]
    out = triton_fused_moe(x.to(DEVICE), ids.to(DEVICE), rw.to(DEVICE), dev).cpu()
    ref = moe64(x, ids, rw, *w.tensors())
    # Both round the intermediate and the output to dtype; fp32 accumulation otherwise:
    # per-element error within a few output ulps (bf16 2^-8, fp16 2^-11) of the row scale.
    ulp = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    torch.testing.assert_close(out.double(), ref, rtol=4 * ulp, atol=4 * ulp * ref.abs().max().item())
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    assert rel < 4 * ulp, rel


def test_one_token_blocks_check_ids_as_loaded():
    # A one-token call's GEMMs take their experts straight from the ids: an id outside [0, E) must
    # give -1 (a skipped block, whose weights are never read), checked before any narrowing, so an
    # int64 id that would alias a valid expert in 32 bits is refused too. (The layer's output cannot
    # show this: the top-k sum ignores such slots anyway.)
    if _slot_block_experts is None:
        pytest.skip("needs Triton")
    e = 6
    for dtype, values in ((torch.int32, [e, e - 1, -1, 0, 3, 2**31 - 1]),
                          (torch.int64, [e, e - 1, -1, 0, 3, 2**32 + 1, 2**32, -2**40, 2**31])):
        ids = torch.tensor(values, dtype=dtype, device=DEVICE)
        out = torch.full((len(values),), 99, dtype=torch.int32, device=DEVICE)
        _slot_block_experts[(len(values),)](ids, out, E=e)
        assert out.cpu().tolist() == [v if 0 <= v < e else -1 for v in values], (dtype, out.cpu().tolist())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("e,h,i", [(6, 512, 256),  # TMA, paired weights, x read in fragment order
                                   (5, 64, 32)])  # plain loads, canonical weights
@pytest.mark.parametrize("ids", [[3, 0, 5, 1], [2, 2, -1, 6], [2**32 + 1, 4, -2**40, 0]])
def test_one_token_needs_no_routing_launch(monkeypatch, e, h, i, ids, dtype):
    # A one-token call takes each slot as a row block of its own, read from the ids by the GEMMs:
    # no routing launch, bitwise the routed path's output (distinct, repeated and invalid ids,
    # int64 ids that would alias a valid expert in 32 bits), and the float64 answer. (The output
    # cannot show the id check itself: test_one_token_blocks_check_ids_as_loaded does.)
    from fp4moe_ops.backends.triton_moe import launch

    w = layer(e, h, i)
    x = torch.randn(1, h, dtype=dtype)
    ids = torch.tensor([ids], dtype=torch.int64)
    rw = torch.rand(1, ids.shape[1])
    tensors = [t.to(DEVICE) for t in kernel_tensors(w)]
    args = (x.to(DEVICE), ids.to(DEVICE), rw.to(DEVICE), tensors)
    routed = triton_fused_moe(*args, config=kernel_config(ids.shape[1], e, h, i) | {"SLOT_BLOCKS": False})

    def no_route(*a, **k):
        raise AssertionError("a one-token call launched the routing kernel")

    monkeypatch.setattr(launch, "route", no_route)
    out = triton_fused_moe(*args)
    assert torch.equal(out, routed)
    ref = moe64(x, ids, rw, *w.tensors())
    # 16-bit intermediate and output: a few ulps (bf16 2^-8) of the row scale, as above
    torch.testing.assert_close(out.cpu().double(), ref, rtol=2**-6, atol=2**-6 * ref.abs().max().item())


def test_triton_multiple_blocks_per_expert():
    # 40 tokens all on experts 0 and 1 with BLOCK_M=16: several M blocks per expert.
    w = layer(4, 64, 32)
    x = torch.randn(40, 64, dtype=torch.bfloat16)
    ids = torch.stack([torch.tensor([0, 1])] * 40)
    ids[::3] = torch.tensor([1, 3])
    rw = torch.rand(40, 2)
    p = fp4moe_ops.prepare_experts(w, "reference")
    cfg = kernel_config(80, 4, 64, 32) | {"BM": 16, "PREFETCH": False}
    out = triton_fused_moe(x.to(DEVICE), ids.to(DEVICE), rw.to(DEVICE), [t.to(DEVICE) for t in p.op_tensors()], cfg).cpu()
    ref = moe64(x, ids, rw, *w.tensors())
    torch.testing.assert_close(out.double(), ref, rtol=2**-6, atol=2**-6 * ref.abs().max().item())


def test_kernel_config_buckets():
    # rows per expert: <= 8 decode (16-row blocks), 8-16 middle (32-row blocks, TMA shapes only), > 16 prefill
    assert [kernel_config(t * 8, 256, 7168, 2048)["BM"] for t in (1, 256, 257, 512, 513)] == [16, 16, 32, 32, 64]
    assert kernel_config(512 * 8, 256, 64, 32)["BM"] == 16  # no TMA: no middle bucket
    # the gate_up GEMM's gate and up in one K loop wherever TMA fits; static K loops (pipelined wgmma) at 1 token
    # and from the middle bucket on, run-time ones for the rest of the decode bucket
    modes = [(c["MERGED_GATE_UP"], c["PIPELINED_GATE_UP"], c["PIPELINED_DOWN"])
             for c in (kernel_config(t * 8, 256, 7168, 2048) for t in (1, 2, 256, 257, 8192))]
    assert modes == [(True, True, True), (True, False, False), (True, False, False), (True, True, True),
                     (True, True, True)]
    small = kernel_config(8, 4, 64, 32)
    assert not small["MERGED_GATE_UP"] and not small["PIPELINED_GATE_UP"]


def test_kernel_config_puts_up_to_six_rows_per_expert_on_decode_v3():
    # DeepSeek-V3: 1-192 tokens of top-8 over 256 experts (up to 6 rows per expert), not 193+
    assert [kernel_config(t * 8, 256, 7168, 2048)["DECODE_V3"] for t in (1, 32, 64, 128, 192, 193, 8192)] == \
        [True, True, True, True, True, False, False]
    assert kernel_config(8, 256, 7168, 2048)["V3_SPS"] == 2 and kernel_config(8, 128, 2048, 768)["V3_SPS"] == 1
    assert kernel_config(64, 256, 7168, 2048)["V3_BM"] == 8 and kernel_config(64, 256, 7168, 2048)["BM"] == 16
    assert not kernel_config(8, 256, 64, 32)["DECODE_V3"]  # no TMA boxes
    assert not kernel_config(8, 256, 7168, 1408)["DECODE_V3"]  # I not a multiple of 256 (a step of the ring)
    assert kernel_config(1024, 32, 7168, 2048, routed_experts=256)["DECODE_V3"]  # rows over the routed experts
    assert not kernel_config(1024, 32, 7168, 2048)["DECODE_V3"]


def test_decode_v3_views_hold_each_warps_chunk():
    # decode_v3's TMA boxes read the op's own tensors through strided views by K chunk (64 elements;
    # step s, warp w is chunk 4s + w, ring slot q's box the chunks from 4 SPS q); checked here
    # against the definition, byte by byte from the flat tensors
    from fp4moe_ops.backends.triton_moe.decode_v3 import gate_up_views, scale_view, weight_view

    e, h, i = 3, 512, 1024
    down = torch.randint(-2**31, 2**31 - 1, (e, h // 2, i // 4), dtype=torch.int32)
    down_scale = torch.randint(0, 256, (e, h, i // 16), dtype=torch.uint8)
    pair_bytes, scale_bytes = down.view(torch.uint8).reshape(e * h // 2, i), down_scale.reshape(e * h, i // 16).long()

    def word(row_bytes, c):  # little-endian int32 of blocks 4c .. 4c + 3
        v = sum(int(row_bytes[4 * c + b]) << (8 * b) for b in range(4))
        return v - (1 << 32) if v >= 1 << 31 else v

    for sps in (1, 2):
        wv, sv = weight_view(down, sps), scale_view(down_scale, sps)
        assert wv.shape == (i // 64, e * h // 2, 64) and sv.shape == (sps, i // (256 * sps), e * h, 4)
        for j, w, q, p in [(0, 0, 0, 0), (sps - 1, 3, 1, 5), (0, 2, i // (256 * sps) - 1, e * h // 2 - 1)]:
            c = 4 * (sps * q + j) + w
            assert torch.equal(wv[4 * sps * q + 4 * j + w, p], pair_bytes[p, 64 * c:64 * c + 64])
            assert int(sv[j, q, 2 * p + 1, w]) == word(scale_bytes[2 * p + 1], c)
    gate_up = torch.randint(-2**31, 2**31 - 1, (e, i, h // 4), dtype=torch.int32)
    gate_up_scale = torch.randint(0, 256, (e, 2 * i, h // 16), dtype=torch.uint8)
    wv, sv = gate_up_views(gate_up, gate_up_scale)
    gate_up_bytes = gate_up.view(torch.uint8).reshape(e, i, h)  # pair rows: gate's i/2, then up's
    for step, w, ex, u, p in [(0, 0, 0, 0, 0), (h // 256 - 1, 3, 2, 1, i // 2 - 1), (0, 1, 1, 1, 7)]:
        c = 4 * step + w
        assert torch.equal(wv[c, 2 * ex + u, p], gate_up_bytes[ex, u * i // 2 + p, 64 * c:64 * c + 64])
        assert int(sv[step, u, ex, 2 * p, w]) == word(gate_up_scale[ex, u * i + 2 * p].long(), c)


def test_kernel_config_uses_tma_only_where_boxes_fit():
    assert kernel_config(8, 256, 7168, 2048)["TMA"] and kernel_config(3 * 2, 4, 512, 256)["TMA"]
    assert not kernel_config(8, 256, 64, 32)["TMA"]  # scale rows of 4 bytes: no 16-byte box
    assert kernel_config(65536, 256, 7168, 2048)["TMA"]  # prefill too
    for slots, h, i in [(8, 7168, 2048), (65536, 7168, 2048), (8, 64, 32), (65536, 2048, 1408)]:
        cfg = kernel_config(slots, 256, h, i)
        assert cfg["FRAGMENT_ORDER"] == cfg["TMA"] and (not cfg["TMA"] or min(cfg["BK_GATE_UP"], cfg["BK_DOWN"]) >= 256)


def test_kernel_config_divides_dims():
    for h, i in [(7168, 2048), (7168, 256), (2048, 1408), (64, 32), (48, 80)]:
        for slots in (8, 512, 65536):
            cfg = kernel_config(slots, 256, h, i)
            assert i % cfg["BN_GATE_UP"] == 0 and h % cfg["BK_GATE_UP"] == 0
            assert h % cfg["BN_DOWN"] == 0 and i % cfg["BK_DOWN"] == 0


@pytest.mark.parametrize("slots_per_token,tokens", [(3, 37), (8, 64), (8, 700)])  # 5600 slots: two launches
def test_fast_and_torch_routing_agree(slots_per_token, tokens):
    from fp4moe_ops.backends import triton_moe

    ids = torch.randint(-2, 9, (tokens, slots_per_token))
    fast = route(ids.to(DEVICE), 8, 4)
    flat = ids.reshape(-1).to(DEVICE)
    slow = triton_moe.launch._route_torch(flat, 8, 4, min(flat.numel(), 8) + flat.numel() // 4)
    fast = [t.cpu() for t in fast]
    slow = [t.cpu().to(torch.int32) for t in slow]
    assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1])
    used = fast[1] >= 0  # row ranges of unused blocks are never read
    assert torch.equal(fast[2][used], slow[2][used]) and torch.equal(fast[3][used], slow[3][used])


def test_fragment_order_is_the_mma_quad_layout():
    # Written from the definition: in each 16-wide step the MMA gives quad thread t the columns
    # 2t, 2t+1 (s = 0) and 2t+8, 2t+9 (s = 1); we want those to be the low (s = 0) and high (s = 1)
    # nibbles of the 2 bytes 2j, 2j+1 of thread t's contiguous chunk/8-byte run.
    from fp4moe_ops.backends.triton_moe import fragment_order

    chunk = 256
    expected = [0] * chunk
    for j in range(chunk // 16):
        for t in range(4):
            for s in range(2):
                for e in range(2):
                    byte = (chunk // 8) * t + 2 * j + e
                    expected[16 * j + 8 * s + 2 * t + e] = 2 * byte + s
    x = torch.arange(2 * chunk).reshape(1, 2 * chunk)  # two chunks: the order repeats per chunk
    got = fragment_order(x, chunk)[0].tolist()
    assert got == expected + [chunk + k for k in expected]
    assert sorted(got) == list(range(2 * chunk))


@pytest.mark.parametrize("fragment,paired", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("merged", [False, True])
def test_triton_decode_variants(fragment, paired, merged):
    # The decode kernels with K in natural or fragment order, canonical or paired weights, the gate_up GEMM
    # with gate and up in two K loops or in one (merged tiles): the same NVFP4 layer, the same
    # float64 answer.
    e, h, i, t, k = 4, 512, 256, 6, 2
    w = layer(e, h, i)
    x = torch.randn(t, h, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    ids[0, -1] = -1  # an unused slot: never computed, never summed
    rw = torch.rand(t, k)
    tensors = kernel_tensors(w) if paired else fp4moe_ops.prepare_experts(w, "reference").op_tensors()
    cfg = kernel_config(t * k, e, h, i) | {"FRAGMENT_ORDER": fragment, "MERGED_GATE_UP": merged}
    out = triton_fused_moe(x.to(DEVICE), ids.to(DEVICE), rw.to(DEVICE), [v.to(DEVICE) for v in tensors], cfg).cpu()
    ref = moe64(x, ids, rw, *w.tensors())
    assert torch.isfinite(out).all()
    # bf16 intermediate and output: a few bf16 ulps (2^-8) of the row scale, as above.
    torch.testing.assert_close(out.double(), ref, rtol=2**-6, atol=2**-6 * ref.abs().max().item())


@pytest.mark.parametrize("paired", [False, True])
def test_triton_prefill_tiles_with_bk128(paired):
    # TMA weight tiles with BK = 128 (scales then come through plain loads: a 8-byte scale box
    # row is below TMA's 16 bytes), 64-row blocks with several blocks per expert.
    e, h, i, t, k = 2, 256, 256, 70, 1
    w = layer(e, h, i)
    x = torch.randn(t, h, dtype=torch.bfloat16)
    ids = torch.randint(0, e, (t, k))
    rw = torch.rand(t, k)
    tensors = kernel_tensors(w) if paired else fp4moe_ops.prepare_experts(w, "reference").op_tensors()
    cfg = kernel_config(t * k, e, h, i) | dict(BM=64, BN_GATE_UP=128, BK_GATE_UP=128, BN_DOWN=128, BK_DOWN=128, TMA=True,
                                               FRAGMENT_ORDER=True, MERGED_GATE_UP=False)
    out = triton_fused_moe(x.to(DEVICE), ids.to(DEVICE), rw.to(DEVICE), [v.to(DEVICE) for v in tensors], cfg).cpu()
    ref = moe64(x, ids, rw, *w.tensors())
    # bf16 intermediate and output: a few bf16 ulps (2^-8) of the row scale
    torch.testing.assert_close(out.double(), ref, rtol=2**-6, atol=2**-6 * ref.abs().max().item())


@pytest.mark.parametrize("bm,bn1,pipelined,paired", [(16, 64, False, True), (64, 128, True, True), (32, 128, True, False)])
def test_triton_merged_gate_up_tiles(bm, bn1, pipelined, paired):
    # the gate_up GEMM with BN_GATE_UP/2 gate rows and the same up rows in one K loop (4-D TMA boxes over [E, 2, I, *]
    # of the paired or canonical weights), with a static or a run-time K loop: several tiles per
    # expert, several blocks per expert, an unused slot.
    e, h, i, t, k = 3, 512, 256, 40, 2
    w = layer(e, h, i)
    x = torch.randn(t, h, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    ids[3, 0] = -1
    rw = torch.rand(t, k)
    cfg = kernel_config(t * k, e, h, i) | dict(BM=bm, BN_GATE_UP=bn1, BK_GATE_UP=256, TMA=True, FRAGMENT_ORDER=True,
                                               MERGED_GATE_UP=True,
                                               PIPELINED_GATE_UP=pipelined, PIPELINED_DOWN=pipelined)
    tensors = kernel_tensors(w) if paired else fp4moe_ops.prepare_experts(w, "reference").op_tensors()
    out = triton_fused_moe(x.to(DEVICE), ids.to(DEVICE), rw.to(DEVICE), [v.to(DEVICE) for v in tensors], cfg).cpu()
    ref = moe64(x, ids, rw, *w.tensors())
    # bf16 intermediate and output: a few bf16 ulps (2^-8) of the row scale
    torch.testing.assert_close(out.double(), ref, rtol=2**-6, atol=2**-6 * ref.abs().max().item())


def test_kernel_config_counts_rows_over_the_routed_experts():
    # An EP=8 rank of DeepSeek-V3 (32 of 256 experts) at 128 tokens: 1024 slots but ~4 local rows
    # per expert. Counted over the local experts it would look like 32 rows: prefill tiles.
    assert kernel_config(1024, 32, 7168, 2048)["BM"] > 16
    assert kernel_config(1024, 32, 7168, 2048, routed_experts=256)["BM"] == 16
    assert kernel_config(1024, 256, 7168, 2048, routed_experts=0) == kernel_config(1024, 256, 7168, 2048)


def test_triton_expert_parallel_shard_with_routed_hint():
    # Local experts 0..1 of 8 routed: ids outside [0, 2) belong to other ranks. The hint moves
    # this call from the prefill to the decode tiles; both must match float64.
    e, h, i, t, k = 2, 256, 256, 40, 1
    w = layer(e, h, i)
    x = torch.randn(t, h, dtype=torch.bfloat16)
    ids = torch.randint(0, 8, (t, k)) - 3
    ids[:4, 0] = torch.tensor([0, 1, 0, 1])  # some local slots for sure
    rw = torch.rand(t, k)
    assert kernel_config(t * k, e, h, i)["BM"] != kernel_config(t * k, e, h, i, routed_experts=8)["BM"]
    tensors = [v.to(DEVICE) for v in fp4moe_ops.prepare_experts(w, "reference").op_tensors()]
    ref = moe64(x, ids, rw, *w.tensors())
    for hint in (0, 8):
        out = triton_fused_moe(x.to(DEVICE), ids.to(DEVICE), rw.to(DEVICE), tensors, routed_experts=hint).cpu()
        # bf16 intermediate and output: a few bf16 ulps (2^-8) of the row scale
        torch.testing.assert_close(out.double(), ref, rtol=2**-6, atol=2**-6 * ref.abs().max().item())


def test_paired_layout_round_trip_and_checks():
    from fp4moe_ops.backends.triton_moe import canonical_from_paired, paired_weight_layout

    w = layer(3, 256, 256)
    prepared = kernel_tensors(w)
    assert prepared[0].dtype == torch.int32 and prepared[0].shape == (3, 256, 64)
    assert torch.equal(canonical_from_paired(prepared[0]), w.gate_up) and torch.equal(canonical_from_paired(prepared[3]), w.down)
    assert not torch.equal(prepared[0].view(torch.uint8).reshape(w.gate_up.shape), w.gate_up)  # really permuted
    assert BACKENDS["triton"].check_expert_tensors(prepared, 256) == 3
    with pytest.raises(ValueError, match="down \\(paired\\)"):
        BACKENDS["triton"].check_expert_tensors(prepared[:3] + [prepared[3][:, :64]] + prepared[4:], 256)
    with pytest.raises(ValueError, match="N % 16"):
        paired_weight_layout(torch.zeros(1, 8, 4, dtype=torch.uint8))
    x, ids, rw = torch.randn(2, 256, dtype=torch.bfloat16), torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1)
    with pytest.raises(ValueError, match="TMA"):  # paired weights with a plain-load config
        triton_fused_moe(x, ids, rw, prepared, kernel_config(2, 3, 256, 256) | {"TMA": False})


@pytest.mark.parametrize("tokens", [1, 5, 700])  # 700 x 8 slots: the two-launch routing path
def test_route_also_permutes_activations_into_fragment_order(tokens):
    from fp4moe_ops.backends import triton_moe
    from fp4moe_ops.backends.triton_moe import fragment_order

    x = torch.randn(tokens, 512, dtype=torch.bfloat16)
    ids = torch.randint(0, 8, (tokens, 8))
    *routed, x_fragment = route(ids.to(DEVICE), 8, 16, x.to(DEVICE), 256)
    assert torch.equal(x_fragment.cpu(), fragment_order(x, 256))  # fragment_order is checked above
    alone = route(ids.to(DEVICE), 8, 16)
    used = alone[1] >= 0  # row ranges of unused blocks are never read
    assert torch.equal(routed[0], alone[0]) and torch.equal(routed[1], alone[1])
    assert torch.equal(routed[2][used], alone[2][used]) and torch.equal(routed[3][used], alone[3][used])
    assert (tokens * 8 <= triton_moe.FAST_ROUTE_MAX_SLOTS) == (tokens < 700)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="inline PTX needs a GPU")
def test_scale_ptx_on_the_gpu_every_e4m3_byte():
    # The decode's scale conversion on the hardware (tests/test_decode_asm.py runs the same PTX
    # in a CPU interpreter): every non-NaN E4M3 byte, subnormals and both zeros included.
    import triton
    import triton.language as tl

    from fp4moe_ops.backends import triton_moe

    @triton.jit
    def convert(src, dst, FAST: tl.constexpr):
        offs = tl.arange(0, 256)
        tl.store(dst + offs, triton_moe.kernels._scales_bf16(tl.load(src + offs), FAST))

    nan = torch.tensor([0x7F, 0xFF])
    data = torch.arange(256, dtype=torch.uint8)
    data = torch.where(torch.isin(data.long(), nan), torch.zeros_like(data), data).cuda()
    want = (data & 0x7F).view(torch.float8_e4m3fn).float() * 2.0**104
    for fast in (True, False):
        out = torch.empty(256, dtype=torch.bfloat16, device="cuda")
        convert[(1,)](data, out, FAST=fast)
        assert torch.equal(out.float(), want), fast


def test_fragment_order_config_with_narrow_tiles_is_refused():
    """BN below 64 or BM below 16 with fragment order gave wrong sums on H200 (the CPU
    interpreter's portable decode does not show it): such a config must fail loudly, not run."""
    w = layer(4, 512, 256)
    dev = [x.to(DEVICE) for x in kernel_tensors(w)]
    x = torch.randn(2, 512, dtype=torch.bfloat16, device=DEVICE)
    ids = torch.tensor([[0, 1], [2, 3]], device=DEVICE)
    cfg = kernel_config(4, 4, 512, 256) | dict(BN_GATE_UP=32)
    assert cfg["FRAGMENT_ORDER"]
    with pytest.raises(ValueError, match="multiples of 64"):
        triton_fused_moe(x, ids, torch.rand(2, 2, device=DEVICE), dev, cfg)
    # 8-row blocks likewise (wrong sums on H200, 2026-12-02)
    with pytest.raises(ValueError, match="BM a multiple of 16"):
        triton_fused_moe(x, ids, torch.rand(2, 2, device=DEVICE), dev, kernel_config(4, 4, 512, 256) | dict(BM=8))



@pytest.mark.parametrize("kernel,pipelined", [("down", True), ("down", False), ("gate_up", True)])
def test_static_k_loop_lets_ptxas_pipeline_the_wgmma(kernel, pipelined):
    # With a run-time K loop ptxas waited for each wgmma before issuing the next (the
    # loop's zero-trip path sets the accumulators outside a wgmma); H and I as constexprs make the
    # loop static and the wgmma overlap. benchmarks/probes/sass_count.py compiles the decode down GEMM of a
    # DeepSeek-V3 layer for sm90 with Triton's bundled ptxas (no GPU; in a process of its own,
    # since the tests run Triton's interpreter) and reports the SASS wgmma waits: 16 wgmma per K
    # step, each followed by a full wait (N = 0) when serialized. Also the prefill gate_up GEMM (merged
    # gate/up tiles, pipelined by default).
    import ast
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump").exists():
        pytest.skip("this Triton has no bundled cuobjdump")
    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = ["--tokens", "8", "--set", f"PIPELINED_DOWN={int(pipelined)}"] if kernel == "down" else \
        ["--tokens", "2048", "--gate-up"]
    run = subprocess.run([sys.executable, str(root / "benchmarks" / "probes" / "sass_count.py"), *args], capture_output=True,
                         text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    waits = ast.literal_eval(re.search(r"wgmma waits \(DEPBAR.LE gsb0, N: count\): (\{.*?\})", run.stdout).group(1))
    if pipelined:
        assert waits.get("0x0", 0) <= 1, waits  # only the wait after the loop
    else:
        assert waits.get("0x0", 0) >= 16, waits


# --- the Gluon prefill kernels (prefill_rs.py; Hopper only) ---------------------------------------

def _gluon_calls(monkeypatch):
    """Count calls of the Gluon prefill GEMMs (so a test knows that path ran)."""
    from fp4moe_ops.backends.triton_moe import prefill_rs

    from fp4moe_ops.backends.triton_moe.compile_ahead import compiling_ahead
    calls = []
    real = prefill_rs.prefill_gemms

    def counted(*args, **kwargs):
        if not compiling_ahead():  # (a layer's first call also compiles them, running nothing)
            calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(prefill_rs, "prefill_gemms", counted)
    return calls


def test_kernel_config_gluon_prefill_from_64_rows_per_expert():
    assert [kernel_config(t * 8, 256, 7168, 2048)["GLUON_PREFILL"] for t in (1, 1024, 2047, 2048, 16384)] == \
        [False, False, False, True, True]
    assert not kernel_config(8192 * 8, 256, 64, 32)["GLUON_PREFILL"]  # no TMA boxes: no paired weights


def test_gluon_kernels_on_the_triton_releases_current_torch_pins():
    # torch 2.11 pins Triton 3.6, 2.12-2.13 3.7, 2.14 3.8, 2.15 3.9; later releases are untested
    from fp4moe_ops.backends.triton_moe.launch import gluon_triton_supported

    assert all(gluon_triton_supported(v) for v in ("3.6.0", "3.6.1", "3.7.0", "3.7.1", "3.8.0", "3.9.0", "3.9.2"))
    assert not any(gluon_triton_supported(v) for v in ("3.5.1", "3.10.0", "3.60.0", "4.6.0", "3"))


def test_gluon_prefill_gemms_refuse_ring_depths_and_shapes_they_cannot_run():
    # checked before anything is launched: fewer than 3 slots would wait on their own refills (a
    # hang), rings past 227 KB do not fit in shared memory (two K steps per slot: both warpgroups'
    # weights, 2 x 8 KB, and the activations, 2 x block_m x 64 bf16: 48 KB at 128 rows, 18 KB at 8);
    # H and I must be multiples of 64 (K chunks; a partial last pair step reads zeros past K); row
    # blocks are powers of two 8..128, tails smaller and decreasing
    pytest.importorskip("triton.experimental.gluon")
    from fp4moe_ops.backends.triton_moe import prefill_rs

    def call(h, i, stages):
        x = torch.zeros(4, h, dtype=torch.bfloat16)
        gate_up_scale = torch.zeros(1, 2 * i, h // 16, dtype=torch.uint8)
        gate_up = torch.zeros(1, i, h // 4, dtype=torch.int32)
        prefill_rs.prefill_gemms(x, gate_up, gate_up_scale, None, None, None, None, None, None, None, None, None, stages=stages)

    for stages in (1, 2, 5, 6):
        with pytest.raises(ValueError, match="stages must be at least 3 and the rings fit"):
            call(512, 256, stages)
    with pytest.raises(ValueError, match="multiples of 64"):
        call(512 + 32, 256, 4)
    prefill_rs.check_config(2880, 2880, 128, 4, (64,))  # gpt-oss's sizes
    for block_m, stages, tails in ((8, 13, ()), (32, 10, ()), (64, 8, ()), (128, 5, ()), (24, 4, ()), (256, 3, ()),
                                   (64, 4, (64,)), (128, 4, (48,)), (128, 4, (32, 64)), (16, 2, ())):
        with pytest.raises(ValueError, match="block_m must be one of|stages must be at least 3"):
            prefill_rs.check_config(512, 256, block_m, stages, tails)
    # the deepest rings that fit, and valid tails, pass
    for block_m, stages, tails in ((8, 12, ()), (16, 11, ()), (32, 9, ()), (64, 7, ()), (128, 4, (64, 32, 16, 8)),
                                   (128, 3, (64,)), (64, 3, (16,))):
        prefill_rs.check_config(7168, 2048, block_m, stages, tails)


@pytest.mark.parametrize("tokens", [1, 37, 600, 2048])  # 2048 x 8 slots: the two-launch routing path
def test_route_splits_off_the_tail_level_as_split_blocks_does(tokens):
    # route(tail=64), the Gluon prefill's one tail level made by the routing kernel itself, against
    # split_blocks' torch ops over the plain block table (checked by the test below): the same
    # blocks in each launch, the same slot order
    from collections import Counter

    from fp4moe_ops.backends.triton_moe import prefill_rs

    e, k = 256, 8
    ids = torch.randint(0, e, (tokens, k))
    ids[0, 0], ids[-1, -1] = -1, e  # dropped
    sorted_slot, *tables = route(ids.to(DEVICE), e, 128, tail=64)
    plain_slot, *plain = route(ids.to(DEVICE), e, 128)
    assert torch.equal(sorted_slot, plain_slot)
    assert tables[3].numel() == e  # the tail table is indexed by expert

    def blocks(launches):
        return Counter((m, int(a), int(b), int(c)) for m, *t in launches for a, b, c in zip(*t) if a >= 0)

    want = blocks(prefill_rs.split_blocks(*plain, e, 128, (64,)))
    assert blocks([(128, *tables[:3]), (64, *tables[3:])]) == want
    assert sum(n for (m, *_), n in want.items() if m == 64) > 0  # the tail level is used


def test_route_with_no_slots_has_no_tail_blocks():
    sorted_slot, *tables = route(torch.empty(0, 8, dtype=torch.int64, device=DEVICE), 16, 128, tail=64)
    assert sorted_slot.numel() == 0 and tables[0].numel() == 0
    assert tables[3].tolist() == [-1] * 16


@pytest.mark.parametrize("tails", [(64,), (64, 32), (64, 32, 16, 8)])
def test_gluon_tail_levels_take_every_block_once(tails):
    # the launches of prefill_gemms over 128-row blocks as routing makes them: every used block in
    # exactly one launch, the one of the smallest size
    # holding its rows; tail levels on grids of min(E, blocks) programs. Unused blocks' rows are
    # garbage, as the routing kernel leaves them.
    from collections import Counter

    pytest.importorskip("triton.experimental.gluon")
    from fp4moe_ops.backends.triton_moe import prefill_rs
    from fp4moe_ops.backends.triton_moe.launch import route

    e, k = 256, 8
    sizes = (128, *tails, 0)
    for t in (1, 37, 600, 2048):
        ids = torch.randint(0, e, (t, k))
        ids[0, 0], ids[-1, -1] = -1, e  # dropped
        _, experts, starts, ends = route(ids, e, 128)
        unused = experts < 0
        starts = torch.where(unused, torch.randint(-9, 999, starts.shape, dtype=starts.dtype), starts)
        ends = torch.where(unused, torch.randint(-9, 999, ends.shape, dtype=ends.dtype), ends)
        want = Counter((int(a), int(b), int(c)) for a, b, c in zip(experts, starts, ends) if a >= 0)
        seen = Counter()
        launches = prefill_rs.split_blocks(experts, starts, ends, e, 128, tails)
        assert [m for m, *_ in launches] == list(sizes[:-1])
        for j, (m, got, got_starts, got_ends) in enumerate(launches):
            assert got.numel() == (experts.numel() if j == 0 else min(e, experts.numel()))
            for a, b, c in zip(got, got_starts, got_ends):
                if a >= 0:
                    assert sizes[j + 1] < c - b <= m
                    seen[(int(a), int(b), int(c))] += 1
        assert seen == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="wgmma: Hopper only")
@pytest.mark.parametrize("h,i", [(512, 256),  # K shorter than the ring (2 and 4 pair steps, 4 slots)
                                 # the ring wraps (16 and 8 pair steps)
                                 (2048, 1024)])
@pytest.mark.parametrize("t", [1100, 2600])  # 2200 slots: one routing launch; 5200: two (per-chunk counts)
def test_gluon_prefill_matches_float64(monkeypatch, h, i, t):
    # 8 experts, top-2, 1100 tokens: ~275 rows per expert (the Gluon prefill bucket), loads
    # skewed so that experts get 1 to 4 row blocks of 128 (2600: up to 10) with partial last
    # blocks, and the lightest a last block of at most 64 rows (the tail launch); sentinels
    # (-1, E) dropped
    e, k = 8, 2
    w = layer(e, h, i)
    x = torch.randn(t, h, dtype=torch.bfloat16)
    p = torch.tensor([0.30, 0.25, 0.15, 0.1, 0.08, 0.06, 0.05, 0.01])
    ids = torch.stack([torch.multinomial(p, k) for _ in range(t)])
    ids[0, -1] = -1
    ids[1, -1] = e
    rw = torch.rand(t, k)
    assert kernel_config(t * k, e, h, i)["GLUON_PREFILL"]
    calls = _gluon_calls(monkeypatch)
    out = triton_fused_moe(x.cuda(), ids.cuda(), rw.cuda(), [a.cuda() for a in kernel_tensors(w)]).cpu()
    assert calls == [1]
    ref = moe64(x, ids, rw, *w.tensors())
    # as test_triton_matches_float64: the intermediate and the output rounded to bf16, fp32 sums
    ulp = 2.0**-8
    torch.testing.assert_close(out.double(), ref, rtol=4 * ulp, atol=4 * ulp * ref.abs().max().item())
    assert ((out.double() - ref).norm() / ref.norm()).item() < 4 * ulp


def skewed_ids(t, e, k, block_m, tails, sentinels=(-1,)):
    """``[t, k]`` expert ids with skewed loads (8 experts: 1 to several row blocks, partial last
    blocks) such that every tail level gets a block (an expert's last rows); token i < len(sentinels)
    has its last id replaced by ``sentinels[i]`` (dropped by the kernels)."""
    p = torch.tensor([0.30, 0.25, 0.15, 0.1, 0.08, 0.06, 0.05, 0.01])
    sizes = (block_m, *tails, 0)
    for _ in range(100):
        ids = torch.stack([torch.multinomial(p, k) for _ in range(t)])
        for row, sentinel in enumerate(sentinels):
            ids[row, -1] = sentinel
        last = torch.bincount(ids[(ids >= 0) & (ids < e)], minlength=e) % block_m
        if all(((last > below) & (last <= m)).any() for m, below in zip(sizes[1:], sizes[2:])):
            return ids
    raise AssertionError(f"no routing filled every tail level {tails}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="wgmma: Hopper only")
@pytest.mark.parametrize("block_m,stages,t,tails", [(8, 8, 5, ()), (16, 4, 40, ()), (32, 3, 150, ()), (64, 6, 300, ()),
                                                   (128, 4, 1100, (64, 32)), (64, 4, 300, (16,)),
                                                   # past 4096 slots: routing by torch ops (prefill's)
                                                   (128, 4, 2100, (64,))])
def test_gluon_row_blocks_and_tails_match_float64(block_m, stages, t, tails):
    # the same kernels with narrower row blocks (wgmma N = block_m) and deeper rings where they
    # fit, and with tail blocks (a block of at most tails[j] rows in a launch of its own with
    # narrower tiles); H = 2048, I = 1024: the ring wraps. Skewed loads: partial and
    # several blocks per expert
    from fp4moe_ops.backends.triton_moe.launch import _gluon_prefill_moe

    e, h, i, k = 8, 2048, 1024, 2
    w = layer(e, h, i)
    x = torch.randn(t, h, dtype=torch.bfloat16)
    ids = skewed_ids(t, e, k, block_m, tails)
    rw = torch.rand(t, k)
    out = _gluon_prefill_moe(x.cuda(), ids.cuda(), rw.cuda(), [a.cuda() for a in kernel_tensors(w)], block_m=block_m,
                             stages=stages, tails=tails).cpu()
    ref = moe64(x, ids, rw, *w.tensors())
    ulp = 2.0**-8  # as test_gluon_prefill_matches_float64
    torch.testing.assert_close(out.double(), ref, rtol=4 * ulp, atol=4 * ulp * ref.abs().max().item())
    assert ((out.double() - ref).norm() / ref.norm()).item() < 4 * ulp


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="wgmma: Hopper only")
def test_gluon_prefill_keeps_a_nan_expert_to_its_own_tokens(monkeypatch):
    """A row block computes all its 128 rows, those past the expert's end (the next expert's
    activations) included, and stores only its own: with one expert's weights NaN and one token
    routed to it (a block of 1 row + 127 other tokens' rows), every other token keeps the output of
    clean weights bit for bit."""
    e, h, i, t, k = 8, 512, 256, 1100, 2
    w = layer(e, h, i)
    bad = fp4moe_ops.NVFP4MoEWeights(*(a.clone() for a in w.tensors()))
    bad.gate_up_global_scale[3] = float("nan")
    bad.down_global_scale[3] = float("nan")
    x = torch.randn(t, h, dtype=torch.bfloat16, device="cuda")
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    ids = torch.where(ids == 3, 5, ids)
    ids[2, 0] = 3
    ids, rw = ids.cuda(), torch.rand(t, k, device="cuda")
    calls = _gluon_calls(monkeypatch)
    clean = triton_fused_moe(x, ids, rw, [a.cuda() for a in kernel_tensors(w)])
    dirty = triton_fused_moe(x, ids, rw, [a.cuda() for a in kernel_tensors(bad)])
    assert calls == [1, 1]
    assert torch.isnan(dirty[2]).all()
    others = torch.arange(t, device="cuda") != 2
    assert torch.isfinite(dirty[others]).all()
    torch.testing.assert_close(dirty[others], clean[others], rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="decode_v3 needs Hopper (TMA, mma.sync) and Gluon")
@pytest.mark.parametrize("stages,sps,bm", [(2, 2, 16), (2, 1, 16), (3, 1, 16), (2, 2, 8)])
@pytest.mark.parametrize("i", [512, 2048])
@pytest.mark.parametrize("t", [1, 3, 16])
def test_decode_v3_matches_float64(t, i, stages, sps, bm):
    # decode_v3 (mma.sync, weights and scales through a TMA ring, four warps splitting K): the layer
    # against the float64 oracle at one token (a row block per slot) and with routed row blocks of 16
    # or 8 rows, partly filled (3 tokens: 1.5 rows per expert, past kernel_config's rule, so forced
    # here; 16: 8 rows, some experts over two blocks); I = H = 512 and 2048: 2 and 8 steps, so the
    # rings of 2 or 3 slots of 1 or 2 steps wrap
    from fp4moe_ops.backends.triton_moe.launch import _gluon_runs

    e, h, k = 8, i, 4
    w = layer(e, h, i)
    x = torch.randn(t, h, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    rw = torch.rand(t, k)
    tensors = [a.cuda() for a in kernel_tensors(w)]
    assert _gluon_runs(x.cuda())
    cfg = kernel_config(t * k, e, h, i)
    v3 = cfg | {"DECODE_V3": True, "V3_STAGES": stages, "V3_SPS": sps, "V3_SPS_ONE_TOKEN": sps, "V3_STAGES_GATE_UP": stages,
                "V3_BM": bm}
    wgmma = cfg | {"DECODE_V3": False}
    out = triton_fused_moe(x.cuda(), ids.cuda(), rw.cuda(), tensors, config=v3).cpu().double()
    ref = moe64(x, ids, rw, *w.tensors())
    # bf16 h and output: a few ulps (2^-8) of the row scale, as the other layer tests
    torch.testing.assert_close(out, ref, rtol=2**-6, atol=2**-6 * ref.abs().max().item())
    base = triton_fused_moe(x.cuda(), ids.cuda(), rw.cuda(), tensors, config=wgmma).cpu().double()
    err, base_err = ((out - ref).norm() / ref.norm()).item(), ((base - ref).norm() / ref.norm()).item()
    assert err < 2 * base_err + 1e-4, (err, base_err)  # as close as the wgmma kernels (summation order only)
