"""Load a generated multi-layer, full-size ModelOpt NVFP4 DeepSeek-V3 checkpoint onto one GPU and
generate with the GPU backend; reports load time, memory and decode speed.

    python benchmarks/bench_modelopt_gpu.py --dir /tmp/fp4moe-ckpt --layers 3 --out benchmarks/out

The checkpoint (random but valid NVFP4 bytes; layer 0 a dense NVFP4 MLP as in DeepSeek-V3's
first layers, the rest MoE layers with 256 full-size experts and a shared expert) is written
first; a fresh process then loads it with ``AutoModelForCausalLM.from_pretrained(path,
device_map="cuda")`` (fp4moe's registered quantizer) and reports:
load seconds, peak host RSS, GPU memory, the relative difference of the first MoE layer's
output (and of the logits) between the GPU backend and the reference backend on the same
loaded weights, greedy tokens eager vs compiled (static cache + CUDA graphs), and decode
tokens/s. Results go to ``modelopt_gpu.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_load_memory import write_checkpoint  # noqa: E402

ROOT = str(Path(__file__).resolve().parent.parent)

CHILD = r"""
import json, resource, statistics, sys, time
sys.path.insert(0, {root!r})
import torch
from transformers import CompileConfig
from transformers import AutoModelForCausalLM
from hf_integration import find_experts_modules, set_backend

res = {{}}
t0 = time.time()
model = AutoModelForCausalLM.from_pretrained({path!r}, dtype=torch.bfloat16, device_map="cuda")
torch.cuda.synchronize()
res["load_s"] = time.time() - t0
res["peak_rss_GB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
res["gpu_allocated_GB"] = torch.cuda.memory_allocated() / 1e9
res["gpu_peak_load_GB"] = torch.cuda.max_memory_allocated() / 1e9
res["backend"] = find_experts_modules(model)[0][1].backend
print("loaded", res, flush=True)

vocab = min(1000, model.config.vocab_size)
prompt = torch.randint(1, vocab, (1, 8), device="cuda")
# the first MoE layer's experts output (same input under both backends) and the logits
outputs = []
hook = find_experts_modules(model)[0][1].register_forward_hook(lambda m, a, out: outputs.append(out.float()))
with torch.no_grad():
    fast = model(prompt).logits.float()
    set_backend(model, "reference")
    ref = model(prompt).logits.float()
    set_backend(model, "auto")
hook.remove()
rel = lambda a, b: ((a - b).norm() / b.norm()).item()
res["experts_rel_diff_vs_reference"] = rel(outputs[0], outputs[1])
res["logits_rel_diff_vs_reference"] = rel(fast, ref)
res["logits_finite"] = bool(torch.isfinite(fast).all())
print("gpu backend vs reference backend: first MoE layer's experts output rel diff",
      res["experts_rel_diff_vs_reference"], "logits rel diff", res["logits_rel_diff_vs_reference"], flush=True)

def generate(batch, new_tokens, compiled):
    ids = torch.randint(1, vocab, (batch, 16), device="cuda", generator=torch.Generator("cuda").manual_seed(batch))
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    if compiled:
        kw.update(cache_implementation="static", compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead"))
    else:
        kw.update(disable_compile=True)
    out = model.generate(ids, **kw)
    times = []
    for _ in range(3):
        torch.cuda.synchronize(); t = time.perf_counter()
        out = model.generate(ids, **kw)
        torch.cuda.synchronize(); times.append(time.perf_counter() - t)
    return batch * new_tokens / statistics.median(times), out

res["rows"] = []
for batch in (1, 8):
    torch.cuda.reset_peak_memory_stats()
    eager_tps, eager = generate(batch, 16, False)
    comp_tps, comp = generate(batch, 16, True)
    row = dict(batch=batch, eager_tok_s=eager_tps, compiled_tok_s=comp_tps,
               greedy_equal=bool(torch.equal(eager, comp)), peak_GB=torch.cuda.max_memory_allocated() / 1e9)
    res["rows"].append(row)
    print(row, flush=True)
print("RESULT " + json.dumps(res), flush=True)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/fp4moe-ckpt")
    ap.add_argument("--layers", type=int, default=3, help="decoder layers; layer 0 dense, the rest MoE")
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--out", default="benchmarks/out")
    args = ap.parse_args()
    path = Path(args.dir)
    t0 = time.time()
    size = write_checkpoint(path, args.layers, first_k_dense=1, vocab_size=args.vocab,
                            device="cuda" if torch.cuda.is_available() else "cpu")
    write_s = time.time() - t0
    print(f"wrote {size / 1e9:.2f} GB checkpoint ({args.layers} layers, {args.layers - 1} MoE) in {write_s:.0f}s",
          flush=True)
    proc = subprocess.run([sys.executable, "-c", CHILD.format(root=ROOT, path=str(path))],
                          capture_output=True, text=True)
    print(proc.stdout[-4000:], proc.stderr[-3000:] if proc.returncode else "", flush=True)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"child failed (rc {proc.returncode})")
    res = json.loads(line[len("RESULT "):])
    res.update(checkpoint_GB=size / 1e9, write_s=write_s, layers=args.layers, vocab=args.vocab,
               device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               date=time.strftime("%Y-%m-%d"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "modelopt_gpu.json").write_text(json.dumps(res, indent=1))
    print(f"checkpoint {size / 1e9:.2f} GB: load {res['load_s']:.1f}s, peak host RSS {res['peak_rss_GB']:.2f} GB, "
          f"GPU {res['gpu_allocated_GB']:.2f} GB after load; experts output vs reference backend "
          f"{res['experts_rel_diff_vs_reference']:.2e}")


if __name__ == "__main__":
    main()
