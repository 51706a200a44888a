"""``generate()``'s static cache kept between calls (``hf_integration.static_cache``): reused only
where it fits and nobody else holds it, and a reused cache gives the tokens a fresh one gives.

The reuse is made for CUDA (where Transformers compiles a static-cache ``generate()`` with CUDA
graphs); here it is switched on for the CPU through ``static_cache.DEVICE_TYPES``, which is the
only difference: the logic it exercises is the same."""

import weakref

import pytest
import torch

import hf_integration  # noqa: F401
from hf_integration import patch_moe, release_static_cache, static_cache
from hf_integration.tiny_models import tiny_qwen3_moe

KEPT = static_cache._KEPT


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = tiny_qwen3_moe()
    patch_moe(m, backend="reference", verbose=False)
    return m


def prompt(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(1, 100, (batch, length), generator=torch.Generator().manual_seed(seed))


def generate(model, ids, new: int = 6, **kw):
    return model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, cache_implementation="static",
                          **kw)


def fresh(model, ids, new: int = 6):
    """The tokens of a call that makes its own new cache (Transformers' own behaviour)."""
    release_static_cache(model)
    saved = static_cache.DEVICE_TYPES
    static_cache.DEVICE_TYPES = ()
    try:
        return generate(model, ids, new)
    finally:
        static_cache.DEVICE_TYPES = saved


def kept(model):
    return model.__dict__.get(KEPT, (None, 0))[0]


@pytest.fixture
def reuse_on_cpu(monkeypatch, model):
    monkeypatch.setattr(static_cache, "DEVICE_TYPES", ("cpu",))
    release_static_cache(model)
    yield
    release_static_cache(model)


def test_a_cpu_model_keeps_no_cache(model):
    release_static_cache(model)
    generate(model, prompt(1, 5, 0))
    assert kept(model) is None


def test_reused_cache_gives_the_fresh_caches_tokens(model, reuse_on_cpu):
    # different prompts in a row: a cache reset badly would leak the earlier call's keys
    prompts = [prompt(1, 7, 1), prompt(1, 4, 2), prompt(1, 7, 3)]
    expected = [fresh(model, p) for p in prompts]
    release_static_cache(model)
    first = generate(model, prompts[0])
    cache = weakref.ref(kept(model))  # (a strong reference here would be someone else holding it)
    keys = cache().layers[0].keys.data_ptr()
    got = [first] + [generate(model, p) for p in prompts[1:]]
    assert kept(model) is cache() and kept(model).layers[0].keys.data_ptr() == keys  # the same tensors every call
    for e, g in zip(expected, got):
        assert torch.equal(e, g)


def test_a_longer_or_wider_call_gets_a_new_cache(model, reuse_on_cpu):
    generate(model, prompt(1, 5, 4))
    first = weakref.ref(kept(model))
    ids = prompt(2, 5, 5)
    wide = generate(model, ids)  # another batch size
    assert first() is None and kept(model).layers[0].keys.shape[0] == 2
    assert torch.equal(wide, fresh(model, ids))
    generate(model, prompt(1, 5, 4))
    second = weakref.ref(kept(model))
    out = generate(model, prompt(1, 5, 6), new=12)  # longer than the kept cache
    assert second() is None and kept(model) is not None  # replaced, and the old one freed
    assert torch.equal(out, fresh(model, prompt(1, 5, 6), new=12))


def test_a_cache_the_caller_holds_is_never_reset(model, reuse_on_cpu):
    out = generate(model, prompt(1, 6, 7), return_dict_in_generate=True)
    held = out.past_key_values if hasattr(out, "past_key_values") else out.cache
    assert held is kept(model)
    before = [layer.keys.clone() for layer in held.layers]
    ids = prompt(1, 6, 8)
    assert torch.equal(generate(model, ids), fresh(model, ids))
    assert all(torch.equal(b, layer.keys) for b, layer in zip(before, held.layers))


def test_release_frees_the_cache(model, reuse_on_cpu):
    generate(model, prompt(1, 5, 9))
    assert kept(model) is not None
    release_static_cache(model)
    assert kept(model) is None
