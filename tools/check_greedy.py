"""Compiled vs eager greedy tokens on a random full-size DeepSeek-V3, for BF16 (the control)
and fp4moe: random weights give near-tied logits that bf16 rounding differences between
inductor and eager can flip, so a difference is a bug only if the BF16 control agrees.

    python tools/check_greedy.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))  # bench_e2e
from bench_e2e import deepseek_v3_layers  # noqa: E402
from hf_integration import patch_deepseek  # noqa: E402


def run(model, prompt, compiled):
    from transformers import CompileConfig

    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)
    if compiled:
        kw.update(cache_implementation="static", compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead"))
        model.generate(prompt, **kw)
    else:
        kw.update(disable_compile=True)
    return model.generate(prompt, **kw)[0, prompt.shape[1]:].tolist()


def main():
    torch.manual_seed(0)
    model = deepseek_v3_layers(2)
    prompt = torch.randint(1, 1000, (1, 16), device="cuda")
    for name in ("BF16", "fp4moe"):
        if name == "fp4moe":
            torch._dynamo.reset()
            patch_deepseek(model, verbose=False)
        eager = run(model, prompt, False)
        comp = run(model, prompt, True)
        first_diff = next((i for i, (a, b) in enumerate(zip(eager, comp)) if a != b), None)
        print(f"{name}: eager {eager}\n{name}: compiled {comp}\n{name}: first difference at step {first_diff}",
              flush=True)


if __name__ == "__main__":
    main()
