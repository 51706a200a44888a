"""The benchmark's code path on CPU (reference backend, small shape), as CI runs it."""

import importlib.util
import json
import site
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks" / "probes"))


def test_bench_moe_runs_on_cpu(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_moe.py"), "--out", str(tmp_path),
                    "--tokens", "1,4"], check=True, capture_output=True, timeout=600)
    result = json.loads((tmp_path / "results_small.json").read_text())
    assert [row["tokens"] for row in result["rows"]] == [1, 4]
    for row in result["rows"]:
        assert row["reference"]["rel_err"] == 0.0 and row["reference"]["ms"] > 0
    assert "| tokens |" in (tmp_path / "results_small.md").read_text()


def test_bench_model_runs_on_cpu(tmp_path):
    """bench_model.py's whole path at tiny shapes: every measurement of both variants, and the
    saved checkpoints (HF BF16's own and fp4moe's) load back with their model's greedy tokens."""
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_model.py"), "--tiny", "--layers", "2",
                    "--batches", "1", "--prompts", "16", "--prefill-chunk", "8", "--requests", "2", "--variants", "bf16,fp4moe",
                    "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path)],
                   check=True, capture_output=True, timeout=600)
    rows = {(r["variant"], r["what"]): r["value"] for r in json.loads((tmp_path / "model.json").read_text())["rows"]}
    for variant in ("bf16", "fp4moe"):
        # read from the steps of one call (on a CPU the host's clock): a rate, and the step it comes from
        step = rows[(variant, "generate() step, median, batch 1 (ms)")]
        assert step > 0 and rows[(variant, "decode tokens/s, batch 1")] == pytest.approx(1e3 / step, rel=1e-6), variant
        for what in ("time to first token, 16 tokens (ms)", "time to first token, 16 tokens, compiled prefill in chunks of 8 (ms)",
                     "generate_batch tokens/s, 2 requests"):
            assert rows[(variant, what)] > 0, (variant, what)
    for variant in ("bf16", "fp4moe"):  # each saved, loaded back, the folder removed after
        assert rows[(variant, "loaded model's greedy tokens equal the model's")] == 1.0, variant
        assert rows[(variant, "checkpoint on disk (GB)")] > 0, variant
        assert not (tmp_path / "ckpt" / variant).exists(), variant
        assert rows[(variant, "ModelOpt's hf_quant_config.json written")] == float(variant == "fp4moe")


def test_bench_model_checkpoint_is_skipped_or_cleaned_up_not_fatal(tmp_path, monkeypatch):
    """bench_model --checkpoint: a checkpoint larger than the free disk is skipped with a note, and
    a save that fails is noted and its folder removed; neither stops the run (at full depth the BF16
    checkpoint is 61 GB, more than the GPU machines' disk)."""
    import shutil
    from collections import namedtuple

    import bench_model
    from bench_generate_batch import TINY, qwen3_moe

    model = qwen3_moe(1, TINY, "cpu")
    rows = {}
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1, 1, 1000))
    bench_model.save_and_load(model, tmp_path / "bf16", rows.__setitem__)
    assert list(rows) == ["checkpoint skipped: too large for the free disk or GPU memory (GB of weights)"]
    assert not (tmp_path / "bf16").exists()
    monkeypatch.undo()

    def failing_save(folder, **kwargs):
        Path(folder).mkdir()
        (Path(folder) / "model-00001-of-00002.safetensors").write_bytes(b"partial")
        raise OSError("No space left on device")

    rows.clear()
    monkeypatch.setattr(model, "save_pretrained", failing_save)
    bench_model.save_and_load(model, tmp_path / "bf16", rows.__setitem__)
    assert rows == {"checkpoint save and load failed (1)": 1.0}
    assert not (tmp_path / "bf16").exists()


def test_generate_step_clock_reads_each_steps_period():
    """bench_e2e.generate_step_ms reads the steps of one generate() call: with 30 ms added to every
    forward after the prefill, each step's period is at least that and the first decoding step is
    told apart from the prefill; without the delay the same model's steps are shorter."""
    from bench_e2e import generate_step_ms
    from bench_generate_batch import TINY, qwen3_moe

    torch.manual_seed(0)
    model = qwen3_moe(1, TINY, "cpu")
    forward = model.forward

    def slow_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        if kwargs["input_ids"].shape[1] == 1:  # a decoding step, not the 16-token prefill
            time.sleep(0.03)
        return out

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (a busy 2-core machine otherwise stretches the fast steps past 30 ms)
    try:
        fast = generate_step_ms(model, 1, 3, skip=3, runs=1, compiled=False)
        model.forward = slow_forward
        slow = generate_step_ms(model, 1, 3, skip=3, runs=1, compiled=False)
    finally:
        torch.set_num_threads(threads)
    for what in ("step", "mean", "slowest", "first", "early"):
        assert slow[what] >= 30 > fast[what], (what, slow, fast)


@pytest.mark.skipif(importlib.util.find_spec("fastapi") is None or importlib.util.find_spec("uvicorn") is None,
                    reason="transformers serve needs its serving extra: pip install 'transformers[serving]'")
