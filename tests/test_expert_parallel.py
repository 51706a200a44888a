"""Expert parallelism on CPU: 2 (and 3) ranks with the gloo backend on a tiny DeepSeek-V3,
against one process. One MoE layer, the last: the ranks' partial outputs are rounded to bf16
before the sum, and with a later router such a rounding could flip a near-tied expert choice."""

import json
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hf_integration import patch_deepseek
from hf_integration.tiny_models import tiny_deepseek_v3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank, world, port, ids, out_dir, compile_too, checkpoint=None):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from hf_integration import load_modelopt_nvfp4
        from hf_integration.expert_parallel import shard_experts

        try:
            if checkpoint:  # each rank reads only its experts from the checkpoint (or its own path)
                path = checkpoint[rank] if isinstance(checkpoint, list) else checkpoint
                model = load_modelopt_nvfp4(path, expert_parallel=True)
            else:
                model = patch_deepseek(tiny_deepseek_v3(seed=0, num_hidden_layers=2), verbose=False)  # same weights everywhere
                shard_experts(model)
        except ValueError as exc:
            torch.save({"error": str(exc)}, f"{out_dir}/rank{rank}.pt")
            return
        experts = model.model.layers[-1].mlp.experts
        with torch.no_grad():
            logits = model(ids).logits
            tokens = model.generate(ids, max_new_tokens=5, do_sample=False)
            compiled = torch.compile(model, fullgraph=True)(ids).logits if compile_too else None
        torch.save({"logits": logits, "tokens": tokens, "compiled": compiled,
                    "local_experts": experts.num_experts}, f"{out_dir}/rank{rank}.pt")
    finally:
        # no collective left in flight on either rank before teardown: gloo can abort the
        # process when a peer tears down while its worker threads still hold work
        dist.barrier()
        dist.destroy_process_group()


