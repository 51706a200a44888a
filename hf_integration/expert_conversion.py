"""The weight conversion of NVFP4 routed experts, plugged into Transformers' loader: the per-expert
ModelOpt / compressed-tensors tensors of a layer, as they are read from the files, straight into the
stacked buffers of :class:`~hf_integration.experts.NVFP4Experts` (:class:`StackNVFP4Experts`; Llama-4's
fused 3-D tensors: :class:`UnfuseNVFP4Experts`; llm-compressor's gpt-oss experts into
:class:`~hf_integration.gpt_oss.NVFP4GptOssExperts`: :class:`StackGptOssExperts`), never through BF16,
every scale value checked by its checkpoint name. :func:`converters_for` makes them for a :class:`~hf_integration.load_plan.LoadPlan`;
:mod:`hf_integration.quantizer` puts them in place of Transformers' own."""

from __future__ import annotations


import itertools
import re

import torch
from transformers.quantizers import HfQuantizer
from transformers.utils import logging

from fp4moe_ops.moe_weights import check_scale_values, check_weight_range, rescale_block_scales
from fp4moe_ops.prepared import CANONICAL_BUFFERS, INPUT_SCALE_BUFFERS

from .checkpoint_format import (
    CheckpointError,
)
from .load_plan import ExpertsPlan, LoadPlan
from .llama4 import FUSED_LEAVES, canonical_from_fused, fused_key

logger = logging.get_logger("transformers.fp4moe")  # under Transformers: set_verbosity_* applies



try:
    from transformers.core_model_loading import ConversionOps
except ImportError:  # pragma: no cover - Transformers without the v5 loader
    ConversionOps = object


def role_names(scheme) -> dict[str, str]:
    """Each tensor role's name in a format's checkpoint (a :class:`~hf_integration.checkpoint_format.TensorScheme`),
    and ``bias`` for gpt-oss's biases."""
    return dict(zip(StackNVFP4Experts.ROLES, scheme.tensors), bias="bias")


