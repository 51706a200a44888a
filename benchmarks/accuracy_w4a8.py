"""Whether FP8-activation ("W4A8") prefill on Hopper is accurate enough, measured before a kernel is
built: the logits of the genuine tiny exports (tests/fixtures) and the synthetic layer of
benchmarks/accuracy_study.py with the 4-bit GEMMs computed three ways, in float64 on the CPU.

    python benchmarks/accuracy_w4a8.py [--cases NAME,...] [--experts-only]     # CPU, ~1-2 min

Paths (each a change of the GEMMs' inputs only; everything else is the loaded fp4moe model):

* **W4A16**: the exact NVFP4/MXFP4 weight times the 16-bit activation (what fp4moe's Triton kernels
  compute on Hopper; fp4moe's own CPU forward is run as well, and its distance from this emulation is
  printed, so that the comparison is like for like).
* **W4A8**: the planned Hopper kernel's math, from benchmarks/probes/probe_w4a8_bound.py's float64
  oracle: activations per token to E4M3 (``oracle_act_quant64``: ``x8 = RNE_E4M3(x * fl32(448 /
  max|x|))``, ``s_x = fl32(max|x| / 448)``), NVFP4 weights to E4M3 with one power-of-two row scale
  (``oracle_decode64``: ``w8 = RNE_E4M3(e2m1 * s_b * 2^k)``, ``r = g * 2^-k``, ``k`` the largest with
  ``6 * max s_b * 2^k <= 448``), ``y = (x8 @ w8^T) * s_x * r`` exactly. MXFP4 weights (E8M0 block scales
  ``2^e``) fold the same way (:func:`mxfp4_decode_w4a8_64`): ``k = 6 - max_b e`` (the largest with
  ``6 * 2^(max e + k) <= 448``), ``w8 = RNE_E4M3(e2m1 * 2^(e + k))``, ``r = 2^-k``; a product is exact
  unless its block lies more than ~2^13 below the row's largest (E4M3's subnormals), so MXFP4 weights
  change only there.
* **NVFP4-act**: the activations through NVFP4 as the Blackwell path does (E2M1 values, E4M3 scales per
  16, the checkpoint's calibrated input scale as the per-tensor global scale; FlashInfer CUTLASS's
  formulation, ``fp4moe_ops.nvfp4.quantize_activation_nvfp4``, per expert or per linear as the
  checkpoint holds it), times the exact weight. Skipped where the checkpoint holds no input scales.

The activations are quantized at each 4-bit GEMM's input: an expert's gate_up GEMM reads the hidden
states routed to it, its down GEMM the gated intermediate as the kernels store it (16-bit). By default
every 4-bit GEMM of the export switches (the routed experts, and the NVFP4/MXFP4 linears: shared
experts, dense MLPs, attention where the export quantized them); ``--experts-only`` also gives the rows
where only the routed experts switch. Each GEMM's output stays float64 in every path (the kernels'
float32 accumulation and 16-bit store are common to all three), the experts' weighted sum is float64,
cast to the model dtype as fp4moe's op does.

The statistic is the tests' (tests/test_real_exports.py ``per_token_error``): per token
``||logits - ref|| / ||ref||`` against the tool's own weight-only forward (``logits_weights_only``, or
``weight_only_logits`` for gpt-oss), the median over the fixture's tokens. For the synthetic layer it is
accuracy_study.py's: the MoE output's relative error against the float64 unquantized layer. Two more
W4A8 variants attribute its error: its weight rounding alone (exact activations) and its activation
quantization alone (exact weights).
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "probes"))
from probe_w4a8_bound import (E4M3_MAX, e2m1_64, e4m3_64, oracle_act_quant64, oracle_decode64,  # noqa: E402
                              round_e4m3_64)

from fp4moe_ops.moe_math import clamped_swiglu, expert_groups, gated_silu  # noqa: E402
from fp4moe_ops.nvfp4 import quantize_activation_nvfp4  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures"
MODES = ("w4a16", "w4a8", "nvfp4_act", "w4a8_weights", "w4a8_acts")
# (name, checkpoint folder, reference file): every genuine export of tests/fixtures
CASES = ([(f"modelopt/{n}", FIXTURES / "modelopt" / n, FIXTURES / "modelopt" / n / "reference_logits.safetensors")
          for n in ("deepseek_v3_nvfp4_mlp_only", "deepseek_v3_nvfp4_default", "qwen3_moe_nvfp4_default",
                    "qwen3_moe_nvfp4_fp8kv", "llama4_text_nvfp4_mlp_only")]
         + [(f"llmcompressor/{n}", FIXTURES / "llmcompressor" / n,
             FIXTURES / "llmcompressor" / n / "reference_logits.safetensors")
            for n in ("deepseek_v3_nvfp4a16", "qwen3_moe_nvfp4", "qwen3_moe_nvfp4a16", "qwen3_moe_nvfp4a16_fp8kv",
                      "deepseek_v3_mxfp4a16", "qwen3_moe_mxfp4", "qwen3_moe_mxfp4a16")]
         + [(f"gpt_oss_nvfp4/{n}", FIXTURES / "gpt_oss_nvfp4" / n / "checkpoint",
             FIXTURES / "gpt_oss_nvfp4" / n / "reference_logits.pt") for n in ("modelopt", "llmcompressor")])


# --------------------------------------------------------------------------------------------------
# One 4-bit GEMM in float64


def mxfp4_decode_w4a8_64(packed: torch.Tensor, e8m0: torch.Tensor):
    """MXFP4 ``[N, K/2]`` bytes + E8M0 block scales ``[N, K/B]`` (uint8, or int8 bytes) -> ``(w8 [N, K]
    E4M3 values, r [N])`` float64: ``k = 6 - max_b e`` per row, ``w8 = RNE_E4M3(e2m1 * 2^(e + k))``,
    ``r = 2^-k`` (module docstring)."""
    exps = e8m0.view(torch.uint8).double() - 127
    k = 6 - exps.amax(dim=-1)
    assert bool((6 * torch.pow(2.0, exps.amax(-1) + k) <= E4M3_MAX).all())
    block = 2 * packed.shape[-1] // e8m0.shape[-1]
    products = e2m1_64(packed) * torch.pow(2.0, exps + k[:, None]).repeat_interleave(block, dim=-1)
    return round_e4m3_64(products), torch.pow(2.0, -k)


def exact_weight64(packed: torch.Tensor, scale: torch.Tensor, global_scale=None, mxfp4: bool = False) -> torch.Tensor:
    """The exact 4-bit weight ``[N, K]`` float64: NVFP4 (``scale`` E4M3, as float8 or its bytes, per 16
    values, times ``global_scale``) or, with ``mxfp4``, MXFP4 (``scale`` E8M0 bytes, ``2^(byte - 127)``)."""
    block = 2 * packed.shape[-1] // scale.shape[-1]
    if mxfp4:
        return e2m1_64(packed) * torch.pow(2.0, scale.view(torch.uint8).double() - 127).repeat_interleave(block, -1)
    return e2m1_64(packed) * e4m3_64(scale.view(torch.uint8)).repeat_interleave(block, -1) * float(global_scale)


class Weight:
    """One 4-bit matrix as a GEMM reads it; its float64 decodes made once."""

    def __init__(self, packed, scale, global_scale=None, mxfp4: bool = False):
        self.packed, self.scale, self.g, self.mxfp4 = packed, scale, global_scale, mxfp4
        self._exact = self._w8 = None

    def exact(self) -> torch.Tensor:
        if self._exact is None:
            self._exact = exact_weight64(self.packed, self.scale, self.g, self.mxfp4)
        return self._exact

    def w8(self):
        """``(w8, r)``: the planned kernel's E4M3 weight and row scale."""
        if self._w8 is None:
            if self.mxfp4:
                self._w8 = mxfp4_decode_w4a8_64(self.packed, self.scale)
            else:
                self._w8 = oracle_decode64(self.packed, self.scale.view(torch.float8_e4m3fn), float(self.g))
        return self._w8


