"""Why compiled and eager greedy tokens can differ on a random full-size DeepSeek-V3: run both
for BF16 and fp4moe, and report the top-1/top-2 logit margin at each step (random weights give
near-ties that bf16 rounding differences between inductor and eager can flip).

    python benchmarks/check_greedy.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_e2e import deepseek_v3_layers  # noqa: E402
from hf_integration import patch_deepseek  # noqa: E402


def run(model, prompt, compiled):
    from transformers import CompileConfig

    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, output_scores=True, return_dict_in_generate=True)
    if compiled:
        kw.update(cache_implementation="static", compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead"))
        model.generate(prompt, **kw)
    else:
        kw.update(disable_compile=True)
    out = model.generate(prompt, **kw)
    margins = [float(s[0].topk(2).values.diff().abs()) / float(s[0].std()) for s in out.scores]
    return out.sequences[0, prompt.shape[1]:].tolist(), margins


def main():
    torch.manual_seed(0)
    model = deepseek_v3_layers(2)
    prompt = torch.randint(1, 1000, (1, 16), device="cuda")
    for name in ("BF16", "fp4moe"):
        if name == "fp4moe":
            torch._dynamo.reset()
            patch_deepseek(model, verbose=False)
        eager, m_eager = run(model, prompt, False)
        comp, _ = run(model, prompt, True)
        first_diff = next((i for i, (a, b) in enumerate(zip(eager, comp)) if a != b), None)
        print(f"{name}: eager {eager}\n{name}: compiled {comp}\n{name}: first difference at step {first_diff}; "
              f"eager top1-top2 margin / logit std per step: {[round(m, 3) for m in m_eager]}", flush=True)


if __name__ == "__main__":
    main()
