"""``generate()``'s static KV cache kept between calls on a GPU, so that the compiled decode step
replays the CUDA graph it recorded instead of recording a new one at every call.

Transformers makes a new :class:`~transformers.StaticCache` for every
``generate(cache_implementation="static")`` call. Its tensors are marked as static addresses, so
torch's CUDA-graph trees record the compiled decode step again for the new addresses at the first
decode step of every call: a whole model's kernels captured and instantiated once more. torch
before 2.13 also counts each of those recordings as unexpected: after
``cudagraph_unexpected_rerecord_limit`` (128) calls it runs the step without CUDA graphs for the
rest of the process.

A model holding fp4moe's quantized modules keeps the last static cache ``generate()`` made and
hands it out again, reset, when a later call asks for one that it fits (the plain ``"static"``
kind, the same batch, no longer than it, on the same device) and nothing outside the model holds it:
a cache returned to the caller (``return_dict_in_generate``'s ``past_key_values``) is never reset
under them. Only on CUDA, where Transformers compiles a static-cache ``generate()``; elsewhere
Transformers' behaviour is unchanged. The cost is the cache's memory staying allocated between
calls, as Transformers did before 5.x; :func:`release_static_cache` frees it.
"""

from __future__ import annotations

import sys
import types

from torch import nn

_KEPT = "_fp4moe_static_cache"


def keep_static_cache(model: nn.Module) -> None:
    """Make ``model.generate()`` reuse its static cache between calls (see the module docstring)."""
    if getattr(type(model), "_prepare_static_cache", None) is None:  # not a generating model
        return
    if getattr(model.__dict__.get("_prepare_static_cache"), "__func__", None) is not _reused_static_cache:
        model._prepare_static_cache = types.MethodType(_reused_static_cache, model)


def release_static_cache(model: nn.Module) -> None:
    """Free the static cache ``model`` keeps between ``generate()`` calls (the next call makes a new one)."""
    model.__dict__.pop(_KEPT, None)


DEVICE_TYPES = ("cuda",)  # where Transformers compiles a static-cache generate() with CUDA graphs


def _reused_static_cache(model, cache_implementation, batch_size, max_cache_len, *args, **kwargs):
    kept, length = model.__dict__.get(_KEPT, (None, 0))
    if kept is not None and length >= max_cache_len and _fits(model, kept, cache_implementation, batch_size):
        kept.reset()
        return kept
    model.__dict__.pop(_KEPT, None)  # (freed before the new one is allocated)
    del kept
    cache = type(model)._prepare_static_cache(model, cache_implementation, batch_size, max_cache_len, *args, **kwargs)
    if (cache_implementation == "static" and model.device.type in DEVICE_TYPES
            and not model.config.is_encoder_decoder):
        # the length Transformers gave it: the longest any call asked for so far
        model.__dict__[_KEPT] = (cache, max(max_cache_len, getattr(model, "_previous_max_cache_length", 0)))
    return cache


def _fits(model, cache, cache_implementation: str, batch_size: int) -> bool:
    # references to the kept cache here: the model's (kept, length) pair, the caller's `kept`, this
    # argument and getrefcount's own; any more is someone else's (a returned cache, a live traceback)
    if sys.getrefcount(cache) > 4:
        return False
    if cache_implementation != "static" or model.device.type not in DEVICE_TYPES:
        return False
    layers = [layer for layer in cache.layers if layer.is_initialized]
    # (the first layer sits with the embeddings, on model.device, also under a device_map)
    return not layers or (layers[0].keys.device == model.device
                          and all(layer.keys.shape[0] == batch_size for layer in layers))


__all__ = ["keep_static_cache", "release_static_cache"]