class StackNVFP4Experts(ConversionOps):
    """Transformers conversion op: one layer's per-expert ModelOpt tensors (as read from the files)
    -> the stacked buffers of :class:`NVFP4Experts`. Gate and up global scales that differ are
    reconciled (their max, the other side's block scales rescaled and re-rounded, logged).

    Every scale value is checked here, by its checkpoint name. Transformers turns any exception
    inside a conversion into a generic report entry, so a bad value is recorded on the quantizer
    and raised as a :class:`CheckpointError` naming the tensor once loading is done."""

    # (leaf index into ExpertLeaves, tensor role) of each source pattern, in order
    ROLES = ("packed", "block", "global", "input")
    SOURCES = tuple(itertools.product(range(3), ROLES))

    def __init__(self, hf_quantizer: HfQuantizer):
        # hf_quantizer: fp4moe's ModelOptQuantizer, whose load plan (``plan``) says what each layer
        # holds and which collects the bad values found (``load_errors``); typed by its base class,
        # as the quantizer module imports this one.
        # Transformers (>= 5.22) keeps the checkpoint dtypes of tensors that an op with an
        # ``hf_quantizer`` consumes; older versions keep them for every renamed key
        self.hf_quantizer = hf_quantizer

    def __deepcopy__(self, memo):
        # Transformers deep-copies a converter per layer: the op holds no per-layer state, and the
        # quantizer (its plan, the errors found) must stay the one shared object
        return self

    def convert(self, input_dict, source_patterns=None, target_patterns=None, full_layer_name=None, **kwargs):
        module_name = full_layer_name.rsplit(".", 1)[0]
        plan = self.hf_quantizer.plan.experts[module_name]
        got = self._collect(input_dict, source_patterns, module_name, plan)
        base = target_patterns[0][:-len(CANONICAL_BUFFERS[0])]
        return {base + name: t for name, t in self._canonical(got, module_name, plan).items()}

    def _collect(self, input_dict, source_patterns, module_name: str, plan: ExpertsPlan) -> dict:
        """``{(leaf, role): [one tensor per expert]}`` of what the loader read, each list checked to
        hold one tensor per expert of the plan."""
        names = role_names(self.hf_quantizer.plan.scheme)
        got = {self.SOURCES[source_patterns.index(p)]: tensors for p, tensors in input_dict.items()}
        input_dict.clear()
        for (leaf, role), tensors in got.items():
            if len(tensors) != len(plan.ids):
                raise CheckpointError(f"{module_name}: read {len(tensors)} '{list(plan.leaves)[leaf]}.{names[role]}' "
                                      f"tensors for {len(plan.ids)} experts")
        return got

    @staticmethod
    def _stack(got: dict, parts: list[tuple[int, str]]) -> torch.Tensor:
        """The experts' tensors of ``parts`` (concatenated along rows), each per-expert tensor
        dropped as soon as it is copied: one layer plus one expert tensor in memory, not two layers."""
        lists = [got.pop(p) for p in parts]
        first, count = lists[0][0], len(lists[0])
        rows = [ts[0].shape[0] if ts[0].dim() else 0 for ts in lists]  # scalars: [] (ModelOpt) or [1]
        out = torch.empty(count, *((sum(rows),) if first.dim() else ()), *first.shape[1:], dtype=first.dtype,
                          device=first.device)
        for e in range(count):
            r0 = 0
            for ts, n in zip(lists, rows):
                if first.dim():
                    out[e, r0:r0 + n] = ts[e]
                else:
                    out[e] = ts[e]
                ts[e], r0 = None, r0 + n
        return out

    def _canonical(self, got: dict, module_name: str, plan: ExpertsPlan) -> dict[str, torch.Tensor]:
        """The canonical buffers (and input scales) of the per-expert tensors in ``got`` (taken out
        of it), every scale value checked; gate and up global scales that differ reconciled."""
        scheme = self.hf_quantizer.plan.scheme
        names = role_names(scheme)
        leaves, inter = list(plan.leaves), plan.inter

        def stack(parts):
            return self._stack(got, parts)

        gate_global, up_global = stack([(0, "global")]), stack([(1, "global")])
        gate_in = stack([(0, "input")]) if plan.input_scales else None
        up_in = stack([(1, "input")]) if plan.input_scales else None
        gate_up = stack([(0, "packed"), (1, "packed")])
        gate_up_scale = stack([(0, "block"), (1, "block")])
        down, down_scale = stack([(2, "packed")]), stack([(2, "block")])
        down_global_scale = stack([(2, "global")])
        down_in = stack([(2, "input")]) if plan.input_scales else None
        # values as the file has them: ModelOpt's input scales may be 0 (never calibrated), a
        # compressed-tensors input global scale (it divides) may not
        input_kind = "global" if scheme.reciprocal else "input"
        errors_before = len(self.hf_quantizer.load_errors)
        for leaf, role, kind, values in ((0, "global", "global", gate_global), (1, "global", "global", up_global),
                                         (2, "global", "global", down_global_scale),
                                         (0, "block", "block", gate_up_scale[:, :inter]),
                                         (1, "block", "block", gate_up_scale[:, inter:]), (2, "block", "block", down_scale),
                                         (0, "input", input_kind, gate_in), (1, "input", input_kind, up_in),
                                         (2, "input", input_kind, down_in)):
            if values is not None:
                self._check(lambda d, v=values, k=kind: check_scale_values(v, k, d), plan, leaves[leaf], names[role])
        gate_global, up_global = scheme.multiplier(gate_global), scheme.multiplier(up_global)
        down_global_scale = scheme.multiplier(down_global_scale)
        if len(self.hf_quantizer.load_errors) == errors_before:  # valid values: do they decode in range?
            for leaf, block, multiplier in ((0, gate_up_scale[:, :inter], gate_global),
                                            (1, gate_up_scale[:, inter:], up_global), (2, down_scale, down_global_scale)):
                self._check(lambda d, b=block, m=multiplier: check_weight_range(b, m, d), plan, leaves[leaf],
                            names["global"])
        if plan.input_scales:
            gate_in, up_in, down_in = scheme.multiplier(gate_in), scheme.multiplier(up_in), scheme.multiplier(down_in)

        gate_up_global_scale = torch.maximum(gate_global, up_global)
        differ = gate_global != up_global
        if bool(differ.any()):
            # one global scale for [gate; up]: rescale the smaller side's block scales (re-rounded)
            gate_up_scale[:, :inter], gate_rows, gate_zeroed = rescale_block_scales(
                gate_up_scale[:, :inter], (gate_global / gate_up_global_scale)[:, None, None])
            gate_up_scale[:, inter:], up_rows, up_zeroed = rescale_block_scales(
                gate_up_scale[:, inter:], (up_global / gate_up_global_scale)[:, None, None])
            logger.warning("fp4moe: %s: %d experts had different %s for %s and %s (experts %s); used their max and "
                           "rescaled the other's block scales (re-rounded to E4M3): %d rows changed, %d rows "
                           "zeroed (every block scale flushed to 0: those output features lost their weights)",
                           module_name, int(differ.sum()), names["global"], leaves[0], leaves[1],
                           differ.nonzero().flatten()[:8].tolist(), gate_rows + up_rows, gate_zeroed + up_zeroed)
        out = dict(zip(CANONICAL_BUFFERS,
                       (gate_up, gate_up_scale, gate_up_global_scale, down, down_scale, down_global_scale)))
        if plan.input_scales:
            out[INPUT_SCALE_BUFFERS[0]] = torch.maximum(gate_in, up_in)
            out[INPUT_SCALE_BUFFERS[1]] = down_in
        return out

    def _check(self, check, plan: ExpertsPlan, leaf: str, tensor: str) -> None:
        """Run ``check(describe)`` (a value or range check of stacked per-expert scales); its error,
        naming the checkpoint key and file of the expert, is raised once loading is done."""
        def describe(e: int) -> str:
            key = plan.key(plan.ids[e], leaf, tensor)
            return f"checkpoint tensor {key!r} in {self.hf_quantizer.plan.files.get(key)}"

        try:
            check(describe)
        except ValueError as exc:
            self.hf_quantizer.load_errors.append(CheckpointError(str(exc)))

    @property
    def reverse_op(self):
        # Saving goes through the fp4moe quantizer's get_state_dict_and_metadata, and the loader drops
        # this converter from the model's conversions once loaded: nothing to reverse.
        raise NotImplementedError("NVFP4 experts are saved by the fp4moe quantizer, not by reverse conversion")


