"""The shared expert inside the routed call (:mod:`hf_integration.shared_experts`): the block's
output against float64 and against the unfused block, the state dict and the saved checkpoint
unchanged by fusing, fusing after loading (a genuine ModelOpt export and our own save), and the
cases that must stay unfused."""

import contextlib
import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from fp4moe_ops.oracle64 import moe64
from hf_integration import CompressedTensorsNVFP4Config, ModelOptConfig, SharedExpertMoE, patch_deepseek
from hf_integration.experts import NVFP4Linear
from hf_integration.shared_experts import SHARED_EXPERT_BLOCKS
from hf_integration.tiny_models import tiny_deepseek_v3, tiny_glm4_moe, write_modelopt_checkpoint

FIXTURES = Path(__file__).parent / "fixtures"


def patched(model_fn=tiny_deepseek_v3, fuse=True):
    return patch_deepseek(model_fn(), quantize_dense_mlps=True, fuse_shared_experts=fuse)


def blocks(model, kind):
    return [m for m in model.modules() if isinstance(m, kind)]


@contextlib.contextmanager
def routing_record(model):
    """The experts each MoE layer's router picks per token (``[T, k]``), in layer order, while the
    context is open."""
    record, hooks = [], [m.register_forward_hook(lambda mod, args, out: record.append(out[-1].reshape(-1, out[-1].shape[-1])))
                         for name, m in model.named_modules() if name.endswith("mlp.gate")]
    try:
        yield record
    finally:
        for h in hooks:
            h.remove()


def assert_fused_like_unfused(unfused, fused, ids, tol):
    """The fused model's outputs against the unfused one's on ``ids``: the first MoE block (the
    same input in both) per token within ``tol``, and the logits of every token whose experts are
    the same in both models in every MoE layer. The two differ by rounding only, which reaches the
    next router: where two of a token's expert scores are nearly tied (these random models), the
    two pick different experts for it and its logits differ by O(1). Those tokens must stay few."""
    moe = [name for name, m in unfused.named_modules() if type(m).__name__ in SHARED_EXPERT_BLOCKS]
    outputs = []
    hooks = [model.get_submodule(moe[0]).register_forward_hook(lambda mod, args, out: outputs.append(out.double()))
             for model in (unfused, fused)]
    try:
        with torch.no_grad(), routing_record(unfused) as routed_a, routing_record(fused) as routed_b:
            a, b = unfused(ids).logits.double(), fused(ids).logits.double()
    finally:
        for h in hooks:
            h.remove()
    block_a, block_b = outputs
    assert ((block_a - block_b).norm(dim=-1) / block_a.norm(dim=-1)).max() < tol
    per_token = ((a - b).norm(dim=-1) / a.norm(dim=-1)).flatten()
    same_route = torch.stack([(x.sort(-1).values == y.sort(-1).values).all(-1)
                              for x, y in zip(routed_a, routed_b, strict=True)]).all(0)
    assert same_route.sum() >= 0.75 * same_route.numel(), (same_route, per_token)
    assert per_token[same_route].max() < tol, (same_route, per_token)


def file_tensors(folder):
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.parametrize("model_fn", [tiny_deepseek_v3, tiny_glm4_moe])
def test_fused_block_matches_float64_and_the_unfused_block(model_fn):
    torch.manual_seed(0)
    unfused = patched(model_fn, fuse=False)
    fused = copy.deepcopy(unfused)
    from hf_integration import fuse_shared_experts

    moe_blocks = [m for m in unfused.modules() if type(m).__name__ in SHARED_EXPERT_BLOCKS]
    assert all(isinstance(m.shared_experts.gate_proj, NVFP4Linear) for m in moe_blocks)
    assert fuse_shared_experts(fused) == len(moe_blocks)
    (name, block), = [(n, m) for n, m in fused.named_modules() if isinstance(m, SharedExpertMoE)][:1]
    original = unfused.get_submodule(name)
    assert type(original).__name__ in SHARED_EXPERT_BLOCKS
    x = torch.randn(3, 7, original.experts.hidden_size, dtype=torch.bfloat16)
    with torch.no_grad():
        got, want_unfused = block(x), original(x)
        _, weights, ids = original.gate(x)
    e = original.experts.num_experts
    t = ids.shape[0]
    w = block.experts.canonical()
    ids_all = torch.cat([ids, torch.full((t, 1), e)], 1)
    weights_all = torch.cat([weights.float(), torch.ones(t, 1)], 1)
    want = moe64(x.reshape(t, -1), ids_all, weights_all, *w.tensors()).reshape(x.shape)

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    # the op's reference backend against float64 (bf16 activations between the GEMMs and one
    # rounding of the sum: the bound of tests/test_op.py); the unfused block adds two bf16 outputs
    assert rel(got, want) < 4e-3
    assert rel(want_unfused, want) < 8e-3 and rel(got, want_unfused) < 8e-3


