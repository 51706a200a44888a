"""fp4moe without an import: NVFP4 checkpoints load through fp4moe in programs that never import it
(``transformers serve``, ``transformers chat``, ``lm_eval --model hf``, any script calling
``from_pretrained``).

Installing fp4moe puts ``fp4moe-autoload.pth`` in site-packages; Python runs its one line at start-up,
which imports this module. It imports nothing heavy (no torch, no Transformers) and does one thing:
the first time ``transformers.quantizers.auto`` (Transformers' quantizer registry) is imported, it
puts a stand-in under the registry's ``"modelopt"``, ``"compressed-tensors"`` and ``"mxfp4"``
(gpt-oss) config entries.
Only when Transformers reads such a checkpoint's ``quantization_config`` does the stand-in put the
registry back as it was and import :mod:`hf_integration`, which registers fp4moe's quantizer
(:func:`hf_integration.quantizer.register`: ModelOpt, NVFP4 and MXFP4 compressed-tensors checkpoints go
to fp4moe, every other compressed-tensors checkpoint to Transformers' own quantizer; gpt-oss's MXFP4
ones as :mod:`hf_integration.mxfp4_quantizer` says); the config is
then read by whatever the registry now holds. Programs that load no such checkpoint never import
fp4moe; a program that imports :mod:`hf_integration` itself registers it at once (the stand-ins give
way to Transformers' entries first, :func:`restore`).

Turn it off with ``FP4MOE_AUTOLOAD=0`` in the environment (read at start-up); ``import
hf_integration`` still registers fp4moe as before.
"""

import os
import sys

ENV = "FP4MOE_AUTOLOAD"
REGISTRY = "transformers.quantizers.auto"
METHODS = ("modelopt", "compressed-tensors", "mxfp4")  # the quant_method values of the formats fp4moe reads


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


class _LazyFp4moeConfig:
    """A registry config entry until fp4moe is needed: its ``from_dict`` (how Transformers reads a
    checkpoint's ``quantization_config``) activates fp4moe, then reads the config with the entry
    that fp4moe registered."""

    def __init__(self, registry, method: str, originals: dict):
        self.registry, self.method, self.originals = registry, method, originals

    def from_dict(self, config_dict, *args, **kwargs):
        activate(self.registry)
        return self.registry.AUTO_QUANTIZATION_CONFIG_MAPPING[self.method].from_dict(config_dict, *args, **kwargs)

    def __repr__(self):
        return f"<fp4moe's entry for {self.method!r}, registered when first used>"


def restore(registry) -> None:
    """Put Transformers' own entries back where stand-ins are (fp4moe's registration calls this
    first, so that it wraps Transformers' entries, never a stand-in)."""
    mapping = registry.AUTO_QUANTIZATION_CONFIG_MAPPING
    for method in METHODS:
        entry = mapping.get(method)
        if isinstance(entry, _LazyFp4moeConfig):
            if entry.originals[method] is None:
                del mapping[method]
            else:
                mapping[method] = entry.originals[method]


def activate(registry) -> None:
    """Put Transformers' own entries back, then import fp4moe's integration (which registers itself)."""
    restore(registry)
    import hf_integration  # noqa: F401  (registers the quantizer on import)


def install_stand_ins(registry) -> None:
    mapping = registry.AUTO_QUANTIZATION_CONFIG_MAPPING
    originals = {m: mapping.get(m) for m in METHODS}
    for method in METHODS:
        mapping[method] = _LazyFp4moeConfig(registry, method, originals)


class _RegistryWatcher:
    """A ``sys.meta_path`` finder that finds nothing itself: when ``transformers.quantizers.auto``
    is about to be imported, it asks the other finders for the module and has the stand-ins
    installed right after the module runs (before any caller can use the registry). Then it
    leaves ``sys.meta_path``."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != REGISTRY:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        loader = getattr(spec, "loader", None)
        run = getattr(loader, "exec_module", None)
        if run is None:
            return spec

        def exec_module(module):
            run(module)
            try:
                install_stand_ins(module)
            except Exception as exc:  # noqa: BLE001 - a changed registry must not break Transformers' import
                print(f"fp4moe: could not register with Transformers' quantizers ({exc!r}); "
                      "`import hf_integration` registers fp4moe explicitly", file=sys.stderr)

        loader.exec_module = exec_module  # (this loader instance is this module's alone)
        return spec


def install() -> None:
    """Called by ``fp4moe-autoload.pth`` at start-up."""
    if not enabled() or any(isinstance(f, _RegistryWatcher) for f in sys.meta_path):
        return
    registry = sys.modules.get(REGISTRY)
    if registry is not None:  # (imported already: a late install())
        install_stand_ins(registry)
        return
    sys.meta_path.insert(0, _RegistryWatcher())
