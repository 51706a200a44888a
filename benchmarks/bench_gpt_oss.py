"""gpt-oss's MXFP4 experts: fp4moe's Triton kernel against Transformers' BF16 experts (``grouped_mm``),
one MoE layer at a time and end to end, in one process on one GPU.

    python benchmarks/bench_gpt_oss.py --out benchmarks/out        # H200: both parts, < 8 minutes
    python benchmarks/bench_gpt_oss.py --parts layer --tokens 1,64  # part 1 only, two token counts
    python benchmarks/bench_gpt_oss.py --tiny --out /tmp/gpt_oss    # CPU smoke test of the script

Part 1, one layer's experts (``--parts layer``): gpt-oss-120b's (E=128) and gpt-oss-20b's (E=32),
both H=2880, I=2880, top-4, clamped SwiGLU (alpha 1.702, limit 7.0). Random weights: Gaussians of
std 1/sqrt(fan-in) quantized by fp4moe's ``quantize_mxfp4`` into gpt-oss's checkpoint layout
(``*_blocks`` / ``*_scales``, gate and up rows interleaved), random BF16 biases. Routing as gpt-oss's
router makes it: the softmax over the top-4 of random logits. Method of bench_moe.py: 8 different
routings (input sets) per CUDA graph, median of 20 replays timed with CUDA events after 3 warm-up
replays; every timed implementation is first run on all the tokens and checked against fp4moe's
``reference`` backend on the first 32 (tokens are independent; a wrong one is not timed). Columns:

* ``experts hit``: distinct experts per routing (mean of the 8);
* ``fp4moe ms``: ``torch.ops.fp4moe.gpt_oss_moe`` with backend ``triton`` on the tensors
  ``layout.gpt_oss_kernel_tensors`` makes of the checkpoint's (converted once, outside the timing);
  ``unavailable`` where this fp4moe has no such function or its Triton backend refuses MXFP4 experts
  (the reason is listed under the table);
* ``floor ms``: the MXFP4 byte floor, the checkpoint bytes of the experts hit (blocks + E8M0 scales +
  BF16 biases, 13.24 MB an expert at these dims) over the device-to-device copy bandwidth measured
  here as bench_moe.py measures it (2 GiB copy, bytes read + written per second; 4.1-4.25 TB/s on
  the H200). The kernel's layout keeps H and I at 2880 and each E8M0 byte once (one per 32 values,
  90 in a 96-byte row) with float32 biases: 13.31 MB an expert (13,305,600 bytes), 1.005x these
  bytes (each E8M0 byte written twice, once per 16 values, it held 14.14 MB, 1.07x);
* ``fp4moe / floor``: fp4moe's time over the floor (1.00 would be the copy bandwidth);
* ``HF BF16 ms``: Transformers' ``GptOssExperts`` holding the same weights decoded to BF16 (its
  layout: ``gate_up_proj [E, H, 2I]``, the decoded ``[E, 2I, H]`` transposed), experts
  implementation ``grouped_mm`` (selected through the config, as ``from_config`` /
  ``from_pretrained(experts_implementation="grouped_mm")`` do); marked ``*`` where its CUDA-graph
  capture failed and it was timed eagerly (CUDA events around the 8 calls, launch gaps included);
* ``speedup``: HF BF16 ms / fp4moe ms.

Part 2, end to end (``--parts e2e``): a GptOssForCausalLM of gpt-oss-120b's dimensions (hidden
2880, 128 experts of 2880, top-4, 64 query / 8 KV heads of 64, vocabulary 201088, sliding window
128 on every other layer; ``--model 20b``: 32 experts) with ``--layers`` decoder layers (default 2;
full depth is 36 for 120b, 24 for 20b), random weights, the experts
the same random MXFP4 weights for both variants (BF16: decoded); ``--variants fp4moe`` builds the
model without any BF16 copy of the experts (:func:`gpt_oss_model_mxfp4`), so that gpt-oss-120b runs
at full depth on one 80 GB GPU (``--parts e2e --model 120b --layers 36 --variants fp4moe --batches 1
--cache-len 32768``: a static KV cache of 32k tokens, 1.2 GB, which each decoding step's attention
reads whole; batch 32 would need 39 GB of it, more than is left. Transformers' gpt-oss has no SDPA,
and its eager attention would hold a 32k-token prompt's scores, 64 x 32k x 32k, so the prompt stays
short). Compiled greedy ``generate()`` with a static cache (``generation_config.cache_implementation
= "static"``, CompileConfig(fullgraph, "reduce-overhead"): CUDA graphs), batch 1 and 32, a prompt of
128 random tokens, 64 new tokens. With ``--variants fp4moe``, ``--checkpoint DIR`` saves the model so
built as a gpt-oss MXFP4 checkpoint and times the model ``from_pretrained`` loads from it (the save
and load times are reported too); ``--also-attn flex_attention`` times fp4moe's rows again on the
same model with Transformers' flex attention, which reads the cache without expanding it to every
query head. The variants:

* ``HF BF16``: Transformers' experts with ``experts_implementation="grouped_mm"``. ``generate()``
  itself switches them to ``batched_mm`` for the decode steps on a GPU (``_optimize_model_for_decode``,
  Transformers 5.17-5.25); ``--bf16-decode grouped_mm`` keeps ``grouped_mm`` there too. Its
  ``generate()`` waits for the GPU at every step (Transformers' stop check on CUDA); at batch 1 it
  is also timed with the check read one step late, as fp4moe's models run it;
* ``fp4moe``: the experts replaced by ``MXFP4GptOssExperts`` (as fp4moe's MXFP4 quantizer replaces
  them), the same bytes copied into its buffers, biases into its parameters, the model-wide guards
  attached (:func:`hf_integration.quantizer.attach_guards`: the deferred stop check), backend ``triton``.

Decode tokens/s on a GPU = batch / the decoding step read inside one ``generate()``
(``bench_e2e.generate_step_ms``: a CUDA event per step; median and mean over 16 steps after 16 left
out, median of 3 calls). On the CPU (``--tiny``) = batch * 64 / (time of generate(1 + 64 tokens) -
time of generate(1 token)), each the median of 5 runs after a warm-up of each length (which
compiles): that difference depends on the two calls costing the same apart from their steps, which
on the GPU they did not (gpt-oss-120b at full depth: 54.3 tokens/s by the difference, 63.2 by the
steps). generate() tokens/s with the prefill included, from the 65-token calls. Peak GB:
``torch.cuda.max_memory_allocated()`` over the measurement of that row, after a reset (the model's
weights and the static cache included).

Each part has a time budget (``--layer-budget``, ``--e2e-budget``, seconds): a case that would start
past it is skipped and listed as such, so one process stays within ~8 minutes. Prints a Markdown
table per part; ``--out DIR`` writes ``gpt_oss.json`` (after every measurement) and ``gpt_oss.md``.
``--tiny``: small dimensions on the CPU, backend ``reference``, no CUDA graphs, the generate()
compile with Dynamo's ``eager`` backend (a smoke test of the script, not a measurement).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(1, str(Path(__file__).resolve().parent))
import fp4moe_ops  # noqa: E402,F401  (registers torch.ops.fp4moe)
from bench_moe import capture_graph, copy_bandwidth, eager_time_ms, error_vs_reference, replay_times_ms  # noqa: E402
from bench_e2e import generate_step_ms  # noqa: E402
from fp4moe_ops import mxfp4  # noqa: E402
from fp4moe_ops.backends import get_backend  # noqa: E402

try:  # being added: the Triton backend's layout of gpt-oss's experts
    from fp4moe_ops.backends.triton_moe.layout import gpt_oss_kernel_tensors
    LAYOUT_MISSING = None
except ImportError as exc:
    gpt_oss_kernel_tensors = None
    LAYOUT_MISSING = f"fp4moe_ops.backends.triton_moe.layout.gpt_oss_kernel_tensors is missing ({exc})"

SWIGLU_ALPHA, LIMIT = 1.702, 7.0  # gpt-oss's swiglu_alpha, swiglu_limit
LAYERS = {"gpt-oss-120b": (128, 2880, 2880, 4), "gpt-oss-20b": (32, 2880, 2880, 4)}  # E, H, I, top-k
TINY_LAYERS = {"tiny": (8, 64, 96, 4)}
TOKENS = (1, 8, 64, 512, 2048, 8192)
INPUT_SETS = 8
CHECK_TOKENS = 32  # tokens are independent: the first 32 stand for the rest in the correctness check
# Largest accepted relative error vs the reference backend: fp4moe differs by accumulation order and
# the BF16 rounding of its intermediate and output (<= 4e-3 in tests/test_gpt_oss_op.py); Transformers
# rounds every step to BF16 (< 2e-2 there)
MAX_ERROR = {"fp4moe": 1e-2, "bf16": 3e-2}
GPT_OSS_120B = dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_local_experts=128,
                    num_experts_per_tok=4, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                    sliding_window=128, max_position_embeddings=131072, pad_token_id=199999,
                    bos_token_id=199998, eos_token_id=200002)
GPT_OSS_20B = GPT_OSS_120B | dict(num_local_experts=32)
FULL_DEPTH = {"120b": 36, "20b": 24}
TINY_MODEL = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_local_experts=8, num_experts_per_tok=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                  max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def log(msg: str) -> None:
    print(msg, flush=True)


def versions() -> dict:
    import transformers

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"torch": torch.__version__, "triton": triton_version, "transformers": transformers.__version__}


# --- weights ------------------------------------------------------------------------------


@torch.no_grad()
def random_gpt_oss_experts(e: int, h: int, i: int, device, chunk: int = 16) -> list[torch.Tensor]:
    """gpt-oss's six checkpoint tensors (:data:`fp4moe_ops.gpt_oss_op.MXFP4_EXPERT_TENSORS`) of ``e``
    random experts, quantized ``chunk`` experts at a time so the float32 scratch stays ~1 GB."""
    gate_up, down = [], []
    for e0 in range(0, e, chunk):
        n = min(chunk, e - e0)
        gate, up = (torch.randn(n, i, h, device=device) / h**0.5 for _ in range(2))
        gate_up.append(mxfp4.quantize_mxfp4(mxfp4.interleave_gate_up(gate, up)))
        del gate, up
        down.append(mxfp4.quantize_mxfp4(torch.randn(n, h, i, device=device) / i**0.5))
    cat = lambda parts, j: torch.cat([p[j] for p in parts])
    bias = lambda rows: (torch.randn(e, rows, device=device) * 0.1).to(torch.bfloat16)
    return [mxfp4.to_gpt_oss_blocks(cat(gate_up, 0)), cat(gate_up, 1), bias(2 * i),
            mxfp4.to_gpt_oss_blocks(cat(down, 0)), cat(down, 1), bias(h)]


def bytes_per_expert(tensors: list[torch.Tensor], experts: int) -> float:
    """What one of ``experts`` experts occupies in ``tensors`` (whatever their layout)."""
    return sum(t.nbytes for t in tensors) / experts


@torch.no_grad()
def fill_bf16_experts(module, tensors: list[torch.Tensor], chunk: int = 16) -> None:
    """Decode the checkpoint tensors into Transformers' ``GptOssExperts`` (``[E, K, N]``: each decoded
    ``[N, K]`` transposed), a few experts at a time (bounded float32 scratch)."""
    for proj, (blocks, scales, bias) in (("gate_up_proj", tensors[0:3]), ("down_proj", tensors[3:6])):
        weight = getattr(module, proj)
        for e0 in range(0, blocks.shape[0], chunk):
            decoded = mxfp4.dequantize_gpt_oss(blocks[e0:e0 + chunk], scales[e0:e0 + chunk], weight.dtype)
            weight[e0:e0 + chunk].copy_(decoded.transpose(1, 2))
        getattr(module, f"{proj}_bias").copy_(bias)


def gpt_oss_config(dims: dict, layers: int, experts_implementation: str = "grouped_mm"):
    """A GptOssConfig. ``swiglu_alpha`` / ``swiglu_limit`` are given explicitly: Transformers 5.24's
    config has them (these defaults), 5.17's does not (its experts hard-code the same 1.702 and 7.0)
    and keeps them as plain attributes, which fp4moe's module reads."""
    from transformers import GptOssConfig

    return GptOssConfig(num_hidden_layers=layers, swiglu_alpha=SWIGLU_ALPHA, swiglu_limit=LIMIT,
                        experts_implementation=experts_implementation, **dims)