def gemm64(x: torch.Tensor, w: Weight, mode: str, input_scale=None) -> torch.Tensor:
    """``x [n, K]`` (16-bit) times the 4-bit weight ``[N, K]``, transposed: ``[n, N]`` float64, the
    inputs rounded as ``mode`` says (module docstring)."""
    if mode == "w4a16":
        return x.double() @ w.exact().T
    if mode in ("w4a8", "w4a8_acts"):
        x8, sx = oracle_act_quant64(x)
        if mode == "w4a8_acts":
            return (x8 * sx[:, None]) @ w.exact().T
        w8, r = w.w8()
        return (x8 @ w8.T) * sx[:, None] * r[None, :]
    if mode == "w4a8_weights":
        w8, r = w.w8()
        return x.double() @ (w8 * r[:, None]).T
    if mode == "nvfp4_act":
        s = torch.as_tensor(input_scale, dtype=torch.float32).reshape(())
        return (quantize_activation_nvfp4(x, 1.0 / s) * s).double() @ w.exact().T
    raise ValueError(mode)


# --------------------------------------------------------------------------------------------------
# The model's 4-bit modules, emulated


def emulated_moe(hidden, ids, weights, gate_up, down, mode, gate_up_in=None, down_in=None, biases=None,
                 swiglu=None):
    """A routed MoE layer with every expert GEMM through :func:`gemm64`: ``gate_up[e]`` / ``down[e]``
    :class:`Weight` s, per-expert input scales ``gate_up_in[e]`` / ``down_in[e]`` (NVFP4-act), the
    gated-SiLU intermediate (or gpt-oss's clamped SwiGLU, ``swiglu = (alpha, limit)``, with
    ``biases = (gate_up [E, 2I], down [E, H])``) in the activation dtype; ``[T, H]`` in its dtype.
    ``mode``: one of :data:`MODES`, or ``(gate_up's, down's)``."""
    gate_up_mode, down_mode = (mode, mode) if isinstance(mode, str) else mode
    dtype = hidden.dtype
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    flat_w = weights.reshape(-1, 1).double()
    for e, slots in expert_groups(ids, len(gate_up)):
        token = slots // ids.shape[1]
        rows = hidden[token]
        h = gemm64(rows, gate_up[e], gate_up_mode, None if gate_up_in is None else gate_up_in[e])
        if swiglu is None:
            act = gated_silu(h, dtype)
        else:
            act = clamped_swiglu(h + biases[0][e].double(), *swiglu).to(dtype)
        y = gemm64(act, down[e], down_mode, None if down_in is None else down_in[e])
        if biases is not None:
            y = y + biases[1][e].double()
        out.index_add_(0, token, y * flat_w[slots])
    return out.to(dtype)


