"""First pass over new shapes: what a user with varied prompts pays before
everything is compiled. A DeepSeek-V3-shaped model (full expert dims, random weights, 2 layers),
compiled static-cache ``generate`` of 16 new tokens, a fixed list of 24 calls with batch in 1..32
and prompt length 8..200; the same list twice in one process (first pass, then warm).

Each implementation runs in its own fresh process; "cold" processes start with empty Triton and
Inductor caches, "disk" processes reuse the caches the cold one left (a second start on the same
machine):

    python benchmarks/bench_first_pass.py --out benchmarks/out            # bf16, fp4moe; cold, disk
    python benchmarks/bench_first_pass.py --impls fp4moe --tree /old/tree --label before

Writes ``first_pass.json`` and ``first_pass.md`` to ``--out``. Also counts the Triton kernel
variants each fp4moe process compiled or loaded (the size of the JIT caches after both passes, and
in the JSON after each call of the first pass: which calls compiled).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def calls(n: int = 24, seed: int = 0) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(1, 32), rng.randint(8, 200)) for _ in range(n)]


def triton_variants() -> dict[str, int]:
    """Compiled variants per fp4moe Triton kernel in this process."""
    import importlib

    counts = {}
    for module in ("fp4moe_ops.backends.triton_moe.kernels", "fp4moe_ops.backends.triton_moe.prefill_rs",
                   "fp4moe_ops.backends.triton_moe.decode_v3", "fp4moe_ops.routing"):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        for name, fn in vars(mod).items():
            caches = getattr(fn, "device_caches", None)
            if name.startswith("_") and name.endswith("_kernel") and caches is not None:
                counts[name] = sum(len(c[0]) for c in caches.values())
    return counts


def model_and_generate_kwargs(impl: str, layers: int, new_tokens: int):
    """The model (BF16, or patched by fp4moe) and the keyword arguments of every ``generate`` call."""
    from transformers import CompileConfig

    from bench_e2e import deepseek_v3_layers

    model = deepseek_v3_layers(layers)
    if impl == "fp4moe":
        from hf_integration import patch_deepseek

        patch_deepseek(model, verbose=False)
    kw = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, cache_implementation="static",
              compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead"))
    return model, kw


def profile_first_call(impl: str, layers: int, new_tokens: int, top: int = 70) -> str:
    """The first call of the list under cProfile: the functions with the largest cumulative and
    own time. (In Python 3.12 cProfile follows every thread, so this is CPU time summed over the
    compile threads, not where the wall time goes.)"""
    import cProfile
    import io
    import pstats

    import torch

    model, kw = model_and_generate_kwargs(impl, layers, new_tokens)
    batch, length = calls()[0]
    prompt = torch.randint(1, 1000, (batch, length), generator=torch.Generator().manual_seed(0)).cuda()
    profile = cProfile.Profile()
    t0 = time.perf_counter()
    profile.runcall(model.generate, prompt, **kw)
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(top)
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
    return f"{impl}: first call {time.perf_counter() - t0:.2f} s under cProfile\n" + text.getvalue()


def one_process(impl: str, layers: int, new_tokens: int) -> dict:
    import torch

    model, kw = model_and_generate_kwargs(impl, layers, new_tokens)
    gen = torch.Generator().manual_seed(0)
    passes, compiled = [], []  # compiled: Triton variants in the JIT caches after each first-pass call
    for n in range(2):
        seconds = []
        for batch, length in calls():
            prompt = torch.randint(1, 1000, (batch, length), generator=gen).cuda()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.generate(prompt, **kw)
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - t0)
            if n == 0:
                compiled.append(sum(triton_variants().values()))
        passes.append(seconds)
    return {"impl": impl, "first": passes[0], "warm": passes[1], "triton_variants": triton_variants(),
            "variants_after_call": compiled}


def summary(r: dict) -> str:
    first, warm = r["first"], r["warm"]
    return (f"| {r['impl']} | {r['caches']} | {sum(first):.1f} | {statistics.median(first):.3f} | {max(first):.2f} "
            f"| {sum(warm):.2f} | {statistics.median(warm):.3f} | {sum(r['triton_variants'].values()) or '-'} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impl", choices=["bf16", "fp4moe"], help="run one process (else: the driver)")
    ap.add_argument("--impls", default="bf16,fp4moe", help="driver: implementations, each cold then disk")
    ap.add_argument("--tree", help="driver: import fp4moe_ops / hf_integration from this tree (an older commit)")
    ap.add_argument("--label", default="", help="driver: suffix for the fp4moe rows (e.g. 'before')")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--json", help="one process: write its result here")
    ap.add_argument("--out", default="benchmarks/out")
    ap.add_argument("--caches", default="cold,disk", help="driver: which starts to run (cold, disk)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="driver: run the list of implementations this many times, in reverse order every other time")
    ap.add_argument("--profile-first", action="store_true",
                    help="instead: the first call of each implementation under cProfile, empty caches")
    args = ap.parse_args()
    if args.impl and args.profile_first:
        sys.path.append(str(HERE.parent))
        Path(args.json).write_text(json.dumps(profile_first_call(args.impl, args.layers, args.new_tokens)))
        return
    if args.impl:
        sys.path.append(str(HERE.parent))  # after PYTHONPATH, where the driver puts --tree
        result = one_process(args.impl, args.layers, args.new_tokens)
        Path(args.json).write_text(json.dumps(result))
        return

    if args.caches.split(",")[0] != "cold":  # each run starts from a fresh cache directory
        ap.error("--caches: 'disk' reuses the caches of the 'cold' process before it; start with cold")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "first_pass.json"
    rows = json.loads(path.read_text())["rows"] if path.exists() else []
    impls = args.impls.split(",")
    order = [(r, impl) for r in range(args.repeat) for impl in (impls if r % 2 == 0 else impls[::-1])]
    for run, impl in order:
        cache = tempfile.mkdtemp(prefix=f"cache_{impl}_")
        env = dict(os.environ, TRITON_CACHE_DIR=f"{cache}/triton", TORCHINDUCTOR_CACHE_DIR=f"{cache}/inductor")
        if args.tree:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.tree, os.environ.get("PYTHONPATH")]))
        for caches in ("cold",) if args.profile_first else args.caches.split(","):
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                cmd = [sys.executable, __file__, "--impl", impl, "--json", f.name, "--layers", str(args.layers),
                       "--new-tokens", str(args.new_tokens)] + (["--profile-first"] if args.profile_first else [])
                t0 = time.time()
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if proc.returncode:
                    print(proc.stdout[-3000:], proc.stderr[-3000:])
                    continue
                r = json.loads(Path(f.name).read_text())
            if args.profile_first:
                (out / f"profile_first_{impl}{f'_{run + 1}' if args.repeat > 1 else ''}.txt").write_text(r)
                print(r.splitlines()[0], flush=True)
                continue
            r["impl"] = impl + (f" ({args.label})" if args.label and impl == "fp4moe" else "")
            r["caches"], r["process_s"] = caches + (f" #{run + 1}" if args.repeat > 1 else ""), time.time() - t0
            rows.append(r)
            print(summary(r), flush=True)
            path.write_text(json.dumps({"calls": calls(), "rows": rows}, indent=1))
    if args.profile_first:
        return
    import torch

    lines = [f"{torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d')}: {args.layers} DeepSeek-V3 MoE layers, "
             f"compiled static-cache generate() of {args.new_tokens} tokens, 24 calls (batch 1-32, prompt 8-200), "
             "the list twice per process", "",
             "| implementation | caches at start | first pass total s | median s | max s | warm pass total s "
             "| median s | Triton variants |", "|---|---|---|---|---|---|---|---|"]
    lines += [summary(r) for r in rows]
    (out / "first_pass.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
