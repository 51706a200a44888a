"""fp4moe's Hugging Face Transformers integration.

Importing it registers fp4moe's ``"modelopt"`` quantizer with Transformers, so
``AutoModelForCausalLM.from_pretrained(<ModelOpt NVFP4 checkpoint>)`` loads NVFP4 experts and
``save_pretrained`` writes them back; and its ``"mxfp4"`` quantizer, which does the same for
gpt-oss's MXFP4 experts. An installed fp4moe does the same in programs that never import it
(``transformers serve``, ``lm_eval``, plain scripts): :mod:`fp4moe_autoload`, a start-up hook,
imports this package when Transformers first reads such a checkpoint's config (``FP4MOE_AUTOLOAD=0``
turns it off). Modules, one concept each:

* ``checkpoint_format``: the NVFP4 checkpoint formats read (ModelOpt, compressed-tensors): configs,
  tensor names, ``CheckpointError``;
* ``quantizer``: the Transformers quantizer (its plug-in points, marking a model quantized), with
  ``load_plan`` (the checkpoint scanned and checked before loading) and ``expert_conversion``
  (file bytes into stacked experts);
* ``experts``: the modules that hold NVFP4 weights in a model;
* ``gpt_oss``, ``mxfp4_quantizer``: gpt-oss's experts modules (MXFP4, and NVFP4 as ModelOpt exports it) and the MXFP4 quantizer (which one wins
  for ``"mxfp4"``, and how to choose Transformers' own, is in ``mxfp4_quantizer``'s docstring);
* ``mxfp4_layers``, ``compressed_mxfp4``: the MXFP4 experts and linears of llm-compressor's MXFP4
  checkpoints of ordinary MoE families, and their loader (which also saves them back);
* ``llama4``: Llama-4's fused 3-D NVFP4 experts and the MoE block that runs them;
* ``router``: the fused DeepSeek-V3-style router;
* ``shared_experts``: a shared expert run inside the routed experts' op call;
* ``patch``: ``patch_moe`` / ``patch_deepseek`` / ``set_backend`` on a loaded BF16 model;
* ``calibration``: activation scales for NVFP4 x NVFP4;
* ``expert_parallel``: experts split over ``torch.distributed`` ranks;
* ``surgery``: finding and swapping modules; ``saving``: atomic ``save_pretrained``;
* ``fused_linears``: linears that serving engines run as one GEMM, on one global scale;
* ``modelopt``: ``load_modelopt_nvfp4`` (``from_pretrained`` plus what it cannot know by itself);
* ``architectures``: published model types Transformers runs under another name (Kimi-K2);
* ``tiny_models``, ``demo``: tiny random models for tests and the demo.
"""

from . import architectures
from .calibration import calibrate_activation_scales
from .experts import NVFP4Experts, NVFP4Linear
from .expert_parallel import shard_experts
from .modelopt import load_modelopt_nvfp4, save_modelopt_nvfp4
from .checkpoint_format import CheckpointError, CompressedTensorsNVFP4Config, ModelOptConfig
from .patch import patch_deepseek, patch_moe, quantize_linears, set_backend
from .quantizer import ModelOptQuantizer, register
from .gpt_oss import MXFP4GptOssExperts, NVFP4GptOssExperts
from . import compressed_mxfp4, mxfp4_quantizer
from .router import GroupedTopkRouter, SoftmaxTopkRouter, fuse_routers
from .shared_experts import SharedExpertMoE, fuse_shared_experts
from .surgery import find_experts_modules

register()
compressed_mxfp4.register()
mxfp4_quantizer.register()
architectures.register()

__all__ = [
    "CheckpointError", "CompressedTensorsNVFP4Config", "GroupedTopkRouter", "SoftmaxTopkRouter", "MXFP4GptOssExperts", "ModelOptConfig",
    "NVFP4GptOssExperts",
    "ModelOptQuantizer",
    "NVFP4Experts", "NVFP4Linear", "SharedExpertMoE",
    "calibrate_activation_scales", "find_experts_modules", "fuse_routers", "fuse_shared_experts", "load_modelopt_nvfp4", "patch_deepseek",
    "patch_moe", "quantize_linears", "save_modelopt_nvfp4", "set_backend", "shard_experts",
]