def transformers_bf16_experts(tensors: list[torch.Tensor], h: int, i: int, k: int, device):
    """Transformers' ``GptOssExperts`` on the decoded weights, experts implementation ``grouped_mm``."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = gpt_oss_config(dict(hidden_size=h, intermediate_size=i, num_local_experts=tensors[0].shape[0],
                                 num_experts_per_tok=k), layers=1)
    with torch.device("meta"):  # no float32 copy of the experts on the way
        module = GptOssExperts(config).to(torch.bfloat16)
    module = module.to_empty(device=device).requires_grad_(False)
    fill_bf16_experts(module, tensors)
    return module


# --- part 1: one layer ----------------------------------------------------------------------


def make_routings(t: int, h: int, e: int, k: int, device, n: int = INPUT_SETS) -> list[tuple]:
    """``n`` input sets ``(x, ids, weights)``: gpt-oss's router on random logits (softmax over the top-k)."""
    sets = []
    for _ in range(n):
        x = torch.randn(t, h, device=device, dtype=torch.bfloat16)
        top = torch.randn(t, e, device=device).topk(k, dim=-1)
        sets.append((x, top.indices, torch.softmax(top.values, dim=-1)))
    return sets


def event_time_ms(fn, inputs, replays: int = 20) -> float:
    """Median per-call time of the ``len(inputs)`` calls run eagerly between two CUDA events: for
    what a CUDA graph cannot capture (launch gaps and host work included)."""
    for args in inputs:
        fn(*args)
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for args in inputs:
            fn(*args)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / len(inputs))
    return statistics.median(times)


