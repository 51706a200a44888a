"""Tiny random Transformers models (no download) for tests, the demo and CI."""

from __future__ import annotations

import re

import torch

from .llama4 import is_llama4_experts

# Shared by the tiny DeepSeek-family configs: 2 layers (the first dense), 8 experts, top-2.
_DEEPSEEK_LIKE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                      num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
                      n_shared_experts=1, max_position_embeddings=256, pad_token_id=0)
_MLA = dict(num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=8)


def _tiny(config_class: str, dtype, **cfg):
    """A randomly initialized model of ``transformers.<config_class>(**cfg)`` in ``dtype``."""
    import transformers

    config = getattr(transformers, config_class)(**cfg)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    _randomize_experts(model)
    return model.eval()


def tiny_deepseek_v3(dtype=torch.bfloat16, seed: int | None = None, **overrides):
    """A 3-layer DeepSeek-V3 (one dense layer, two MoE layers with 8 experts, top-2)."""
    if seed is not None:
        torch.manual_seed(seed)
    cfg = _DEEPSEEK_LIKE | _MLA | dict(num_hidden_layers=3, n_group=2, topk_group=1, routed_scaling_factor=2.5)
    return _tiny("DeepseekV3Config", dtype, **(cfg | overrides))


def tiny_deepseek_v2(dtype=torch.bfloat16):
    return _tiny("DeepseekV2Config", dtype, **_DEEPSEEK_LIKE, **_MLA, n_group=2, topk_group=1, topk_method="greedy")


def tiny_glm4_moe(dtype=torch.bfloat16):
    return _tiny("Glm4MoeConfig", dtype, **_DEEPSEEK_LIKE, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, n_group=1, topk_group=1)


def tiny_qwen3_moe(dtype=torch.bfloat16):
    return _tiny("Qwen3MoeConfig", dtype, vocab_size=256, hidden_size=64, intermediate_size=128,
                 moe_intermediate_size=32, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0)


def tiny_minimax_m2(dtype=torch.bfloat16):
    """MiniMax-M2's layout: sigmoid top-k router with a correction bias, checkpoint keys
    ``block_sparse_moe.experts.<e>.w1/w2/w3`` (Transformers maps them to ``mlp.experts``)."""
    return _tiny("MiniMaxM2Config", dtype, vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
                 max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def tiny_llama4_text(dtype=torch.bfloat16):
    """Llama-4's text MoE: fused experts stored transposed (``gate_up_proj [E, H, 2I]``, input dim
    first), a shared expert, sigmoid top-1 routing; both layers MoE."""
    return _tiny("Llama4TextConfig", dtype, vocab_size=256, hidden_size=64, intermediate_size=32,
                 intermediate_size_mlp=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, num_local_experts=4, num_experts_per_tok=1, max_position_embeddings=256, pad_token_id=0)


def tiny_mixtral(dtype=torch.bfloat16):
    return _tiny("MixtralConfig", dtype, vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                 num_local_experts=4, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=256, pad_token_id=0)


@torch.no_grad()
def _randomize_experts(model) -> None:
    """Give experts well-scaled random weights (the default init leaves some at zero), and
    routers and the LM head well-separated scores: with the default std 0.02 all router scores
    and logits are near ties, so any rounding difference (compiled vs eager) flips top-k and
    greedy choices and comparisons become coin tosses. Shared experts too: at std 0.02 their
    output was ~1/700 of the routed experts' (DeepSeek-V3), so no comparison could see them."""
    # Peaky output distribution: greedy decoding then has clear winners instead of near-ties.
    lm_head = model.get_output_embeddings()
    lm_head.weight.normal_(0, 8 * lm_head.weight.shape[-1] ** -0.5)
    for m in model.modules():
        shared = getattr(m, "shared_experts", None) or getattr(m, "shared_expert", None)
        for name in ("gate_proj", "up_proj", "down_proj"):
            linear = getattr(shared, name, None)
            if isinstance(linear, torch.nn.Linear):
                linear.weight.normal_(0, linear.in_features ** -0.5)
        experts = getattr(m, "experts", None)
        if isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor) and experts.gate_up_proj.dim() == 3:
            fan_in = 1 if is_llama4_experts(experts) else -1  # Llama-4's bmm layout [E, K, N]
            experts.gate_up_proj.normal_(0, experts.gate_up_proj.shape[fan_in] ** -0.5)
            experts.down_proj.normal_(0, experts.down_proj.shape[fan_in] ** -0.5)
            gate = getattr(m, "gate", None) if hasattr(m, "gate") else getattr(m, "router", None)
            if gate is not None and getattr(gate, "weight", None) is not None:
                gate.weight.normal_(0, 4 * gate.weight.shape[-1] ** -0.5)