def _experts_of(m):
    """``(gate_up Weights, down Weights, gate_up input scales | None, down ones | None, extra kwargs)`` of
    an fp4moe experts module, or None for any other module."""
    from fp4moe_ops.prepared import INPUT_SCALE_BUFFERS, PreparedExperts
    from hf_integration.gpt_oss import NVFP4GptOssExperts
    from hf_integration.mxfp4_layers import MXFP4Experts

    if isinstance(m, PreparedExperts):
        w = m.canonical()
        gate_up = [Weight(w.gate_up[e], w.gate_up_scale[e], w.gate_up_global_scale[e]) for e in range(w.num_experts)]
        down = [Weight(w.down[e], w.down_scale[e], w.down_global_scale[e]) for e in range(w.num_experts)]
        ins = [m._buffers.get(n) for n in INPUT_SCALE_BUFFERS]
        return gate_up, down, ins[0], ins[1], {}
    if isinstance(m, MXFP4Experts):
        b = m._buffers
        gate_up, down = ([Weight(b[f"{proj}_packed"][e], b[f"{proj}_scale"][e], mxfp4=True) for e in range(m.num_experts)]
                         for proj in ("gate_up_proj", "down_proj"))
        return gate_up, down, None, None, {}
    if isinstance(m, NVFP4GptOssExperts):
        t = m.expert_tensors()  # (the reference backend: the checkpoint's tensors, [E, N, K/2] views)
        e_count = m.num_experts
        gate_up = [Weight(t[0][e], t[1][e], t[2][e]) for e in range(e_count)]
        down = [Weight(t[4][e], t[5][e], t[6][e]) for e in range(e_count)]
        gin, din = m._buffers.get("gate_up_proj_input_scale"), m._buffers.get("down_proj_input_scale")
        gin = None if gin is None else gin.reshape(-1).expand(e_count)
        din = None if din is None else din.reshape(-1).expand(e_count)
        if gin is None:
            gin, din = getattr(m, "_file_input_scales", (None, None))
        return gate_up, down, gin, din, dict(biases=(t[3], t[7]), swiglu=(m.swiglu_alpha, m.limit))
    return None


