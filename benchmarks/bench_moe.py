"""Fused-MoE layer benchmark: fp4moe's Triton kernel vs FlashInfer CUTLASS (W4A16-MXFP4, BF16),
torch ``_grouped_mm`` BF16 and the reference, side by side in one process.

    python benchmarks/bench_moe.py                      # GPU: DeepSeek-V3 layer, all token counts
    python benchmarks/bench_moe.py --shape small        # CPU: reference on a small shape (CI)
    python benchmarks/bench_moe.py --backends triton,triton_single_role,grouped_mm,reference \
        --tokens 1,8,64,512,2048,8192 --input-sets 8      # the Triton-release table (RESULTS.md)

``triton_single_role``: the same prepared experts with the Gluon kernels switched off, so the
single-role Triton kernels (what an unsupported Triton release or FP4MOE_GLUON=0 runs) are timed
in the same process as the fast path. The log names the kernel family ``triton`` ran per token count.

Method: random NVFP4 weights (quantized from Gaussians), random top-k routing; several input
sets rotated inside one CUDA graph so neither L2 nor a fixed routing flatters; median of graph
replays timed with CUDA events. Every timed kernel is first checked against the reference
(on the first 32 tokens: tokens are independent). The byte floor is the NVFP4 bytes of the
experts actually hit (weights + block scales) over the measured device-copy bandwidth.
Writes ``results_<shape>.json``, ``results_<shape>.md`` and ``latency_<shape>.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import fp4moe_ops  # noqa: E402
from fp4moe_ops import mxfp4, nvfp4  # noqa: E402

SHAPES = {  # name: (E local, H, I, top_k, E routed over)
    "deepseek": (256, 7168, 2048, 8, 256),
    "ep32": (32, 7168, 2048, 8, 256),  # expert-parallel shard: ids >= 32 are other ranks'
    "tp256": (256, 7168, 256, 8, 256),  # tensor-parallel shard (TP=8)
    "small": (8, 256, 128, 2, 8),
    "shared": (1, 7168, 2048, 1, 1),  # DeepSeek-V3's shared expert as a one-expert MoE (quantize_dense_mlps)
}
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 512, 2048, 8192)
INPUT_SETS = 4


def log(msg: str) -> None:
    print(msg, flush=True)


def random_weights(e: int, h: int, i: int, device) -> fp4moe_ops.NVFP4MoEWeights:
    """Quantize Gaussian experts a few at a time (bounded fp32 scratch)."""
    parts = []
    for e0 in range(0, e, 16):
        n = min(16, e - e0)
        gate_up = torch.randn(n, 2 * i, h, device=device) / h**0.5
        down = torch.randn(n, h, i, device=device) / i**0.5
        parts.append(fp4moe_ops.quantize_moe_weights(gate_up, down))
    return fp4moe_ops.NVFP4MoEWeights(*(torch.cat([p.tensors()[n] for p in parts]) for n in range(6)))


def bf16_weights(w: fp4moe_ops.NVFP4MoEWeights):
    """Dequantize expert by expert to bf16 ([gate; up] order), bounded scratch."""
    gate_up = torch.empty(w.num_experts, 2 * w.intermediate_size, w.hidden_size, dtype=torch.bfloat16, device=w.device)
    down = torch.empty(w.num_experts, w.hidden_size, w.intermediate_size, dtype=torch.bfloat16, device=w.device)
    for e in range(w.num_experts):
        gate_up[e] = nvfp4.dequantize_nvfp4(w.gate_up[e], w.gate_up_scale[e], w.gate_up_global_scale[e], torch.bfloat16)
        down[e] = nvfp4.dequantize_nvfp4(w.down[e], w.down_scale[e], w.down_global_scale[e], torch.bfloat16)
    return gate_up, down


def grouped_mm_moe(x, ids, rw, gate_up_t, down_t, num_experts):
    """torch._grouped_mm BF16 MoE (what Transformers' grouped_mm experts do). ``gate_up_t`` is
    ``[E, H, 2I]`` ([gate; up] columns), ``down_t`` ``[E, I, H]``."""
    k = ids.shape[1]
    flat = ids.reshape(-1)
    valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, num_experts)
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=x.device).scatter_add_(0, key, torch.ones_like(key, dtype=torch.int32))
    offs = torch.cumsum(counts[:num_experts], 0, dtype=torch.int32)
    tok = order // k
    h = torch._grouped_mm(x[tok], gate_up_t, offs=offs)
    gate, up = h.chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, down_t, offs=offs)
    weight = torch.where(valid, rw.reshape(-1), 0.0)[order]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    return out.index_add_(0, tok, y.float() * weight[:, None]).to(x.dtype)


def copy_bandwidth(device) -> float:
    """Device-to-device copy, bytes read + written per second (the HBM ceiling we use)."""
    a = torch.empty(2 * 1024**3, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); b.copy_(a); e.record(); torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * a.numel() / statistics.median(times)


def capture_graph(fn, inputs) -> torch.cuda.CUDAGraph:
    """A CUDA graph that calls ``fn`` once per input set (run once eagerly first, on a side
    stream), replayed three times to warm up."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for args in inputs:
            fn(*args)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for args in inputs:
                fn(*args)
    torch.cuda.current_stream().wait_stream(s)
    for _ in range(3):
        g.replay()
    return g


def replay_times_ms(g: torch.cuda.CUDAGraph, calls: int, replays: int = 20) -> list[float]:
    """Each replay's time from CUDA events, per call of the ``calls`` the graph holds."""
    times = []
    for _ in range(replays):
        st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        st.record(); g.replay(); en.record(); torch.cuda.synchronize()
        times.append(st.elapsed_time(en) / calls)
    return times


def graph_time_ms(fn, inputs, replays=20) -> float:
    """Median per-call time of a CUDA graph that calls ``fn`` once per input set."""
    g = capture_graph(fn, inputs)
    times = replay_times_ms(g, len(inputs), replays)
    del g
    return statistics.median(times)


def eager_time_ms(fn, inputs, reps=3) -> float:
    """Median wall time of single calls (synchronized): for the slow reference, CPU too."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn(*inputs[0])
    sync()
    times = []
    for r in range(reps):
        start = time.perf_counter()
        fn(*inputs[r % len(inputs)])
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


# Largest accepted error vs the reference: exact-weight paths differ by fp32 summation order and
# bf16 roundings (<= 1.2e-3 measured); W4A16-MXFP4 re-quantizes the weights (0.20 measured).
MAX_ERROR = {"flashinfer_mxfp4": 0.5}


def error_vs_reference(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error; when no slot was routed here (expert-parallel shard), the
    reference is all zeros and the output must be too: then the largest |out|."""
    ref_norm = ref.norm().item()
    if ref_norm == 0.0:
        return out.abs().max().item()
    return ((out - ref).norm() / ref_norm).item()


def without_gluon(fn):
    """``fn`` with the Gluon kernels switched off while it runs (and while a CUDA graph captures it)."""
    from fp4moe_ops.backends.triton_moe import launch

    def call(*args):
        saved, launch._gluon_runs = launch._gluon_runs, lambda x: False
        try:
            return fn(*args)
        finally:
            launch._gluon_runs = saved

    return call


def make_inputs(t, h, k, routed_over, device, n=INPUT_SETS):
    sets = []
    for _ in range(n):
        x = torch.randn(t, h, device=device, dtype=torch.bfloat16)
        ids = torch.rand(t, routed_over, device=device).argsort(dim=1)[:, :k].contiguous()
        rw = torch.softmax(torch.randn(t, k, device=device), -1)
        sets.append((x, ids, rw))
    return sets


def distinct_experts(inputs, num_experts) -> float:
    hit = [((ids >= 0) & (ids < num_experts)).any() and ids[(ids >= 0) & (ids < num_experts)].unique().numel()
           for _, ids, _ in inputs]
    return sum(int(x) for x in hit) / len(hit)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default=None, choices=sorted(SHAPES), help="default: deepseek on GPU, small on CPU")
    ap.add_argument("--tokens", default=None, help="comma-separated token counts")
    ap.add_argument("--backends", default="triton,flashinfer_mxfp4,flashinfer_bf16,grouped_mm,reference")
    ap.add_argument("--out", default="benchmarks/out")
    ap.add_argument("--reference-max-tokens", type=int, default=8, help="time the (slow) reference only up to this")
    ap.add_argument("--input-sets", type=int, default=INPUT_SETS, help="routings (input sets) per CUDA graph")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    shape = args.shape or ("deepseek" if cuda else "small")
    e, h, i, k, routed_over = SHAPES[shape]
    tokens = [int(x) for x in args.tokens.split(",")] if args.tokens else (list(TOKENS) if cuda else [1, 8])
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(int(time.time()))

    name = torch.cuda.get_device_name() if cuda else "cpu"
    log(f"device: {name}; shape {shape}: E={e} H={h} I={i} top-{k} (routed over {routed_over}); torch {torch.__version__}")
    bw = copy_bandwidth(device) if cuda else float("nan")
    log(f"measured copy bandwidth: {bw / 1e12:.2f} TB/s")

    t0 = time.time()
    w = random_weights(e, h, i, device)
    log(f"weights: {w.nbytes() / 1e9:.2f} GB NVFP4 ({time.time() - t0:.1f}s)")
    wanted = args.backends.split(",")
    impls = {}
    if "reference" in wanted:
        impls["reference"] = fp4moe_ops.prepare_experts(w, "reference")
    if cuda:
        for b in ("triton", "flashinfer_mxfp4", "flashinfer_bf16"):
            if b in wanted:
                try:
                    impls[b] = fp4moe_ops.prepare_experts(w, b)
                    # an expert-parallel shard: tell the op how many experts the router spans
                    impls[b].routed_experts = routed_over if routed_over != e else 0
                except Exception as exc:  # report, keep benchmarking the others
                    log(f"{b}: unavailable: {exc}")
        if "triton_single_role" in wanted and "triton" in impls:
            impls["triton_single_role"] = without_gluon(impls["triton"])
        if "grouped_mm" in wanted:
            gate_up, down = bf16_weights(w)
            gate_up_t, down_t = gate_up.transpose(1, 2), down.transpose(1, 2)
            impls["grouped_mm"] = lambda x, ids, rw: grouped_mm_moe(x, ids, rw, gate_up_t, down_t, e)
        if "flashinfer_mxfp4" in impls:
            first = nvfp4.NVFP4Tensor(w.gate_up[:8], w.gate_up_scale[:8], w.gate_up_global_scale[:8])
            log(f"MXFP4 re-quantization weight error (gate_up): {mxfp4.mxfp4_requant_error(first):.3e}")
    bytes_per_expert = 3 * h * i * (0.5 + 1 / 16)

    rows = []
    for t in tokens:
        inputs = make_inputs(t, h, k, routed_over, device, args.input_sets)
        hit = distinct_experts(inputs, e)
        if cuda and "triton" in impls:
            from fp4moe_ops.backends.triton_moe.launch import kernel_family

            log(f"T={t}: triton runs {kernel_family(inputs[0][0], t * k, e, h, i, impls['triton'].routed_experts)}")
        floor_ms = hit * bytes_per_expert / bw * 1e3 if cuda else float("nan")
        sub = slice(0, min(t, 32))
        x0, ids0, rw0 = inputs[0]
        ref = impls["reference"](x0[sub], ids0[sub], rw0[sub]).double() if "reference" in impls else None
        row = {"tokens": t, "experts_hit": hit, "floor_ms": floor_ms}
        for b, fn in impls.items():
            if b == "reference" and t > args.reference_max_tokens:
                continue
            try:
                out = fn(x0, ids0, rw0)
                err = error_vs_reference(out[sub].double(), ref) if ref is not None else float("nan")
                if err > MAX_ERROR.get(b, 1e-2):  # checked before timing: a wrong kernel is not timed
                    log(f"  T={t} {b}: WRONG, rel err vs reference {err:.2e}; not timed")
                    continue
                ms = graph_time_ms(fn, inputs) if cuda and b != "reference" else eager_time_ms(fn, inputs)
            except Exception as exc:
                log(f"  T={t} {b}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
                continue
            row[b] = {"ms": ms, "rel_err": err}
            checked = f"rel err vs reference {err:.2e}" if ref is not None else "not checked (no reference backend)"
            log(f"  T={t:5d} {b:17s} {ms:9.4f} ms  {checked}  (floor {floor_ms:.4f} ms, {hit:.0f} experts)")
        rows.append(row)
        del inputs

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    result = {"device": name, "shape": shape, "E": e, "H": h, "I": i, "top_k": k,
              "copy_bandwidth_TBps": bw / 1e12, "torch": torch.__version__, "triton": triton_version,
              "input_sets": args.input_sets,
              "date": time.strftime("%Y-%m-%d"), "rows": rows}
    (out_dir / f"results_{shape}.json").write_text(json.dumps(result, indent=1))
    md = markdown_table(result, list(impls))
    (out_dir / f"results_{shape}.md").write_text(md)
    print(md)
    if cuda:
        plot(result, list(impls), out_dir / f"latency_{shape}.png")


def markdown_table(result, names) -> str:
    peers = [n for n in names if n != "triton"]
    head = ["tokens", "experts hit", "floor ms"] + [f"{n} ms" for n in names]
    if "triton" in names:
        head += ["ours TB/s", "ours / floor"] + [f"speedup vs {n}" for n in peers]
    lines = [f"Device {result['device']}, {result['date']}, torch {result['torch']}, Triton {result['triton']}, shape "
             f"{result['shape']} (E={result['E']}, H={result['H']}, I={result['I']}, top-{result['top_k']}), "
             f"{result['input_sets']} routings per graph, copy bandwidth {result['copy_bandwidth_TBps']:.2f} TB/s",
             "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["rows"]:
        cells = [str(r["tokens"]), f"{r['experts_hit']:.0f}", f"{r['floor_ms']:.4f}"]
        cells += [f"{r[n]['ms']:.4f}" if n in r else "-" for n in names]
        if "triton" in names and "triton" in r:
            ours = r["triton"]["ms"]
            floor_bytes_tbps = r["floor_ms"] / ours * result["copy_bandwidth_TBps"]
            cells += [f"{floor_bytes_tbps:.2f}", f"{ours / r['floor_ms']:.2f}x"]
            cells += [f"{r[n]['ms'] / ours:.2f}x" if n in r else "-" for n in peers]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(result, names, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    toks = [r["tokens"] for r in result["rows"]]
    ax.plot(toks, [r["floor_ms"] for r in result["rows"]], "k--", label="NVFP4 byte floor")
    for n in names:
        pts = [(r["tokens"], r[n]["ms"]) for r in result["rows"] if n in r]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=n)
    ax.set_xscale("log", base=2); ax.set_yscale("log")
    ax.set_xlabel("tokens"); ax.set_ylabel("ms per MoE layer (median graph replay)")
    ax.set_title(f"{result['device']}: {result['shape']} MoE layer")
    ax.grid(True, which="both", alpha=0.3); ax.legend(fontsize=8)
    fig.tight_layout(); fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