class UnfuseNVFP4Experts(StackNVFP4Experts):
    """Transformers conversion op for Llama-4's fused 3-D NVFP4 experts: one layer's eight file
    tensors (:mod:`hf_integration.llama4`) -> the canonical buffers of :class:`NVFP4Experts`, every
    scale value checked by its checkpoint name (errors raised after loading, as for the per-expert op)."""

    SOURCES = tuple(itertools.product(FUSED_LEAVES, StackNVFP4Experts.ROLES))

    def convert(self, input_dict, source_patterns=None, target_patterns=None, full_layer_name=None, **kwargs):
        module_name = full_layer_name.rsplit(".", 1)[0]
        plan = self.hf_quantizer.plan.experts[module_name]
        got = {}
        for p, tensors in input_dict.items():
            leaf, role = self.SOURCES[source_patterns.index(p)]
            if len(tensors) != 1:
                raise CheckpointError(f"{module_name}: read {len(tensors)} {fused_key(plan.checkpoint_prefix, leaf, role)!r} tensors")
            got[f"{leaf}.{role}"] = tensors[0]
        input_dict.clear()
        if not plan.input_scales:  # a weights-only load of a W4A4 export: the input scales go unused
            got = {k: v for k, v in got.items() if not k.endswith(".input")}
        errors_before = len(self.hf_quantizer.load_errors)
        for name, t in got.items():
            leaf, role = name.split(".")
            if role == "packed":
                continue
            key = fused_key(plan.checkpoint_prefix, leaf, role)
            where = f"checkpoint tensor {key!r} in {self.hf_quantizer.plan.files.get(key)}"
            describe = (lambda e: f"{where} (expert {e})") if t.dim() else (lambda e: where)
            try:  # the roles name their checks: block scales [E, K/16, N] per expert, scalars once
                check_scale_values(t if t.dim() else t.reshape(1), role, describe)
            except ValueError as exc:
                self.hf_quantizer.load_errors.append(CheckpointError(str(exc)))
        weights = canonical_from_fused(got, plan.ids)
        if len(self.hf_quantizer.load_errors) == errors_before:  # valid values: do they decode in range?
            for leaf, proj in zip(FUSED_LEAVES, ("gate_up", "down")):
                key = fused_key(plan.checkpoint_prefix, leaf, "global")
                where = f"checkpoint tensor {key!r} in {self.hf_quantizer.plan.files.get(key)}"
                try:
                    check_weight_range(getattr(weights, f"{proj}_scale"), getattr(weights, f"{proj}_global_scale"),
                                       lambda e, where=where: f"{where} (expert {e})")
                except ValueError as exc:
                    self.hf_quantizer.load_errors.append(CheckpointError(str(exc)))
        base = target_patterns[0][:-len(CANONICAL_BUFFERS[0])]
        out = {base + name: t for name, t in zip(CANONICAL_BUFFERS, weights.tensors())}
        if plan.input_scales:
            out[base + INPUT_SCALE_BUFFERS[0]] = weights.gate_up_input_scale
            out[base + INPUT_SCALE_BUFFERS[1]] = weights.down_input_scale
        return out