def tiny_tokenizer():
    """A word-level tokenizer built in memory: "w0" .. "w252" plus [PAD], [UNK], [EOS]."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, "[EOS]": 2} | {f"w{i}": i + 3 for i in range(253)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]")


QUANTIZED_MLP = re.compile(r"\.(mlp|shared_experts)\.(gate_proj|up_proj|down_proj)$")  # dense MLP linears


@torch.no_grad()
def write_modelopt_checkpoint(model, path, *, equal_gate_up_scales: bool = True, shards: int = 2,
                              model_type: str | None = None, input_scales: bool = True) -> dict:
    """Write ``model`` (a BF16 Transformers MoE model) as a ModelOpt NVFP4 checkpoint in the layout of
    :mod:`hf_integration.checkpoint_format`, under the checkpoint's own names (Transformers' reverse
    weight conversion: per-expert keys, Mixtral-style ``block_sparse_moe.experts.<e>.w1`` where the
    architecture's checkpoints use them): routed experts per expert, dense/shared MLP linears NVFP4,
    everything else as is; random (but ModelOpt-like) per-linear input scales (none with
    ``input_scales=False``, a W4A16 export). Returns the tensors written (name -> tensor).

    ``equal_gate_up_scales`` mimics ModelOpt's fused gate/up amax (routed experts and dense MLPs);
    False writes different ``weight_scale_2`` for gate and up (a loader must reconcile them).
    """
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    from fp4moe_ops import nvfp4

    from .checkpoint_format import ModelOptConfig, linear_tensors

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}

    def put_linear(name, w, global_scale=None, input_scale=None):
        q = nvfp4.quantize_nvfp4(w.float(), global_scale)
        if input_scale is None:
            input_scale = (torch.rand(()) * 4 + 1) / (6 * 448)
        tensors.update(linear_tensors(name, q.packed, q.block_scale, q.global_scale,
                                      input_scale if input_scales else None))

    # The checkpoint's own names (e.g. MiniMax-M2's block_sparse_moe.experts.<e>.w1): Transformers'
    # reverse weight conversion of the BF16 model, the same one its save_pretrained applies.
    from transformers.core_model_loading import revert_weight_conversion

    from .checkpoint_format import expert_leaves, model_conversions

    _, converters = model_conversions(model)
    leaves = [expert_leaves(name, converters) for name, m in model.named_modules()
              if isinstance(getattr(m, "gate_up_proj", None), torch.Tensor)]
    gate, up, down = (leaves[0].gate, leaves[0].up, leaves[0].down) if leaves else ("gate_proj", "up_proj", "down_proj")
    expert_key = re.compile(rf"^(.*\.experts)\.(\d+)\.({gate}|{up}|{down})\.weight$")
    state = revert_weight_conversion(model, dict(model.state_dict()))
    for key, t in state.items():
        match = expert_key.match(key)
        if match and match.group(3) == gate:
            prefix, e = match.group(1), match.group(2)
            w_gate, w_up = t, state[f"{prefix}.{e}.{up}.weight"]
            shared = nvfp4.global_scale_from_amax(torch.maximum(w_gate.abs().max(), w_up.abs().max()).float())
            same_input = (torch.rand(()) * 4 + 1) / (6 * 448)  # gate and up read the same input
            put_linear(f"{prefix}.{e}.{gate}", w_gate, shared if equal_gate_up_scales else None, same_input)
            put_linear(f"{prefix}.{e}.{up}", w_up, shared if equal_gate_up_scales else None, same_input.clone())
        elif match and match.group(3) == down:
            put_linear(key[:-len(".weight")], t)
        elif not match and key.endswith(".weight") and QUANTIZED_MLP.search(key[:-len(".weight")]):
            name = key[:-len(".weight")]
            if name.endswith(".up_proj"):
                continue  # with its gate_proj
            if name.endswith(".gate_proj"):  # one global scale and input scale for gate and up, as ModelOpt's
                w_up = state[f"{name[:-len('gate_proj')]}up_proj.weight"]
                shared = nvfp4.global_scale_from_amax(torch.maximum(t.abs().max(), w_up.abs().max()).float())
                same_input = (torch.rand(()) * 4 + 1) / (6 * 448)
                put_linear(name, t, shared if equal_gate_up_scales else None, same_input)
                put_linear(f"{name[:-len('gate_proj')]}up_proj", w_up, shared if equal_gate_up_scales else None,
                           same_input.clone())
            else:
                put_linear(name, t)
    for key, t in state.items():
        if expert_key.match(key) or f"{key[:-len('.weight')]}.weight_scale" in tensors:
            continue
        tensors[key] = t.clone()
    if getattr(model.config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)

    keys = sorted(tensors)
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)] if shards > 1 else ["model.safetensors"]
    for i, name in enumerate(names):
        save_file({k: tensors[k].contiguous().clone() for k in keys[i::shards]}, str(path / name))
    if shards > 1:  # the index Transformers reads to find each tensor's shard
        weight_map = {k: names[i % shards] for i, k in enumerate(keys)}
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg = model.config.to_dict()
    cfg.pop("_experts_implementation", None)
    cfg.pop("quantization_config", None)  # like NVIDIA's DeepSeek exports: the config is in hf_quant_config.json
    if model_type:
        cfg["model_type"] = model_type
    (path / "config.json").write_text(json.dumps(cfg, indent=1, default=str))
    quant = ModelOptConfig(quant_algo="NVFP4" if input_scales else "W4A16_NVFP4",
                           exclude_modules=["lm_head", "*self_attn*", "*mlp.gate"], producer={"name": "modelopt"})
    (path / "hf_quant_config.json").write_text(json.dumps(quant.hf_quant_config(), indent=1))
    return tensors


# gpt-oss-20b's config.json lists these as kept in BF16 (Transformers' Mxfp4Config reads it)
GPT_OSS_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def tiny_gpt_oss(dtype=torch.bfloat16, seed: int | None = None, **overrides):
    """A 2-layer gpt-oss (one sliding-window and one full-attention layer, 4 experts, top-2), BF16 experts."""
    if seed is not None:
        torch.manual_seed(seed)
    cfg = dict(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
               max_position_embeddings=131072,  # YaRN's factor 32 over 4096 positions, as gpt-oss's config
               pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return _tiny("GptOssConfig", dtype, **(cfg | overrides))


@torch.no_grad()
def write_gpt_oss_mxfp4_checkpoint(path, seed: int = 0, shards: int = 2, **overrides) -> dict:
    """Write a tiny gpt-oss checkpoint in the published MXFP4 layout (OpenAI's gpt-oss-20b/120b, as
    :mod:`fp4moe_ops.mxfp4` describes it): per layer ``mlp.experts.{gate_up_proj,down_proj}_blocks``
    and ``_scales`` uint8 with random bytes (every E2M1 code) and E8M0 scales 2^-6..2^-4 (weights of
    about 1/sqrt(fan-in)), BF16 biases, everything else BF16 from :func:`tiny_gpt_oss`; sharded with
    an index; ``config.json`` with gpt-oss's ``quantization_config``. Returns the tensors written."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    from fp4moe_ops.mxfp4 import gpt_oss_shapes

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = tiny_gpt_oss(seed=seed, **overrides)
    cfg = model.config
    e, h, i = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    g = torch.Generator().manual_seed(seed + 1)
    tensors = {}
    for key, t in model.state_dict().items():
        prefix, _, leaf = key.rpartition(".")
        if not prefix.endswith(".mlp.experts"):
            tensors[key] = t.clone()
            continue
        if leaf in ("gate_up_proj", "down_proj"):
            rows, cols = (2 * i, h) if leaf == "gate_up_proj" else (h, i)
            blocks, scales = gpt_oss_shapes(rows, cols, e)
            tensors[f"{key}_blocks"] = torch.randint(0, 256, blocks, dtype=torch.uint8, generator=g)
            tensors[f"{key}_scales"] = torch.randint(121, 124, scales, dtype=torch.uint8, generator=g)
        else:  # the biases
            tensors[key] = (torch.randn(t.shape, generator=g) * 0.1).to(torch.bfloat16)
    keys = sorted(tensors)
    names = [f"model-{n + 1:05d}-of-{shards:05d}.safetensors" for n in range(shards)] if shards > 1 else ["model.safetensors"]
    for n, name in enumerate(names):
        save_file({k: tensors[k].contiguous() for k in keys[n::shards]}, str(path / name), metadata={"format": "pt"})
    if shards > 1:
        weight_map = {k: names[n % shards] for n, k in enumerate(keys)}
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = cfg.to_dict()
    config.pop("_experts_implementation", None)
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": GPT_OSS_NOT_CONVERTED}
    (path / "config.json").write_text(json.dumps(config, indent=1, default=str))
    return tensors