@pytest.mark.skipif(not any((Path(p) / "fp4moe-autoload.pth").exists() for p in site.getsitepackages()),
                    reason="the server loads fp4moe's checkpoint through its start-up hook: pip install -e .")
def test_bench_serve_runs_on_cpu(tmp_path):
    """bench_serve.py's whole path at tiny shapes: both servers answer every request, and their
    answers are greedy generate()'s of their own checkpoint, which differ between the variants
    (so the server really ran fp4moe's NVFP4 experts, not a BF16 model)."""
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_serve.py"), "--tiny", "--layers", "2",
                    "--requests", "3", "--prompt", "8", "--new", "6", "--check", "3", "--folder", str(tmp_path / "ckpt"),
                    "--out", str(tmp_path)], check=True, capture_output=True, timeout=600)
    rows = {r["variant"]: r for r in json.loads((tmp_path / "serve.json").read_text())["rows"]}
    for variant in ("bf16", "fp4moe"):
        assert rows[variant]["tokens_per_s"] > 0 and rows[variant]["tokens"] == 3 * 6
        assert rows[variant]["equal_to_generate"] == 3, rows[variant]
    assert rows["bf16"]["checked_answers"] != rows["fp4moe"]["checked_answers"]


def test_error_vs_reference_checks_an_all_zero_reference_exactly():
    from bench_moe import error_vs_reference

    zero = torch.zeros(3, 4, dtype=torch.float64)
    assert error_vs_reference(zero, zero) == 0.0
    assert error_vs_reference(zero + 1e-3, zero) == 1e-3  # nothing routed here, yet output: caught
    ref = torch.randn(3, 4, dtype=torch.float64)
    assert abs(error_vs_reference(ref * 1.01, ref) - 0.01) < 1e-12


def test_gpu_only_benchmark_scripts_import_on_cpu():
    """The GPU-only scripts at least import (their helpers and names exist) where CI runs."""
    import importlib

    for name in ("bench_e2e", "bench_router", "profile_decode_step", "sweep_triton", "profile_layer", "probe_stream",
                 "probe_dense_bound", "probe_v3_decode", "probe_generate_loop"):
        module = importlib.import_module(name)
        assert callable(module.main), name


def test_generate_loop_probe_finds_the_gpus_idle_gaps():
    """probe_generate_loop --gaps: the GPU's idle time inside a step, from kernel intervals that
    overlap, nest, touch and run past the step's ends (expected gaps worked out by hand)."""
    from probe_generate_loop import idle_gaps, merge_intervals

    kernels = sorted([(0, 3), (2, 5), (3, 4), (5, 6), (8, 9), (12, 20), (25, 26)])
    merged = merge_intervals(kernels)
    assert merged == [[0, 6], [8, 9], [12, 20], [25, 26]]
    assert idle_gaps(merged, 1, 15) == [(6, 8), (9, 12)]
    assert idle_gaps(merged, -2, 30) == [(-2, 0), (6, 8), (9, 12), (20, 25), (26, 30)]
    assert idle_gaps(merged, 13, 19) == []  # inside one kernel
    assert idle_gaps(merged, 21, 24) == [(21, 24)]  # no kernel at all

    # each gap named by the host events running at its middle, outermost first
    from types import SimpleNamespace as NS

    from probe_generate_loop import gap_lines

    event = lambda name, a, b: NS(name=name, time_range=NS(start=a, end=b))
    cpu = [event("inner", 6500, 7500), event("outer", 0, 20000), event("elsewhere", 9000, 12000)]
    assert gap_lines([(6000, 8000), (9000, 12000)], 1000, cpu) == [
        "     2.000 ms at     5.00 ms: outer > inner", "     3.000 ms at     8.00 ms: outer > elsewhere"]


def test_bench_generate_batch_runs_on_cpu(tmp_path):
    # --tiny: the script's path (BF16, then patched, every request checked complete), small and on the CPU
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_generate_batch.py"), "--tiny",
                           "--requests", "2", "--prompt", "5", "--new", "3", "--repeats", "1", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads((tmp_path / "generate_batch.json").read_text())["rows"]
    assert [(r["variant"], r["requests"]) for r in rows] == [("BF16", 2), ("fp4moe", 2)]
    assert all(r["tokens_per_s"] > 0 for r in rows)
    assert "| requests | BF16 tokens/s | fp4moe tokens/s |" in done.stdout