@pytest.mark.parametrize("model_fn", [tiny_deepseek_v3, tiny_glm4_moe])
def test_fused_experts_carry_the_routed_rows_hint(model_fn):
    from hf_integration.shared_experts import routed_rows_hint

    fused = blocks(patched(model_fn), SharedExpertMoE)
    assert fused
    for block in fused:
        k = block.gate.top_k
        assert block.experts.routed_experts == routed_rows_hint(block.num_routed, k) == \
            round(block.num_routed * (k + 1) / k)


def test_the_routed_rows_hint_gives_the_routed_experts_tiles():
    """The shared expert's T slots must not move a call into another bucket: with the hint, the
    fused call's tiles are those of the routed experts' own call at every token count (DeepSeek-V3's
    E=256, top-8: counted over 257 experts, 172-192, 229-256, 457-512 and 1828-2047 tokens land a
    bucket higher)."""
    from fp4moe_ops.backends.triton_moe.launch import kernel_config
    from hf_integration.shared_experts import routed_rows_hint

    bucket = ("BM", "BN_GATE_UP", "BK_GATE_UP", "BN_DOWN", "BK_DOWN", "num_warps", "GLUON_PREFILL", "DECODE_V3")
    e, k, h, i = 256, 8, 7168, 2048
    hint = routed_rows_hint(e, k)
    for t in range(1, 4097):
        fused = kernel_config(t * (k + 1), e + 1, h, i, hint)
        routed = kernel_config(t * k, e, h, i)
        assert [fused[key] for key in bucket] == [routed[key] for key in bucket], t


def test_state_dict_and_saved_checkpoint_are_the_unfused_ones(tmp_path):
    unfused = patched(fuse=False)
    fused = copy.deepcopy(unfused)
    from hf_integration import fuse_shared_experts

    fuse_shared_experts(fused)
    a, b = unfused.state_dict(), fused.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    unfused.save_pretrained(tmp_path / "unfused")
    fused.save_pretrained(tmp_path / "fused")
    fa, fb = file_tensors(tmp_path / "unfused"), file_tensors(tmp_path / "fused")
    assert fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa)
    assert any(".shared_experts.gate_proj.weight_scale_2" in k for k in fb)
    # reloaded, each gives its own logits bit for bit when it runs the shared experts the same way
    # (from_pretrained does not fuse by default; the README says so)
    ids = torch.randint(1, 256, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        for model, config in ((fused, ModelOptConfig(fuse_shared_experts=True)), (unfused, None)):
            kw = {"quantization_config": config} if config is not None else {}
            back = AutoModelForCausalLM.from_pretrained(tmp_path / "fused", dtype=torch.bfloat16, **kw)
            assert isinstance(back.model.layers[1].mlp, SharedExpertMoE) == (config is not None)
            assert torch.equal(back(ids).logits, model(ids).logits)
    # load_state_dict takes the unfused layout back
    again = copy.deepcopy(fused)
    for m in again.modules():
        if isinstance(m, SharedExpertMoE):
            m.experts.gate_up_proj_global_scale.mul_(2)
    again.load_state_dict(a)
    assert all(torch.equal(v, fused.state_dict()[k]) for k, v in again.state_dict().items())


def test_a_calibrated_fused_model_state_dict_holds_the_shared_input_scales_and_loads_back():
    # calibration gives the fused layer input scales [E + 1] that no file scalar of the shared
    # expert holds: its state dict left the shared expert's out, and loading it back failed with
    # a size mismatch ([E] against [E + 1])
    from hf_integration import calibrate_activation_scales

    model = patched(fuse=True)
    calibrate_activation_scales(model, [torch.randint(1, 256, (2, 12))])
    state = {k: v.clone() for k, v in model.state_dict().items()}  # (not aliases of the buffers changed below)
    key = next(k for k in state if k.endswith("shared_experts.down_proj.input_scale"))
    fused = next(m for m in model.modules() if isinstance(m, SharedExpertMoE))
    assert torch.equal(state[key], fused.experts.down_proj_input_scale[-1])
    before = {k: v.clone() for k, v in state.items()}
    for m in model.modules():
        if isinstance(m, SharedExpertMoE):
            m.experts.gate_up_proj_input_scale.mul_(2)
    model.load_state_dict(state)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_fused_model_compiles_without_graph_breaks_and_generates_like_unfused():
    torch.manual_seed(1)
    unfused = patched(fuse=False)
    fused = copy.deepcopy(unfused)
    from hf_integration import fuse_shared_experts

    fuse_shared_experts(fused)
    ids = torch.randint(1, 256, (2, 6))
    explanation = torch._dynamo.explain(fused)(ids)
    assert explanation.graph_break_count == 0
    assert_fused_like_unfused(unfused, fused, ids, 2e-2)  # the same weights; only the order of bf16 roundings differs
    assert fused.generate(ids, max_new_tokens=3, do_sample=False).shape == (2, 9)


def test_fusing_is_optional_and_refused_where_one_expert_cannot_hold_the_shared_one(tmp_path):
    assert not blocks(patched(fuse=False), SharedExpertMoE)
    assert not blocks(patch_deepseek(tiny_deepseek_v3()), SharedExpertMoE)  # BF16 shared experts
    # a shared expert of another width than the routed experts
    wide = patch_deepseek(tiny_deepseek_v3(n_shared_experts=2), quantize_dense_mlps=True)
    assert not blocks(wide, SharedExpertMoE) and isinstance(wide.model.layers[1].mlp.shared_experts.up_proj, NVFP4Linear)
    # gate and up with different global scales in the file: kept as three linears
    write_modelopt_checkpoint(tiny_deepseek_v3(seed=0), tmp_path, equal_gate_up_scales=False)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16,
                                                  quantization_config=ModelOptConfig(nvfp4_linears="nvfp4"))
    assert not blocks(loaded, SharedExpertMoE)
    assert isinstance(loaded.model.layers[1].mlp.shared_experts.gate_proj, NVFP4Linear)