def _linear_of(m):
    """``(Weight, input scale | None)`` of an fp4moe 4-bit linear, or None."""
    from hf_integration.experts import NVFP4Linear
    from hf_integration.mxfp4_layers import MXFP4Linear

    if isinstance(m, NVFP4Linear):
        packed, block, g, inp = m.linear_tensors()
        return Weight(packed, block, g), inp
    if isinstance(m, MXFP4Linear):
        return Weight(m.weight_packed, m.weight_scale, mxfp4=True), None
    return None


def four_bit_modules(model):
    """``(experts modules, linear modules)``: names of the model's fp4moe 4-bit modules."""
    experts, linears = [], []
    for name, m in model.named_modules():
        if _experts_of(m) is not None:
            experts.append(name)
        elif _linear_of(m) is not None:
            linears.append(name)
    return experts, linears


@contextmanager
def emulate(model, mode: str, linears: bool = True, only=None):
    """Within the block, the model's routed experts (and, with ``linears``, its 4-bit linears) compute
    in ``mode`` (:data:`MODES`); the modules' own forwards come back after. ``only(module name, role)``
    (role ``"gate_up"``, ``"down"`` or ``"linear"``), where given, picks the GEMMs that take ``mode``;
    the others of those modules run W4A16."""
    def pick(name, role):
        return mode if only is None or only(name, role) else "w4a16"

    patched = []
    for name, m in model.named_modules():
        spec = _experts_of(m)
        if spec is not None:
            gate_up, down, gin, din, extra = spec
            modes = (pick(name, "gate_up"), pick(name, "down"))
            if "nvfp4_act" in modes and gin is None:
                raise LookupError(f"{type(m).__name__} holds no input scales")

            def forward(hidden, ids, weights, *_, gate_up=gate_up, down=down, gin=gin, din=din, extra=extra, m=m,
                        modes=modes):
                ids = m.dispatch.prepare(ids) if hasattr(m, "dispatch") else ids
                out = emulated_moe(hidden, ids, weights.float(), gate_up, down, modes, gin, din, **extra)
                return m.dispatch.finalize(out) if hasattr(m, "dispatch") else out
        elif linears and _linear_of(m) is not None:
            w, inp = _linear_of(m)
            linear_mode = pick(name, "linear")
            if linear_mode == "nvfp4_act" and inp is None:
                raise LookupError(f"{type(m).__name__} holds no input scale")

            def forward(x, w=w, inp=inp, m=m, linear_mode=linear_mode):
                y = gemm64(x.reshape(-1, x.shape[-1]), w, linear_mode, inp)
                if m.bias is not None:
                    y = y + m.bias.double()
                return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])
        else:
            continue
        m.forward = forward
        patched.append(m)
    try:
        yield
    finally:
        for m in patched:
            del m.forward


