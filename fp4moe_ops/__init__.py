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

The ops are also here as functions (``fused_moe``, ``gpt_oss_moe``, ``grouped_topk``, ``softmax_topk``,
``nvfp4_linear``): calling one calls ``torch.ops.fp4moe.<name>``, and ``help()`` shows its arguments.
Loading checkpoints with Transformers is :mod:`hf_integration`'s (``import hf_integration``, or the
start-up hook that installing fp4moe adds unless ``FP4MOE_AUTOLOAD=0``).
"""

import functools

from . import mxfp4, nvfp4, routing
from .backends import AUTO_ORDER, BACKENDS, available_backends, resolve_backend, resolve_gpt_oss_backend
from .moe_weights import NVFP4MoEWeights, quantize_moe_weights
from .linear import nvfp4_linear as _nvfp4_linear
from .op import fused_moe as _fused_moe
from .gpt_oss_op import gpt_oss_moe as _gpt_oss_moe
from .prepared import ACT_SCALE_MODES, PreparedExperts, activation_scales, prepare_experts
from .routing import grouped_topk as _grouped_topk
from .routing import softmax_topk as _softmax_topk
from . import autograd  # noqa: F401 (registers the ops' backward)


def _version() -> str:
    """The installed package's version; from a source tree that was never installed, pyproject's."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fp4moe")
    except PackageNotFoundError:
        import re
        from pathlib import Path

        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        found = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.M) if pyproject.exists() else None
        return found.group(1) if found else "unknown"


__version__ = _version()


def _documented(op):
    """A plain function that calls the custom op ``op``: ``help()`` on a ``torch.library`` custom op
    shows torch's ``CustomOpDef`` class, this shows the op's own signature and docstring. Calling it
    is calling the op (also under ``torch.compile``); ``.op`` is the custom op itself."""

    defined_from = getattr(op, "_init_fn", None)  # the decorated function: name, signature, docstring
    if defined_from is None:  # a torch that keeps it elsewhere: the op itself, with torch's help()
        return op

    @functools.wraps(defined_from)
    def call(*args, **kwargs):
        return op(*args, **kwargs)

    call.op = op
    return call


fused_moe = _documented(_fused_moe)
gpt_oss_moe = _documented(_gpt_oss_moe)
grouped_topk = _documented(_grouped_topk)
softmax_topk = _documented(_softmax_topk)
nvfp4_linear = _documented(_nvfp4_linear)

__all__ = [
    "__version__", "ACT_SCALE_MODES", "AUTO_ORDER", "BACKENDS", "NVFP4MoEWeights", "PreparedExperts",
    "activation_scales", "available_backends", "fused_moe", "grouped_topk", "gpt_oss_moe", "mxfp4", "nvfp4", "nvfp4_linear", "prepare_experts",
    "quantize_moe_weights", "resolve_backend", "resolve_gpt_oss_backend", "routing", "softmax_topk",
]