def run(world, tmp_path, compile_too=False, checkpoint=None):
    ids = torch.randint(1, 256, (2, 7))
    mp.spawn(worker, args=(world, free_port(), ids, str(tmp_path), compile_too, checkpoint), nprocs=world, join=True)
    return ids, [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


def test_two_ranks_match_one_process(tmp_path):
    ids, results = run(2, tmp_path, compile_too=True)
    single = patch_deepseek(tiny_deepseek_v3(seed=0, num_hidden_layers=2), verbose=False)
    with torch.no_grad():
        want = single(ids).logits.double()
        want_tokens = single.generate(ids, max_new_tokens=5, do_sample=False)
    for r in results:
        assert r["local_experts"] == 4  # 8 experts over 2 ranks: each holds only its half
        # partial sums are reduced in float32 then rounded once: bf16 rounding of the
        # experts' output per rank is the only difference from one process
        per_token = (r["logits"].double() - want).norm(dim=-1) / want.norm(dim=-1)
        assert per_token.max() < 3e-2, per_token
        assert torch.equal(r["tokens"], want_tokens)
        per_token_c = (r["compiled"].double() - want).norm(dim=-1) / want.norm(dim=-1)
        assert per_token_c.median() < 3e-2, per_token_c
    assert torch.equal(results[0]["logits"], results[1]["logits"])  # ranks agree exactly


def test_world_size_not_dividing_experts_fails_alike_on_every_rank(tmp_path):
    _, results = run(3, tmp_path)
    messages = {r["error"] for r in results}
    assert len(messages) == 1 and "8 experts cannot be split evenly over world size 3" in messages.pop()


def test_expert_parallel_loading_from_modelopt_checkpoint(tmp_path):
    from hf_integration import load_modelopt_nvfp4
    from hf_integration.tiny_models import write_modelopt_checkpoint

    ckpt = tmp_path / "ckpt"
    write_modelopt_checkpoint(tiny_deepseek_v3(seed=1, num_hidden_layers=2), ckpt)
    ids, results = run(2, tmp_path, checkpoint=str(ckpt))
    single = load_modelopt_nvfp4(ckpt)
    with torch.no_grad():
        want = single(ids).logits.double()
        want_tokens = single.generate(ids, max_new_tokens=5, do_sample=False)
    for r in results:
        assert r["local_experts"] == 4
        per_token = (r["logits"].double() - want).norm(dim=-1) / want.norm(dim=-1)
        assert per_token.max() < 3e-2, per_token
        assert torch.equal(r["tokens"], want_tokens)


def test_a_rank_missing_its_expert_fails_on_every_rank(tmp_path):
    from safetensors.torch import load_file, save_file

    from hf_integration.tiny_models import write_modelopt_checkpoint

    ckpt = tmp_path / "ckpt"
    write_modelopt_checkpoint(tiny_deepseek_v3(seed=1, num_hidden_layers=2), ckpt)
    missing = "model.layers.1.mlp.experts.6.down_proj.weight"  # expert 6: rank 1's half
    for f in ckpt.glob("*.safetensors"):
        tensors = load_file(f)
        if tensors.pop(missing, None) is not None:
            save_file(tensors, f)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    del index["weight_map"][missing]  # a consistent checkpoint that lacks one tensor
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    _, results = run(2, tmp_path, checkpoint=str(ckpt))
    messages = {r.get("error") for r in results}
    assert len(messages) == 1  # rank 0 loaded its half fine, and still stops with rank 1's error
    message = messages.pop()
    assert "failed on rank 1" in message and missing in message and "is missing" in message


def test_ranks_with_different_checkpoints_fail_alike(tmp_path):
    from hf_integration.tiny_models import write_modelopt_checkpoint

    write_modelopt_checkpoint(tiny_deepseek_v3(seed=1, num_hidden_layers=2), tmp_path / "a")
    write_modelopt_checkpoint(tiny_deepseek_v3(seed=1, num_hidden_layers=3), tmp_path / "b")
    _, results = run(2, tmp_path, checkpoint=[str(tmp_path / "a"), str(tmp_path / "b")])
    messages = {r.get("error") for r in results}
    assert len(messages) == 1 and "ranks disagree on the checkpoint" in messages.pop()


def calibrating_worker(rank, world, port, ids, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from hf_integration import calibrate_activation_scales
        from hf_integration.expert_parallel import shard_experts

        model = shard_experts(patch_deepseek(tiny_deepseek_v3(seed=0, num_hidden_layers=2), verbose=False))
        calibrate_activation_scales(model, [ids])
        experts = model.model.layers[-1].mlp.experts
        torch.save({"gate_up": experts.gate_up_proj_input_scale, "down": experts.down_proj_input_scale,
                    "offset": experts.dispatch.offset}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.barrier()
        dist.destroy_process_group()


def test_a_rank_whose_experts_see_no_token_calibrates_to_the_layers_largest_scale(tmp_path):
    # one token: the router's one group (topk_group=1) of 4 experts is one rank's shard, so the
    # other rank's experts see nothing; they got a made-up 1.0, not the layer's largest scale
    from hf_integration import calibrate_activation_scales

    ids = torch.tensor([[11]])
    mp.spawn(calibrating_worker, args=(2, free_port(), ids, str(tmp_path)), nprocs=2, join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    single = calibrate_activation_scales(patch_deepseek(tiny_deepseek_v3(seed=0, num_hidden_layers=2), verbose=False),
                                         [ids])
    experts = single.model.layers[-1].mlp.experts
    for name in ("gate_up", "down"):
        want = getattr(experts, f"{name}_proj_input_scale")
        # the case this test is about: one rank's shard saw nothing (all four at the layer's largest)
        assert any(bool((want[o:o + 4] == want.max()).all()) for o in (0, 4))
        for r in results:  # the same inputs through the same reference math: exactly the one-process scales
            assert torch.equal(r[name], want[r["offset"]:r["offset"] + 4])