def time_ms(fn, inputs, cuda: bool) -> tuple[float, str]:
    """``(median ms per call, how)``: a CUDA graph of the 8 calls where it captures, else CUDA events
    around eager calls (said in ``how``); on the CPU, wall time of single calls."""
    if not cuda:
        return eager_time_ms(fn, inputs), "wall"
    try:
        graph = capture_graph(fn, inputs)
    except Exception as exc:  # noqa: BLE001  (any capture failure: time it without a graph)
        torch.cuda.synchronize()
        why = f"{type(exc).__name__}: {str(exc)[:160]}"
        return event_time_ms(fn, inputs), f"eager, CUDA events: graph capture failed ({why})"
    times = replay_times_ms(graph, len(inputs))
    del graph
    return statistics.median(times), "graph"


def fp4moe_layer_fn(tensors, device, tiny: bool):
    """``(fn(x, ids, weights), None)`` running fp4moe on this layer, or ``(None, reason)``."""
    if tiny:  # the CPU smoke test: the reference backend on the checkpoint tensors
        return (lambda x, ids, rw: torch.ops.fp4moe.gpt_oss_moe(x, ids, rw, tensors, SWIGLU_ALPHA, LIMIT, "reference")), None
    if gpt_oss_kernel_tensors is None:
        return None, LAYOUT_MISSING
    refusal = get_backend("triton").gpt_oss_refusal(device)
    if refusal is not None:
        return None, f"backend 'triton' refuses MXFP4 experts here: {refusal}"
    try:
        kernel = gpt_oss_kernel_tensors(tensors)
    except Exception as exc:  # noqa: BLE001  (an API still in flux: say why, time BF16 anyway)
        return None, f"gpt_oss_kernel_tensors failed: {type(exc).__name__}: {str(exc)[:300]}"
    e = tensors[0].shape[0]
    log(f"  fp4moe's kernel layout: {bytes_per_expert(kernel, e) / 1e6:.2f} MB per expert (checkpoint "
        f"{bytes_per_expert(tensors, e) / 1e6:.2f} MB)")
    return (lambda x, ids, rw: torch.ops.fp4moe.gpt_oss_moe(x, ids, rw, kernel, SWIGLU_ALPHA, LIMIT, "triton")), None