@pytest.mark.parametrize("source", ["saved", "modelopt"])
def test_loading_with_kept_nvfp4_linears_fuses_and_matches_the_unfused_load(tmp_path, source):
    if source == "saved":
        folder = tmp_path / "ckpt"
        patched().save_pretrained(folder)
    else:  # a genuine nvidia-modelopt export (default config: the shared experts are NVFP4)
        folder = FIXTURES / "modelopt" / "deepseek_v3_nvfp4_default"
    kw = dict(dtype=torch.bfloat16)
    fused = AutoModelForCausalLM.from_pretrained(folder, quantization_config=ModelOptConfig(fuse_shared_experts=True),
                                                 **kw)
    unfused = AutoModelForCausalLM.from_pretrained(folder, **kw)  # NVFP4 linears kept, not fused: the default
    moe_layers = [m for m in unfused.modules() if type(m).__name__ in SHARED_EXPERT_BLOCKS]
    assert moe_layers and len(blocks(fused, SharedExpertMoE)) == len(moe_layers)
    shared = moe_layers[0].shared_experts
    fused_block = blocks(fused, SharedExpertMoE)[0]
    w = fused_block.split()[1]
    assert torch.equal(w.gate_up[0], torch.cat([shared.gate_proj.weight, shared.up_proj.weight]))  # the file's bytes
    assert torch.equal(w.down_global_scale[0], shared.down_proj.weight_scale_2)
    ids = torch.randint(1, 200, (1, 8))
    # three NVFP4 linears (weight rounded to bf16 after the global scale) vs the expert kernel's
    # arithmetic (exact decode, global scale on the float32 sum) on the same bytes. In our saved tiny
    # model the shared expert is about half of the first MoE block's output (without it the block
    # differs by 25-67%); the genuine export's was made from a model with small shared experts.
    assert_fused_like_unfused(unfused, fused, ids, 3e-2)
    saved = tmp_path / "again"
    fused.save_pretrained(saved)
    files = file_tensors(saved)
    for leaf in ("gate_proj", "up_proj", "down_proj"):
        key = f"model.layers.1.mlp.shared_experts.{leaf}.weight"
        assert torch.equal(files[key], getattr(shared, leaf).weight)


def test_expert_parallelism_refuses_a_fused_model_before_changing_it():
    from hf_integration import shard_experts

    model = patched()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="shared expert inside the routed experts' call"):
        shard_experts(model)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("fmt,name", [("modelopt", "deepseek_v3_nvfp4_default"),
                                      ("llmcompressor", "deepseek_v3_nvfp4a16")])