# --------------------------------------------------------------------------------------------------
# The exports


def per_token_error(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """tests/test_real_exports.py's statistic: ``||got - want|| / ||want||`` per token."""
    got, want = got.double().flatten(0, -2), want.double().flatten(0, -2)
    return (got - want).norm(dim=-1) / want.norm(dim=-1)


def load_case(folder: Path, reference: Path):
    """``(model, input_ids, the tool's weight-only logits, its 16-bit source's logits)``."""
    import hf_integration  # noqa: F401  (registers fp4moe's quantizers)
    from transformers import AutoModelForCausalLM

    if reference.suffix == ".pt":
        ref = torch.load(reference)
        ids, want, source = ref["input_ids"], ref["weight_only_logits"], ref["bf16_source_logits"]
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, attn_implementation="eager")
        _attach_file_input_scales(model, folder)
    else:
        from safetensors.torch import load_file

        ref = load_file(reference)
        ids, want, source = ref["input_ids"], ref["logits_weights_only"], ref["logits_bf16"]
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    return model.eval(), ids, want, source


def _attach_file_input_scales(model, folder: Path) -> None:
    """llm-compressor's gpt-oss export holds per-expert input scales that fp4moe does not keep
    (``experts.<e>.{gate,down}_proj.input_global_scale``, dividing): read from the file for NVFP4-act."""
    from safetensors import safe_open

    from hf_integration.gpt_oss import NVFP4GptOssExperts

    files = sorted(folder.glob("*.safetensors"))
    keys = {}
    for f in files:
        with safe_open(str(f), "pt") as h:
            keys.update({k: (f, k) for k in h.keys() if k.endswith("input_global_scale")})
    for name, m in model.named_modules():
        if isinstance(m, NVFP4GptOssExperts) and "gate_up_proj_input_scale" not in m._buffers:
            scales = []
            for leaf in ("gate_proj", "down_proj"):
                per_expert = []
                for e in range(m.num_experts):
                    key = f"{name}.{e}.{leaf}.input_global_scale"
                    if key not in keys:
                        return
                    with safe_open(str(keys[key][0]), "pt") as h:
                        per_expert.append(1.0 / h.get_tensor(key).float().reshape(()))
                scales.append(torch.stack(per_expert))
            m._file_input_scales = tuple(scales)


def _group(name: str, role: str) -> str:
    """The attribution group of a GEMM: ``L<layer> <what>``."""
    parts = name.split(".")
    layer = next((f"L{parts[i + 1]}" for i, p in enumerate(parts[:-1]) if p == "layers"), "")
    if role != "linear":
        return f"{layer} routed experts {role}"
    what = ("attention" if "attn" in name else "shared expert" if "shared" in name else
            "dense MLP" if ".mlp." in name else name)
    return f"{layer} {what}"


def attribution(model, ids, want, linears: bool) -> list[tuple[str, dict]]:
    """W4A8 on one group of GEMMs at a time (:func:`_group`), the rest W4A16: ``[(group, {mode:
    median})]`` for the full W4A8, its activations alone and its weight rounding alone."""
    groups = []
    for name, m in model.named_modules():
        if _experts_of(m) is not None:
            groups += [_group(name, "gate_up"), _group(name, "down")]
        elif linears and _linear_of(m) is not None and _group(name, "linear") not in groups:
            groups.append(_group(name, "linear"))
    out = []
    for g in groups:
        medians = {}
        for mode in ("w4a8", "w4a8_acts", "w4a8_weights"):
            with emulate(model, mode, linears, only=lambda n, r, g=g: _group(n, r) == g):
                medians[mode] = per_token_error(model(ids).logits, want).median().item()
        out.append((g, medians))
    return out