@torch.no_grad()
def layer_part(args, result: dict, save) -> None:
    cuda = not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    layers = TINY_LAYERS if args.tiny else {n: LAYERS[n] for n in args.shapes.split(",")}
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else ([1, 8, 64] if args.tiny else list(TOKENS))
    part = result["layer"] = {"input_sets": args.input_sets, "rows": [], "skipped": [], "notes": []}
    bw = copy_bandwidth(device) if cuda else float("nan")
    part["copy_bandwidth_TBps"] = bw / 1e12
    log(f"part 1: measured copy bandwidth {bw / 1e12:.2f} TB/s")
    start = time.time()
    for name, (e, h, i, k) in layers.items():
        if time.time() - start > args.layer_budget:
            part["skipped"].append(f"{name}: all token counts (time budget {args.layer_budget:.0f} s)")
            log(f"skipping {name}: time budget")
            continue
        t0 = time.time()
        tensors = random_gpt_oss_experts(e, h, i, device)
        per_expert = bytes_per_expert(tensors, e)
        ours, reason = fp4moe_layer_fn(tensors, device, args.tiny)
        if ours is None:
            part["notes"].append(f"{name}: fp4moe not timed: {reason}")
            log(f"  {name}: fp4moe not timed: {reason}")
        bf16 = transformers_bf16_experts(tensors, h, i, k, device)
        impls = {"fp4moe": ours, "bf16": lambda x, ids, rw: bf16(x, ids, rw.to(torch.bfloat16))}
        impls = {n: f for n, f in impls.items() if f is not None}
        log(f"{name}: E={e} H={h} I={i} top-{k}, {per_expert / 1e6:.2f} MB MXFP4 per expert, "
            f"BF16 experts {sum(p.nbytes for p in bf16.parameters()) / 1e9:.2f} GB ({time.time() - t0:.1f}s)")
        for t in tokens:
            if time.time() - start > args.layer_budget:
                part["skipped"].append(f"{name} T={t} (time budget {args.layer_budget:.0f} s)")
                log(f"  skipping {name} T={t}: time budget")
                continue
            inputs = make_routings(t, h, e, k, device, args.input_sets)
            hit = sum(ids.unique().numel() for _, ids, _ in inputs) / len(inputs)
            row = {"layer": name, "E": e, "H": h, "I": i, "top_k": k, "tokens": t, "experts_hit": hit,
                   "bytes_per_expert": per_expert, "floor_ms": hit * per_expert / bw * 1e3}
            if ours is None:
                row["fp4moe"] = {"error": f"unavailable: {reason}"}
            # the check runs the kernels T selects; the slow reference only on the first tokens
            first = slice(0, CHECK_TOKENS)
            ref = torch.ops.fp4moe.gpt_oss_moe(*(a[first] for a in inputs[0]), tensors, SWIGLU_ALPHA, LIMIT, "reference")
            ref = ref.double()
            for impl, fn in impls.items():
                try:
                    err = error_vs_reference(fn(*inputs[0])[first].double(), ref)
                    if err > MAX_ERROR[impl]:  # a wrong result is not timed
                        row[impl] = {"error": f"WRONG: rel err vs reference {err:.2e}"}
                        log(f"  {name} T={t} {impl}: WRONG, rel err vs reference {err:.2e}; not timed")
                        continue
                    ms, how = time_ms(fn, inputs, cuda)
                except Exception as exc:  # noqa: BLE001  (report it, time the others)
                    row[impl] = {"error": f"FAILED {type(exc).__name__}: {str(exc)[:300]}"}
                    log(f"  {name} T={t} {impl}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
                    continue
                row[impl] = {"ms": ms, "rel_err": err, "timing": how}
                log(f"  {name} T={t:5d} {impl:6s} {ms:9.4f} ms  rel err {err:.1e}  (floor {row['floor_ms']:.4f} ms, "
                    f"{hit:.1f} experts; {how})")
            part["rows"].append(row)
            save()
            del inputs
        del tensors, ours, bf16, impls
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def layer_table(result: dict) -> str:
    part = result["layer"]
    fp4moe = "fp4moe reference" if result["tiny"] else "fp4moe triton"
    lines = [f"gpt-oss MoE layer (experts only), {result['date']}, {result['device']}, torch {result['torch']}, "
             f"Triton {result['triton']}, Transformers {result['transformers']}; " +
             ("CPU smoke test (wall time of single calls, no floor)" if result["tiny"] else
              f"{part['input_sets']} routings per CUDA graph; floor: MXFP4 bytes of the experts hit (blocks + scales "
              f"+ BF16 biases) over the measured copy bandwidth {part['copy_bandwidth_TBps']:.2f} TB/s"), "",
             f"| layer | tokens | experts hit | {fp4moe} ms | MXFP4 floor ms | fp4moe / floor | "
             "HF BF16 grouped_mm ms | speedup vs BF16 |", "|---|---:|---:|---:|---:|---:|---:|---:|"]

    def cell(m: dict) -> str:
        if "ms" in m:
            return f"{m['ms']:.4f}" + ("*" if m["timing"].startswith("eager") else "")
        return m["error"].split(":")[0] if m else "-"

    eager = False
    for r in part["rows"]:
        ours, theirs = r.get("fp4moe", {}), r.get("bf16", {})
        eager |= "*" in cell(theirs) + cell(ours)
        ratio = f"{ours['ms'] / r['floor_ms']:.2f}x" if "ms" in ours and r["floor_ms"] == r["floor_ms"] else "-"
        speedup = f"{theirs['ms'] / ours['ms']:.2f}x" if "ms" in ours and "ms" in theirs else "-"
        lines.append(f"| {r['layer']} | {r['tokens']} | {r['experts_hit']:.1f} | {cell(ours)} | {r['floor_ms']:.4f} | "
                     f"{ratio} | {cell(theirs)} | {speedup} |")
    if eager:
        lines += ["", "\\* timed without a CUDA graph (its capture failed): CUDA events around 8 eager calls"]
    lines += [""] + [f"- {n}" for n in part["notes"]] + [f"- skipped: {s}" for s in part["skipped"]]
    return "\n".join(lines).rstrip() + "\n"


# --- part 2: end to end ---------------------------------------------------------------------


def gpt_oss_model(dims: dict, layers: int, device, attn: str | None = None):
    """``attn``: the attention implementation (None: Transformers' default for gpt-oss, ``eager``)."""
    from transformers import AutoModelForCausalLM

    config = gpt_oss_config(dims, layers)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation=attn)
    return model.eval().requires_grad_(False)


