"""The contract every quantized module kind keeps, run on each kind of :data:`hf_integration.kinds.KINDS`
(a kind added there gets these cases once it has a factory here): ``load_state_dict`` refuses a
quantized tensor of another dtype or shape and a scale that is not finite or out of its format's
range, naming the key, with every tensor of the model unchanged (a model of two such modules under
:func:`~hf_integration.quantizer.attach_guards`: the second one's bad tensor must not leave the first
loaded); ``strict=False`` loads exactly the tensors given; a cast to float16 keeps the quantized bytes
and dequantizes to float16 weights equal to a float64 decode (:mod:`fp4moe_ops.oracle64`, never the
module's own decoder); ``.double()`` is refused with the model unchanged where the kind's op cannot
run float64; the state dict round-trips byte for byte."""

import re

import pytest
import torch
from torch import nn
from transformers import GptOssConfig

from fp4moe_ops import NVFP4MoEWeights
from fp4moe_ops.oracle64 import dequant64, dequant_mx64
from hf_integration.checkpoint_format import MODELOPT
from hf_integration.experts import FP8Linear, NVFP4Experts, NVFP4Linear
from hf_integration.gpt_oss import MXFP4GptOssExperts, NVFP4GptOssExperts
from hf_integration.mxfp4_quantizer import MIN_TRANSFORMERS, supported
from hf_integration.kinds import KINDS
from hf_integration.llama4 import NVFP4Llama4Experts
from hf_integration.mxfp4_layers import MXFP4Experts, MXFP4Linear
from hf_integration.quantizer import attach_guards
from hf_integration.shared_experts import ExpertsWithShared, SharedExpertMoE

E, H, I = 3, 64, 32  # experts, hidden, intermediate: multiples of 32 (MXFP4's block)


# --- random tensors, valid by their format's rules -----------------------------------------------


def random_tensor(dtype: torch.dtype, shape, kind: str | None, gen: torch.Generator) -> torch.Tensor:
    """Non-degenerate random values a check accepts: ``kind`` is the scale rule the tensor follows
    (:data:`fp4moe_ops.moe_weights.SCALE_CHECKS`), None for packed codes, FP8 weights and plain tensors."""
    rand = torch.rand(shape, generator=gen, dtype=torch.float64)
    if kind == "block":
        return (0.5 + 3.5 * rand).to(torch.float8_e4m3fn)
    if kind == "e8m0":  # 2^-8 .. 2^-3
        return torch.randint(119, 125, shape, generator=gen, dtype=torch.uint8)
    if kind == "global":
        return (0.5 + 1.5 * rand).float()
    if kind == "input":
        return (0.1 + rand).float()
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    return (4 * rand - 2).to(dtype)  # FP8 weights, biases, a router's weight


