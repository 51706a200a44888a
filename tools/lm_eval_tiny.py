"""lm-evaluation-harness on a patched model, fully local (no hub download): the tool the seed's
accuracy numbers came from, evaluating through its HF wrapper ``HFLM(pretrained=model)``.

    pip install lm-eval && python tools/lm_eval_tiny.py

Uses a tiny random DeepSeek-V3 and a word-level tokenizer built in memory, and a small
multiple-choice task written to a temporary folder (JSON lines + task YAML). It checks that the
harness runs through fp4moe's op and compares per-document log-likelihoods with the unpatched
BF16 model (random weights: accuracy itself means nothing here).
"""

from __future__ import annotations

import copy
import json
import os
import random
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from hf_integration import patch_deepseek  # noqa: E402
from hf_integration.tiny_models import tiny_deepseek_v3, tiny_tokenizer  # noqa: E402


def write_task(folder: Path, n: int = 24) -> None:
    rng = random.Random(0)
    with open(folder / "data.jsonl", "w") as f:
        for _ in range(n):
            q = " ".join(f"w{rng.randrange(253)}" for _ in range(6))
            choices = [" ".join(f"w{rng.randrange(253)}" for _ in range(2)) for _ in range(4)]
            f.write(json.dumps({"question": q, "choices": choices, "answer": rng.randrange(4)}) + "\n")
    (folder / "fp4moe_tiny.yaml").write_text(f"""task: fp4moe_tiny
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'data.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""")


def evaluate(model, tokenizer, task_dir):
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=8, max_length=128)
    out = simple_evaluate(model=lm, tasks=["fp4moe_tiny"], task_manager=TaskManager(include_path=str(task_dir)),
                          log_samples=True)
    lls = [r[0][0] for s in out["samples"]["fp4moe_tiny"] for r in s["resps"]]
    return out["results"]["fp4moe_tiny"]["acc,none"], torch.tensor(lls)


def main() -> None:
    model = tiny_deepseek_v3(seed=0)
    bf16 = copy.deepcopy(model)
    patch_deepseek(model, verbose=False)
    tok = tiny_tokenizer()
    with tempfile.TemporaryDirectory() as d:
        write_task(Path(d))
        acc_fp4, ll_fp4 = evaluate(model, tok, d)
        acc_bf16, ll_bf16 = evaluate(bf16, tok, d)
    rel = ((ll_fp4 - ll_bf16).norm() / ll_bf16.norm()).item()
    print(f"lm-eval fp4moe_tiny (24 docs x 4 choices): acc fp4moe {acc_fp4:.3f}, BF16 {acc_bf16:.3f}; "
          f"log-likelihoods relative difference {rel:.3f} ({ll_fp4.numel()} requests)")


if __name__ == "__main__":
    main()