def run_case(name, folder, reference, experts_only_rows: bool, attribute: bool = False):
    """The rows of one export: ``[(gemms label, {mode: median}, notes)]`` and fp4moe's own distance."""
    model, ids, want, source = load_case(folder, reference)
    experts, linears = four_bit_modules(model)
    with torch.no_grad():
        native = model(ids).logits
        results = []
        variants = [(True, f"routed experts ({len(experts)} layers) + {len(linears)} 4-bit linears" if linears else
                     f"routed experts ({len(experts)} layers)")]
        if experts_only_rows and linears:
            variants.append((False, f"routed experts only ({len(experts)} layers)"))
        for with_linears, label in variants:
            medians, logits = {}, {}
            for mode in MODES:
                try:
                    with emulate(model, mode, linears=with_linears):
                        logits[mode] = model(ids).logits
                except LookupError as e:
                    medians[mode] = str(e)
                    continue
                medians[mode] = per_token_error(logits[mode], want).median().item()
            results.append((label, medians, logits))
        groups = attribution(model, ids, want, bool(linears)) if attribute else []
    vs_source = {mode: per_token_error(logits, source).median().item() for mode, logits in results[0][2].items()}
    return {"name": name, "rows": results, "native": per_token_error(native, want).median().item(),
            "vs_source": vs_source,
            "native_vs_emulated": per_token_error(native, results[0][2]["w4a16"]).median().item(),
            "weights_error": per_token_error(want, source).median().item(), "linears": linears,
            "groups": groups}


# --------------------------------------------------------------------------------------------------
# The synthetic layer (accuracy_study.py)


