"""fp4moe_ops: NVFP4 Mixture-of-Experts as one ``torch.library`` op with pluggable backends (and
gpt-oss's experts, MXFP4 or NVFP4, as another, ``gpt_oss_moe``).

Typical use::

    from fp4moe_ops import quantize_moe_weights, prepare_experts
    weights = quantize_moe_weights(gate_up [E, 2I, H], down [E, H, I])
    experts = prepare_experts(weights, backend="auto")     # a PreparedExperts module
    out = experts(hidden [T, H] bf16, topk_ids [T, k], topk_weights [T, k] fp32)

Modules: ``nvfp4`` and ``mxfp4`` the formats, ``moe_weights`` a layer's canonical experts, ``op`` the op,
``gpt_oss_op`` gpt-oss's experts op,
``linear`` the NVFP4 linear-layer op, ``autograd`` the ops' backward (frozen weights),
``prepared`` the prepared layer, ``backends`` the kernels behind the op, ``moe_math`` the
pure-torch MoE math, ``routing`` the router ops, ``flashinfer_sim`` a CPU model of FlashInfer's
NVFP4 kernel (a test oracle), ``oracle64`` the float64 oracle, ``selftest`` ``python -m
fp4moe_ops.selftest``.
"""

from . import mxfp4, nvfp4, routing
from .backends import AUTO_ORDER, BACKENDS, available_backends, resolve_backend, resolve_gpt_oss_backend
from .moe_weights import NVFP4MoEWeights, quantize_moe_weights
from .linear import nvfp4_linear
from .op import fused_moe
from .gpt_oss_op import gpt_oss_moe
from .prepared import ACT_SCALE_MODES, PreparedExperts, activation_scales, prepare_experts
from .routing import grouped_topk, softmax_topk
from . import autograd  # noqa: F401 (registers the ops' backward)

__all__ = [
    "ACT_SCALE_MODES", "AUTO_ORDER", "BACKENDS", "NVFP4MoEWeights", "PreparedExperts",
    "activation_scales", "available_backends", "fused_moe", "grouped_topk", "gpt_oss_moe", "mxfp4", "nvfp4", "nvfp4_linear", "prepare_experts",
    "quantize_moe_weights", "resolve_backend", "resolve_gpt_oss_backend", "routing", "softmax_topk",
]
