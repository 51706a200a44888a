"""fp4moe demo: build a tiny random DeepSeek-V3, patch its experts to NVFP4, compile, generate.

    python -m hf_integration.demo            # CPU: reference backend; GPU: the GPU backend

Prints what ran: the backend, the router op, the experts' error against BF16, compile graph breaks,
tokens/s.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from hf_integration import find_experts_modules, patch_deepseek
from hf_integration.tiny_models import tiny_deepseek_v3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--new-tokens", type=int, default=16)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, torch {torch.__version__}")

    with torch.device(device):
        model = tiny_deepseek_v3(seed=0)
    bf16 = copy.deepcopy(model)
    t0 = time.perf_counter()
    patch_deepseek(model, backend=args.backend, verbose=False)
    experts = find_experts_modules(model)
    print(f"patched {len(experts)} MoE layer(s) in {time.perf_counter() - t0:.2f}s: {experts[0][1].extra_repr()}")
    routers = [m for m in model.modules() if "grouped_topk" in m.extra_repr()]
    print(f"routers: {len(routers)} run as one fp4moe::grouped_topk op each "
          f"({'Triton kernel' if device == 'cuda' else 'torch ops'})")

    prompt = torch.randint(1, 256, (1, 8), device=device)
    seen = {}
    hook = experts[0][1].register_forward_hook(lambda mod, inputs, out: seen.update(inputs=inputs, out=out))
    with torch.no_grad():
        model(prompt)
        hook.remove()
        want = find_experts_modules(bf16)[0][1](*seen["inputs"]).float()
    err = ((seen["out"].float() - want).norm() / want.norm()).item()
    print(f"first MoE layer, NVFP4 experts vs BF16 experts on the same input: relative error {err:.3f} "
          "(NVFP4 on Gaussian weights: ~0.1 per matrix)")

    explanation = torch._dynamo.explain(model)(prompt)
    print(f"torch.compile(fullgraph=True): {explanation.graph_count} graph, "
          f"{explanation.graph_break_count} graph breaks")

    from transformers import CompileConfig

    cfg = CompileConfig(fullgraph=True, mode="reduce-overhead" if device == "cuda" else "default")
    cfg._compile_all_devices = True  # compile generate() on CPU too
    eager = model.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False, disable_compile=True)
    kw = dict(max_new_tokens=args.new_tokens, do_sample=False, cache_implementation="static", compile_config=cfg)
    t0 = time.perf_counter()
    model.generate(prompt, **kw)  # compiles
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = model.generate(prompt, **kw)
    if device == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    print(f"compiled generate: {args.new_tokens / dt:.1f} tokens/s (first call incl. compile {compile_s:.1f}s); "
          f"greedy tokens {'match' if torch.equal(out, eager) else 'DIFFER from'} eager")
    print("tokens:", out[0, prompt.shape[1]:].tolist())


if __name__ == "__main__":
    main()