class StackGptOssExperts(StackNVFP4Experts):
    """Transformers conversion op for gpt-oss's experts as llm-compressor exports them: one layer's
    per-expert biased linears (``<e>.gate_proj`` ...) -> the held tensors of
    :class:`~hf_integration.gpt_oss.NVFP4GptOssExperts` with one global scale per expert: ModelOpt's
    fused layout (``[E, K/2, N]`` bytes and ``[E, K/16, N]`` block scales, gate and up rows
    interleaved along 2I as gpt-oss computes them), the multiplying global scales ``[E]`` and the
    biases. Every scale value is checked by its checkpoint name, as for other experts; input scales
    are checked and not held (the activations stay 16-bit). The fused tensors are written from the
    stacked ones: two copies of a layer's weights at the peak."""

    SOURCES = (*StackNVFP4Experts.SOURCES, *((leaf, "bias") for leaf in range(3)))

    def convert(self, input_dict, source_patterns=None, target_patterns=None, full_layer_name=None, **kwargs):
        module_name = full_layer_name.rsplit(".", 1)[0]
        gpt_oss = self.hf_quantizer.plan.gpt_oss[module_name]
        plan = gpt_oss.per_expert
        got = self._collect(input_dict, source_patterns, module_name, plan)
        # in the model's dtype, as Transformers loads any bias (it keeps a converter's outputs as they are)
        biases = [self._stack(got, [(leaf, "bias")]).to(gpt_oss.bias_dtype) for leaf in range(3)]
        canonical = self._canonical(got, module_name, plan)
        inter = plan.inter

        def fused(name, interleave=True):
            """A canonical ``[E, N, K']`` tensor (taken out of ``canonical``) as ModelOpt's ``[E, K', N]``,
            gate and up columns alternating where ``interleave`` (gpt-oss's order)."""
            t = canonical.pop(name)
            out = t.new_empty(t.shape[0], t.shape[2], t.shape[1])
            if interleave:
                out[:, :, 0::2], out[:, :, 1::2] = t[:, :inter].transpose(1, 2), t[:, inter:].transpose(1, 2)
            else:
                out.copy_(t.transpose(1, 2))
            return out

        gate_up_bias = torch.stack(biases[:2], dim=2).flatten(1, 2)  # [E, 2I]: gate 0, up 0, gate 1, ...
        base = target_patterns[0][:-len("gate_up_proj")]
        gate_up_key, gate_up_scale_key, gate_up_global_key, down_key, down_scale_key, down_global_key = CANONICAL_BUFFERS
        return {f"{base}gate_up_proj": fused(gate_up_key), f"{base}gate_up_proj_weight_scale": fused(gate_up_scale_key),
                f"{base}gate_up_proj_weight_scale_2": canonical[gate_up_global_key], f"{base}gate_up_proj_bias": gate_up_bias,
                f"{base}down_proj": fused(down_key, False), f"{base}down_proj_weight_scale": fused(down_scale_key, False),
                f"{base}down_proj_weight_scale_2": canonical[down_global_key], f"{base}down_proj_bias": biases[2]}


