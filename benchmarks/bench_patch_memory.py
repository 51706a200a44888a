"""Peak memory while ``patch_moe`` quantizes a BF16 model.

A Qwen3-MoE-shaped model with random BF16 weights is built, then patched; the peak is measured
above what the model held before patching:

* on CUDA: ``torch.cuda.max_memory_allocated`` (reset before patching);
* on CPU: the process's resident high-water mark (``VmHWM``, reset through
  ``/proc/self/clear_refs``), so the allocator's own retention counts too.

    python benchmarks/bench_patch_memory.py --device cpu --layers 4 --experts 64 --hidden 1024 --inter 512
    python benchmarks/bench_patch_memory.py --device cuda --layers 2 --experts 128 --hidden 4096 --inter 1536
"""

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after PYTHONPATH: an older tree can go first


def rss_hwm_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=512)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    import hf_integration
    from hf_integration import patch_moe

    cfg = Qwen3MoeConfig(vocab_size=1024, hidden_size=args.hidden, moe_intermediate_size=args.inter,
                         intermediate_size=args.inter, num_hidden_layers=args.layers, num_experts=args.experts,
                         num_experts_per_tok=8, num_attention_heads=8, num_key_value_heads=2, head_dim=64)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    gc.collect()
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        before = rss_bytes()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    t0 = time.time()
    patch_moe(model, backend="reference" if not cuda else "auto", verbose=False)
    seconds = time.time() - t0
    peak = torch.cuda.max_memory_allocated() if cuda else rss_hwm_bytes()
    after = torch.cuda.memory_allocated() if cuda else rss_bytes()
    extra = peak - before
    print(f"fp4moe_ops from {Path(hf_integration.__file__).parent.parent}")
    print(f"{args.device}: {args.layers} layers x {args.experts} experts (H={args.hidden}, I={args.inter}), "
          f"BF16 model {model_bytes / 1e9:.3f} GB; held before patching {before / 1e9:.3f} GB")
    print(f"patch_moe: {seconds:.1f} s, peak {peak / 1e9:.3f} GB = held + {extra / 1e9:.3f} GB "
          f"(+{100 * extra / model_bytes:.1f}% of the BF16 model); after {after / 1e9:.3f} GB")


if __name__ == "__main__":
    main()
