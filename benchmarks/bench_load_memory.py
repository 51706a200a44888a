"""Peak host memory while loading a checkpoint, in a fresh process per load:

* a generated ModelOpt NVFP4 checkpoint of one full-size DeepSeek-V3 MoE layer (256 experts,
  H=7168, I=2048: ~6.3 GB of NVFP4 experts): random but valid NVFP4 bytes, E4M3 scales, fp32
  global and input scales; a small vocabulary so the experts dominate;
* ``--bf16 N``: a 16-bit checkpoint of N Qwen3-30B-A3B-shaped layers (128 experts, H=2048, I=768;
  random weights, vocabulary cut to 1024), loaded three ways: as it is, then ``patch_moe`` after
  loading, and quantized while loading (``quantization_config=ModelOptConfig(quant_algo=
  "W4A16_NVFP4")``).

    python benchmarks/bench_load_memory.py --dir /tmp/fp4moe-ckpt
    python benchmarks/bench_load_memory.py --dir /tmp/fp4moe-bf16 --bf16 4

Each load reports its time, the process's peak RSS (``VmHWM``, which also counts the
memory-mapped checkpoint pages) and peak anonymous memory (``RssAnon``, the process's own), against
the checkpoint size and the same process after only the imports (the Python/torch/Transformers
baseline).
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


def config_dict(num_layers: int = 1, first_k_dense: int = 0, vocab_size: int = 1024) -> dict:
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=H, intermediate_size=18432, moe_intermediate_size=I,
        num_hidden_layers=num_layers, first_k_dense_replace=first_k_dense, n_routed_experts=E, num_experts_per_tok=8,
        n_group=8, topk_group=4, n_shared_experts=1, num_attention_heads=128, num_key_value_heads=128,
        q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        max_position_embeddings=4096)
    return cfg.to_dict()


def nvfp4_linear(name: str, n: int, k: int, device="cpu", scalars: tuple | None = None) -> dict:
    """One ModelOpt NVFP4 linear: random codes, E4M3 block scales in [2^-2, 2), small global
    scales (so activations stay finite over layers); ``scalars``: its ``(weight_scale_2,
    input_scale)``, to give gate and up the same ones as ModelOpt's export does."""
    def rand(*shape, lo=0, hi=256):
        return torch.randint(lo, hi, shape, dtype=torch.uint8, device=device).cpu()

    global_scale, input_scale = scalars or (torch.rand(()) * 1e-3 + 1e-4, torch.rand(()) * 1e-2 + 1e-3)
    return {
        f"{name}.weight": rand(n, k // 2),
        f"{name}.weight_scale": rand(n, k // 16, lo=0x28, hi=0x40).view(torch.float8_e4m3fn),
        f"{name}.weight_scale_2": global_scale.clone(),
        f"{name}.input_scale": input_scale.clone(),
    }


def mlp_linears(prefix: str, inter: int, device="cpu") -> dict:
    """A gated MLP's three NVFP4 linears, gate and up on one global and input scale (ModelOpt)."""
    shared = (torch.rand(()) * 1e-3 + 1e-4, torch.rand(()) * 1e-2 + 1e-3)
    return (nvfp4_linear(f"{prefix}.gate_proj", inter, H, device, shared)
            | nvfp4_linear(f"{prefix}.up_proj", inter, H, device, shared)
            | nvfp4_linear(f"{prefix}.down_proj", H, inter, device))


def write_checkpoint(path: Path, num_layers: int = 1, first_k_dense: int = 0, vocab_size: int = 1024,
                     device: str = "cpu") -> int:
    """Write a DeepSeek-V3 ModelOpt NVFP4 checkpoint with full-size layers; returns its bytes.

    Experts, shared experts and dense MLPs are NVFP4; attention, router and embeddings bf16
    (excluded, as in nvidia/DeepSeek-R1-FP4). ``device="cuda"`` draws the random bytes there (fast).
    """
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    from hf_integration.checkpoint_format import ModelOptConfig

    path.mkdir(parents=True, exist_ok=True)
    cfg = config_dict(num_layers, first_k_dense, vocab_size)
    quant = ModelOptConfig(exclude_modules=["lm_head", "*self_attn*", "*mlp.gate"], producer={"name": "modelopt"})
    # both places, as ModelOpt's newer exports: plain from_pretrained reads config.json's
    (path / "config.json").write_text(json.dumps(cfg | {"quantization_config": quant.to_dict()}, default=str))
    (path / "hf_quant_config.json").write_text(json.dumps(quant.hf_quant_config()))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(DeepseekV3Config(**cfg), dtype=torch.bfloat16)
    other = {}
    for name, t in model.state_dict().items():
        if ".mlp.experts." in name or "shared_experts" in name or ("_proj" in name and ".mlp." in name):
            continue
        other[name] = (torch.randn(t.shape, device=device) * 0.02).to(t.dtype).cpu()
    weight_map = {}
    for layer in range(num_layers):
        mlp = f"model.layers.{layer}.mlp"
        if layer < first_k_dense:
            other.update(mlp_linears(mlp, 18432, device))
            continue
        other.update(mlp_linears(f"{mlp}.shared_experts", I, device))
        for e0 in range(0, E, 16):
            shard = {}
            for e in range(e0, e0 + 16):
                shard.update(mlp_linears(f"{mlp}.experts.{e}", I, device))
            name = f"model-layer{layer:02d}-experts-{e0:03d}.safetensors"
            save_file(shard, str(path / name))
            weight_map.update(dict.fromkeys(shard, name))
    save_file(other, str(path / "model-other.safetensors"))
    weight_map.update(dict.fromkeys(other, "model-other.safetensors"))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


CHILD = """
import sys, threading, time
sys.path.insert(0, {root!r})
import torch
import hf_integration
from transformers import AutoModelForCausalLM

peak_anon = [0]
def status(field):  # bytes; VmHWM is this program's peak RSS (ru_maxrss would carry the parent's over exec)
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
def sample():  # RssAnon: the process's own memory; RSS also counts the mapped checkpoint pages
    while True:
        peak_anon[0] = max(peak_anon[0], status("RssAnon"))
        time.sleep(0.02)
threading.Thread(target=sample, daemon=True).start()
time.sleep(0.1)
base = status("VmHWM")
base_anon = peak_anon[0]
t0 = time.time()
from hf_integration import ModelOptConfig, patch_moe
model = AutoModelForCausalLM.from_pretrained({path!r}, dtype=torch.bfloat16, device_map={device!r}, **{kwargs})
if {patch}:
    patch_moe(model, verbose=False)
dt = time.time() - t0
time.sleep(0.1)
peak = status("VmHWM")
kept = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
print(base, peak, kept, dt, base_anon, peak_anon[0])
"""


def write_bf16_checkpoint(path: Path, num_layers: int) -> int:
    """A 16-bit Qwen3-30B-A3B-shaped checkpoint of ``num_layers`` layers; returns its bytes."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(num_hidden_layers=num_layers, hidden_size=2048, intermediate_size=6144,
                         moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, num_attention_heads=32,
                         num_key_value_heads=4, head_dim=128, vocab_size=1024)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(path)
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def measure(path: Path, size: int, device_map: str, label: str, kwargs: str = "{}", patch: bool = False) -> None:
    root = str(Path(__file__).resolve().parent.parent)
    out = subprocess.run([sys.executable, "-c", CHILD.format(root=root, path=str(path), device=device_map,
                                                               kwargs=kwargs, patch=patch)],
                         capture_output=True, text=True, check=True).stdout.split()
    base, peak, kept, dt, base_anon, peak_anon = int(out[0]), int(out[1]), int(out[2]), float(out[3]), int(out[4]), int(out[5])
    print(f"{label}: {dt:.1f}s; peak RSS {peak / 1e9:.2f} GB = {peak / size:.2f}x the "
          f"checkpoint ({(peak - base) / size:.2f}x above the {base / 1e9:.2f} GB import baseline; RSS counts the "
          f"memory-mapped checkpoint pages too); peak anonymous memory {peak_anon / 1e9:.2f} GB = {peak_anon / size:.2f}x "
          f"({(peak_anon - base_anon) / size:.2f}x above the baseline); model tensors {kept / 1e9:.2f} GB", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/fp4moe-ckpt")
    ap.add_argument("--device-map", default="cpu", help="where from_pretrained puts the model (cpu, cuda, auto)")
    ap.add_argument("--fuse-shared-experts", action="store_true", help="load with the shared expert inside the routed call")
    ap.add_argument("--bf16", type=int, default=0, help="a 16-bit Qwen3-30B-A3B-shaped checkpoint of this many layers")
    ap.add_argument("--reuse", action="store_true", help="load the checkpoint already in --dir")
    args = ap.parse_args()
    path = Path(args.dir)
    t0 = time.time()
    if args.reuse:
        size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    elif args.bf16:
        size = write_bf16_checkpoint(path, args.bf16)
    else:
        size = write_checkpoint(path, device="cuda" if torch.cuda.is_available() else "cpu")
    if not args.reuse:
        print(f"wrote {size / 1e9:.2f} GB checkpoint to {path} in {time.time() - t0:.0f}s", flush=True)
    if args.bf16:
        measure(path, size, args.device_map, "16-bit, as it is")
        measure(path, size, args.device_map, "16-bit, then patch_moe", patch=True)
        measure(path, size, args.device_map, "quantized while loading",
                kwargs='dict(quantization_config=ModelOptConfig(quant_algo="W4A16_NVFP4"))')
        return
    measure(path, size, args.device_map, f"from_pretrained(device_map={args.device_map!r}, fuse_shared_experts="
            f"{args.fuse_shared_experts})", kwargs=f"dict(quantization_config=ModelOptConfig("
            f"fuse_shared_experts={args.fuse_shared_experts}))")


if __name__ == "__main__":
    main()