@torch.no_grad()
def swap_in_mxfp4_experts(model, checkpoint: list[list[torch.Tensor]], backend: str) -> str:
    """Every layer's ``GptOssExperts`` -> ``MXFP4GptOssExperts`` holding ``checkpoint[layer]`` (as
    fp4moe's MXFP4 quantizer does for a checkpoint: bytes into its buffers, biases into its
    parameters, and the model-wide guards, ``generate()``'s deferred stop check included), on
    ``backend``; returns the backend name."""
    from hf_integration.quantizer import attach_guards
    from hf_integration.surgery import replace_module

    config = model.config.get_text_config()
    for layer, tensors in zip(model.model.layers, checkpoint):
        replace_module(layer.mlp, "experts", mxfp4_experts(config, tensors, model.device))
    attach_guards(model)
    return [layer.mlp.experts.set_backend(backend) for layer in model.model.layers][0]


@torch.no_grad()
def mxfp4_experts(config, tensors: list[torch.Tensor] | None, device):
    """An ``MXFP4GptOssExperts`` on ``device`` holding the six checkpoint ``tensors`` (``None``: on the
    meta device, empty)."""
    from hf_integration import MXFP4GptOssExperts

    with torch.device("meta"):
        new = MXFP4GptOssExperts(config, dtype=torch.bfloat16)
    if tensors is None:
        return new
    new = new.to_empty(device=device)
    for target, source in zip(new.expert_tensors(), tensors):
        target.copy_(source)
    return new


@torch.no_grad()
def gpt_oss_model_mxfp4(dims: dict, layers: int, device, backend: str, attn: str | None = None):
    """The model as fp4moe holds an MXFP4 checkpoint, built without a BF16 copy of the experts (which
    for gpt-oss-120b would not fit one GPU): Transformers' model on the meta device, each layer's
    experts an ``MXFP4GptOssExperts``, everything materialised on ``device``; the rest initialised
    by Transformers' own ``initialize_weights`` (the rotary tables included), the experts filled
    with random MXFP4 tensors one layer at a time, then the model-wide guards and ``backend``.
    Returns ``(model, backend name)``."""
    from transformers import AutoModelForCausalLM

    from hf_integration.quantizer import attach_guards
    from hf_integration.surgery import replace_module

    config = gpt_oss_config(dims, layers)
    text = config.get_text_config()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation=attn)
    for layer in model.model.layers:
        replace_module(layer.mlp, "experts", mxfp4_experts(text, None, device))
        layer.mlp.experts._is_hf_initialized = True  # filled below, not by Transformers' init
    model = model.to_empty(device=device).eval().requires_grad_(False)
    model.initialize_weights()
    e, h, i = dims["num_local_experts"], dims["hidden_size"], dims["intermediate_size"]
    for layer in model.model.layers:
        tensors = random_gpt_oss_experts(e, h, i, device)
        for target, source in zip(layer.mlp.experts.expert_tensors(), tensors):
            target.copy_(source)
        del tensors
    attach_guards(model)
    return model, [layer.mlp.experts.set_backend(backend) for layer in model.model.layers][0]


def forget_compiled(model) -> None:
    """Drop what the last variant's compile holds (Dynamo's caches, generate()'s compiled call and its
    CUDA-graph pool), so the next variant compiles afresh and its peak memory is its own."""
    torch._dynamo.reset()
    for attr in ("_compiled_call", "_last_compile_config"):
        if hasattr(model, attr):
            delattr(model, attr)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def time_generate(model, batch: int, prompt_len: int, new: int, repeats: int, tiny: bool, cache_len: int | None = None):
    """(decode tokens/s, generate() tokens/s with prefill, tokens of the long run): see the module docstring."""
    from transformers import CompileConfig

    device = model.device
    prompt = torch.randint(3, model.config.vocab_size, (batch, prompt_len),
                           generator=torch.Generator().manual_seed(batch)).to(device)
    if tiny:  # Dynamo traces the whole model (fullgraph) on the CPU, no Inductor build or CUDA graphs
        compile_config = CompileConfig(fullgraph=True, backend="eager", mode="default")
        compile_config._compile_all_devices = True  # Transformers' switch for a compile on the CPU
    else:
        compile_config = CompileConfig(fullgraph=True, mode="reduce-overhead")
    model.generation_config.cache_implementation = "static"
    model.generation_config.compile_config = compile_config
    model.generation_config.max_cache_len = cache_len  # None: the prompt and the new tokens
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def run(n):  # min_new_tokens: random weights may emit EOS; every run makes n tokens per row
        return model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)

    run(1 + new), run(1)  # warm-up: compiles (the decode steps) and records the CUDA graphs
    seconds = {}
    for n in (1, 1 + new):
        times = []
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            out = run(n)
            sync()
            times.append(time.perf_counter() - t0)
        seconds[n] = statistics.median(times)
    decode = batch * new / (seconds[1 + new] - seconds[1])
    return decode, batch * (1 + new) / seconds[1 + new], out


def save_checkpoint(model, folder: Path, part: dict) -> None:
    """``--checkpoint``, first half: ``model`` (fp4moe's, built without BF16 experts) saved as a
    gpt-oss MXFP4 checkpoint (OpenAI's layout: ``*_blocks`` / ``*_scales``, ``quant_method:
    "mxfp4"``); the seconds and the size go into ``part``. The caller then drops its model, so that
    :func:`load_checkpoint` finds only the loaded one on the GPU."""
    import shutil

    from hf_integration.tiny_models import GPT_OSS_NOT_CONVERTED

    weights = sum(t.nbytes for t in list(model.parameters()) + list(model.buffers()))
    folder.mkdir(parents=True, exist_ok=True)
    if 1.1 * weights > shutil.disk_usage(folder).free:
        raise SystemExit(f"--checkpoint: {weights / 1e9:.1f} GB of weights do not fit the free disk under {folder}")
    model.config.quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": GPT_OSS_NOT_CONVERTED}
    t0 = time.perf_counter()
    try:
        model.save_pretrained(folder)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    part["checkpoint"] = {"save_s": time.perf_counter() - t0,
                          "GB_on_disk": sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 1e9}