def synthetic_rows() -> list[tuple[str, dict]]:
    """accuracy_study.py's layer through this file's paths: ``[(label, {mode: error})]``, the error
    relative to the float64 unquantized layer."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import accuracy_study

    layer = accuracy_study.build_layer()
    w, x, ids, rw, err = layer["weights"], layer["x"], layer["ids"], layer["rw"], layer["err"]
    e = w.gate_up.shape[0]
    gate_up = [Weight(w.gate_up[i], w.gate_up_scale[i], w.gate_up_global_scale[i]) for i in range(e)]
    down = [Weight(w.down[i], w.down_scale[i], w.down_global_scale[i]) for i in range(e)]
    out = {}
    for mode in MODES:
        out[mode] = err(emulated_moe(x, ids, rw, gate_up, down, mode, w.gate_up_input_scale, w.down_input_scale))
    label = (f"synthetic E={e} H={accuracy_study.H} I={accuracy_study.I} top-{ids.shape[1]} "
             "(accuracy_study.py; vs float64 unquantized)")
    return [(label, out, layer["rows"])]


# --------------------------------------------------------------------------------------------------


def _fmt(v) -> str:
    return f"{100 * v:.2f}%" if isinstance(v, float) else "n/a"


def table(cases: list[dict], synthetic) -> list[str]:
    lines = ["| case | GEMMs switched | W4A16 median | W4A8 median | NVFP4-act median | W4A8 / W4A16 "
             "| W4A8 < NVFP4-act? |", "|---|---|---|---|---|---|---|"]
    for c in cases:
        for label, med, _ in c["rows"]:
            a, b, n = med["w4a16"], med["w4a8"], med["nvfp4_act"]
            closer = ("skipped: no input scales" if not isinstance(n, float) else "yes" if b < n else "**no**")
            lines.append(f"| {c['name']} | {label} | {_fmt(a)} | {_fmt(b)} | {_fmt(n)} | {b / a:.2f}x | {closer} |")
    for label, med, _ in synthetic:
        a, b, n = med["w4a16"], med["w4a8"], med["nvfp4_act"]
        lines.append(f"| {label} | experts (gate_up, down) | {_fmt(a)} | {_fmt(b)} | {_fmt(n)} | {b / a:.2f}x "
                     f"| {'yes' if b < n else '**no**'} |")
    return lines


def diagnostics(cases: list[dict], synthetic) -> list[str]:
    lines = ["| case | GEMMs switched | W4A8 weights' rounding alone | W4A8 activations alone | fp4moe's own forward "
             "| fp4moe vs the W4A16 emulation | the 4-bit weights' own error (weight-only vs source) "
             "| vs the 16-bit source: W4A16 / W4A8 / NVFP4-act |",
             "|---|---|---|---|---|---|---|---|"]
    for c in cases:
        for i, (label, med, _) in enumerate(c["rows"]):
            src = c["vs_source"]
            own = (f"{_fmt(c['native'])} | {_fmt(c['native_vs_emulated'])} | {_fmt(c['weights_error'])} | "
                   f"{_fmt(src.get('w4a16'))} / {_fmt(src.get('w4a8'))} / {_fmt(src.get('nvfp4_act'))}" if i == 0
                   else " | | | ")
            lines.append(f"| {c['name']} | {label} | {_fmt(med['w4a8_weights'])} | {_fmt(med['w4a8_acts'])} | {own} |")
    for label, med, study in synthetic:
        lines.append(f"| {label} | experts | {_fmt(med['w4a8_weights'])} | {_fmt(med['w4a8_acts'])} | "
                     f"{_fmt(dict(study).get('W4A16 NVFP4 (exact weights; fp4moe triton/reference)'))} | | | |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="", help="comma-separated case names (substrings) to run; default all")
    ap.add_argument("--experts-only", action="store_true",
                    help="also the rows where only the routed experts switch (where an export has 4-bit linears)")
    ap.add_argument("--attribute", action="store_true",
                    help="also W4A8 on one group of GEMMs at a time (a layer's experts' gate_up or down, "
                         "its attention ...)")
    ap.add_argument("--no-synthetic", action="store_true", help="leave out accuracy_study.py's layer")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    wanted = [s for s in args.cases.split(",") if s]
    start = time.time()
    cases = []
    for name, folder, reference in CASES:
        if wanted and not any(w in name for w in wanted):
            continue
        cases.append(run_case(name, folder, reference, args.experts_only, args.attribute))
        print(f"[{time.time() - start:.0f}s] {name}", file=sys.stderr, flush=True)
    synthetic = [] if args.no_synthetic else synthetic_rows()
    print("\n".join(table(cases, synthetic)))
    print("\nAttribution (W4A8 variants, median per-token error against the same reference), and fp4moe's own "
          "forward:\n")
    print("\n".join(diagnostics(cases, synthetic)))
    if args.attribute:
        print("\nW4A8 on one group of GEMMs at a time (the rest W4A16), median per-token error:\n")
        print("| case | group | W4A8 | its activations alone | its weight rounding alone |\n|---|---|---|---|---|")
        for c in cases:
            for g, med in c["groups"]:
                print(f"| {c['name']} | {g} | {_fmt(med['w4a8'])} | {_fmt(med['w4a8_acts'])} | "
                      f"{_fmt(med['w4a8_weights'])} |")
    failing = []
    for c in cases:
        for label, med, _ in c["rows"]:
            ok_nv = not isinstance(med["nvfp4_act"], float) or med["w4a8"] < med["nvfp4_act"]
            if not (ok_nv and med["w4a8"] <= 2 * med["w4a16"]):
                failing.append(f"{c['name']} [{label}]")
    for label, med, _ in synthetic:
        if not (med["w4a8"] < med["nvfp4_act"] and med["w4a8"] <= 2 * med["w4a16"]):
            failing.append(label)
    print(f"\nAcceptance (W4A8 closer than NVFP4-act where it runs, and within 2x W4A16): "
          f"{'holds on every case' if not failing else 'broken on ' + '; '.join(failing)}")
    print(f"({time.time() - start:.0f} s, torch {torch.__version__})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