def converters_for(plan: LoadPlan, quantizer: HfQuantizer) -> list:
    """One converter per distinct experts naming (e.g. ``mlp.experts`` with ``gate_proj`` ...), whose
    sources are the per-expert NVFP4 tensors in model terms (after Transformers' renamings)."""
    from transformers.core_model_loading import WeightConverter

    converters, seen = [], set()
    for p in plan.experts.values():
        base = ".".join(p.name.split(".")[-2:])  # e.g. "mlp.experts": what the layer-independent pattern needs
        if p.fused:
            if base not in seen:
                seen.add(base)
                sources = [rf"{re.escape(base)}\.{re.escape(fused_key('', leaf, role)[1:])}$"
                           for leaf, role in UnfuseNVFP4Experts.SOURCES]
                converters.append(WeightConverter(sources, f"{base}.{CANONICAL_BUFFERS[0]}", [UnfuseNVFP4Experts(quantizer)]))
            continue
        ids = r"\d+" if len(p.ids) == p.total else "|".join(str(e) for e in p.ids)  # a shard: its ids only
        key = (base, tuple(p.leaves), ids)
        if key in seen:
            continue
        seen.add(key)
        names = role_names(plan.scheme)
        sources = [rf"{re.escape(base)}\.(?:{ids})\.{re.escape(list(p.leaves)[leaf])}\.{names[role]}$"
                   for leaf, role in StackNVFP4Experts.SOURCES]
        converters.append(WeightConverter(sources, f"{base}.{CANONICAL_BUFFERS[0]}", [StackNVFP4Experts(quantizer)]))
    for p in plan.gpt_oss.values():
        base = ".".join(p.name.split(".")[-2:])
        if p.per_expert is None or ("gpt-oss", base) in seen:
            continue
        seen.add(("gpt-oss", base))
        names = role_names(plan.scheme)
        leaves = list(p.per_expert.leaves)
        sources = [rf"{re.escape(base)}\.\d+\.{re.escape(leaves[leaf])}\.{names[role]}$"
                   for leaf, role in StackGptOssExperts.SOURCES]
        converters.append(WeightConverter(sources, f"{base}.gate_up_proj", [StackGptOssExperts(quantizer)]))
    return converters


def is_ours(conversion) -> bool:
    """Whether a Transformers conversion is one of these (UnfuseNVFP4Experts included)."""
    #
    return any(isinstance(op, StackNVFP4Experts) for op in getattr(conversion, "operations", ()))


__all__ = ["StackGptOssExperts", "StackNVFP4Experts", "UnfuseNVFP4Experts", "converters_for", "is_ours"]