def load_checkpoint(folder: Path, device, backend: str, attn: str | None, part: dict, log):
    """``--checkpoint``, second half: ``from_pretrained`` of :func:`save_checkpoint`'s folder as a
    user loads one (fp4moe's MXFP4 quantizer: the bytes straight into ``MXFP4GptOssExperts``);
    returns ``(loaded model, backend name)``. The load's seconds, the loaded model's memory and the
    load's peak go into ``part``; the folder is deleted after."""
    import shutil

    from transformers import AutoModelForCausalLM

    cuda = torch.device(device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else 0
    try:
        sync()
        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map=str(device),
                                                     attn_implementation=attn)
        sync()
        part["checkpoint"]["load_s"] = time.perf_counter() - t0
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if cuda:
        part["checkpoint"]["loaded_GB"] = (torch.cuda.memory_allocated() - before) / 1e9
        part["checkpoint"]["load_peak_GB"] = torch.cuda.max_memory_allocated() / 1e9
    log(f"checkpoint: saved in {part['checkpoint']['save_s']:.1f} s ({part['checkpoint']['GB_on_disk']:.2f} GB), "
        f"from_pretrained {part['checkpoint']['load_s']:.1f} s")
    model.eval().requires_grad_(False)
    return model, [layer.mlp.experts.set_backend(backend) for layer in model.model.layers][0]


def keep_grouped_mm_for_decode(model) -> None:
    """Switch off generate()'s change of the experts to ``batched_mm`` for the decode steps."""
    import contextlib

    model._optimize_model_for_decode = contextlib.nullcontext


