"""Expert parallelism on several GPUs of one host, against one GPU, in one torchrun job:

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
        torchrun --nproc-per-node 2 benchmarks/bench_ep.py --layers 2 --out benchmarks/out

1. Checkpoint check: a tiny ModelOpt NVFP4 checkpoint loaded with ``expert_parallel=True``
   (each rank reads only its experts) gives the logits of a one-GPU load of the same file.
2. A DeepSeek-V3-shaped model (full expert dims, 256 experts, ``--layers`` MoE layers, random
   weights, the same on every rank) patched with ``patch_deepseek``; on every rank, with all
   256 experts: greedy tokens and decode tokens/s (the one-GPU baseline, each GPU alone).
3. ``shard_experts``: each rank keeps 256/N experts per layer; the same greedy tokens and
   decode tokens/s, now with an NCCL all-reduce per MoE layer. Memory per GPU for both.

Decode speed as in ``bench_e2e.py`` (generate() with static cache, CompileConfig with CUDA graphs,
16 new tokens after a 16-token prompt, median of 3). Rank 0 writes ``ep.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

for _var in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    # NVLink multicast off in every process: it can take a shared host's GPUs out of service
    os.environ[_var] = "0" if _var == "NCCL_NVLS_ENABLE" else "1"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_e2e import deepseek_v3_layers, expert_bytes, time_generate  # noqa: E402
from hf_integration import load_modelopt_nvfp4, patch_deepseek, shard_experts  # noqa: E402
from hf_integration.tiny_models import tiny_deepseek_v3, write_modelopt_checkpoint  # noqa: E402


def log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def checkpoint_check(rank: int) -> float:
    """Max |logits difference| between an expert-parallel load and a one-GPU load."""
    path = [None]
    if rank == 0:
        path[0] = tempfile.mkdtemp(prefix="fp4moe-ep-")
        write_modelopt_checkpoint(tiny_deepseek_v3(seed=0, num_hidden_layers=2), path[0])
    dist.broadcast_object_list(path)
    ep = load_modelopt_nvfp4(path[0], device="cuda", expert_parallel=True)
    one = load_modelopt_nvfp4(path[0], device="cuda")
    local = ep.model.layers[-1].mlp.experts.num_experts
    ids = torch.randint(1, 256, (2, 7), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    with torch.no_grad():
        diff = (ep(ids).logits.float() - one(ids).logits.float()).abs().max().item()
    log(f"checkpoint check: {local} local experts per rank; max |logits EP - one GPU| = {diff:.3e}")
    return diff


def decode_rows(model, label: str, batches: list[int], budget_end: float) -> tuple[list[dict], torch.Tensor]:
    rows = []
    torch.manual_seed(0)
    _, greedy = time_generate(model, 1, 16, compiled=False)
    for b in batches:
        if time.time() > budget_end:
            log(f"{label}: skipping batch {b} (time budget)")
            continue
        torch.cuda.reset_peak_memory_stats()
        torch.manual_seed(b)  # the same prompt on every rank
        try:
            tps, _ = time_generate(model, b, 16, compiled=True)
            mode = "compiled"
        except Exception as exc:  # same failure on every rank (same graph): report, time eager
            log(f"{label}: compiled generate failed ({type(exc).__name__}: {str(exc)[:300]}); timing eager")
            torch._dynamo.reset()
            torch.manual_seed(b)
            tps, _ = time_generate(model, b, 16, compiled=False)
            mode = "eager"
        peaks = [None] * dist.get_world_size()
        dist.all_gather_object(peaks, torch.cuda.max_memory_allocated() / 1e9)
        rows.append(dict(variant=label, batch=b, mode=mode, tokens_per_s=tps, peak_GB_per_gpu=peaks))
        log(f"{label:8s} {mode:8s} batch {b:3d}: {tps:8.1f} tok/s, peak GB per GPU {[round(p, 1) for p in peaks]}")
    return rows, greedy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--out", default="benchmarks/out")
    ap.add_argument("--time-budget", type=float, default=480)
    args = ap.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    start = time.time()
    result = dict(device=torch.cuda.get_device_name(), world_size=world, layers=args.layers,
                  date=time.strftime("%Y-%m-%d"), torch=torch.__version__)
    result["checkpoint_max_abs_logit_diff"] = checkpoint_check(rank)

    torch.manual_seed(0)  # identical random weights on every rank
    model = patch_deepseek(deepseek_v3_layers(args.layers), verbose=False)
    with torch.no_grad():  # make sure: rank 0's weights everywhere
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t, 0)
    torch.cuda.empty_cache()
    result["expert_GB_per_gpu_one"] = expert_bytes(model) / 1e9
    batches = [int(b) for b in args.batches.split(",")]
    budget_end = start + args.time_budget
    rows, greedy_one = decode_rows(model, "one GPU", batches, start + args.time_budget / 2)
    torch._dynamo.reset()

    shard_experts(model)
    torch.cuda.empty_cache()
    result["expert_GB_per_gpu_ep"] = expert_bytes(model) / 1e9
    log(f"experts per GPU: {result['expert_GB_per_gpu_one']:.2f} GB alone -> {result['expert_GB_per_gpu_ep']:.2f} GB "
        f"with EP={world}")
    ep_rows, greedy_ep = decode_rows(model, f"EP={world}", batches, budget_end)
    result["rows"] = rows + ep_rows
    result["greedy_equal"] = bool(torch.equal(greedy_one, greedy_ep))
    first_diff = (greedy_one != greedy_ep).any(0).nonzero()
    result["greedy_first_difference_at"] = None if first_diff.numel() == 0 else int(first_diff[0])
    log(f"greedy tokens (batch 1, 16 new, eager) EP={world} vs one GPU: "
        f"{'equal' if result['greedy_equal'] else 'differ from position ' + str(result['greedy_first_difference_at'])}")
    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "ep.json").write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