def test_gpt_oss_built_without_bf16_experts_is_the_swapped_model():
    """bench_gpt_oss.gpt_oss_model_mxfp4 (for gpt-oss-120b at full depth on one GPU): no BF16 expert
    weight is ever made, nothing is left as to_empty's uninitialised memory (the rotary tables,
    norms, embeddings), and the model gives exactly the logits of the usual path, a BF16-built model
    with the same weights whose experts are then swapped for the same MXFP4 tensors."""
    from bench_gpt_oss import TINY_MODEL, gpt_oss_model, gpt_oss_model_mxfp4, swap_in_mxfp4_experts

    torch.manual_seed(0)
    model, backend = gpt_oss_model_mxfp4(TINY_MODEL, 2, torch.device("cpu"), "reference")
    assert backend == "reference"
    e, h, i = (TINY_MODEL[k] for k in ("num_local_experts", "hidden_size", "intermediate_size"))
    assert not [n for n, p in model.named_parameters() if p.dim() == 3 and p.shape[0] == e]  # no [E, ., .] BF16 weights
    usual = gpt_oss_model(TINY_MODEL, 2, torch.device("cpu"))
    rotary = dict(usual.named_buffers())
    for name, buf in model.named_buffers():
        if "rotary" in name:
            assert torch.equal(buf, rotary[name]), name
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            assert torch.equal(p, torch.ones_like(p)), name
    dense = {n: p for n, p in model.state_dict().items() if ".mlp.experts." not in n}
    usual.load_state_dict(dense, strict=False)
    experts = [[t.clone() for t in layer.mlp.experts.expert_tensors()] for layer in model.model.layers]
    swap_in_mxfp4_experts(usual, experts, "reference")
    ids = torch.randint(3, TINY_MODEL["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, usual(ids).logits)


def test_gpt_oss_checkpoint_round_trip_is_the_built_model(tmp_path):
    """bench_gpt_oss's --checkpoint: the model built without BF16 experts, saved as a gpt-oss MXFP4
    checkpoint and loaded by from_pretrained, has MXFP4 experts and the built model's logits exactly;
    the folder is gone after, and the save and load are reported."""
    from bench_gpt_oss import TINY_MODEL, gpt_oss_model_mxfp4, load_checkpoint, save_checkpoint

    from hf_integration.mxfp4_quantizer import MIN_TRANSFORMERS, supported

    if not supported():  # (building the model runs there; loading a gpt-oss checkpoint through fp4moe does not)
        pytest.skip(f"fp4moe's gpt-oss loading needs Transformers {'.'.join(map(str, MIN_TRANSFORMERS))} or later")
    torch.manual_seed(0)
    model, _ = gpt_oss_model_mxfp4(TINY_MODEL, 2, torch.device("cpu"), "reference")
    ids = torch.randint(3, TINY_MODEL["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
    part = {}
    save_checkpoint(model, tmp_path / "ckpt", part)
    loaded, backend = load_checkpoint(tmp_path / "ckpt", torch.device("cpu"), "reference", None, part, lambda msg: None)
    assert backend == "reference" and not (tmp_path / "ckpt").exists()
    assert {type(layer.mlp.experts).__name__ for layer in loaded.model.layers} == {"MXFP4GptOssExperts"}
    assert part["checkpoint"]["GB_on_disk"] > 0 and part["checkpoint"]["load_s"] > 0
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, want)


def test_bench_gpt_oss_runs_on_cpu(tmp_path):
    # --tiny: both parts' code paths (the layer against Transformers' BF16 experts, compiled generate),
    # small and on the CPU with the reference backend; every fp4moe row checked against the reference
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_gpt_oss.py"), "--tiny", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((tmp_path / "gpt_oss.json").read_text())
    assert [row["tokens"] for row in result["layer"]["rows"]] == [1, 8, 64]
    # Transformers' BF16 experts on the decoded weights against fp4moe's reference: bf16 rounding only
    assert all(0 < row["bf16"]["rel_err"] < 2e-2 for row in result["layer"]["rows"])
    assert {row["variant"] for row in result["e2e"]["rows"]} == {"HF BF16 grouped_mm", "fp4moe reference"}


def test_probe_op_host_times_the_launch_path_and_restores_it():
    """probe_op_host.timed_functions: the routing step's host time and its kernel launch are counted
    (Triton's interpreter runs the routing kernel here), and the functions are the originals after."""
    pytest.importorskip("triton")
    from collections import defaultdict

    from fp4moe_ops.backends.triton_moe import launch
    from probe_op_host import timed_functions

    route, launch_fn = launch.route, launch.launch_or_compile
    seconds = defaultdict(float)
    ids = torch.randint(0, 8, (5, 2), dtype=torch.int32)
    with timed_functions(seconds):
        sorted_slot, *_ = launch.route(ids, 8, 16)
    assert sorted(sorted_slot.tolist()) == list(range(10))  # every slot placed once: the kernel ran
    assert seconds["route"] >= seconds["launch _route_kernel"] > 0
    assert launch.route is route and launch.launch_or_compile is launch_fn


def test_probe_op_host_runs_on_cpu():
    """probe_op_host.py's whole path at tiny shapes (reference backend, uncompiled model): a row per
    token count and per model depth, each with a positive host time."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "probes" / "probe_op_host.py"), "--tokens", "1",
                           "--calls", "3", "--model-layers", "1", "--model-tokens", "8"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| 1 |")]
    assert len(rows) == 2, done.stdout  # the op's row at 1 token, the model's at 1 layer
    assert float(rows[0][1]) > 0 and all(float(v) > 0 for v in rows[1][1:]), rows
