"""Peak host memory while loading a generated ModelOpt NVFP4 checkpoint of one full-size
DeepSeek-V3 MoE layer (256 experts, H=7168, I=2048: ~6.3 GB of NVFP4 experts).

    python benchmarks/bench_load_memory.py --dir /tmp/fp4moe-ckpt

Writes the checkpoint shard by shard (random but valid NVFP4 bytes, E4M3 scales, fp32 global
and input scales; a small vocabulary so the experts dominate), then loads it with
``load_modelopt_nvfp4`` in a fresh process and reports that process's peak RSS
(``ru_maxrss``) against the checkpoint size, next to the RSS of the same process after only the
imports (the Python/torch/Transformers baseline).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

E, H, I = 256, 7168, 2048


def config_dict() -> dict:
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(
        vocab_size=1024, hidden_size=H, intermediate_size=18432, moe_intermediate_size=I, num_hidden_layers=1,
        first_k_dense_replace=0, n_routed_experts=E, num_experts_per_tok=8, n_group=8, topk_group=4,
        n_shared_experts=1, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=4096)
    return cfg.to_dict()


def nvfp4_linear(name: str, n: int, k: int) -> dict:
    return {
        f"{name}.weight": torch.randint(0, 256, (n, k // 2), dtype=torch.uint8),
        f"{name}.weight_scale": torch.randint(0x28, 0x70, (n, k // 16), dtype=torch.uint8).view(torch.float8_e4m3fn),
        f"{name}.weight_scale_2": torch.rand(()) * 1e-3 + 1e-4,
        f"{name}.input_scale": torch.rand(()) * 1e-2 + 1e-3,
    }


def write_checkpoint(path: Path) -> int:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    path.mkdir(parents=True, exist_ok=True)
    cfg = config_dict()
    (path / "config.json").write_text(json.dumps(cfg, default=str))
    (path / "hf_quant_config.json").write_text(json.dumps({"quantization": {
        "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head", "*self_attn*", "*mlp.gate"]}}))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(DeepseekV3Config(**cfg), dtype=torch.bfloat16)
    other = {}
    for name, t in model.state_dict().items():
        if ".mlp.experts." in name or "shared_experts" in name:
            continue
        other[name] = (torch.randn(t.shape) * 0.02).to(t.dtype)
    shared = "model.layers.0.mlp.shared_experts"
    for proj, (n, k) in {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}.items():
        other.update(nvfp4_linear(f"{shared}.{proj}", n, k))
    save_file(other, str(path / "model-other.safetensors"))
    prefix = "model.layers.0.mlp.experts"
    for e0 in range(0, E, 16):
        shard = {}
        for e in range(e0, e0 + 16):
            for proj, (n, k) in {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}.items():
                shard.update(nvfp4_linear(f"{prefix}.{e}.{proj}", n, k))
        save_file(shard, str(path / f"model-experts-{e0:03d}.safetensors"))
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


CHILD = """
import resource, sys, time
sys.path.insert(0, {root!r})
import torch
from hf_integration.modelopt import load_modelopt_nvfp4
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.time()
model = load_modelopt_nvfp4({path!r}, verbose=False)
dt = time.time() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
kept = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
print(base * 1024, peak * 1024, kept, dt)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/fp4moe-ckpt")
    args = ap.parse_args()
    path = Path(args.dir)
    t0 = time.time()
    size = write_checkpoint(path)
    print(f"wrote {size / 1e9:.2f} GB checkpoint to {path} in {time.time() - t0:.0f}s", flush=True)
    root = str(Path(__file__).resolve().parent.parent)
    out = subprocess.run([sys.executable, "-c", CHILD.format(root=root, path=str(path))],
                         capture_output=True, text=True, check=True).stdout.split()
    base, peak, kept, dt = int(out[0]), int(out[1]), int(out[2]), float(out[3])
    print(f"load: {dt:.1f}s; peak RSS {peak / 1e9:.2f} GB = {peak / size:.2f}x the checkpoint "
          f"({(peak - base) / size:.2f}x above the {base / 1e9:.2f} GB import baseline); model tensors {kept / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