@torch.no_grad()
def e2e_part(args, result: dict, save) -> None:
    from hf_integration.mxfp4_quantizer import MIN_TRANSFORMERS, supported

    cuda = not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    dims = TINY_MODEL if args.tiny else {"120b": GPT_OSS_120B, "20b": GPT_OSS_20B}[args.model]
    batches = [int(b) for b in args.batches.split(",")] if args.batches else ([1, 2] if args.tiny else [1, 32])
    prompt_len = args.prompt or (16 if args.tiny else 128)
    new = args.new_tokens or (8 if args.tiny else 64)
    repeats = 1 if args.tiny else 5
    part = result["e2e"] = {"model": "tiny" if args.tiny else args.model, "layers": args.layers, "prompt": prompt_len,
                            "new_tokens": new, "cache_len": args.cache_len, "rows": [],
                            "skipped": [], "notes": [], "bf16_decode": args.bf16_decode}
    if not supported():
        part["notes"].append(f"Transformers {result['transformers']} is older than fp4moe's gpt-oss path "
                             f"({'.'.join(map(str, MIN_TRANSFORMERS))}): its gpt-oss config has no swiglu_alpha / "
                             f"swiglu_limit (set here to the 1.702 / 7.0 its experts hard-code)")
    variants = args.variants.split(",")
    if not set(variants) <= {"bf16", "fp4moe"}:
        raise SystemExit(f"--variants takes bf16 and/or fp4moe, got {args.variants!r}")
    if args.checkpoint and "bf16" in variants:
        raise SystemExit("--checkpoint saves fp4moe's model built without BF16 experts: pass --variants fp4moe")
    if args.checkpoint and not supported():  # an older one loads gpt-oss's MXFP4 through its own quantizer
        raise SystemExit(f"--checkpoint: fp4moe loads gpt-oss checkpoints from Transformers "
                         f"{'.'.join(map(str, MIN_TRANSFORMERS))} on, this is {result['transformers']}")
    part["variants"] = variants
    backend = "reference" if args.tiny else "triton"
    start = time.time()
    e, h, i = dims["num_local_experts"], dims["hidden_size"], dims["intermediate_size"]
    expert_gb = lambda: sum(t.nbytes for n, t in list(model.named_parameters()) + list(model.named_buffers())
                            if ".mlp.experts." in n) / 1e9
    part["experts_GB_bf16"] = args.layers * e * 3 * i * h * 2 / 1e9  # gate_up [2I, H] + down [H, I] in BF16
    if "bf16" not in variants:
        model, name = gpt_oss_model_mxfp4(dims, args.layers, device, backend, args.attn)
        log(f"part 2: {args.layers} gpt-oss-{part['model']} layers built with MXFP4 experts, no BF16 copy "
            f"({time.time() - start:.0f}s)")
        if args.checkpoint:
            save_checkpoint(model, args.checkpoint, part)
            del model  # (the built model gone before the load: at 120b the GPU holds one copy only)
            model, name = load_checkpoint(args.checkpoint, device, backend, args.attn, part, log)
    else:
        model = gpt_oss_model(dims, args.layers, device, args.attn)
        checkpoint = []
        for layer in model.model.layers:
            tensors = random_gpt_oss_experts(e, h, i, device)
            fill_bf16_experts(layer.mlp.experts, tensors)
            # held on the host while BF16 runs, so that its peak memory holds no MXFP4 copy
            checkpoint.append([t.cpu() for t in tensors])
            del tensors
        log(f"part 2: {args.layers} gpt-oss-{part['model']} layers, experts "
            f"{part['experts_GB_bf16']:.2f} GB BF16 ({time.time() - start:.0f}s)")
    if args.bf16_decode == "grouped_mm":
        keep_grouped_mm_for_decode(model)
    decode_note = " (decode: batched_mm)" if args.bf16_decode == "transformers" else " (decode: grouped_mm kept)"
    bf16_label = "HF BF16 grouped_mm" + (decode_note if cuda else "")  # the CPU keeps grouped_mm anyway
    outputs = {}

    def rows(variant: str, also_deferred: bool = False) -> None:
        for b in batches:
            row(variant, b)
            if also_deferred and b == 1 and cuda:
                # Transformers' loop waits for the GPU every step on CUDA; fp4moe's models read the stop
                # flag one step late (hf_integration.deferred_stop). BF16 in that loop too, so the table
                # holds the loop's share and the kernels' share apart.
                from hf_integration.deferred_stop import deferring

                with deferring():
                    row(variant + ", stop check deferred", b)

    def row(variant: str, b: int) -> None:
        if time.time() - start > args.e2e_budget:
            part["skipped"].append(f"{variant} batch {b} (time budget {args.e2e_budget:.0f} s)")
            log(f"skipping {variant} batch {b}: time budget")
            return
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        resident = torch.cuda.memory_allocated() / 1e9 if cuda else float("nan")
        t0 = time.time()
        try:
            decode, generate_tps, out = time_generate(model, b, prompt_len, new, repeats, args.tiny, args.cache_len)
        except Exception as exc:  # noqa: BLE001  (report it, go on with the next case)
            error = f"{type(exc).__name__}: {str(exc)[:300]}"
            part["rows"].append({"variant": variant, "batch": b, "error": error})
            log(f"{variant} batch {b}: FAILED {error}")
            save()
            return
        outputs[(variant, b)] = out[:, prompt_len:].cpu()
        # the step read inside one call (CUDA events) gives the GPU's decode rate: the two-call
        # difference above can misread a loop whose calls differ apart from their steps; reuses the
        # static cache sized above
        steps = generate_step_ms(model, b, 16, skip=16, runs=3) if cuda else {}
        if cuda:
            decode = b * 1e3 / steps["step"]
        peak = torch.cuda.max_memory_allocated() / 1e9 if cuda else float("nan")
        measured = {"variant": variant, "batch": b, "decode_tokens_per_s": decode, "generate_tokens_per_s": generate_tps,
                    "step_ms": steps.get("step", float("nan")), "step_mean_ms": steps.get("mean", float("nan")),
                    "peak_GB": peak, "resident_GB": resident, "seconds": time.time() - t0}
        part["rows"].append(measured)
        log(f"{variant:28s} batch {b:3d}: decode {decode:9.1f} tok/s, generate() {generate_tps:8.1f} tok/s "
            f"(prefill incl.), step {measured['step_ms']:.3f} ms (mean {measured['step_mean_ms']:.3f}), "
            f"peak {peak:6.2f} GB, weights {resident:6.2f} GB ({measured['seconds']:.0f}s)")
        save()

    if "bf16" in variants:
        rows(bf16_label, also_deferred=True)
        forget_compiled(model)
        name = None
        if "fp4moe" in variants:
            try:
                name = swap_in_mxfp4_experts(model, checkpoint, backend)
            except Exception as exc:  # noqa: BLE001  (e.g. the Triton backend refusing MXFP4 experts)
                part["notes"].append(f"fp4moe not run: MXFP4GptOssExperts.set_backend({backend!r}) failed: "
                                     f"{type(exc).__name__}: {str(exc)[:300]}")
                log(part["notes"][-1])
        del checkpoint
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    part["experts_GB_mxfp4"] = expert_gb()
    if name is not None:
        log(f"experts now MXFP4GptOssExperts ({part['experts_GB_mxfp4']:.2f} GB), backend {name}")
        rows(f"fp4moe {name}")
        ours_label = f"fp4moe {name}"
        for b in batches:  # same weights (BF16: decoded): greedy tokens agree unless a near-tie flips
            if (bf16_label, b) in outputs and (ours_label, b) in outputs:
                same = (outputs[(bf16_label, b)] == outputs[(ours_label, b)]).cumprod(dim=1).sum(dim=1)
                part["notes"].append(f"batch {b}: fp4moe's greedy tokens equal BF16's for the first "
                                     f"{same.min().item()}-{same.max().item()} of {1 + new} tokens (per row, min-max)")
        save()
        if args.also_attn:  # the same model and weights, another attention (no second build)
            forget_compiled(model)
            try:
                model.set_attn_implementation(args.also_attn)
            except Exception as exc:  # noqa: BLE001  (Transformers refuses an implementation the model lacks)
                part["notes"].append(f"--also-attn {args.also_attn}: {type(exc).__name__}: {str(exc)[:200]}")
                log(part["notes"][-1])
            else:
                rows(f"fp4moe {name}, attention {args.also_attn}")
    forget_compiled(model)