def random_state(module: nn.Module, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A valid state dict for ``module``, every tensor random."""
    layout, kinds = quantized_layout(module), scale_kinds(module)
    state = {}
    for key, held in module.state_dict().items():
        dtype, shape = layout.get(key, (held.dtype, tuple(held.shape)))
        state[key] = random_tensor(dtype, shape, kinds.get(key), gen)
    return state


def quantized_layout(module: nn.Module) -> dict[str, tuple[torch.dtype, tuple]]:
    """``{state dict key: (dtype, shape)}`` of every quantized tensor of ``module`` and its submodules."""
    return {f"{name}.{k}" if name else k: v for name, m in module.named_modules()
            if callable(getattr(m, "incoming_layout", None)) for k, v in m.incoming_layout().items()}


def scale_kinds(module: nn.Module) -> dict[str, str]:
    return {f"{name}.{k}" if name else k: kind for name, m in module.named_modules()
            if callable(getattr(m, "scale_checks", None)) for k, kind in m.scale_checks()}


def loaded(module: nn.Module, seed: int) -> nn.Module:
    module.load_state_dict(random_state(module, torch.Generator().manual_seed(seed)))
    return module


# --- one factory per kind: a tiny random instance on the CPU ---------------------------------------


def gpt_oss_config() -> GptOssConfig:
    return GptOssConfig(num_local_experts=E, hidden_size=H, intermediate_size=I, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=64)


def nvfp4_experts(cls, seed):
    return loaded(cls(None, None, num_experts=E, hidden_size=H, intermediate_size=I, input_scales=True), seed)


def shared_expert_block(seed):
    """A fused shared expert: the routed experts and the shared one (its gate and up on one global
    and input scale, as the block requires) as one ``E + 1`` experts layer."""
    gen = torch.Generator().manual_seed(seed)
    w = [random_tensor(torch.uint8, (E + 1, 2 * I, H // 2), None, gen),
         random_tensor(torch.float8_e4m3fn, (E + 1, 2 * I, H // 16), "block", gen),
         random_tensor(torch.float32, (E + 1,), "global", gen),
         random_tensor(torch.uint8, (E + 1, H, I // 2), None, gen),
         random_tensor(torch.float8_e4m3fn, (E + 1, H, I // 16), "block", gen),
         random_tensor(torch.float32, (E + 1,), "global", gen),
         random_tensor(torch.float32, (E + 1,), "input", gen), random_tensor(torch.float32, (E + 1,), "input", gen)]
    experts = ExpertsWithShared(NVFP4MoEWeights(*w), backend=None, owns_weights=True)
    scalars = {f"{leaf}.{t}": s[E].clone() for leaf, g, i in (("gate_proj", w[2], w[6]), ("up_proj", w[2], w[6]),
                                                              ("down_proj", w[5], w[7]))
               for t, s in (("weight_scale_2", g), ("input_scale", i))}
    gate = nn.Linear(H, E, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        gate.weight.copy_(random_tensor(torch.bfloat16, (E, H), None, gen))
    return SharedExpertMoE(gate, experts, E, MODELOPT, scalars)


def linear(cls, seed, **kwargs):
    return loaded(cls(nn.Linear(H, I, dtype=torch.bfloat16), input_scale=True, **kwargs), seed)


FACTORIES = {
    NVFP4Experts: lambda seed: nvfp4_experts(NVFP4Experts, seed),
    NVFP4Llama4Experts: lambda seed: nvfp4_experts(NVFP4Llama4Experts, seed),
    SharedExpertMoE: shared_expert_block,
    NVFP4Linear: lambda seed: linear(NVFP4Linear, seed, scheme=MODELOPT),
    FP8Linear: lambda seed: linear(FP8Linear, seed),
    MXFP4GptOssExperts: lambda seed: loaded(MXFP4GptOssExperts(gpt_oss_config()), seed),
    NVFP4GptOssExperts: lambda seed: loaded(NVFP4GptOssExperts(gpt_oss_config(), input_scales=True), seed),
    MXFP4Experts: lambda seed: loaded(MXFP4Experts(E, H, I), seed),
    MXFP4Linear: lambda seed: loaded(MXFP4Linear(nn.Linear(H, I, dtype=torch.bfloat16)), seed),
}


@pytest.fixture(params=KINDS, ids=lambda kind: kind.__name__)
def kind(request):
    if request.param in (MXFP4GptOssExperts, NVFP4GptOssExperts) and not supported():
        pytest.skip(f"fp4moe's gpt-oss path needs Transformers {'.'.join(map(str, MIN_TRANSFORMERS))} or later "
                    "(an older one's GptOssConfig has no swiglu_alpha)")
    return request.param


def test_every_kind_has_a_factory():
    assert set(FACTORIES) == set(KINDS)


# --- float64 decodes of a state dict, in dequantized_state's names and layouts ------------------


def nvfp4_stack64(packed, block, global_scale) -> torch.Tensor:
    """``[E, N, K/2]`` / ``[E, N, K/16]`` / ``[E]`` or ``[]`` -> ``[E, N, K]`` float64."""
    scales = global_scale.reshape(-1).expand(packed.shape[0])
    return torch.stack([dequant64(packed[e], block[e], scales[e]) for e in range(packed.shape[0])])


def experts64(state, prefix="", count=None):
    n = slice(None, count)
    return {f"{prefix}gate_up_proj": nvfp4_stack64(*(state[f"{prefix}gate_up_proj_{t}"][n] for t in ("packed", "scale", "global_scale"))),
            f"{prefix}down_proj": nvfp4_stack64(*(state[f"{prefix}down_proj_{t}"][n] for t in ("packed", "scale", "global_scale")))}


def shared_block64(state):
    out = {"gate.weight": state["gate.weight"].double()} | experts64(state, "experts.")
    for leaf in ("gate_proj", "up_proj", "down_proj"):
        key = f"shared_experts.{leaf}."
        out[f"{key}weight"] = dequant64(state[f"{key}weight"], state[f"{key}weight_scale"], state[f"{key}weight_scale_2"])
    return out


def linear64(state):
    return {"weight": dequant64(state["weight"], state["weight_scale"], state["weight_scale_2"]),
            "bias": state["bias"].double()}


def fp8_linear64(state):
    return {"weight": state["weight"].double() * state["weight_scale"].double(), "bias": state["bias"].double()}


def mxfp4_gpt_oss64(state):
    out = {f"{proj}_bias": state[f"{proj}_bias"].double() for proj in ("gate_up_proj", "down_proj")}
    for proj in ("gate_up_proj", "down_proj"):  # GptOssExperts holds [E, K, N]: the transposes
        out[proj] = dequant_mx64(state[f"{proj}_blocks"], state[f"{proj}_scales"]).transpose(1, 2)
    return out


def nvfp4_gpt_oss64(state):
    out = {f"{proj}_bias": state[f"{proj}_bias"].double() for proj in ("gate_up_proj", "down_proj")}
    for proj in ("gate_up_proj", "down_proj"):  # ModelOpt's [E, K/2, N] are the [E, N, K/2] rows transposed
        rows = nvfp4_stack64(state[proj].transpose(1, 2), state[f"{proj}_weight_scale"].transpose(1, 2),
                             state[f"{proj}_weight_scale_2"])
        out[proj] = rows.transpose(1, 2)
    return out


def mxfp4_rows64(packed, scales):
    """``[..., N, K/2]`` / ``[..., N, K/32]`` E8M0 -> ``[..., N, K]`` float64 (the blocks as gpt-oss's)."""
    return dequant_mx64(packed.unflatten(-1, (-1, 16)), scales)


def mxfp4_experts64(state):
    return {proj: mxfp4_rows64(state[f"{proj}_packed"], state[f"{proj}_scale"]) for proj in ("gate_up_proj", "down_proj")}


def mxfp4_linear64(state):
    return {"weight": mxfp4_rows64(state["weight_packed"], state["weight_scale"]), "bias": state["bias"].double()}


# None: the kind refuses to dequantize (Llama-4's experts: fp4moe cannot give Transformers' module back)
DECODE64 = {NVFP4Experts: experts64, NVFP4Llama4Experts: None, SharedExpertMoE: shared_block64,
            NVFP4Linear: linear64, FP8Linear: fp8_linear64, MXFP4GptOssExperts: mxfp4_gpt_oss64,
            NVFP4GptOssExperts: nvfp4_gpt_oss64, MXFP4Experts: mxfp4_experts64, MXFP4Linear: mxfp4_linear64}
# keys that must change together (the fused shared expert runs up on gate's scales): a bad value in
# one is refused naming either
TIED = {f"shared_experts.{a}_proj.{t}": f"shared_experts.{b}_proj.{t}" for t in ("weight_scale_2", "input_scale")
        for a, b in (("gate", "up"), ("up", "gate"))}


# --- helpers --------------------------------------------------------------------------------------


class Model(nn.Module):
    """Two modules of one kind under the model-wide guards, the way a model holds its layers."""

    def __init__(self, kind, seeds=(1, 2)):
        super().__init__()
        self.first, self.second = (FACTORIES[kind](s) for s in seeds)
        attach_guards(self)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def snapshot(model: nn.Module) -> dict:
    """Every tensor the model holds (state dict, buffers kept out of it, parameters), as bytes."""
    tensors = {f"state:{k}": v for k, v in model.state_dict().items()}
    tensors |= {f"buffer:{k}": v for k, v in model.named_buffers()}
    tensors |= {f"param:{k}": v for k, v in model.named_parameters()}
    return {k: (v.dtype, tuple(v.shape), as_bytes(v).clone()) for k, v in tensors.items()}


def assert_unchanged(model: nn.Module, before: dict) -> None:
    after = snapshot(model)
    assert sorted(after) == sorted(before)
    for k, (dtype, shape, data) in before.items():
        assert after[k][:2] == (dtype, shape) and torch.equal(after[k][2], data), k


def assert_same_bytes(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(as_bytes(a[k]), as_bytes(b[k])), k


def refused(model: nn.Module, state: dict, key: str, reason: str = "") -> None:
    """``load_state_dict(state)`` raises naming ``key`` (or the key tied to it) and matching
    ``reason``, the model unchanged."""
    before = snapshot(model)
    partner = TIED.get(key.removeprefix("second."))
    names = [key] + ([f"second.{partner}"] if partner else [])
    with pytest.raises((TypeError, ValueError), match="|".join(re.escape(n) for n in names)) as raised:
        model.load_state_dict(state)
    assert re.search(reason, str(raised.value)), raised.value
    assert_unchanged(model, before)


# --- the cases ------------------------------------------------------------------------------------

# quantized dtype -> a tensor of the same bytes or values in another dtype
WRONG_DTYPE = {torch.uint8: lambda t: t.view(torch.int8), torch.float8_e4m3fn: lambda t: t.view(torch.uint8),
               torch.float32: lambda t: t.double()}
# scale rule -> (a value that is not finite, a value out of its range)
BAD_VALUES = {"block": (float("nan"), -1.0), "e8m0": (255, 253), "global": (float("nan"), 0.0),
              "input": (float("inf"), -1.0)}


def test_a_wrong_dtype_or_shape_is_refused_naming_the_key_and_nothing_changes(kind):
    model = Model(kind)
    other = Model(kind, seeds=(3, 4)).state_dict()
    for key, (dtype, shape) in quantized_layout(model.second).items():
        key = f"second.{key}"
        for change in (WRONG_DTYPE[dtype], lambda t: t[..., :-1] if t.dim() else t.reshape(1, 1)):
            state = dict(other)
            state[key] = change(other[key])
            refused(model, state, key)


@pytest.mark.parametrize("bad", ["not_finite", "out_of_range"])
def test_a_bad_scale_is_refused_naming_the_key_and_nothing_changes(kind, bad):
    model = Model(kind)
    other = Model(kind, seeds=(3, 4)).state_dict()
    checked = scale_kinds(model.second)
    assert checked
    for key, rule in checked.items():
        key = f"second.{key}"
        state = dict(other)
        t = other[key].clone()
        value = BAD_VALUES[rule][bad == "out_of_range"]
        t.view(-1)[0] = value
        if key.removeprefix("second.") in TIED:  # (its partner too: a mismatch would be refused on its own)
            partner = f"second.{TIED[key.removeprefix('second.')]}"
            state[partner] = t.clone()
        state[key] = t
        # (a non-finite value refused as such: an E8M0 0xFF byte is past the range too)
        refused(model, state, key, "must be finite|NaN" if bad == "not_finite" else "")


def test_a_module_refuses_on_its_own_too(kind):
    module = FACTORIES[kind](1)
    key, (dtype, _) = next(iter(quantized_layout(module).items()))
    state = {k: v.clone() for k, v in FACTORIES[kind](3).state_dict().items()}
    state[key] = WRONG_DTYPE[dtype](state[key])
    before = snapshot(module)
    with pytest.raises(TypeError, match=re.escape(key)):
        module.load_state_dict(state)
    assert_unchanged(module, before)


def test_a_partial_load_loads_exactly_the_tensors_given(kind):
    module = FACTORIES[kind](1)
    other = FACTORIES[kind](3).state_dict()
    # the fused shared expert's tensors are taken together (they become one row of the fused experts)
    groups = [[k] for k in other if not k.startswith("shared_experts.")]
    groups += [[k for k in other if k.startswith("shared_experts.")]] * any(k.startswith("shared_experts.") for k in other)
    for group in groups:
        before = {k: v.clone() for k, v in module.state_dict().items()}
        result = module.load_state_dict({k: other[k] for k in group}, strict=False)
        assert not result.unexpected_keys
        after = module.state_dict()
        assert_same_bytes({k: after[k] for k in group}, {k: other[k] for k in group})
        assert_same_bytes({k: v for k, v in after.items() if k not in group},
                          {k: v for k, v in before.items() if k not in group})


def test_the_state_dict_round_trips_byte_for_byte(kind):
    state = FACTORIES[kind](1).state_dict()
    module = FACTORIES[kind](2)
    module.load_state_dict(state)
    assert_same_bytes(module.state_dict(), state)


def ulps_apart(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """How many float16 steps ``got`` is from ``want`` (both float16)."""
    step = (torch.nextafter(want.abs(), torch.tensor(float("inf"), dtype=want.dtype)) - want.abs()).double()
    return (got.double() - want.double()).abs() / step


def test_a_cast_to_float16_keeps_the_bytes_and_dequantizes_to_the_float64_decode(kind):
    module = FACTORIES[kind](1)
    state = {k: v.clone() for k, v in module.state_dict().items()}
    quantized = quantized_layout(module)
    module.to(torch.float16)
    after = module.state_dict()
    assert_same_bytes({k: after[k] for k in quantized}, {k: state[k] for k in quantized})
    assert all(p.dtype == torch.float16 for p in module.parameters())
    decode = DECODE64[kind]
    if decode is None:
        with pytest.raises(NotImplementedError, match="cannot turn back"):
            module.dequantized_state(torch.float16, gpt_oss_config())
        return
    got = module.dequantized_state(torch.float16, gpt_oss_config())
    want = decode(state)
    assert sorted(got) == sorted(want)
    for key, w in want.items():
        assert got[key].dtype == torch.float16 and got[key].shape == w.shape, key
        assert w.abs().max() > 0 and w.std() > 0, key  # not a degenerate module
        # decoded in float32 then rounded once to float16: the float32 product of a code, a block
        # scale and a float32 global scale is itself rounded, so a float16 tie can round the other
        # way: at most one float16 step from the float64 decode rounded to float16, and mostly equal
        apart = ulps_apart(got[key], w.to(torch.float16))
        assert apart.max() <= 1, key
        assert (apart == 0).double().mean() > 0.99, key


def test_double_is_refused_with_the_model_unchanged_where_the_kind_cannot_run_it(kind):
    model = Model(kind)
    before = snapshot(model)
    runs = [m.COMPUTE_DTYPES for m in model.modules() if getattr(m, "COMPUTE_DTYPES", None) is not None]
    if all(torch.float64 in r for r in runs):  # (FP8 linears, dequantized at load, compute in any dtype)
        model.double()
        assert all(p.dtype == torch.float64 for p in model.parameters())
        after = snapshot(model)
        for key in quantized_layout(model.second):  # the quantized bytes kept
            dtype, shape, data = before[f"state:second.{key}"]
            assert after[f"state:second.{key}"][:2] == (dtype, shape) and torch.equal(after[f"state:second.{key}"][2], data)
        return
    with pytest.raises(ValueError, match=r"model.to\(torch.float64\): .* runs .* activations only"):
        model.double()
    assert_unchanged(model, before)


def test_a_missing_tensor_is_refused_with_strict_and_nothing_changes(kind):
    model = Model(kind)
    other = Model(kind, seeds=(3, 4)).state_dict()
    for key in quantized_layout(model.second):
        state = {k: v for k, v in other.items() if k != f"second.{key}"}
        before = snapshot(model)
        # (the fused shared expert names the tensor among those it takes together)
        named = re.escape(f"second.{key}") + "|" + re.escape(f"'{key.removeprefix('shared_experts.')}'")
        with pytest.raises((ValueError, RuntimeError), match=named):
            model.load_state_dict(state)
        assert_unchanged(model, before)
