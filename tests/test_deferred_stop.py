"""``generate()`` of an fp4moe model defers its stop check on CUDA (``hf_integration.deferred_stop``):
Transformers' ``DeferredStopCheck`` is allowed on CUDA while an fp4moe model generates, and only then;
Transformers' own conditions still hold. The tokens against Transformers' loop: the GPU test below
(CUDA events, which the deferred check needs, do not exist on the CPU)."""

import pytest
import torch
from transformers.generation.utils import DeferredStopCheck

import hf_integration  # noqa: F401
from hf_integration import patch_moe
from hf_integration.tiny_models import tiny_qwen3_moe

CUDA = torch.device("cuda")


class Croppable:
    is_croppable = False


def answers_inside_generate(model, **kw) -> list[bool]:
    """``DeferredStopCheck.is_supported`` for a CUDA device, asked from inside ``model.generate()``
    (a forward hook) with no cache, with a returned cache that cannot be cropped, and for an assistant."""
    seen = []

    def ask(*_):
        seen.append([DeferredStopCheck.is_supported(CUDA, None, False, False),
                     DeferredStopCheck.is_supported(CUDA, Croppable(), True, False),
                     DeferredStopCheck.is_supported(CUDA, None, False, True)])

    hook = model.register_forward_hook(ask)
    try:
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False, **kw)
    finally:
        hook.remove()
    assert seen and all(s == seen[0] for s in seen)
    return seen[0]


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    bf16 = tiny_qwen3_moe()
    patched = tiny_qwen3_moe()
    patch_moe(patched, backend="reference", verbose=False)
    return bf16, patched


def test_deferred_inside_an_fp4moe_generate_only(models, monkeypatch):
    monkeypatch.delenv("FP4MOE_DEFERRED_STOP", raising=False)
    bf16, patched = models
    assert answers_inside_generate(patched) == [True, False, False]  # Transformers' other conditions kept
    assert answers_inside_generate(bf16) == [False, False, False]  # another model: Transformers' answer
    assert not DeferredStopCheck.is_supported(CUDA, None, False, False)  # outside any generate()
    assert DeferredStopCheck.is_supported(torch.device("mps"), None, False, False)  # mps as before


@pytest.mark.parametrize("value", ["0", "off"])
def test_the_environment_switch_keeps_transformers_loop(models, monkeypatch, value):
    monkeypatch.setenv("FP4MOE_DEFERRED_STOP", value)
    assert answers_inside_generate(models[1]) == [False, False, False]


def test_a_misspelt_switch_is_refused(models, monkeypatch):
    monkeypatch.setenv("FP4MOE_DEFERRED_STOP", "ture")
    with pytest.raises(ValueError, match="FP4MOE_DEFERRED_STOP='ture'"):
        models[1].generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2)


def test_deferral_is_installed_once(models):
    from hf_integration.deferred_stop import defer_stop_checks

    bf16, patched = models
    wrapped = DeferredStopCheck.is_supported
    defer_stop_checks(patched)
    assert DeferredStopCheck.is_supported is wrapped
    assert "generate" not in bf16.__dict__


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("stop", ["length", "eos"])
def test_deferred_generate_gives_transformers_tokens_on_gpu(monkeypatch, stop):
    """The same tokens with the deferred stop check as with Transformers' loop, stopping at the
    length limit or at an end token mid-way (where the deferred loop runs one forward too many and
    undoes it): a static cache compiled (not returned: a static cache cannot be cropped, so
    Transformers defers only when it stays inside generate()), and a dynamic cache returned to the
    caller, cropped back to the same length."""
    torch.manual_seed(0)
    model = tiny_qwen3_moe().cuda()
    patch_moe(model, verbose=False)
    ids = torch.randint(1, 200, (2, 7), generator=torch.Generator().manual_seed(3)).cuda()
    used = []
    init = DeferredStopCheck.__init__
    monkeypatch.setattr(DeferredStopCheck, "__init__", lambda self, *a, **k: (used.append(1), init(self, *a, **k))[1])

    def run(**kw):
        return model.generate(ids, max_new_tokens=12, do_sample=False, **kw)

    if stop == "eos":  # an end token the model emits mid-way
        eos = dict(eos_token_id=run(cache_implementation="static")[0, 7 + 5].item(), pad_token_id=0)
    else:
        eos = dict(eos_token_id=None, min_new_tokens=12)
    for kw in (dict(cache_implementation="static"), dict(return_dict_in_generate=True)):
        monkeypatch.setenv("FP4MOE_DEFERRED_STOP", "0")
        used.clear()
        plain = run(**kw, **eos)
        assert not used
        monkeypatch.setenv("FP4MOE_DEFERRED_STOP", "1")
        deferred = run(**kw, **eos)
        assert used, "DeferredStopCheck was not used"
        if isinstance(plain, torch.Tensor):
            assert torch.equal(plain, deferred)
        else:
            assert torch.equal(plain.sequences, deferred.sequences)
            caches = [getattr(out, "past_key_values", None) or out.cache for out in (plain, deferred)]
            assert caches[0].get_seq_length() == caches[1].get_seq_length()