def test_a_loaded_fused_model_has_the_unfused_state_dict_and_takes_it_back(fmt, name):
    # the shared expert's keys are the file's three linears (compressed-tensors' own names and
    # dividing scalars included), not the fused module's
    folder = FIXTURES / fmt / name
    cls = CompressedTensorsNVFP4Config if fmt == "llmcompressor" else ModelOptConfig
    kw = dict(dtype=torch.bfloat16)
    fused = AutoModelForCausalLM.from_pretrained(folder, quantization_config=cls(fuse_shared_experts=True), **kw)
    unfused = AutoModelForCausalLM.from_pretrained(folder, quantization_config=cls(), **kw)
    assert blocks(fused, SharedExpertMoE) and not blocks(unfused, SharedExpertMoE)
    a, b = unfused.state_dict(), fused.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(k.endswith("shared_experts.gate_proj.weight_scale") for k in b)
    before = {k: v.clone() for k, v in b.items()}
    for m in blocks(fused, SharedExpertMoE):  # change the fused tensors, then load the unfused state back
        m.experts.gate_up_proj_global_scale.mul_(3)
        m.experts.down_proj_scale.view(torch.uint8)[-1] ^= 1
    fused.load_state_dict(a)
    after = fused.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_recalibrating_a_loaded_fused_model_moves_the_shared_input_scales_of_its_state_dict(tmp_path):
    # a W4A4 export's shared-expert input scales are kept as the file's scalars; after calibration
    # the state dict gave those stale scalars, and loading it back put them into the fused layer
    import shutil

    from safetensors.torch import save_file

    from hf_integration import calibrate_activation_scales

    # The export's own scales came from calibrating on random token ids too, and a batch holding
    # the token that set its largest activation calibrates to the same value: the file's shared
    # input scales are made 4x larger first, which no calibration here reproduces
    folder = tmp_path / "export"
    shutil.copytree(FIXTURES / "modelopt" / "deepseek_v3_nvfp4_default", folder)
    tensors = load_file(folder / "model.safetensors")
    scaled = [k for k in tensors if ".shared_experts." in k and k.endswith(".input_scale")]
    assert scaled
    save_file({k: v * 4 if k in scaled else v for k, v in tensors.items()}, folder / "model.safetensors",
              metadata={"format": "pt"})
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=ModelOptConfig(fuse_shared_experts=True),
                                                 dtype=torch.bfloat16)
    fused = blocks(model, SharedExpertMoE)[0]
    key = next(k for k in model.state_dict() if k.endswith("shared_experts.down_proj.input_scale"))
    filed = model.state_dict()[key].clone()
    calibrate_activation_scales(model, [torch.randint(1, 200, (2, 10))])
    calibrated = fused.experts.down_proj_input_scale[-1].clone()
    assert not torch.equal(calibrated, filed)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert torch.equal(state[key], calibrated)
    model.load_state_dict(state)
    assert torch.equal(fused.experts.down_proj_input_scale[-1], calibrated)


def test_nvfp4_activations_are_refused_on_fused_experts_and_change_nothing():
    from hf_integration import calibrate_activation_scales, set_backend

    model = patched()
    calibrate_activation_scales(model, [torch.randint(1, 256, (2, 8))])
    with pytest.raises(ValueError, match="fuse_shared_experts=False"):
        set_backend(model, "reference", act_scale_mode="global_max")
    assert all(m.experts.act_scale_mode is None for m in blocks(model, SharedExpertMoE))


def test_nvfp4_activations_after_loading_need_the_shared_expert_unfused():
    # a genuine ModelOpt W4A4 export (input scales in the file): loaded with its shared experts
    # inside the routed call, it cannot switch to NVFP4 activations (the shared expert would take
    # the routed experts' activation scale) and the error says how to load it instead; loaded as by
    # default (unfused), it can
    from hf_integration import load_modelopt_nvfp4, set_backend

    folder = FIXTURES / "modelopt" / "deepseek_v3_nvfp4_default"
    fused = load_modelopt_nvfp4(folder, fuse_shared_experts=True)
    assert blocks(fused, SharedExpertMoE)
    with pytest.raises(ValueError, match="load without fuse_shared_experts=True"):
        set_backend(fused, "reference", act_scale_mode="global_max")
    unfused = load_modelopt_nvfp4(folder)
    assert not blocks(unfused, SharedExpertMoE)
    set_backend(unfused, "reference", act_scale_mode="global_max")
    ids = torch.randint(1, 100, (1, 5))
    with torch.no_grad():
        assert torch.isfinite(unfused(ids).logits).all()