def e2e_table(result: dict) -> str:
    part = result["e2e"]
    lines = [f"gpt-oss end to end, {result['date']}, {result['device']}, torch {result['torch']}, Triton "
             f"{result['triton']}, Transformers {result['transformers']}: {part['layers']} gpt-oss-"
             f"{part.get('model', '120b')}-shaped layers, random weights, compiled static-cache greedy "
             f"generate(), prompt {part['prompt']}, {part['new_tokens']} new tokens"
             + (f", static cache of {part['cache_len']} tokens" if part.get("cache_len") else ""), "",
             "| variant | batch | decode tokens/s | generate() tokens/s (prefill incl.) | step ms, read in one call "
             "(median / mean) | peak GB | speedup vs BF16 |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    base = {r["batch"]: r for r in part["rows"]
            if r["variant"].startswith("HF BF16") and "deferred" not in r["variant"] and "error" not in r}
    for r in part["rows"]:
        if "error" in r:
            lines.append(f"| {r['variant']} | {r['batch']} | FAILED: {r['error'][:80]} | | | | |")
            continue
        b = base.get(r["batch"])
        speedup = f"{r['decode_tokens_per_s'] / b['decode_tokens_per_s']:.2f}x" if b and b is not r else "-"
        peak = f"{r['peak_GB']:.2f}" if r["peak_GB"] == r["peak_GB"] else "-"
        step = (f"{r['step_ms']:.3f} / {r['step_mean_ms']:.3f}" if r.get("step_ms", float("nan")) == r.get("step_ms")
                else "-")
        lines.append(f"| {r['variant']} | {r['batch']} | {r['decode_tokens_per_s']:.1f} | "
                     f"{r['generate_tokens_per_s']:.1f} | {step} | {peak} | {speedup} |")
    if "experts_GB_mxfp4" in part:
        lines += ["", f"Expert weights: {part['experts_GB_bf16']:.2f} GB in BF16 (from the shapes), {part['experts_GB_mxfp4']:.2f} GB "
                      "as fp4moe's module holds them (its own tensors; a backend's converted copy not counted)."]
    if "checkpoint" in part:
        c = part["checkpoint"]
        lines += ["", f"Through a checkpoint (`--checkpoint`): save_pretrained {c['save_s']:.1f} s, {c['GB_on_disk']:.2f} GB "
                      f"on disk; from_pretrained {c['load_s']:.1f} s"
                      + (f", the loaded model {c['loaded_GB']:.2f} GB of GPU memory, {c['load_peak_GB']:.2f} GB at the "
                         "load's peak" if "loaded_GB" in c else "") + "; the rows above time the loaded model."]
    lines += [""] + [f"- {n}" for n in part["notes"]] + [f"- skipped: {s}" for s in part["skipped"]]
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="layer,e2e", help="comma-separated: layer (part 1), e2e (part 2)")
    ap.add_argument("--shapes", default=",".join(LAYERS), help=f"part 1's layers, of {list(LAYERS)}")
    ap.add_argument("--tokens", default=None, help=f"part 1's token counts (default {','.join(map(str, TOKENS))})")
    ap.add_argument("--input-sets", type=int, default=INPUT_SETS, help="routings per CUDA graph")
    ap.add_argument("--model", choices=("120b", "20b"), default="120b", help="part 2's dimensions")
    ap.add_argument("--layers", type=int, default=2, help=f"part 2's decoder layers (full depth: {FULL_DEPTH})")
    ap.add_argument("--batches", default=None, help="part 2's batch sizes (default 1,32)")
    ap.add_argument("--prompt", type=int, default=None, help="part 2's prompt tokens (default 128)")
    ap.add_argument("--new-tokens", type=int, default=None, help="part 2's new tokens (default 64)")
    ap.add_argument("--variants", default="bf16,fp4moe",
                    help="part 2's variants; fp4moe alone builds the model without a BF16 copy of the experts "
                         "(gpt-oss-120b at full depth fits one 80 GB GPU only so)")
    ap.add_argument("--cache-len", type=int, default=None,
                    help="part 2's static KV cache length (Transformers' generation_config.max_cache_len); "
                         "default: the prompt and the new tokens")
    ap.add_argument("--checkpoint", type=Path, default=None, metavar="DIR",
                    help="part 2 with --variants fp4moe: the built model saved as a gpt-oss MXFP4 checkpoint in DIR "
                         "and loaded back with from_pretrained; the rows time the loaded model (DIR deleted after)")
    ap.add_argument("--also-attn", default=None, metavar="IMPL",
                    help="part 2: fp4moe's rows again with this attention implementation (e.g. flex_attention), "
                         "set on the same model")
    ap.add_argument("--attn", default=None, help="part 2's attention implementation (default: Transformers' for gpt-oss, "
                    "eager; e.g. flex_attention)")
    ap.add_argument("--bf16-decode", choices=("transformers", "grouped_mm"), default="transformers",
                    help="HF BF16's decode steps: as generate() runs them (batched_mm), or grouped_mm kept")
    ap.add_argument("--layer-budget", type=float, default=170, help="seconds: part 1 starts no case past it")
    ap.add_argument("--e2e-budget", type=float, default=210, help="seconds: part 2 starts no case past it")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="small dimensions on the CPU (smoke test of the script)")
    ap.add_argument("--out", type=Path, default=None, help="write gpt_oss.json and gpt_oss.md here")
    args = ap.parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (or --tiny for a CPU smoke test)")
    parts = args.parts.split(",")
    torch.manual_seed(args.seed)
    result = {"device": torch.cuda.get_device_name() if not args.tiny else "CPU", "date": time.strftime("%Y-%m-%d"),
              "tiny": args.tiny, **versions(), "fp4moe_layout": LAYOUT_MISSING or "present"}
    log(f"{result['device']}, torch {result['torch']}, Triton {result['triton']}, Transformers "
        f"{result['transformers']}; fp4moe's gpt-oss Triton layout: {result['fp4moe_layout']}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)

    steps = (("layer", layer_part, layer_table), ("e2e", e2e_part, e2e_table))

    def save() -> None:  # after every measurement: a run stopped by a timeout keeps what it measured
        if args.out is not None:
            (args.out / "gpt_oss.json").write_text(json.dumps(result, indent=1, default=str))
            (args.out / "gpt_oss.md").write_text("\n".join(table(result) for name, _, table in steps if name in result))

    for name, run, table in steps:
        if name in parts:
            run(args, result, save)
            log("\n" + table(result))
            save()
    return result


if __name__ == "__main__":
    main()
